"""Joining a run's DHT and keeping expert ownership in it (SPEC §1 "Ownership", §2).

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

import contextlib
import errno
import hashlib
import os
import shutil
import socket
import functools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import hivemind
from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.logging import get_logger
from hivemind.utils.multiaddr import Multiaddr

from sync.records import MAX_ROUND, MAX_STEP, MAX_TOKENS, ephemeral_identity, load_identity, peers_key, revoked_key
from sync.records import RunRecordValidator
from sync.reach import PING_TIMEOUT, dht_neighbours, ping_maddrs, relay_client_options, static_relays_only

logger = get_logger(__name__)

REJOIN_TIMEOUT = 1.5  # seconds per connect / ping of an initial peer while cut off (retried every poll)


class SwarmError(RuntimeError):
    """Could not start or join the swarm; the message names the cause (bad multiaddr, unreachable peer, ...)."""


@dataclass
class PeerRecord:
    """What one peer publishes about itself."""

    peer_id: str
    experts: list[int]
    round: int = 0
    step: int = 0
    tokens: int = 0
    ticket: bytes = b""  # closed runs: the organizer's ticket for this peer ID (sync.admission)
    # A slow uplink: it follows the shared tensors by download and never joins an all-reduce group, so nobody
    # waits for it in matchmaking (sync.follow_below_mbit, docs/DESIGN.md "Bandwidth-aware rounds").
    follows: bool = False

    def to_value(self) -> dict[str, Any]:
        value = {"experts": list(self.experts), "round": self.round, "step": self.step, "tokens": self.tokens}
        if self.ticket:
            value["ticket"] = self.ticket
        if self.follows:
            value["follows"] = True
        return value

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
        return cls(peer_id, sorted(set(experts)), *counters, ticket=ticket if isinstance(ticket, bytes) else b"",
                   follows=value.get("follows") is True)


def median_round(records: Iterable[PeerRecord]) -> int | None:
    """The swarm's round as a liar cannot move it: the lower median of the records' rounds (None if none).

    One peer claiming a huge (or tiny) round shifts the median by at most one position among honest values,
    and with two records the lower median is the smaller one, so a lone liar can never make the honest peer
    jump ahead. The max, used before, let one record of round 2**62 move every peer (issue 9)."""
    rounds = sorted(r.round for r in records)
    return rounds[(len(rounds) - 1) // 2] if rounds else None


def _is_peer_id(text: str) -> bool:
    try:
        PeerID.from_base58(text)
        return True
    except Exception:  # any peer can write any subkey: a garbage one is skipped, not trusted
        return False


def busy_tcp_port(host_maddrs: Sequence[str | Multiaddr]) -> tuple[int, str] | None:
    """The first fixed TCP port among `host_maddrs` that something already listens on, with its multiaddr.

    hivemind's p2pd listens with SO_REUSEPORT, so a second node on a taken port would not fail: it would silently
    share the port. A plain probe bind (SO_REUSEADDR only, as p2pd, so TIME_WAIT sockets of a node restarted on
    the same port do not count) fails against any listener. Port 0, DNS names and non-TCP addresses are skipped:
    p2pd reports its own errors for those. There is a short race until p2pd binds.
    """
    for text in host_maddrs:
        maddr = Multiaddr(str(text))
        names = {p.name for p in maddr.protocols()}
        if "tcp" not in names or not names & {"ip4", "ip6"}:
            continue
        port = int(maddr.value_for_protocol("tcp"))
        if port == 0:
            continue
        family = socket.AF_INET6 if "ip6" in names else socket.AF_INET
        host = maddr.value_for_protocol("ip6" if family == socket.AF_INET6 else "ip4")
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 on this machine: p2pd listens on the other addresses or reports it
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # Go listens on tcp6 sockets as v6-only: probe the same way
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind((host, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return port, str(text)
                # Anything else (an address not on this machine, ...) is p2pd's to report or to survive.
    return None


def start_dht(initial_peers: Sequence[str] = (), host_maddrs: Sequence[str] = ("/ip4/0.0.0.0/tcp/0",),
              announce_maddrs: Sequence[str] = (), identity_path: str | None = None, *, run_id: str | None = None,
              num_experts: int = 0, record_ttl: float = 30.0, admission: Any = None,
              rejects: Any = None, use_auto_relay: bool = False, client_mode: bool = False) -> hivemind.DHT:
    """Start a peer's DHT node (joining `initial_peers` if given) that signs its own record and validates the
    run's records (sync.records); SwarmError with the daemon's reason on failure.

    Behind NAT (sync.reach): `use_auto_relay` reserves slots on the initial peers as circuit relays and
    announces `<initial peer>/p2p-circuit`; `client_mode` makes the DHT a hivemind client (it only makes
    requests; the averagers built on it follow `dht.client_mode`)."""
    options: dict[str, Any] = {}
    if use_auto_relay:
        options = relay_client_options(initial_peers, announce_maddrs)
        announce_maddrs = options.pop("announce_maddrs")
    if client_mode:
        options["client_mode"] = True
    return start_dht_node(initial_peers, host_maddrs, announce_maddrs, identity_path, run_id=run_id,
                          num_experts=num_experts, record_ttl=record_ttl, admission=admission, rejects=rejects,
                          sign=True, **options)


def start_dht_node(initial_peers: Sequence[str] = (), host_maddrs: Sequence[str] = ("/ip4/0.0.0.0/tcp/0",),
                   announce_maddrs: Sequence[str] = (), identity_path: str | None = None, *,
                   run_id: str | None = None, num_experts: int = 0, record_ttl: float = 30.0,
                   admission: Any = None, rejects: Any = None, sign: bool = False,
                   **p2p_options: Any) -> hivemind.DHT:
    """start_dht with extra hivemind.DHT / P2P.create options (use_relay, use_auto_relay, ...), for callers such
    as the bootstrap node that expose them; same errors.

    With `run_id`, the node validates the run's records (every node must, or it would store forgeries for
    others to read); with `sign`, it also signs its own record with its identity key — a peer without
    `identity_path` gets a fresh identity file, removed once the daemon has read it. `num_experts` 0 accepts
    any expert index up to 2**16 (a bootstrap node may not know the model).
    """
    kwargs: dict[str, Any] = {"initial_peers": list(initial_peers), "host_maddrs": list(host_maddrs), "start": True,
                              **p2p_options}
    if announce_maddrs:
        kwargs["announce_maddrs"] = list(announce_maddrs)
    temp_dir = None
    if sign and not identity_path:
        identity_path, temp_dir = ephemeral_identity()
        kwargs["check_if_identity_free"] = False  # brand new: asking the swarm whether it is taken costs ~5 s
    if identity_path:
        kwargs["identity_path"] = identity_path
    try:
        if run_id is not None:
            private_key = None
            if sign:
                if not os.path.isfile(identity_path):
                    P2P.generate_identity(identity_path)  # what hivemind would do; we need the key to sign
                private_key = load_identity(identity_path)
            kwargs["record_validators"] = [RunRecordValidator(
                run_id, num_experts or 2**16, private_key=private_key, record_ttl=record_ttl,
                admission=admission, rejects=rejects)]
        # With auto-relay, only the trusted relays are used (sync.reach.static_relays_only says why).
        with static_relays_only() if kwargs.get("use_auto_relay") else contextlib.nullcontext():
            return hivemind.DHT(**kwargs)
    except Exception as e:  # hivemind raises P2PDaemonError/ValueError/... with the daemon's own message
        reason = " ".join(str(e).split()) or type(e).__name__
        if "bootstrap" in reason and initial_peers:
            reason = f"cannot reach any initial peer ({', '.join(initial_peers)}): {reason}"
        raise SwarmError(reason) from None
    finally:
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)



def least_covered(coverage: dict[int, int], count: int, peer_id: str = "") -> list[int]:
    """The `count` experts with the fewest owners. Ties are broken by a hash of (peer ID, expert): deterministic,
    yet peers that join at the same moment (seeing the same coverage) mostly pick different experts."""
    return sorted(coverage, key=lambda e: (coverage[e], adoption_rank(peer_id, e)))[:count]


def adoption_rank(peer_id: str, expert: int) -> bytes:
    # Every peer evaluates the same rule on the same records, so one peer (not all of them) adopts an orphan.
    return hashlib.sha256(f"{peer_id}:{expert}".encode()).digest()


@dataclass
class Swarm:
    """One peer's membership in a run: its DHT node, its ownership record and a heartbeat."""

    dht: hivemind.DHT
    run_id: str
    num_experts: int
    ttl: float = 30.0
    ticket: bytes = b""   # closed runs: this peer's organizer ticket, carried in its record
    admission: Any = None  # closed runs: sync.admission.Admission (revoked peers are not read)
    # Full multiaddrs of the run's initial peers: where this peer re-joins the DHT after its link came back.
    initial_peers: Sequence[str] = ()
    record: PeerRecord = field(init=False)

    def __post_init__(self) -> None:
        self.peer_id = str(self.dht.peer_id)
        self.key = peers_key(self.run_id)
        self.record = PeerRecord(self.peer_id, [], ticket=self.ticket)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._cut_off_since: float | None = None  # monotonic time the DHT routing table was first seen empty
        self.rejoined_at = -float("inf")  # monotonic time of the last re-join (rejoin_if_cut_off)
        self._rejoin_lock = threading.Lock()  # the heartbeat and the progress reader both check

    def visible_maddrs(self) -> list[str]:
        return [str(m) for m in self.dht.get_visible_maddrs()]

    # ---- records ------------------------------------------------------------------------------------------

    def publish(self, **changes: Any) -> None:
        """Update and store this peer's record (experts / round / step / tokens)."""
        with self._lock:
            for name, value in changes.items():
                setattr(self.record, name, sorted(value) if name == "experts" else value)
            value = self.record.to_value()
        try:
            self._store(value, get_dht_time() + self.ttl)
        except TimeoutError:  # the heartbeat stores it again within ttl / 3
            logger.warning("storing this peer's record timed out; the heartbeat retries")

    def withdraw(self) -> None:
        """Remove this peer's record now (a clean leave: others adopt its experts without waiting for expiry)."""
        # The DHT keeps the value with the latest expiration per subkey, so the tombstone (an empty expert
        # list, which readers skip) must expire later than the record it replaces.
        with self._lock:
            self.record.experts = []
            value = self.record.to_value()
        self._store(value, get_dht_time() + self.ttl + 1.0)

    def _store(self, value: dict[str, Any], expiration: float, timeout: float = 15.0) -> bool:
        """Store this peer's record, bounded: a DHT process that died or hangs must not hang the heartbeat or
        the shutdown (seen once in CI: a withdrawal waited forever on a store whose future never resolved)."""
        future = self.dht.store(self.key, subkey=self.peer_id, value=value, expiration_time=expiration,
                                return_future=True)
        return bool(future.result(timeout=timeout))

    def peers(self) -> dict[str, PeerRecord]:
        """Live peers' records (ours included once published)."""
        found = self.dht.get(self.key, latest=True)
        records: dict[str, PeerRecord] = {}
        if found is None or not isinstance(found.value, dict):
            return records
        now = get_dht_time()
        revoked = self.revoked() if self.admission is not None else set()
        for subkey, item in found.value.items():
            value = getattr(item, "value", None)
            expiration = getattr(item, "expiration_time", 0)
            if not isinstance(subkey, str) or expiration < now or subkey in revoked or not _is_peer_id(subkey):
                continue
            record = PeerRecord.from_value(subkey, value, self.num_experts)
            if record is not None and record.experts:
                records[subkey] = record
        return records

    def revoked(self) -> set[str]:
        """Peer IDs the organizer revoked (closed runs; every DHT node checked the organizer's signature)."""
        found = self.dht.get(revoked_key(self.run_id), latest=True)
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

    def choose_auto(self, count: int) -> list[int]:
        """Experts for `--experts auto`: the least-covered ones at join time."""
        coverage = {e: len(o) for e, o in self.coverage().items()}
        return sorted(least_covered(coverage, count, self.peer_id))

    def orphans_to_adopt(self, owned: Iterable[int], max_owned: int, records: dict[str, PeerRecord] | None = None,
                         adoptable: Iterable[int] | None = None) -> list[int]:
        """Experts with no live owner that this peer should adopt, within `max_owned` experts in total.

        Only experts in `adoptable` (default: all) are considered — the caller passes the experts it has seen
        owned, so an expert whose owner left is adopted but one nobody ever took waits for a joining peer.
        Among the live peers with room left, the one ranked first by adoption_rank(peer, expert) adopts it.
        """
        records = self.peers() if records is None else records
        owned = set(owned)
        records = dict(records)
        records[self.peer_id] = PeerRecord(self.peer_id, sorted(owned))
        coverage = self.coverage(records)
        load = {p: len(r.experts) for p, r in records.items()}
        adopt: list[int] = []
        allowed = set(coverage) if adoptable is None else set(adoptable)
        for expert in sorted(e for e, o in coverage.items() if not o and e in allowed):
            candidates = [p for p in records if load[p] < max_owned]
            if not candidates:
                break
            winner = min(candidates, key=lambda p: adoption_rank(p, expert))
            load[winner] += 1
            if winner == self.peer_id:
                adopt.append(expert)
        return adopt

    # ---- heartbeat ----------------------------------------------------------------------------------------

    def reachable(self) -> bool:
        """Can this peer reach the run at all? True if one of the initial peers answers a ping now (bounded by
        sync.reach.PING_TIMEOUT); always True without initial peers (the run's first node: nothing to be cut off
        from). Asked only when no other peer is visible: alone in the run, or cut off from it (sync.ownership)."""
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
                except Exception as e:  # a failed store must not kill the heartbeat; the next one retries
                    logger.warning(f"heartbeat failed: {e}")
        self._heartbeat = threading.Thread(target=beat, name="spes-heartbeat", daemon=True)
        self._heartbeat.start()

    def shutdown(self, withdraw: bool = True) -> None:
        """Stop the heartbeat, withdraw the record (unless the DHT is already gone) and stop the DHT node."""
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
        if withdraw and self.dht.is_alive():
            try:
                self.withdraw()
            except Exception as e:
                logger.warning(f"could not withdraw ownership record: {e}")
        self.dht.shutdown()
