"""SPES sync rounds for one peer (SPEC §1 "Sync every H local steps", §2b).

A round, started by the peer every `sync.every` local steps:
1. publish (training thread): snapshot the shared tensors and the experts this peer owns; the expert snapshots
   are served to others by `ExpertExchange`, and the DHT record gets the new round number;
2. in a background thread, while training goes on: the shared snapshot is all-reduced with the live peers
   (sync/shared.py, weights = tokens since the last round), then each expert's owners' snapshots are fetched
   (a non-owner fetches its owners', an owner its co-owners') — expert tensors travel only from owners,
   keyed by expert ID — and validated; a refused expert keeps its local copy and is counted;
3. at a later step boundary (training thread) the results are applied as deltas against the snapshots
   (one-round-delayed update), experts without a live owner are adopted, and a peer that fell more than one
   round behind re-downloads the swarm's state instead of averaging stale values.
`overlap: false` (or `round()`) does all of it at once, blocking.

Background processes per peer: the DHT node and one averager (each with its p2pd) — never one per expert.
"""
from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from hivemind.p2p import PeerID
from hivemind.utils.logging import get_logger

from model.model import SpesMoE
from sync.config import SyncConfig
from sync.merge import merge_alpha, merge_deltas, merge_due
from sync.shared import SharedAverager
from sync.swarm import PeerRecord, Swarm
from sync.transfer import ExpertExchange
from sync.validate import RejectCounter, validate_tensors

logger = get_logger(__name__)

Snapshot = dict[str, torch.Tensor]


@dataclass
class RoundReport:
    round_id: int
    group_size: int = 1                 # peers in the shared all-reduce (1: averaged with nobody)
    experts_synced: list[int] = field(default_factory=list)
    experts_missing: list[int] = field(default_factory=list)  # owned elsewhere, but no usable copy arrived
    rejected: int = 0
    expert_group_size: int = 0          # peers in the owned-experts all-reduce (0: not run)
    adopted: list[int] = field(default_factory=list)
    redownloaded: bool = False
    merge_alpha: float = 0.0            # > 0 when this round applied the expert-merging warm-up
    seconds: float = 0.0                # wall time from start to apply
    blocked_seconds: float = 0.0        # of which the training loop waited


@dataclass
class _Pending:
    report: RoundReport
    started: float
    own_snapshots: dict[int, Snapshot]
    future: concurrent.futures.Future   # -> (records, {expert: mean of owners' copies})
    behind: bool = False
    step: int = 0


