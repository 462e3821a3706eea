"""Bounded contributions per round: does an outer rule over C of N peers' changes train as well as over all N?

    python -m bench.lottery                                   # 8 peers, 2 drawn per round, every arm (~6 min)
    python -m bench.lottery --codec sparse --arms all,scaled,discard      # changes through the run's codec
    python -m bench.lottery --peers 3 --contributors 1 --rounds 2 --every 2 --eval-every 1    # the CI smoke version

The question before the round fetches a bounded number of contributions (issue "Many peers": every peer fetching
every peer's blob is O(N) per peer and round): what the peers that are not drawn do with their training, and how
the drawn ones' changes are weighed. This bench answers it for the outer rule alone, in one process, with no DHT
(by default fp32 changes; `model.frozen_expert_dtype: float32`), so only the rule differs between arms: every
peer is a real `peer.train.Trainer` on configs/tiny.yaml with its own data order, owning `--experts-per-peer`
experts (peer i: experts i, i+1, ... mod E), training `--every` steps per round on them and the shared tensors.
A peer's change is its live values minus the last synchronized ones (shared tensors and owned experts); with
`--codec sparse` it is sent through the run's codec (sync/sparse.py) and the unsent part stays in the live model,
also over the rounds a `discard` peer is not drawn (error feedback).

Arms (the draw: the C peers with the lowest sha256(round, peer) tickets):
  all      every peer contributes every round; synchronized += mean of the changes (each expert: over its owners),
           the rule the round has today.
  mean     C drawn peers contribute; synchronized += mean of their changes. A peer not drawn keeps its training
           (live += the synchronized change) and sends it, accumulated, when next drawn.
  scaled   as mean, but synchronized += sum of the changes / sum of k_i, k_i the rounds since peer i last
           contributed (its change holds k_i rounds of training): with everyone drawn it is `all`.
  perround as mean, but synchronized += the mean of change_i / k_i: each drawn peer's change per round trained.
  discard  as mean, but a peer not drawn drops its round's training (live := synchronized, plus with --codec
           sparse the unsent part of its last change).
  gossip   no draw and no common synchronized model: every peer averages its live values with those of C other
           peers of its own random choice (each expert over the owners among them), as gossip averaging does;
           the loss is the mean over the peers' models.

Reported per arm: held-out loss of the synchronized model at 25/50/100 % of the rounds (every arm trains the
same tokens), its ratio to `all`, and the contributions a peer fetches per round. Writes results.json.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.common import REPO_ROOT, format_table, logger, set_threads, setup_logging
from sync.sparse import SparseSpec, encode

ARMS = ("all", "mean", "scaled", "perround", "discard", "gossip")
SEED_STRIDE = 1_000_000  # --seed s draws as rounds s * SEED_STRIDE + 1, 2, ... (s = 0: the runs recorded)
Values = dict[str, torch.Tensor]  # a model's synchronized tensors: "s/{i}" shared, "e{expert}/{name}" experts


def _expert(name: str) -> int | None:
    """The expert a Values name belongs to ("e3/..." -> 3), None for a shared tensor ("s/...")."""
    return None if name.startswith("s/") else int(name[1:name.index("/")])


def drawn(round_id: int, peers: int, contributors: int) -> list[int]:
    """The `contributors` peers of round `round_id` with the lowest tickets (every peer computes the same)."""
    def ticket(peer: int) -> bytes:
        return hashlib.sha256(f"{round_id}/{peer}".encode()).digest()
    return sorted(sorted(range(peers), key=ticket)[:contributors])


def _values(trainer: Any, experts: range) -> Values:
    model = trainer.model
    out = {f"s/{i}": p.detach().float().clone() for i, (_, p) in enumerate(model.shared_parameters())}
    for e in experts:
        out.update({f"e{e}/{k}": v.detach().float().clone() for k, v in model.expert_tensors(e).items()})
    return out


@torch.no_grad()
def _load(trainer: Any, values: Values) -> None:
    model = trainer.model
    for i, (_, p) in enumerate(model.shared_parameters()):
        p.copy_(values[f"s/{i}"])
    for e in range(model.cfg.num_experts):
        prefix = f"e{e}/"
        model.load_expert_tensors(e, {k[len(prefix):]: v for k, v in values.items() if k.startswith(prefix)})


def outer(synced: Values, changes: dict[int, Values], owners: dict[int, list[int]], arm: str,
          skipped: dict[int, int]) -> Values:
    """The new synchronized values from the contributors' changes: shared tensors over all of them, each expert
    over its owners among them (unchanged without one). `skipped[i]`: rounds peer i has trained since it last
    contributed, this one included (the `scaled` arm's k_i)."""
    new = dict(synced)
    for name in synced:
        expert = _expert(name)
        peers = [p for p in changes if expert is None or expert in owners[p]]
        if not peers:
            continue
        if arm == "perround":
            new[name] = synced[name] + sum(changes[p][name] / skipped[p] for p in peers) / len(peers)
            continue
        total = sum(changes[p][name] for p in peers)
        new[name] = synced[name] + total / (sum(skipped[p] for p in peers) if arm == "scaled" else len(peers))
    return new


def gossip(lives: list[Values], owners: dict[int, list[int]], contributors: int, round_id: int) -> list[Values]:
    """Each peer's new values: the mean of its own and `contributors` other peers' (its own random choice this
    round) live values; an expert's over the owners among them, a peer's own value where none of them owns it."""
    out = []
    for i, live in enumerate(lives):
        others = [j for j in range(len(lives)) if j != i]
        group = [i] + random.Random(f"{round_id}/{i}").sample(others, min(contributors, len(others)))
        new = {}
        for name, value in live.items():
            expert = _expert(name)
            peers = [j for j in group if expert is None or expert in owners[j]]
            new[name] = sum(lives[j][name] for j in peers) / len(peers) if peers else value
        out.append(new)
    return out


def run_arm(arm: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One arm: `--peers` Trainers from one initial model, `--rounds` rounds; the held-out loss of the synchronized
    model every `--eval-every` rounds."""
    from peer.config import load_config
    from peer.train import Trainer

    def trainer(name: str, seed: int) -> Any:
        cfg = load_config(REPO_ROOT / "configs" / "tiny.yaml", [{
            "run_dir": str(out / arm / name), "model": {"frozen_expert_dtype": "float32"},
            "train": {"warmup_steps": 5, "max_steps": args.rounds * args.every, "eval_batches": 8,
                      "seed": args.seed}}])
        return Trainer(cfg, data_seed=seed)

    peers = [trainer(f"peer{i}", 1000 + 100 * args.seed + i) for i in range(args.peers)]
    evaluator = trainer("eval", 0)
    num_experts = evaluator.model.cfg.num_experts
    spec = None
    if args.codec == "sparse":  # the run's default codec, as configs/tiny.yaml peers use it
        sp = evaluator.cfg.sync.sparse
        spec = SparseSpec(method="sparse", chunk=sp.chunk, topk=sp.topk, bits=sp.bits)
    owners = {i: sorted({(i + j) % num_experts for j in range(args.experts_per_peer)}) for i in range(args.peers)}
    synced = _values(peers[0], range(num_experts))
    for i, t in enumerate(peers):
        _load(t, synced)
        t.set_owned_experts(owners[i])
    skipped = {i: 0 for i in range(args.peers)}
    unsent: dict[int, Values] = {}  # --codec sparse: each peer's part of its last change the codec did not send
    losses: dict[int, float] = {}
    fetched = []
    for round_id in range(1, args.rounds + 1):
        draw = round_id + SEED_STRIDE * args.seed  # the draw's and the gossip choice's round number
        for t in peers:
            for _ in range(args.every):
                t.train_step(readback=False)
        if arm == "gossip":
            mixed = gossip([_values(t, range(num_experts)) for t in peers], owners, args.contributors, draw)
            for t, values in zip(peers, mixed):
                _load(t, values)
            fetched.append(min(args.contributors, args.peers - 1))
            if round_id % args.eval_every == 0 or round_id == args.rounds:
                losses[round_id] = sum(t.evaluate() for t in peers) / len(peers)
                logger.info(f"{arm}: round {round_id}/{args.rounds}, held-out loss {losses[round_id]:.4f}")
            continue
        for i in skipped:
            skipped[i] += 1
        chosen = list(range(args.peers)) if arm == "all" else drawn(draw, args.peers, args.contributors)
        changes = {}
        for i in chosen:
            live = _values(peers[i], owners[i])
            changes[i] = {n: v - synced[n] for n, v in live.items()}
            if spec is not None:  # what the codec sends; the rest stays in the live model (sparse.keep_residual)
                _, sent = encode(changes[i], spec)
                unsent[i] = {n: changes[i][n] - sent[n] for n in sent}  # until it is drawn again
                changes[i] = sent
        new = outer(synced, changes, owners, arm, skipped)
        fetched.append(len(chosen) * (1 - 1 / args.peers))  # a drawn peer fetches the others, the rest all
        for i, t in enumerate(peers):
            if i in changes or arm == "discard":  # its change is in the new values (or dropped), not its unsent part
                _load(t, {n: new[n] + unsent[i][n] if n in unsent.get(i, {}) else new[n] for n in new})
            else:  # keeps what it trained: its owned experts and the shared tensors move by the round's change
                live = _values(t, range(num_experts))
                _load(t, {n: live[n] + new[n] - synced[n] if _expert(n) in (None, *owners[i]) else new[n]
                          for n in live})
        for i in changes:
            skipped[i] = 0
        synced = new
        if round_id % args.eval_every == 0 or round_id == args.rounds:
            _load(evaluator, synced)
            losses[round_id] = evaluator.evaluate()
            logger.info(f"{arm}: round {round_id}/{args.rounds}, held-out loss {losses[round_id]:.4f}")
    return {"losses": losses, "fetched_per_round": sum(fetched) / len(fetched)}


def _at(losses: dict[int, float], fraction: float) -> float:
    rounds = sorted(losses)
    return losses[min(rounds, key=lambda r: abs(r - fraction * rounds[-1]))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lottery", description=__doc__.split("\n\n")[0])
    p.add_argument("--peers", type=int, default=8)
    p.add_argument("--contributors", type=int, default=2, help="peers drawn per round (C)")
    p.add_argument("--experts-per-peer", type=int, default=2)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--every", type=int, default=10, help="training steps per round (sync.every)")
    p.add_argument("--eval-every", type=int, default=5, help="rounds between held-out evaluations")
    p.add_argument("--seed", type=int, default=0, help="model init, data orders and draws (0: the recorded runs)")
    p.add_argument("--codec", choices=("none", "sparse"), default="none",
                   help="changes as sent: fp32, or the sparse codec with the unsent part kept (not for gossip)")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--out", type=Path, default=None, help="folder for results.json (default: a temp folder)")
    args = p.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    bad = [a for a in arms if a not in ARMS]
    if bad or not 1 <= args.contributors <= args.peers or min(args.rounds, args.every, args.eval_every) < 1:
        p.error(f"unknown arm {bad[0]!r} (choose from {', '.join(ARMS)})" if bad else
                "--contributors must be 1..--peers; --rounds, --every and --eval-every at least 1")
    if args.codec != "none" and "gossip" in arms:
        p.error("--codec sparse has no gossip arm (no synchronized values to measure a change from)")
    setup_logging()
    set_threads(1)
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-lottery-"))
    out.mkdir(parents=True, exist_ok=True)
    results = {arm: run_arm(arm, args, out / "runs") for arm in arms}
    base = results.get("all")
    rows = []
    for arm, r in results.items():
        at = [_at(r["losses"], f) for f in (0.25, 0.5, 1.0)]
        ratio = f"{at[2] / _at(base['losses'], 1.0):.3f}" if base else "-"
        rows.append([arm, *(f"{v:.4f}" for v in at), ratio, f"{r['fetched_per_round']:.2f}"])
    (out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                  "arms": results}, indent=1))
    sys.stdout.write(f"{args.peers} peers, {args.contributors} drawn per round, {args.rounds} rounds of {args.every} "
                     f"steps, {args.experts_per_peer} experts per peer, seed {args.seed}, codec {args.codec}\n")
    sys.stdout.write(format_table(["arm", "held-out loss at 25 %", "at 50 %", "at 100 %", "÷ all (100 %)",
                                   "contributions fetched per peer per round"], rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
