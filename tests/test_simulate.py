"""peer.simulate (issue "Many peers"): 16 real peers in this process, with churn: every expert keeps two owners,
every live peer completes the rounds, and all hold the same synchronized tensors; 12 with 3 drawn per round; 16
in roster shards (sync/roster.py)."""
from __future__ import annotations

import statistics

import pytest

from peer.simulate import SimConfig, Simulation, build_parser, format_rows


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sixteen_peers_with_churn_keep_coverage_and_agree():
    # The announcement wait ends as soon as every live peer announced; 15 s leaves room for a loaded machine (the
    # suite's other worker) without slowing an idle one.
    cfg = SimConfig(peers=16, rounds=4, experts=8, churn=0.0625, report_every=2, matchmaking_time=15.0)
    with Simulation(cfg) as sim:
        rows = list(sim.run())
        assert [r["rounds"] for r in rows] == [2, 4]
        assert sum(r["left"] for r in rows) == 3 and sum(r["joined"] for r in rows) == 3  # one per round after 1..3
        for row in rows:
            assert row["live"] == 16 and row["covered"] == 8, row
            assert row["distinct_states"] == 1, row  # every peer at the newest round holds the same tensors
            assert row["group"] > 12, row  # nearly every contribution aggregated by every peer
            assert row["store_s"] is not None and row["store_s"] > 0, row  # every record store timed
        assert rows[-1]["min_owners"] >= 2, rows[-1]  # N = 2E: two owners per expert, also after the churn
        assert all(len(p.rounds) >= 1 for p in sim.peers)
        assert "records/read" in format_rows(rows) and "store s (median)" in format_rows(rows)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_twelve_peers_with_three_drawn_per_round_agree_and_the_others_drop_their_round():
    """sync.contributors 3 of 12 (sync/draw.py): about 3 contribute to each round, every peer aggregates exactly
    those, all hold the same tensors, coverage holds under churn, and a peer not drawn leaves its round's training
    out of its live model but keeps its codec's unsent part: live = synchronized + kept, tensor for tensor."""
    import torch

    cfg = SimConfig(peers=12, rounds=5, experts=8, churn=1 / 12, report_every=1, matchmaking_time=15.0,
                    contributors=3)
    with Simulation(cfg) as sim:
        rows, checked, experts_checked = [], 0, 0
        for row in sim.run():
            rows.append(row)
            assert row["distinct_states"] == 1 and row["covered"] == 8, row
            # A round may draw nobody (0.75^12 = 3 % of rounds): then nothing changes and nothing is fetched.
            assert row["drawn"] <= 9 and row["group"] <= row["drawn"] + 1e-9, row
            for peer in sim.peers:
                sync = peer.sync
                if sync.contributing or not sync._kept or not peer.rounds:
                    continue
                for name, param, synced in zip(sync._shared_names, sync.shared.params, sync.shared.synced):
                    assert torch.allclose(param.detach(), synced + sync._kept[name], atol=1e-6), (peer.name, name)
                for expert in sync.model.owned_experts:  # its experts too (owned then: it kept their unsent part)
                    live, synced = sync.model.expert_tensors(expert), sync._expert_synced[expert]
                    for k in synced:
                        kept = sync._kept.get(f"e{expert}/{k}")
                        if kept is not None:
                            assert torch.allclose(live[k].detach().float(), synced[k] + kept, atol=1e-6), (expert, k)
                            experts_checked += 1
                checked += 1
        assert 1 <= sum(r["drawn"] for r in rows) <= 30  # bounded: 12 x 5 contributions without the draw
        assert min(r["min_owners"] for r in rows[1:]) >= 1 and rows[-1]["min_owners"] >= 2, rows
        assert checked >= 1 and experts_checked >= 1  # some peer not drawn after it had contributed once


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sixteen_peers_in_roster_shards_read_a_sample_and_agree():
    """Shards of 8 (sync/roster.py: --roster-shard 4, raised to 2E with 4 experts) at 16 peers: each peer reads
    its shard and the drawn peers' key, not all 16 records, and still aggregates exactly what the others aggregate;
    the estimates meet near 16 on one or two neighbouring levels, and churn leaves every expert covered."""
    cfg = SimConfig(peers=16, rounds=4, experts=4, churn=1 / 16, report_every=1, matchmaking_time=15.0,
                    contributors=3, roster_shard=4)
    with Simulation(cfg) as sim:
        rows = list(sim.run())
        levels = {p.swarm.roster.level for p in sim.peers}
        estimates = [p.swarm.roster.estimate for p in sim.peers]
        shards = [sum(not r.outside for r in p.swarm.peers().values()) for p in sim.peers]
    assert all(r["distinct_states"] == 1 and r["covered"] == 4 for r in rows), format_rows(rows)
    assert statistics.fmean(shards) < 12, shards  # a shard: not the 16 records
    assert max(levels) >= 1 and max(levels) - min(levels) <= 1, levels
    assert all(8 <= e <= 32 for e in estimates), estimates
    assert 1 <= sum(r["drawn"] for r in rows) <= 30 and rows[-1]["min_owners"] >= 1, format_rows(rows)


@pytest.mark.unit
def test_bad_scenarios_are_refused_in_one_line():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--peer", "3"])  # no abbreviations
    for bad in (SimConfig(peers=1), SimConfig(churn=1.0), SimConfig(rounds=0)):
        with pytest.raises(ValueError):
            bad.check()


def test_the_command_prints_the_table_and_writes_json_and_png(tmp_path, capsys):
    import json

    from peer.simulate import main

    assert main(["--peers", "2", "--rounds", "2", "--experts", "2", "--report-every", "1", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "KB/peer/round" in printed and len(printed.strip().splitlines()) == 3  # header + one row per round
    saved = json.loads((tmp_path / "simulate.json").read_text())
    assert saved["config"]["peers"] == 2 and [r["rounds"] for r in saved["rows"]] == [1, 2]
    assert saved["rows"][-1]["distinct_states"] == 1 and saved["rows"][-1]["group"] == 2
    assert (tmp_path / "simulate.png").stat().st_size > 1000
