"""What one peer publishes about itself in the run's DHT (docs/DESIGN.md, "DHT records"), parsed defensively,
and the swarm's round as one liar cannot move it. The records' signed schema is sync/records.py's; the
swarm that reads and writes them is sync/swarm.py's."""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any, Iterable

from sync.aggregate import Announcement
from sync.roster import MAX_ESTIMATE, MAX_LEVEL
from sync.records import MAX_ROUND, MAX_STEP, MAX_TOKENS, is_contrib, is_due, is_origin, is_synced
from sync.settings import is_fingerprint


@dataclass
class PeerRecord:
    """What one peer publishes about itself."""

    peer_id: str
    experts: list[int]
    round: int = 0
    step: int = 0
    tokens: int = 0
    ticket: bytes = b""  # closed runs: the organizer's ticket for this peer ID (sync.admission)
    # The most experts this peer may own (its sync.max_experts_per_peer; 0: not published, any number), and the
    # owned experts it only takes care of until another peer takes them over (sync.ownership).
    budget: int = 0
    caretaking: list[int] = field(default_factory=list)
    # It completed its fixed-length run and left (Swarm.finish): not a live peer, and its experts are not
    # adopted by the peers still running (they finish soon too; adopting would only grow their memory).
    finished: bool = False
    # A joiner choosing experts (--experts auto), before it owns any: the experts it means to take (Swarm.
    # choose_auto). Published only while `experts` is empty; readers count it like ownership when it beats them.
    claims: list[int] = field(default_factory=list)
    # [machine, PID, start ms] of the process that publishes it (process_origin): a restarted peer tells its own
    # crashed predecessor's record from a live duplicate at once when both ran on the same machine
    # (live_elsewhere), and of two live processes with one identity the later start gives way (Swarm.peers).
    origin: list = field(default_factory=list)
    # A clean leave's tombstone (experts empty): the experts it owned until then. The peers that saw it own them
    # adopt them on this one read instead of two (sync.ownership), so a leave is covered within one round.
    left: list[int] = field(default_factory=list)
    # [round, DHT time]: when this peer expects to be ready to start that round (sync.schedule: the others keep
    # training until the last of them is, so a round's contributions are announced together). Empty: no estimate.
    due: list = field(default_factory=list)
    # Its newest contribution: [round, size, sha256 hex, weight, experts]; the
    # one before it (`prev`, same form, an older round: a peer still gathering that round, behind this one,
    # still finds it); and [round, digest] of its synchronized tensors after it applied a round
    # (sync/contributions.py).
    contrib: list = field(default_factory=list)
    prev: list = field(default_factory=list)
    synced: list = field(default_factory=list)
    cfg: str = ""  # fingerprint of its run settings (sync/settings.py); "" = not published
    lvl: int = 0  # the roster level it reads at (sync/roster.py): where a joiner finds the swarm
    est: int = 0  # N as its own last shard read counted it (sync/roster.py: readers take the median of these)
    # Not published: this reader found the record only under the drawn key, outside its own shard (sync/roster.py).
    # It counts for the round (waits, fetches), not for coverage or N, which are judged from the shard.
    outside: bool = field(default=False, compare=False)

    def announcement(self, round_id: int | None = None) -> Announcement | None:
        """Its contribution to `round_id` (default: its newest) as sync.aggregate reads it; None: none announced
        for that round."""
        for entry in (self.contrib, self.prev):
            if entry and (round_id is None or entry[0] == round_id):
                r, size, digest, weight, experts = entry
                return Announcement(r, size, digest, weight, tuple(experts))
        return None

    def to_value(self) -> dict[str, Any]:
        value = {"experts": list(self.experts), "round": self.round, "step": self.step, "tokens": self.tokens}
        if self.ticket:
            value["ticket"] = self.ticket
        if self.budget:
            value["budget"] = self.budget
        caretaking = sorted(set(self.caretaking) & set(self.experts))
        if caretaking:
            value["caretaking"] = caretaking
        if self.finished:
            value["finished"] = True
        if self.claims and not self.experts:
            value["claims"] = sorted(self.claims)
        if self.origin:
            value["origin"] = list(self.origin)
        if self.left and not self.experts:
            value["left"] = sorted(self.left)
        if self.due:
            value["due"] = [int(self.due[0]), float(self.due[1])]
        if self.contrib:
            value["contrib"] = list(self.contrib)
        if self.prev:
            value["prev"] = list(self.prev)
        if self.synced:
            value["synced"] = list(self.synced)
        if self.cfg:
            value["cfg"] = self.cfg
        if self.lvl:
            value["lvl"] = self.lvl
        if self.est:
            value["est"] = self.est
        return value

    def room(self, num_experts: int) -> int:
        """How many more experts this peer may own."""
        return (self.budget or num_experts) - len(self.experts)

    def owns_for_good(self, expert: int) -> bool:
        """It owns `expert` and is not merely taking care of it."""
        return expert in self.experts and expert not in self.caretaking

    @classmethod
    def from_value(cls, peer_id: str, value: Any, num_experts: int) -> "PeerRecord | None":
        """Parse a DHT value written by another peer; None if it is malformed or out of range."""
        if not isinstance(value, dict):
            return None
        experts, counters = value.get("experts"), [value.get(k, 0) for k in ("round", "step", "tokens")]
        if not isinstance(experts, list) or len(experts) > num_experts:
            return None
        if not all(isinstance(e, int) and not isinstance(e, bool) and 0 <= e < num_experts for e in experts):
            return None
        bounds = (MAX_ROUND, MAX_STEP, MAX_TOKENS)
        if not all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c <= b for c, b in zip(counters, bounds)):
            return None
        ticket = value.get("ticket", b"")
        budget, caretaking = value.get("budget", 0), value.get("caretaking", [])
        if not (type(budget) is int and 0 <= budget <= num_experts) or not isinstance(caretaking, list):
            return None
        if not all(type(e) is int and e in experts for e in caretaking):
            return None
        claims = value.get("claims", [])
        if not isinstance(claims, list) or not all(type(e) is int and 0 <= e < num_experts for e in claims):
            return None
        origin = value.get("origin", [])
        if origin and not is_origin(origin):
            return None
        left = value.get("left", [])
        if not isinstance(left, list) or not all(type(e) is int and 0 <= e < num_experts for e in left) or (
                left and experts):
            return None
        due = value.get("due", [])
        if due and not is_due(due):
            return None
        contrib, prev, synced = value.get("contrib", []), value.get("prev", []), value.get("synced", [])
        if (contrib and not is_contrib(contrib, num_experts)) or (synced and not is_synced(synced)):
            return None
        if prev and not (contrib and is_contrib(prev, num_experts) and prev[0] < contrib[0]):
            return None
        cfg, lvl, est = value.get("cfg", ""), value.get("lvl", 0), value.get("est", 0)
        if (cfg and not is_fingerprint(cfg)) or not (type(lvl) is int and 0 <= lvl <= MAX_LEVEL):
            return None
        if not (type(est) is int and 0 <= est <= MAX_ESTIMATE):
            return None
        return cls(peer_id, sorted(set(experts)), *counters, ticket=ticket if isinstance(ticket, bytes) else b"",
                   budget=budget, caretaking=sorted(set(caretaking)),
                   finished=value.get("finished") is True, claims=sorted(set(claims)), origin=list(origin),
                   left=sorted(set(left)), due=[due[0], float(due[1])] if due else [],
                   contrib=[*contrib[:4], sorted(contrib[4])] if contrib else [],
                   prev=[*prev[:4], sorted(prev[4])] if prev else [], synced=list(synced), cfg=cfg, lvl=lvl, est=est)


