"""Averaging of the shared (non-expert) tensors: one hivemind DecentralizedAverager per peer.

The averager all-reduces a snapshot of the shared parameters taken at the round boundary, weighted by the
tokens each peer trained on since the last round. `apply()` then adds (result - snapshot) to the live
parameters, so training may continue while the all-reduce runs (a one-round-delayed update); with no training
in between it is exactly "parameters := average". `outer: nesterov` instead treats (anchor - average) as
DiLoCo's pseudo-gradient and takes an SGD step with Nesterov momentum from the previous round's anchor.
"""
from __future__ import annotations

import multiprocessing as mp

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.compression import CompressionBase, CompressionInfo, Float16Compression, NoCompression
from hivemind.compression import SizeAdaptiveCompression, Uniform8BitQuantization
from hivemind.proto import runtime_pb2
from hivemind.utils.logging import get_logger

from model.model import SpesMoE
from sync.config import SyncConfig
from sync.swarm import Swarm
from sync.transfer import patch_hivemind_8bit_decoder

logger = get_logger(__name__)

def _eight_bit() -> CompressionBase:
    # Below ~1k values hivemind's 1,032-byte 8-bit codebook costs more than fp16 (norms, small routers).
    return SizeAdaptiveCompression(threshold=1032, less=Float16Compression(), greater_equal=Uniform8BitQuantization())


COMPRESSIONS = {"none": NoCompression, "fp16": Float16Compression, "8bit": _eight_bit}


class CountingCompression(CompressionBase):
    """Wraps a hivemind compression and counts the bytes of every part it encodes for sending.

    The averager runs in a forked process, so the counter is a shared-memory value. In hivemind's butterfly
    all-reduce a peer sends its input parts (counted here) and sends back, for the part it reduces, one averaged
    delta per other sender of the same size and codec; so payload sent = received = 2 x counted input bytes
    when partitions are equal (the default, no bandwidth hints).
    """

    def __init__(self, inner: CompressionBase):
        self.inner = inner
        # Adaptive compressions (8-bit here) have no single type; hivemind only reads the per-tensor one.
        self.compression_type = getattr(inner, "compression_type", None)
        self.counter = mp.Value("q", 0, lock=True)

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        out = self.inner.compress(tensor, info, allow_inplace)
        with self.counter.get_lock():
            self.counter.value += len(out.buffer)
        return out

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        return self.inner.extract(serialized_tensor)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self.inner.estimate_compression_ratio(info)

    @property
    def input_bytes_sent(self) -> int:
        return int(self.counter.value)


class SharedAverager:
    """The shared tensors of the model in one DecentralizedAverager, with optional outer Nesterov."""

    def __init__(self, model: SpesMoE, swarm: Swarm, cfg: SyncConfig, params: list[torch.Tensor] | None = None,
                 prefix: str | None = None, outer: str | None = None):
        """Averages `params` (default: the model's shared parameters) under DHT prefix `prefix`."""
        self.cfg = cfg
        self.params = [p for _, p in model.shared_parameters()] if params is None else list(params)
        if cfg.compression == "8bit":
            patch_hivemind_8bit_decoder()  # before the averager process forks, so it inherits the fix
        self.compression = CountingCompression(COMPRESSIONS[cfg.compression]())
        self.averager = DecentralizedAverager(
            [p.detach().to("cpu", torch.float32).clone() for p in self.params], swarm.dht,
            prefix=prefix or f"{swarm.run_id}_shared", start=True, min_group_size=2, target_group_size=None,
            min_matchmaking_time=cfg.matchmaking_time, request_timeout=min(3.0, cfg.matchmaking_time / 2),
            allreduce_timeout=cfg.round_timeout, next_chunk_timeout=min(10.0, cfg.round_timeout / 4),
            compression=self.compression, allow_state_sharing=params is None,
        )
        self.snapshot: list[torch.Tensor] | None = None
        # DiLoCo's outer optimizer needs the params of the previous round (identical on every peer after a
        # successful round) and a momentum buffer.
        outer = cfg.outer if outer is None else outer
        self.anchor = [p.detach().to("cpu", torch.float32).clone() for p in self.params] if outer == "nesterov" else None
        self.momentum = [torch.zeros_like(a) for a in self.anchor] if self.anchor is not None else None

    def payload_bytes(self) -> int:
        """Bytes of one full copy of the shared tensors as they travel (fp32)."""
        return sum(p.numel() * 4 for p in self.params)

    def bytes_on_wire(self) -> int:
        """Payload bytes this peer sent (= received) in all-reduces so far; see CountingCompression."""
        return 2 * self.compression.input_bytes_sent

    def take_snapshot(self, tensors: list[torch.Tensor] | None = None) -> None:
        """At the round boundary (training thread): what this peer contributes to the average."""
        source = self.params if tensors is None else tensors
        self.snapshot = [p.detach().to("cpu", torch.float32).clone() for p in source]
        with self.averager.get_tensors() as tensors:
            for tensor, snap in zip(tensors, self.snapshot):
                tensor.copy_(snap)

    def all_reduce(self, weight: float, timeout: float) -> int:
        """Run the all-reduce on the snapshot (any thread); returns the group size, 0 if it failed."""
        control = None
        try:
            control = self.averager.step(weight=max(weight, 1e-6), timeout=timeout, wait=False)
            # Bounded even if the averager process itself dies (its future would never resolve otherwise).
            gathered = control.result(timeout=timeout + self.cfg.round_timeout)
        except Exception as e:  # a peer died mid-round, matchmaking timed out, ...: keep local values
            logger.warning(f"averaging failed this round: {type(e).__name__}: {e}")
            if control is not None and not control.done():
                control.cancel()
            return 0
        return len(gathered) if gathered else 0

    @torch.no_grad()
    def apply(self) -> None:
        """Training thread, after a successful all_reduce: live params += (new value - snapshot)."""
        with self.averager.get_tensors() as averaged:
            if self.anchor is None:
                targets = averaged
            else:
                lr, mu = self.cfg.outer_lr, self.cfg.outer_momentum
                for anchor, buf, avg in zip(self.anchor, self.momentum, averaged):
                    pseudo_grad = anchor - avg
                    buf.mul_(mu).add_(pseudo_grad)
                    anchor.sub_(pseudo_grad.add(buf, alpha=mu), alpha=lr)
                targets = self.anchor
            for param, snap, target in zip(self.params, self.snapshot, targets):
                # copy_ (not add_) keeps integer-free storage dtypes like bf16 exact when nothing changed.
                param.copy_((param.float() + (target - snap).to(param.device)).to(param.dtype))

    def load_from_peers(self, timeout: float) -> bool:
        """Late joiner / fell behind: copy the shared tensors from a live peer; False if none answered."""
        try:
            loaded = self.averager.load_state_from_peers(timeout=timeout)
        except Exception as e:
            logger.warning(f"could not download shared state: {e}")
            return False
        if loaded is None:
            return False
        _, tensors = loaded
        if len(tensors) != len(self.params) or any(t.shape != p.shape for t, p in zip(tensors, self.params)):
            logger.warning("a peer sent shared state of the wrong shapes: ignored")
            return False
        if not all(bool(torch.isfinite(t).all()) for t in tensors):
            logger.warning("a peer sent non-finite shared state: ignored")
            return False
        with torch.no_grad():
            for tensor, param in zip(tensors, self.params):
                param.copy_(tensor)
        if self.anchor is not None:
            for anchor, param in zip(self.anchor, self.params):
                anchor.copy_(param.detach())
        return True

    def shutdown(self) -> None:
        self.averager.shutdown()
