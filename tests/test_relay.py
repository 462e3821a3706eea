"""sync/relay.py: the circuit v2 reply parser against well-formed and hostile bytes, and RelayKeeper on real
hivemind DHTs over loopback: a stranger reaches a peer through the relay only while the peer holds a
reservation, and after the peer's connection to the relay dropped (the relay forgets the reservation; p2pd's
autorelay would not ask again for an hour) the keeper's next pass makes it reachable again."""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any

import hivemind
import pytest
from hivemind.p2p import PeerID
from sync.hivemind_private import daemon_connect, daemon_disconnect

from tests.netlab_p2p import daemon_multiaddr
from sync.relay import MAX_MESSAGE, RelayKeeper, RelayReplyError, _read_message, parse_reservation

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def _varint(n: int) -> bytes:
    out = b""
    while True:
        out += bytes([(n & 0x7F) | (0x80 if n > 0x7F else 0)])
        n >>= 7
        if not n:
            return out


def _field(number: int, value: int | bytes) -> bytes:
    if isinstance(value, int):
        return _varint(number << 3) + _varint(value)
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def _status(status: int, expire: int | None = 1_900_000_000, limit: bytes = b"") -> bytes:
    reservation = _field(1, expire) + _field(2, b"\x04\x7f\x00\x00\x01") if expire is not None else b""
    body = _field(1, 2) + _field(5, status)
    return body + (_field(3, reservation) if reservation else b"") + (_field(4, limit) if limit else b"")


def test_parse_reservation_reads_an_ok_and_its_limits() -> None:
    r = parse_reservation(_status(100, limit=_field(1, 120) + _field(2, 131072)))
    assert (r.expire, r.limit_seconds, r.limit_bytes) == (1_900_000_000, 120, 131072)
    assert parse_reservation(_status(100) + _field(9, b"future field")).expire == 1_900_000_000


@pytest.mark.parametrize("body,reason", [
    (_status(204), "NO_RESERVATION"),
    (_status(200), "RESERVATION_REFUSED"),
    (_status(100, expire=None), "without a reservation expiry"),
    (_field(1, 1) + _field(5, 100), "expected a STATUS"),
    (b"", "expected a STATUS"),
    (_status(100)[:-3], "past the end"),
    (b"\x08" + b"\xff" * 12, "longer than 10 bytes"),
    (b"\x0b", "unknown wire type"),
    (_field(1, 2) + _field(5, 100) + bytes([3 << 3 | 2, 200]) + b"x", "past the end"),
])
def test_parse_reservation_refuses_refusals_and_malformed_replies(body: bytes, reason: str) -> None:
    with pytest.raises(RelayReplyError, match=reason):
        parse_reservation(body)


def test_a_reply_longer_than_the_relay_limit_is_not_read() -> None:
    async def read() -> bytes:
        reader = asyncio.StreamReader()
        reader.feed_data(_varint(MAX_MESSAGE + 1) + b"x" * 16)
        return await _read_message(reader)

    with pytest.raises(RelayReplyError, match="limit"):
        asyncio.run(read())


async def _dial_via_relay(relay_maddr: str, target: str, _dht: hivemind.DHT, node: Any) -> str:
    """Inside `fresh`'s DHT process: connect to `target` only through the relay's circuit; "" or the error."""
    p2p = node.protocol.p2p
    peer = PeerID.from_base58(target)
    try:
        await daemon_disconnect(p2p, peer)  # a connection from an earlier check would make connect a no-op
        await daemon_connect(p2p, peer, [daemon_multiaddr(f"{relay_maddr}/p2p-circuit")])
        return ""
    except Exception as e:
        return str(e)


async def _drop_connection(peer_b58: str, _dht: hivemind.DHT, node: Any) -> None:
    await daemon_disconnect(node.protocol.p2p, PeerID.from_base58(peer_b58))


def _dial_ok_within(fresh: hivemind.DHT, dial: Any, seconds: float) -> str:
    """Dial until it works: libp2p backs an address off for ~5 s after a failed dial (the NO_RESERVATION one)."""
    deadline = time.monotonic() + seconds
    while (error := fresh.run_coroutine(dial)) and time.monotonic() < deadline:
        time.sleep(1.0)
    return error


def test_keeper_makes_a_peer_reachable_through_the_relay_and_again_after_the_connection_dropped(caplog) -> None:
    dhts: list[hivemind.DHT] = []
    try:
        relay = hivemind.DHT(start=True, host_maddrs=LOOPBACK)
        dhts.append(relay)
        relay_maddr = str(relay.get_visible_maddrs()[0])
        relay_id = relay.peer_id.to_base58()
        # Listening on nothing: like a peer behind NAT, reachable only over connections it opened itself.
        home = hivemind.DHT(start=True, no_listen=True, client_mode=True, initial_peers=[relay_maddr])
        dhts.append(home)
        fresh = hivemind.DHT(start=True, host_maddrs=LOOPBACK, initial_peers=[relay_maddr])
        dhts.append(fresh)
        dial = functools.partial(_dial_via_relay, relay_maddr, home.peer_id.to_base58())

        assert "NO_RESERVATION" in fresh.run_coroutine(dial)  # connected to the relay, but nothing reserved

        keeper = RelayKeeper(home, [relay_maddr, f"{relay_maddr}/p2p-circuit", "/ip4/127.0.0.1/tcp/1"])
        assert keeper.relays == [relay_maddr]  # one per relay peer; circuits and ID-less addresses are not relays
        with caplog.at_level(logging.INFO, logger="sync.relay"):
            assert keeper.reserve_now() == 1
            assert _dial_ok_within(fresh, dial, 20) == ""

            # The relay forgets a reservation with the peer's last connection to it (a link outage does this).
            home.run_coroutine(functools.partial(_drop_connection, relay_id))
            assert "NO_RESERVATION" in fresh.run_coroutine(dial)
            assert keeper.reserve_now() == 1  # it dials the relay again and reserves
            assert _dial_ok_within(fresh, dial, 20) == ""
        text = caplog.text
        assert f"relay reservation on {relay_id[-6:]}: reachable by peer ID" in text
        # This pass never saw the reservation missing (the drop happened between passes): no "lost" line.
        assert "lost" not in text

        # A relay that cannot be reached (its daemon stopped): a warning once, not one per pass.
        dead = hivemind.DHT(start=True, host_maddrs=LOOPBACK)
        dead_maddr = str(dead.get_visible_maddrs()[0])
        dead.shutdown()
        gone = RelayKeeper(home, [dead_maddr])
        with caplog.at_level(logging.INFO, logger="sync.relay"):
            caplog.clear()
            assert gone.reserve_now() == 0 and gone.reserve_now() == 0
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "not made" in warnings[0].getMessage(), caplog.text
    finally:
        for dht in reversed(dhts):
            dht.shutdown()
