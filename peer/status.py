"""`python -m peer.status`: a run as its DHT records show it, without joining it as a trainer.

    python -m peer.status --initial-peers MADDR [MADDR ...] [--run-id ID] [--json FILE] [--timeout S]

Starts a hivemind DHT client (it only makes requests: no port is opened, no record published), reads the run's
signed peer records (sync/records.py checks each) and prints one row per live peer (experts owned, and those
only taken care of; round; step; tokens; the round of its newest contribution; the digest of its synchronized
tensors), then the coverage of the experts, the swarm's round (the median) and whether the peers at the newest
applied round hold the same synchronized tensors. The number of experts comes from the run's settings
(sync/settings.py), else from the records. An unreachable initial peer or an empty run: one line on stderr, exit 2.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from typing import Any

from hivemind.utils.logging import get_logger

from peer.cli import OneLineParser

logger = get_logger(__name__)

PROG = "python -m peer.status"
ANY_EXPERTS = 4096  # the records' expert indices are only bounded by this until the run's settings are read


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description="A run's peers, experts and rounds, read from its DHT records (no training).")
    p.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR",
                   help="full multiaddrs of the run's bootstrap node or any peer (/ip4/.../tcp/.../p2p/...)")
    p.add_argument("--run-id", default="spes-demo", help="the run to show (default: spes-demo)")
    p.add_argument("--timeout", type=float, default=20.0, metavar="S",
                   help="seconds to keep trying the initial peers and to wait for records (default: 20)")
    p.add_argument("--json", metavar="FILE", help="also write what is printed as a JSON object to FILE")
    return p


def summarize(records: dict[str, Any], num_experts: int) -> dict[str, Any]:
    """The run's state from its live records (sync.peer_record.PeerRecord by peer ID): per-peer rows, owners per
    expert, the median round, and how many distinct synchronized digests the newest applied round has."""
    rows = [{"peer": p[-8:], "experts": sorted(set(r.experts) - set(r.caretaking)), "caretaking": sorted(r.caretaking),
             "round": r.round, "step": r.step, "tokens": r.tokens,
             "contributed": r.contrib[0] if r.contrib else None,
             "synced": f"{r.synced[1][:8]}@{r.synced[0]}" if r.synced else ""}
            for p, r in sorted(records.items(), key=lambda kv: kv[0])]
    owners = {e: 0 for e in range(num_experts)}
    for r in records.values():
        for e in r.experts:
            owners[e] = owners.get(e, 0) + 1
    newest = max((int(r.synced[0]) for r in records.values() if r.synced), default=None)
    digests = Counter(r.synced[1] for r in records.values() if r.synced and int(r.synced[0]) == newest)
    rounds = [r.round for r in records.values()]
    return {"peers": rows, "owners": owners, "uncovered": sorted(e for e, n in owners.items() if n == 0),
            "round": int(statistics.median_low(rounds)) if rounds else None,
            "tokens": sum(r.tokens for r in records.values()),
            "synced_round": newest, "synced_digests": len(digests)}


def format_status(run_id: str, status: dict[str, Any]) -> str:
    head = ("peer", "experts", "caretaking", "round", "step", "tokens", "contributed", "synced")
    rows = [[str(row[k]) if not isinstance(row[k], list) else ",".join(map(str, row[k])) or "-" for k in head]
            for row in status["peers"]]
    rows = [[cell if cell not in ("None", "") else "-" for cell in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    owners = status["owners"]
    covered = sum(n > 0 for n in owners.values())
    agree = ("the same synchronized tensors" if status["synced_digests"] == 1 else
             f"{status['synced_digests']} different synchronized tensors")
    lines.append(f"run {run_id}: {len(rows)} live peer(s), round {status['round']}, {status['tokens']:,} tokens; "
                 f"experts covered {covered}/{len(owners)} (min owners {min(owners.values(), default=0)}"
                 f"{', uncovered ' + ','.join(map(str, status['uncovered'])) if status['uncovered'] else ''})"
                 + (f"; at round {status['synced_round']}: {agree}" if status["synced_round"] is not None else ""))
    return "\n".join(lines)


def read_run(initial_peers: list[str], run_id: str, timeout: float) -> tuple[dict[str, Any], int]:
    """(live records, number of experts) of `run_id`, through a DHT client started and stopped here."""
    from sync.swarm import Swarm, start_dht
    dht = start_dht(initial_peers, ("/ip4/0.0.0.0/tcp/0",), run_id=run_id, num_experts=ANY_EXPERTS,
                    client_mode=True, join_timeout=timeout)
    try:
        swarm = Swarm(dht, run_id, ANY_EXPERTS)
        deadline, records = time.monotonic() + timeout, {}
        while not records and time.monotonic() < deadline:  # a fresh node's first reads may find nothing yet
            records = {p: r for p, r in swarm.peers().items() if p != swarm.peer_id}
            if not records:
                time.sleep(0.5)
        num_experts = 1 + max((e for r in records.values() for e in r.experts), default=-1)
        _, settings = swarm.run_settings(records.values())
        if settings is not None and isinstance(settings.get("model.num_experts"), int):
            num_experts = settings["model.num_experts"]
        return records, num_experts
    finally:
        dht.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from peer.logs import setup_logging
    setup_logging()
    from sync.dht import SwarmError
    try:
        records, num_experts = read_run(args.initial_peers, args.run_id, args.timeout)
    except SwarmError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if not records:
        print(f"{PROG}: error: no live peer of run {args.run_id} found through {', '.join(args.initial_peers)} "
              f"within {args.timeout:g} s (is --run-id right?)", file=sys.stderr)
        return 2
    status = summarize(records, num_experts)
    print(format_status(args.run_id, status))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"run_id": args.run_id, **status}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
