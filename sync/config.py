"""Synchronization configuration (docs/DESIGN.md, "The method"): how often peers sync and which experts a peer owns.

Kept free of hivemind imports so the peer can parse configs without starting anything.
"""
from __future__ import annotations

import math

from dataclasses import dataclass, field


@dataclass
class MergeConfig:
    """Expert-merging warm-up: alpha = alpha0 * (1 - min(step / decay_steps, 1)) at steps % interval == 0."""

    interval: int = 500
    alpha: float = 0.0
    decay_steps: int = 10000
    topk: int = 4


@dataclass
class SparseConfig:
    """The sparse codec of contributions (sync/sparse.py; `compression: sparse`, SparseLoCo-style)."""

    # Elements per chunk of a flattened tensor (a power of two up to 65536; indices take about 2 + log2(chunk/topk)
    # bits each, Elias-Fano coded).
    chunk: int = 4096
    # Largest-magnitude entries kept per chunk.
    topk: int = 256
    # Bits per kept value: 2, 4 or 8 (one fp16 scale per chunk).
    bits: int = 2
    # Error feedback: what compression left out is kept and sent later; before each round the kept residual is
    # multiplied by this (1.0: nothing is ever dropped; SparseLoCo uses 0.95, standing in for outer momentum).
    ef_decay: float = 1.0
    # Keep the part of this peer's shared change that compression did not send in its live model (it goes out in
    # later rounds from there) instead of moving the live model to the synchronized values and holding the rest
    # as error feedback. Every peer then trains on its own view ahead of the consensus by what it has not sent.
    keep_residual: bool = True


