"""Defences against hostile peers, piece by piece (docs/DESIGN.md, "Hostile peers"): signed and bounded DHT
records on real hivemind DHTs, the median round, centered clipping of downloaded copies, and the rollback after a
non-finite loss."""
from __future__ import annotations

import math

import hivemind
import pytest
import torch
from hivemind.utils import get_dht_time

from peer.callbacks import Callback
from sync.records import peers_key
from sync.robust import centered_clip, coordinate_median, robust_mean
from sync.swarm import PeerRecord, Swarm, median_round, start_dht
from sync.validate import RejectCounter

RUN = "robust-test"


@pytest.fixture
def two_signed_dhts():
    """Two peers' DHT nodes with the run's record validator, shut down at the end."""
    rejects = RejectCounter()
    first = start_dht(run_id=RUN, num_experts=4, record_ttl=30.0, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                      rejects=rejects)
    second = None
    try:
        second = start_dht(initial_peers=[str(m) for m in first.get_visible_maddrs()], run_id=RUN, num_experts=4,
                           record_ttl=30.0, host_maddrs=["/ip4/127.0.0.1/tcp/0"], rejects=rejects)
        yield first, second, rejects
    finally:
        for dht in (second, first):
            if dht is not None:
                dht.shutdown()


def test_only_the_key_holder_writes_its_record(two_signed_dhts):
    first, second, rejects = two_signed_dhts
    a, b = Swarm(first, RUN, 4), Swarm(second, RUN, 4)
    a.publish(experts=[0, 1], round=3)
    b.publish(experts=[2], round=3)
    assert set(b.peers()) == {a.peer_id, b.peer_id}
    # The tombstone attack: b's node stores under a's subkey. Unsigned by a's key, so no node keeps it.
    forged = {"experts": [], "round": 0, "step": 0, "tokens": 0}
    ok = second.store(peers_key(RUN), subkey=a.peer_id, value=forged, expiration_time=get_dht_time() + 20)
    assert not ok
    assert a.peers()[a.peer_id].experts == [0, 1] and b.peers()[a.peer_id].experts == [0, 1]
    # A plain hivemind DHT without the validator stores it locally; honest nodes still refuse it from there.
    outsider = hivemind.DHT(initial_peers=[str(m) for m in first.get_visible_maddrs()], start=True,
                            host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        outsider.store(peers_key(RUN), subkey=a.peer_id, value=forged, expiration_time=get_dht_time() + 20)
        outsider.store(peers_key(RUN), subkey=str(outsider.peer_id), value={"experts": [3], "round": 2**62,
                       "step": 0, "tokens": 0}, expiration_time=get_dht_time() + 20)
        assert a.peers()[a.peer_id].experts == [0, 1]
        assert str(outsider.peer_id) not in b.peers()  # unsigned record of the outsider itself: ignored
    finally:
        outsider.shutdown()
    assert rejects.counts()["record"] >= 1


def test_far_future_and_malformed_records_are_refused(two_signed_dhts):
    first, second, rejects = two_signed_dhts
    a = Swarm(first, RUN, 4)
    now = get_dht_time()
    # Signed by the rightful key, yet an expiration an hour away is refused by every node.
    assert not first.store(peers_key(RUN), subkey=a.peer_id, value=PeerRecord(a.peer_id, [1]).to_value(),
                           expiration_time=now + 3600)
    for bad in ({"experts": [9], "round": 0, "step": 0, "tokens": 0},          # expert out of range
                {"experts": [1], "round": 2**62, "step": 0, "tokens": 0},      # round near overflow
                {"experts": [1], "round": 1, "step": 0, "tokens": 0, "x": 1},  # unknown field
                {"experts": [1, 1], "round": 1, "step": 0, "tokens": 0},       # duplicate expert
                {"experts": [1], "round": 1, "step": 0, "tokens": 0, "finished": 1}):  # finished: only True
        assert not first.store(peers_key(RUN), subkey=a.peer_id, value=bad, expiration_time=now + 20), bad
    assert a.peers() == {}
    a.publish(experts=[1], round=1)
    seen = Swarm(second, RUN, 4).peers()
    assert list(seen) == [a.peer_id] and seen[a.peer_id].round == 1


@pytest.mark.unit
def test_median_round_ignores_one_liar():
    records = [PeerRecord(f"p{i}", [0], round=r) for i, r in enumerate([7, 7, 8, 2**31 - 1])]
    assert median_round(records) == 7
    assert median_round(records[:1] + records[3:]) == 7  # two records: the lower one, never the liar's
    assert median_round([]) is None


@pytest.mark.unit
def test_coordinate_median_small_groups_pick_the_sorted_middle_exactly():
    """Groups of up to 4 take the median by min/max (no sort): the same values, bit for bit, as the sorted middle,
    also next to a peer's +-1e30 entries (no sums that could cancel) and with ties."""
    torch.manual_seed(0)
    for n in range(1, 7):
        for _ in range(20):
            x = torch.randn(n, 500)
            x[torch.rand(n, 500) < 0.1] = 1e30
            x[torch.rand(n, 500) < 0.1] = -1e30
            x[:, :20] = 3.0
            sorted_x = torch.sort(x, dim=0).values
            assert torch.equal(coordinate_median(x), 0.5 * (sorted_x[(n - 1) // 2] + sorted_x[n // 2]))


@pytest.mark.unit
def test_centered_clip_is_the_plain_mean_without_outliers():
    torch.manual_seed(0)
    base = torch.randn(1000)
    x = base + 0.1 * torch.randn(5, 1000)
    w = torch.tensor([1.0, 2.0, 1.0, 3.0, 1.0])
    mean = (w[:, None] * x).sum(0) / w.sum()
    assert torch.equal(centered_clip(x, w), mean)


@pytest.mark.unit
def test_centered_clip_bounds_one_attacker():
    torch.manual_seed(0)
    honest = torch.randn(1000) + 0.05 * torch.randn(3, 1000)
    honest_mean = honest.mean(0)
    spread = float(torch.linalg.vector_norm(honest - honest_mean, dim=1).max())
    for attack in (honest[0] * 1e6, -9 * honest[0], torch.zeros(1000)):
        x = torch.cat([honest, attack[None]])
        out = centered_clip(x, torch.ones(4))
        # The attacker moves the result by at most weight share x tau (= 2.5 x median distance).
        assert float(torch.linalg.vector_norm(out - honest_mean)) < 2 * spread


@pytest.mark.unit
def test_robust_mean_of_expert_copies():
    honest = [{"w": torch.ones(4, 4) + 0.01 * i, "b": torch.ones(4)} for i in range(3)]
    forged = {"w": -9 * torch.ones(4, 4), "b": -9 * torch.ones(4)}
    out = robust_mean(honest + [forged])
    assert float(out["w"].min()) > 0.5 and out["b"].shape == (4,)
    plain = robust_mean(honest)
    assert torch.allclose(plain["w"], torch.stack([h["w"] for h in honest]).mean(0))


def test_nonfinite_loss_right_after_a_round_rolls_back_and_training_goes_on(tmp_path):
    """A real lone peer (DHT, rounds): right after round 1 is applied, a shared weight turns NaN (as if
    something had slipped through every check). The next step's loss is NaN: the peer restores the values from
    before that round, counts it, and finishes its run with a finite loss instead of dying."""
    from peer.config import load_config, parse_override
    from peer.node import PeerNode
    from tests.conftest import REPO

    cfg = load_config(REPO / "configs/tiny.yaml", [parse_override(s) for s in (
        f"run_dir={tmp_path / 'run'}", "train.max_steps=12", "sync.every=4", "sync.overlap=false",
        "train.checkpoint_every=0", "train.eval_every=0")])
    poisoned = []

    def poison(trainer) -> None:
        if trainer.step == 4 and not poisoned:  # the hook runs after the round of step 4 was applied
            name, param = trainer.model.shared_parameters()[0]
            with torch.no_grad():
                param.fill_(float("nan"))
            poisoned.append(name)

    with PeerNode(cfg, host_maddrs=["/ip4/127.0.0.1/tcp/0"]) as node:
        class Poison(Callback):
            def post_step(self, trainer) -> None:
                poison(trainer)

        node.trainer.add_callback(Poison())
        node.run()
        assert poisoned and node.sync.rollbacks == 1
        assert node.trainer.step == 12 and math.isfinite(node.trainer.last_loss)
        assert all(bool(torch.isfinite(p).all()) for _, p in node.trainer.model.shared_parameters())
