"""A follower's shared changes carried into the all-reduce by a peer that joins it (sync/carry.py,
sync/following.py; docs/DESIGN.md "Carried changes"): real DHTs, averagers and expert exchanges on loopback."""
from __future__ import annotations

import time

import torch
from hivemind.p2p import PeerID
from hivemind.utils.streaming import split_for_streaming

from sync.carry import ChangeSender, encode_change
from sync.codec import deserialize_parts, serialize_tensor
from tests.conftest import Peer, local_training, shared_params, allreduce_cfg


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _swarm_with_follower(swarm_factory) -> tuple[Peer, Peer, Peer]:
    cfg = allreduce_cfg(matchmaking_time=4.0, follow_below_mbit=10.0)
    a, b = swarm_factory([0, 1], cfg), swarm_factory([2], cfg)
    home = swarm_factory([3], cfg, bandwidth=5.0)
    assert home.sync.follower
    # The carriers take a change only from a peer their (background) record reader shows as a follower.
    for peer in (a, b):
        _wait(lambda: getattr(peer.sync.progress.others().get(home.swarm.peer_id), "follows", False), 15,
              "the follower's record never reached the reader")
    return a, b, home


def _round(peers: list[Peer], tokens: int = 100) -> list:
    for peer in peers:
        peer.sync.start_round(step=1, tokens=tokens, tokens_since_last=tokens)
    return [peer.sync.finish_round(block=True) for peer in peers]


def _change_arrived(home: Peer, carriers: tuple[Peer, ...]) -> Peer:
    """Wait for the follower's send; the carrier that took it."""
    sender = home.sync._change_sender
    _wait(lambda: not sender.busy(), 20, "the change is still on its way")
    assert sender.sent == 1, "the carrier did not take the change"
    took = [p for p in carriers if p.sync.exchange.carried.received == 1]
    assert len(took) == 1, [p.sync.exchange.carried.received for p in carriers]
    return took[0]


def test_a_followers_change_is_averaged_in_through_its_carrier(swarm_factory):
    """The follower's shared change of round 1 enters round 2's average with its tokens as weight, as if it had
    been in the group (up to 8-bit rounding), while nobody waits for it."""
    a, b, home = _swarm_with_follower(swarm_factory)
    start = shared_params(home)
    for i, peer in enumerate((a, b, home)):
        local_training(peer, seed=40 + i)
    home_change = {k: v - start[k] for k, v in shared_params(home).items()}
    assert [r.group_size for r in _round([a, b])] == [2, 2]  # the public peers' round: nobody waits for home
    _round([home])
    carrier = _change_arrived(home, (a, b))
    other = b if carrier is a else a
    base = shared_params(carrier)  # round 1's average (no training since): the carrier's last synced value
    for i, peer in enumerate((a, b)):
        local_training(peer, seed=50 + i)
    snap_c, snap_o = shared_params(carrier), shared_params(other)
    reports = _round([a, b])
    assert [r.group_size for r in reports] == [2, 2] and not any(r.rejected for r in reports), reports
    result = shared_params(a)
    for name, value in result.items():
        with_home = (snap_c[name] + snap_o[name] + base[name] + home_change[name]) / 3
        without = (snap_c[name] + snap_o[name]) / 2
        error = float(torch.linalg.vector_norm(value - with_home))
        scale = float(torch.linalg.vector_norm(home_change[name])) / 3
        assert error < 0.05 * scale, (name, error, scale)  # 8-bit rounding of the change, nothing more
        assert float(torch.linalg.vector_norm(value - without)) > 0.2 * scale, name
    assert carrier.sync.exchange.carried.take(carrier.sync.round_id) == []  # folded once, not again


def test_a_carrier_that_averages_with_nobody_holds_the_change_for_its_next_round(swarm_factory):
    """A change folded into an all-reduce that found no partner reached nobody: the carrier holds it again (it
    dropped it before), with all its tokens, for its next round."""
    a, b, home = _swarm_with_follower(swarm_factory)
    for i, peer in enumerate((a, b, home)):
        local_training(peer, seed=70 + i)
    _round([a, b])
    _round([home])
    carrier = _change_arrived(home, (a, b))
    other = b if carrier is a else a
    other.sync.shutdown()  # gone: the carrier's next round averages with nobody
    local_training(carrier, seed=73)
    (report,) = _round([carrier])
    assert report.group_size == 1
    (held,) = carrier.sync.exchange.carried.take(carrier.sync.round_id)
    assert held.sender == home.swarm.peer_id and abs(held.weight - 100) < 1e-6, held.weight


