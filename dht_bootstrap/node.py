"""The bootstrap node: a hivemind DHT node that only serves the run's DHT and reports on it (README, "Operate a swarm").

It never publishes a peer record or a heartbeat of its own: it reads the run's records (`{run_id}_peers`) through
sync.swarm, logs a one-line status, and optionally serves the swarm-level Prometheus gauges. Input problems are
raised as BootstrapError with a message that names the cause, checked before any process is started.
"""
from __future__ import annotations

import errno
import functools
import inspect
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import hivemind
from hivemind.utils.logging import get_logger
from hivemind.utils.multiaddr import Multiaddr
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from sync.admission import Admission, AdmissionError, load_organizer_public_key
from sync.reach import dht_neighbours, ping_maddrs
from sync.peer_record import proven_round, unserved_claimants
from sync.swarm import PeerRecord, Swarm, SwarmError, busy_tcp_port, start_dht_node

logger = get_logger(__name__)

# Swarm gauges are refreshed at least this often, however long --status-every is.
REFRESH_SECONDS = 3.0
# Addresses of known DHT nodes kept across restarts (see BootstrapNode.reconnect).
MAX_REMEMBERED = 64


class BootstrapError(ValueError):
    """Bad input or a failed start; the message names the cause (bad multiaddr, port in use, ...)."""


def check_maddrs(maddrs: Sequence[str], flag: str) -> None:
    """Parse every multiaddr here, so a typo is reported by name before p2pd is started."""
    for text in maddrs:
        try:
            Multiaddr(text)
        except Exception as e:  # multiaddr raises several exception types, all meaning "cannot parse"
            reason = str(e).split(": ", 1)[-1] if ": " in str(e) else str(e)
            raise BootstrapError(f"bad multiaddr '{text}' in {flag}: {reason}") from None


def check_ports_free(host_maddrs: Sequence[str]) -> None:
    """Refuse a TCP listen port that another process already listens on (see sync.swarm.busy_tcp_port)."""
    busy = busy_tcp_port(host_maddrs)
    if busy is not None:
        raise BootstrapError(f"port {busy[0]} is in use ({busy[1]})")


@dataclass
class SwarmStatus:
    """What the run's live records say: peers, owners per expert, summed tokens."""

    peers: int
    replicas: dict[int, int]
    tokens: int
    unserved: int = 0  # peers claiming experts that never announced a contribution (sync.peer_record)

    @classmethod
    def from_records(cls, records: dict[str, PeerRecord], num_experts: int, unserved: int = 0) -> "SwarmStatus":
        replicas = {e: 0 for e in range(num_experts)}
        for record in records.values():
            for e in record.experts:
                replicas[e] += 1
        return cls(len(records), replicas, sum(r.tokens for r in records.values()), unserved)

    def line(self, run_id: str, short_id: str, dht_nodes: int | None = None) -> str:
        covered = sum(1 for n in self.replicas.values() if n > 0)
        min_replicas = min(self.replicas.values(), default=0)
        known = "" if dht_nodes is None else f", {dht_nodes} other DHT node{'s' * (dht_nodes != 1)} known"
        unserved = (f", {self.unserved} claiming experts but never contributing (not counted by peers as owners)"
                    if self.unserved else "")
        return (f"[{run_id} {short_id}] {self.peers} peer{'s' * (self.peers != 1)}, experts covered "
                f"{covered}/{len(self.replicas)} (min replicas {min_replicas}), swarm tokens {self.tokens}"
                f"{unserved}{known}")


class SwarmGauges:
    """The bootstrap node's Prometheus gauges (README, "Operate a swarm"), in a registry of their own."""

    def __init__(self, num_experts: int):
        self.registry = CollectorRegistry()
        self.peers = Gauge("spes_swarm_peers", "live peers in the run's DHT records", registry=self.registry)
        self.replicas = Gauge("spes_swarm_expert_replicas", "live owners of each expert", ["expert"],
                              registry=self.registry)
        self.tokens = Gauge("spes_swarm_tokens_total", "sum of the tokens counters of the live peer records",
                            registry=self.registry)
        self.uncovered = Gauge("spes_swarm_uncovered_experts", "experts no live peer owns (nobody trains them)",
                               registry=self.registry)
        self.unserved = Gauge("spes_swarm_unserved_claims", "live peers claiming experts that never announced a "
                              "contribution in 3 swarm rounds (ghost owners)", registry=self.registry)
        for e in range(num_experts):  # one series per expert from the start, 0 until someone owns it
            self.replicas.labels(expert=str(e)).set(0)
        self._server: Any = None

    def serve(self, port: int) -> None:
        try:
            server = start_http_server(port, registry=self.registry)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise BootstrapError(f"metrics port {port} is in use") from None
            raise BootstrapError(f"cannot serve metrics on port {port}: {e.strerror or e}") from None
        self._server = server[0] if isinstance(server, tuple) else None  # a tuple since prometheus_client 0.17

    def update(self, status: SwarmStatus) -> None:
        self.peers.set(status.peers)
        for e, n in status.replicas.items():
            self.replicas.labels(expert=str(e)).set(n)
        self.tokens.set(status.tokens)
        self.uncovered.set(sum(1 for n in status.replicas.values() if n == 0))
        self.unserved.set(status.unserved)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


