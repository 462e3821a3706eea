"""Single-peer training end to end: loss falls, eval runs, resume continues the same run exactly,
export loads in plain transformers with equal logits, Ctrl-C finishes cleanly."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from model.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, load_model_state
from model.export import export_run
from model.model import SpesMoE
from peer.callbacks import Callback
from peer.config import load_config, parse_override
from peer.train import Trainer
from tests.conftest import REPO, peer_cmd


def _cfg(run_dir: Path, *sets: str):
    return load_config(REPO / "configs/tiny.yaml", [parse_override(f"run_dir={run_dir}")] + [parse_override(s) for s in sets])


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_tiny_run_loss_falls_by_20_percent(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(peer_cmd("--config", "configs/tiny.yaml", "--max-steps", "60", "--run-dir", str(run_dir)),
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = _metrics(run_dir)
    first, last = records[0], records[-1]
    assert first["step"] == 1 and last["step"] == 60
    assert last["loss"] <= 0.8 * first["loss"], (first["loss"], last["loss"])
    for key in ("step", "loss", "tokens", "tokens_per_s", "rounds", "owned_experts", "time"):
        assert key in last
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert len(evals) == 3 and evals[-1] < evals[0]
    assert last["tokens"] == 60 * 8 * 64
    assert (run_dir / "config.yaml").exists() and (run_dir / "tokenizer").is_dir()
    assert [s for s, _ in list_checkpoints(run_dir / "checkpoints")] == [30, 60]


def test_resume_continues_the_same_run_exactly(tmp_path):
    sets = ("train.max_steps=12", "train.checkpoint_every=4", "train.eval_every=0", "train.log_every=1")
    straight = Trainer(_cfg(tmp_path / "straight", *sets))
    straight.run()

    interrupted = Trainer(_cfg(tmp_path / "resumed", *sets))
    class StopAt7(Callback):
        def post_step(self, trainer: Trainer) -> None:
            if trainer.step == 7:
                trainer.request_stop()

    interrupted.add_callback(StopAt7())
    interrupted.run()  # stops after step 7 and writes a checkpoint there
    assert latest_checkpoint(tmp_path / "resumed" / "checkpoints").name == "step_00000007.safetensors"
    resumed = Trainer(_cfg(tmp_path / "resumed", *sets))
    assert resumed.step == 7
    resumed.run()

    a, meta_a = load_checkpoint(latest_checkpoint(tmp_path / "straight" / "checkpoints"))
    b, meta_b = load_checkpoint(latest_checkpoint(tmp_path / "resumed" / "checkpoints"))
    assert meta_a["step"] == meta_b["step"] == 12 and meta_a["tokens"] == meta_b["tokens"]
    assert meta_a["data"] == meta_b["data"]
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    steps = [r["step"] for r in _metrics(tmp_path / "resumed")]
    assert steps == list(range(1, 13))


def test_export_loads_in_plain_transformers_with_equal_logits(tmp_path):
    run_dir = tmp_path / "run"
    trainer = Trainer(_cfg(run_dir, "train.max_steps=5", "train.eval_every=0", "sync.experts=0,2"))
    trainer.run()
    out = tmp_path / "hf"
    export_run(run_dir, out)

    hf = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    text = "def spam(eggs):\n    return eggs  # ünïcode"
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert ids.tolist() == [trainer.tokenizer(text).input_ids]
    assert tokenizer.decode(ids[0]) == text

    ours = SpesMoE(trainer.cfg.model, owned_experts=[0, 2], seed=1).eval()
    tensors, _ = load_checkpoint(latest_checkpoint(run_dir / "checkpoints"))
    load_model_state(ours, tensors, "test")
    with torch.no_grad():
        diff = (ours(ids).logits - hf(input_ids=ids).logits).abs().max().item()
    assert diff <= 1e-4


def _wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    metrics = run_dir / "metrics.jsonl"
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        if metrics.exists() and any(json.loads(l)["step"] >= step for l in metrics.read_text().splitlines() if l):
            return
        time.sleep(0.2)
    raise TimeoutError(f"no step {step} in {metrics}")


def _interrupt_at_step(cmd: list[str], cwd: Path, run_dir: Path, step: int) -> tuple[subprocess.Popen, str]:
    """Start a peer, Ctrl-C it once its metrics show `step`, wait for it to exit; returns (process, stderr)."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_step(run_dir, step, proc, timeout=400)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc, err


