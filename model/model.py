"""The SPES MoE language model: transformers' Qwen3-MoE with an ownership-aware expert bank.

Attention, RoPE, RMSNorm and the top-k router are transformers' own Qwen3-MoE modules; only each layer's
`mlp.experts` is replaced by `SpesExperts`, which keeps owned experts trainable (fp32) and the others
frozen (bf16 by default). Initialization depends only on the seed, never on ownership, so every peer of a
swarm starts from the same weights.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from model.config import ModelConfig
from model.experts import ExpertSlot, SpesExperts, grouped_mm_available

logger = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def hf_config(cfg: ModelConfig) -> Qwen3MoeConfig:
    """The stock transformers config of this model shape (what export writes as config.json)."""
    return Qwen3MoeConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.expert_hidden,
        moe_intermediate_size=cfg.expert_hidden,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.attention_head_dim,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k,
        norm_topk_prob=cfg.norm_topk_prob,
        max_position_embeddings=max(cfg.seq_len, 2048),
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        rms_norm_eps=cfg.rms_norm_eps,
        initializer_range=cfg.init_std,
        tie_word_embeddings=cfg.tie_embeddings,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        output_router_logits=False,
        use_cache=False,
        architectures=["Qwen3MoeForCausalLM"],
    )


def _expert_generator(seed: int, layer: int, expert: int) -> torch.Generator:
    # A generator per (seed, layer, expert): an expert's init never depends on which experts a peer owns
    # or on the order they are built in.
    digest = hashlib.sha256(f"spes-expert:{seed}:{layer}:{expert}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


class SelectionBiasedRouter(Qwen3MoeTopKRouter):
    """transformers' Qwen3-MoE top-k router with a per-expert bias on the *choice* of experts, in training only.

    The bias (`select_bias_E`, added to the logits before top-k) changes which experts a token goes to, not how
    their outputs are weighted (the unbiased softmax probabilities of the chosen experts) nor the router logits
    the z / load-balance losses see. A training lever (docs/DESIGN.md, "Levers beyond the paper"): a peer biased
    toward the experts it owns sends more of its tokens through experts it can train. Zero (the default) and
    eval mode route exactly as the stock router; the buffer is not saved (never in checkpoints or exports)."""

    def __init__(self, config: Qwen3MoeConfig):
        super().__init__(config)
        self.register_buffer("select_bias_E", torch.zeros(self.num_experts), persistent=False)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.training or not bool(self.select_bias_E.any()):
            return super().forward(hidden_states)
        hidden_TD = hidden_states.reshape(-1, self.hidden_dim)
        logits_TE = F.linear(hidden_TD, self.weight)
        probs_TE = torch.softmax(logits_TE, dtype=torch.float, dim=-1)
        chosen_TK = torch.topk(logits_TE.float() + self.select_bias_E, self.top_k, dim=-1).indices
        weights_TK = probs_TE.gather(1, chosen_TK)
        if self.norm_topk_prob:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        return logits_TE, weights_TK.to(logits_TE.dtype), chosen_TK


@dataclass
class ModelOutput:
    logits: torch.Tensor                    # [B, T, V]
    router_logits: tuple[torch.Tensor, ...]  # per layer [B*T, E]


class SpesMoE(nn.Module):
    """Decoder-only MoE LLM whose experts can be owned (trainable) or frozen, per expert index."""

    def __init__(self, cfg: ModelConfig, owned_experts: Iterable[int] = (), seed: int = 0):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.frozen_dtype = DTYPES[cfg.frozen_expert_dtype]
        owned = set(owned_experts)
        self._check_experts(owned)
        self.owned_experts: frozenset[int] = frozenset(owned)

        config = hf_config(cfg)
        # Build transformers' model with 1-wide experts so the full fp32 expert bank is never allocated
        # (at the paper's shapes that transient alone would dominate peak memory), then swap in our bank.
        stub_config = hf_config(cfg)
        stub_config.moe_intermediate_size = 1
        torch.manual_seed(seed)
        self.lm = Qwen3MoeForCausalLM(stub_config)
        self.lm.config = config
        self.lm.model.config = config
        self._own_bias = 0.0
        for layer_idx, layer in enumerate(self.lm.model.layers):
            # The same router weight (already initialized by transformers), in a router that can take a bias.
            router = SelectionBiasedRouter(config)
            router.weight = layer.mlp.gate.weight
            layer.mlp.gate = router
            act_fn = layer.mlp.experts.act_fn
            slots = []
            for expert in range(cfg.num_experts):
                gen = _expert_generator(seed, layer_idx, expert)
                gate_up = torch.randn(2 * cfg.expert_hidden, cfg.d_model, generator=gen).mul_(cfg.init_std)
                down = torch.randn(cfg.d_model, cfg.expert_hidden, generator=gen).mul_(cfg.init_std)
                slots.append(ExpertSlot(gate_up, down, expert in owned, self.frozen_dtype))
            layer.mlp.experts = SpesExperts(slots, act_fn, grouped=cfg.expert_kernel == "grouped")

    def use_expert_kernel(self, device: torch.device) -> str:
        """Pick the experts' kernel for `device` (model.expert_kernel "auto": grouped on CUDA, loop elsewhere);
        returns the one in use. Raises ValueError if "grouped" is asked of a torch without grouped GEMM."""
        kernel = self.cfg.expert_kernel
        if kernel == "auto":
            kernel = "grouped" if device.type == "cuda" and grouped_mm_available() else "loop"
        if kernel == "grouped" and not grouped_mm_available():
            raise ValueError(f"model.expert_kernel grouped needs torch._grouped_mm (torch {torch.__version__} has none)")
        for bank in self.expert_banks():
            bank.grouped = kernel == "grouped"
        return kernel

    def enable_gradient_checkpointing(self) -> None:
        """Recompute decoder layers in backward instead of keeping their activations (transformers' mechanism)."""
        kwargs = {"use_reentrant": False}
        if hasattr(self.lm, "activation_checkpointing_enable"):  # newer transformers; the old name is deprecated
            self.lm.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            self.lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

    # ---- ownership -------------------------------------------------------------------------------------

    def _check_experts(self, experts: set[int]) -> None:
        bad = [e for e in experts if not 0 <= e < self.cfg.num_experts]
        if bad:
            raise ValueError(f"expert index {bad[0]} out of range 0..{self.cfg.num_experts - 1}")

    def expert_banks(self) -> list[SpesExperts]:
        return [layer.mlp.experts for layer in self.lm.model.layers]

    def set_owned_experts(self, experts: Iterable[int]) -> None:
        """Change which experts are trainable, in place, keeping every expert's current values.

        Parameters of newly owned experts are new tensors: the optimizer must be told (see peer.optim).
        """
        owned = set(experts)
        self._check_experts(owned)
        for bank in self.expert_banks():
            bank.set_owned(owned)
        self.owned_experts = frozenset(owned)
        self.set_own_expert_bias(self._own_bias)

    def set_own_expert_bias(self, bias: float) -> None:
        """Bias every layer's expert choice (training only) by `bias` toward the experts this peer owns."""
        self._own_bias = float(bias)
        for layer in self.lm.model.layers:
            bias_E = layer.mlp.gate.select_bias_E
            bias_E.zero_()
            if self._own_bias and self.owned_experts:
                bias_E[sorted(self.owned_experts)] = self._own_bias

    def expert_tensor_names(self, layer: int | None = None) -> list[str]:
        """The keys of `expert_tensors(e)` (the same for every expert), layer by layer, or those of one `layer`;
        the first of each layer is the gate projection (fused `gate_up_proj`). sync/ names, orders and sends an
        expert's tensors by these keys and never builds them itself."""
        layers = range(self.cfg.n_layers) if layer is None else [layer]
        return [f"layers.{l}.{name}" for l in layers for name in ExpertSlot.TENSOR_NAMES]

    def expert_tensors(self, expert: int) -> dict[str, torch.Tensor]:
        """All tensors of expert `expert` across layers, keyed as `expert_tensor_names()` (storage dtype, no
        copy; trainable parameters when owned)."""
        out = {}
        for layer_idx, bank in enumerate(self.expert_banks()):
            for name, tensor in bank.bank[expert].tensors().items():
                out[f"layers.{layer_idx}.{name}"] = tensor
        return out

    def expert_parameters(self, expert: int) -> list[torch.Tensor]:
        """The live tensors of `expert` (not detached: parameters when owned), in `expert_tensor_names()` order."""
        return [getattr(bank.bank[expert], name) for bank in self.expert_banks() for name in ExpertSlot.TENSOR_NAMES]

    def load_expert_tensors(self, expert: int, tensors: dict[str, torch.Tensor]) -> None:
        """Overwrite expert `expert` in every layer from a dict shaped like `expert_tensors(expert)`."""
        missing = set(self.expert_tensors(expert)) - set(tensors)
        if missing:
            raise ValueError(f"expert {expert}: missing tensors {sorted(missing)[:3]}")
        for layer_idx, bank in enumerate(self.expert_banks()):
            slot = bank.bank[expert]
            slot.load_tensors({name: tensors[f"layers.{layer_idx}.{name}"] for name in slot.TENSOR_NAMES})

    def shared_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name, param) of every non-expert parameter (embeddings, attention, norms, router, LM head)."""
        return [(n, p) for n, p in self.named_parameters() if ".mlp.experts." not in n]

    # ---- parameter counts ------------------------------------------------------------------------------

    def num_parameters(self, kind: str = "total") -> int:
        """'total' (every expert), 'trainable' (what this peer optimizes), 'active' (used per token)."""
        shared = sum(p.numel() for _, p in self.shared_parameters())
        per_expert = sum(t.numel() for t in self.expert_tensors(0).values())
        if kind == "total":
            return shared + per_expert * self.cfg.num_experts
        if kind == "trainable":
            return sum(p.numel() for p in self.parameters() if p.requires_grad)
        if kind == "active":
            return shared + per_expert * self.cfg.top_k
        raise ValueError(f"unknown parameter count kind {kind!r}")

    # ---- forward ---------------------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor) -> ModelOutput:
        out = self.lm.model(input_ids=input_ids, output_router_logits=True, use_cache=False)
        logits = self.lm.lm_head(out.last_hidden_state)
        return ModelOutput(logits=logits, router_logits=tuple(out.router_logits))


def router_losses(router_logits: tuple[torch.Tensor, ...], top_k: int,
                  count_scale_E: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router z-loss (ST-MoE) and Switch load-balance loss, each averaged over layers.

    load-balance = E * sum_e f_e * P_e with f_e the share of routed (token, slot) pairs sent to expert e and
    P_e its mean router probability; 1.0 when perfectly balanced. `count_scale_E` multiplies the counts f_e
    (the decayed load-balance variant scales a peer's own experts).
    """
    z_terms, lb_terms = [], []
    for logits_TE in router_logits:
        logits_TE = logits_TE.float()
        num_experts = logits_TE.shape[-1]
        z_terms.append(torch.logsumexp(logits_TE, dim=-1).pow(2).mean())
        probs_TE = logits_TE.softmax(dim=-1)
        chosen_TK = probs_TE.topk(top_k, dim=-1).indices
        counts_E = torch.bincount(chosen_TK.reshape(-1), minlength=num_experts).to(probs_TE.dtype)
        if count_scale_E is not None:
            counts_E = counts_E * count_scale_E.to(counts_E)
        frac_E = counts_E / chosen_TK.numel()
        lb_terms.append(num_experts * (frac_E * probs_TE.mean(dim=0)).sum())
    return torch.stack(z_terms).mean(), torch.stack(lb_terms).mean()


