"""The fetching side of the expert exchange (sync/transfer.py; docs/DESIGN.md, "Joining and state downloads").

A mixin of `sync.transfer.ExpertExchange`, in its own file to keep that one readable: it uses the exchange's
event loop, P2P replica, servicer stub, codec executor and byte counters. A fetch asks one peer for one expert,
its synchronized shared values or an owned expert's AdamW moments; collects the streamed parts with bounded
buffering (`response_limit`: what the asked-for tensors take in fp32, from the model's own sizes; without it
`max_fetch_bytes`); checks that every announced tensor arrived whole; and decodes without unpickling.
A stream cut short is retried once within the same timeout; a malformed one is refused and counted as
"malformed" (docs/DESIGN.md, "Hostile peers"). The first message's metadata is checked by sync/codec.py
`parse_metadata`; keys it does not know are ignored.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from contextlib import suppress

import torch
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.logging import get_logger
from hivemind.utils.serializer import MSGPackSerializer

from sync.codec import IncompleteResponse, MalformedResponse, deserialize_parts as _deserialize_parts
from sync.codec import SHARED_KEY, make_uid as _make_uid, parse_metadata as _parse_metadata, parse_uid

logger = get_logger(__name__)


class FetchedExpert(dict):
    """A fetched expert: name -> tensor, and `round`, the round of the copy the owner served."""

    def __init__(self, tensors: dict[str, torch.Tensor], round_id: int) -> None:
        super().__init__(tensors)
        self.round = round_id


class ExpertClient:
    """ExpertExchange mixin: fetch experts, shared values and moments from other peers."""

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
        request = {**({"min_round": int(min_round)} if min_round is not None else {}),
                   **({"bf16": True} if bf16 else {})}
        return asyncio.run_coroutine_threadsafe(
            self._fetch(peer, int(expert), int(round_id), timeout, request,
                        int(round_id) if min_round is None else int(min_round)), self._loop)

    def fetch_shared_async(self, peer: PeerID, round_id: int, min_round: int, timeout: float, bf16: bool = True,
                           ) -> concurrent.futures.Future:
        """`peer`'s synchronized shared values of `round_id` (or its newest, no older than `min_round`; bf16 if
        asked), for a joiner or a repairing peer; a `FetchedExpert` (name -> tensor) or None, never raises."""
        if self._closed:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(None)
            return done
        request = {"min_round": int(min_round), **({"bf16": True} if bf16 else {})}
        return asyncio.run_coroutine_threadsafe(
            self._fetch(peer, SHARED_KEY, int(round_id), timeout, request, int(min_round)), self._loop)

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

    async def _fetch(self, peer: PeerID, expert: int, round_id: int, timeout: float, request: dict | None = None,
                     min_round: int | None = None, moments: bool = False) -> FetchedExpert | None:
        uid = _make_uid(expert, round_id, moments)
        what = f"{'moments of ' if moments else ''}expert {expert}@{round_id} from {peer}"
        min_round = round_id if min_round is None else min_round
        request = request or {}
        try:
            return await asyncio.wait_for(self._fetch_retrying(peer, uid, min_round, request), timeout)
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

    async def _fetch_retrying(self, peer: PeerID, uid: str, min_round: int, request: dict) -> FetchedExpert | None:
        try:
            return await self._fetch_unbounded(peer, uid, min_round, request)
        except IncompleteResponse as e:
            logger.debug(f"Retrying {uid} from {peer}: {e}")
            return await self._fetch_unbounded(peer, uid, min_round, request)

    async def _request(self, peer: PeerID, uid: str, request: dict | bytes | None = None,
                       ) -> tuple[dict, list[list[runtime_pb2.Tensor]]]:
        """Send one raw request; return (metadata, parts grouped per tensor). Unbounded: callers add a timeout."""
        stub = self._servicer.get_stub(self._p2p, peer, namespace=self.namespace)
        # Raw bytes: tests sending malformed options as they are.
        options = request if isinstance(request, bytes) else MSGPackSerializer.dumps(request) if request else b""
        stream = await stub.rpc_get_expert(runtime_pb2.ExpertRequest(uid=uid, metadata=options))
        meta: dict | None = None
        groups: list[list[runtime_pb2.Tensor]] = []
        received, limit = 0, self._limit(uid)
        try:
            async for message in stream:
                if meta is None:
                    meta = _parse_metadata(message.metadata)
                    if "error" in meta:
                        return meta, []
                elif message.metadata:
                    raise MalformedResponse("metadata after the first message")
                for part in message.tensors:
                    received = self._collect(part, groups, received, "expert", limit)
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

    def _limit(self, uid: str) -> int:
        """The most payload bytes a response to `uid` may bring (ExpertExchange.response_limit)."""
        parsed = parse_uid(uid)
        if parsed is None or self.response_limit is None:
            return self.max_fetch_bytes
        moments, expert, _ = parsed
        return min(self.max_fetch_bytes, self.response_limit(expert, moments))

    def _collect(self, part: runtime_pb2.Tensor, groups: list[list[runtime_pb2.Tensor]], received: int,
                 kind: str, limit: int) -> int:
        """Count one streamed part and file it under its tensor; returns the bytes received so far."""
        received += len(part.buffer)
        self._count("received", len(part.buffer), kind=kind)
        if received > limit:
            raise MalformedResponse(f"response exceeds {limit} bytes (what the tensors asked for take)")
        if part.dtype:  # hivemind's streaming marks the first part of each tensor by its dtype
            groups.append([part])
        elif groups:
            groups[-1].append(part)
        else:
            raise MalformedResponse("continuation part before any tensor header")
        return received

    async def _fetch_unbounded(self, peer: PeerID, uid: str, min_round: int, request: dict) -> FetchedExpert | None:
        meta, groups = await self._request(peer, uid, request)
        if "error" in meta:
            logger.debug(f"Peer {peer} has no expert {uid}: {meta['error'][:40]}")
            return None
        if meta["round"] < min_round:
            raise MalformedResponse(f"asked for round {min_round} or later, got the older round {meta['round']}")
        tensors = await self._decode(meta, groups)
        return FetchedExpert(dict(zip(meta["names"], tensors)), meta["round"])

    async def _decode(self, meta: dict, groups: list[list[runtime_pb2.Tensor]]) -> list[torch.Tensor]:
        """Check that every announced tensor arrived whole, then decode (off the event loop)."""
        names = meta["names"]
        if len(groups) > len(names):
            raise MalformedResponse(f"{len(names)} names but {len(groups)} tensors")
        if len(groups) < len(names) or not all(len(g) >= max(g[0].chunks, 1) for g in groups):
            raise IncompleteResponse(f"{len(names)} names, {len(groups)} tensors, not every part arrived")

        def decode() -> list[torch.Tensor]:
            return [_deserialize_parts(g) for g in groups]

        return await asyncio.get_running_loop().run_in_executor(self._executor, decode)

