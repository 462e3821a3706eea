"""Communication of SPES rounds vs DiLoCo: payload bytes per peer per round, scaling with peers, blocked time.

    python -m bench.comm                    # all three parts (≈ 5-6 min on 2 CPU cores)
    python -m bench.comm --quick            # smoke run of the same code (≈ 2 min)
    python -m bench.comm --parts scaling --peer-counts 2 4 8 16

Parts (result tables on stdout, progress on stderr):
- `ratio`: 4 real peers (DHT + SparseSync each) on 127.0.0.1 in this process. SPES (each peer owns 1/4 of the
  experts) vs DiLoCo (every peer owns every expert: the experts go through a second all-reduce,
  `SparseSync._expert_averager`), for `sync.compression` none / fp16 / 8bit. Bytes per peer per round are the
  difference of `SparseSync.bytes_on_wire()` (sent + received, by kind) around a round, averaged over peers and
  over the measured rounds, after a warm-up round. The headline ratio is SPES(compression) ÷ DiLoCo(none);
  DiLoCo fp16 / 8bit rows are extra context (not with --quick). Every number is also compared with its theory.
- `scaling`: the same with the tiny shape (configs/tiny.yaml model, num_experts 16), SPES only, 2/4/8/16 peers,
  each owning 16/N experts; bytes per peer per round and the wall time of each round.
- `blocked`: real training, `python -m peer.run` processes (the first one's `initial peer:` line is given to
  the others) with `--sync-every 100`; the share of wall time the training loop waited on sync, read from the
  "sync blocked the training loop X s of Y s (Z%)" line that peer/node.py logs at the end.

Rounds are driven as in tests/test_swarm.py `_round_all`: every peer's `start_round` in the main thread (averager
creation must happen there), then every peer's `finish_round(block=True)`. A round counts as measured only if
every peer was in a full group (and, for DiLoCo, a full expert group) and had every expert synchronized.
Every DHT and averager started here is shut down (`peer.sync.shutdown()` in `finally`).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

from bench.common import (REPO_ROOT, OtherCpu, config_path, format_table, get_logger, setup_logging,
                          wait_until_quiet)

if TYPE_CHECKING:
    from model.config import ModelConfig
    from model.model import SpesMoE
    from sync.config import SyncConfig
    from sync.rounds import RoundReport, SparseSync
    from sync.swarm import Swarm

logger = get_logger(__name__)

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
MB = 1e6
TOKENS_PER_ROUND = 1000
BYTES_PER_VALUE = {"none": 4, "fp16": 2, "8bit": 1}
# hivemind's 8-bit format: [int64 n][n = 256 fp32 codebook][uint8 indices]
CODEBOOK_BYTES = 8 + 256 * 4
# The paper's 1B shape (configs/paper-1b.yaml).
PAPER_1B = dict(vocab_size=151665, d_model=768, n_layers=12, n_heads=12, n_kv_heads=12, num_experts=16, top_k=2,
                expert_hidden=2048, seq_len=2048)
# The paper's shape with d_model and expert_hidden / 6, layers / 3 and vocab / 18: experts (d·F·L), attention (d²·L)
# and embeddings (V·d) all shrink by the same factor 108, so the shared share s stays the paper's (0.2247 vs 0.2239:
# norms and router shrink less, heads 2 keep head_dim 64, F = 341 is rounded).
RATIO_SHAPE = dict(vocab_size=8426, d_model=128, n_layers=4, n_heads=2, n_kv_heads=2, num_experts=16, top_k=2,
                   expert_hidden=341, seq_len=256)


# ---- model shapes --------------------------------------------------------------------------------------------

def model_config(**fields: int | str) -> "ModelConfig":
    """A ModelConfig from keyword fields (SpesMoE validates it)."""
    from model.config import ModelConfig

    return ModelConfig(**fields)


def tiny_config(num_experts: int) -> "ModelConfig":
    """configs/tiny.yaml's model section with `num_experts` experts."""
    from peer.config import load_config

    return dataclasses.replace(load_config(config_path("tiny")).model, num_experts=num_experts)


