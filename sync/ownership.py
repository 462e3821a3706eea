"""Adopting orphaned experts, and giving them back when their owner returns (docs/DESIGN.md, "Partitions").

An expert whose owner's record expired is adopted by one live peer (`Swarm.orphans_to_adopt`), so the swarm keeps
training it. An expired record does not mean a dead peer, though: a volunteer whose link went down for a minute
comes back with the same peer ID and the same experts. Two rules keep ownership from doubling (or vanishing):

* a peer that sees no other peer at all and cannot reach the run's initial peers is cut off, not alone: it
  adopts nothing (otherwise it would return owning every expert);
* an adopter remembers whom it adopted an expert from; once that peer is back claiming it and the two copies
  were averaged (here, or there: the returned owner fetches the adopter's copy as a co-owner), it gives the
  expert back, so neither side's training is lost.
"""
from __future__ import annotations

from typing import Iterable

from hivemind.utils.logging import get_logger

from sync.swarm import PeerRecord, Swarm

logger = get_logger(__name__)


class Ownership:
    """This peer's adoption bookkeeping; the caller applies the decisions (set_owned, publish)."""

    def __init__(self, swarm: Swarm, max_owned: int, owned: Iterable[int]):
        self.swarm, self.max_owned = swarm, max_owned
        # Experts seen with an owner: only these are adopted when orphaned (see Swarm.orphans_to_adopt).
        self.seen_owned: set[int] = set(owned)
        self._last_owners: dict[int, set[str]] = {}   # expert -> its other owners when last seen owned
        self.adopted_from: dict[int, set[str]] = {}   # expert -> the owners it had before this peer adopted it
        self._seen_back: set[int] = set()             # adopted experts whose previous owner was back last round
        self._cut_off_logged = False

    def observe(self, records: dict[str, PeerRecord]) -> None:
        """Remember who owned what (records of a round, this peer's included)."""
        owners: dict[int, set[str]] = {}
        for peer_id, record in records.items():
            if peer_id != self.swarm.peer_id:
                for expert in record.experts:
                    owners.setdefault(expert, set()).add(peer_id)
        self.seen_owned |= set(owners)
        self._last_owners.update(owners)  # an orphan keeps the owners it had: that is whom it is given back to

    def to_adopt(self, owned: Iterable[int], records: dict[str, PeerRecord], cut_off: bool) -> list[int]:
        """Orphans this peer adopts now; none while it is `cut_off` (it saw no other peer and the run's initial
        peers did not answer: Swarm.reachable, asked by the round's background thread)."""
        owned = set(owned)
        adopt = self.swarm.orphans_to_adopt(owned, self.max_owned, records, self.seen_owned)
        if not adopt:
            return []
        if cut_off:
            if not self._cut_off_logged:
                logger.warning(f"no other peer visible and the run's initial peers do not answer: this peer is cut "
                               f"off, not alone; it keeps its experts and adopts none of {adopt}")
                self._cut_off_logged = True
            return []
        self._cut_off_logged = False
        for expert in adopt:
            self.adopted_from[expert] = set(self._last_owners.get(expert, ()))
        return adopt

    def to_release(self, owned: Iterable[int], records: dict[str, PeerRecord], averaged: Iterable[int]) -> list[int]:
        """Adopted experts whose previous owner is back claiming them, and that this round averaged with its copy
        or whose owner was back the round before too; this peer gives them back. Experts it owned before adopting
        are never given away here."""
        averaged, owned = set(averaged), set(owned)
        for expert in [e for e in self.adopted_from if e not in owned]:
            del self.adopted_from[expert]  # already gone (rebalanced away, or ownership reset)
        back: dict[int, str] = {}
        for expert, previous in self.adopted_from.items():
            returned = sorted(p for p in previous if p in records and expert in records[p].experts)
            if not returned:
                self._seen_back.discard(expert)
            elif expert in averaged or expert in self._seen_back:
                back[expert] = returned[0]
            else:
                # Seen back for the first time, and its copy was not accepted here (after a long cut the two copies
                # may differ more than one round explains): give it back next round; the returned owner fetches
                # this peer's copy as a co-owner this round, so this peer's training on it is kept there.
                self._seen_back.add(expert)
        if not back or not owned - set(back):
            return []  # never down to no expert at all (honest records cannot cause it; a guard against lies)
        for expert, peer_id in back.items():
            del self.adopted_from[expert]
            self._seen_back.discard(expert)
            logger.info(f"giving expert {expert} back to peer ...{peer_id[-6:]}: it is back and owns it again")
        return sorted(back)