def test_an_out_of_proportion_change_is_refused_and_the_round_goes_on(swarm_factory):
    """A follower's change 1000x an honest one is refused by its carrier (counted as `delta`): the round's average
    is the public peers' own."""
    a, b, home = _swarm_with_follower(swarm_factory)
    with torch.no_grad():
        for _, p in home.model.shared_parameters():
            p.add_(torch.randn_like(p) * 10.0)
    _round([a, b])
    _round([home])
    carrier = _change_arrived(home, (a, b))
    for i, peer in enumerate((a, b)):
        local_training(peer, seed=60 + i)
    snaps = [shared_params(p) for p in (a, b)]
    before = carrier.sync.rejects.counts().get("delta", 0)
    assert [r.group_size for r in _round([a, b])] == [2, 2]
    assert carrier.sync.rejects.counts().get("delta", 0) == before + 1
    for name, value in shared_params(a).items():
        assert torch.allclose(value, (snaps[0][name] + snaps[1][name]) / 2, atol=1e-6), name


def test_a_carrier_refuses_changes_from_peers_that_do_not_follow_and_malformed_ones(swarm_factory):
    a, b, home = _swarm_with_follower(swarm_factory)
    shapes = [p.shape for p in home.sync.shared.params]
    good = [serialize_tensor(torch.zeros(s), 0) for s in shapes]

    def send(sender: Peer, serialized, weight: float = 100.0) -> str | None:
        return sender.sync.exchange.carry_async(PeerID.from_base58(a.swarm.peer_id), 1, weight, serialized,
                                                timeout=20).result(30)

    # Refused: the carrier answers at once and stops reading, so the sender sees the reason or a reset stream.
    assert send(b, good) is not None  # b all-reduces itself: its change must not count twice
    assert a.sync.exchange.carried.received == 0
    malformed = a.sync.rejects.counts().get("malformed", 0)
    assert send(home, good[:-1]) is not None  # a tensor missing
    assert send(home, good[1:] + good[:1]) is not None  # wrong shapes
    assert send(home, [serialize_tensor(torch.full(s, float("nan")), 0) for s in shapes]) is not None
    assert send(home, good, weight=float("inf")) is not None
    assert a.sync.rejects.counts().get("malformed", 0) == malformed + 4
    assert a.sync.exchange.carried.received == 0
    assert send(home, good) is None and a.sync.exchange.carried.received == 1


def test_what_a_send_does_not_carry_goes_with_the_next_one():
    """Error feedback: the 8-bit rounding and a failed send stay with the follower, with their tokens."""
    g = torch.Generator().manual_seed(0)
    delta = [torch.randn(128, 64, generator=g) * 0.01, torch.randn(32, generator=g)]
    serialized, leftover = encode_change(delta)
    decoded = [deserialize_parts(list(split_for_streaming(s))) for s in serialized]
    assert serialized[0].compression != serialized[1].compression  # a small tensor goes 16-bit, not 8-bit
    for d, dec, r in zip(delta, decoded, leftover):
        assert torch.allclose(dec + r, d, atol=1e-7) and float(r.abs().max()) > 0
    sender = ChangeSender()
    total, weight = sender.take(delta, 10.0)
    sender.keep(leftover)
    import concurrent.futures
    failed = concurrent.futures.Future()
    sender.started(failed, decoded, weight)
    failed.set_result("busy")
    total2, weight2 = sender.take([torch.zeros_like(d) for d in delta], 5.0)
    assert weight2 == 15.0
    for t, d in zip(total2, delta):
        assert torch.allclose(t, d, atol=1e-6)  # all of round 1's change, for the next send


