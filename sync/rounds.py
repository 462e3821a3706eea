"""SPES sync rounds for one peer (docs/DESIGN.md, "The method" and "A round").

A round, started by the peer every `sync.every` local steps (earlier when the other peers already started it:
`round_due`, sync/progress.py):
1. publish (training thread): snapshot the shared tensors and the experts this peer owns; the expert snapshots
   are served to others by `ExpertExchange`, and the DHT record gets the new round number;
2. in a background thread, while training goes on: the shared snapshot is all-reduced with the live peers
   (sync/shared.py, weights = tokens since the last round), then each expert's owners' snapshots are fetched
   (a non-owner fetches its owners', an owner its co-owners') — expert tensors travel only from owners,
   keyed by expert ID — until a deadline derived from the all-reduce's rate, and validated; a refused expert
   keeps its local copy and is counted, a late one is used in a later round (docs/DESIGN.md, "Bandwidth-aware
   rounds"). A slow uplink may follow instead of all-reducing (sync.follow_below_mbit);
3. at a later step boundary (training thread) the results are applied as deltas against the snapshots
   (one-round-delayed update), experts without a live owner are adopted and adopted ones given back to an owner
   that returned (sync/ownership.py), and a peer that fell more than one round behind re-downloads the swarm's
   state instead of averaging stale values. Expert fetching and its checks live in sync/fetch.py, applying
   in sync/applying.py, replica averaging and byte counts in sync/replicas.py.
`overlap: false` (or `round()`) does all of it at once, blocking.

Against hostile peers (docs/DESIGN.md, "Hostile peers"): the swarm's round is the median of live records;
the all-reduce is robust at every reducer and its result is checked against this peer's own change; expert
copies are refused when their change since the last synchronized value is out of proportion to an honest
round's, and 3+ copies are aggregated robustly; an owner that never serves gets short timeouts after its first;
state downloads come from several sources chosen from verified records; and the state before each applied
round is kept so that a non-finite loss right after it rolls back instead of killing the peer.

Background processes per peer: the DHT node and one averager (each with its p2pd) — never one per expert.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import threading
import time
from typing import Callable

import torch
from hivemind.utils.logging import get_logger

from model.model import SpesMoE
from sync.config import SyncConfig
from sync.applying import Applying
from sync.between import SharedRounds
from sync.contributions import Contributions
from sync.durable import Durable
from sync.replicas import Replicas
from sync.fetch import CopiesDuring, ExpertFetching, Snapshot
from sync.following import Following
from sync.leave import LeaveHandoff
from sync.merge import merge_alpha, merge_due
from sync.shared import SharedAverager
from sync.shared_tensors import SharedTensors
from sync.ownership import Ownership
from sync.progress import SwarmProgress
from sync.schedule import Scheduling
from sync.report import RoundReport, _Pending
from sync.swarm import PeerRecord, Swarm, median_round
from sync.transfer import ExpertExchange
from sync.uplink import UplinkMeasuring
from sync.validate import RejectCounter

logger = get_logger(__name__)


STOP_GRACE = 6.0  # seconds a stopping peer still waits for its pending round (then checkpoint, leave: < 10 s)


def _expected_group(others: dict[str, PeerRecord], among_followers: bool = False) -> int:
    """How many peers (this one included) a round's all-reduce waits for: every live peer but followers
    (sync.follow_below_mbit), which never join an all-reduce, or all of them when every peer follows
    (`among_followers`, sync/following.py `_follows_this_round`). Slower peers are waited for (at most
    matchmaking_time): they join the round early (sync.progress) and their tokens count."""
    return 1 + (len(others) if among_followers else sum(not r.follows for r in others.values()))


def _run_in_daemon_thread(fn: Callable, *args) -> concurrent.futures.Future:
    """Run fn(*args) in a daemon thread: a round stuck on a dead peer must never keep the process alive."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def target() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:
            future.set_exception(e)

    threading.Thread(target=target, name="spes-round", daemon=True).start()
    return future


