"""Starting a peer's hivemind DHT node for a run (sync.swarm builds a peer's membership on it).

Every node started here validates the run's records (sync.records.RunRecordValidator); a peer's node also signs
its own record with its identity key. Start-up failures become a SwarmError with the daemon's own reason, and a
fixed listen port that is already taken is found before p2pd would silently share it (busy_tcp_port). Initial
peers that do not answer are tried again for `join_timeout` seconds (a dropped first connection, a bootstrap node
restarting) before that error.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import shutil
import socket
import time
from typing import Any, Sequence

import hivemind
from hivemind.utils.logging import get_logger
from hivemind.utils.multiaddr import Multiaddr

from sync.hivemind_private import store_near
from sync.records import RunRecordValidator, create_identity, ephemeral_identity, load_identity
from sync.reach import relay_client_options, static_relays_only

logger = get_logger(__name__)

# Seconds before the first retry to reach the initial peers; each next wait is twice as long.
FIRST_JOIN_RETRY_S = 1.0

# Every DHT request that touches a run key costs the whole record set: each node holding the key answers a find
# with all of its records (docs/DESIGN.md, "DHT records"). hivemind's defaults visit up to bucket_size (20) nodes
# per read, and a store looks the key itself up through as many: reads are bounded here, stores look up elsewhere.
NUM_REPLICAS = 5  # nodes a record is stored on (hivemind's default)
# A read visits the two nodes nearest the key: one that missed a store (stores do not wait for the replicas) is
# covered by the other, and the heartbeat stores every record again within ttl/3.
READ_BEAM = 2


def read_latest(dht: hivemind.DHT, key: str, return_future: bool = False) -> Any:
    """The freshest value of a run key (a dictionary merged over the nodes visited), as `DHT.get(latest=True)`
    returns it, from the READ_BEAM nodes nearest the key."""
    return dht.get(key, latest=True, return_future=return_future, beam_size=READ_BEAM)


def store_record(dht: hivemind.DHT, keys: str | Sequence[str], subkey: str, value: Any, expiration: float,
                 return_future: bool = False, route_ttl: float = 0.0) -> Any:
    """Store one subkey under a run key (or each of several, in one lookup) on the NUM_REPLICAS nodes nearest it,
    found by a lookup whose nodes answer with neighbours only, not the key's records
    (sync.hivemind_private.store_near); True if every key was stored on some node. The lookup keeps hivemind's
    beam (bucket_size): cheap now, and a joiner whose routing table is still sparse finds the same nearest nodes as
    everyone's reads (a narrower beam stored some joiners' records elsewhere). `route_ttl` > 0: the nodes a lookup
    found are stored to again without one for that many seconds while they answer."""
    keys = (keys,) if isinstance(keys, str) else tuple(keys)
    return dht.run_coroutine(functools.partial(store_near, keys=keys, subkey=subkey, value=value,
                                               expiration=expiration, route_ttl=route_ttl),
                             return_future=return_future)


class SwarmError(RuntimeError):
    """Could not start or join the swarm; the message names the cause (bad multiaddr, unreachable peer, ...)."""


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
              rejects: Any = None, use_auto_relay: bool = False, client_mode: bool = False,
              join_timeout: float = 0.0) -> hivemind.DHT:
    """Start a peer's DHT node (joining `initial_peers` if given) that signs its own record and validates the
    run's records (sync.records); SwarmError with the daemon's reason on failure, after trying unanswering initial
    peers again for `join_timeout` seconds.

    Behind NAT (sync.reach): `use_auto_relay` reserves slots on the initial peers as circuit relays and
    announces `<initial peer>/p2p-circuit` and makes its hivemind DHT a client; `client_mode` makes the DHT a
    hivemind client (it only makes requests) and its p2pd's kad-DHT too."""
    options: dict[str, Any] = {}
    if use_auto_relay:
        options = relay_client_options(initial_peers, announce_maddrs)
        announce_maddrs = options.pop("announce_maddrs")
        # Its hivemind DHT answers no requests and stays out of others' routing tables (as go-libp2p's own kad-DHT
        # does on a private node): nobody could dial it except over its own connections or a relay, and a DHT
        # reply queued behind its bulk uploads on a slow home uplink would hold every public peer's record reads.
        # Its p2pd keeps the libp2p DHT's server mode it had.
        options["client_mode"], options["dht_mode"] = True, "server"
    if client_mode:
        options["client_mode"] = True
        options.pop("dht_mode", None)
    return start_dht_node(initial_peers, host_maddrs, announce_maddrs, identity_path, run_id=run_id,
                          num_experts=num_experts, record_ttl=record_ttl, admission=admission, rejects=rejects,
                          sign=True, join_timeout=join_timeout, **options)


