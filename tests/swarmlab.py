"""SPES processes in the network lab (tests/netlab.py), shared by the namespace tests and bench/wan.py.

One launcher for `dht_bootstrap` and `peer.run` inside a lab's namespaces, the peers' applied rounds (their run
dirs' rounds.jsonl, not log text), and a CPU-quota helper that makes one peer slower than the others the way a
slower machine is (a cgroup CPU limit, no code of ours involved).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from tests.conftest import applied_rounds
from tests.netlab import NetLab, Node, NsProcess

RUN_ID = "netlab"
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclass
class Round:
    """One applied round of a peer, from its run dir's rounds.jsonl (peer/node.py `_log_round`)."""

    applied_at: float  # Unix time the round was applied
    round_id: int
    step: int
    group: int
    synced: int
    missing: list[int]
    adopted: list[int]
    given_back: list[int]
    redownloaded: bool
    seconds: float
    blocked: float

    @property
    def started_at(self) -> float:
        return self.applied_at - self.seconds


def rounds(proc: NsProcess) -> list[Round]:
    """The rounds `proc` (a `spes_peer`) applied so far."""
    return [Round(r["time"], r["round"], r["step"], r["contributions"], len(r["experts_synced"]), r["missing"],
                  r["adopted"], r["given_back"], r["redownloaded"], r["seconds"], r["blocked_s"])
            for r in applied_rounds(Path(proc.argv[proc.argv.index("--run-dir") + 1]))]


def start_bootstrap(lab: NetLab, node: Node, num_experts: int, *flags: str) -> tuple[NsProcess, str]:
    """A `dht_bootstrap` node on port 31337 of `node`; returns it and its full multiaddr."""
    boot = lab.python(node, "-m", "dht_bootstrap", "--host-maddrs", f"/ip4/{node.ip}/tcp/31337",
                      "--run-id", RUN_ID, "--num-experts", str(num_experts), "--status-every", "5", *flags,
                      name="boot")
    return boot, boot.wait_log(r"initial peer: (\S+)", 60).group(1)


def spes_peer(lab: NetLab, node: str, initial: str, experts: str, *flags: str, steps: int = 40,
              every: int = 10, env: Optional[dict] = None) -> NsProcess:
    """`python -m peer.run` (configs/tiny.yaml, one torch thread) in `node`'s namespace, run dir in the lab."""
    ip = lab.nodes[node].ip
    return lab.python(node, "-m", "peer.run", "--config", "configs/tiny.yaml", "--run-id", RUN_ID,
                      "--run-dir", str(lab.workdir / f"run-{node}"), "--host-maddrs", f"/ip4/{ip}/tcp/0",
                      "--initial-peers", initial, "--experts", experts, "--max-steps", str(steps),
                      "--sync-every", str(every), "--set", "train.eval_every=100000",
                      "--set", "train.checkpoint_every=100000", *flags, name=f"peer-{node}",
                      env={**os.environ, **THREADS, **(env or {})})


def wait_rounds(proc: NsProcess, count: int, timeout: float, min_group: int = 1, after: float = 0.0) -> list[Round]:
    """Wait until `proc` applied `count` rounds with at least `min_group` peers that started after `after`."""
    deadline = time.monotonic() + timeout
    while True:
        found = [r for r in rounds(proc) if r.group >= min_group and r.started_at >= after]
        if len(found) >= count:
            return found
        if not proc.alive() or time.monotonic() > deadline:
            raise AssertionError(f"{proc.argv[:4]}: {len(found)} of {count} rounds with group >= {min_group} "
                                 f"(rc={proc.popen.poll()}):\n{proc.log_tail(60)}")
        time.sleep(0.5)


class CpuQuota:
    """A cgroup (v2 or v1 `cpu` controller) limiting its processes to `cores` CPU cores: a slower machine.

    Processes join with `add(pid)`; their children (hivemind's DHT process, p2pd) inherit it."""

    PERIOD_US = 100_000

    def __init__(self, name: str, cores: float):
        quota = max(1000, int(cores * self.PERIOD_US))
        v2, v1 = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/cpu")
        if (v2 / "cgroup.controllers").is_file() and "cpu" in (v2 / "cgroup.controllers").read_text().split():
            self.path = v2 / name
            self.path.mkdir(exist_ok=True)
            (self.path / "cpu.max").write_text(f"{quota} {self.PERIOD_US}")
        elif (v1 / "cpu.cfs_quota_us").is_file():
            self.path = v1 / name
            self.path.mkdir(exist_ok=True)
            (self.path / "cpu.cfs_period_us").write_text(str(self.PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            raise OSError("no cgroup cpu controller (v2 cpu.max or v1 cpu.cfs_quota_us) to limit a peer's CPU")

    @staticmethod
    def unavailable() -> Optional[str]:
        if os.geteuid() != 0:
            return "needs root (cgroups)"
        v2, v1 = Path("/sys/fs/cgroup/cgroup.controllers"), Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
        if v1.is_file() or (v2.is_file() and "cpu" in v2.read_text().split()):
            return None
        return "no cgroup cpu controller"

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def close(self) -> None:
        """Move what is left back to the root group and remove this one."""
        try:
            for pid in (self.path / "cgroup.procs").read_text().split():
                try:
                    (self.path.parent / "cgroup.procs").write_text(pid)
                except OSError:
                    pass
            self.path.rmdir()
        except OSError:
            pass
