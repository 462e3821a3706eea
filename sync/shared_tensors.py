"""The shared tensors' round state (docs/DESIGN.md, "Rounds as contributions"):
their live parameters, the snapshot a round measures from, the last synchronized values every honest peer holds
alike, and DiLoCo's outer state. No averager process: contributions travel through sync/contrib_exchange.py and
joiners download the synchronized values from the expert exchange (sync/fetch.py `_download_shared`).
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from hivemind.utils.logging import get_logger

from model.model import SpesMoE
from sync.config import SyncConfig
from sync.robust import coordinate_median
from sync.validate import RejectCounter

logger = get_logger(__name__)


def load_shared_state(params: list[torch.Tensor], candidates: list[list[torch.Tensor]], max_norm_ratio: float,
                      reject: Callable[[str], None]) -> bool:
    """Copy into `params` the shared tensors downloaded from several peers: each copy must have the right shapes,
    be finite and have per-tensor norms within `max_norm_ratio` of the local ones (a x1000 state is refused); of
    three or more valid copies the coordinate-wise median is taken, so one hostile source cannot choose the state
    (identical honest copies: exactly theirs). False, and nothing changed, if none is valid."""
    bound = [max_norm_ratio * max(float(torch.linalg.vector_norm(p.detach().float())), 1e-3 * math.sqrt(p.numel()))
             for p in params]
    valid = []
    for tensors in candidates:
        if len(tensors) != len(params) or any(t.shape != p.shape for t, p in zip(tensors, params)):
            reject("shape")
        elif not all(bool(torch.isfinite(t).all()) for t in tensors):
            reject("nonfinite")
        elif any(float(torch.linalg.vector_norm(t.float())) > b for t, b in zip(tensors, bound)):
            reject("norm")
        else:
            valid.append([t.float() for t in tensors])
    if not valid:
        return False
    with torch.no_grad():
        for i, param in enumerate(params):
            stacked = torch.stack([copy[i] for copy in valid])
            value = coordinate_median(stacked) if len(valid) >= 3 else stacked[0]
            param.copy_(value.to(param.device, param.dtype))
    return True


class SharedTensors:
    """Snapshot, synchronized values and outer-optimizer state of the model's shared parameters."""

    def __init__(self, model: SpesMoE, cfg: SyncConfig, rejects: RejectCounter | None = None):
        self.cfg, self.rejects = cfg, rejects
        self.params = [p for _, p in model.shared_parameters()]
        self.snapshot: list[torch.Tensor] | None = None
        self.synced = [p.detach().to("cpu", torch.float32).clone() for p in self.params]
        nesterov = cfg.outer == "nesterov"
        # The outer optimizer steps from the synchronized values (its anchor: kept equal to them) with momentum.
        self.anchor = [s.clone() for s in self.synced] if nesterov else None
        self.momentum = [torch.zeros_like(s) for s in self.synced] if nesterov else None

    def take_snapshot(self, tensors: list[torch.Tensor] | None = None) -> None:
        """At the round boundary (training thread): the values a contribution is measured from."""
        source = self.params if tensors is None else tensors
        self.snapshot = [p.detach().to("cpu", torch.float32).clone() for p in source]

    def reset_reference(self) -> None:
        """The current parameters become the synchronized values (after a state download or a rollback)."""
        for synced, param in zip(self.synced, self.params):
            synced.copy_(param.detach().float().cpu())
        if self.anchor is not None:
            for anchor, synced in zip(self.anchor, self.synced):
                anchor.copy_(synced)

    def rebase_on_snapshot(self) -> None:
        for synced, snap in zip(self.synced, self.snapshot):
            synced.copy_(snap)

    def load_state(self, candidates: list[list[torch.Tensor]]) -> bool:
        """Joiner: the synchronized shared values from copies downloaded from several peers (load_shared_state);
        they become this peer's synchronized values. False (local values kept) if none is valid."""
        if not load_shared_state(self.params, candidates, self.cfg.max_norm_ratio, self._reject):
            return False
        self.reset_reference()
        return True

    def _reject(self, reason: str) -> None:
        if self.rejects is not None:
            self.rejects.add(reason)
