"""Joining a run's DHT and keeping expert ownership in it (docs/DESIGN.md, "The method" and "Coverage").

Each peer stores one record under the run's key `{run_id}_peers`, subkey = its peer ID, value = the experts it
owns plus its progress, with an expiration; a heartbeat thread refreshes it. These records are the only
swarm-wide state: coverage (who owns what), live peers, and the round counter are all read from them.
Values in the DHT are msgpack (hivemind's serializer), never pickle. Every DHT node started here runs
`sync.records.RunRecordValidator`: a peer's record is signed by that peer's libp2p identity key, schema-checked
and time-bounded, so nobody can write, replace or tombstone another peer's record (docs/DESIGN.md, "Hostile
peers"). Readers still parse defensively and derive the swarm's round from the median of live records, never
the max, so one liar cannot move it.
"""
from __future__ import annotations

import hashlib
import os
import functools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import hivemind
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.logging import get_logger

from sync.records import peers_key, revoked_key
from sync.roster import MAX_LEVEL, Roster, drawn_key, parse_cached, parse_drawn
from sync.peer_record import PeerRecord, median_round, process_origin, twin_started_first  # noqa: F401 (API)
from sync.dht import read_latest, store_record
from sync.dht import SwarmError, busy_tcp_port, start_dht, start_dht_node  # noqa: F401 (the swarm's API)
from sync.reach import PING_TIMEOUT, dht_neighbours, ping_maddrs
from sync.run_settings import RunSettings
from sync.settings import SETTINGS_LIFETIME, fingerprint

logger = get_logger(__name__)

REJOIN_TIMEOUT = 1.5  # seconds per connect / ping of an initial peer while cut off (retried every poll)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


def least_covered(coverage: dict[int, int], count: int, peer_id: str = "") -> list[int]:
    """The `count` experts with the fewest owners. Ties are broken by a hash of (peer ID, expert): deterministic,
    yet peers that join at the same moment (seeing the same coverage) mostly pick different experts."""
    return sorted(coverage, key=lambda e: (coverage[e], adoption_rank(peer_id, e)))[:count]


def adoption_rank(peer_id: str, expert: int) -> bytes:
    # Every peer evaluates the same rule on the same records, so one peer (not all of them) adopts an orphan.
    return hashlib.sha256(f"{peer_id}:{expert}".encode()).digest()


def adoption_order(candidates: Iterable[str], expert: int) -> list[str]:
    """`candidates` (peers with room) in the order the adoption rule prefers them for an ownerless `expert`: the
    first adopts it (Swarm.orphans_to_adopt); a leaver pokes the first few (sync.leave.likely_adopters)."""
    return sorted(candidates, key=lambda p: adoption_rank(p, expert))


