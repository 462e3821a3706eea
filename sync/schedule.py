"""When a peer starts its next round (docs/DESIGN.md, "Starting a round together").

Rounds are counted in local steps (`sync.every`), so the peers of a run reach a round's boundary at different
wall-clock times: one finished its previous round later, or trains slower on a shared machine. The first to
arrive then waits, blocked, for the last one's announcement (bench.wan: 0.4-1 s of a 5.6 s round, measured on
the old all-reduce's matchmaking). Instead:

- every peer publishes in its DHT record when it expects to be ready for its next round (`due`: [round, DHT
  time], from its own median step time), from a background thread, again when the estimate moves by more than a
  step;
- a peer that reached `every` steps keeps training while another live peer is due later for the same round,
  within every/2 extra steps; it starts at the step boundary nearest the latest such due time, so the round's
  contributions are announced together and the waiting became training (its contribution's weight is the
  tokens it trained, capped as always);
- a peer that already started the round (its record says so) is joined at once; a due time beyond the extra
  steps is not waited for: that peer is much slower and joins the swarm's round early instead (`round_due`'s
  other branch, sync/progress.py).

A lying `due` costs at most the every/2 extra steps per round (then the round starts regardless), and only
records of the run's signed schema are read (sync/records.py).

`Scheduling` is a mixin of `SparseSync` (sync/rounds.py): `round_due` and this start-together hold.
"""
from __future__ import annotations

import collections
import statistics
import threading
import time

from hivemind.utils import get_dht_time
from hivemind.utils.logging import get_logger

from sync.peer_record import proven_round
from sync.progress import reads_hot

logger = get_logger(__name__)

STEP_SAMPLES = 16  # step intervals the median step time is taken over (a round's long interval is an outlier)


class DuePublisher:
    """Stores this peer's `due` estimate in its record from a daemon thread (a DHT store must never block the
    training loop), when the round changes or the time moves by more than the tolerance; at most every
    `min_interval` seconds."""

    def __init__(self, swarm, min_interval: float = 0.5):
        self.swarm, self.min_interval = swarm, min_interval
        self._lock = threading.Lock()
        self._wanted: tuple[int, float, float] | None = None  # round, DHT time, tolerance
        self._published: tuple[int, float] | None = None
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None

    def set(self, round_id: int, due: float, tolerance: float) -> None:
        with self._lock:
            self._wanted = (round_id, due, tolerance)
            if self._stale():
                self._wake.set()
        if self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self._loop, name="spes-due", daemon=True)
            self._thread.start()

    def _stale(self) -> bool:
        if self._wanted is None:
            return False
        round_id, due, tolerance = self._wanted
        return self._published is None or self._published[0] != round_id or abs(self._published[1] - due) > tolerance

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(timeout=1.0)
            self._wake.clear()
            with self._lock:
                wanted = self._wanted if self._stale() else None
            if wanted is None or self._stop.is_set():
                continue
            try:
                self.swarm.publish(due=[wanted[0], wanted[1]])
                with self._lock:
                    self._published = wanted[:2]
            except Exception as e:  # a DHT restarting or cut off: the next change (or the heartbeat) stores it
                logger.debug(f"storing the due estimate failed: {e!r}")
            self._stop.wait(self.min_interval)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


