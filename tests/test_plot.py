"""`python -m peer.plot` (issue 34 item 7): run dirs' metrics.jsonl and rounds.jsonl into one PNG."""
from __future__ import annotations

import pytest
import json

from peer import plot as peer_plot

pytestmark = pytest.mark.unit  # the fast tier: pure decisions, no DHT (python -m pytest -m unit)


def _run_dir(path, loss0: float):
    path.mkdir()
    with open(path / "metrics.jsonl", "w") as f:
        for step in range(1, 21):
            record = {"step": step, "loss": loss0 / step, "tokens": 512 * step, "tokens_per_s": 1000.0 + step,
                      "rounds": step // 10, "owned_experts": [0], "time": 1.7e9 + step}
            if step % 10 == 0:
                record["eval_loss"] = loss0 / step + 0.1
            f.write(json.dumps(record) + "\n")
        f.write('{"step": 21, "loss"')  # a torn last line (a peer killed mid-write) is skipped
    with open(path / "rounds.jsonl", "w") as f:
        for r in (1, 2):
            f.write(json.dumps({"round": r, "step": 10 * r, "time": 1.7e9 + 10 * r, "seconds": 0.5 * r}) + "\n")
    return path


def test_two_runs_overlaid_in_one_png(tmp_path, capsys):
    a, b = _run_dir(tmp_path / "a", 5.0), _run_dir(tmp_path / "b", 6.0)
    out = tmp_path / "curves.png"
    for x in ("step", "tokens", "time"):
        assert peer_plot.main([str(a), str(b), "--out", str(out), "--x", x]) == 0
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert "wrote" in capsys.readouterr().out


def test_a_dir_without_metrics_is_one_line_and_exit_2(tmp_path, capsys):
    assert peer_plot.main([str(tmp_path), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no metrics.jsonl" in err[0] and not (tmp_path / "x.png").exists()
