"""Every use of hivemind's (and its p2pd client's) private names, in one place: what this project needs from
hivemind 1.1.12 that it does not expose publicly. hivemind is pinned (setup.cfg), and a change there breaks here
first. No subclass of hivemind's averaging classes and no runtime patch of it exists in this project.

- `listen_maddr`: the DHT process's p2pd control address, to start a private `P2P.replicate` on another event loop
  (what `DHT.replicate_p2p` itself asks; its cached replica is bound to one loop).
- `handle_name`: the wire name of a `ServicerBase` rpc handler, for a raw binary stream call to it.
- `daemon_connect` / `daemon_disconnect` / `daemon_stream_open`: p2pd's own connect, disconnect and stream
  open (hivemind's P2P does not offer them): dialing a peer by ID or address (sync/reach.py), a libp2p circuit
  relay reservation over a raw protocol stream (sync/relay.py).
"""
from __future__ import annotations

import asyncio
from typing import Any, Sequence

import hivemind
from hivemind.p2p import P2P, PeerID, ServicerBase
from hivemind.utils.multiaddr import Multiaddr


def listen_maddr(dht: hivemind.DHT) -> Multiaddr:
    """The p2pd listen address of `dht`'s daemon (blocking: asks the DHT process)."""
    return dht.run_coroutine(hivemind.DHT._get_p2p_daemon_listen_maddr)


def handle_name(servicer: type[ServicerBase], namespace: str, method: str) -> str:
    """The protocol name under which `servicer.method` is registered in `namespace`."""
    return servicer._get_handle_name(namespace, method)


async def daemon_connect(p2p: P2P, peer: PeerID, addrs: Sequence[Multiaddr]) -> None:
    """Connect the daemon to `peer` (at `addrs`, or by its own routing when empty); a no-op if connected."""
    await p2p._client.connect(peer, list(addrs))


async def daemon_disconnect(p2p: P2P, peer: PeerID) -> None:
    """Close the daemon's connections to `peer`."""
    await p2p._client.disconnect(peer)


async def daemon_stream_open(p2p: P2P, peer: PeerID, protocols: Sequence[str]) -> tuple[Any, asyncio.StreamReader,
                                                                                        asyncio.StreamWriter]:
    """A raw stream to `peer` on one of `protocols`: (stream info, reader, writer)."""
    return await p2p._client.stream_open(peer, list(protocols))
