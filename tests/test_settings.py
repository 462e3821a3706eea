"""A run's shared settings (sync/settings.py): the fingerprint and its checks without a DHT, the content-addressed
DHT entry's validation, and a `peer.run` process started with another model shape than the run's, which exits 2
naming the first differing setting and the run's value (issue 34, item 1)."""
from __future__ import annotations

import re
import signal
import subprocess
import time

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

from peer.config import load_config, parse_override, run_settings
from sync.records import RunRecordValidator
from sync.settings import (MAX_ENTRIES, first_difference, fingerprint, is_fingerprint, is_settings,
                           run_fingerprint, settings_key)
from tests.conftest import peer_cmd


@pytest.mark.unit
def test_fingerprint_is_canonical_and_names_what_differs():
    tiny = run_settings(load_config("configs/tiny.yaml", []))
    wider = run_settings(load_config("configs/tiny.yaml", [parse_override("model.d_model=128")]))
    assert fingerprint(tiny) == fingerprint(dict(reversed(list(tiny.items()))))  # order does not matter
    assert is_fingerprint(fingerprint(tiny)) and fingerprint(tiny) != fingerprint(wider)
    assert first_difference(tiny, wider) == ("model.d_model", 64, 128)
    assert first_difference(tiny, dict(tiny)) is None
    assert first_difference({"a": 1.0}, {"a": 1}) == ("a", 1.0, 1)  # a fingerprint tells 1 from 1.0: so does this
    # What a machine chooses for itself (its expert kernel, its data) is not a run setting.
    local = run_settings(load_config("configs/tiny.yaml", [parse_override("model.expert_kernel=loop"),
                                                            parse_override("data.dataset=elsewhere")]))
    assert fingerprint(local) == fingerprint(tiny)


@pytest.mark.unit
def test_the_run_fingerprint_is_the_most_published_and_ties_pick_the_same():
    assert run_fingerprint(["b" * 16, "a" * 16, "b" * 16, ""]) == "b" * 16
    assert run_fingerprint(["b" * 16, "a" * 16]) == "a" * 16
    assert run_fingerprint(["", ""]) is None


@pytest.mark.unit
def test_settings_values_are_bounded():
    assert is_settings({"model.d_model": 64, "sync.outer": "avg", "x": None, "y": 0.5, "z": True})
    for bad in ([], {1: 2}, {"a": float("nan")}, {"a": [1]}, {"a": "x" * 300}, {"": 1},
                {f"k{i}": i for i in range(MAX_ENTRIES + 1)}):
        assert not is_settings(bad), bad


@pytest.mark.unit
def test_only_content_addressed_settings_entries_are_stored():
    validator = RunRecordValidator("run", num_experts=4)
    key = DHTID.generate(source=settings_key("run")).to_bytes()
    settings = {"model.d_model": 64}

    def record(subkey: str, value, lifetime: float = 3600.0) -> DHTRecord:
        return DHTRecord(key=key, subkey=MSGPackSerializer.dumps(subkey), value=MSGPackSerializer.dumps(value),
                         expiration_time=get_dht_time() + lifetime)
    assert validator.validate(record(fingerprint(settings), settings))
    assert not validator.validate(record(fingerprint(settings), {"model.d_model": 128}))  # false settings
    assert not validator.validate(record("not-a-fingerprint", settings))
    assert not validator.validate(record(fingerprint(settings), settings, lifetime=10 * 86400))  # far future


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_peer_with_another_model_shape_exits_2_naming_the_setting(tmp_path, processes):
    first = processes.start(peer_cmd("--config", "configs/tiny.yaml", "--run-dir", str(tmp_path / "a"),
                                     "--run-id", "shape", "--max-steps", "100000", "--sync-every", "10",
                                     "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--set", "train.eval_every=0"),
                            log=tmp_path / "a.log")
    deadline, maddr = time.time() + 120, None
    while maddr is None and time.time() < deadline:
        match = re.search(r"initial peer: (\S+)", (tmp_path / "a.log").read_text())
        maddr = match.group(1) if match else None
        assert first.poll() is None, (tmp_path / "a.log").read_text()[-2000:]
        time.sleep(0.5)
    while "round 1 applied" not in (tmp_path / "a.log").read_text() and time.time() < deadline:
        time.sleep(0.5)  # its record (with its fingerprint) and its settings are stored by now
    try:
        other = subprocess.run(peer_cmd("--config", "configs/tiny.yaml", "--run-dir", str(tmp_path / "b"),
                                        "--run-id", "shape", "--max-steps", "20", "--initial-peers", maddr,
                                        "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--set", "model.d_model=128"),
                               capture_output=True, text=True, timeout=120)
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=60)
    errors = [line for line in other.stderr.splitlines() if "error" in line.lower()]
    assert other.returncode == 2, other.stderr[-2000:]
    assert any("uses model.d_model = 64, this peer 128" in line for line in errors), other.stderr[-2000:]
