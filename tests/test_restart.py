"""A restarted peer continues its state (issue 12, "Durable sync state"): trainer callbacks carry state through
the trainer's checkpoints (peer/callbacks.py), and the swarm's sync callback restores the round id, the outer
optimizer and the caretaking history, so counters never go backwards and a caretaker stays one."""
from __future__ import annotations

import pytest
import torch

from model.checkpoint import latest_checkpoint, load_checkpoint
from peer.callbacks import Callback
from peer.config import load_config, parse_override
from peer.train import Trainer
from tests.conftest import REPO


def _tiny(run_dir, *overrides: str):
    return load_config(REPO / "configs/tiny.yaml", [parse_override(o) for o in (
        f"run_dir={run_dir}", "train.eval_every=0", "train.log_every=0", *overrides)])


class Counting(Callback):
    """A callback with state: how many steps it saw, and a tensor that changes with them."""

    name = "counting"

    def __init__(self) -> None:
        self.steps, self.total = 0, torch.zeros(3)

    def post_step(self, trainer: Trainer) -> None:
        self.steps += 1
        self.total += trainer.step

    def state_dict(self):
        return {"total": self.total}, {"steps": self.steps}

    def load_state_dict(self, tensors, meta) -> None:
        if not isinstance(meta["steps"], int) or tensors["total"].shape != (3,):
            raise ValueError("bad counting state")
        self.steps, self.total = meta["steps"], tensors["total"].clone()


def test_callback_state_goes_through_the_checkpoint(tmp_path):
    first = Trainer(_tiny(tmp_path, "train.max_steps=4", "train.checkpoint_every=2", "sync.every=0"))
    counting = Counting()
    assert not first.add_callback(counting)  # nothing to restore in a new run
    first.run()
    tensors, meta = load_checkpoint(latest_checkpoint(tmp_path / "checkpoints"))
    assert meta["callbacks"] == {"counting": {"steps": 4}} and torch.equal(tensors["callbacks.counting.total"],
                                                                            torch.full((3,), 10.0))
    resumed = Trainer(_tiny(tmp_path, "train.max_steps=6", "train.checkpoint_every=2", "sync.every=0"))
    again = Counting()
    assert resumed.add_callback(again) and again.steps == 4 and torch.equal(again.total, counting.total)
    resumed.run()
    assert again.steps == 6 and float(again.total[0]) == 1 + 2 + 3 + 4 + 5 + 6


def test_malformed_callback_state_is_a_warning_and_a_fresh_start(tmp_path, caplog):
    first = Trainer(_tiny(tmp_path, "train.max_steps=2", "train.checkpoint_every=2", "sync.every=0"))

    class Lying(Counting):
        def state_dict(self):
            return {"total": torch.zeros(5)}, {"steps": "many"}

    first.add_callback(Lying())
    first.run()
    resumed = Trainer(_tiny(tmp_path, "train.max_steps=3", "train.checkpoint_every=2", "sync.every=0"))
    fresh = Counting()
    assert not resumed.add_callback(fresh)
    assert fresh.steps == 0 and resumed.step == 2  # the model and optimizer were restored all the same
    assert any("counting state is unusable" in r.getMessage() for r in caplog.records)


@pytest.mark.timeout(240)
def test_restarted_peer_keeps_its_round_outer_state_and_caretaking(tmp_path):
    """A run's first peer (alone, --experts auto) takes care of the experts beyond its share and runs rounds;
    restarted into a swarm whose only other peer is at round 0, its round id does not go back, its trained values
    and outer Nesterov state are the ones it checkpointed (not the newcomer's older ones), and its record still
    says which experts it only takes care of."""
    from peer.node import PeerNode

    common = ("sync.every=3", "sync.outer=nesterov", "sync.matchmaking_time=1", "sync.round_timeout=10",
              "train.checkpoint_every=100", "run_id=restart")
    with PeerNode(_tiny(tmp_path / "a", "train.max_steps=7", *common), host_maddrs=["/ip4/127.0.0.1/tcp/0"]) as a:
        a.run()
        rounds, cared = a.sync.round_id, a.sync.ownership.caretaking
        anchor = [t.clone() for t in a.sync.shared.anchor]
        shared = [p.detach().clone() for _, p in a.trainer.model.shared_parameters()]
    assert rounds >= 2 and cared, (rounds, cared)
    _, meta = load_checkpoint(latest_checkpoint(tmp_path / "a" / "checkpoints"))
    assert meta["callbacks"]["sync"]["round"] == rounds == meta["rounds"]

    with PeerNode(_tiny(tmp_path / "b", "train.max_steps=1", "sync.experts=0", *common),
                  host_maddrs=["/ip4/127.0.0.1/tcp/0"]) as b:
        initial = b.swarm.visible_maddrs()
        with PeerNode(_tiny(tmp_path / "a", "train.max_steps=9", *common), initial_peers=initial,
                      host_maddrs=["/ip4/127.0.0.1/tcp/0"]) as restarted:
            assert restarted.trainer.step == 7
            assert restarted.sync.round_id == restarted.trainer.rounds == rounds  # b is at round 0: not back to it
            assert restarted.sync.ownership.caretaking == cared
            assert all(torch.equal(x, y) for x, y in zip(restarted.sync.shared.anchor, anchor))
            # b's state is older (round 0): the restarted peer keeps its own training instead of downloading it.
            assert all(torch.equal(p, q) for (_, p), q in zip(restarted.trainer.model.shared_parameters(), shared))
            seen_by_b = b.swarm.peers()[restarted.swarm.peer_id]
            assert seen_by_b.caretaking == cared and seen_by_b.round == rounds
