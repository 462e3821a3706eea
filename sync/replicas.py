"""Replica averaging and wire-byte accounting, for `sync.rounds.SparseSync` (kept in its own file).

`Replicas` is a mixin: peers that own exactly the same experts (the DiLoCo case: everyone owns everything)
all-reduce those experts with a second averager, created lazily and re-created when ownership changes; the
byte counters add what that averager moved (also of the ones already shut down) to the shared averager's and
the expert exchange's. It uses `model`, `swarm`, `cfg`, `shared`, `exchange`, `rejects`, `max_weight`, `gate`,
`bandwidth` and the last synchronized experts `_expert_synced`.
"""
from __future__ import annotations

import torch

from sync.fetch import Snapshot
from sync.shared import SharedAverager


class Replicas:
    """Mixin of SparseSync: the owned-experts averager of replicas, and bytes on the wire by kind."""

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
            self._expert_avg = SharedAverager(self.model, self.swarm, self.cfg, params=params, prefix=prefix,
                                              rejects=self.rejects, max_weight=self.max_weight, gate=self.gate,
                                              bandwidth=self.bandwidth)
            # Its results are judged against the experts' last synchronized values, not today's trained ones.
            names = self.model.expert_tensor_names()
            if all(e in self._expert_synced for e in key):
                self._expert_avg.synced = [self._expert_synced[e][n].clone() for e in key for n in names]
        self._expert_avg.take_snapshot()
        return self._expert_avg

    def _owned_params(self, expert: int) -> list[torch.Tensor]:
        return self.model.expert_parameters(expert)

    def bytes_sent(self) -> dict[str, int]:
        """Tensor payload bytes (after compression) this peer sent so far, by kind ("shared", "expert")."""
        replicas = self._closed_expert_avg_bytes["sent"] + (self._expert_avg.bytes_sent() if self._expert_avg else 0)
        blobs = self.contribution_bytes()[0]
        return {"shared": self.shared.bytes_sent() + self.exchange.bytes_sent.get("shared", 0) + blobs["shared"],
                "expert": self.exchange.bytes_sent.get("expert", 0) + replicas + blobs["expert"]}

    def bytes_received(self) -> dict[str, int]:
        """Tensor payload bytes (after compression) this peer received so far, by kind ("shared", "expert")."""
        replicas = (self._closed_expert_avg_bytes["received"]
                    + (self._expert_avg.bytes_received() if self._expert_avg else 0))
        blobs = self.contribution_bytes()[1]
        return {"shared": self.shared.bytes_received() + self.exchange.bytes_received.get("shared", 0) + blobs["shared"],
                "expert": self.exchange.bytes_received.get("expert", 0) + replicas + blobs["expert"]}

    def bytes_on_wire(self) -> dict[str, int]:
        """Tensor payload bytes this peer sent + received so far, by kind ("shared", "expert")."""
        sent, received = self.bytes_sent(), self.bytes_received()
        return {kind: sent[kind] + received[kind] for kind in sent}
