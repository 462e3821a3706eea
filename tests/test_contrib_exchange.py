"""Contribution blobs between real hivemind peers on 127.0.0.1 (sync.contrib_exchange).

Three DHTs run inside this pytest process; every DHT and exchange is shut down in fixtures so no p2pd process
outlives the module. Hostile servers are subclasses that override the serving side only.
"""
from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time
import uuid

import hivemind
import pytest
from hivemind.proto import runtime_pb2

from sync.contrib_exchange import PART_BYTES, ContributionError, ContributionExchange, _header

NO_SUCH_PEER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"  # a well-formed peer ID nobody here has


def make_blob(nbytes: int = 3 * 2**20 + 12345) -> tuple[bytes, str]:
    blob = os.urandom(nbytes)
    return blob, hashlib.sha256(blob).hexdigest()


@pytest.fixture(scope="module")
def dhts():
    """Three connected DHT peers on loopback: A (bootstrap), B and C."""
    started: list[hivemind.DHT] = []
    try:
        started.append(hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
        maddrs = started[0].get_visible_maddrs()
        for _ in range(2):
            started.append(hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=maddrs))
        yield started
    finally:
        for dht in started:
            dht.shutdown()
        for dht in started:
            dht.join(timeout=10)


@pytest.fixture
def exchanges(dhts):
    """make(dht_index, cls=ContributionExchange, **kwargs): exchanges in one fresh namespace, all shut down after."""
    namespace, created = f"test-{uuid.uuid4().hex[:8]}", []

    def make(index: int, cls: type = ContributionExchange, **kwargs) -> ContributionExchange:
        created.append(cls(dhts[index], namespace, **kwargs))
        return created[-1]

    try:
        yield make
    finally:
        for exchange in created:
            exchange.shutdown()


class Stalling(ContributionExchange):
    """Answers the header, then sends nothing more (holding its serve slot meanwhile)."""

    async def _serve(self, uid, requester):
        async for message in super()._serve(uid, requester):
            yield message
            await asyncio.sleep(3600)


class Lying(ContributionExchange):
    """Announces whatever size is asked for, then streams the whole blob it holds regardless."""

    async def _serve(self, uid, requester):
        origin, round_id, size, digest = uid.split("@")
        blob = self._store[(origin, int(round_id), digest)]
        yield _header(size=int(size))
        for offset in range(0, len(blob), PART_BYTES):
            yield runtime_pb2.ExpertResponse(metadata=blob[offset:offset + PART_BYTES])


def reason(call) -> str:
    with pytest.raises(ContributionError) as info:
        call()
    return str(info.value)


def test_fetch_intact_and_counted(exchanges):
    a, b = exchanges(0), exchanges(1)
    blob, digest = make_blob()
    a.publish(7, blob, digest)
    started = time.monotonic()
    assert b.fetch(a.peer_id, a.peer_id, 7, len(blob), digest, timeout=20) == blob
    assert time.monotonic() - started < 10
    assert a.bytes_sent() == len(blob) and b.bytes_received() == len(blob)
    assert b.bytes_sent() == 0 and a.bytes_received() == 0
    assert a.served_to(a.peer_id, 7) == {b.peer_id} and a.served_to(a.peer_id, 6) == set()  # (a finished peer's linger)
    # Uppercase digests are the same digest; an empty blob is a blob too.
    assert b.fetch(a.peer_id, a.peer_id, 7, len(blob), digest.upper(), timeout=20) == blob
    a.publish(8, b"", hashlib.sha256(b"").hexdigest())
    assert b.fetch(a.peer_id, a.peer_id, 8, 0, hashlib.sha256(b"").hexdigest(), timeout=10) == b""


