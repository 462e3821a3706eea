"""SPES expert-merging warm-up (docs/DESIGN.md, "The method"): early in training, pull each expert toward its most similar peers.

At sync rounds started at a step that is a multiple of `merge.interval`, while
`alpha = merge.alpha * (1 - min(step / merge.decay_steps, 1)) > 0`, per layer:
experts are compared by the cosine similarity of their flattened gate projection (the first half of the rows of
the fused `gate_up_proj`, whose output goes through the activation); each expert i takes the `merge.topk` most
similar *other* experts j and moves by `alpha * mean_j (e_j - e_i)` on all its tensors, using pre-merge values
for every expert. Decentralized: each owner computes this for the experts it owns from the same synchronized
snapshot of all experts, so replicas stay identical and non-owners receive the merged experts in the owners' next
contributions — no extra traffic.
"""
from __future__ import annotations

import torch

from sync.config import MergeConfig

Snapshot = dict[str, torch.Tensor]   # one expert, all layers: "layers.{l}.gate_up_proj" / "layers.{l}.down_proj"


def merge_alpha(step: int, cfg: MergeConfig) -> float:
    """The warm-up coefficient at `step` (0 once decayed)."""
    return cfg.alpha * (1.0 - min(step / cfg.decay_steps, 1.0))


def merge_step(step: int, cfg: MergeConfig, since: int | None = None) -> int | None:
    """The multiple of `cfg.interval` that a round started at `step` merges for: the latest in (since, step], where
    `since` is the previous round's start step (default step - 1: only a round started exactly on a multiple).
    A round started a few steps late (held, sync.schedule) or early (sync.progress) so still merges once per
    multiple, at the coefficient of that multiple. None: no multiple in the range, or the warm-up is over."""
    since = step - 1 if since is None else since
    multiple = step - step % cfg.interval
    if multiple <= since or merge_alpha(multiple, cfg) <= 0:
        return None
    return multiple


def merge_due(step: int, cfg: MergeConfig, since: int | None = None) -> bool:
    """Whether a round started at `step` (the previous one at `since`) merges (merge_step)."""
    return merge_step(step, cfg, since) is not None


def merge_neighbours(gate_up_EFD: torch.Tensor, topk: int) -> torch.Tensor:
    """[E, topk] indices of the most cosine-similar other experts, from stacked gate_up [E, 2F, D] of one layer."""
    num_experts = gate_up_EFD.shape[0]
    half = gate_up_EFD.shape[1] // 2
    gate_EX = gate_up_EFD[:, :half].reshape(num_experts, -1).float()
    unit_EX = gate_EX / gate_EX.norm(dim=1, keepdim=True).clamp_min(1e-12)
    sim_EE = unit_EX @ unit_EX.T
    sim_EE.fill_diagonal_(float("-inf"))  # never pick itself
    return sim_EE.topk(min(topk, num_experts - 1), dim=1).indices


@torch.no_grad()
def merge_deltas(snapshot: dict[int, Snapshot], targets: list[int], alpha: float, topk: int,
                 layers: list[list[str]]) -> dict[int, Snapshot]:
    """alpha * mean_j (e_j - e_i) for each expert i in `targets`, per tensor, from the pre-merge `snapshot`
    (which must hold every expert of the model). `layers`: each layer's tensor names, gate projection first
    (SpesMoE.expert_tensor_names(layer))."""
    experts = sorted(snapshot)
    position = {e: k for k, e in enumerate(experts)}
    deltas: dict[int, Snapshot] = {e: {} for e in targets}
    if len(experts) < 2:
        return {e: {k: torch.zeros_like(v, dtype=torch.float32) for k, v in snapshot[e].items()} for e in targets}
    for names in layers:
        gate_up_EFD = torch.stack([snapshot[e][names[0]].float() for e in experts])
        neighbours_EK = merge_neighbours(gate_up_EFD, topk)
        for name in names:
            stacked = torch.stack([snapshot[e][name].float() for e in experts])
            for e in targets:
                i = position[e]
                deltas[e][name] = alpha * (stacked[neighbours_EK[i]].mean(dim=0) - stacked[i])
    return deltas
