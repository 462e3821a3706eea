"""`python -m peer.simulate`: many peers in one process, to try a config or a change at scale before a real run.

    python -m peer.simulate --peers 16 --rounds 12 --experts 8 [--churn 0.1] [--report-every 4] [--out DIR]

N peers, each with its own hivemind DHT node and p2pd on 127.0.0.1, a tiny model (configs/tiny.yaml, `--experts`
experts) and the real round code (sync.rounds.SparseSync: contributions, aggregation, ownership, repair), run
rounds of synthetic training: before each round every peer moves its shared tensors and the experts it owns by a
direction common to all peers plus one of its own (what a few local steps do, without data or backward passes);
`--interval S` spreads that over S seconds of 10 steps (rounds S apart, as in a run, not back to back).
The first N peers own ceil(2E / N) experts each, in turn; with `--churn f`, after each round f x N live peers
leave cleanly and as many fresh ones join with `--experts auto` (Swarm.choose_auto).

Every `--report-every` rounds a table row: live peers, experts covered (min / max owners), rounds completed,
peers drawn per round (`--contributors C`: about C of N contribute, sync/draw.py), contributions aggregated per
peer, round seconds; per peer per round (round start to round start): blob bytes sent + received, DHT record
reads / stores and records per read, and the DHT requests its node sent with their bytes both ways
(sync.hivemind_private.count_dht_rpcs); the roster levels the peers read at and their median estimate of N
(`--roster-shard T`: records per shard, sync/roster.py); and how many different synchronized states the peers
that completed the same round hold (1: no divergence). `--out DIR` writes simulate.json and simulate.png
(`pip install -e ".[plot]"`) there.
Peers, DHT nodes and p2pd daemons are all shut down on exit, also on Ctrl-C.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from hivemind.utils.logging import get_logger

from peer.cli import OneLineParser

logger = get_logger(__name__)

PROG = "python -m peer.simulate"
REPO = Path(__file__).resolve().parent.parent
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
RUN_ID = "spes-simulate"
STEPS = 10  # local steps per round (sync.every) that --interval is cut into


@dataclass
class SimConfig:
    """One scenario."""

    peers: int = 16                # peers at the start (and live peers kept under churn)
    rounds: int = 12               # rounds every live peer runs
    experts: int = 8               # experts of the tiny model
    churn: float = 0.0             # fraction of the live peers that leave after each round (as many join)
    report_every: int = 4          # rounds per table row
    seed: int = 0
    compression: str = "sparse"    # sync.compression of every peer
    round_timeout: float = 30.0
    matchmaking_time: float = 5.0
    interval: float = 0.0          # seconds of (simulated) training between rounds, in 10 steps; 0: back to back
    contributors: int = 16         # sync.contributors of every peer (0: every peer contributes to every round)
    roster_shard: int = 0          # sync.roster_shard of every peer (records per roster shard, sync/roster.py; 0: off)

    def check(self) -> None:
        if self.peers < 2:
            raise ValueError(f"--peers must be >= 2, got {self.peers}")
        if self.rounds < 1 or self.report_every < 1:
            raise ValueError("--rounds and --report-every must be >= 1")
        if self.experts < 1:
            raise ValueError(f"--experts must be >= 1, got {self.experts}")
        if not 0.0 <= self.churn < 1.0:
            raise ValueError(f"--churn must be in [0, 1), got {self.churn}")
        if self.interval < 0:
            raise ValueError(f"--interval must be >= 0, got {self.interval}")
        if self.contributors < 0:
            raise ValueError(f"--contributors must be >= 0, got {self.contributors}")
        if self.roster_shard < 0:
            raise ValueError(f"--roster-shard must be >= 0, got {self.roster_shard}")


@dataclass
class SimPeer:
    """One simulated peer and its counters of DHT requests (reads and stores of the run's records)."""

    name: str
    model: Any
    swarm: Any
    sync: Any
    reads: int = 0
    stores: int = 0
    records_read: int = 0
    store_seconds: list[float] = field(default_factory=list)  # each record store's time until its future resolved
    rounds: list[dict[str, Any]] = field(default_factory=list)

    def shutdown(self) -> None:
        try:
            self.sync.shutdown()
        except Exception as e:  # a peer that fails to leave cleanly must not keep the others' shutdown from running
            logger.warning(f"{self.name}: shutdown: {e}")


def _count_requests(peer: SimPeer) -> None:
    """Count the peer's DHT reads and stores (wrapping the public methods of its own hivemind.DHT instance), and
    every request its DHT node sends with the bytes both ways (sync.hivemind_private.count_dht_rpcs)."""
    from sync.hivemind_private import count_dht_rpcs, store_near

    dht = peer.swarm.dht
    count_dht_rpcs(dht)
    get, run = dht.get, dht.run_coroutine

    def count_records(found) -> None:
        value = getattr(found, "value", None)
        peer.records_read += len(value) if isinstance(value, dict) else 0

    def counted_get(key, *args, **kwargs):
        peer.reads += 1
        found = get(key, *args, **kwargs)
        if kwargs.get("return_future"):  # the drawn key, read beside the roster shard (sync/roster.py)
            found.add_done_callback(lambda f: count_records(f.result()) if not f.exception() else None)
        else:
            count_records(found)
        return found

    def counted_run(coro, *args, **kwargs):  # sync.dht.store_record runs store_near in the DHT process
        if getattr(coro, "func", None) is not store_near:
            return run(coro, *args, **kwargs)
        peer.stores += len(coro.keywords["keys"])  # a record stored under each of its keys counts per key
        started = time.monotonic()
        done = lambda _: peer.store_seconds.append(time.monotonic() - started)
        if kwargs.get("return_future"):
            future = run(coro, *args, **kwargs)
            future.add_done_callback(done)
            return future
        try:
            return run(coro, *args, **kwargs)
        finally:
            done(None)

    dht.get, dht.run_coroutine = counted_get, counted_run


class Simulation:
    """The swarm of one scenario; `run()` yields one row per report interval. Use as a context manager."""

    def __init__(self, cfg: SimConfig):
        from model.config import ModelConfig
        from sync.config import SyncConfig

        cfg.check()
        self.cfg = cfg
        tiny = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())["model"]
        self.model_cfg = ModelConfig(**{**tiny, "num_experts": cfg.experts})
        self.sync_cfg = SyncConfig(every=STEPS, compression=cfg.compression, round_timeout=cfg.round_timeout,
                                   matchmaking_time=cfg.matchmaking_time, record_ttl=10.0,
                                   contributors=cfg.contributors, roster_shard=cfg.roster_shard)
        self.per_peer = min(cfg.experts, math.ceil(2 * cfg.experts / cfg.peers))
        self.rng = random.Random(cfg.seed)
        self.peers: list[SimPeer] = []
        self.joined = 0
        self.rows: list[dict[str, Any]] = []

    def __enter__(self) -> "Simulation":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- peers ------------------------------------------------------------------------------------------------

    def add_peer(self, owned: list[int] | None) -> SimPeer:
        """A peer joining through up to 3 live peers' addresses (the first ones may have left); `owned` None:
        --experts auto."""
        from model.model import SpesMoE
        from sync.rounds import SparseSync
        from sync.swarm import Swarm, start_dht

        initial = [m for p in self.rng.sample(self.peers, min(3, len(self.peers)))
                   for m in p.swarm.visible_maddrs()]
        dht = start_dht(initial, LOOPBACK, run_id=RUN_ID, num_experts=self.cfg.experts,
                        record_ttl=self.sync_cfg.record_ttl)
        swarm = Swarm(dht, RUN_ID, self.cfg.experts, ttl=self.sync_cfg.record_ttl, shard=self.sync_cfg.roster_shard)
        if owned is None:
            owned = swarm.choose_auto(self.per_peer)
        model = SpesMoE(self.model_cfg, owned_experts=owned, seed=self.cfg.seed)
        peer = SimPeer(f"p{self.joined}", model, swarm, SparseSync(model, swarm, self.sync_cfg))
        self.joined += 1
        _count_requests(peer)
        self.peers.append(peer)
        peer.sync.join(step=0, tokens=0)
        return peer

    def start(self) -> None:
        n, e, k = self.cfg.peers, self.cfg.experts, self.per_peer
        for i in range(n):
            self.add_peer(sorted({(i * k + j) % e for j in range(k)}))
        logger.info(f"{n} peers in the swarm, {k} of {e} experts each")

    def shutdown(self) -> None:
        peers, self.peers = self.peers, []
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(SimPeer.shutdown, peers))

    # ---- rounds -----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def _train(self, round_id: int) -> None:
        """What local steps do: a common direction (the data's signal) plus each peer's own part."""
        for i, peer in enumerate(self.peers):
            common = torch.Generator().manual_seed(self.cfg.seed * 100003 + round_id)
            own = torch.Generator().manual_seed(self.cfg.seed * 100003 + round_id * 1009 + i + 1)
            params = [p for _, p in peer.model.shared_parameters()]
            for expert in sorted(peer.model.owned_experts):
                params += list(peer.model.expert_tensors(expert).values())
            for p in params:
                p.add_(0.002 * torch.randn(p.shape, generator=common).to(p.dtype)
                       + 0.0006 * torch.randn(p.shape, generator=own).to(p.dtype))

    @staticmethod
    def _rpc(peer: SimPeer) -> dict[str, int]:
        from sync.hivemind_private import dht_rpc_counts
        try:
            return dht_rpc_counts(peer.swarm.dht)
        except Exception:  # a DHT process gone (the peer shut down): nothing more to count
            return {}

    def _steps(self) -> None:
        """--interval: the round's local steps in wall time, each peer told of every step as the training loop
        tells it (its step time and when it reaches the round's boundary: sync.schedule, sync.progress)."""
        for step in range(1, STEPS + 1):
            time.sleep(self.cfg.interval / STEPS)
            for peer in self.peers:
                peer.sync.note_step(step)

    def round(self, index: int) -> dict[str, Any]:
        """One round on every live peer (concurrent network parts, as separate machines would run them), after
        --interval seconds of training; what a peer sends and reads is counted over both."""
        before = {id(p): (sum(p.sync.bytes_sent().values()) + sum(p.sync.bytes_received().values()), p.reads,
                          p.stores, p.records_read, self._rpc(p), len(p.store_seconds)) for p in self.peers}
        self._train(index)
        if self.cfg.interval > 0:
            self._steps()
        started = time.monotonic()
        # All at once, as separate machines would: one after the other, the first peers' announcement wait
        # (matchmaking_time) ran out before the last ones had published, and they aggregated fewer contributions.
        with ThreadPoolExecutor(max_workers=len(self.peers)) as pool:
            list(pool.map(lambda p: p.sync.start_round(step=index, tokens=100 * index, tokens_since_last=100),
                          self.peers))
        reports = [peer.sync.finish_round(block=True) for peer in self.peers]
        wall = time.monotonic() - started
        stats = []
        for peer, report in zip(self.peers, reports):
            b, r, s, rr, rpc0, st = before[id(peer)]
            now_bytes = sum(peer.sync.bytes_sent().values()) + sum(peer.sync.bytes_received().values())
            rpc = self._rpc(peer)
            delta = {k: rpc.get(k, 0) - rpc0.get(k, 0) for k in ("requests", "sent", "received")}
            stats.append({"dht_requests": delta["requests"], "dht_bytes": delta["sent"] + delta["received"],
                          "round_id": report.round_id if report else None, "group": report.group_size if report else 0,
                          "drawn": bool(report and report.contributed),
                          "announced": report.expected if report else 0,
                          "store_seconds": peer.store_seconds[st:],
                          "seconds": report.seconds if report else None, "bytes": now_bytes - b,
                          "reads": peer.reads - r, "stores": peer.stores - s, "records": peer.records_read - rr,
                          "digest": peer.sync.synced_digest, "level": peer.swarm.roster.level,
                          "estimate": peer.swarm.roster.estimate})
            peer.rounds.append(stats[-1])
        return {"wall": wall, "peers": stats}

    def churn(self) -> tuple[int, int]:
        """Some live peers leave cleanly and as many fresh ones join (--experts auto); (left, joined)."""
        count = int(self.cfg.churn * len(self.peers))
        if count == 0:
            return 0, 0
        leaving = self.rng.sample(self.peers, count)
        self.peers = [p for p in self.peers if p not in leaving]
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(SimPeer.shutdown, leaving))
        for _ in range(count):
            self.add_peer(None)
        return count, count

    def coverage(self) -> dict[int, int]:
        """Owners per expert as the records show them (one live peer's read)."""
        owners = {e: 0 for e in range(self.cfg.experts)}
        for record in self.peers[0].swarm.peers().values():
            for e in record.experts:
                owners[e] += 1
        return owners

    def run(self):
        """Start the swarm, then run the rounds; yields a summary row every report interval (and at the end)."""
        self.start()
        window: list[dict[str, Any]] = []
        left = joined = 0
        for index in range(1, self.cfg.rounds + 1):
            window.append(self.round(index))
            if index % self.cfg.report_every == 0 or index == self.cfg.rounds:
                owners = self.coverage()
                row = summarize(window, owners, len(self.peers), index, left, joined)
                self.rows.append(row)
                window = []
                left = joined = 0
                yield row
            if index < self.cfg.rounds:
                out, came = self.churn()
                left, joined = left + out, joined + came


