"""Bounds on what a stranger can make a peer hold or compute (docs/DESIGN.md, "Every door bounded"): the record
validator's cheap checks, the DHT's refusal of keys outside the run, responses bounded by the model's own
tensor sizes, and twin identities."""
from __future__ import annotations

import time

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

import sync.records as records
from sync.admission import Admission, generate_organizer_key, load_organizer_public_key, sign_ticket
from sync.peer_record import PeerRecord, twin_started_first
from sync.records import RunRecordValidator, peer_id_of_public_key, peers_key
from sync.validate import RejectCounter

RUN = "doors"
PEERS_KEY = DHTID.generate(source=peers_key(RUN)).to_bytes()


def _signed(key: rsa.RSAPrivateKey, payload: dict, lifetime: float = 20.0) -> DHTRecord:
    """A peer record signed by `key` for its own peer ID, as that peer's node would store it."""
    signer = RunRecordValidator(RUN, num_experts=4, private_key=key)
    der = key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    subkey = MSGPackSerializer.dumps(peer_id_of_public_key(der).to_base58())
    record = DHTRecord(key=PEERS_KEY, subkey=subkey, value=MSGPackSerializer.dumps(payload),
                       expiration_time=get_dht_time() + lifetime)
    return DHTRecord(key=record.key, subkey=record.subkey, value=signer.sign_value(record),
                     expiration_time=record.expiration_time)


PAYLOAD = {"experts": [1], "round": 1, "step": 10, "tokens": 100}


@pytest.mark.unit
def test_a_costly_key_is_refused_before_its_signature_is_checked(monkeypatch):
    rejects = RejectCounter()
    validator = RunRecordValidator(RUN, num_experts=4, rejects=rejects)
    checked: list[bytes] = []
    verify = RunRecordValidator._verify_peer_record

    def counting(self, record, peer_id):
        checked.append(record.subkey)
        return verify(self, record, peer_id)

    monkeypatch.setattr(RunRecordValidator, "_verify_peer_record", counting)
    standard = _signed(rsa.generate_private_key(public_exponent=65537, key_size=2048), PAYLOAD)
    assert validator.validate(standard)
    assert validator.validate(standard) and len(checked) == 1  # the same record again: not verified again
    small_exponent = _signed(rsa.generate_private_key(public_exponent=3, key_size=2048), PAYLOAD)
    assert not validator.validate(small_exponent)
    small_key = _signed(rsa.generate_private_key(public_exponent=65537, key_size=1024), PAYLOAD)
    assert not validator.validate(small_key)
    assert rejects.counts()["record"] == 2


@pytest.mark.unit
def test_a_closed_run_refuses_a_stranger_s_record_before_its_rsa_signature_is_checked(tmp_path, monkeypatch):
    key_path = str(tmp_path / "org.key")
    admission = Admission(load_organizer_public_key(generate_organizer_key(key_path)), RUN)
    validator = RunRecordValidator(RUN, num_experts=4, admission=admission)
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    der = key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    stranger = _signed(key, PAYLOAD)
    ticket = sign_ticket(key_path, RUN, peer_id_of_public_key(der).to_base58(), 1)
    ticketed = _signed(key, {**PAYLOAD, "ticket": ticket})
    signed_messages: list[bytes] = []  # what the RSA verification is asked to check
    message = RunRecordValidator._signed_message

    def counting(record, payload):
        signed_messages.append(record.subkey)
        return message(record, payload)

    monkeypatch.setattr(RunRecordValidator, "_signed_message", staticmethod(counting))
    assert not validator.validate(stranger) and not signed_messages  # no ticket: no RSA work
    assert validator.validate(ticketed) and len(signed_messages) == 1


@pytest.mark.unit
def test_keys_outside_the_run_and_oversized_values_are_refused():
    validator = RunRecordValidator(RUN, num_experts=4)
    junk = DHTRecord(key=DHTID.generate(source="someone-elses-key").to_bytes(), subkey=b"",
                     value=MSGPackSerializer.dumps(b"x" * 1000), expiration_time=get_dht_time() + 365 * 86400)
    assert not validator.validate(junk)
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    assert not validator.validate(_signed(key, {**PAYLOAD, "ticket": b"x" * (records.MAX_VALUE_BYTES + 1)}))


@pytest.mark.unit
def test_a_node_holds_records_of_at_most_max_run_records_peers(monkeypatch):
    monkeypatch.setattr(records, "MAX_RUN_RECORDS", 2)
    validator = RunRecordValidator(RUN, num_experts=4)
    keys = [rsa.generate_private_key(public_exponent=65537, key_size=2048) for _ in range(3)]
    assert validator.validate(_signed(keys[0], PAYLOAD)) and validator.validate(_signed(keys[1], PAYLOAD, 0.5))
    assert not validator.validate(_signed(keys[2], PAYLOAD))  # a third identity: no room
    assert validator.validate(_signed(keys[0], {**PAYLOAD, "round": 2}))  # a peer already held: refreshed
    time.sleep(0.6)  # the second peer's record expired: its place is free
    assert validator.validate(_signed(keys[2], PAYLOAD))


