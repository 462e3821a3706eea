"""The roster in shards (sync/roster.py), without a DHT: levels from an estimate, the two levels a record is
stored at against the one a peer reads, the median estimate, the hold after a move, counts robust to reads that
missed records, a joiner's jump, and a DHT
node's refusal of a record under a shard its peer ID is not in."""
from __future__ import annotations

import random
import statistics

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

from sync.peer_record import PeerRecord
from sync.records import RunRecordValidator, check_record_payload, peer_id_of_public_key
from sync.roster import (MAX_LEVEL, Roster, drawn_key, read_level, shard_key, shard_prefix, sharded,
                         write_levels)

pytestmark = pytest.mark.unit
RUN = "roster"


def test_a_swarm_smaller_than_a_shard_is_one_key_as_before_sharding():
    for n in range(1, 27):  # below 2^-0.25 x 32: nobody within 0.75 of level 1
        assert read_level(n, 32) == 0 and write_levels(n, 32) == [0] and not sharded(n, 32)
    assert shard_key(RUN, 0, 0) == f"{RUN}_peers"
    assert write_levels(48, 32) == [0, 1] and read_level(1000, 32) == 5 and write_levels(1000, 32) == [4, 5, 6]
    assert write_levels(32 * 2 ** 4.5, 32) == [4, 5] and write_levels(32 * 2 ** 4.1, 32) == [3, 4, 5]
    assert write_levels(20, 32) == [0] and write_levels(30, 32) == [0, 1]
    assert read_level(10**9, 32) == MAX_LEVEL


def test_a_reader_sees_every_writer_of_its_shard_whose_estimate_is_within_a_factor_1_6():
    for shard in (4, 32):
        for reader in range(1, 5000, 7):
            for factor in (0.62, 0.8, 1.0, 1.25, 1.6):
                assert read_level(reader, shard) in write_levels(reader * factor, shard), (reader, factor)


def test_shards_split_a_level_evenly_and_nest():
    peers = [f"peer{i}" for i in range(4000)]
    sizes = [sum(shard_prefix(p, 4) == s for p in peers) for s in range(16)]
    assert min(sizes) > 180 and max(sizes) < 320  # 250 each
    assert all(shard_prefix(p, 5) >> 1 == shard_prefix(p, 4) for p in peers)  # a shard's halves are its children


def _swarm_estimates(n: int, shard: int, rounds: int = 6, sample_drawn: int = 16, seed: int = 0) -> list[float]:
    """Every peer of an n-peer swarm reading its shard and a sample of the swarm's counts (the drawn key's records),
    `rounds` times, as peers do, all starting at once at level 0."""
    rng = random.Random(seed)
    ids = [f"p{i}" for i in range(n)]
    rosters = {p: Roster(RUN, p, shard, settle=0.0) for p in ids}
    for step in range(rounds):
        shards: dict[tuple[int, int], list[str]] = {}  # (level, prefix) -> the peers storing there, this step
        for q in ids:
            for level in write_levels(rosters[q].estimate, shard):
                shards.setdefault((level, shard_prefix(q, level)), []).append(q)
        for p in ids:
            r = rosters[p]
            level = r.level
            mates = shards.get((level, shard_prefix(p, level)), [])
            drawn = rng.sample(ids, min(sample_drawn, n))
            counts = [rosters[q].count for q in set(drawn) - {p}]
            r.update(level, len(set(mates) | {p}), counts, [rosters[q].level for q in drawn], set(), now=step + 1.0)
    return [rosters[p].estimate for p in ids]


def test_a_sharded_swarm_agrees_on_its_size():
    """Shards differ in size, and a peer always finds itself in its own: the median of counts across the swarm
    still puts every peer within 2x of N (the draw's slack) and on neighbouring levels."""
    for n in (64, 300, 1000):
        estimates = _swarm_estimates(n, 32)
        assert all(n / 2 <= e <= 2 * n for e in estimates), (n, min(estimates), max(estimates))
        assert 0.7 * n < statistics.median(estimates) < 1.4 * n
        assert max(read_level(e, 32) for e in estimates) - min(read_level(e, 32) for e in estimates) <= 1


