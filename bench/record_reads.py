"""How a flood of valid peer records costs every read of the run's records (issue "Every door bounded").

    python -m bench.record_reads                 # 4 honest DHT nodes + 1 flooder, 0 and 1,100 flood identities
    python -m bench.record_reads --flood 0 300 1100 --reads 20
    python -m bench.record_reads --closed        # the same in a closed run (organizer key; the flood has no tickets)

Four honest DHT nodes of one run (`sync.swarm.start_dht`, the run's record validator) publish a record each; one
attacker node (bench/adversary_doors.py, the d_records attack's signer) stores `--flood` valid records of fresh
identities. One honest peer then reads the run's records `--reads` times (`Swarm.peers`, as the rounds do) and the
table gives the records per read and milliseconds per read, and what validating the flood's records costs
(`validation_ms`): verifying them the first time, validating them again once verified (what each answering node's
records cost a read), and refusing them in a closed run (no ticket: no RSA check). With `--closed` the honest
nodes run a closed run (an organizer key, a ticket in each honest record) and the flood's identities have none,
as Sybils of an open run would not. The machine should be idle.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

from bench.common import format_table, logger, setup_logging

RUN_ID = "record-reads"
NUM_EXPERTS = 8


def validation_ms(count: int) -> tuple[float, float, float]:
    """Milliseconds for `count` flood records (valid signatures, no ticket) to be: verified the first time by an
    open run's validator, validated again once verified (what every read costs per answering node), and refused
    by a closed run's validator (no ticket: refused before the RSA check)."""
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import get_dht_time
    from hivemind.utils.serializer import MSGPackSerializer

    from bench.adversary_doors import MultiSigner, identities
    from sync.admission import Admission, generate_organizer_key, load_organizer_public_key
    from sync.records import MAX_RUN_RECORDS, RunRecordValidator, peers_key

    signer = MultiSigner(RUN_ID, NUM_EXPERTS, identities(count))
    key, expiration = DHTID.generate(source=peers_key(RUN_ID)).to_bytes(), get_dht_time() + 25
    payload = MSGPackSerializer.dumps({"experts": [1], "round": 1, "step": 0, "tokens": 0})
    records = []
    for peer_id in signer.peer_ids:
        record = DHTRecord(key, MSGPackSerializer.dumps(peer_id), payload, expiration)
        records.append(DHTRecord(record.key, record.subkey, signer.sign_value(record), expiration))

    def timed(validator: RunRecordValidator) -> tuple[float, int]:
        started = time.perf_counter()
        accepted = sum(validator.validate(r) for r in records)
        return (time.perf_counter() - started) * 1000, accepted

    open_run = RunRecordValidator(RUN_ID, NUM_EXPERTS)
    first, accepted = timed(open_run)
    again, _ = timed(open_run)
    with tempfile.TemporaryDirectory() as tmp:
        public = load_organizer_public_key(generate_organizer_key(f"{tmp}/org.key"))
        refused, taken = timed(RunRecordValidator(RUN_ID, NUM_EXPERTS, admission=Admission(public, RUN_ID)))
    assert accepted == min(count, MAX_RUN_RECORDS) and taken == 0, (accepted, taken)
    return first, again, refused


def read_ms(flood: int, reads: int, closed: bool = False) -> tuple[int, float]:
    """(records per read, milliseconds per read) of one honest peer with `flood` flood identities stored; with
    `closed`, in a closed run whose tickets only the honest peers hold."""
    import hivemind
    from hivemind.utils import get_dht_time

    import bench.adversary_doors as doors
    from sync.admission import (Admission, generate_organizer_key, load_organizer_public_key, peer_id_from_identity,
                                sign_ticket)
    from sync.records import peers_key
    from sync.swarm import Swarm, start_dht

    signer = doors.MultiSigner(RUN_ID, NUM_EXPERTS, doors.identities(flood) if flood else [])
    doors._FORKED_IDS[:] = signer.peer_ids  # before the attacker's DHT process forks (adversary_doors)
    nodes, swarms, attacker, initial = [], [], None, []
    with tempfile.TemporaryDirectory() as tmp:
        public = load_organizer_public_key(generate_organizer_key(f"{tmp}/org.key")) if closed else None
        try:
            for i in range(4):
                identity = str(Path(tmp) / f"{i}.id")
                admission = None
                if closed:
                    ticket = sign_ticket(f"{tmp}/org.key", RUN_ID, peer_id_from_identity(identity, create=True), 1)
                    admission = Admission(public, RUN_ID, ticket)
                nodes.append(start_dht(initial, ["/ip4/127.0.0.1/tcp/0"], identity_path=identity if closed else None,
                                       run_id=RUN_ID, num_experts=NUM_EXPERTS, admission=admission))
                initial = initial or [str(m) for m in nodes[0].get_visible_maddrs()]
                swarms.append(Swarm(nodes[-1], RUN_ID, NUM_EXPERTS, ticket=admission.own_ticket if closed else b"",
                                    admission=admission))
            attacker = hivemind.DHT(initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True,
                                    record_validators=[signer])
            return _timed_reads(swarms, attacker, flood, reads, partial(
                doors._store_records, key=peers_key(RUN_ID), claimed=None, round_id=1, fingerprint="",
                num_experts=NUM_EXPERTS, expiration=get_dht_time() + 25))
        finally:
            if attacker is not None:
                attacker.shutdown()
            for node in nodes:
                node.shutdown()


def _timed_reads(swarms: list, attacker: Any, flood: int, reads: int, store_flood: Callable) -> tuple[int, float]:
    """Publish the honest records and (with `flood`) the attacker's, then time `reads` reads of honest peer 1."""
    for swarm in swarms:
        swarm.publish(experts=[0], round=1)
    if flood:
        attacker.run_coroutine(store_flood)
    time.sleep(2.0)
    for _ in range(3):  # warm: every record verified once
        swarms[1].peers()
    started = time.perf_counter()
    for _ in range(reads):
        found = swarms[1].peers()
    return len(found), (time.perf_counter() - started) / reads * 1000


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.record_reads", description=__doc__.split("\n\n")[0])
    p.add_argument("--flood", type=int, nargs="+", default=[0, 1100], help="flood identities per row")
    p.add_argument("--reads", type=int, default=20, help="timed reads per row")
    p.add_argument("--closed", action="store_true", help="a closed run: only the honest peers hold tickets")
    args = p.parse_args(argv)
    setup_logging()
    rows, base = [], None
    for flood in args.flood:
        records, ms = read_ms(flood, args.reads, args.closed)
        base = base or ms
        first, again, refused = validation_ms(flood) if flood else (0.0, 0.0, 0.0)
        rows.append([flood, records, f"{ms:.0f}", f"{ms / base:.1f}x", f"{first:.0f}", f"{again:.1f}",
                     f"{refused:.0f}"])
        logger.info(f"flood {flood}: {records} records per read, {ms:.0f} ms per read")
    sys.stdout.write(format_table(["flood identities", "records per read", "ms per read", "÷ first row",
                                   "ms to verify the flood (open run)", "ms to validate it again (cached)",
                                   "ms to refuse it (closed run)"], rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
