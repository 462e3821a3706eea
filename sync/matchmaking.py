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

A member that is not in the group answers the leader's parts at once (`could_join`, `LeaverAwareRunner`). hivemind's
averager holds a part for a group id it does not know until it registers a group of its own (the go may come after
the leader's first part), which for a member that had left, or whose join stream broke before it read ACCEPTED
(seen in tests/test_netns.py: the leader counted it in, it never knew), is its next round: the leader waited its
sender timeout twice, 20 s, and lost the round. Such a part is now refused (BAD_GROUP_ID) as soon as this averager
can no longer be in that group: no join request of its own is awaiting an answer and it formed no group of that id.
The leader then stops waiting for that member's parts too, as hivemind does for a sender that never started.

Why a join stream broke: a stream handler that returns right after its last answer lets p2pd reset the stream,
which can overtake the answers in flight. The leader's join handler now keeps the stream open until the asking
peer closes it (`linger_after_answers`).
"""
from __future__ import annotations

import asyncio
import collections
import functools
from typing import Any, AsyncIterator, Mapping

from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.averaging.partition import TensorPartContainer
from hivemind.proto import averaging_pb2
from hivemind.utils.logging import get_logger

logger = get_logger(__name__)

# How often a part for a group not (yet) known here looks again whether it may still be this averager's.
GROUP_POLL_S = 0.05
# How long a refused sender's remaining parts are read (and dropped) while it learns the answer (`drain`).
DRAIN_S = 5.0
# How long a join request's stream stays open after its last answer, for the asking peer to close it first
# (`linger_after_answers`); it does so as soon as it read them.
ANSWER_LINGER_S = 10.0
NOT_IN_GROUP = averaging_pb2.MessageCode.Name(averaging_pb2.BAD_GROUP_ID)


class PatientMatchmaking(Matchmaking):
    """Matchmaking whose accepted followers wait `begin_grace` s longer for BEGIN_ALLREDUCE."""

    def __init__(self, *args, begin_grace: float, **kwargs):
        self.begin_grace = float(begin_grace)
        self.asking = 0  # join requests of this averager still talking to a leader
        self.formed: collections.deque[bytes] = collections.deque(maxlen=8)  # ids of groups formed here, newest last
        super().__init__(*args, **kwargs)

    def could_join(self, group_id: bytes) -> bool:
        """Whether a part for `group_id` may belong to a group of this averager that it does not know yet: one it
        formed (its registration waits for the step's trigger), or one whose go is still on its way (a join request
        is awaiting a leader's answers: the leader may have started its all-reduce before its go arrived here)."""
        return self.asking > 0 or group_id in self.formed

    async def _request_join_group(self, leader):
        self.asking += 1
        try:
            return await super()._request_join_group(leader)
        finally:
            self.asking -= 1

    async def leader_assemble_group(self):
        group_info = await super().leader_assemble_group()
        self.formed.append(group_info.group_id)
        return group_info

    async def follower_assemble_group(self, leader, msg):
        group_info = await super().follower_assemble_group(leader, msg)
        self.formed.append(group_info.group_id)
        return group_info

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


async def could_be_in(averager: Any, group_id: bytes, patience: float) -> bool:
    """(Averager process, a part arriving) False once the group `group_id` cannot be `averager`'s: not registered
    and not `could_join` (at most `patience` seconds: the sender gives up by then anyway). True when registered, or
    when hivemind's own matchmaking is in use (nothing known: hivemind's wait applies)."""
    matchmaking = getattr(averager, "_matchmaking", None)
    if not isinstance(matchmaking, PatientMatchmaking):
        return True
    deadline = asyncio.get_running_loop().time() + patience
    while group_id not in averager._running_groups:
        if not matchmaking.could_join(group_id) or asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(GROUP_POLL_S)
    return True


async def linger_after_answers(answers: AsyncIterator) -> AsyncIterator:
    """A join request's answers (ACCEPTED and BEGIN_ALLREDUCE, or a refusal), then its stream kept open until the
    asking peer closes it (hivemind then cancels this handler), at most ANSWER_LINGER_S.

    A handler that returns right after its last message closes its end at once, and p2pd then resets the stream;
    the reset can overtake the messages still in flight, and the asking peer reads an empty stream. Over a
    100 Mbit/s tc-tbf link between two namespaces with bulk transfers beside them, 11 of 14,000 two-message
    answers of a plain hivemind stream handler arrived empty (0 of 14,000 with this wait). A leader that had accepted a
    follower so assembled its group with a member that never knew (tests/test_netns.py: about once in 450 rounds
    between two public peers). hivemind's follower reads the answers it needs and closes the stream at once."""
    async for answer in answers:
        yield answer
    await asyncio.sleep(ANSWER_LINGER_S)


async def drain(stream: Any, seconds: float = DRAIN_S) -> None:
    """Read and drop what a sender still writes to `stream` until it closes it (at most `seconds`). A handler that
    answers and returns at once closes its end while the sender still writes its parts: the stream is then reset
    and the answer lost with it (the leader read BrokenPipeError or ConnectionResetError instead of BAD_GROUP_ID in
    2 of 5 split rounds of tests/test_matchmaking.py, and waited its sender timeout). A sender that read the answer
    stops writing and closes its end."""
    async def read_all() -> None:
        async for _ in stream:
            pass
    try:
        await asyncio.wait_for(read_all(), timeout=seconds)
    except Exception as e:  # timed out, or the stream broke: either way there is nothing more to wait for
        logger.debug(f"stopped reading a refused sender's stream: {e!r}")


class LeaverAwareRunner(AllReduceRunner):
    """hivemind's AllReduceRunner that stops waiting for the parts of a member that answered it is not in the group.

    hivemind marks such a member's reducer failed (this peer keeps its own values for that part) but its reducer
    still waits for that member's parts until the sender timeout; a member that is not in the group sends none."""

    async def _communicate_with_peer(self, peer_id):
        try:
            await super()._communicate_with_peer(peer_id)
        except AllreduceException as e:
            # hivemind 1.1.12 says so only in the message: "{peer} sent BAD_GROUP_ID".
            if str(e).endswith(f"sent {NOT_IN_GROUP}") and peer_id in self.sender_peer_ids:
                logger.debug(f"{peer_id} is not in group {self.group_id.hex()[:8]}: not waiting for its parts")
                await self._ban_sender(peer_id)
            raise


def install_group_forming(begin_grace: float) -> None:
    """Make the averagers of *this process* use PatientMatchmaking, TrackedPartContainer and LeaverAwareRunner
    (call inside the averager process before its run loop starts: it is a forked process of its own)."""
    import hivemind.averaging.allreduce as allreduce_module
    import hivemind.averaging.averager as averager_module

    averager_module.Matchmaking = functools.partial(PatientMatchmaking, begin_grace=begin_grace)
    averager_module.AllReduceRunner = LeaverAwareRunner
    allreduce_module.TensorPartContainer = TrackedPartContainer
