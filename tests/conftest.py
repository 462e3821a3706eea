"""Test-wide setup: everything offline and hermetic (corpus and HF caches in a session temp dir), and the one
in-process swarm launcher (`swarm_factory`: real DHTs and SparseSyncs on 127.0.0.1, each shut down after the
test) that the sync tests share."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from model.config import ModelConfig
from model.model import SpesMoE
from sync.config import SyncConfig
from sync.rounds import SparseSync
from sync.swarm import Swarm, start_dht
from sync.validate import RejectCounter

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session", autouse=True)
def offline_env(tmp_path_factory: pytest.TempPathFactory):
    """No test may touch the network; caches live in a temp dir that subprocesses inherit too, as does one compute
    thread per process."""
    cache = tmp_path_factory.mktemp("cache")
    saved = dict(os.environ)
    os.environ.update({
        "SPES_CACHE_DIR": str(cache / "spes"),
        "HF_HOME": str(cache / "hf"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # One compute thread per process: a test runs several peers, and two xdist workers share the cores. With a
        # thread per core each, OpenMP's threads spin against each other's and CPU goes to waiting, not work.
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    })
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield cache
    torch.set_num_threads(threads)
    os.environ.clear()
    os.environ.update(saved)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The end-to-end process runs first (stable order otherwise): the longest jobs first keep the two xdist workers
    busy to the end instead of leaving one with a long test after the other ran out."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def peer_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "peer.run", *args]


def jsonl_records(path: Path) -> list[dict]:
    """The JSON records of a run dir's .jsonl file (metrics.jsonl, rounds.jsonl) so far; a line still being
    written is skipped."""
    found = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            found.append(json.loads(line))
        except ValueError:
            continue
    return found


def applied_rounds(run_dir: Path) -> list[dict]:
    """The rounds a `peer.run` applied so far, from its run dir's rounds.jsonl (peer/node.py `_log_round`)."""
    return jsonl_records(run_dir / "rounds.jsonl")


# ---- in-process swarm ------------------------------------------------------------------------------------

MODEL = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, num_experts=4, top_k=2,
                    expert_hidden=32, seq_len=16, frozen_expert_dtype="float32")
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


@dataclass
class Peer:
    model: SpesMoE
    swarm: Swarm
    sync: SparseSync

    def shutdown(self) -> None:
        self.sync.shutdown()


def sync_cfg(**kw) -> SyncConfig:
    base = dict(every=1, round_timeout=20.0, matchmaking_time=2.0, record_ttl=6.0)
    base.update(kw)
    return SyncConfig(**base)


@torch.no_grad()
def local_training(peer: Peer, seed: int) -> None:
    """Change what this peer trains (shared params, owned experts) as a few local steps would."""
    g = torch.Generator().manual_seed(seed)
    for _, p in peer.model.shared_parameters():
        p.add_(torch.randn(p.shape, generator=g) * 0.01)
    for e in peer.model.owned_experts:
        for bank in peer.model.expert_banks():
            for name in ("gate_up_proj", "down_proj"):
                t = getattr(bank.bank[e], name)
                t.add_(torch.randn(t.shape, generator=g) * 0.01)


def shared_params(peer: Peer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in peer.model.shared_parameters()}


def round_all(peers: list[Peer], tokens: int = 100) -> list:
    """One round on every peer: starts are local and quick (the network part runs in each peer's background
    thread, concurrently), then each peer applies its result, as the training loop does at a step boundary."""
    for peer in peers:
        peer.sync.start_round(step=1, tokens=tokens, tokens_since_last=tokens)
    return [peer.sync.finish_round(block=True) for peer in peers]


