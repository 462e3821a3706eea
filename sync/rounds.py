"""SPES sync rounds for one peer (docs/DESIGN.md, "The method" and "Rounds as contributions").

A round, started by the peer every `sync.every` local steps (earlier when the other peers already started it:
`round_due`, sync/progress.py; held a little for a peer due soon: sync/schedule.py):
1. publish (training thread): snapshot the shared tensors and the experts this peer owns; the experts'
   synchronized values are served to joiners by `ExpertExchange`;
2. in a background thread, while training goes on, the contribution round (sync/contributions.py): this peer's
   compressed change is announced in its signed record and served, the others' are fetched, checked and
   aggregated by this peer itself; no group, no reducer, every wait bounded;
3. at a later step boundary (training thread) the aggregate is applied against the last synchronized values
   (one-round-delayed update), experts without a live owner are adopted and adopted ones given back to an owner
   that returned (sync/ownership.py), and a peer that fell more than one round behind re-downloads the swarm's
   state. Applying lives in sync/applying.py, joiners' downloads in sync/fetch.py.
`overlap: false` (or `round()`) does all of it at once, blocking.

Against hostile peers (docs/DESIGN.md, "Hostile peers"): the swarm's round is the median of live records;
every contribution is decoded strictly, clipped and weighted by each receiver (sync/aggregate.py); state
downloads come from several sources chosen from verified records; and the state before each applied round is
kept so that a non-finite loss right after it rolls back instead of killing the peer.

Background processes per peer: the DHT node (with its p2pd); the exchanges replicate its p2p connection.
"""
from __future__ import annotations

import concurrent.futures
import math
import threading
import time
from typing import Callable

import torch
from hivemind.utils.logging import get_logger

from model.model import SpesMoE
from sync.config import SyncConfig
from sync.applying import Applying
from sync.codec import SHARED_KEY
from sync.contributions import Contributions
from sync.durable import Durable
from sync.fetch import ExpertFetching, Snapshot
from sync.leave import LeaveHandoff
from sync.merge import merge_alpha, merge_step
from sync.shared_tensors import SharedTensors
from sync.ownership import Ownership
from sync.progress import SwarmProgress
from sync.schedule import Scheduling
from sync.report import RoundReport, _Pending
from sync.peer_record import proven_round
from sync.swarm import PeerRecord, Swarm, median_round
from sync.transfer import ExpertExchange
from sync.validate import RejectCounter

logger = get_logger(__name__)


STOP_GRACE = 6.0  # seconds a stopping peer still waits for its pending round (then checkpoint, leave: < 10 s)


def response_limit(model: SpesMoE) -> Callable[[int, bool], int]:
    """The most payload bytes a state-download response may bring, from the model's own sizes: the shared
    tensors or one expert in fp32, an expert's moments (exp_avg, exp_avg_sq and a step per tensor), plus 1 %
    and 64 KiB for the codec's headers."""
    shared = sum(p.numel() for _, p in model.shared_parameters()) * 4
    expert = sum(t.numel() for t in model.expert_tensors(0).values()) * 4

    def limit(key: int, moments: bool) -> int:
        payload = shared if key == SHARED_KEY else 2 * expert + 4096 if moments else expert
        return payload + payload // 100 + 65536
    return limit


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