def test_a_move_waits_for_the_hold_and_lowers_no_estimate_during_it():
    r = Roster(RUN, "me", 4, settle=10.0)
    assert r.update(0, 12, [], [], set(), now=0.0)  # 12 peers at level 0: to level 2, read again there
    assert r.level == 2 and r.estimate == 12
    # The new level is still empty (the others' records arrive with their next refresh): kept.
    assert not r.update(2, 1, [], [], set(), now=1.0) and r.level == 2 and r.estimate == 12
    # After the hold a swarm that really shrank brings it down.
    assert r.update(2, 1, [], [], set(), now=11.0) and r.level == 0


def test_a_read_that_missed_records_does_not_lower_the_count_for_a_settle_period():
    r = Roster(RUN, "me", 4, settle=10.0)
    r.level = 2
    r.update(2, 5, [17, 17], [2, 2], set(), now=100.0)
    assert r.count == 17 and r.estimate == 17  # itself + 4 others x 2^2
    # A read under load found 2 of the 5: the count stays what this level showed within the settle period ...
    assert not r.update(2, 2, [17, 17], [2, 2], set(), now=105.0) and r.count == 17 and r.level == 2
    # ... and after it, a shard that really lost its peers is counted as it is.
    r.update(2, 2, [5, 5], [2, 2], set(), now=116.0)
    assert r.count == 5 and r.estimate == 5


def test_a_joiner_finds_a_sharded_swarm_through_the_drawn_peers_levels():
    r = Roster(RUN, "joiner", 32)
    assert r.probes(0)  # its first read found nobody: it reads the drawn key too
    assert r.update(0, 1, [1000, 990, 1010], [5, 5, 4], set(), now=0.0)
    assert r.level == 5


def test_a_drawn_peer_stores_under_the_drawn_key_only_while_the_swarm_is_sharded():
    small, big = Roster(RUN, "a", 32), Roster(RUN, "a", 32)
    big.estimate = 1000.0
    assert drawn_key(RUN) not in small.store_keys(drawn=True)
    assert big.store_keys(drawn=True)[-1] == drawn_key(RUN) and len(big.store_keys(drawn=False)) == 3


def _signed_at(key: rsa.RSAPrivateKey, name: str) -> DHTRecord:
    signer = RunRecordValidator(RUN, num_experts=4, private_key=key)
    der = key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    record = DHTRecord(key=DHTID.generate(source=name).to_bytes(),
                       subkey=MSGPackSerializer.dumps(peer_id_of_public_key(der).to_base58()),
                       value=MSGPackSerializer.dumps({"experts": [1], "round": 1, "step": 1, "tokens": 1, "lvl": 3,
                                                      "est": 500}),
                       expiration_time=get_dht_time() + 20)
    return DHTRecord(record.key, record.subkey, signer.sign_value(record), record.expiration_time)


def test_a_node_stores_a_record_only_under_its_peer_s_own_shard_or_the_drawn_key():
    validator = RunRecordValidator(RUN, num_experts=4)
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    der = key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    prefix = shard_prefix(peer_id_of_public_key(der).to_base58(), 3)
    assert validator.validate(_signed_at(key, shard_key(RUN, 3, prefix)))
    assert validator.validate(_signed_at(key, drawn_key(RUN)))
    assert validator.validate(_signed_at(key, shard_key(RUN, 0, 0)))
    assert not validator.validate(_signed_at(key, shard_key(RUN, 3, (prefix + 1) % 8)))  # another shard's key
    assert not validator.validate(_signed_at(key, f"{RUN}_peers_{MAX_LEVEL + 1}_0"))  # no such level


def test_level_and_count_are_bounded_in_the_schema():
    base = {"experts": [1], "round": 1, "step": 1, "tokens": 1}
    assert check_record_payload({**base, "lvl": 3, "est": 1000}, 4)
    for bad in ({"lvl": 0}, {"lvl": MAX_LEVEL + 1}, {"lvl": "3"}, {"est": 0}, {"est": 2**40}, {"est": 1.5}):
        assert not check_record_payload({**base, **bad}, 4), bad
        assert PeerRecord.from_value("p", {**base, **bad}, 4) is None or bad in ({"lvl": 0}, {"est": 0})
