"""Every use of hivemind's (and its p2pd client's) private names, in one place: what this project needs from
hivemind 1.1.12 that it does not expose publicly. hivemind is pinned (setup.cfg), and a change there breaks here
first. No subclass of hivemind's averaging classes exists in this project; the one runtime wrapper is
`count_dht_rpcs`, a measurement that peer.simulate installs (no peer run does).

- `store_near`: `DHTNode.store_many` for one subkey under one or more keys, except the lookup (its node's
  `protocol.serializer` / `record_validator` / `storage` / `call_store`, and for the lookup, `_find_nearest_together`:
  `find_nearest_nodes` with every query in one request in a small swarm, through `hivemind.dht.traverse.traverse_dht`,
  the node's routing table and its `uid_to_peer_id`, `_filter_blacklisted` and `_call_find_with_blacklist`): see
  their docstrings. It keeps each key's nearest nodes for `route_ttl` seconds in the DHT process.

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
import time
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


async def _find_nearest_together(node: Any, queries: list[Any], k_nearest: int) -> dict[Any, dict[Any, PeerID]]:
    """`DHTNode.find_nearest_nodes` (hivemind's beam: bucket_size), except that while the node knows at most two
    beams of nodes, one find request carries every query (hivemind packs sqrt(len(queries)) of them: one each for
    the two or three keys of a record): the keys' beams then overlap, and a node in several is asked once
    (peer.simulate, 16 and 32 peers: half the DHT requests, 10 % fewer to 20 % more bytes: a packed answer carries
    a neighbour list per key). In a larger swarm the beams are apart and a packed request would only add a
    neighbour list per extra query to every answer: hivemind's `find_nearest_nodes` itself then. Its blacklist and
    routing table as hivemind's own lookup uses them."""
    from hivemind.dht.traverse import traverse_dht

    beam = max(node.protocol.bucket_size, k_nearest)
    if len(node.protocol.routing_table.uid_to_peer_id) > 2 * beam:  # the beams are apart: hivemind's own lookup
        return await node.find_nearest_nodes(queries, k_nearest=k_nearest)
    node_to_peer_id: dict[Any, PeerID] = {}
    for query in queries:
        nearest = node.protocol.routing_table.get_nearest_neighbors(query, beam, exclude=node.node_id)
        node_to_peer_id.update(node._filter_blacklisted(dict(nearest)))

    async def get_neighbors(peer: Any, asked: Any) -> dict[Any, tuple[tuple[Any, ...], bool]]:
        response = await node._call_find_with_blacklist(node_to_peer_id[peer], asked)
        if not response:
            return {query: ((), False) for query in asked}
        out = {}
        for query, (_, peers) in response.items():
            node_to_peer_id.update(peers)
            out[query] = tuple(peers), False
        return out

    nearest_per_query, _ = await traverse_dht(
        queries, initial_nodes=list(node_to_peer_id), beam_size=beam, num_workers=node.num_workers,
        queries_per_call=len(queries), get_neighbors=get_neighbors,
        visited_nodes={query: {node.node_id} for query in queries})
    node_to_peer_id[node.node_id] = node.peer_id
    return {query: {n: node_to_peer_id[n] for n in sorted([*nearest, node.node_id], key=query.xor_distance)[:k_nearest]}
            for query, nearest in nearest_per_query.items()}


# key -> (monotonic time its routes expire, {node ID: peer ID} of its nearest nodes) of this DHT process's stores.
_ROUTES: dict[str, tuple[float, dict[Any, PeerID]]] = {}


async def store_near(_dht: hivemind.DHT, node: Any, keys: Sequence[str], subkey: str, value: Any,
                     expiration: float, route_ttl: float = 0.0) -> bool:
    """Store `value` under (key, `subkey`) for every key of `keys` on the `num_replicas` nodes nearest that key,
    signed and validated as `DHTNode.store_many` does; True if each key was stored on at least one node. The
    difference is the lookup: store_many looks up the key itself, so every node it visits that holds the key
    answers with the whole dictionary (every peer record of a run: O(N) bytes per visit, for nothing). This looks
    up an ID one bit away from each key's, which no node holds; nodes are ordered by XOR distance, so its nearest
    nodes are the key's (unless two differ only in their last bit), and each answers with neighbours only
    (docs/DESIGN.md, "DHT records"). The keys share one lookup (a node visited for two answers both in one
    request) and a node nearest to several keys gets them in one store request (a record stored at two or three
    roster levels, sync/roster.py).

    `route_ttl` > 0: a key's nearest nodes found by a lookup are stored to again without one for that many
    seconds, as long as each of them answers (a lookup visits up to bucket_size nodes; the stores then go to
    num_replicas). A node nearer than those that joins meanwhile misses the record for at most that long, as it
    would between two heartbeats."""
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord

    protocol = node.protocol
    key_ids = {key: DHTID.generate(source=key) for key in keys}
    probes = {key: DHTID(int(key_id) ^ 1) for key, key_id in key_ids.items()}
    now = time.monotonic()
    for key in [k for k, (until, _) in _ROUTES.items() if until <= now]:
        del _ROUTES[key]
    lookup = [key for key in keys if route_ttl <= 0 or key not in _ROUTES]
    found = {probes[key]: _ROUTES[key][1] for key in keys if key not in lookup}
    if lookup:
        looked_up = await _find_nearest_together(node, [probes[key] for key in lookup], node.num_replicas)
        found.update(looked_up)
        if route_ttl > 0:
            for key in lookup:
                if looked_up.get(probes[key]):
                    _ROUTES[key] = (now + route_ttl, looked_up[probes[key]])
    stored = {key: False for key in keys}
    per_peer: dict[Any, list[tuple[str, Any]]] = {}  # remote peer ID -> [(key, signed record)]
    for key, key_id in key_ids.items():
        record = DHTRecord(key_id.to_bytes(), protocol.serializer.dumps(subkey), protocol.serializer.dumps(value),
                           expiration)
        if protocol.record_validator is not None:
            record = dataclasses.replace(record, value=protocol.record_validator.sign_value(record))
        for node_id, peer_id in found.get(probes[key], {}).items():
            if node_id == node.node_id:
                valid = protocol.record_validator is None or protocol.record_validator.validate(record)
                stored[key] |= bool(valid and protocol.storage.store(key_id, record.value, expiration, subkey=subkey))
            else:
                per_peer.setdefault(peer_id, []).append((key, record))
    peers = list(per_peer)
    answers = await asyncio.gather(*[protocol.call_store(
        peer, [key_ids[k] for k, _ in per_peer[peer]], [r.value for _, r in per_peer[peer]], expiration,
        subkeys=[subkey] * len(per_peer[peer])) for peer in peers], return_exceptions=True)
    for peer, answer in zip(peers, answers):
        # A protobuf repeated field (one flag per key), None for no answer, or the request's exception.
        if answer is not None and not isinstance(answer, BaseException):
            for (key, _), ok in zip(per_peer[peer], answer):
                stored[key] |= bool(ok)
        else:  # a node gone or stalled: the keys it was nearest to are looked up again next time
            for key, _ in per_peer[peer]:
                _ROUTES.pop(key, None)
    return all(stored.values())
