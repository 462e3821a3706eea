"""`python -m peer.run` and `python -m model.export` with bad input: exit != 0, one line naming the cause,
and nothing in the run dir overwritten."""
from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

from model.checkpoint import latest_checkpoint
from peer.config import load_config, parse_override
from peer.train import Trainer
from tests.conftest import REPO, peer_cmd


def _run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(peer_cmd(*args), cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode not in (0, None), proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    errors = [l for l in lines if "error" in l.lower()]
    assert len(errors) == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return errors[0]


def _digest(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("args, cause", [
    (["--set", "model.d_modle=3"], "unknown config key 'model.d_modle'"),
    (["--set", "train.lr=abc"], "bad value for train.lr"),
    (["--set", "nonsense"], "expected KEY=VALUE"),
    (["--max-steps", "ten"], "--max-steps"),
    (["--bogus-flag"], "unrecognized arguments: --bogus-flag"),
    (["--config", "no/such/config.yaml"], "cannot read config file no/such/config.yaml"),
    (["--experts", "0-9"], "experts are numbered 0..3"),
    (["--device", "tpu"], "--device"),
    (["--dataset", "/no/such/corpus.jsonl"], "/no/such/corpus.jsonl"),
    (["--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmXfCrWyR4MUYwEbx5ZsbCCGXEvzJ1fqJW4ut3Jkzgjpyf"],
     "cannot reach any initial peer (/ip4/127.0.0.1/tcp/1/p2p/QmXfCrWyR4MUYwEbx5ZsbCCGXEvzJ1fqJW4ut3Jkzgjpyf)"),
    (["--initial-peers", "garbage"], "garbage"),
    (["--host-maddrs", "/ip4/127.0.0.1/tcp/notaport"], "notaport"),
    (["--metrics-port", "9100"], "--metrics-port"),
])
def test_bad_input_gives_one_line_error(tmp_path, args, cause):
    proc = _run("--config", "configs/tiny.yaml", "--run-dir", str(tmp_path / "run"), *args)
    line = _one_error_line(proc)
    assert cause in line, proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_unknown_key_in_config_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((REPO / "configs/tiny.yaml").read_text() + "\ntrain:\n  lr_typo: 1\n")
    proc = _run("--config", str(bad), "--run-dir", str(tmp_path / "run"))
    assert "unknown config key 'train.lr_typo'" in _one_error_line(proc)


@pytest.mark.parametrize("damage", ["truncate", "garble_header"])
def test_corrupt_checkpoint_is_refused_and_nothing_is_overwritten(tmp_path, damage):
    run_dir = tmp_path / "run"
    cfg = load_config(REPO / "configs/tiny.yaml", [parse_override(f"run_dir={run_dir}"),
                                                   parse_override("train.max_steps=3"),
                                                   parse_override("train.eval_every=0")])
    Trainer(cfg).run()
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    data = ckpt.read_bytes()
    ckpt.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\xff" * 16 + data[16:])
    before = _digest(run_dir)
    proc = _run("--config", "configs/tiny.yaml", "--run-dir", str(run_dir), "--max-steps", "6")
    line = _one_error_line(proc)
    assert "corrupt checkpoint" in line and ckpt.name in line
    assert _digest(run_dir) == before


def test_export_of_a_run_without_checkpoints_fails_in_one_line(tmp_path):
    proc = subprocess.run(["python", "-m", "model.export", str(tmp_path / "nope"), str(tmp_path / "out")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "cannot read the run's config" in _one_error_line(proc)
