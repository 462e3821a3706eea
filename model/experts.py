"""Expert bank for one MoE layer with per-expert ownership (the SPES memory saving).

Each expert lives in its own slot. An *owned* expert's tensors are fp32 `nn.Parameter`s (trained, with
gradients and optimizer state); a *frozen* expert's tensors are buffers in `frozen_dtype` (bf16 by default)
that only feed the forward pass. The slot keeps the same attribute names either way, so state_dict keys do
not depend on ownership, and switching is done in place without rebuilding the model.

Layout matches transformers' Qwen3-MoE experts per expert: `gate_up_proj` [2F, D] (gate rows first, then up
rows) and `down_proj` [D, F], so export is a plain stack over experts.

Two ways to run a layer's experts, equal in result (tests/test_model.py): `loop` calls each expert in turn;
`grouped` (model.expert_kernel) sorts the (token, expert) pairs so the owned experts' rows come first, then runs
one grouped GEMM (`torch._grouped_mm`) over the owned experts and one over the frozen ones per projection. Both
groups' weights are stacked for the GEMM and stacked again in backward rather than kept (`_OwnedGroupedLinear`,
`_FrozenGroupedLinear`, as `_FrozenLinear` does for one expert), so autograd keeps what the loop keeps: the
inputs and the weights' own storage (bench.memory `quarter_grouped`).

Shape suffixes: T tokens, K experts per token, S = T*K routed rows, D d_model, F expert hidden, E experts
(E_own / E_frz: owned / frozen), G groups of one grouped GEMM.
"""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    # Under autocast F.linear computes in the autocast dtype anyway: casting the bf16 weight to fp32 first
    # would make two throw-away copies of it.
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


_scratch = threading.local()


