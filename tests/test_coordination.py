"""Coordination (issue "Many peers"): what one read or store of the run's records costs in a real swarm of hivemind
DHT nodes on 127.0.0.1 (every node a request visits that holds the run's key answers with all of its records, so
a read visits READ_BEAM nodes and a store looks up an ID next to the key's, sync.hivemind_private.store_near;
counted at the node's p2p calls, sync.hivemind_private.count_dht_rpcs, not timed), and when the records' reader
reads (sync.progress)."""
from __future__ import annotations

import pytest
from hivemind.utils import get_dht_time

from sync.dht import NUM_REPLICAS, READ_BEAM, read_latest, store_record
from sync.hivemind_private import count_dht_rpcs, dht_rpc_counts
from sync.leave import likely_adopters
from sync.progress import SwarmProgress, reads_hot
from sync.roster import drawn_key, shard_key, shard_prefix
from sync.swarm import PeerRecord, Swarm, adoption_rank, start_dht

RUN = "coordination-test"
PEERS = 12  # well over a read's bound: hivemind's defaults would visit every other node (11)
# hivemind's lookup runs 4 requests at once, so it may visit one node past its beam before it knows the nearest.
OVERSHOOT = 1


@pytest.fixture
def swarms():
    started: list[Swarm] = []
    try:
        for i in range(PEERS):
            initial = [str(m) for m in started[0].dht.get_visible_maddrs()] if started else []
            dht = start_dht(initial, ["/ip4/127.0.0.1/tcp/0"], run_id=RUN, num_experts=PEERS, record_ttl=60.0)
            swarm = Swarm(dht, RUN, PEERS, ttl=60.0)
            started.append(swarm)
            swarm.publish(experts=[i])
        yield started
    finally:
        for swarm in started:
            swarm.shutdown(withdraw=False)


def _delta(swarm: Swarm, before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in dht_rpc_counts(swarm.dht).items()}


def test_a_read_and_a_store_visit_only_the_nodes_they_need(swarms):
    reader = swarms[-1]
    count_dht_rpcs(reader.dht)
    records = {}
    for _ in range(3):  # the last stores may still be reaching their replicas
        before = dht_rpc_counts(reader.dht)
        records = reader.peers()
        spent = _delta(reader, before)
        if len(records) == PEERS:
            break
    assert set(records) == {s.peer_id for s in swarms}
    # Every node knows all others here (no lookup hops): a read asks READ_BEAM of them, each answering with the
    # whole record set.
    assert spent.get("rpc_find requests", 0) <= READ_BEAM + OVERSHOOT, spent
    assert spent.get("rpc_store requests", 0) == 0, spent  # no caching of the read on another node
    one_answer = spent["rpc_find received"] / spent["rpc_find requests"]  # a holder's: every record
    # A store under a key this node has not stored to yet (the drawn key, sync/roster.py) looks it up ...
    before = dht_rpc_counts(reader.dht)
    assert store_record(reader.dht, drawn_key(RUN), reader.peer_id, reader.record.to_value(), get_dht_time() + 60)
    spent = _delta(reader, before)
    assert spent.get("rpc_store requests", 0) <= NUM_REPLICAS, spent
    # ... and the lookup is answered with neighbours only, not with the records (sync.hivemind_private.store_near):
    # hivemind's own lookup of the key would have had every record in each answer.
    assert spent["rpc_find received"] / spent["rpc_find requests"] < one_answer / 4, (spent, one_answer)
    # The swarm's own stores keep a key's nearest nodes for a heartbeat's period (ttl / 3; the fixture's publish
    # found them): no lookup, the same store requests.
    before = dht_rpc_counts(reader.dht)
    reader.publish(round=1)
    spent = _delta(reader, before)
    assert spent.get("rpc_find requests", 0) == 0 and 0 < spent.get("rpc_store requests", 0) <= NUM_REPLICAS, spent
    records = reader.peers()
    assert records[reader.peer_id].round == 1 and len(records) == PEERS


