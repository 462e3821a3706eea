"""One peer over K processes (`torchrun --nproc-per-node K -m peer.run`, peer/ranks.py) vs one process: tokens/s.

    python -m bench.ranks                                  # CPU, configs/small.yaml, K = 2, 3 interleaved rounds
    python -m bench.ranks --shape tiny --steps 20 --rounds 1          # smoke run
    python -m bench.ranks --device cuda --shape paper-1b --nproc 2    # on a machine with 2 GPUs (bench/gpu.sh)

Both arms are whole `peer.run` processes training alone (`sync.every 0`, every expert owned, the same per-process
batch), so the K-process arm trains K × the tokens per step and its gradients are all-reduced every step. Reported:
the median over rounds of tokens/s (from metrics.jsonl, between the first record after `--warmup` steps and the
last), and the ratio to one process: the speed-up (K would be perfect scaling). On a CPU the arms get the same
cores: one process with K threads vs K processes with one thread each (torchrun's default). Arms alternate within
each round; the machine is left quiet before each run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import REPO_ROOT, config_path, format_table, get_logger, median, setup_logging, wait_until_quiet

logger = get_logger(__name__)


def _command(args: argparse.Namespace, nproc: int, run_dir: Path) -> list[str]:
    flags = ["--config", str(config_path(args.shape)), "--run-dir", str(run_dir), "--sync-every", "0",
             "--experts", "all", "--max-steps", str(args.steps), "--device", args.device,
             "--set", "train.eval_every=0", "--set", "train.checkpoint_every=0", "--set", "train.log_every=5"]
    if nproc == 1:
        return [sys.executable, "-m", "peer.run", *flags]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "peer.run", *flags]


def _tokens_per_s(run_dir: Path, warmup: int) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    after = [r for r in records if r["step"] >= warmup]
    first, last = after[0], after[-1]
    if last["time"] <= first["time"]:
        raise RuntimeError(f"{run_dir}: too few logged steps after the warm-up to time")
    return (last["tokens"] - first["tokens"]) / (last["time"] - first["time"])


def run_arm(args: argparse.Namespace, nproc: int, workdir: Path, index: int) -> float:
    run_dir = workdir / f"p{nproc}-{index}"
    env = dict(os.environ)
    if args.device == "cpu":
        # The same cores for both arms: one process with K threads, or K with one (torchrun sets 1 itself).
        env["OMP_NUM_THREADS"] = str(args.nproc if nproc == 1 else 1)
    proc = subprocess.run(_command(args, nproc, run_dir), cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{nproc}-process arm failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return _tokens_per_s(run_dir, args.warmup)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ranks", description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="small", help="tiny | small | paper-1b (configs/)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--nproc", type=int, default=2, help="K, processes of the multi-process arm")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the timing")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=1200, help="seconds per run")
    args = p.parse_args(argv)
    setup_logging()
    speeds: dict[int, list[float]] = {1: [], args.nproc: []}
    with tempfile.TemporaryDirectory(prefix="bench-ranks-") as tmp:
        for r in range(args.rounds):
            order = [1, args.nproc] if r % 2 == 0 else [args.nproc, 1]
            for nproc in order:
                if args.device == "cpu":
                    wait_until_quiet(30)
                speeds[nproc].append(run_arm(args, nproc, Path(tmp), r))
                logger.info(f"round {r + 1}/{args.rounds}: {nproc} process(es) {speeds[nproc][-1]:,.0f} tok/s")
    base = median(speeds[1])
    rows = [[f"{n} process{'es' if n > 1 else ''}" + (" (torchrun)" if n > 1 else ""), f"{median(v):,.0f}",
             f"{median(v) / base:.2f}x", " ".join(f"{x:,.0f}" for x in v)] for n, v in speeds.items()]
    print(f"bench.ranks: {args.shape} shape on {args.device}, {args.steps} steps ({args.warmup} warm-up), "
          f"per-process batch from the config, {args.rounds} round(s)")
    print(format_table(["arm", "tokens/s (median)", "vs 1 process", "each round"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