@pytest.mark.unit
def test_of_two_live_processes_with_one_identity_the_later_start_gives_way():
    first, second = ["a" * 16, 100, 1_000], ["b" * 16, 200, 2_000]
    assert twin_started_first(first, second) and not twin_started_first(second, first)
    same_time = ["c" * 16, 300, 1_000]  # started in the same millisecond: the origin decides, the same everywhere
    assert twin_started_first(first, same_time) != twin_started_first(same_time, first)
    assert not twin_started_first(["a" * 16, 100], second)  # an origin without a start time decides nothing
    assert PeerRecord.from_value("p", {**PAYLOAD, "origin": first}, 4).origin == first


@pytest.mark.unit
def test_a_ghost_claiming_a_high_round_moves_no_peers_round():
    """Ghost owners publishing the highest honest round + 3 never delivered a contribution: the swarm's round by
    deeds is the honest peers' (no re-download, no early start), whatever their number."""
    from sync.peer_record import proven_round

    contrib = [10, 100, "0" * 64, 1.0, []]
    honest = {f"h{i}": PeerRecord(f"h{i}", [i], round=10, contrib=contrib) for i in range(3)}
    ghosts = {f"g{i}": PeerRecord(f"g{i}", [0, 1, 2, 3], round=13) for i in range(8)}
    assert proven_round({**honest, **ghosts}, delivered=set(honest)) == 10
    assert proven_round(ghosts, delivered=set(honest)) is None
    # Nothing arrived yet (a joiner): the records that announce a contribution count, not the 8 that only claim.
    assert proven_round({**honest, **ghosts}, delivered=set()) == 10
    assert proven_round(ghosts, delivered=set()) is None


@pytest.mark.unit
def test_a_claimant_that_never_delivered_is_no_owner_after_the_grace_rounds():
    from sync.peer_record import credible_owners

    records = {p: PeerRecord(p, [0]) for p in ("honest", "joiner", "ghost")}
    # Rounds each had to deliver in (surely drawn since first seen, sync.draw.count_chances).
    chances = {"honest": 9, "joiner": 1, "ghost": 8}
    credible = credible_owners(records, delivered={"honest"}, chances=chances, grace=3)
    assert set(credible) == {"honest", "joiner"}  # the joiner's first contribution may still be on its way


@pytest.mark.unit
def test_a_source_is_named_once_a_minute_and_the_map_stays_bounded(monkeypatch):
    import sync.sourcelog as sourcelog

    now = [1000.0]
    monkeypatch.setattr(sourcelog.time, "monotonic", lambda: now[0])
    log = sourcelog.SourceLog(interval=60.0, limit=4)
    assert log.allow("a") and not log.allow("a")
    now[0] += 59.0
    assert not log.allow("a") and log.allow("b")
    now[0] += 1.0
    assert log.allow("a")
    for i in range(10):  # many strangers: the oldest are forgotten, the map never holds more than `limit`
        now[0] += 1.0
        assert log.allow(f"s{i}")
    assert len(log._last) <= 4


@pytest.mark.unit
def test_the_bootstrap_counts_claimants_that_never_contributed_in_three_swarm_rounds():
    from dht_bootstrap.node import SwarmStatus
    from sync.peer_record import unserved_claimants

    contrib = [5, 100, "0" * 64, 1.0, []]
    records = {"honest": PeerRecord("honest", [0], round=5, contrib=contrib),
               "joiner": PeerRecord("joiner", [1], round=5), "ghost": PeerRecord("ghost", [2, 3], round=8)}
    first_seen = {"honest": 1, "joiner": 4, "ghost": 2}
    assert unserved_claimants(records, first_seen, swarm_round=5) == {"ghost"}  # the joiner is 1 round in
    assert unserved_claimants(records, first_seen, swarm_round=None) == set()
    # Drawn about once in N / C rounds (sync/draw.py): 3 records, 1 contributor per round, 3 x 3 rounds of grace.
    assert unserved_claimants(records, first_seen, swarm_round=5, contributors=1) == set()
    assert unserved_claimants(records, first_seen, swarm_round=12, contributors=1) == {"ghost"}
    status = SwarmStatus.from_records(records, num_experts=4, unserved=1)
    assert "1 claiming experts but never contributing" in status.line("run", "abc")
    assert "never contributing" not in SwarmStatus.from_records(records, num_experts=4).line("run", "abc")
