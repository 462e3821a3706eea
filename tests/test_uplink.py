"""Measuring a peer's upload with a probe (sync/uplink.py; docs/DESIGN.md, "Uneven links"): what a sink counts,
its limits against abuse, and what a peer does with a slow result. The rate itself is measured on a real
rate-limited link in tests/test_netns.py."""
from __future__ import annotations

import asyncio
import time

from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer

from sync.uplink import COOLDOWN, FAST_UPLINK_MBIT, MAX_SINK_BYTES, UplinkSink, measure_upload
from tests.conftest import round_all, allreduce_cfg


def test_probe_between_real_peers_gives_a_rate_and_the_sink_limits_each_sender(swarm_factory):
    a = swarm_factory([0], allreduce_cfg())
    b = swarm_factory([1], allreduce_cfg())
    c = swarm_factory([2], allreduce_cfg())  # sees a and b at join: probes them in the background
    deadline = time.monotonic() + 20
    while c.sync.measured_upload is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert c.sync.measured_upload is not None and c.sync.measured_upload > 20  # loopback: far above 20
    assert c.sync.shared.averager.bandwidth == FAST_UPLINK_MBIT  # equal shares among fast peers
    # Each sender once per COOLDOWN: a second probe at once finds both sinks busy.
    assert c.sync.exchange.measure_upload([a.sync.exchange.peer_id, b.sync.exchange.peer_id]) is None
    assert COOLDOWN >= 10


def test_sink_reads_no_more_than_its_cap_and_answers_busy_beyond_its_concurrency():
    async def scenario() -> None:
        sink = UplinkSink()
        chunk = runtime_pb2.ExpertRequest(metadata=b"x" * 65536)

        async def endless():
            while True:
                yield chunk
                await asyncio.sleep(0)

        answer = MSGPackSerializer.loads((await sink.absorb(endless(), PeerID(b"a" * 34))).metadata)
        assert answer == {"received": MAX_SINK_BYTES}

        gate = asyncio.Event()

        async def held():
            yield chunk
            await gate.wait()

        first = asyncio.create_task(sink.absorb(held(), PeerID(b"b" * 34)))
        second = asyncio.create_task(sink.absorb(held(), PeerID(b"c" * 34)))
        await asyncio.sleep(0.05)
        third = MSGPackSerializer.loads((await sink.absorb(held(), PeerID(b"d" * 34))).metadata)
        assert third == {"error": "busy"}
        gate.set()
        for task in (first, second):
            assert MSGPackSerializer.loads((await task).metadata) == {"received": 65536}
    asyncio.run(scenario())


def test_lying_or_broken_targets_do_not_inflate_the_estimate():
    """A target claiming more than was sent counts as what was sent; malformed or failing ones not at all."""
    async def scenario() -> None:
        async def liar(requests):
            async for _ in requests:
                pass
            return runtime_pb2.ExpertResponse(metadata=MSGPackSerializer.dumps({"received": 10**12}))

        async def garbage(requests):
            return runtime_pb2.ExpertResponse(metadata=b"\xff\x00")

        async def failing(requests):
            raise ConnectionError("gone")

        rate = await measure_upload([liar], nbytes=2**20, seconds=1.0)
        assert rate is not None and rate < 1e5
        assert await measure_upload([garbage, failing], nbytes=2**20, seconds=1.0) is None
    asyncio.run(scenario())


