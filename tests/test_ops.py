"""Operations: a peer stopped with SIGTERM in the middle of a swarm finishes its step, writes a checkpoint, leaves
the swarm cleanly (its record withdrawn, so the others adopt its experts long before the record would expire),
stops every background process it started and exits 0; Ctrl-C in a terminal (SIGINT to the whole process group)
does the same."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

import pytest

from tests.conftest import jsonl_records, peer_cmd

RECORD_TTL = 60.0  # long, so that expiry cannot explain the adoption


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state) of every process, from /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # exited meanwhile
        fields = stat[stat.rindex(")") + 2:].split()  # the command name may contain spaces and parentheses
        table[int(entry)] = (int(fields[1]), fields[0])
    return table


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (children, grandchildren: hivemind's DHT process, p2pd)."""
    table = _proc_table()
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, (parent, _) in table.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pids: set[int]) -> set[int]:
    """The pids that still run (zombies, already dead, do not count)."""
    table = _proc_table()
    return {pid for pid in pids if pid in table and table[pid][1] != "Z"}


def wait_for(path: Path, pattern: str, procs: list[subprocess.Popen], timeout: float) -> re.Match:
    deadline = time.time() + timeout
    while time.time() < deadline:
        match = re.search(pattern, path.read_text() if path.exists() else "")
        if match:
            return match
        assert all(p.poll() is None for p in procs), f"a process exited early:\n{path.read_text()[-3000:]}"
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} within {timeout}s in {path}:\n{path.read_text()[-3000:]}")


def wait_record(path: Path, wanted: Callable[[dict], bool], procs: list[subprocess.Popen], timeout: float) -> dict:
    """The first record of a run dir's .jsonl file (rounds.jsonl, metrics.jsonl) that `wanted` accepts."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = [r for r in jsonl_records(path) if wanted(r)]
        if found:
            return found[0]
        assert all(p.poll() is None for p in procs), f"a process exited early; {path}: {jsonl_records(path)[-3:]}"
        time.sleep(0.2)
    raise AssertionError(f"no such record within {timeout}s in {path}: {jsonl_records(path)[-3:]}")


def wait_round(run_dir: Path, applied: Callable[[dict], bool], procs: list[subprocess.Popen],
               timeout: float) -> dict:
    """The first round in `run_dir`'s rounds.jsonl that `applied` accepts."""
    return wait_record(run_dir / "rounds.jsonl", applied, procs, timeout)


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


@pytest.mark.slow
def test_sigterm_leaves_cleanly_and_the_other_peer_adopts_its_experts(tmp_path, processes):
    procs: list[subprocess.Popen] = []

    def start(cmd: list[str], log: Path) -> subprocess.Popen:
        procs.append(processes.start(cmd, log))  # reaped after the test, p2pd daemons included (tests/conftest.py)
        return procs[-1]

    try:
        boot_log = tmp_path / "bootstrap.log"
        # hivemind's own bootstrap node (tests/test_metrics.py runs `python -m dht_bootstrap`).
        boot = start(["hivemind-dht", "--host_maddrs", "/ip4/127.0.0.1/tcp/0"], boot_log)
        maddr = wait_for(boot_log, r"--initial_peers (\S+)", [boot], 90).group(1)
        peers, peer_logs = [], []
        for i in range(2):
            peer_logs.append(tmp_path / f"peer{i}.log")
            # Fixed experts covering all four (auto could give both the same ones, and then nothing would be
            # orphaned). A round in flight when the other peer leaves waits for it up to sync.round_timeout: keep
            # that short.
            peers.append(start(peer_cmd(
                "--config", "configs/tiny.yaml", "--initial-peers", maddr, "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                "--run-id", "ops", "--run-dir", str(tmp_path / f"peer{i}"), "--experts", ("0-1", "2-3")[i],
                "--max-steps", "100000", "--sync-every", "4", "--set", f"sync.record_ttl={RECORD_TTL}",
                "--set", "sync.matchmaking_time=2", "--set", "sync.round_timeout=10", "--set", "train.eval_every=0",
                "--set", "train.checkpoint_every=100000", "--set", "train.log_every=1"), peer_logs[-1]))
        survivor, leaver = peers
        # Both have aggregated each other's contributions (so each has seen the other's experts owned) before one leaves.
        for i in range(2):
            wait_round(tmp_path / f"peer{i}", lambda r: r["contributions"] == 2, procs, 180)
        children = descendants(leaver.pid)
        assert len(children) >= 2, children  # at least the DHT process and its p2pd
        left_at = time.time()
        assert stop(leaver) == 0, peer_logs[1].read_text()[-3000:]
        leave_seconds = time.time() - left_at
        text = peer_logs[1].read_text()
        # (Not "no Traceback": asyncio may log one for an expert fetch it was serving when it left.)
        assert "left the swarm" in text and "could not withdraw" not in text, text[-3000:]
        final_step = int(re.search(r"stop requested: finished step (\d+)", text).group(1))
        assert (tmp_path / "peer1" / "checkpoints" / f"step_{final_step:08d}.safetensors").exists(), text[-2000:]
        deadline = time.time() + 15
        while alive(children) and time.time() < deadline:
            time.sleep(0.2)
        assert not alive(children), f"left behind: {alive(children)}"
        # The survivor adopts experts 2 and 3 from the withdrawn record, well before the record could have expired.
        adoption = wait_round(tmp_path / "peer0", lambda r: r["adopted"] == [2, 3], [survivor], RECORD_TTL / 2)
        assert adoption["time"] - left_at < RECORD_TTL / 2, adoption
        # With the leaver's AdamW moments (the only peer that had them), served while it left and checked against
        # AdamW's bound on loading.
        # (0 and 1 too when this peer started late under load: the other had adopted them as orphans meanwhile and
        # handed their moments over when this one came up, seen in 1 of 8 runs two at a time on 2 cores.)
        last = wait_record(tmp_path / "peer0" / "metrics.jsonl", lambda r: r.get("owned_experts") == [0, 1, 2, 3]
                           and r.get("moments_taken_over") in ([2, 3], [0, 1, 2, 3]), [survivor], 60)
        # The survivor's records carry the sync counters the benchmarks read.
        assert last["bytes_sent"]["shared"] > 0 and last["bytes_received"]["expert"] > 0, last
        assert last["blocked_s"] >= 0
        survivor_children = descendants(survivor.pid)
        assert stop(survivor) == 0, peer_logs[0].read_text()[-3000:]
        deadline = time.time() + 15
        while alive(survivor_children) and time.time() < deadline:
            time.sleep(0.2)
        assert not alive(survivor_children), f"left behind: {alive(survivor_children)}"
        assert leave_seconds < 30, leave_seconds
    finally:
        for proc in reversed(procs):
            stop(proc, timeout=30)