def _upcast(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`w` in `dtype`; on the CPU a reused per-thread buffer, only valid until the next call for this shape.

    A fresh 6-12 MiB copy per frozen expert and pass (hundreds per step at the paper-1b shape) leaves the CPU
    allocator's heap fragmented: the step's peak RSS grows by far more than the copies (bench.memory)."""
    if w.dtype == dtype or w.device.type != "cpu":
        return w.to(dtype)
    bufs = getattr(_scratch, "bufs", None)
    if bufs is None:
        bufs = _scratch.bufs = {}
    key = (tuple(w.shape), dtype)
    buf = bufs.get(key)
    if buf is None:
        buf = bufs[key] = torch.empty(w.shape, dtype=dtype)
    return buf.copy_(w)


class _FrozenLinear(torch.autograd.Function):
    """y = x @ w.T for a frozen low-precision weight, without keeping an upcast copy alive.

    Plain `F.linear(x, w.float())` would make autograd save the fp32 copy of every frozen expert for the
    backward pass (it needs w to compute dL/dx), which costs more memory than storing the expert in fp32.
    Here only the bf16 storage itself is saved and re-upcast in backward, one expert at a time.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(w)
        return F.linear(x, _upcast(w, _compute_dtype(x)))

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        (w,) = ctx.saved_tensors
        return grad_out @ _upcast(w, grad_out.dtype), None


def frozen_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Linear layer with a frozen weight; fast path when no gradient is needed at all."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return F.linear(x, _upcast(w, _compute_dtype(x)))
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


def grouped_mm_available() -> bool:
    """Whether this torch has the grouped GEMM the `grouped` expert kernel needs."""
    return hasattr(torch, "_grouped_mm")


def _offsets(counts_G: torch.Tensor) -> torch.Tensor:
    # grouped_mm takes each group's end row, int32, on the device of the rows.
    return torch.cumsum(counts_G, dim=0).to(torch.int32)


def _grouped(x_SD: torch.Tensor, w_GOD: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
    """Row block g of x times w_GOD[g].T: [S, D] x [G, O, D] -> [S, O]."""
    return torch._grouped_mm(x_SD, w_GOD.transpose(-2, -1), offs=offs_G)


class _FrozenGroupedLinear(torch.autograd.Function):
    """`_grouped(x, stack(ws))` for frozen weights: the stack (a copy) is not kept for backward; the weights'
    own storage is, and backward stacks it again. No gradient for the weights, as for `_FrozenLinear`."""

    @staticmethod
    def forward(ctx, x_SD: torch.Tensor, offs_G: torch.Tensor, *ws: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(offs_G, *ws)
        return _grouped(x_SD, torch.stack(ws).to(x_SD.dtype), offs_G)

    @staticmethod
    def backward(ctx, grad_SO: torch.Tensor):  # type: ignore[override]
        offs_G, *ws = ctx.saved_tensors
        w_GOD = torch.stack(ws).to(grad_SO.dtype)
        grad_SD = torch._grouped_mm(grad_SO.contiguous(), w_GOD, offs=offs_G)
        return (grad_SD, None, *([None] * len(ws)))


class _OwnedGroupedLinear(torch.autograd.Function):
    """`_grouped(x, stack(ws))` for trainable weights, without keeping the stack (a copy of every owned expert
    in the compute dtype) alive until backward: the weights themselves are saved, as F.linear saves its weight,
    and backward stacks them again; each expert's gradient is its own block of one grouped x^T @ grad."""

    @staticmethod
    def forward(ctx, x_SD: torch.Tensor, offs_G: torch.Tensor, *ws: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x_SD, offs_G, *ws)
        return _grouped(x_SD, torch.stack([w.to(x_SD.dtype) for w in ws]), offs_G)

    @staticmethod
    def backward(ctx, grad_SO: torch.Tensor):  # type: ignore[override]
        x_SD, offs_G, *ws = ctx.saved_tensors
        grad_SO = grad_SO.contiguous()
        grad_SD = None
        if ctx.needs_input_grad[0]:
            grad_SD = torch._grouped_mm(grad_SO, torch.stack([w.to(grad_SO.dtype) for w in ws]), offs=offs_G)
        # [O, S] x [S, D] split along S by the groups: one [O, D] block per expert.
        grad_GOD = torch._grouped_mm(grad_SO.t(), x_SD.to(grad_SO.dtype), offs=offs_G)
        return (grad_SD, None, *(grad_GOD[g].to(w.dtype) for g, w in enumerate(ws)))


def _stacked_linear(x_SD: torch.Tensor, ws: list[torch.Tensor], offs_G: torch.Tensor, frozen: bool) -> torch.Tensor:
    if not torch.is_grad_enabled():
        return _grouped(x_SD, torch.stack([w.to(x_SD.dtype) for w in ws]), offs_G)
    if frozen:
        if not x_SD.requires_grad:
            return _grouped(x_SD, torch.stack(ws).to(x_SD.dtype), offs_G)
        return _FrozenGroupedLinear.apply(x_SD, offs_G, *ws)
    return _OwnedGroupedLinear.apply(x_SD, offs_G, *ws)


class SpesExperts(nn.Module):
    """Drop-in replacement for transformers' `Qwen3MoeExperts` with per-expert ownership.

    forward(hidden_states [T, D], top_k_index [T, K], top_k_weights [T, K]) -> [T, D], like the original.
    """

    def __init__(self, slots: list[ExpertSlot], act_fn, grouped: bool = False):
        super().__init__()
        self.bank = nn.ModuleList(slots)
        self.num_experts = len(slots)
        self.act_fn = act_fn
        self.grouped = grouped

    def set_owned(self, owned: set[int]) -> None:
        for idx, slot in enumerate(self.bank):
            slot.set_owned(idx in owned)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.grouped:
            return self._forward_grouped(hidden_states, top_k_index, top_k_weights)
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

    def _forward_grouped(self, x_TD: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                         ) -> torch.Tensor:
        num_tokens, top_k = top_k_index.shape
        owned = [e for e, slot in enumerate(self.bank) if slot.owned]
        frozen = [e for e, slot in enumerate(self.bank) if not slot.owned]
        expert_S = top_k_index.reshape(-1)
        # Owned experts' rows first (in expert order), then the frozen ones': each part is one grouped GEMM.
        is_frozen_E = torch.ones(self.num_experts, dtype=torch.long, device=expert_S.device)
        is_frozen_E[owned] = 0
        order_S = torch.argsort(expert_S + self.num_experts * is_frozen_E[expert_S], stable=True)
        counts_E = torch.bincount(expert_S, minlength=self.num_experts)
        # The one host sync, as in the loop path: where the owned rows end, and which owned experts got no token
        # (left out of the GEMM, so their gradient stays None as in the loop and AdamW leaves them alone).
        counts = counts_E.tolist()
        owned = [e for e in owned if counts[e]]
        num_owned = sum(counts[e] for e in owned)
        token_S = order_S // top_k
        # Under autocast the GEMMs run in its dtype as F.linear's would (grouped_mm is not autocast-aware).
        x_SD = x_TD[token_S].to(_compute_dtype(x_TD))
        parts = []
        for experts, rows_SD in ((owned, x_SD[:num_owned]), (frozen, x_SD[num_owned:])):
            if rows_SD.shape[0] == 0:
                continue
            is_frozen = experts is frozen
            offs_G = _offsets(counts_E[experts])
            slots = [self.bank[e] for e in experts]
            gate_up_S2F = _stacked_linear(rows_SD, [s.gate_up_proj for s in slots], offs_G, is_frozen)
            gate_SF, up_SF = gate_up_S2F.chunk(2, dim=-1)
            parts.append(_stacked_linear(self.act_fn(gate_SF) * up_SF, [s.down_proj for s in slots], offs_G,
                                         is_frozen))
        y_SD = torch.cat(parts, dim=0) * top_k_weights.reshape(-1)[order_S].unsqueeze(-1).to(x_TD.dtype)
        out_TD = torch.zeros_like(x_TD)
        return out_TD.index_add_(0, token_S, y_SD.to(out_TD.dtype))
