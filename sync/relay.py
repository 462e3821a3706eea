"""Relay reservations a peer behind NAT keeps itself (`--use-auto-relay`; docs/DESIGN.md, "Peers behind NAT").

A relay forwards a stranger's connection to a NAT'd peer only while it holds a *reservation* for that peer, and it
drops the reservation with the peer's last connection to it. go-libp2p's autorelay (inside p2pd, v0.32) asks each
static relay once; when that request fails, or the connection to the relay later drops (a link outage, a relay
restart), it does not ask that relay again for an hour (its per-relay backoff, with no daemon call to reset it).
Seen in a CI run: a home peer whose first reservation failed stayed unreachable for the whole test.

`RelayKeeper` therefore asks for the reservation itself, with circuit relay v2's hop protocol over a stream the
daemon opens (`RESERVE`, then the relay's `STATUS` reply), right after start and then every few seconds: a refresh
of a live reservation costs one 3-byte request and a short reply, and after an outage the peer is reachable
again within one interval of its link coming back. Incoming circuits are accepted by the daemon's relay transport
exactly as for autorelay's own reservation. The reply comes from another peer, so it is parsed with bounds on
every length and never trusted beyond "the relay said OK".
"""
from __future__ import annotations

import asyncio
import functools
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

import hivemind
from hivemind.p2p import P2P, PeerID
from hivemind.utils.logging import get_logger
from hivemind.utils.multiaddr import Multiaddr

from sync.hivemind_private import daemon_connect, daemon_stream_open

logger = get_logger(__name__)

HOP_PROTOCOL = "/libp2p/circuit/relay/0.2.0/hop"
# A uvarint-length-prefixed HopMessage{type: RESERVE}: field 1, varint, value 0 (explicit, as go-libp2p sends it).
RESERVE_REQUEST = bytes([2, 0x08, 0x00])
MAX_MESSAGE = 4096  # go-libp2p's circuit v2 message size limit: a longer reply is not from a relay
HOP_STATUS, STATUS_OK = 2, 100  # HopMessage.Type.STATUS, Status.OK
STATUS_NAMES = {100: "OK", 200: "RESERVATION_REFUSED", 201: "RESOURCE_LIMIT_EXCEEDED", 202: "PERMISSION_DENIED",
                203: "CONNECTION_FAILED", 204: "NO_RESERVATION", 400: "MALFORMED_MESSAGE", 401: "UNEXPECTED_MESSAGE"}
REQUEST_TIMEOUT = 10.0  # seconds for connect + reserve, as go-libp2p's own reservation request
REFRESH_EVERY = 15.0  # seconds between requests while every relay holds a reservation
RETRY_EVERY = 5.0  # ... while one does not (start-up, or the link just came back)


class RelayReplyError(ValueError):
    """The relay's reply is not a well-formed circuit v2 HopMessage, or it refused the reservation."""


@dataclass(frozen=True)
class Reservation:
    """A relay's answer to RESERVE: `expire` in Unix seconds (the relay's clock), how long and how many bytes
    each relayed connection may carry (0 = the relay set no limit)."""

    expire: int
    limit_seconds: int = 0
    limit_bytes: int = 0


def _uvarint(data: bytes, pos: int) -> tuple[int, int]:
    value = 0
    for shift in range(0, 70, 7):
        if pos >= len(data):
            raise RelayReplyError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
    raise RelayReplyError("varint longer than 10 bytes")


def _fields(data: bytes) -> list[tuple[int, int | bytes]]:
    """Protobuf fields of `data` as (number, value): varints as int, length-delimited ones as bytes; fixed-size
    fields are skipped (circuit v2 has none), unknown wire types are an error."""
    out, pos = [], 0
    while pos < len(data):
        key, pos = _uvarint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _uvarint(data, pos)
            out.append((number, value))
        elif wire == 2:
            size, pos = _uvarint(data, pos)
            if pos + size > len(data):
                raise RelayReplyError("field runs past the end of the message")
            out.append((number, data[pos:pos + size]))
            pos += size
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
            if pos > len(data):
                raise RelayReplyError("truncated fixed-size field")
        else:
            raise RelayReplyError(f"unknown wire type {wire}")
    return out


def parse_reservation(body: bytes) -> Reservation:
    """The Reservation in a relay's HopMessage reply; RelayReplyError if it is malformed or not an OK."""
    msg_type = status = None
    reservation = limit = b""
    for number, value in _fields(body):
        if number == 1 and isinstance(value, int):
            msg_type = value
        elif number == 5 and isinstance(value, int):
            status = value
        elif number == 3 and isinstance(value, bytes):
            reservation = value
        elif number == 4 and isinstance(value, bytes):
            limit = value
    if msg_type != HOP_STATUS:
        raise RelayReplyError(f"expected a STATUS message, got type {msg_type}")
    if status != STATUS_OK:
        raise RelayReplyError(f"relay refused: {STATUS_NAMES.get(status, status)}")
    expire = next((v for n, v in _fields(reservation) if n == 1 and isinstance(v, int)), None)
    if expire is None:
        raise RelayReplyError("OK without a reservation expiry")
    limits = {n: v for n, v in _fields(limit) if isinstance(v, int)}
    return Reservation(expire=expire, limit_seconds=limits.get(1, 0), limit_bytes=limits.get(2, 0))


