"""Hostile volunteers (issue 9): the defended behaviour, against attackers from bench/adversary.py.

(a) In one pytest process: two honest `SparseSync` peers on real hivemind DHTs (as in tests/test_swarm.py) and
one attacker started through `bench.adversary.start_attacker`, attacking records: each test asserts that the
honest peers keep aggregating each other's contributions, that the liar's round counter and forged records do not
move them, that a silent owner costs one wait at most, and that refusals are counted in `sync.rejects.counts()`.
Hostile contributions (garbage, huge, scaled, reversed, stale blobs...) are tested in tests/test_contributions.py
and measured by bench.byzantine. (b) A slow smoke run of `python -m bench.byzantine` on one attack at a tiny scale.

Peer a owns experts 0-1 and peer b expert 2; expert 3 is owned by nobody (the attackers' "spare" claim).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from bench.adversary import start_attacker
from peer.config import RunConfig
from sync.config import SyncConfig
from sync.validate import RejectCounter
from tests.conftest import MODEL, REPO, Peer, sync_cfg as _sync_cfg

RUN_ID = "byz-test"
TOKENS = 128  # what each honest peer claims per round: a full round at the run's batch settings (the weight cap)
ROUNDS = 3


def _run_cfg(sync: SyncConfig) -> RunConfig:
    return RunConfig(run_id=RUN_ID, model=MODEL, sync=sync)


def _cap(cfg: RunConfig) -> float:
    t = cfg.train
    return float(cfg.sync.every * t.grad_accum * t.batch_size * cfg.model.seq_len)


@pytest.fixture
def honest(swarm_factory):
    """make(owned, cfg) -> an honest peer wired as peer.node.PeerNode wires one (validated DHT records, one
    reject counter for them and the rounds, the weight cap), from the shared launcher (tests/conftest.py)."""
    def make(owned: list[int], cfg: SyncConfig) -> Peer:
        return swarm_factory(owned, cfg, run_id=RUN_ID, rejects=RejectCounter(), max_weight=_cap(_run_cfg(cfg)))
    return make


def _pair(honest, cfg) -> tuple[Peer, Peer]:
    return honest([0, 1], cfg), honest([2], cfg)


def _initial(peer: Peer) -> list[str]:
    return peer.swarm.visible_maddrs()


def _shared(peer: Peer) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for _, p in peer.model.shared_parameters()])


@torch.no_grad()
def _train(peer: Peer, round_seed: int, peer_seed: int) -> None:
    """What a few local steps do: a change common to all peers (the gradient signal) plus a smaller own part."""
    common, own = torch.Generator().manual_seed(round_seed), torch.Generator().manual_seed(peer_seed)
    params = [p for _, p in peer.model.shared_parameters()]
    for e in sorted(peer.model.owned_experts):
        params += [getattr(bank.bank[e], name) for bank in peer.model.expert_banks()
                   for name in ("gate_up_proj", "down_proj")]
    for p in params:
        p.add_(0.002 * torch.randn(p.shape, generator=common) + 0.0006 * torch.randn(p.shape, generator=own))


def _round(peers: list[Peer], seed: int):
    """Local training on every honest peer, then one round; returns (reports, the peers' shared value before
    training, the honest mean of what they sent)."""
    before = [_shared(p) for p in peers]
    for i, peer in enumerate(peers):
        _train(peer, seed, seed * 100 + i + 1)
    sent = [_shared(p) for p in peers]
    for peer in peers:
        peer.sync.start_round(step=1, tokens=TOKENS, tokens_since_last=TOKENS)
    reports = [peer.sync.finish_round(block=True) for peer in peers]
    return reports, before, torch.stack(sent).mean(0)


def _rejected(peers: list[Peer], reasons: set[str] | None = None) -> int:
    return sum(n for p in peers for r, n in p.sync.rejects.counts().items() if reasons is None or r in reasons)


def _assert_keep_averaging(reports) -> None:
    assert all(r is not None for r in reports), reports
    assert all(r.group_size >= 2 for r in reports), f"honest peers stopped aggregating: {[r.group_size for r in reports]}"
    assert all(r.round_id <= ROUNDS + 2 for r in reports), [r.round_id for r in reports]


def test_round_liar_does_not_move_the_round_counter(honest):
    cfg = _sync_cfg()
    a, b = _pair(honest, cfg)
    attacker = start_attacker("round", _initial(a), _run_cfg(cfg), wait_peers=2)
    try:
        time.sleep(2.0)  # the lie is in the DHT (if any node accepted it)
        for r in range(ROUNDS):
            reports, _, _ = _round([a, b], seed=30 + r)
            _assert_keep_averaging(reports)
            assert not any(rep.redownloaded for rep in reports), f"round {r + 1}: re-downloaded on a liar's round"
        assert a.sync.round_id <= ROUNDS + 1 and b.sync.round_id <= ROUNDS + 1, (a.sync.round_id, b.sync.round_id)
        # ...and the honest peers still read each other's records
        assert b.swarm.peer_id in a.swarm.peers() and a.swarm.peer_id in b.swarm.peers()
    finally:
        attacker.shutdown()


def test_forged_tombstone_under_an_honest_subkey_is_ignored(honest):
    cfg = _sync_cfg()
    a, b = _pair(honest, cfg)
    attacker = start_attacker("tombstone", _initial(a), _run_cfg(cfg), wait_peers=2)
    try:
        assert len(attacker.stats.targets) >= 2, attacker.stats
        time.sleep(cfg.record_ttl / 3 + 1.0)  # a heartbeat of each honest peer has run since
        assert b.swarm.peer_id in a.swarm.peers() and a.swarm.peer_id in b.swarm.peers(), \
            "a forged tombstone hides an honest peer's record"
        for r in range(2):
            reports, _, _ = _round([a, b], seed=50 + r)
            _assert_keep_averaging(reports)
        assert _rejected([a, b], {"record"}) >= 1, "the forged store was not counted as a refused record"
    finally:
        attacker.shutdown()


def test_silent_owner_costs_one_timeout_at_most(honest):
    cfg = _sync_cfg(round_timeout=8.0)
    a, b = _pair(honest, cfg)
    attacker = start_attacker("silent", _initial(a), _run_cfg(cfg), wait_peers=2)
    try:
        time.sleep(1.0)
        seconds, missing = [], []
        for r in range(ROUNDS):
            start = time.monotonic()
            reports, _, _ = _round([a, b], seed=60 + r)
            seconds.append(time.monotonic() - start)
            _assert_keep_averaging(reports)
            missing += [3 in rep.experts_missing for rep in reports]
        assert attacker.stats.claimed == [3] and any(missing), "nobody asked the silent owner: the test is vacuous"
        assert all(s < cfg.round_timeout / 2 + cfg.matchmaking_time for s in seconds[1:]), \
            f"rounds after the first still wait on the silent owner: {[round(s, 1) for s in seconds]}"
    finally:
        attacker.shutdown()


def test_ghost_owners_neither_move_the_round_nor_keep_the_experts_they_claim(honest):
    """Eight identities claim the spare expert for good with the highest honest round + 3 and serve nothing: no
    honest peer re-downloads or jumps ahead, and once OWNER_GRACE rounds passed they count as no owners (the
    expert gets adopted) and show in spes_unserved_claims."""
    from sync.peer_record import OWNER_GRACE

    cfg = _sync_cfg(matchmaking_time=1.0)
    a, b = _pair(honest, cfg)
    attacker = start_attacker("d_ghosts", _initial(a), _run_cfg(cfg), params={"count": 8}, wait_peers=2)
    try:
        time.sleep(1.0)
        assert attacker.stats.claimed == [3] and attacker.stats.stores_accepted >= 8, attacker.stats
        assert sum(p not in (a.swarm.peer_id, b.swarm.peer_id) for p in a.swarm.peers()) == 8  # they are read
        for r in range(OWNER_GRACE + 4):  # grace, then two reads that agree before an adoption
            reports, _, _ = _round([a, b], seed=70 + r)
            assert all(rep.group_size == 2 for rep in reports), [rep.group_size for rep in reports]
            assert not any(rep.redownloaded for rep in reports), f"round {r + 1}: re-downloaded on ghosts' rounds"
        assert a.sync.round_id == b.sync.round_id == OWNER_GRACE + 4  # one round per round, no jump
        assert 3 in set(a.model.owned_experts) | set(b.model.owned_experts), "the ghosts kept expert 3 untrained"
        assert a.sync.unserved_claims == 8 and b.sync.unserved_claims == 8
    finally:
        attacker.shutdown()


def test_a_flood_of_identities_fills_a_bounded_table_and_costly_keys_are_refused(honest, monkeypatch):
    """40 fresh identities with valid records (8 of them with a ~2040-bit public exponent) against nodes that hold
    records of at most 16 peer IDs: the honest peers keep their places and keep aggregating, the costly keys
    are refused before their signatures are checked."""
    import sync.records as records

    monkeypatch.setattr(records, "MAX_RUN_RECORDS", 16)  # before the DHT processes fork: they inherit it
    cfg = _sync_cfg()
    a, b = _pair(honest, cfg)
    attacker = start_attacker("d_records", _initial(a), _run_cfg(cfg), params={"count": 40, "costly": 8, "every": 2.0},
                              wait_peers=2)
    try:
        time.sleep(3.0)
        for r in range(2):
            reports, _, _ = _round([a, b], seed=80 + r)
            _assert_keep_averaging(reports)
        for peer in (a, b):
            seen = peer.swarm.peers()
            assert a.swarm.peer_id in seen and b.swarm.peer_id in seen
            assert 2 < len(seen) <= 16, len(seen)  # the flood is read, up to the bound (each node validates)
        assert _rejected([a, b], {"record"}) >= 8, a.sync.rejects.counts()
    finally:
        attacker.shutdown()


def test_junk_under_keys_outside_the_run_is_stored_by_no_honest_node(honest):
    cfg = _sync_cfg()
    a, b = _pair(honest, cfg)
    attacker = start_attacker("d_junk", _initial(a), _run_cfg(cfg), params={"count": 10, "size": 4096},
                              wait_peers=2)
    try:
        assert attacker.stats.stores_refused == 10 and attacker.stats.stores_accepted == 0, attacker.stats
        assert _rejected([a, b], {"record"}) >= 10
        reports, _, _ = _round([a, b], seed=90)
        _assert_keep_averaging(reports)
    finally:
        attacker.shutdown()


@pytest.mark.slow
def test_byzantine_bench_smoke(tmp_path):
    """Two attack arms at the quick scale (no baseline arm, to stay near a minute): the bench runs real `peer.run`
    processes and an attacker process, leaves nothing running and writes its table; eight ghost identities
    (d_ghosts) claiming a higher round move no honest peer's round counter and cause no re-download."""
    out, work = tmp_path / "results", tmp_path / "work"
    proc = subprocess.run([sys.executable, "-m", "bench.byzantine", "--quick",
                           "--attacks", "c_scale,d_ghosts", "--baselines", "",
                           "--out", str(out), "--work-dir", str(work)],
                          cwd=REPO, capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    arm, ghosts = results["arms"]
    assert ghosts["arm"] == "d_ghosts" and ghosts["honest_crashed"] == 0, ghosts
    assert ghosts["attacker"]["stores_accepted"] >= 8 and ghosts["attacker"]["claimed"] == [6, 7], ghosts["attacker"]
    assert ghosts["round_counter"] <= 2 and ghosts["redownloads"] == 0, ghosts  # 20 steps, H = 10: two rounds
    assert arm["arm"] == "c_scale" and arm["honest"] == 3 and len(arm["rcs"]) == 3, arm
    assert arm["attacker_rc"] == 0, arm  # the attacker left cleanly on SIGTERM
    assert arm["attacker"]["contrib_rounds"] >= 1, arm["attacker"]
    assert all(p["step"] > 0 for p in arm["peers"]), arm["peers"]
    assert "| c_scale" in (out / "table.md").read_text() and "| c_scale" in proc.stdout


@pytest.mark.unit
def test_closed_bench_arms_ticket_the_honest_identities_only(tmp_path):
    """`bench.byzantine --closed`: every honest identity gets a ticket for the arm's run that the run's admission
    accepts; the bootstrap node gets the organizer key (the attacker, started without flags, has no ticket)."""
    from hivemind.p2p import P2P

    from bench.byzantine import closed_run_flags
    from sync.admission import Admission, load_organizer_public_key, peer_id_from_identity, read_signed

    identities = []
    for i in range(2):
        identities.append(tmp_path / f"honest{i}.key")
        P2P.generate_identity(str(identities[-1]))
    boot, peers = closed_run_flags(tmp_path, "byz-run", identities)
    assert boot[0] == "--organizer-key" and all(flags[1] == boot[1] for flags in peers)
    admission = Admission(load_organizer_public_key(boot[1]), "byz-run")
    for identity, flags in zip(identities, peers):
        ticket = read_signed(flags[3])
        assert admission.ticket_valid(peer_id_from_identity(str(identity)), ticket)
        assert not Admission(admission.organizer_public_key, "another-run").ticket_valid(
            peer_id_from_identity(str(identity)), ticket)
