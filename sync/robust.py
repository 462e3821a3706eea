"""Robust aggregation: no single peer may move an average beyond a bound (docs/DESIGN.md, "Hostile peers").

Shape suffixes: N = contributions (peers or copies), P = flattened elements of one part.

`centered_clip` is CenteredClip from BTARD (Gorbunov et al., "Secure Distributed Training at Scale", ICML 2022):
v <- v + sum_i w_i * min(1, tau / ||x_i - v||) * (x_i - v) / sum_i w_i, started at the coordinate-wise median,
with tau = clip_factor * median_i ||x_i - median||, so tau follows the honest spread and needs no tuning to the
scale of the tensors. A contribution then moves the result by about w_i / (the others' weight) * tau at most (at
the fixed point the others' unclipped pull balances its clipped one: tau / 2 with three equal rows); one further than 2 tau
from the median (5x the median distance) is dropped altogether, as long as two others remain. When every
contribution lies within tau of the plain weighted mean, that mean is a fixed point and is returned exactly:
with nobody attacking, robust aggregation *is* plain averaging.

`robust_mean` combines 3+ copies of an expert downloaded at join (sync/fetch.py); `coordinate_median` picks
among downloaded shared states (sync/shared_tensors.py).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from hivemind.utils.logging import get_logger

logger = get_logger(__name__)


def coordinate_median(x_NP: torch.Tensor) -> torch.Tensor:
    """Coordinate-wise median (the mean of the two middle values for an even count)."""
    n = x_NP.shape[0]
    # Every reducer runs this on each part of every all-reduce, on the averager's event loop: a sort across the
    # rows of a 512 KiB part took 7.7 ms of a 12 ms part on one core (the all-reduce waits meanwhile), min/max
    # networks 0.25 ms. They pick values (no sums, so no cancellation against a peer's 1e30 entries).
    if n <= 2:
        return x_NP.mean(0) if n == 2 else x_NP[0].clone()
    if n == 3:
        a, b, c = x_NP[0], x_NP[1], x_NP[2]
        return torch.maximum(torch.minimum(a, b), torch.minimum(torch.maximum(a, b), c))
    if n == 4:
        # Sorted pairs (lo1, hi1), (lo2, hi2): the smallest is one of the lows, the largest one of the highs; the
        # middle two are the larger low and the smaller high.
        lo1, hi1 = torch.minimum(x_NP[0], x_NP[1]), torch.maximum(x_NP[0], x_NP[1])
        lo2, hi2 = torch.minimum(x_NP[2], x_NP[3]), torch.maximum(x_NP[2], x_NP[3])
        return 0.5 * (torch.maximum(lo1, lo2) + torch.minimum(hi1, hi2))
    sorted_NP = torch.sort(x_NP, dim=0).values
    return 0.5 * (sorted_NP[(n - 1) // 2] + sorted_NP[n // 2])


def median_distance(x_NP: torch.Tensor, median_P: torch.Tensor | None = None,
                    dist_N: torch.Tensor | None = None) -> float:
    """The median of the rows' distances to their coordinate-wise median: the honest spread tau scales with."""
    if dist_N is None:
        median_P = coordinate_median(x_NP) if median_P is None else median_P
        dist_N = torch.linalg.vector_norm(x_NP - median_P, dim=1)
    return float(coordinate_median(dist_N[:, None])[0])


def centered_clip(x_NP: torch.Tensor, w_N: torch.Tensor, clip_factor: float = 2.5, iters: int = 50) -> torch.Tensor:
    """Robust weighted mean of finite rows `x_NP` with non-negative weights `w_N` (module docstring).

    With fewer than 3 rows there is no majority to stand on: the plain weighted mean is returned."""
    return centered_clip_outliers(x_NP, w_N, clip_factor, iters)[0]


def centered_clip_outliers(x_NP: torch.Tensor, w_N: torch.Tensor, clip_factor: float = 2.5,
                           iters: int = 50, min_tau: float = 0.0) -> tuple[torch.Tensor, int]:
    """centered_clip, plus how many rows lie more than 2 tau from the result (clipped to under half their pull:
    the outliers worth counting as refusals). `min_tau`: a floor for tau (from the honest
    spread of earlier parts), for parts where most rows coincide."""
    x_NP, w_N = x_NP.float(), w_N.float()
    total = float(w_N.sum())
    if total <= 0:
        w_N, total = torch.ones_like(w_N), float(x_NP.shape[0])
    mean_P = (w_N[:, None] * x_NP).sum(0) / total
    if x_NP.shape[0] < 3:
        return mean_P, 0
    median_P = coordinate_median(x_NP)
    dist_N = torch.linalg.vector_norm(x_NP - median_P, dim=1)
    tau = max(clip_factor * median_distance(x_NP, median_P, dist_N), min_tau)
    far_N = dist_N > 2 * tau
    far = int(far_N.sum())
    if tau > 0 and far and x_NP.shape[0] - far >= 2:
        # Far outside the honest spread (a stale model, a x1e6 update): no pull at all, rather than the pull of
        # a clipped contribution, which repeated every round drifts the model (measured: bench.byzantine).
        x_NP, w_N = x_NP[~far_N], w_N[~far_N]
        total = float(w_N.sum())
        if total <= 0:
            w_N, total = torch.ones_like(w_N), float(x_NP.shape[0])
        mean_P = (w_N[:, None] * x_NP).sum(0) / total
    else:
        far = 0
    if not tau > 0:  # at least half the rows coincide: the median is the robust answer
        if float(torch.linalg.vector_norm(x_NP - mean_P, dim=1).max()) == 0:
            return mean_P, 0
        return median_P, int((torch.linalg.vector_norm(x_NP - median_P, dim=1) > 0).sum())
    if float(torch.linalg.vector_norm(x_NP - mean_P, dim=1).max()) <= tau:
        return mean_P, far  # nobody (else) is an outlier: exactly the plain mean (of the rest)
    v_P = median_P
    for _ in range(iters):
        diff_NP = x_NP - v_P
        scale_N = torch.clamp(tau / torch.linalg.vector_norm(diff_NP, dim=1).clamp_min(1e-30), max=1.0)
        step_P = (w_N[:, None] * scale_N[:, None] * diff_NP).sum(0) / total
        v_P = v_P + step_P
        if float(torch.linalg.vector_norm(step_P)) <= 1e-6 * tau:
            break
    return v_P, far + int((torch.linalg.vector_norm(x_NP - v_P, dim=1) > 2 * tau).sum())


def robust_mean(copies: Sequence[dict[str, torch.Tensor]], clip_factor: float = 2.5) -> dict[str, torch.Tensor]:
    """Aggregate several copies of one expert (name -> tensor): centered clip over the whole expert, so a copy
    is judged as one vector (a forged expert is an outlier as a whole, not per coordinate)."""
    names = list(copies[0])
    flat_NP = torch.stack([torch.cat([c[n].float().reshape(-1) for n in names]) for c in copies])
    out_P = centered_clip(flat_NP, torch.ones(len(copies)), clip_factor)
    out, offset = {}, 0
    for name in names:
        shape = copies[0][name].shape
        numel = math.prod(shape)
        out[name] = out_P[offset:offset + numel].reshape(shape)
        offset += numel
    return out
