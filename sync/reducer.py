"""The reducer side of hivemind's butterfly all-reduce, reading each sender's parts apart from writing its results
(docs/DESIGN.md, "Reading apart from writing").

In hivemind 1.1.12 a reducer serves each sender in one generator: read part k, wait until every sender's part k
is in, write part k's result back to that sender, and only then read part k+1. Writing a result waits while the
sender's download is busy, so the reducers could stop reading the parts of a peer whose download ran full. In
bench.wan (issue shape, 100 Mbit/s) such a peer's sockets had nothing queued (p2pd's send queues at 0) while its
upload ran at 50-60 Mbit/s for 1-1.5 s of a 3.3 s all-reduce, its download at 96; then it alone uploaded at full
rate for 0.4-0.6 s while every other link idled, waiting for its parts. (Such stretches still occur about as often
with this reducer: it removed one coupling of the two directions, not every one; the phase went from 1.29-1.44x
its bytes' link time to 1.28-1.32x.)

Here each sender's stream is read by a task of its own into per-part slots (up to `READ_AHEAD_PARTS` parts ahead
of the results it has been sent: bounded memory), a part is reduced once every sender still in the group has
delivered it, in any order across parts, and the handler writes the results back in part order as they complete.
The reduction rule is the caller's (sync/robust.py `AggregationPolicy.aggregate`: every sender's copy of a part
is kept, not a running sum). `install_reducer` puts both into hivemind's `AllReduceRunner` inside the averager's
own (forked) process only.

Shape suffixes: P = elements of one flattened part.
"""
from __future__ import annotations

import asyncio
import math
from typing import AsyncIterator, Callable, Sequence

import torch
from hivemind.utils.logging import get_logger

logger = get_logger(__name__)

# Parts of one sender read ahead of the results written back to it: 32 of hivemind's 512 KiB parts is 16 MiB per
# sender at most, more than a 100 Mbit/s link carries in a second (the skews measured were 0.4-1.5 s of parts
# held back at about half the link rate).
READ_AHEAD_PARTS = 32

Aggregate = Callable[[list[torch.Tensor], list[float], torch.Size], torch.Tensor]


class StreamingPartReducer:
    """hivemind's TensorPartReducer interface (`accumulate_part`, `on_sender_failed`, `finalize`, `finished`,
    `num_parts`), plus `submit_part`, which files a part without waiting for the others and returns the future of
    its result. A part completes when every sender that has not failed before it delivered it."""

    def __init__(self, part_shapes: Sequence[torch.Size], num_senders: int, aggregate: Aggregate):
        self.part_shapes, self.num_senders, self.num_parts = tuple(part_shapes), num_senders, len(part_shapes)
        self.aggregate = aggregate
        self.num_parts_received = [0] * num_senders
        # A failed sender's parts count up to the index it had delivered (hivemind's semantics): later parts are
        # reduced without it.
        self.sender_failed_after = [math.inf] * num_senders
        self._slots: list[dict[int, tuple[torch.Tensor, float]]] = [{} for _ in range(self.num_parts)]
        self._futures: list[asyncio.Future] = [asyncio.get_event_loop().create_future() for _ in range(self.num_parts)]
        self._completed = 0
        self.finished = asyncio.Event()
        if self.num_parts == 0:
            self.finalize()

    def submit_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor,
                    weight: float = 1.0) -> asyncio.Future:
        """File sender `sender_index`'s part `part_index` (each sender's parts come in order); the future of the
        part's result. Raises BannedException for a sender that failed, AllreduceException once finalized."""
        from hivemind.averaging.partition import AllreduceException, BannedException

        if not (0 <= sender_index < self.num_senders and 0 <= part_index < self.num_parts):
            raise AllreduceException(f"part {part_index} of sender {sender_index} is out of range")
        if self.sender_failed_after[sender_index] != math.inf:
            raise BannedException(f"sender {sender_index} was banned in background")
        if self.finished.is_set():
            raise AllreduceException(f"attempted to aggregate part in a finalized {type(self).__name__}")
        if part_index != self.num_parts_received[sender_index]:
            raise AllreduceException(f"sender {sender_index} sent part {part_index} out of order")
        self.num_parts_received[sender_index] += 1
        self._slots[part_index][sender_index] = (tensor_part, float(weight))
        self._try_complete(part_index)
        return self._futures[part_index]

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor,
                              weight: float = 1.0) -> torch.Tensor:
        """hivemind's call (its runner uses it for this peer's own parts): file the part, wait for its result."""
        from hivemind.averaging.partition import AllreduceException

        future = self.submit_part(sender_index, part_index, tensor_part, weight)
        try:
            # Shielded: the future is every sender's, and cancelling one waiter must not cancel it for the others.
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if future.cancelled():
                raise AllreduceException(f"{type(self).__name__} was finalized before part {part_index} completed")
            raise

    def on_sender_failed(self, sender_index: int) -> None:
        """Reduce the parts this sender did not deliver without it (those waiting for it complete now)."""
        self.sender_failed_after[sender_index] = self.num_parts_received[sender_index]
        if not self.finished.is_set():
            for part_index in range(self.num_parts_received[sender_index], self.num_parts):
                self._try_complete(part_index)

    def _try_complete(self, part_index: int) -> None:
        future = self._futures[part_index]
        if future.done():
            return
        present = [v for s, v in self._slots[part_index].items() if part_index < self.sender_failed_after[s]]
        expected = sum(part_index < failed_after for failed_after in self.sender_failed_after)
        if len(present) < expected:
            return
        shape = self.part_shapes[part_index]
        if present:
            result = self.aggregate([t for t, _ in present], [w for _, w in present], shape)
        else:
            result = torch.zeros(shape)  # every sender failed before this part: nobody waits for it
        self._slots[part_index] = {}
        future.set_result(result)
        self._completed += 1
        if self._completed == self.num_parts:
            self.finalize()

    def finalize(self) -> None:
        if self.finished.is_set():
            return
        for future in self._futures:
            if not future.done():
                future.cancel()
        self._slots = [{} for _ in range(self.num_parts)]
        self.finished.set()
        expected, received = self.num_parts * self.num_senders, sum(self.num_parts_received)
        if self.num_parts and self.num_senders and received != expected:
            logger.debug(f"reducer: received {received / expected * 100:.1f}% of input parts")


