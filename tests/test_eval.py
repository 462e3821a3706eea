"""`python -m peer.eval`: the same held-out loss for a run dir and for its export, one-line errors for bad input,
`build_eval_blocks` equal to build_data's eval set, and the lm-evaluation-harness task it writes."""
from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model.checkpoint import latest_checkpoint
from model.export import EVAL_INFO_FILE, export_run
from peer import eval as peer_eval
from peer.config import DataConfig, load_config, parse_override
from peer.data import build_data, build_eval_blocks, heldout_documents
from peer.tokenizer import build_tokenizer
from peer.train import Trainer
from tests.conftest import REPO

BLOCKS = "16"  # fewer than the default 64: the point is agreement, not a precise number


WORDS = ("the peer trains experts it owns and the shared layers while others keep theirs frozen until a round "
         "averages what every peer has learned since the last one").split()


def _write_corpus(path: Path, docs: int = 600) -> Path:
    """A small local JSON-lines corpus: builds in milliseconds, unlike the built-in one."""
    with open(path, "w") as f:
        for i in range(docs):
            words = [WORDS[(i * 7 + j * (i % 5 + 1)) % len(WORDS)] for j in range(30 + i % 20)]
            f.write(json.dumps({"text": f"Note {i}. " + " ".join(words) + "."}) + "\n")
    return path


