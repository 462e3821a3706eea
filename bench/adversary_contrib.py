"""Attacks on the contribution rounds: the c_* attacks of bench/adversary.py, a mixin of its `Attacker`.

Attacks on the contribution rounds. The attacker is a `SparseSync` peer like the honest ones, with a validly
signed record: it takes part in every round (it starts its round as soon as an honest record announces one:
fetches every blob, aggregates, applies), only its own contribution (`_contribute`, and for some its
ContributionExchange's `_serve`) is replaced:
- `c_silent`: announces a valid blob (size, sha256) but its handler never answers (stalls until it leaves);
- `c_slow`: serves its valid blob `part` (1) byte(s) every `interval` (1.0) s: each read is within the fetcher's
  idle bound, the blob never completes before its deadline;
- `c_garbage`: serves random bytes of an honest blob's size; the announced digest is theirs, so the digest
  passes and the decode must refuse;
- `c_huge`: announces and serves `size` (200e6) random bytes (the record allows up to sync.records.MAX_BLOB_BYTES);
- `c_copyset`: no SparseSync and no exchange at all: a signed record copying one honest peer's exact expert set,
  its round kept at the honest peers' lowest (so they wait for its announcement), never announcing a contribution;
- `c_stale`: contributes the previous round's honest mean change again (as decoded from their blobs);
- `c_reverse`: fetches this round's honest blobs first (it waits for their announcements), then contributes
  -`strength` (3) x their mean change, scaled down to the lower median of their norms when `fit` (1) (so no
  receiver clips it);
- `c_scale`: fetches this round's honest blobs first, contributes `factor` (100) x one honest peer's change;
- `c_init`: contributes (untrained initial shared weights - synchronized ones), claiming weight `weight` (2**62,
  the most the record allows).
Crafted contributions (c_stale, c_reverse, c_scale, c_init) go out as fp32 blobs (the header picks the method,
receivers accept any), so what receivers decode is exactly what the attacker computed. Attackers whose blob no
honest peer takes (silent, slow, garbage, huge) leave it out of their own aggregate too, so their synchronized
values stay the honest peers' (their `synced` digest matches; no divergence is reported because of it).
"""
from __future__ import annotations

import math
import time
from typing import Any, Sequence

import torch
from hivemind.utils.logging import get_logger

from peer.config import RunConfig

logger = get_logger(__name__)

CONTRIB_ATTACKS = ("c_silent", "c_slow", "c_garbage", "c_huge", "c_copyset", "c_stale", "c_reverse", "c_scale",
                   "c_init")
# Contribution attacks whose blob no honest peer can use (they leave it out of their own aggregate too).
UNUSABLE_BLOB_ATTACKS = frozenset({"c_silent", "c_slow", "c_garbage", "c_huge"})
# Contribution attacks that fetch the honest peers' blobs of the round before building their own.
PEEKING_ATTACKS = frozenset({"c_reverse", "c_scale"})


def honest_weight(cfg: RunConfig) -> float:
    """Tokens an honest peer trains in one round at the run's batch settings (what it claims as its weight)."""
    return float(cfg.train.batch_size * cfg.train.grad_accum * cfg.model.seq_len * max(cfg.sync.every, 1))


def supported_kwargs(fn: Any, **candidates: Any) -> dict[str, Any]:
    """The keyword arguments among `candidates` that `fn` (a function or class) accepts: lets the attacker and the
    tests wire things the way the current build's peers do, on builds before and after the defences landed."""
    import inspect
    params = inspect.signature(fn).parameters
    return {k: v for k, v in candidates.items() if k in params}


def _flat_norm(tensors: Sequence[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.float().pow(2).sum()) for t in tensors))


