"""Fetching the swarm's state from other peers when joining or after falling behind (docs/DESIGN.md, "Hostile
peers"): the synchronized shared tensors from up to 3 verified sources, each expert from its live owners.

`ExpertFetching` is a part of `sync.rounds.SparseSync`, kept in its own file: it uses `round_id`, `cfg`,
`exchange`, `model`, `shared`, `rejects`. For each wanted expert every live owner's copy is fetched at once (one
stream per owner and expert, `sync.transfer.ExpertExchange`), each copy checked (names, shapes, finiteness, norm)
and 3+ copies combined robustly. Every fetch is bounded by min(round_timeout, 30 s).
"""
from __future__ import annotations

import concurrent.futures
import random

import torch
from hivemind.p2p import PeerID
from hivemind.utils.logging import get_logger

from sync.robust import robust_mean
from sync.swarm import PeerRecord, median_round
from sync.validate import validate_tensors

logger = get_logger(__name__)

Snapshot = dict[str, torch.Tensor]
class ExpertFetching:
    """Mixin of SparseSync: download the swarm's state (shared tensors from up to 3 verified sources, experts
    from their owners) when joining or behind, and a taken-over expert's optimizer moments."""

    def _download_state(self, others: dict[str, PeerRecord]) -> None:
        # The median, never the max: a record claiming round 1e9 neither moves this counter nor is asked for
        # the state (sources are peers whose round is within one of the median). Never backwards.
        swarm_round = median_round(others.values())
        self.round_id = max(self.round_id, swarm_round)
        sources = [p for p, r in others.items() if abs(r.round - swarm_round) <= 1]
        random.shuffle(sources)
        copies = self._download_shared(sources, want=3, timeout=min(self.cfg.round_timeout, 30.0))
        if self.shared.load_state(copies):
            logger.info(f"downloaded the shared tensors of round {self.round_id} from {len(copies)} peer(s)")
        else:
            logger.warning("no peer served valid shared tensors: keeping the local ones")
        means = self._fetch_means(others, set(range(self.model.cfg.num_experts)))
        for expert, mean in means.items():
            self.model.load_expert_tensors(expert, mean)
        # An owned expert no other peer served keeps its synchronized reference (restored from the checkpoint, or
        # this peer's own): only its owner knows how far its live value is ahead of the others'.
        keep = frozenset(self.model.owned_experts) - set(means)
        self._reset_expert_references(keep)

    def _take_over_moments(self, experts: list[int], others: dict[str, PeerRecord]) -> None:
        """Handoff (docs/DESIGN.md, "Coverage"): the AdamW moments of experts this peer takes over, from a peer
        that trains them now (its caretaker first, else a co-owner), so the new owner does not restart them from
        zero. Checked here for names, shapes and finiteness; the optimizer's own invariant is checked where they
        are loaded (peer/optim.py). Kept in `handed_over` for the training loop."""
        timeout = min(self.cfg.round_timeout, 30.0)
        for expert in experts:
            holders = [p for p, r in others.items() if expert in r.experts]
            random.shuffle(holders)
            holders.sort(key=lambda p: expert not in others[p].caretaking)
            for peer_id in holders[:2]:  # a second source if the first has none or sends garbage
                tensors = self.exchange.fetch_moments(PeerID.from_base58(peer_id), expert, timeout)
                if tensors is None:
                    continue
                reason = self._moments_problem(expert, tensors)
                if reason is None:
                    self.handed_over[expert] = self._per_tensor_steps(expert, tensors)
                    break
                self.rejects.add(reason)
                logger.warning(f"refused the optimizer moments of expert {expert} from peer ...{peer_id[-6:]}: "
                               f"{reason}")

    def _moments_problem(self, expert: int, tensors: dict[str, torch.Tensor]) -> str | None:
        """Why a received set of moments is unusable (a REJECT_REASONS entry), or None. A step count per tensor
        (`{name}.step`, peer/optim.py) or, from owners of earlier builds, one `step` for all of them."""
        live = self.model.expert_tensors(expert)
        moments = {f"{n}.{k}" for n in live for k in ("exp_avg", "exp_avg_sq")}
        if set(tensors) not in (moments | {f"{n}.step" for n in live}, moments | {"step"}):
            return "malformed"
        steps = [t for k, t in tensors.items() if k == "step" or k.endswith(".step")]
        if any(t.numel() != 1 for t in steps) or any(tensors[f"{n}.{k}"].shape != t.shape for n, t in live.items()
                                                     for k in ("exp_avg", "exp_avg_sq")):
            return "shape"
        if not all(t.is_floating_point() and bool(torch.isfinite(t).all()) for t in tensors.values()):
            return "nonfinite"
        return None

    def _per_tensor_steps(self, expert: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checked moments in the per-tensor form the optimizer loads (an earlier build's one `step` for all)."""
        if "step" not in tensors:
            return tensors
        out = {k: t for k, t in tensors.items() if k != "step"}
        out.update({f"{n}.step": tensors["step"] for n in self.model.expert_tensors(expert)})
        return out

    def _download_shared(self, sources: list[str], want: int, timeout: float) -> list[list[torch.Tensor]]:
        """The synchronized shared values each source published with its latest apply (sync/contributions.py), exact, from up to `want` sources at once (more tried if some fail); names must match."""
        names = [n for n, _ in self.model.shared_parameters()]
        copies: list[list[torch.Tensor]] = []
        for start in range(0, len(sources), want):
            batch = sources[start:start + want - len(copies)]
            futures = [self.exchange.fetch_shared_async(PeerID.from_base58(p), self.round_id, 0, timeout, bf16=False)
                       for p in batch]
            for future in futures:
                try:
                    fetched = future.result(timeout=timeout + 5.0)
                except Exception:
                    fetched = None
                if fetched is None:
                    continue
                if sorted(fetched) != sorted(names):
                    self.rejects.add("malformed")
                    continue
                copies.append([fetched[n] for n in names])
            if len(copies) >= want:
                break
        return copies

    def _fetch_means(self, others: dict[str, PeerRecord], want: set[int]) -> dict[int, Snapshot]:
        """The swarm's value of each wanted expert that other peers own (blocking: joining or behind): every live
        owner's copy, asked at once, each validated (names, shapes, finite, norm); one copy is the value, two are
        averaged, 3+ combined robustly (sync/robust.py). An expert whose every copy is missing or refused is left
        out (the caller keeps its local value)."""
        timeout = min(self.cfg.round_timeout, 30.0)
        asked: list[tuple[int, str, concurrent.futures.Future]] = []
        for record in others.values():
            for expert in record.experts:
                if expert in want:
                    # An owner one round behind serves the newest it has; one round of staleness is expected.
                    future = self.exchange.fetch_async(PeerID.from_base58(record.peer_id), expert, self.round_id,
                                                       timeout=timeout, min_round=min(self.round_id, record.round),
                                                       bf16=self._stored_in_bf16(expert))
                    asked.append((expert, record.peer_id, future))
        copies: dict[int, list[Snapshot]] = {}
        for expert, peer_id, future in asked:
            try:
                copy = future.result(timeout=timeout + 5.0)
            except Exception:  # cancelled, or the exchange shut down: nothing from this owner
                copy = None
            if copy is None:
                continue
            tensors, reason = validate_tensors(copy, self.model.expert_tensors(expert),
                                               max_norm_ratio=self.cfg.max_norm_ratio)
            if tensors is None:
                self.rejects.add(reason)
                logger.warning(f"refused expert {expert} from peer ...{peer_id[-6:]}: {reason}")
                continue
            copies.setdefault(expert, []).append(tensors)
        means = {}
        for expert, found in copies.items():
            if len(found) == 1:
                means[expert] = found[0]  # stored as it came (bf16 into bf16)
            elif len(found) >= 3:
                means[expert] = robust_mean(found)
            else:
                means[expert] = {n: torch.stack([c[n].float() for c in found]).mean(dim=0) for n in found[0]}
        return means

    def _stored_in_bf16(self, expert: int) -> bool:
        """Whether this peer keeps `expert` in bfloat16 (a frozen copy, model.frozen_expert_dtype's default): then
        an fp32 copy would cost twice the bytes for precision rounded away on arrival. An owned (trainable)
        expert is kept in fp32: asked at full precision."""
        tensors = self.model.expert_tensors(expert)
        return bool(tensors) and all(t.dtype == torch.bfloat16 for t in tensors.values())
