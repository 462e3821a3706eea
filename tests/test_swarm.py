"""SPES rounds between real hivemind peers on 127.0.0.1, several peers in one pytest process.

Each peer is a DHT node + SparseSync around its own SpesMoE. Local training is stood in for by seeded perturbations
of what each peer trains. The exact aggregation
of rounds as contributions is tested in tests/test_contributions.py; these are about the swarm around them:
stalls, leaves, ownership, restarts."""
from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest
import torch

from tests.conftest import MODEL, Peer, local_training as _local_training, round_all as _round_all
from tests.conftest import shared_params as _shared, sync_cfg as _sync_cfg


def _experts(peer: Peer) -> dict[int, dict[str, torch.Tensor]]:
    return {e: {k: v.clone() for k, v in peer.model.expert_tensors(e).items()} for e in range(MODEL.num_experts)}


def _assert_experts_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for name in a:
        torch.testing.assert_close(a[name].float(), b[name].float(), rtol=1e-6, atol=1e-6)


def _kill(peer: Peer) -> None:
    """The peer's processes stop without leaving cleanly (no record withdrawal)."""
    peer.sync.contrib_exchange.shutdown()
    peer.sync.exchange.shutdown()
    peer.swarm._stop.set()
    peer.swarm.dht.shutdown()


def test_peer_killed_mid_round_does_not_stall_the_others(swarm_factory):
    cfg = _sync_cfg(round_timeout=15.0)
    a, b, c = (swarm_factory(owned, cfg) for owned in ([0, 1], [2], [3]))
    _round_all([a, b, c])
    for peer in (a, b, c):
        peer.sync.start_round(step=2, tokens=200, tokens_since_last=100)
    time.sleep(1.0)  # everyone is waiting for announcements / fetching
    _kill(c)
    start = time.monotonic()
    reports = [a.sync.finish_round(block=True), b.sync.finish_round(block=True)]
    assert time.monotonic() - start < cfg.round_timeout + 15
    assert all(r is not None for r in reports)
    reports = _round_all([a, b])  # and the next round works between the survivors
    assert all(r.group_size == 2 for r in reports), reports


def test_leaving_peer_does_not_wait_the_round_timeout_for_a_partner_that_left(swarm_factory):
    cfg = _sync_cfg(round_timeout=40.0)
    a, b = swarm_factory([0, 1], cfg), swarm_factory([2, 3], cfg)
    _round_all([a, b])
    a.sync.start_round(step=2, tokens=200, tokens_since_last=100)  # b never starts this round: it is leaving
    time.sleep(cfg.matchmaking_time + 1.0)  # a's first matchmaking attempt failed: hivemind retries until timeout
    a.sync.leave_soon()  # what a SIGTERM does (Trainer.request_stop -> stop hooks)
    start = time.monotonic()
    report = a.sync.finish_round(block=True)
    assert time.monotonic() - start < 10, "the leaving peer waited for the round timeout"
    assert report is not None and report.group_size == 1
    assert a.sync.start_round(step=3, tokens=300, tokens_since_last=100) is None  # no round after leave_soon
    assert a.sync.finish_round(block=True) is None


def test_last_peer_stops_looking_for_a_group_once_the_others_left(swarm_factory):
    """Draining its last round, a peer whose partners finished and withdrew their records stops looking for a
    group within a poll or two of the background reader, not after the whole grace."""
    cfg = _sync_cfg(matchmaking_time=5.0, round_timeout=30.0)
    a, b = swarm_factory([0, 1], cfg), swarm_factory([2, 3], cfg)
    _round_all([a, b])
    a.sync.start_round(step=2, tokens=200, tokens_since_last=100)  # expects b, which is about to leave
    b.shutdown()  # withdraws its record
    start = time.monotonic()
    report = a.sync.drain(grace=20.0)
    assert report.group_size == 1 and time.monotonic() - start < 8.0, (report, time.monotonic() - start)


