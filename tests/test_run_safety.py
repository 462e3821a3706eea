"""Run safety (docs/DESIGN.md "Run safety", issue 12): one live peer per run dir, `--fresh`, a damaged newest checkpoint, and the
final checkpoint written after the final round."""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from model.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from peer.config import load_config, parse_override
from peer.train import Trainer
from tests.conftest import REPO, peer_cmd
from tests.test_cli import _digest, _one_error_line
from tests.test_ops import alive, descendants


def _tiny(run_dir, *overrides: str):
    return load_config(REPO / "configs/tiny.yaml", [parse_override(o) for o in (f"run_dir={run_dir}", *overrides)])


def _run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(peer_cmd("--config", "configs/tiny.yaml", *args), cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_second_peer_on_a_live_run_dir_exits_2_and_touches_nothing(tmp_path):
    run_dir = tmp_path / "run"
    first = subprocess.Popen(peer_cmd("--config", "configs/tiny.yaml", "--run-dir", str(run_dir), "--sync-every", "0",
                                      "--max-steps", "1000000", "--set", "train.eval_every=0",
                                      "--set", "train.checkpoint_every=0"),
                             cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def files() -> dict[str, str]:  # all but the log the first peer keeps appending to
        return {k: v for k, v in _digest(run_dir).items() if k != "metrics.jsonl"}

    try:
        deadline = time.time() + 120
        while time.time() < deadline and "training on" not in (line := first.stderr.readline()):
            assert line or first.poll() is None, "the first peer exited"
        time.sleep(1)
        before = files()
        for extra in ((), ("--fresh",)):  # not even --fresh moves a live peer's directory
            second = _run("--run-dir", str(run_dir), "--sync-every", "0", "--max-steps", "5", *extra)
            assert second.returncode == 2, second.stderr
            line = _one_error_line(second)
            assert f"run dir {run_dir} is in use by another live peer (pid {first.pid})" in line, line
        assert first.poll() is None and run_dir.is_dir() and not list(tmp_path.glob("run.old-*"))
        assert files() == before and "config.yaml" in before  # the second (--max-steps 5) rewrote nothing
    finally:
        first.terminate()
        first.communicate(timeout=60)
    assert first.returncode == 0
    # The lock went with its holder: the directory is usable again at once.
    again = _run("--run-dir", str(run_dir), "--sync-every", "0", "--max-steps", "1", "--set", "train.eval_every=0")
    assert again.returncode == 0, again.stderr[-2000:]


def test_fresh_moves_the_old_run_dir_aside_and_starts_over(tmp_path):
    run_dir = tmp_path / "run"
    Trainer(_tiny(run_dir, "train.max_steps=4", "train.checkpoint_every=2", "train.eval_every=0")).run()
    old = _digest(run_dir)
    proc = _run("--run-dir", str(run_dir), "--sync-every", "0", "--max-steps", "2", "--fresh",
                "--set", "train.eval_every=0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "resumed from" not in proc.stderr and "moved the old run dir" in proc.stderr
    moved = list(tmp_path.glob("run.old-*"))
    assert len(moved) == 1 and _digest(moved[0]) == old  # nothing of the old run lost or changed
    assert [step for step, _ in list_checkpoints(run_dir / "checkpoints")] == [2]


def test_damaged_newest_checkpoint_falls_back_to_the_previous_complete_one(tmp_path):
    run_dir = tmp_path / "run"
    Trainer(_tiny(run_dir, "train.max_steps=4", "train.checkpoint_every=2", "train.eval_every=0")).run()
    newest = latest_checkpoint(run_dir / "checkpoints")
    assert newest.name == "step_00000004.safetensors"
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])  # a copy cut short
    proc = _run("--run-dir", str(run_dir), "--sync-every", "0", "--max-steps", "6", "--set", "train.eval_every=0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    warnings = [l for l in proc.stderr.splitlines() if "WARN" in l and newest.name in l]
    assert len(warnings) == 1 and "corrupt checkpoint" in warnings[0] and "step_00000002" in warnings[0], proc.stderr
    assert "resumed from" in proc.stderr and "step_00000002.safetensors at step 2" in proc.stderr
    kept = newest.with_name(newest.name + ".corrupt")
    assert kept.read_bytes() == data[: len(data) // 2]  # kept for inspection, not overwritten by step 4 again
    assert load_checkpoint(latest_checkpoint(run_dir / "checkpoints"))[1]["step"] == 6


@pytest.mark.timeout(300)
def test_final_checkpoint_holds_the_final_round(tmp_path):
    """max_steps a multiple of checkpoint_every (as in every shipped config): the final round is drained after
    the last step, and the final checkpoint must hold it. Two peers that averaged that round end with the same
    synchronized shared tensors on disk (they differed in every one when the checkpoint was written before the round)."""
    import hivemind

    from peer.node import PeerNode

    boot = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    initial = [str(m) for m in boot.get_visible_maddrs()]
    nodes: list[PeerNode] = []
    try:
        for name, experts in (("a", "0-1"), ("b", "2-3")):  # built here, in the main thread, as peer.run does
            cfg = _tiny(tmp_path / name, "train.max_steps=8", "train.checkpoint_every=4", "sync.every=4",
                        "train.eval_every=0", "sync.matchmaking_time=3", "sync.round_timeout=30",
                        f"sync.experts={experts}", "run_id=final-ckpt")
            nodes.append(PeerNode(cfg, initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda n: n.run(), nodes))
        assert all(n.trainer.step == 8 for n in nodes)
        shared = [f"model.{name}" for name, _ in nodes[0].trainer.model.shared_parameters()]
        live = [{f"model.{k}": p.detach().clone() for k, p in n.trainer.model.shared_parameters()} for n in nodes]
        rounds = [n.trainer.rounds for n in nodes]
    finally:
        for node in nodes:
            node.shutdown()
        boot.shutdown()
    finals = [load_checkpoint(latest_checkpoint(tmp_path / name / "checkpoints")) for name in "ab"]
    assert [meta["step"] for _, meta in finals] == [8, 8]
    # Exactly the state each peer ended with, its last round included ...
    assert [meta["rounds"] for _, meta in finals] == rounds and min(rounds) >= 2, (rounds, [m for _, m in finals])
    for (tensors, _), ended in zip(finals, live):
        for name in shared:
            assert torch.equal(tensors[name], ended[name]), name
    # ... and so the two agree: they aggregated the same contributions in that round, so their synchronized
    # shared tensors are bit-identical (the live ones differ by what each has not sent yet,
    # sync.sparse.keep_residual).
    synced = sorted(k for k in finals[0][0] if k.startswith("callbacks.sync.contrib.synced."))
    assert len(synced) == len(shared), synced
    for name in synced:
        assert torch.equal(finals[0][0][name], finals[1][0][name]), name


@pytest.mark.timeout(180)
def test_sigkilled_peer_leaves_no_process_behind(tmp_path):
    """The OOM killer's SIGKILL gives a peer no chance to stop its DHT and p2pd processes: they must
    end by themselves within 10 s, and release the run dir's lock with them."""
    run_dir = tmp_path / "run"
    peer = subprocess.Popen(peer_cmd("--config", "configs/tiny.yaml", "--run-dir", str(run_dir), "--sync-every", "5",
                                     "--max-steps", "1000000", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                                     "--set", "train.eval_every=0", "--set", "sync.matchmaking_time=1"),
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    children: set[int] = set()
    try:
        deadline = time.time() + 120
        while time.time() < deadline and "round 1 applied" not in (line := peer.stderr.readline()):
            assert line or peer.poll() is None, "the peer exited"
        children = descendants(peer.pid)
        names = {Path(f"/proc/{c}/comm").read_text().strip() for c in alive(children)}
        assert "p2pd" in names and len(children) >= 2, names  # the DHT process and its p2pd
        os.kill(peer.pid, signal.SIGKILL)
        peer.wait(timeout=10)
        deadline = time.time() + 10
        while alive(children) and time.time() < deadline:
            time.sleep(0.2)
        left = {c: Path(f"/proc/{c}/cmdline").read_bytes()[:80] for c in alive(children)}
        assert not left, left
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()
        for child in alive(children):  # only if the test failed: leave nothing behind ourselves
            os.kill(child, signal.SIGKILL)
    again = _run("--run-dir", str(run_dir), "--sync-every", "0", "--max-steps", "1", "--set", "train.eval_every=0")
    assert again.returncode == 0, again.stderr[-2000:]


@pytest.mark.timeout(240)
def test_second_process_with_a_live_peer_id_exits_2(tmp_path):
    """The same --identity-path twice (its own run dir each): the second process sees its peer ID's record kept
    alive by someone else's heartbeat and exits 2 in one line, leaving the first one's record alone."""
    identity = str(tmp_path / "peer.key")
    common = ("--config", "configs/tiny.yaml", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--identity-path", identity,
              "--run-id", "dup", "--set", "train.eval_every=0", "--set", "sync.record_ttl=6")
    first = subprocess.Popen(peer_cmd(*common, "--run-dir", str(tmp_path / "a"), "--max-steps", "1000000"),
                             cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        initial, deadline = None, time.time() + 120
        while time.time() < deadline and "training on" not in (line := first.stderr.readline()):
            assert line or first.poll() is None, "the first peer exited"
            if "initial peer:" in line:
                initial = line.split("initial peer: ")[1].strip()
        second = _run(*common[2:], "--run-dir", str(tmp_path / "b"), "--max-steps", "5", "--initial-peers", initial)
        assert second.returncode == 2, second.stderr[-3000:]
        line = _one_error_line(second)
        # hivemind's own check (a libp2p dial of the peer ID through the initial peers) usually answers first;
        # the record check (test_a_peer_id_live_elsewhere_is_told_from_a_crashed_run_of_it) covers what it misses.
        assert ("is already live in run dup: another process uses this identity" in line
                or f"Identity from `{identity}` is already taken by another peer" in line), line
        assert first.poll() is None  # untouched, still training
    finally:
        first.terminate()
        first.communicate(timeout=60)
    assert first.returncode == 0


@contextlib.contextmanager
def _same_identity(tmp_path, ttl: float):
    """(swarm(), nodes): swarm() starts a DHT node and Swarm with the same identity file each time, hivemind's own
    dial check off (as when it misses); every node started is shut down at the end."""
    from sync.swarm import Swarm, start_dht, start_dht_node

    identity, loopback = str(tmp_path / "same.key"), ["/ip4/127.0.0.1/tcp/0"]
    boot = start_dht(host_maddrs=loopback, run_id="dup", num_experts=4, record_ttl=ttl)
    initial = [str(m) for m in boot.get_visible_maddrs()]
    nodes = [boot]

    def swarm() -> Swarm:
        dht = start_dht_node(initial, loopback, identity_path=identity, run_id="dup", num_experts=4,
                             record_ttl=ttl, sign=True, check_if_identity_free=False)
        nodes.append(dht)
        return Swarm(dht, "dup", 4, ttl=ttl)
    try:
        yield swarm, nodes
    finally:
        for dht in nodes:
            dht.shutdown()


def test_a_peer_id_live_elsewhere_is_told_from_a_crashed_run_of_it(tmp_path):
    """The record check behind "a duplicate live peer ID is refused": a record under this peer ID that someone's
    heartbeat keeps refreshing is live elsewhere; one nobody refreshes (left by a run of this peer that crashed)
    is not, and costs at most one heartbeat period of waiting."""
    with _same_identity(tmp_path, ttl=3.0) as (swarm, nodes):
        first = swarm()
        assert not first.live_elsewhere()  # nothing under its ID yet
        first.publish(experts=[0])  # a run of this peer that then crashed: no heartbeat refreshes it
        second = swarm()
        start = time.monotonic()
        assert not second.live_elsewhere() and time.monotonic() - start < 3.0 / 3 + 4
        first.start_heartbeat()  # now a live process keeps it fresh
        time.sleep(1.5)
        third = swarm()
        assert third.live_elsewhere()
        first.shutdown(withdraw=False)
        nodes.remove(first.dht)


def test_a_crashed_predecessor_on_this_machine_costs_no_wait(tmp_path):
    """A peer restarted after a crash (same identity, same machine) finds the record its dead predecessor left:
    the record names the process that published it, which is gone, so the restart does not watch the record
    for a heartbeat period first (13 s at the default ttl). A predecessor that is still alive is still watched."""
    from sync.swarm import process_origin

    dead = subprocess.Popen(["true"])
    dead.wait()
    with _same_identity(tmp_path, ttl=30.0) as (swarm, _):
        crashed = swarm()
        assert crashed.record.origin[:2] == process_origin()
        crashed.record.origin = [process_origin()[0], dead.pid]  # published by a process that has exited since
        crashed.publish(experts=[0])
        start = time.monotonic()
        assert not swarm().live_elsewhere()
        assert time.monotonic() - start < 5.0  # not the 13 s watch
        crashed.record.origin = [process_origin()[0], os.getppid()]  # a live process: watched as before
        crashed.publish(experts=[0])
        start = time.monotonic()
        assert not swarm().live_elsewhere(poll=0.5)  # nobody refreshes it: not live, after the watch
        assert time.monotonic() - start > 30.0 / 3


def test_of_twins_started_together_the_later_gives_way_and_leaves_the_record_alone(tmp_path):
    """Two live processes with one identity, both past the start-up check (started together): once either reads
    the other's record, the one that started later gives way (Swarm.twin) and stores nothing more under the peer
    ID, not even a tombstone; the earlier one's record stays."""
    with _same_identity(tmp_path, ttl=30.0) as (swarm, _):
        first, second = swarm(), swarm()  # in this order: the first started first
        first.publish(experts=[0])
        second.publish(experts=[1])  # stored later: its record is the one the DHT keeps
        first.peers()  # sees the later twin: stores its own record again (not waiting) so that the twin sees it
        assert first.twin is None
        deadline = time.monotonic() + 10
        while second.twin is None and time.monotonic() < deadline:
            time.sleep(0.2)
            seen = second.peers()
        assert seen[second.peer_id].experts == [0] and second.twin == first.record.origin
        second.publish(experts=[1])
        second.shutdown()  # a twin withdraws nothing: the record is the other process's
        assert first.peers()[first.peer_id].experts == [0] and first.twin is None
        first.shutdown(withdraw=False)


@pytest.mark.unit
def test_processes_creating_one_identity_file_together_all_load_the_one_key(tmp_path):
    """Peers started at one moment with a new --identity-path race to create it: exactly one key lands, every
    process reads that whole key, and a file already there is never rewritten (a rewrite made the twins of
    the test below two unrelated peers with one file, in one CI run)."""
    from sync.admission import peer_id_from_identity
    from sync.records import create_identity

    path = str(tmp_path / "keys" / "shared.key")
    os.makedirs(os.path.dirname(path))
    with concurrent.futures.ProcessPoolExecutor(4) as pool:
        ids = list(pool.map(peer_id_from_identity, [path] * 8, [True] * 8))
    assert len(set(ids)) == 1
    before = Path(path).read_bytes()
    assert create_identity(path) is False and Path(path).read_bytes() == before
    assert os.listdir(os.path.dirname(path)) == ["shared.key"]  # no temp file left behind


@pytest.mark.unit
def test_an_identity_is_created_where_the_file_system_has_no_hard_links(tmp_path, monkeypatch):
    from sync.admission import peer_id_from_identity
    from sync.records import create_identity

    def no_links(*_):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    path = str(tmp_path / "fat.key")
    assert peer_id_from_identity(path, create=True) == peer_id_from_identity(path)
    before = Path(path).read_bytes()
    assert create_identity(path) is False and Path(path).read_bytes() == before
    assert os.listdir(tmp_path) == ["fat.key"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_twin_peer_processes_started_together_one_exits_2_naming_the_identity(tmp_path, processes):
    """The same --identity-path in two `peer.run` processes started at the same moment through a bootstrap
    node: within seconds of both being up one of them exits 2 in one line naming the identity file (the later
    start, or hivemind's own dial check when it answers first); the other trains on."""
    from tests.test_e2e import _start_bootstrap

    _, maddr = _start_bootstrap(processes)
    identity = str(tmp_path / "twin.key")
    subprocess.run(peer_cmd("--help"), cwd=REPO, capture_output=True)  # warm the imports' caches for both
    twins = [processes.start(peer_cmd(
        "--config", "configs/tiny.yaml", "--initial-peers", maddr, "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
        "--identity-path", identity, "--run-dir", str(tmp_path / f"twin{i}"), "--run-id", "twins",
        "--max-steps", "1000000", "--set", "train.eval_every=0", "--set", "train.checkpoint_every=0"),
        log=tmp_path / f"twin{i}.log") for i in range(2)]
    deadline = time.time() + 200
    while time.time() < deadline and all(t.poll() is None for t in twins):
        time.sleep(0.5)
    gone = [t for t in twins if t.poll() is not None]
    logs = [(tmp_path / f"twin{i}.log").read_text() for i in range(2)]
    assert len(gone) == 1 and gone[0].returncode == 2, [log[-2000:] for log in logs]
    errors = [l for l in logs[twins.index(gone[0])].splitlines() if "error:" in l]
    assert len(errors) == 1 and identity in errors[0], errors
    survivor = twins[1 - twins.index(gone[0])]
    time.sleep(3)
    assert survivor.poll() is None
    survivor.send_signal(signal.SIGTERM)
    assert survivor.wait(timeout=120) == 0


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_soak_bench_smoke(tmp_path):
    """bench/soak.py at smoke length: 3 peers, one SIGKILL + restart; nothing left behind, no NaN, every peer
    exits 0 at the end. (How fast the restarted peer is back is a measurement of the full 30-minute run,
    bench/README.md, not checked here: on 2 busy cores its start-up alone can outlast this smoke run.)"""
    import json
    import sys

    out = tmp_path / "soak"
    proc = subprocess.run([sys.executable, "-m", "bench.soak", "--minutes", "1.4", "--kill-every", "0.3",
                           "--peers", "3", "--every", "10", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert len(result["restarts"]) == 1 and result["restarts"][0]["left_behind"] == 0, result["restarts"]
    assert result["nan_losses"] == 0 and result["exit_codes"] == [0, 0, 0], result
    assert "back in a group after s" in (out / "table.md").read_text()
