"""Which peers contribute to a round: C drawn of N (docs/DESIGN.md, "Rounds of C drawn contributions").

Every peer fetching every other peer's blob costs each peer O(N) per round. With `sync.contributors` C > 0 a
peer contributes to a round only when its ticket, a hash of (run, round, peer ID) in [0, 1), is below C / N, N
the live peers it counts; otherwise it sends nothing, aggregates the drawn peers' contributions like everyone
else, and drops what it trained in the round (keeping its codec's unsent part): `bench.lottery` measured that
dropping trains better than sending the change later, when it has drifted. About C contributions per round, so a
peer fetches about C blobs whatever N is, and every peer's work counts once in about N / C rounds.

N differs between peers' views (a record expired here, not yet there), so a receiver judges another's ticket
with slack: it waits for a peer whose ticket is below 2C / N while its record has not reached the round (it may
be drawn); a record at the round without a contribution to it says the peer was not drawn, and nobody waits for
it. A contribution whose ticket is 2C / N or more is refused (no peer can contribute every round). A peer surely
drawn, ticket < C / 2N (every peer in a view of at most C), had to deliver: only such rounds count against a
record's grace to prove itself an owner. A ticket cannot be chosen: a peer ID is its key's.

N counts only peers that are owners by deeds (sync.peer_record.credible_owners): identities that never deliver
would otherwise shrink every honest peer's chance to contribute.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sync.peer_record import OWNER_GRACE, credible_owners

if TYPE_CHECKING:
    from sync.peer_record import PeerRecord


def ticket(run_id: str, round_id: int, peer_id: str) -> float:
    """A peer's ticket for a round: the first 64 bits of sha256("{run}/{round}/{peer}") as a fraction of 2^64
    (every peer computes the same number; nobody can pick it without picking a new key)."""
    digest = hashlib.sha256(f"{run_id}/{round_id}/{peer_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64


@dataclass(frozen=True)
class Draw:
    """The ticket thresholds of one round as one peer sees it: `contributors` C (0: every peer) of `peers` N."""

    contributors: int
    peers: int

    def _below(self, factor: float) -> float:
        if self.contributors <= 0:
            return 1.0
        return min(1.0, factor * self.contributors / max(self.peers, 1))

    @property
    def drawn(self) -> float:
        """This peer contributes when its ticket is below this."""
        return self._below(1.0)

    @property
    def surely(self) -> float:
        """Another peer is drawn in any view up to twice as large as this one's (in a view of at most C peers,
        every peer): it had to deliver (count_chances)."""
        return 1.0 if self.peers <= self.contributors else self._below(0.5)

    @property
    def accepted(self) -> float:
        """Another peer's contribution counts when its ticket is below this (a view up to half this one's)."""
        return self._below(2.0)


def counted_peers(others: dict[str, "PeerRecord"], delivered: set[str], chances: dict[str, int]) -> int:
    """N for the draw: this peer and the others that are owners by deeds (credible_owners)."""
    return 1 + len(credible_owners(others, delivered, chances, OWNER_GRACE))


def count_chances(chances: dict[str, int], first_seen: dict[str, int], records: dict[str, "PeerRecord"],
                  round_id: int, surely: dict[str, bool]) -> dict[str, int]:
    """Per live record, the rounds since it was first seen in which it was surely drawn (`surely`), so had to
    deliver: what credible_owners' grace counts (every round when every peer contributes). Records no longer
    live are forgotten, so the map stays as large as the run."""
    out = {}
    for peer_id in records:
        seen = first_seen.setdefault(peer_id, round_id)
        out[peer_id] = chances.get(peer_id, 0) + int(round_id > seen and surely.get(peer_id, True))
    return out


class Drawing:
    """Mixin of SparseSync (sync/contributions.py): this round's draw. Uses `swarm`, `cfg`, `round_id`,
    `_delivered_ever`."""

    def _init_drawing(self) -> None:
        self._draw = Draw(0, 1)
        self.contributing = True  # this peer's ticket drew it for the round in progress (or the last one)
        self._chances: dict[str, int] = {}  # credible_owners' grace, counted in rounds a peer had to deliver
        self._first_seen: dict[str, int] = {}  # peer -> the round its record was first read
        self._tickets: tuple[int, dict[str, float]] = (-1, {})  # (round, peer -> ticket): polls ask many times
        self.swarm.in_drawn_key = self._in_drawn_key

    def _in_drawn_key(self, round_id: int, due_round: int | None) -> bool:
        """Whether this peer's record, at `round_id` (and due for `due_round`), goes under the drawn key while the
        roster is sharded (sync/roster.py): drawn for the next round or the one it is due for (readers outside its
        shard then wait for it), or possibly drawn for this one in another's view (below 2C / N: they then see it
        reach the round, contributing or not). Every peer while every peer contributes."""
        me, run, draw = self.swarm.peer_id, self.swarm.run_id, self._draw
        return (ticket(run, round_id, me) < draw.accepted or ticket(run, round_id + 1, me) < draw.drawn
                or (due_round is not None and ticket(run, due_round, me) < draw.drawn))

    def _ticket(self, peer_id: str) -> float:
        if self._tickets[0] != self.round_id:
            self._tickets = (self.round_id, {})
        cache = self._tickets[1]
        if peer_id not in cache:
            cache[peer_id] = ticket(self.swarm.run_id, self.round_id, peer_id)
        return cache[peer_id]

    def _decide_draw(self, others: dict[str, "PeerRecord"]) -> bool:
        """Whether this peer contributes to this round, from the records read at its start: N from this peer's
        roster shard, or the roster's estimate once it is sharded (sync/roster.py)."""
        shard = {p: r for p, r in others.items() if not r.outside}
        peers = counted_peers(shard, self._delivered_ever, self._chances)
        roster = self.swarm.roster
        if roster.level > 0:  # the swarm's estimate, less the share of the shard that is not owners by deeds
            peers = max(1, round(roster.estimate * peers / (len(shard) + 1)))
        self._draw = Draw(self.cfg.contributors, peers)
        self.contributing = self._ticket(self.swarm.peer_id) < self._draw.drawn
        return self.contributing

    def _surely_drawn(self, peer_id: str) -> bool:
        return self._ticket(peer_id) < self._draw.surely

    def _may_be_drawn(self, peer_id: str) -> bool:
        return self._ticket(peer_id) < self._draw.accepted

    def _count_chances(self, records: dict[str, "PeerRecord"]) -> dict[str, int]:
        """Update and return the grace counts from this round's records (sync.applying._adopt)."""
        surely = {p: self._surely_drawn(p) for p in records}
        self._chances = count_chances(self._chances, self._first_seen, records, self.round_id, surely)
        self._first_seen = {p: r for p, r in self._first_seen.items() if p in records}
        return self._chances