def test_a_follower_takes_the_last_result_in_bf16_from_the_exchange(swarm_factory):
    """While a peer follows, the others serve each round's all-reduce result from their expert exchange; the
    follower gets it in bf16 (half the bytes) without asking any averager for its state."""
    a, b, home = _swarm_with_follower(swarm_factory)
    for i, peer in enumerate((a, b, home)):
        local_training(peer, seed=70 + i)
    assert [r.group_size for r in _round([a, b])] == [2, 2]
    average = shared_params(a)
    served_by_averagers = a.sync.shared.bytes_sent() + b.sync.shared.bytes_sent()
    received = home.sync.bytes_received()["shared"]
    report = _round([home])[0]
    assert report.group_size == 1 and "download" in report.timing, report
    for name, value in shared_params(home).items():
        # (live + (downloaded - snapshot) in fp32: exact up to that arithmetic's rounding)
        assert torch.allclose(value, average[name].to(torch.bfloat16).float(), rtol=0, atol=1e-6), name
    assert a.sync.shared.bytes_sent() + b.sync.shared.bytes_sent() == served_by_averagers  # no state download
    fp32_bytes = sum(4 * p.numel() for p in home.sync.shared.params)
    assert home.sync.bytes_received()["shared"] - received < 0.6 * fp32_bytes


def test_fold_weighs_by_tokens_and_bounds_each_changes_pull():
    """The fold is the weighted mean of the carrier's and the followers' changes on the carrier's last
    synchronized value; a change is refused when its pull on the contribution (share x its distance from the
    carrier's own change) exceeds max_ratio x that own change, so a big change with few tokens passes and the
    same change claiming a full round does not."""
    from sync.carry import CarriedChange, fold_changes

    synced = [torch.zeros(4, 4), torch.ones(8)]
    own = [torch.full((4, 4), 0.1), torch.full((8,), 0.1)]
    snapshot = [s + o for s, o in zip(synced, own)]
    follower = [torch.full((4, 4), -0.2), torch.full((8,), 0.3)]
    change = CarriedChange("f", 5, weight=50.0, tensors=follower)
    contribution, total, refused, rest = fold_changes(snapshot, synced, 150.0, [change], max_ratio=4.0)
    assert total == 200.0 and refused == [] and rest == []
    for c, s, o, f in zip(contribution, synced, own, follower):
        assert torch.allclose(c, s + (150 * o + 50 * f) / 200)
    big = [20.0 * o for o in own]  # pull 0.5 x 19 = 9.5x the carrier's own change at equal weights
    assert fold_changes(snapshot, synced, 150.0, [CarriedChange("f", 5, 150.0, big)], 4.0)[2][0][0] == "f"
    assert fold_changes(snapshot, synced, 150.0, [CarriedChange("f", 5, 10.0, big)], 4.0)[2] == []  # 1.2x
    # Two followers: the hostile one is refused, the honest one still folded in at its share of what is left.
    contribution, total, refused, _ = fold_changes(
        snapshot, synced, 150.0, [CarriedChange("h", 5, 150.0, big), CarriedChange("f", 5, 50.0, follower)], 4.0)
    assert [r[0] for r in refused] == ["h"] and total == 200.0
    for c, s, o, f in zip(contribution, synced, own, follower):
        assert torch.allclose(c, s + (150 * o + 50 * f) / 200)


