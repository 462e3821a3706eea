"""The links alone (`python -m bench.wan --raw-link`): libp2p streams between 4 agents in the same network
namespaces and `tc tbf` links as bench/wan.py's arms: one stream, then every peer pulling from the 3 others at
once (a contribution round's pattern: each peer fetches every other peer's blob). What a round's transfers could
cost at best on these links, without SPES or training (bench/README.md)."""
from __future__ import annotations

import os
from pathlib import Path

from bench.common import format_table

MB = 1e6


def raw_link(public_mbit: float, nbytes: int = 20_000_000) -> str:
    """The links alone, without SPES: libp2p streams (tests/netlab_p2p.py agents) through the same `tc tbf`
    links as the arms. Returns a table: one stream of `nbytes`, and an all-to-all exchange with every stream at
    once (each peer receives nbytes from the 3 others and sends as much), in 1 or 2 streams per pair, twice
    each, as seconds ÷ link time."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.netlab import NetLab

    rate = public_mbit * 1e6 / 8
    names = [f"p{i}" for i in range(4)]
    with NetLab(workdir=Path("/tmp") / f"spes-wan-raw-{os.getpid()}") as lab:
        for name in names:
            lab.add_public(name, up_mbit=public_mbit)
        agents = {"p0": lab.p2p_agent("p0")}
        for name in names[1:]:
            agents[name] = lab.p2p_agent(name, {"initial_peers": agents["p0"].ready["maddrs"]})
        ids = {name: agent.ready["peer_id"] for name, agent in agents.items()}
        pairs = [(a, b) for a in names for b in names if a != b]
        for a, b in pairs:  # dials and TCP warm-up off the clock
            agents[a].request("pull", 30, peer=ids[b], nbytes=100_000, timeout=20)
        one = agents["p1"].request("pull", 120, peer=ids["p0"], nbytes=nbytes, timeout=100)
        rows = [["one stream", f"{nbytes / MB:.1f}", f"{one['seconds']:.2f}", f"{nbytes / rate:.2f}",
                 f"{one['seconds'] / (nbytes / rate):.2f}"]]
        if not one.get("ok"):
            raise RuntimeError(f"a raw transfer failed: {one}")
        # Every peer pulls nbytes in all from the 3 others at once, in 1 stream per pair (3 in and 3 out per link:
        # a contribution round, one blob per peer) or 2 (6 and 6).
        for per_pair in (1, 2, 1, 2):
            part = nbytes // (3 * per_pair)
            with ThreadPoolExecutor(len(names)) as pool:
                replies = list(pool.map(lambda a: agents[a].request(
                    "pullmany", 180, peers=[ids[b] for b in names if b != a] * per_pair, nbytes=part, timeout=160),
                    names))
            if not all(r.get("ok") for r in replies):
                raise RuntimeError(f"a raw transfer failed: {[r for r in replies if not r.get('ok')]}")
            slowest = max(r["total_seconds"] for r in replies)
            rows.append([f"all-to-all, {3 * per_pair} streams in + {3 * per_pair} out per link, slowest peer",
                         f"{3 * per_pair * part / MB:.1f} in + out per peer", f"{slowest:.2f}",
                         f"{3 * per_pair * part / rate:.2f}", f"{slowest / (3 * per_pair * part / rate):.2f}"])
        for agent in agents.values():
            agent.request("quit", 10)
    return (f"bench.wan --raw-link: libp2p streams through {public_mbit:g} Mbit/s tbf links\n\n"
            + format_table(["transfer", "MB", "seconds", "link time s", "ratio"], rows) + "\n")

