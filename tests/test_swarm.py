"""SPES rounds between real hivemind peers on 127.0.0.1, several peers in one pytest process.

Each peer is a DHT node + SparseSync (its averager and expert exchange) around its own SpesMoE. Local training is
stood in for by seeded perturbations of what each peer trains, so the expected post-round values are exact."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest
import torch

from model.config import ModelConfig
from model.model import SpesMoE
from sync.config import SyncConfig
from sync.rounds import SparseSync
from sync.swarm import Swarm, start_dht

MODEL = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, num_experts=4, top_k=2,
                    expert_hidden=32, seq_len=16, frozen_expert_dtype="float32")
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


@dataclass
class Peer:
    model: SpesMoE
    swarm: Swarm
    sync: SparseSync

    def shutdown(self) -> None:
        self.sync.shutdown()


def _sync_cfg(**kw) -> SyncConfig:
    base = dict(every=1, round_timeout=20.0, matchmaking_time=2.0, record_ttl=6.0)
    base.update(kw)
    return SyncConfig(**base)


@pytest.fixture
def swarm_factory():
    peers: list[Peer] = []
    first_maddrs: list[str] = []

    def make(owned: list[int], cfg: SyncConfig | None = None, join: bool = True, bandwidth: float | None = None
             ) -> Peer:
        cfg = cfg or _sync_cfg()
        # Signed, validated records as in peer.run (sync.records).
        dht = start_dht(first_maddrs, LOOPBACK, run_id="test-run", num_experts=MODEL.num_experts,
                        record_ttl=cfg.record_ttl)
        if not first_maddrs:
            first_maddrs.extend(str(m) for m in dht.get_visible_maddrs())
        swarm = Swarm(dht, "test-run", MODEL.num_experts, ttl=cfg.record_ttl)
        model = SpesMoE(MODEL, owned_experts=owned, seed=0)
        peer = Peer(model, swarm, SparseSync(model, swarm, cfg, set_owned=model.set_owned_experts, bandwidth=bandwidth))
        peers.append(peer)
        if join:
            peer.sync.join(step=0, tokens=0)
        return peer

    try:
        yield make
    finally:
        for peer in peers:
            try:
                peer.shutdown()
            except Exception:
                pass


@torch.no_grad()
def _local_training(peer: Peer, seed: int) -> None:
    """Change what this peer trains (shared params, owned experts) as a few local steps would."""
    g = torch.Generator().manual_seed(seed)
    for _, p in peer.model.shared_parameters():
        p.add_(torch.randn(p.shape, generator=g) * 0.01)
    for e in peer.model.owned_experts:
        for bank in peer.model.expert_banks():
            for name in ("gate_up_proj", "down_proj"):
                t = getattr(bank.bank[e], name)
                t.add_(torch.randn(t.shape, generator=g) * 0.01)


def _shared(peer: Peer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in peer.model.shared_parameters()}


def _experts(peer: Peer) -> dict[int, dict[str, torch.Tensor]]:
    return {e: {k: v.clone() for k, v in peer.model.expert_tensors(e).items()} for e in range(MODEL.num_experts)}


def _round_all(peers: list[Peer], tokens: int = 100) -> list:
    """One round on every peer: starts are local and quick (the network part runs in each peer's background
    thread, concurrently), then each peer applies its result, as the training loop does at a step boundary."""
    for peer in peers:
        peer.sync.start_round(step=1, tokens=tokens, tokens_since_last=tokens)
    return [peer.sync.finish_round(block=True) for peer in peers]


def _assert_experts_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for name in a:
        torch.testing.assert_close(a[name].float(), b[name].float(), rtol=1e-6, atol=1e-6)


def test_round_averages_shared_and_spreads_owned_experts(swarm_factory):
    peers = [swarm_factory([0, 1]), swarm_factory([2]), swarm_factory([3])]
    for i, peer in enumerate(peers):
        _local_training(peer, seed=i)
    shared_before = [_shared(p) for p in peers]
    experts_before = [_experts(p) for p in peers]
    owner_of = {0: 0, 1: 0, 2: 1, 3: 2}

    reports = _round_all(peers)
    assert [r.group_size for r in reports] == [3, 3, 3], reports
    for peer in peers:
        for name, value in _shared(peer).items():
            mean = torch.stack([s[name] for s in shared_before]).mean(0)
            torch.testing.assert_close(value, mean, rtol=1e-5, atol=1e-6)
        for expert, owner in owner_of.items():
            _assert_experts_equal(_experts(peer)[expert], experts_before[owner][expert])
    coverage = peers[0].swarm.coverage()
    assert all(len(owners) == 1 for owners in coverage.values())


def test_slow_owner_copy_arrives_late_and_is_used_next_round(swarm_factory, monkeypatch):
    """A slow owner's expert copy does not hold the round up: the fetcher applies what arrived by its deadline,
    keeps the slow transfer running (never asking twice) and applies the copy in a later round."""
    fast, slow = swarm_factory([0, 1, 2]), swarm_factory([3])
    served: list[str] = []
    original = slow.sync.exchange._serve

    async def slow_serve(uid, metadata=b""):
        served.append(uid)
        if len(served) == 1:
            await asyncio.sleep(8.0)  # the first copy crawls through a slow uplink
        async for message in original(uid, metadata):
            yield message

    monkeypatch.setattr(slow.sync.exchange, "_serve", slow_serve)
    _local_training(fast, seed=4)
    _local_training(slow, seed=5)
    round1_copy = _experts(slow)[3]
    started = time.monotonic()
    reports = _round_all([fast, slow])
    assert reports[0].experts_missing == [3] and time.monotonic() - started < 8.0, reports[0]
    assert not torch.equal(_experts(fast)[3]["layers.0.down_proj"], round1_copy["layers.0.down_proj"])
    time.sleep(8.0)  # the late copy arrives meanwhile
    _local_training(fast, seed=7)
    _local_training(slow, seed=6)
    reports = _round_all([fast, slow])
    assert 3 in reports[0].experts_synced and served == ["3@1"], (reports[0], served)
    _assert_experts_equal(_experts(fast)[3], round1_copy)  # the round-1 copy, one round late
    _local_training(fast, seed=8)
    _local_training(slow, seed=9)
    reports = _round_all([fast, slow])  # and the next round asks again, for the current copy
    assert 3 in reports[0].experts_synced and served[-1] == "3@3", served
    _assert_experts_equal(_experts(fast)[3], _experts(slow)[3])


def test_slow_uplink_follows_and_nobody_waits_for_it(swarm_factory):
    """A peer below sync.follow_below_mbit never joins an all-reduce group: the others average without waiting
    for it, it takes the swarm's shared tensors by download (keeping what it trained since its snapshot), and
    its experts still reach them."""
    cfg = _sync_cfg(matchmaking_time=4.0, follow_below_mbit=10.0)
    a, b = swarm_factory([0, 1], cfg), swarm_factory([2], cfg)
    home = swarm_factory([3], cfg, bandwidth=5.0)
    assert home.sync.follower and all(r.follows == (p == home.swarm.peer_id) for p, r in a.swarm.peers().items())
    for i, peer in enumerate((a, b, home)):
        _local_training(peer, seed=30 + i)
    before = [_shared(p) for p in (a, b)]
    home_expert = _experts(home)[3]
    for peer in (a, b, home):
        peer.sync.start_round(step=1, tokens=100, tokens_since_last=100)
    started = time.monotonic()
    reports = [peer.sync.finish_round(block=True) for peer in (a, b)]
    assert [r.group_size for r in reports] == [2, 2], reports
    assert time.monotonic() - started < 4.0  # nobody waited the matchmaking time for the follower
    home_report = home.sync.finish_round(block=True)
    assert home_report.group_size == 1 and "download" in home_report.timing, home_report
    for name, value in _shared(home).items():  # one of the swarm's states: a source's snapshot or the average
        candidates = [before[0][name], before[1][name], (before[0][name] + before[1][name]) / 2]
        assert any(torch.allclose(value, c, rtol=1e-5, atol=1e-6) for c in candidates), name
    for peer in (a, b):
        _assert_experts_equal(_experts(peer)[3], home_expert)


def test_diloco_mode_every_peer_owns_every_expert(swarm_factory):
    peers = [swarm_factory([0, 1, 2, 3]) for _ in range(3)]
    for i, peer in enumerate(peers):
        _local_training(peer, seed=10 + i)
    experts_before = [_experts(p) for p in peers]
    _round_all(peers)  # the replicas discover each other; their expert averagers start with this round
    for i, peer in enumerate(peers):
        _local_training(peer, seed=20 + i)
    experts_before = [_experts(p) for p in peers]
    reports = _round_all(peers)
    assert all(r.group_size == 3 and r.expert_group_size == 3 for r in reports), reports
    for peer in peers:
        for expert in range(MODEL.num_experts):
            mean = {k: torch.stack([b[expert][k] for b in experts_before]).mean(0) for k in experts_before[0][expert]}
            _assert_experts_equal(_experts(peer)[expert], mean)


def test_hostile_expert_is_refused_counted_and_model_unchanged(swarm_factory):
    honest, hostile = swarm_factory([0, 1, 2]), swarm_factory([3])
    before = _experts(honest)[3]
    evil = {k: torch.full_like(v, float("nan")) for k, v in hostile.model.expert_tensors(3).items()}
    # The hostile peer serves NaNs for every round it claims (publish after its own round publish).
    original_publish = hostile.sync.exchange.publish
    hostile.sync.exchange.publish = lambda round_id, expert, tensors: original_publish(round_id, expert, evil)
    reports = _round_all([honest, hostile])
    assert reports[0].rejected == 1 and honest.sync.rejects.counts().get("nonfinite") == 1
    assert 3 in reports[0].experts_missing
    _assert_experts_equal(_experts(honest)[3], before)


def _kill(peer: Peer) -> None:
    """The peer's processes stop without leaving cleanly (no record withdrawal)."""
    peer.sync.shared.shutdown()
    peer.sync.exchange.shutdown()
    peer.swarm._stop.set()
    peer.swarm.dht.shutdown()


