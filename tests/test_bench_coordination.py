"""bench.coordination's model of the coordination traffic: what grows with the peer count and what does not, how
this build's request bounds (sync.dht) change it, from a record measured as signed and hivemind's DHT defaults."""
from __future__ import annotations

import pytest

from bench.coordination import (DhtParams, Requests, Schedule, builds, coordination_row, floor_kb, hivemind_dht_params,
                                main, neighbours_bytes, record_copy_bytes, roster_records)

SCHED = Schedule(interval_s=10.0, progress_poll_s=1.0, wait_s=1.0, wait_poll_s=0.2, heartbeat_s=10.0, lead_s=7.0,
                 idle_poll_s=10.0)
OLD, NEW = Requests("old", 20, 20, 5), Requests("new", 2, 5, 5, scheduled_reads=True)


@pytest.mark.unit
def test_every_visited_holder_answers_with_every_record():
    small, large = (coordination_row(n, 1000, 0, OLD, SCHED) for n in (64, 1000))
    assert small["reads"] == large["reads"] == 10 + 5 + 1  # set by the schedule, not by N
    assert small["kb_per_read"] == 20 * 64 and large["kb_per_read"] == 20 * 1000  # the beam's 20 nodes answer
    assert large["kb"] / small["kb"] == pytest.approx(1000 / 64, rel=0.01)  # linear in N per peer
    assert large["served_kb"] / small["served_kb"] == pytest.approx(999 * 1000 / (63 * 64), rel=1e-9)  # N^2
    assert coordination_row(3, 1000, 0, OLD, SCHED)["kb_per_read"] == 2 * 3  # every other node holds the key
    # The bounds cut a read to two answers and a store's lookup to five: a constant factor, still linear in N.
    new_small, new_large = (coordination_row(n, 1000, 0, NEW, SCHED) for n in (64, 1000))
    assert new_large["kb_per_read"] == 2 * 1000
    assert 8 < large["kb"] / new_large["kb"] < 10 and new_large["kb"] / new_small["kb"] == pytest.approx(1000 / 64,
                                                                                                         rel=0.01)
    # On the rounds' schedule the reader reads every poll only from lead_s before a round to its wait's end.
    assert new_small["reads"] == 5 + 1 + 8 + 2 / 10
    long = Schedule(100.0, 1.0, 1.0, 0.2, 10.0, lead_s=7.0, idle_poll_s=10.0)
    assert coordination_row(64, 1000, 0, OLD, long)["reads"] == 106
    assert coordination_row(64, 1000, 0, NEW, long)["reads"] == pytest.approx(5 + 1 + 8 + 92 / 10)
    # A store that looks up a neighbouring ID (store_near) is not answered with the records.
    probe = Requests("probe", 2, 5, 5, scheduled_reads=True, store_lookup_answers_records=False)
    lighter = coordination_row(1000, 1000, 0, probe, long)
    heavier = coordination_row(1000, 1000, 0, NEW, long)
    stores = 100 / 10 + 1  # the heartbeat's and the announcement's
    assert heavier["kb"] - lighter["kb"] == pytest.approx(stores * 5 * 1000 * 1000 / 1000)  # 5 answers of N records
    # Measured reads and stores (peer.simulate) replace the schedule's.
    assert coordination_row(16, 1000, 0, NEW, SCHED, reads=8, stores=2)["reads"] == 8