async def _known_peers(_dht: hivemind.DHT, node: Any) -> list[str]:
    # Full multiaddrs of the DHT nodes in the routing table; libp2p dials out from its listen port (reuseport),
    # so a connection's remote address is normally the address that peer listens on.
    in_table = {str(p) for p in node.protocol.routing_table.uid_to_peer_id.values()}
    peers = await node.protocol.p2p.list_peers()
    return sorted(f"{addr}/p2p/{info.peer_id}" for info in peers if str(info.peer_id) in in_table
                  for addr in info.addrs)[: MAX_REMEMBERED]


class BootstrapNode:
    """A running bootstrap node. Use as a context manager or call shutdown()."""

    def __init__(self, run_id: str, num_experts: int, host_maddrs: Sequence[str],
                 announce_maddrs: Sequence[str] = (), identity_path: str | None = None,
                 initial_peers: Sequence[str] = (), metrics_port: int = 0, organizer_key: str = "",
                 record_ttl: float = 30.0, **p2p_options: Any):
        """`organizer_key` (base64 or a key file): a closed run, whose records this node's DHT validates like
        every peer's; the node itself holds no ticket."""
        check_maddrs(host_maddrs, "--host-maddrs")
        check_maddrs(announce_maddrs, "--announce-maddrs")
        check_maddrs(initial_peers, "--initial-peers")
        check_ports_free(host_maddrs)
        self.run_id, self.num_experts = run_id, num_experts
        self.admission: Admission | None = None
        if organizer_key:
            try:
                self.admission = Admission(load_organizer_public_key(organizer_key), run_id, own_ticket=None)
            except AdmissionError as e:
                raise BootstrapError(str(e)) from None
        # Like every node of the run, this one refuses unsigned, malformed or far-future records (sync.records);
        # record_ttl must be the run's sync.record_ttl, or the peers' records would look far-future here.
        # Expert indices are not range-checked here (num_experts 0): --num-experts only sizes the gauges, and a
        # wrong value must not make this node refuse a bigger model's records (the peers check the range).
        record_checks = {"run_id": run_id, "admission": self.admission, "num_experts": 0, "record_ttl": record_ttl}
        self.gauges = SwarmGauges(num_experts) if metrics_port else None
        if self.gauges is not None:  # before the DHT: a busy metrics port fails without starting p2pd
            self.gauges.serve(metrics_port)
        if identity_path:  # hivemind writes a missing key file but not its folder
            Path(identity_path).parent.mkdir(parents=True, exist_ok=True)
        try:
            self.dht = start_dht_node(initial_peers, host_maddrs, announce_maddrs, identity_path, **record_checks,
                                      **p2p_options)
        except SwarmError as e:
            if self.gauges is not None:
                self.gauges.close()
            raise BootstrapError(str(e)) from None
        # Peers keep a restarted node out of their routing tables once a request to it failed during the
        # downtime, and the restarted node knows nobody; so it remembers its DHT neighbours next to its identity.
        self.peers_path = Path(f"{identity_path}.peers") if identity_path else None
        self._remembered: list[str] = []
        self._remember_failed = False
        # Swarm only reads here: its constructor stores nothing, and publish/heartbeat are never called. In a closed
        # run it also skips revoked peers (where this build's Swarm knows about admission).
        closed = {"admission": self.admission} if "admission" in inspect.signature(Swarm).parameters else {}
        self.reader = Swarm(self.dht, run_id, num_experts, **closed)
        self.short_id = self.reader.peer_id[-6:]
        self.status = SwarmStatus.from_records({}, num_experts)
        self._first_seen: dict[str, int] = {}  # live peer -> the swarm's round when first read (unserved_claimants)
        self._contributors: int | None = None  # the run's sync.contributors (sync/draw.py), from its settings

    def visible_maddrs(self) -> list[str]:
        return self.reader.visible_maddrs()

    def reconnect(self) -> None:
        """Ping the DHT nodes known before a restart (from FILE.peers), so that they take this node back."""
        if self.peers_path is None or not self.peers_path.is_file():
            return
        try:
            maddrs = [line.strip() for line in self.peers_path.read_text().splitlines() if line.strip()]
            check_maddrs(maddrs, str(self.peers_path))
            self._remembered = maddrs
            found = self.dht.run_coroutine(functools.partial(ping_maddrs, maddrs))
        except Exception as e:  # a damaged or stale file only costs the reconnect, never the start
            logger.warning(f"could not reconnect to the peers in {self.peers_path}: {e}")
            return
        known = len({m.rsplit("/p2p/", 1)[-1] for m in maddrs})
        logger.info(f"reconnected to {found} of {known} DHT nodes known before the restart")

    def remember_peers(self) -> None:
        """Keep the current DHT neighbours in FILE.peers (only when they changed, never an empty list)."""
        if self.peers_path is None:
            return
        maddrs = self.dht.run_coroutine(_known_peers)
        if maddrs and maddrs != self._remembered:
            tmp = self.peers_path.with_name(self.peers_path.name + ".tmp")
            tmp.write_text("".join(f"{m}\n" for m in maddrs))
            os.replace(tmp, self.peers_path)  # atomic: a crash mid-write leaves the previous list
            self._remembered = maddrs

    def refresh(self) -> SwarmStatus:
        """Read the live records (this DHT lookup also keeps the routing table fresh) and update the gauges."""
        records = self.reader.peers()
        swarm_round = proven_round(records, set())
        if swarm_round is not None:
            self._first_seen = {p: self._first_seen.get(p, swarm_round) for p in records}
        if self._contributors is None and records:  # the run's sync.contributors, once its settings are found
            try:
                settings = self.reader.run_settings(records.values())[1]
            except Exception as e:  # a failed read costs only this refresh's estimate; asked again next time
                logger.debug(f"reading the run's settings: {e}")
                settings = None
            value = settings.get("sync.contributors") if settings else None
            self._contributors = value if isinstance(value, int) and not isinstance(value, bool) else None
        unserved = unserved_claimants(records, self._first_seen, swarm_round, contributors=self._contributors or 0)
        self.status = SwarmStatus.from_records(records, self.num_experts, len(unserved))
        if self.gauges is not None:
            self.gauges.update(self.status)
        return self.status

    def status_line(self) -> str:
        try:
            nodes: int | None = self.dht.run_coroutine(dht_neighbours)
        except Exception:  # the count is a nicety; the line is still worth logging without it
            nodes = None
        return self.status.line(self.run_id, self.short_id, nodes)

    def serve_forever(self, stop: threading.Event, status_every: float) -> None:
        """Refresh every few seconds and log a status line every `status_every` seconds until `stop` is set."""
        tick = max(0.1, min(REFRESH_SECONDS, status_every))
        next_status = time.monotonic() + status_every
        while not stop.wait(tick):
            if not self.dht.is_alive():
                raise BootstrapError("the DHT process died")
            try:
                self.refresh()
            except Exception as e:  # a failed lookup must not end the node; the next tick retries
                logger.warning(f"could not read the run's records: {e}")
            try:
                self.remember_peers()
            except Exception as e:  # e.g. a read-only folder: the node still serves, only restarts suffer
                if not self._remember_failed:  # once, not every few seconds
                    logger.warning(f"could not update {self.peers_path}: {e}")
                self._remember_failed = True
            if time.monotonic() >= next_status:
                logger.info(self.status_line())
                # Skip missed slots (a slow lookup) instead of logging a burst of lines to catch up.
                next_status = max(next_status + status_every, time.monotonic() + status_every / 2)

    def shutdown(self) -> None:
        """Stop the DHT (and its p2pd) and the metrics server. Idempotent."""
        if getattr(self, "dht", None) is not None:
            self.dht.shutdown()
            self.dht = None
        if self.gauges is not None:
            self.gauges.close()
            self.gauges = None

    def __enter__(self) -> "BootstrapNode":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
