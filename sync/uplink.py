"""Measuring this peer's upload (docs/DESIGN.md, "Uneven links"): a probe that pushes bytes to other peers.

A volunteer at home rarely knows (or declares) that its uplink is 5 Mbit/s while the swarm's are 100. Without
that, hivemind's all-reduce gives it an equal part to reduce and it sends its parts at full precision, and every
group it joins runs at its pace (bench.wan `mixed`: 30-65 s rounds instead of 5). The rate of its transfers in a
round tells nothing by itself (a group runs at its slowest member's pace, so every member's send rate drops
alike), so the peer measures its uplink directly, once it sees other peers: it pushes up to `PROBE_BYTES` of
random bytes to each of up to 3 of them at once, for at most `PROBE_SECONDS`, and each answers how many bytes it
received once the stream ended. The estimate is the sum of the per-target rates (bytes received ÷ seconds until
that target's answer), so one target that answers late lowers it by its share only.

The sink side (`UplinkSink`, served on the expert exchange's handler namespace) reads at most `MAX_SINK_BYTES`
from one probe, serves at most `MAX_CONCURRENT` probes at once and each sender once per `COOLDOWN` seconds:
probing costs a peer's downlink a few MB per joining peer, and a hostile peer cannot turn it into more.
"""
from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from typing import AsyncIterator, Awaitable, Callable

from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.logging import get_logger
from hivemind.utils.serializer import MSGPackSerializer

logger = get_logger(__name__)

CHUNK_BYTES = 256 * 1024
PROBE_BYTES = 4 * 2**20  # per target: 0.3 s at 100 Mbit/s, capped by PROBE_SECONDS below ~11 Mbit/s
PROBE_SECONDS = 3.0
PROBE_TARGETS = 3
MAX_SINK_BYTES = 2 * PROBE_BYTES
MAX_CONCURRENT = 2
COOLDOWN = 30.0
FAST_UPLINK_MBIT = 100.0  # what a measured uplink at or above sync.slow_uplink_mbit declares to hivemind
MAX_PROBES = 3  # attempts (one per round while no target answered), then the uplink stays unknown
# A probe runs at a step between rounds, or at any step once BUSY_PROBE_AFTER s passed since the last attempt
# (or the start): a slow uplink's rounds may leave no step between them, and a home peer on 5 Mbit/s that saw
# nobody at join never measured in a CI run. One confirming a reading below sync.follow_below_mbit waits out the
# sinks' COOLDOWN first (they would refuse it as busy).
BUSY_PROBE_AFTER = 10.0
CONFIRM_AFTER = COOLDOWN + 1.0
FIRST_READING_WAIT = PROBE_SECONDS + 5.0  # the most a round waits for a peer's first reading (see _measuring_first)

_PAYLOAD = runtime_pb2.ExpertRequest(metadata=os.urandom(CHUNK_BYTES))  # incompressible, built once


class UplinkSink:
    """Counts the bytes of probes other peers push to this one (see the module docstring for the limits)."""

    def __init__(self) -> None:
        self._active = 0
        self._last: dict[PeerID, float] = {}

    async def absorb(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], sender: PeerID,
                     ) -> runtime_pb2.ExpertResponse:
        now = time.monotonic()
        self._last = {p: t for p, t in self._last.items() if now - t < COOLDOWN}  # bounded by senders per COOLDOWN
        if self._active >= MAX_CONCURRENT or sender in self._last:
            return runtime_pb2.ExpertResponse(metadata=MSGPackSerializer.dumps({"error": "busy"}))
        self._active += 1
        self._last[sender] = now
        received = 0
        try:
            async for message in requests:
                received += len(message.metadata)
                if received >= MAX_SINK_BYTES:
                    break
        finally:
            self._active -= 1
        return runtime_pb2.ExpertResponse(metadata=MSGPackSerializer.dumps({"received": received}))


async def _probe_one(call: Callable[[AsyncIterator[runtime_pb2.ExpertRequest]], Awaitable], started: float,
                     nbytes: int, seconds: float) -> tuple[int, float] | None:
    """Push to one target; (bytes it says it received, at most what was sent; seconds until its answer)."""
    sent = 0

    async def chunks() -> AsyncIterator[runtime_pb2.ExpertRequest]:
        nonlocal sent
        while sent < nbytes and time.monotonic() - started < seconds:
            sent += CHUNK_BYTES
            yield _PAYLOAD

    response = await call(chunks())
    try:
        answer = MSGPackSerializer.loads(response.metadata)
        received = int(answer["received"]) if isinstance(answer, dict) else -1
    except Exception:  # malformed answer: this target does not count
        return None
    if received <= 0:
        return None
    return min(received, sent), time.monotonic() - started


