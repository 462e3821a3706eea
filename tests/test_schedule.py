"""When rounds start (sync/schedule.py, docs/DESIGN.md "Heterogeneous peers" and "Starting a round together"):
a slower peer joins the swarm's round early, a faster one defers or holds a due round, peers start together and
look for their group ahead; between real hivemind peers on 127.0.0.1, several in one pytest process."""
from __future__ import annotations

import time

import torch

from tests.conftest import Peer, local_training as _local_training, round_all as _round_all
from tests.conftest import allreduce_cfg, shared_params as _shared, sync_cfg as _sync_cfg


def test_slower_peer_joins_the_swarms_round_early_weighted_by_its_tokens(swarm_factory):
    cfg = allreduce_cfg(every=10, target_group_size=3)
    a, b, slow = swarm_factory([0, 1], cfg), swarm_factory([2], cfg), swarm_factory([3], cfg)
    _round_all([a, b, slow])
    assert not slow.sync.round_due(3)  # nobody is ahead yet: a slower peer keeps training
    for i, peer in enumerate((a, b, slow)):
        _local_training(peer, seed=40 + i)
    before = [_shared(p) for p in (a, b, slow)]
    for peer in (a, b):  # the fast peers reached step 10 of the round
        peer.sync.start_round(step=11, tokens=1100, tokens_since_last=1000)
    deadline = time.monotonic() + 10
    while not slow.sync.round_due(3) and time.monotonic() < deadline:  # the slow one is at step 3 of 10
        time.sleep(0.1)
    assert slow.sync.round_due(3), "the slower peer did not notice that the swarm started a round"
    assert not slow.sync.round_due(0)  # never an early round without a step trained
    slow.sync.start_round(step=4, tokens=400, tokens_since_last=300)
    reports = [p.sync.finish_round(block=True) for p in (a, b, slow)]
    assert [r.group_size for r in reports] == [3, 3, 3], reports
    assert len({r.round_id for r in reports}) == 1
    weights = torch.tensor([1000.0, 1000.0, 300.0])
    for peer in (a, b, slow):
        for name, value in _shared(peer).items():
            mean = (torch.stack([s[name] for s in before]) * weights.view(-1, *[1] * value.dim())).sum(0) / weights.sum()
            torch.testing.assert_close(value, mean, rtol=1e-5, atol=1e-6)


def test_faster_peer_trains_past_a_due_round_the_others_have_not_started(swarm_factory):
    """A peer whose previous round still waits for a peer that has not started it keeps training past its next
    due round (up to every/2 steps) instead of blocking on it; once that round is done, the next one is due."""
    cfg = allreduce_cfg(every=10, matchmaking_time=5.0, round_timeout=30.0)
    fast, slow = swarm_factory([0, 1], cfg), swarm_factory([2, 3], cfg)
    _round_all([fast, slow])
    fast.sync.start_round(step=11, tokens=1100, tokens_since_last=1000)  # round 2; slow is still in round 1
    deadline = time.monotonic() + 10
    while fast.sync.shared.group_wait() < 2 * fast.sync.progress.poll + 1.5 and time.monotonic() < deadline:
        time.sleep(0.05)  # waited longer than the records can lag: slow's record still says round 1
    assert not fast.sync.round_due(10) and not fast.sync.round_due(14), "blocked on a round nobody else started"
    assert fast.sync.deferred_rounds == 1
    assert fast.sync.round_due(15), "deferred past every + every/2 steps"
    slow.sync.start_round(step=11, tokens=1100, tokens_since_last=1000)
    reports = [p.sync.finish_round(block=True) for p in (fast, slow)]
    assert [r.group_size for r in reports] == [2, 2], reports
    assert fast.sync.round_due(10)  # the previous round is applied: nothing to wait for


def _steps(peer: Peer, count: int, seconds: float = 0.02) -> None:
    """`count` local steps of `seconds` each as the training loop reports them (sync.schedule's step time)."""
    for step in range(count):
        time.sleep(seconds)
        peer.sync.note_step(step)


