"""A round's decisions on contributions, as pure functions (docs/DESIGN.md, "Rounds as contributions").

Every peer aggregates every contribution itself: there is no reducer, no group and no bandwidth claim, so
what one peer may do to another's model is bounded here, on the receiver. The functions take plain values
(records' announcements, decoded tensors) and are unit-tested without a DHT (tests/test_aggregate.py).

Determinism: every honest peer that aggregates the same contributions must get bit-identical tensors (their
synchronized models stay identical; a digest of them is published, sync/contributions.py). So contributions are
taken in peer-ID order, norms are computed in float64 and rounded to 2^-24 relative before they decide anything,
scales are rounded to float32 once, and the weighted sum is accumulated one contribution at a time as a separate
float32 multiply and add per element (IEEE-exact on every machine: no fused multiply-add, no reduction whose
order depends on thread counts or vector width).

Shape suffixes: N = contributions, P = elements of one tensor.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import torch


@dataclass(frozen=True)
class Announcement:
    """What a peer's signed record says of its contribution to one round (sync.peer_record `contrib`)."""

    round: int
    size: int  # bytes of the blob
    digest: str  # sha256 hex of the blob
    weight: int  # tokens it trained since its previous contribution (capped by every receiver)
    experts: tuple[int, ...]  # the experts whose deltas the blob carries (besides the shared tensors)


def contributors(announcements: Mapping[str, Announcement | None], round_id: int) -> dict[str, Announcement]:
    """The peers whose announcement is for `round_id`, in peer-ID order (the order every peer aggregates in)."""
    return {p: a for p, a in sorted(announcements.items()) if a is not None and a.round == round_id}


def fetch_deadline(total_bytes: int, rate_bytes_per_s: float | None, floor_s: float, cap_s: float) -> float:
    """Seconds to wait for a round's blobs: their bytes at the measured download rate, twice over (a peer's
    link is shared with its training traffic and the others' requests), at least `floor_s`, at most `cap_s`.
    An unmeasured rate gets the cap; a contribution not in by then is left out of this round."""
    if not rate_bytes_per_s or rate_bytes_per_s <= 0 or not math.isfinite(rate_bytes_per_s):
        return cap_s
    return min(cap_s, max(floor_s, 2.0 * total_bytes / rate_bytes_per_s))


def norm64(tensors: Iterable[torch.Tensor]) -> float:
    """L2 norm over several tensors, accumulated in float64 and rounded to 24 significant bits: summation orders
    differ between machines by far less than that, so every peer decides clip scales from the same number."""
    value = math.sqrt(sum(float(torch.linalg.vector_norm(t.double())) ** 2 for t in tensors))
    if value == 0 or not math.isfinite(value):
        return value
    mantissa, exponent = math.frexp(value)
    return math.ldexp(round(mantissa * 2 ** 24) / 2 ** 24, exponent)


