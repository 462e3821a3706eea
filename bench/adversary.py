"""Hostile swarm participants for measuring the defences of issue 9 (one attack per name).

    python -m bench.adversary --attack scale --initial-peers MADDR --config configs/tiny.yaml [--set KEY=VALUE ...]

Each attacker is built the way a real one would be: from plain hivemind classes and this project's own code, so
it speaks the wire protocol of whatever build it runs next to. Where a peer-like attacker is needed it is a
`SparseSync` on a model of the run's shape (its DHT record is published, and signed once records are signed,
by the project's `Swarm` with the attacker's *own* key); the forged-record attack uses a raw `hivemind.DHT`.

Attacks (`--param KEY=VALUE` changes the value in brackets):
- `nan`: joins every shared all-reduce with NaN tensors, claiming an honest token weight;
- `scale`: joins it with the last synchronized value x `factor` (1e6);
- `stale`: joins it with the untrained initial weights and a weight of `weight` (1e9);
- `signflip`: joins it in bounds, honest weight: the last synchronized value minus `strength` (3) x the honest
  mean change of the previous round (recovered from the result, as a plain weighted mean);
- `expert`: claims an expert an honest peer owns and serves `factor` (-9) x its initial value: finite,
  right-shaped and within the 10x norm bound;
- `round`: a record (claiming one expert, so that readers count it) with round `value` (2**62 - 1);
- `state`: a record with round `value` (1e9) plus an averager serving `factor` (1000) x the shared state with
  `state_sharing_priority` `priority` (1e9);
- `tombstone`: one raw DHT store per honest peer under that peer's subkey, `experts: []`, expiring in `ttl` (3600 s);
- `silent`: claims an expert and never answers requests for it.

Attacks on the contribution protocol (`sync.protocol: contributions`; the run's config must say so). The attacker
is a `SparseSync` peer like the honest ones, with a validly signed record: it takes part in every round (it starts
its round as soon as an honest record announces one: fetches every blob, aggregates, applies), only its own
contribution (`_contribute`, and for some its ContributionExchange's `_serve`) is replaced:
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

Attackers that need a claimed expert take one nobody owns when there is one ("spare"), so that what they serve
for it (the initial value every peer already holds) changes nothing but the attack itself; `--param expert=E`
chooses. An attacker never serves its state to joiners unless that is its attack (`state`).
The Python API (`start_attacker`) runs everything on background threads and processes of the calling process,
for tests; the CLI runs until SIGTERM/SIGINT, `--max-seconds` or `--max-rounds`, then shuts every DHT and
averager down (their p2pd daemons exit with them) and exits 0.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import math
import os
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from hivemind.utils import get_dht_time
from hivemind.utils.logging import get_logger

from peer.config import RunConfig

logger = get_logger(__name__)

ALLREDUCE_ERA_ATTACKS = ("nan", "scale", "stale", "signflip", "expert", "round", "state", "tombstone", "silent")
# Attacks on the contribution protocol (sync.protocol: contributions): see the module doc.
CONTRIB_ATTACKS = ("c_silent", "c_slow", "c_garbage", "c_huge", "c_copyset", "c_stale", "c_reverse", "c_scale",
                   "c_init")
ATTACKS = ALLREDUCE_ERA_ATTACKS + CONTRIB_ATTACKS
# Contribution attacks whose blob no honest peer can use (they leave it out of their own aggregate too).
UNUSABLE_BLOB_ATTACKS = frozenset({"c_silent", "c_slow", "c_garbage", "c_huge"})
# Contribution attacks that fetch the honest peers' blobs of the round before building their own.
PEEKING_ATTACKS = frozenset({"c_reverse", "c_scale"})
# Attacks that take part in the shared all-reduce (the bench gives honest peers a target group of 4 for them).
ALLREDUCE_ATTACKS = frozenset({"nan", "scale", "stale", "signflip"})
DEFAULTS: dict[str, dict[str, Any]] = {
    "nan": {}, "scale": {"factor": 1e6}, "stale": {"weight": 1e9}, "signflip": {"strength": 3.0},
    "expert": {"factor": -9.0}, "round": {"value": 2**62 - 1},
    "state": {"value": 10**9, "factor": 1000.0, "priority": 1e9}, "tombstone": {"ttl": 3600.0}, "silent": {},
    "c_silent": {}, "c_slow": {"interval": 1.0, "part": 1}, "c_garbage": {}, "c_huge": {"size": 200e6},
    "c_copyset": {}, "c_stale": {}, "c_reverse": {"strength": 3.0, "fit": 1}, "c_scale": {"factor": 100.0},
    "c_init": {"weight": 2**62},
}
LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)


@dataclass
class AttackStats:
    """What the attacker did, for the benchmark's table and the tests' checks."""

    attack: str
    peer_id: str = ""
    claimed: list[int] = field(default_factory=list)
    allreduce_tries: int = 0
    allreduce_joined: int = 0                       # rounds the attacker's tensors were part of (group > 1)
    group_sizes: list[int] = field(default_factory=list)
    targets: list[str] = field(default_factory=list)  # honest subkeys the tombstone was stored under
    stores_accepted: int = 0
    stores_refused: int = 0
    served_rounds: int = 0                          # (expert, round) entries published for fetchers
    contrib_rounds: int = 0                         # contribution rounds the attacker took part in
    contrib_sizes: list[int] = field(default_factory=list)  # bytes announced per round
    contrib_norms: list[float] = field(default_factory=list)  # shared-tensor norm of each crafted contribution
    honest_norms: list[float] = field(default_factory=list)   # lower median of honest decoded norms it saw
    honest_seen: list[int] = field(default_factory=list)      # honest blobs decoded before building its own
    serves_stalled: int = 0                         # requests c_silent / c_slow held
    copied: list[int] = field(default_factory=list)  # c_copyset: the expert set copied
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


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


class Attacker:
    """One hostile participant. `start()` blocks until it is in the swarm; `shutdown()` leaves. See module doc."""

    def __init__(self, attack: str, initial_peers: Sequence[str], cfg: RunConfig,
                 params: dict[str, Any] | None = None, host_maddrs: Sequence[str] = LOOPBACK,
                 wait_peers: int = 1, max_rounds: int = 0, poll_s: float = 0.5):
        """`wait_peers`: honest records to wait for before choosing targets; `max_rounds`: stop after that many
        all-reduce rounds joined (0 = never)."""
        if attack not in ATTACKS:
            raise ValueError(f"unknown attack {attack!r}; choose one of {', '.join(ATTACKS)}")
        self.attack, self.cfg = attack, cfg
        self.params = {**DEFAULTS[attack], **(params or {})}
        self.initial_peers, self.host_maddrs = list(initial_peers), list(host_maddrs)
        self.wait_peers, self.max_rounds, self.poll_s = wait_peers, max_rounds, poll_s
        self.stats = AttackStats(attack)
        self.log_prefix = f"attacker {attack}"  # for peer.stop.StopOnSignal
        self.served: dict[int, dict[str, torch.Tensor]] = {}  # what this attacker serves per claimed expert
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._raw_dht = None
        self.swarm = self.sync = self.model = None
        self._init_shared: list[torch.Tensor] = []
        self._init_experts: dict[int, dict[str, torch.Tensor]] = {}

    # ---- lifetime -----------------------------------------------------------------------------------------

    def start(self, timeout: float = 120.0) -> "Attacker":
        """Join the swarm and start the attack; raises (after cleaning up) if it cannot within `timeout`."""
        deadline = time.monotonic() + timeout
        try:
            if self.attack == "tombstone":
                self._start_tombstone(deadline)
            elif self.attack == "c_copyset":
                self._start_copyset(deadline)
            else:
                self._start_peer(deadline)
        except BaseException:
            self.shutdown()
            raise
        logger.info(f"{self.log_prefix} ready: peer ...{self.stats.peer_id[-6:]}, claims {self.stats.claimed}")
        return self

    def request_stop(self) -> None:
        """Stop attacking (from a signal handler or any thread); `shutdown()` still has to be called."""
        self._stop.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until stopped (request_stop or max_rounds); True if stopped."""
        return self._stop.wait(timeout)

    def shutdown(self) -> None:
        """Stop every thread, averager and DHT this attacker started. Idempotent."""
        self.request_stop()
        # Processes first: an all-reduce the attack thread is blocked in ends with its averager (else it would
        # wait for its timeout); the threads see the stop flag and exit, errors after it are expected and quiet.
        if self.sync is not None:
            try:
                self.sync.shutdown()  # averager, exchange, heartbeat, record withdrawal, DHT
            except Exception as e:
                logger.warning(f"{self.log_prefix}: shutdown: {e}")
            self.sync = None
        elif self.swarm is not None:
            self.swarm.shutdown(withdraw=False)
        self.swarm = None
        if self._raw_dht is not None:
            self._raw_dht.shutdown()
            self._raw_dht = None
        # Daemon threads: one still waiting on the (now stopped) averager's bounded future dies with the process.
        for thread in self._threads:
            thread.join(timeout=2.0)
        self._threads = []

    def __enter__(self) -> "Attacker":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- a peer-like attacker (SparseSync) ----------------------------------------------------------------

    def _start_peer(self, deadline: float) -> None:
        from model.model import SpesMoE
        from sync.rounds import SparseSync
        from sync.swarm import Swarm, start_dht

        # Whatever the project's peers pass to start their DHT node (run_id, ... once records are signed and
        # validated), the attacker passes too: its record is then signed with its own key, as a real one's is.
        dht = start_dht(self.initial_peers, self.host_maddrs, **supported_kwargs(
            start_dht, run_id=self.cfg.run_id, num_experts=self.cfg.model.num_experts,
            record_ttl=self.cfg.sync.record_ttl))
        self.swarm = Swarm(dht, self.cfg.run_id, self.cfg.model.num_experts, ttl=self.cfg.sync.record_ttl)
        self.stats.peer_id = self.swarm.peer_id
        others = self._wait_for_honest(deadline)
        claims = self._choose_claims(others)
        self.stats.claimed = claims
        self.model = SpesMoE(self.cfg.model, owned_experts=claims, seed=self.cfg.train.seed)
        # The untrained values, before join() downloads the swarm's: `stale` sends them, `expert` scales them.
        self._init_shared = [p.detach().float().clone() for _, p in self.model.shared_parameters()]
        self._init_experts = {e: {k: v.detach().float().clone() for k, v in self.model.expert_tensors(e).items()}
                              for e in claims}
        contrib = self.attack in CONTRIB_ATTACKS
        if contrib and self.cfg.sync.protocol != "contributions":
            raise ValueError(f"{self.attack}: the run's config must say sync.protocol: contributions "
                             f"(it says {self.cfg.sync.protocol!r})")
        # As peer/node.py builds an honest peer's (the weight cap matters for the attacker's own aggregate).
        from peer.node import round_token_cap
        self.sync = SparseSync(self.model, self.swarm, self.cfg.sync, **supported_kwargs(
            SparseSync, max_weight=round_token_cap(self.cfg)))
        # Builds whose contribution protocol runs no averager (sync.shared_tensors) have none to configure.
        averager = getattr(self.sync.shared, "averager", None)
        if averager is None and self.attack == "state":
            raise RuntimeError("state attack: this build's SparseSync has no averager (sync.protocol: contributions?)")
        if averager is not None:
            # Serving corrupted or stale state to joiners would mix a second attack into every other one.
            averager.allow_state_sharing = self.attack == "state"
        if self.attack == "silent":
            self._make_silent()
        if contrib:
            self._install_contrib_attack()
        self.sync.join(step=0, tokens=0)  # downloads the swarm's state, publishes the record, starts the heartbeat
        if self.attack == "state":
            shared = [p.detach().float() for _, p in self.model.shared_parameters()]
            with averager.get_tensors() as tensors:
                for tensor, value in zip(tensors, shared):
                    tensor.copy_(value * self.params["factor"])
            averager.state_sharing_priority = float(self.params["priority"])
        if contrib:  # a real peer's rounds: the record, expert serving and contribution all go through SparseSync
            self._spawn(self._contrib_loop, "contrib")
            return
        for e in claims:
            self.served[e] = self._served_tensors(e)
        self._spawn(self._mirror_loop, "mirror")
        if self.attack in ALLREDUCE_ATTACKS:
            self._spawn(self._allreduce_loop, "allreduce")

    def _wait_for_honest(self, deadline: float) -> dict:
        others: dict = {}
        while time.monotonic() < deadline and not self._stop.is_set():
            others = {p: r for p, r in self.swarm.peers().items() if p != self.swarm.peer_id}
            if len(others) >= self.wait_peers:
                return others
            time.sleep(self.poll_s)
        if not others:
            raise TimeoutError(f"{self.log_prefix}: no honest peer record appeared")
        logger.warning(f"{self.log_prefix}: only {len(others)} of {self.wait_peers} honest peers seen: attacking")
        return others

    def _choose_claims(self, others: dict) -> list[int]:
        num_experts = self.cfg.model.num_experts
        if "expert" in self.params:
            return [int(self.params["expert"])]
        owned_sets = [set(r.experts) for r in others.values()]
        owned = set().union(*owned_sets) if owned_sets else set()
        spare = [e for e in range(num_experts) if e not in owned]
        if self.attack == "expert":
            # An expert whose owner also owns others: claiming exactly an owner's set would start its replica
            # averager as well, a second channel this attack does not need.
            for candidates in ([e for e in sorted(owned) if not any(s == {e} for s in owned_sets)], sorted(owned)):
                if candidates:
                    return [candidates[0]]
            raise RuntimeError("expert attack: no honest peer owns an expert")
        if spare:
            return [spare[0]]
        # No spare expert: a peer-like attacker must claim one to be counted as a peer at all.
        return [min(owned)] if owned and (self.attack in ("round", "state", "silent")
                                          or self.attack in CONTRIB_ATTACKS) else []

    def _served_tensors(self, expert: int) -> dict[str, torch.Tensor]:
        if self.attack == "expert":
            return {k: v * float(self.params["factor"]) for k, v in self._init_experts[expert].items()}
        # Everyone else serves its honest copy (for a spare expert: the initial value every peer holds).
        return {k: v.detach().float().clone() for k, v in self.model.expert_tensors(expert).items()}

    def _make_silent(self) -> None:
        """Answer expert requests never: every fetch from this peer waits for its full timeout."""
        exchange = self.sync.exchange
        if not hasattr(exchange, "_serve"):
            raise RuntimeError("silent attack: sync.transfer.ExpertExchange no longer has _serve; update the attack")
        stop = self._stop

        async def never(uid: str, metadata: bytes = b"", requester=None):
            import asyncio
            while not stop.is_set():
                await asyncio.sleep(0.5)
            return
            yield  # an async generator, as _serve is

        exchange._serve = never

    def _spawn(self, target, name: str) -> None:
        thread = threading.Thread(target=self._guard, args=(target,), name=f"attacker-{name}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def _guard(self, target) -> None:
        try:
            target()
        except Exception as e:  # a dying attacker thread must not take the process (or the test) with it
            if not self._stop.is_set():
                logger.warning(f"{self.log_prefix}: {target.__name__} failed: {type(e).__name__}: {e}")
                self.stats.errors.append(f"{type(e).__name__}: {e}")

    def _mirror_loop(self) -> None:
        """Keep the record's round where the attack wants it and serve the claimed experts for every round
        honest peers may ask for (their own round and the next: fetchers ask for min(theirs, ours))."""
        lie = self.params.get("value") if self.attack in ("round", "state") else None
        served: set[tuple[int, int]] = set()
        while not self._stop.wait(self.poll_s):
            others = [r for p, r in self.swarm.peers().items() if p != self.swarm.peer_id]
            if not others:
                continue
            honest_round = int(statistics.median_low([r.round for r in others]))
            for expert, tensors in self.served.items():
                for round_id in (honest_round, honest_round + 1):
                    if (expert, round_id) not in served:
                        self.sync.exchange.publish(round_id, expert, tensors)
                        served.add((expert, round_id))
                        self.stats.served_rounds += 1
            want = int(lie) if lie is not None else honest_round
            if self.swarm.record.round != want:
                try:
                    self.swarm.publish(round=want)
                except Exception as e:  # e.g. a build whose own record schema refuses the lie: keep serving
                    logger.warning(f"{self.log_prefix}: could not publish round {want}: {type(e).__name__}: {e}")
                    self.stats.errors.append(f"publish round {want}: {type(e).__name__}: {e}")
                    self.swarm.record.round = want  # do not retry every poll

    def _contribution(self, synced: list[torch.Tensor], honest_change: list[torch.Tensor] | None) -> list[torch.Tensor]:
        if self.attack == "nan":
            return [torch.full_like(s, float("nan")) for s in synced]
        if self.attack == "scale":
            return [s * float(self.params["factor"]) for s in synced]
        if self.attack == "stale":
            return [t.clone() for t in self._init_shared]
        # signflip: the opposite of what honest peers did last round, scaled; before any round, no change at all.
        if honest_change is None:
            return [s.clone() for s in synced]
        return [s - float(self.params["strength"]) * d for s, d in zip(synced, honest_change)]

    @torch.no_grad()
    def _allreduce_loop(self) -> None:
        """Stay in matchmaking all the time, so every honest round finds this attacker in its group."""
        params = [p for _, p in self.model.shared_parameters()]
        synced = [p.detach().float().clone() for p in params]  # the last synchronized value, as far as known
        honest_change: list[torch.Tensor] | None = None
        weight = float(self.params.get("weight", honest_weight(self.cfg)))
        while not self._stop.is_set():
            sent = self._contribution(synced, honest_change)
            for p, value in zip(params, sent):
                p.copy_(value)
            self.sync.shared.take_snapshot()
            self.stats.allreduce_tries += 1
            group = self.sync.shared.all_reduce(weight, timeout=self.cfg.sync.round_timeout)
            result = None
            if group > 1 and not self._stop.is_set():
                try:
                    self.sync.shared.apply()  # params were the snapshot, so they become the round's result
                    result = [p.detach().float().clone() for p in params]
                except Exception as e:
                    logger.debug(f"{self.log_prefix}: apply failed: {e}")
                self.stats.allreduce_joined += 1
                self.stats.group_sizes.append(group)
                logger.info(f"{self.log_prefix}: joined an all-reduce of {group} peers")
            # Keep a sane base: a result the attack itself blew up (or NaN) would only attack the attacker.
            if result is not None and all(bool(torch.isfinite(r).all()) for r in result) \
                    and _flat_norm(result) <= 10 * max(_flat_norm(synced), 1e-6):
                if self.attack == "signflip" and group > 1:
                    # Plain mean with equal weights: result = (sum honest + sent) / group.
                    honest_mean = [(r * group - s) / (group - 1) for r, s in zip(result, sent)]
                    honest_change = [h - b for h, b in zip(honest_mean, synced)]
                synced = result
            for p, value in zip(params, synced):
                p.copy_(value)
            if self.max_rounds and self.stats.allreduce_joined >= self.max_rounds:
                logger.info(f"{self.log_prefix}: {self.max_rounds} rounds joined: stopping")
                self.request_stop()

    # ---- contribution-protocol attacks (sync.protocol: contributions) --------------------------------------

    def _install_contrib_attack(self) -> None:
        """Replace the attacker SparseSync's own contribution (and, for some attacks, its exchange's serving)."""
        sync = self.sync
        if not getattr(sync, "contributing", False) or sync.contrib_exchange is None:
            raise RuntimeError(f"{self.attack}: this build's SparseSync has no contribution protocol")
        for name in ("_contribute", "_relative_change", "_aggregate_shared", "_aggregate_experts", "_expected_shapes", "_own_blob",
                     "_spec", "_shared_names"):
            if not hasattr(sync, name):
                raise RuntimeError(f"{self.attack}: SparseSync no longer has {name}; update bench/adversary.py")
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
        from sync.swarm import Swarm, start_dht
        dht = start_dht(self.initial_peers, self.host_maddrs, **supported_kwargs(
            start_dht, run_id=self.cfg.run_id, num_experts=self.cfg.model.num_experts,
            record_ttl=self.cfg.sync.record_ttl))
        self.swarm = Swarm(dht, self.cfg.run_id, self.cfg.model.num_experts, ttl=self.cfg.sync.record_ttl)
        self.stats.peer_id = self.swarm.peer_id
        others = self._wait_for_honest(deadline)
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

    # ---- forged records on a raw hivemind DHT -------------------------------------------------------------

    def _start_tombstone(self, deadline: float) -> None:
        import hivemind

        self._raw_dht = hivemind.DHT(initial_peers=self.initial_peers, host_maddrs=self.host_maddrs, start=True,
                                     record_validators=[_signature_stripper()])
        self.stats.peer_id = str(self._raw_dht.peer_id)
        try:
            from sync.records import peers_key
            self._key = peers_key(self.cfg.run_id)
        except ImportError:  # builds before signed records: sync.swarm.Swarm.key
            self._key = f"{self.cfg.run_id}_peers"
        while time.monotonic() < deadline and len(self._honest_subkeys()) < self.wait_peers:
            time.sleep(self.poll_s)
        self._plant()
        if not self.stats.targets:
            raise TimeoutError(f"{self.log_prefix}: no honest record found under {self._key!r}")
        self._spawn(self._tombstone_loop, "tombstone")

    def _honest_subkeys(self) -> list:
        """Live subkeys of the run's record key that are not tombstones already (whatever their value's form:
        a node without the run's validators may not even decode a signed value)."""
        try:
            found = self._raw_dht.get(self._key, latest=True)
        except Exception as e:
            logger.debug(f"{self.log_prefix}: get failed: {e}")
            return []
        value = getattr(found, "value", None)
        if not isinstance(value, dict):
            return []
        now = get_dht_time()
        subkeys = []
        for subkey, item in value.items():
            record = getattr(item, "value", None)
            if getattr(item, "expiration_time", 0) < now or (isinstance(record, dict) and not record.get("experts")):
                continue
            subkeys.append(subkey)
        return subkeys

    def _plant(self) -> None:
        """One store per honest subkey not yet targeted, with exactly the subkey (str or bytes) found."""
        for subkey in self._honest_subkeys():
            name = subkey.decode(errors="replace") if isinstance(subkey, bytes) else str(subkey)
            if name in self.stats.targets:
                continue
            tombstone = {"experts": [], "round": 0, "step": 0, "tokens": 0}
            ok = self._raw_dht.store(self._key, subkey=subkey, value=tombstone,
                                     expiration_time=get_dht_time() + float(self.params["ttl"]))
            self.stats.targets.append(name)
            if ok:
                self.stats.stores_accepted += 1
            else:
                self.stats.stores_refused += 1
            logger.info(f"{self.log_prefix}: tombstone under ...{name[-6:]}: {'stored' if ok else 'refused'}")

    def _tombstone_loop(self) -> None:
        while not self._stop.wait(2.0):
            self._plant()  # honest peers that join later get theirs too


def _signature_stripper():
    """A validator that lets the raw DHT *read* records signed in hivemind's RSASignatureValidator format (their
    value bytes carry a signature suffix that msgpack alone cannot decode) while checking and signing nothing:
    the attacker's own node keeps and serves its forged values; honest nodes are the ones that must refuse them."""
    from hivemind.dht.crypto import RSASignatureValidator

    class Stripper(RSASignatureValidator):
        def validate(self, record) -> bool:
            return True

        def sign_value(self, record) -> bytes:
            return record.value

    return Stripper()


def start_attacker(name: str, initial_peers: Sequence[str], cfg: RunConfig, params: dict[str, Any] | None = None,
                   wait_peers: int = 1, timeout: float = 120.0, **kwargs: Any) -> Attacker:
    """Start attack `name` against the swarm reachable through `initial_peers` (same process); returns once it
    is in the swarm. Call `.shutdown()` (or use it as a context manager) to stop it."""
    return Attacker(name, initial_peers, cfg, params=params, wait_peers=wait_peers, **kwargs).start(timeout)


def _parse_params(items: Sequence[str]) -> dict[str, Any]:
    import yaml
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"bad --param {item!r}: expected KEY=VALUE")
        value = yaml.safe_load(raw)
        if isinstance(value, str):  # YAML 1.1 reads 1e9 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.adversary", description=__doc__.split("\n\n")[0])
    p.add_argument("--attack", required=True, choices=ATTACKS, help="which attack to run")
    p.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR", help="multiaddrs of the swarm")
    p.add_argument("--config", metavar="FILE", help="the run's YAML config (model shape, run_id, sync settings)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="attack parameter, e.g. factor=1e3, expert=2, value=1000 (repeatable)")
    p.add_argument("--host-maddrs", nargs="+", default=list(LOOPBACK), metavar="MADDR", help="where to listen")
    p.add_argument("--wait-peers", type=int, default=1, help="honest records to wait for before attacking")
    p.add_argument("--max-seconds", type=float, default=0, help="stop after this many seconds (0 = never)")
    p.add_argument("--max-rounds", type=int, default=0, help="stop after joining this many all-reduces (0 = never)")
    p.add_argument("--stats-out", metavar="FILE", help="write what the attacker did as JSON here on exit")
    args = p.parse_args(argv)
    from peer.config import ConfigError, load_config, parse_override
    from peer.run import keep_p2pd_out_of_terminal_signals, setup_logging
    from peer.stop import StopOnSignal

    setup_logging()
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` dumps every thread's stack (a hung shutdown)
    try:
        cfg = load_config(args.config, [parse_override(s) for s in args.set])
        params = _parse_params(args.param)
    except (ConfigError, ValueError) as e:
        logger.error(f"error: {e}")
        return 2
    keep_p2pd_out_of_terminal_signals()  # p2pd dies with its DHT/averager, whatever kills them
    attacker = Attacker(args.attack, args.initial_peers, cfg, params=params, host_maddrs=args.host_maddrs,
                        wait_peers=args.wait_peers, max_rounds=args.max_rounds)
    started = time.monotonic()
    with StopOnSignal(attacker):  # first SIGTERM/SIGINT: stop and leave cleanly; forked children die as usual
        try:
            start_timeout = max(60.0, 2 * cfg.sync.round_timeout)
            attacker.start(timeout=min(start_timeout, args.max_seconds) if args.max_seconds else start_timeout)
            while not attacker.wait(1.0):
                if args.max_seconds and time.monotonic() - started > args.max_seconds:
                    break
        except Exception as e:
            logger.error(f"{attacker.log_prefix}: {type(e).__name__}: {e}")
            attacker.stats.errors.append(f"{type(e).__name__}: {e}")
        finally:
            attacker.shutdown()
    if args.stats_out:
        with open(args.stats_out, "w") as f:
            json.dump(attacker.stats.to_dict(), f, indent=1)
    logger.info(f"{attacker.log_prefix}: left; {json.dumps(attacker.stats.to_dict())[:400]}")
    return 0


if __name__ == "__main__":
    code = main()
    # Everything is shut down and the stats are written. Exit without the interpreter's finalization: it ends
    # daemon threads still inside a torch op (an attack thread given up after its join timeout) by unwinding
    # them through C++ noexcept frames, which aborts the process ("terminate called without an active
    # exception", rc -6, seen once in CI after "left").
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