def test_draining_peer_does_not_give_up_its_group_on_one_partial_read(swarm_factory, monkeypatch):
    """A background read that comes back with this peer's own record alone (as DHT reads sometimes do) is not
    "the others left": the draining peer keeps looking, and the partner that reaches the round later joins it
    (CI once saw the first peer to finish give up, leaving the other to average its last round alone)."""
    cfg = _sync_cfg(matchmaking_time=8.0, round_timeout=30.0)
    a, b = swarm_factory([0, 1], cfg), swarm_factory([2, 3], cfg)
    _round_all([a, b])
    key, real_get, partial = a.swarm.key, a.swarm.dht.get, []

    def own_record_only_twice(k, *args, **kw):  # the background reader's next two reads
        found = real_get(k, *args, **kw)
        if k != key or found is None or threading.current_thread().name != "spes-progress" or len(partial) >= 2:
            return found
        partial.append(time.monotonic())
        return type(found)({p: v for p, v in found.value.items() if p == a.swarm.peer_id}, found.expiration_time)

    monkeypatch.setattr(a.swarm.dht, "get", own_record_only_twice)
    a.sync.start_round(step=2, tokens=200, tokens_since_last=100)
    draining = concurrent.futures.ThreadPoolExecutor(1).submit(a.sync.drain, 20.0)
    deadline = time.monotonic() + 10
    while len(partial) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(partial) == 2 and not draining.done()
    b.sync.start_round(step=2, tokens=200, tokens_since_last=100)  # b reaches the round after the partial reads
    reports = [draining.result(timeout=60), b.sync.finish_round(block=True)]
    assert [r.group_size for r in reports] == [2, 2], reports


def test_dead_peer_does_not_block_and_its_experts_are_adopted(swarm_factory):
    cfg = _sync_cfg(record_ttl=3.0)
    a, b, c = swarm_factory([0], cfg), swarm_factory([1], cfg), swarm_factory([2, 3], cfg)
    _round_all([a, b, c])
    _kill(c)  # c dies without leaving cleanly: no withdrawal, its processes just stop
    start = time.monotonic()
    reports = _round_all([a, b])
    assert time.monotonic() - start < cfg.round_timeout + 10
    assert all(r.group_size == 2 for r in reports)
    time.sleep(cfg.record_ttl + 1)  # c's record expires
    # Adopted after two reads without an owner (sync.ownership): the round above may already have read c's record
    # expired (under load it can outlast the 3 s ttl), so within two more rounds, once, by one peer each.
    adopted: list[int] = []
    for _ in range(2):
        reports = _round_all([a, b])
        adopted += reports[0].adopted + reports[1].adopted
    assert sorted(adopted) == [2, 3], adopted
    coverage = a.swarm.coverage()
    assert all(len(owners) == 1 for owners in coverage.values()), coverage


def test_clean_leave_is_covered_on_the_first_round_after_it(swarm_factory):
    """A peer that leaves cleanly (Ctrl-C / SIGTERM: SparseSync.shutdown) stores a signed tombstone listing the
    experts it owned: the others adopt them in their very next round (one read, not the two after a death),
    once, by one peer each, and each adopter gets the leaver's optimizer moments of what it adopts (served
    during the leave's grace, fetched by the adopter's record reader: sync/leave.py)."""
    cfg = _sync_cfg(record_ttl=6.0)
    a, b, c = swarm_factory([0], cfg), swarm_factory([1], cfg), swarm_factory([2, 3], cfg)
    g = torch.Generator().manual_seed(0)
    moments = {e: {**{f"{n}.{k}": torch.rand(t.shape, generator=g) * 1e-3 for n, t in c.model.expert_tensors(e).items()
                      for k in ("exp_avg", "exp_avg_sq")},
                   **{f"{n}.step": torch.tensor(7.0 + i) for i, n in enumerate(c.model.expert_tensors(e))}}
               for e in (2, 3)}
    c.sync.exchange.moments_provider = lambda e: moments.get(e)  # as peer.node serves the live optimizer's
    _round_all([a, b, c])
    c.sync.shutdown()
    assert c.sync.exchange.moments_served == {2, 3}  # both went out before it stopped serving
    reports = _round_all([a, b])
    assert all(r.group_size == 2 for r in reports), reports
    assert sorted(reports[0].adopted + reports[1].adopted) == [2, 3], reports
    coverage = a.swarm.coverage()
    assert all(len(owners) == 1 for owners in coverage.values()), coverage
    assert a.swarm.left_by() == {2: {c.swarm.peer_id}, 3: {c.swarm.peer_id}}
    for peer, report in zip((a, b), reports):
        assert sorted(peer.sync.handed_over) == sorted(report.adopted)
        for e in report.adopted:
            for name, value in moments[e].items():
                assert torch.equal(peer.sync.handed_over[e][name], value), name


