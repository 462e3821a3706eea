"""Followers and their carriers, the SparseSync side (docs/DESIGN.md, "Slow uplinks follow", "Carried changes").

A peer whose uplink is below `sync.follow_below_mbit` (declared as `network.upload_mbit`, or measured:
sync/uplink.py) never joins an all-reduce group: each round it downloads the swarm's shared tensors from one
peer that does, and sends its own shared change to one such peer (its carrier, sync/carry.py), who folds it into
its next round's contribution. Every other peer is a possible carrier: it holds the changes followers send it and
folds them in at its next round's start.
"""
from __future__ import annotations

import random
import time

import torch
from hivemind.p2p import PeerID
from hivemind.utils.logging import get_logger

from sync.carry import ChangeSender, encode_change
from sync.codec import SHARED_KEY
from sync.report import RoundReport
from sync.swarm import PeerRecord

logger = get_logger(__name__)


class Following:
    """SparseSync mixin: become a follower, a follower's round (download + carried change), a carrier's fold."""

    def _init_following(self, bandwidth: float | None) -> None:
        self.follower = False
        self._following_last = True  # what _follows_this_round last decided (logged when it changes)
        self.follows_now = False  # this round: a follower that follows (not one among followers only)
        self._change_sender = ChangeSender()
        inbox = self.exchange.carried
        inbox.shapes = [tuple(p.shape) for p in self.shared.params]
        inbox.max_weight = self.max_weight
        inbox.follows = self._sender_follows
        if bandwidth is not None and bandwidth < self.cfg.follow_below_mbit:
            self._become_follower(f"upload {bandwidth:g} Mbit/s")

    def _become_follower(self, why: str, then: str = "") -> None:
        # Its record says so (from its next store on), so that nobody waits for it in matchmaking.
        self.follower = True
        self.swarm.record.follows = True
        self.shared.cancel_ahead()
        logger.info(f"{why} is below sync.follow_below_mbit ({self.cfg.follow_below_mbit:g}): this peer downloads "
                    f"the swarm's shared tensors each round instead of joining the all-reduce, and "
                    f"{'sends its shared changes to a peer that carries them in' if self.cfg.carry_changes else 'its shared changes are not averaged in'}; "
                    f"its experts are served as usual{then}")

    def _maybe_unfollow(self) -> float:
        """(Training thread, a round's start, before the snapshot) Stop following once a re-probe found the
        uplink fast (sync/uplink.py `_reprobed`) and no change of this peer is on its way to a carrier: what no
        send carried (8-bit rounding, a failed send) goes back into its shared tensors, so that its first
        all-reduce contribution holds it; returns the tokens that trained it, for that contribution's weight."""
        if self.unfollow_why is None or not self.follower or self._change_sender.busy():
            return 0.0
        tokens = self._take_back_unsent()
        why, self.unfollow_why, self.follower = self.unfollow_why, None, False
        self.swarm.record.follows = False  # stored with this round's record: the others wait for it again
        logger.info(f"{why}: at or above sync.follow_below_mbit ({self.cfg.follow_below_mbit:g}), this peer joins "
                    f"the shared all-reduce again from this round"
                    + (f" (its change that no carrier took, {tokens:g} tokens, goes with it)" if tokens else ""))
        return tokens

    def _take_back_unsent(self) -> float:
        """What no carrier took of this peer's changes (8-bit rounding, a refused or failed send) goes back into its
        shared tensors, for an all-reduce contribution to hold it; returns the tokens that trained it. Only while
        no send is on its way (the caller checks)."""
        with torch.no_grad():
            zeros = [torch.zeros(p.shape, dtype=torch.float32) for p in self.shared.params]
            residual, tokens = self._change_sender.take(zeros, 0.0)
            for param, change in zip(self.shared.params, residual):
                param.add_(change.to(param.device, param.dtype))
        return tokens

    def _follows_this_round(self, others: dict[str, PeerRecord]) -> bool:
        """(Round start) Whether this follower follows in this round: only while some live peer averages. When
        every peer of the run follows (home lines all below sync.follow_below_mbit), nobody would serve a result
        or carry a change, and the shared tensors would never be averaged: they all-reduce among themselves
        instead (each expects all of them, `_expected_group`), slow as their links are, until a peer that
        averages is there again. What no carrier took of this peer's changes goes into that contribution."""
        if not self.follower:
            return False
        following = not others or any(not r.follows for r in others.values())
        if following != self._following_last:
            self._following_last = following
            if not following:
                logger.info(f"every other peer of the run ({len(others)}) follows too: this round and the next "
                            f"ones all-reduce among the followers, until a peer that averages is there again")
            else:
                logger.info("a peer that averages is there again: this peer follows again")
        return following

    def _sender_follows(self, peer_id: str) -> bool:
        """(Exchange loop) A change is taken only from a peer whose signed record says it follows: one that
        all-reduces itself would otherwise count twice."""
        if not self.cfg.carry_changes or self.follower:
            return False
        record = self.progress.others().get(peer_id)  # the background reader's view: no DHT read on this loop
        return record is not None and record.follows

    def _fold_carried(self, tokens: int) -> float:
        """(Round start, after the snapshot) this round's shared all-reduce weight, with the changes that
        followers sent since the last round folded into the contribution."""
        if self.follower or not self.cfg.carry_changes:
            return tokens
        weight, rest = self.shared.fold_carried(self.exchange.carried.take(self.round_id), tokens)
        self.exchange.carried.put_back(rest)
        return weight

    def _return_carried(self, folded: list) -> None:
        """Changes folded into an all-reduce that averaged with nobody: held again for the next round."""
        logger.info(f"this round averaged with nobody: {len(folded)} carried change(s) wait for the next one")
        self.exchange.carried.put_back(folded)

    def _follow_round(self, report: RoundReport, others_at_start: dict[str, PeerRecord], tokens: int) -> None:
        """A follower's network part: its shared change goes to one carrier (in the background: a slow uplink
        must not hold the round) and the swarm's shared tensors come from one peer that all-reduces."""
        started = time.perf_counter()
        sources = [p for p, r in (others_at_start or {}).items() if not r.follows]
        random.shuffle(sources)
        if self.cfg.carry_changes:
            self._send_change(sources[-1:], tokens)
        report.followed = self._download_result(sources)
        report.timing["download"] = time.perf_counter() - started

    def _download_result(self, sources: list[str]) -> list[list[torch.Tensor]] | None:
        """The swarm's shared tensors from one source: its last all-reduce result in bf16 (half the bytes of
        fp32, served by the expert exchange; the averager process, which runs the source's all-reduce, is left
        alone), or else its averager's state (a source of an earlier build). One source: three copies through a
        slow downlink would triple the round; a liar's copy is still bounded by the state checks
        (SharedAverager.apply_followed), and the next round's source is another random peer."""
        names = [n for n, _ in self.model.shared_parameters()]
        timeout = min(self.cfg.round_timeout, 30.0)
        for source in sources[:2]:
            fetched = self.exchange.fetch_shared_async(PeerID.from_base58(source), self.round_id,
                                                       max(0, self.round_id - 2), timeout).result(timeout + 5)
            if fetched is not None and all(n in fetched for n in names):
                return [[fetched[n] for n in names]]
        return self._download_shared(sources, want=1) or None

    def _serve_result(self, round_id: int) -> None:
        """(After a round's all-reduce was applied) this round's result is what followers download: published in
        the expert exchange while any live peer follows (the last synchronized value of each tensor, the same
        on every member of the group unless this peer refused some of it)."""
        if self.follower or not any(r.follows for r in self.progress.others().values()):
            return
        names = [n for n, _ in self.model.shared_parameters()]
        # Parameters, not changes: never 8-bit (sync.compression=8bit is for expert copies); fp16 is as small
        # as the bf16 form the default codec gives.
        codec = "fp16" if self.cfg.compression == "8bit" else None
        self.exchange.publish(round_id, SHARED_KEY, dict(zip(names, self.shared.synced)), codec=codec)

    def _send_change(self, carriers: list[str], tokens: int) -> None:
        with torch.no_grad():
            delta = [s - r for s, r in zip(self.shared.snapshot, self.shared.synced)]
        total, weight = self._change_sender.take(delta, float(tokens))
        if not carriers or self._change_sender.busy():
            self._change_sender.keep(total, weight)  # the previous one is still on its way: this goes with the next
            return
        serialized, leftover = encode_change(total)
        self._change_sender.keep(leftover)
        sent = [t - r for t, r in zip(total, leftover)]
        future = self.exchange.carry_async(PeerID.from_base58(carriers[0]), self.round_id, weight, serialized,
                                           timeout=self.cfg.round_timeout)
        self._change_sender.started(future, sent, weight)
