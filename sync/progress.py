"""Where the swarm's rounds are, read in the background: lets a slower peer join the swarm's round on time.

Rounds are counted in local steps (`sync.every`), so a peer 3x slower than the others reaches its round boundary
long after them; the fast peers would then aggregate without its contribution (or wait for it). A
`SwarmProgress` thread re-reads the live peer records every `poll` seconds; `SparseSync.round_due` starts a round
early when the lower median of the other peers' published rounds is already past this peer's (they started a
later round: they published it at its start). The peer then enters that round with the tokens it did train, and
its contribution's weight is those tokens (docs/DESIGN.md, "Heterogeneous peers").

The median, not the max: one peer publishing a huge round cannot make the others start rounds every step
(records are signed and bounded, sync.records, and a lone liar cannot move the median, sync.swarm.median_round).
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from hivemind.utils.logging import get_logger

from sync.swarm import PeerRecord, Swarm

logger = get_logger(__name__)


PARTIAL_READS_KEPT = 2  # (see SwarmProgress._loop)


class SwarmProgress:
    """Background reader of the run's peer records (one thread; every read bounded by the DHT's own timeouts)."""

    def __init__(self, swarm: Swarm, poll: float = 1.0):
        self.swarm, self.poll = swarm, poll
        self._records: dict[str, PeerRecord] = {}
        self._read_at = 0.0
        self._reads_without_others = 0  # consecutive complete reads showing no other group-joining peer
        self._partial_kept = 0  # consecutive reads of this peer's record alone that kept the last view's others
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Called with every complete read (this thread): sync.leave watches for leaving peers' tombstones.
        self.on_read: Callable[[dict[str, PeerRecord]], None] | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="spes-progress", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                # Checked here too (not only in the heartbeat, every ttl/3): a peer whose link came back re-joins
                # within a poll, so its very next round finds the others.
                self.swarm.rejoin_if_cut_off()
                records = self.swarm.peers()
                self.offer(records)
                me = self.swarm.peer_id
                if me in records:  # a read lacking this peer's own record tells nothing
                    alone = not any(p != self.swarm.peer_id for p in records)
                    self._reads_without_others = self._reads_without_others + 1 if alone else 0
                    if self.on_read is not None:
                        self.on_read(records)
            except Exception as e:  # a DHT that is restarting or partitioned: keep the last view, try again
                logger.debug(f"reading peer records failed: {e!r}")
            self._stop.wait(self.poll)

    def offer(self, records: dict[str, PeerRecord]) -> None:
        """Take a complete read of the records as the current view: this thread's own, or one the rounds made
        (a round's start and end read them anyway, and the reader's first read may have come before any record
        was stored: a look-ahead right after a peer's first round then found no view, tests/test_schedule.py)."""
        me = self.swarm.peer_id
        if not records:
            # No record at all, not even this peer's own (stored at join): the read tells nothing and the last
            # view is kept (it ages out by others' max_age). (A read with others but without this peer's own
            # record, as a new peer's reads are for seconds after it stored its record, does count.)
            return
        if set(records) == {me} and len(self._records) > 1 and self._partial_kept < PARTIAL_READS_KEPT:
            # Its own record alone, right after a read that showed others: most likely partial (the local
            # storage), not all of them gone at once (seen twice in one run of tests/test_schedule.py). Their last
            # records are kept for up to PARTIAL_READS_KEPT such reads.
            self._partial_kept += 1
            self._records, self._read_at = {**self._records, me: records[me]}, time.monotonic()
        else:
            self._partial_kept = 0
            self._records, self._read_at = dict(records), time.monotonic()

    def others(self, max_age: float | None = None) -> dict[str, PeerRecord]:
        """The other live peers' records as last read (empty if the last read is older than `max_age`)."""
        if max_age is not None and time.monotonic() - self._read_at > max_age:
            return {}
        return {p: r for p, r in self._records.items() if p != self.swarm.peer_id}

    def nobody_else(self, reads: int, max_age: float) -> bool:
        """The last `reads` complete reads in a row (the latest within `max_age` seconds) showed no other peer
        that joins all-reduce groups. One read is not enough: a DHT read can come back with this peer's own
        record alone (from its local storage) while the others are still there (test_closed_run: the first
        peer to finish gave up its last round's group, and the other then averaged that round alone)."""
        fresh = self._thread is not None and time.monotonic() - self._read_at <= max_age
        return fresh and self._reads_without_others >= reads

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
