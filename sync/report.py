"""What one SPES round reports (`RoundReport`: logged per round, fed to the metrics) and the state of the round
in flight (`_Pending`), for sync/rounds.py."""
from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field

import torch

from sync.fetch import Snapshot


@dataclass
class RoundReport:
    round_id: int
    group_size: int = 1                 # peers in the shared all-reduce (1: averaged with nobody)
    experts_synced: list[int] = field(default_factory=list)
    experts_missing: list[int] = field(default_factory=list)  # owned elsewhere, but no usable copy arrived
    rejected: int = 0
    peers_seen: int = 1                 # live peers in the run's records (this one included)
    expected: int = 1                   # of which the all-reduce waits for (_expected_group)
    expert_group_size: int = 0          # peers in the owned-experts all-reduce (0: not run)
    adopted: list[int] = field(default_factory=list)
    given_back: list[int] = field(default_factory=list)  # adopted experts returned to their owner (it is back)
    cut_off: bool = False               # saw no other peer, and the run's initial peers did not answer
    redownloaded: bool = False
    reading_seconds: float = 0.0        # the records read after the all-reduce (inside the expert phase's time)
    merge_alpha: float = 0.0            # > 0 when this round applied the expert-merging warm-up
    seconds: float = 0.0                # wall time from start to apply
    # Where the round's wall time went (seconds): snapshot + publish, group forming and all-reduce of the shared
    # tensors, expert fetches still running after it, applying. Logged with the round line, for tuning.
    timing: dict[str, float] = field(default_factory=dict)
    # A follower's round (sync.follow_below_mbit): the shared tensors it downloaded instead of all-reducing.
    followed: list[list[torch.Tensor]] | None = field(default=None, repr=False)
    blocked_seconds: float = 0.0        # of which the training loop waited


@dataclass
class _Pending:
    report: RoundReport
    started: float
    own_snapshots: dict[int, Snapshot]
    future: concurrent.futures.Future   # -> (records, {expert: mean of owners' copies})
    behind: bool = False
    step: int = 0
    weight: int = 0                     # tokens this peer trained since the previous round
