"""Fetching from other peers: owners' copies of experts in a round, and the swarm's state when joining (docs/DESIGN.md,
"Hostile peers").

`ExpertFetching` is a part of `sync.rounds.SparseSync`, kept in its own file: it uses the round's state
(`round_id`, `cfg`, `exchange`, `model`, `rejects`, the last synchronized experts `_expert_synced` and their
staleness `_stale`) and owns the owners' strike counts. For each wanted expert every live owner's copy for this
round is fetched at once (one stream per owner and expert, `sync.transfer.ExpertExchange`), each copy checked
(shape, finiteness, norm, change in proportion to an honest round's) and 3+ copies combined robustly. An owner
that let a fetch time out is skipped for 2, 4, 8.. rounds and then asked with a short timeout; its strikes are
forgotten when its record expires, so a peer whose link came back is asked like anyone else.
"""
from __future__ import annotations

import concurrent.futures
import math
import random
import time

import torch
from hivemind.p2p import PeerID
from hivemind.utils.logging import get_logger

from sync.robust import robust_mean
from sync.swarm import PeerRecord, median_round
from sync.validate import validate_tensors

logger = get_logger(__name__)

Snapshot = dict[str, torch.Tensor]
# Twice the relative rounding error bound of a dtype a frozen expert copy may be stored in.
_ROUNDING = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -10}


