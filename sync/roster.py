"""The run's roster in shards, and the drawn peers' key (docs/DESIGN.md, "A roster in shards"). Opt-in:
`sync.roster_shard` 0 (the default) keeps every record under one key.

A DHT read returns every record under a key, so one key for all peer records makes every read O(N). Instead
each peer reads one shard of about `shard` to 2 x `shard` records (`sync.roster_shard`, a run setting):

- level L splits the peers into 2^L shards by the first L bits of sha256(peer ID); key
  `{run_id}_peers` at level 0 (every peer: a swarm of fewer than `shard` peers is one shard, as before
  sharding), `{run_id}_peers_{L}_{prefix}` above it. A DHT node stores a record under a shard key only if the
  signer's peer ID falls in that shard (sync/records.py), so nobody floods a shard it does not belong to.
- A peer counts N from its own shard (itself + the other records x 2^L) and publishes that count (`est`); its
  estimate is the median of its own count and the counts of the drawn key's records. Shards differ in size, and
  the drawn peers are a sample of the whole swarm (by ticket), so the median puts every peer near one value (the
  draw's odds and acceptance assume views within 2x, sync/draw.py). Not the shard mates' counts: they are one
  view, and a shard whose members all counted few would keep itself at a level of its own. It places itself at
  x = log2(N / shard): it reads the level nearest x and stores its record at every level within 0.75 of x
  (write_levels: two or three). A reader therefore sees every writer of its shard whose estimate is within a
  factor 2^0.75 of its own; the price is two or three keys per store (one lookup for them all,
  sync.hivemind_private.store_near). Its count is the largest of its level's reads within the hold after a move
  (a read may miss records, never invent one). A joiner starts at level 0 and moves to where the records it
  reads say the swarm is (records carry their writer's level, `lvl`), at most MAX_LEVEL + 1 reads.
- Contributions come from C drawn peers anywhere (sync/draw.py), so while the swarm is sharded a peer also
  stores its record under `{run_id}_drawn` when it is drawn for its next round (or the one it is due for), or
  may be drawn for its current one in another's view (ticket below 2C / N): every peer reads that key too (about
  3C records), waits for an outside peer there whose record is of the previous round (it said it is drawn for
  this one) until it reaches this round, contributing or not, and so aggregates what one roster would show.

Coverage, ownership and N are judged from the shard (a sample of the swarm: each shard keeps every expert
covered on its own, so the swarm does too; hence a shard is at least 2E records whatever `sync.roster_shard`
says: peers owning one expert each can still give each of E experts two owners in it); the round's
contributions from the shard plus the drawn key.
"""
from __future__ import annotations

import hashlib
import math
import threading
import time
from functools import lru_cache
from typing import Any

from hivemind.utils import get_dht_time
from hivemind.p2p import PeerID

MAX_LEVEL = 10  # 1,024 shards: far more than a swarm of MAX_RUN_RECORDS peers per node needs
MAX_ESTIMATE = 2**31  # the most peers a record may say it counted


def peers_key(run_id: str) -> str:
    return f"{run_id}_peers"


def drawn_key(run_id: str) -> str:
    return f"{run_id}_drawn"


def shard_key(run_id: str, level: int, prefix: int) -> str:
    return peers_key(run_id) if level == 0 else f"{run_id}_peers_{level}_{prefix}"


@lru_cache(maxsize=65536)
def shard_prefix(peer_id: str, level: int) -> int:
    """The shard of `peer_id` at `level`: the first `level` bits of sha256(peer ID)."""
    if level == 0:
        return 0
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:4], "big") >> (32 - level)


def position(estimate: float, shard: int) -> float:
    """x = log2(N / shard): where a peer with estimate N places itself (below 0: one shard)."""
    return math.log2(max(estimate, 1.0) / shard)


def read_level(estimate: float, shard: int) -> int:
    """The level a peer reads: the one nearest its x (halves round up), within [0, MAX_LEVEL]."""
    return min(MAX_LEVEL, max(0, math.floor(position(estimate, shard) + 0.5)))


