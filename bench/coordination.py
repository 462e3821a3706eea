"""Per-peer coordination traffic of the round protocol per round, from 8 to 1,000 peers (issue "Many peers").

    python -m bench.coordination                           # the default sync settings, H = 100 steps of 1 s
    python -m bench.coordination --interval 30 --peers 8 64 1000

Coordination is what a peer sends and receives to learn about the others (DHT reads and stores of the run's peer
records), not the contribution blobs (bench.contrib_bytes). Two builds side by side: `7466c65` (hivemind's DHT
defaults) and this one (sync.dht: READ_BEAM, stores that look up elsewhere, no caching at other nodes). Every input is
measured here or read from the code that sets it:

- bytes per record copy: a peer record as a round leaves it (contrib, prev, synced, due, origin, settings
  fingerprint, 4 experts) signed by a fresh 2048-bit RSA identity (`RunRecordValidator.sign_value`), with its
  subkey and expiration, msgpack-framed as hivemind's DHT sends it; bytes of a find answer's neighbour list
  (`bucket_size` node and peer IDs, hivemind's own protobuf).
- reads per round: the records' reader (sync/progress.py) every `min(1, matchmaking_time / 4)` s over the round
  interval (7466c65), or (this build) so from `matchmaking_time` + 2 polls before a round's start to the end of
  its announcement wait and every `record_ttl / 3` s otherwise; the announcement wait's reads every 0.2 s for
  `--wait` seconds (sync/contributions.py) and the round start's read. Stores per round: the heartbeat every
  `record_ttl / 3` s plus the announcement.
- what a request costs (hivemind.dht.node): every record of the run lives under one key, and every node a
  request visits that holds the key answers with all of its records. A read (`latest=True`) visits the
  `beam_size` nearest nodes it finds: 20 by default, READ_BEAM here. A store first visits the nodes nearest the
  key (beam 20 by default), each answering like a read, then stores on `num_replicas`; here it looks up an ID
  next to the key's (sync.hivemind_private.store_near: the same beam, answered with neighbours only). With
  `cache_nearest` 1 (hivemind's default) every read that found a fresher dictionary stores all of it on one more
  node, so over time every visited node holds the key: peer.simulate measured it (bench/README.md).

The rows are a model (the formula in `coordination_row`), checked against peer.simulate's measured DHT bytes at 8
and 16 peers (bench/results/coordination/NOTES.md). What it leaves out (routing upkeep, retries) only adds.
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
SHARD = 32  # sync.roster_shard of the sharded arm (2E for the paper-1b shape's 16 experts)


@dataclass(frozen=True)
class DhtParams:
    bucket_size: int
    num_replicas: int
    cache_nearest: int


@dataclass(frozen=True)
class Requests:
    """How many nodes a read and a store visit (each holding the key answers with every record), how many
    nodes a record is stored on, and whether the records' reader reads on the rounds' schedule."""

    name: str
    read_visits: int
    store_visits: int
    replicas: int
    scheduled_reads: bool = False
    store_lookup_answers_records: bool = True  # False: a store looks up a neighbouring ID (store_near)
    shard: int = 0         # sync.roster_shard (sync/roster.py); 0: every record under one key
    contributors: int = 0  # sync.contributors: the drawn key holds about 3C records while sharded
    packed_stores: bool = False  # a record's keys in one lookup, its routes kept (sync.hivemind_private.store_near)


def roster_records(peers: int, shard: int, contributors: int) -> tuple[float, float, int]:
    """(records in the shard a peer reads, records under the drawn key, levels a record is stored at) with every
    peer's estimate at N (sync/roster.py); a single key when `shard` is 0."""
    from sync.roster import read_level, sharded, write_levels
    if not shard or not sharded(peers, shard):
        return float(peers), 0.0, 1
    # Drawn for the next round (C) or below 2C / N for this one (2C), as sync.draw's thresholds are.
    drawn = min(peers, 3 * contributors) if contributors else peers
    return peers / 2 ** read_level(peers, shard), float(drawn), len(write_levels(peers, shard))


@dataclass(frozen=True)
class Schedule:
    interval_s: float     # wall time between two rounds' starts (H steps x step time)
    progress_poll_s: float
    wait_s: float         # the announcement wait's length
    wait_poll_s: float
    heartbeat_s: float
    lead_s: float = 0.0   # the reader reads every poll this long before a round's start (sync.schedule._reads_hot)
    idle_poll_s: float = 0.0  # and every idle_poll_s otherwise (scheduled builds)


def hivemind_dht_params() -> DhtParams:
    """hivemind's defaults for a DHT node (DHTNode.create)."""
    from hivemind.dht.node import DHTNode
    defaults = {name: p.default for name, p in inspect.signature(DHTNode.create).parameters.items()}
    return DhtParams(defaults["bucket_size"], defaults["num_replicas"], defaults["cache_nearest"])