def test_ctrl_c_finishes_the_step_checkpoints_and_exits_0(tmp_path):
    run_dir = tmp_path / "run"
    proc, err = _interrupt_at_step(peer_cmd("--config", "configs/tiny.yaml", "--max-steps", "100000", "--run-dir",
                                            str(run_dir), "--set", "train.log_every=1",
                                            "--set", "train.checkpoint_every=100000"), REPO, run_dir, step=3)
    assert proc.returncode == 0, err[-2000:]
    last_logged = _metrics(run_dir)[-1]["step"]
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    assert ckpt is not None, "no checkpoint written on Ctrl-C"
    _, meta = load_checkpoint(ckpt)
    assert meta["step"] == last_logged


@pytest.mark.slow
def test_no_arguments_trains_the_default_model_offline(tmp_path):
    """`python -m peer.run` with no arguments at all: default small model, built-in corpus, no network
    (the session fixture sets HF_HUB_OFFLINE / HF_DATASETS_OFFLINE). Stopped with Ctrl-C after 10 steps."""
    run_dir = tmp_path / "runs" / "spes-demo"
    proc, err = _interrupt_at_step(peer_cmd(), tmp_path, run_dir, step=10)
    assert proc.returncode == 0, err[-2000:]
    records = _metrics(run_dir)
    # auto, alone in its run: every expert (a quarter of them, 2, is its share once others join; the rest it only
    # takes care of), so the export has no expert left at its random init
    assert records[0]["owned_experts"] == list(range(8)), records[0]
    assert "alone in the run: training experts [0, 1, 2, 3, 4, 5, 6, 7] of 8" in err, err[-2000:]
    assert records[-1]["loss"] < records[0]["loss"]
    assert latest_checkpoint(run_dir / "checkpoints") is not None


def test_deferred_readback_trains_alike_and_skips_a_nonfinite_step_on_the_device(tmp_path):
    """The GPU loop (loss read back on log steps only, fused AdamW skipping a bad step on the device), run on CPU:
    it logs the same losses as the loop that reads every step, and a NaN in a step it does not read back leaves
    parameters, moments and step counts untouched and training goes on."""
    sets = ("train.max_steps=12", "train.checkpoint_every=0", "train.eval_every=0", "train.log_every=4",
            "sync.experts=0-1")
    eager = Trainer(_cfg(tmp_path / "eager", *sets))
    eager.run()
    deferred = Trainer(_cfg(tmp_path / "deferred", *sets), deferred_readback=True)
    assert deferred.optimizer.defaults["fused"] and [deferred.needs_readback()] == [True]  # step 1 is read
    deferred.run()
    want, got = _metrics(tmp_path / "eager"), _metrics(tmp_path / "deferred")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 4, 8, 12]
    for a, b in zip(want, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3), (a, b)

    nan_run = Trainer(_cfg(tmp_path / "nan", *sets), deferred_readback=True)
    trainable = [p for g in nan_run.optimizer.param_groups for p in g["params"]]
    snapshots: dict[int, list[torch.Tensor]] = {}

    class Snapshot(Callback):
        def post_step(self, trainer: Trainer) -> None:
            snapshots[trainer.step] = [p.detach().clone() for p in trainable]
            if trainer.step == 3:
                assert all(float(nan_run.optimizer.state[p]["step"]) == 2 for p in trainable)

    nan_run.add_callback(Snapshot())
    # The 3rd step (not a log step: read back at 1, 4, 8, 12) sees NaN logits.
    nan_run.model.lm.lm_head.register_forward_hook(
        lambda module, args, out: out * float("nan") if nan_run.step == 2 else None)
    nan_run.run()
    assert nan_run.step == 12
    assert all(torch.equal(a, b) for a, b in zip(snapshots[2], snapshots[3]))  # skipped on the device
    assert not all(torch.equal(a, b) for a, b in zip(snapshots[3], snapshots[4]))  # and training went on
    records = _metrics(tmp_path / "nan")
    assert all(math.isfinite(r["loss"]) for r in records), records
    assert float(nan_run.optimizer.state[trainable[0]]["step"]) == 11
