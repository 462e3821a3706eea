"""The all-reduce's reducer side (sync/reducer.py): parts filed in any order across senders, failed senders left
out of later parts, and a sender's parts read while its results are not being taken (docs/DESIGN.md, "Reading
apart from writing")."""
from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.averaging.partition import AllreduceException, BannedException
from hivemind.compression import serialize_torch_tensor
from hivemind.proto import averaging_pb2, runtime_pb2

import sync.reducer as reducer_mod
from sync.reducer import StreamingPartReducer, accumulate_parts_streaming


def _mean(parts: list[torch.Tensor], weights: list[float], shape: torch.Size) -> torch.Tensor:
    return sum(p * w for p, w in zip(parts, weights)) / sum(weights)


def test_parts_complete_in_any_order_across_senders():
    async def main():
        r = StreamingPartReducer([torch.Size([3])] * 3, num_senders=2, aggregate=_mean)
        # Sender 0 runs all its parts ahead of sender 1 (hivemind's reducer made it wait at part 0).
        futures = [r.submit_part(0, k, torch.full((3,), float(k)), 1.0) for k in range(3)]
        assert not any(f.done() for f in futures)
        for k in range(3):
            r.submit_part(1, k, torch.full((3,), float(k) + 2), 3.0)
            assert futures[k].done() and not any(f.done() for f in futures[k + 1:])
            torch.testing.assert_close(futures[k].result(), torch.full((3,), k + 1.5))
        assert r.finished.is_set()
        with pytest.raises(AllreduceException):
            r.submit_part(0, 0, torch.zeros(3))
    asyncio.run(main())


def test_a_failed_sender_is_left_out_of_the_parts_it_did_not_deliver():
    async def main():
        r = StreamingPartReducer([torch.Size([2])] * 3, num_senders=3, aggregate=_mean)
        for k in range(3):
            r.submit_part(0, k, torch.full((2,), 1.0))
        done_early = r.submit_part(1, 0, torch.full((2,), 4.0))
        waiting = [r.submit_part(2, k, torch.full((2,), 7.0)) for k in range(3)]
        assert done_early.done() and not any(f.done() for f in waiting[1:])
        r.on_sender_failed(1)  # it delivered part 0 only
        torch.testing.assert_close(waiting[0].result(), torch.full((2,), 4.0))
        for f in waiting[1:]:
            torch.testing.assert_close(f.result(), torch.full((2,), 4.0))  # (1 + 7) / 2
        with pytest.raises(BannedException):
            r.submit_part(1, 1, torch.zeros(2))
        with pytest.raises(AllreduceException):
            r.submit_part(0, 0, torch.zeros(2))  # out of order (and already finished)
    asyncio.run(main())


def test_out_of_order_parts_of_one_sender_are_refused():
    async def main():
        r = StreamingPartReducer([torch.Size([1])] * 2, num_senders=2, aggregate=_mean)
        with pytest.raises(AllreduceException):
            r.submit_part(0, 1, torch.zeros(1))
        with pytest.raises(AllreduceException):
            r.submit_part(2, 0, torch.zeros(1))
    asyncio.run(main())


class _Container:
    prefetch = 1


class _Runner:
    """What accumulate_parts_streaming uses of hivemind's AllReduceRunner."""

    def __init__(self, reducer: StreamingPartReducer):
        self.tensor_part_reducer, self.tensor_part_container = reducer, _Container()
        self.sender_peer_ids = ["a", "b"]
        self.banned: list[str] = []

    async def _ban_sender(self, peer_id: str) -> None:
        self.banned.append(peer_id)
        self.tensor_part_reducer.on_sender_failed(self.sender_peer_ids.index(peer_id))


def _stream(n: int, value: float):
    async def gen():
        for k in range(n):
            yield averaging_pb2.AveragingData(
                tensor_part=serialize_torch_tensor(torch.full((4,), value + k), runtime_pb2.CompressionType.NONE),
                weight=1.0)
    return gen()


def test_a_senders_parts_are_read_while_its_results_are_not_taken(monkeypatch):
    """hivemind's reducer read a sender's next part only after writing back the last one's result: with that
    sender's download busy (its results not taken) its uploads stalled. Here they are read on, up to the bound."""
    monkeypatch.setattr(reducer_mod, "READ_AHEAD_PARTS", 3)

    async def main():
        r = StreamingPartReducer([torch.Size([4])] * 5, num_senders=2, aggregate=_mean)
        runner = _Runner(r)
        results = accumulate_parts_streaming(runner, _stream(5, 0.0), sender_index=0)
        first = asyncio.create_task(results.__anext__())  # the handler starts; nobody takes its results yet
        await asyncio.sleep(0.3)
        assert r.num_parts_received[0] == 3 and not first.done()  # read ahead to the bound, no further
        for k in range(5):
            r.submit_part(1, k, torch.full((4,), 10.0 + k))
        deltas = [await first] + [msg async for msg in results]
        assert [m.code for m in deltas] == [averaging_pb2.AVERAGED_PART] * 5 and r.num_parts_received[0] == 5
        assert runner.banned == []
    asyncio.run(main())


def test_a_sender_whose_stream_breaks_is_banned_at_once():
    async def main():
        r = StreamingPartReducer([torch.Size([4])] * 4, num_senders=2, aggregate=_mean)
        runner = _Runner(r)

        async def broken():
            async for msg in _stream(2, 0.0):
                yield msg
            raise ConnectionResetError("gone")

        other = [r.submit_part(1, k, torch.full((4,), 5.0)) for k in range(4)]
        with pytest.raises(ConnectionResetError):
            async for _ in accumulate_parts_streaming(runner, broken(), sender_index=0):
                pass
        assert runner.banned and runner.banned[0] == "a"
        assert all(f.done() for f in other)  # parts 2-3 were reduced without it
        torch.testing.assert_close(other[3].result(), torch.full((4,), 5.0))
    asyncio.run(main())


def test_a_handler_waiting_for_a_part_ends_when_the_all_reduce_is_finalized(monkeypatch):
    """The all-reduce failed or ended (finalize cancels every part's future): a sender's handler waiting for a
    result, with its reader waiting for room, ends at once instead of hanging."""
    monkeypatch.setattr(reducer_mod, "READ_AHEAD_PARTS", 1)

    async def main():
        r = StreamingPartReducer([torch.Size([4])] * 3, num_senders=2, aggregate=_mean)
        runner = _Runner(r)
        results = [m async for m in _until_finalized(r, accumulate_parts_streaming(runner, _stream(3, 0.0), 0))]
        assert results == [] and runner.banned == ["a"]

    async def _until_finalized(r, gen):
        asyncio.get_event_loop().call_later(0.2, r.finalize)
        async for m in gen:
            yield m
    asyncio.run(asyncio.wait_for(main(), 5))
