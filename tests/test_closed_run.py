"""A closed run end to end (issue 9.3, docs/DESIGN.md "Closed runs"): two ticketed peers and a stranger with only
the initial peer's address, all real hivemind DHTs and exchanges in one process. The stranger
gets nothing at any door — its record is not read, its expert, state and contribution requests are refused, no
admitted peer aggregates anything of it — and a peer revoked while the run is live is dropped."""
from __future__ import annotations

import time

import pytest
from hivemind.p2p import PeerID

from model.config import ModelConfig
from model.model import SpesMoE
from sync.admission import (Admission, Gate, generate_organizer_key, load_organizer_public_key,
                            peer_id_from_identity, publish_revocation, sign_revocation, sign_ticket)
from sync.config import SyncConfig
from sync.contrib_exchange import ContributionError
from sync.rounds import SparseSync
from sync.swarm import Swarm, start_dht

RUN = "closed-test"
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
MODEL = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, num_experts=4, top_k=2,
                    expert_hidden=32, seq_len=16)


@pytest.fixture
def closed_swarm(tmp_path):
    """Peers A and B with tickets, stranger S without (its own node is an open-run node: it signs its own
    record and validates nothing of the organizer's). Yields (a, b, s, key_path); shuts everything down."""
    key_path = str(tmp_path / "org.key")
    public = load_organizer_public_key(generate_organizer_key(key_path))
    cfg = SyncConfig(every=1, round_timeout=15.0, matchmaking_time=2.0, record_ttl=10.0)
    syncs: list[SparseSync] = []
    initial: list[str] = []

    def make(name: str, owned: list[int], ticketed: bool) -> SparseSync:
        identity = str(tmp_path / f"{name}.id")
        peer_id = peer_id_from_identity(identity, create=True)
        admission = Admission(public, RUN, sign_ticket(key_path, RUN, peer_id, days=1)) if ticketed else None
        dht = start_dht(initial, LOOPBACK, identity_path=identity, run_id=RUN, num_experts=MODEL.num_experts,
                        record_ttl=cfg.record_ttl, admission=admission)
        if not initial:
            initial.extend(str(m) for m in dht.get_visible_maddrs())
        swarm = Swarm(dht, RUN, MODEL.num_experts, ttl=cfg.record_ttl,
                      ticket=admission.own_ticket if admission else b"", admission=admission)
        model = SpesMoE(MODEL, owned_experts=owned, seed=0)
        gate = Gate(dht, admission) if admission else None
        sync = SparseSync(model, swarm, cfg, gate=gate)
        syncs.append(sync)
        return sync

    try:
        a = make("a", [0, 1], True)
        a.join(0, 0)
        b = make("b", [2, 3], True)
        b.join(0, 0)
        s = make("s", [0], False)
        s.join(0, 0)
        yield a, b, s, key_path
    finally:
        for sync in reversed(syncs):
            sync.shutdown()


def test_stranger_gets_nothing_at_any_door(closed_swarm):
    a, b, s, _ = closed_swarm
    assert set(a.swarm.peers()) == {a.swarm.peer_id, b.swarm.peer_id}  # S's record is refused by every node
    assert s.swarm.peer_id not in b.swarm.peers()
    a_id = PeerID.from_base58(a.swarm.peer_id)
    # The expert exchange: S asks A for an expert A publishes.
    assert s.exchange.fetch(a_id, 0, a.round_id, timeout=5.0) is None
    # The state download door: the synchronized shared tensors A serves to joiners.
    assert s.exchange.fetch_shared_async(a_id, a.round_id, 0, 5.0, bf16=False).result(timeout=10.0) is None
    assert a.rejects.counts()["unauthorized"] >= 2
    # A round: A and B aggregate each other's contributions; S reads no admitted record, so it has none to fetch.
    for sync in (a, b, s):
        sync.start_round(step=1, tokens=100, tokens_since_last=100)
    reports = [sync.finish_round(block=True) for sync in (a, b, s)]
    assert reports[0].group_size == 2 and reports[1].group_size == 2, reports
    assert reports[2].group_size <= 1
    # The contribution door: S asks A for A's blob of this round, announced in A's (admitted) record.
    announced = a.swarm.peers()[a.swarm.peer_id].contrib
    assert announced and announced[0] == a.round_id, announced
    with pytest.raises(ContributionError, match="refused"):
        s.contrib_exchange.fetch(a.swarm.peer_id, a.swarm.peer_id, announced[0], announced[1], announced[2], 5.0)
    # ...and the admitted peers still fetch each other's experts and blobs.
    assert b.exchange.fetch(a_id, 0, a.round_id, timeout=5.0) is not None
    assert b.contrib_exchange.fetch(a.swarm.peer_id, a.swarm.peer_id, *announced[:3], 5.0)


