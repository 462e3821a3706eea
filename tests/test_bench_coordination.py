"""bench.coordination's model of today's coordination traffic: what grows with the peer count and what does not,
from a record measured as signed, and hivemind's DHT defaults read from hivemind."""
from __future__ import annotations

import pytest

from bench.coordination import DhtParams, Schedule, coordination_row, hivemind_dht_params, main, record_copy_bytes

DHT = DhtParams(bucket_size=20, num_replicas=5, cache_nearest=1)
SCHED = Schedule(interval_s=10.0, progress_poll_s=1.0, wait_s=1.0, wait_poll_s=0.2, heartbeat_s=10.0)


@pytest.mark.unit
def test_reads_carry_every_record_from_each_holder_and_holders_serve_everyone():
    small, large = (coordination_row(n, 1000, DHT, SCHED) for n in (64, 1000))
    assert small["reads"] == large["reads"] == 10 + 5 + 1  # set by the schedule, not by N
    assert small["kb_per_read"] == 6 * 64 and large["kb_per_read"] == 6 * 1000  # 5 replicas + 1 cache answer
    assert large["kb"] / small["kb"] == pytest.approx(1000 / 64, rel=0.01)  # linear in N per peer
    assert large["served_kb"] / small["served_kb"] == pytest.approx(999 * 1000 / (63 * 64), rel=1e-9)  # N^2
    assert coordination_row(3, 1000, DHT, SCHED)["kb_per_read"] == 3 * 3  # every node holds the key


@pytest.mark.unit
def test_inputs_come_from_a_signed_record_and_hivemind(capsys):
    assert hivemind_dht_params() == DHT  # hivemind 1.1.12's DHTNode.create defaults
    assert 700 < record_copy_bytes() < 2000  # RSA-2048 key and signature plus the payload
    assert main(["--peers", "8", "1000", "--interval", "2"]) == 0
    out = capsys.readouterr().out
    assert "| 1000" in out and "goal (10 KB)" in out