@pytest.mark.slow
def test_ctrl_c_in_a_terminal_stops_the_peer_cleanly(tmp_path, processes):
    """Ctrl-C signals the whole foreground process group, hivemind's processes and p2pd included. The peer must
    still finish its step and withdraw its record through a working DHT (p2pd would be gone otherwise), so the
    swarm sees it leave at once, then exit 0."""
    import hivemind

    from sync.swarm import Swarm

    procs: list[subprocess.Popen] = []
    probe = None
    try:
        procs.append(processes.start(["hivemind-dht", "--host_maddrs", "/ip4/127.0.0.1/tcp/0"],
                                     tmp_path / "bootstrap.log"))
        maddr = wait_for(tmp_path / "bootstrap.log", r"--initial_peers (\S+)", procs, 90).group(1)
        log_path = tmp_path / "peer.log"
        # Its own session = its own process group, like a command started from a shell (as every tree the
        # launcher starts).
        peer = processes.start(peer_cmd(
            "--config", "configs/tiny.yaml", "--initial-peers", maddr, "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
            "--run-id", "ctrlc", "--run-dir", str(tmp_path / "run"), "--max-steps", "100000", "--sync-every", "3",
            "--set", f"sync.record_ttl={RECORD_TTL}", "--set", "train.eval_every=0",
            "--set", "train.checkpoint_every=100000"), log_path)
        procs.append(peer)
        wait_round(tmp_path / "run", lambda r: True, procs, 180)
        children = descendants(peer.pid)
        daemons = [pid for pid in children if Path(f"/proc/{pid}/comm").read_text().strip() == "p2pd"]
        assert daemons and all(os.getpgid(pid) != peer.pid for pid in daemons)  # out of the terminal's reach
        os.killpg(peer.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        assert peer.wait(timeout=60) == 0, log_path.read_text()[-3000:]
        text = log_path.read_text()
        assert "SIGINT received" in text and "left the swarm" in text, text[-3000:]
        assert "Traceback" not in text and "could not withdraw" not in text, text[-3000:]
        # The bootstrap node holds the tombstone now, not the live record (which would live RECORD_TTL seconds).
        probe = hivemind.DHT(initial_peers=[maddr], host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
        assert Swarm(probe, "ctrlc", 4).peers() == {}
        deadline = time.time() + 15
        while alive(children) and time.time() < deadline:
            time.sleep(0.2)
        assert not alive(children), f"left behind: {alive(children)}"
    finally:
        if probe is not None:
            probe.shutdown()
        for proc in reversed(procs):
            stop(proc, timeout=30)