def median_clip_scales(norms: Sequence[float]) -> list[float]:
    """Per contribution, the factor that clips its norm to the lower median of all norms (1.0 when within).

    With three or more contributions a single peer can then move the aggregate by at most the median honest
    norm times its weight share, whatever it sent; with two, nobody can tell which is honest, and the larger is
    brought down to the smaller. A zero change (a peer that trained nothing) says nothing about an honest norm
    and does not set the median: with two peers it would clip the other's whole change to nothing. Scales are
    float32-rounded, so every peer multiplies by the same number."""
    finite = sorted(n for n in norms if math.isfinite(n) and n > 0)
    if not finite:
        return [1.0 if n == 0 else 0.0 for n in norms]
    tau = finite[(len(finite) - 1) // 2]
    return [float(torch.tensor(min(1.0, tau / n) if n > 0 else 1.0, dtype=torch.float32))
            if math.isfinite(n) else 0.0 for n in norms]


def capped_weights(weights: Sequence[float], cap: float) -> list[float]:
    """Claimed weights (tokens) bounded to [1, cap]: a claim of 10^12 tokens counts as one round's worth."""
    return [min(max(float(w), 1.0), cap) for w in weights]


def weighted_sum(tensors_N: Sequence[torch.Tensor], coefficients: Sequence[float]) -> torch.Tensor:
    """sum_n c_n x_n in float32, accumulated in order (deterministic on any machine)."""
    out_P = torch.zeros_like(tensors_N[0], dtype=torch.float32)
    for x_P, c in zip(tensors_N, coefficients):
        out_P.add_(x_P.float().mul(c))  # multiply, then add: never fused
    return out_P


def _coefficients(weights: Sequence[float], scales: Sequence[float]) -> list[float]:
    total = sum(wi for wi, s in zip(weights, scales) if s > 0)
    if total <= 0:
        return []
    return [float(torch.tensor(wi * s / total, dtype=torch.float32)) for wi, s in zip(weights, scales)]


def dot64(a: Iterable[torch.Tensor], b: Iterable[torch.Tensor]) -> float:
    """Sum of elementwise products over paired tensors in float64, rounded like norm64."""
    value = sum(float(torch.dot(x.double().flatten(), y.double().flatten())) for x, y in zip(a, b))
    if value == 0 or not math.isfinite(value):
        return value
    mantissa, exponent = math.frexp(value)
    return math.ldexp(round(mantissa * 2 ** 24) / 2 ** 24, exponent)


def aggregate(contributions: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float], cap: float,
              names: Sequence[str], min_cosine: float | None = 0.0) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The robust mean of `contributions` (each a dict name -> dense delta) over `names`: each contribution
    clipped to the median norm (over those names) and weighted by its capped tokens; then, with three or more,
    a contribution whose cosine with that mean is at most `min_cosine` (None: no such test) is left out and the
    mean taken again without it. Returns the mean and the scale applied to each contribution (1.0: as sent;
    0.0: left out), in the given order.

    Why the direction test: the norm clip bounds how far one contribution moves the mean, not where to; one
    attacker of four sending minus the honest change at the median norm raised the honest held-out loss 1.24x
    (bench.byzantine c_reverse). Honest changes of one round agree in direction, so each has a positive cosine
    with a mean they dominate; a reversed or rolled-back one (the untrained weights minus the synchronized ones)
    has a negative one."""
    norms = [norm64(c[n] for n in names) for c in contributions]
    scales = median_clip_scales(norms)
    w = capped_weights(weights, cap)
    coefficients = _coefficients(w, scales)
    if not coefficients:
        return {}, scales
    mean = {n: weighted_sum([c[n] for c in contributions], coefficients) for n in names}
    if min_cosine is None or len(contributions) < 3:
        return mean, scales
    mean_norm = norm64(mean.values())
    if mean_norm == 0:
        return mean, scales
    cosines = [dot64((c[n] for n in names), (mean[n] for n in names)) / (norm * mean_norm) if norm > 0 and s > 0
               else 1.0 for c, norm, s in zip(contributions, norms, scales)]
    if all(cos > min_cosine for cos in cosines):
        return mean, scales
    scales = [0.0 if cos <= min_cosine else s for s, cos in zip(scales, cosines)]
    coefficients = _coefficients(w, scales)
    if not coefficients:
        return {}, scales
    return {n: weighted_sum([c[n] for c in contributions], coefficients) for n in names}, scales


def change_within(delta_norm: float, reference_norm: float, own_relative_change: float, ratio: float,
                  floor: float = 1e-3) -> bool:
    """A contribution nobody else can be compared with (an expert with a single owner) must be finite and
    change its tensors by at most `ratio` times the relative change this peer saw in its own round (at least
    `floor` relative): an owner's honest round changes its expert about as much as this peer's changed its own."""
    if not math.isfinite(delta_norm):
        return False
    return delta_norm <= ratio * max(own_relative_change, floor) * max(reference_norm, 1e-6)


def rounds_to_skip(strikes: int, cap: int = 32) -> int:
    """Rounds a peer is neither waited for nor asked after `strikes` failures in a row (no announcement in
    time, a blob that did not arrive or did not decode): 1, 2, 4, ... up to `cap`. A silent or hostile peer then
    costs the others one wait, not one per round; an honest peer whose link came back is asked again soon."""
    return 0 if strikes <= 0 else min(2 ** (strikes - 1), cap)


def majority_digest(digests: Mapping[str, str]) -> str | None:
    """The digest most peers published for a round (ties: the smallest, so every peer picks the same one)."""
    counts: dict[str, int] = {}
    for d in digests.values():
        counts[d] = counts.get(d, 0) + 1
    if not counts:
        return None
    best = max(counts.values())
    return min(d for d, c in counts.items() if c == best)