def summarize(window: list[dict[str, Any]], owners: dict[int, int], live: int, upto: int, left: int,
              joined: int) -> dict[str, Any]:
    """One table row from the rounds of one report interval."""
    stats = [s for r in window for s in r["peers"]]
    distinct = []
    for r in window:  # per round: different synchronized states among the peers at the newest round id
        newest = max((s["round_id"] or 0) for s in r["peers"])
        distinct.append(len({s["digest"] for s in r["peers"] if s["round_id"] == newest}))
    seconds = [s["seconds"] for s in stats if s["seconds"] is not None]
    store_s = [t for s in stats for t in s["store_seconds"]]
    return {"rounds": upto, "live": live, "left": left, "joined": joined,
            "covered": sum(n > 0 for n in owners.values()), "experts": len(owners),
            "min_owners": min(owners.values()), "max_owners": max(owners.values()),
            "group": statistics.fmean(s["group"] for s in stats),
            # Contributions announced in a peer's view (its own included): above `group`, fetches were lost.
            "announced": statistics.fmean(s["announced"] for s in stats),
            "drawn": sum(s["drawn"] for s in stats) / max(1, len(window)),
            "round_s": statistics.median(seconds) if seconds else None,
            "kb_per_peer_round": statistics.fmean(s["bytes"] for s in stats) / 1e3,
            "reads_per_peer_round": statistics.fmean(s["reads"] for s in stats),
            "dht_kb_per_peer_round": statistics.fmean(s["dht_bytes"] for s in stats) / 1e3,
            "dht_requests_per_peer_round": statistics.fmean(s["dht_requests"] for s in stats),
            "stores_per_peer_round": statistics.fmean(s["stores"] for s in stats),
            "store_s": statistics.median(store_s) if store_s else None,
            "records_per_read": (sum(s["records"] for s in stats) / max(1, sum(s["reads"] for s in stats))),
            "levels": f"{min(s['level'] for s in stats)}-{max(s['level'] for s in stats)}",
            "estimate": statistics.median(s["estimate"] for s in stats),
            "distinct_states": max(distinct)}