def test_a_slow_measured_uplink_reduces_a_small_part_and_sends_its_parts_fp16(swarm_factory, monkeypatch):
    """What a peer does with a measured rate below sync.slow_uplink_mbit: hivemind gets the rate (its share of
    each all-reduce to reduce shrinks to what the others' 100 leave it) and its parts go fp16; the all-reduce
    still averages, within fp16 precision, at the peers that send and expect full precision, and the slow peer's
    work is in the average (its 8-bit parts were 23-56x the honest spread away and dropped by every reducer)."""
    import torch

    from tests.conftest import local_training, round_all, shared_params

    cfg = allreduce_cfg(slow_uplink_mbit=20.0, follow_below_mbit=0.0)  # 5 Mbit/s would follow by default (below)
    peers = [swarm_factory([e], cfg, join=False) for e in range(3)]
    slow = peers[2]
    for peer, rate in zip(peers, (95.0, 110.0, 5.0)):  # as the probe measured them (tests/test_netns.py)
        monkeypatch.setattr(peer.sync.exchange, "measure_upload", lambda targets, rate=rate: rate)
    for peer in peers:
        peer.sync.join(step=0, tokens=0)  # probes the peers it sees (none for the first: at its next step)
    peers[0].sync._maybe_measure_uplink({p.swarm.peer_id: None for p in peers[1:]})
    deadline = time.monotonic() + 10
    while any(p.sync._probing or p.sync.measured_upload is None for p in peers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p.sync.shared.averager.bandwidth for p in peers] == [100.0, 100.0, 5.0]
    assert slow.sync.measured_upload == 5.0 and slow.sync._probes_left == 0
    for i, peer in enumerate(peers):
        local_training(peer, seed=i)
    before = [shared_params(p) for p in peers]
    sent = [p.sync.shared.bytes_sent() for p in peers]
    reports = round_all(peers)
    assert all(r.group_size == 3 for r in reports), reports
    mean = {n: sum(b[n] for b in before) / 3 for n in before[0]}
    without_slow = {n: (before[0][n] + before[1][n]) / 2 for n in before[0]}
    for peer in peers:
        for name, value in shared_params(peer).items():
            error = float((value - mean[name]).abs().max())
            assert error < 1e-3, name  # fp16 rounds each value to 2^-11 of itself
            assert error < 0.1 * float((without_slow[name] - mean[name]).abs().max()), name
    # The slow peer reduced nothing and sent its whole vector as inputs, in fp16: half its fp32 bytes, where the
    # fast peers sent over a full copy each (inputs plus their part's results).
    fp32 = slow.sync.shared.payload_bytes()
    slow_sent = slow.sync.shared.bytes_sent() - sent[2]
    assert slow_sent <= 0.5 * fp32, (slow_sent, fp32)
    assert all(p.sync.shared.bytes_sent() - s > 0.9 * fp32 for p, s in zip(peers[:2], sent[:2]))


def test_parts_keep_their_layout_when_a_slow_uplink_switches_codec():
    """hivemind cuts each sender's tensors into parts by its codec's estimated ratio, and a reducer combines the
    senders' part i: a peer whose parts go fp16 must still cut them like the others (with 8-bit parts it cut 4x
    larger ones and stalled every all-reduce it joined)."""
    import torch
    from hivemind.averaging.partition import TensorPartContainer
    from hivemind.compression import NoCompression

    from sync.shared import CountingCompression, WireCounter

    tensors = [torch.randn(70_000), torch.randn(300, 200)]
    plain = CountingCompression(NoCompression(), WireCounter(), switchable=True)
    slow = CountingCompression(NoCompression(), WireCounter(), switchable=True)
    slow.use_slow_codec(True)

    def layout(compression):
        container = TensorPartContainer(tensors, peer_fractions=(0.5, 0.5), compression=compression,
                                        part_size_bytes=2**16)
        return [[part.shape for part in container.get_raw_input_parts(i)] for i in range(2)]

    assert layout(slow) == layout(plain) and len(layout(plain)[0]) > 2
    info = TensorPartContainer(tensors, peer_fractions=(0.5, 0.5), compression=slow, part_size_bytes=2**16)
    part, part_info = info._input_parts_by_peer[0][0]
    assert len(slow.compress(part, part_info).buffer) == len(plain.compress(part, part_info).buffer) / 2


def _joined_with_readings(swarm_factory, monkeypatch, readings: list[list[float]]) -> list:
    """Peers whose probes read `readings[i]` in turn (the last one from then on), joined; returns once the last
    peer's first reading is in."""
    cfg = allreduce_cfg(matchmaking_time=4.0)
    peers = [swarm_factory([e], cfg, join=False) for e in range(len(readings))]
    for peer, rates in zip(peers, readings):
        monkeypatch.setattr(peer.sync.exchange, "measure_upload",
                            lambda targets, rates=rates: rates.pop(0) if len(rates) > 1 else rates[0])
    for peer in peers:
        peer.sync.join(step=0, tokens=0)
    last = peers[-1].sync
    deadline = time.monotonic() + 10
    while (last._probing or last.measured_upload is None) and time.monotonic() < deadline:
        time.sleep(0.05)
    return peers