def test_a_record_under_three_keys_is_stored_with_one_lookup(swarms):
    """A sharded peer's record goes under two or three roster levels and maybe the drawn key (sync/roster.py):
    one lookup for them all, and one store request per node however many of the keys it is nearest to."""

    writer = swarms[0]
    count_dht_rpcs(writer.dht)
    me = writer.peer_id
    keys = [drawn_key(RUN)] + [shard_key(RUN, level, shard_prefix(me, level)) for level in (1, 2)]
    value = writer.record.to_value()
    before = dht_rpc_counts(writer.dht)
    assert store_record(writer.dht, keys, me, value, get_dht_time() + 60)
    spent = _delta(writer, before)
    # Every node knows all others here: one lookup visits each of the other PEERS - 1 at most once, each asked for
    # the three keys in one request (three lookups would have made up to three times as many).
    assert spent.get("rpc_find requests", 0) <= PEERS - 1 + OVERSHOOT, spent
    assert spent.get("rpc_store requests", 0) <= PEERS - 1, spent  # at most one per node
    for key in keys:
        found = read_latest(swarms[-1].dht, key)
        assert found is not None and me in found.value, key


# ---- the records' reader on the rounds' schedule (sync.progress), decided without a DHT --------------------------

class _FakeSwarm:
    peer_id = "me"


def _record(peer: str, round_id: int = 5, due: list | None = None, experts=(0,), budget: int = 0) -> PeerRecord:
    return PeerRecord(peer, list(experts), round=round_id, due=due or [], budget=budget)


@pytest.mark.unit
def test_reads_are_hot_near_and_during_rounds_and_when_another_peer_leads():
    lead, now = 7.0, 1000.0
    quiet = [_record("a", 5, [6, now + 60]), _record("b", 5)]
    assert not reads_hot(now, 5, now + 60, quiet, lead, in_round=False)  # mid-interval: idle reads suffice
    assert reads_hot(now, 5, now + 60, quiet, lead, in_round=True)
    assert reads_hot(now, 5, now + 5, quiet, lead, in_round=False)  # its own boundary is near
    assert reads_hot(now, 5, None, quiet, lead, in_round=False)  # no step time yet: as without a schedule
    assert reads_hot(now, 5, now + 60, quiet + [_record("c", 6)], lead, in_round=False)  # c started round 6
    assert reads_hot(now, 5, now + 60, [_record("a", 5, [6, now + 3])], lead, in_round=False)  # a is due soon
    assert not reads_hot(now, 5, now + 60, [_record("a", 4, [5, now + 3])], lead, in_round=False)  # a round it ran


@pytest.mark.unit
def test_the_reader_reads_every_poll_when_hot_every_idle_poll_otherwise_and_once_when_woken():
    progress = SwarmProgress(_FakeSwarm(), poll=1.0, idle_poll=10.0)
    hot = [False]
    progress.hot = lambda: hot[0]
    progress._own_read_at = 100.0
    assert not progress.read_due(100.5)  # read less than a poll ago
    assert not progress.read_due(105.0) and progress.read_due(110.0)  # idle: every idle_poll
    hot[0] = True
    assert progress.read_due(101.0)
    hot[0] = False
    progress.wake()
    assert progress.read_due(100.2)  # a poke reads at once ...
    progress.wake()  # ... at most once per poll, whoever pokes
    assert not progress.read_due(100.3)
    progress.hot = lambda: 1 / 0  # a broken schedule reads as if there were none
    assert progress.read_due(101.5)


@pytest.mark.unit
def test_a_leaver_pokes_the_likely_adopters_of_experts_only_it_owned():
    records = {p: _record(p, experts=[e], budget=2) for p, e in (("a", 1), ("b", 2), ("c", 3), ("d", 4))}
    records["full"] = _record("full", experts=[5, 6], budget=2)  # no room: never an adopter
    chosen = likely_adopters(records, left=[0, 1], num_experts=8)  # 1 is still owned by a: nobody adopts it
    ranked = sorted(["a", "b", "c", "d"], key=lambda p: adoption_rank(p, 0))
    assert chosen == set(ranked[:2])
    assert likely_adopters(records, left=[1], num_experts=8) == set()
    assert likely_adopters({}, left=[0], num_experts=8) == set()
