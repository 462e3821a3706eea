"""bench.lottery: the draw, the outer rules it compares, and a smoke run printing every arm."""
from __future__ import annotations

import json

import pytest
import torch

from bench.lottery import drawn, gossip, main, outer


@pytest.mark.unit
def test_the_draw_picks_c_distinct_peers_the_same_on_every_call_and_others_next_round():
    first = drawn(7, 16, 4)
    assert first == drawn(7, 16, 4) and len(set(first)) == 4 and all(0 <= p < 16 for p in first)
    assert any(drawn(r, 16, 4) != first for r in range(8, 12))
    assert drawn(3, 5, 5) == [0, 1, 2, 3, 4]


@pytest.mark.unit
def test_scaled_divides_by_the_rounds_the_changes_hold_and_an_expert_without_a_drawn_owner_stays():
    synced = {"s/0": torch.zeros(2), "e0/w": torch.ones(2), "e1/w": torch.ones(2)}
    changes = {0: {"s/0": torch.full((2,), 3.0), "e0/w": torch.full((2,), 3.0)},
               1: {"s/0": torch.full((2,), 1.0), "e0/w": torch.full((2,), 1.0)}}
    owners = {0: [0], 1: [0], 2: [1]}
    one_round = outer(synced, changes, owners, "scaled", {0: 1, 1: 1, 2: 1})
    mean = outer(synced, changes, owners, "mean", {0: 3, 1: 1, 2: 1})
    assert torch.equal(one_round["s/0"], mean["s/0"]) and torch.equal(mean["s/0"], torch.full((2,), 2.0))
    scaled = outer(synced, changes, owners, "scaled", {0: 3, 1: 1, 2: 1})
    assert torch.equal(scaled["s/0"], torch.full((2,), 1.0)) and torch.equal(scaled["e0/w"], torch.full((2,), 2.0))
    assert torch.equal(scaled["e1/w"], synced["e1/w"])
    perround = outer(synced, changes, owners, "perround", {0: 3, 1: 1, 2: 1})
    assert torch.equal(perround["s/0"], torch.full((2,), 1.0))  # (3 / 3 + 1 / 1) / 2


@pytest.mark.unit
def test_gossip_with_every_other_peer_is_the_mean_and_an_expert_no_one_in_the_group_owns_stays():
    lives = [{"s/0": torch.full((2,), float(i)), "e0/w": torch.full((2,), float(i)), "e1/w": torch.full((2,), 9.0)}
             for i in range(4)]
    owners = {0: [0], 1: [0], 2: [0], 3: [1]}
    everyone = gossip(lives, owners, 3, round_id=5)
    assert all(torch.equal(v["s/0"], torch.full((2,), 1.5)) for v in everyone)
    assert all(torch.equal(v["e0/w"], torch.full((2,), 1.0)) for v in everyone)  # owners 0, 1, 2
    alone = gossip(lives, owners, 1, round_id=5)
    assert torch.equal(alone[0]["e1/w"], lives[0]["e1/w"]) or torch.equal(alone[0]["e1/w"], torch.full((2,), 9.0))
    assert gossip(lives, owners, 1, round_id=5)[2]["s/0"].tolist() == alone[2]["s/0"].tolist()  # deterministic


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_smoke_prints_every_arm_and_writes_the_losses(tmp_path, capsys):
    assert main(["--peers", "3", "--contributors", "1", "--rounds", "2", "--every", "2", "--eval-every", "1",
                 "--out", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    for arm in ("all", "mean", "scaled", "perround", "discard", "gossip"):
        assert f"| {arm} " in table
    results = json.loads((tmp_path / "results.json").read_text())["arms"]
    assert results["all"]["fetched_per_round"] == pytest.approx(2.0)
    assert results["mean"]["fetched_per_round"] == pytest.approx(2 / 3)
    assert results["gossip"]["fetched_per_round"] == 1
    assert all(len(r["losses"]) == 2 for r in results.values())
    assert main(["--peers", "2", "--contributors", "1", "--rounds", "1", "--every", "1", "--codec", "sparse",
                 "--arms", "all,discard", "--out", str(tmp_path / "sparse")]) == 0
    assert "codec sparse" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--codec", "sparse", "--arms", "gossip"])
