"""Communication of SPES rounds vs DiLoCo: payload bytes per peer per round, scaling with peers, blocked time.

    python -m bench.comm                    # all three parts (≈ 5-6 min on 2 CPU cores)
    python -m bench.comm --quick            # smoke run of the same code (≈ 2 min)
    python -m bench.comm --parts scaling --peer-counts 2 4 8 16

Every round is a contribution round: each peer serves one blob (its shared tensors and the experts it owns, in
the `sync.compression` codec) and fetches every other peer's. Parts (result tables on stdout, progress on stderr):
- `ratio`: 4 real peers (DHT + SparseSync each) on 127.0.0.1 in this process. SPES (each peer owns 1/4 of the
  experts) vs DiLoCo (every peer owns every expert, so every blob carries them all), for `sync.compression`
  none (fp32) / fp16 / 8bit / sparse. Bytes per peer per round are the difference of the SparseSync's
  `bytes_sent()` + `bytes_received()` (by kind) around a round, averaged over peers and over the measured
  rounds, after a warm-up round. The headline ratio is SPES(compression) ÷ DiLoCo(none); DiLoCo fp16 / 8bit /
  sparse rows are extra context (not with --quick). Every number is also compared with its theory: 2 (N-1)
  blobs per peer, each of `sync.sparse.encoded_size` bytes.
- `scaling`: the same with the tiny shape (configs/tiny.yaml model, num_experts 16), SPES only, 2/4/8/16 peers,
  each owning 16/N experts (`--scaling-codec`, default sparse); bytes per peer per round and the wall time of
  each round.
- `blocked` (bench/comm_blocked.py): real training, `python -m peer.run` processes (the first one's `initial
  peer:` line is given to the others) with `--sync-every 100`; the share of wall time the training loop waited on
  sync, read from the "sync blocked the training loop X s of Y s (Z%)" line that peer/node.py logs at the end.

Rounds are driven as in tests/test_swarm.py `_round_all`: every peer's `start_round` (the network parts run in
the background), then every peer's `finish_round(block=True)`. A round counts as measured only if every peer
aggregated every peer's contribution and had every expert synchronized. Every DHT and exchange started here is
shut down (`peer.sync.shutdown()` in `finally`).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence

from bench.common import (OtherCpu, census, config_path, format_table, get_logger, setup_logging,
                          wait_for_no_p2pd, wait_until_quiet)

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
CODECS = ("none", "fp16", "8bit", "sparse")  # sync.compression
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
    """Parameter tensors of a model shape, as they travel in a contribution: every shared tensor's shape and one
    expert's tensors' shapes (the same for every expert)."""

    shared: dict[str, tuple[int, ...]]
    expert: dict[str, tuple[int, ...]]
    num_experts: int

    @property
    def shared_total(self) -> int:
        return sum(map(math.prod, self.shared.values()))

    @property
    def per_expert(self) -> int:
        return sum(map(math.prod, self.expert.values()))

    @property
    def expert_total(self) -> int:
        return self.num_experts * self.per_expert

    @property
    def s(self) -> float:
        return self.shared_total / (self.shared_total + self.expert_total)


def count_shape(cfg: "ModelConfig") -> ShapeCount:
    """Tensor shapes of a model, from SpesMoE built on the meta device (no memory, so the paper's 1B shape is
    counted exactly too)."""
    import torch

    from model.model import SpesMoE

    with torch.device("meta"):
        model = SpesMoE(cfg)
    return ShapeCount({n: tuple(p.shape) for n, p in model.shared_parameters()},
                      {n: tuple(t.shape) for n, t in model.expert_tensors(0).items()}, cfg.num_experts)


def blob_bytes(shape: ShapeCount, owned: int, compression: str) -> int:
    """Bytes of one contribution of a peer owning `owned` experts: the shared tensors and those experts' tensors
    in one blob of the codec (`sync.sparse.encoded_size`, header included; sync.sparse settings: the defaults)."""
    from sync.config import SparseConfig
    from sync.sparse import SparseSpec, encoded_size

    sp = SparseConfig()
    method = {"none": "fp32"}.get(compression, compression)
    tensors = {f"s/{n}": v for n, v in shape.shared.items()}
    tensors.update({f"e{e}/{n}": v for e in range(owned) for n, v in shape.expert.items()})
    return encoded_size(tensors, SparseSpec(method=method, chunk=sp.chunk, topk=sp.topk, bits=sp.bits))


def expected_bytes(n: int, shape: ShapeCount, owned: int, compression: str) -> tuple[float, float]:
    """(shared, expert) payload one peer sends + receives per round, on average over the peers, in theory: every
    peer fetches every other peer's blob, so a peer sends its blob N-1 times and receives N-1 blobs. Each blob's
    bytes count by kind in proportion to its elements, as SparseSync counts them."""
    moved = 2 * (n - 1) * blob_bytes(shape, owned, compression)
    expert = owned * shape.per_expert / (shape.shared_total + owned * shape.per_expert)
    return moved * (1 - expert), moved * expert


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
    starts_s: float                   # first start_round to last start_round (the announcement wait covers it)
    bytes: list[dict[str, int]]       # per peer: {"shared": sent+received, "expert": sent+received}
    reports: list["RoundReport"]
    problem: str | None               # why it does not count (partial group, missing experts), None if it does


def on_wire(sync: "SparseSync") -> dict[str, int]:
    """Tensor payload bytes a peer sent + received so far, by kind ("shared", "expert")."""
    sent, received = sync.bytes_sent(), sync.bytes_received()
    return {k: sent.get(k, 0) + received.get(k, 0) for k in ("shared", "expert")}


def run_round(peers: list[Peer], index: int) -> RoundResult:
    """One round on every peer: all starts, then all finishes, as tests/test_swarm._round_all."""
    before = [on_wire(p.sync) for p in peers]
    start = time.perf_counter()
    for peer in peers:
        peer.sync.start_round(step=index, tokens=TOKENS_PER_ROUND * index, tokens_since_last=TOKENS_PER_ROUND)
    starts_s = time.perf_counter() - start
    reports = [peer.sync.finish_round(block=True) for peer in peers]
    wall = time.perf_counter() - start
    after = [on_wire(p.sync) for p in peers]
    deltas = [{k: a[k] - b.get(k, 0) for k in a} for a, b in zip(after, before)]
    n, num_experts = len(peers), peers[0].model.cfg.num_experts
    problem = None
    if any(r.group_size != n for r in reports):
        problem = f"contributions aggregated {[r.group_size for r in reports]} of {n}"
    else:
        for i, r in enumerate(reports):
            if r.experts_missing or len(set(r.experts_synced) | peers[i].model.owned_experts) != num_experts:
                problem = f"peer {i}: experts synced {len(r.experts_synced)}, missing {r.experts_missing}"
                break
    return RoundResult(wall, starts_s, deltas, reports, problem)


def measure_rounds(peers: list[Peer], rounds: int, warmup: int, extra: int = 2,
                   label: str = "") -> tuple[list[RoundResult], list[RoundResult]]:
    """Warm-up rounds, then rounds until `rounds` complete ones (at most `extra` more tries).
    Returns (complete measured rounds, every round after the warm-up)."""
    for i in range(warmup):
        result = run_round(peers, i + 1)
        logger.info(f"{label}: warm-up round {i + 1}: {result.wall_s:.1f}s (starts {result.starts_s:.1f}s)"
                    f"{', ' + result.problem if result.problem else ''}")
    good: list[RoundResult] = []
    every: list[RoundResult] = []
    index = warmup
    while len(good) < rounds and index < warmup + rounds + extra:
        index += 1
        result = run_round(peers, index)
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


def _goal(compression: str, ratio: float, s: float, theory: float) -> tuple[str, str]:
    """The goal for SPES with this codec (ratio = SPES(codec) ÷ DiLoCo(none), shared share s, `theory` that ratio
    in theory) and whether it is met: "none" within 0.02 of its theory (s + (1 - s) / 4 with 4 peers, headers
    aside); fp16 / 8-bit at most half / a quarter of (1 + s) / 2; no goal for sparse."""
    eps = 1e-9  # exactly half / a quarter meets "≤"; do not let float rounding decide
    first = (1 + s) / 2
    bound = {"none": (f"{theory:.4f} ± 0.02", abs(ratio - theory) <= 0.02),
             "fp16": (f"≤ {first / 2:.4f}", ratio <= first / 2 + eps),
             "8bit": (f"≤ {first / 4:.4f}", ratio <= first / 4 + eps)}.get(compression)
    return (bound[0], "yes" if bound[1] else "NO") if bound else ("-", "-")


def _theory_ratio(n: int, shape: ShapeCount, compression: str) -> float:
    """SPES(codec) ÷ DiLoCo(none) bytes per peer per round, in theory."""
    spes = sum(expected_bytes(n, shape, shape.num_experts // n, compression))
    return spes / sum(expected_bytes(n, shape, shape.num_experts, "none"))


def bench_ratio(args: argparse.Namespace) -> list[str]:
    """Part `ratio`: bytes per peer per round, SPES vs DiLoCo, 4 peers, per codec. Returns the output lines."""
    n = 4
    cfg = model_config(**RATIO_SHAPE)
    shape, paper = count_shape(cfg), count_shape(model_config(**PAPER_1B))
    theory = shape.s + (1 - shape.s) / n
    arms = [("DiLoCo", "none"), *(("SPES", c) for c in CODECS)]
    if not args.quick:
        arms += [("DiLoCo", c) for c in CODECS if c != "none"]
    results: list[ArmResult] = []
    for method, compression in arms:
        label = f"ratio {method} {compression}"
        logger.info(f"{label}: starting {n} peers")
        sync_cfg = sync_config(compression, args.matchmaking_time, args.round_timeout)
        owned = _owned_lists(method, n, cfg.num_experts)
        with running_swarm(cfg, owned, sync_cfg, f"comm-{method.lower()}-{compression}") as peers:
            counted = sum(p.numel() for _, p in peers[0].model.shared_parameters())
            assert counted == shape.shared_total, f"shared parameter count {counted} != {shape.shared_total}"
            good, every = measure_rounds(peers, args.rounds, args.warmup, label=label)
        expected = expected_bytes(n, shape, len(owned[0]), compression)
        results.append(ArmResult(method, compression, mean_bytes(good), expected, len(good), [r.wall_s for r in every]))
    denominator = next(r for r in results if r.method == "DiLoCo" and r.compression == "none").bytes["total"]
    same = {r.compression: r.bytes["total"] for r in results if r.method == "DiLoCo"}
    rows = []
    for r in results:
        ratio = r.bytes["total"] / denominator
        goal, met = (_goal(r.compression, ratio, shape.s, _theory_ratio(n, shape, r.compression))
                     if r.method == "SPES" else ("-", "-"))
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
    for compression in CODECS:
        ratio = _theory_ratio(n, paper, compression)
        paper_rows.append([compression, f"{ratio:.4f}", *_goal(compression, ratio, paper.s, ratio)])
    return [
        f"## ratio: payload bytes sent + received per peer per round, {n} peers on 127.0.0.1",
        f"shape: {describe(cfg)}: {(shape.shared_total + shape.expert_total) / 1e6:.2f}M params, shared "
        f"{shape.shared_total:,}, experts {shape.expert_total:,}; s = shared / total = {shape.s:.4f} "
        f"(paper 1B shape: {paper.shared_total / 1e6:.1f}M of {(paper.shared_total + paper.expert_total) / 1e6:.1f}M, "
        f"s = {paper.s:.4f}); SPES ÷ DiLoCo in theory s + (1 - s) / {n} = {theory:.4f} with the same codec "
        f"(paper shape: {paper.s + (1 - paper.s) / n:.4f})",
        f"SPES: peer i owns experts {cfg.num_experts // n}i .. {cfg.num_experts // n}i+{cfg.num_experts // n - 1}; "
        f"DiLoCo: every peer owns all {cfg.num_experts}. Mean over the {n} peers and the counted rounds (every "
        f"contribution aggregated, every expert synced) after {args.warmup} warm-up round(s); matchmaking "
        f"{args.matchmaking_time}s. theory MB: 2·(N-1) blobs per peer (its own sent N-1 times, N-1 received), "
        f"each of sync.sparse.encoded_size bytes (sparse: the default sync.sparse settings)",
        "",
        format_table(headers, rows),
        "",
        f"Same theory at the paper's 1B shape (SPES ÷ DiLoCo none, {n} peers):",
        "",
        format_table(["codec", "SPES ÷ DiLoCo none", "goal", "met"], paper_rows),
    ]


# ---- part 2: scaling with the number of peers --------------------------------------------------------------------

def bench_scaling(args: argparse.Namespace) -> list[str]:
    """Part `scaling`: SPES bytes per peer per round and round wall time vs peers. Returns the output lines."""
    experts_total, codec = 16, args.scaling_codec
    cfg = tiny_config(experts_total)
    shape = count_shape(cfg)
    rows = []
    base: float | None = None
    base_theory: float | None = None
    totals: dict[int, tuple[float, float]] = {}  # peers -> (measured, theory)
    for n in args.peer_counts:
        if experts_total % n:
            raise ValueError(f"--peer-counts: {n} does not divide {experts_total} experts")
        m = experts_total // n
        label = f"scaling {n} peers"
        logger.info(f"{label}: starting {n} peers")
        start = time.perf_counter()
        sync_cfg = sync_config(codec, args.matchmaking_time, args.round_timeout)
        try:
            with running_swarm(cfg, _owned_lists("SPES", n, experts_total), sync_cfg, f"comm-scale-{n}") as peers:
                startup = time.perf_counter() - start
                procs, p2pd, pss = census()
                logger.info(f"{label}: started in {startup:.0f}s: {procs} child processes ({p2pd} p2pd), "
                            f"PSS {pss:.2f} GiB")
                good, every = measure_rounds(peers, args.rounds, args.warmup, label=label)
        except Exception as e:  # e.g. out of processes or memory at 16 peers: report what did fit
            logger.warning(f"{label}: failed: {type(e).__name__}: {e}")
            rows.append([n, m, "failed", "", "", "", "", "", "", "", "", f"{type(e).__name__}: {str(e)[:80]}"])
            continue
        b = mean_bytes(good)
        theory = sum(expected_bytes(n, shape, m, codec))
        base = base if base is not None else b["total"]
        base_theory = base_theory if base_theory is not None else theory
        totals[n] = (b["total"], theory)
        groups = sorted({r.group_size for res in every for r in res.reports})
        rows.append([n, m, f"{b['shared'] / 1e3:.0f}", f"{b['expert'] / 1e3:.0f}", f"{b['total'] / 1e3:.0f}",
                     f"{b['min'] / 1e3:.0f} .. {b['max'] / 1e3:.0f}", f"{theory / 1e3:.0f}",
                     f"{b['total'] / base:.3f}", f"{theory / base_theory:.3f}",
                     f"{len(good)}: " + " ".join(f"{r.wall_s:.1f}" for r in every), "/".join(map(str, groups)),
                     f"{procs} ({p2pd} p2pd), {pss:.2f} GiB, {startup:.0f}s"])
    headers = ["peers", "experts/peer", "shared kB", "expert kB", "total kB", "min .. max over peers", "theory kB",
               f"÷ at {args.peer_counts[0]} peers", "theory ÷", "rounds counted: wall s of each",
               "contributions aggregated", "child processes, PSS, startup"]
    lines = [
        f"## scaling: payload bytes sent + received per peer per round vs number of peers (SPES, codec {codec})",
        f"shape: configs/tiny.yaml model with num_experts {experts_total} ({describe(cfg)}): shared "
        f"{shape.shared_total:,}, experts {shape.expert_total:,} params, s = {shape.s:.4f}; peer i owns experts "
        f"(16/N)·i .. (16/N)·(i+1)-1 (every expert has one owner at every N). Theory per peer: 2·(N-1) blobs of "
        f"the shared tensors + 16/N experts (sync.sparse.encoded_size). {args.rounds} rounds after {args.warmup} "
        f"warm-up; matchmaking {args.matchmaking_time}s; all peers in this one process, {os.cpu_count()} CPU cores",
        "",
        format_table(headers, rows),
    ]
    if len(totals) > 1:
        (lo, (lo_b, lo_t)), (hi, (hi_b, hi_t)) = min(totals.items()), max(totals.items())
        lines.append(f"\nper-peer bytes at {hi} peers ÷ at {lo} peers = {hi_b / lo_b:.3f} (theory {hi_t / lo_t:.3f}: "
                     f"every peer fetches every other peer's blob)")
    return lines


# ---- main ------------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    """Command line of `python -m bench.comm`."""
    p = argparse.ArgumentParser(prog="python -m bench.comm", description=__doc__.split("\n")[0])
    p.add_argument("--parts", nargs="+", choices=("ratio", "scaling", "blocked"),
                   default=["ratio", "scaling", "blocked"], help="which parts to run (default: all)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 measured round, 2 and 4 peers, no DiLoCo fp16/8bit/sparse arms, 130 training "
                        "steps at H=50 (its blocked share includes draining the last round when training ends)")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds per arm (after the warm-up)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up rounds per arm")
    p.add_argument("--matchmaking-time", type=float, default=2.0, help="sync.matchmaking_time for parts ratio/scaling")
    p.add_argument("--round-timeout", type=float, default=20.0, help="sync.round_timeout for parts ratio/scaling")
    p.add_argument("--peer-counts", type=int, nargs="+", default=[2, 4, 8, 16], help="peer counts of part scaling")
    p.add_argument("--scaling-codec", choices=CODECS, default="sparse", help="sync.compression of part scaling")
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
    from bench.comm_blocked import bench_blocked

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