class SparseSync(Contributions, Following, ExpertFetching, Applying, Replicas, Durable, LeaveHandoff, SharedRounds, Scheduling, UplinkMeasuring):
    """Drives SPES rounds for one peer; the caller (peer/) owns the training loop."""

    def __init__(self, model: SpesMoE, swarm: Swarm, cfg: SyncConfig, rejects: RejectCounter | None = None,
                 max_weight: float = math.inf, gate=None, bandwidth: float | None = None):
        """`max_weight`: the most tokens a peer can train in one round at the run's batch settings (the cap on
        any peer's all-reduce weight); `gate`: a closed run's door check (sync.admission.Gate), None if open;
        `bandwidth`: this peer's upload in Mbit/s if known (its share of each all-reduce to reduce).
        Ownership changes (adoption, hand-back) are made on `model` (SpesMoE.set_owned_experts); the training
        loop's optimizer follows the model's trainable parameters by itself (peer/train.py)."""
        self.model, self.swarm, self.cfg = model, swarm, cfg
        self.rejects = rejects if rejects is not None else RejectCounter()
        self.max_weight, self.gate = max_weight, gate
        self.round_id = 0
        # Joiners' state downloads and the all-reduce protocol's copies: whole tensors (the sparse codec is for
        # contributions only, sync/contributions.py).
        whole = cfg if cfg.compression != "sparse" else dataclasses.replace(cfg, compression="none")
        self.exchange = ExpertExchange(swarm.dht, namespace=swarm.run_id, compression=whole.compression,
                                       rejects=self.rejects, gate=gate)
        if cfg.protocol == "contributions":
            # No averager process: no group to join, no all-reduce share to size by the uplink.
            self.bandwidth = bandwidth = None
            self.shared = SharedTensors(model, cfg, rejects=self.rejects)
        else:
            self.bandwidth = bandwidth
            self.shared = SharedAverager(model, swarm, whole, rejects=self.rejects, max_weight=max_weight, gate=gate,
                                         bandwidth=bandwidth)
        self._init_following(bandwidth)
        self._init_uplink()
        # Last synchronized value of each owned expert (what its own change in a round is measured from), rounds
        # since each expert was last synchronized, and owners that let a fetch time out (short timeouts after).
        self._expert_synced: dict[int, Snapshot] = {}
        self._stale: dict[int, int] = {}
        # Owners' steps as their signed records said at this round's start, and at the copy of each (expert,
        # owner) last taken: how far a faster owner trained between two copies (sync/fetch.py `_change_ok`).
        self._owner_steps: dict[str, int] = {}
        self._taken_at_step: dict[tuple[int, str], int] = {}
        self._taking: dict[tuple[int, str], int] = {}
        self._strikes: dict[str, int] = {}
        self._asked: dict = {}  # (expert, owner) -> the round it was last asked for (sync/fetch.py): once a round
        self._inflight: dict = {}  # (expert, owner) -> its running fetch (sync/fetch.py): asked once, used when it arrives
        self._owner_seconds: dict[str, float] = {}  # how long each owner's last copy took to arrive (sync/fetch.py)
        self._retry_at: dict[str, int] = {}  # round from which a struck owner is asked again
        self.rounds_alone = 0
        self.rollbacks = 0
        self._pre_apply: tuple[list[torch.Tensor], dict[int, Snapshot]] | None = None
        self._reset_expert_references()
        self.max_owned = cfg.max_experts_per_peer or model.cfg.num_experts
        self._pending: _Pending | None = None
        self._last_network: concurrent.futures.Future | None = None
        self._deferring = False  # a due round waits for the previous one's group (_defer)
        self.deferred_rounds = 0
        self._leaving = False  # set by leave_soon(): no new round, the pending one stops looking for a group
        self._leave_at = math.inf  # monotonic time of leave_soon(): the pending round gets STOP_GRACE s from it
        self._give_up_at = math.inf  # set by drain(): when the pending round stops looking for a group
        self.progress = SwarmProgress(swarm, poll=min(1.0, cfg.matchmaking_time / 4))
        self._last_transfer_seconds, self._last_applied_at = 0.0, 0.0  # of the last applied round (round_due)
        self.ownership = Ownership(swarm, self.max_owned, model.owned_experts)
        # Replicas: peers owning exactly the same experts all-reduce them with a second averager (the DiLoCo
        # case: everyone owns everything); created lazily, re-created when ownership changes.
        self._expert_avg: SharedAverager | None = None
        self._expert_avg_key: tuple[int, ...] = ()
        self._closed_expert_avg_bytes = {"sent": 0, "received": 0}  # replica averagers already shut down
        # Optimizer moments of experts taken over at join or from a leaving peer, for the training loop to load
        # (sync/fetch.py, sync/leave.py).
        self.handed_over: dict[int, dict[str, torch.Tensor]] = {}
        self._init_leave_handoff()
        self._init_scheduling()
        self._init_contributions()
        if self.contributing:  # no all-reduce to keep a slow uplink out of: every peer contributes alike
            self.follower, self._probes_left = False, 0
        self.progress.on_read = self._watch_leavers

    # ---- joining ------------------------------------------------------------------------------------------

    def join(self, step: int, tokens: int, alone_takes_all: bool = False, take_over_moments: bool = False) -> int:
        """Publish ownership; if the swarm already has peers, download its state. Returns the swarm's round.
        `alone_takes_all` (--experts auto): a run's first peer, alone, takes care of every expert its budget
        allows (sync.ownership). `take_over_moments` (a peer without optimizer state of its own): fetch the
        optimizer moments of its experts that others train now (handed_over, sync/fetch.py)."""
        if self.cfg.follow_swarm or self.cfg.start_together:
            self.progress.start()
        self.swarm.record.budget = self.max_owned  # stored with the record below: others count its room by it
        others = self._others()
        if alone_takes_all and not others and not self.swarm.initial_peers:
            self._care_for_all_at_start()
        if others and median_round(others.values()) > self.round_id:
            # The swarm is ahead of this peer's state (a new peer: round 0; a restarted one: the round its
            # checkpoint holds, sync/durable.py): take the swarm's. A peer whose state is as new (or newer: the
            # others restarted from scratch) keeps its own and averages it in the next round; downloading then
            # would overwrite its training with older values.
            # In a closed run the others' doors open only to peers with a (ticketed) record: publish it before
            # asking them for the state, with the swarm's round (median, see _download_state).
            self.round_id = max(self.round_id, median_round(others.values()))
            self.swarm.publish(experts=sorted(self.model.owned_experts), round=self.round_id, step=step,
                               tokens=tokens)
            self._download_state(others)
        self._publish(step, tokens)
        if take_over_moments and others:  # after publishing: a closed run's doors open to peers with a record
            self._take_over_moments(sorted(self.model.owned_experts), others)
        self.swarm.start_heartbeat()
        self._maybe_measure_uplink(others)
        return self.round_id

    def wait_for_peers(self, count: int, timeout: float, poll: float = 0.5) -> int:
        """Block until `count` peers (this one included) have live records, at most `timeout` seconds; returns
        how many were seen. Called once after join, before training."""
        deadline = time.monotonic() + timeout
        seen = len(self.swarm.peers())
        while seen < count and time.monotonic() < deadline:
            time.sleep(poll)
            seen = len(self.swarm.peers())
        return seen

    def _others(self, records: dict[str, PeerRecord] | None = None) -> dict[str, PeerRecord]:
        if records is None:
            records = self.swarm.peers()
            self.progress.offer(records)  # the freshest view, for the steps until the reader's next read
        return {p: r for p, r in records.items() if p != self.swarm.peer_id}

    def _reset_expert_references(self, keep: frozenset[int] = frozenset()) -> None:
        """Each owned expert's last synchronized value becomes its current value, except those in `keep` (an
        expert only this peer trains keeps its reference under contributions: nobody else can serve it)."""
        # Contributions: as every peer stores them (sync/contributions.py), so owners and non-owners agree.
        cast = self._canonical if getattr(self, "contributing", False) else (lambda v: v.detach().float().cpu().clone())
        old = getattr(self, "_expert_synced", {})
        self._expert_synced = {e: old[e] if e in keep and e in old else
                               {k: cast(v) for k, v in self.model.expert_tensors(e).items()}
                               for e in self.model.owned_experts}
        self._stale = {}

    def _publish(self, step: int, tokens: int, record: bool = True) -> dict[int, Snapshot]:
        """Snapshot the owned experts and serve them for this round; `record`: also store the DHT record now
        (a round stores it from its network thread instead, off the training loop's critical path)."""
        snapshots = {}
        for expert in sorted(self.model.owned_experts):
            snapshots[expert] = {k: v.detach().to("cpu").clone() for k, v in self.model.expert_tensors(expert).items()}
            # Contributions: a joiner downloads the synchronized value, which every peer holds alike.
            served = self._expert_synced.get(expert) if getattr(self, "contributing", False) else None
            self.exchange.publish(self.round_id, expert, served if served is not None else snapshots[expert])
        if record:
            self.swarm.publish(experts=sorted(self.model.owned_experts), round=self.round_id, step=step, tokens=tokens)
        return snapshots

    # ---- rounds -------------------------------------------------------------------------------------------

    def round(self, step: int, tokens: int, tokens_since_last: int) -> RoundReport:
        """A whole round, blocking (start + finish)."""
        self.start_round(step, tokens, tokens_since_last)
        return self.finish_round(block=True)

    def start_round(self, step: int, tokens: int, tokens_since_last: int) -> RoundReport | None:
        """Snapshot and publish, then run the network part in the background. If the previous round is still
        running it is finished first (blocking) and its report returned."""
        previous = self.finish_round(block=True) if self._pending is not None else None
        self._deferring = False
        if self._leaving:
            self.shared.cancel_ahead()
            return previous
        tokens_since_last += int(self._maybe_unfollow())
        started = time.perf_counter()
        self.round_id += 1
        report = RoundReport(self.round_id)
        if self.contributing:  # the averager's tensors keep serving the synchronized values to joiners
            self.shared.snapshot = [p.detach().to("cpu", torch.float32).clone() for p in self.shared.params]
        else:
            self.shared.take_snapshot()
        own = self._publish(step, tokens, record=False)
        # A fresh read, not the progress reader's last one: a peer that joined within the last poll would be
        # missing from the expected group, which would then start without it and leave it averaging alone.
        # Together with the background reader's recent view: a DHT read sometimes comes back partial (this peer's
        # own record alone), and a round started from it skipped averaging with a partner that was there
        # (test_closed_run). A peer that left within the last seconds costs one matchmaking window instead.
        others = {**self.progress.others(max_age=2 * self.progress.poll + 1), **self._others()}
        report.peers_seen = len(others) + 1
        self._owner_steps = {p: int(r.step) for p, r in others.items()}  # replaced whole: the network thread reads it
        self.follows_now = False if self.contributing else self._follows_this_round(others)
        among_followers = self.follower and not self.follows_now
        if among_followers and self._change_sender.holds() and not self._change_sender.busy():
            tokens_since_last += int(self._take_back_unsent())
            self.shared.take_snapshot()  # again: the contribution holds it now
        report.expected = _expected_group(others, among_followers)
        replicated = any(set(r.experts) == set(own) for r in others.values())
        expert_avg = None if self.contributing else self._expert_averager(own, replicated)
        if self.follows_now and others and median_round(others.values()) > self.round_id:
            # A follower takes the swarm's shared tensors every round anyway: it is never "behind", it only
            # keeps its round number with the swarm's, so that its record and expert copies are labelled alike.
            self.round_id = report.round_id = median_round(others.values())
            for expert, snapshot in own.items():
                self.exchange.publish(self.round_id, expert, snapshot)
        behind = bool(others) and not self.follows_now and median_round(others.values()) > self.round_id + 1
        # A peer that trained less than a full round (it joined the swarm's round early, sync.progress) changed
        # its tensors less than the others changed theirs: scale its yardstick up, as SharedAverager.check_result.
        short = self.max_weight / max(tokens_since_last, 1) if math.isfinite(self.max_weight) else 1.0
        rel_change = self._relative_change(own) * max(1.0, short)
        report.timing["publish"] = time.perf_counter() - started
        # The record with the new round is stored concurrently (a DHT store waits for its replicas); fetchers ask
        # the exchange for this round directly and owners serve it from now on.
        average = bool(others) and not behind
        if self.contributing:  # the record goes out with the contribution's announcement (its network part)
            future = _run_in_daemon_thread(self._contribution_round, report, own, tokens_since_last, step, tokens,
                                           rel_change, others)
            self._pending = _Pending(report, started, own, future, behind, step, tokens_since_last)
            return previous
        record = dict(experts=sorted(own), round=self.round_id, step=step, tokens=tokens)
        _run_in_daemon_thread(lambda: self.swarm.publish(**record))
        # Followers' shared changes this peer carries into its all-reduce (sync/following.py): folded into the
        # snapshot the averager holds, before the network thread can release it.
        shared_weight = self._fold_carried(tokens_since_last) if average else tokens_since_last
        future = _run_in_daemon_thread(self._network_part, report, own, tokens_since_last, average, expert_avg,
                                       rel_change, {} if replicated else others, shared_weight)
        self._pending = _Pending(report, started, own, future, behind, step, tokens_since_last)
        return previous

    def _network_part(self, report: RoundReport, own: dict[int, Snapshot], weight: int, average: bool,
                      expert_avg: SharedAverager | None,
                      rel_change: float | None = None, others_at_start: dict[str, PeerRecord] | None = None,
                      shared_weight: float | None = None) -> tuple[dict[str, PeerRecord], dict[int, Snapshot]]:
        """The round's transfers (its own thread). `weight`: tokens this peer trained since its last round;
        `shared_weight`: the shared all-reduce's weight (with carried changes folded in; default `weight`)."""
        want = set(range(self.model.cfg.num_experts))
        rejected_before = self.rejects.total()
        if not average or self.follows_now:
            self.shared.cancel_ahead()  # a group formed ahead (sync.schedule) that this round will not join
        net_started, during = time.perf_counter(), CopiesDuring()
        # The all-reduce runs first, on a link that carries nothing else, and the expert copies follow it: copies
        # fetched during the matchmaking delayed the group, and a slow owner's served copies would compete with its
        # own all-reduce upload that its whole group waits for. sync.copies_during_allreduce asks for them once the
        # group formed instead (docs/DESIGN.md, "Bandwidth-aware rounds": 0.06 lower ratio on equal links).
        if average and self.follows_now:
            self._follow_round(report, others_at_start, weight)
        elif average:
            early = None
            if self.cfg.copies_during_allreduce and others_at_start:
                early = self._copies_while_reducing(others_at_start, want, own, rel_change, during)
            shared_weight = weight if shared_weight is None else shared_weight
            # A slow uplink still in a group (measured from one target, or following turned off) serves its
            # copies after its own all-reduce part, which the group waits for.
            slow = self.bandwidth is not None and self.bandwidth < self.cfg.slow_uplink_mbit
            with self.exchange.copies_held(slow):
                report.group_size = max(1, self.shared.all_reduce(shared_weight, timeout=self.cfg.round_timeout,
                                                                  expected=report.expected, on_grouped=early,
                                                                  nobody_left=self._nobody_left))
            report.timing.update({k: v for k, v in self.shared.last_timing.items() if k in ("group", "all-reduce")})
            if others_at_start and not self._leaving:
                # The copies of experts owned elsewhere are asked for now, from the owners the round's start read
                # showed, not after the records read below (0.1-0.35 s on a loaded DHT): a peer that starts its
                # fetches late gets the owners' uplinks last and ends the round last (docs/DESIGN.md,
                # "Bandwidth-aware rounds"). Owners found only by the read below are asked then; none twice.
                self._start_fetches(others_at_start, want - set(own))
        copies_started = time.perf_counter()
        # Read the records after the all-reduce: by then every peer of the group has published this round (with
        # the copies during the all-reduce, read from when the group formed: a record may then still show its
        # previous round, which costs nothing here, as the round's start read used for the early copies).
        records = self.swarm.peers() if during.records is None else during.records.result(self.cfg.round_timeout)
        # The read runs while the copies stream in and counts in the expert phase's time, but it is no transfer:
        # round_due's "transfers took longer than it trained since" must not count it (on a peer slow on CPU it
        # took 0.3-0.7 s, and the peer then joined the fast peers' rounds late, missing their groups).
        report.reading_seconds = time.perf_counter() - copies_started
        records, others = self._checked_read(report, records, others_at_start)
        if not others or not average or self._leaving:
            return records, {}
        replicas = sum(set(r.experts) == set(own) for r in others.values())
        if expert_avg is not None and replicas:
            report.expert_group_size = expert_avg.all_reduce(weight, timeout=self.cfg.round_timeout,
                                                             expected=replicas + 1, nobody_left=self._nobody_left)
            if report.expert_group_size > 1:
                want -= set(own)  # averaged with the replicas already: nothing to fetch for them
        owners = self._start_fetches(others, want)
        # The whole round stays within one matchmaking window plus one timeout: an all-reduce that lost a member
        # took its chunk timeout and measured a rate far below the link's, which alone would give the copies the
        # full round_timeout on top (a 30 s round when a peer's link went down mid-round).
        budget = self.cfg.matchmaking_time + self.cfg.round_timeout - (time.perf_counter() - net_started)
        deadline = time.monotonic() + min(self._expert_grace(owners, own), max(2.0, budget))
        means = self._collect_means(owners, own, rel_change, deadline=deadline, checked=during.received)
        report.timing["experts"] = time.perf_counter() - copies_started
        report.rejected = self.rejects.total() - rejected_before
        owned_elsewhere = {e for r in others.values() for e in r.experts} & want
        report.experts_synced = sorted(set(means) | (set(own) - want))
        report.experts_missing = sorted(owned_elsewhere - set(means))
        return records, means

    def _checked_read(self, report: RoundReport, records: dict[str, PeerRecord],
                      others_at_start: dict[str, PeerRecord] | None) -> tuple[dict[str, PeerRecord], dict[str, PeerRecord]]:
        """The records read during a round (network thread), judged before anything is decided from them: an
        incomplete read gives ({} , the peers seen in either read), so that no ownership changes; a read showing
        no other peer sets `report.cut_off` when this peer cannot reach the run (asked with a ping)."""
        others = self._others(records)
        if ((self.model.owned_experts and self.swarm.peer_id not in records) or len(others) + 1 < report.group_size
                or (not others and report.peers_seen > 1)):
            # An incomplete read: not even this peer's own record came back (stored at join, refreshed by the
            # heartbeat), or fewer peers than this round's all-reduce group, or none while the read at the round's
            # start, seconds ago, showed some (a home peer behind a NAT read only its own record and adopted every
            # expert). Nothing is decided from it: no "alone", no orphans adopted; copies are fetched from the
            # owners seen in either read.
            logger.warning(f"the run's peer records read this round are incomplete ({len(others)} other peer(s), "
                           f"group {report.group_size}): no ownership change from them")
            return {}, {**(others_at_start or {}), **others}
        self._forget_strikes_of_gone(records)
        if not others and records:  # alone, or cut off from the run? Asked here, off the training thread (a ping).
            # Just re-joined after a cut: the others' records may not have reached this peer yet (ttl to be sure).
            reachable = self.swarm.reachable()
            rejoined = time.monotonic() - self.swarm.rejoined_at < self.cfg.record_ttl
            report.cut_off = rejoined or not reachable
        return records, others

    def finish_round(self, block: bool = False) -> RoundReport | None:
        """Apply a finished round (training thread). Non-blocking returns None while it still runs."""
        pending = self._pending
        if pending is None or (not block and not pending.future.done()):
            return None
        wait_start = time.perf_counter()
        try:
            records, means = self._wait(pending.future)
        except Exception as e:  # never let a network failure kill training: the round is just lost
            logger.warning(f"round {pending.report.round_id} failed: {type(e).__name__}: {e}")
            records, means = {}, {}
        report = pending.report
        self._pending = None
        self._last_network = pending.future  # may still run if abandoned (stop): shutdown waits for it
        applying = time.perf_counter()
        self._capture_pre_apply()
        if pending.behind:
            logger.info("fell more than one round behind the swarm: re-downloading its state")
            self._download_state(self._others())
            report.redownloaded = True
            if self.contributing:
                self._after_contribution_apply()
        else:
            folded = self.shared.take_folded()
            if self.contributing:
                report.rejected += self._apply_contributions()
            elif report.group_size > 1:
                report.rejected += self.shared.apply(tokens=pending.weight)
                self._serve_result(report.round_id)
            elif folded:  # carried changes that reached nobody: held for the next round (sync/following.py)
                self._return_carried(folded)
            elif self.follows_now and not (report.followed is not None
                                           and self.shared.apply_followed(report.followed)):
                if report.followed is not None:
                    logger.warning("no peer served valid shared tensors this round: keeping the local ones")
                # The change up to this round's snapshot went to a carrier or is kept for the next send: the next
                # change is measured from here, or it would hold this one a second time.
                self.shared.rebase_on_snapshot()
            report.followed = None  # applied: do not keep a copy of the shared tensors alive in the report
            if report.expert_group_size > 1 and self._expert_avg is not None:
                report.rejected += self._expert_avg.apply(tokens=pending.weight)
            synced = self._synced_owned(means, pending.own_snapshots, report.expert_group_size > 1)
            self._apply_experts(self._live_updates(means) if self.contributing else means, pending.own_snapshots)
            if merge_due(pending.step, self.cfg.merge) and synced:
                report.merge_alpha = merge_alpha(pending.step, self.cfg.merge)
                self._merge(synced, report.merge_alpha)
            self._expert_synced = {e: {k: v.float().clone() for k, v in synced[e].items()} for e in synced}
            # Rounds since an expert last synchronized widen the change its next copy may show (sync/fetch.py):
            # count missing copies, and every expert in a round this peer spent cut off / without any other
            # peer (after a partition the others' experts moved on for that many rounds).
            unsynced = range(self.model.cfg.num_experts) if report.cut_off else report.experts_missing
            for expert in unsynced:
                self._stale[expert] = self._stale.get(expert, 0) + 1
            for expert in means:
                self._stale.pop(expert, None)
            for (expert, owner), step in self._taking.items():
                if expert in means:
                    self._taken_at_step[(expert, owner)] = step
            self._taking = {}
            if self.contributing:
                self._after_contribution_apply()
        self._track_alone(report)
        # A peer that is itself stopping changes no ownership: peers stopped together (Ctrl-C on a machine running
        # several, a test's teardown) adopted each other's experts in their last round after one's tombstone
        # showed, and each left owning what another had just left (tests/test_partition.py).
        if records and not self._leaving:
            report.adopted, report.given_back = self._adopt(records, set(means), report.cut_off)
        self._take_late_moments()
        now = time.perf_counter()
        report.timing["apply"] = now - applying
        report.blocked_seconds = now - wait_start
        report.seconds = now - pending.started
        transfers = sum(report.timing.get(k, 0.0) for k in ("all-reduce", "experts", "download"))
        if "experts" in report.timing:
            transfers -= report.reading_seconds  # inside the expert phase's time, but no transfer
        self._last_transfer_seconds, self._last_applied_at = transfers, time.monotonic()
        return report

    def _wait(self, future: concurrent.futures.Future) -> tuple[dict[str, PeerRecord], dict[int, Snapshot]]:
        """The network part's result. Every network wait inside is bounded; the overall bound is a last resort
        against a wedged round. Polled so that a stop requested meanwhile (leave_soon) cancels matchmaking
        from this thread rather than from a signal handler."""
        deadline = time.monotonic() + 4 * self.cfg.round_timeout + 30
        cancelled = False
        while True:
            try:
                return future.result(timeout=max(0.0, min(0.25, deadline - time.monotonic())))
            except concurrent.futures.TimeoutError:
                if time.monotonic() >= deadline:
                    raise
                if time.monotonic() - self._leave_at > STOP_GRACE:
                    # A stop must complete within seconds: an all-reduce whose partner vanished mid-round would
                    # otherwise hold it for a chunk timeout, and expert fetches for up to round_timeout.
                    raise TimeoutError(f"stopping: abandoned after {STOP_GRACE:.0f}s") from None
            draining = self._give_up_at < math.inf
            if (self._leaving or time.monotonic() > self._give_up_at or (draining and self._nobody_left())
                    ) and not cancelled:
                averagers = [self.shared] + ([self._expert_avg] if self._expert_avg is not None else [])
                # Until it takes: right after the round started, its network part may not have begun looking for
                # a group yet (publish, records read), and a one-shot cancel then left a drained last round
                # looking for the whole round_timeout (90 s in bench.convergence's smoke run, a CI failure).
                if any([avg.cancel_matchmaking() for avg in averagers]):
                    cancelled = True
                    logger.info("stopped looking for an averaging group for this round (leaving, or last step done)")

    def _nobody_left(self) -> bool:
        """The background reader's fresh views show no other peer that could still join a group (they finished
        and withdrew their records). The last peer of a run then stops looking after about three polls instead
        of waiting out the drain's grace (bench.wan: 10 s at the end of a 2-minute run) or, in a round that
        looked longer than matchmaking_time, the round's timeout (SharedAverager.all_reduce)."""
        return self.progress.nobody_else(reads=3, max_age=2 * self.progress.poll + 1)

    def drain(self, grace: float) -> RoundReport | None:
        """The last step is done: finish the pending round, but stop looking for a group after `grace` seconds
        (the others may have finished their last round and left; hivemind would look for the whole
        round_timeout). An all-reduce already running is still awaited."""
        self._give_up_at = time.monotonic() + grace
        self.shared.cancel_ahead()  # a group formed ahead for a round after the last step
        try:
            return self.finish_round(block=True)
        finally:
            self._give_up_at = math.inf

    def leave_soon(self) -> None:
        """The peer is stopping (safe to call from a signal handler: it only sets a flag). The pending round
        stops looking for a group, and no round starts after it: a leaving peer must not wait the whole round
        timeout for partners that may be leaving too."""
        self._leaving = True
        self._leave_at = min(self._leave_at, time.monotonic())

    # ---- leaving ------------------------------------------------------------------------------------------

    def shutdown(self, finished: bool = False) -> None:
        """Leave cleanly: withdraw the record (`finished`: this peer completed its fixed-length run; its record
        says so and the others do not adopt its experts: Swarm.finish), stop the averager, the exchange and the
        DHT."""
        had_others = bool(self.progress.others())
        if finished and self.contributing:
            self._linger_for_last_contribution()
        closers = [self._stop_scheduling, self.progress.stop, self.shared.shutdown] + ([self._expert_avg.shutdown] if self._expert_avg else [])
        # A clean leave (not a finished run): tombstone first, then its experts' moments to their adopters, while
        # the exchange still serves (sync/leave.py), within the stop budget counted from leave_soon().
        closers += [lambda: self._hand_over_on_leave(had_others, self._leave_at + STOP_GRACE + 1.0)] if not finished else []
        for closer in closers + [self.exchange.shutdown, self._shutdown_contributions]:
            try:
                closer()
            except Exception as e:
                logger.warning(f"shutdown: {e}")
        self.swarm.shutdown(withdraw=True, finished=finished)
        # A round abandoned by a stop (STOP_GRACE) still runs in its daemon thread; with the averager and the DHT
        # gone it ends within moments. A peer that exited right after such a round aborted once ("terminate called
        # without an active exception", exit -6, in a test run of tests/test_metrics.py): a daemon thread inside
        # torch at interpreter exit is the likely cause, so it gets a few seconds to end first.
        # A stop keeps its promise first (done within 10 s of the request, issue 12): the wait gets only what is
        # left of that budget (tests/test_partition.py: with the partner's link down the thread does not end soon).
        last = self._last_network
        budget = 5.0 if self._leave_at == math.inf else min(5.0, self._leave_at + STOP_GRACE + 1.5 - time.monotonic())
        if last is not None and not last.done() and budget > 0:
            try:
                last.result(timeout=budget)
            except BaseException:  # its failure was reported already; a thread still stuck is left to the exit
                pass