@pytest.mark.unit
def test_inputs_come_from_a_signed_record_hivemind_and_sync_dht(capsys):
    assert hivemind_dht_params() == DhtParams(bucket_size=20, num_replicas=5, cache_nearest=1)  # hivemind 1.1.12
    old, new, sharded = builds()
    assert (old.read_visits, old.store_visits) == (20, 20) and (new.read_visits, new.store_visits) == (2, 20)
    assert not old.scheduled_reads and new.scheduled_reads
    assert old.store_lookup_answers_records and not new.store_lookup_answers_records
    assert (new.shard, sharded.shard, sharded.contributors) == (0, 32, 16)  # one key; shards of 32; sync's C
    assert 700 < record_copy_bytes() < 2000  # RSA-2048 key and signature plus the payload
    assert 1000 < neighbours_bytes() < 1500  # 20 node IDs and peer IDs
    assert main(["--peers", "8", "1000", "--interval", "2"]) == 0
    out = capsys.readouterr().out
    assert "| 1000" in out and "goal (10 KB)" in out and "floor at 1000 peers" in out
    with pytest.raises(SystemExit):
        main(["--peers", "1"])


@pytest.mark.unit
def test_a_sharded_roster_keeps_a_peer_s_reads_flat_in_n():
    """sync/roster.py: a read carries a shard (32 to 45 records at the default) and, for the rounds' reads, the
    drawn key (3C records), whatever N is; below a shard's size it is the one key it was."""
    sharded = Requests("sharded", 2, 20, 5, scheduled_reads=True, store_lookup_answers_records=False, shard=32,
                       contributors=16)
    assert roster_records(16, 32, 16) == (16.0, 0.0, 1)  # one key below a shard
    for n in (128, 1000, 20_000):
        in_shard, drawn, levels = roster_records(n, 32, 16)
        assert 32 / 2 ** 0.5 <= in_shard <= 32 * 2 ** 0.5 and drawn == 48 and levels in (2, 3)
    long = Schedule(100.0, 1.0, 1.0, 0.2, 10.0, lead_s=7.0, idle_poll_s=10.0)
    rows = {n: coordination_row(n, 1000, 1160, sharded, long) for n in (128, 1000, 20_000)}
    assert rows[20_000]["kb"] / rows[128]["kb"] < 1.6  # flat in N but for the lookups' hops (log N)
    assert rows[1000]["records_per_read"] < 60 and rows[1000]["kb"] < coordination_row(1000, 1000, 1160, NEW, long)[
        "kb"] / 10


@pytest.mark.unit
def test_a_packed_store_asks_each_node_once_while_the_beams_overlap():
    """sync.hivemind_private.store_near: a record's two or three keys share one lookup, packed into each request
    while a node knows at most two beams of nodes; apart in a larger swarm, as before; routes kept a heartbeat."""
    packed = Requests("packed", 2, 20, 5, scheduled_reads=True, store_lookup_answers_records=False, shard=8,
                      contributors=4, packed_stores=True)
    apart = Requests("apart", 2, 20, 5, scheduled_reads=True, store_lookup_answers_records=False, shard=8,
                     contributors=4)
    long = Schedule(100.0, 1.0, 1.0, 0.2, 10.0, lead_s=7.0, idle_poll_s=10.0)
    small = [coordination_row(32, 1000, 1160, req, long) for req in (packed, apart)]
    assert small[0]["requests"] < small[1]["requests"] / 1.5
    # Apart at 1,000 peers: packed or not, the same lookups but for those the kept routes save (one a heartbeat).
    large = [coordination_row(1000, 1000, 1160, req, long) for req in (packed, apart)]
    assert large[0]["kb"] < large[1]["kb"] and large[0]["requests"] < large[1]["requests"]
    assert large[0]["records_per_read"] == large[1]["records_per_read"]


@pytest.mark.unit
def test_the_floor_is_the_drawn_records_and_two_lookups():
    """What no protocol over this DHT and these records gets below: C + 1 records and two lookups' neighbour
    lists; it grows with N only through the lookups' hops."""
    assert floor_kb(16, 1000, 1160, 16) == pytest.approx(17 + 2 * 1.16 * 15 / 20)  # no hop: the table knows all
    assert floor_kb(1000, 1000, 1160, 16) == pytest.approx(17 + 2 * 7 * 1.16)  # six hops of a 20-bucket lookup
    assert floor_kb(1000, 0, 0, 16) == 0