def decayed_lb_scale(step: int, max_steps: int, owned: Iterable[int], num_experts: int) -> torch.Tensor:
    """The decayed load-balance variant (docs/DESIGN.md, "The method"): the token counts of this peer's own experts are multiplied by a
    factor rising linearly 0.7 -> 1.0 over the first 20 % of training (so more tokens flow to local experts early)."""
    factor = 0.7 + 0.3 * min(step / max(0.2 * max_steps, 1e-9), 1.0)
    scale_E = torch.ones(num_experts)
    scale_E[sorted(owned)] = factor
    return scale_E


def lm_loss(model: SpesMoE, tokens_BT1: torch.Tensor, z_coef: float, lb_coef: float,
            count_scale_E: torch.Tensor | None = None, readback: bool = True,
            ) -> tuple[torch.Tensor, dict[str, Any]]:
    """Training loss on a packed block batch [B, T+1]: CE(next token) + z_coef*z + lb_coef*lb.

    The parts come back as floats, or with `readback=False` as detached 0-dim tensors on the model's device
    (reading a CUDA value makes the host wait for the GPU; the training loop reads them on log steps only)."""
    inputs_BT, targets_BT = tokens_BT1[:, :-1], tokens_BT1[:, 1:]
    out = model(inputs_BT)
    ce = F.cross_entropy(out.logits.flatten(0, 1).float(), targets_BT.reshape(-1))
    z, lb = router_losses(out.router_logits, model.cfg.top_k, count_scale_E)
    loss = ce + z_coef * z + lb_coef * lb
    parts = {"ce": ce.detach(), "z_loss": z.detach(), "lb_loss": lb.detach()}
    return loss, {k: v.item() for k, v in parts.items()} if readback else parts