class ExpertFetching:
    """Mixin of SparseSync: fetch, validate and aggregate the owners' copies of experts; download the swarm's
    state (shared tensors from up to 3 verified sources, experts from their owners) when joining or behind."""

    def _download_state(self, others: dict[str, PeerRecord]) -> None:
        # The median, never the max: a record claiming round 1e9 neither moves this counter nor is asked for
        # the state (sources are peers whose round is within one of the median). Never backwards.
        swarm_round = median_round(others.values())
        self.round_id = max(self.round_id, swarm_round)
        sources = [p for p, r in others.items() if abs(r.round - swarm_round) <= 1]
        random.shuffle(sources)
        copies = self._download_shared(sources, want=3)
        if self.shared.load_state(copies):
            logger.info(f"downloaded the shared tensors of round {self.round_id} from {len(copies)} peer(s)")
        else:
            logger.warning("no peer served valid shared tensors: keeping the local ones")
        means = self._fetch_means(others, set(range(self.model.cfg.num_experts)), own_snapshots={})
        for expert, mean in means.items():
            self.model.load_expert_tensors(expert, mean)
        self._reset_expert_references()

    def _download_shared(self, sources: list[str], want: int) -> list[list[torch.Tensor]]:
        """Shared-state copies from up to `want` of `sources` (fetched concurrently, more tried if some fail)."""
        timeout = min(self.cfg.round_timeout, 30.0)
        prefix = self.shared.averager.prefix
        copies: list[list[torch.Tensor]] = []
        with concurrent.futures.ThreadPoolExecutor(max(1, want)) as pool:
            for start in range(0, len(sources), want):
                batch = sources[start:start + want - len(copies)]
                results = pool.map(lambda p: self.exchange.download_state(PeerID.from_base58(p), prefix, timeout),
                                   batch)
                copies.extend(r for r in results if r is not None)
                if len(copies) >= want:
                    break
        return copies

    def _forget_strikes_of_gone(self, records: dict[str, PeerRecord]) -> None:
        for peer_id in [p for p in self._strikes if p not in records]:
            # Its record expired (it left, or its link was down): if it comes back it is asked like anyone else.
            self._strikes.pop(peer_id, None)
            self._retry_at.pop(peer_id, None)

    def _fetch_means(self, others: dict[str, PeerRecord], want: set[int], own_snapshots: dict[int, Snapshot],
                     rel_change: float | None = None) -> dict[int, Snapshot]:
        """Aggregate of the owners' copies (validated) for each wanted expert that other peers own; an expert
        whose every remote copy is missing or refused is left out (it keeps its local value).

        `rel_change` (this peer's own relative change this round; None when joining, where there is no
        synchronized value to compare with): a copy whose change from the last synchronized value exceeds
        sync.max_delta_ratio x that (x rounds since the expert last synchronized) is refused as "delta"."""
        owners: dict[int, list[PeerRecord]] = {}
        for record in others.values():
            for expert in record.experts:
                if expert in want:
                    owners.setdefault(expert, []).append(record)
        futures, finished_at = {}, {}
        started = time.monotonic()
        for expert, records in list(owners.items()):
            # An owner that let a fetch time out is skipped for 2, 4, 8.. rounds, then retried with a short
            # timeout: a claimed owner that never serves costs one timeout, not one per round.
            records = [r for r in records if self._retry_at.get(r.peer_id, 0) <= self.round_id]
            owners[expert] = records
            for record in records:
                timeout = self._fetch_timeout(record.peer_id)
                # An owner that is behind serves the newest round it has; one round of staleness is expected.
                round_id = min(self.round_id, record.round)
                future = self.exchange.fetch_async(PeerID.from_base58(record.peer_id), expert, round_id,
                                                   timeout=timeout)
                future.add_done_callback(lambda f, key=(expert, record.peer_id): finished_at.setdefault(key, time.monotonic()))
                futures[(expert, record.peer_id)] = (future, timeout)
        longest = max((t for _, t in futures.values()), default=0.0)
        concurrent.futures.wait([f for f, _ in futures.values()], timeout=longest + 5)
        means = {}
        for expert in sorted(owners):
            reference = own_snapshots.get(expert) or self.model.expert_tensors(expert)
            synced = self._expert_synced.get(expert) if expert in own_snapshots else self.model.expert_tensors(expert)
            copies = [own_snapshots[expert]] if expert in own_snapshots else []
            fresh = 0
            for record in owners[expert]:
                future, timeout = futures[(expert, record.peer_id)]
                received = future.result() if future.done() and not future.exception() else None
                elapsed = finished_at.get((expert, record.peer_id), time.monotonic()) - started
                self._note_serving(record.peer_id, received is not None or elapsed < 0.8 * timeout)
                if received is None:
                    continue
                tensors, reason = validate_tensors(received, reference, max_norm_ratio=self.cfg.max_norm_ratio)
                if tensors is None and reason is not None:
                    self.rejects.add(reason)
                elif rel_change is not None and synced is not None and not self._change_ok(expert, tensors, synced,
                                                                                           rel_change):
                    tensors, reason = None, "delta"
                    self.rejects.add(reason)
                if tensors is None:
                    logger.warning(f"refused expert {expert} from peer ...{record.peer_id[-6:]}: {reason}")
                    continue
                copies.append(tensors)
                fresh += 1
            if fresh:
                if len(copies) >= 3:
                    means[expert] = robust_mean(copies, self.cfg.clip_factor)
                else:
                    means[expert] = {n: torch.stack([c[n].float() for c in copies]).mean(dim=0) for n in reference}
        return means

    def _change_ok(self, expert: int, tensors: Snapshot, synced: Snapshot, rel_change: float) -> bool:
        """Is a copy's change from the expert's last synchronized value in proportion to an honest round's?"""
        change = math.sqrt(sum(float(torch.linalg.vector_norm(tensors[k].float() - synced[k].float())) ** 2
                               for k in synced))
        size = math.sqrt(sum(float(torch.linalg.vector_norm(synced[k].float())) ** 2 for k in synced))
        rounds = 1 + self._stale.get(expert, 0)
        # A frozen copy kept in bf16/fp16 differs from the owner's fp32 tensor by its rounding error alone
        # (up to 2^-9 / 2^-11 of each element): early rounds change an expert by about that much, so without
        # this floor every honest copy of round 1 was refused as "delta".
        rounding = max((_ROUNDING.get(t.dtype, 0.0) for t in synced.values()), default=0.0)
        return change <= (self.cfg.max_delta_ratio * rounds * max(rel_change, 1e-4) + rounding) * max(size, 1e-12)

    def _fetch_timeout(self, peer_id: str) -> float:
        if self._strikes.get(peer_id, 0) == 0:
            return self.cfg.round_timeout
        return min(self.cfg.round_timeout, max(2.0, self.cfg.matchmaking_time))

    def _note_serving(self, peer_id: str, served: bool) -> None:
        if served:
            self._strikes.pop(peer_id, None)
            self._retry_at.pop(peer_id, None)
        else:
            strikes = self._strikes[peer_id] = self._strikes.get(peer_id, 0) + 1
            self._retry_at[peer_id] = self.round_id + 2 ** min(strikes, 5)
            if strikes == 1:
                logger.warning(f"peer ...{peer_id[-6:]} claims experts but let a fetch time out: skipped for a "
                               f"few rounds, then retried with a short timeout")
