"""`python -m peer.status` (issue 34 item 7): a run's peers, experts and rounds read from its DHT by a client
that does not join as a trainer; real hivemind peers on 127.0.0.1 in this process, the tool's main() beside them."""
from __future__ import annotations

import json

from peer import status as peer_status
from tests.conftest import round_all, sync_cfg


def test_status_shows_every_peer_the_coverage_and_agreement(swarm_factory, tmp_path, capsys):
    from sync.settings import fingerprint
    a, b = swarm_factory([0, 1], sync_cfg()), swarm_factory([2], sync_cfg())
    settings = {"model.num_experts": 4, "model.d_model": 32}
    for peer in (a, b):  # as peer.run's Swarm does: the run's settings, so the tool learns the expert count
        peer.swarm.settings, peer.swarm.record.cfg = settings, fingerprint(settings)
        peer.swarm.publish_settings()
    round_all([a, b])
    for peer in (a, b):  # the applied round's digest goes out with the next store (the heartbeat's, here now)
        peer.swarm.publish()
    out = tmp_path / "status.json"
    code = peer_status.main(["--initial-peers", *a.swarm.visible_maddrs(), "--run-id", "test-run",
                             "--json", str(out), "--timeout", "15"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    status = json.loads(out.read_text())
    assert sorted(row["peer"] for row in status["peers"]) == sorted(p.swarm.peer_id[-8:] for p in (a, b))
    # 4 experts (from the run's settings, not the records' highest index); who holds expert 3 depends on
    # adoption, so only the three owned ones are pinned.
    owners = {int(e): n for e, n in status["owners"].items()}
    assert set(owners) == {0, 1, 2, 3} and owners[0] == owners[1] == owners[2] == 1
    assert status["synced_digests"] == 1 and status["round"] == 1
    assert "run test-run: 2 live peer(s), round 1" in printed and "the same synchronized tensors" in printed


def test_no_peer_found_is_one_line_and_exit_2(swarm_factory, capsys):
    a = swarm_factory([0, 1], sync_cfg())
    code = peer_status.main(["--initial-peers", *a.swarm.visible_maddrs(), "--run-id", "no-such-run",
                             "--timeout", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "no live peer of run no-such-run" in err[0], err
