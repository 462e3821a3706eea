"""Where the swarm's rounds are, read in the background: lets a slower peer join the swarm's round on time.

Rounds are counted in local steps (`sync.every`), so a peer 3x slower than the others reaches its round boundary
long after them; the fast peers would then aggregate without its contribution (or wait for it). A
`SwarmProgress` thread re-reads the live peer records every `poll` seconds; `SparseSync.round_due` starts a round
early when the lower median of the other peers' published rounds is already past this peer's (they started a
later round: they published it at its start). The peer then enters that round with the tokens it did train, and
its contribution's weight is those tokens (docs/DESIGN.md, "Heterogeneous peers").

The median, not the max: one peer publishing a huge round cannot make the others start rounds every step
(records are signed and bounded, sync.records, and a lone liar cannot move the median, sync.swarm.median_round).

Every read carries every record (docs/DESIGN.md, "DHT records"), so the reader reads on the rounds' schedule
(`reads_hot`): every `poll` seconds near and during a round, while another peer is ahead or due soon, and when
woken (a leaving peer's poke, sync.leave); otherwise every `idle_poll` seconds.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Iterable

from hivemind.utils.logging import get_logger

from sync.swarm import PeerRecord, Swarm

logger = get_logger(__name__)


PARTIAL_READS_KEPT = 2  # (see SwarmProgress._loop)


def reads_hot(now: float, round_id: int, boundary_at: float | None, others: Iterable[PeerRecord], lead: float,
              in_round: bool) -> bool:
    """Whether the records must be read every poll now (DHT time `now`): while a round runs, within `lead`
    seconds of this peer's next round boundary (`boundary_at`; None: not estimated yet), and while another peer
    is past this peer's round (it may have to follow, sync.schedule.round_due) or due within `lead` for a round
    after it (start together). Otherwise nothing a read could show is acted on before the next idle read."""
    if in_round or boundary_at is None or boundary_at - now < lead:
        return True
    for r in others:
        if r.round > round_id or (r.due and r.due[0] > round_id and float(r.due[1]) - now < lead):
            return True
    return False


class SwarmProgress:
    """Background reader of the run's peer records (one thread; every read bounded by the DHT's own timeouts)."""

    def __init__(self, swarm: Swarm, poll: float = 1.0, idle_poll: float | None = None):
        self.swarm, self.poll = swarm, poll
        self.idle_poll = poll if idle_poll is None else max(poll, idle_poll)
        # Set by the rounds (sync.rounds): True while reads are needed every poll (reads_hot); None: always.
        self.hot: Callable[[], bool] | None = None
        self._wake = threading.Event()
        self._woken_at = 0.0
        self.reads = 0  # reads this thread made (tests, peer.simulate)
        self._own_read_at = -float("inf")  # monotonic time of this thread's last read
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

    def wake(self) -> None:
        """Read at once (a leaving peer's poke, sync.leave): at most once per poll, whoever asks."""
        now = time.monotonic()
        if now - self._woken_at >= self.poll:
            self._woken_at = now
            self._wake.set()

    def read_due(self, now: float) -> bool:
        """Whether this loop iteration reads (monotonic `now`; module docstring)."""
        age = now - self._own_read_at
        if self._wake.is_set():
            self._wake.clear()
            return True
        if age < self.poll:
            return False
        try:
            hot = self.hot is None or self.hot()
        except Exception as e:  # a half-built round state: read, as without a schedule
            logger.debug(f"reads_hot failed: {e!r}")
            hot = True
        return hot or age >= self.idle_poll

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                # Checked here too (not only in the heartbeat, every ttl/3): a peer whose link came back re-joins
                # within a poll, so its very next round finds the others.
                rejoined = self.swarm.rejoin_if_cut_off()
                if not (rejoined or self.read_due(time.monotonic())):
                    self._wake.wait(self.poll)
                    continue
                self.reads += 1
                self._own_read_at = time.monotonic()
                # Its roster shard alone (sync/roster.py): the drawn peers' key is read by the rounds, which
                # need it; what this view serves (rounds ahead, due times) a shard shows as well.
                records = self.swarm.peers(drawn=False)
                self.offer(records)
                me = self.swarm.peer_id
                if me in records:  # a read lacking this peer's own record tells nothing
                    alone = not any(p != self.swarm.peer_id for p in records)
                    self._reads_without_others = self._reads_without_others + 1 if alone else 0
                    if self.on_read is not None:
                        self.on_read(records)
            except Exception as e:  # a DHT that is restarting or partitioned: keep the last view, try again
                logger.debug(f"reading peer records failed: {e!r}")
            self._wake.wait(self.poll)

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

    def peer_count(self) -> int | None:
        """Live peers in the view, this one included (the roster's estimate once sharded: a view is one shard,
        sync/roster.py); None while the reader does not run or its last read is older than an idle poll plus a few
        seconds."""
        if self._thread is None or time.monotonic() - self._read_at > self.idle_poll + 5:
            return None
        roster = getattr(self.swarm, "roster", None)
        if roster is not None and roster.level > 0:
            return round(roster.estimate)
        return len(set(self._records) | {self.swarm.peer_id})

    def nobody_else(self, reads: int, max_age: float) -> bool:
        """The last `reads` complete reads in a row (the latest within `max_age` seconds) showed no other peer
        that joins all-reduce groups. One read is not enough: a DHT read can come back with this peer's own
        record alone (from its local storage) while the others are still there (test_closed_run: the first
        peer to finish gave up its last round's group, and the other then averaged that round alone)."""
        fresh = self._thread is not None and time.monotonic() - self._read_at <= max_age
        return fresh and self._reads_without_others >= reads

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