def test_peer_killed_mid_round_does_not_stall_the_others(swarm_factory):
    cfg = _sync_cfg(round_timeout=15.0)
    a, b, c = swarm_factory([0, 1], cfg), swarm_factory([2], cfg), swarm_factory([3], cfg)
    _round_all([a, b, c])
    for peer in (a, b, c):
        peer.sync.start_round(step=2, tokens=200, tokens_since_last=100)
    time.sleep(1.0)  # everyone is looking for its group / fetching
    _kill(c)
    start = time.monotonic()
    reports = [a.sync.finish_round(block=True), b.sync.finish_round(block=True)]
    assert time.monotonic() - start < cfg.round_timeout + 15
    assert all(r is not None for r in reports)
    reports = _round_all([a, b])  # and the next round works between the survivors
    assert all(r.group_size == 2 for r in reports), reports


def test_leaving_peer_does_not_wait_the_round_timeout_for_a_partner_that_left(swarm_factory):
    cfg = _sync_cfg(round_timeout=40.0)
    a, b = swarm_factory([0, 1], cfg), swarm_factory([2, 3], cfg)
    _round_all([a, b])
    a.sync.start_round(step=2, tokens=200, tokens_since_last=100)  # b never starts this round: it is leaving
    time.sleep(cfg.matchmaking_time + 1.0)  # a's first matchmaking attempt failed: hivemind retries until timeout
    a.sync.leave_soon()  # what a SIGTERM does (Trainer.request_stop -> stop hooks)
    start = time.monotonic()
    report = a.sync.finish_round(block=True)
    assert time.monotonic() - start < 10, "the leaving peer waited for the round timeout"
    assert report is not None and report.group_size == 1
    assert a.sync.start_round(step=3, tokens=300, tokens_since_last=100) is None  # no round after leave_soon
    assert a.sync.finish_round(block=True) is None