def test_a_measured_uplink_below_follow_below_mbit_follows(swarm_factory, monkeypatch):
    """A 5 Mbit/s uplink, measured (nobody declared it), makes the peer a follower at once (sync.follow_below_mbit,
    20 by default): its record says so, and the others' next round neither waits for it nor counts it. A second
    reading, below it too, confirms it."""
    import sync.uplink

    monkeypatch.setattr(sync.uplink, "CONFIRM_AFTER", 0.0)  # (the sinks' cooldown is 30 s: stubbed out here)
    peers = _joined_with_readings(swarm_factory, monkeypatch, [[95.0], [110.0], [5.0]])
    home = peers[2].sync
    # One reading: it follows, and its record is stored at once; a second probe, between rounds, decides.
    assert home.follower and home._probes_left == 1 and home._reprobe_at is None
    assert not peers[0].sync.follower and not peers[1].sync.follower
    records = peers[0].swarm.peers()
    assert records[peers[2].swarm.peer_id].follows and not records[peers[1].swarm.peer_id].follows
    started = time.monotonic()
    for peer in peers[:2]:
        peer.sync.start_round(step=1, tokens=10, tokens_since_last=10)
    assert [p.sync.finish_round(block=True).group_size for p in peers[:2]] == [2, 2]
    assert time.monotonic() - started < 4.0  # not the matchmaking time spent waiting for the follower
    home.note_step(steps_since_round=1)  # the confirming probe, at a step between rounds
    deadline = time.monotonic() + 10
    while (home._probing or home._probes_left) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert home.follower and home.unfollow_why is None and home._reprobe_at is not None  # confirmed


def test_a_slow_reading_from_one_probe_target_is_measured_again_before_following(swarm_factory, monkeypatch):
    """A reading from one target is the slower of this uplink and that target's download: a public peer whose only
    target was a home peer read 4.6 Mbit/s. It does not follow on it; it takes a small share meanwhile, and the
    next reading decides (below: it follows; at or above: it never followed)."""
    import sync.uplink

    monkeypatch.setattr(sync.uplink, "CONFIRM_AFTER", 0.0)  # (the sinks' cooldown is 30 s: stubbed out here)
    peers = _joined_with_readings(swarm_factory, monkeypatch, [[95.0], [4.6, 4.0]])
    home = peers[1].sync
    assert not home.follower and home._unsure_slow and home._probes_left == 1 and home.bandwidth == 4.6
    assert not peers[0].swarm.peers()[peers[1].swarm.peer_id].follows
    home.note_step(steps_since_round=1)  # the second probe, at a step between rounds
    deadline = time.monotonic() + 10
    while (home._probing or home._probes_left) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert home.follower and home.measured_upload == 4.0  # two slow readings: it follows


def test_a_slow_reading_from_one_probe_target_that_the_next_does_not_confirm_never_follows(swarm_factory,
                                                                                           monkeypatch):
    import sync.uplink

    monkeypatch.setattr(sync.uplink, "CONFIRM_AFTER", 0.0)
    fast = _joined_with_readings(swarm_factory, monkeypatch, [[95.0], [4.6, 90.0]])[1].sync
    assert not fast.follower and fast._unsure_slow
    fast.note_step(steps_since_round=1)
    deadline = time.monotonic() + 10
    while (fast._probing or fast._probes_left) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not fast.follower and fast.measured_upload == 90.0