def builds() -> tuple[Requests, Requests, Requests]:
    """(7466c65: hivemind's defaults; this build with one key (sync.roster_shard 0, the default): sync.dht's
    bounds; and with the roster in shards of SHARD and the drawn key, sync/roster.py)."""
    from sync.config import SyncConfig
    from sync.dht import NUM_REPLICAS, READ_BEAM
    dht, cfg = hivemind_dht_params(), SyncConfig()
    bounded = dict(scheduled_reads=True, store_lookup_answers_records=False, packed_stores=True)
    return (Requests("7466c65", dht.bucket_size, dht.bucket_size, dht.num_replicas),
            Requests("one key", READ_BEAM, dht.bucket_size, NUM_REPLICAS, **bounded),
            Requests(f"shards of {SHARD}", READ_BEAM, dht.bucket_size, NUM_REPLICAS, **bounded, shard=SHARD,
                     contributors=cfg.contributors))


def neighbours_bytes() -> int:
    """Bytes of the neighbour list in every find answer: `bucket_size` node and peer IDs (hivemind's protobuf)."""
    from hivemind.dht.routing import DHTID
    from hivemind.p2p import PeerID
    from hivemind.proto import dht_pb2

    peer = PeerID.from_base58("QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN")  # an RSA identity's ID
    k = hivemind_dht_params().bucket_size
    return dht_pb2.FindResult(type=dht_pb2.NOT_FOUND, nearest_node_ids=[DHTID.generate().to_bytes()] * k,
                              nearest_peer_ids=[peer.to_bytes()] * k).ByteSize()


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


def coordination_row(peers: int, record_bytes: int, neighbours: int, req: Requests, sched: Schedule,
                     bucket_size: int = 20, reads: float | None = None,
                     stores: float | None = None) -> dict[str, float]:
    """Per-peer, per-round coordination with `peers` peers (each runs one DHT node) under `req`'s request sizes;
    `reads` / `stores` per round: as measured (peer.simulate), else from `sched`."""
    # Lookup steps towards the key's nearest nodes (answering with neighbours only): none while the routing table
    # holds every node, then about one per halving of the distance.
    hops = max(0, math.ceil(math.log2(peers / bucket_size)))
    read_answers, store_answers = (min(peers - 1, n) for n in (req.read_visits, req.store_visits))
    replicas = min(peers - 1, req.replicas)
    round_reads = sched.wait_s / sched.wait_poll_s + 1  # the announcement wait's polls and the round start's read
    if reads is None:
        reads = round_reads
        if req.scheduled_reads:  # every poll from lead_s before the start to the wait's end, else every idle poll
            hot = min(sched.interval_s, sched.lead_s + sched.wait_s)
            reads += hot / sched.progress_poll_s + (sched.interval_s - hot) / sched.idle_poll_s
        else:
            reads += sched.interval_s / sched.progress_poll_s
    if stores is None:
        stores = sched.interval_s / sched.heartbeat_s + 1
    in_shard, drawn, levels = roster_records(peers, req.shard, req.contributors)
    # The rounds' reads read the drawn key too while sharded; the progress reader's the shard alone.
    drawn_reads = min(reads, round_reads) if drawn else 0.0
    read_records = reads * in_shard + drawn_reads * drawn
    # A record goes to its levels' shard keys, and to the drawn key for the fraction of peers drawn.
    store_keys = levels + (drawn / peers if drawn else 0)
    read_finds = (reads + drawn_reads) * (read_answers + hops)
    # Routes kept for a heartbeat's period (sync.hivemind_private.store_near): a lookup per heartbeat, not per store.
    lookups = min(stores, max(1.0, sched.interval_s / sched.heartbeat_s)) if req.packed_stores else stores
    if req.packed_stores and peers - 1 <= 2 * bucket_size:
        # One lookup for the record's keys, each request carrying them all (sync.hivemind_private.store_near,
        # while a node knows at most two beams of nodes): the union of their beams, a neighbour list per key in
        # every answer, and one store request per node nearest to any key.
        store_finds = lookups * (min(peers - 1, store_keys * store_answers) + hops)
        store_lists, store_requests = store_finds * store_keys, stores * min(peers - 1, store_keys * replicas)
    else:
        store_finds = store_lists = lookups * store_keys * (store_answers + hops)
        store_requests = stores * store_keys * replicas
    neighbour_list = neighbours * min(bucket_size, peers - 1) / bucket_size  # a node names the ones it knows
    lookup_records = store_answers * peers * record_bytes if req.store_lookup_answers_records else 0
    kb = (read_answers * read_records * record_bytes + stores * store_keys * (lookup_records + replicas * record_bytes)
          + (read_finds + store_lists) * neighbour_list) / 1000
    return {"peers": peers, "records_per_read": read_records / reads,
            "kb_per_read": read_answers * (in_shard + drawn) * record_bytes / 1000,
            "reads": reads, "kb": kb, "requests": read_finds + store_finds + store_requests,
            # Each node holding a key answers the requests that visit it with the whole set: a shard's its own
            # peers' reads, the drawn key's everyone's. The busier of the two.
            "served_kb": max((min(in_shard, peers - 1) if drawn else peers - 1) * in_shard * reads,
                             (peers - 1) * drawn * drawn_reads) * record_bytes / 1000
            + (peers - 1) * (stores * lookup_records / 1000 if lookup_records else 0)}


