"""The gather of a contribution round (docs/DESIGN.md, "Rounds as contributions"), for sync/contributions.py.

Waiting for the round's announcements (for the drawn peers only, sync/draw.py), striking peers that fail to
contribute (not waited for nor asked for a while: sync.aggregate.rounds_to_skip), and fetching the announced
blobs within a deadline from their sizes and the measured download rate.
"""
from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING

from hivemind.utils import get_dht_time
from hivemind.utils.logging import get_logger

from sync.aggregate import Announcement, contributors, fetch_deadline, rounds_to_skip
from sync.sparse import encoded_size

if TYPE_CHECKING:
    from sync.peer_record import PeerRecord
    from sync.report import RoundReport

logger = get_logger(__name__)

# Where an unmeasured download rate starts: a 20 Mbit/s home line (bytes per second).
DEFAULT_RATE = 20e6 / 8
# The shortest wait for blobs once announced: a request's round trip and a small blob's stream.
MIN_FETCH_SECONDS = 2.0
# How many sources a blob is asked from: its origin, then peers that may hold it already.
SOURCES_PER_BLOB = 3


class Gathering:
    """Mixin of SparseSync (sync/contributions.py): the round's waits, strikes and fetches. Uses `swarm`, `cfg`,
    `round_id`, `contrib_exchange`, `rejects`, `_spec`, `_misses`, `_skip_until`, `_delivered_ever`,
    `_silent_behind`, `_chances`, `_source_log`, `_download_rate`, `_leaving` and the draw (sync/draw.py)."""

    def _await_announcements(self, report: "RoundReport") -> tuple[dict[str, "PeerRecord"], dict[str, Announcement]]:
        """Read the records until every live peer that may be drawn (sync/draw.py) announced this round or reached
        it without a contribution, at most matchmaking_time, or longer for a peer whose record says when it expects
        to be ready for this round (`due`, sync.schedule): until then plus matchmaking_time, within round_timeout. A
        slower honest peer's contribution so counts in the round it trained for; nobody waits beyond that, and a
        peer that promised to be ready and was not, or stays behind and silent, is struck
        (sync.aggregate.rounds_to_skip)."""
        start = time.monotonic()
        base = start + self.cfg.matchmaking_time
        while True:
            records = self.swarm.peers()
            others = self._others(records)
            announced = contributors({p: r.announcement(self.round_id) for p, r in others.items()}, self.round_id)
            announced = {p: a for p, a in announced.items() if not self._skipped(p) and self._may_be_drawn(p)}
            # A peer that never delivered a contribution and missed once (a record with nothing behind it) is
            # not waited for again: it costs one wait, not one every few rounds. Nor is a record that never
            # announced any although it was surely drawn in an earlier round since first read here (ghost
            # identities claiming experts, sync/draw.py count_chances): an honest joiner announces its first in
            # the first round it is drawn in, and what it announces in time still counts.
            # Waited for: a peer that may be drawn (sync/draw.py) and whose record has not reached this round; one
            # at this round without a contribution to it was not drawn (or just joined, or re-downloaded).
            # A peer outside this peer's roster shard is known only by its record under the drawn key
            # (sync/roster.py), stored there from the round before the one it is drawn for: waited for when that
            # record is of the previous round or says it will be ready for this one (`due`).
            waiting = {p: r for p, r in others.items() if p not in announced and r.round < self.round_id
                       and self._may_be_drawn(p) and not self._skipped(p)
                       and (not r.outside or r.round == self.round_id - 1 or (r.due and r.due[0] == self.round_id))
                       and not (self._misses.get(p) and p not in self._delivered_ever)
                       and not (not r.contrib and self._chances.get(p, 0) > 0)}
            now, dht_now = time.monotonic(), get_dht_time()
            until = base
            for r in waiting.values():
                if r.due and r.due[0] == self.round_id:
                    until = max(until, now + (float(r.due[1]) - dht_now) + self.cfg.matchmaking_time)
            until = min(until, start + self.cfg.round_timeout)
            if not waiting or now >= until or self._leaving:
                for peer_id, r in waiting.items():
                    # Promised to be ready for this round (`due`) and was not: struck. One behind without a
                    # promise may still be training; behind and silent in the previous round too, with a record
                    # that did not move on or a peer that never delivered, it is struck as well (a record with
                    # nothing behind it costs one wait, not one per round).
                    last = self._silent_behind.get(peer_id)
                    stuck = last is not None and last[0] == self.round_id - 1 and (
                        last[1] == r.round or peer_id not in self._delivered_ever)
                    if (r.due and r.due[0] == self.round_id) or stuck:
                        self._missed(peer_id, "announced no contribution in time")
                    else:
                        self._silent_behind[peer_id] = (self.round_id, r.round)
                return records, announced
            time.sleep(0.2)

    def _skipped(self, peer_id: str) -> bool:
        return self._skip_until.get(peer_id, 0) > self.round_id

    def _missed(self, peer_id: str, why: str) -> None:
        strikes = self._misses[peer_id] = self._misses.get(peer_id, 0) + 1
        skip = rounds_to_skip(strikes)
        self._skip_until[peer_id] = self.round_id + 1 + skip
        if self._source_log.allow(peer_id):
            logger.info(f"peer ...{peer_id[-6:]} {why} in round {self.round_id}: not waited for in the next "
                        f"{skip} round(s)")

    def _delivered(self, peer_id: str) -> None:
        self._delivered_ever.add(peer_id)
        self._silent_behind.pop(peer_id, None)
        self._misses.pop(peer_id, None)
        self._skip_until.pop(peer_id, None)

    def _fetch_blobs(self, announced: dict[str, Announcement], ends: float) -> dict[str, bytes]:
        if not announced:
            return {}
        requests = []
        for origin, ann in list(announced.items()):
            expected = encoded_size(self._expected_shapes(ann.experts), self._spec)
            if ann.size != expected:  # the run's codec fixes every blob's size: nothing else is fetched
                self.rejects.add("size")
                self._missed(origin, f"announced a {ann.size}-byte contribution (the run's codec gives {expected})")
                del announced[origin]
                continue
            holders = [p for p in announced if p != origin]
            random.shuffle(holders)
            requests.append(([origin] + holders[:SOURCES_PER_BLOB - 1], origin, ann.round, ann.size, ann.digest))
        if not requests:
            return {}
        total = sum(a.size for a in announced.values())
        wait = fetch_deadline(total, self._download_rate or DEFAULT_RATE, MIN_FETCH_SECONDS, self.cfg.round_timeout)
        started = time.monotonic()
        deadline = min(started + wait, max(ends, started + MIN_FETCH_SECONDS))
        results = self.contrib_exchange.fetch_many(requests, deadline=deadline)
        missing = lambda r: not isinstance(r, (bytes, bytearray)) and "digest" not in str(r)
        late = [r for r in requests if missing(results[r[1]])]
        # Most blobs not in by the deadline: this peer's own link or CPU is the likelier cause (a joiner's first
        # connections, a busy machine), and aggregating without them makes it diverge for sure (a repair next
        # round): those are asked again until the round's end. Peers serving garbage are never asked again.
        if late and 2 * len(late) > len(requests) and time.monotonic() < ends:
            results.update(self.contrib_exchange.fetch_many(late, deadline=ends))
        blobs = {p: r for p, r in results.items() if isinstance(r, (bytes, bytearray))}
        failed = {p: r for p, r in results.items() if p not in blobs}
        for origin, result in failed.items():
            self.rejects.add("missing" if missing(result) else "digest")
            # Struck (not waited for next round) for garbage, or for silence while most others delivered; not
            # for a failure that was most likely this peer's own.
            if not missing(result) or 2 * len(failed) <= len(results):
                self._missed(origin, f"served no valid contribution ({result})")
        got = sum(len(b) for b in blobs.values())
        if got and blobs:
            self._download_rate = got / max(time.monotonic() - started, 1e-3)
        return blobs
