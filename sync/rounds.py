"""SPES sync rounds for one peer (SPEC §1 "Sync every H local steps", §2b).

A round, run by the peer every `sync.every` local steps:
1. publish: the peer snapshots the experts it owns for this round (served to others by `ExpertExchange`) and
   refreshes its DHT record (experts, round, step, tokens);
2. shared tensors (embeddings, attention, norms, router, LM head) are averaged across live peers with one
   hivemind `DecentralizedAverager`, weighted by tokens since the last round (`outer: nesterov` applies DiLoCo's
   outer step to the averaged pseudo-gradient instead);
3. every expert becomes the mean of its owners' round snapshots: a non-owner fetches them from the owners, an
   owner fetches its co-owners' (replicas) — expert tensors travel only from owners, keyed by expert ID;
4. every received tensor is validated first; a refused expert keeps its local copy and is counted;
5. experts that lost every live owner are adopted (deterministic winner, within `max_experts_per_peer`).

Background processes per peer: the DHT node and one averager (plus their p2pd daemons) — never one per expert.
"""
from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.p2p import PeerID
from hivemind.compression import Float16Compression, NoCompression, Uniform8BitQuantization
from hivemind.utils.logging import get_logger

from model.model import SpesMoE
from sync.config import SyncConfig
from sync.swarm import PeerRecord, Swarm
from sync.transfer import ExpertExchange, patch_hivemind_8bit_decoder
from sync.validate import RejectCounter, validate_tensors

logger = get_logger(__name__)

COMPRESSIONS = {"none": NoCompression, "fp16": Float16Compression, "8bit": Uniform8BitQuantization}


@dataclass
class RoundReport:
    round_id: int
    group_size: int = 1                 # peers in the shared all-reduce (1: averaged with nobody)
    experts_synced: list[int] = field(default_factory=list)
    experts_missing: list[int] = field(default_factory=list)  # no fresh copy could be had this round
    rejected: int = 0
    adopted: list[int] = field(default_factory=list)
    seconds: float = 0.0


class SharedAverager:
    """The shared (non-expert) tensors of the model in one DecentralizedAverager, with optional outer Nesterov."""

    def __init__(self, model: SpesMoE, swarm: Swarm, cfg: SyncConfig):
        self.cfg = cfg
        self.params = [p for _, p in model.shared_parameters()]
        if cfg.compression == "8bit":
            patch_hivemind_8bit_decoder()  # before the averager process forks, so it inherits the fix
        self.averager = DecentralizedAverager(
            [p.detach().to("cpu", torch.float32).clone() for p in self.params], swarm.dht,
            prefix=f"{swarm.run_id}_shared", start=True, min_group_size=2, target_group_size=None,
            min_matchmaking_time=cfg.matchmaking_time, request_timeout=min(3.0, cfg.matchmaking_time / 2),
            allreduce_timeout=cfg.round_timeout, next_chunk_timeout=min(10.0, cfg.round_timeout / 4),
            compression=COMPRESSIONS[cfg.compression](), allow_state_sharing=True,
        )
        # DiLoCo's outer optimizer needs the params of the previous round (identical on every peer after a
        # successful round) and a momentum buffer.
        self.anchor = [p.detach().to("cpu", torch.float32).clone() for p in self.params] if cfg.outer == "nesterov" else None
        self.momentum = [torch.zeros_like(a) for a in self.anchor] if self.anchor is not None else None

    def payload_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)

    def average(self, weight: float, timeout: float) -> int:
        """All-reduce the shared params with whoever is in this round; returns the group size (0 = failed)."""
        with self.averager.get_tensors() as tensors:
            for tensor, param in zip(tensors, self.params):
                tensor.copy_(param.detach())
        try:
            gathered = self.averager.step(weight=max(weight, 1e-6), timeout=timeout)
        except Exception as e:  # a peer died mid-round, matchmaking timed out, ...: keep local values
            logger.warning(f"shared averaging failed this round: {type(e).__name__}: {e}")
            gathered = None
        if not gathered:
            return 0
        with self.averager.get_tensors() as tensors, torch.no_grad():
            if self.anchor is None:
                for tensor, param in zip(tensors, self.params):
                    param.copy_(tensor)
            else:
                self._outer_step(tensors)
        return len(gathered)

    @torch.no_grad()
    def _outer_step(self, averaged: list[torch.Tensor]) -> None:
        lr, mu = self.cfg.outer_lr, self.cfg.outer_momentum
        for anchor, buf, avg, param in zip(self.anchor, self.momentum, averaged, self.params):
            pseudo_grad = anchor - avg
            buf.mul_(mu).add_(pseudo_grad)
            anchor.sub_(pseudo_grad.add(buf, alpha=mu), alpha=lr)
            param.copy_(anchor)

    def load_from_peers(self, timeout: float) -> bool:
        """Late joiner: copy the shared tensors from a live peer's averager; False if none answered."""
        try:
            loaded = self.averager.load_state_from_peers(timeout=timeout)
        except Exception as e:
            logger.warning(f"could not download shared state: {e}")
            return False
        if loaded is None:
            return False
        _, tensors = loaded
        if len(tensors) != len(self.params) or any(t.shape != p.shape for t, p in zip(tensors, self.params)):
            logger.warning("a peer sent shared state of the wrong shapes: ignored")
            return False
        if not all(torch.isfinite(t).all() for t in tensors):
            logger.warning("a peer sent non-finite shared state: ignored")
            return False
        with torch.no_grad():
            for tensor, param in zip(tensors, self.params):
                param.copy_(tensor)
        if self.anchor is not None:
            for anchor, param in zip(self.anchor, self.params):
                anchor.copy_(param.detach())
        return True

    def shutdown(self) -> None:
        self.averager.shutdown()