@dataclass
class SyncConfig:
    """When and what a peer synchronizes. `every: 0` turns synchronization off."""

    every: int = 100
    # Shared-only rounds (sync/between.py; sync.protocol: allreduce only): all-reduce the shared tensors alone every
    # this many local steps between full rounds; 0 (default) = off. Must be below `every`; all peers of a run
    # should use the same.
    shared_every: int = 0
    # "auto" (least-covered experts), "all", or a list like "0-3,8".
    experts: str = "auto"
    # How many experts "auto" takes; 0 means num_experts / 4 (at least 1).
    experts_per_peer: int = 0
    # How a round exchanges tensors (docs/DESIGN.md): "contributions" = every peer serves one signed, compressed
    # contribution (its change plus error feedback) and aggregates everyone's itself (sync/contributions.py);
    # "allreduce" = hivemind's all-reduce groups (sync/shared.py) and expert copies (sync/fetch.py).
    protocol: str = "contributions"
    # none | fp16 | 8bit (both protocols) | sparse (contributions only: chunked top-k, see `sparse`).
    compression: str = "sparse"
    sparse: SparseConfig = field(default_factory=SparseConfig)
    outer: str = "avg"
    # DiLoCo outer optimizer (outer: nesterov): SGD with Nesterov momentum on the pseudo-gradient.
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    # Most experts a peer may own after adopting orphans; 0 = no limit.
    max_experts_per_peer: int = 0
    # Seconds: how long a round may wait for its group / transfers, and how long peers look for a group.
    round_timeout: float = 60.0
    matchmaking_time: float = 5.0
    # Start an all-reduce as soon as this many peers joined its group instead of after the whole matchmaking
    # time. 0 (default): as many as the run's records showed live at the round's start (a peer that does not
    # come costs matchmaking_time, as without a target); N >= 2: exactly N (organized runs); -1: no target,
    # always wait the whole matchmaking_time.
    target_group_size: int = 0
    # A peer whose upload (declared as network.upload_mbit, or else measured: sync/uplink.py) is below this many
    # Mbit/s does not join the shared all-reduce: every round it downloads the last all-reduce result (bf16) and
    # sends its own shared change to a peer that folds it in (carry_changes), and serves its experts as usual.
    # Its uplink would otherwise make every all-reduce it joins as slow as itself, and a DHT reply of it wait
    # behind its uploads (bench.wan `mixed`: public rounds 3.5-4.5 s with it following, 9-12 s without). 20, the
    # same as slow_uplink_mbit, since a slow peer's all-reduce parts go fp16 instead of 8-bit (its 8-bit parameters
    # were dropped by every reducer): a 15 Mbit/s home peer in the groups made the public rounds 12.3 s (median),
    # following 5.9 s, with its changes all carried in (bench/README.md, issue 13 session 13). 0 = every peer
    # all-reduces.
    follow_below_mbit: float = 20.0
    # A follower whose uplink was measured (not declared as network.upload_mbit) measures it again this many
    # seconds after it began following, and after each later reading below follow_below_mbit; two readings in a
    # row at or above it and it joins the all-reduce again from its next round (a home line whose upload was
    # busy with something else when it was measured, or got faster). 0 = follow for the whole run.
    follower_reprobe_s: float = 600.0
    # A follower sends its own shared change each round (8-bit, rounding error kept for the next one) to one peer
    # that all-reduces, which folds it into its contribution (sync/carry.py): the follower's tokens count in the
    # shared average instead of being dropped. False: a follower's shared changes are not averaged in.
    carry_changes: bool = True
    # An uplink below this many Mbit/s (declared as network.upload_mbit, or else measured once other peers are
    # seen: sync/uplink.py) is told to hivemind, so this peer reduces a matching small part of each all-reduce,
    # and its all-reduce parts travel fp16 (half the bytes; 8-bit parameters were dropped by every reducer). A
    # faster measured uplink declares 100 (equal shares among fast peers: a measurement varies too much between
    # equal links to split by it).
    # 0 = never measure (an undeclared uplink gets an equal share, full precision).
    slow_uplink_mbit: float = 20.0
    # While this peer's uplink is below slow_uplink_mbit: send each bf16 expert copy out once per round and send
    # the other requesters to a peer that already holds it (checked against this owner's digest; sync/copies.py),
    # instead of one copy per requester through the slow uplink.
    pass_on_copies: bool = True
    # Before the first step, wait until this many peers (this one included) have records in the run, at most
    # round_timeout seconds (0 = start at once). For organized starts: no peer runs its first rounds alone.
    wait_for_peers: int = 0
    # Start a round before `every` local steps when the other live peers' median round is already past this
    # peer's (it is slower than they are): it joins their round with the tokens it trained, weighted by them,
    # instead of holding their group up or averaging alone later (sync.progress).
    follow_swarm: bool = True
    # A peer that reached `every` steps keeps training (at most every/2 more steps) while another live peer
    # expects to be ready for the same round later, and starts at the step boundary nearest that time: the
    # round's group forms at once instead of the first arrivals waiting, blocked, for the last (sync.schedule).
    start_together: bool = True
    # With start_together: look for the round's all-reduce group `group_ahead` seconds before the round is
    # expected to start (hivemind's triggered step), so the group has formed when the snapshot is ready; at most
    # half of matchmaking_time (a leader waits that long for its group). 0 (default) = look for it at the round's
    # start. Opt-in: hivemind lets a peer join only leaders that expire no later than its own request, and peers
    # looking ahead expire at their own expected starts (docs/DESIGN.md, "Starting a round together").
    group_ahead: float = 0.0
    # The most processes one peer may span (`torchrun --nproc-per-node K`, SPEC 3a): every peer caps another's
    # all-reduce weight at this many processes' tokens per round (a claimed weight of 1e9 counts as that much,
    # docs/DESIGN.md "Hostile peers"). A K-process peer in a run where this is below K is counted as this many
    # processes (its start-up log says so). All peers of a run should use the same value.
    max_peer_processes: int = 1
    # Seconds an ownership record lives without a heartbeat (a dead peer's experts are orphaned after this).
    record_ttl: float = 30.0
    # Run a round's network part in the background while training continues (one-round-delayed update).
    overlap: bool = True
    # Ask for the expert copies once this round's all-reduce group has formed (both transfers share the link)
    # instead of after the all-reduce (one transfer at a time). docs/DESIGN.md, "Bandwidth-aware rounds".
    copies_during_allreduce: bool = False
    # A received tensor is refused if its L2 norm exceeds this multiple of the local copy's.
    max_norm_ratio: float = 10.0
    # Robust aggregation (docs/DESIGN.md, "Hostile peers"). "centered_clip": every all-reduce reducer clips each
    # peer's contribution at clip_factor x the median distance from the coordinate-wise median (BTARD's
    # CenteredClip; exactly the plain mean when nobody is an outlier); "mean": plain weighted averaging.
    aggregation: str = "centered_clip"
    clip_factor: float = 2.5
    # A received change (all-reduce result, expert copy) is refused when it exceeds this multiple of this peer's
    # own change over the round (relative, per tensor / per expert).
    max_delta_ratio: float = 4.0
    # Warn (and show in spes_sync_alone_rounds) after this many rounds in a row averaged with nobody while other
    # peers are in the run.
    alone_warn_rounds: int = 3
    merge: MergeConfig = field(default_factory=MergeConfig)

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if self.every < 0:
            raise ValueError(f"sync.every must be >= 0, got {self.every}")
        if self.shared_every < 0 or (self.shared_every and self.every and self.shared_every >= self.every):
            raise ValueError(f"sync.shared_every must be 0 (off) or between 1 and sync.every - 1 ({self.every - 1}), "
                             f"got {self.shared_every}")
        if self.experts_per_peer < 0:
            raise ValueError(f"sync.experts_per_peer must be >= 0, got {self.experts_per_peer}")
        if self.protocol not in ("contributions", "allreduce"):
            raise ValueError(f"sync.protocol must be contributions|allreduce, got {self.protocol!r}")
        if self.compression not in ("none", "fp16", "8bit", "sparse"):
            raise ValueError(f"sync.compression must be none|fp16|8bit|sparse, got {self.compression!r}")
        if self.shared_every and self.protocol != "allreduce":
            raise ValueError("sync.shared_every (shared-only all-reduce rounds) needs sync.protocol: allreduce")
        if self.compression == "sparse" and self.protocol != "contributions":
            raise ValueError("sync.compression: sparse needs sync.protocol: contributions")
        sp = self.sparse
        if sp.chunk < 2 or sp.chunk > 65536 or sp.chunk & (sp.chunk - 1):
            raise ValueError(f"sync.sparse.chunk must be a power of two in 2..65536, got {sp.chunk}")
        if not 1 <= sp.topk <= sp.chunk:
            raise ValueError(f"sync.sparse.topk must be in 1..sync.sparse.chunk ({sp.chunk}), got {sp.topk}")
        if sp.bits not in (2, 4, 8):
            raise ValueError(f"sync.sparse.bits must be 2, 4 or 8, got {sp.bits}")
        if not 0 < sp.ef_decay <= 1:
            raise ValueError(f"sync.sparse.ef_decay must be in (0, 1], got {sp.ef_decay}")
        if self.outer not in ("avg", "nesterov"):
            raise ValueError(f"sync.outer must be avg|nesterov, got {self.outer!r}")
        if self.aggregation not in ("centered_clip", "mean"):
            raise ValueError(f"sync.aggregation must be centered_clip|mean, got {self.aggregation!r}")
        if self.max_peer_processes < 1:
            raise ValueError(f"sync.max_peer_processes must be >= 1, got {self.max_peer_processes}")
        if self.alone_warn_rounds < 1:
            raise ValueError(f"sync.alone_warn_rounds must be >= 1, got {self.alone_warn_rounds}")
        if self.follower_reprobe_s < 0:
            raise ValueError(f"sync.follower_reprobe_s must be >= 0, got {self.follower_reprobe_s}")
        if self.follow_below_mbit < 0:
            raise ValueError(f"sync.follow_below_mbit must be >= 0, got {self.follow_below_mbit}")
        if not 0 <= self.slow_uplink_mbit < 1e6:
            raise ValueError(f"sync.slow_uplink_mbit must be >= 0, got {self.slow_uplink_mbit}")
        for name in ("round_timeout", "matchmaking_time", "record_ttl", "max_norm_ratio", "outer_lr", "clip_factor",
                     "max_delta_ratio"):
            if getattr(self, name) <= 0:
                raise ValueError(f"sync.{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.group_ahead < math.inf:
            raise ValueError(f"sync.group_ahead must be >= 0 seconds (0 = off), got {self.group_ahead}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"sync.outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if self.max_experts_per_peer < 0:
            raise ValueError(f"sync.max_experts_per_peer must be >= 0, got {self.max_experts_per_peer}")
        if self.wait_for_peers < 0:
            raise ValueError(f"sync.wait_for_peers must be >= 0, got {self.wait_for_peers}")
        if self.target_group_size < -1 or self.target_group_size == 1:
            raise ValueError(f"sync.target_group_size must be 0 (the live peers), -1 (none) or >= 2, "
                             f"got {self.target_group_size}")
        if self.matchmaking_time >= self.round_timeout:
            raise ValueError("sync.matchmaking_time must be shorter than sync.round_timeout")
        if self.merge.interval <= 0 or self.merge.decay_steps <= 0 or self.merge.topk <= 0:
            raise ValueError("sync.merge.interval, decay_steps and topk must be > 0")
        if self.merge.alpha < 0:
            raise ValueError(f"sync.merge.alpha must be >= 0, got {self.merge.alpha}")


def parse_expert_list(spec: str, num_experts: int) -> list[int]:
    """Parse "0-3,8" into [0, 1, 2, 3, 8]; "all" into every expert. Raises ValueError on bad input."""
    spec = str(spec).strip()
    if spec == "all":
        return list(range(num_experts))
    experts: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"bad expert list {spec!r}: empty item")
        try:
            if "-" in part:
                lo_s, hi_s = part.split("-", 1)
                lo, hi = int(lo_s), int(hi_s)
            else:
                lo = hi = int(part)
        except ValueError:
            raise ValueError(f"bad expert list {spec!r}: {part!r} is not an index or a range like 0-3") from None
        if lo > hi:
            raise ValueError(f"bad expert list {spec!r}: range {part!r} is empty")
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"bad expert list {spec!r}: experts are numbered 0..{num_experts - 1}")
        experts.update(range(lo, hi + 1))
    return sorted(experts)


def default_experts_per_peer(cfg: SyncConfig, num_experts: int) -> int:
    """How many experts `--experts auto` takes: the configured count, else a quarter of the model (>= 1)."""
    if cfg.experts_per_peer:
        return min(cfg.experts_per_peer, num_experts)
    return max(1, num_experts // 4)
