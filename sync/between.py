"""Shared-only rounds between full rounds (sync.shared_every; docs/DESIGN.md, "Levers beyond the paper").

Every peer trains the shared tensors (embeddings, attention, norms, routers, LM head), while each expert is trained
by its owners only; the shared tensors are 10-22 % of a full round's bytes. With `sync.shared_every = S` (0 < S <
sync.every) a peer all-reduces the shared tensors alone every S local steps between its full rounds: the part of
the model every peer trains is averaged more often, at a fraction of a full round's bytes. Such a round blocks the
training loop (it is short: no expert phase) and uses the same averager as a full round's shared all-reduce, so a
peer in a shared-only round and one starting its full round may meet in one group; both average the same tensors,
each weighted by the tokens its caller passes. All peers of a run should use the same S (like sync.every).
"""
from __future__ import annotations

import time

from hivemind.utils.logging import get_logger

logger = get_logger(__name__)


class SharedRounds:
    """Mixin of sync.rounds.SparseSync: uses its `cfg`, `shared`, `progress`, `_others()`, `_pending`, `_leaving`
    and `follower`."""

    shared_rounds = 0

    def shared_round_due(self, steps_since_shared: int) -> bool:
        """A shared-only round now? Every sync.shared_every steps, when no full round is in flight (its shared
        snapshot is in use until it is applied) and the peer is neither leaving nor a follower (which never joins
        an all-reduce)."""
        every = self.cfg.shared_every
        return (every > 0 and steps_since_shared >= every and self._pending is None and not self._leaving
                and not self.follower)

    def shared_round(self, step: int, tokens_since_shared: int) -> int:
        """All-reduce the shared tensors now (blocking) and apply the result; returns the group size (1: nobody to
        average with, or the all-reduce failed: local values kept). The result is checked as a full round's
        (SharedAverager.check_result: change bounded by this peer's own change since its last sync)."""
        started = time.perf_counter()
        # As a full round's start: the background reader's recent view plus a fresh read (either may be partial).
        others = {**self.progress.others(max_age=2 * self.progress.poll + 1), **self._others()}
        expected = 1 + sum(not r.follows for r in others.values())
        if expected < 2:
            return 1
        self.shared.take_snapshot()
        size = max(1, self.shared.all_reduce(tokens_since_shared, timeout=self.cfg.round_timeout, expected=expected,
                                             nobody_left=self._nobody_left))
        refused = self.shared.apply() if size > 1 else 0
        self.shared_rounds += 1
        logger.info(f"shared-only round at step {step}: group {size}, {time.perf_counter() - started:.2f}s"
                    + (f", refused {refused} tensor(s)" if refused else ""))
        return size