def write_levels(estimate: float, shard: int) -> list[int]:
    """The levels a peer stores its record at, within [0, MAX_LEVEL]: every level within 0.75 of its x (two or
    three). A reader whose x is within 0.75 of the writer's (estimates within 2^0.75 = 1.7x) reads one of them.
    Narrower (one level near an integer x) let a swarm split across two levels keep itself split: each half
    counted only itself (tests/test_roster.py's swarm model oscillated with period 3)."""
    x = position(estimate, shard)
    if x <= -0.25:
        return [0]
    clamp = lambda level: min(MAX_LEVEL, max(0, level))
    return sorted({clamp(math.floor(x - 0.25)), clamp(round(x)), clamp(math.ceil(x + 0.25))})


def sharded(estimate: float, shard: int) -> bool:
    """Whether a peer with this estimate may read, or be read, above level 0 (then the drawn key is used)."""
    return write_levels(estimate, shard)[-1] > 0


def roster_key_names(run_id: str) -> dict[str, tuple[int, int]]:
    """Every shard key of the run -> (level, prefix): what a DHT node accepts peer records under."""
    return {shard_key(run_id, level, prefix): (level, prefix)
            for level in range(MAX_LEVEL + 1) for prefix in range(2 ** level)}


def next_level(level: int, estimate: float, members: int, shard: int, drawn_levels: list[int]) -> tuple[int, bool]:
    """(the level to read next, whether it is a joiner's jump) for a peer at `level` with this `estimate` whose
    read there found `members` live records in its shard (itself included), and `drawn_levels`: the levels the
    drawn key's records were written from. A shard read near empty says little (a joiner of a sharded swarm finds
    nobody at level 0): then the drawn peers' median level, if higher, is where the swarm is."""
    target = read_level(estimate, shard)
    if 2 * members < shard and drawn_levels:
        median = sorted(drawn_levels)[len(drawn_levels) // 2]
        if median > max(level, target):
            return median, True
    return target, False


PROBE_EVERY = 16  # an unsharded peer reads the drawn key every this many reads (a swarm that outgrew its view)


class Roster:
    """One peer's place in the sharded roster: its estimate of N, the level it reads, the keys it stores at.
    Thread-safe (the progress reader and the round thread both read the records)."""

    def __init__(self, run_id: str, peer_id: str, shard: int, settle: float = 11.0):
        if shard < 0:
            raise ValueError(f"sync.roster_shard must be >= 0, got {shard}")
        self.run_id, self.peer_id, self.shard = run_id, peer_id, shard
        # Seconds a level is kept after a move (the others' records reach a new level with their next refresh,
        # within record_ttl / 3): reads there meanwhile may raise the estimate, never lower it. Without it a swarm
        # that starts at once flaps between levels (each peer, first at the new level, finds it empty).
        self.settle = settle
        self.count = 1  # N as this peer's last shard read counted it (records x 2^level), published as `est`
        self.estimate = 1.0  # the median of its count and the counts it read
        self.level = 0
        self.reads = 0
        self._hold_until = -math.inf
        self._counts: list[tuple[float, int]] = []  # (monotonic time, count) of this level's recent reads
        self._lock = threading.Lock()

    @property
    def scale(self) -> int:
        """How many peers one record of this peer's shard stands for."""
        return 2 ** self.level

    def read_key(self) -> tuple[int, str]:
        with self._lock:
            level = self.level
        return level, shard_key(self.run_id, level, shard_prefix(self.peer_id, level))

    def sharded(self) -> bool:
        return bool(self.shard) and sharded(self.estimate, self.shard)

    def probes(self, others: int) -> bool:
        """Whether an unsharded read that found `others` other live records also reads the drawn key: when it
        found nobody (a joiner of a sharded swarm finds nobody at level 0) and every PROBE_EVERY reads. Never
        with sharding off (shard 0: one key, nobody writes the drawn key)."""
        return bool(self.shard) and (others == 0 or (self.reads + 1) % PROBE_EVERY == 0)

    def store_keys(self, drawn: bool) -> list[str]:
        """Where this peer's record goes: its shard at every level of write_levels, and the drawn key while it is
        drawn (`drawn`) and the swarm may be sharded for some reader; the one key with sharding off."""
        if not self.shard:
            return [peers_key(self.run_id)]
        with self._lock:
            estimate = self.estimate
        keys = [shard_key(self.run_id, level, shard_prefix(self.peer_id, level))
                for level in write_levels(estimate, self.shard)]
        return keys + [drawn_key(self.run_id)] if drawn and sharded(estimate, self.shard) else keys

    def update(self, level: int, members: int, counts: list[int] | None, drawn_levels: list[int],
               visited: set[int], now: float | None = None) -> bool:
        """Take a read at `level` that found `members` live records in this peer's shard (itself included) and
        the drawn records' published `counts` (est; None: the drawn key was not read): update the estimate, and
        move to the level it points to. True: moved to a level not read yet in this pass (read again there)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self.reads += 1
            visited.add(level)
            if level != self.level:
                return False  # another thread moved meanwhile: this read is of a level left
            if not self.shard:  # sharding off: one key, every record in it
                self.count = max(1, members)
                self.estimate = float(self.count)
                return False
            # Itself plus the others scaled: a peer always finds itself in its shard, so members x 2^L would
            # count it 2^L times.
            # A read may miss records (a node that answered late, a store still on its way) but never invents
            # one, so the count is the largest of this level's reads within `settle` seconds (no peer.simulate row
            # shows it paying at 32 peers; without it test_simulate's 16 sharded peers split once under load).
            self._counts = [(t, c) for t, c in self._counts if t > now - self.settle] + [
                (now, 1 + max(0, members - 1) * 2 ** level)]
            self.count = max(c for _, c in self._counts)
            if counts is None and sharded(self.estimate, self.shard):
                return False  # a shard alone is one view: the estimate waits for the drawn peers' counts
            if now >= self._hold_until or self.count > self.estimate:
                # Right after a move the new level fills as the others' records arrive: meanwhile its counts
                # may only raise the estimate (a swarm starting at once would flap between levels).
                self.estimate = float(median([self.count, *(counts or [])]))
            target, jump = next_level(level, self.estimate, members, self.shard, drawn_levels)
            if target == level or (now < self._hold_until and not jump):
                return False  # a move the estimate asks for waits for the hold to end (a joiner's jump does not)
            self.level, self._hold_until, self._counts = target, now + self.settle, []
            return target not in visited


def median(values: list[int]) -> float:
    ordered = sorted(values)
    return float(ordered[len(ordered) // 2])


def parse_drawn(found: Any, cache: dict[str, tuple[float, Any]], me: str, num_experts: int, revoked: set[str],
                ) -> tuple[dict[str, Any], dict[str, tuple[float, Any]]]:
    """The live records of a read of the drawn key (not this peer's own), marked `outside`, and the parse cache
    for the next read ({subkey: (expiration, record or None)}: unchanged records are not parsed again)."""
    from sync.peer_record import PeerRecord

    records: dict[str, PeerRecord] = {}
    parsed: dict[str, tuple[float, PeerRecord | None]] = {}
    if found is None or not isinstance(found.value, dict):
        return records, parsed
    now = get_dht_time()
    for subkey, item in found.value.items():
        expiration = getattr(item, "expiration_time", 0)
        if not isinstance(subkey, str) or expiration < now or subkey in revoked or subkey == me:
            continue
        record = parse_cached(subkey, item, cache, num_experts)
        if record is not None:
            record.outside = True
        parsed[subkey] = (expiration, record)
        if record is not None and record.experts and not record.finished:
            records[subkey] = record
    return records, parsed


def parse_cached(subkey: str, item: Any, cache: dict[str, tuple[float, Any]], num_experts: int) -> Any:
    """The record of one DHT entry (None: malformed), from `cache` when the same subkey had the same expiration
    in the last read (a record changes every ttl / 3: a read of many costs a lookup each, not a parse)."""
    from sync.peer_record import PeerRecord

    hit = cache.get(subkey)
    if hit is not None and hit[0] == getattr(item, "expiration_time", 0):
        return hit[1]
    return PeerRecord.from_value(subkey, getattr(item, "value", None), num_experts) if is_peer_id(subkey) else None


def is_peer_id(text: str) -> bool:
    try:
        return len(text) < 100 and bool(PeerID.from_base58(text))
    except Exception:  # any peer can write any subkey: a garbage one is skipped, not trusted
        return False
