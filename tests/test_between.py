"""Shared-only rounds (sync.shared_every, sync/between.py) between real hivemind peers on 127.0.0.1: the shared
tensors are averaged, no expert moves, full rounds are not counted, and such a round is never due while a full
round is in flight."""
from __future__ import annotations

import concurrent.futures

import pytest
import torch

from peer.config import ConfigError, load_config, parse_override
from tests.conftest import MODEL, allreduce_cfg


@torch.no_grad()
def _perturb(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _, p in model.shared_parameters():
        p.add_(torch.randn(p.shape, generator=g) * 0.01)
    for e in model.owned_experts:
        for t in model.expert_parameters(e):
            t.add_(torch.randn(t.shape, generator=g) * 0.01)


def test_shared_only_round_averages_the_shared_tensors_and_moves_no_expert(swarm_factory):
    cfg = allreduce_cfg(every=10, shared_every=5)
    peers = [swarm_factory([0, 1], cfg), swarm_factory([2, 3], cfg)]
    for i, peer in enumerate(peers):
        _perturb(peer.model, seed=i)
    shared = [{n: p.detach().clone() for n, p in peer.model.shared_parameters()} for peer in peers]
    experts = [{e: [t.detach().float().clone() for t in peer.model.expert_parameters(e)]
                for e in range(MODEL.num_experts)} for peer in peers]
    sync = peers[0].sync
    assert not sync.shared_round_due(4) and sync.shared_round_due(5)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        sizes = list(pool.map(lambda p: p.sync.shared_round(step=5, tokens_since_shared=100), peers))
    assert sizes == [2, 2]
    for peer, own_experts in zip(peers, experts):
        for name, value in peer.model.shared_parameters():
            torch.testing.assert_close(value.detach(), (shared[0][name] + shared[1][name]) / 2, rtol=1e-5, atol=1e-6)
        for e in range(MODEL.num_experts):  # every expert, owned or not, exactly as before on this peer
            for before, now in zip(own_experts[e], peer.model.expert_parameters(e)):
                assert torch.equal(before, now.detach().float())
        assert peer.sync.round_id == 0 and peer.sync.shared_rounds == 1
    assert sync.shared.bytes_sent() > 0

    # A full round in flight holds the shared snapshot until it is applied: no shared-only round meanwhile.
    for peer in peers:
        peer.sync.start_round(step=10, tokens=200, tokens_since_last=100)
    assert not sync.shared_round_due(5)
    reports = [peer.sync.finish_round(block=True) for peer in peers]
    assert [r.group_size for r in reports] == [2, 2]
    assert sync.shared_round_due(5) and not peers[1].sync.shared_round_due(0)


def test_off_by_default_and_bounded_by_every():
    assert load_config(None).sync.shared_every == 0
    with pytest.raises(ConfigError, match="sync.shared_every"):
        load_config(None, [parse_override("sync.every=10"), parse_override("sync.shared_every=10")])
    with pytest.raises(ConfigError, match="sync.shared_every"):
        load_config(None, [parse_override("sync.shared_every=-1")])