class ContribAttacks:
    """Mixin of bench.adversary.Attacker: the contribution-round attacks (its `sync`, `swarm`, `params`, `stats`,
    `cfg`, `attack`, `_stop`, `_spawn`, `_wait_for_honest`, ... are the Attacker's)."""

    def _install_contrib_attack(self) -> None:
        """Replace the attacker SparseSync's own contribution (and, for some attacks, its exchange's serving)."""
        sync = self.sync
        for name in ("contrib_exchange", "_contribute", "_relative_change", "_aggregate_shared", "_aggregate_experts",
                     "_expected_shapes", "_own_blob", "_spec", "_shared_names"):
            if not hasattr(sync, name):
                raise RuntimeError(f"{self.attack}: SparseSync no longer has {name}; update bench/adversary_contrib.py")
        self._prev_honest_mean: dict[str, torch.Tensor] | None = None  # previous round's honest shared mean change
        self._huge_blob: bytes | None = None
        original_shared, original_experts = sync._aggregate_shared, sync._aggregate_experts
        me = self.swarm.peer_id
        drop_own = self.attack in UNUSABLE_BLOB_ATTACKS

        def aggregate_shared(decoded, weights):
            honest = {p: d for p, d in decoded.items() if p != me}
            if honest:
                self._prev_honest_mean = self._mean_shared(list(honest.values()))
            if drop_own and honest:  # the honest peers aggregate without this attacker's (refused) blob
                decoded, weights = honest, {p: w for p, w in weights.items() if p != me}
            return original_shared(decoded, weights)

        def aggregate_experts(decoded, weights, announced, own, rel_change):
            if drop_own:
                decoded = {p: d for p, d in decoded.items() if p != me}
            return original_experts(decoded, weights, announced, own, rel_change)

        sync._contribute = self._contribute_attack
        # It trains nothing, so its own round's relative change (the yardstick for single-owner experts) is ~0 and
        # it would refuse every honest expert change, diverge, and re-download the state from the honest peers
        # every round (load on them that is no part of the attack): it takes every finite expert change instead.
        sync._relative_change = lambda own: math.inf
        sync._aggregate_shared = aggregate_shared
        sync._aggregate_experts = aggregate_experts
        if self.attack in ("c_silent", "c_slow"):
            sync.contrib_exchange._serve = self._stalling_serve

    def _mean_shared(self, contributions: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        names = self.sync._shared_names
        return {n: torch.stack([c[n].float() for c in contributions]).mean(0) for n in names}

    def _shared_norm(self, deltas: dict[str, torch.Tensor]) -> float:
        return _flat_norm([deltas[n] for n in self.sync._shared_names])

    def _own_deltas(self, own: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """What an honest contribution of this (untraining) peer holds: snapshot - synchronized, ~0."""
        sync = self.sync
        deltas = {n: snap - ref for n, snap, ref in zip(sync._shared_names, sync.shared.snapshot, sync.shared.synced)}
        for expert, snapshot in sorted(own.items()):
            ref = sync._expert_synced[expert]
            for k in sorted(ref):
                deltas[f"e{expert}/{k}"] = snapshot[k].float() - ref[k]
        return deltas

    def _peek_honest(self) -> list[dict[str, torch.Tensor]]:
        """This round's honest blobs, decoded, before the attacker announces its own: it waits for their
        announcements (at most half the matchmaking window, so the honest peers still wait for it), fetches them
        as any peer may, and decodes them as receivers do. In peer-ID order."""
        from sync.aggregate import contributors
        from sync.sparse import CodecError, decode
        sync, round_id = self.sync, self.sync.round_id
        deadline = time.monotonic() + 0.5 * self.cfg.sync.matchmaking_time
        announced: dict = {}
        while not self._stop.is_set():
            others = {p: r for p, r in self.swarm.peers().items() if p != self.swarm.peer_id}
            announced = contributors({p: r.announcement() for p, r in others.items()}, round_id)
            if len(announced) >= max(1, self.wait_peers) or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        if not announced:
            return []
        requests = [([p], p, a.round, a.size, a.digest) for p, a in announced.items()]
        results = sync.contrib_exchange.fetch_many(requests, deadline=time.monotonic() + 3.0)
        decoded = []
        for p, blob in results.items():
            if isinstance(blob, (bytes, bytearray)):
                try:
                    decoded.append(decode(blob, sync._expected_shapes(announced[p].experts),
                                          max_bytes=announced[p].size))
                except CodecError as e:
                    logger.debug(f"{self.log_prefix}: honest blob of ...{p[-6:]} undecodable: {e}")
        return decoded

    @torch.no_grad()
    def _contribute_attack(self, own: dict[int, dict[str, torch.Tensor]], weight: int) -> tuple[int, str, int]:
        """Stands in for SparseSync._contribute: build, keep and serve this round's (hostile) blob."""
        import dataclasses
        import os as _os
        from sync.sparse import blob_digest, encode
        sync, attack = self.sync, self.attack
        deltas = self._own_deltas(own)
        crafted = False
        if attack in PEEKING_ATTACKS:
            honest = self._peek_honest()
            self.stats.honest_seen.append(len(honest))
            if honest:
                norms = sorted(self._shared_norm(h) for h in honest)
                median = norms[(len(norms) - 1) // 2]
                self.stats.honest_norms.append(median)
                if attack == "c_scale":
                    change = honest[0]
                    for n in sync._shared_names:
                        deltas[n] = change[n].float() * float(self.params["factor"])
                else:  # c_reverse
                    mean = self._mean_shared(honest)
                    for n in sync._shared_names:
                        deltas[n] = -float(self.params["strength"]) * mean[n]
                    norm = self._shared_norm(deltas)
                    if self.params.get("fit") and norm > median > 0:
                        for n in sync._shared_names:
                            deltas[n] = deltas[n] * (median / norm)
                crafted = True
        elif attack == "c_stale" and self._prev_honest_mean is not None:
            for n in sync._shared_names:
                deltas[n] = self._prev_honest_mean[n].clone()
            crafted = True
        elif attack == "c_init":
            for n, init, synced in zip(sync._shared_names, self._init_shared, sync.shared.synced):
                deltas[n] = init - synced
            crafted = True
        spec = dataclasses.replace(sync._spec, method="fp32") if crafted else sync._spec
        blob, decoded = encode(deltas, spec)
        if crafted:
            self.stats.contrib_norms.append(self._shared_norm(decoded))
        if attack == "c_garbage":
            blob = _os.urandom(len(blob))
        elif attack == "c_huge":
            if self._huge_blob is None:
                self._huge_blob = _os.urandom(int(float(self.params["size"])))
            blob = self._huge_blob
        digest = blob_digest(blob)
        sync._own_blob = (sync.round_id, digest, decoded)
        sync.contrib_exchange.publish(sync.round_id, blob, digest)
        self.stats.contrib_sizes.append(len(blob))
        return len(blob), digest, 0

    async def _stalling_serve(self, uid: str, requester=None):
        """c_silent: never answers; c_slow: the header, then its blob `part` byte(s) per `interval` s. Either
        way until the requester gives up or this attacker leaves (at most 10 minutes)."""
        import asyncio
        from sync.contrib_exchange import _UID, _header
        exchange, stop = self.sync.contrib_exchange, self._stop
        self.stats.serves_stalled += 1
        until = time.monotonic() + 600.0
        blob = None
        if self.attack == "c_slow":
            match = _UID.fullmatch(uid)
            if match is not None:
                with exchange._lock:
                    blob = exchange._store.get((match[1], int(match[2]), match[4]))
        if blob is None:
            while not stop.is_set() and time.monotonic() < until:
                await asyncio.sleep(0.5)
            return
        from hivemind.proto import runtime_pb2
        yield _header(size=len(blob))
        part, interval = max(1, int(self.params["part"])), float(self.params["interval"])
        for offset in range(0, len(blob), part):
            if stop.is_set() or time.monotonic() >= until:
                return
            await asyncio.sleep(interval)
            yield runtime_pb2.ExpertResponse(metadata=blob[offset:offset + part])

    def _contrib_loop(self) -> None:
        """Take part in every contribution round: start one as soon as an honest record announces a round past
        this attacker's (it then contributes, waits for the others, fetches, aggregates and applies as they do)."""
        sync = self.sync
        weight = int(float(self.params.get("weight", honest_weight(self.cfg))))
        while not self._stop.is_set():
            others = {p: r for p, r in self.swarm.peers().items() if p != self.swarm.peer_id}
            if not any(r.round > sync.round_id for r in others.values()):
                self._stop.wait(0.2)
                continue
            step = max(int(r.step) for r in others.values())
            tokens = max(int(r.tokens) for r in others.values())
            report = sync.round(step, tokens, weight)
            self.stats.contrib_rounds += 1
            if report is not None:
                self.stats.group_sizes.append(int(report.group_size))
                logger.info(f"{self.log_prefix}: round {report.round_id}: aggregated {report.group_size} "
                            f"contribution(s), announced {self.stats.contrib_sizes[-1] if self.stats.contrib_sizes else '?'}"
                            f" bytes")
            if self.max_rounds and self.stats.contrib_rounds >= self.max_rounds:
                logger.info(f"{self.log_prefix}: {self.max_rounds} rounds done: stopping")
                self.request_stop()

    def _start_copyset(self, deadline: float) -> None:
        """A signed record copying one honest peer's exact expert set; no SparseSync, no exchange."""
        others = self._join_dht(deadline)
        target = min((r for r in others.values() if r.experts), key=lambda r: (len(r.experts), sorted(r.experts)))
        self.stats.copied = self.stats.claimed = sorted(target.experts)
        self.swarm.publish(experts=self.stats.claimed, round=min(r.round for r in others.values()),
                           step=int(target.step), tokens=int(target.tokens))
        self.swarm.start_heartbeat()
        self._spawn(self._copyset_loop, "copyset")

    def _copyset_loop(self) -> None:
        """Keep the record's round at the honest peers' lowest (so each of them waits for an announcement that
        never comes) and its step with theirs."""
        while not self._stop.wait(self.poll_s):
            others = [r for p, r in self.swarm.peers().items() if p != self.swarm.peer_id]
            if not others:
                continue
            want = min(int(r.round) for r in others)
            if self.swarm.record.round != want:
                self.swarm.publish(round=want, step=max(int(r.step) for r in others))