def test_pass_on_after_origin_is_gone(exchanges):
    a, b, c = exchanges(0), exchanges(1), exchanges(2)
    blob, digest = make_blob(2 * 2**20)
    a.publish(3, blob, digest)
    got = b.fetch_many([([a.peer_id], a.peer_id, 3, len(blob), digest)], deadline=time.monotonic() + 20)
    assert got == {a.peer_id: blob}
    a.shutdown()  # the origin stops serving: only B's held copy is left
    assert reason(lambda: c.fetch(a.peer_id, a.peer_id, 3, len(blob), digest, timeout=5)) == "unreachable"
    assert c.fetch(b.peer_id, a.peer_id, 3, len(blob), digest, timeout=20) == blob
    assert b.bytes_sent() == len(blob) and c.bytes_received() == len(blob)
    # B holds it under A's name and A's digest only.
    assert reason(lambda: c.fetch(b.peer_id, b.peer_id, 3, len(blob), digest, timeout=5)) == "missing"


def test_digest_mismatch(exchanges):
    a, b = exchanges(0), exchanges(1)
    blob, _ = make_blob(2**20 + 1)
    _, other_digest = make_blob(2**20 + 1)
    a.publish(1, blob, other_digest)  # announced a digest that is not this blob's
    assert reason(lambda: b.fetch(a.peer_id, a.peer_id, 1, len(blob), other_digest, timeout=10)) == "digest mismatch"
    assert b.bytes_received() == len(blob)  # read whole, then refused


def test_announced_size_smaller_than_blob(exchanges):
    a, b = exchanges(0), exchanges(1)
    blob, digest = make_blob(3 * 2**20)
    a.publish(1, blob, digest)
    # An honest server names the real size and sends nothing more.
    assert reason(lambda: b.fetch(a.peer_id, a.peer_id, 1, len(blob) - 1, digest, timeout=10)) == "too large"
    assert b.bytes_received() == 0 and a.bytes_sent() == 0
    # A lying one streams past what was announced: refused before reading more than the announced size.
    liar = exchanges(2, cls=Lying)
    liar.hold(a.peer_id, 1, blob, digest)
    size = 2 * 2**20 + 100
    assert reason(lambda: b.fetch(liar.peer_id, a.peer_id, 1, size, digest, timeout=10)) == "too large"
    assert b.bytes_received() <= size
    # ... and one that ends short of it is "truncated".
    before = b.bytes_received()
    assert reason(lambda: b.fetch(liar.peer_id, a.peer_id, 1, len(blob) + 10, digest, timeout=10)) == "truncated"
    assert b.bytes_received() - before == len(blob)
    assert reason(lambda: b.fetch(a.peer_id, a.peer_id, 1, 2**31, digest, timeout=10)) == "too large"  # > max


def test_missing_and_kept_rounds(exchanges):
    a, b = exchanges(0, keep_rounds=2), exchanges(1)
    blobs = {r: make_blob(1000 + r) for r in range(1, 5)}
    for r, (blob, digest) in blobs.items():
        a.publish(r, blob, digest)
    for r, (blob, digest) in blobs.items():
        fetch = lambda: b.fetch(a.peer_id, a.peer_id, r, len(blob), digest, timeout=10)  # noqa: E731
        if r <= 2:  # older than the newest keep_rounds
            assert reason(fetch) == "missing"
        else:
            assert fetch() == blob
    blob, digest = blobs[4]
    assert reason(lambda: b.fetch(a.peer_id, a.peer_id, 99, len(blob), digest, timeout=10)) == "missing"
    assert reason(lambda: b.fetch(a.peer_id, b.peer_id, 4, len(blob), digest, timeout=10)) == "missing"
    assert reason(lambda: b.fetch(a.peer_id, a.peer_id, 4, len(blob), "zz", timeout=10)) == "bad request"


