"""Expert transfer between real hivemind peers on 127.0.0.1 (sync.transfer) and received-tensor checks (sync.validate).

Several DHTs run inside this pytest process, like hivemind's own tests; every DHT and exchange is shut down in
fixtures so no p2pd process outlives the module.
"""
from __future__ import annotations

import asyncio
import time
import uuid

import hivemind
import pytest
import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.streaming import split_for_streaming

from sync.transfer import ExpertExchange
from sync.validate import REJECT_REASONS, RejectCounter, validate_tensors

D_MODEL, HIDDEN = 64, 128


def make_expert(seed: int, layers: int = 2) -> dict[str, torch.Tensor]:
    """Tensors named like SpesMoE.expert_tensors: layer 0 fp32 (owned storage), layer 1 bf16 (frozen storage)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(layers):
        dtype = torch.float32 if layer % 2 == 0 else torch.bfloat16
        out[f"layers.{layer}.gate_up_proj"] = (torch.randn(2 * HIDDEN, D_MODEL, generator=gen) * 0.02).to(dtype)
        out[f"layers.{layer}.down_proj"] = (torch.randn(D_MODEL, HIDDEN, generator=gen) * 0.02).to(dtype)
    return out


@pytest.fixture(scope="module")
def dhts():
    """Three connected DHT peers: A (bootstrap), B and C."""
    started: list[hivemind.DHT] = []
    try:
        started.append(hivemind.DHT(start=True))
        maddrs = started[0].get_visible_maddrs()
        started.append(hivemind.DHT(initial_peers=maddrs, start=True))
        started.append(hivemind.DHT(initial_peers=maddrs, start=True))
        yield started
    finally:
        for dht in started:
            dht.shutdown()
        for dht in started:
            dht.join(timeout=10)


@pytest.fixture
def make_exchange():
    """Factory for exchanges; all of them are shut down after the test even if it fails."""
    created: list[ExpertExchange] = []

    def factory(dht: hivemind.DHT, namespace: str, cls: type = ExpertExchange, **kwargs) -> ExpertExchange:
        exchange = cls(dht, namespace, **kwargs)
        created.append(exchange)
        return exchange

    try:
        yield factory
    finally:
        for exchange in created:
            exchange.shutdown()


def fresh_namespace() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


def test_roundtrip_per_compression(dhts, make_exchange):
    dht_a, dht_b, _ = dhts
    expert = make_expert(0)
    sizes = {}
    for compression in ("none", "fp16", "8bit"):
        ns = fresh_namespace()
        a = make_exchange(dht_a, ns, compression=compression)
        b = make_exchange(dht_b, ns, compression=compression)
        a.publish(5, 3, expert)
        assert a.published(3) == 5 and a.published(4) is None
        got = b.fetch(a.peer_id, 3, 5, timeout=20)
        assert got is not None and set(got) == set(expert)
        for name, ref in expert.items():
            assert got[name].shape == ref.shape and not got[name].requires_grad
            if compression == "none":
                assert got[name].dtype == ref.dtype and torch.equal(got[name], ref)
            elif compression == "fp16":
                torch.testing.assert_close(got[name].to(ref.dtype), ref, rtol=1e-3, atol=1e-5)
            else:
                err = (got[name].float() - ref.float()).norm() / ref.float().norm()
                assert err < 0.1, (name, float(err))
        sent, received = a.bytes_sent["expert"], b.bytes_received["expert"]
        assert sent == received > 0
        sizes[compression] = received
    assert sizes["8bit"] < sizes["fp16"] < sizes["none"], sizes


def test_bf16_copies_are_the_fp32_values_rounded_in_half_the_bytes(dhts, make_exchange):
    """A fetcher that keeps the copy in bf16 asks for it so: the owner sends exactly what the fetcher would have
    stored (fp32 rounded to bf16), in half the bytes; a full-precision fetch of the same entry is still exact,
    whichever form was asked first; codecs already at 16 bits or less are served as configured."""
    dht_a, dht_b, _ = dhts
    expert = {k: v.float() for k, v in make_expert(4).items()}
    for first in ("bf16", "full"):
        ns = fresh_namespace()
        a, b = make_exchange(dht_a, ns), make_exchange(dht_b, ns)
        a.publish(2, 5, expert)
        sizes = {}
        for form in (first, "full" if first == "bf16" else "bf16"):
            before = b.bytes_received["expert"]
            got = b.fetch(a.peer_id, 5, 2, timeout=20, **({"bf16": True} if form == "bf16" else {}))
            assert got is not None and set(got) == set(expert)
            sizes[form] = b.bytes_received["expert"] - before
            for name, ref in expert.items():
                want = ref.to(torch.bfloat16) if form == "bf16" else ref
                assert got[name].dtype == want.dtype and torch.equal(got[name], want), (form, name)
        assert sizes["bf16"] * 2 == sizes["full"], sizes
        # Both forms made: the fp32 snapshot is dropped, each form is still served from its bytes.
        entry = a._store[5][2]
        assert entry.tensors is None and set(entry.serialized) == {False, True}
        assert torch.equal(b.fetch(a.peer_id, 5, 2, timeout=20, bf16=True)["layers.0.down_proj"],
                           expert["layers.0.down_proj"].to(torch.bfloat16))
    # An unknown request key is ignored: served directly, in bf16.
    raw = MSGPackSerializer.dumps({"bf16": True, "via": True, "min_round": 2})
    meta, groups = asyncio.run_coroutine_threadsafe(b._request(a.peer_id, "5@2", raw), b._loop).result(timeout=10)
    assert meta == {"names": list(expert), "round": 2} and [g[0].dtype for g in groups] == ["bfloat16"] * len(expert)
    ns = fresh_namespace()
    a, b = make_exchange(dht_a, ns, compression="fp16"), make_exchange(dht_b, ns, compression="fp16")
    a.publish(2, 5, expert)
    got, plain = b.fetch(a.peer_id, 5, 2, timeout=20, bf16=True), b.fetch(a.peer_id, 5, 2, timeout=20)
    assert got is not None and plain is not None  # the codec's form, not bf16
    assert all(got[n].dtype == plain[n].dtype and torch.equal(got[n], plain[n]) for n in expert)
    for options in ({"bf16": 1}, {"bf16": "yes"}, {"bf16": None}, {"bf16": True, "min_round": -1}):
        raw = MSGPackSerializer.dumps(options)
        meta, _ = asyncio.run_coroutine_threadsafe(b._request(a.peer_id, "5@2", raw), b._loop).result(timeout=10)
        assert meta == {"error": "bad request"}, options


def test_missing_and_keep_rounds(dhts, make_exchange):
    dht_a, dht_b, _ = dhts
    ns = fresh_namespace()
    a = make_exchange(dht_a, ns, keep_rounds=2)
    b = make_exchange(dht_b, ns)
    for round_id in (5, 6, 7):
        a.publish(round_id, 3, make_expert(round_id))
    assert a.published(3) == 7
    t0 = time.monotonic()
    # Round 5 was dropped (only 6 and 7 kept): the owner's newest copy is served instead, never an older one.
    got = b.fetch(a.peer_id, 3, 5, timeout=20)
    assert got is not None and torch.equal(got["layers.0.down_proj"], make_expert(7)["layers.0.down_proj"])
    assert b.fetch(a.peer_id, 3, 8, timeout=20) is None  # not published yet
    assert b.fetch(a.peer_id, 4, 7, timeout=20) is None  # never published
    assert time.monotonic() - t0 < 5.0
    for round_id in (6, 7):
        got = b.fetch(a.peer_id, 3, round_id, timeout=20)
        assert got is not None and torch.equal(got["layers.0.down_proj"], make_expert(round_id)["layers.0.down_proj"])
    assert b.rejects.total() == 0  # "missing" answers are normal, not malformed


def test_min_round_allows_an_owner_one_round_behind(dhts, make_exchange):
    """A fetcher asks for its round; an owner one behind serves its older copy only as far as min_round allows."""
    dht_a, dht_b, _ = dhts
    ns = fresh_namespace()
    a = make_exchange(dht_a, ns)
    b = make_exchange(dht_b, ns)
    a.publish(1, 3, make_expert(1))
    assert b.fetch(a.peer_id, 3, 2, timeout=20) is None  # nothing older than asked by default
    got = b.fetch(a.peer_id, 3, 2, timeout=20, min_round=1)
    assert got is not None and got.round == 1
    assert torch.equal(got["layers.0.down_proj"], make_expert(1)["layers.0.down_proj"])
    assert b.fetch(a.peer_id, 3, 3, timeout=20, min_round=2) is None
    a.publish(2, 3, make_expert(2))
    got = b.fetch(a.peer_id, 3, 2, timeout=20, min_round=1)
    assert got is not None and got.round == 2  # the asked round when it is there
    # Malformed options are a bad request, not a crash or an unbounded answer.
    for options in ({"min_round": -3}, {"min_round": "1"}, {"min_round": True}, [1, 2], b"\xc1" * 300):
        raw = options if isinstance(options, bytes) else MSGPackSerializer.dumps(options)
        meta, _ = asyncio.run_coroutine_threadsafe(b._request(a.peer_id, "3@2", raw), b._loop).result(timeout=10)
        assert meta == {"error": "bad request"}, options
    assert b.rejects.total() == 0


def test_dead_peer_returns_none_within_timeout(dhts, make_exchange):
    dht_a, dht_b, _ = dhts
    ns = fresh_namespace()
    dht_d = hivemind.DHT(initial_peers=dht_a.get_visible_maddrs(), start=True)
    try:
        d = make_exchange(dht_d, ns)
        b = make_exchange(dht_b, ns)
        d.publish(1, 0, make_expert(1))
        assert b.fetch(d.peer_id, 0, 1, timeout=20) is not None
        d.shutdown()
    finally:
        dht_d.shutdown()
        dht_d.join(timeout=10)
    t0 = time.monotonic()
    assert b.fetch(d.peer_id, 0, 1, timeout=3.0) is None
    assert time.monotonic() - t0 < 3.0 + 1.0


def test_20mb_tensor_streams(dhts, make_exchange):
    dht_a, dht_b, _ = dhts
    ns = fresh_namespace()
    a = make_exchange(dht_a, ns)
    b = make_exchange(dht_b, ns)
    big = {"layers.0.gate_up_proj": torch.randn(5 * 2**20)}  # 20 MiB of fp32, far above one p2p message
    a.publish(1, 2, big)
    got = b.fetch(a.peer_id, 2, 1, timeout=30)
    assert got is not None and torch.equal(got["layers.0.gate_up_proj"], big["layers.0.gate_up_proj"])
    assert b.bytes_received["expert"] == 4 * 5 * 2**20


def test_hostile_tensors_are_refused(dhts, make_exchange):
    dht_a, dht_b, _ = dhts
    ns = fresh_namespace()
    a = make_exchange(dht_a, ns)
    b = make_exchange(dht_b, ns)
    reference = make_expert(7)
    reference_before = {k: v.clone() for k, v in reference.items()}
    nan = dict(reference, **{"layers.0.down_proj": torch.full((D_MODEL, HIDDEN), float("nan"))})
    wrong_shape = dict(reference, **{"layers.0.down_proj": torch.zeros(D_MODEL, HIDDEN + 1)})
    huge = dict(reference, **{"layers.1.gate_up_proj": torch.full((2 * HIDDEN, D_MODEL), 1e3)})
    counter = RejectCounter()
    for expert, (payload, reason) in enumerate([(nan, "nonfinite"), (wrong_shape, "shape"), (huge, "norm")]):
        a.publish(1, expert, payload)
        got = b.fetch(a.peer_id, expert, 1, timeout=20)
        assert got is not None  # transfer is fine; validation is the caller's job
        tensors, why = validate_tensors(got, reference)
        assert tensors is None and why == reason
        counter.add(why)
    assert counter.counts() == {r: int(r in ("nonfinite", "shape", "norm")) for r in REJECT_REASONS}
    assert counter.total() == 3
    for name, value in reference.items():
        assert torch.equal(value, reference_before[name])


def test_malformed_requests_do_not_break_server(dhts, make_exchange):
    dht_a, dht_b, _ = dhts
    ns = fresh_namespace()
    a = make_exchange(dht_a, ns)
    b = make_exchange(dht_b, ns)
    a.publish(1, 3, make_expert(3))
    for uid in ("x@y", "", "999999999999999999999@1", "3@1@1", "-3@1", "٣@1", "3@1" * 100):
        future = asyncio.run_coroutine_threadsafe(b._request(a.peer_id, uid), b._loop)
        meta, groups = future.result(timeout=20)
        assert meta == {"error": "bad request"} and groups == [], uid
    assert b.fetch(a.peer_id, 3, 1, timeout=20) is not None


class _HostileExchange(ExpertExchange):
    """Answers every request with the response listed in `self.script` (metadata bytes, tensor parts)."""

    script: list[runtime_pb2.ExpertResponse] = []
    stall_s = 0.0

    async def _serve(self, uid, metadata=b""):
        for message in self.script:
            yield message
        await asyncio.sleep(self.stall_s)


def test_hostile_metadata_gives_none(dhts, make_exchange):
    dht_a, dht_b, _ = dhts
    ns = fresh_namespace()
    a = make_exchange(dht_a, ns, cls=_HostileExchange)
    b = make_exchange(dht_b, ns)
    good_part = list(split_for_streaming(serialize_torch_tensor(torch.ones(4))))
    cases = [
        [runtime_pb2.ExpertResponse(metadata=b"\xc1garbage")],
        [runtime_pb2.ExpertResponse(metadata=MSGPackSerializer.dumps([1, 2]))],
        [runtime_pb2.ExpertResponse(metadata=MSGPackSerializer.dumps({"names": "ab", "round": 1}))],
        [runtime_pb2.ExpertResponse(metadata=MSGPackSerializer.dumps({"names": ["a"], "round": "1"}))],
        [runtime_pb2.ExpertResponse(metadata=MSGPackSerializer.dumps({"names": ["a", "b"], "round": 1})),
         runtime_pb2.ExpertResponse(tensors=good_part)],  # two names, one tensor: incomplete, not counted
        [runtime_pb2.ExpertResponse(metadata=MSGPackSerializer.dumps({"names": ["a"], "round": 0})),
         runtime_pb2.ExpertResponse(tensors=good_part)],  # older than the round asked for
        [runtime_pb2.ExpertResponse(metadata=MSGPackSerializer.dumps({"names": ["a"], "round": 1})),
         runtime_pb2.ExpertResponse(tensors=[runtime_pb2.Tensor(buffer=b"\0" * 12, size=[4], dtype="object")])],
        [runtime_pb2.ExpertResponse(metadata=MSGPackSerializer.dumps({"names": ["a"], "round": 1})),
         runtime_pb2.ExpertResponse(tensors=[runtime_pb2.Tensor(buffer=b"\0" * 12, size=[4], dtype="float32")])],
        [runtime_pb2.ExpertResponse(metadata=MSGPackSerializer.dumps({"names": ["a"], "round": 1})),
         runtime_pb2.ExpertResponse(tensors=[runtime_pb2.Tensor(
             compression=runtime_pb2.UNIFORM_8BIT, buffer=b"\x05" + b"\0" * 40, size=[4], dtype="float32")])],
        [],  # empty stream: our server always answers something, so nothing arrived: incomplete, not counted
    ]
    for i, script in enumerate(cases):
        _HostileExchange.script = script
        assert b.fetch(a.peer_id, 0, 1, timeout=10) is None, i
    # A stream cut short (or empty) is retried once, then given up as a transport failure, not refused as hostile.
    malformed = len(cases) - 2
    assert b.rejects.counts()["malformed"] == malformed
    _HostileExchange.script = [
        runtime_pb2.ExpertResponse(metadata=MSGPackSerializer.dumps({"names": ["a"], "round": 1})),
        runtime_pb2.ExpertResponse(tensors=good_part),
    ]
    got = b.fetch(a.peer_id, 0, 1, timeout=10)
    assert got is not None and torch.equal(got["a"], torch.ones(4))
    # A server that sends everything it announced and then keeps the stream open: the fetch is complete.
    _HostileExchange.stall_s = 60.0
    t0 = time.monotonic()
    got = b.fetch(a.peer_id, 0, 1, timeout=5.0)
    assert got is not None and torch.equal(got["a"], torch.ones(4)) and time.monotonic() - t0 < 3.0
    # One that sends the header and part of it, then stalls: the fetch gives up at its timeout, not later.
    _HostileExchange.script = [
        runtime_pb2.ExpertResponse(metadata=MSGPackSerializer.dumps({"names": ["a", "b"], "round": 1})),
        runtime_pb2.ExpertResponse(tensors=good_part),
    ]
    t0 = time.monotonic()
    assert b.fetch(a.peer_id, 0, 1, timeout=1.0) is None
    assert 1.0 <= time.monotonic() - t0 < 3.0
    assert b.rejects.counts()["malformed"] == malformed  # a slow peer is not a hostile one


def test_a_flooding_answer_is_cut_off_at_what_the_asked_for_tensors_take(dhts, make_exchange):
    """A server answering an expert fetch with well-formed 1 MiB parts without end (a memory flood): the fetcher
    stops reading once the payload passes the response limit its model gives for that expert, refuses the
    answer as malformed, and has buffered no more than the limit and one part. An answer within the limit is
    fetched as before."""
    from sync.rounds import response_limit
    from tests.conftest import MODEL
    from model.model import SpesMoE

    dht_a, dht_b, _ = dhts
    ns = fresh_namespace()
    limit = response_limit(SpesMoE(MODEL))
    a = make_exchange(dht_a, ns, cls=_HostileExchange)
    b = make_exchange(dht_b, ns, response_limit=limit)
    part = list(split_for_streaming(serialize_torch_tensor(torch.ones(2**18)), 2**20))
    assert len(part) == 1
    flood = 64  # MiB offered: far above the tiny expert's limit
    _HostileExchange.script = [runtime_pb2.ExpertResponse(metadata=MSGPackSerializer.dumps(
        {"names": [f"t{i}" for i in range(flood)], "round": 1}))] + [
        runtime_pb2.ExpertResponse(tensors=part) for _ in range(flood)]
    _HostileExchange.stall_s = 0.0
    assert b.fetch(a.peer_id, 0, 1, timeout=20) is None
    assert b.rejects.counts()["malformed"] == 1
    assert limit(0, False) < b.bytes_received["expert"] <= limit(0, False) + 2**20 < flood * 2**20
    expert = {k: v.float() for k, v in SpesMoE(MODEL).expert_tensors(0).items()}
    honest = make_exchange(dht_a, ns + "-honest")
    fetcher = make_exchange(dht_b, ns + "-honest", response_limit=limit)
    honest.publish(1, 0, expert)
    got = fetcher.fetch(honest.peer_id, 0, 1, timeout=20)
    assert got is not None and all(torch.equal(got[k], v) for k, v in expert.items())
    assert sum(v.numel() * 4 for v in expert.values()) <= limit(0, False)


def test_streams_per_requester_are_bounded_and_an_idle_one_is_taken_back(dhts, make_exchange, monkeypatch):
    """A requester holding streams_per_peer responses open gets "busy" for the next at once (it goes on with its
    other sources); a response that sent nothing for SERVE_IDLE_S is ended and its slot taken back."""
    import sync.transfer as transfer

    monkeypatch.setattr(transfer, "SERVE_IDLE_S", 3.0)
    dht_a, dht_b, _ = dhts
    ns = fresh_namespace()
    a = make_exchange(dht_a, ns, cls=_HostileExchange, streams_per_peer=1)
    b = make_exchange(dht_b, ns)
    header = runtime_pb2.ExpertResponse(metadata=MSGPackSerializer.dumps({"names": ["a", "b"], "round": 1}))
    _HostileExchange.script = [header]  # then it stalls: a stream that sends nothing more
    _HostileExchange.stall_s = 60.0

    def request() -> dict:
        return asyncio.run_coroutine_threadsafe(b._request(a.peer_id, "0@1"), b._loop).result(timeout=30)[0]

    stalled = asyncio.run_coroutine_threadsafe(b._request(a.peer_id, "0@1"), b._loop)  # one try, no retry
    deadline = time.monotonic() + 10
    while not a._serving and time.monotonic() < deadline:
        time.sleep(0.05)
    assert request() == {"error": "busy"}
    while a._serving and time.monotonic() < deadline + 10:
        time.sleep(0.2)
    assert not a._serving  # the idle stream was ended
    assert stalled.result(timeout=30)[0] == {"names": ["a", "b"], "round": 1}  # and then nothing: it ended
    assert request() == {"names": ["a", "b"], "round": 1}  # served again


@pytest.fixture(scope="module")
def dht_d(dhts):
    """A fourth DHT peer (an owner and three fetchers)."""
    dht = hivemind.DHT(initial_peers=dhts[0].get_visible_maddrs(), start=True)
    try:
        yield dht
    finally:
        dht.shutdown()
        dht.join(timeout=10)


def test_concurrent_bf16_requesters_each_get_the_owners_copy(dhts, dht_d, make_exchange):
    """Three requesters asking at once for the same bf16 copy each get it from the owner, exactly the fp32 values
    rounded; full-precision fetches of the same entry afterwards are still exact."""
    ns = fresh_namespace()
    owner = make_exchange(dhts[0], ns)
    fetchers = [make_exchange(dht, ns) for dht in (dhts[1], dhts[2], dht_d)]
    expert = make_expert(21)
    owner.publish(3, 7, expert)
    futures = [f.fetch_async(owner.peer_id, 7, 3, timeout=30, bf16=True) for f in fetchers]
    one_copy = sum(t.numel() * 2 for t in expert.values())  # bf16
    for future in futures:
        got = future.result(timeout=40)
        assert got is not None and got.round == 3
        for name, ref in expert.items():
            assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], ref.to(torch.bfloat16)), name
    assert sum(f.rejects.total() for f in fetchers) == 0
    assert owner.bytes_sent["expert"] == 3 * one_copy and sum(f.bytes_sent["expert"] for f in fetchers) == 0
    assert all(torch.equal(f.fetch(owner.peer_id, 7, 3, timeout=20)["layers.0.down_proj"], expert["layers.0.down_proj"])
               for f in fetchers)


def test_a_request_during_serialization_shares_it(dhts, make_exchange, monkeypatch):
    """A request for a form that another request is still serializing waits for that serialization (one job per
    form) and gets the same, complete copy."""
    import sync.transfer

    real, calls = sync.transfer.ExpertExchange._serialize_entry, []

    def slow_serialize(self, entry, bf16):
        calls.append(bf16)
        time.sleep(1.0)
        return real(self, entry, bf16)

    monkeypatch.setattr(sync.transfer.ExpertExchange, "_serialize_entry", slow_serialize)
    ns = fresh_namespace()
    owner, first, second = (make_exchange(dht, ns) for dht in dhts)
    expert = make_expert(23)
    owner.publish(1, 4, expert)
    early = first.fetch_async(owner.peer_id, 4, 1, timeout=20, bf16=True)
    time.sleep(0.5)
    late = second.fetch_async(owner.peer_id, 4, 1, timeout=20, bf16=True)
    for got in (early.result(timeout=30), late.result(timeout=30)):
        assert got is not None
        assert all(torch.equal(got[n], t.to(torch.bfloat16)) for n, t in expert.items())
    assert calls == [True]
    assert first.rejects.total() == second.rejects.total() == 0


def test_fetch_async_two_owners(dhts, make_exchange):
    dht_a, dht_b, dht_c = dhts
    ns = fresh_namespace()
    a = make_exchange(dht_a, ns, compression="fp16")
    c = make_exchange(dht_c, ns, compression="8bit")
    b = make_exchange(dht_b, ns)
    a.publish(4, 1, make_expert(11))
    c.publish(4, 2, make_expert(12))
    futures = [b.fetch_async(a.peer_id, 1, 4, timeout=20), b.fetch_async(c.peer_id, 2, 4, timeout=20)]
    results = [f.result(timeout=30) for f in futures]
    for got, seed in zip(results, (11, 12)):
        assert got is not None
        ok, why = validate_tensors(got, make_expert(seed))
        assert why is None and ok["layers.1.down_proj"].dtype == torch.bfloat16


def test_shutdown_is_idempotent(dhts):
    exchange = ExpertExchange(dhts[0], fresh_namespace())
    exchange.shutdown()
    exchange.shutdown()
    assert not exchange._thread.is_alive()
    assert exchange.fetch_async(exchange.peer_id, 0, 0, timeout=1).result() is None


# ---- validate_tensors unit tests (no network) ----------------------------------------------------------------


def test_validate_ok_casts_to_reference():
    reference = make_expert(1)
    received = {k: v.double() * 1.01 for k, v in reference.items()}
    ok, why = validate_tensors(received, reference)
    assert why is None
    for name, ref in reference.items():
        assert ok[name].dtype == ref.dtype and ok[name].device == ref.device
        torch.testing.assert_close(ok[name].float(), (ref.double() * 1.01).to(ref.dtype).float())


def test_validate_rejections():
    reference = make_expert(2)
    missing = dict(reference)
    del missing["layers.0.down_proj"]
    extra = dict(reference, extra=torch.zeros(1))
    as_int = dict(reference, **{"layers.0.down_proj": torch.zeros(D_MODEL, HIDDEN, dtype=torch.int32)})
    as_bool = dict(reference, **{"layers.0.down_proj": torch.zeros(D_MODEL, HIDDEN, dtype=torch.bool)})
    inf = dict(reference, **{"layers.1.down_proj": torch.full((D_MODEL, HIDDEN), float("inf"), dtype=torch.bfloat16)})
    overflow = dict(reference, **{"layers.0.down_proj": torch.full((D_MODEL, HIDDEN), 1e30)})  # squares overflow
    for received, reason in [(missing, "missing"), (extra, "missing"), (as_int, "dtype"), (as_bool, "dtype"),
                             (inf, "nonfinite"), (overflow, "norm")]:
        assert validate_tensors(received, reference) == (None, reason)


def test_validate_norm_floor_for_zero_reference():
    reference = {"w": torch.zeros(100, 100)}
    assert validate_tensors({"w": torch.full((100, 100), 1e-3)}, reference)[1] is None
    assert validate_tensors({"w": torch.full((100, 100), 1.0)}, reference)[1] == "norm"


def test_reject_counter_rejects_unknown_reason():
    counter = RejectCounter()
    counter.add("norm", 2)
    assert counter.counts()["norm"] == 2 and counter.total() == 2
    with pytest.raises(ValueError):
        counter.add("typo")
