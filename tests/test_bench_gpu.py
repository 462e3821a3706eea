"""bench.gpu's code runs on CPU (the table a lent GPU machine prints, here at the tiny shape), and its FLOP count
matches a hand count of the paper-1b shape."""
from __future__ import annotations

import subprocess
import sys

import torch

from bench.common import config_path
from bench.gpu import flops_per_token, peak_tflops
from peer.config import load_config
from tests.conftest import REPO


def test_flops_per_token_of_the_paper_shape():
    cfg = load_config(config_path("paper-1b"), []).model
    d, layers, hidden, vocab, seq = 768, 12, 2048, 151665, 2048
    # per layer: q, k, v, o (d x d each, 12 heads = 12 kv heads), 2 of 16 experts (3 d x hidden), router d x 16
    active = layers * (4 * d * d + 2 * 3 * d * hidden + d * 16) + d * vocab
    assert flops_per_token(cfg) == 6 * active + 12 * layers * d * seq


def test_cpu_smoke_prints_every_arm():
    proc = subprocess.run([sys.executable, "-m", "bench.gpu", "--device", "cpu", "--shape", "tiny", "--steps", "1",
                           "--warmup", "1"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| quarter") or line.startswith("| all")]
    assert len(rows) == 4, proc.stdout
    for row in rows:
        tokens_per_s = float(row.split("|")[3].replace(",", ""))
        assert tokens_per_s > 0
    assert peak_tflops(torch.device("cpu"), 0) is None and peak_tflops(torch.device("cpu"), 500.0) == 500.0