def test_a_change_beyond_the_carriers_room_arrives_over_several_rounds():
    """A change folded in whole put its carrier's parts 6.6-6.8x the median distance away in bench.wan, and a
    reducer dropped them. With a room (the carrier's distance from the last average x FOLD_ROOM) only a fraction
    of its tokens is folded, so each tensor moves by at most the room; the rest (same tensors, the rest of the
    tokens) is held again for the next round, merged with a newer change of the same sender, and nothing is lost."""
    from sync.carry import CarriedChange, CarryInbox, fold_changes
    from sync.validate import RejectCounter

    synced = [torch.zeros(4, 4), torch.ones(8)]
    own = [torch.full((4, 4), 0.1), torch.full((8,), 0.1)]
    snapshot = [s + o for s, o in zip(synced, own)]
    follower = [torch.full((4, 4), 0.7), torch.full((8,), -0.5)]  # 3 rounds' worth, far from the carrier's own
    room = [0.5, 0.5]
    change = CarriedChange("f", 5, weight=150.0, tensors=follower)
    contribution, total, refused, rest = fold_changes(snapshot, synced, 150.0, [change], 4.0, room)
    assert refused == [] and len(rest) == 1
    folded = total - 150.0
    assert 0 < folded < 150.0 and abs(rest[0].weight - (150.0 - folded)) < 1e-6  # the tokens add up
    assert rest[0].tensors is follower and rest[0].sender == "f" and rest[0].round_id == 5
    for c, s_, r in zip(contribution, snapshot, room):
        assert float(torch.linalg.vector_norm(c - s_)) <= r * 1.0001
    for c, s, o, f in zip(contribution, synced, own, follower):  # still the weighted mean, of fewer tokens
        assert torch.allclose(c, s + (150 * o + folded * f) / total)
    # A change out of all proportion is still refused whole, room or not.
    huge = [1000.0 * f for f in follower]
    assert fold_changes(snapshot, synced, 150.0, [CarriedChange("h", 5, 150.0, huge)], 4.0, room)[2][0][0] == "h"
    # The rest with the sender's next change spans more rounds of tokens than one: its bound grows with them.
    backlog = CarriedChange("f", 6, 300.0, [1.5 * f for f in follower])
    assert fold_changes(snapshot, synced, 150.0, [backlog], 4.0, room)[2] == []
    assert fold_changes(snapshot, synced, 150.0, [CarriedChange("f", 6, 150.0, backlog.tensors)], 4.0, room)[2]
    # Without a room (no average yet) or with room to spare, the whole change goes in at once.
    assert fold_changes(snapshot, synced, 150.0, [change], 4.0)[3] == []
    assert fold_changes(snapshot, synced, 150.0, [change], 4.0, [100.0, 100.0])[3] == []

    inbox = CarryInbox(RejectCounter())
    newer = CarriedChange("f", 7, 100.0, [torch.ones(4, 4), torch.ones(8)])
    inbox._held["f"] = newer  # arrived while the round ran
    inbox.put_back(rest)
    (held,) = inbox.take(8)
    assert held.round_id == 7 and abs(held.weight - (rest[0].weight + 100.0)) < 1e-6
    mean = (rest[0].weight * follower[0] + 100.0 * 1.0) / held.weight  # each keeps its tokens x change
    assert torch.allclose(held.tensors[0], mean)


def test_followers_with_nobody_to_follow_all_reduce_among_themselves(swarm_factory):
    """Every live peer follows (a swarm of home lines all below sync.follow_below_mbit): nobody would serve a
    result or carry a change, and their shared tensors would never be averaged. They all-reduce among themselves
    instead, each waiting for all of them, until a peer that averages turns up."""
    cfg = allreduce_cfg(matchmaking_time=4.0, follow_below_mbit=10.0)
    homes = [swarm_factory([e], cfg, bandwidth=5.0) for e in range(2)]
    assert all(h.sync.follower for h in homes)
    for h in homes:
        _wait(lambda h=h: len(h.sync.progress.others()) == 1, 15, "the other record never reached the reader")
    for i, peer in enumerate(homes):
        local_training(peer, seed=60 + i)
    before = [shared_params(h) for h in homes]
    reports = _round(homes)
    assert [r.group_size for r in reports] == [2, 2] and not any(r.rejected for r in reports), reports
    for h in homes:
        assert h.sync.follower  # still followers: they follow again once a peer that averages is there
        for name, value in shared_params(h).items():
            # (declared slow uplinks send their parts fp16: rounding of about 1e-5 here, the changes are 1e-2)
            torch.testing.assert_close(value, (before[0][name] + before[1][name]) / 2, rtol=1e-3, atol=1e-4)
        assert h.sync._change_sender.take([torch.zeros(1)], 0.0)[1] == 0.0  # nothing kept to send again