class Scheduling:
    """When to start the next round (mixin of SparseSync: uses its cfg, progress, round_id, _pending)."""

    def _init_scheduling(self) -> None:
        self._step_intervals: collections.deque[float] = collections.deque(maxlen=STEP_SAMPLES)
        self._last_step_at: float | None = None
        self._ready_at: tuple[int, float] | None = None  # (round, DHT time) it first was ready for that round
        self._holding = False  # this due round is held for a later peer (counted once per round)
        self.round_shift = 0  # steps the round that round_due just started was held (sync.start_together)
        self._steps_left: int | None = None  # steps the run had left before the last note_step's (None: no end)
        self.held_rounds = 0
        self.held_steps = 0
        self._due_publisher = DuePublisher(self.swarm)
        self._boundary_at: float | None = None  # DHT time this peer expects to reach its next round boundary

    def _reads_hot(self) -> bool:
        """(Progress reader thread.) Whether the records are read every poll now (sync.progress.reads_hot): within
        matchmaking_time + 2 polls of a round's start."""
        lead = self.cfg.matchmaking_time + 2 * self.progress.poll
        return reads_hot(get_dht_time(), self.round_id, self._boundary_at, self.progress.others().values(), lead,
                         in_round=self._pending is not None or self._leaving)

    def step_time(self) -> float | None:
        """Median seconds per local step over the last steps, None before there are a few."""
        if len(self._step_intervals) < 3:
            return None
        return statistics.median(self._step_intervals)

    def note_step(self, steps_since_round: int, steps_left: int | None = None) -> None:
        """After every step (training thread), once this step's round is started or finished: measure the step
        time and publish when this peer expects to be ready for its next round (sync.schedule). `steps_left`:
        steps this peer still trains (None: no end known)."""
        now = time.monotonic()
        self._steps_left = steps_left
        if self._last_step_at is not None:
            self._step_intervals.append(now - self._last_step_at)
        self._last_step_at = now
        step_time = self.step_time()
        if step_time is not None:
            self._boundary_at = get_dht_time() + max(0, self.cfg.every - steps_since_round) * step_time
        if not self.cfg.start_together or step_time is None or self._leaving:
            return
        target = self.round_id + 1
        if steps_since_round >= self.cfg.every:
            if self._ready_at is None or self._ready_at[0] != target:
                self._ready_at = (target, get_dht_time())
            due = self._ready_at[1]  # ready since then: not moved on while it holds
        else:
            due = get_dht_time() + (self.cfg.every - steps_since_round) * step_time
        self._due_publisher.set(target, due, tolerance=max(0.2, step_time))

    def _latest_due(self, others: dict, steps_since_round: int, step_time: float, now: float) -> float | None:
        """The latest time another live peer expects to be ready for this peer's next round, among those within
        the extra steps; `now` if one of them started it already; None if no such estimate."""
        target = self.round_id + 1
        horizon = now + (self.cfg.every + self._extra_steps() - steps_since_round) * step_time
        latest = None
        for record in others.values():
            if record.round >= target:
                return now  # it started the round already and waits for the others' contributions: join it now
            if record.due and record.due[0] == target and record.due[1] <= horizon:
                latest = record.due[1] if latest is None else max(latest, record.due[1])
        return latest

    def round_due(self, steps_since_round: int) -> bool:
        """Start a round now? After `sync.every` local steps (unless held, below), or earlier (but
        after at least every/10 steps, and after training at least as long as its last round took) when the
        other peers' median round is already past this peer's: it is slower than them, and joins the round they
        are in with the tokens it trained (sync.progress)."""
        # (Not at the run's last step: nothing is left to train while waiting, and a round held
        # there never started: a 20-step run's peer ended without its second round while the other peer's
        # looked for it, bench.convergence's smoke run in a CI simulation.)
        last_step = self._steps_left is not None and self._steps_left <= 1
        if steps_since_round >= self.cfg.every:
            if not last_step and self._hold(steps_since_round):
                return False
            # Steps held for a later peer are borrowed from the next interval (the caller counts the next round
            # from `round_shift` steps back): the peers' rounds stay on the same steps. Counted from the held
            # start instead, a 20-step run with every=10 held its first round one step and ended at step 20 with
            # no second round (bench.convergence's smoke run, a CI simulation).
            self.round_shift = steps_since_round - self.cfg.every if self._holding else 0
            self._holding = False
            return True
        if not self.cfg.follow_swarm or self._leaving or steps_since_round < max(1, self.cfg.every // 10):
            return False
        if self._pending is not None and not self._pending.future.done():
            # Its previous round still runs: an early start would block on it.
            return False
        if time.monotonic() - self._last_applied_at < self._last_transfer_seconds:
            # Its rounds are link-bound (a slow uplink: the last one's transfers took longer than it has trained
            # since): joining earlier would only make it sync after every step. It keeps the every-H pace. The
            # transfers, not the whole round: a CPU-slow peer's round is mostly its wait for announcements.
            return False
        # The swarm's round by deeds (proven_round): a ghost's round cannot make this one start early.
        recent = self.progress.others(max_age=5 * self.progress.poll + 5)
        swarm_round = proven_round(recent, self._delivered_ever)
        self.round_shift = 0
        return swarm_round is not None and swarm_round > self.round_id

    def _extra_steps(self) -> int:
        """The most steps a peer trains past a due round (held) before it starts it regardless."""
        return max(1, self.cfg.every // 2)

    def _hold(self, steps_since_round: int) -> bool:
        """Keep training past a due round while another live peer expects to be ready for it later, within the
        extra steps (sync.schedule); start at the step boundary nearest the latest such time."""
        step_time = self.step_time()
        if (not self.cfg.start_together or step_time is None or self._leaving
                or steps_since_round >= self.cfg.every + self._extra_steps()):
            return False
        if self._pending is not None and not self._pending.future.done():
            return False  # the previous round still runs: start this one after it
        now = get_dht_time()
        latest = self._latest_due(self.progress.others(max_age=2 * self.progress.poll + 1), steps_since_round,
                                  step_time, now)
        hold = latest is not None and now + step_time / 2 < latest
        if hold:
            self.held_steps += 1
            if not self._holding:
                self.held_rounds += 1
                self._holding = True
        return hold

    def _stop_scheduling(self) -> None:
        self._due_publisher.stop()