def median_round(records: Iterable[PeerRecord]) -> int | None:
    """The swarm's round as a liar cannot move it: the lower median of the records' rounds (None if none).

    One peer claiming a huge (or tiny) round shifts the median by at most one position among honest values,
    and with two records the lower median is the smaller one, so a lone liar can never make the honest peer
    jump ahead. The max, used before, let one record of round 2**62 move every peer (issue 9)."""
    rounds = sorted(r.round for r in records)
    return rounds[(len(rounds) - 1) // 2] if rounds else None


def proven_round(records: dict[str, "PeerRecord"], delivered: set[str]) -> int | None:
    """The swarm's round by deeds: the lower median round of the peers whose contributions this peer received
    (`delivered`), None if none of them is in `records`. A record that never delivered anything (a ghost claiming
    the highest round + 3) does not move this peer's round or make it re-download (docs/DESIGN.md "Round
    agreement"). Before any contribution arrived (a joiner that fell behind before its first), the records that
    announce a contribution count: otherwise such a peer would never learn that it is behind, while identities
    that only claim (eight ghosts beside three honest peers) would still outvote the honest rounds."""
    if delivered:
        return median_round(r for p, r in records.items() if p in delivered)
    return median_round(r for r in records.values() if r.contrib)


# Rounds a new record may claim experts (surely drawn ones, sync.draw) before a contribution of it must have
# arrived (credible_owners).
OWNER_GRACE = 3


def unserved_claimants(records: dict[str, "PeerRecord"], first_seen: dict[str, int], swarm_round: int | None,
                       grace: int = OWNER_GRACE, contributors: int = 0) -> set[str]:
    """For an observer that fetches nothing (the bootstrap node): the records that claim experts and have never
    announced a contribution although the swarm's round moved `grace` rounds since they were first seen
    (`first_seen`: peer -> swarm round then); with the run's `sync.contributors` C below the N records, `grace`
    times N / C rounds (a peer is drawn about once in N / C, sync/draw.py). A ghost that also forges announcements
    shows only to the peers that fail to fetch them (credible_owners, spes_unserved_claims)."""
    if swarm_round is None:
        return set()
    if 0 < contributors < len(records):
        grace = grace * -(-len(records) // contributors)
    return {p for p, r in records.items()
            if r.experts and not r.contrib and swarm_round - first_seen.get(p, swarm_round) >= grace}


def credible_owners(records: dict[str, "PeerRecord"], delivered: set[str], chances: dict[str, int],
                    grace: int) -> dict[str, "PeerRecord"]:
    """The records that count as owners for coverage and hand-back: of peers whose contributions this peer
    received, or that had at most `grace` rounds to deliver one since first seen (`chances`: rounds in which they
    were surely drawn, sync.draw; a joiner's first contribution is still on its way). A record that claims experts
    for longer without delivering any is a claim, not an owner."""
    return {p: r for p, r in records.items() if p in delivered or chances.get(p, 0) <= grace}


def process_origin(started: float | None = None) -> list:
    """[machine, PID] of this process, and [.., start ms] with `started` (DHT time): the machine is a hash of the
    boot ID and the PID namespace (PIDs are only comparable within both; two containers on one host differ), so
    nothing about the host is published."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return []  # not Linux: no fast path, the watch decides
    origin = [hashlib.sha256(f"{boot}:{namespace}".encode()).hexdigest()[:16], os.getpid()]
    return origin if started is None else origin + [int(started * 1000)]


def twin_started_first(theirs: list, mine: list) -> bool:
    """Of two live processes publishing under one peer ID, did the one of origin `theirs` start first (so the
    one of `mine` gives way)? By start time, then by origin: every process decides the same. False when either
    origin lacks a start time."""
    if len(theirs) != 3 or len(mine) != 3:
        return False
    return (theirs[2], theirs[0], theirs[1]) < (mine[2], mine[0], mine[1])
