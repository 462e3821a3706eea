"""What one SPES round reports (`RoundReport`: logged per round, fed to the metrics) and the state of the round
in flight (`_Pending`), for sync/rounds.py."""
from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field

from sync.fetch import Snapshot


@dataclass
class RoundReport:
    round_id: int
    group_size: int = 1                 # contributions aggregated, this peer's own included (1: alone)
    experts_synced: list[int] = field(default_factory=list)
    experts_missing: list[int] = field(default_factory=list)  # owned elsewhere, but no usable copy arrived
    rejected: int = 0
    peers_seen: int = 1                 # live peers in the run's records (this one included)
    expected: int = 1                   # contributions announced for this round, this peer's own included
    contributed: bool = True            # this peer was drawn and contributed (sync/draw.py)
    adopted: list[int] = field(default_factory=list)
    given_back: list[int] = field(default_factory=list)  # adopted experts returned to their owner (it is back)
    cut_off: bool = False               # saw no other peer, and the run's initial peers did not answer
    redownloaded: bool = False
    merge_alpha: float = 0.0            # > 0 when this round applied the expert-merging warm-up
    seconds: float = 0.0                # wall time from start to apply
    # Where the round's wall time went (seconds): snapshot + publish, contribute, gather, aggregate, apply.
    # Logged with the round line, for tuning.
    timing: dict[str, float] = field(default_factory=dict)
    blocked_seconds: float = 0.0        # of which the training loop waited
    # Determinism, checkable from outside (rounds.jsonl): the digest of the synchronized state this round's
    # aggregate was added to (this peer's last, or the majority's after a repair), the sha256 of every
    # contribution aggregated (sorted), and the digest after the apply. Equal base and blobs: equal digest.
    base_digest: str = ""
    blobs: list[str] = field(default_factory=list)
    digest: str = ""

    @property
    def others_aggregated(self) -> int:
        """Other peers' contributions aggregated this round (0: alone, or nobody else drawn delivered)."""
        return self.group_size - int(self.contributed)


@dataclass
class _Pending:
    report: RoundReport
    started: float
    own_snapshots: dict[int, Snapshot]
    future: concurrent.futures.Future   # -> (records, {expert: mean of owners' copies})
    behind: bool = False
    step: int = 0
    weight: int = 0                     # tokens this peer trained since the previous round
