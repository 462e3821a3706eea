"""Applying a finished round to the live model, for `sync.rounds.SparseSync` (kept in its own file).

`Applying` is a mixin: it uses the round's state (`model`, `shared`, `cfg`, the last synchronized experts
`_expert_synced`). Results are applied as deltas against the round's
snapshots ("live += result - snapshot", so what was trained during the round is kept); the state before each
applied round is kept so that a non-finite loss right after it rolls back (docs/DESIGN.md, "Hostile peers").
After a round, ownership follows the records it read (adopt orphans, give adopted experts back: sync.ownership),
and a peer that keeps aggregating alone says so.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from hivemind.utils.logging import get_logger

from sync.fetch import Snapshot
from sync.delta import rebased
from sync.merge import merge_deltas
from sync.peer_record import OWNER_GRACE, credible_owners
from sync.swarm import PeerRecord

if TYPE_CHECKING:
    from sync.rounds import RoundReport

logger = get_logger(__name__)


class Applying:
    """Mixin of SparseSync: measure a round's own change, apply results and the merge warm-up, roll back, and
    the ownership changes after a round."""

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

    @property
    def awaiting_check(self) -> bool:
        """A round was applied and no step since has shown its loss finite: the next step's loss must be read."""
        return self._pre_apply is not None

    def step_done(self) -> None:
        """The training loop finished a step with a finite loss after the last apply: the round is kept."""
        self._pre_apply = None

    @torch.no_grad()
    def _merge(self, synced_owned: dict[int, Snapshot], alpha: float) -> None:
        """Warm-up merge of the owned experts from this round's synchronized snapshot of every expert."""
        snapshot = {e: synced_owned.get(e) or self.model.expert_tensors(e) for e in range(self.model.cfg.num_experts)}
        owned = sorted(e for e in synced_owned if e in self.model.owned_experts)
        deltas = merge_deltas(snapshot, owned, alpha, self.cfg.merge.topk,
                              [self.model.expert_tensor_names(l) for l in range(self.model.cfg.n_layers)])
        for expert, delta in deltas.items():
            live = self.model.expert_tensors(expert)
            self.model.load_expert_tensors(expert, {k: live[k].float() + delta[k] for k in live})
        logger.info(f"merge warm-up (alpha {alpha:.4f}) applied to experts {owned}")

    @torch.no_grad()
    def _apply_experts(self, means: dict[int, Snapshot], own: dict[int, Snapshot]) -> None:
        for expert, mean in means.items():
            if expert in own and expert in self.model.owned_experts:
                # Keep what this peer trained since the snapshot (sync/delta.py).
                live = self.model.expert_tensors(expert)
                mean = {k: rebased(live[k], mean[k], own[expert][k]) for k in mean}
            self.model.load_expert_tensors(expert, mean)

    def _track_alone(self, report: "RoundReport") -> None:
        """A warning (and spes_sync_alone_rounds) when this peer keeps aggregating alone while others exist:
        e.g. every contribution it fetches is refused, or its records cannot be read (issue 9, "Visibility")."""
        if report.peers_seen > 1 and report.others_aggregated == 0:
            self.rounds_alone += 1
            if self.rounds_alone % self.cfg.alone_warn_rounds == 0:
                logger.warning(f"aggregated no other peer's contribution for {self.rounds_alone} rounds in a row although "
                               f"{report.peers_seen - 1} other peer(s) are in the run")
        else:
            self.rounds_alone = 0

    def _adopt(self, records: dict[str, PeerRecord], averaged: set[int], cut_off: bool) -> tuple[list[int], list[int]]:
        """Ownership changes after a round (sync.ownership): give adopted experts back to an owner that returned,
        adopt orphans. Returns (adopted, given back). Owners by deeds: a record that claimed experts for
        OWNER_GRACE rounds it was surely drawn in without a contribution reaching this peer counts as no owner
        (credible_owners, sync/draw.py)."""
        credible = credible_owners(records, self._delivered_ever | {self.swarm.peer_id}, self._count_chances(records),
                                   OWNER_GRACE)
        unserved = set(records) - set(credible)
        self.unserved_claims = len(unserved)
        new = sorted(unserved - self._discounted)
        if new:  # one line for any number of them (a thousand fresh identities must not make a thousand lines)
            self._discounted = (self._discounted & set(records)) | set(new)  # live ones only: stays bounded
            named = ", ".join(f"...{p[-6:]} (experts {records[p].experts})" for p in new[:3])
            more = f" and {len(new) - 3} more" if len(new) > 3 else ""
            logger.warning(f"peer(s) {named}{more} claim experts but no contribution of theirs arrived in "
                           f"{OWNER_GRACE} rounds: not counted as owners (spes_unserved_claims)")
        records = credible
        self.ownership.observe(records)
        owned = set(self.model.owned_experts)
        back = self.ownership.to_release(owned, records, averaged)
        adopt = self.ownership.to_adopt(owned - set(back), records, cut_off)
        now_owned = (owned - set(back)) | set(adopt)
        # Experts whose owner finished its run are left alone on purpose (Swarm.finish): no warning for them.
        uncovered = sorted(set(self.swarm.uncovered(now_owned, records)) - self.swarm.finished_experts())
        others = [r for p, r in records.items() if p != self.swarm.peer_id]
        room = any(r.room(self.model.cfg.num_experts) > 0 for r in others) or len(now_owned) < self.max_owned
        if uncovered and not room and not cut_off:
            # One line per round while it lasts: nobody trains these experts, and nobody has room to adopt them.
            logger.warning(f"experts {uncovered} have no owner and none of the {len(others) + 1} live peer(s) has "
                           f"room to adopt them: all are at their budget (sync.max_experts_per_peer)")
        if not adopt and not back:
            return [], []
        if adopt:
            with_moments = self._take_left_moments(adopt)  # a leaving owner's moments, fetched as it left
            logger.info(f"adopting experts {adopt}: no live owner; taking care of them until a peer owns them "
                        f"for good{f' (with the optimizer moments of their leaving owner: {with_moments})' if with_moments else ''}")
        owned = sorted((owned - set(back)) | set(adopt))
        given = {e: self._expert_synced.get(e) for e in back}
        self.model.set_owned_experts(owned)
        for expert in back:
            self._expert_synced.pop(expert, None)
            if given[expert] is not None:
                # A non-owner holds the synchronized value, as every other peer does (sync/contributions.py);
                # what it trained since goes to nobody (its owner's change counts).
                self.model.load_expert_tensors(expert, given[expert])
        for expert in adopt:  # its last synchronized value is what this peer holds of it now
            self._expert_synced[expert] = {k: self._canonical(v) for k, v in self.model.expert_tensors(expert).items()}
        self.swarm.publish(experts=owned, caretaking=self.ownership.caretaking)
        return adopt, back

    def _care_for_all_at_start(self) -> None:
        """The run's first peer, alone: it takes care of every expert its budget allows until other peers take
        them over (sync.ownership), instead of training its share and leaving the rest at their random init."""
        owned = set(self.model.owned_experts)
        extra = self.swarm.orphans_to_adopt(owned, self.max_owned, {})
        if not extra:
            return
        self.ownership.care_for(extra)
        self.model.set_owned_experts(sorted(owned | set(extra)))
        self._reset_expert_references()
        self.swarm.record.caretaking = self.ownership.caretaking
        why = "" if self.swarm.on_its_own() else (
            f" ({sorted(extra)} taken care of until other peers take them over; budget {self.max_owned}, "
            f"sync.max_experts_per_peer)")
        logger.info(f"alone in the run: training experts {sorted(owned | set(extra))} of "
                    f"{self.model.cfg.num_experts}{why}")