async def _read_message(reader: asyncio.StreamReader) -> bytes:
    size, raw = 0, b""
    for shift in range(0, 70, 7):
        raw = await reader.readexactly(1)
        size |= (raw[0] & 0x7F) << shift
        if not raw[0] & 0x80:
            break
    else:
        raise RelayReplyError("length varint longer than 10 bytes")
    if size > MAX_MESSAGE:
        raise RelayReplyError(f"reply of {size} bytes (limit {MAX_MESSAGE})")
    return await reader.readexactly(size)


async def reserve(p2p: P2P, relay_maddr: str, timeout: float = REQUEST_TIMEOUT) -> Reservation:
    """Ask the relay at `relay_maddr` (a full multiaddr with /p2p/) for a reservation for `p2p`'s peer ID.

    Dials it at that address first (after an outage the daemon may have no connection, and the relay binds the
    reservation to one). Raises RelayReplyError for a refusal or a bad reply, asyncio.TimeoutError or the
    daemon's error when the relay cannot be reached."""
    maddr = Multiaddr(relay_maddr)
    peer_b58 = maddr.value_for_protocol("p2p")
    peer = PeerID.from_base58(peer_b58)

    async def run() -> Reservation:
        await daemon_connect(p2p, peer, [maddr.decapsulate(Multiaddr(f"/p2p/{peer_b58}"))])
        _, reader, writer = await daemon_stream_open(p2p, peer, [HOP_PROTOCOL])
        try:
            writer.write(RESERVE_REQUEST)
            await writer.drain()
            return parse_reservation(await _read_message(reader))
        finally:
            writer.close()

    return await asyncio.wait_for(run(), timeout)


async def _reserve_all(relays: list[str], _dht: hivemind.DHT, node: Any) -> dict[str, str]:
    """Inside the DHT process (module-level so that it pickles): reserve on every relay at once; per relay
    maddr, "" for a reservation held or the reason there is none."""
    p2p = node.protocol.p2p

    async def one(maddr: str) -> str:
        try:
            await reserve(p2p, maddr)
            return ""
        except asyncio.TimeoutError:
            return f"no answer within {REQUEST_TIMEOUT:.0f} s"
        except Exception as e:  # unreachable (link down), refused, or a malformed reply: said in the log line
            return f"{type(e).__name__}: {e}"

    return dict(zip(relays, await asyncio.gather(*(one(m) for m in relays))))


class RelayKeeper:
    """A background thread holding a reservation on each of `relays` (full multiaddrs, one per relay peer).

    Logs once per change: a reservation made, lost (with the relay's or the network's reason), and back."""

    def __init__(self, dht: hivemind.DHT, relays: Sequence[str]):
        by_peer: dict[str, str] = {}
        for maddr in relays:  # one address per relay peer: the reservation is per peer, not per address
            if "/p2p/" in str(maddr) and "/p2p-circuit" not in str(maddr):
                by_peer.setdefault(str(maddr).rsplit("/p2p/", 1)[1], str(maddr))
        self.dht, self.relays = dht, list(by_peer.values())
        self.held: dict[str, bool] = {m: False for m in self.relays}
        self._since: dict[str, float] = {m: time.monotonic() for m in self.relays}  # when it was lost
        self._warned: dict[str, bool] = {m: False for m in self.relays}
        self._ever: set[str] = set()
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._loop, name="spes-relay-keeper", daemon=True)

    def held_count(self) -> int:
        return sum(self.held.values())

    def reserve_now(self) -> int:
        """One pass in the caller's thread; returns on how many relays a reservation is held now."""
        if not self.relays:
            return 0
        errors = self.dht.run_coroutine(functools.partial(_reserve_all, self.relays))
        now = time.monotonic()
        for maddr in self.relays:
            error, short = errors.get(maddr, "no result"), maddr.rsplit("/p2p/", 1)[1][-6:]
            if not error:
                if not self.held[maddr]:
                    if maddr in self._ever:
                        logger.info(f"relay reservation on {short} back after {now - self._since[maddr]:.0f} s: "
                                    f"reachable by peer ID through it again")
                    else:
                        logger.info(f"relay reservation on {short}: reachable by peer ID through it (renewed "
                                    f"every {REFRESH_EVERY:.0f} s)")
                self.held[maddr], self._warned[maddr] = True, False
                self._ever.add(maddr)
                continue
            if not self._warned[maddr]:  # once per failure streak, not every few seconds
                logger.warning(f"relay reservation on {short} {'lost' if self.held[maddr] else 'not made'} "
                               f"({error}): peers this one never dialed cannot reach it through that relay; "
                               f"retrying every {RETRY_EVERY:.0f} s")
                self._warned[maddr] = True
            if self.held[maddr]:
                self._since[maddr] = now
            self.held[maddr] = False
        return self.held_count()

    def start(self) -> "RelayKeeper":
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.reserve_now()
            except Exception as e:  # the DHT busy or shutting down: the next pass retries
                if not self._stop.is_set():
                    logger.debug(f"relay reservation pass failed: {e!r}")
            interval = REFRESH_EVERY if self.relays and all(self.held.values()) else RETRY_EVERY
            self._wake.wait(interval)
            self._wake.clear()

    def shutdown(self) -> None:
        """Stop asking. Waits at most a second: a pass still waiting on a relay that does not answer must not
        hold a peer's stop (10 s in all); it fails harmlessly once the DHT is gone (a daemon thread)."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1.0)