async def measure_upload(calls: list[Callable[[AsyncIterator[runtime_pb2.ExpertRequest]], Awaitable]],
                         nbytes: int = PROBE_BYTES, seconds: float = PROBE_SECONDS) -> float | None:
    """This peer's upload in Mbit/s, pushed to the targets `calls` open a probe stream to (all at once); None if
    no target answered (busy, gone, malformed). Takes at most `seconds` plus the time to drain what was sent."""
    started = time.monotonic()
    results = await asyncio.gather(*(asyncio.wait_for(_probe_one(call, started, nbytes, seconds), seconds + 10.0)
                                     for call in calls), return_exceptions=True)
    rates = [received * 8 / max(elapsed, 1e-3) / 1e6 for r in results
             if isinstance(r, tuple) for received, elapsed in [r]]
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, (asyncio.TimeoutError, ConnectionError, OSError)):
            logger.debug(f"upload probe failed: {r!r}")
    return sum(rates) if rates else None


class UplinkMeasuring:
    """SparseSync mixin: measure this peer's upload once other peers are seen (at join, else at a later round's
    start), unless declared (network.upload_mbit) or sync.slow_uplink_mbit is 0; in a daemon thread, so neither
    join nor a round waits for it. Below sync.slow_uplink_mbit, hivemind is told the rate (a small part of each
    all-reduce to reduce), the all-reduce parts go fp16 and each bf16 expert copy goes out once a round
    (sync.pass_on_copies, sync/copies.py); at or above it, FAST_UPLINK_MBIT is declared. Below
    sync.follow_below_mbit it follows at once (sync/following.py), and a second reading decides whether it goes
    on following; a measured follower measures again every sync.follower_reprobe_s."""

    def _init_uplink(self) -> None:
        self.measured_upload: float | None = None
        measure = self.bandwidth is None and self.cfg.slow_uplink_mbit > 0 and not self.follower
        self._probes_left = MAX_PROBES if measure else 0
        self._below_follow = False  # it follows since one reading below sync.follow_below_mbit: the next decides
        self._above_follow = False  # a follower's last re-probe was at or above it (one more confirms it)
        self._below_follow_at = 0.0  # monotonic time of the measurement to confirm
        self._reprobe_at: float | None = None  # when a measured follower measures again (sync.follower_reprobe_s)
        self.unfollow_why: str | None = None  # set by a confirmed fast re-probe: stop following at the next round
        self._confirm_tries = 0
        self._unsure_slow = False  # a slow reading from one probe target: the next reading decides (_decide_on)
        self._last_probe_at = time.monotonic()  # of the last attempt (or the start): see _probe_allowed
        self._probing = False
        self._probe_retry_at = 0.0  # monotonic: no attempt before (a failed one waits out the sinks' cooldown)
        if self.bandwidth is not None and self.bandwidth < self.cfg.slow_uplink_mbit:
            self.shared.compression.use_slow_codec(True)  # a declared slow uplink: its parts go fp16 too
            self.exchange.pass_copies_on = self.cfg.pass_on_copies

    def _probe_allowed(self, idle: bool) -> bool:
        """Whether a probe may start at this step: between rounds (`idle`) or BUSY_PROBE_AFTER s after the last
        attempt; one confirming a slow reading only after the sinks' cooldown."""
        now = time.monotonic()
        if (self._below_follow or self._above_follow) and now - self._below_follow_at <= CONFIRM_AFTER:
            return False
        if now < self._probe_retry_at:
            return False
        return idle or now - self._last_probe_at > BUSY_PROBE_AFTER

    def _measuring_first(self) -> bool:
        """(Training thread, round_due) Whether this peer's first probe is still running: its rounds wait for the
        reading (at most FIRST_READING_WAIT s from the probe's start) and it trains on meanwhile. A round it joined
        before would run at its uplink's pace for the whole group when that is slow: 45-53 s for every peer of
        bench.wan `mixed`'s first round (a 5 Mbit/s home peer in a group of 4), and a first round of 3 in
        tests/test_netns.py; after the reading it follows, or takes a small share of each all-reduce."""
        return (self._probing and self.measured_upload is None and not self.follower
                and time.monotonic() - self._last_probe_at < FIRST_READING_WAIT)

    def _maybe_measure_uplink(self, others: dict) -> None:
        if self._probes_left <= 0 or self._probing or not others:
            return
        self._probing, self._probes_left, self._last_probe_at = True, self._probes_left - 1, time.monotonic()
        # Not followers: a probe measures the slower of this uplink and the targets' downlinks, and a follower's
        # (a home line) can be the slower (a 100 Mbit/s peer read 4.4 Mbit/s with a home peer its only target).
        candidates = sorted(p for p, r in others.items() if not getattr(r, "follows", False)) or sorted(others)
        targets = random.sample(candidates, min(PROBE_TARGETS, len(candidates)))
        threading.Thread(target=self._measure_uplink, args=(targets,), daemon=True, name="spes-uplink-probe").start()

    def _measure_uplink(self, targets: list[str]) -> None:
        # "Probing" lasts until what the reading decides is done (a follower's state included): a step that
        # looked in between would see a new follower without its re-probe time, or start another probe.
        try:
            try:
                rate = self.exchange.measure_upload([PeerID.from_base58(t) for t in targets])
                failed = "no target answered (busy, gone or malformed)"
            except Exception as e:  # the exchange is shutting down, or every target failed: maybe next round
                rate, failed = None, f"{type(e).__name__}: {str(e)[:80]}"
            if rate is None:
                # The targets that took the failed push count this sender for COOLDOWN and refuse it as busy
                # until then: three attempts one round apart (rounds of 1.5 s in tests/test_netns.py) all failed
                # that way, and the peer never measured. So the next attempt waits that long.
                self._probe_retry_at = time.monotonic() + CONFIRM_AFTER
            self._decide_on(rate, targets)
            if rate is None:
                then = (f"trying again in {CONFIRM_AFTER:.0f} s or later" if self._probes_left else
                        "measuring again later" if self._reprobe_at is not None else
                        "as a follower" if self.follower else
                        "the uplink stays unmeasured (declare it with --set network.upload_mbit=N)")
                logger.info(f"upload probe to {len(targets)} peer(s) failed ({failed}); {then}")
        finally:
            self._probing = False

    def _decide_on(self, rate: float | None, targets: list[str]) -> None:
        """What one reading (None: no target answered) changes: the declared rate, the codec, following."""
        if rate is None:
            if self._below_follow and self._probes_left == 0 and self._confirm_tries < MAX_PROBES:
                self._confirm_tries += 1
                self._probes_left = 1  # no target answered the confirming probe (busy, gone): try again
            elif self.follower and self._probes_left == 0 and self.cfg.follower_reprobe_s > 0:
                # A re-probe, or a confirmation that never got an answer: it keeps following, measures later.
                self._above_follow = self._below_follow = False
                self._reprobe_at = time.monotonic() + self.cfg.follower_reprobe_s
            return
        confirming = self._below_follow and self.follower
        self._probes_left, self.measured_upload, self._below_follow = 0, rate, False
        slow = rate < self.cfg.slow_uplink_mbit
        self.bandwidth = rate if slow else FAST_UPLINK_MBIT
        self.shared.averager.bandwidth = self.bandwidth  # read by each step() in this process
        self.shared.compression.use_slow_codec(slow)
        self.exchange.pass_copies_on = slow and self.cfg.pass_on_copies
        if confirming:
            self._confirmed(rate, len(targets))
        elif self.follower:
            self._reprobed(rate, len(targets))
        elif rate < self.cfg.follow_below_mbit and len(targets) < 2 and not self._unsure_slow:
            # One target's reading is the slower of this uplink and that target's download (and its load): a public
            # 100 Mbit/s peer whose only target was the home peer (20 Mbit/s down) read 4.6 Mbit/s and followed, and
            # its one partner then averaged alone and fell behind every round (tests/test_netns.py, in a CI
            # simulation). It takes a small share of each all-reduce, as any slow uplink, until a second reading,
            # after the sinks' cooldown, says whether it follows.
            self._unsure_slow, self._probes_left = True, 1
            self._probe_retry_at = time.monotonic() + CONFIRM_AFTER
            logger.info(f"upload measured at {rate:.1f} Mbit/s with one probe target, below sync.follow_below_mbit "
                        f"({self.cfg.follow_below_mbit:g}): measured again in {CONFIRM_AFTER:.0f} s before it follows "
                        f"(a small share of each all-reduce meanwhile)")
        elif rate < self.cfg.follow_below_mbit:
            # It follows from now on, and a second probe (after the sinks' cooldown, at a step between rounds)
            # decides whether it keeps following: a 100 Mbit/s peer's probe at join, overlapping the first round's
            # transfers, read 4.4 Mbit/s once in bench.wan. Until session 14 it all-reduced until that second
            # reading, as a slow uplink, and a public peer that grouped with it in that time spent 31 s on one
            # all-reduce at its uplink's pace, fell behind and re-downloaded the state, while the other two waited
            # out a matchmaking window for that one in each of the next five rounds (docs/DESIGN.md, "Slow
            # uplinks follow"). A wrong first reading now costs a fast peer a round or two of following instead.
            self._below_follow, self._probes_left, self._below_follow_at = True, 1, time.monotonic()
            self._become_follower(f"upload measured at {rate:.1f} Mbit/s (probe to {len(targets)} peer(s))",
                                  then=f"; it is measured once more, between rounds after {CONFIRM_AFTER:.0f} s, "
                                       f"and follows on only if that reading is below it too")
            # Stored now (this is the probe's thread), not at the next round: carriers take changes only from
            # peers whose record says they follow, and its first change goes out with that round.
            try:
                self.swarm.publish()
            except Exception as e:  # the heartbeat stores it within ttl / 3 anyway
                logger.debug(f"could not store the record now: {e!r}")
        elif slow:
            logger.info(f"upload measured at {rate:.1f} Mbit/s (probe to {len(targets)} peer(s)), below "
                        f"sync.slow_uplink_mbit ({self.cfg.slow_uplink_mbit:g}): this peer reduces a matching small "
                        f"part of each all-reduce, sends its parts fp16"
                        f"{' and each expert copy once a round' if self.exchange.pass_copies_on else ''} "
                        f"(set network.upload_mbit to override)")
        else:
            logger.info(f"upload measured at {rate:.0f} Mbit/s (probe to {len(targets)} peer(s)): an equal share "
                        f"of each all-reduce (declared as {FAST_UPLINK_MBIT:g})")

    def _reprobe_due(self) -> None:
        """(Training thread, every step) A measured follower's time to measure again (sync.follower_reprobe_s):
        the probe then runs as any other, between rounds."""
        if self._reprobe_at is not None and time.monotonic() >= self._reprobe_at and not self._probing:
            self._reprobe_at, self._probes_left = None, 1

    def _reprobed(self, rate: float, targets: int) -> None:
        """A measured follower's later reading. Two in a row at or above sync.follow_below_mbit (the second after
        the sinks' cooldown, between rounds, as when it began to follow) and it joins the all-reduce again at its
        next round's start (sync/following.py `_maybe_unfollow`); below it, it measures again later. Its own
        sends (its change, its experts) share the uplink with the probe: a busy line reads low, never high."""
        if rate < self.cfg.follow_below_mbit:
            self._above_follow, self._reprobe_at = False, time.monotonic() + self.cfg.follower_reprobe_s
            logger.info(f"upload measured at {rate:.1f} Mbit/s (probe to {targets} peer(s)): still below "
                        f"sync.follow_below_mbit ({self.cfg.follow_below_mbit:g}), this peer keeps following")
        elif not self._above_follow:
            self._above_follow, self._probes_left, self._below_follow_at = True, 1, time.monotonic()
            logger.info(f"upload measured at {rate:.1f} Mbit/s (probe to {targets} peer(s)), at or above "
                        f"sync.follow_below_mbit ({self.cfg.follow_below_mbit:g}): measuring once more, between "
                        f"rounds, before joining the all-reduce again")
        else:
            self._above_follow = False
            self._stop_following(f"upload measured at {rate:.1f} Mbit/s twice (probes to {targets} peer(s))")

    def _confirmed(self, rate: float, targets: int) -> None:
        """The second reading of a peer that follows since its first one was below sync.follow_below_mbit: below
        it again and it keeps following (measuring again after sync.follower_reprobe_s); at or above it, the first
        reading was wrong (its probe shared the line with a round's transfers, or its targets' downlinks were the
        bottleneck) and it joins the all-reduce at its next round. One fast reading is enough here, against two for
        a confirmed follower: a busy line reads low, never high, and this one was never confirmed slow."""
        if rate < self.cfg.follow_below_mbit:
            if self.cfg.follower_reprobe_s > 0:
                self._reprobe_at = time.monotonic() + self.cfg.follower_reprobe_s
            logger.info(f"upload measured at {rate:.1f} Mbit/s twice (probes to {targets} peer(s)), below "
                        f"sync.follow_below_mbit ({self.cfg.follow_below_mbit:g}): this peer keeps following")
        else:
            self._stop_following(f"upload measured at {rate:.1f} Mbit/s (probe to {targets} peer(s)) after a first "
                                 f"reading below sync.follow_below_mbit")

    def _stop_following(self, why: str) -> None:
        """Join the all-reduce again at the next round's start (sync/following.py `_maybe_unfollow`)."""
        self.unfollow_why = why
        if self._change_sender.busy():
            return  # its record changes when it stops following, after that change arrived
        # Stored now (this is the probe's thread), so that the others' next round expects it in its group; a
        # change of its still on its way would be refused from now on (and go back into its tensors).
        self.swarm.record.follows = False
        try:
            self.swarm.publish()
        except Exception as e:  # the heartbeat stores it within ttl / 3, or its next round does
            logger.debug(f"could not store the record now: {e!r}")
