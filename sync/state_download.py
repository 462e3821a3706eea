"""Shared-state downloads through the expert exchange's P2P replica (docs/DESIGN.md, "State downloads").

A mixin of `sync.transfer.ExpertExchange`, in its own file to keep that one readable: it uses the exchange's
event loop, its bounded part collector and its codec executor. hivemind's own `load_state_from_peers` picks the
source by a self-declared priority in the DHT (a liar with a high priority is asked first), so the caller
chooses the source from verified records and this only fetches, without unpickling anything.
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

from sync.codec import IncompleteResponse, MalformedResponse, deserialize_parts as _deserialize_parts

logger = get_logger(__name__)


class StateDownloads:
    """ExpertExchange mixin: `download_state` from one peer's averager."""

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