@dataclass
class Swarm(RunSettings):
    """One peer's membership in a run: its DHT node, its ownership record and a heartbeat."""

    dht: hivemind.DHT
    run_id: str
    num_experts: int
    ttl: float = 30.0
    ticket: bytes = b""   # closed runs: this peer's organizer ticket, carried in its record
    admission: Any = None  # closed runs: sync.admission.Admission (revoked peers are not read)
    # Full multiaddrs of the run's initial peers: where this peer re-joins the DHT after its link came back.
    initial_peers: Sequence[str] = ()
    # The settings every peer of the run must share (sync/settings.py; built by peer/), None: not checked.
    settings: Mapping[str, Any] | None = None
    shard: int = 0  # sync.roster_shard: records per roster shard (sync/roster.py); 0: one key
    record: PeerRecord = field(init=False)

    def __post_init__(self) -> None:
        self.peer_id = str(self.dht.peer_id)
        self.key = peers_key(self.run_id)
        # A shard covers every expert by itself (sync/roster.py): at least 2E records, so even peers owning one
        # expert each can give every expert two owners in it. 0: sharding off.
        self.roster = Roster(self.run_id, self.peer_id, max(self.shard, 2 * self.num_experts) if self.shard else 0,
                             settle=self.ttl / 3 + 1.0)
        # Set by the rounds (sync/draw.py): whether this peer's record (round, due round) also goes under the
        # drawn key while the roster is sharded (sync/roster.py).
        self.in_drawn_key: Callable[[int, int | None], bool] | None = None
        self._drawn: dict[str, tuple[float, PeerRecord | None]] = {}  # the drawn key's parsed records (see _parsed)
        self.record = PeerRecord(self.peer_id, [], ticket=self.ticket, origin=process_origin(get_dht_time()),
                                 cfg=fingerprint(self.settings) if self.settings else "")
        self._settings_stored_at = -float("inf")
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._cut_off_since: float | None = None  # monotonic time the DHT routing table was first seen empty
        self.rejoined_at = -float("inf")  # monotonic time of the last re-join (rejoin_if_cut_off)
        self._rejoin_lock = threading.Lock()  # the heartbeat and the progress reader both check
        self._finished_experts: set[int] = set()  # see peers() and finish()
        self._claims: dict[str, list[int]] = {}  # other joiners' claims seen by the last read (choose_auto)
        # The last read's parsed records by subkey, (expiration, record or None): a record changes every ttl / 3,
        # so a thousand identities' records cost a lookup each per read, not a parse (callers never change them).
        self._parsed: dict[str, tuple[float, PeerRecord | None]] = {}
        self._left: dict[int, set[str]] = {}  # expert -> peers whose clean-leave tombstone the last read showed
        self.withdrawn = False  # its tombstone is stored (a leaving peer: sync.leave stores it before the rest)
        # The origin of another live process that publishes under this peer ID and started first (the same
        # identity file twice): this one gives way, touching that record no more (peers(), _check_twin).
        self.twin: list | None = None
        self._stored_expiration = 0.0  # of this peer's latest record store

    def visible_maddrs(self) -> list[str]:
        return [str(m) for m in self.dht.get_visible_maddrs()]

    def on_its_own(self) -> bool:
        """Started without initial peers, listening on loopback only (the offline default): nobody else can
        join, so its log says nothing about other peers."""
        loopback = ("/ip4/127.", "/ip6/::1/")
        return not self.initial_peers and all(m.startswith(loopback) for m in self.visible_maddrs())

    # ---- records ------------------------------------------------------------------------------------------

    def publish(self, wait: bool = True, **changes: Any) -> None:
        """Update and store this peer's record (experts / round / step / tokens). `wait=False`: the record is
        updated now and its store goes out without waiting for the replicas' answers (a round's announcement: a
        DHT node that went away costs each store a request timeout, which must not stretch the round)."""
        with self._lock:
            for name, value in changes.items():
                setattr(self.record, name, sorted(value) if name in ("experts", "caretaking") else value)
            value = self.record.to_value()
            # Taken under the lock: of two publishes racing (the round's start, the heartbeat, sync.schedule's
            # estimate), the value built last expires last, and the DHT keeps the latest expiration.
            expiration = get_dht_time() + self.ttl
            if self.twin is not None:
                return  # the record under this peer ID is the other process's
            self._stored_expiration = max(self._stored_expiration, expiration)
        if not wait:  # the heartbeat stores it again within ttl / 3 if this one fails
            self._store_future(value, expiration)
            return
        try:
            self._store(value, expiration)
        except TimeoutError:  # the heartbeat stores it again within ttl / 3
            logger.warning("storing this peer's record timed out; the heartbeat retries")

    def withdraw(self) -> None:
        """Remove this peer's record now (a clean leave: others adopt its experts without waiting for expiry)."""
        # The DHT keeps the value with the latest expiration per subkey, so the tombstone (an empty expert
        # list, which readers skip) must expire later than the record it replaces.
        with self._lock:
            self.record.left, self.record.experts = list(self.record.experts), []
            value = self.record.to_value()
        self._store(value, get_dht_time() + self.ttl + 1.0)
        self.withdrawn = True

    def finish(self) -> None:
        """Leave after completing a fixed-length run: the record stays, marked finished, for one more ttl. The
        others stop counting this peer at once, and remember that its experts' owner finished rather than
        died, so they do not adopt them (peers())."""
        with self._lock:
            self.record.finished = True
            value = self.record.to_value()
        self._store(value, get_dht_time() + self.ttl + 1.0)  # outlives the live record it replaces

    def finished_experts(self) -> set[int]:
        """Experts whose last owner seen finished its run and that no live peer owns since."""
        with self._lock:
            return set(self._finished_experts)

    def remember_finished(self, experts: Iterable[int]) -> None:
        """Add to finished_experts() (a restarted peer's memory of it, sync/durable.py)."""
        with self._lock:
            self._finished_experts |= set(experts)

    def _store(self, value: dict[str, Any], expiration: float, timeout: float = 15.0) -> bool:
        """Store this peer's record, bounded: a DHT process that died or hangs must not hang the heartbeat or
        the shutdown. Nothing once a twin started first (the record under this peer ID is the other process's)."""
        if self.twin is not None:
            return False
        return bool(self._store_future(value, expiration).result(timeout=timeout))

    def _store_future(self, value: dict[str, Any], expiration: float) -> Any:
        """Store this peer's record under every key it belongs to now (sync/roster.py; one lookup for them all),
        without waiting: a future of whether every key was stored."""
        record = self.record  # the drawn key only matters while sharded: no tickets hashed on every store otherwise
        drawn = self.roster.sharded() and self.in_drawn_key is not None and self.in_drawn_key(
            record.round, record.due[0] if record.due else None)
        # Routes kept for a heartbeat's period: the heartbeat looks the keys up again about as often as it stores
        # (sync.hivemind_private.store_near), the round's and the due estimate's stores between two do not.
        return store_record(self.dht, self.roster.store_keys(drawn), self.peer_id, value, expiration,
                            return_future=True, route_ttl=self.ttl / 3)

    def _store_at(self, key: str, subkey: str, value: Any, expiration: float, timeout: float = 15.0) -> bool:
        future = store_record(self.dht, key, subkey, value, expiration, return_future=True)
        return bool(future.result(timeout=timeout))

    def peers(self, drawn: bool = True) -> dict[str, PeerRecord]:
        """Live peers' records (ours included once published): this peer's roster shard, and the drawn peers
        outside it marked `outside` (sync/roster.py; `drawn=False`: the shard alone, as the progress reader reads
        between rounds). A read at a level the shard says is wrong is read again at the right one (a joiner finds
        the swarm's level within MAX_LEVEL + 1 reads)."""
        visited: set[int] = set()
        key = drawn_key(self.run_id)
        outside: dict[str, PeerRecord] = {}
        for _ in range(MAX_LEVEL + 1):
            # The drawn key is read in parallel with the shard while sharded.
            future = read_latest(self.dht, key, return_future=True) if drawn and self.roster.sharded() else None
            level, shard_key = self.roster.read_key()
            records = self._read_shard(read_latest(self.dht, shard_key))
            if future is None and drawn and self.roster.probes(len(records) - (self.peer_id in records)):
                future = read_latest(self.dht, key, return_future=True)
            counts = None  # the drawn peers' counts: drawn by ticket, a sample of the whole swarm
            if future is not None:
                found = future.result()
                revoked = self.revoked() if self.admission is not None and found is not None else set()
                outside, self._drawn = parse_drawn(found, self._drawn, self.peer_id, self.num_experts, revoked)
                counts = [r.est for r in outside.values() if r.est]
            moved = self.roster.update(level, len(records), counts, [r.lvl for r in outside.values()], visited)
            if self.roster.level != level and self.withdrawn is False and self.record.experts:
                self.publish(wait=False)  # at its new levels at once: the others reading there count it
            if not moved:
                break
        if self.roster.shard:  # unsharded runs publish the records they always did
            with self._lock:
                self.record.lvl, self.record.est = self.roster.level, self.roster.count
        return {**{p: r for p, r in outside.items() if p not in records}, **records}

    def _read_shard(self, found: Any) -> dict[str, PeerRecord]:
        """The live records of one read of this peer's shard; also notes finished experts, claims and clean
        leaves (finished_experts, choose_auto, left_by)."""
        records: dict[str, PeerRecord] = {}
        if found is None or not isinstance(found.value, dict):
            return records
        now = get_dht_time()
        revoked = self.revoked() if self.admission is not None else set()
        finished: set[int] = set()
        claims: dict[str, list[int]] = {}
        left: dict[int, set[str]] = {}
        cache, parsed = self._parsed, {}
        for subkey, item in found.value.items():
            expiration = getattr(item, "expiration_time", 0)
            if not isinstance(subkey, str) or expiration < now or subkey in revoked:
                continue
            record = parse_cached(subkey, item, cache, self.num_experts)
            parsed[subkey] = (expiration, record)
            if subkey == self.peer_id and record is not None:
                self._check_twin(record, expiration)
            if record is not None and record.finished:
                finished.update(record.experts)
            elif record is not None and record.experts:
                records[subkey] = record
            elif record is not None and record.claims and subkey != self.peer_id:
                claims[subkey] = record.claims
            if record is not None and record.left and subkey != self.peer_id:
                for expert in record.left:
                    left.setdefault(expert, set()).add(subkey)
        live = set().union(*(r.experts for r in records.values()))
        with self._lock:
            # Remembered beyond the finished record's life: the reads of the round that would adopt the expert
            # come after that record expired. Forgotten once a live peer owns the expert again.
            self._finished_experts = (self._finished_experts | finished) - live
            self._claims = claims
            self._left = left
            self._parsed = parsed
        return records

    def _check_twin(self, record: PeerRecord, expiration: float) -> None:
        """The record under this peer ID came from another process and was stored after this peer's latest
        store (so that process is alive): the later start of the two gives way (twin); the earlier one stores
        its record again now, so the later one sees it within a read."""
        mine = self.record.origin
        if (self.twin is not None or not self._stored_expiration or not record.origin or record.origin == mine
                or record.finished or not record.experts or expiration <= self._stored_expiration):
            return
        if twin_started_first(record.origin, mine):
            logger.error(f"another live process publishes as peer {self.peer_id} in run {self.run_id} and "
                         f"started first: this one gives way")
            self.twin = list(record.origin)
            self._stop.set()  # no more refreshes of the other process's record
        elif twin_started_first(mine, record.origin):
            self.publish(wait=False)

    def left_by(self) -> dict[int, set[str]]:
        """Expert -> the peers whose clean-leave tombstone, in the last read, says they owned it until they left."""
        with self._lock:
            return {e: set(p) for e, p in self._left.items()}

    def _own_record(self) -> tuple[float, PeerRecord] | None:
        """(expiration, record) of the run's live record under this peer ID, None if there is none (or a
        withdrawn or finished one)."""
        found = read_latest(self.dht, self.roster.read_key()[1])
        item = found.value.get(self.peer_id) if found is not None and isinstance(found.value, dict) else None
        expiration = getattr(item, "expiration_time", None)
        if item is None or expiration is None or expiration < get_dht_time():
            return None
        record = PeerRecord.from_value(self.peer_id, getattr(item, "value", None), self.num_experts)
        return (expiration, record) if record is not None and record.experts and not record.finished else None

    def live_elsewhere(self, poll: float = 1.0) -> bool:
        """Is another live process using this peer ID in the run (the same --identity-path twice)? Asked once,
        before this peer publishes anything. A record under its ID may also be its own, left by a run of it that
        crashed: that one is never refreshed, while a live peer's heartbeat re-stores it every ttl/3 with a later
        expiration. So it watches the record for one heartbeat period (plus slack) at most, unless the record
        says it came from a process of this machine that is gone (the usual restart after a crash: no wait)."""
        own = self._own_record()
        if own is None:
            return False
        first, record = own
        mine = process_origin()
        if (mine and record.origin and record.origin[0] == mine[0] and record.origin[1] != mine[1]
                and not _pid_alive(record.origin[1])):
            logger.info(f"the record of this peer ID in run {self.run_id} was left by a run of it that crashed "
                        f"(PID {record.origin[1]} on this machine is gone): taking it over")
            return False
        logger.info(f"a record of this peer ID is already in run {self.run_id}: a crashed earlier run of this "
                    f"peer, or another live process with the same identity; watching it for up to "
                    f"{self.ttl / 3 + 3:.0f}s to tell which")
        deadline = time.monotonic() + self.ttl / 3 + 3.0
        while time.monotonic() < deadline:
            time.sleep(poll)
            own = self._own_record()
            if own is None:
                return False  # expired or withdrawn: nobody keeps it alive
            if own[0] > first + 0.5:
                return True  # refreshed by someone else's heartbeat
        return False

    def revoked(self) -> set[str]:
        """Peer IDs the organizer revoked (closed runs; every DHT node checked the organizer's signature)."""
        found = read_latest(self.dht, revoked_key(self.run_id))
        if found is None or not isinstance(found.value, dict):
            return set()
        return {subkey for subkey in found.value if isinstance(subkey, str)}

    def coverage(self, records: dict[str, PeerRecord] | None = None) -> dict[int, list[str]]:
        """expert -> peer IDs that own it (live records only)."""
        records = self.peers() if records is None else records
        owners: dict[int, list[str]] = {e: [] for e in range(self.num_experts)}
        for peer_id, record in records.items():
            for e in record.experts:
                owners[e].append(peer_id)
        return owners

    def choose_auto(self, count: int, settle: float | None = None, attempts: int = 4) -> list[int]:
        """Experts for `--experts auto`: those nobody owns first, then those only taken care of (a peer holds them
        until someone takes them over: sync.ownership), then the least replicated.

        Joiners that start at the same moment read the same records and would often take the same experts while
        others stay uncovered. So the choice is claimed first: the record (no experts yet) lists the claimed
        ones, and after `settle` seconds (DHT propagation) the choice is made again counting the others' claims
        as ownership, but only the claims of peers that beat this one on that expert (adoption_rank): the
        winner of a contested expert keeps it, the others move to the next least covered. Repeated until the
        choice stands (at most `attempts` times); the record's expert list then replaces the claim at join."""
        settle = min(2.0, self.ttl / 10) if settle is None else settle
        choice = self._choose(count)
        with self._lock:
            alone = not self._claims
        if alone and not self.initial_peers and not [p for p in self.peers() if p != self.peer_id]:
            return choice  # the run's first peer: nobody can be joining a swarm that only it knows of yet
        for _ in range(attempts):
            with self._lock:
                self.record.claims = list(choice)
                value = self.record.to_value()
            try:
                self._store(value, get_dht_time() + self.ttl)
            except Exception as e:  # a claim is a courtesy to other joiners: never fatal
                logger.warning(f"could not publish this peer's expert claim: {e}")
                break
            time.sleep(settle)
            again = self._choose(count)
            if again == choice:
                break
            choice = again
        with self._lock:
            self.record.claims = []
        return choice

    def _choose(self, count: int) -> list[int]:
        """One choice from a fresh read of the records and the other joiners' claims (choose_auto)."""
        records = self.peers()
        with self._lock:
            claims = dict(self._claims)
        mine = self.peer_id
        for_good = {e: sum(r.owns_for_good(e) for p, r in records.items() if p != mine) for e in range(self.num_experts)}
        cared = {e: sum(e in r.caretaking for p, r in records.items() if p != mine) for e in range(self.num_experts)}
        contested = {e: sum(e in c and adoption_rank(p, e) < adoption_rank(mine, e) for p, c in claims.items())
                     for e in range(self.num_experts)}
        order = sorted(range(self.num_experts),
                       key=lambda e: (for_good[e] + contested[e], cared[e], adoption_rank(mine, e)))
        return sorted(order[:count])

    def orphans_to_adopt(self, owned: Iterable[int], max_owned: int, records: dict[str, PeerRecord] | None = None,
                         ) -> list[int]:
        """Experts with no live owner that this peer should adopt, within `max_owned` experts in total.

        Every expert is covered, including ones nobody ever owned (a 3-peer swarm on a 4-expert model trained
        only 3 of them): among the live peers with room left under their published budget, the one ranked first by
        adoption_rank(peer, expert) adopts it. Records without a budget are taken to have room for any number.
        """
        records = self.peers() if records is None else records
        owned = set(owned)
        records = dict(records)
        records[self.peer_id] = PeerRecord(self.peer_id, sorted(owned), budget=max_owned)
        coverage = self.coverage(records)
        room = {p: r.room(self.num_experts) for p, r in records.items()}
        adopt: list[int] = []
        finished = self.finished_experts()
        for expert in sorted(e for e, o in coverage.items() if not o and e not in finished):
            # Coverage counts the drawn peers read outside the shard too (drawn by ticket: a sample blind to
            # experts); adopters are of the shard, whose members all see the same orphan (sync/roster.py).
            candidates = [p for p in records if room[p] > 0 and not records[p].outside]
            if not candidates:
                break
            winner = adoption_order(candidates, expert)[0]
            room[winner] -= 1
            if winner == self.peer_id:
                adopt.append(expert)
        return adopt

    def uncovered(self, owned: Iterable[int], records: dict[str, PeerRecord]) -> list[int]:
        """Experts no live peer owns (this one's `owned` included)."""
        covered = set(owned).union(*(r.experts for r in records.values()))
        return sorted(set(range(self.num_experts)) - covered)

    # ---- heartbeat ----------------------------------------------------------------------------------------

    def reachable(self) -> bool:
        """Can this peer reach the run at all? True if one of the initial peers answers a ping now (bounded by
        sync.reach.PING_TIMEOUT); always True without initial peers (the run's first node: nothing to be cut off
        from). Asked when no other peer, or no other owner's contribution, is visible: alone or cut off?
        (sync.rounds)"""
        if not self.initial_peers:
            return True
        try:
            with self._rejoin_lock:
                if self.dht.run_coroutine(dht_neighbours) == 0:
                    # No DHT node known: cut off until a moment ago at best. Re-join if the link is back (records
                    # of the others reach this peer only after that), but do not call it reachable yet.
                    self._rejoin_if_cut_off()
                    return False
            return self.dht.run_coroutine(functools.partial(ping_maddrs, list(self.initial_peers))) > 0
        except Exception as e:  # the DHT process is stopping or wedged: not reachable, as far as we can tell
            logger.debug(f"reachability check failed: {e!r}")
            return False

    def rejoin_if_cut_off(self) -> bool:
        """If the DHT routing table is empty (hivemind drops every node whose request failed: a link that was
        down for a while leaves none, and hivemind never bootstraps again), ping the initial peers to get back
        in, and publish this peer's record at once. Returns True when it re-joined now."""
        # Blocking: a caller must not see "reachable" while another thread is half-way through a re-join.
        if not self._rejoin_lock.acquire(timeout=PING_TIMEOUT):
            return False
        try:
            return self._rejoin_if_cut_off()
        finally:
            self._rejoin_lock.release()

    def _rejoin_if_cut_off(self) -> bool:
        if not self.initial_peers or self.dht.run_coroutine(dht_neighbours) > 0:
            self._cut_off_since = None
            return False
        now = time.monotonic()
        if self._cut_off_since is None:
            self._cut_off_since = now
            logger.warning("no DHT node reachable any more (link down?): trying to re-join through the run's "
                           "initial peers")
        # Short attempts, one per poll: an attempt started while the link is still down must not delay the
        # first one after it is back by a long timeout.
        found = self.dht.run_coroutine(functools.partial(ping_maddrs, list(self.initial_peers),
                                                         timeout=REJOIN_TIMEOUT))
        if not found:
            return False
        logger.info(f"re-joined the DHT through {found} initial peer(s), {now - self._cut_off_since:.0f}s after "
                    f"losing it")
        self._cut_off_since = None
        self.rejoined_at = time.monotonic()
        self.publish()  # its record expired everywhere else meanwhile: be visible again now, not at the next beat
        return True

    def start_heartbeat(self) -> None:
        def beat() -> None:
            while not self._stop.wait(self.ttl / 3):
                try:
                    self.rejoin_if_cut_off()
                    self.publish()
                    if time.monotonic() - self._settings_stored_at > SETTINGS_LIFETIME / 24:
                        self.publish_settings()
                except Exception as e:  # a failed store must not kill the heartbeat; the next one retries
                    logger.warning(f"heartbeat failed: {e}")
        self._heartbeat = threading.Thread(target=beat, name="spes-heartbeat", daemon=True)
        self._heartbeat.start()

    def stop_heartbeat(self) -> None:
        """No more record refreshes (a leaving peer, before its tombstone: a beat after it would revive the record)."""
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)

    def shutdown(self, withdraw: bool = True, finished: bool = False) -> None:
        """Stop the heartbeat, withdraw the record (unless the DHT is already gone or it was withdrawn already;
        `finished`: mark it finished instead, see finish()) and stop the DHT node."""
        self.stop_heartbeat()
        if withdraw and self.dht.is_alive() and not (self.withdrawn and not finished):
            try:
                self.finish() if finished else self.withdraw()
            except Exception as e:
                logger.warning(f"could not withdraw ownership record: {e}")
        self.dht.shutdown()