def test_stalls_and_busy_end_within_timeout(exchanges):
    staller, b, c = exchanges(0, cls=Stalling, max_concurrent_serves=1), exchanges(1), exchanges(2)
    blob, digest = make_blob(2**20)
    staller.publish(1, blob, digest)
    for source, timeout in ((NO_SUCH_PEER, 2.0), ("not a peer id", 2.0), (staller.peer_id, 1.5)):
        started = time.monotonic()
        with pytest.raises(ContributionError):
            b.fetch(source, staller.peer_id, 1, len(blob), digest, timeout=timeout)
        assert time.monotonic() - started < timeout + 1.0
    # While one stream holds the only slot, others are answered "busy" at once; the slot comes back after.
    outcome = {}
    holder = threading.Thread(target=lambda: outcome.update(
        first=reason(lambda: b.fetch(staller.peer_id, staller.peer_id, 1, len(blob), digest, timeout=3))))
    holder.start()
    try:
        time.sleep(1.0)
        started = time.monotonic()
        assert reason(lambda: c.fetch(staller.peer_id, staller.peer_id, 1, len(blob), digest, timeout=5)) == "busy"
        assert time.monotonic() - started < 2
    finally:
        holder.join()
    assert outcome["first"] == "timeout"
    time.sleep(0.5)
    assert reason(lambda: c.fetch(staller.peer_id, staller.peer_id, 1, len(blob), digest, timeout=1)) == "timeout"


def test_fetch_many_falls_to_next_source(exchanges):
    a, staller, c = exchanges(0), exchanges(1, cls=Stalling), exchanges(2)
    blob, digest = make_blob(2 * 2**20)
    a.publish(2, blob, digest)
    staller.hold(a.peer_id, 2, blob, digest)
    started = time.monotonic()
    got = c.fetch_many([
        ([NO_SUCH_PEER, staller.peer_id, a.peer_id], a.peer_id, 2, len(blob), digest),
        ([NO_SUCH_PEER], staller.peer_id, 2, 10, "0" * 64),
        ([], "nobody", 2, 10, "0" * 64),
    ], deadline=time.monotonic() + 9)
    assert time.monotonic() - started < 9 + 1
    assert got[a.peer_id] == blob  # after the missing peer and the one that stalled (its share of the time)
    assert str(got[staller.peer_id]) == "unreachable" and str(got["nobody"]) == "no source"
    # Fetched blobs are held and passed on.
    assert a.fetch(c.peer_id, a.peer_id, 2, len(blob), digest, timeout=10) == blob
    assert c.bytes_received() == len(blob) and c.bytes_sent() == len(blob)


def test_gate(exchanges):
    class Gate:
        def __init__(self, admitted: bool) -> None:
            self.admitted, self.asked = admitted, []

        async def admits(self, peer_id) -> bool:
            self.asked.append(peer_id.to_base58())
            return self.admitted

    closed, open_ = Gate(False), Gate(True)
    a, b, c = exchanges(0, gate=closed), exchanges(1, gate=open_), exchanges(2)
    blob, digest = make_blob(4096)
    a.publish(1, blob, digest)
    b.publish(1, blob, digest)
    assert reason(lambda: c.fetch(a.peer_id, a.peer_id, 1, len(blob), digest, timeout=10)) == "refused"
    assert reason(lambda: c.fetch(a.peer_id, a.peer_id, 9, len(blob), digest, timeout=10)) == "refused"
    assert c.fetch(b.peer_id, b.peer_id, 1, len(blob), digest, timeout=10) == blob
    assert closed.asked == [c.peer_id] * 2 and open_.asked == [c.peer_id]
    assert a.bytes_sent() == 0


def test_shutdown_is_idempotent_and_final(dhts):
    before = {t.ident for t in threading.enumerate()}
    exchange = ContributionExchange(dhts[0], f"test-{uuid.uuid4().hex[:8]}")
    exchange.shutdown()
    exchange.shutdown()
    assert {t.ident for t in threading.enumerate()} <= before
    assert reason(lambda: exchange.fetch(NO_SUCH_PEER, NO_SUCH_PEER, 1, 1, "0" * 64, timeout=1)) == "closed"
    assert str(exchange.fetch_many([([NO_SUCH_PEER], "x", 1, 1, "0" * 64)], time.monotonic() + 1)["x"]) == "closed"