async def accumulate_parts_streaming(runner, stream: AsyncIterator, sender_index: int) -> AsyncIterator:
    """AllReduceRunner._accumulate_parts_streaming with reading and writing apart: a task reads the sender's parts
    into the reducer while this generator yields each part's result (averaged - sent) in order as it completes."""
    from hivemind.averaging import allreduce
    from hivemind.averaging.partition import BannedException
    from hivemind.proto import averaging_pb2
    from hivemind.utils.asyncio import amap_in_executor

    # (De)serialized through the module's names, which sync/wire.py counts the bytes of in this process.
    reducer: StreamingPartReducer = runner.tensor_part_reducer
    loop = asyncio.get_event_loop()
    filed: asyncio.Queue = asyncio.Queue()
    room = asyncio.Semaphore(READ_AHEAD_PARTS)

    async def read() -> None:
        part_index = 0
        try:
            def decode(msg: averaging_pb2.AveragingData) -> tuple[torch.Tensor, float, int]:
                return allreduce.deserialize_torch_tensor(msg.tensor_part), msg.weight, msg.tensor_part.compression

            async for tensor_part, weight, compression in amap_in_executor(
                    decode, stream, max_prefetch=runner.tensor_part_container.prefetch):
                await room.acquire()
                filed.put_nowait((reducer.submit_part(sender_index, part_index, tensor_part, weight), tensor_part,
                                  compression))
                part_index += 1
        except BannedException:
            logger.debug(f"sender {sender_index} is already banned")
        except asyncio.CancelledError:
            raise  # the handler ended (finalized, or the sender is gone): whoever ended it decides about a ban
        except BaseException:
            # Its later parts are reduced without it at once, not when its results run out.
            await runner._ban_sender(runner.sender_peer_ids[sender_index])
            raise
        finally:
            filed.put_nowait(None)

    reader = asyncio.create_task(read())
    written, finalized = 0, False
    try:
        while (item := await filed.get()) is not None:
            future, tensor_part, compression = item
            try:
                averaged_part = await asyncio.shield(future)  # the future is every sender's (accumulate_part)
            except asyncio.CancelledError:
                if future.cancelled():
                    finalized = True  # the all-reduce ended (or failed) without this part
                    break
                raise
            room.release()
            delta = await loop.run_in_executor(
                None, lambda: allreduce.serialize_torch_tensor(averaged_part - tensor_part, compression))
            yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=delta)
            written += 1
        if not finalized:  # (a finalized reducer's reader may wait for room forever: cancelled below)
            await reader  # its error (a timeout, a malformed part) ends this stream as hivemind's did
    finally:
        if not reader.done():
            reader.cancel()
        if written != reducer.num_parts:
            await runner._ban_sender(runner.sender_peer_ids[sender_index])


def install_reducer(aggregate: Aggregate) -> None:
    """Make hivemind's all-reduce in *this process* reduce with `aggregate`, reading apart from writing (call
    inside the averager process, before any all-reduce)."""
    from hivemind.averaging import allreduce

    class _Reducer(StreamingPartReducer):
        def __init__(self, part_shapes: Sequence[torch.Size], num_senders: int):
            super().__init__(part_shapes, num_senders, aggregate)

    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        async for message in accumulate_parts_streaming(self, stream, sender_index):
            yield message

    allreduce.TensorPartReducer = _Reducer
    allreduce.AllReduceRunner._accumulate_parts_streaming = _accumulate_parts_streaming
