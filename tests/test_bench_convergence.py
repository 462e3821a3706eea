"""Smoke version of the convergence benchmark (bench/convergence.py): a centralized arm and a 2-peer SPES swarm
of real `python -m peer.run` processes around a plain `hivemind-dht`, a few steps each. Checks the pipeline
(processes, rounds, curves, table, PNGs), not the numbers of the full benchmark."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_convergence_smoke(tmp_path):
    out = tmp_path / "conv"
    proc = subprocess.run([sys.executable, "-m", "bench.convergence", "--scale", "smoke", "--arms",
                           "centralized,spes", "--peers", "2", "--out", str(out), "--arm-timeout", "240"],
                          cwd=REPO, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {r["arm"]: r for r in json.loads((out / "results.json").read_text())["results"]}
    assert set(results) == {"centralized", "spes"}
    for arm in results.values():
        assert arm["curve"], arm
        assert all(math.isfinite(p["eval_loss"]) for p in arm["curve"])
        # Equal token budgets: the centralized batch is the sum of the swarm's.
        assert arm["curve"][-1]["tokens"] == results["centralized"]["curve"][-1]["tokens"]
    spes = results["spes"]
    assert spes["min_group"] == 2 and spes["rounds"] == 2          # both rounds averaged with both peers
    # sync.wait_for_peers: neither peer started training before the other was in the run.
    for i in range(2):
        assert "2 peers in the run: starting" in (out / "spes" / f"peer{i}.log").read_text()
    assert spes["bytes_per_peer"] and spes["bytes_per_peer"] > 0    # tensors really travelled
    assert results["centralized"]["bytes_per_peer"] is None
    # The loss went down from its start (ln 320 ~ 5.77) on the held-out blocks in both arms.
    assert all(r["curve"][-1]["eval_loss"] < 5.0 for r in results.values())
    table = (out / "table.md").read_text()
    assert "centralized" in table and "SPES" in table and "÷ central" in table
    for name in ("convergence_tokens.png", "convergence_wall.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "loss@100%" in proc.stdout


@pytest.mark.slow
def test_equal_memory_fit_measures_real_peers():
    """bench.fit on the smoke shape with wider experts (so the parameters, not the activations, decide): a peer
    owning a quarter of the experts needs less memory than one owning all of them, and the largest DiLoCo model
    within the quarter-owner's memory has fewer experts."""
    from bench.convergence import SCALES, Arm, arm_config
    from bench.fit import largest_fitting, measure

    scale = dict(SCALES["smoke"], model=dict(SCALES["smoke"]["model"], expert_hidden=1024, num_experts=8))

    def cfg_for(num_experts: int) -> dict:
        return arm_config(Arm("fit", "", 2, ["all", "all"], {"model": {"num_experts": num_experts}}), scale, 2)

    quarter, full = measure(cfg_for(8), "0-1"), measure(cfg_for(8), "all")
    assert quarter["params_total"] == full["params_total"] and quarter["params_trainable"] < full["params_trainable"]
    # 8 experts x 2 layers x 3 x 64 x 1024 fp32: ~12 MiB of weights, x4 with gradients and AdamW state.
    assert full["model_peak"] - quarter["model_peak"] > 20 * 2**20, (quarter, full)
    fitted, seen = largest_fitting(cfg_for, quarter["model_peak"], 2, 8)
    assert 2 <= fitted < 8
    assert all(seen[e]["model_peak"] > quarter["model_peak"] for e in seen if e > fitted)