class SparseSync:
    """Drives SPES rounds for one peer; the caller (peer/) owns the training loop and calls `round()`."""

    def __init__(self, model: SpesMoE, swarm: Swarm, cfg: SyncConfig,
                 set_owned: Callable[[list[int]], None], rejects: RejectCounter | None = None):
        self.model, self.swarm, self.cfg = model, swarm, cfg
        self.set_owned = set_owned
        self.rejects = rejects or RejectCounter()
        self.round_id = 0
        self.exchange = ExpertExchange(swarm.dht, namespace=swarm.run_id, compression=cfg.compression,
                                       rejects=self.rejects)
        self.shared = SharedAverager(model, swarm, cfg)
        self.max_owned = cfg.max_experts_per_peer or model.cfg.num_experts

    # ---- joining ------------------------------------------------------------------------------------------

    def join(self, step: int, tokens: int) -> int:
        """Publish ownership; if the swarm already has peers, download its state. Returns the swarm's round."""
        others = {p: r for p, r in self.swarm.peers().items() if p != self.swarm.peer_id}
        if others:
            self.round_id = max(r.round for r in others.values())
            if self.shared.load_from_peers(timeout=self.cfg.round_timeout):
                logger.info("downloaded shared tensors from the swarm")
            else:
                logger.warning("no peer served the shared tensors: starting from the local init")
            missing = self._pull_experts(others, want=set(range(self.model.cfg.num_experts)), own_snapshots={})
            if missing:
                logger.warning(f"experts not downloaded at join (kept local init): {missing}")
        self._publish(step, tokens)
        self.swarm.start_heartbeat()
        return self.round_id

    def _publish(self, step: int, tokens: int) -> dict[int, dict[str, torch.Tensor]]:
        snapshots = {}
        for expert in sorted(self.model.owned_experts):
            snapshots[expert] = {k: v.detach().to("cpu").clone() for k, v in self.model.expert_tensors(expert).items()}
            self.exchange.publish(self.round_id, expert, snapshots[expert])
        self.swarm.publish(experts=sorted(self.model.owned_experts), round=self.round_id, step=step, tokens=tokens)
        return snapshots

    # ---- one round ----------------------------------------------------------------------------------------

    def round(self, step: int, tokens: int, tokens_since_last: int) -> RoundReport:
        start = time.perf_counter()
        self.round_id += 1
        report = RoundReport(self.round_id)
        snapshots = self._publish(step, tokens)
        if any(p != self.swarm.peer_id for p in self.swarm.peers()):
            report.group_size = max(1, self.shared.average(tokens_since_last, timeout=self.cfg.round_timeout))
        # Read the records after the all-reduce: by then every peer of the group has published this round.
        records = self.swarm.peers()
        others = {p: r for p, r in records.items() if p != self.swarm.peer_id}
        if others:
            rejected_before = self.rejects.total()
            want = set(range(self.model.cfg.num_experts))
            report.experts_missing = self._pull_experts(others, want, snapshots)
            report.experts_synced = sorted(want - set(report.experts_missing))
            report.rejected = self.rejects.total() - rejected_before
        report.adopted = self._adopt(records)
        report.seconds = time.perf_counter() - start
        return report

    def _pull_experts(self, others: dict[str, PeerRecord], want: set[int],
                      own_snapshots: dict[int, dict[str, torch.Tensor]]) -> list[int]:
        """Set each wanted expert to the mean of its owners' snapshots; returns experts left unchanged
        (orphans, or every copy missing/refused) among those that other peers own."""
        owners: dict[int, list[PeerRecord]] = {}
        for record in others.values():
            for expert in record.experts:
                if expert in want:
                    owners.setdefault(expert, []).append(record)
        futures: dict[tuple[int, str], concurrent.futures.Future] = {}
        for expert, records in owners.items():
            for record in records:
                # An owner that is behind serves the newest round it has; one round of staleness is expected.
                round_id = min(self.round_id, record.round)
                futures[(expert, record.peer_id)] = self.exchange.fetch_async(
                    PeerID.from_base58(record.peer_id), expert, round_id, timeout=self.cfg.round_timeout)
        concurrent.futures.wait(futures.values(), timeout=self.cfg.round_timeout + 5)
        missing = []
        for expert in sorted(owners):
            reference = self.model.expert_tensors(expert)
            copies = [own_snapshots[expert]] if expert in own_snapshots else []
            for record in owners[expert]:
                future = futures[(expert, record.peer_id)]
                received = future.result() if future.done() and not future.exception() else None
                if received is None:
                    continue
                tensors, reason = validate_tensors(received, reference, max_norm_ratio=self.cfg.max_norm_ratio)
                if tensors is None:
                    self.rejects.add(reason)
                    logger.warning(f"refused expert {expert} from {record.peer_id[-8:]}: {reason}")
                    continue
                copies.append(tensors)
            fresh = len(copies) - (1 if expert in own_snapshots else 0)
            if fresh == 0:
                missing.append(expert)
                continue
            mean = {name: torch.stack([c[name].float() for c in copies]).mean(dim=0) for name in reference}
            self.model.load_expert_tensors(expert, mean)
        return missing

    def _adopt(self, records: dict[str, PeerRecord]) -> list[int]:
        adopt = self.swarm.orphans_to_adopt(self.model.owned_experts, self.max_owned, records)
        if adopt:
            owned = sorted(set(self.model.owned_experts) | set(adopt))
            logger.info(f"adopting orphaned experts {adopt}: no live owner")
            self.set_owned(owned)
            self.swarm.publish(experts=owned)
        return adopt

    def shutdown(self) -> None:
        """Leave cleanly: withdraw the record, stop the averager, the exchange and the DHT."""
        for closer in (self.shared.shutdown, self.exchange.shutdown):
            try:
                closer()
            except Exception as e:
                logger.warning(f"shutdown: {e}")
        self.swarm.shutdown(withdraw=True)
