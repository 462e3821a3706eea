"""Test-wide setup: everything offline and hermetic (corpus and HF caches in a session temp dir), and the one
in-process swarm launcher (`swarm_factory`: real DHTs and SparseSyncs on 127.0.0.1, each shut down after the
test) that the sync tests share."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from model.config import ModelConfig
from model.model import SpesMoE
from sync.config import SyncConfig
from sync.rounds import SparseSync
from sync.swarm import Swarm, start_dht
from sync.validate import RejectCounter

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session", autouse=True)
def offline_env(tmp_path_factory: pytest.TempPathFactory):
    """No test may touch the network; caches live in a temp dir that subprocesses inherit too."""
    cache = tmp_path_factory.mktemp("cache")
    saved = dict(os.environ)
    os.environ.update({
        "SPES_CACHE_DIR": str(cache / "spes"),
        "HF_HOME": str(cache / "hf"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    })
    yield cache
    os.environ.clear()
    os.environ.update(saved)


def peer_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "peer.run", *args]


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


@pytest.fixture
def swarm_factory():
    peers: list[Peer] = []
    first_maddrs: list[str] = []

    def make(owned: list[int], cfg: SyncConfig | None = None, join: bool = True, bandwidth: float | None = None,
             auto: bool = False, run_id: str = "test-run", rejects: RejectCounter | None = None,
             **sync_options) -> Peer:
        # auto: as --experts auto (the first peer owns `owned` and takes care of the rest, a joiner chooses as many
        # as `owned` holds from the records); rejects: one counter for the DHT's record checks and the rounds, as
        # peer.node wires it; sync_options: more SparseSync arguments (max_weight, gate, ...).
        cfg = cfg or sync_cfg()
        # Signed, validated records as in peer.run (sync.records).
        dht = start_dht(first_maddrs, LOOPBACK, run_id=run_id, num_experts=MODEL.num_experts,
                        record_ttl=cfg.record_ttl, rejects=rejects)
        if not first_maddrs:
            first_maddrs.extend(str(m) for m in dht.get_visible_maddrs())
        swarm = Swarm(dht, run_id, MODEL.num_experts, ttl=cfg.record_ttl)
        if auto and join and peers:  # a joiner with --experts auto: chosen from the records, as peer.run does
            owned = swarm.choose_auto(len(owned))
        model = SpesMoE(MODEL, owned_experts=owned, seed=0)
        peer = Peer(model, swarm, SparseSync(model, swarm, cfg, bandwidth=bandwidth, rejects=rejects,
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
