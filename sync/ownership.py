"""Covering every expert: adopting orphaned and never-owned experts, and handing them over when a peer claims
them for good (docs/DESIGN.md, "Partitions" and "Coverage").

An expert nobody owns (its owner's record expired, or no peer ever chose it: a 3-peer swarm on a 4-expert model
trained only 3 of them) is adopted by one live peer with room under its budget (`Swarm.orphans_to_adopt`), so the
swarm trains every expert. The adopter only *takes care* of it: its record lists the expert under `caretaking`,
joiners choose such experts before replicating others (`Swarm.choose_auto`), and once another peer owns it for
good the caretaker gives it back. That also covers the owner that returns: an expired record does not mean a
dead peer (a volunteer whose link went down for a minute comes back with the same peer ID and experts). Two
rules keep ownership from doubling (or vanishing):

* a peer that sees no other peer (or no other peer's contribution) and cannot reach the run's initial peers
  is cut off, not alone: it adopts nothing (otherwise it would return owning every expert); an expert is
  adopted only when two rounds' reads in a row show it without a live owner, and a read that is visibly
  incomplete (sync.rounds) is not used, so one failed or partial DHT read (a flaky link, a NAT) cannot make a
  peer adopt the experts of live peers.
  The exception is a clean leave: the leaver's signed tombstone lists the experts it left (`left`), and the
  experts it was seen owning are adopted on the first read that shows the tombstone;
* a caretaker gives an expert back only once a peer owning it for good is seen and the two copies were averaged
  (here, or there: the new owner fetches the caretaker's copy as a co-owner) or that owner was seen the round
  before too, so neither side's training is lost.
"""
from __future__ import annotations

from typing import Iterable

from hivemind.utils.logging import get_logger

from sync.swarm import PeerRecord, Swarm

logger = get_logger(__name__)


class Ownership:
    """This peer's adoption bookkeeping; the caller applies the decisions (model ownership, publish)."""

    def __init__(self, swarm: Swarm, max_owned: int, owned: Iterable[int]):
        self.swarm, self.max_owned = swarm, max_owned
        self._last_owners: dict[int, set[str]] = {}   # expert -> its other owners when last seen owned
        # The experts this peer takes care of (adopted) -> the owners they had before (empty: never owned).
        self.adopted_from: dict[int, set[str]] = {}
        self._seen_back: set[int] = set()             # cared-for experts seen with an owner for good last round
        self._cut_off_logged = False
        self._orphaned_before: set[int] = set()      # experts the previous read showed without a live owner

    def observe(self, records: dict[str, PeerRecord]) -> None:
        """Remember who owned what (records of a round, this peer's included)."""
        owners: dict[int, set[str]] = {}
        for peer_id, record in records.items():
            if peer_id != self.swarm.peer_id:
                for expert in record.experts:
                    owners.setdefault(expert, set()).add(peer_id)
        self._last_owners.update(owners)  # an orphan keeps the owners it had: that is whom it is given back to

    def to_adopt(self, owned: Iterable[int], records: dict[str, PeerRecord], cut_off: bool) -> list[int]:
        """Orphans this peer adopts now; none while it is `cut_off` (it saw no other peer and the run's initial
        peers did not answer: Swarm.reachable, asked by the round's background thread)."""
        owned = set(owned)
        orphaned = set(self.swarm.orphans_to_adopt(owned, self.max_owned, records))
        # A clean leave's signed tombstone is positive evidence, which a partial read cannot fake: its experts
        # are adopted on this read. Only those the leaver was seen owning (a peer can only give up its own).
        left = {e for e, peers in self.swarm.left_by().items() if peers & self._last_owners.get(e, set())}
        adopt = sorted(orphaned & (self._orphaned_before | left))
        self._orphaned_before = orphaned
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

    def care_for(self, experts: Iterable[int]) -> None:
        """Take care of `experts` without adoption's two reads (a run's first peer, alone at its start)."""
        for expert in experts:
            self.adopted_from.setdefault(expert, set())

    @property
    def caretaking(self) -> list[int]:
        return sorted(self.adopted_from)

    def to_release(self, owned: Iterable[int], records: dict[str, PeerRecord], averaged: Iterable[int]) -> list[int]:
        """Cared-for experts that another live peer now owns for good (it chose them, or it is their returning
        owner), and that this round averaged with its copy or whose owner was there the round before too; this
        peer gives them back. Experts it owns for good itself are never given away here."""
        averaged, owned = set(averaged), set(owned)
        for expert in [e for e in self.adopted_from if e not in owned]:
            del self.adopted_from[expert]  # already gone (rebalanced away, or ownership reset)
        back: dict[int, str] = {}
        for expert in self.adopted_from:
            owners = sorted(p for p, r in records.items() if p != self.swarm.peer_id and r.owns_for_good(expert))
            if not owners:
                self._seen_back.discard(expert)
            elif expert in averaged or expert in self._seen_back:
                back[expert] = owners[0]
            else:
                # Seen for the first time, and its copy was not accepted here (after a long cut the two copies
                # may differ more than one round explains): give it back next round; the new owner fetches this
                # peer's copy as a co-owner this round, so this peer's training on it is kept there.
                self._seen_back.add(expert)
        if not back or not owned - set(back):
            return []  # never down to no expert at all (honest records cannot cause it; a guard against lies)
        for expert, peer_id in back.items():
            del self.adopted_from[expert]
            self._seen_back.discard(expert)
            logger.info(f"giving expert {expert} back to peer ...{peer_id[-6:]}: it owns it for good now")
        return sorted(back)