def test_a_follower_whose_download_failed_sends_only_its_new_change_next(swarm_factory, monkeypatch):
    """A follower round whose download failed keeps the local tensors; the change it sent (or holds) must not be
    counted again in the next round's change (its base moves to that round's snapshot)."""
    a, b, home = _swarm_with_follower(swarm_factory)
    monkeypatch.setattr(home.sync, "_download_result", lambda sources: None)
    start = shared_params(home)
    local_training(home, seed=70)
    first = {k: v - start[k] for k, v in shared_params(home).items()}
    _round([home])
    _change_arrived(home, (a, b))
    middle = shared_params(home)
    local_training(home, seed=71)
    second = {k: v - middle[k] for k, v in shared_params(home).items()}
    home.sync.shared.take_snapshot()
    with torch.no_grad():
        names = [n for n, _ in home.model.shared_parameters()]
        delta = [s - r for s, r in zip(home.sync.shared.snapshot, home.sync.shared.synced)]
    for name, d in zip(names, delta):
        torch.testing.assert_close(d, second[name], rtol=1e-5, atol=1e-6)
        assert float(torch.linalg.vector_norm(first[name])) > 0


@torch.no_grad()
def _move_experts(peer: Peer, seed: int, times: float = 1.0) -> None:
    """Move the peer's owned experts by `times` steps along the direction of `seed` (1e-4 per element: a relative
    change of about 0.5 % per step, as real training's). Real training keeps a direction for a while, so its
    steps add up: the same seed again continues it (random noise per round would grow only as the square root)."""
    g = torch.Generator().manual_seed(seed)
    for e in sorted(peer.model.owned_experts):
        for bank in peer.model.expert_banks():
            for name in ("gate_up_proj", "down_proj"):
                t = getattr(bank.bank[e], name)
                t.add_(torch.randn(t.shape, generator=g) * 1e-4 * times)


def test_a_faster_owners_copy_spanning_its_steps_is_taken_not_refused(swarm_factory):
    """A follower joins no group, so it trains on while the others wait for theirs: its experts' copies then span
    more of its steps than one of the receivers' rounds (bench runs: 80 steps to their 10). Such a copy is taken,
    its allowed change widened by the steps its owner's signed record says it trained since the last copy taken
    (up to OWNER_PACE_CAP times this peer's own rounds); beyond that cap it is refused."""
    from sync.fetch import OWNER_PACE_CAP
    a, b, home = _swarm_with_follower(swarm_factory)

    def rounds(peers: list[Peer], step: int) -> list:
        for peer in peers:
            peer.sync.start_round(step=step, tokens=100, tokens_since_last=100)
        return [peer.sync.finish_round(block=True) for peer in peers]

    def delta_refusals() -> list[int]:
        return [p.sync.rejects.counts().get("delta", 0) for p in (a, b)]

    for seed, peer in enumerate((a, b, home)):
        _move_experts(peer, seed=seed)
    rounds([a, b, home], step=1)  # everyone takes the others' copies of step 1
    for step in range(2, 10):  # the follower trains 8 rounds ahead of the others, in one direction
        _move_experts(home, seed=2)
        rounds([home], step=step)
    _wait(lambda: a.sync.progress.others().get(home.swarm.peer_id).step == 9, 15, "home's record of step 9")
    for seed, peer in enumerate((a, b), start=10):
        _move_experts(peer, seed=seed)
    before = delta_refusals()
    reports = rounds([a, b], step=2)
    assert delta_refusals() == before and all(3 in r.experts_synced for r in reports), reports
    for peer in (a, b):
        for bank, home_bank in zip(peer.model.expert_banks(), home.model.expert_banks()):
            torch.testing.assert_close(bank.bank[3].down_proj.float(), home_bank.bank[3].down_proj.float(),
                                       rtol=1e-2, atol=1e-4)
    # A claimed pace is believed up to OWNER_PACE_CAP times this peer's own: a record 100 rounds on whose copy moved
    # 6 x OWNER_PACE_CAP rounds' worth is refused (it would pass at the 100 rounds the record claims).
    _move_experts(home, seed=2, times=6 * OWNER_PACE_CAP)
    rounds([home], step=109)
    _wait(lambda: a.sync.progress.others().get(home.swarm.peer_id).step == 109, 15, "home's record of step 109")
    for seed, peer in enumerate((a, b), start=20):
        _move_experts(peer, seed=seed)
    reports = rounds([a, b], step=3)
    assert delta_refusals() == [n + 1 for n in before] and not any(3 in r.experts_synced for r in reports), reports
