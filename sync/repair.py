"""Repairing a peer whose synchronized tensors differ from the others' (docs/DESIGN.md, "Repair"), a mixin of SparseSync beside sync/contributions.py.

Each record carries `synced = [round, digest]`. In round r's network part a peer compares its own digest of
round r-1 with the others' for r-1. If the majority's differs (ties: the smallest digest, so every peer picks the
same), it fetches the round-(r-1) synchronized values from peers holding the majority's digest, exact and
labelled with that round (the shared tensors as `s0@{r-1}`, each expert from an owner as `{e}@{r-1}`), checks that
they hash to that digest, and uses them as the reference this round's aggregate is added to: after the round's
apply it holds what the others hold, having lost nothing it trained (its live model moves by the correction).
Why not download the live state: the others keep applying rounds, so a download at an arbitrary moment is of
an arbitrary round, and the repaired peer stayed divergent round after round (tests/test_contributions.py).
"""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import torch
from hivemind.p2p import PeerID
from hivemind.utils.logging import get_logger

from sync.aggregate import majority_digest

if TYPE_CHECKING:
    from sync.peer_record import PeerRecord

logger = get_logger(__name__)

Snapshot = dict[str, torch.Tensor]
REPAIR_TIMEOUT = 20.0  # seconds for the repair's fetches, within the round's network part


class Repair:
    """Mixin: `_check_divergence` (network thread), `_repaired_expert`, `_apply_repair` (training thread)."""

    def _init_repair(self) -> None:
        self.divergent_rounds = 0
        self.repairs = 0
        self._digest_round = -1
        self._base_digest = ""  # what this round's aggregate is added to (RoundReport.base_digest)
        # Round-(r-1) values fetched from the majority: shared list and experts, applied at this round's apply.
        self._repaired_shared: list[torch.Tensor] | None = None
        self._repaired_experts: dict[int, Snapshot] = {}

    def _digest_of(self, shared: list[torch.Tensor], experts: dict[int, Snapshot]) -> str:
        """sha256 (first 32 hex digits) of the synchronized tensors: shared, then every expert, fixed order."""
        h = hashlib.sha256()
        for t in shared:
            h.update(t.contiguous().numpy().tobytes())
        view = torch.int32 if self.model.frozen_dtype == torch.float32 else torch.int16
        for expert in range(self.model.cfg.num_experts):
            for _, t in sorted(experts[expert].items()):
                h.update(t.to(self.model.frozen_dtype).contiguous().view(view).numpy().tobytes())
        return h.hexdigest()[:32]

    def _check_divergence(self, others: dict[str, "PeerRecord"]) -> None:
        """Compare this peer's digest of its last applied round with the others' for the same round; fetch the
        majority's values of that round if they differ (network thread, before this round aggregates)."""
        self._repaired_shared, self._repaired_experts = None, {}
        self._base_digest = self.synced_digest
        if not self.synced_digest:
            return
        digests = {p: r.synced[1] for p, r in others.items() if r.synced and r.synced[0] == self._digest_round}
        if not digests:
            return
        majority = majority_digest({**digests, self.swarm.peer_id: self.synced_digest})
        if all(d == self.synced_digest for d in digests.values()):
            return
        self.divergent_rounds += 1
        differ = sum(d != self.synced_digest for d in digests.values())
        logger.warning(f"round {self._digest_round}: {differ} of {len(digests)} peer(s) hold other synchronized "
                       f"tensors than this peer (divergent rounds so far: {self.divergent_rounds})")
        if majority != self.synced_digest:
            self._fetch_repair({p: others[p] for p, d in digests.items() if d == majority}, majority)

    def _fetch_repair(self, sources: dict[str, "PeerRecord"], digest: str) -> None:
        round_id = self._digest_round
        names = [n for n, _ in self.model.shared_parameters()]
        shared = None
        for peer_id in sources:
            fetched = self.exchange.fetch_shared_async(PeerID.from_base58(peer_id), round_id, round_id,
                                                       REPAIR_TIMEOUT, bf16=False).result(REPAIR_TIMEOUT + 5)
            if fetched is not None and fetched.round == round_id and sorted(fetched) == sorted(names):
                shared = [fetched[n].float() for n in names]
                break
        experts = {e: self._synced_expert(e) for e in range(self.model.cfg.num_experts)}
        fetched_experts: dict[int, Snapshot] = {}
        for expert in range(self.model.cfg.num_experts):
            # Its owners among them first; any of them holds its value of that round (Repair._serve_synced).
            order = sorted(sources, key=lambda p: expert not in sources[p].experts)
            for peer_id in order:
                got = self.exchange.fetch(PeerID.from_base58(peer_id), expert, round_id, REPAIR_TIMEOUT,
                                          min_round=round_id)
                if got is not None and got.round == round_id and set(got) == set(experts[expert]):
                    fetched_experts[expert] = {k: self._canonical(v) for k, v in got.items()}
                    break
        if shared is None:
            logger.warning(f"repair: no peer holding the majority's state served round {round_id}'s shared tensors")
            return
        experts.update(fetched_experts)
        if self._digest_of(shared, experts) != digest:
            logger.warning(f"repair: the values fetched for round {round_id} do not hash to the majority's digest; "
                           f"keeping this peer's")
            return
        self._repaired_shared, self._repaired_experts = shared, fetched_experts
        self._base_digest = digest
        self.repairs += 1
        logger.info(f"repair: took round {round_id}'s synchronized values from {len(sources)} peer(s) holding the "
                    f"majority's digest")

    def _serve_synced(self, expert: int, round_id: int) -> Snapshot | None:
        """(Exchange loop) This peer's synchronized value of a non-owned expert, if it is of `round_id`."""
        if round_id != self._digest_round or expert in self.model.owned_experts:
            return None
        return {k: v.detach().clone() for k, v in self.model.expert_tensors(expert).items()}

    def _repaired_expert(self, expert: int) -> Snapshot:
        """The reference this round's aggregate is added to: the majority's value if repaired, else this peer's."""
        return self._repaired_experts.get(expert) or self._synced_expert(expert)

    @torch.no_grad()
    def _apply_repair(self) -> None:
        """(Training thread, before the round's aggregate) the shared references become the majority's, and the
        live model moves by the same correction, keeping what it trained."""
        shared, self._repaired_shared = self._repaired_shared, None
        if shared is None:
            return
        for param, synced, value in zip(self.shared.params, self.shared.synced, shared):
            param.add_((value - synced).to(param.device, param.dtype))
            synced.copy_(value)
        if self.shared.anchor is not None:
            for anchor, synced in zip(self.shared.anchor, self.shared.synced):
                anchor.copy_(synced)
