"""A bare hivemind.P2P node driven over stdin/stdout, to run inside a `tests.netlab` namespace.

    python -m tests.netlab_p2p --host 10.213.0.1 --kwargs '{"force_reachability": "public"}'

It starts `hivemind.P2P.create(host_maddrs=[/ip4/HOST/tcp/0], **kwargs)`, registers two binary stream handlers
(``netlab.echo``: echoes one length-prefixed message; ``netlab.source``: sends as many bytes as asked for) and
prints ``{"re": "ready", "peer_id": ..., "maddrs": [...]}``. Then it answers one JSON request per stdin line with
one ``{"re": OP, ...}`` line (see `NsProcess.request`):

* ``info``: peer id, visible maddrs (refreshed from the daemon), connected peers with their addresses;
* ``wait_relay {timeout}``: wait until p2pd's autorelay reports a granted relay reservation ("adding new relay"
  in its debug log, which the agent switches on for the autorelay subsystem only); ``t_reservation`` = seconds
  from process start (before P2P.create) to it, ``relay_maddrs_visible`` = whether `get_visible_maddrs` shows a
  ``/p2p-circuit`` address;
* ``connect {maddr}``: dial a peer at an explicit multiaddr (e.g. ``/p2p/RELAY/p2p-circuit/p2p/HOME``);
* ``dial {peer, timeout}``: connect to a peer *by its ID only* (the daemon finds its addresses), report the
  addresses of the resulting connection;
* ``call {peer, timeout}``: open ``netlab.echo`` on a peer *by its ID only* and round-trip a message;
* ``pull {peer, nbytes, timeout}``: fetch ``nbytes`` from the peer's ``netlab.source``, report seconds and Mbit/s;
* ``pullmany {peers, nbytes, timeout}``: fetch ``nbytes`` from each listed peer at once (one stream per entry: list a
  peer twice for two streams), report each stream's seconds and the total (requests are answered one at a time,
  so concurrent transfers of one agent need this op);
* ``quit``.

``--daemon-args '{"relayDiscovery": false}'`` appends raw p2pd flags that hivemind.P2P.create does not expose
(the harness uses it to compare against hivemind's own option set; see tests/test_netns.py).

Everything the agent logs goes to stderr (the harness keeps it in a per-process log file).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from typing import Any, Optional

T_START = time.monotonic()  # before importing hivemind: "time to relay address" counts daemon start-up too

from hivemind.p2p import P2P, PeerID  # noqa: E402
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo  # noqa: E402
from hivemind.utils.logging import get_logger  # noqa: E402
from hivemind.utils.multiaddr import Multiaddr  # noqa: E402

from sync.hivemind_private import daemon_connect  # noqa: E402

logger = get_logger(__name__)

CHUNK = 1 << 16


# The option sets that make a NAT'd hivemind.P2P reachable through a relay within seconds (tests/test_netns.py).
RELAY_SERVER_KWARGS: dict[str, Any] = {
    # Every p2pd with use_relay=True (hivemind's default) serves circuit-relay v2 with libp2p's *default* limits:
    # 128 KiB and 2 min per relayed connection. Its configured relay service (4 GiB / 30 min) only starts once the
    # host believes it is publicly reachable, which AutoNAT never confirms for a private (lab/LAN) address, so we
    # force it. Even then both services register the same protocol and the last one wins (a race inside p2pd):
    # relayed bulk transfers stay unreliable — use relayed connections to *reach* a NAT'd peer, not to stream to it.
    "force_reachability": "public",
}


def relay_client_options(relay_maddrs: list[str], *, announce: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
    """(P2P.create kwargs, extra p2pd flags) for a peer behind NAT that should take a reservation on `relay_maddrs`.

    * ``use_auto_relay`` + ``force_reachability="private"``: start autorelay at once (AutoNAT may never decide);
    * ``trusted_relays``: the relays to reserve a slot on (e.g. the bootstrap nodes);
    * p2pd ``-relayDiscovery=0`` (not exposed by hivemind.P2P.create): use *only* the trusted relays as static
      relays. With hivemind's default (discovery on) go-libp2p's autorelay waits for 4 candidates or a 3-minute
      boot delay before it reserves anything — with fewer than 4 public peers that is ~181 s;
    * ``announce_maddrs=[RELAY/p2p-circuit]`` (``announce``): advertise the circuit address ourselves. go-libp2p's
      autorelay drops relays whose addresses are private (RFC 1918, e.g. this lab's 10.213.0.0/24 or a LAN), so
      without it nobody learns a circuit address in the lab; on the real internet (public relay IPs) autorelay
      advertises it by itself and `announce` can be False."""
    kwargs: dict[str, Any] = {"use_auto_relay": True, "force_reachability": "private",
                              "trusted_relays": list(relay_maddrs)}
    if announce:
        kwargs["announce_maddrs"] = [f"{m}/p2p-circuit" for m in relay_maddrs]
    return kwargs, {"relayDiscovery": False}


def emit(obj: dict) -> None:
    """One reply line on stdout (the harness's `expect` reads it)."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def patch_daemon_args(extra: dict[str, Any]) -> None:
    """Append raw p2pd flags to every daemon this process starts (hivemind has no pass-through for them)."""
    original = P2P._make_process_args

    def make_process_args(*args: Any, **kwargs: Any) -> list[str]:
        kwargs.update(extra)
        return original(*args, **kwargs)

    P2P._make_process_args = staticmethod(make_process_args)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


P2P_PROTO_CODE = 421  # multicodec of the /p2p/ multiaddr component


def daemon_multiaddr(addr: str) -> Multiaddr:
    """A Multiaddr whose binary form p2pd can parse, for addresses with /p2p/ components inside.

    hivemind's bundled py-multiaddr encodes a /p2p/ value as a CIDv1 (0x01 0x72 + multihash) while go-multiaddr
    in p2pd expects the bare multihash, so `P2P._client.connect(peer, [/ip4/../p2p/RELAY/p2p-circuit])` fails with
    "length greater than remaining number of bytes in buffer". We splice the raw multihash in ourselves (the
    result still parses and prints normally on the Python side)."""
    parts = addr.split("/p2p/")
    out = Multiaddr(parts[0]).to_bytes() if parts[0] else b""
    for part in parts[1:]:
        peer_b58, _, rest = part.partition("/")
        mh = PeerID.from_base58(peer_b58).to_bytes()
        out += _varint(P2P_PROTO_CODE) + _varint(len(mh)) + mh
        if rest:
            out += Multiaddr("/" + rest).to_bytes()
    return Multiaddr(out)


async def echo_handler(_: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        data = await P2P.receive_raw_data(reader)
        await P2P.send_raw_data(data, writer)
    finally:
        writer.close()


async def source_handler(_: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Reads an 8-byte size, then streams that many bytes in 64 KiB writes (back-pressured by drain)."""
    try:
        n = int.from_bytes(await reader.readexactly(8), "big")
        block = b"\x5a" * CHUNK
        sent = 0
        while sent < n:
            piece = block[: min(CHUNK, n - sent)]
            writer.write(piece)
            await writer.drain()
            sent += len(piece)
        # drain() only hands bytes to the local daemon, and closing the stream can reset it with bytes still in
        # flight: close only once the puller, having read everything, closed its side (EOF here).
        await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()


class RelayWatch(logging.Handler):
    """Notes when p2pd's autorelay logs "adding new relay" (a reservation was granted), from its debug log."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.t_reservation: Optional[float] = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.t_reservation is None and "adding new relay" in record.getMessage():
            self.t_reservation = round(time.monotonic() - T_START, 2)


RELAY_WATCH = RelayWatch()


def watch_relay_reservations() -> None:
    # Only autorelay's debug lines (plus errors) come out of p2pd; hivemind forwards them to this logger.
    os.environ["GOLOG_LOG_LEVEL"] = "error,autorelay=debug"
    daemon_logger = logging.getLogger("hivemind.p2p.p2p_daemon")
    daemon_logger.setLevel(logging.DEBUG)
    daemon_logger.addHandler(RELAY_WATCH)


async def visible(p2p: P2P) -> list[str]:
    return [str(a) for a in await p2p.get_visible_maddrs(latest=True)]


async def _pull(p2p: P2P, peer: PeerID, nbytes: int) -> tuple[float, float, int]:
    """Fetch `nbytes` from `peer`'s netlab.source: (seconds to open the stream, seconds to transfer, bytes got)."""
    t_open = time.monotonic()
    _, reader, writer = await p2p.call_binary_stream_handler(peer, "netlab.source")
    try:
        t0 = time.monotonic()  # transfer time excludes opening the stream (a dial, maybe a relay hop)
        writer.write(nbytes.to_bytes(8, "big"))
        await writer.drain()
        got = 0
        while got < nbytes:
            chunk = await reader.read(1 << 20)
            if not chunk:
                break
            got += len(chunk)
        return t0 - t_open, time.monotonic() - t0, got
    finally:
        writer.close()


async def handle(p2p: P2P, req: dict) -> dict:
    op = req["op"]
    if op == "info":
        peers = await p2p.list_peers()
        return {"peer_id": p2p.peer_id.to_base58(), "maddrs": await visible(p2p),
                "peers": {p.peer_id.to_base58(): [str(a) for a in p.addrs] for p in peers}}
    if op == "wait_relay":
        # Done when p2pd reports a granted reservation, or (announced or real) circuit addresses are visible
        # *and* a reservation was seen; `relay_maddrs_visible` says whether autorelay itself advertised any.
        deadline = time.monotonic() + float(req.get("timeout", 30))
        while True:
            maddrs = await visible(p2p)
            relayed = [a for a in maddrs if "p2p-circuit" in a]
            if RELAY_WATCH.t_reservation is not None or time.monotonic() >= deadline:
                return {"ok": RELAY_WATCH.t_reservation is not None, "t_reservation": RELAY_WATCH.t_reservation,
                        "t_since_start": round(time.monotonic() - T_START, 2), "maddrs": maddrs,
                        "relay_maddrs_visible": bool(relayed)}
            await asyncio.sleep(0.2)
    if op == "connect":
        # The daemon wants the transport part and the peer id apart: split at the *last* /p2p/ (a relay address
        # /ip4/../p2p/RELAY/p2p-circuit/p2p/TARGET keeps the relay's /p2p/ in the transport part).
        head, _, peer_b58 = str(req["maddr"]).rpartition("/p2p/")
        maddr, peer = daemon_multiaddr(head), PeerID.from_base58(peer_b58)
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(daemon_connect(p2p, peer, [maddr]), float(req.get("timeout", 10)))
            return {"ok": True, "seconds": round(time.monotonic() - t0, 3)}
        except Exception as e:
            return {"ok": False, "seconds": round(time.monotonic() - t0, 3), "error": f"{type(e).__name__}: {e}"}
    if op == "dial":
        peer = PeerID.from_base58(req["peer"])
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(daemon_connect(p2p, peer, []), float(req.get("timeout", 10)))
            via = [str(a) for info in await p2p.list_peers() if info.peer_id == peer for a in info.addrs]
            return {"ok": True, "seconds": round(time.monotonic() - t0, 3), "via": via}
        except Exception as e:
            return {"ok": False, "seconds": round(time.monotonic() - t0, 3), "error": f"{type(e).__name__}: {e}"}
    if op == "call":
        peer = PeerID.from_base58(req["peer"])
        t0 = time.monotonic()

        async def roundtrip() -> bytes:
            _, reader, writer = await p2p.call_binary_stream_handler(peer, "netlab.echo")
            try:
                await P2P.send_raw_data(b"ping", writer)
                return await P2P.receive_raw_data(reader)
            finally:
                writer.close()

        try:
            got = await asyncio.wait_for(roundtrip(), float(req.get("timeout", 10)))
            return {"ok": got == b"ping", "seconds": round(time.monotonic() - t0, 3)}
        except Exception as e:
            return {"ok": False, "seconds": round(time.monotonic() - t0, 3), "error": f"{type(e).__name__}: {e}"}
    if op == "pull":
        nbytes = int(req["nbytes"])
        try:
            t_open, seconds, got = await asyncio.wait_for(_pull(p2p, PeerID.from_base58(req["peer"]), nbytes),
                                                          float(req.get("timeout", 60)))
            return {"ok": got == nbytes, "bytes": got, "open_seconds": round(t_open, 3),
                    "seconds": round(seconds, 3), "mbit_s": round(got * 8 / seconds / 1e6, 2)}
        except Exception as e:
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    if op == "pullmany":
        nbytes = int(req["nbytes"])
        t0 = time.monotonic()
        try:
            results = await asyncio.wait_for(asyncio.gather(
                *(_pull(p2p, PeerID.from_base58(peer), nbytes) for peer in req["peers"])), float(req.get("timeout", 60)))
            return {"ok": all(got == nbytes for _, _, got in results), "total_seconds": round(time.monotonic() - t0, 3),
                    "seconds": [round(t_open + seconds, 3) for t_open, seconds, _ in results]}
        except Exception as e:
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    raise ValueError(f"unknown op {op!r}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", required=True, help="IP to listen on (the node's own address in the lab)")
    parser.add_argument("--kwargs", default="{}", help="JSON kwargs for hivemind.P2P.create")
    parser.add_argument("--daemon-args", default="{}", help="JSON extra p2pd flags, e.g. {\"relayDiscovery\": false}")
    args = parser.parse_args()
    watch_relay_reservations()
    kwargs = json.loads(args.kwargs)
    extra = json.loads(args.daemon_args)
    if extra:
        patch_daemon_args(extra)
    # nat_port_map off by default: there is no UPnP/NAT-PMP gateway in the lab, and no multicast should be sent.
    kwargs.setdefault("nat_port_map", False)
    p2p = await P2P.create(host_maddrs=[f"/ip4/{args.host}/tcp/0"], **kwargs)
    try:
        await p2p.add_binary_stream_handler("netlab.echo", echo_handler)
        await p2p.add_binary_stream_handler("netlab.source", source_handler)
        emit({"re": "ready", "peer_id": p2p.peer_id.to_base58(), "maddrs": await visible(p2p),
              "t_since_start": round(time.monotonic() - T_START, 2)})
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                break  # the harness closed stdin (or died): shut the daemon down
            line = line.strip()
            if not line:
                continue
            req = json.loads(line)
            if req["op"] == "quit":
                emit({"re": "quit"})
                break
            try:
                reply = await handle(p2p, req)
            except Exception as e:
                logger.exception(f"request {req} failed")
                reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            emit({"re": req["op"], **reply})
    finally:
        await p2p.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
