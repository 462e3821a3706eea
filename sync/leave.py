"""Optimizer moments across a clean leave (docs/DESIGN.md, "Coverage"), a mixin of `sync.rounds.SparseSync`.

A stopping peer first replaces its record by a tombstone listing the experts it `left` (Swarm.withdraw), pokes
the peers its last view names as their likely adopters (`likely_adopters`: their readers read at once, even
between rounds, when they read only every few seconds, sync.progress), then keeps its expert exchange open for at
most `LEAVE_GRACE` seconds, until each left expert's AdamW moments went out once. The one that the adoption rule
makes the expert's next owner (Swarm.orphans_to_adopt, the same rule its round will apply) fetches the leaver's
moments at once, checks them like a join handoff (names, shapes, finite) and keeps them. When its round adopts
the expert, they go to `handed_over`, which the training loop loads (peer/node.py checks them against what AdamW
can produce); moments that arrive just after the adoption round are taken at the next one (`LATE_MOMENTS_S`).
Moments nobody adopted within `KEEP_ROUNDS` rounds are dropped. Without them an adopter starts
fresh moments, as after a death.
"""
from __future__ import annotations

import threading
import time
from typing import Iterable

import torch
from hivemind.p2p import PeerID
from hivemind.utils.logging import get_logger

from sync.swarm import PeerRecord, adoption_order

logger = get_logger(__name__)

# Seconds a leaving peer serves its moments after its tombstone: the others' readers poll every second. A stop must
# finish within 10 s (issue 12) of the signal: the grace also ends STOP_GRACE + 1 s after it (sync.rounds).
LEAVE_GRACE = 3.0
KEEP_ROUNDS = 3
LATE_MOMENTS_S = LEAVE_GRACE + 10.0  # an adopted expert's moments still arriving this long after its adoption


POKED_PER_EXPERT = 2  # likely adopters poked per left expert: the first by the rule, and the next if it had no room


def likely_adopters(records: dict[str, PeerRecord], left: Iterable[int], num_experts: int,
                    per_expert: int = POKED_PER_EXPERT) -> set[str]:
    """The peers (of `records`: the live others, as the leaver last read them) the adoption rule most likely names
    for the `left` experts that nobody else owns: the first `per_expert` with room (sync.swarm.adoption_order). A
    wrong guess costs that peer one read; a missed adopter reads the tombstone at its next read and may start
    fresh moments."""
    owned = set().union(*(r.experts for r in records.values())) if records else set()
    room = [p for p, r in records.items() if r.room(num_experts) > 0]
    chosen: set[str] = set()
    for expert in sorted(set(left) - owned):
        chosen.update(adoption_order(room, expert)[:per_expert])
    return chosen


