"""Expert-merging warm-up: the schedule, the formula against a plain reference, and merging through a real
3-peer round (replicas identical, non-owners receive the merged experts next round)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sync.config import MergeConfig
from sync.merge import merge_alpha, merge_deltas, merge_due, merge_neighbours, merge_step
from tests.conftest import MODEL, sync_cfg as _sync_cfg
from tests.conftest import local_training as _local_training
from tests.test_swarm import _experts


def reference_merge(snapshot: dict[int, dict[str, torch.Tensor]], alpha: float, topk: int,
                    n_layers: int) -> dict[int, dict[str, torch.Tensor]]:
    """The SPEC's formula written out with loops: per layer, cosine of flattened gate rows, top-k others."""
    experts = sorted(snapshot)
    out = {e: {} for e in experts}
    for layer in range(n_layers):
        gu, dn = f"layers.{layer}.gate_up_proj", f"layers.{layer}.down_proj"
        half = snapshot[experts[0]][gu].shape[0] // 2
        gate = {e: snapshot[e][gu][:half].flatten().float() for e in experts}
        for i in experts:
            sims = sorted(((F.cosine_similarity(gate[i], gate[j], dim=0).item(), j) for j in experts if j != i),
                          reverse=True)
            chosen = [j for _, j in sims[:topk]]
            for name in (gu, dn):
                pull = sum(snapshot[j][name].float() - snapshot[i][name].float() for j in chosen) / len(chosen)
                out[i][name] = snapshot[i][name].float() + alpha * pull
    return out


@pytest.mark.unit
def test_alpha_schedule_edges():
    cfg = MergeConfig(interval=500, alpha=0.05, decay_steps=10_000, topk=4)
    assert merge_alpha(0, cfg) == pytest.approx(0.05)
    assert merge_alpha(5_000, cfg) == pytest.approx(0.025)
    assert merge_alpha(10_000, cfg) == 0.0 and merge_alpha(20_000, cfg) == 0.0
    assert merge_due(500, cfg) and merge_due(9_500, cfg)
    assert not merge_due(501, cfg) and not merge_due(10_000, cfg) and not merge_due(10_500, cfg)
    assert not merge_due(500, MergeConfig(alpha=0.0))


@pytest.mark.unit
def test_a_round_started_late_or_early_still_merges_once_per_interval():
    """Rounds start a step or two off the multiples of sync.merge.interval (held for a later peer, started early
    to join the swarm's round): the round whose steps cover a multiple merges, once, at that multiple's alpha."""
    cfg = MergeConfig(interval=5, alpha=0.05, decay_steps=1000)
    assert merge_step(12, cfg, since=9) == 10  # held two steps past 10
    assert merge_step(17, cfg, since=12) == 15 and merge_step(22, cfg, since=17) == 20
    assert merge_step(14, cfg, since=10) is None  # 10 was merged by the round that started there
    assert merge_step(19, cfg, since=15) is None and merge_step(21, cfg, since=19) == 20  # early, then late
    assert merge_step(1002, cfg, since=998) is None  # the multiple 1000 is past the warm-up
    starts = [0, 7, 12, 18, 21, 29, 31]  # uneven starts: every multiple of 5 up to 31 merged exactly once
    merged = [merge_step(s, cfg, since=p) for p, s in zip(starts, starts[1:])]
    assert [m for m in merged if m is not None] == [5, 10, 15, 20, 25, 30], merged


@pytest.mark.unit
def test_topk_never_picks_itself():
    g = torch.Generator().manual_seed(0)
    gate_up_EFD = torch.randn(6, 8, 5, generator=g)
    gate_up_EFD[3] = gate_up_EFD[1] * 2  # 1 and 3 are each other's nearest
    neighbours = merge_neighbours(gate_up_EFD, topk=5)
    assert neighbours.shape == (6, 5)
    for i in range(6):
        assert i not in neighbours[i].tolist()
    assert neighbours[1, 0] == 3 and neighbours[3, 0] == 1


@pytest.mark.unit
def test_vectorized_merge_equals_the_reference():
    g = torch.Generator().manual_seed(1)
    snapshot = {e: {f"layers.{l}.{n}": torch.randn(*shape, generator=g) for l in range(2)
                    for n, shape in (("gate_up_proj", (8, 4)), ("down_proj", (4, 4)))} for e in range(5)}
    deltas = merge_deltas(snapshot, targets=[0, 3], alpha=0.3, topk=2,
                          layers=[[f"layers.{l}.gate_up_proj", f"layers.{l}.down_proj"] for l in range(2)])
    reference = reference_merge(snapshot, alpha=0.3, topk=2, n_layers=2)
    for e in (0, 3):
        for name, delta in deltas[e].items():
            torch.testing.assert_close(snapshot[e][name] + delta, reference[e][name])


def test_merge_through_a_real_round(swarm_factory):
    cfg = _sync_cfg(compression="none", merge=MergeConfig(interval=2, alpha=0.5, decay_steps=1000, topk=2))
    a, b, c, d = (swarm_factory([0, 1], cfg), swarm_factory([2], cfg), swarm_factory([3], cfg),
                  swarm_factory([2], cfg))  # d is a replica of b
    for i, peer in enumerate((a, b, c, d)):
        _local_training(peer, seed=50 + i)
    peers = [a, b, c, d]
    for peer in peers:
        peer.sync.start_round(step=2, tokens=100, tokens_since_last=100)
    reports = [peer.sync.finish_round(block=True) for peer in peers]
    assert all(r.merge_alpha == pytest.approx(0.5 * (1 - 2 / 1000)) for r in reports), reports
    alpha = reports[0].merge_alpha
    # Pre-merge snapshot = what the round synchronized: a's 0 and 1, c's 3, b and d's averaged 2.
    # Non-owners hold the synchronized, not yet merged, values (the merged ones reach them next round).
    synced = {0: _experts(b)[0], 1: _experts(b)[1], 2: _experts(a)[2], 3: _experts(a)[3]}
    expected = reference_merge(synced, alpha, topk=2, n_layers=MODEL.n_layers)
    for owner, expert in ((a, 0), (a, 1), (b, 2), (d, 2), (c, 3)):
        for name, value in _experts(owner)[expert].items():
            torch.testing.assert_close(value.float(), expected[expert][name], rtol=1e-5, atol=1e-6)
    # Next round (no merge due): non-owners receive the merged experts.
    for peer in peers:
        peer.sync.start_round(step=3, tokens=200, tokens_since_last=100)
    reports = [peer.sync.finish_round(block=True) for peer in peers]
    assert all(r.merge_alpha == 0 for r in reports)
    for expert in range(MODEL.num_experts):
        values = [_experts(p)[expert] for p in peers]
        for other in values[1:]:
            for name in values[0]:
                torch.testing.assert_close(other[name].float(), values[0][name].float(), rtol=1e-5, atol=1e-6)
