"""Every use of hivemind's (and its p2pd client's) private names, in one place: what this project needs from
hivemind 1.1.12 that it does not expose publicly. hivemind is pinned (setup.cfg), and a change there breaks here
first. No subclass of hivemind's averaging classes exists in this project; the one runtime wrapper is
`count_dht_rpcs`, a measurement that peer.simulate installs (no peer run does).

- `store_near`: `DHTNode.store_many` for one subkey, except the lookup (its node's `find_nearest_nodes`,
  `protocol.serializer` / `record_validator` / `storage` / `call_store`): see its docstring.

- `listen_maddr`: the DHT process's p2pd control address, to start a private `P2P.replicate` on another event loop
  (what `DHT.replicate_p2p` itself asks; its cached replica is bound to one loop).
- `handle_name`: the wire name of a `ServicerBase` rpc handler, for a raw binary stream call to it.
- `daemon_connect` / `daemon_disconnect` / `daemon_stream_open`: p2pd's own connect, disconnect and stream
  open (hivemind's P2P does not offer them): dialing a peer by ID or address (sync/reach.py), a libp2p circuit
  relay reservation over a raw protocol stream (sync/relay.py).
- `count_dht_rpcs` / `dht_rpc_counts`: wrap the DHT process's `P2P.call_protobuf_handler` (every DHT request a
  node makes: find, store, ping) to count requests and their protobuf bytes both ways (peer.simulate).
"""
from __future__ import annotations

import asyncio
import dataclasses
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


async def _install_rpc_counter(_dht: hivemind.DHT, node: Any) -> None:
    p2p = node.protocol.p2p
    if getattr(p2p, "_spes_rpc_counts", None) is not None:
        return
    counts = p2p._spes_rpc_counts = {"requests": 0, "sent": 0, "received": 0}
    call = p2p.call_protobuf_handler

    async def counted(peer: PeerID, name: str, request: Any, response_type: Any) -> Any:
        kind = name.rsplit(".", 1)[-1]  # rpc_find, rpc_store, rpc_ping: also counted apart
        sent = request.ByteSize()
        response = await call(peer, name, request, response_type)
        for key, add in (("requests", 1), ("sent", sent), ("received", response.ByteSize())):
            counts[key] += add
            counts[f"{kind} {key}"] = counts.get(f"{kind} {key}", 0) + add
        return response

    p2p.call_protobuf_handler = counted


async def _read_rpc_counter(_dht: hivemind.DHT, node: Any) -> dict[str, int]:
    return dict(getattr(node.protocol.p2p, "_spes_rpc_counts", None) or {})


def count_dht_rpcs(dht: hivemind.DHT) -> None:
    """From now on, count the DHT requests `dht`'s node makes and their bytes (blocking: asks the DHT process)."""
    dht.run_coroutine(_install_rpc_counter)


def dht_rpc_counts(dht: hivemind.DHT) -> dict[str, int]:
    """{requests, sent, received} since `count_dht_rpcs` (bytes: the requests' and responses' protobuf sizes), and
    the same per request kind ("rpc_find requests", ...)."""
    return dht.run_coroutine(_read_rpc_counter)


async def store_near(_dht: hivemind.DHT, node: Any, key: str, subkey: str, value: Any, expiration: float) -> bool:
    """Store `value` under (`key`, `subkey`) on the `num_replicas` nodes nearest the key, signed and validated as
    `DHTNode.store_many` does; True if any of them stored it. The difference is the lookup: store_many looks up
    the key itself, so every node it visits that holds the key answers with the whole dictionary (every peer
    record of a run: O(N) bytes per visit, for nothing). This looks up an ID one bit away from the key's, which
    no node holds; nodes are ordered by XOR distance, so its nearest nodes are the key's (unless two differ only
    in their last bit), and each answers with neighbours only (docs/DESIGN.md, "DHT records")."""
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord

    protocol = node.protocol
    key_id = DHTID.generate(source=key)
    probe = DHTID(int(key_id) ^ 1)
    found = await node.find_nearest_nodes([probe], k_nearest=node.num_replicas)
    record = DHTRecord(key_id.to_bytes(), protocol.serializer.dumps(subkey), protocol.serializer.dumps(value),
                       expiration)
    if protocol.record_validator is not None:
        record = dataclasses.replace(record, value=protocol.record_validator.sign_value(record))
    stored, remote = [], []
    for node_id, peer_id in found.get(probe, {}).items():
        if node_id == node.node_id:
            valid = protocol.record_validator is None or protocol.record_validator.validate(record)
            stored.append(bool(valid and protocol.storage.store(key_id, record.value, expiration, subkey=subkey)))
        else:
            remote.append(protocol.call_store(peer_id, [key_id], [record.value], [expiration], subkeys=[subkey]))
    for answer in await asyncio.gather(*remote, return_exceptions=True):
        stored.append(isinstance(answer, list) and bool(answer) and bool(answer[0]))
    return any(stored)
