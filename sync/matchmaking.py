"""hivemind's group forming: a follower that waits longer for its leader's go, and a group counted by who was
heard from (docs/DESIGN.md, "A late go").

In hivemind 1.1.12 a follower accepted into a group waits for the leader's BEGIN_ALLREDUCE until its own declared
expiration plus `request_timeout`, then leaves the group and looks for another. The leader assembles the group at
its own expiration (never later than the follower's), but nothing tells it that a follower left: a leader whose
go is late by more than `request_timeout` (its process or event loop stalled, its message retransmitted on a lossy
link) starts the all-reduce with a follower that is no longer in it. The group then splits: the leader waits its
sender timeout for parts that never come and keeps its own values while hivemind reports a group of two; the
follower finds nobody else and looks until its round times out. A leader's averager process stopped for 1.6 s
just before its expiration split every round of a two-peer test this way (request_timeout 1 s), and a CI run on
two busy cores split one round so.

Here an accepted follower waits `begin_grace` seconds longer for that go. The wait for a leader's first answer
keeps hivemind's `request_timeout`: hivemind holds a lock while it awaits it, and that short timeout is what
breaks two peers asking each other at once. A follower whose leader is gone without closing the stream loses the
extra grace once, then looks on as before.

A go later than that grace still splits the group. The leader's all-reduce then counts only the members from which
something reached it (`heard_from`): a part sent to its reducer or a result from theirs. hivemind counts every
member of the group, so a leader that had averaged with nobody reported a group of two, and its round was taken
as averaged (its result served as the round's, nothing held for the next round, no "averaged with nobody").
"""
from __future__ import annotations

import functools
from typing import Any, Mapping

from hivemind.averaging.matchmaking import Matchmaking
from hivemind.averaging.partition import TensorPartContainer
from hivemind.utils.logging import get_logger

logger = get_logger(__name__)


class PatientMatchmaking(Matchmaking):
    """Matchmaking whose accepted followers wait `begin_grace` s longer for BEGIN_ALLREDUCE."""

    def __init__(self, *args, begin_grace: float, **kwargs):
        self.begin_grace = float(begin_grace)
        super().__init__(*args, **kwargs)

    # hivemind reads request_timeout in _request_join_group twice: for the leader's first answer (before it
    # accepted this peer: current_leader is None) and for the go that follows (current_leader is that leader).
    # Only the second wait grows; any other reader (the averager's own request_timeout) sees hivemind's value.
    @property
    def request_timeout(self) -> float:
        accepted = getattr(self, "current_leader", None) is not None
        return self._request_timeout + (self.begin_grace if accepted else 0.0)

    @request_timeout.setter
    def request_timeout(self, value: float) -> None:
        self._request_timeout = value


class TrackedPartContainer(TensorPartContainer):
    """hivemind's TensorPartContainer, remembering per reducer how many of its results had arrived when it failed
    (hivemind fills a failed reducer's remaining parts with this peer's own, indistinguishable afterwards)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.results_before_failure: dict[int, int] = {}

    def register_failed_reducer(self, peer_index: int) -> None:
        self.results_before_failure.setdefault(peer_index, self._outputs_registered_by_peer[peer_index])
        super().register_failed_reducer(peer_index)


def heard_from(runner: Any, gathered: Mapping) -> dict:
    """`gathered` (hivemind's per-member data of a finished all-reduce run by `runner`) without the members from
    which nothing reached this peer: no part arrived at its reducer and their reducers failed before their first
    result. Nothing of theirs is then in this peer's result, so when every other member is dropped this peer
    averaged with nobody. Members that may send nothing (auxiliaries) are kept."""
    container, reducer = runner.tensor_part_container, runner.tensor_part_reducer
    failed = getattr(container, "results_before_failure", None)
    received = getattr(reducer, "num_parts_received", None)
    if failed is None or received is None:  # not installed in this process: hivemind's count
        return dict(gathered)
    parts = container.num_parts_by_peer
    own_parts = parts[runner.ordered_peer_ids.index(runner.peer_id)]
    silent = set()
    for index, peer in enumerate(runner.ordered_peer_ids):
        if peer == runner.peer_id or peer not in runner.sender_peer_ids or (own_parts == 0 and parts[index] == 0):
            continue  # this peer itself, an auxiliary, or nothing could have come from it either way
        sent_nothing = own_parts == 0 or received[runner.sender_peer_ids.index(peer)] == 0
        reduced_nothing = parts[index] == 0 or failed.get(index) == 0
        if sent_nothing and reduced_nothing:
            silent.add(peer)
    if silent:
        logger.warning(f"all-reduce: nothing reached this peer from {len(silent)} of the {len(parts) - 1} other "
                       f"member(s) of its group (they had left it): not counted as averaged with")
    return {peer: value for peer, value in gathered.items() if peer not in silent}


def install_group_forming(begin_grace: float) -> None:
    """Make the averagers of *this process* use PatientMatchmaking and TrackedPartContainer (call inside the
    averager process before its run loop starts: it is a forked process of its own)."""
    import hivemind.averaging.allreduce as allreduce_module
    import hivemind.averaging.averager as averager_module

    averager_module.Matchmaking = functools.partial(PatientMatchmaking, begin_grace=begin_grace)
    allreduce_module.TensorPartContainer = TrackedPartContainer