def test_dead_peer_does_not_block_and_its_experts_are_adopted(swarm_factory):
    cfg = _sync_cfg(record_ttl=3.0)
    a, b, c = swarm_factory([0], cfg), swarm_factory([1], cfg), swarm_factory([2, 3], cfg)
    _round_all([a, b, c])
    _kill(c)  # c dies without leaving cleanly: no withdrawal, its processes just stop
    start = time.monotonic()
    reports = _round_all([a, b])
    assert time.monotonic() - start < cfg.round_timeout + 10
    assert all(r.group_size == 2 for r in reports)
    time.sleep(cfg.record_ttl + 1)  # c's record expires
    reports = _round_all([a, b])
    adopted = sorted(reports[0].adopted + reports[1].adopted)
    assert adopted == [2, 3]
    coverage = a.swarm.coverage()
    assert all(len(owners) == 1 for owners in coverage.values()), coverage


def test_late_joiner_downloads_the_swarm_state_and_joins_the_next_round(swarm_factory):
    a, b = swarm_factory([0, 1]), swarm_factory([2, 3])
    for i, peer in enumerate((a, b)):
        _local_training(peer, seed=20 + i)
    _round_all([a, b])
    late = swarm_factory([1], join=False)
    assert not all(torch.equal(x, y) for x, y in zip(_shared(late).values(), _shared(a).values()))
    late.sync.join(step=0, tokens=0)
    for name, value in _shared(late).items():
        torch.testing.assert_close(value, _shared(a)[name])
    for expert in range(MODEL.num_experts):
        _assert_experts_equal(_experts(late)[expert], _experts(a if expert < 2 else b)[expert])
    reports = _round_all([a, b, late])
    assert all(r.group_size == 3 for r in reports)
    # expert 1 now has two owners (a and the late joiner): both hold their mean
    _assert_experts_equal(_experts(a)[1], _experts(late)[1])