class SparseSync(Contributions, ExpertFetching, Applying, Durable, LeaveHandoff, Scheduling):
    """Drives SPES rounds for one peer; the caller (peer/) owns the training loop."""

    def __init__(self, model: SpesMoE, swarm: Swarm, cfg: SyncConfig, rejects: RejectCounter | None = None,
                 max_weight: float = math.inf, gate=None):
        """`max_weight`: the most tokens a peer can train in one round at the run's batch settings (the cap on
        any peer's contribution weight); `gate`: a closed run's door check (sync.admission.Gate), None if open.
        Ownership changes (adoption, hand-back) are made on `model` (SpesMoE.set_owned_experts); the training
        loop's optimizer follows the model's trainable parameters by itself (peer/train.py)."""
        self.model, self.swarm, self.cfg = model, swarm, cfg
        self.rejects = rejects if rejects is not None else RejectCounter()
        self.max_weight, self.gate = max_weight, gate
        self.round_id = 0
        self._merge_since: int | None = None  # start step of the last applied round (sync.merge.merge_step)
        # Joiners' state downloads: whole tensors, exact (fp32; the frozen experts' storage dtype as held).
        self.exchange = ExpertExchange(swarm.dht, namespace=swarm.run_id, compression="none",
                                       rejects=self.rejects, gate=gate, response_limit=response_limit(model),
                                       streams_per_peer=2 * model.cfg.num_experts + 2,
                                       streams=8 * (model.cfg.num_experts + 1))
        self.shared = SharedTensors(model, cfg, rejects=self.rejects)
        # Last synchronized value of each owned expert (what its contribution is measured from).
        self._expert_synced: dict[int, Snapshot] = {}
        self.rounds_alone = 0
        self.rollbacks = 0
        self._pre_apply: tuple[list[torch.Tensor], dict[int, Snapshot]] | None = None
        self._reset_expert_references()
        self.max_owned = cfg.max_experts_per_peer or model.cfg.num_experts
        self._pending: _Pending | None = None
        self._last_network: concurrent.futures.Future | None = None
        self._leaving = False  # set by leave_soon(): no new round, the pending one stops waiting for the others
        self._leave_at = math.inf  # monotonic time of leave_soon(): the pending round gets STOP_GRACE s from it
        # Reads every poll near and during rounds, else as often as the heartbeat stores (sync/progress.py).
        self.progress = SwarmProgress(swarm, poll=min(1.0, cfg.matchmaking_time / 4), idle_poll=cfg.record_ttl / 3)
        self._last_transfer_seconds, self._last_applied_at = 0.0, 0.0  # of the last applied round (round_due)
        self.ownership = Ownership(swarm, self.max_owned, model.owned_experts)
        # Optimizer moments of experts taken over at join or from a leaving peer, for the training loop to load
        # (sync/fetch.py, sync/leave.py).
        self.handed_over: dict[int, dict[str, torch.Tensor]] = {}
        self._init_leave_handoff()
        self._init_scheduling()
        self._init_contributions()
        self.progress.on_read = self._watch_leavers
        self.progress.hot = self._reads_hot
        self.exchange.on_leaving = self.progress.wake

    # ---- joining ------------------------------------------------------------------------------------------

    def join(self, step: int, tokens: int, alone_takes_all: bool = False, take_over_moments: bool = False) -> int:
        """Publish ownership; if the swarm already has peers, download its state. Returns the swarm's round.
        `alone_takes_all` (--experts auto): a run's first peer, alone, takes care of every expert its budget
        allows (sync.ownership). `take_over_moments` (a peer without optimizer state of its own): fetch the
        optimizer moments of its experts that others train now (handed_over, sync/fetch.py)."""
        self._merge_since = step
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
        # As every peer stores them (sync/contributions.py), so owners and non-owners agree.
        old = getattr(self, "_expert_synced", {})
        self._expert_synced = {e: old[e] if e in keep and e in old else
                               {k: self._canonical(v) for k, v in self.model.expert_tensors(e).items()}
                               for e in self.model.owned_experts}

    def _publish(self, step: int, tokens: int, record: bool = True) -> dict[int, Snapshot]:
        """Snapshot the owned experts and serve them for this round; `record`: also store the DHT record now
        (a round stores it from its network thread instead, off the training loop's critical path)."""
        snapshots = {}
        for expert in sorted(self.model.owned_experts):
            snapshots[expert] = {k: v.detach().to("cpu").clone() for k, v in self.model.expert_tensors(expert).items()}
            # A joiner downloads the synchronized value, which every peer holds alike.
            served = self._expert_synced.get(expert)
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
        if self._leaving:
            return previous
        started = time.perf_counter()
        self.round_id += 1
        report = RoundReport(self.round_id)
        self.shared.take_snapshot()
        own = self._publish(step, tokens, record=False)
        # A fresh read, not the progress reader's last one: a peer that joined within the last poll would not be
        # waited for. Together with the background reader's recent view: a DHT read sometimes comes back partial
        # (this peer's own record alone), and a round decided from it would have left a live peer out.
        others = {**self.progress.others(max_age=2 * self.progress.poll + 1), **self._others()}
        report.peers_seen = len(others) + 1
        swarm_round = proven_round(others, self._delivered_ever)
        behind = swarm_round is not None and swarm_round > self.round_id + 1
        # A peer that trained less than a full round (it joined the swarm's round early, sync.progress) changed
        # its tensors less than the others changed theirs: scale its yardstick up.
        short = self.max_weight / max(tokens_since_last, 1) if math.isfinite(self.max_weight) else 1.0
        rel_change = self._relative_change(own) * max(1.0, short)
        report.timing["publish"] = time.perf_counter() - started
        # The record goes out with the contribution's announcement, in the network part.
        future = _run_in_daemon_thread(self._contribution_round, report, own, tokens_since_last, step, tokens,
                                       rel_change, others)
        self._pending = _Pending(report, started, own, future, behind, step, tokens_since_last)
        return previous

    def _checked_read(self, report: RoundReport, records: dict[str, PeerRecord],
                      others_at_start: dict[str, PeerRecord] | None) -> tuple[dict[str, PeerRecord], dict[str, PeerRecord]]:
        """The records read during a round (network thread), judged before anything is decided from them: an
        incomplete read gives ({} , the peers seen in either read), so that no ownership changes; a read showing
        no other peer, or a round that got no other peer's contribution, sets `report.cut_off` when this peer cannot
        reach the run (asked with a ping)."""
        others = self._others(records)
        if ((self.model.owned_experts and self.swarm.peer_id not in records) or len(others) + 1 < report.group_size
                or (not others and report.peers_seen > 1)):
            # An incomplete read: not even this peer's own record came back (stored at join, refreshed by the
            # heartbeat), or fewer peers than contributed to this round, or none while the read at the round's
            # start, seconds ago, showed some (a home peer behind a NAT read only its own record and adopted every
            # expert). Nothing is decided from it: no "alone", no orphans adopted.
            logger.warning(f"the run's peer records read this round are incomplete ({len(others)} other peer(s), "
                           f"{report.group_size} contributions): no ownership change from them")
            return {}, {**(others_at_start or {}), **others}
        if records and (not others or (report.others_aggregated == 0 and any(r.experts for r in others.values()))):
            # Alone, or cut off from the run? Asked here, off the training thread (a ping). Also when owners'
            # records show but none of their contributions came: a cut-off peer still reads records it cached
            # until they expire, one after another, and would adopt the experts of the first to expire. (A
            # clean leave's tombstone owns nothing: its experts are adopted at once, sync.ownership.)
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
        else:
            report.rejected += self._apply_contributions()
            # An owned expert nobody contributed to keeps its value: this peer's own if it contributed (only this
            # peer trains it, or its change was refused); if it was not drawn (sync/draw.py), its round's training
            # goes and every owned expert takes its last synchronized value (plus the unsent part: _live_updates).
            values = means if self.contributing else {**{e: self._expert_synced[e] for e in pending.own_snapshots
                                                         if e in self._expert_synced}, **means}
            synced = {e: values.get(e, snapshot) for e, snapshot in pending.own_snapshots.items()}
            self._apply_experts(self._live_updates(values), pending.own_snapshots)
            merged_for = merge_step(pending.step, self.cfg.merge, since=self._merge_since)
            if merged_for is not None and synced:
                report.merge_alpha = merge_alpha(merged_for, self.cfg.merge)
                self._merge(synced, report.merge_alpha)
            self._merge_since = pending.step
            self._expert_synced = {e: {k: v.float().clone() for k, v in synced[e].items()} for e in synced}
        self._after_contribution_apply()
        report.digest = self.synced_digest
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
        self._last_transfer_seconds = report.timing.get("gather", 0.0)
        self._last_applied_at = time.monotonic()
        return report

    def _wait(self, future: concurrent.futures.Future) -> tuple[dict[str, PeerRecord], dict[int, Snapshot]]:
        """The network part's result. Every network wait inside is bounded; the overall bound is a last resort
        against a wedged round. Polled so that a stop requested meanwhile (leave_soon) is honoured within
        STOP_GRACE seconds."""
        deadline = time.monotonic() + 4 * self.cfg.round_timeout + 30
        while True:
            try:
                return future.result(timeout=max(0.0, min(0.25, deadline - time.monotonic())))
            except concurrent.futures.TimeoutError:
                if time.monotonic() >= deadline:
                    raise
                if time.monotonic() - self._leave_at > STOP_GRACE:
                    # A stop must complete within seconds: fetches from a partner whose link went down mid-round
                    # would otherwise hold it until their deadline.
                    raise TimeoutError(f"stopping: abandoned after {STOP_GRACE:.0f}s") from None

    def drain(self, grace: float) -> RoundReport | None:
        """The last step is done: finish the pending round (its waits are bounded by themselves; `grace` is
        kept for the caller's contract: a contribution round never looks for a group)."""
        return self.finish_round(block=True)

    def leave_soon(self) -> None:
        """The peer is stopping (safe to call from a signal handler: it only sets a flag). The pending round
        stops waiting for the others' announcements, and no round starts after it."""
        self._leaving = True
        self._leave_at = min(self._leave_at, time.monotonic())

    # ---- leaving ------------------------------------------------------------------------------------------

    def shutdown(self, finished: bool = False) -> None:
        """Leave cleanly: withdraw the record (`finished`: this peer completed its fixed-length run; its record
        says so and the others do not adopt its experts: Swarm.finish), stop the exchanges and the DHT."""
        had_others = bool(self.progress.others())
        if finished:
            self._linger_for_last_contribution()
        closers = [self._stop_scheduling, self.progress.stop]
        # A clean leave (not a finished run): tombstone first, then its experts' moments to their adopters, while
        # the exchange still serves (sync/leave.py), within the stop budget counted from leave_soon().
        closers += [lambda: self._hand_over_on_leave(had_others, self._leave_at + STOP_GRACE + 1.0)] if not finished else []
        for closer in closers + [self.exchange.shutdown, self._shutdown_contributions]:
            try:
                closer()
            except Exception as e:
                logger.warning(f"shutdown: {e}")
        self.swarm.shutdown(withdraw=True, finished=finished)
        # A round abandoned by a stop (STOP_GRACE) still runs in its daemon thread; with the exchanges and the DHT
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
