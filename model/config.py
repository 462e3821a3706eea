"""Model configuration: the shape of the MoE LLM and how non-owned experts are stored.

Kept free of torch/hivemind imports so configs can be parsed and validated cheaply.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FROZEN_DTYPES = ("bfloat16", "float16", "float32")
EXPERT_KERNELS = ("auto", "loop", "grouped")


@dataclass
class ModelConfig:
    """Shape of the decoder-only MoE LLM (Qwen3-MoE architecture; docs/DESIGN.md, "The method")."""

    vocab_size: int = 320
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4
    num_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 512
    seq_len: int = 256
    # Storage dtype of experts this peer does not own (they only feed the forward pass).
    frozen_expert_dtype: str = "bfloat16"
    norm_topk_prob: bool = False
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    init_std: float = 0.02
    # Attention head width; 0 = d_model / n_heads. Dense Qwen3 checkpoints set it on its own (Qwen3-0.6B: d 1024,
    # 16 heads of 128), so an upcycled model must carry it (model.upcycle).
    head_dim: int = 0
    # How a layer's experts run (model/experts.py): "loop" = one matmul per expert; "grouped" = one grouped GEMM
    # (torch._grouped_mm) over the owned and one over the frozen experts; "auto" = grouped on CUDA when torch
    # has it, loop elsewhere (on CPU grouped is not faster: bench.throughput). Results are equal either way.
    expert_kernel: Literal["auto", "loop", "grouped"] = "auto"

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field."""
        positive = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "num_experts", "top_k",
                    "expert_hidden", "seq_len")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name} must be > 0, got {getattr(self, name)}")
        if self.head_dim < 0:
            raise ValueError(f"model.head_dim must be >= 0 (0 = d_model / n_heads), got {self.head_dim}")
        if self.head_dim == 0 and self.d_model % self.n_heads:
            raise ValueError(f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})"
                             " unless model.head_dim is set")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_heads ({self.n_heads}) must be divisible by model.n_kv_heads ({self.n_kv_heads})")
        if self.attention_head_dim % 2:
            raise ValueError("the attention head width (model.head_dim, or d_model / n_heads) must be even (RoPE)")
        if self.top_k > self.num_experts:
            raise ValueError(f"model.top_k ({self.top_k}) must be <= model.num_experts ({self.num_experts})")
        if self.expert_kernel not in EXPERT_KERNELS:
            raise ValueError(f"model.expert_kernel must be one of {EXPERT_KERNELS}, got {self.expert_kernel!r}")
        if self.frozen_expert_dtype not in FROZEN_DTYPES:
            raise ValueError(f"model.frozen_expert_dtype must be one of {FROZEN_DTYPES}, got {self.frozen_expert_dtype!r}")

    @property
    def attention_head_dim(self) -> int:
        """The width of one attention head: head_dim, or d_model / n_heads when that is 0."""
        return self.head_dim or self.d_model // self.n_heads
