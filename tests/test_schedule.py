"""When rounds start (sync/schedule.py, docs/DESIGN.md "Heterogeneous peers" and "Starting a round together"):
a slower peer joins the swarm's round early, a faster one holds a due round so that peers start together; between
real hivemind peers on 127.0.0.1, several in one pytest process."""
from __future__ import annotations

import time


from tests.conftest import Peer, local_training as _local_training, round_all as _round_all
from tests.conftest import sync_cfg as _sync_cfg


def test_slower_peer_joins_the_swarms_round_early_weighted_by_its_tokens(swarm_factory):
    cfg = _sync_cfg(every=10)
    a, b, slow = swarm_factory([0, 1], cfg), swarm_factory([2], cfg), swarm_factory([3], cfg)
    _round_all([a, b, slow])
    assert not slow.sync.round_due(3)  # nobody is ahead yet: a slower peer keeps training
    for i, peer in enumerate((a, b, slow)):
        _local_training(peer, seed=40 + i)
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
    # Its contribution counts with the tokens it trained (how weights are capped: tests/test_aggregate.py).
    assert {p.sync.swarm.record.contrib[3] for p in (a, b)} == {1000} and slow.sync.swarm.record.contrib[3] == 300
    assert len({p.sync.synced_digest for p in (a, b, slow)}) == 1, "the three hold other synchronized tensors"


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
    (within every/2 extra steps), starts at the step boundary nearest that time, and both contribute to it."""
    from hivemind.utils import get_dht_time
    cfg = _sync_cfg(every=10, matchmaking_time=5.0, round_timeout=30.0)
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


def test_a_lone_liar_cannot_trigger_early_rounds(swarm_factory):
    cfg = _sync_cfg(every=10)
    peers = [swarm_factory([e], cfg) for e in range(4)]
    _round_all(peers)
    liar = peers[0]
    liar.swarm.publish(round=liar.sync.round_id + 1000)
    time.sleep(3 * peers[1].sync.progress.poll + 1)
    assert not any(p.sync.round_due(5) for p in peers[1:])  # the median of the others did not move


def test_round_starts_once_every_live_peer_joined_not_after_the_matchmaking_window(swarm_factory):
    cfg = _sync_cfg(matchmaking_time=30.0, round_timeout=60.0)
    peers = [swarm_factory([e], cfg) for e in range(3)]
    start = time.monotonic()
    reports = _round_all(peers)
    assert [r.group_size for r in reports] == [3, 3, 3], reports
    assert time.monotonic() - start < cfg.matchmaking_time / 2, "the round waited for the matchmaking window"


def test_a_round_stops_looking_for_a_group_once_nobody_else_is_left(swarm_factory):
    """A round started while another peer's record was live, which then finished its run and left, stops waiting
    for its announcement within matchmaking_time and a few record reads, not at round_timeout."""
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
