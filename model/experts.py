"""Expert bank for one MoE layer with per-expert ownership (the SPES memory saving).

Each expert lives in its own slot. An *owned* expert's tensors are fp32 `nn.Parameter`s (trained, with
gradients and optimizer state); a *frozen* expert's tensors are buffers in `frozen_dtype` (bf16 by default)
that only feed the forward pass. The slot keeps the same attribute names either way, so state_dict keys do
not depend on ownership, and switching is done in place without rebuilding the model.

Layout matches transformers' Qwen3-MoE experts per expert: `gate_up_proj` [2F, D] (gate rows first, then up
rows) and `down_proj` [D, F], so export is a plain stack over experts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    # Under autocast F.linear computes in the autocast dtype anyway: casting the bf16 weight to fp32 first
    # would make two throw-away copies of it.
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class _FrozenLinear(torch.autograd.Function):
    """y = x @ w.T for a frozen low-precision weight, without keeping an upcast copy alive.

    Plain `F.linear(x, w.float())` would make autograd save the fp32 copy of every frozen expert for the
    backward pass (it needs w to compute dL/dx), which costs more memory than storing the expert in fp32.
    Here only the bf16 storage itself is saved and re-upcast in backward, one expert at a time.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(w)
        return F.linear(x, w.to(_compute_dtype(x)))

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        (w,) = ctx.saved_tensors
        return grad_out @ w.to(grad_out.dtype), None


def frozen_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Linear layer with a frozen weight; fast path when no gradient is needed at all."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return F.linear(x, w.to(_compute_dtype(x)))
    return _FrozenLinear.apply(x, w)


class ExpertSlot(nn.Module):
    """One SwiGLU expert: `gate_up_proj` [2F, D] and `down_proj` [D, F], as parameters or frozen buffers."""

    TENSOR_NAMES = ("gate_up_proj", "down_proj")

    def __init__(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, owned: bool, frozen_dtype: torch.dtype):
        super().__init__()
        self.frozen_dtype = frozen_dtype
        self.owned = owned
        for name, tensor in zip(self.TENSOR_NAMES, (gate_up_proj, down_proj)):
            self._store(name, tensor, owned)

    def _store(self, name: str, tensor: torch.Tensor, owned: bool) -> None:
        if owned:
            self.register_parameter(name, nn.Parameter(tensor.detach().to(torch.float32), requires_grad=True))
        else:
            self.register_buffer(name, tensor.detach().to(self.frozen_dtype), persistent=True)

    def set_owned(self, owned: bool) -> None:
        """Move this expert between trainable fp32 parameters and frozen storage, keeping its values."""
        if owned == self.owned:
            return
        for name in self.TENSOR_NAMES:
            tensor = getattr(self, name).detach()
            delattr(self, name)
            self._store(name, tensor, owned)
        self.owned = owned

    def tensors(self) -> dict[str, torch.Tensor]:
        """This expert's tensors (detached views of the storage, in storage dtype)."""
        return {name: getattr(self, name).detach() for name in self.TENSOR_NAMES}

    @torch.no_grad()
    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Overwrite this expert's values in place (cast to the storage dtype); shapes must match."""
        for name in self.TENSOR_NAMES:
            dst = getattr(self, name)
            src = tensors[name]
            if src.shape != dst.shape:
                raise ValueError(f"expert tensor {name}: shape {tuple(src.shape)} != {tuple(dst.shape)}")
            dst.copy_(src.to(device=dst.device, dtype=dst.dtype))

    def forward(self, x_ND: torch.Tensor, act_fn) -> torch.Tensor:
        if self.owned:
            gate_up_N2F = F.linear(x_ND, self.gate_up_proj)
            gate_NF, up_NF = gate_up_N2F.chunk(2, dim=-1)
            return F.linear(act_fn(gate_NF) * up_NF, self.down_proj)
        gate_up_N2F = frozen_linear(x_ND, self.gate_up_proj)
        gate_NF, up_NF = gate_up_N2F.chunk(2, dim=-1)
        return frozen_linear(act_fn(gate_NF) * up_NF, self.down_proj)


class SpesExperts(nn.Module):
    """Drop-in replacement for transformers' `Qwen3MoeExperts` with per-expert ownership.

    forward(hidden_states [T, D], top_k_index [T, K], top_k_weights [T, K]) -> [T, D], like the original.
    """

    def __init__(self, slots: list[ExpertSlot], act_fn):
        super().__init__()
        self.bank = nn.ModuleList(slots)
        self.num_experts = len(slots)
        self.act_fn = act_fn

    def set_owned(self, owned: set[int]) -> None:
        for idx, slot in enumerate(self.bank):
            slot.set_owned(idx in owned)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        x_TD = hidden_states
        num_tokens, top_k = top_k_index.shape
        # Group the T*K (token, expert) pairs by expert: one sort and a single host sync for the counts,
        # instead of one boolean mask and sync per expert.
        expert_S = top_k_index.reshape(-1)
        order_S = torch.argsort(expert_S, stable=True)
        counts = torch.bincount(expert_S, minlength=self.num_experts).tolist()
        token_S = order_S // top_k
        x_SD = x_TD[token_S]
        outputs = []
        start = 0
        for expert_idx, count in enumerate(counts):
            if count == 0:
                continue
            outputs.append(self.bank[expert_idx](x_SD[start:start + count], self.act_fn))
            start += count
        y_SD = torch.cat(outputs, dim=0) * top_k_weights.reshape(-1)[order_S].unsqueeze(-1).to(x_TD.dtype)
        out_TD = torch.zeros_like(x_TD)
        return out_TD.index_add_(0, token_S, y_SD.to(out_TD.dtype))