def test_revoked_peer_is_dropped_while_the_run_is_live(closed_swarm):
    a, b, _, key_path = closed_swarm
    b_id = b.swarm.peer_id
    gate = a.gate
    assert gate.admits_sync(b_id)
    assert publish_revocation(a.swarm.dht, RUN, b_id, sign_revocation(key_path, RUN, b_id), ttl_days=1)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (b_id in a.swarm.peers() or gate.admits_sync(b_id)):
        time.sleep(0.5)
    assert b_id not in a.swarm.peers()
    assert not gate.admits_sync(b_id)
    # A's doors are closed to B now: its expert exchange refuses B's request.
    assert b.exchange.fetch(PeerID.from_base58(a.swarm.peer_id), 0, a.round_id, timeout=5.0) is None


@pytest.mark.slow
def test_closed_run_as_processes(tmp_path, processes):
    """`python -m dht_bootstrap --organizer-key` + two ticketed `peer.run` peers + a stranger `peer.run` given only
    the initial peer's address: the admitted peers aggregate each other's contributions and exit 0; the stranger
    is told at start, in one line, that the run is closed and what to pass, and exits 2 (issue 34 item 2: it
    used to train alone, blocked half its time, refused by everyone without a word)."""
    import re
    import signal
    import subprocess

    from sync.admission import encode_signed
    from tests.conftest import REPO, applied_rounds, peer_cmd

    key = str(tmp_path / "org.key")
    public = generate_organizer_key(key)
    # The fixture reaps every process this test starts and fails it on a p2pd daemon left behind.
    boot = processes.start([*peer_cmd()[:2], "dht_bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--run-id",
                            "closed", "--num-experts", "4", "--organizer-key", public], stderr=subprocess.STDOUT)
    procs: list[subprocess.Popen] = []
    try:
        initial = None
        deadline = time.time() + 60
        while initial is None and time.time() < deadline:
            match = re.search(r"initial peer: (/ip4/127\.0\.0\.1/\S+)", boot.stdout.readline())
            initial = match.group(1) if match else None
        assert initial, "the bootstrap node printed no initial peer line"
        common = ["--config", "configs/tiny.yaml", "--initial-peers", initial, "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                  "--run-id", "closed", "--max-steps", "30", "--sync-every", "10", "--set", "sync.matchmaking_time=2",
                  "--set", "sync.round_timeout=20", "--set", "train.eval_every=0", "--set", "train.checkpoint_every=0"]
        for name in ("a", "b"):
            identity = str(tmp_path / f"{name}.id")
            ticket = tmp_path / f"{name}.ticket"
            ticket.write_text(encode_signed(sign_ticket(key, "closed", peer_id_from_identity(identity, create=True), 1)))
            procs.append(processes.start(peer_cmd(*common, "--run-dir", str(tmp_path / name), "--identity-path",
                                                  identity, "--organizer-key", public, "--ticket", str(ticket),
                                                  "--set", "sync.wait_for_peers=2", "--max-steps", "20000"),
                                         log=tmp_path / f"{name}.log"))
        # The stranger comes once a and b train (their ticketed records are in the DHT by then). They train until
        # stopped below: the stranger must find them live however long its own start takes.
        deadline = time.time() + 120
        while not all("training on" in (tmp_path / f"{n}.log").read_text() for n in "ab"):
            assert time.time() < deadline and all(p.poll() is None for p in procs), "a and b did not start training"
            time.sleep(0.2)
        stranger = subprocess.run(peer_cmd(*common, "--run-dir", str(tmp_path / "stranger")), cwd=REPO,
                                  capture_output=True, text=True, timeout=120)
        errors = [line for line in stranger.stderr.splitlines() if "error:" in line]
        assert stranger.returncode == 2 and len(errors) == 1, stranger.stderr[-3000:]
        assert "run closed is closed" in errors[0] and "--organizer-key" in errors[0], errors
        # Once each admitted peer aggregated the other's contribution they are stopped (SIGTERM: a clean leave,
        # exit 0) instead of running out their steps.
        def groups(name: str) -> list[int]:
            return [r["contributions"] for r in applied_rounds(tmp_path / name)]

        deadline = time.time() + 240
        while not all(2 in groups(n) for n in "ab") and time.time() < deadline and all(p.poll() is None for p in procs):
            time.sleep(0.5)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=120)
        outputs = [(tmp_path / f"{name}.log").read_text() for name in ("a", "b")]
        for p, err in zip(procs, outputs):
            assert p.returncode == 0, err[-3000:]
        for name, err in zip("ab", outputs):
            # A round alone (1) is fine: when one peer stops first, the other's last round finds nobody.
            assert 2 in groups(name) and set(groups(name)) <= {1, 2}, err[-3000:]
    finally:
        boot.terminate()
        try:
            boot.wait(timeout=30)
        except subprocess.TimeoutExpired:
            boot.kill()
