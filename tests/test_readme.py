"""The README's Quick start runs as written, line after line, in a fresh directory (issue 12, "the first hour"):
every `peer.run` line (shortened to a few steps) trains into its own run dir, the export line finds the default
run, and the exported folder loads with transformers as the README shows."""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

import pytest

from tests.conftest import REPO


def _block(after: str, language: str) -> str:
    text = (REPO / "README.md").read_text()
    section = text.split(after, 1)[1]
    return re.search(rf"```{language}\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_start_lines_run_in_order(tmp_path):
    from peer.corpus import builtin_corpus_path
    from peer.tokenizer import build_tokenizer

    (tmp_path / "configs").symlink_to(REPO / "configs")
    # The files the README's own-data line names: a JSON-lines corpus with a "body" field, a tokenizer folder.
    with open(builtin_corpus_path()) as f:
        docs = [json.loads(next(f))["text"] for _ in range(400)]
    (tmp_path / "my_corpus.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    build_tokenizer("builtin").save_pretrained(str(tmp_path / "my_tokenizer"))

    lines = [l.split("#")[0].strip() for l in _block("## Quick start", "bash").splitlines()]
    lines = [l for l in lines if l]
    assert len(lines) >= 5 and lines[-1].startswith("python -m model.export")
    for line in lines:
        argv = shlex.split(line)
        if argv[0] == "torchrun":  # the console script of the same torch: python -m torch.distributed.run
            argv = ["python", "-m", "torch.distributed.run", *argv[1:]]
        assert argv[:2] == ["python", "-m"], line
        argv[0] = sys.executable
        if "peer.run" in argv:  # as written, then only a few steps (the last --max-steps wins)
            argv += ["--max-steps", "3", "--set", "train.eval_every=0"]
        proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{line}\n{proc.stderr[-3000:]}"
    run_dirs = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert len(run_dirs) == sum("-m peer.run" in l for l in lines), run_dirs  # one dir per line
    loads = subprocess.run([sys.executable, "-c", _block("The exported folder loads", "python")], cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
    assert loads.returncode == 0, loads.stderr[-3000:]


def test_what_the_readme_commands_write_is_git_ignored():
    """Every file or folder the README's commands write into the checkout (runs, exports, eval outputs, keys,
    tickets, revocations) is git-ignored, so following the README leaves `git status` clean."""
    import shutil
    if not (REPO / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    written = ["runs/spes-demo/config.yaml", "exported/model.safetensors", "eval.json", "heldout_task/x.yaml",
               "upcycled/config.json", "sim/simulate.json", "org.key", "peer.key", "bootstrap.key", "peer.ticket", "peer.revoked"]
    proc = subprocess.run(["git", "check-ignore", "--no-index", *written], cwd=REPO, capture_output=True, text=True)
    assert sorted(proc.stdout.split()) == sorted(written), proc.stdout
