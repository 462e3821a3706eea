"""Per-peer peak memory of a training step for a run config and an expert ownership (issue 10's equal-memory arms).

    python -m bench.fit --config RUN.yaml --experts 0-3     # one measurement in this process: one JSON line

`measure()` runs that in a fresh subprocess and returns the JSON: the process's peak resident set during 3
training steps (bench/memory.py's `run_step`: forward, backward, clipping, the project's AdamW, zero_grad) minus
its resident set before the model was built (torch, transformers and hivemind already imported). That difference
is what the model costs a peer: parameters, frozen expert copies, gradients, AdamW state and activations; the
~0.6-0.8 GiB of runtime every peer pays anyway is left out, so small models compare by what differs between them.
Routing is balanced (bench/memory.py `balance_routing`: every expert gets the same number of tokens, as in
steady-state training), so every owned expert has gradients and AdamW state when the peak is taken.

`largest_fitting()` searches, by bisection over `model.num_experts` (the per-token compute of a top-k MoE does
not depend on it: only the parameter count does), the largest model of a config whose peer owning every expert
stays within a memory budget: the DiLoCo side of an equal-memory comparison.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import yaml

from bench.common import REPO_ROOT, get_logger, rss_bytes, setup_logging

logger = get_logger(__name__)
RESULT_PREFIX = "FIT_RESULT "
STEPS = 3


def measure_in_process(config: Path, experts: str) -> dict[str, Any]:
    """Build the model owning `experts`, run STEPS balanced training steps, return its memory (bytes)."""
    import torch

    from bench.common import PeakMeter
    from bench.memory import balance_routing, run_step
    from model.model import SpesMoE
    from peer.config import load_config
    from peer.optim import build_optimizer
    from sync.config import parse_expert_list

    torch.set_num_threads(1)
    runtime = rss_bytes()
    meter = PeakMeter()
    meter.start()
    cfg = load_config(config)
    owned = parse_expert_list(experts, cfg.model.num_experts)
    model = SpesMoE(cfg.model, owned_experts=owned, seed=cfg.train.seed)
    optimizer = build_optimizer(model, cfg.train)
    balance_routing(model)
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.model.seq_len + 1), generator=gen)
    for _ in range(STEPS):
        run_step(model, optimizer, batch, cfg.train, meter)
    meter.stop()
    return {"experts": experts, "owned": len(owned), "num_experts": cfg.model.num_experts,
            "params_total": model.num_parameters("total"), "params_trainable": model.num_parameters("trainable"),
            "runtime_rss": runtime, "peak_rss": meter.process_peak, "model_peak": meter.process_peak - runtime}


def measure(cfg: dict[str, Any], experts: str) -> dict[str, Any]:
    """`measure_in_process` in a fresh `python -m bench.fit` (no other model's memory in the process)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        proc = subprocess.run([sys.executable, "-m", "bench.fit", "--config", str(path), "--experts", experts],
                              cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [l for l in proc.stdout.splitlines() if l.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"bench.fit failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(lines[-1][len(RESULT_PREFIX):])


def largest_fitting(cfg_for: Callable[[int], dict[str, Any]], budget: int, lo: int, hi: int
                    ) -> tuple[int, dict[int, dict[str, Any]]]:
    """The largest num_experts in [lo, hi] whose all-experts peer (config `cfg_for(E)`) peaks within `budget`
    bytes of model memory, by bisection (memory grows with E); `lo` if none fits. Returns it and every measurement."""
    seen: dict[int, dict[str, Any]] = {}

    def fits(E: int) -> bool:
        seen[E] = measure(cfg_for(E), "all")
        logger.info(f"fit: {E} experts, every one owned: {seen[E]['model_peak'] / 2**20:.0f} MiB "
                    f"(budget {budget / 2**20:.0f} MiB)")
        return seen[E]["model_peak"] <= budget

    if not fits(lo):
        return lo, seen
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo, seen


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fit", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, type=Path, help="run config YAML")
    p.add_argument("--experts", default="all", help="owned experts, as peer.run --experts")
    args = p.parse_args(argv)
    setup_logging()
    print(RESULT_PREFIX + json.dumps(measure_in_process(args.config, args.experts)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