HEAD = [("rounds", "rounds", "d"), ("live", "live", "d"), ("left", "left", "d"), ("joined", "joined", "d"),
        ("covered", "covered", "d"), ("min_owners", "min owners", "d"), ("max_owners", "max owners", "d"),
        ("drawn", "drawn", ".1f"), ("announced", "announced", ".1f"), ("group", "group", ".1f"),
        ("round_s", "round s", ".2f"),
        ("kb_per_peer_round", "KB/peer/round", ".1f"),
        ("reads_per_peer_round", "reads/peer/round", ".1f"), ("stores_per_peer_round", "stores/peer/round", ".1f"),
        ("store_s", "store s (median)", ".2f"),
        ("records_per_read", "records/read", ".1f"), ("dht_kb_per_peer_round", "DHT KB/peer/round", ".1f"),
        ("dht_requests_per_peer_round", "DHT requests/peer/round", ".0f"), ("levels", "roster levels", "s"),
        ("estimate", "N estimate", ".0f"), ("distinct_states", "states", "d")]


def format_rows(rows: list[dict[str, Any]]) -> str:
    cells = [[("-" if row[k] is None else format(row[k], spec)) for k, _, spec in HEAD] for row in rows]
    titles = [t for _, t, _ in HEAD]
    widths = [max(len(t), *(len(c[i]) for c in cells)) if cells else len(t) for i, t in enumerate(titles)]
    lines = ["  ".join(t.rjust(w) for t, w in zip(titles, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["rounds"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
    axes[0].plot(x, [r["round_s"] or 0 for r in rows], marker="o")
    axes[0].set_title("round seconds (median)")
    axes[1].plot(x, [r["kb_per_peer_round"] for r in rows], marker="o", label="KB")
    axes[1].plot(x, [r["reads_per_peer_round"] for r in rows], marker="o", label="record reads")
    axes[1].set_title("per peer per round")
    axes[1].legend()
    axes[2].plot(x, [r["min_owners"] for r in rows], marker="o", label="min owners")
    axes[2].plot(x, [r["covered"] for r in rows], marker="o", label="experts covered")
    axes[2].set_title("coverage")
    axes[2].legend()
    for ax in axes:
        ax.set_xlabel("round")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    d = SimConfig()
    p = OneLineParser(prog=PROG, description="Many SPES peers in one process: rounds, coverage, bytes, DHT requests.")
    p.add_argument("--peers", type=int, default=d.peers, help=f"peers at the start (default {d.peers})")
    p.add_argument("--rounds", type=int, default=d.rounds, help=f"rounds (default {d.rounds})")
    p.add_argument("--experts", type=int, default=d.experts, help=f"experts of the tiny model (default {d.experts})")
    p.add_argument("--churn", type=float, default=d.churn,
                   help="fraction of the live peers that leave after each round, as many join (default 0)")
    p.add_argument("--report-every", type=int, default=d.report_every, help="rounds per table row")
    p.add_argument("--interval", type=float, default=d.interval,
                   help="seconds of training between rounds, in 10 steps (default 0: rounds back to back)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--compression", default=d.compression, help="sync.compression of every peer")
    p.add_argument("--contributors", type=int, default=d.contributors,
                   help=f"sync.contributors of every peer: about this many contribute to a round (default "
                        f"{d.contributors}; 0: all)")
    p.add_argument("--roster-shard", type=int, default=d.roster_shard,
                   help=f"sync.roster_shard of every peer: records per roster shard (default {d.roster_shard}: "
                        f"one key)")
    p.add_argument("--out", metavar="DIR", help="write simulate.json and simulate.png here")
    return p


def main(argv: list[str] | None = None) -> int:
    from peer.logs import setup_logging

    args = build_parser().parse_args(argv)
    setup_logging()
    cfg = SimConfig(peers=args.peers, rounds=args.rounds, experts=args.experts, churn=args.churn,
                    report_every=args.report_every, seed=args.seed, compression=args.compression,
                    interval=args.interval, contributors=args.contributors, roster_shard=args.roster_shard)
    try:
        cfg.check()
    except ValueError as e:
        logger.error(f"error: {e}")
        return 2
    torch.set_num_threads(1)  # N peers share the cores: one thread each keeps them from fighting
    with Simulation(cfg) as sim:
        try:
            for row in sim.run():
                logger.info(f"after round {row['rounds']}: {row['live']} live, covered {row['covered']}/"
                            f"{row['experts']} (min owners {row['min_owners']}), round {row['round_s']:.2f}s, "
                            f"{row['kb_per_peer_round']:.1f} KB and {row['reads_per_peer_round']:.1f} record reads "
                            f"per peer per round, {row['distinct_states']} synchronized state(s)")
        except KeyboardInterrupt:
            logger.warning("interrupted: shutting every peer down")
    sys.stdout.write(format_rows(sim.rows) + "\n")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "simulate.json").write_text(json.dumps({"config": asdict(cfg), "rows": sim.rows}, indent=1))
        try:
            plot(sim.rows, out / "simulate.png")
        except ImportError:
            logger.warning('no simulate.png: matplotlib is missing (pip install -e ".[plot]")')
    return 0


if __name__ == "__main__":
    sys.exit(main())
