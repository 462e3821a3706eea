"""The part of a peer's sync state that must survive a restart (docs/DESIGN.md, "Durable sync state").

`Durable` is a mixin of `sync.rounds.SparseSync`: `state_dict()` returns tensors and JSON for the trainer's
checkpoint (peer/ wires it as a stateful callback), `load_state_dict()` restores them before the peer joins.
What is kept, and why:

* the round id: a restarted peer's counter must never move backwards (its record, its expert copies and the
  metrics are labelled with it; the swarm's median only ever moves it forward);
* the outer optimizer's state (`sync.outer: nesterov`): the anchor (the last synchronized values, from which the
  pseudo-gradient is measured) and the momentum buffer; without them a restart silently restarts DiLoCo's outer
  momentum and counts everything trained since the last round as already synchronized;
* the ownership history (sync.ownership): which experts this peer only takes care of, and whose they were, so a
  restarted caretaker still gives them back instead of keeping them as its own for good;
* the experts whose owner finished its run (Swarm.finish): they stay unadopted after a restart too;
* the rollback and deferral counters, so the metrics of a restarted peer continue theirs.

Per-round bookkeeping (fetch strikes, in-flight fetches, the last synchronized copy of each expert) is not kept:
it is rebuilt in a round, and a stale copy of it would be wrong after the time the peer was away.

Everything read back is checked as if it came from a stranger (a checkpoint file can be damaged or edited): a
malformed state raises before anything changes, and the trainer then starts the sync state fresh.
"""
from __future__ import annotations

from typing import Any

import torch

# A peer ID in base58 is ~46-53 characters; anything much longer or not a string is not one.
_MAX_PEER_ID = 128
_MAX_ROUND = 2 ** 53  # JSON integers beyond this lose precision in other readers


def _experts_to_peers(value: Any, num_experts: int, what: str) -> dict[int, set[str]]:
    """{"expert": [peer id, ...]} from JSON, checked."""
    if not isinstance(value, dict):
        raise TypeError(f"{what} is not an object")
    out: dict[int, set[str]] = {}
    for key, peers in value.items():
        expert = int(key)
        if not 0 <= expert < num_experts:
            raise ValueError(f"{what}: expert {expert} out of range 0..{num_experts - 1}")
        if not isinstance(peers, list) or not all(isinstance(p, str) and 0 < len(p) <= _MAX_PEER_ID for p in peers):
            raise TypeError(f"{what}[{key}] is not a list of peer IDs")
        out[expert] = set(peers)
    return out


