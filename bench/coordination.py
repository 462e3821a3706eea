"""Per-peer coordination traffic of today's round protocol per round, from 8 to 1,000 peers (issue "Many peers").

    python -m bench.coordination                           # the default sync settings, H = 100 steps of 1 s
    python -m bench.coordination --interval 30 --peers 8 64 1000

Coordination is what a peer sends and receives to learn about the others (DHT reads and stores of the run's peer
records), not the contribution blobs (bench.contrib_bytes). Every input is measured here or read from the code
that sets it:

- bytes per record copy: a peer record as a round leaves it (contrib, prev, synced, due, origin, settings
  fingerprint, 4 experts) signed by a fresh 2048-bit RSA identity (`RunRecordValidator.sign_value`), with its
  subkey and expiration, msgpack-framed as hivemind's DHT sends it.
- reads per round: the progress reader every `min(1, matchmaking_time / 4)` s over the round interval
  (sync/rounds.py), the announcement wait's reads every 0.2 s for `--wait` seconds (sync/contributions.py) and
  the round start's read.
- stores per round: the heartbeat every `record_ttl / 3` s plus one at the round's announcement.
- hivemind's DHT (its own defaults, read from hivemind.dht.node.DHTNode.create): every record of the run lives
  under one key; a full read (`latest=True`, as `Swarm.peers`) asks every node of its beam (`bucket_size`) and
  each node holding the key (`num_replicas`, + `cache_nearest` caches) answers with every live record; a store
  goes to `num_replicas` nodes.

The rows are a model (the formula in `coordination_row`), not a swarm run: peer.simulate measures reads per round
at up to 32 peers on this machine. What the model leaves out (DHT routing upkeep, hops beyond the beam) only adds.
"""
from __future__ import annotations

import argparse
import inspect
import math
import sys
from dataclasses import dataclass
from typing import Sequence

from bench.common import format_table, setup_logging

GOAL_KB = 10.0  # issue "Many peers": per-peer coordination per round at 1,000 peers


@dataclass(frozen=True)
class DhtParams:
    bucket_size: int
    num_replicas: int
    cache_nearest: int


@dataclass(frozen=True)
class Schedule:
    interval_s: float     # wall time between two rounds' starts (H steps x step time)
    progress_poll_s: float
    wait_s: float         # the announcement wait's length
    wait_poll_s: float
    heartbeat_s: float


def hivemind_dht_params() -> DhtParams:
    """hivemind's defaults for the DHT node every peer runs (sync/dht.py passes none of these)."""
    from hivemind.dht.node import DHTNode
    defaults = {name: p.default for name, p in inspect.signature(DHTNode.create).parameters.items()}
    return DhtParams(defaults["bucket_size"], defaults["num_replicas"], defaults["cache_nearest"])


def record_copy_bytes() -> int:
    """Bytes of one signed peer record as a read carries it (subkey, value, expiration; msgpack)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import get_dht_time
    from hivemind.utils.serializer import MSGPackSerializer

    from sync.peer_record import PeerRecord
    from sync.records import RunRecordValidator, peer_id_of_public_key, peers_key

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    der = key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    peer_id = peer_id_of_public_key(der).to_base58()
    now = get_dht_time()
    digest = "ab" * 32
    record = PeerRecord(peer_id, [0, 5, 9, 12], round=1234, step=123_400, tokens=2 ** 40, origin=[1234567890, 4321,
                        int(now * 1000)], due=[1235, now + 100.0], contrib=[1234, 2 ** 22, digest, 409_600, [0, 5, 9,
                        12]], prev=[1233, 2 ** 22, digest, 409_600, [0, 5, 9, 12]], synced=[1233, "cd" * 16],
                        cfg="ef" * 8)
    run_id = "a-volunteer-run"
    signer = RunRecordValidator(run_id, 16, private_key=key)
    subkey = MSGPackSerializer.dumps(peer_id)
    unsigned = DHTRecord(DHTID.generate(source=peers_key(run_id)).to_bytes(), subkey,
                         MSGPackSerializer.dumps(record.to_value()), now + 30)
    value = signer.sign_value(unsigned)
    return len(MSGPackSerializer.dumps([subkey, value, now + 30]))


def coordination_row(peers: int, record_bytes: int, dht: DhtParams, sched: Schedule) -> dict[str, float]:
    """Per-peer, per-round coordination of today's protocol with `peers` peers (each runs one DHT node)."""
    holders = min(peers, dht.num_replicas + dht.cache_nearest)  # nodes answering a read with every record
    asked = min(peers - 1, dht.bucket_size + math.ceil(math.log2(max(peers, 2))))  # the beam plus the hops to it
    reads = sched.interval_s / sched.progress_poll_s + sched.wait_s / sched.wait_poll_s + 1
    stores = sched.interval_s / sched.heartbeat_s + 1
    read_kb = holders * peers * record_bytes / 1000
    return {"peers": peers, "kb_per_read": read_kb, "reads": reads,
            "kb": reads * read_kb + stores * min(peers, dht.num_replicas) * record_bytes / 1000,
            "requests": reads * asked + stores * min(peers - 1, dht.num_replicas),
            # Each node holding the key answers every full read of every other peer with the whole record set.
            "served_kb": (peers - 1) * reads * peers * record_bytes / 1000}


def table(rows: Sequence[dict[str, float]]) -> str:
    return format_table(
        ["peers (= records per read)", "KB per read", "reads per round", "coordination KB/peer/round",
         "DHT requests/peer/round", "KB a record holder serves per round", "÷ goal (10 KB)"],
        [[r["peers"], f"{r['kb_per_read']:.0f}", f"{r['reads']:.0f}", f"{r['kb']:,.0f}", f"{r['requests']:,.0f}",
          f"{r['served_kb']:,.0f}", f"{r['kb'] / GOAL_KB:,.0f}x"] for r in rows])


def main(argv: list[str] | None = None) -> int:
    from sync.config import SyncConfig

    defaults = SyncConfig()
    p = argparse.ArgumentParser(prog="python -m bench.coordination", description=__doc__.split("\n\n")[0])
    p.add_argument("--peers", type=int, nargs="+", default=[8, 16, 32, 64, 128, 1000])
    p.add_argument("--interval", type=float, default=float(defaults.every),
                   help="seconds between rounds (default: sync.every steps of 1 s)")
    p.add_argument("--wait", type=float, default=1.0, help="seconds the announcement wait polls per round")
    args = p.parse_args(argv)
    if min(args.peers) < 1 or args.interval <= 0 or args.wait < 0:
        p.error("--peers >= 1, --interval > 0 and --wait >= 0")
    setup_logging()
    sched = Schedule(args.interval, min(1.0, defaults.matchmaking_time / 4), args.wait, 0.2, defaults.record_ttl / 3)
    dht, record_bytes = hivemind_dht_params(), record_copy_bytes()
    rows = [coordination_row(n, record_bytes, dht, sched) for n in args.peers]
    sys.stdout.write(f"record copy {record_bytes} B; hivemind DHT bucket_size {dht.bucket_size}, num_replicas "
                     f"{dht.num_replicas}, cache_nearest {dht.cache_nearest}; round every {args.interval:g} s, "
                     f"progress poll {sched.progress_poll_s:g} s, announcement wait {args.wait:g} s\n"
                     + table(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
