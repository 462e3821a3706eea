"""`python -m dht_bootstrap` as real processes on 127.0.0.1: a stable identity across restarts (and peers that take
the restarted node back), interop with plain hivemind both ways, the status line and swarm gauges, bad input.

Every process started here is stopped in a finally; an autouse fixture fails a test that leaves a p2pd behind
(told apart from other users' p2pd by an environment marker that every child of this process inherits).
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import hivemind
import pytest
from hivemind.utils import get_dht_time

from sync.records import peers_key
from sync.swarm import Swarm, start_dht
from tests.conftest import REPO

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
RUN, EXPERTS = "boot-test", 4
MARK = f"SPES_BOOTSTRAP_TEST={uuid.uuid4().hex}"
UNREACHABLE = "/ip4/127.0.0.1/tcp/1/p2p/QmXfCrWyR4MUYwEbx5ZsbCCGXEvzJ1fqJW4ut3Jkzgjpyf"


def _our_p2pds() -> set[int]:
    found = subprocess.run(["pgrep", "-x", "p2pd"], capture_output=True, text=True).stdout.split()
    ours = set()
    for pid in map(int, found):
        try:
            if MARK.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                ours.add(pid)
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return ours


@pytest.fixture(autouse=True)
def no_leftover_p2pd(monkeypatch):
    monkeypatch.setenv(*MARK.split("="))  # inherited by every p2pd started from here (hivemind copies os.environ)
    assert not _our_p2pds()
    yield
    deadline = time.monotonic() + 10
    while _our_p2pds() and time.monotonic() < deadline:  # shutdowns finish asynchronously
        time.sleep(0.2)
    left = _our_p2pds()
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"p2pd left behind: {left}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A child process whose stderr lines are collected by a thread, so waiting never blocks on a full pipe."""

    def __init__(self, cmd: list[str]):
        self.lines: list[str] = []
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)  # its own group: a failed test can kill all of it
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float = 30, after: int = 0) -> re.Match:
        """First match of `pattern` in the lines from index `after` on."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines[after:]:
                if m := re.search(pattern, line):
                    return m
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.1)
        raise AssertionError(f"no {pattern!r} in:\n" + "\n".join(self.lines))

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()
            self._reader.join(1)  # torch_shm_manager may hold the pipe open a little longer; lines are in by now

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)


def bootstrap(*args: str) -> Proc:
    return Proc([sys.executable, "-m", "dht_bootstrap", "--run-id", RUN, "--num-experts", str(EXPERTS),
                 "--status-every", "0.5", *args])


def _initial_peer(proc: Proc) -> str:
    return proc.wait_for(r"initial peer: (/ip4/\S+/p2p/\S+)").group(1)


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def _swarm(initial: list[str], experts: list[int], tokens: int, ttl: float = 30.0) -> Swarm:
    swarm = Swarm(start_dht(initial, LOOPBACK, run_id=RUN, num_experts=EXPERTS, record_ttl=ttl), RUN, EXPERTS,
                  ttl=ttl)
    try:
        swarm.publish(experts=experts, tokens=tokens)
    except BaseException:
        swarm.shutdown(withdraw=False)
        raise
    return swarm


def test_identity_persists_and_peers_take_the_restarted_node_back(tmp_path):
    port, key = _free_port(), tmp_path / "keys" / "id.key"  # a missing folder too: created
    args = ("--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}", "--identity-path", str(key))
    first = bootstrap(*args)
    second, client = None, None
    try:
        line = _initial_peer(first)
        assert key.is_file()  # hivemind's P2P.create writes a missing identity file
        key_bytes = key.read_bytes()
        # A live peer with a heartbeat every second: during the downtime its stores to the bootstrap fail, which
        # makes hivemind drop the bootstrap from its routing table; only the restarted node's reconnect helps.
        client = _swarm([line], [1], tokens=7, ttl=3.0)
        client.start_heartbeat()
        first.wait_for(r"\] 1 peer, experts covered 1/4")
        assert Path(f"{key}.peers").read_text().split() == client.visible_maddrs()
        assert first.stop() == 0
        first.wait_for(r"SIGTERM received: DHT node shut down")
        time.sleep(1.5)  # at least one heartbeat lands in the downtime

        second = bootstrap(*args)
        assert _initial_peer(second) == line  # same key, same port: the very same line
        assert key.read_bytes() == key_bytes
        second.wait_for(r"reconnected to 1 of 1 DHT nodes")
        second.wait_for(r"\] 1 peer, experts covered 1/4 \(min replicas 0\), swarm tokens 7")
        # The peer's record, re-stored after the restart, is readable through the restarted node by a plain
        # hivemind client.
        other = hivemind.DHT(initial_peers=[line], host_maddrs=LOOPBACK, start=True)
        try:
            client.publish(tokens=8)
            found = other.get(peers_key(RUN), latest=True)
            assert found is not None and client.peer_id in found.value
        finally:
            other.shutdown()
        assert second.stop() == 0
    finally:
        if client is not None:
            client.shutdown(withdraw=False)
        for proc in (first, second):
            if proc is not None:
                proc.kill()


def test_a_peer_started_before_its_bootstrap_node_joins_it_once_it_is_up(tmp_path):
    """network.join_timeout_s: a peer whose initial peer does not answer yet (a bootstrap node restarting, a home
    line's first connection lost) tries again instead of exiting 2, and joins the node once it is up."""
    port, key = _free_port(), tmp_path / "boot.key"
    made = subprocess.run([sys.executable, "-m", "peer.admit", "peer-id", "--identity-path", str(key)], cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=True)
    node_id = re.search(r"peer id: (\S+)", made.stdout).group(1)
    line = f"/ip4/127.0.0.1/tcp/{port}/p2p/{node_id}"
    peer = Proc([sys.executable, "-m", "peer.run", "--config", "configs/tiny.yaml", "--run-id", RUN,
                 "--run-dir", str(tmp_path / "run"), "--initial-peers", line, "--host-maddrs", *LOOPBACK,
                 "--max-steps", "40", "--set", "train.eval_every=100000", "--set", "network.join_timeout_s=60"])
    boot = None
    try:
        peer.wait_for(r"no initial peer answered .* trying again in", timeout=90)
        boot = bootstrap("--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}", "--identity-path", str(key))
        assert _initial_peer(boot) == line
        boot.wait_for(r"\] 1 peer, experts covered", timeout=90)  # the peer's own record, read through the node
        assert peer.proc.wait(120) == 0, "\n".join(peer.lines[-30:])
        assert not any("error" in text.lower() for text in peer.lines), "\n".join(peer.lines)
    finally:
        for proc in (peer, boot):
            if proc is not None:
                proc.kill()


def test_plain_hivemind_client_joins_through_our_bootstrap_which_keeps_none_of_its_junk():
    """A plain hivemind client joins through the bootstrap node and reads from it, but a value under a key
    outside the run (a year's expiry, 1 KiB: the DHT junk attack) is not kept there."""
    node = bootstrap("--host-maddrs", *LOOPBACK)
    writer = reader = None
    try:
        line = _initial_peer(node)
        writer = hivemind.DHT(initial_peers=[line], host_maddrs=LOOPBACK, start=True)
        writer.store("junk", b"x" * 1024, get_dht_time() + 365 * 86400)  # hivemind pipes bigger ones badly
        writer.shutdown()  # whatever was stored now lives only on the bootstrap node
        writer = None
        reader = hivemind.DHT(initial_peers=[line], host_maddrs=LOOPBACK, start=True)
        assert reader.get("junk") is None
        assert node.stop(signal.SIGINT) == 0  # Ctrl-C is a clean stop too
    finally:
        for dht in (writer, reader):
            if dht is not None:
                dht.shutdown()
        node.kill()


def test_our_peers_join_through_plain_hivemind_dht():
    # `python -m hivemind.hivemind_cli.run_dht` is the hivemind-dht console script, found without relying on PATH.
    plain = Proc([sys.executable, "-m", "hivemind.hivemind_cli.run_dht", "--host_maddrs", *LOOPBACK,
                  "--refresh_period", "2"])
    swarms: list[Swarm] = []
    node = None
    try:
        maddr = plain.wait_for(r"--initial_peers (/ip4/\S+)").group(1)
        node = bootstrap("--host-maddrs", *LOOPBACK, "--initial-peers", maddr)  # starts while the peers join
        swarms.append(_swarm([maddr], [0, 1], tokens=100))
        swarms.append(_swarm([maddr], [2, 3], tokens=50))
        for swarm in swarms:
            deadline = time.monotonic() + 10
            while len(swarm.peers()) < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert set(swarm.peers()) == {s.peer_id for s in swarms}
        node.wait_for(r"\] 2 peers, experts covered 4/4 \(min replicas 1\), swarm tokens 150")
        plain.proc.send_signal(signal.SIGTERM)  # both shut down at once
        assert node.stop() == 0
    finally:
        for swarm in swarms:
            swarm.shutdown(withdraw=False)
        for proc in (node, plain):
            if proc is not None:
                proc.stop(timeout=15)


def test_status_line_and_swarm_metrics():
    metrics_port = _free_port()
    node = bootstrap("--host-maddrs", *LOOPBACK, "--metrics-port", str(metrics_port))
    swarms: list[Swarm] = []
    try:
        line = _initial_peer(node)
        short = line[-6:]
        swarms.append(_swarm([line], [0, 1], tokens=1000))
        swarms.append(_swarm([line], [1, 2], tokens=234))
        node.wait_for(rf"\[{RUN} {short}\] 2 peers, experts covered 3/4 \(min replicas 0\), swarm tokens 1234")
        text = _metrics(metrics_port)
        assert "spes_swarm_peers 2.0" in text, text
        for expert, owners in {0: 1, 1: 2, 2: 1, 3: 0}.items():
            assert f'spes_swarm_expert_replicas{{expert="{expert}"}} {owners}.0' in text, text
        assert "spes_swarm_tokens_total 1234.0" in text and "spes_swarm_uncovered_experts 1.0" in text, text
        assert "# TYPE spes_swarm_peers gauge" in text and "# TYPE spes_swarm_tokens_total gauge" in text

        swarms[0].withdraw()  # a clean leave: gone from the status and the gauges without waiting for expiry
        mark = len(node.lines)
        node.wait_for(r"\] 1 peer, experts covered 2/4 \(min replicas 0\), swarm tokens 234", after=mark)
        deadline = time.monotonic() + 10
        while "spes_swarm_peers 1.0" not in (text := _metrics(metrics_port)) and time.monotonic() < deadline:
            time.sleep(0.3)
        assert "spes_swarm_peers 1.0" in text and 'spes_swarm_expert_replicas{expert="0"} 0.0' in text, text
        assert "spes_swarm_uncovered_experts 2.0" in text, text
        assert node.stop() == 0
    finally:
        for swarm in swarms:
            swarm.shutdown(withdraw=False)
        node.kill()


def _one_error_line(proc: Proc) -> str:
    try:
        rc = proc.proc.wait(60)  # the bad-input paths end by themselves
    finally:
        proc.stop()
    assert rc == 2, proc.lines
    errors = [line for line in proc.lines if "error" in line.lower()]
    assert len(errors) == 1, proc.lines
    assert not any("Traceback" in line for line in proc.lines), proc.lines
    return errors[0]


def test_bad_input_gives_one_line_error():
    # All cases run at once: each is a process start (hivemind import) plus a short wait, on 2 cores.
    holder = socket.socket()
    dht = None
    procs: dict[str, tuple[Proc, str]] = {}
    try:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        dht = start_dht((), LOOPBACK)  # p2pd listens with SO_REUSEPORT: a second p2pd alone would not notice
        p2pd_port = int(str(dht.get_visible_maddrs()[0]).split("/")[4])
        cases = {
            "bad multiaddr": (["--host-maddrs", "/ip4/127.0.0.1/tcp/notaport"],
                              "bad multiaddr '/ip4/127.0.0.1/tcp/notaport' in --host-maddrs"),
            "bad announce multiaddr": (["--host-maddrs", *LOOPBACK, "--announce-maddrs", "/ip4/1.2.3/tcp/5"],
                                       "bad multiaddr '/ip4/1.2.3/tcp/5' in --announce-maddrs"),
            "port in use": (["--host-maddrs", f"/ip4/127.0.0.1/tcp/{busy}"], f"port {busy} is in use"),
            "port held by p2pd": (["--host-maddrs", f"/ip4/127.0.0.1/tcp/{p2pd_port}"],
                                  f"port {p2pd_port} is in use"),
            "metrics port in use": (["--host-maddrs", *LOOPBACK, "--metrics-port", str(busy)],
                                    f"metrics port {busy} is in use"),
            "unreachable initial peer": (["--host-maddrs", *LOOPBACK, "--initial-peers", UNREACHABLE],
                                         f"cannot reach any initial peer ({UNREACHABLE})"),
            "bad flag value": (["--num-experts", "0"], "--num-experts"),
            "exclusive flags": (["--port", "5", "--host-maddrs", *LOOPBACK], "not allowed with argument"),
        }
        for case, (args, cause) in cases.items():
            procs[case] = (bootstrap(*args), cause)
        for case, (proc, cause) in procs.items():
            line = _one_error_line(proc)
            assert cause in line, (case, line)
    finally:
        for proc, _ in procs.values():
            proc.kill()
        holder.close()
        if dht is not None:
            dht.shutdown()
