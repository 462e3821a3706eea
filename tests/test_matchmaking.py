"""A group whose leader gives its go late still all-reduces as one group, and one that split anyway is not counted
as averaged with (sync/matchmaking.py).

Two real SparseSync peers on 127.0.0.1. Around the moment a group forms, one peer's averager process is stopped
(SIGSTOP) for longer than hivemind's request_timeout, as a stalled process or a retransmitted message delays a
leader's BEGIN_ALLREDUCE. Without the follower's grace the group split in every such round: the leader kept its
own values while hivemind reported a group of two, the follower found no group. When a group splits anyway, the
member that left answers the leader's parts at once, and the leader stops waiting for that member's.
"""
from __future__ import annotations

import collections
import os
import signal
import threading
import time

import torch

from sync.matchmaking import PatientMatchmaking
from tests.conftest import local_training, round_all, shared_params, allreduce_cfg

MATCHMAKING = 2.0  # the tests' matchmaking_time: request_timeout is 1 s, the follower's grace 2 s
STALL = 1.6  # longer than request_timeout, shorter than request_timeout + grace
LONG_STALL = 4.5  # longer than all the follower waits for the go, with its half second of head start
NEXT_CHUNK_TIMEOUT = 2.5  # the sender timeout of round_timeout=10 (sync/shared.py: a quarter of it)


def _stall_later(pid: int, after: float, seconds: float) -> threading.Thread:
    def stall() -> None:
        time.sleep(after)
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            os.kill(pid, signal.SIGCONT)
    thread = threading.Thread(target=stall, name="stall-averager", daemon=True)
    thread.start()
    return thread


def test_a_group_whose_leaders_go_is_late_still_averages_together(swarm_factory):
    # No target size: the leader assembles its group when its matchmaking time is up (as when the records show a
    # peer that does not come), not the moment the follower joins.
    cfg = allreduce_cfg(matchmaking_time=MATCHMAKING, round_timeout=10.0, target_group_size=-1)
    a, b = swarm_factory([0, 1], cfg), swarm_factory([2, 3], cfg)
    # Each peer stalled once: which one leads depends on their expirations, and a stalled follower missed the go
    # as well (its wait for it timed out while it was stopped).
    for r, stalled in enumerate((a, b, a)):
        for i, peer in enumerate((a, b)):
            local_training(peer, seed=10 * r + i)
        before = [shared_params(p) for p in (a, b)]
        # The group forms at the leader's expiration, matchmaking_time after its step began looking.
        thread = _stall_later(stalled.sync.shared.averager.pid, after=MATCHMAKING - 0.1, seconds=STALL)
        try:
            reports = round_all([a, b])
        finally:
            thread.join()
        assert [rep.group_size for rep in reports] == [2, 2], f"round {r + 1}: the group split: {reports}"
        for name, value in shared_params(a).items():
            mean = (before[0][name] + before[1][name]) / 2
            torch.testing.assert_close(value, mean, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(shared_params(b)[name], value, rtol=1e-5, atol=1e-6)


def test_a_leader_whose_group_split_anyway_reports_what_it_averaged(swarm_factory):
    """A go later than the grace: the follower has left, the leader's all-reduce hears nothing from it. Each
    peer's report must say what its values show: a group of two with the mean, or alone with its own values; and
    the leader does not wait for the parts of a member that answered it is not in the group."""
    cfg = allreduce_cfg(matchmaking_time=MATCHMAKING, round_timeout=10.0, target_group_size=-1)
    a, b = swarm_factory([0, 1], cfg), swarm_factory([2, 3], cfg)
    alone = []
    for r in range(2):
        for i, peer in enumerate((a, b)):
            local_training(peer, seed=10 * r + i)
        before = [shared_params(p) for p in (a, b)]
        # a starts looking half a second earlier: its expiration comes first, so it leads, and it is stalled.
        thread = _stall_later(a.sync.shared.averager.pid, after=MATCHMAKING - 0.1, seconds=LONG_STALL)
        try:
            a.sync.start_round(step=1, tokens=100, tokens_since_last=100)
            time.sleep(0.5)
            b.sync.start_round(step=1, tokens=100, tokens_since_last=100)
            reports = [peer.sync.finish_round(block=True) for peer in (a, b)]
        finally:
            thread.join()
        for peer, own, report in zip((a, b), before, reports):
            for name, value in shared_params(peer).items():
                expected = (before[0][name] + before[1][name]) / 2 if report.group_size > 1 else own[name]
                torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"round {r + 1}: reported group {report.group_size}: {m}")
        alone.append([report.group_size for report in reports])
        if reports[0].group_size == 1 and "all-reduce" in reports[0].timing:
            # b had left: its averager said so at once (BAD_GROUP_ID), and a stopped waiting for b's parts. Without
            # that, a's all-reduce waited out its sender timeout twice (5.0 s with these settings).
            assert reports[0].timing["all-reduce"] < NEXT_CHUNK_TIMEOUT, f"round {r + 1}: {reports[0].timing}"
    assert [1, 1] in alone, f"the group never split: the test shows nothing ({alone})"


def test_only_the_wait_for_the_go_grows():
    """The wait for a leader's first answer stays hivemind's (it breaks two peers asking each other at once)."""
    matchmaking = PatientMatchmaking.__new__(PatientMatchmaking)
    matchmaking.begin_grace, matchmaking.request_timeout = 2.0, 1.0
    assert matchmaking.request_timeout == 1.0  # nothing set up yet: no leader
    matchmaking.current_leader = None
    assert matchmaking.request_timeout == 1.0
    matchmaking.current_leader = object()  # accepted by a leader: waiting for its go
    assert matchmaking.request_timeout == 3.0


def test_a_part_may_be_for_a_group_only_while_one_could_form_here():
    """A part for a group id this averager does not know waits only while that group could still be its own: while
    a join request is talking to a leader (its go may come after the leader's first part) or for a group formed
    here (registered at the step's trigger). Otherwise it is answered at once as not this averager's group."""
    matchmaking = PatientMatchmaking.__new__(PatientMatchmaking)
    matchmaking.asking, matchmaking.formed = 0, collections.deque(maxlen=8)
    assert not matchmaking.could_join(b"g1")  # looking for a group, asking nobody: g1 cannot be its
    matchmaking.asking = 1
    assert matchmaking.could_join(b"g1")  # a leader may have started before its go got here
    matchmaking.asking = 0
    matchmaking.formed.append(b"g1")
    assert matchmaking.could_join(b"g1") and not matchmaking.could_join(b"g2")