def test_a_first_slow_reading_that_the_second_does_not_confirm_ends_following(swarm_factory, monkeypatch):
    """A fast uplink whose first probe read low (it shared the line with the first round, say) follows from that
    reading until the second: then, at or above sync.follow_below_mbit, it joins the all-reduce again at its next
    round (one fast reading is enough: a busy line reads low, never high), and its record says so at once."""
    import sync.uplink

    monkeypatch.setattr(sync.uplink, "CONFIRM_AFTER", 0.0)  # (the sinks' cooldown is 30 s: stubbed out here)
    peers = _joined_with_readings(swarm_factory, monkeypatch, [[95.0], [110.0], [4.4, 90.0]])
    home = peers[2].sync
    deadline = time.monotonic() + 10
    assert home.follower and home._probes_left == 1
    home.note_step(steps_since_round=1)
    while (home._probing or home._probes_left) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert home.unfollow_why is not None and home.measured_upload == 90.0
    deadline = time.monotonic() + 10  # stored from the probe's thread: the others' next round expects it
    while peers[0].swarm.peers()[peers[2].swarm.peer_id].follows and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not peers[0].swarm.peers()[peers[2].swarm.peer_id].follows
    reports = round_all(peers)
    assert [r.group_size for r in reports] == [3, 3, 3], reports
    assert not home.follower and home._reprobe_at is None


def test_a_failed_probe_waits_out_the_sinks_cooldown_before_the_next_attempt(swarm_factory, monkeypatch):
    """A target that took a push counts its sender for the sinks' cooldown and answers busy until then: the next
    attempt waits that long (three attempts one round apart all failed so, and the peer never measured)."""
    import sync.uplink

    monkeypatch.setattr(sync.uplink, "CONFIRM_AFTER", 0.6)
    peers = [swarm_factory([e], allreduce_cfg(), join=False) for e in range(2)]
    readings = [None, 50.0]
    monkeypatch.setattr(peers[1].sync.exchange, "measure_upload", lambda targets: readings.pop(0))
    for peer in peers:
        peer.sync.join(step=0, tokens=0)
    home = peers[1].sync
    deadline = time.monotonic() + 10
    while (home._probing or len(readings) == 2) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert home.measured_upload is None and home._probes_left == sync.uplink.MAX_PROBES - 1
    home.note_step(steps_since_round=1)  # between rounds, but within the cooldown: no attempt
    assert not home._probing and readings == [50.0]
    time.sleep(0.7)
    home.note_step(steps_since_round=1)
    while (home._probing or home.measured_upload is None) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert home.measured_upload == 50.0 and readings == []


def test_rounds_wait_for_the_first_reading_while_its_probe_runs(swarm_factory, monkeypatch):
    """A peer whose first probe is still running trains on instead of starting a round (a slow uplink in that
    round's group would set its pace for everyone); once the reading is in, the round is due."""
    import threading

    import sync.uplink

    peers = [swarm_factory([e], allreduce_cfg(), join=False) for e in range(2)]
    release = threading.Event()

    def slow_probe(targets):
        release.wait(10)
        return 50.0

    monkeypatch.setattr(peers[1].sync.exchange, "measure_upload", slow_probe)
    for peer in peers:
        peer.sync.join(step=0, tokens=0)
    home = peers[1].sync
    assert home._probing and home._measuring_first()
    assert not home.round_due(home.cfg.every) and not home.round_due(home.cfg.every + 50)
    release.set()
    deadline = time.monotonic() + 10
    while home._probing and time.monotonic() < deadline:
        time.sleep(0.02)
    assert home.measured_upload == 50.0 and not home._measuring_first()
    assert home.round_due(home.cfg.every)
    monkeypatch.setattr(sync.uplink, "FIRST_READING_WAIT", 0.0)  # and the wait is bounded
    home._probing, home.measured_upload = True, None
    assert not home._measuring_first()
    home._probing = False


