"""Expert transfer between peers over one hivemind P2P handler keyed by expert ID (docs/DESIGN.md, "Joining and
state downloads"; what a hostile server or requester can do: "Hostile peers").

Each peer runs one `ExpertExchange`: it serves the experts it published for recent sync rounds (and, if asked, its
synchronized shared values or an owned expert's AdamW moments) and fetches other peers' (sync/fetch_client.py), all
through a single streaming rpc handler. A joiner or a peer that fell behind fetches from them (sync/fetch.py,
sync/repair.py). Wire format:

- request: `runtime_pb2.ExpertRequest(uid="{expert}@{round}")` (or `"s0@{round}"`: the synchronized shared
  values; `"m{expert}@0"`: the owner's AdamW moments of the expert, for a peer taking it over; docs/DESIGN.md
  "Coverage"), optionally with `metadata` = MSGPack `{"min_round": m, "bf16": true}` (both optional, at most 256
  bytes; other keys are ignored, see sync/codec.py `parse_request_metadata`): if that round is not there, an older
  copy no older than round `m` may be served instead (an owner one round behind); `bf16`: the fetcher stores the
  copy in bf16, so it gets the tensors rounded to bf16 (half the bytes; moments never);
- response stream of `runtime_pb2.ExpertResponse`: first message `metadata` = MSGPack `{"names": [...],
  "round": r}` — r is the round asked for, or the owner's newest if that one is gone and a later one exists;
  older only as `min_round` allows — (or `{"error": "missing" | "bad request" | "internal" | "unauthorized"}`
  and the stream ends), then the tensors, each serialized with hivemind's codecs and cut into parts by
  `split_for_streaming` (so tensors bigger than a p2p message work), several parts per message.

Nothing received is unpickled: metadata is MSGPack, tensors go through hivemind's deserializers (or the local
8-bit decoder in sync/codec.py). Fetched tensors are *not* validated here; callers run `sync.validate.validate_tensors`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from contextlib import suppress
from typing import AsyncIterator, Callable

import torch
from hivemind.dht import DHT
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils.logging import get_logger
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.streaming import split_for_streaming

from sync.codec import COMPRESSION_TYPES, parse_request_metadata as _parse_request_metadata
from sync.codec import parse_uid as _parse_uid
from sync.codec import serialize_tensor as _serialize_tensor
from sync.fetch_client import ExpertClient, FetchedExpert  # noqa: F401 (FetchedExpert: imported from here)
from sync.hivemind_private import listen_maddr
from sync.validate import RejectCounter

logger = get_logger(__name__)

# 16 parts of hivemind's 64 KiB streaming chunk = 1 MiB per message: fewer Python round trips per tensor.
PARTS_PER_MESSAGE = 16
# A hostile server could stream forever inside the timeout; cap what one fetch may buffer.
DEFAULT_MAX_FETCH_BYTES = 16 * 2**30
# A requester that stops reading holds its stream's slot: taken back after this long without a message sent.
SERVE_IDLE_S = 30.0


class _Entry:
    """One published (expert, round): CPU snapshot until every form it can be asked for was made (as published,
    and bf16 for fetchers that store copies in bf16), then only the serialized forms."""

    def __init__(self, names: list[str], tensors: list[torch.Tensor], codec: int | None = None) -> None:
        self.names = names
        self.codec = codec  # None: the exchange's
        self.tensors: list[torch.Tensor] | None = tensors
        # Serialized forms by "bf16" (False: as published, with the exchange's codec); the jobs making them are
        # touched only on the exchange's loop thread.
        self.serialized: dict[bool, list[runtime_pb2.Tensor]] = {}
        self.job: dict[bool, asyncio.Future] = {}


class _ExpertServicer(ServicerBase):
    """The rpc handler: `{namespace}::_ExpertServicer.rpc_get_expert`."""

    def __init__(self, exchange: "ExpertExchange") -> None:
        self.exchange = exchange

    async def rpc_get_expert(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        gate = self.exchange.gate
        if gate is not None and not await gate.admits(context.remote_id):
            # Closed run: a peer without a valid ticket gets nothing, not even whether the expert exists.
            self.exchange.rejects.add("unauthorized")
            logger.debug(f"Refusing expert request from unadmitted peer {context.remote_id}")
            yield runtime_pb2.ExpertResponse(metadata=MSGPackSerializer.dumps({"error": "unauthorized"}))
            return
        exchange, remote = self.exchange, context.remote_id
        if not exchange._take_slot(remote):  # "busy": the fetcher goes on with its other sources
            yield runtime_pb2.ExpertResponse(metadata=MSGPackSerializer.dumps({"error": "busy"}))
            return
        task = asyncio.current_task()
        watchdog = asyncio.get_running_loop().call_later(SERVE_IDLE_S, task.cancel)
        try:
            async for message in exchange._serve(request.uid, request.metadata):
                yield message
                watchdog.cancel()
                watchdog = asyncio.get_running_loop().call_later(SERVE_IDLE_S, task.cancel)
        finally:
            watchdog.cancel()
            exchange._give_slot(remote)

    async def rpc_leaving(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertUID:
        """A leaving peer's poke (sync/leave.py): read the records now, to see its tombstone and fetch the moments
        of the experts this peer adopts while it still serves them. Ungated: all a poke does is make the reader
        read, at most once per poll whoever sends it (sync.progress.SwarmProgress.wake)."""
        if self.exchange.on_leaving is not None:
            self.exchange.on_leaving()
        return runtime_pb2.ExpertUID()


class ExpertExchange(ExpertClient):
    """Serves this peer's published experts and fetches other peers' experts through one P2P handler.

    namespace: the run_id, so handlers of different runs on one DHT never collide.
    compression: none | fp16 | 8bit (hivemind NONE / FLOAT16 / UNIFORM_8BIT) for everything this peer serves.
    keep_rounds: how many newest rounds per expert stay available to fetchers.
    rejects: where malformed responses are counted (reason "malformed"); a fresh counter if omitted.
    gate: in a closed run, the admission check (`async admits(peer_id) -> bool`, sync.admission.Gate) every
        request's libp2p-authenticated sender must pass; None (open run) serves everyone.
    response_limit: (expert or SHARED_KEY, moments?) -> the most payload bytes a response may bring (the peer
        derives it from its model: a stranger cannot make a fetch buffer more than the tensors asked for).
    streams_per_peer, streams: the most responses served at once to one remote peer and to all of them; more
        are answered "busy" (the peer derives them from its model: a joiner asks every expert of an owner and
        the shared tensors at once). A stream idle for SERVE_IDLE_S is taken back.
    """

    def __init__(self, dht: DHT, namespace: str, compression: str = "none", keep_rounds: int = 2,
                 rejects: RejectCounter | None = None, start_timeout: float = 30.0,
                 max_fetch_bytes: int = DEFAULT_MAX_FETCH_BYTES, gate=None,
                 response_limit: Callable[[int, bool], int] | None = None, streams_per_peer: int = 64,
                 streams: int = 256) -> None:
        if compression not in COMPRESSION_TYPES:
            raise ValueError(f"compression must be one of {sorted(COMPRESSION_TYPES)}, got {compression!r}")
        if keep_rounds < 1:
            raise ValueError(f"keep_rounds must be >= 1, got {keep_rounds}")
        self.namespace, self.compression, self.keep_rounds = namespace, compression, keep_rounds
        self.rejects = rejects if rejects is not None else RejectCounter()
        self.max_fetch_bytes = max_fetch_bytes
        self.response_limit = response_limit
        self.streams_per_peer, self.streams = streams_per_peer, streams
        self._serving: dict[PeerID, int] = {}  # remote peer -> responses in flight (touched on the loop only)
        self.gate = gate
        # Set by the peer: expert -> its optimizer moments (name -> tensor) if this peer owns it, else None.
        self.moments_provider: Callable[[int], dict[str, torch.Tensor] | None] | None = None
        # (expert, round) -> the synchronized value this peer holds of an expert it did not publish, if it is of
        # that round (sync/repair.py: a repairing peer needs every expert's value, its own ones included).
        self.synced_provider: Callable[[int, int], dict[str, torch.Tensor] | None] | None = None
        self.moments_served: set[int] = set()  # experts whose moments went out whole (a leaver's grace, sync/leave)
        self.on_leaving: Callable[[], None] | None = None  # called on another peer's leave poke (rpc_leaving)
        self._codec = COMPRESSION_TYPES[compression]
        self._lock = threading.Lock()
        self._store: dict[int, dict[int, _Entry]] = {}
        self._bytes = {"sent": {"expert": 0, "shared": 0}, "received": {"expert": 0, "shared": 0}}
        self._servicer = _ExpertServicer(self)
        self._p2p: P2P | None = None
        self._closed = False
        # Codec work runs here, off the event loop, so one big tensor does not stall other transfers.
        self._executor = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="expert-codec")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name=f"expert-exchange-{namespace}", daemon=True)
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._astart(dht), self._loop).result(timeout=start_timeout)
        except BaseException:
            self.shutdown()
            raise
        self.peer_id: PeerID = self._p2p.peer_id

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    async def _astart(self, dht: DHT) -> None:
        # A private P2P replica, not dht.replicate_p2p() (cached per DHT object): other components replicating
        # on their own event loops are then not bound to this loop, and our shutdown does not close theirs.
        maddr = await asyncio.get_running_loop().run_in_executor(None, listen_maddr, dht)
        self._p2p = await P2P.replicate(maddr)
        await self._servicer.add_p2p_handlers(self._p2p, namespace=self.namespace)

    def poke_leaving(self, peers: list[PeerID], timeout: float = 1.0) -> int:
        """Blocking, at most `timeout` s: tell `peers` that this peer is leaving (rpc_leaving); how many answered."""
        async def poke(peer: PeerID) -> bool:
            stub = self._servicer.get_stub(self._p2p, peer, namespace=self.namespace)
            await stub.rpc_leaving(runtime_pb2.ExpertUID(), timeout=timeout)
            return True

        async def poke_all() -> int:
            done = await asyncio.gather(*(asyncio.wait_for(poke(p), timeout) for p in peers), return_exceptions=True)
            return sum(d is True for d in done)

        if self._closed or not peers:
            return 0
        try:
            return asyncio.run_coroutine_threadsafe(poke_all(), self._loop).result(timeout=timeout + 1.0)
        except Exception as e:  # the loop is stopping: nobody was told, the adopters read on their own schedule
            logger.debug(f"leave pokes failed: {e!r}")
            return 0

    # ---- serving -------------------------------------------------------------------------------------------

    def publish(self, round_id: int, expert: int, tensors: dict[str, torch.Tensor], codec: str | None = None) -> None:
        """Make `expert` as of `round_id` fetchable; takes CPU snapshots, keeps the newest keep_rounds rounds.
        `codec`: serve it with this one of COMPRESSION_TYPES instead of the exchange's (then never as bf16)."""
        names = list(tensors)
        # One copy now (the model keeps training in place); contiguous so serialization is a plain memcpy.
        snapshot = [tensors[n].detach().to("cpu", copy=True).contiguous() for n in names]
        with self._lock:
            rounds = self._store.setdefault(int(expert), {})
            rounds[int(round_id)] = _Entry(names, snapshot, None if codec is None else COMPRESSION_TYPES[codec])
            for old in sorted(rounds)[:-self.keep_rounds]:
                del rounds[old]

    def _lookup(self, expert: int, round_id: int, min_round: int | None) -> tuple[int, _Entry | None]:
        """(round, entry) to serve for a request of round_id; entry None if there is none."""
        with self._lock:
            rounds = self._store.get(expert, {})
            if round_id in rounds or not rounds:
                return round_id, rounds.get(round_id)
            # The round asked for, or else the newest if that is later: round numbers are labels, and an owner
            # that ran rounds alone (cut off for a while) numbers them ahead of the swarm; what a fetcher wants
            # is this owner's newest copy, never an older one than it allows (min_round: an owner one behind).
            newest = max(rounds)
            if newest > round_id or (min_round is not None and min_round <= newest):
                return newest, rounds[newest]
            return round_id, None
    def _moments_entry(self, expert: int) -> _Entry | None:
        """The optimizer moments of an owned expert, read now from `moments_provider` (set by the peer: sync/
        knows no optimizer), or None. Served only on request (a handoff), so they cost nothing otherwise."""
        provider = self.moments_provider
        try:
            tensors = provider(expert) if provider is not None else None
        except Exception as e:  # the training loop changed ownership meanwhile, ...: just not available
            logger.debug(f"no moments for expert {expert}: {e!r}")
            tensors = None
        if not tensors:
            return None
        names = list(tensors)
        # Uncompressed: 8-bit or fp16 rounding of the second moment would break the invariant the receiver checks.
        return _Entry(names, [tensors[n].detach().to("cpu", torch.float32, copy=True).contiguous() for n in names],
                      codec=COMPRESSION_TYPES["none"])

    def _synced_entry(self, expert: int, round_id: int) -> _Entry | None:
        try:
            tensors = self.synced_provider(expert, round_id)
        except Exception as e:  # ownership changed meanwhile, ...: just not available
            logger.debug(f"no synchronized value of expert {expert}@{round_id}: {e!r}")
            tensors = None
        if not tensors:
            return None
        names = list(tensors)
        return _Entry(names, [tensors[n].detach().to("cpu", copy=True).contiguous() for n in names],
                      codec=COMPRESSION_TYPES["none"])

    def published(self, expert: int) -> int | None:
        """The newest round published for `expert`, or None."""
        with self._lock:
            rounds = self._store.get(int(expert))
            return max(rounds) if rounds else None

    def _forms(self, entry: _Entry) -> set[bool]:
        """The serialized forms `entry` can be asked for: a bf16 one only where it is smaller than the codec's
        (codec "none"; fp16/8-bit are no bigger) and the entry is not exact by design (AdamW moments)."""
        return {False, True} if entry.codec is None and self._codec == COMPRESSION_TYPES["none"] else {False}

    def _serialize_entry(self, entry: _Entry, bf16: bool) -> list[runtime_pb2.Tensor]:
        codec = entry.codec if entry.codec is not None else self._codec
        tensors = entry.tensors
        assert tensors is not None, "every form is made before the snapshot is dropped"
        # bf16: rounded here exactly as the fetcher would round an fp32 copy into its bf16 frozen storage.
        serialized = [_serialize_tensor(t.to(torch.bfloat16) if bf16 and t.is_floating_point() else t, codec)
                      for t in tensors]
        entry.serialized[bf16] = serialized
        if set(entry.serialized) >= self._forms(entry):
            entry.tensors = None  # only serialized forms are served from now on: the snapshot is not kept twice
        return serialized

    async def _serialized(self, entry: _Entry, bf16: bool = False) -> list[runtime_pb2.Tensor]:
        bf16 = bf16 and True in self._forms(entry)
        if bf16 in entry.serialized:
            return entry.serialized[bf16]
        if bf16 not in entry.job:  # concurrent requests for the same form share one serialization
            entry.job[bf16] = asyncio.get_running_loop().run_in_executor(self._executor, self._serialize_entry,
                                                                         entry, bf16)
        return await asyncio.shield(entry.job[bf16])

    async def _serve(self, uid: str, metadata: bytes = b"") -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """The response stream for one request; never raises (a hostile request only ends its own stream)."""
        def respond(meta: dict) -> runtime_pb2.ExpertResponse:
            return runtime_pb2.ExpertResponse(metadata=MSGPackSerializer.dumps(meta))

        parsed, (well_formed, min_round, bf16) = _parse_uid(uid), _parse_request_metadata(metadata)
        if parsed is None or not well_formed:
            logger.debug(f"Refusing malformed expert request uid {uid[:40]!r}")
            yield respond({"error": "bad request"})
            return
        moments, expert = parsed[0], parsed[1]
        if moments:
            round_id, entry = parsed[2], self._moments_entry(expert)
        else:
            round_id, entry = self._lookup(expert, parsed[2], min_round)
            if entry is None and self.synced_provider is not None:
                entry = self._synced_entry(expert, round_id)
        if entry is None:
            yield respond({"error": "missing"})
            return
        try:
            serialized = await self._serialized(entry, bf16)
        except Exception as e:
            logger.warning(f"Cannot serialize expert {expert}@{round_id}: {e!r}")
            yield respond({"error": "internal"})
            return
        yield respond({"names": entry.names, "round": round_id})
        async for message in self._batched(part for tensor in serialized for part in split_for_streaming(tensor)):
            yield message
        if moments:
            self.moments_served.add(expert)

    async def _batched(self, parts) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Streamed parts, PARTS_PER_MESSAGE per message; bytes counted once actually sent."""
        batch: list[runtime_pb2.Tensor] = []
        for part in parts:
            batch.append(part)
            if len(batch) >= PARTS_PER_MESSAGE:
                yield runtime_pb2.ExpertResponse(tensors=batch)
                self._count("sent", sum(len(p.buffer) for p in batch))
                batch = []
        if batch:
            yield runtime_pb2.ExpertResponse(tensors=batch)
            self._count("sent", sum(len(p.buffer) for p in batch))

    # ---- accounting and lifetime ---------------------------------------------------------------------------

    def _take_slot(self, remote: PeerID) -> bool:
        if self._serving.get(remote, 0) >= self.streams_per_peer or sum(self._serving.values()) >= self.streams:
            return False
        self._serving[remote] = self._serving.get(remote, 0) + 1
        return True

    def _give_slot(self, remote: PeerID) -> None:
        left = self._serving.pop(remote, 1) - 1
        if left > 0:
            self._serving[remote] = left

    def _count(self, direction: str, nbytes: int, kind: str = "expert") -> None:
        with self._lock:
            self._bytes[direction][kind] += nbytes

    @property
    def bytes_sent(self) -> dict[str, int]:
        """Tensor payload bytes served (after compression), by kind."""
        with self._lock:
            return dict(self._bytes["sent"])

    @property
    def bytes_received(self) -> dict[str, int]:
        """Tensor payload bytes received (after compression), by kind, including refused responses."""
        with self._lock:
            return dict(self._bytes["received"])

    async def _ashutdown(self) -> None:
        if self._p2p is not None:
            # The daemon may already be gone with its DHT: then there is nothing to unregister.
            with suppress(Exception):
                await asyncio.wait_for(self._servicer.remove_p2p_handlers(self._p2p, namespace=self.namespace), 3)
            with suppress(Exception):
                await self._p2p.shutdown()
        # Fetches and streams still in flight end now (their futures are cancelled), so the loop can close.
        current = asyncio.current_task()
        pending = [t for t in asyncio.all_tasks() if t is not current]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    def shutdown(self) -> None:
        """Stop serving, cancel fetches in flight, close the P2P replica and the loop thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._thread.is_alive():
            with suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._ashutdown(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        self._executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "ExpertExchange":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()