def floor_kb(peers: int, record_bytes: int, neighbours: int, contributors: int, bucket_size: int = 20) -> float:
    """The least a round can cost a peer over this DHT with these records, whatever the protocol on top: it must
    read the C drawn contributors' signed records (from one node) and store its own (on one node), each after a
    lookup whose every step is answered with a neighbour list (hivemind's find)."""
    hops = max(0, math.ceil(math.log2(peers / bucket_size)))
    neighbour_list = neighbours * min(bucket_size, peers - 1) / bucket_size
    return (contributors * record_bytes + record_bytes + 2 * (hops + 1) * neighbour_list) / 1000


def table(rows: Sequence[Sequence[dict[str, float]]], names: Sequence[str]) -> str:
    """One row per peer count: reads and records per read, then per build KB and requests per peer per round."""
    first, last = names[0], names[-1]
    return format_table(
        ["peers", f"reads per round ({last})", f"records per read, {' / '.join(names)}",
         *[f"KB/peer/round, {n}" for n in names], f"{first} ÷ {last}",
         f"DHT requests/peer/round, {' / '.join(names)}", f"KB a key holder serves per round ({last})",
         f"{last} ÷ goal (10 KB)"],
        [[r[-1]["peers"], f"{r[-1]['reads']:.0f}", " / ".join(f"{b['records_per_read']:,.0f}" for b in r),
          *[f"{b['kb']:,.0f}" for b in r], f"{r[0]['kb'] / r[-1]['kb']:,.0f}x",
          " / ".join(f"{b['requests']:,.0f}" for b in r), f"{r[-1]['served_kb']:,.0f}",
          f"{r[-1]['kb'] / GOAL_KB:,.1f}x"] for r in rows])


def main(argv: list[str] | None = None) -> int:
    from sync.config import SyncConfig

    defaults = SyncConfig()
    p = argparse.ArgumentParser(prog="python -m bench.coordination", description=__doc__.split("\n\n")[0])
    p.add_argument("--peers", type=int, nargs="+", default=[8, 16, 32, 64, 128, 1000])
    p.add_argument("--interval", type=float, default=float(defaults.every),
                   help="seconds between rounds (default: sync.every steps of 1 s)")
    p.add_argument("--wait", type=float, default=1.0, help="seconds the announcement wait polls per round")
    p.add_argument("--reads", type=float, help="record reads per peer per round, e.g. as peer.simulate measured")
    p.add_argument("--stores", type=float, help="record stores per peer per round, e.g. as peer.simulate measured")
    args = p.parse_args(argv)
    if min(args.peers) < 2 or args.interval <= 0 or args.wait < 0 or min(args.reads or 0, args.stores or 0) < 0:
        p.error("--peers >= 2, --interval > 0, --wait, --reads and --stores >= 0")
    setup_logging()
    poll = min(1.0, defaults.matchmaking_time / 4)  # as sync.rounds sets the reader up
    sched = Schedule(args.interval, poll, args.wait, 0.2, defaults.record_ttl / 3,
                     lead_s=defaults.matchmaking_time + 2 * poll, idle_poll_s=defaults.record_ttl / 3)
    record_bytes, neighbours, reqs = record_copy_bytes(), neighbours_bytes(), builds()
    old, new = reqs[0], reqs[-1]
    k = hivemind_dht_params().bucket_size
    rows = [[coordination_row(n, record_bytes, neighbours, req, sched, k, args.reads, args.stores) for req in reqs]
            for n in args.peers]
    sys.stdout.write(f"record copy {record_bytes} B, neighbour list {neighbours} B; a read visits {old.read_visits} / "
                     f"{new.read_visits} nodes, a store {old.store_visits} / {new.store_visits} and stores on "
                     f"{new.replicas} ({old.name} / this build); roster shards of {new.shard}, "
                     f"{new.contributors} contributors; round every {args.interval:g} s, progress poll "
                     f"{sched.progress_poll_s:g} s, announcement wait {args.wait:g} s"
                     + (f"; reads {args.reads:g} per round" if args.reads is not None else "")
                     + (f"; stores {args.stores:g} per round" if args.stores is not None else "") + "\n"
                     + table(rows, [r.name for r in reqs]) + "\n")
    c, top = defaults.contributors, max(args.peers)
    floor = floor_kb(top, record_bytes, neighbours, c, k)
    sys.stdout.write(f"floor at {top} peers (one read of C = {c} records and one store, each after a lookup): "
                     f"{floor:,.1f} KB per peer per round = {floor / GOAL_KB:.1f}x the goal; of it the records "
                     f"{(c + 1) * record_bytes / 1000:,.1f} KB\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
