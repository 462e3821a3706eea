"""Trainer callbacks: everything that hooks into the training loop, and the state it must keep across restarts.

Modelled on OLMo-core's `Callback(Stateful)`: a callback gets events from `Trainer.run` (`post_step` after every
optimizer step, `on_nonfinite` before a bad step is retried, `on_stop_requested` from a signal handler,
`post_train` once when the loop ends, before the final checkpoint) and may carry state through checkpoints with
`state_dict`/`load_state_dict`. The trainer writes that state into its own checkpoint (tensors under
`callbacks.<name>.`, JSON under `metadata["callbacks"][name]`) and hands it back to the callback of that name when
one is added to a resumed trainer, so a restarted peer continues its sync state instead of starting it over
(docs/DESIGN.md, "Durable sync state").

This file never talks to the network itself: the sync callback (peer/node.py) wraps sync/'s `SparseSync`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from peer.train import Trainer


class CallbackStateError(ValueError):
    """A callback's checkpointed state is malformed (the callback starts fresh; the trainer says so)."""


class Callback:
    """Base class: override the events and, for a callback with state, `state_dict`/`load_state_dict`.

    `name` keys the callback's state in checkpoints: two callbacks with state need distinct names."""

    name: str = "callback"

    def post_step(self, trainer: "Trainer") -> None:
        """After every optimizer step with a finite loss (trainer.step already counts it)."""

    def needs_checked_step(self, trainer: "Trainer") -> bool:
        """Whether the next step's loss must be read back and checked before post_step (a loop that defers the
        readback on a GPU asks before each step; see peer/train.py)."""
        return False

    def on_nonfinite(self, trainer: "Trainer", loss: float) -> bool:
        """A step's loss was not finite and nothing was updated: True if this callback restored a good state
        (training then retries the step), False to let the trainer fail."""
        return False

    def on_stop_requested(self) -> None:
        """A stop was requested, possibly from a signal handler: only set flags here."""

    def post_train(self, trainer: "Trainer") -> None:
        """Once when the loop ends (finished or stopped), before the final checkpoint is written."""

    def record_fields(self, trainer: "Trainer") -> dict[str, Any]:
        """Extra fields for the metrics.jsonl record being written at this step."""
        return {}

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors, JSON-serializable metadata) to checkpoint; both empty for a callback without state."""
        return {}, {}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Restore what `state_dict` returned; raise CallbackStateError (or KeyError/ValueError/TypeError) on a
        malformed state, before changing anything."""


def split_callback_state(name: str, tensors: dict[str, torch.Tensor],
                         meta: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """The checkpointed state of callback `name` out of a whole checkpoint, or None if it holds none."""
    prefix = f"callbacks.{name}."
    own_tensors = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    states = meta.get("callbacks")
    own_meta = states.get(name) if isinstance(states, dict) else None
    if own_meta is None and not own_tensors:
        return None
    if not isinstance(own_meta, dict):
        raise CallbackStateError(f"the state of callback {name!r} is not a JSON object")
    return own_tensors, own_meta


def join_callback_states(callbacks: list[Callback]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """All callbacks' states as checkpoint tensors (prefixed) and the `callbacks` metadata entry."""
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {}
    for callback in callbacks:
        own_tensors, own_meta = callback.state_dict()
        if not own_tensors and not own_meta:
            continue
        if callback.name in meta:
            raise ValueError(f"two callbacks with state are named {callback.name!r}")
        meta[callback.name] = own_meta
        tensors.update({f"callbacks.{callback.name}.{k}": v.detach().cpu().contiguous() for k, v in own_tensors.items()})
    return tensors, meta
