"""One peer over several processes (`torchrun --nproc-per-node 2 -m peer.run`, peer/ranks.py) on CPU with gloo:
the gradient averaging itself (two real processes, a real process group), a 2-process peer training alone and
resuming, in a swarm with a 1-process peer, a rank-0 start-up failure, and a multi-machine launch refused."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
import torch.multiprocessing as mp

from model.checkpoint import latest_checkpoint, load_checkpoint
from tests.conftest import REPO, ProcessLauncher, peer_cmd

if TYPE_CHECKING:
    from peer.ranks import PeerRanks
    from peer.train import Trainer

TINY = ("--config", "configs/tiny.yaml", "--set", "train.eval_every=0")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(*args: str, nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "peer.run", *args]


def _run(processes: ProcessLauncher, cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """`cmd` to its end under the test's launcher (its whole tree is reaped whatever happens)."""
    proc = processes.start(cmd)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _join(rank: int, port: int) -> "PeerRanks":
    """Rank `rank` of a 2-process group on loopback, as torchrun would set it up (spawned test workers)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    from peer.ranks import PeerRanks
    return PeerRanks(rank, rank, 2, device_kind="cpu")


def _tiny_trainer(ranks: "PeerRanks", run_dir: str, experts: str, max_steps: int, **kwargs) -> "Trainer":
    """The tiny config alone (no swarm, no logs, evals or checkpoints in the loop), state from rank 0."""
    from peer.config import load_config
    from peer.train import Trainer
    cfg = load_config(REPO / "configs/tiny.yaml", [{"run_dir": run_dir, "sync": {"every": 0, "experts": experts},
                                                    "train": {"max_steps": max_steps, "log_every": 0,
                                                              "eval_every": 0, "checkpoint_every": 0}}])
    trainer = Trainer(cfg, data_seed=ranks.rank_data_seed(0), ranks=ranks, **kwargs)
    ranks.sync_state(trainer, initial=True)
    return trainer


# ---- the collectives, in two real processes ----------------------------------------------------------------

def _average_worker(rank: int, port: int, out: str) -> None:
    ranks = _join(rank, port)
    try:
        torch.manual_seed(0)
        both, only_rank0, nobody = (torch.nn.Parameter(torch.zeros(3, 2)) for _ in range(3))
        both.grad = torch.full((3, 2), float(rank + 1))           # 1 and 2: mean 1.5
        if rank == 0:
            only_rank0.grad = torch.full((3, 2), 4.0)             # 4 and (none = 0): mean 2
        parts = ranks.average_gradients([both, only_rank0, nobody], {"ce": float(rank), "z_loss": 2.0 * rank})
        deferred = ranks.average_gradients([both], {"ce": torch.tensor(float(rank))})
        gathered = ranks.gather_json({"rank": rank})
        told = ranks.broadcast_json({"from": rank} if rank == 0 else None)
        Path(out, f"{rank}.json").write_text(json.dumps({
            "both": both.grad.tolist(), "only_rank0": only_rank0.grad.tolist(), "nobody": nobody.grad is None,
            "parts": parts, "deferred_is_tensor": torch.is_tensor(deferred["ce"]), "deferred": float(deferred["ce"]),
            "gathered": gathered, "told": told}))
    finally:
        ranks.shutdown()


def test_gradients_are_averaged_and_none_only_where_no_rank_had_one(tmp_path):
    mp.start_processes(_average_worker, args=(_free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    for res in results:
        assert res["both"] == [[1.5, 1.5]] * 3
        assert res["only_rank0"] == [[2.0, 2.0]] * 3  # the mean over both ranks' batches, as one process would get
        assert res["nobody"] is True  # no token chose it anywhere: AdamW must leave it alone
        assert res["parts"] == {"ce": 0.5, "z_loss": 1.0}
        assert res["deferred_is_tensor"] and res["deferred"] == 0.5  # deferred readback: stays a tensor
        assert res["gathered"] == [{"rank": 0}, {"rank": 1}]
        assert res["told"] == {"from": 0}


def _deferred_worker(rank: int, port: int, run_dir: str, out: str) -> None:
    ranks = _join(rank, port)
    try:
        # The GPU mode on CPU: the loss stays a tensor between readbacks and fused AdamW skips a bad step itself.
        trainer = _tiny_trainer(ranks, run_dir, "all", 8, deferred_readback=True)
        forward = trainer.model.forward

        def poisoned(*args, **kwargs):  # rank 1 alone gets a NaN loss at step 4, a step nobody reads back
            out = forward(*args, **kwargs)
            if rank == 1 and trainer.step == 3:
                out.logits = out.logits * float("nan")
            return out
        trainer.model.forward = poisoned
        trainer.run()  # ends with check_identical: RankError if the two copies differ
        step_counts = {float(state["step"]) for state in trainer.optimizer.state.values()}
        Path(out, f"{rank}.json").write_text(json.dumps({"step": trainer.step, "adam_steps": sorted(step_counts)}))
    finally:
        ranks.shutdown()


def test_deferred_readback_skips_a_bad_step_on_every_rank(tmp_path):
    """A NaN on one rank in an unread step: the averaged loss is NaN on both, both skip it on the device, and
    the two copies stay identical (the run's final check would raise otherwise)."""
    mp.start_processes(_deferred_worker, args=(_free_port(), str(tmp_path / "run"), str(tmp_path)), nprocs=2,
                       start_method="spawn")
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    for res in results:
        assert res["step"] == 8
        assert res["adam_steps"] == [7.0]  # 8 loop steps, one skipped by fused AdamW on both ranks


def _leader_changes_worker(rank: int, port: int, run_dir: str, out: str) -> None:
    from peer.callbacks import Callback

    class LeaderOnly(Callback):
        """What the sync callback does on rank 0 alone: at step 2 it changes the model outside the optimizer
        and takes over an expert (a round applied, an adoption); on a NaN loss it restores a state (rollback)."""

        def post_step(self, trainer):
            if trainer.step == 2:
                with torch.no_grad():
                    trainer.model.lm.model.embed_tokens.weight.mul_(0.5)
                trainer.set_owned_experts([0, 1, 2])

        def on_nonfinite(self, trainer, loss):
            with torch.no_grad():
                trainer.model.lm.model.norm.weight.fill_(1.25)
            return True

    ranks = _join(rank, port)
    try:
        trainer = _tiny_trainer(ranks, run_dir, "0,1", 6)
        if rank == 0:
            trainer.add_callback(LeaderOnly())
        forward, poisoned_once = trainer.model.forward, []

        def poisoned(*args, **kwargs):  # rank 1 alone gets a NaN loss once, at step 4 (read back on CPU)
            out = forward(*args, **kwargs)
            if rank == 1 and trainer.step == 3 and not poisoned_once:
                poisoned_once.append(True)
                out.logits = out.logits * float("nan")
            return out
        trainer.model.forward = poisoned
        trainer.run()  # ends with check_identical: RankError if the two copies differ
        Path(out, f"{rank}.json").write_text(json.dumps({
            "step": trainer.step, "owned": sorted(trainer.model.owned_experts),
            "norm": float(trainer.model.lm.model.norm.weight.detach().mean())}))
    finally:
        ranks.shutdown()


def test_what_rank0_changes_outside_the_optimizer_reaches_every_rank(tmp_path):
    """Rank 0 alone changes weights and ownership in a callback and restores a state after a NaN that only rank 1
    saw: rank 1 follows both (same ownership, same values: the run's final identity check passes)."""
    mp.start_processes(_leader_changes_worker, args=(_free_port(), str(tmp_path / "run"), str(tmp_path)), nprocs=2,
                       start_method="spawn")
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert results[0] == results[1], results
    assert results[0]["step"] == 6 and results[0]["owned"] == [0, 1, 2]


# ---- whole peers -----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_two_process_peer_trains_alone_and_resumes(tmp_path, processes):
    run_dir = tmp_path / "run"
    common = (*TINY, "--run-dir", str(run_dir), "--sync-every", "0", "--set", "train.checkpoint_every=10",
              "--set", "train.log_every=5")
    proc = _run(processes, _torchrun(*common, "--max-steps", "20"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the 2 processes of this peer hold the same model" in proc.stderr, proc.stderr[-3000:]
    records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # One metrics file for the peer; it counts both processes' tokens: 2 x batch 8 x 64 targets per step.
    assert records[-1]["step"] == 20 and records[-1]["tokens"] == 20 * 2 * 8 * 64, records[-1]
    tensors, meta = load_checkpoint(latest_checkpoint(run_dir / "checkpoints"))
    assert meta["step"] == 20 and meta["tokens"] == 20 * 2 * 8 * 64
    assert len(meta["data_ranks"]) == 1 and meta["data_ranks"][0]["blocks_consumed"] == 20 * 8, meta
    # Only rank 0 wrote into the run dir: one checkpoint per checkpoint step, one config, one metrics file.
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "step_00000010.safetensors", "step_00000020.safetensors"]

    proc = _run(processes, _torchrun(*common, "--max-steps", "30"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr and "the checkpoint holds the data positions" not in proc.stderr
    assert "the 2 processes of this peer hold the same model" in proc.stderr, proc.stderr[-3000:]
    _, meta = load_checkpoint(latest_checkpoint(run_dir / "checkpoints"))
    assert meta["step"] == 30 and meta["data_ranks"][0]["blocks_consumed"] == 30 * 8, meta


@pytest.mark.slow
def test_copies_stay_identical_after_ownership_changed_before_the_first_step(tmp_path, processes):
    """Alone in a new swarm, rank 0 adopts every expert at join, after its optimizer was built: its optimizer
    lists the parameters in another order than rank 1's. No round comes before the end (every 100), so only
    order-independent steps keep the copies equal (the gradient norm summed in optimizer order did not)."""
    proc = _run(processes, _torchrun(*TINY, "--run-dir", str(tmp_path / "run"), "--sync-every", "100",
                                     "--max-steps", "5", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "alone in the run: training experts [0, 1, 2, 3]" in proc.stderr, proc.stderr[-3000:]
    assert "the 2 processes of this peer hold the same model" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_two_process_peer_in_a_swarm_with_a_one_process_peer(tmp_path, processes):
    common = (*TINY, "--run-id", "ranks-swarm", "--max-steps", "40", "--sync-every", "10",
              "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--set", "sync.matchmaking_time=2",
              "--set", "sync.round_timeout=30", "--set", "sync.max_peer_processes=2")
    logs = [tmp_path / "one.log", tmp_path / "two.log"]
    procs = [processes.start(peer_cmd(*common, "--run-dir", str(tmp_path / "one"), "--set", "sync.wait_for_peers=2"),
                             logs[0])]
    deadline, maddr = time.time() + 120, None
    while maddr is None and time.time() < deadline and procs[0].poll() is None:
        match = re.search(r"initial peer: (\S+)", logs[0].read_text())
        maddr = match.group(1) if match else time.sleep(0.5)
    assert maddr, logs[0].read_text()[-3000:]
    procs.append(processes.start(_torchrun(*common, "--run-dir", str(tmp_path / "two"), "--initial-peers", maddr),
                                 logs[1]))
    for proc in procs:
        proc.wait(timeout=400)
    one, two = (log.read_text() for log in logs)
    assert procs[0].returncode == 0, one[-3000:]
    assert procs[1].returncode == 0, two[-3000:]
    # Both peers averaged with each other; the 2-process peer is one peer (its weight not refused as an outlier:
    # the run allows 2 processes per peer) and its two processes ended identical.
    for name, log in (("one", one), ("two", two)):
        rounds = [json.loads(l) for l in (tmp_path / name / "rounds.jsonl").read_text().splitlines()]
        assert any(r["contributions"] == 2 for r in rounds), (rounds, log[-3000:])
        assert all(r["rejected"] == 0 for r in rounds), (rounds, log[-3000:])
    assert "the 2 processes of this peer hold the same model" in two, two[-3000:]
    assert two.count("initial peer:") == 1  # rank 0 alone joined the DHT
    records = [json.loads(l) for l in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 40 and records[-1]["tokens"] == 40 * 2 * 8 * 64, records[-1]


@pytest.mark.slow
def test_ctrl_c_stops_every_process_after_the_same_step_with_a_checkpoint(tmp_path, processes):
    """Ctrl-C in a terminal: SIGINT to the whole group, so each worker gets it from the terminal and again from
    torchrun's agent at once. That is one request: every rank finishes the same step, rank 0 checkpoints it."""
    run_dir = tmp_path / "run"
    log = tmp_path / "peer.log"
    proc = processes.start(_torchrun(*TINY, "--run-dir", str(run_dir), "--sync-every", "0", "--max-steps", "100000",
                                      "--set", "train.log_every=1", "--set", "train.checkpoint_every=100000"), log)
    deadline = time.time() + 240
    while "step 3/" not in log.read_text() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal does
    proc.wait(timeout=120)
    text = log.read_text()
    stopped = re.findall(r"\[spes-tiny (\S+(?: 1)?)\] stop requested: finished step (\d+)", text)
    assert len(stopped) == 2 and stopped[0][1] == stopped[1][1], text[-3000:]
    assert "aborted by a second interrupt" not in text, text[-3000:]
    _, meta = load_checkpoint(latest_checkpoint(run_dir / "checkpoints"))
    assert meta["step"] == int(stopped[0][1]) and len(meta["data_ranks"]) == 1, meta


@pytest.mark.slow
def test_rank0_start_failure_stops_every_process_in_one_line(tmp_path, processes):
    """A failure only rank 0 can meet (here: the metrics port is taken): the other rank waits for rank 0's start
    message; it must get the error and exit too, not hang."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proc = _run(processes, _torchrun(*TINY, "--run-dir", str(tmp_path / "run"), "--metrics-port", str(port)))
    assert proc.returncode != 0
    assert re.search(rf"error: (metrics )?port {port} is in use", proc.stderr), proc.stderr[-3000:]
    assert re.search(rf"error: rank 0 could not start the peer: (metrics )?port {port} is in use", proc.stderr), \
        proc.stderr[-3000:]
    assert "[rank" not in proc.stderr  # no worker traceback
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_multi_machine_launch_is_refused_in_one_line(tmp_path):
    env = {**os.environ, "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}
    proc = subprocess.run(peer_cmd(*TINY, "--run-dir", str(tmp_path / "run")), cwd=REPO, capture_output=True,
                          text=True, timeout=180, env=env)
    assert proc.returncode == 2
    errors = [l for l in proc.stderr.splitlines() if "error" in l.lower()]
    assert len(errors) == 1 and "a peer spans one machine" in errors[0], proc.stderr
    assert not (tmp_path / "run").exists()