def _run_in_daemon_thread(fn: Callable, *args) -> concurrent.futures.Future:
    """Run fn(*args) in a daemon thread: a round stuck on a dead peer must never keep the process alive."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def target() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:
            future.set_exception(e)

    threading.Thread(target=target, name="spes-round", daemon=True).start()
    return future


class SparseSync:
    """Drives SPES rounds for one peer; the caller (peer/) owns the training loop."""

    def __init__(self, model: SpesMoE, swarm: Swarm, cfg: SyncConfig,
                 set_owned: Callable[[list[int]], None], rejects: RejectCounter | None = None):
        self.model, self.swarm, self.cfg = model, swarm, cfg
        self.set_owned = set_owned
        self.rejects = rejects or RejectCounter()
        self.round_id = 0
        self.exchange = ExpertExchange(swarm.dht, namespace=swarm.run_id, compression=cfg.compression,
                                       rejects=self.rejects)
        self.shared = SharedAverager(model, swarm, cfg, rejects=self.rejects)
        self.max_owned = cfg.max_experts_per_peer or model.cfg.num_experts
        self._pending: _Pending | None = None
        # Experts seen with an owner: only these are adopted when orphaned (see Swarm.orphans_to_adopt).
        self._seen_owned: set[int] = set(model.owned_experts)
        # Replicas: peers owning exactly the same experts all-reduce them with a second averager (the DiLoCo
        # case: everyone owns everything); created lazily, re-created when ownership changes.
        self._expert_avg: SharedAverager | None = None
        self._expert_avg_key: tuple[int, ...] = ()
        self._closed_expert_avg_bytes = {"sent": 0, "received": 0}  # replica averagers already shut down

    # ---- joining ------------------------------------------------------------------------------------------

    def join(self, step: int, tokens: int) -> int:
        """Publish ownership; if the swarm already has peers, download its state. Returns the swarm's round."""
        others = self._others()
        if others:
            self._download_state(others)
        self._publish(step, tokens)
        self.swarm.start_heartbeat()
        return self.round_id

    def wait_for_peers(self, count: int, timeout: float, poll: float = 0.5) -> int:
        """Block until `count` peers (this one included) have live records, at most `timeout` seconds; returns
        how many were seen. Called once after join, before training."""
        deadline = time.monotonic() + timeout
        seen = len(self.swarm.peers())
        while seen < count and time.monotonic() < deadline:
            time.sleep(poll)
            seen = len(self.swarm.peers())
        return seen

    def _others(self, records: dict[str, PeerRecord] | None = None) -> dict[str, PeerRecord]:
        records = self.swarm.peers() if records is None else records
        return {p: r for p, r in records.items() if p != self.swarm.peer_id}

    def _download_state(self, others: dict[str, PeerRecord]) -> None:
        self.round_id = max(r.round for r in others.values())
        if self.shared.load_from_peers(timeout=self.cfg.round_timeout):
            logger.info(f"downloaded the shared tensors of round {self.round_id} from the swarm")
        else:
            logger.warning("no peer served the shared tensors: keeping the local ones")
        means = self._fetch_means(others, set(range(self.model.cfg.num_experts)), own_snapshots={})
        for expert, mean in means.items():
            self.model.load_expert_tensors(expert, mean)

    def _publish(self, step: int, tokens: int) -> dict[int, Snapshot]:
        snapshots = {}
        for expert in sorted(self.model.owned_experts):
            snapshots[expert] = {k: v.detach().to("cpu").clone() for k, v in self.model.expert_tensors(expert).items()}
            self.exchange.publish(self.round_id, expert, snapshots[expert])
        self.swarm.publish(experts=sorted(self.model.owned_experts), round=self.round_id, step=step, tokens=tokens)
        return snapshots

    # ---- rounds -------------------------------------------------------------------------------------------

    def round(self, step: int, tokens: int, tokens_since_last: int) -> RoundReport:
        """A whole round, blocking (start + finish)."""
        self.start_round(step, tokens, tokens_since_last)
        return self.finish_round(block=True)

    def start_round(self, step: int, tokens: int, tokens_since_last: int) -> RoundReport | None:
        """Snapshot and publish, then run the network part in the background. If the previous round is still
        running it is finished first (blocking) and its report returned."""
        previous = self.finish_round(block=True) if self._pending is not None else None
        started = time.perf_counter()
        self.round_id += 1
        report = RoundReport(self.round_id)
        self.shared.take_snapshot()
        own = self._publish(step, tokens)
        others = self._others()
        replicated = any(set(r.experts) == set(own) for r in others.values())
        expert_avg = self._expert_averager(own, replicated)
        behind = bool(others) and max(r.round for r in others.values()) > self.round_id + 1
        future = _run_in_daemon_thread(self._network_part, report, own, tokens_since_last,
                                       bool(others) and not behind, expert_avg)
        self._pending = _Pending(report, started, own, future, behind, step)
        return previous

    def _network_part(self, report: RoundReport, own: dict[int, Snapshot], weight: int, average: bool,
                      expert_avg: SharedAverager | None) -> tuple[dict[str, PeerRecord], dict[int, Snapshot]]:
        if average:
            report.group_size = max(1, self.shared.all_reduce(weight, timeout=self.cfg.round_timeout))
        # Read the records after the all-reduce: by then every peer of the group has published this round.
        records = self.swarm.peers()
        others = self._others(records)
        if not others or not average:
            return records, {}
        want = set(range(self.model.cfg.num_experts))
        if expert_avg is not None and any(set(r.experts) == set(own) for r in others.values()):
            report.expert_group_size = expert_avg.all_reduce(weight, timeout=self.cfg.round_timeout)
            if report.expert_group_size > 1:
                want -= set(own)  # averaged with the replicas already: nothing to fetch for them
        rejected_before = self.rejects.total()
        means = self._fetch_means(others, want, own)
        report.rejected = self.rejects.total() - rejected_before
        owned_elsewhere = {e for r in others.values() for e in r.experts} & want
        report.experts_synced = sorted(set(means) | (set(own) - want))
        report.experts_missing = sorted(owned_elsewhere - set(means))
        return records, means

    def _expert_averager(self, own: dict[int, Snapshot], replicated: bool) -> SharedAverager | None:
        """The averager over this peer's owned experts (training thread), snapshotted for this round; only
        started once another peer owns exactly the same experts."""
        key = tuple(sorted(own))
        if key != self._expert_avg_key and self._expert_avg is not None:
            self._closed_expert_avg_bytes["sent"] += self._expert_avg.bytes_sent()
            self._closed_expert_avg_bytes["received"] += self._expert_avg.bytes_received()
            self._expert_avg.shutdown()
            self._expert_avg = None
        self._expert_avg_key = key
        if not key or (self._expert_avg is None and not replicated):
            return None
        if self._expert_avg is None:
            params = [t for e in key for t in self._owned_params(e)]
            prefix = f"{self.swarm.run_id}_experts_{'-'.join(map(str, key))}"
            self._expert_avg = SharedAverager(self.model, self.swarm, self.cfg, params=params, prefix=prefix)
        self._expert_avg.take_snapshot()
        return self._expert_avg

    def _owned_params(self, expert: int) -> list[torch.Tensor]:
        return [getattr(bank.bank[expert], name) for bank in self.model.expert_banks()
                for name in bank.bank[expert].TENSOR_NAMES]

    def bytes_sent(self) -> dict[str, int]:
        """Tensor payload bytes (after compression) this peer sent so far, by kind ("shared", "expert")."""
        replicas = self._closed_expert_avg_bytes["sent"] + (self._expert_avg.bytes_sent() if self._expert_avg else 0)
        return {"shared": self.shared.bytes_sent(), "expert": self.exchange.bytes_sent.get("expert", 0) + replicas}

    def bytes_received(self) -> dict[str, int]:
        """Tensor payload bytes (after compression) this peer received so far, by kind ("shared", "expert")."""
        replicas = (self._closed_expert_avg_bytes["received"]
                    + (self._expert_avg.bytes_received() if self._expert_avg else 0))
        return {"shared": self.shared.bytes_received(),
                "expert": self.exchange.bytes_received.get("expert", 0) + replicas}

    def bytes_on_wire(self) -> dict[str, int]:
        """Tensor payload bytes this peer sent + received so far, by kind ("shared", "expert")."""
        sent, received = self.bytes_sent(), self.bytes_received()
        return {kind: sent[kind] + received[kind] for kind in sent}

    def finish_round(self, block: bool = False) -> RoundReport | None:
        """Apply a finished round (training thread). Non-blocking returns None while it still runs."""
        pending = self._pending
        if pending is None or (not block and not pending.future.done()):
            return None
        wait_start = time.perf_counter()
        try:
            # Every network wait inside is bounded; this bound is a last resort against a wedged round.
            records, means = pending.future.result(timeout=4 * self.cfg.round_timeout + 30)
        except Exception as e:  # never let a network failure kill training: the round is just lost
            logger.warning(f"round {pending.report.round_id} failed: {type(e).__name__}: {e}")
            records, means = {}, {}
        report = pending.report
        self._pending = None
        if pending.behind:
            logger.info(f"fell more than one round behind the swarm: re-downloading its state")
            self._download_state(self._others())
            report.redownloaded = True
        else:
            if report.group_size > 1:
                self.shared.apply()
            synced = self._synced_owned(means, pending.own_snapshots, report.expert_group_size > 1)
            if report.expert_group_size > 1 and self._expert_avg is not None:
                self._expert_avg.apply()
            self._apply_experts(means, pending.own_snapshots)
            if merge_due(pending.step, self.cfg.merge) and synced:
                report.merge_alpha = merge_alpha(pending.step, self.cfg.merge)
                self._merge(synced, report.merge_alpha)
        report.adopted = self._adopt(records) if records else []
        now = time.perf_counter()
        report.blocked_seconds = now - wait_start
        report.seconds = now - pending.started
        return report

    def _synced_owned(self, means: dict[int, Snapshot], own: dict[int, Snapshot], all_reduced: bool) -> dict[int, Snapshot]:
        """This round's synchronized (pre-merge) value of each expert this peer owns."""
        synced = {e: means.get(e, snapshot) for e, snapshot in own.items()}
        if all_reduced and self._expert_avg is not None:
            with self._expert_avg.averager.get_tensors() as averaged:
                names = [f"layers.{l}.{n}" for l in range(self.model.cfg.n_layers) for n in ("gate_up_proj", "down_proj")]
                values = iter(averaged)
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

    def _fetch_means(self, others: dict[str, PeerRecord], want: set[int],
                     own_snapshots: dict[int, Snapshot]) -> dict[int, Snapshot]:
        """Mean of the owners' copies (validated) for each wanted expert that other peers own; an expert whose
        every remote copy is missing or refused is left out (it keeps its local value)."""
        owners: dict[int, list[PeerRecord]] = {}
        for record in others.values():
            for expert in record.experts:
                if expert in want:
                    owners.setdefault(expert, []).append(record)
        futures = {}
        for expert, records in owners.items():
            for record in records:
                # An owner that is behind serves the newest round it has; one round of staleness is expected.
                round_id = min(self.round_id, record.round)
                futures[(expert, record.peer_id)] = self.exchange.fetch_async(
                    PeerID.from_base58(record.peer_id), expert, round_id, timeout=self.cfg.round_timeout)
        concurrent.futures.wait(futures.values(), timeout=self.cfg.round_timeout + 5)
        means = {}
        for expert in sorted(owners):
            reference = own_snapshots.get(expert) or self.model.expert_tensors(expert)
            copies = [own_snapshots[expert]] if expert in own_snapshots else []
            fresh = 0
            for record in owners[expert]:
                future = futures[(expert, record.peer_id)]
                received = future.result() if future.done() and not future.exception() else None
                if received is None:
                    continue
                tensors, reason = validate_tensors(received, reference, max_norm_ratio=self.cfg.max_norm_ratio)
                if tensors is None:
                    self.rejects.add(reason)
                    logger.warning(f"refused expert {expert} from peer ...{record.peer_id[-6:]}: {reason}")
                    continue
                copies.append(tensors)
                fresh += 1
            if fresh:
                means[expert] = {name: torch.stack([c[name].float() for c in copies]).mean(dim=0) for name in reference}
        return means

    def _adopt(self, records: dict[str, PeerRecord]) -> list[int]:
        self._seen_owned |= {e for r in records.values() for e in r.experts}
        adopt = self.swarm.orphans_to_adopt(self.model.owned_experts, self.max_owned, records, self._seen_owned)
        if adopt:
            owned = sorted(set(self.model.owned_experts) | set(adopt))
            logger.info(f"adopting orphaned experts {adopt}: no live owner")
            self.set_owned(owned)
            self.swarm.publish(experts=owned)
        return adopt

    # ---- leaving ------------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Leave cleanly: withdraw the record, stop the averager, the exchange and the DHT."""
        closers = [self.shared.shutdown, self.exchange.shutdown] + ([self._expert_avg.shutdown] if self._expert_avg else [])
        for closer in closers:
            try:
                closer()
            except Exception as e:
                logger.warning(f"shutdown: {e}")
        self.swarm.shutdown(withdraw=True)