def start_dht_node(initial_peers: Sequence[str] = (), host_maddrs: Sequence[str] = ("/ip4/0.0.0.0/tcp/0",),
                   announce_maddrs: Sequence[str] = (), identity_path: str | None = None, *,
                   run_id: str | None = None, num_experts: int = 0, record_ttl: float = 30.0,
                   admission: Any = None, rejects: Any = None, sign: bool = False, join_timeout: float = 0.0,
                   **p2p_options: Any) -> hivemind.DHT:
    """start_dht with extra hivemind.DHT / P2P.create options (use_relay, use_auto_relay, ...), for callers such
    as the bootstrap node that expose them; same errors.

    With `run_id`, the node validates the run's records (every node must, or it would store forgeries for
    others to read); with `sign`, it also signs its own record with its identity key — a peer without
    `identity_path` gets a fresh identity file, removed once the daemon has read it. `num_experts` 0 accepts
    any expert index up to 2**16 (a bootstrap node may not know the model).
    """
    # No caching at the nodes nearest a key after a read: hivemind would store every record set a read found
    # fresher on one more node (a whole O(N) copy uploaded per read), which then answers every later read too.
    kwargs: dict[str, Any] = {"initial_peers": list(initial_peers), "host_maddrs": list(host_maddrs), "start": True,
                              "cache_nearest": 0, "num_replicas": NUM_REPLICAS, **p2p_options}
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
                create_identity(identity_path)  # if missing: what hivemind would do, but atomic; we need the key
                private_key = load_identity(identity_path)
            kwargs["record_validators"] = [RunRecordValidator(
                run_id, num_experts or 2**16, private_key=private_key, record_ttl=record_ttl,
                admission=admission, rejects=rejects)]
        give_up_at, wait = time.monotonic() + join_timeout, FIRST_JOIN_RETRY_S
        while True:
            try:
                # With auto-relay, only the trusted relays are used (sync.reach.static_relays_only says why).
                with static_relays_only() if kwargs.get("use_auto_relay") else contextlib.nullcontext():
                    return hivemind.DHT(**kwargs)
            except Exception as e:  # hivemind raises P2PDaemonError/ValueError/... with the daemon's own message
                reason = " ".join(str(e).split()) or type(e).__name__
                if "can't access this node" in reason and temp_dir is None and identity_path:
                    # Also what a second process with the same identity file gets when both start together (a
                    # fresh temp identity, temp_dir, is nobody else's: no hint then).
                    reason += f" (or another process uses the identity {identity_path}: give this one its own)"
                if "bootstrap" not in reason or not initial_peers:
                    raise SwarmError(reason) from None
                left = give_up_at - time.monotonic()
                if left <= 0:
                    waited = f" (tried for {join_timeout:g} s)" if join_timeout > 0 else ""
                    raise SwarmError(f"cannot reach any initial peer ({', '.join(initial_peers)}){waited}: "
                                     f"{reason}") from None
                # A home line's first connection can fail where the next one works (tests/test_netns.py saw
                # "failed to connect to bootstrap peers" once from behind the NAT), and a bootstrap node may be
                # restarting: a volunteer's peer should not exit on one attempt.
                wait = min(wait, left)
                logger.warning(f"no initial peer answered ({reason}); trying again in {wait:g} s "
                               f"(network.join_timeout_s: {left:.0f} s left)")
                time.sleep(wait)
                wait *= 2
    finally:
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)