def test_a_stopping_peer_adopts_nothing_from_another_that_left(swarm_factory):
    """Two peers stopped at once: one's tombstone reaches the other in its last round, which must not adopt
    the leaver's experts (it would leave owning them, its final checkpoint and record claiming them)."""
    cfg = _sync_cfg(record_ttl=6.0)
    a, b, c = swarm_factory([0], cfg), swarm_factory([1], cfg), swarm_factory([2, 3], cfg)
    _round_all([a, b, c])
    c.sync.shutdown()
    for peer in (a, b):
        peer.sync.start_round(step=1, tokens=100, tokens_since_last=100)
    b.sync.leave_soon()  # b is stopping too: its pending round still ends and is applied, its ownership stays
    reports = [peer.sync.finish_round(block=True) for peer in (a, b)]
    assert reports[1].adopted == [] and set(b.model.owned_experts) == {1}, reports[1]
    assert set(reports[0].adopted) <= {2, 3}, reports[0]  # a stays: it may adopt (the rule may name b instead)


def test_finished_peer_leaves_without_making_the_others_adopt_its_experts(swarm_factory, caplog):
    """A peer that completed its fixed-length run marks its record finished when it leaves: the peers still
    running stop counting it but never adopt its experts (nor warn about them) for their last steps,
    even after its record expired; a peer joining later does take them, as experts nobody owns."""
    cfg = _sync_cfg(record_ttl=3.0)
    a, b, c = swarm_factory([0], cfg), swarm_factory([1], cfg), swarm_factory([2, 3], cfg)
    _round_all([a, b, c])
    c.sync.shutdown(finished=True)
    reports = _round_all([a, b])
    assert all(r.group_size == 2 for r in reports), reports
    time.sleep(cfg.record_ttl + 1.5)  # the finished record expired too
    for _ in range(3):  # more than the two reads that adopt a dead peer's experts
        reports = _round_all([a, b])
        assert not any(r.adopted for r in reports), reports
    assert a.swarm.finished_experts() == {2, 3} and sorted(a.model.owned_experts) == [0]
    assert not any("have no owner" in r.getMessage() for r in caplog.records)
    joiner = swarm_factory([0, 1], cfg, auto=True)
    assert sorted(joiner.model.owned_experts) == [2, 3]
    reports = _round_all([a, b])
    assert a.swarm.finished_experts() == set()  # owned again: if its new owner dies, it is adopted as usual


@pytest.mark.unit
def test_record_parsing_refuses_hostile_values():
    from sync.swarm import PeerRecord
    assert PeerRecord.from_value("p", {"experts": [1, 0], "round": 2}, 4).experts == [0, 1]
    for bad in (None, [], {"experts": "0"}, {"experts": [9]}, {"experts": [True]}, {"experts": [0], "round": -1},
                {"experts": [0], "step": 2**70}, {"experts": list(range(5))},
                {"experts": [0], "left": [1]}, {"experts": [], "left": [7]}, {"experts": [], "left": "0"},
                {"experts": [0], "due": [1, float("nan")]}, {"experts": [0], "due": [1, 2.0**60]},
                {"experts": [0], "due": [-1, 5.0]}, {"experts": [0], "due": ["1", 5.0]}, {"experts": [0], "due": [1]}):
        assert PeerRecord.from_value("p", bad, 4) is None, bad
    # A clean leave's tombstone: no experts, the ones it left; it survives the round trip and the DHT's schema.
    from sync.records import check_record_payload
    tombstone = PeerRecord("p", [0, 2])
    tombstone.left, tombstone.experts = tombstone.experts, []
    value = tombstone.to_value()
    assert PeerRecord.from_value("p", value, 4).left == [0, 2] and check_record_payload(value, 4)
    assert not check_record_payload({**value, "experts": [1]}, 4)
    timed = PeerRecord("p", [1], round=3, due=[4, 1.7e9])  # sync.schedule's estimate survives it too
    assert PeerRecord.from_value("p", timed.to_value(), 4).due == [4, 1.7e9] and check_record_payload(timed.to_value(), 4)
    assert not check_record_payload({**timed.to_value(), "due": [4, float("inf")]}, 4)