@dataclass
class ShapeCount:
    """Parameter tensors of a model shape, as they travel: every shared tensor, every expert's tensors."""

    shared: list[int]    # numel of each shared tensor
    experts: list[int]   # numel of each expert tensor (every layer, every expert)

    @property
    def shared_total(self) -> int:
        return sum(self.shared)

    @property
    def expert_total(self) -> int:
        return sum(self.experts)

    @property
    def s(self) -> float:
        return self.shared_total / (self.shared_total + self.expert_total)


def count_shape(cfg: "ModelConfig") -> ShapeCount:
    """Tensor sizes of a shape, from transformers' Qwen3-MoE built on the meta device (no memory, so the paper's
    1B shape is counted exactly too). Its fused expert tensors [E, ...] are split per expert, as SpesMoE keeps them."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    from model.model import hf_config

    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(hf_config(cfg))
    shared = [p.numel() for n, p in model.named_parameters() if ".mlp.experts." not in n]
    experts = [p.numel() // cfg.num_experts for n, p in model.named_parameters() if ".mlp.experts." in n
               for _ in range(cfg.num_experts)]
    return ShapeCount(shared, experts)


def describe(cfg: "ModelConfig") -> str:
    """A one-line description of a model shape."""
    return (f"d {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads ({cfg.n_kv_heads} kv), "
            f"{cfg.num_experts} experts top-{cfg.top_k}, expert hidden {cfg.expert_hidden}, vocab {cfg.vocab_size}")


# ---- in-process peers ----------------------------------------------------------------------------------------

@dataclass
class Peer:
    """One in-process peer: its model, its swarm membership (DHT) and its SparseSync."""

    model: "SpesMoE"
    swarm: "Swarm"
    sync: "SparseSync"


@contextmanager
def running_swarm(model_cfg: "ModelConfig", owned: Sequence[Sequence[int]], sync_cfg: "SyncConfig",
                  run_id: str) -> Iterator[list[Peer]]:
    """Start one peer per entry of `owned` (DHT on 127.0.0.1 + SpesMoE + SparseSync, joined); shut all down."""
    from model.model import SpesMoE
    from sync.rounds import SparseSync
    from sync.swarm import Swarm, start_dht

    peers: list[Peer] = []
    initial: list[str] = []
    try:
        for experts in owned:
            dht = start_dht(initial, LOOPBACK, run_id=run_id, num_experts=model_cfg.num_experts,
                            record_ttl=sync_cfg.record_ttl)
            try:
                if not initial:
                    initial.extend(str(m) for m in dht.get_visible_maddrs())
                swarm = Swarm(dht, run_id, model_cfg.num_experts, ttl=sync_cfg.record_ttl)
                model = SpesMoE(model_cfg, owned_experts=experts, seed=0)
                sync = SparseSync(model, swarm, sync_cfg)
            except BaseException:
                dht.shutdown()
                raise
            peers.append(Peer(model, swarm, sync))
            sync.join(step=0, tokens=0)
        yield peers
    finally:
        for peer in peers:
            try:
                peer.sync.shutdown()
            except Exception as e:
                logger.warning(f"shutdown of a peer failed: {type(e).__name__}: {e}")


@dataclass
class RoundResult:
    wall_s: float                     # first start_round to last finish_round
    starts_s: float                   # first start_round to last start_round (matchmaking must cover it)
    bytes: list[dict[str, int]]       # per peer: {"shared": sent+received, "expert": sent+received}
    reports: list["RoundReport"]
    problem: str | None               # why it does not count (partial group, missing experts), None if it does


def run_round(peers: list[Peer], index: int, replicated: bool) -> RoundResult:
    """One round on every peer: all starts (main thread), then all finishes, as tests/test_swarm._round_all."""
    before = [p.sync.bytes_on_wire() for p in peers]
    start = time.perf_counter()
    for peer in peers:
        peer.sync.start_round(step=index, tokens=TOKENS_PER_ROUND * index, tokens_since_last=TOKENS_PER_ROUND)
    starts_s = time.perf_counter() - start
    reports = [peer.sync.finish_round(block=True) for peer in peers]
    wall = time.perf_counter() - start
    after = [p.sync.bytes_on_wire() for p in peers]
    deltas = [{k: a[k] - b.get(k, 0) for k in a} for a, b in zip(after, before)]
    n, num_experts = len(peers), peers[0].model.cfg.num_experts
    problem = None
    if any(r.group_size != n for r in reports):
        problem = f"shared groups {[r.group_size for r in reports]} of {n}"
    elif replicated and any(r.expert_group_size != n for r in reports):
        problem = f"expert groups {[r.expert_group_size for r in reports]} of {n}"
    else:
        for i, r in enumerate(reports):
            if r.experts_missing or len(set(r.experts_synced) | peers[i].model.owned_experts) != num_experts:
                problem = f"peer {i}: experts synced {len(r.experts_synced)}, missing {r.experts_missing}"
                break
    return RoundResult(wall, starts_s, deltas, reports, problem)


def measure_rounds(peers: list[Peer], rounds: int, warmup: int, replicated: bool, extra: int = 2,
                   label: str = "") -> tuple[list[RoundResult], list[RoundResult]]:
    """Warm-up rounds, then rounds until `rounds` complete ones (at most `extra` more tries).
    Returns (complete measured rounds, every round after the warm-up)."""
    for i in range(warmup):
        result = run_round(peers, i + 1, replicated)
        logger.info(f"{label}: warm-up round {i + 1}: {result.wall_s:.1f}s (starts {result.starts_s:.1f}s)"
                    f"{', ' + result.problem if result.problem else ''}")
    good: list[RoundResult] = []
    every: list[RoundResult] = []
    index = warmup
    while len(good) < rounds and index < warmup + rounds + extra:
        index += 1
        result = run_round(peers, index, replicated)
        every.append(result)
        total = sum(sum(b.values()) for b in result.bytes) / len(peers)
        logger.info(f"{label}: round {index}: {result.wall_s:.1f}s (starts {result.starts_s:.1f}s), "
                    f"{total / MB:.2f} MB/peer"
                    f"{' (not counted: ' + result.problem + ')' if result.problem else ''}")
        if result.problem is None:
            good.append(result)
    return good, every


def mean_bytes(results: list[RoundResult]) -> dict[str, float]:
    """Per kind and "total": mean over rounds and peers of the bytes one peer sent + received in one round."""
    if not results:
        return {"shared": float("nan"), "expert": float("nan"), "total": float("nan"), "min": float("nan"),
                "max": float("nan")}
    per_peer = [b for r in results for b in r.bytes]
    shared = sum(b["shared"] for b in per_peer) / len(per_peer)
    expert = sum(b["expert"] for b in per_peer) / len(per_peer)
    totals = [b["shared"] + b["expert"] for b in per_peer]
    return {"shared": shared, "expert": expert, "total": shared + expert, "min": min(totals), "max": max(totals)}


def sync_config(compression: str, matchmaking_time: float, round_timeout: float) -> "SyncConfig":
    """SyncConfig for in-process rounds driven by this script (every=1: a round whenever we call one)."""
    from sync.config import SyncConfig

    cfg = SyncConfig(every=1, round_timeout=round_timeout, matchmaking_time=matchmaking_time, compression=compression)
    cfg.validate()
    return cfg


def _all_reduce_payload(numels: list[int], compression: str) -> float:
    """Bytes of one copy of these tensors in hivemind's averager: each tensor is cut into parts of
    DEFAULT_PART_SIZE_BYTES (after the codec's estimated ratio), and each 8-bit part carries its codebook."""
    from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES

    payload = float(sum(numels) * BYTES_PER_VALUE[compression])
    if compression == "8bit":
        part_values = int(DEFAULT_PART_SIZE_BYTES / (4 * 0.25))  # fp32 x Uniform8Bit's ratio estimate
        payload += CODEBOOK_BYTES * sum(math.ceil(n / part_values) for n in numels)
    return payload


def _transfer_payload(numels: list[int], compression: str, frozen_bf16: bool = True) -> float:
    """Bytes of one copy of these fp32 tensors through ExpertExchange (sync/transfer.py `_serialize_tensor`); a
    non-owner that keeps frozen experts in bf16 (the default) asks for bf16 copies (2 bytes a value)."""
    from sync.transfer import MIN_8BIT_NUMEL

    if compression == "none" and frozen_bf16:
        return float(sum(numels) * 2)
    if compression != "8bit":
        return float(sum(numels) * BYTES_PER_VALUE[compression])
    return float(sum(n + CODEBOOK_BYTES if n >= MIN_8BIT_NUMEL else 2 * n for n in numels))


def expected_bytes(method: str, n: int, shape: ShapeCount, compression: str,
                   frozen_bf16: bool = True) -> tuple[float, float]:
    """(shared, expert) payload one peer sends + receives per round, on average over the peers, in theory.

    Butterfly all-reduce: a peer sends (N-1)/N of a copy as input parts and as much again as averaged deltas,
    and receives as much: 4 (N-1)/N copies. Owner-to-non-owner transfer: a peer receives the (N-1)/N of the
    experts it does not own and sends its own to N-1 peers: 2 (N-1)/N copies."""
    f = (n - 1) / n
    shared = 4 * f * _all_reduce_payload(shape.shared, compression)
    if method == "DiLoCo":
        return shared, 4 * f * _all_reduce_payload(shape.experts, compression)
    return shared, 2 * f * _transfer_payload(shape.experts, compression, frozen_bf16)


# ---- process census ------------------------------------------------------------------------------------------

def descendants(root: int) -> list[int]:
    """PIDs of every live descendant process of `root` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def process_name(pid: int) -> str:
    """The command name of a process ("?" if it is gone)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def pss_bytes(pids: Sequence[int]) -> int:
    """Sum of proportional set sizes (shared pages split between the processes mapping them)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            continue
    return total


def census() -> tuple[int, int, float]:
    """(descendant processes, of which p2pd, PSS of this process + descendants in GiB)."""
    kids = descendants(os.getpid())
    p2pd = sum(process_name(p) == "p2pd" for p in kids)
    return len(kids), p2pd, pss_bytes([os.getpid(), *kids]) / 2**30


def wait_for_no_p2pd(timeout_s: float = 20.0) -> int:
    """Wait until no p2pd daemon started by this process is left; returns how many remain."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [p for p in descendants(os.getpid()) if process_name(p) == "p2pd"]
        if not left or time.monotonic() > deadline:
            return len(left)
        time.sleep(0.5)


# ---- part 1: SPES / DiLoCo byte ratio ---------------------------------------------------------------------------

@dataclass
class ArmResult:
    method: str
    compression: str
    bytes: dict[str, float]
    expected: tuple[float, float]   # (shared, expert) in theory
    rounds: int
    walls: list[float]


def _owned_lists(method: str, n: int, num_experts: int) -> list[list[int]]:
    """DiLoCo: every peer owns every expert; SPES: peer i owns the i-th block of num_experts / n experts."""
    if method == "DiLoCo":
        return [list(range(num_experts)) for _ in range(n)]
    m = num_experts // n
    return [list(range(i * m, (i + 1) * m)) for i in range(n)]


def _goal(compression: str, ratio: float, s: float) -> tuple[str, str]:
    """The goal for SPES with this codec (ratio = SPES(codec) ÷ DiLoCo(none), shared share s) and whether it is
    met. The first goal was (1 + s) / 2 ± 0.02 with fp32 expert copies; since non-owners ask for bf16 copies
    (what they store), "none" is s + (1 - s) / 4. The fp16 / 8-bit bounds are the first goal's half / quarter."""
    eps = 1e-9  # exactly half / a quarter meets "≤"; do not let float rounding decide
    theory, first = s + (1 - s) / 4, (1 + s) / 2
    bound = {"none": (f"{theory:.4f} ± 0.02", abs(ratio - theory) <= 0.02),
             "fp16": (f"≤ {first / 2:.4f}", ratio <= first / 2 + eps),
             "8bit": (f"≤ {first / 4:.4f}", ratio <= first / 4 + eps)}[compression]
    return bound[0], "yes" if bound[1] else "NO"


def bench_ratio(args: argparse.Namespace) -> list[str]:
    """Part `ratio`: bytes per peer per round, SPES vs DiLoCo, 4 peers, per codec. Returns the output lines."""
    n = 4
    cfg = model_config(**RATIO_SHAPE)
    shape, paper = count_shape(cfg), count_shape(model_config(**PAPER_1B))
    theory = shape.s + (1 - shape.s) / 4
    arms = [("DiLoCo", "none"), ("SPES", "none"), ("SPES", "fp16"), ("SPES", "8bit")]
    if not args.quick:
        arms += [("DiLoCo", "fp16"), ("DiLoCo", "8bit")]
    results: list[ArmResult] = []
    for method, compression in arms:
        label = f"ratio {method} {compression}"
        logger.info(f"{label}: starting {n} peers")
        sync_cfg = sync_config(compression, args.matchmaking_time, args.round_timeout)
        owned = _owned_lists(method, n, cfg.num_experts)
        with running_swarm(cfg, owned, sync_cfg, f"comm-{method.lower()}-{compression}") as peers:
            counted = sum(p.numel() for _, p in peers[0].model.shared_parameters())
            assert counted == shape.shared_total, f"shared parameter count {counted} != {shape.shared_total}"
            good, every = measure_rounds(peers, args.rounds, args.warmup, method == "DiLoCo", label=label)
        results.append(ArmResult(method, compression, mean_bytes(good), expected_bytes(method, n, shape, compression),
                                 len(good), [r.wall_s for r in every]))
    denominator = next(r for r in results if r.method == "DiLoCo" and r.compression == "none").bytes["total"]
    same = {r.compression: r.bytes["total"] for r in results if r.method == "DiLoCo"}
    rows = []
    for r in results:
        ratio = r.bytes["total"] / denominator
        goal, met = _goal(r.compression, ratio, shape.s) if r.method == "SPES" else ("-", "-")
        vs_same = f"{r.bytes['total'] / same[r.compression]:.3f}" if r.compression in same else "-"
        expected = sum(r.expected)
        rows.append([r.method, r.compression, f"{r.bytes['shared'] / MB:.2f}", f"{r.bytes['expert'] / MB:.2f}",
                     f"{r.bytes['total'] / MB:.2f}", f"{r.bytes['min'] / MB:.2f} .. {r.bytes['max'] / MB:.2f}",
                     f"{expected / MB:.2f}", f"{r.bytes['total'] / expected:.4f}",
                     f"{r.rounds}: " + " ".join(f"{w:.1f}" for w in r.walls), f"{ratio:.4f}", vs_same, goal, met])
    headers = ["method", "codec", "shared MB", "expert MB", "total MB", "min .. max over peers", "theory MB",
               "measured ÷ theory", "rounds counted: wall s of each", "÷ DiLoCo none", "÷ DiLoCo same codec",
               "goal", "met"]
    # The same formulas (which the table shows to match the measurement) at the paper's 1B shape.
    paper_rows = []
    paper_denominator = sum(expected_bytes("DiLoCo", n, paper, "none"))
    for compression in ("none", "fp16", "8bit"):
        ratio = sum(expected_bytes("SPES", n, paper, compression)) / paper_denominator
        paper_rows.append([compression, f"{ratio:.4f}", *_goal(compression, ratio, paper.s)])
    return [
        f"## ratio: payload bytes sent + received per peer per round, {n} peers on 127.0.0.1",
        f"shape: {describe(cfg)}: {(shape.shared_total + shape.expert_total) / 1e6:.2f}M params, shared "
        f"{shape.shared_total:,}, experts {shape.expert_total:,}; s = shared / total = {shape.s:.4f} "
        f"(paper 1B shape: {paper.shared_total / 1e6:.1f}M of {(paper.shared_total + paper.expert_total) / 1e6:.1f}M, "
        f"s = {paper.s:.4f}); theory s + (1 - s) / 4 = {theory:.4f} (paper shape: {paper.s + (1 - paper.s) / 4:.4f}; "
        f"(1 + s) / 2 = {(1 + shape.s) / 2:.4f} with fp32 expert copies)",
        f"SPES: peer i owns experts {cfg.num_experts // n}i .. {cfg.num_experts // n}i+{cfg.num_experts // n - 1}; "
        f"DiLoCo: every peer owns all {cfg.num_experts} (second all-reduce). Mean over the {n} peers and the counted "
        f"rounds (full groups, every expert synced) after {args.warmup} warm-up round(s); matchmaking "
        f"{args.matchmaking_time}s. theory MB: butterfly all-reduce 4·(N-1)/N copies, owner transfer 2·(N-1)/N "
        f"copies (bf16 with codec none: non-owners store frozen experts in bf16), + 1032 B codebook per 8-bit "
        f"part/tensor",
        "",
        format_table(headers, rows),
        "",
        "Same theory formulas at the paper's 1B shape (SPES ÷ DiLoCo none, 4 peers):",
        "",
        format_table(["codec", "SPES ÷ DiLoCo none", "goal", "met"], paper_rows),
    ]


# ---- part 2: scaling with the number of peers --------------------------------------------------------------------

def bench_scaling(args: argparse.Namespace) -> list[str]:
    """Part `scaling`: SPES bytes per peer per round and round wall time vs peers. Returns the output lines."""
    experts_total = 16
    cfg = tiny_config(experts_total)
    shape = count_shape(cfg)
    rows = []
    base: float | None = None
    base_theory: float | None = None
    totals: dict[int, float] = {}
    for n in args.peer_counts:
        if experts_total % n:
            raise ValueError(f"--peer-counts: {n} does not divide {experts_total} experts")
        m = experts_total // n
        label = f"scaling {n} peers"
        logger.info(f"{label}: starting {n} peers")
        start = time.perf_counter()
        sync_cfg = sync_config("none", args.matchmaking_time, args.round_timeout)
        try:
            with running_swarm(cfg, _owned_lists("SPES", n, experts_total), sync_cfg, f"comm-scale-{n}") as peers:
                startup = time.perf_counter() - start
                procs, p2pd, pss = census()
                logger.info(f"{label}: started in {startup:.0f}s: {procs} child processes ({p2pd} p2pd), "
                            f"PSS {pss:.2f} GiB")
                good, every = measure_rounds(peers, args.rounds, args.warmup, False, label=label)
        except Exception as e:  # e.g. out of processes or memory at 16 peers: report what did fit
            logger.warning(f"{label}: failed: {type(e).__name__}: {e}")
            rows.append([n, m, "failed", "", "", "", "", "", "", "", "", f"{type(e).__name__}: {str(e)[:80]}"])
            continue
        b = mean_bytes(good)
        theory = sum(expected_bytes("SPES", n, shape, "none"))
        base = base if base is not None else b["total"]
        base_theory = base_theory if base_theory is not None else theory
        totals[n] = b["total"]
        groups = sorted({r.group_size for res in every for r in res.reports})
        rows.append([n, m, f"{b['shared'] / 1e3:.0f}", f"{b['expert'] / 1e3:.0f}", f"{b['total'] / 1e3:.0f}",
                     f"{b['min'] / 1e3:.0f} .. {b['max'] / 1e3:.0f}", f"{theory / 1e3:.0f}",
                     f"{b['total'] / base:.3f}", f"{theory / base_theory:.3f}",
                     f"{len(good)}: " + " ".join(f"{r.wall_s:.1f}" for r in every), "/".join(map(str, groups)),
                     f"{procs} ({p2pd} p2pd), {pss:.2f} GiB, {startup:.0f}s"])
    headers = ["peers", "experts/peer", "shared kB", "expert kB", "total kB", "min .. max over peers", "theory kB",
               f"÷ at {args.peer_counts[0]} peers", "theory ÷", "rounds counted: wall s of each",
               "shared group sizes", "child processes, PSS, startup"]
    lines = [
        "## scaling: payload bytes sent + received per peer per round vs number of peers (SPES, codec none)",
        f"shape: configs/tiny.yaml model with num_experts {experts_total} ({describe(cfg)}): shared "
        f"{shape.shared_total:,}, experts {shape.expert_total:,} params, s = {shape.s:.4f}; peer i owns experts "
        f"(16/N)·i .. (16/N)·(i+1)-1 (every expert has one owner at every N). Theory per peer: "
        f"(N-1)/N · (4·shared + 2·experts) · 4 B. {args.rounds} rounds after {args.warmup} warm-up; matchmaking "
        f"{args.matchmaking_time}s; all peers in this one process, {os.cpu_count()} CPU cores",
        "",
        format_table(headers, rows),
    ]
    if 2 in totals and 16 in totals:
        ratio = totals[16] / totals[2]
        lines.append(f"\nper-peer bytes at 16 peers ÷ at 2 peers = {ratio:.3f} (goal ≤ 1.1: "
                     f"{'met' if ratio <= 1.1 else 'NOT met'}; theory (15/16) / (1/2) = 1.875)")
    return lines


# ---- part 3: share of wall time the training loop is blocked ----------------------------------------------------

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


# ---- main ------------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    """Command line of `python -m bench.comm`."""
    p = argparse.ArgumentParser(prog="python -m bench.comm", description=__doc__.split("\n")[0])
    p.add_argument("--parts", nargs="+", choices=("ratio", "scaling", "blocked"),
                   default=["ratio", "scaling", "blocked"], help="which parts to run (default: all)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 measured round, 2 and 4 peers, no DiLoCo fp16/8bit arms, 130 training steps "
                        "at H=50 (its blocked share includes draining the last round when training ends)")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds per arm (after the warm-up)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up rounds per arm (expert averagers start in the first)")
    p.add_argument("--matchmaking-time", type=float, default=2.0, help="sync.matchmaking_time for parts ratio/scaling")
    p.add_argument("--round-timeout", type=float, default=20.0, help="sync.round_timeout for parts ratio/scaling")
    p.add_argument("--peer-counts", type=int, nargs="+", default=[2, 4, 8, 16], help="peer counts of part scaling")
    p.add_argument("--blocked-peers", type=int, default=2, help="peer processes of part blocked")
    p.add_argument("--blocked-shape", choices=("tiny", "small"), default="small", help="config of part blocked")
    p.add_argument("--blocked-batch", type=int, default=2, help="train.batch_size of part blocked")
    p.add_argument("--blocked-steps", type=int, default=370, help="train.max_steps of part blocked")
    p.add_argument("--blocked-threads", type=int, default=1, help="OMP_NUM_THREADS of each peer process")
    p.add_argument("--blocked-timeout", type=float, default=420.0, help="seconds each peer process may take")
    p.add_argument("--sync-every", type=int, default=100, help="H of part blocked")
    p.add_argument("--wait-quiet", type=float, default=60.0,
                   help="before each part, wait up to this many seconds for other processes to leave the CPUs idle")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the selected parts, print their tables; exit 1 if a p2pd daemon of this run is left behind."""
    args = build_parser().parse_args(argv)
    if args.quick:
        args.rounds = 1
        args.peer_counts = [2, 4]
        args.blocked_steps, args.sync_every = 130, 50
        args.wait_quiet = min(args.wait_quiet, 10.0)
    setup_logging()
    start = time.perf_counter()
    outputs: list[str] = []
    parts = {"ratio": bench_ratio, "scaling": bench_scaling, "blocked": bench_blocked}
    for name in args.parts:
        if args.wait_quiet > 0:
            wait_until_quiet(args.wait_quiet)
        part_start, other = time.perf_counter(), OtherCpu().start()
        lines = parts[name](args)
        lines.append(f"({name}: {time.perf_counter() - part_start:.0f}s; CPU used by other processes meanwhile: "
                     f"{other.stop():.0%})")
        outputs.append("\n".join(lines))
        print("\n" + outputs[-1] + "\n", flush=True)
    left = wait_for_no_p2pd()
    print(f"bench.comm: {time.perf_counter() - start:.0f}s in all; p2pd daemons of this run left: {left}", flush=True)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
