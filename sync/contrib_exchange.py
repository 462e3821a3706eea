"""Per-round contribution blobs between peers over one hivemind P2P stream handler.

Each peer publishes one opaque compressed blob per round and announces (round, size, sha256 hex digest) in its
signed DHT record; other peers fetch it from the origin or from any peer that holds a checked copy (pass-on: the
digest from the origin's signed record makes a copy from anyone as good as the origin's). This module is only the
transport: which blobs to want, and what they mean, is the round engine's.

Wire format (handler `{namespace}::_ContributionServicer.rpc_get_contribution`, one request, a response stream):

- request: `runtime_pb2.ExpertRequest(uid="{origin}@{round}@{size}@{digest}")`: base58 peer ID, decimal round and
  announced size, 64 lower hex digits. A server serves only exactly that (origin, round, digest).
- response: first message `ExpertResponse(metadata=msgpack {"size": n})`, or `{"error": reason}` and the stream
  ends (reason: "refused" (the gate turned the requester away; nothing else is said), "busy" (all
  max_concurrent_serves slots taken: try the next source at once), "missing", "bad request"); then the blob in
  order, PART_BYTES (1 MiB) per message, raw in `metadata` of one `ExpertResponse` each. If the blob held is not
  of the size asked for, only the header goes out (the fetcher then fails it: no bytes wasted on it).

Why so: the blob is already compressed bytes, so nothing needs (de)serializing, and nothing received is ever
unpickled (the header is plain msgpack without ext types). The fetch side does not use hivemind's protobuf
reader, which would buffer whatever length a frame announces: it reads the same framing itself and refuses any
frame longer than what is still owed (announced size - received + a few bytes of protobuf overhead) before
reading it, so a fetch never buffers more than `size` bytes of payload however the server behaves. Every read
has an idle bound and the whole fetch a timeout; every failure is a `ContributionError` with a one-word reason.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import re
import threading
import time
from contextlib import suppress
from typing import AsyncIterator

import hivemind
import msgpack
from google.protobuf.message import DecodeError
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils.logging import get_logger

from sync.hivemind_private import handle_name, listen_maddr

logger = get_logger(__name__)

PART_BYTES = 2**20  # payload per response message
FRAME_OVERHEAD = 8  # protobuf tag + length varint around one part (6 bytes at most for a 1 MiB part)
HEADER_LIMIT = 4096  # the first response message and remote error messages are small
SERVE_MIN_SECONDS = 30.0  # a serve slot is taken back after this plus size / SERVE_MIN_RATE (a reader that stalls)
SERVE_MIN_RATE = 256 * 2**10
MIN_IDLE = 2.0  # fetch_many: the least a source may stay silent before the next one is tried
REASONS = ("refused", "busy", "missing", "bad request")
_UID = re.compile(r"([1-9A-HJ-NP-Za-km-z]{1,128})@(\d{1,18})@(\d{1,18})@([0-9a-f]{64})")


class ContributionError(ConnectionError):
    """A fetch failed; str() is a one-word reason: refused, busy, missing, bad request, too large, truncated,
    digest mismatch, malformed, timeout, unreachable, no source, closed."""


class _ContributionServicer(ServicerBase):
    def __init__(self, exchange: "ContributionExchange") -> None:
        self.exchange = exchange

    async def rpc_get_contribution(self, request: runtime_pb2.ExpertRequest, context: P2PContext,
                                   ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for message in self.exchange._serve(request.uid, context.remote_id):
            yield message


def _header(**meta) -> runtime_pb2.ExpertResponse:
    return runtime_pb2.ExpertResponse(metadata=msgpack.packb(meta))


class ContributionExchange:
    """Serves this peer's blobs (publish) and checked copies of others' (hold); fetches others' blobs.

    namespace: the run_id, so handlers of different runs on one DHT never collide.
    gate: in a closed run the admission check (`async admits(peer_id) -> bool`, sync.admission.Gate) each
        requester must pass; None (open run) serves everyone.
    keep_rounds: blobs (own and held) of rounds older than the newest keep_rounds round numbers stored are dropped.
    max_blob_bytes: fetches of larger announced sizes fail at once ("too large"); hold() ignores larger blobs.
    max_concurrent_serves: requests beyond this many streams in flight are answered "busy".
    """

    def __init__(self, dht: hivemind.DHT, namespace: str, gate=None, keep_rounds: int = 3,
                 max_blob_bytes: int = 2**30, max_concurrent_serves: int = 8) -> None:
        if keep_rounds < 1 or max_concurrent_serves < 1:
            raise ValueError("keep_rounds and max_concurrent_serves must be >= 1")
        self.namespace, self.gate, self.keep_rounds = namespace, gate, keep_rounds
        self.max_blob_bytes, self.max_concurrent_serves = max_blob_bytes, max_concurrent_serves
        self._lock = threading.Lock()
        self._store: dict[tuple[str, int, str], bytes] = {}  # (origin, round, digest) -> blob
        self._served_to: dict[tuple[str, int], set[str]] = {}  # (origin, round) -> requesters sent the whole blob
        self._sent = self._received = 0
        self._serving = 0  # streams in flight; touched on the loop thread only
        self._closed = False
        self._p2p: P2P | None = None
        self._servicer = _ContributionServicer(self)
        self._handle = handle_name(_ContributionServicer, namespace, "rpc_get_contribution")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"contrib-{namespace}", daemon=True)
        self._thread.start()
        try:
            # A private replica (as sync/transfer.py): bound to this loop, and our shutdown closes only it.
            maddr = listen_maddr(dht)
            asyncio.run_coroutine_threadsafe(self._astart(maddr), self._loop).result(timeout=30)
        except BaseException:
            self.shutdown()
            raise
        self.peer_id: str = self._p2p.peer_id.to_base58()

    async def _astart(self, maddr) -> None:
        self._p2p = await P2P.replicate(maddr)
        await self._servicer.add_p2p_handlers(self._p2p, namespace=self.namespace)

    # ---- holding and serving -------------------------------------------------------------------------------

    def publish(self, round_id: int, blob: bytes, digest: str) -> None:
        """Serve this peer's own blob for round_id (the digest is the one announced; not re-checked here)."""
        self._put(self.peer_id, round_id, blob, digest)

    def hold(self, origin: str, round_id: int, blob: bytes, digest: str) -> None:
        """Keep and serve a blob of `origin` that was already checked against its signed digest."""
        if len(blob) <= self.max_blob_bytes:
            self._put(origin, round_id, blob, digest)

    def _put(self, origin: str, round_id: int, blob: bytes, digest: str) -> None:
        with self._lock:
            if self._closed:
                return
            self._store[(str(origin), int(round_id), digest.lower())] = bytes(blob)
            rounds = sorted({r for _, r, _ in self._store})
            if len(rounds) > self.keep_rounds:
                cutoff = rounds[-self.keep_rounds]
                self._store = {k: v for k, v in self._store.items() if k[1] >= cutoff}
                self._served_to = {k: v for k, v in self._served_to.items() if k[1] >= cutoff}

    async def _serve(self, uid: str, requester: PeerID) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """The response stream for one request; never raises."""
        match, blob = _UID.fullmatch(uid), None
        if match is not None:
            with self._lock:
                blob = self._store.get((match[1], int(match[2]), match[4]))
        # An unadmitted peer learns nothing else; "busy" at once, so the fetcher tries its next source.
        error = ("refused" if self.gate is not None and not await self.gate.admits(requester) else
                 "busy" if self._serving >= self.max_concurrent_serves else
                 "bad request" if match is None else "missing" if blob is None else None)
        if error is not None:
            yield _header(error=error)
            return
        self._serving += 1
        # A requester that stops reading would hold its slot forever: take the slot back after a generous time.
        watchdog = self._loop.call_later(SERVE_MIN_SECONDS + len(blob) / SERVE_MIN_RATE, asyncio.current_task().cancel)
        try:
            yield _header(size=len(blob))
            if len(blob) != int(match[3]):
                return
            for offset in range(0, len(blob), PART_BYTES):
                part = blob[offset:offset + PART_BYTES]
                yield runtime_pb2.ExpertResponse(metadata=part)
                self._count(sent=len(part))
            with self._lock:
                self._served_to.setdefault((match[1], int(match[2])), set()).add(requester.to_base58())
        finally:
            watchdog.cancel()
            self._serving -= 1

    def served_to(self, origin: str, round_id: int) -> set[str]:
        """Peers this exchange sent origin's whole blob of round_id to (a fetcher may have got it elsewhere)."""
        with self._lock:
            return set(self._served_to.get((str(origin), int(round_id)), ()))

    # ---- fetching ------------------------------------------------------------------------------------------

    def fetch(self, source: str, origin: str, round_id: int, size: int, digest: str, timeout: float) -> bytes:
        """Blocking: origin's blob of round_id from `source`, checked against size and digest; raises only
        ContributionError, within `timeout` (plus scheduling slack)."""
        coro = self._fetch_one(source, origin, int(round_id), int(size), digest, timeout, timeout)
        result = self._run_blocking(coro, timeout)
        if isinstance(result, ContributionError):
            raise result
        return result

    def fetch_many(self, requests: list[tuple[list[str], str, int, int, str]], deadline: float,
                   ) -> dict[str, bytes | ContributionError]:
        """All requests at once, each trying its sources in order until one succeeds or time.monotonic() passes
        `deadline`; keyed by origin. Blobs fetched are held (and so served on) by this peer."""
        requests = list(requests)
        outcome = self._run_blocking(self._fetch_many(requests, deadline), deadline - time.monotonic())
        if isinstance(outcome, ContributionError):
            return {origin: outcome for _, origin, *_ in requests}
        return outcome

    def _run_blocking(self, coro, timeout: float):
        if self._closed or threading.current_thread() is self._thread:  # (on our own loop it would deadlock)
            coro.close()
            return ContributionError("closed" if self._closed else "wrong thread")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout=max(timeout, 0.0) + 3.0)  # the coroutine bounds itself; slack for scheduling
        except concurrent.futures.TimeoutError:
            future.cancel()
            return ContributionError("timeout")
        except concurrent.futures.CancelledError:
            return ContributionError("closed")

    async def _fetch_many(self, requests, deadline: float) -> dict[str, bytes | ContributionError]:
        async def one(sources: list[str], origin: str, round_id: int, size: int, digest: str):
            error = ContributionError("no source" if not sources else "timeout")
            for i, source in enumerate(sources):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                # A silent source gets its share of the time left, so later sources are still tried.
                idle = min(remaining, max(MIN_IDLE, remaining / (len(sources) - i)))
                try:
                    blob = await self._fetch_one(source, origin, int(round_id), int(size), digest, remaining, idle)
                except ContributionError as e:
                    error = e
                    continue
                if origin != self.peer_id:
                    self.hold(origin, round_id, blob, digest)
                return origin, blob
            return origin, error

        results = await asyncio.gather(*(one(*request) for request in requests))
        return dict(results)

    async def _fetch_one(self, source: str, origin: str, round_id: int, size: int, digest: str,
                         timeout: float, idle: float) -> bytes:
        """One source; raises ContributionError only. A stream that ends before its first message (seen rarely
        on a loaded machine, see sync/fetch_client.py) is tried once more within the same timeout."""
        what = f"contribution of {origin}@{round_id} from {source}"
        if size > self.max_blob_bytes or size < 0:
            raise ContributionError("too large")
        end = time.monotonic() + timeout
        for _ in range(2):
            try:
                return await asyncio.wait_for(self._attempt(source, origin, round_id, size, str(digest).lower(), idle),
                                              max(end - time.monotonic(), 0))
            except ContributionError as e:
                error = e
            except asyncio.TimeoutError:
                error = ContributionError("timeout")
            except Exception as e:  # no such peer, no handler there, connection broken
                logger.debug(f"Could not fetch {what}: {type(e).__name__}: {e}")
                error = ContributionError("unreachable")
            if str(error) != "empty" or time.monotonic() >= end:
                break
        reason = "truncated" if str(error) == "empty" else str(error)
        logger.debug(f"Failed to fetch {what}: {reason}")
        raise ContributionError(reason)

    async def _attempt(self, source: str, origin: str, round_id: int, size: int, digest: str, idle: float) -> bytes:
        peer = PeerID.from_base58(source)  # an unparsable one fails as "unreachable"
        _, reader, writer = await asyncio.wait_for(self._p2p.call_binary_stream_handler(peer, self._handle), idle)
        try:
            await P2P.send_protobuf(runtime_pb2.ExpertRequest(uid=f"{origin}@{round_id}@{size}@{digest}"), writer)
            await P2P.send_protobuf(P2P.END_OF_STREAM, writer)
            first = await asyncio.wait_for(self._read_message(reader, HEADER_LIMIT, "malformed"), idle)
            if first is None:
                raise ContributionError("empty")
            try:
                meta = msgpack.unpackb(first.metadata, raw=False)
                error, served = meta.get("error"), meta.get("size")
            except Exception:
                raise ContributionError("malformed") from None
            if error is not None:
                raise ContributionError(error if error in REASONS else "refused")
            if type(served) is not int:
                raise ContributionError("malformed")
            if served != size:
                raise ContributionError("too large" if served > size else "truncated")
            hasher, parts, received = hashlib.sha256(), [], 0
            while received < size:
                owed = size - received
                message = await asyncio.wait_for(self._read_message(reader, owed + FRAME_OVERHEAD, "too large"), idle)
                if message is None:
                    raise ContributionError("truncated")
                part = message.metadata
                self._count(received=len(part))
                if len(part) > owed:
                    raise ContributionError("too large")
                if not part or len(message.tensors):
                    raise ContributionError("malformed")
                hasher.update(part)
                parts.append(part)
                received += len(part)
            if hasher.hexdigest() != digest:
                raise ContributionError("digest mismatch")
            return b"".join(parts)
        finally:
            with suppress(Exception):
                writer.close()

    @staticmethod
    async def _read_message(reader: asyncio.StreamReader, limit: int, too_long: str,
                            ) -> runtime_pb2.ExpertResponse | None:
        """One frame of hivemind's protobuf framing, refused before reading if longer than `limit`; None at
        the end of the stream."""
        marker = await reader.read(1)
        if not marker:
            return None
        if marker != P2P.MESSAGE_MARKER:  # an error message (the remote handler failed) or garbage
            raise ContributionError("refused" if marker == P2P.ERROR_MARKER else "malformed")
        message = runtime_pb2.ExpertResponse()
        try:
            length = int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
            if length > limit:
                raise ContributionError(too_long)
            message.ParseFromString(await reader.readexactly(length))
        except asyncio.IncompleteReadError:
            raise ContributionError("truncated") from None
        except DecodeError:
            raise ContributionError("malformed") from None
        return message

    # ---- accounting and lifetime ---------------------------------------------------------------------------

    def _count(self, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            self._sent, self._received = self._sent + sent, self._received + received

    def bytes_sent(self) -> int:
        """Blob payload bytes served to others."""
        return self._sent

    def bytes_received(self) -> int:
        """Blob payload bytes received, including those of fetches that failed their checks."""
        return self._received

    async def _ashutdown(self) -> None:
        if self._p2p is not None:
            with suppress(Exception):  # the daemon may be gone with its DHT already
                await asyncio.wait_for(self._servicer.remove_p2p_handlers(self._p2p, namespace=self.namespace), 3)
            with suppress(Exception):
                await self._p2p.shutdown()
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in pending:  # fetches and streams still in flight end now
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    def shutdown(self) -> None:
        """Stop serving, cancel fetches in flight, close the P2P replica and the loop thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._store = {}
        if self._thread.is_alive():
            with suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._ashutdown(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()

