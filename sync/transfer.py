"""Owner-to-non-owner expert transfer over one hivemind P2P handler keyed by expert ID (docs/DESIGN.md, "A round").

Each peer runs one `ExpertExchange`: it serves the experts it published for recent sync rounds and fetches other
owners' experts, all through a single streaming rpc handler (not one averager per expert). Wire format:

- request: `runtime_pb2.ExpertRequest(uid="{expert}@{round}")` (or `"m{expert}@0"`: the owner's AdamW moments of the
  expert, for a peer taking it over; docs/DESIGN.md "Coverage"), optionally with `metadata` = MSGPack
  `{"min_round": m, "bf16": true}` (both optional): if that round is not there, an older copy no older than round
  `m` may be served instead (an owner one round behind; docs/DESIGN.md, "Bandwidth-aware rounds"); `bf16`: the
  fetcher stores the copy in bf16, so it gets the tensors rounded to bf16 (half the bytes; moments never);
- response stream of `runtime_pb2.ExpertResponse`: first message `metadata` = MSGPack `{"names": [...],
  "round": r}` — r is the round asked for, or the owner's newest if that one is gone and a later one exists;
  older only as `min_round` allows — (or `{"error": "missing" | "bad request" | "internal"}` and the stream
  ends), then the tensors,
  each serialized with hivemind's codecs and cut into parts by `split_for_streaming` (so tensors bigger than
  a p2p message work), several parts per message.

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

from sync.codec import COMPRESSION_TYPES, MalformedResponse, deserialize_parts as _deserialize_parts
from sync.codec import parse_metadata as _parse_metadata, parse_request_metadata as _parse_request_metadata
from sync.codec import parse_uid as _parse_uid
from sync.codec import serialize_tensor as _serialize_tensor
from sync.codec import MIN_8BIT_NUMEL, extract_quantized, patch_hivemind_8bit_decoder  # noqa: F401 (their old home)
from sync.uplink import PROBE_SECONDS, UplinkSink, measure_upload
from sync.validate import RejectCounter

logger = get_logger(__name__)

# 16 parts of hivemind's 64 KiB streaming chunk = 1 MiB per message: fewer Python round trips per tensor.
PARTS_PER_MESSAGE = 16
# A hostile server could stream forever inside the timeout; cap what one fetch may buffer.
DEFAULT_MAX_FETCH_BYTES = 16 * 2**30


class FetchedExpert(dict):
    """A fetched expert: name -> tensor, and `round`, the round of the copy the owner served."""

    def __init__(self, tensors: dict[str, torch.Tensor], round_id: int) -> None:
        super().__init__(tensors)
        self.round = round_id


class IncompleteResponse(ConnectionError):
    """The stream ended before every announced tensor arrived: seen rarely on loopback (~1 in 500 fetches)
    although the server sent everything, so it is treated as a transport failure and retried, not refused."""


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
    """The rpc handlers: `{namespace}::_ExpertServicer.rpc_get_expert`, and `.rpc_uplink_probe` (sync/uplink.py)."""

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
        async for message in self.exchange._serve(request.uid, request.metadata):
            yield message

    async def rpc_uplink_probe(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext,
                               ) -> runtime_pb2.ExpertResponse:
        """Another peer measuring its upload (sync/uplink.py): count what it pushes, within the sink's limits."""
        gate = self.exchange.gate
        if gate is not None and not await gate.admits(context.remote_id):
            return runtime_pb2.ExpertResponse(metadata=MSGPackSerializer.dumps({"error": "unauthorized"}))
        return await self.exchange.uplink_sink.absorb(requests, context.remote_id)


