"""Wire accounting for the shared all-reduce (sync/shared.py): the payload bytes one averager sends and
receives, counted in its own forked process and read from the peer's, and the codec switch that sends a slow
uplink's parts in fp16 (docs/DESIGN.md, "Slow uplinks are measured")."""
from __future__ import annotations

import multiprocessing as mp

import torch
from hivemind.compression import CompressionBase, CompressionInfo, Float16Compression, NoCompression
from hivemind.compression import SizeAdaptiveCompression, Uniform8BitQuantization
from hivemind.proto import runtime_pb2


def eight_bit() -> CompressionBase:
    # Below ~1k values hivemind's 1,032-byte 8-bit codebook costs more than fp16 (norms, small routers).
    return SizeAdaptiveCompression(threshold=1032, less=Float16Compression(), greater_equal=Uniform8BitQuantization())


COMPRESSIONS = {"none": NoCompression, "fp16": Float16Compression, "8bit": eight_bit}


class WireCounter:
    """Tensor payload bytes (after compression) one averager sent and received, in shared memory: the averager
    runs in its own forked process, where the counting happens, while the peer reads the totals here."""

    def __init__(self) -> None:
        self._sent = mp.Value("q", 0, lock=True)
        self._received = mp.Value("q", 0, lock=True)

    def add_sent(self, nbytes: int) -> None:
        with self._sent.get_lock():
            self._sent.value += nbytes

    def add_received(self, nbytes: int) -> None:
        with self._received.get_lock():
            self._received.value += nbytes

    @property
    def sent(self) -> int:
        return int(self._sent.value)

    @property
    def received(self) -> int:
        return int(self._received.value)


class CountingCompression(CompressionBase):
    """Wraps a hivemind compression and counts the bytes of every part it encodes as sent.

    hivemind compresses with it exactly the parts that go to other peers: this peer's input parts for the
    other reducers (its own part is averaged locally, unserialized) and, as `state_compression`, the tensors it
    serves to a peer downloading the state. The averaged deltas a reducer sends back and everything received
    are counted by `install_wire_counting` inside the averager process.
    """

    def __init__(self, inner: CompressionBase, counter: WireCounter, switchable: bool = False):
        self.inner = inner
        # Adaptive compressions (8-bit here) have no single type; hivemind only reads the per-tensor one.
        self.compression_type = getattr(inner, "compression_type", None)
        self.counter = counter
        # Set from the peer's process, read in the averager's (compress runs there): a slow uplink's parts go
        # fp16 from the next all-reduce on (sync.slow_uplink_mbit); receivers decode each part by its own codec.
        # Not 8-bit: the parts are parameters, and 8-bit rounding of a parameter (1/256 of 6 sigma of its part's
        # values) put a slow peer's part 23-56x the honest spread from the median in bench.wan `mixed`, so every
        # reducer dropped it as an outlier (sync/robust.py): it cost the others its upload and counted for
        # nothing. fp16's rounding (2^-11 of each value) stays inside the spread.
        self._slow = mp.Value("b", 0, lock=False) if switchable else None
        self._slow_codec = Float16Compression() if switchable else None

    def use_slow_codec(self, on: bool) -> None:
        if self._slow is not None:
            self._slow.value = int(on)

    def _current(self) -> CompressionBase:
        return self._slow_codec if self._slow is not None and self._slow.value else self.inner

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        out = self._current().compress(tensor, info, allow_inplace)
        self.counter.add_sent(len(out.buffer))
        return out

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        return self.inner.extract(serialized_tensor)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        # The configured codec's, even while parts go 8-bit: hivemind cuts the tensors into parts by this ratio,
        # and every sender's part i must hold the same values (a slow peer cutting 4x larger parts stalled every
        # all-reduce it joined in bench.wan `mixed`).
        return self.inner.estimate_compression_ratio(info)


def install_wire_counting(counter: WireCounter) -> None:
    """Count the tensors hivemind's all-reduce and state download (de)serialize without the configured
    compression object: averaged deltas sent back by a reducer, and every part received.

    Runs inside the averager's own process (see _CountingAverager.run), so the module globals patched here are
    that process's copies: other averagers, the DHT and the peer's own serialization are not affected.
    """
    from hivemind.averaging import allreduce, averager

    serialize, deserialize = allreduce.serialize_torch_tensor, allreduce.deserialize_torch_tensor

    def counted_serialize(*args, **kwargs) -> runtime_pb2.Tensor:
        out = serialize(*args, **kwargs)
        counter.add_sent(len(out.buffer))
        return out

    def counted_deserialize(serialized: runtime_pb2.Tensor, *args, **kwargs) -> torch.Tensor:
        counter.add_received(len(serialized.buffer))
        return deserialize(serialized, *args, **kwargs)

    allreduce.serialize_torch_tensor = counted_serialize       # averaged deltas a reducer returns
    allreduce.deserialize_torch_tensor = counted_deserialize   # input parts and averaged deltas received
    averager.deserialize_torch_tensor = counted_deserialize    # state downloaded by load_state_from_peers
