"""One table for a GPU machine: tokens/s, MFU and peak memory of SPES training steps, grouped vs loop experts.

    python -m bench.gpu                                   # paper-1b shape (vocab 151 665), bf16 autocast on CUDA
    python -m bench.gpu --device cpu --shape tiny --steps 2 --warmup 1   # the same code on CPU, seconds (CI smoke)
    bash bench/gpu.sh                                     # what to run when a GPU machine is lent (README there)

Arms: experts owned (a quarter, as a SPES peer; all, as DiLoCo or one centralized trainer) x expert kernel
(`loop`: one matmul per expert; `grouped`: `torch._grouped_mm`, model/experts.py). Each arm builds the model and
the project's AdamW (`peer.optim.build_optimizer`) fresh, runs `--warmup` untimed and `--steps` timed steps of the
training step's math (`model.model.lm_loss`, backward, grad clipping, AdamW step; bf16 autocast on CUDA, as
`peer.train.Trainer` does) on random tokens (no tokenizer or dataset: nothing to download), with routing as it
comes. Peak memory is `torch.cuda.max_memory_allocated` per arm on CUDA; on CPU it is not shown (arms share one
process, so RSS cannot separate them: bench.memory measures CPU memory, one fresh process per arm).

MFU = achieved FLOP/s / the GPU's peak bf16 FLOP/s (`--peak-tflops`, or looked up by device name), with training
FLOPs per token = 6 x active parameters (embeddings excluded, top-k experts) + 12 x layers x d_model x seq_len
(attention scores and values, PaLM's count). A quarter-owner's backward skips the frozen experts' weight
gradients, so its MFU counts FLOPs it does not do: compare kernels within one ownership.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time

import torch

from bench.common import config_path, format_table, get_logger, median, setup_logging

logger = get_logger(__name__)

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) by a substring of torch.cuda.get_device_name().
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0,
                    "RTX 4090": 165.0, "RTX 3090": 71.0}


def peak_tflops(device: torch.device, override: float) -> float | None:
    """The device's bf16 peak in TFLOP/s: `override` if > 0, a known CUDA GPU's, else None (MFU not shown)."""
    if override > 0:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops for key, tflops in PEAK_BF16_TFLOPS.items() if key in name), None)


def flops_per_token(model_cfg) -> float:
    """Training FLOPs per token (forward + backward) of the model shape; see the module docstring."""
    from model.config import ModelConfig

    cfg: ModelConfig = model_cfg
    head = cfg.attention_head_dim
    attn = cfg.d_model * head * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)  # q, o + k, v projections
    experts = cfg.top_k * 3 * cfg.d_model * cfg.expert_hidden
    router = cfg.d_model * cfg.num_experts
    active = cfg.n_layers * (attn + experts + router) + cfg.d_model * cfg.vocab_size  # + LM head
    return 6.0 * active + 12.0 * cfg.n_layers * cfg.d_model * cfg.seq_len


def run_arm(cfg, owned: list[int], kernel: str, device: torch.device, steps: int, warmup: int) -> dict[str, float]:
    """Build model + optimizer for one arm, train `warmup` + `steps` steps; tokens/s (median) and peak bytes."""
    import dataclasses

    from model.model import SpesMoE, lm_loss
    from peer.optim import build_optimizer

    tcfg = cfg.train
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        base = 0
    model = SpesMoE(dataclasses.replace(cfg.model, expert_kernel=kernel), owned_experts=owned, seed=0).to(device)
    model.use_expert_kernel(device)
    optimizer = build_optimizer(model, tcfg)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, cfg.model.vocab_size, (tcfg.batch_size, cfg.model.seq_len + 1), generator=gen).to(device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast(
        "cpu", enabled=False)
    rates = []
    for step in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with autocast:
            loss, _ = lm_loss(model, batch, tcfg.z_loss, tcfg.lb_loss)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, tcfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step >= warmup:
            rates.append(tcfg.batch_size * cfg.model.seq_len / (time.perf_counter() - t0))
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else float("nan")
    del model, optimizer, params, batch
    return {"tokens_per_s": median(rates), "peak_bytes": float(peak)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="paper-1b", choices=["paper-1b", "small", "tiny"],
                        help="model shape: a config in configs/ (default paper-1b)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="default cuda")
    parser.add_argument("--batch", type=int, default=0, help="sequences per step (default: the config's)")
    parser.add_argument("--seq-len", type=int, default=0, help="override model.seq_len")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per arm (median; default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per arm first (default 2)")
    parser.add_argument("--kernels", default="loop,grouped", help="comma list of expert kernels (default loop,grouped)")
    parser.add_argument("--peak-tflops", type=float, default=0.0,
                        help="the device's bf16 peak for MFU (default: looked up by GPU name)")
    args = parser.parse_args(argv)
    setup_logging()
    from peer.config import ConfigError, load_config, parse_override

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench.gpu: error: no CUDA device (pass --device cpu for the CPU smoke run)", file=sys.stderr)
        return 2
    sets = ["train.device=" + args.device]
    if args.batch:
        sets.append(f"train.batch_size={args.batch}")
    if args.seq_len:
        sets.append(f"model.seq_len={args.seq_len}")
    try:
        cfg = load_config(config_path(args.shape), [parse_override(s) for s in sets])
    except ConfigError as e:
        print(f"bench.gpu: error: {e}", file=sys.stderr)
        return 2
    kernels = [k for k in args.kernels.split(",") if k]
    quarter = list(range(max(1, cfg.model.num_experts // 4)))
    peak = peak_tflops(device, args.peak_tflops)
    fpt = flops_per_token(cfg.model)
    rows: list[list[str]] = []
    results: dict[tuple[str, str], dict[str, float] | None] = {}
    for owned_name, owned in (("quarter", quarter), ("all", list(range(cfg.model.num_experts)))):
        for kernel in kernels:
            try:
                r = run_arm(cfg, owned, kernel, device, args.steps, args.warmup)
            except torch.OutOfMemoryError:
                # Owning every expert of the paper's shape needs ~55 GB: on a smaller GPU that arm is the finding.
                logger.warning(f"{owned_name}/{kernel}: out of memory")
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                results[(owned_name, kernel)] = None
                continue
            results[(owned_name, kernel)] = r
            logger.info(f"{owned_name}/{kernel}: {r['tokens_per_s']:,.0f} tok/s, peak {r['peak_bytes'] / 2**30:.2f} GiB"
                        if device.type == "cuda" else f"{owned_name}/{kernel}: {r['tokens_per_s']:,.0f} tok/s")
    for (owned_name, kernel), r in results.items():
        label = (f"{owned_name} ({len(quarter) if owned_name == 'quarter' else cfg.model.num_experts}"
                 f"/{cfg.model.num_experts})")
        if r is None:
            rows.append([label, kernel, "OOM", "-", "-", "-"])
            continue
        mfu = f"{100 * r['tokens_per_s'] * fpt / (peak * 1e12):.1f}" if peak else "-"
        vs_loop = results.get((owned_name, "loop"))
        rows.append([label, kernel, f"{r['tokens_per_s']:,.0f}",
                     f"{r['tokens_per_s'] / vs_loop['tokens_per_s']:.2f}" if vs_loop else "-", mfu,
                     f"{r['peak_bytes'] / 2**30:.2f}" if device.type == "cuda" else "-"])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    m = cfg.model
    print(f"bench.gpu: {name}; shape {args.shape} (d {m.d_model}, {m.n_layers} layers, {m.num_experts} experts "
          f"top-{m.top_k}, expert hidden {m.expert_hidden}, vocab {m.vocab_size}), batch {cfg.train.batch_size} x "
          f"{m.seq_len} tokens, {'bf16 autocast' if device.type == 'cuda' else 'fp32'}; {args.steps} timed steps "
          f"after {args.warmup}; {fpt / 1e9:.2f} GFLOP/token; peak {peak or '-'} TFLOP/s")
    print()
    print(format_table(["experts owned", "kernel", "tokens/s", "x loop", "MFU %", "peak GiB"], rows))
    for kernel in kernels:
        q, a = results[("quarter", kernel)], results[("all", kernel)]
        if q and a and device.type == "cuda":
            print(f"\npeak memory, quarter / all ({kernel}): {q['peak_bytes'] / max(a['peak_bytes'], 1):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