def _wait_for_due(reader: Peer, writer: Peer, timeout: float = 10.0) -> None:
    """Until `reader`'s background view holds `writer`'s published due estimate for its next round."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = reader.sync.progress.others().get(writer.swarm.peer_id)
        if record is not None and record.due and record.due[0] == writer.sync.round_id + 1:
            return
        time.sleep(0.1)
    raise AssertionError("the due estimate never reached the other peer")


def test_a_peer_due_first_trains_until_the_later_one_is_ready_then_both_start_together(swarm_factory):
    """sync.start_together: the peer at its due step keeps training while the other expects to be ready later
    (within every/2 extra steps), starts at the step boundary nearest that time, and both form the group at once."""
    from hivemind.utils import get_dht_time
    cfg = allreduce_cfg(every=10, matchmaking_time=5.0, round_timeout=30.0)
    early, late = swarm_factory([0, 1], cfg), swarm_factory([2, 3], cfg)
    _round_all([early, late])
    # Step time 0.6 s: up to 5 extra steps = 3 s of holding. The other peer is due 2.4 s later, which leaves 2 s
    # for its estimate to reach this peer (a CI run under load once took more than the 1 s that 0.3 s steps left).
    _steps(early, 10, seconds=0.6)
    ready = get_dht_time() + 2.4
    late.sync._due_publisher.set(late.sync.round_id + 1, ready, tolerance=0.2)  # as note_step publishes it
    _wait_for_due(early, late)
    assert not early.sync.round_due(10), "started without the peer due 2.4 s later"
    assert early.sync.held_steps == 1 and early.sync.held_rounds == 1
    while not early.sync.round_due(11):
        assert get_dht_time() < ready, "still holding past the other peer's due time"
        time.sleep(0.05)
    assert get_dht_time() >= ready - 0.6 / 2 - 0.05  # the step boundary nearest the due time
    assert early.sync.round_shift == 1  # the held step is borrowed from the next interval: rounds stay aligned
    for peer in (early, late):
        peer.sync.start_round(step=11, tokens=1100, tokens_since_last=1000)
    reports = [p.sync.finish_round(block=True) for p in (early, late)]
    assert [r.group_size for r in reports] == [2, 2], reports
    assert reports[0].timing["group"] < 1.0, reports[0].timing  # the group formed at once


def test_start_together_never_waits_beyond_the_extra_steps_nor_for_a_started_round(swarm_factory):
    from hivemind.utils import get_dht_time
    cfg = _sync_cfg(every=10, matchmaking_time=5.0, round_timeout=30.0)
    a, b = swarm_factory([0, 1], cfg), swarm_factory([2, 3], cfg)
    _round_all([a, b])
    _steps(a, 4, seconds=0.5)
    # A (lying or much slower) peer due an hour later is not waited for: it joins the swarm's round early.
    b.sync._due_publisher.set(b.sync.round_id + 1, get_dht_time() + 3600, tolerance=0.2)
    _wait_for_due(a, b)
    assert a.sync.round_due(10) and a.sync.held_steps == 0
    soon = get_dht_time() + 2.0
    b.sync._due_publisher.set(b.sync.round_id + 1, soon, tolerance=0.2)
    _wait_for_due(a, b)
    deadline = time.monotonic() + 10
    while a.sync.progress.others()[b.swarm.peer_id].due[1] > get_dht_time() + 3000 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert get_dht_time() < soon - 0.5, "the estimate took too long to arrive for this test"
    assert not a.sync.round_due(10)  # due within 2 s: within the 5 extra steps of 0.5 s
    assert a.sync.round_due(15), "held past every + every/2 steps"
    b.sync.start_round(step=11, tokens=1100, tokens_since_last=1000)  # b started the round: join it at once
    deadline = time.monotonic() + 10
    while a.sync.progress.others()[b.swarm.peer_id].round <= a.sync.round_id and time.monotonic() < deadline:
        time.sleep(0.1)
    b.sync._due_publisher.set(b.sync.round_id + 1, get_dht_time() + 1.0, tolerance=0.2)
    assert a.sync.round_due(10)
    a.sync.start_round(step=11, tokens=1100, tokens_since_last=1000)
    assert [p.sync.finish_round(block=True).group_size for p in (a, b)] == [2, 2]


def test_group_formed_ahead_of_the_round_averages_the_snapshot_taken_at_its_start(swarm_factory):
    """sync.group_ahead: within that many seconds of its expected start a peer looks for the round's group (a
    triggered hivemind step); the group forms while both still train, and the all-reduce released at the round's
    start averages the snapshots taken then, with the weights given then."""
    from hivemind.averaging.control import AveragingStage
    cfg = allreduce_cfg(every=10, matchmaking_time=5.0, round_timeout=30.0, group_ahead=2.0)
    a, b = swarm_factory([0, 1], cfg), swarm_factory([2, 3], cfg)
    _round_all([a, b])
    for peer in (a, b):
        _steps(peer, 4, seconds=0.1)
        peer.sync.note_step(9)  # one step left: expected to start within 0.1 s
        assert peer.sync.shared.prepared()
    deadline = time.monotonic() + 10
    while a.sync.shared._ahead.stage != AveragingStage.AWAITING_TRIGGER and time.monotonic() < deadline:
        time.sleep(0.05)
    assert a.sync.shared._ahead.stage == AveragingStage.AWAITING_TRIGGER, "no group formed ahead"
    for i, peer in enumerate((a, b)):
        _local_training(peer, seed=70 + i)  # the steps trained after the group formed count
    before = [_shared(p) for p in (a, b)]
    a.sync.start_round(step=11, tokens=1100, tokens_since_last=300)
    b.sync.start_round(step=11, tokens=1100, tokens_since_last=100)
    reports = [p.sync.finish_round(block=True) for p in (a, b)]
    assert [r.group_size for r in reports] == [2, 2], reports
    assert reports[0].timing["group"] < 0.5, reports[0].timing  # formed already: released, not looked for
    for peer in (a, b):
        for name, value in _shared(peer).items():
            torch.testing.assert_close(value, (3 * before[0][name] + before[1][name]) / 4, rtol=1e-5, atol=1e-6)
        assert not peer.sync.shared.prepared()


def test_a_group_formed_ahead_for_a_round_that_never_comes_is_given_up(swarm_factory):
    cfg = allreduce_cfg(every=10, matchmaking_time=5.0, round_timeout=30.0, group_ahead=2.0)
    a, b = swarm_factory([0, 1], cfg), swarm_factory([2, 3], cfg)
    _round_all([a, b])
    _steps(a, 4, seconds=0.1)
    a.sync.note_step(9)
    assert a.sync.shared.prepared()
    assert a.sync.drain(grace=1.0) is None  # the run ended before that round: nothing pending, group given up
    assert not a.sync.shared.prepared()
    a.sync.leave_soon()  # a stopping peer gives up a prepared group at its next round's start as well
    _steps(b, 4, seconds=0.1)
    b.sync.note_step(9)
    assert b.sync.shared.prepared()
    b.sync.leave_soon()
    assert b.sync.start_round(step=11, tokens=1100, tokens_since_last=1000) is None and not b.sync.shared.prepared()


def test_a_lone_liar_cannot_trigger_early_rounds(swarm_factory):
    cfg = _sync_cfg(every=10)
    peers = [swarm_factory([e], cfg) for e in range(4)]
    _round_all(peers)
    liar = peers[0]
    liar.swarm.publish(round=liar.sync.round_id + 1000)
    time.sleep(3 * peers[1].sync.progress.poll + 1)
    assert not any(p.sync.round_due(5) for p in peers[1:])  # the median of the others did not move


def test_round_starts_once_every_live_peer_joined_not_after_the_matchmaking_window(swarm_factory):
    cfg = _sync_cfg(matchmaking_time=30.0, round_timeout=60.0)  # target_group_size 0: the live peers
    peers = [swarm_factory([e], cfg) for e in range(3)]
    start = time.monotonic()
    reports = _round_all(peers)
    assert [r.group_size for r in reports] == [3, 3, 3], reports
    assert time.monotonic() - start < cfg.matchmaking_time / 2, "the group waited for the matchmaking window"


def test_averager_shuts_down_cleanly_while_its_group_waits_for_a_member(swarm_factory, monkeypatch):
    """A peer whose all-reduce group is registered (released, waiting for a member that has not released yet)
    stops: its averager process's shutdown completes without an error, and the other member's round goes on
    without it. hivemind 1.1.12's own shutdown raised an AttributeError in this state (it calls finalize() on the
    Futures holding the runners; sync/shared.py `_CountingAverager._shutdown`)."""
    import multiprocessing as mp
    from hivemind.averaging.control import AveragingStage
    from sync.shared import _CountingAverager
    failed = mp.Value("b", 0)  # shared memory: the averager process is forked after this
    shutdown = _CountingAverager._shutdown

    async def recording_shutdown(self, timeout):
        try:
            await shutdown(self, timeout)
        except BaseException:
            failed.value = 1
            raise
    monkeypatch.setattr(_CountingAverager, "_shutdown", recording_shutdown)
    cfg = allreduce_cfg(every=10, matchmaking_time=5.0, round_timeout=30.0, group_ahead=2.0)
    a, b = swarm_factory([0, 1], cfg), swarm_factory([2, 3], cfg)
    _round_all([a, b])
    for peer in (a, b):
        _steps(peer, 4, seconds=0.1)
        peer.sync.note_step(9)
    deadline = time.monotonic() + 10
    while a.sync.shared._ahead.stage != AveragingStage.AWAITING_TRIGGER and time.monotonic() < deadline:
        time.sleep(0.05)
    a.sync.start_round(step=11, tokens=1100, tokens_since_last=1000)  # released: its group is registered
    deadline = time.monotonic() + 10
    while a.sync.shared._control.stage != AveragingStage.RUNNING_ALLREDUCE and time.monotonic() < deadline:
        time.sleep(0.05)
    assert a.sync.shared._control.stage == AveragingStage.RUNNING_ALLREDUCE
    averager = a.sync.shared.averager
    averager.shutdown()
    assert averager.exitcode == 0 and failed.value == 0, "the averager's shutdown failed"
    b.sync.start_round(step=11, tokens=1100, tokens_since_last=1000)
    assert b.sync.finish_round(block=True).group_size <= 2  # averaged alone or with what a sent: it goes on



def test_a_round_stops_looking_for_a_group_once_nobody_else_is_left(swarm_factory):
    """A round started while another peer's record was live, which then finished its run and left, stops looking
    for a group about three record reads after matchmaking_time, not at round_timeout (hivemind retries
    matchmaking until then: 60 s for nobody at the end of a bench.wan `mixed` run)."""
    cfg = _sync_cfg(every=10, matchmaking_time=2.0, round_timeout=40.0)
    a, b = swarm_factory([0, 1], cfg), swarm_factory([2, 3], cfg)
    _round_all([a, b])
    deadline = time.monotonic() + 10
    while b.swarm.peer_id not in a.sync.progress.others() and time.monotonic() < deadline:
        time.sleep(0.1)
    started = time.monotonic()
    a.sync.start_round(step=11, tokens=1100, tokens_since_last=1000)  # b's record is live: a looks for b
    time.sleep(0.5)
    b.sync.progress.stop()
    b.swarm.finish()  # b completed its run: its record says so, it is no longer a live peer
    report = a.sync.finish_round(block=True)
    elapsed = time.monotonic() - started
    assert report.group_size == 1, report
    assert elapsed < 2.0 + 4 * a.sync.progress.poll + 4.0, f"looked for a group for {elapsed:.1f}s"