@pytest.fixture(scope="module")
def run_and_export(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny solo run (no swarm) on a small local corpus, 4 steps, experts 1 and 3 left frozen in bf16, and its
    export."""
    root = tmp_path_factory.mktemp("eval")
    run_dir, out = root / "run", root / "export"
    corpus = _write_corpus(root / "corpus.jsonl")
    sets = [f"run_dir={run_dir}", f"data.dataset={corpus}", "data.eval_fraction=0.05", "train.max_steps=4",
            "train.eval_every=0", "sync.every=0", "sync.experts=0,2"]
    Trainer(load_config(REPO / "configs/tiny.yaml", [parse_override(s) for s in sets])).run()
    export_run(run_dir, out)
    return run_dir, out


def _eval(capfd, caplog, *args: str) -> tuple[int, str, list[str]]:
    """peer.eval in this process: (exit code, stdout, error lines); error lines are logged ERROR records (caplog:
    the log handler may hold pytest's stderr from an earlier test) plus stderr lines saying "error"."""
    caplog.clear()
    try:
        code = peer_eval.main(list(args))
    except SystemExit as e:  # argparse's exit for a bad flag or path
        code = e.code
    out, err = capfd.readouterr()
    assert "Traceback" not in err, err
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    return code, out, errors + [line for line in err.splitlines() if "error" in line.lower()]


def _one_error_line(errors: list[str]) -> str:
    assert len(errors) == 1, errors
    return errors[0]


def test_run_dir_and_export_give_the_same_loss(run_and_export, tmp_path, capfd, caplog):
    run_dir, export = run_and_export
    info = json.loads((export / EVAL_INFO_FILE).read_text())
    assert info["seq_len"] == 64 and info["step"] == 4
    # The weights are as readable as the files beside them (safetensors writes 0600 on its own).
    assert {p.stat().st_mode & 0o777 for p in export.iterdir()} == {(export / EVAL_INFO_FILE).stat().st_mode & 0o777}
    assert info["data"] == {"dataset": str(run_dir.parent / "corpus.jsonl"), "text_field": "text", "split": "train",
                            "eval_fraction": 0.05, "streaming": None}
    results = {}
    for name, path in (("run", run_dir), ("export", export)):
        code, out, errors = _eval(capfd, caplog, str(path), "--max-blocks", BLOCKS,
                                  "--json", str(tmp_path / f"{name}.json"))
        assert code == 0, errors
        assert out.startswith("held-out loss "), out
        assert f"({BLOCKS} blocks x 64 tokens, dataset {info['data']['dataset']}, step 4)" in out
        results[name] = json.loads((tmp_path / f"{name}.json").read_text())
    run, exp = results["run"], results["export"]
    assert (run["source"], exp["source"]) == ("run dir", "export")
    assert math.isfinite(run["loss"]) and run["loss"] < math.log(320)  # below a uniform guess over the vocab
    assert abs(run["loss"] - exp["loss"]) <= 1e-5 * run["loss"], (run["loss"], exp["loss"])
    assert run["perplexity"] == pytest.approx(math.exp(run["loss"]))
    assert run["blocks"] == exp["blocks"] == int(BLOCKS) and run["tokens"] == int(BLOCKS) * 64


def test_seq_len_flag_overrides_the_recorded_block_length(run_and_export, tmp_path, capfd, caplog):
    _, export = run_and_export
    code, out, errors = _eval(capfd, caplog, str(export), "--max-blocks", "4", "--seq-len", "32")
    assert code == 0, errors
    assert "(4 blocks x 32 tokens" in out


def test_missing_dir_is_one_line_in_a_real_process(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "peer.eval", str(tmp_path / "nope")], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == f"python -m peer.eval: error: {tmp_path / 'nope'} does not exist"


def test_bad_input_is_one_line_and_exit_2(run_and_export, tmp_path, capfd, caplog):
    run_dir, export = run_and_export
    # A run dir without checkpoints (config.yaml and tokenizer only).
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.yaml").write_text((run_dir / "config.yaml").read_text())
    code, _, errors = _eval(capfd, caplog, str(empty))
    assert code == 2 and "no checkpoint found" in _one_error_line(errors)

    # Its only checkpoint damaged: named, not renamed (eval never changes a run dir).
    (empty / "checkpoints").mkdir()
    bad = empty / "checkpoints" / latest_checkpoint(run_dir / "checkpoints").name
    bad.write_bytes(b"\xff" * 64)
    code, _, errors = _eval(capfd, caplog, str(empty))
    assert code == 2 and f"corrupt checkpoint {bad}" in _one_error_line(errors)
    assert bad.exists()

    # Neither a run dir nor an export.
    code, _, errors = _eval(capfd, caplog, str(tmp_path))
    assert code == 2 and "neither a run dir" in _one_error_line(errors)

    # An export without spes_eval.json needs --dataset.
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in export.iterdir():
        if f.name != EVAL_INFO_FILE:
            (bare / f.name).write_bytes(f.read_bytes())
    code, _, errors = _eval(capfd, caplog, str(bare))
    assert code == 2 and "pass --dataset" in _one_error_line(errors)
    (bare / EVAL_INFO_FILE).write_text("{not json")
    code, _, errors = _eval(capfd, caplog, str(bare))
    assert code == 2 and "spes_eval.json: corrupt" in _one_error_line(errors)

    # A bad flag: argparse's one line, exit 2.
    code, _, errors = _eval(capfd, caplog, str(export), "--max-blocks", "0")
    assert code == 2 and "--max-blocks" in _one_error_line(errors)


def test_export_records_a_relative_dataset_path_absolute(tmp_path, monkeypatch):
    """A run started with a relative --dataset: the export stores it absolute, so peer.eval finds it anywhere."""
    from model.export import eval_info
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _write_corpus(tmp_path / "corpus.jsonl", docs=1)
    (run_dir / "config.yaml").write_text("data:\n  dataset: corpus.jsonl\n  text_field: body\n")
    monkeypatch.chdir(tmp_path)
    info = eval_info(run_dir, seq_len=32, step=7)
    assert info == {"format": "spes-eval-v1", "step": 7, "seq_len": 32,
                    "data": {"dataset": str(tmp_path / "corpus.jsonl"), "text_field": "body"}}
    (run_dir / "config.yaml").write_text("data:\n  dataset: builtin\n")
    assert eval_info(run_dir, seq_len=32, step=7)["data"] == {"dataset": "builtin"}


@pytest.mark.parametrize("streaming", [False, True])
def test_build_eval_blocks_is_build_datas_eval_set_and_heldout_documents_make_it(tmp_path, streaming):
    """The eval-only path gives the very tensor build_data gives, and the documents written for lm-eval are the
    held-out documents those blocks are packed from, in order."""
    path = tmp_path / "docs.jsonl"
    with open(path, "w") as f:
        for i in range(400):
            f.write(json.dumps({"body": f"document {i}: " + "lorem ipsum " * (i % 7 + 1)}) + "\n")
    cfg = DataConfig(dataset=str(path), text_field="body", eval_fraction=0.2, streaming=streaming)
    tok = build_tokenizer("builtin")
    full = build_data(cfg, tok, seq_len=16, seed=0, max_eval_blocks=8).eval_blocks
    only = build_eval_blocks(cfg, tok, seq_len=16, max_eval_blocks=8)
    assert torch.equal(full, only) and only.shape == (8, 17)
    ids: list[int] = []
    for text in heldout_documents(cfg):
        ids += tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        if len(ids) >= only.numel():
            break
    assert ids[:only.numel()] == only.flatten().tolist()


@pytest.mark.slow
def test_lm_eval_task_scores_the_export_offline(run_and_export, tmp_path, capfd, caplog):
    pytest.importorskip("lm_eval")
    _, export = run_and_export
    task_dir = tmp_path / "task"
    code, _, errors = _eval(capfd, caplog, str(export), "--max-blocks", "4", "--write-lm-eval-task", str(task_dir))
    assert code == 0, errors
    docs = (task_dir / f"{peer_eval.TASK_NAME}.jsonl").read_text().splitlines()
    assert docs and all(json.loads(line)["text"] for line in docs)
    out = tmp_path / "lm_eval_out"
    # The conftest environment is offline (HF_*_OFFLINE=1): this passes only if lm_eval needs no network.
    proc = subprocess.run(["lm_eval", "--model", "hf", "--model_args", f"pretrained={export},max_length=64",
                           "--tasks", peer_eval.TASK_NAME, "--include_path", str(task_dir), "--limit", "2",
                           "--device", "cpu", "--batch_size", "4", "--output_path", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(p.read_text()) for p in out.rglob("results_*.json")]
    assert len(results) == 1, list(out.rglob("*"))
    metrics = results[0]["results"][peer_eval.TASK_NAME]
    assert math.isfinite(metrics["word_perplexity,none"]) and metrics["word_perplexity,none"] > 1
    assert 0 < metrics["bits_per_byte,none"] < 9  # a byte-level model: at most ~8 bits per byte plus noise


def test_peer_eval_scores_the_blocks_the_training_loop_scored(tmp_path, capfd, caplog):
    """One eval set (peer/config.py eval_block_count): `peer.eval` of the final checkpoint, with no --max-blocks,
    gives the eval_loss the training loop logged at that step (it scored 64 blocks against the loop's 32 before,
    and the numbers differed)."""
    run_dir = tmp_path / "run"
    corpus = _write_corpus(tmp_path / "corpus.jsonl")
    sets = [f"run_dir={run_dir}", f"data.dataset={corpus}", "data.eval_fraction=0.3", "train.max_steps=2",
            "train.eval_every=2", "train.batch_size=4", "train.eval_batches=3", "sync.every=0"]
    Trainer(load_config(REPO / "configs/tiny.yaml", [parse_override(s) for s in sets])).run()
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    loop = [r["eval_loss"] for r in logged if "eval_loss" in r and r.get("step") == 2]
    code, out, errors = _eval(capfd, caplog, str(run_dir), "--json", str(tmp_path / "eval.json"))
    assert code == 0 and not errors, errors
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["blocks"] == 12 and loop and abs(result["loss"] - loop[-1]) < 1e-4, (result, loop)