def test_record_parsing_refuses_hostile_values():
    from sync.swarm import PeerRecord
    assert PeerRecord.from_value("p", {"experts": [1, 0], "round": 2}, 4).experts == [0, 1]
    for bad in (None, [], {"experts": "0"}, {"experts": [9]}, {"experts": [True]}, {"experts": [0], "round": -1},
                {"experts": [0], "step": 2**70}, {"experts": list(range(5))}):
        assert PeerRecord.from_value("p", bad, 4) is None, bad


def test_least_covered_and_adoption_rules_are_deterministic():
    from sync.swarm import least_covered
    coverage = {0: 2, 1: 0, 2: 1, 3: 0}
    picks = {least_covered(coverage, 2, f"peer{i}")[0] for i in range(20)}
    assert picks == {1, 3}  # ties among the uncovered, spread by peer
    assert sorted(least_covered(coverage, 2, "x")) == [1, 3]
    assert least_covered(coverage, 3, "x")[2] == 2


def test_only_experts_seen_owned_are_adopted(swarm_factory):
    a = swarm_factory([0])
    records = a.swarm.peers()
    assert a.swarm.orphans_to_adopt([0], 4, records, adoptable={0}) == []
    assert a.swarm.orphans_to_adopt([0], 4, records, adoptable={0, 2}) == [2]
    assert a.swarm.orphans_to_adopt([0], 1, records, adoptable={0, 2}) == []  # no room left


def test_nesterov_outer_step_on_the_averaged_pseudo_gradient(swarm_factory):
    cfg = _sync_cfg(outer="nesterov", outer_lr=0.7, outer_momentum=0.9)
    peers = [swarm_factory([0, 1], cfg), swarm_factory([2, 3], cfg)]
    anchor = _shared(peers[0])  # the same init on both peers
    for i, peer in enumerate(peers):
        _local_training(peer, seed=40 + i)
    shared_before = [_shared(p) for p in peers]
    reports = _round_all(peers)
    assert all(r.group_size == 2 for r in reports)
    for peer in peers:
        for name, value in _shared(peer).items():
            pseudo_grad = anchor[name] - (shared_before[0][name] + shared_before[1][name]) / 2
            # first round: momentum buffer = g, Nesterov update = g + mu * g
            expected = anchor[name] - 0.7 * (pseudo_grad + 0.9 * pseudo_grad)
            torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("compression", ["fp16", "8bit"])