@pytest.mark.unit
@pytest.mark.parametrize("others, group, answers, cut_off", [
    ((), 1, False, True),          # sees nobody, the run does not answer: cut off
    (("b",), 1, False, True),      # sees a cached record but got nobody's contribution: cut off too
    (("b",), 1, True, False),      # ... while the run answers: alone in this round, not cut off
    (("b",), 2, False, False),     # a contribution came: connected, nobody is asked
    (("left",), 1, False, False),  # only a clean leave's tombstone: its experts are taken over, nobody is asked
])
def test_a_round_without_anyone_s_contribution_asks_whether_the_peer_is_cut_off(others, group, answers, cut_off):
    """A partitioned peer reads records it cached until they expire, one after another; its rounds got nobody's
    contribution. It must count as cut off (adopting nothing) unless the run's initial peers answer."""
    from types import SimpleNamespace

    from sync.report import RoundReport
    from sync.rounds import SparseSync
    from sync.swarm import PeerRecord

    asked = []
    swarm = SimpleNamespace(peer_id="a", rejoined_at=-1e9, reachable=lambda: asked.append(1) or answers)
    peer = SimpleNamespace(swarm=swarm, model=SimpleNamespace(owned_experts=[0]),
                           cfg=SimpleNamespace(record_ttl=10.0))
    peer._others = lambda records: SparseSync._others(peer, records)
    records = {p: PeerRecord(p, [] if p == "left" else [1]) for p in ("a", *others)}
    report = RoundReport(5)
    report.group_size, report.peers_seen = group, len(records)
    kept, _ = SparseSync._checked_read(peer, report, records, None)
    assert kept == records and report.cut_off is cut_off and bool(asked) is (group <= 1 and others != ("left",))


@pytest.mark.unit
def test_least_covered_and_adoption_rules_are_deterministic():
    from sync.swarm import least_covered
    coverage = {0: 2, 1: 0, 2: 1, 3: 0}
    picks = {least_covered(coverage, 2, f"peer{i}")[0] for i in range(20)}
    assert picks == {1, 3}  # ties among the uncovered, spread by peer
    assert sorted(least_covered(coverage, 2, "x")) == [1, 3]
    assert least_covered(coverage, 3, "x")[2] == 2


def test_never_owned_experts_are_adopted_within_each_peers_budget(swarm_factory):
    """Uncovered experts are adopted whether or not anyone ever owned them, by peers with room under the budget
    their records publish (a peer at its budget adopts nothing; this one's budget is its max_owned)."""
    a, b = swarm_factory([0]), swarm_factory([1], _sync_cfg(max_experts_per_peer=1))
    records = a.swarm.peers()
    assert records[b.swarm.peer_id].budget == 1 and records[a.swarm.peer_id].budget == MODEL.num_experts
    assert a.swarm.orphans_to_adopt([0], 4, records) == [2, 3]  # b has no room: a takes both
    assert a.swarm.orphans_to_adopt([0], 2, records) == [2]  # room for one more: the lowest uncovered index
    assert a.swarm.orphans_to_adopt([0], 1, records) == []  # no room left anywhere


def test_three_peers_on_four_experts_train_all_four(swarm_factory):
    """Nobody chose expert 3: one peer adopts it (after two reads agree), takes care of it, and says so in its
    record; from then on every expert is trained."""
    peers = [swarm_factory([0]), swarm_factory([1]), swarm_factory([2])]
    adopted = {}
    for _ in range(3):
        for peer, report in zip(peers, _round_all(peers)):
            if report.adopted:
                adopted[peer.swarm.peer_id] = report.adopted
    assert list(adopted.values()) == [[3]], adopted
    coverage = peers[0].swarm.coverage()
    assert all(len(owners) == 1 for owners in coverage.values()), coverage
    (carer,) = adopted
    assert peers[0].swarm.peers()[carer].caretaking == [3]


