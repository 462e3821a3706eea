"""hivemind's matchmaking with a follower that waits longer for its leader's go (docs/DESIGN.md, "A late go").

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
"""
from __future__ import annotations

import functools

from hivemind.averaging.matchmaking import Matchmaking


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


def install_patient_matchmaking(begin_grace: float) -> None:
    """Make the averagers created in *this process* use PatientMatchmaking (call inside the averager process,
    before its run loop creates the matchmaking: it is a forked process of its own)."""
    import hivemind.averaging.averager as averager_module

    averager_module.Matchmaking = functools.partial(PatientMatchmaking, begin_grace=begin_grace)