def test_compressed_round_is_close_to_the_exact_mean(swarm_factory, compression):
    cfg = _sync_cfg(compression=compression)
    peers = [swarm_factory([0, 1], cfg), swarm_factory([2, 3], cfg)]
    for i, peer in enumerate(peers):
        _local_training(peer, seed=60 + i)
    shared_before = [_shared(p) for p in peers]
    experts_before = [_experts(p) for p in peers]
    reports = _round_all(peers)
    assert all(r.group_size == 2 and not r.experts_missing for r in reports), reports
    tol = 1e-2 if compression == "fp16" else 5e-2
    for name, value in _shared(peers[0]).items():
        mean = (shared_before[0][name] + shared_before[1][name]) / 2
        assert (value - mean).norm() <= tol * mean.norm() + 1e-6, name
    for name, value in _experts(peers[0])[2].items():
        owner_value = experts_before[1][2][name]
        assert (value - owner_value).norm() <= tol * owner_value.norm(), name
    assert peers[0].sync.bytes_on_wire()["shared"] > 0 and peers[0].sync.bytes_on_wire()["expert"] > 0


def test_slower_peer_joins_the_swarms_round_early_weighted_by_its_tokens(swarm_factory):
    cfg = _sync_cfg(every=10, target_group_size=3)
    a, b, slow = swarm_factory([0, 1], cfg), swarm_factory([2], cfg), swarm_factory([3], cfg)
    _round_all([a, b, slow])
    assert not slow.sync.round_due(3)  # nobody is ahead yet: a slower peer keeps training
    for i, peer in enumerate((a, b, slow)):
        _local_training(peer, seed=40 + i)
    before = [_shared(p) for p in (a, b, slow)]
    for peer in (a, b):  # the fast peers reached step 10 of the round
        peer.sync.start_round(step=11, tokens=1100, tokens_since_last=1000)
    deadline = time.monotonic() + 10
    while not slow.sync.round_due(3) and time.monotonic() < deadline:  # the slow one is at step 3 of 10
        time.sleep(0.1)
    assert slow.sync.round_due(3), "the slower peer did not notice that the swarm started a round"
    assert not slow.sync.round_due(0)  # never an early round without a step trained
    slow.sync.start_round(step=4, tokens=400, tokens_since_last=300)
    reports = [p.sync.finish_round(block=True) for p in (a, b, slow)]
    assert [r.group_size for r in reports] == [3, 3, 3], reports
    assert len({r.round_id for r in reports}) == 1
    weights = torch.tensor([1000.0, 1000.0, 300.0])
    for peer in (a, b, slow):
        for name, value in _shared(peer).items():
            mean = (torch.stack([s[name] for s in before]) * weights.view(-1, *[1] * value.dim())).sum(0) / weights.sum()
            torch.testing.assert_close(value, mean, rtol=1e-5, atol=1e-6)


def test_a_lone_liar_cannot_trigger_early_rounds(swarm_factory):
    cfg = _sync_cfg(every=10)
    peers = [swarm_factory([e], cfg) for e in range(4)]
    _round_all(peers)
    liar = peers[0]
    liar.swarm.publish(round=liar.sync.round_id + 1000)
    time.sleep(3 * peers[1].sync.progress.poll + 1)
    assert not any(p.sync.round_due(5) for p in peers[1:])  # the median of the others did not move


def test_round_starts_once_every_live_peer_joined_not_after_the_matchmaking_window(swarm_factory):
    cfg = _sync_cfg(matchmaking_time=30.0, round_timeout=60.0)  # target_group_size 0: the live peers
    peers = [swarm_factory([e], cfg) for e in range(3)]
    start = time.monotonic()
    reports = _round_all(peers)
    assert [r.group_size for r in reports] == [3, 3, 3], reports
    assert time.monotonic() - start < cfg.matchmaking_time / 2, "the group waited for the matchmaking window"