@pytest.fixture
def swarm_factory():
    peers: list[Peer] = []
    first_maddrs: list[str] = []

    def make(owned: list[int], cfg: SyncConfig | None = None, join: bool = True,
             auto: bool = False, run_id: str = "test-run", rejects: RejectCounter | None = None,
             model_cfg: ModelConfig = MODEL, **sync_options) -> Peer:
        # auto: as --experts auto (the first peer owns `owned` and takes care of the rest, a joiner chooses as many
        # as `owned` holds from the records); rejects: one counter for the DHT's record checks and the rounds, as
        # peer.node wires it; model_cfg: MODEL with other settings (the same number of experts);
        # sync_options: more SparseSync arguments (max_weight, gate, ...).
        cfg = cfg or sync_cfg()
        # Signed, validated records as in peer.run (sync.records).
        dht = start_dht(first_maddrs, LOOPBACK, run_id=run_id, num_experts=MODEL.num_experts,
                        record_ttl=cfg.record_ttl, rejects=rejects)
        if not first_maddrs:
            first_maddrs.extend(str(m) for m in dht.get_visible_maddrs())
        swarm = Swarm(dht, run_id, MODEL.num_experts, ttl=cfg.record_ttl, shard=cfg.roster_shard)
        if auto and join and peers:  # a joiner with --experts auto: chosen from the records, as peer.run does
            owned = swarm.choose_auto(len(owned))
        model = SpesMoE(model_cfg, owned_experts=owned, seed=0)
        peer = Peer(model, swarm, SparseSync(model, swarm, cfg, rejects=rejects,
                                             **sync_options))
        peers.append(peer)
        if join:
            peer.sync.join(step=0, tokens=0, alone_takes_all=auto)
        return peer

    try:
        yield make
    finally:
        for peer in peers:
            try:
                peer.shutdown()
            except Exception:
                pass


# ---- whole processes ---------------------------------------------------------------------------------------

class ProcessLauncher:
    """Starts whole process trees for one test (`peer.run`, torchrun, bootstrap nodes) and reaps them after it.

    Each tree gets its own session (so the whole group can be signalled or killed, as a terminal would) and a
    marker in its environment that every descendant inherits, p2pd daemons included: `p2pd_alive()` finds the
    daemons this test started and no one else's."""

    def __init__(self) -> None:
        self.marker = ("SPES_TEST_PROCS", uuid.uuid4().hex)
        self.env = dict(os.environ, **{self.marker[0]: self.marker[1]})
        self.procs: list[subprocess.Popen] = []

    def start(self, cmd: list[str], log: Path | None = None, **kwargs) -> subprocess.Popen:
        """`cmd` in the repository root; output to `log` (stdout and stderr together) or to pipes; `kwargs`
        override Popen's arguments (not the session or the environment's marker)."""
        out = open(log, "w") if log is not None else subprocess.PIPE
        options = dict(cwd=REPO, stdout=out, stderr=subprocess.STDOUT if log is not None else subprocess.PIPE,
                       text=True)
        options.update(kwargs)
        env = dict(options.pop("env", None) or self.env, **{self.marker[0]: self.marker[1]})
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, **options)
        if log is not None:
            out.close()  # the child holds its own descriptor
        self.procs.append(proc)
        return proc

    def alive(self, comm: str | None = None) -> set[str]:
        """PIDs of live processes started under this launcher (any descendant: they inherit the marker), or only
        those whose command name is `comm`."""
        tag = f"{self.marker[0]}={self.marker[1]}".encode()
        mine = set()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if tag in (entry / "environ").read_bytes().split(b"\0") and (
                        comm is None or (entry / "comm").read_text().strip() == comm):
                    state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                    if state != "Z":  # a zombie has exited; its parent reaps it
                        mine.add(entry.name)
            except OSError:  # exited meanwhile, or not ours to read
                pass
        return mine

    def p2pd_alive(self) -> set[str]:
        """PIDs of p2pd daemons started under this launcher that are still alive."""
        return self.alive("p2pd")

    def wait_all_gone(self, timeout: float = 15.0) -> set[str]:
        """After stopping every tree cleanly: wait until none of their processes is alive; returns those left."""
        deadline = time.time() + timeout
        while self.alive() and time.time() < deadline:
            time.sleep(0.2)
        return self.alive()

    def reap(self, p2pd_grace_s: float = 15.0) -> set[str]:
        """Kill every group still running, wait for them, and give their p2pd daemons (which die with their
        parents) `p2pd_grace_s` to go; returns the daemons left, which is a leak."""
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait(timeout=60)
        deadline = time.time() + p2pd_grace_s
        while self.p2pd_alive() and time.time() < deadline:
            time.sleep(0.5)
        return self.p2pd_alive()


@pytest.fixture
def processes():
    """A `ProcessLauncher` whose trees are all gone after the test, p2pd daemons included (a leak fails it)."""
    launcher = ProcessLauncher()
    try:
        yield launcher
    finally:
        left = launcher.reap()
    assert not left, f"p2pd daemons left behind: {sorted(left)}"