class ExpertExchange:
    """Serves this peer's published experts and fetches other peers' experts through one P2P handler.

    namespace: the run_id, so handlers of different runs on one DHT never collide.
    compression: none | fp16 | 8bit (hivemind NONE / FLOAT16 / UNIFORM_8BIT) for everything this peer serves.
    keep_rounds: how many newest rounds per expert stay available to fetchers.
    rejects: where malformed responses are counted (reason "malformed"); a fresh counter if omitted.
    gate: in a closed run, the admission check (`async admits(peer_id) -> bool`, sync.admission.Gate) every
        request's libp2p-authenticated sender must pass; None (open run) serves everyone.
    """

    def __init__(self, dht: DHT, namespace: str, compression: str = "none", keep_rounds: int = 2,
                 rejects: RejectCounter | None = None, start_timeout: float = 30.0,
                 max_fetch_bytes: int = DEFAULT_MAX_FETCH_BYTES, gate=None) -> None:
        if compression not in COMPRESSION_TYPES:
            raise ValueError(f"compression must be one of {sorted(COMPRESSION_TYPES)}, got {compression!r}")
        if keep_rounds < 1:
            raise ValueError(f"keep_rounds must be >= 1, got {keep_rounds}")
        self.namespace, self.compression, self.keep_rounds = namespace, compression, keep_rounds
        self.rejects = rejects if rejects is not None else RejectCounter()
        self.max_fetch_bytes = max_fetch_bytes
        self.gate = gate
        # Set by the peer: expert -> its optimizer moments (name -> tensor) if this peer owns it, else None.
        self.moments_provider: Callable[[int], dict[str, torch.Tensor] | None] | None = None
        self.moments_served: set[int] = set()  # experts whose moments went out whole (a leaver's grace, sync/leave)
        self._codec = COMPRESSION_TYPES[compression]
        self._lock = threading.Lock()
        self._store: dict[int, dict[int, _Entry]] = {}
        self._bytes = {"sent": {"expert": 0}, "received": {"expert": 0, "shared": 0}}
        self._servicer = _ExpertServicer(self)
        self.uplink_sink = UplinkSink()
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
        get_maddr = DHT._get_p2p_daemon_listen_maddr  # what dht.replicate_p2p() itself asks the DHT process
        maddr = await asyncio.get_running_loop().run_in_executor(None, dht.run_coroutine, get_maddr)
        self._p2p = await P2P.replicate(maddr)
        await self._servicer.add_p2p_handlers(self._p2p, namespace=self.namespace)

    # ---- serving -------------------------------------------------------------------------------------------

    def publish(self, round_id: int, expert: int, tensors: dict[str, torch.Tensor]) -> None:
        """Make `expert` as of `round_id` fetchable; takes CPU snapshots, keeps the newest keep_rounds rounds."""
        names = list(tensors)
        # One copy now (the model keeps training in place); contiguous so serialization is a plain memcpy.
        snapshot = [tensors[n].detach().to("cpu", copy=True).contiguous() for n in names]
        with self._lock:
            rounds = self._store.setdefault(int(expert), {})
            rounds[int(round_id)] = _Entry(names, snapshot)
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
        def error(kind: str) -> runtime_pb2.ExpertResponse:
            return runtime_pb2.ExpertResponse(metadata=MSGPackSerializer.dumps({"error": kind}))

        parsed, (well_formed, min_round, bf16) = _parse_uid(uid), _parse_request_metadata(metadata)
        if parsed is None or not well_formed:
            logger.debug(f"Refusing malformed expert request uid {uid[:40]!r}")
            yield error("bad request")
            return
        moments, expert = parsed[0], parsed[1]
        if moments:
            round_id, entry = parsed[2], self._moments_entry(expert)
        else:
            round_id, entry = self._lookup(expert, parsed[2], min_round)
        if entry is None:
            yield error("missing")
            return
        try:
            serialized = await self._serialized(entry, bf16)
        except Exception as e:
            logger.warning(f"Cannot serialize expert {expert}@{round_id}: {e!r}")
            yield error("internal")
            return
        yield runtime_pb2.ExpertResponse(metadata=MSGPackSerializer.dumps({"names": entry.names, "round": round_id}))
        batch: list[runtime_pb2.Tensor] = []
        for tensor in serialized:
            for part in split_for_streaming(tensor):
                batch.append(part)
                if len(batch) >= PARTS_PER_MESSAGE:
                    yield runtime_pb2.ExpertResponse(tensors=batch)
                    self._count("sent", sum(len(p.buffer) for p in batch))  # counted once actually sent
                    batch = []
        if batch:
            yield runtime_pb2.ExpertResponse(tensors=batch)
            self._count("sent", sum(len(p.buffer) for p in batch))
        if moments:
            self.moments_served.add(expert)

    # ---- fetching ------------------------------------------------------------------------------------------

    def fetch_async(self, peer: PeerID, expert: int, round_id: int, timeout: float,
                    min_round: int | None = None, bf16: bool = False) -> concurrent.futures.Future:
        """Start fetching `expert@round_id` from `peer`; the future gives a `FetchedExpert` (name -> tensor, and
        the round served) or None. `min_round`: the oldest copy acceptable if round_id is not there (default:
        round_id itself). `bf16`: this peer keeps the copy in bfloat16, so the owner sends it rounded to that
        (half the bytes of fp32, and the same values this peer would store); an older owner ignores the flag.

        The future never raises; it is cancelled only if the exchange shuts down mid-fetch.
        """
        if self._closed:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(None)
            return done
        request = {**({"min_round": int(min_round)} if min_round is not None else {}), **({"bf16": True} if bf16 else {})}
        options = MSGPackSerializer.dumps(request) if request else b""
        return asyncio.run_coroutine_threadsafe(
            self._fetch(peer, int(expert), int(round_id), timeout, options,
                        int(round_id) if min_round is None else int(min_round)), self._loop)

    def fetch(self, peer: PeerID, expert: int, round_id: int, timeout: float,
              min_round: int | None = None, bf16: bool = False) -> FetchedExpert | None:
        """Blocking fetch (from any thread but the exchange's own); None if unavailable, late or malformed."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("ExpertExchange.fetch would deadlock on its own loop; use fetch_async")
        future = self.fetch_async(peer, expert, round_id, timeout, min_round=min_round, bf16=bf16)
        try:
            # _fetch bounds itself by `timeout`; the margin covers scheduling on a busy machine.
            return future.result(timeout=timeout + 5.0)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            future.cancel()
            return None

    def measure_upload(self, peers: list[PeerID]) -> float | None:
        """This peer's upload in Mbit/s, by pushing bytes to `peers` at once (sync/uplink.py); None if none answered."""
        calls = [_ExpertServicer.get_stub(self._p2p, p, namespace=self.namespace).rpc_uplink_probe for p in peers]
        return asyncio.run_coroutine_threadsafe(measure_upload(calls), self._loop).result(timeout=PROBE_SECONDS + 15)

    def fetch_moments(self, peer: PeerID, expert: int, timeout: float) -> dict[str, torch.Tensor] | None:
        """Blocking: `peer`'s optimizer moments of `expert` (name -> tensor, not validated), None if it has none."""
        if self._closed:
            return None
        future = asyncio.run_coroutine_threadsafe(self._fetch(peer, int(expert), 0, timeout, moments=True), self._loop)
        try:
            return future.result(timeout=timeout + 5.0)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            future.cancel()
            return None

    async def _fetch(self, peer: PeerID, expert: int, round_id: int, timeout: float, options: bytes = b"",
                     min_round: int | None = None, moments: bool = False) -> FetchedExpert | None:
        uid = f"{'m' if moments else ''}{expert}@{round_id}"
        what = f"{'moments of ' if moments else ''}expert {expert}@{round_id} from {peer}"
        min_round = round_id if min_round is None else min_round
        try:
            return await asyncio.wait_for(self._fetch_retrying(peer, uid, min_round, options), timeout)
        except asyncio.TimeoutError:
            logger.debug(f"Timed out fetching {what} after {timeout:.1f}s")
        except IncompleteResponse as e:
            logger.debug(f"Incomplete {what} twice: {e}")
        except MalformedResponse as e:
            self.rejects.add("malformed")
            logger.warning(f"Refused malformed {what}: {e}")
        except Exception as e:  # unreachable peer, no handler there, broken connection
            logger.debug(f"Could not fetch {what}: {type(e).__name__}: {e}")
        return None

    async def _fetch_retrying(self, peer: PeerID, uid: str, min_round: int, options: bytes = b"",
                              ) -> FetchedExpert | None:
        try:
            return await self._fetch_unbounded(peer, uid, min_round, options)
        except IncompleteResponse as e:
            logger.debug(f"Retrying {uid} from {peer}: {e}")
            return await self._fetch_unbounded(peer, uid, min_round, options)

    async def _request(self, peer: PeerID, uid: str, options: bytes = b"",
                       ) -> tuple[dict, list[list[runtime_pb2.Tensor]]]:
        """Send one raw request; return (metadata, parts grouped per tensor). Unbounded: callers add a timeout."""
        stub = _ExpertServicer.get_stub(self._p2p, peer, namespace=self.namespace)
        stream = await stub.rpc_get_expert(runtime_pb2.ExpertRequest(uid=uid, metadata=options))
        meta: dict | None = None
        groups: list[list[runtime_pb2.Tensor]] = []
        received = 0
        try:
            async for message in stream:
                if meta is None:
                    meta = _parse_metadata(message.metadata)
                    if "error" in meta:
                        return meta, []
                elif message.metadata:
                    raise MalformedResponse("metadata after the first message")
                for part in message.tensors:
                    received = self._collect(part, groups, received, "expert")
                if len(groups) == len(meta["names"]) and all(len(g) >= max(g[0].chunks, 1) for g in groups):
                    # Everything announced arrived: do not wait for the end of the stream (a stream whose server
                    # took a while before answering was seen to stay open at the daemon after the server
                    # finished, so the fetch only ended at its timeout).
                    break
        finally:
            with suppress(Exception):
                await stream.aclose()
        if meta is None:
            # Our server always answers with at least one message: a stream with none lost it on the way (seen
            # once on a loaded 2-core machine, and the round's merge then missed an expert). Retried once like a
            # cut-off stream; a peer that keeps answering nothing costs one retry within the same timeout.
            raise IncompleteResponse("empty response stream")
        return meta, groups

    def _collect(self, part: runtime_pb2.Tensor, groups: list[list[runtime_pb2.Tensor]], received: int,
                 kind: str) -> int:
        """Count one streamed part and file it under its tensor; returns the bytes received so far."""
        received += len(part.buffer)
        self._count("received", len(part.buffer), kind=kind)
        if received > self.max_fetch_bytes:
            raise MalformedResponse(f"response exceeds {self.max_fetch_bytes} bytes")
        if part.dtype:  # hivemind's streaming marks the first part of each tensor by its dtype
            groups.append([part])
        elif groups:
            groups[-1].append(part)
        else:
            raise MalformedResponse("continuation part before any tensor header")
        return received

    async def _fetch_unbounded(self, peer: PeerID, uid: str, min_round: int, options: bytes = b"",
                               ) -> FetchedExpert | None:
        meta, groups = await self._request(peer, uid, options)
        if "error" in meta:
            logger.debug(f"Peer {peer} has no expert {uid}: {meta['error'][:40]}")
            return None
        if meta["round"] < min_round:
            raise MalformedResponse(f"asked for round {min_round} or later, got the older round {meta['round']}")
        if len(groups) > len(meta["names"]):
            raise MalformedResponse(f"{len(meta['names'])} names but {len(groups)} tensors")
        if len(groups) < len(meta["names"]):
            raise IncompleteResponse(f"{len(meta['names'])} names but only {len(groups)} tensors arrived")
        loop = asyncio.get_running_loop()
        tensors = await loop.run_in_executor(self._executor, lambda: [_deserialize_parts(g) for g in groups])
        return FetchedExpert(dict(zip(meta["names"], tensors)), meta["round"])

    # ---- shared state downloads ----------------------------------------------------------------------------

    def download_state(self, peer: PeerID, prefix: str, timeout: float) -> list[torch.Tensor] | None:
        """The shared tensors a peer's averager (DHT prefix `prefix`) serves to joiners, or None.

        hivemind's own `load_state_from_peers` picks the source by a self-declared priority in the DHT, so a
        liar with a high priority is asked first; here the caller chooses the source from verified records and
        this only fetches, through the same bounded, pickle-free decoding as experts (validation is the
        caller's: sync.shared.SharedAverager.load_state)."""
        if self._closed or threading.current_thread() is self._thread:
            return None
        future = asyncio.run_coroutine_threadsafe(self._download_state(peer, prefix, timeout), self._loop)
        try:
            return future.result(timeout=timeout + 5.0)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            future.cancel()
            return None

    async def _download_state(self, peer: PeerID, prefix: str, timeout: float) -> list[torch.Tensor] | None:
        from hivemind.averaging import DecentralizedAverager
        from hivemind.proto import averaging_pb2

        async def download() -> list[torch.Tensor]:
            stub = DecentralizedAverager.get_stub(self._p2p, peer, namespace=prefix)
            stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
            groups: list[list[runtime_pb2.Tensor]] = []
            received = 0
            try:
                async for message in stream:
                    received = self._collect(message.tensor_part, groups, received, "shared")
            finally:
                with suppress(Exception):
                    await stream.aclose()
            if groups and len(groups[-1]) < max(groups[-1][0].chunks, 1):
                # The stream ended inside its last tensor: a dropped or size-limited connection (a relayed one
                # carries 128 KiB), not a hostile server; the caller tries another source.
                raise IncompleteResponse(f"state stream ended after {len(groups[-1])} of "
                                         f"{groups[-1][0].chunks} parts of tensor {len(groups)}")
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor, lambda: [_deserialize_parts(g) for g in groups])

        try:
            tensors = await asyncio.wait_for(download(), timeout)
            return tensors or None
        except MalformedResponse as e:
            self.rejects.add("malformed")
            logger.warning(f"Refused malformed shared state from {peer}: {e}")
        except Exception as e:  # unreachable, refused, timed out
            logger.debug(f"Could not download shared state from {peer}: {type(e).__name__}: {e}")
        return None

    # ---- accounting and lifetime ---------------------------------------------------------------------------

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
