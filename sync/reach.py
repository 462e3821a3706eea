"""Peers behind NAT (`--use-auto-relay` / `--client-mode`; docs/DESIGN.md, "Peers behind NAT").

A home peer without a forwarded port can open connections but accept none. Two ways to take part anyway:

* **relay** (`use_auto_relay`): the peer reserves a slot on libp2p circuit relays (the run's initial peers,
  normally the bootstrap node, which relays by default) and announces `<relay>/p2p-circuit` addresses, so that
  any peer can reach it by peer ID. Relayed connections are small and short (libp2p's default relay limits:
  128 KiB, 2 min), so they serve to *reach* the peer, not to move tensors; the reservations are kept by
  sync/relay.py, because p2pd's autorelay does not renew one it lost within an hour;
* **client mode** (`client_mode`): the DHT runs as a hivemind client — it only makes requests.

Either way bulk data (contributions, state downloads) must flow over connections the home
peer opened itself: `PeerDialer` dials every peer in the run's records, so that when a public peer opens a
stream to it, libp2p reuses that direct connection. `reachability_line` says in one log line which mode a
peer is in and why.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import hivemind
from hivemind.p2p import P2P, PeerID
from hivemind.utils.logging import get_logger
from hivemind.utils.multiaddr import Multiaddr

from sync.hivemind_private import daemon_connect, daemon_disconnect

logger = get_logger(__name__)

DIAL_TIMEOUT = 5.0  # seconds per peer; a peer that does not answer is retried at the next pass
PING_TIMEOUT = 5.0  # seconds per connect and per ping of a known DHT node
CIRCUIT = "/p2p-circuit"


@dataclass(frozen=True)
class NetworkMode:
    """How this peer takes part in the network: both False = a public peer that accepts connections."""

    use_auto_relay: bool = False
    client_mode: bool = False

    @property
    def behind_nat(self) -> bool:
        return self.use_auto_relay or self.client_mode


def relay_client_options(initial_peers: Sequence[str], announce_maddrs: Sequence[str] = ()) -> dict[str, Any]:
    """hivemind.DHT / P2P.create options for a peer behind NAT that reserves slots on its initial peers.

    AutoNAT may never decide that a peer is private (it needs several public peers to test it), so reachability
    is forced; the initial peers are the static relays; and `<initial peer>/p2p-circuit` is announced by hand,
    because go-libp2p's autorelay does not advertise relays with private (RFC 1918) addresses — on the internet
    it would, and the announced address is then merely a duplicate."""
    circuits = [f"{str(m).rstrip('/')}{CIRCUIT}" for m in initial_peers if CIRCUIT not in str(m)]
    return {"use_auto_relay": True, "force_reachability": "private", "trusted_relays": list(initial_peers),
            "announce_maddrs": [*announce_maddrs, *circuits]}


@contextlib.contextmanager
def static_relays_only() -> Iterator[None]:
    """While inside, every p2pd started by this process gets `-relayDiscovery=0`: autorelay uses only the
    trusted (static) relays. hivemind.P2P.create has no option for it, and with discovery on, go-libp2p's
    autorelay waits for 4 relay candidates or a 3-minute boot delay before it reserves anything — a swarm with
    one bootstrap node would leave a home peer unreachable for ~3 minutes. hivemind.DHT forks its process and
    starts p2pd before `DHT(start=True)` returns, so wrapping that call is enough; the patch is undone after."""
    original = P2P.__dict__["_make_process_args"]
    make_args = original.__func__ if isinstance(original, staticmethod) else original

    def with_static_relays(*args: Any, **kwargs: Any) -> list[str]:
        kwargs.setdefault("relayDiscovery", False)
        return make_args(*args, **kwargs)

    P2P._make_process_args = staticmethod(with_static_relays)
    try:
        yield
    finally:
        P2P._make_process_args = original


def _is_private(maddr: str) -> bool:
    try:
        parsed = Multiaddr(maddr.split("/p2p/", 1)[0])  # the transport part is all that says where it listens
        for proto in ("ip4", "ip6"):
            if proto in {p.name for p in parsed.protocols()}:
                ip = ipaddress.ip_address(parsed.value_for_protocol(proto))
                return ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_unspecified
    except Exception:  # a DNS name or an address we cannot parse: assume whoever announced it knows
        return False
    return False


def reachability_line(mode: NetworkMode, visible_maddrs: Sequence[str], relays: Sequence[str] = ()) -> str:
    """One line saying how other peers reach this one, and why (the flags; the addresses it can be dialed at).

    p2pd does not report its AutoNAT verdict to hivemind, so a public peer is judged by its addresses: only
    private/loopback ones mean peers outside this network cannot dial it."""
    parts = []
    if mode.use_auto_relay:
        ids = sorted({str(m).rsplit("/p2p/", 1)[-1][-6:] for m in relays if "/p2p/" in str(m)})
        via = f"relays {', '.join(ids)}" if ids else "no relay (no initial peers: nobody can reach this peer)"
        parts.append(f"behind NAT/firewall, reachable by peer ID through {via} (--use-auto-relay); "
                     f"bulk transfers go over connections this peer opens to the run's peers")
    if mode.client_mode:
        parts.append("client mode: averaging as a client, serving experts over connections it opened "
                     "(--client-mode)")
    if parts:
        return "reachability: " + "; ".join(parts)
    direct = [m for m in visible_maddrs if CIRCUIT not in m]
    if direct and all(_is_private(m) for m in direct):
        return (f"reachability: public mode, listening on {', '.join(direct)} — private addresses only: peers "
                f"outside this network cannot dial this peer (behind NAT? use --use-auto-relay or --client-mode)")
    return f"reachability: public, listening on {', '.join(direct) or 'no address'}"


async def _dial_peers(peer_ids: list[str], _dht: hivemind.DHT, node: Any) -> int:
    """Inside the DHT process: make sure this peer has a direct connection it opened to each of `peer_ids`.

    The daemon connects by peer ID through its own routing (addresses from identify / its kad-DHT), as in
    dht_bootstrap's reconnect. A peer reached only over a relayed connection (it dialed us through the relay
    first) is disconnected and dialed again: libp2p's connect is a no-op for a connected peer, and streams
    would keep using the limited relayed connection. Returns how many peers are now directly connected."""
    p2p = node.protocol.p2p
    connected: dict[str, list[str]] = {}
    for info in await p2p.list_peers():
        connected.setdefault(str(info.peer_id), []).extend(str(a) for a in info.addrs)

    async def dial(peer_id: str) -> bool:
        addrs = connected.get(peer_id)
        if addrs and any(CIRCUIT not in a for a in addrs):
            return True
        try:
            peer = PeerID.from_base58(peer_id)
            if addrs:  # relayed only
                await asyncio.wait_for(daemon_disconnect(p2p, peer), DIAL_TIMEOUT)
            await asyncio.wait_for(daemon_connect(p2p, peer, []), DIAL_TIMEOUT)
            return True
        except Exception as e:  # gone, or not yet findable: the next pass retries
            logger.debug(f"could not dial {peer_id}: {e!r}")
            return False

    own = str(p2p.peer_id)
    return sum(await asyncio.gather(*(dial(p) for p in peer_ids if p != own)))


class PeerDialer:
    """A background thread that keeps direct connections from this (NAT'd) peer to every peer in the run.

    `peer_ids()` returns the peers to dial (normally the live records' IDs); `poke()` asks for a pass now, e.g.
    before a round, without blocking the caller."""

    def __init__(self, dht: hivemind.DHT, peer_ids: Callable[[], Iterable[str]], interval: float = 10.0):
        self.dht, self.peer_ids, self.interval = dht, peer_ids, interval
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._loop, name="spes-dialer", daemon=True)
        self.passes = 0

    def dial_now(self) -> int:
        """One pass in the caller's thread; returns how many peers are directly connected."""
        peers = sorted(set(self.peer_ids()))
        self.passes += 1
        return self.dht.run_coroutine(functools.partial(_dial_peers, peers)) if peers else 0

    def start(self) -> "PeerDialer":
        self._thread.start()
        return self

    def poke(self) -> None:
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.dial_now()
            except Exception as e:  # a failed pass (DHT busy or shutting down) must not end the thread
                if not self._stop.is_set():
                    logger.debug(f"dial pass failed: {e!r}")
            self._wake.wait(self.interval)
            self._wake.clear()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=DIAL_TIMEOUT + 2)


async def dht_neighbours(_dht: hivemind.DHT, node: Any) -> int:
    """Inside the DHT process (module-level so that it pickles): DHT nodes in the routing table (not itself).

    hivemind drops a node from the table when a request to it fails, so a peer whose link was down for a
    while ends up with none, and nothing in hivemind ever re-bootstraps it: see `ping_maddrs`."""
    return len(node.protocol.routing_table.uid_to_peer_id)


async def ping_maddrs(maddrs: list[str], _dht: hivemind.DHT, node: Any, timeout: float = PING_TIMEOUT) -> int:
    """Inside the DHT process: dial and ping DHT nodes by full multiaddr; returns how many answered.

    A ping puts this node back into each peer's routing table (and the peer into ours): this is how a node
    re-joins after a restart (dht_bootstrap) or after its link came back (Swarm's heartbeat). The connect
    goes through the daemon client because hivemind has no public "dial this address" call."""
    by_peer: dict[str, list[Multiaddr]] = {}
    for text in maddrs:
        maddr = Multiaddr(text)
        peer_id = maddr.value_for_protocol("p2p")
        by_peer.setdefault(peer_id, []).append(maddr.decapsulate(Multiaddr(f"/p2p/{peer_id}")))

    async def ping(peer_id: str, addrs: list[Multiaddr]) -> bool:
        try:
            peer = PeerID.from_base58(peer_id)
            await asyncio.wait_for(daemon_connect(node.protocol.p2p, peer, addrs), timeout)
            return await asyncio.wait_for(node.protocol.call_ping(peer), timeout) is not None
        except Exception:  # gone, moved, unreachable (link down), or another peer on that address now
            return False

    return sum(await asyncio.gather(*(ping(p, a) for p, a in by_peer.items())))