def test_a_measured_follower_measures_again_and_joins_the_allreduce_once_its_uplink_is_fast(swarm_factory,
                                                                                                monkeypatch):
    """A follower whose uplink was measured measures it again (sync.follower_reprobe_s): a slow reading keeps it
    following; two fast ones in a row and it joins the all-reduce from its next round, its record no longer says
    it follows, and the part of its changes that no carrier took goes into its contribution (none is lost)."""
    import torch

    import sync.uplink
    from tests.conftest import local_training, round_all, shared_params

    monkeypatch.setattr(sync.uplink, "CONFIRM_AFTER", 0.0)  # (the sinks' cooldown is 30 s: stubbed out here)
    cfg = allreduce_cfg(matchmaking_time=4.0, follower_reprobe_s=0.3)
    peers = [swarm_factory([e], cfg, join=False) for e in range(3)]
    rates = [95.0, 110.0, 5.0]
    for i, peer in enumerate(peers):
        monkeypatch.setattr(peer.sync.exchange, "measure_upload", lambda targets, i=i: rates[i])
    for peer in peers:
        peer.sync.join(step=0, tokens=0)
    home = peers[2].sync

    def probe_at_a_step() -> None:
        deadline = time.monotonic() + 10
        while home._probing and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.35)  # past follower_reprobe_s
        home.note_step(steps_since_round=1)
        while home._probing and time.monotonic() < deadline:
            time.sleep(0.02)

    deadline = time.monotonic() + 10
    while (home._probing or home.measured_upload is None) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert home.follower and home._reprobe_at is None  # following since the first reading
    probe_at_a_step()  # the confirming reading
    assert home.follower and home._reprobe_at is not None
    probe_at_a_step()  # measured again, still 5 Mbit/s: it keeps following and measures later
    assert home.follower and home.unfollow_why is None and home._reprobe_at is not None
    rates[2] = 50.0  # the line got faster (or whatever used it at join stopped)
    probe_at_a_step()
    assert home.follower and home.unfollow_why is None  # one fast reading is not enough
    probe_at_a_step()
    assert home.unfollow_why is not None and home.follower  # it stops following at its next round's start
    deadline = time.monotonic() + 10  # stored now, from the probe's thread: the next round expects it
    while peers[0].swarm.peers()[peers[2].swarm.peer_id].follows and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not peers[0].swarm.peers()[peers[2].swarm.peer_id].follows
    for i, peer in enumerate(peers):
        local_training(peer, seed=i)
    left_behind = [0.002 * torch.randn(p.shape, generator=torch.Generator().manual_seed(9)) for p in home.shared.params]
    home._change_sender.keep(left_behind)  # as a send a carrier refused would leave it
    before = [shared_params(p) for p in peers]
    names = list(before[0])
    reports = round_all(peers)
    assert [r.group_size for r in reports] == [3, 3, 3], reports
    assert not home.follower
    for peer in peers:
        for name, value in shared_params(peer).items():
            mean = (before[0][name] + before[1][name] + before[2][name] + left_behind[names.index(name)]) / 3
            torch.testing.assert_close(value, mean, rtol=1e-5, atol=1e-6)


def test_a_slow_uplink_sends_its_expert_copies_once_a_round(swarm_factory):
    """A peer with a slow uplink (declared here; measured ones alike) sends each of its experts' bf16 copies out
    once in a round of four peers: the first requester gets it, the other two are sent to that holder and get
    the very same values, checked against the owner's digest (sync/copies.py)."""
    import torch

    from dataclasses import replace

    from tests.conftest import MODEL, local_training, round_all

    cfg = allreduce_cfg(slow_uplink_mbit=20.0, follow_below_mbit=0.0)  # it all-reduces too (it would follow by default)
    bf16 = replace(MODEL, frozen_expert_dtype="bfloat16")  # copies asked for in bf16, as by default in peer.run
    peers = [swarm_factory([e], cfg, model_cfg=bf16) for e in range(3)]
    peers.append(swarm_factory([3], cfg, bandwidth=5.0, model_cfg=bf16))
    slow = peers[3]
    assert slow.sync.exchange.pass_copies_on and not peers[0].sync.exchange.pass_copies_on
    for i, peer in enumerate(peers):
        local_training(peer, seed=60 + i)
    sent_before = slow.sync.exchange.bytes_sent["expert"]
    reports = round_all(peers)
    assert all(r.group_size == 4 and not r.experts_missing for r in reports), reports
    trained = {n: t.detach().clone() for n, t in slow.model.expert_tensors(3).items()}
    one_copy = sum(t.numel() * 2 for t in trained.values())  # bf16
    assert slow.sync.exchange.bytes_sent["expert"] - sent_before == one_copy
    assert slow.sync.exchange.redirects["sent"] == 2
    assert sum(p.sync.exchange.redirects["followed"] for p in peers[:3]) == 2
    for peer in peers[:3]:
        for name, value in peer.model.expert_tensors(3).items():
            assert torch.equal(value, trained[name].to(value.dtype)), name
        assert peer.sync.rejects.total() == 0