class Durable:
    """Mixin of SparseSync: its restart-surviving state."""

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors, JSON metadata) for the trainer's checkpoint."""
        ownership = self.ownership
        meta = {"round": int(self.round_id), "rollbacks": int(self.rollbacks),
                "caretaking": {str(e): sorted(p) for e, p in ownership.adopted_from.items()},
                "last_owners": {str(e): sorted(p) for e, p in ownership._last_owners.items()},
                "finished_experts": sorted(self.swarm.finished_experts()),
                "outer": "nesterov" if self.shared.anchor is not None else "average"}
        tensors: dict[str, torch.Tensor] = {}
        if self.shared.anchor is not None:
            for i, (anchor, momentum) in enumerate(zip(self.shared.anchor, self.shared.momentum)):
                tensors[f"shared.anchor.{i}"] = anchor
                tensors[f"shared.momentum.{i}"] = momentum
        # The synchronized shared values a change is measured from, and the error feedback (what compression has
        # not sent yet); without them a restart drops both. With sync.sparse.keep_residual the unsent part is in
        # the live model, and `kept` says how much of it a round this peer is not drawn in keeps (sync/draw.py).
        meta["contrib"] = True
        for i, synced in enumerate(self.shared.synced):
            tensors[f"contrib.synced.{i}"] = synced
        for name, ef in self._ef.items():
            tensors[f"contrib.ef.{name}"] = ef
        for name, kept in self._kept.items():
            tensors[f"contrib.kept.{name}"] = kept
        for expert, synced in self._expert_synced.items():
            for name, value in synced.items():
                tensors[f"contrib.expert.{expert}/{name}"] = value
        return tensors, meta

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Restore a checkpointed sync state (before join). Raises KeyError/ValueError/TypeError, changing
        nothing, if any part is malformed."""
        num_experts = self.model.cfg.num_experts
        round_id = meta["round"]
        if not isinstance(round_id, int) or not 0 <= round_id < _MAX_ROUND:
            raise ValueError(f"round {round_id!r} is not a round number")
        counters = {k: meta.get(k, 0) for k in ("rollbacks",)}
        if not all(isinstance(v, int) and 0 <= v < _MAX_ROUND for v in counters.values()):
            raise ValueError(f"bad counters {counters}")
        caretaking = _experts_to_peers(meta.get("caretaking", {}), num_experts, "caretaking")
        last_owners = _experts_to_peers(meta.get("last_owners", {}), num_experts, "last_owners")
        finished = meta.get("finished_experts", [])
        if not isinstance(finished, list) or not all(type(e) is int and 0 <= e < num_experts for e in finished):
            raise ValueError(f"finished_experts {finished!r} is not a list of experts")
        outer = self._checked_outer(tensors) if meta.get("outer") == "nesterov" else None

        contrib = self._checked_contrib(tensors) if meta.get("contrib") is True else None

        self.round_id = max(self.round_id, round_id)
        if contrib is not None:
            for dst, src in zip(self.shared.synced, contrib[0]):
                dst.copy_(src)
            self._ef, self._kept = contrib[1], contrib[3]
            self._expert_synced.update(contrib[2])
            self._serve_synced_state()
        self.rollbacks = counters["rollbacks"]
        # Caretaking only of experts it still owns (the checkpoint's ownership was restored with the model).
        self.ownership.adopted_from = {e: p for e, p in caretaking.items() if e in self.model.owned_experts}
        self.ownership._last_owners = last_owners
        self.swarm.record.caretaking = self.ownership.caretaking
        self.swarm.remember_finished(finished)
        if outer is not None and self.shared.anchor is not None:
            for dst, src in zip(self.shared.anchor + self.shared.momentum, outer[0] + outer[1]):
                dst.copy_(src)

    def _checked_contrib(self, tensors: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor],
                                                                         dict[int, dict[str, torch.Tensor]],
                                                                         dict[str, torch.Tensor]]:
        """The checkpoint's synchronized shared values, error feedback, owned experts' synchronized values and kept
        unsent part, checked against this model: shapes, finite; what belongs to tensors this peer no longer holds
        is dropped."""
        synced = [tensors[f"contrib.synced.{i}"] for i in range(len(self.shared.params))]
        for value, param in zip(synced, self.shared.params):
            if value.shape != param.shape or not bool(torch.isfinite(value).all()):
                raise ValueError("checkpointed synchronized shared tensors do not fit this model")
        shapes = self._expected_shapes(tuple(sorted(self.model.owned_experts)))
        residuals: dict[str, dict[str, torch.Tensor]] = {"ef": {}, "kept": {}}
        for key, value in tensors.items():
            kind, _, name = key[len("contrib."):].partition(".")
            if key.startswith("contrib.") and kind in residuals and shapes.get(name) == tuple(value.shape):
                if not bool(torch.isfinite(value).all()):
                    raise ValueError(f"checkpointed {'error feedback' if kind == 'ef' else 'unsent part'} {name} "
                                     f"is not finite")
                residuals[kind][name] = value.float().clone()
        experts: dict[int, dict[str, torch.Tensor]] = {}
        for expert in self.model.owned_experts:
            live = self.model.expert_tensors(expert)
            saved = {k: tensors.get(f"contrib.expert.{expert}/{k}") for k in live}
            if all(v is not None and v.shape == live[k].shape for k, v in saved.items()):
                if not all(bool(torch.isfinite(v).all()) for v in saved.values()):
                    raise ValueError(f"checkpointed synchronized expert {expert} is not finite")
                experts[expert] = {k: v.float().clone() for k, v in saved.items()}
        return [t.float().clone() for t in synced], residuals["ef"], experts, residuals["kept"]

    def _checked_outer(self, tensors: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """The checkpoint's outer-optimizer tensors, checked against the shared parameters (None when this run
        does not use an outer optimizer: the state of another setting is dropped, not an error)."""
        if self.shared.anchor is None:
            return None
        anchors, momenta = [], []
        for i, param in enumerate(self.shared.params):
            for name, out in (("anchor", anchors), ("momentum", momenta)):
                value = tensors[f"shared.{name}.{i}"]
                if value.shape != param.shape:
                    raise ValueError(f"shared.{name}.{i} has shape {tuple(value.shape)}, expected "
                                     f"{tuple(param.shape)}")
                value = value.to(torch.float32)
                if not bool(torch.isfinite(value).all()):
                    raise ValueError(f"shared.{name}.{i} is not finite")
                out.append(value)
        if f"shared.anchor.{len(self.shared.params)}" in tensors:
            raise ValueError("more outer-optimizer tensors than shared parameters")
        return anchors, momenta
