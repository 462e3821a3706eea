"""`python -m peer.run` and `python -m model.export` with bad input: exit != 0, one line naming the cause,
and nothing in the run dir overwritten."""
from __future__ import annotations

import hashlib
import socket
import os
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
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != ".lock"}  # the lock is no user data


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
    # Offline checks come before the DHT: with an unreachable initial peer too, the error is the dataset's, and
    # no DHT was started (its "initial peer:" line would come first).
    (["--dataset", "/no/such/corpus.jsonl", "--initial-peers",
      "/ip4/127.0.0.1/tcp/1/p2p/QmXfCrWyR4MUYwEbx5ZsbCCGXEvzJ1fqJW4ut3Jkzgjpyf"], "/no/such/corpus.jsonl"),
    # Tried again for network.join_timeout_s (20 s by default; 2 s here) before the error.
    (["--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmXfCrWyR4MUYwEbx5ZsbCCGXEvzJ1fqJW4ut3Jkzgjpyf",
      "--set", "network.join_timeout_s=2"],
     "cannot reach any initial peer (/ip4/127.0.0.1/tcp/1/p2p/QmXfCrWyR4MUYwEbx5ZsbCCGXEvzJ1fqJW4ut3Jkzgjpyf) "
     "(tried for 2 s)"),
    (["--set", "network.join_timeout_s=-1"], "network.join_timeout_s must be in [0, 3600]"),
    (["--initial-peers", "garbage"], "garbage"),
    (["--initial-peers", "/ip4/127.0.0.1/tcp/4000"], "/ip4/127.0.0.1/tcp/4000 names no peer: the address must end "
                                                     "with /p2p/<peer ID>"),
    (["--host-maddrs", "/ip4/127.0.0.1/tcp/notaport"], "notaport"),
    (["--announce-maddrs", "/ip4/1.2.3/tcp/5"], "bad multiaddr '/ip4/1.2.3/tcp/5' (--announce-maddrs)"),
    (["--metrics-port", "70000"], "metrics.port must be in [0, 65535]"),
    (["--max-step", "3"], "unrecognized arguments: --max-step 3"),  # no abbreviations: a typo is an error
])
def test_bad_input_gives_one_line_error(tmp_path, args, cause):
    proc = _run("--config", "configs/tiny.yaml", "--run-dir", str(tmp_path / "run"), *args)
    line = _one_error_line(proc)
    assert cause in line, proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
    # Nor a run dir holding only the lock file: a failed start that created it takes it away again.
    run = tmp_path / "run"
    assert not run.exists() or any(p.name != ".lock" for p in run.iterdir()), sorted(run.iterdir())
    if "--dataset" in args and "--initial-peers" in args:
        assert "initial peer" not in proc.stderr.replace(line, ""), proc.stderr


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


def _listener(host: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket()
    sock.bind((host, 0))
    sock.listen()
    return sock


def test_metrics_port_in_use_fails_before_any_work(tmp_path):
    with _listener("0.0.0.0") as busy:
        port = busy.getsockname()[1]
        proc = _run("--config", "configs/tiny.yaml", "--run-dir", str(tmp_path / "run"), "--metrics-port", str(port))
    assert f"metrics port {port} is in use" in _one_error_line(proc)
    assert not (tmp_path / "run").exists()  # checked before the run dir, the model or the DHT


def test_metrics_listen_where_the_peer_listens_unless_told():
    """A peer on loopback (the default for a run started alone) serves its metrics on loopback too; one that
    listens on every interface serves them there; --metrics-host / metrics.host overrides both."""
    from peer.config import load_config, parse_override
    from peer.run import metrics_host, parse_maddrs
    cfg = load_config(None, [])
    assert metrics_host(cfg, parse_maddrs("--host-maddrs", ["/ip4/127.0.0.1/tcp/0"])) == "127.0.0.1"
    assert metrics_host(cfg, parse_maddrs("--host-maddrs", ["/ip4/0.0.0.0/tcp/31337"])) == "0.0.0.0"
    assert metrics_host(cfg, parse_maddrs("--host-maddrs", ["/ip6/::1/tcp/0"])) == "::1"
    told = load_config(None, [parse_override("metrics.host=0.0.0.0")])
    assert metrics_host(told, parse_maddrs("--host-maddrs", ["/ip4/127.0.0.1/tcp/0"])) == "0.0.0.0"


def test_host_port_in_use_by_a_plain_listener(tmp_path):
    with _listener() as busy:
        port = busy.getsockname()[1]
        proc = _run("--config", "configs/tiny.yaml", "--run-dir", str(tmp_path / "run"),
                    "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}")
    assert f"port {port} is in use" in _one_error_line(proc)
    assert not (tmp_path / "run").exists()


def test_host_port_in_use_by_another_peer(tmp_path):
    """p2pd listens with SO_REUSEPORT: without the check a second peer would silently share the port."""
    import hivemind
    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    try:
        port = int(str(dht.get_visible_maddrs()[0]).split("/")[4])
        proc = _run("--config", "configs/tiny.yaml", "--run-dir", str(tmp_path / "run"),
                    "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}")
    finally:
        dht.shutdown()
    assert f"port {port} is in use" in _one_error_line(proc)


def test_daemon_port_error_is_translated():
    from peer.run import explain_swarm_error
    raw = ("Daemon failed to start: 2026/11/30 00:12:05 failed to listen on any addresses: "
           "[listen tcp4 127.0.0.1:41965: bind: address already in use]")
    assert explain_swarm_error(raw) == "port 41965 is in use"
    assert explain_swarm_error("something else") == "something else"


@pytest.mark.parametrize("args, cause", [
    (["--set", "data.tokenizer=someone/tokenizer"], "cannot load tokenizer 'someone/tokenizer': not in the local cache"),
    (["--dataset", "someone/corpus"], "cannot read dataset someone/corpus: it is no local path"),
])
def test_unreachable_hub_is_one_line_without_retries(tmp_path, args, cause):
    """A hub name while the hub cannot be reached (no network, a firewall): one error line at once, not ~45 s of
    doubled retry warnings. The hub here is a local port nothing listens on; offline mode is off."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"
    proc = subprocess.run(peer_cmd("--config", "configs/tiny.yaml", "--run-dir", str(tmp_path / "run"),
                                   "--sync-every", "0", *args), cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=180)
    line = _one_error_line(proc)
    assert cause in line and "127.0.0.1 cannot be reached" in line, proc.stderr
    assert "Retry" not in proc.stderr and "WARN" not in proc.stderr, proc.stderr


def test_help_shows_every_default():
    """`--help` names the default of every option that has one (the built-in config's value, or what happens
    without it), so nobody has to read the code to learn what a run does by default."""
    import re

    from peer.run import build_parser

    text = " ".join(build_parser().format_help().split())
    for flag in ("--config", "--initial-peers", "--run-id", "--experts", "--max-steps", "--sync-every", "--run-dir",
                 "--metrics-port", "--host-maddrs", "--announce-maddrs", "--identity-path", "--device", "--dataset",
                 "--tokenizer"):
        entry = re.search(rf"\s{flag} [^-].*?(?= --[a-z]|$)", text)
        assert entry and "default" in entry.group(0), (flag, entry and entry.group(0))
