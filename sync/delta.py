"""The one rule for applying a round's result to a model that kept training while the round ran.

A round works on snapshots taken at its start; by the time its result arrives, the live tensors have moved on
by whatever this peer trained since. The result replaces the snapshot, not the live value:
`new = live + (result - snapshot)`, so the local progress made during the round is kept (the one-round-delayed
update of docs/DESIGN.md, "A round"). The shared tensors and the experts both use it.
"""
from __future__ import annotations

import torch


@torch.no_grad()
def rebased(live: torch.Tensor, result: torch.Tensor, snapshot: torch.Tensor) -> torch.Tensor:
    """live + (result - snapshot) in float32, on live's device (the caller casts it to its storage dtype)."""
    device = live.device
    return live.float() + (result.to(device, torch.float32) - snapshot.to(device, torch.float32))


@torch.no_grad()
def apply_rebased_(live: torch.Tensor, result: torch.Tensor, snapshot: torch.Tensor) -> None:
    """In place: live := live + (result - snapshot), in live's dtype. copy_ rather than add_: a bf16 tensor
    that the round did not change stays bit-exact."""
    live.copy_(rebased(live, result, snapshot).to(live.dtype))
