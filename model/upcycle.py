"""Upcycle a dense transformers Qwen3 checkpoint into a SPES MoE run: `python -m model.upcycle DENSE_HF_DIR OUT_DIR`.

The paper's 9B run starts from the dense Qwen3-1.7B (docs/DESIGN.md, "Upcycling"): every layer's dense SwiGLU MLP
is copied into each of E experts, the router is new (initialized as a fresh model's would be) and picks top-k with
normalized probabilities, and Gaussian noise of std S is added to a random half of each expert's weights so the
experts differ from the first step. With S = 0 and normalized top-k weights the MoE computes exactly the dense
model: k identical experts weighted by probabilities that sum to 1 give the dense MLP's output.

OUT_DIR gets:
- `config.yaml`: a run config (the model section from the dense config, `data.tokenizer` pointing at OUT_DIR's
  tokenizer); `python -m peer.run --config OUT_DIR/config.yaml --init-from OUT_DIR` starts a peer from it;
- `init.safetensors`: the upcycled weights, keyed as a checkpoint's `model.` tensors (safetensors: nothing pickled);
- `tokenizer/`: the dense checkpoint's tokenizer.

Everything is computed from the seed alone, never from ownership, so every peer that starts from OUT_DIR starts
from the same weights whatever experts it owns.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import sys
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file
from transformers import AutoConfig, AutoTokenizer, Qwen3ForCausalLM

from model.checkpoint import CheckpointError, read_safetensors
from model.config import ModelConfig
from model.logfmt import setup_plain_logging

logger = logging.getLogger(__name__)

INIT_FILE = "init.safetensors"
INIT_FORMAT = "spes-init-v1"


class UpcycleError(ValueError):
    """The dense checkpoint cannot be upcycled; the message names the cause in one line."""


def _generator(seed: int, *parts: object) -> torch.Generator:
    # One generator per (purpose, layer, expert): the result does not depend on the order tensors are made in.
    digest = hashlib.sha256(":".join(["spes-upcycle", str(seed), *map(str, parts)]).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def model_config_from_dense(dense_config, num_experts: int, top_k: int, seq_len: int) -> ModelConfig:
    """The MoE shape of an upcycled dense Qwen3: same attention, norms, vocab; experts as wide as the dense MLP."""
    if getattr(dense_config, "model_type", None) != "qwen3":
        raise UpcycleError(f"expected a dense Qwen3 checkpoint (model_type 'qwen3'), got "
                           f"{getattr(dense_config, 'model_type', None)!r}")
    rope = dict(getattr(dense_config, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise UpcycleError(f"rope type {rope.get('rope_type')!r} is not supported (only the default RoPE)")
    if getattr(dense_config, "attention_bias", False):
        raise UpcycleError("attention with bias terms is not supported (Qwen3 has none)")
    if getattr(dense_config, "use_sliding_window", False):
        raise UpcycleError("sliding-window attention is not supported")
    if getattr(dense_config, "hidden_act", "silu") != "silu":
        raise UpcycleError(f"MLP activation {dense_config.hidden_act!r} is not supported (SwiGLU experts use silu)")
    d_model, n_heads = dense_config.hidden_size, dense_config.num_attention_heads
    head_dim = getattr(dense_config, "head_dim", None) or d_model // n_heads
    cfg = ModelConfig(
        vocab_size=dense_config.vocab_size, d_model=d_model, n_layers=dense_config.num_hidden_layers,
        n_heads=n_heads, n_kv_heads=dense_config.num_key_value_heads, num_experts=num_experts, top_k=top_k,
        expert_hidden=dense_config.intermediate_size, seq_len=seq_len,
        # Normalized top-k weights: what makes k copies of one MLP sum back to that MLP (the paper's recipe).
        norm_topk_prob=True, tie_embeddings=bool(dense_config.tie_word_embeddings),
        rope_theta=float(rope.get("rope_theta", getattr(dense_config, "rope_theta", 10000.0))),
        rms_norm_eps=dense_config.rms_norm_eps, init_std=dense_config.initializer_range,
        head_dim=0 if head_dim * n_heads == d_model else head_dim,
    )
    try:
        cfg.validate()
    except ValueError as e:
        raise UpcycleError(str(e)) from None
    return cfg


def noisy_half(weight: torch.Tensor, noise_std: float, gen: torch.Generator) -> torch.Tensor:
    """`weight` plus N(0, noise_std) noise on a random half of its entries (a new tensor; fp32)."""
    out = weight.detach().to(torch.float32).clone()
    if noise_std <= 0:
        return out
    mask = torch.rand(out.shape, generator=gen) < 0.5
    noise = torch.randn(out.shape, generator=gen).mul_(noise_std)
    return out.add_(noise * mask)


def upcycle_state(dense_state: dict[str, torch.Tensor], cfg: ModelConfig, noise_std: float, seed: int
                  ) -> dict[str, torch.Tensor]:
    """Checkpoint-style tensors (`model.`-prefixed SpesMoE state_dict names) of the upcycled model."""
    out: dict[str, torch.Tensor] = {}
    mlp_names = ("gate_proj", "up_proj", "down_proj")
    for name, tensor in dense_state.items():
        if ".mlp." in name:
            continue
        if name == "lm_head.weight" and cfg.tie_embeddings:
            continue  # tied to the embeddings: a checkpoint stores the storage once
        out[f"model.lm.{name}"] = tensor.detach().to(torch.float32).contiguous()
    for layer in range(cfg.n_layers):
        prefix = f"model.layers.{layer}.mlp."
        try:
            gate_FD, up_FD, down_DF = (dense_state[prefix + n + ".weight"] for n in mlp_names)
        except KeyError as e:
            raise UpcycleError(f"dense checkpoint has no {e.args[0]} (not a Qwen3 dense MLP)") from None
        # Our fused layout (model/experts.py): gate rows first, then up rows.
        gate_up_2FD = torch.cat([gate_FD, up_FD], dim=0)
        for expert in range(cfg.num_experts):
            gen = _generator(seed, "noise", layer, expert)
            slot = f"model.lm.model.layers.{layer}.mlp.experts.bank.{expert}."
            out[slot + "gate_up_proj"] = noisy_half(gate_up_2FD, noise_std, gen)
            out[slot + "down_proj"] = noisy_half(down_DF, noise_std, gen)
        router_ED = torch.randn(cfg.num_experts, cfg.d_model, generator=_generator(seed, "router", layer))
        out[f"model.lm.model.layers.{layer}.mlp.gate.weight"] = router_ED.mul_(cfg.init_std)
    return out


def upcycle(dense_dir: str | Path, out_dir: str | Path, num_experts: int = 8, top_k: int = 2,
            noise_std: float = 0.02, seq_len: int = 2048, seed: int = 0, run_id: str = "spes-upcycled") -> Path:
    """Write OUT_DIR (config.yaml, init.safetensors, tokenizer/) from the dense Qwen3 in `dense_dir`."""
    dense_dir, out_dir = Path(dense_dir), Path(out_dir)
    if not (dense_dir / "config.json").is_file():
        raise UpcycleError(f"{dense_dir}: not a transformers model folder (no config.json)")
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise UpcycleError(f"need 1 <= top_k <= num_experts, got top_k {top_k}, num_experts {num_experts}")
    if noise_std < 0:
        raise UpcycleError(f"--noise-std must be >= 0, got {noise_std}")
    if (out_dir / INIT_FILE).exists():
        raise UpcycleError(f"{out_dir} already holds an upcycled model ({INIT_FILE}); choose another OUT_DIR")
    try:
        dense_config = AutoConfig.from_pretrained(str(dense_dir), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise UpcycleError(f"{dense_dir}: cannot read config.json ({str(e).splitlines()[0]})") from None
    seq_len = min(seq_len, dense_config.max_position_embeddings)
    cfg = model_config_from_dense(dense_config, num_experts, top_k, seq_len)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(dense_dir), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise UpcycleError(f"{dense_dir}: no usable tokenizer ({str(e).splitlines()[0]})") from None
    if tokenizer.eos_token_id is None:
        raise UpcycleError(f"{dense_dir}: the tokenizer has no end-of-text token (documents are separated by it)")
    try:
        dense = Qwen3ForCausalLM.from_pretrained(str(dense_dir), local_files_only=True, dtype=torch.float32)
    except (OSError, ValueError, RuntimeError) as e:
        raise UpcycleError(f"{dense_dir}: cannot load the weights ({str(e).splitlines()[0]})") from None
    state = upcycle_state(dense.state_dict(), cfg, noise_std, seed)
    del dense

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_dir / "tokenizer"))
    meta = {"format": INIT_FORMAT, "metadata": json.dumps({
        "source": str(dense_dir.resolve()), "num_experts": num_experts, "top_k": top_k, "noise_std": noise_std,
        "seed": seed, "model": dataclasses.asdict(cfg)})}
    tmp = out_dir / f".{INIT_FILE}.tmp"
    save_file(state, str(tmp), metadata=meta)
    tmp.replace(out_dir / INIT_FILE)
    run_config = {
        "run_id": run_id,
        "model": dataclasses.asdict(cfg),
        # Absolute, so the config works from any directory a peer is started in.
        "data": {"tokenizer": str((out_dir / "tokenizer").resolve())},
        "train": {"seed": seed},
    }
    (out_dir / "config.yaml").write_text(yaml.safe_dump(run_config, sort_keys=False))
    return out_dir


def read_init(init_dir: str | Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The tensors of INIT_DIR/init.safetensors, after checking they were upcycled for this model shape.

    Raises CheckpointError (one line naming the file) for a missing, damaged or mismatched file."""
    path = Path(init_dir) / INIT_FILE
    if not path.is_file():
        raise CheckpointError(f"--init-from {init_dir}: no {INIT_FILE} there (write one with python -m model.upcycle)")
    tensors, meta = read_safetensors(path, INIT_FORMAT, kind="init file")
    runtime_only = ("seq_len", "frozen_expert_dtype", "expert_kernel")  # free to differ from the upcycled file
    want = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in runtime_only}
    have = meta.get("model") if isinstance(meta, dict) else None
    if not isinstance(have, dict):
        raise CheckpointError(f"corrupt init file {path}: no model shape in its metadata")
    diff = sorted(k for k in want if have.get(k) != want[k])
    if diff:
        raise CheckpointError(f"{path} was upcycled for another model shape: model.{diff[0]} is {have.get(diff[0])!r} "
                              f"there, {want[diff[0]]!r} in this run's config")
    return tensors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m model.upcycle",
                                     description="Upcycle a dense transformers Qwen3 checkpoint into a SPES MoE run.")
    parser.add_argument("dense_dir", metavar="DENSE_HF_DIR", help="a local transformers Qwen3 folder (config.json, "
                        "weights, tokenizer)")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="folder to write (config.yaml, init.safetensors, tokenizer/)")
    parser.add_argument("--num-experts", type=int, default=8, help="experts per layer (default 8, as the paper)")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token (default 2)")
    parser.add_argument("--noise-std", type=float, default=0.02,
                        help="std of the Gaussian noise added to a random half of each expert's weights (default 0.02)")
    parser.add_argument("--seq-len", type=int, default=2048, help="training block length (capped by the dense "
                        "model's max positions; default 2048)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the router init and the noise (default 0)")
    parser.add_argument("--run-id", default="spes-upcycled", help="run_id written into config.yaml")
    args = parser.parse_args(argv)
    setup_plain_logging()
    try:
        out = upcycle(args.dense_dir, args.out_dir, args.num_experts, args.top_k, args.noise_std, args.seq_len,
                      args.seed, args.run_id)
    except UpcycleError as e:
        logger.error(f"error: {e}")
        return 2
    logger.info(f"upcycled {args.dense_dir} into {out}: {args.num_experts} experts top-{args.top_k}, noise std "
                f"{args.noise_std}; start peers with: python -m peer.run --config {out}/config.yaml --init-from {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