class LeaveHandoff:
    """Both sides of the moments handoff on a clean leave (module docstring)."""

    def _init_leave_handoff(self) -> None:
        self._leave_lock = threading.Lock()
        self._left_moments: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}  # expert -> (round, moments)
        self._left_asked: set[tuple[int, str]] = set()  # (expert, leaver) already fetched or being fetched
        self._adopted_without: dict[int, float] = {}  # expert adopted before its leaver's moments came -> when

    # ---- the peers that stay --------------------------------------------------------------------------------

    def _watch_leavers(self, records: dict[str, PeerRecord]) -> None:
        """(Progress reader thread, after each read.) Fetch a leaver's moments of the experts this peer will
        adopt from it."""
        left = self.swarm.left_by()
        if not left or self.swarm.peer_id not in records:
            return
        mine = set(self.swarm.orphans_to_adopt(self.model.owned_experts, self.max_owned, records))
        with self._leave_lock:  # adopted by a round that read the tombstone before this reader did
            mine |= set(self._adopted_without)
        for expert, leavers in sorted(left.items()):
            seen = self.ownership._last_owners.get(expert, set())
            for leaver in sorted(leavers & seen):
                if expert not in mine or (expert, leaver) in self._left_asked:
                    continue
                self._left_asked.add((expert, leaver))
                threading.Thread(target=self._fetch_left_moments, args=(expert, leaver), daemon=True,
                                 name=f"spes-leave-moments-{expert}").start()

    def _fetch_left_moments(self, expert: int, leaver: str) -> None:
        tensors = self.exchange.fetch_moments(PeerID.from_base58(leaver), expert, timeout=LEAVE_GRACE)
        if tensors is None:
            return
        reason = self._moments_problem(expert, tensors)
        if reason is not None:
            self.rejects.add(reason)
            logger.warning(f"refused the optimizer moments of expert {expert} from leaving peer ...{leaver[-6:]}: "
                           f"{reason}")
            return
        with self._leave_lock:
            self._left_moments[expert] = (self.round_id, self._per_tensor_steps(expert, tensors))

    def _take_left_moments(self, adopted: Iterable[int]) -> list[int]:
        """(Round apply.) Move the kept moments of the experts just adopted to `handed_over`; drop old ones."""
        taken = []
        with self._leave_lock:
            for expert in adopted:
                if expert in self._left_moments:
                    self.handed_over[expert] = self._left_moments.pop(expert)[1]
                    taken.append(expert)
                else:
                    self._adopted_without[expert] = time.monotonic()
            for expert, (round_id, _) in list(self._left_moments.items()):
                if round_id < self.round_id - KEEP_ROUNDS:
                    del self._left_moments[expert]
        return taken

    def _take_late_moments(self) -> list[int]:
        """(Round apply.) Moments that arrived after their expert was adopted, within LATE_MOMENTS_S of the
        adoption and while this peer still owns it: a round can adopt a leaver's experts a fraction of a second
        after its tombstone, before the fetch started by the background reader is done (a lone peer's rounds
        take 0.1 s: tests/test_ops.py on a loaded machine)."""
        taken: list[int] = []
        now = time.monotonic()
        with self._leave_lock:
            pending = {e: t for e, t in self._adopted_without.items() if e in self.model.owned_experts}
            ready = sorted(e for e in pending if e in self._left_moments)
            # All of one adoption's moments at once (the training loop loads them together), unless some never come.
            waiting = [e for e, t in pending.items() if e not in self._left_moments and now - t <= LATE_MOMENTS_S]
            if ready and not waiting:
                for expert in ready:
                    self.handed_over[expert] = self._left_moments.pop(expert)[1]
                    del pending[expert]
                taken = ready
            self._adopted_without = {e: t for e, t in pending.items() if now - t <= LATE_MOMENTS_S}
        if taken:
            logger.info(f"the optimizer moments of adopted experts {taken} from their leaving owner arrived")
        return taken

    # ---- the leaving peer -----------------------------------------------------------------------------------

    def _hand_over_on_leave(self, others: bool, budget_end: float) -> None:
        """Tombstone first, then serve the left experts' moments for at most LEAVE_GRACE seconds (until each went
        out once) and never past `budget_end` (monotonic). Only a peer with moments to give and `others` (peers
        seen by its last read) to take them waits at all."""
        experts = set(self.model.owned_experts)
        deadline = min(time.monotonic() + LEAVE_GRACE, budget_end)
        if not experts or self.exchange.moments_provider is None or not others or deadline - time.monotonic() < 0.5:
            return
        self.swarm.stop_heartbeat()
        try:
            self.swarm.withdraw()
        except Exception as e:
            logger.warning(f"could not store the leave's tombstone: {e}")
            return
        adopters = likely_adopters(self.progress.others(), experts, self.model.cfg.num_experts)
        self.exchange.poke_leaving([PeerID.from_base58(p) for p in sorted(adopters)],
                                   timeout=max(0.1, min(1.0, deadline - time.monotonic() - 0.5)))
        while time.monotonic() < deadline and not experts <= self.exchange.moments_served:
            time.sleep(0.1)
        served = sorted(experts & self.exchange.moments_served)
        if served:
            logger.info(f"handed the optimizer moments of experts {served} to the peers adopting them")
