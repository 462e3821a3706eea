"""Applying a finished round to the live model, for `sync.rounds.SparseSync` (kept in its own file).

`Applying` is a mixin: it uses the round's state (`model`, `shared`, `cfg`, the last synchronized experts
`_expert_synced`, the replica averager `_expert_avg`). Results are applied as deltas against the round's
snapshots ("live += result - snapshot", so what was trained during the round is kept); the state before each
applied round is kept so that a non-finite loss right after it rolls back (docs/DESIGN.md, "Hostile peers").
"""
from __future__ import annotations

import math

import torch
from hivemind.utils.logging import get_logger

from sync.fetch import Snapshot
from sync.merge import merge_deltas

logger = get_logger(__name__)


class Applying:
    """Mixin of SparseSync: measure a round's own change, apply results and the merge warm-up, roll back."""

    def _relative_change(self, own: dict[int, Snapshot]) -> float:
        """How much an honest round changed this peer's tensors, relative to their size: the largest of the
        shared tensors' and each owned expert's ||snapshot - last synchronized|| / ||last synchronized||."""
        def rel(now: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
            num = math.sqrt(sum(float(torch.linalg.vector_norm(a.float() - b.float())) ** 2 for a, b in zip(now, ref)))
            den = math.sqrt(sum(float(torch.linalg.vector_norm(b.float())) ** 2 for b in ref))
            return num / max(den, 1e-12)
        values = [rel(self.shared.snapshot, self.shared.synced)] if self.shared.snapshot is not None else []
        for expert, snapshot in own.items():
            ref = self._expert_synced.get(expert)
            if ref is not None:
                values.append(rel([snapshot[k] for k in ref], list(ref.values())))
        return max(values, default=0.0)

    @torch.no_grad()
    def _capture_pre_apply(self) -> None:
        """Keep the model's values from just before a round is applied, for rollback()."""
        shared = [p.detach().clone() for _, p in self.model.shared_parameters()]
        experts = {e: {k: v.detach().clone() for k, v in self.model.expert_tensors(e).items()}
                   for e in range(self.model.cfg.num_experts)}
        self._pre_apply = (shared, experts)

    @torch.no_grad()
    def rollback(self) -> bool:
        """Restore the values from before the last applied round (a non-finite loss right after applying it:
        someone else's NaN or overflow got through). False if there is nothing to roll back to."""
        if self._pre_apply is None:
            return False
        shared, experts = self._pre_apply
        self._pre_apply = None
        for (_, param), value in zip(self.model.shared_parameters(), shared):
            param.copy_(value)
        for expert, tensors in experts.items():
            self.model.load_expert_tensors(expert, tensors)
        self.shared.reset_reference()
        self._reset_expert_references()
        self.rollbacks += 1
        return True

    def step_done(self) -> None:
        """The training loop finished a step with a finite loss after the last apply: the round is kept."""
        self._pre_apply = None

    def _synced_owned(self, means: dict[int, Snapshot], own: dict[int, Snapshot], all_reduced: bool) -> dict[int, Snapshot]:
        """This round's synchronized (pre-merge) value of each expert this peer owns."""
        synced = {e: means.get(e, snapshot) for e, snapshot in own.items()}
        if all_reduced and self._expert_avg is not None:
            # The replicas' all-reduce result as apply() accepted it (refused tensors: this peer's snapshot).
            names = [f"layers.{l}.{n}" for l in range(self.model.cfg.n_layers) for n in ("gate_up_proj", "down_proj")]
            values = iter(self._expert_avg.synced)
            synced = {e: {name: next(values).clone() for name in names} for e in self._expert_avg_key}
        return synced

    @torch.no_grad()
    def _merge(self, synced_owned: dict[int, Snapshot], alpha: float) -> None:
        """Warm-up merge of the owned experts from this round's synchronized snapshot of every expert."""
        snapshot = {e: synced_owned.get(e) or self.model.expert_tensors(e) for e in range(self.model.cfg.num_experts)}
        owned = sorted(e for e in synced_owned if e in self.model.owned_experts)
        deltas = merge_deltas(snapshot, owned, alpha, self.cfg.merge.topk, self.model.cfg.n_layers)
        for expert, delta in deltas.items():
            live = self.model.expert_tensors(expert)
            self.model.load_expert_tensors(expert, {k: live[k].float() + delta[k] for k in live})
        logger.info(f"merge warm-up (alpha {alpha:.4f}) applied to experts {owned}")

    @torch.no_grad()
    def _apply_experts(self, means: dict[int, Snapshot], own: dict[int, Snapshot]) -> None:
        for expert, mean in means.items():
            if expert in own and expert in self.model.owned_experts:
                # Keep what this peer trained since the snapshot: new = mean + (live - snapshot).
                live = self.model.expert_tensors(expert)
                mean = {k: mean[k] + (live[k].float() - own[expert][k].float()) for k in mean}
            self.model.load_expert_tensors(expert, mean)