@pytest.mark.parametrize("repeat", range(3))
def test_simultaneous_joiners_claim_different_experts_while_some_are_uncovered(swarm_factory, repeat):
    """Four joiners with --experts auto start at the same moment on a 4-expert model whose only peer owns
    expert 0: without claims each picks one of the 3 uncovered experts by its own hash order, and they left one
    uncovered more often than not. With claims, the 3 are taken by 3 different joiners; the 4th replicates."""
    from tests.conftest import LOOPBACK
    from sync.swarm import Swarm, start_dht

    cfg = _sync_cfg(record_ttl=20.0)  # claims settle for min(2 s, ttl / 10): room for DHT stores on busy cores
    first = swarm_factory([0], cfg)
    initial = first.swarm.visible_maddrs()
    swarms: list[Swarm] = []
    try:
        for _ in range(4):
            dht = start_dht(initial, LOOPBACK, run_id="test-run", num_experts=MODEL.num_experts,
                            record_ttl=cfg.record_ttl)
            swarms.append(Swarm(dht, "test-run", MODEL.num_experts, ttl=cfg.record_ttl))
        barrier = threading.Barrier(len(swarms))

        def join(swarm: Swarm) -> list[int]:
            barrier.wait()
            return swarm.choose_auto(1)
        with concurrent.futures.ThreadPoolExecutor(len(swarms)) as pool:
            choices = list(pool.map(join, swarms))
    finally:
        for swarm in swarms:
            swarm.shutdown(withdraw=False)
    taken = [e for choice in choices for e in choice]
    assert {1, 2, 3} <= set(taken), choices


def test_first_peer_alone_cares_for_every_expert_and_hands_them_over(swarm_factory):
    """`--experts auto` on the run's first peer: it trains every expert its budget allows, not just its share; a
    joiner picks among the experts it only takes care of, and it gives those back once they were averaged."""
    first = swarm_factory([0], auto=True)
    assert sorted(first.model.owned_experts) == [0, 1, 2, 3]
    assert first.swarm.peers()[first.swarm.peer_id].caretaking == [1, 2, 3]
    joiner = swarm_factory([0, 0], auto=True)  # two experts chosen from the records
    choice = sorted(joiner.model.owned_experts)
    assert len(choice) == 2 and 0 not in choice, choice  # never the expert the first peer owns for good
    given_back = []
    for _ in range(2):
        reports = _round_all([first, joiner])
        given_back += reports[0].given_back
    assert sorted(given_back) == choice
    remaining = sorted({0, 1, 2, 3} - set(choice))
    assert sorted(first.model.owned_experts) == remaining
    assert first.swarm.peers()[first.swarm.peer_id].caretaking == [e for e in remaining if e != 0]
    assert all(len(owners) == 1 for owners in first.swarm.coverage().values())


def test_without_a_swarm_auto_trains_every_expert(tmp_path):
    from peer.config import load_config, parse_override
    from peer.train import Trainer
    from tests.conftest import REPO

    cfg = load_config(REPO / "configs/tiny.yaml", [parse_override(o) for o in (
        f"run_dir={tmp_path}", "sync.every=0", "sync.experts=auto")])
    assert sorted(Trainer(cfg).model.owned_experts) == [0, 1, 2, 3]
    cfg = load_config(REPO / "configs/tiny.yaml", [parse_override(o) for o in (
        f"run_dir={tmp_path}", "sync.every=0", "sync.experts=auto", "sync.max_experts_per_peer=3")])
    assert sorted(Trainer(cfg).model.owned_experts) == [0, 1, 2]


