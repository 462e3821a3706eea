"""Synchronization configuration (docs/DESIGN.md, "The method"): how often peers sync and which experts a peer owns.

Kept free of hivemind imports so the peer can parse configs without starting anything.
"""
from __future__ import annotations

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
    # Bits per kept value: 2, 4 or 8 (one bf16 scale per chunk).
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
    # "auto" (least-covered experts), "all", or a list like "0-3,8".
    experts: str = "auto"
    # How many experts "auto" takes; 0 means num_experts / 4 (at least 1).
    experts_per_peer: int = 0
    # How a round's contribution travels (sync/contributions.py): sparse = chunked top-k with error feedback
    # (see `sparse`); none (fp32) | fp16 | 8bit = every value, dense.
    compression: str = "sparse"
    sparse: SparseConfig = field(default_factory=SparseConfig)
    outer: str = "avg"
    # DiLoCo outer optimizer (outer: nesterov): SGD with Nesterov momentum on the pseudo-gradient.
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    # Contributions per round (sync/draw.py): with more live peers than this, a peer contributes to a round only
    # when drawn (about this many are), and a peer fetches about this many blobs per round whatever the run's
    # size; one not drawn drops what it trained in the round. 0: every peer contributes to every round.
    contributors: int = 16
    # Records per roster shard (sync/roster.py): a peer reads one shard of about this many records, plus the
    # drawn peers', so its DHT reads stay bounded whatever N is; a run of fewer peers is one shard. At least
    # 2 x model.num_experts (a shard covers every expert by itself). 0 (default): one key, every read O(N): a
    # sharded run of 32 peers on one 2-core machine diverged (bench/README.md) and nothing larger was measured.
    roster_shard: int = 0
    # Most experts a peer may own after adopting orphans; 0 = no limit.
    max_experts_per_peer: int = 0
    # Seconds: the most a round waits for announcements (round_timeout), and for the others' contributions to
    # be announced once this peer announced its own (matchmaking_time; longer for a peer whose record says when
    # it will be ready, within round_timeout). Gathering ends by round_timeout + matchmaking_time at the latest.
    round_timeout: float = 60.0
    matchmaking_time: float = 5.0
    # Before the first step, wait until this many peers (this one included) have records in the run, at most
    # round_timeout seconds (0 = start at once). For organized starts: no peer runs its first rounds alone.
    wait_for_peers: int = 0
    # Start a round before `every` local steps when the other live peers' median round is already past this
    # peer's (it is slower than they are): it joins their round with the tokens it trained, weighted by them,
    # instead of contributing late or alone (sync.progress).
    follow_swarm: bool = True
    # A peer that reached `every` steps keeps training (at most every/2 more steps) while another live peer
    # expects to be ready for the same round later, and starts at the step boundary nearest that time: the
    # round's contributions are all announced at once instead of the first arrivals waiting, blocked, for the
    # last (sync.schedule).
    start_together: bool = True
    # The most processes one peer may span (`torchrun --nproc-per-node K`, SPEC 3a): every peer caps another's
    # contribution weight at this many processes' tokens per round (a claimed weight of 1e9 counts as that much,
    # docs/DESIGN.md "Hostile peers"). A K-process peer in a run where this is below K is counted as this many
    # processes (its start-up log says so). All peers of a run should use the same value.
    max_peer_processes: int = 1
    # Seconds an ownership record lives without a heartbeat (a dead peer's experts are orphaned after this).
    record_ttl: float = 30.0
    # Run a round's network part in the background while training continues (one-round-delayed update).
    overlap: bool = True
    # A received tensor is refused if its L2 norm exceeds this multiple of the local copy's.
    max_norm_ratio: float = 10.0
    # A single owner's expert change is refused when it exceeds this multiple of an honest round's relative
    # change (the contributors' median; sync/contributions.py), and so is an expert copy fetched at join.
    max_delta_ratio: float = 4.0
    # Warn (and show in spes_sync_alone_rounds) after this many rounds in a row aggregated alone while other
    # peers are in the run.
    alone_warn_rounds: int = 3
    merge: MergeConfig = field(default_factory=MergeConfig)

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if self.every < 0:
            raise ValueError(f"sync.every must be >= 0, got {self.every}")
        if self.experts_per_peer < 0:
            raise ValueError(f"sync.experts_per_peer must be >= 0, got {self.experts_per_peer}")
        if self.compression not in ("none", "fp16", "8bit", "sparse"):
            raise ValueError(f"sync.compression must be none|fp16|8bit|sparse, got {self.compression!r}")
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
        if self.max_peer_processes < 1:
            raise ValueError(f"sync.max_peer_processes must be >= 1, got {self.max_peer_processes}")
        if self.alone_warn_rounds < 1:
            raise ValueError(f"sync.alone_warn_rounds must be >= 1, got {self.alone_warn_rounds}")
        for name in ("round_timeout", "matchmaking_time", "record_ttl", "max_norm_ratio", "outer_lr",
                     "max_delta_ratio"):
            if getattr(self, name) <= 0:
                raise ValueError(f"sync.{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"sync.outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if self.roster_shard < 0:
            raise ValueError(f"sync.roster_shard must be >= 0, got {self.roster_shard}")
        if self.contributors < 0:
            raise ValueError(f"sync.contributors must be >= 0, got {self.contributors}")
        if self.max_experts_per_peer < 0:
            raise ValueError(f"sync.max_experts_per_peer must be >= 0, got {self.max_experts_per_peer}")
        if self.wait_for_peers < 0:
            raise ValueError(f"sync.wait_for_peers must be >= 0, got {self.wait_for_peers}")
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
