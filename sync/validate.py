"""Validation of tensors received from other peers, before they touch the model (docs/DESIGN.md, "Hostile peers").

A peer on the network may be buggy or hostile: anything it sends is checked against the local copy (names,
shapes, dtype, finiteness, norm). Validation is all-or-nothing per expert, because a half-updated expert is
worse than a stale one. Refusals are counted by reason for the `spes_rejected_tensors_total` metric.
"""
from __future__ import annotations

import math
import multiprocessing as mp

import torch

# "malformed" is a response that could not even be decoded into named tensors (counted by sync.transfer);
# "missing" .. "norm" are produced by validate_tensors; the rest by the defences against hostile peers
# (docs/DESIGN.md, "Hostile peers"):
#   delta        a received change out of proportion to an honest round's (a single owner's expert change, a
#                downloaded expert copy);
#   weight       a contribution whose claimed weight is above the per-round token cap (counted at the cap);
#   unauthorized a request without a valid ticket in a closed run;
#   record       a DHT record refused by the record validator (unsigned, forged, malformed, far-future);
#   digest       a contribution whose bytes do not match the digest its signed record announced;
#   size         a contribution announced at another size than the run's codec gives for its tensors;
#   direction    a contribution pointing away from the round's aggregate (sync/aggregate.py).
REJECT_REASONS = ("missing", "shape", "dtype", "nonfinite", "norm", "malformed", "delta", "weight", "unauthorized",
                  "record", "digest", "size", "direction")


class RejectCounter:
    """Counts of refused receptions per reason, in shared memory: refusals happen in the peer's threads and
    in its forked hivemind DHT process (it validates records), and are all read here. Create it before those processes start so they inherit it."""

    def __init__(self) -> None:
        self._counts = mp.Array("q", len(REJECT_REASONS), lock=True)

    def add(self, reason: str, n: int = 1) -> None:
        """Count `n` refusals for `reason` (one of REJECT_REASONS)."""
        if reason not in REJECT_REASONS:
            # A typo here would silently create a metric label nobody watches.
            raise ValueError(f"unknown reject reason {reason!r}; expected one of {REJECT_REASONS}")
        with self._counts.get_lock():
            self._counts[REJECT_REASONS.index(reason)] += n

    def counts(self) -> dict[str, int]:
        """A snapshot {reason: count} including zero counts."""
        with self._counts.get_lock():
            return dict(zip(REJECT_REASONS, self._counts[:]))

    def total(self) -> int:
        """All refusals so far."""
        with self._counts.get_lock():
            return sum(self._counts[:])


def _norm_fp32(tensor: torch.Tensor) -> float:
    # vector_norm(dtype=fp32) upcasts bf16/fp16 on the fly: at most one temporary, none for fp32 input.
    # It refuses to narrow fp64, which gets one explicit fp32 copy instead.
    tensor = tensor.detach()
    if tensor.dtype == torch.float64:
        tensor = tensor.to(torch.float32)
    return float(torch.linalg.vector_norm(tensor, dtype=torch.float32))


def validate_tensors(
    received: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor],
    max_norm_ratio: float = 10.0,
    norm_floor: float = 1e-3,
) -> tuple[dict[str, torch.Tensor] | None, str | None]:
    """Check `received` against the local `reference` copy of the same expert / tensor group.

    Returns (tensors cast to each reference's dtype and device, None) when every tensor passes, else
    (None, reason) with reason in REJECT_REASONS. The reference is only read, never modified.
    A tensor's L2 norm must be <= max_norm_ratio * max(norm(reference), norm_floor * sqrt(numel)): the floor
    keeps a zero-initialized reference from refusing every update.
    """
    if not isinstance(received, dict) or set(received) != set(reference):
        return None, "missing"
    # Cheap structural checks on every tensor first, so a wrong-shaped expert costs no norm computation.
    for name, ref in reference.items():
        tensor = received[name]
        if not isinstance(tensor, torch.Tensor):
            return None, "dtype"
        if tuple(tensor.shape) != tuple(ref.shape):
            return None, "shape"
        # is_floating_point is False for integer, bool and complex dtypes: all refused.
        if not tensor.is_floating_point():
            return None, "dtype"
    for name, ref in reference.items():
        tensor = received[name]
        norm = _norm_fp32(tensor)
        if not math.isfinite(norm):
            # An infinite norm is either a NaN/Inf element or finite values whose squares overflow fp32;
            # only the first is "nonfinite" (this second temporary exists only on this rare path).
            if not bool(torch.isfinite(tensor).all()):
                return None, "nonfinite"
            return None, "norm"
        bound = max_norm_ratio * max(_norm_fp32(ref), norm_floor * math.sqrt(max(ref.numel(), 1)))
        if not norm <= bound:
            return None, "norm"
    out = {
        name: received[name].detach().to(device=ref.device, dtype=ref.dtype).requires_grad_(False)
        for name, ref in reference.items()
    }
    return out, None
