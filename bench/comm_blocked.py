"""Part `blocked` of bench/comm.py (`python -m bench.comm --parts blocked`): the share of wall time the training
loop of real `python -m peer.run` processes waited on sync.

The first peer's `initial peer:` line is given to the others; every peer trains with `--sync-every H`, and its
share is read from the "sync blocked the training loop X s of Y s (Z%)" line that peer/node.py logs at the end.
Seconds per step with a round in flight and without one come from metrics.jsonl.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO_ROOT, config_path, format_table, get_logger

logger = get_logger(__name__)

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
_BLOCKED_RE = re.compile(r"sync blocked the training loop ([\d.]+)s of ([\d.]+)s \(([\d.]+)%\)")
_ROUND_RE = re.compile(r"round (\d+) applied at step (\d+): shared group (\d+).*?([\d.]+)s \(([\d.]+)s blocked\)")
_INITIAL_RE = re.compile(r"initial peer: (\S+)")


def _peer_command(args: argparse.Namespace, run_dir: Path, experts: str, initial: str | None) -> list[str]:
    """The `python -m peer.run` command line of one peer of part `blocked`."""
    cmd = [sys.executable, "-m", "peer.run", "--config", str(config_path(args.blocked_shape)),
           "--max-steps", str(args.blocked_steps), "--sync-every", str(args.sync_every),
           "--host-maddrs", LOOPBACK[0], "--run-dir", str(run_dir), "--run-id", "comm-blocked",
           "--experts", experts, "--set", "train.eval_every=0", "--set", "train.checkpoint_every=0",
           "--set", "train.log_every=10", "--set", f"train.batch_size={args.blocked_batch}"]
    return cmd + (["--initial-peers", initial] if initial else [])


def _wait_for_line(path: Path, pattern: re.Pattern, proc: subprocess.Popen, timeout_s: float) -> str:
    """Wait until the log file has a line matching `pattern`; return its first group."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = pattern.search(path.read_text(errors="replace")) if path.exists() else None
        if match:
            return match.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"peer exited ({proc.returncode}) before printing its address: "
                               f"{path.read_text(errors='replace')[-2000:]}")
        time.sleep(0.2)
    raise RuntimeError(f"no {pattern.pattern!r} line after {timeout_s:.0f}s")


def _step_seconds(metrics: Path, applied_at: list[int], every: int) -> tuple[float, float, float]:
    """(all, with a round in flight, with none) mean wall seconds per step, from metrics.jsonl's logged
    (step, time) pairs; a log window counts as "in flight" if it overlaps a round's [start step, applied step]."""
    import json

    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    points = [(r["step"], r["time"]) for r in records if "time" in r and "step" in r]
    spans = [(((a - 1) // every) * every, a) for a in applied_at]
    busy, idle = [0.0, 0], [0.0, 0]
    for (s0, t0), (s1, t1) in zip(points, points[1:]):
        if s1 <= s0:
            continue
        acc = busy if any(lo < s1 and s0 < hi for lo, hi in spans) else idle
        acc[0] += t1 - t0
        acc[1] += s1 - s0
    total = (busy[0] + idle[0]) / max(busy[1] + idle[1], 1)
    return total, busy[0] / busy[1] if busy[1] else float("nan"), idle[0] / idle[1] if idle[1] else float("nan")


def bench_blocked(args: argparse.Namespace) -> list[str]:
    """Part `blocked`: peer.run processes training with sync every H steps; the share of wall time the
    training loop waited on sync (PeerNode's log line). Returns the output lines."""
    n = args.blocked_peers
    from peer.config import load_config

    num_experts = load_config(config_path(args.blocked_shape)).model.num_experts
    m = max(1, num_experts // n)
    experts = [f"{(i * m) % num_experts}-{(i * m) % num_experts + m - 1}" for i in range(n)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.blocked_threads), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    procs: list[subprocess.Popen] = []
    logs: list[Path] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="spes-comm-") as tmp:
        try:
            initial = None
            for i in range(n):
                log = Path(tmp) / f"peer{i}.log"
                logs.append(log)
                with open(log, "w") as f:
                    procs.append(subprocess.Popen(_peer_command(args, Path(tmp) / f"peer{i}", experts[i], initial),
                                                  cwd=REPO_ROOT, env=env, stdout=f, stderr=subprocess.STDOUT))
                if initial is None:
                    initial = _wait_for_line(log, _INITIAL_RE, procs[0], timeout_s=120)
                    logger.info(f"blocked: first peer at {initial}")
            for i, proc in enumerate(procs):
                proc.wait(timeout=args.blocked_timeout)
                logger.info(f"blocked: peer {i} exited with {proc.returncode} after "
                            f"{time.perf_counter() - started:.0f}s")
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
        rows = []
        for i, (proc, log) in enumerate(zip(procs, logs)):
            text = log.read_text(errors="replace")
            blocked = _BLOCKED_RE.search(text)
            rounds = _ROUND_RE.findall(text)
            if proc.returncode != 0 or blocked is None:
                rows.append([i, experts[i], f"exit {proc.returncode}", "", "", "", "", "", "", "", ""])
                logger.warning(f"blocked: peer {i} log tail:\n{text[-3000:]}")
                continue
            x, y, pct = (float(v) for v in blocked.groups())
            per_round = ", ".join(f"r{r[0]}@{r[1]}: g{r[2]} {float(r[4]):.2f}/{float(r[3]):.1f}" for r in rounds)
            step_s, busy_s, idle_s = _step_seconds(Path(tmp) / f"peer{i}" / "metrics.jsonl",
                                                   [int(r[1]) for r in rounds], args.sync_every)
            rows.append([i, experts[i], args.blocked_steps, len(rounds), f"{x:.2f}", f"{y:.1f}", f"{pct:.2f}",
                         "yes" if pct <= 2.0 else "NO", f"{step_s:.3f}", f"{busy_s:.3f} / {idle_s:.3f}", per_round])
    headers = ["peer", "experts", "steps", "rounds applied", "blocked s", "wall s", "blocked %", "≤ 2 %",
               "s/step", "s/step round in flight / not", "per round: r@applied step: group, blocked s / round s"]
    return [
        f"## blocked: share of wall time the training loop waited on sync, H = {args.sync_every}, {n} peer processes",
        f"`python -m peer.run --config configs/{args.blocked_shape}.yaml --sync-every {args.sync_every} "
        f"--max-steps {args.blocked_steps} --set train.batch_size={args.blocked_batch} --experts LIST "
        f"--host-maddrs {LOOPBACK[0]}` (+ `--initial-peers` of the first; eval and checkpoints off), "
        f"OMP_NUM_THREADS={args.blocked_threads}; wall s = PeerNode's (from its start, DHT join included)",
        "",
        format_table(headers, rows),
    ]