@pytest.mark.parametrize("compression", ["fp16", "8bit"])
def test_compressed_round_is_close_to_the_exact_mean(swarm_factory, compression):
    cfg = _sync_cfg(compression=compression)
    peers = [swarm_factory([0, 1], cfg), swarm_factory([2, 3], cfg)]
    for i, peer in enumerate(peers):
        _local_training(peer, seed=60 + i)
    shared_before = [_shared(p) for p in peers]
    experts_before = [_experts(p) for p in peers]
    reports = _round_all(peers)
    assert all(r.group_size == 2 and not r.experts_missing for r in reports), reports
    tol = 1e-2 if compression == "fp16" else 5e-2
    for name, value in _shared(peers[0]).items():
        mean = (shared_before[0][name] + shared_before[1][name]) / 2
        assert (value - mean).norm() <= tol * mean.norm() + 1e-6, name
    for name, value in _experts(peers[0])[2].items():
        owner_value = experts_before[1][2][name]
        assert (value - owner_value).norm() <= tol * owner_value.norm(), name
    assert peers[0].sync.bytes_on_wire()["shared"] > 0 and peers[0].sync.bytes_on_wire()["expert"] > 0


def test_sync_state_survives_a_restart(swarm_factory):
    """Round id, DiLoCo's outer anchor and momentum and the caretaking history go through state_dict into a new
    SparseSync (a restarted peer, sync/durable.py), and the restored caretaking is in its published record."""
    cfg = _sync_cfg(outer="nesterov")
    a = swarm_factory([0], cfg, auto=True)   # alone: owns 0, takes care of 1-3 until others own them
    b = swarm_factory([1], cfg)
    for i, peer in enumerate((a, b)):
        _local_training(peer, seed=70 + i)
    reports = _round_all([a, b])
    assert all(r.group_size == 2 for r in reports), reports
    tensors, meta = a.sync.state_dict()
    assert meta["round"] == a.sync.round_id >= 1
    assert any(float(m.abs().sum()) > 0 for m in a.sync.shared.momentum)  # an outer step was taken
    cared = a.sync.ownership.caretaking
    assert 2 in cared and 3 in cared, cared

    restarted = swarm_factory(sorted(a.model.owned_experts), cfg, join=False)
    restarted.sync.load_state_dict(tensors, meta)
    assert restarted.sync.round_id == a.sync.round_id
    assert restarted.sync.ownership.caretaking == [e for e in cared if e in a.model.owned_experts]
    for mine, theirs in zip(restarted.sync.shared.anchor + restarted.sync.shared.momentum,
                            a.sync.shared.anchor + a.sync.shared.momentum):
        assert torch.equal(mine, theirs)
    # Its counter was ahead of the swarm's (say it kept running rounds alone): joining never moves it back.
    restarted.sync.load_state_dict(tensors, dict(meta, round=meta["round"] + 4))
    restarted.sync.join(step=0, tokens=0)
    assert restarted.sync.round_id == a.sync.round_id + 4
    record = restarted.swarm.peers()[restarted.swarm.peer_id]
    assert set(record.caretaking) == set(restarted.sync.ownership.caretaking)


@pytest.mark.parametrize("damage", ["round", "expert", "peer", "shape", "nan"])
def test_malformed_sync_state_is_refused_and_changes_nothing(swarm_factory, damage):
    cfg = _sync_cfg(outer="nesterov")
    peer = swarm_factory([0, 1], cfg, join=False)
    tensors, meta = peer.sync.state_dict()
    meta = dict(meta, round=5, caretaking={"1": ["QmPeer"]})
    if damage == "round":
        meta["round"] = -1
    elif damage == "expert":
        meta["caretaking"] = {"99": []}
    elif damage == "peer":
        meta["last_owners"] = {"0": [7]}
    elif damage == "shape":
        tensors = dict(tensors, **{"shared.anchor.0": torch.zeros(3)})
    else:
        tensors = dict(tensors, **{"shared.momentum.1": torch.full_like(tensors["shared.momentum.1"], float("nan"))})
    anchor = [t.clone() for t in peer.sync.shared.anchor]
    with pytest.raises((KeyError, ValueError, TypeError)):
        peer.sync.load_state_dict(tensors, meta)
    assert peer.sync.round_id == 0 and peer.sync.ownership.caretaking == []
    assert all(torch.equal(x, y) for x, y in zip(anchor, peer.sync.shared.anchor))
