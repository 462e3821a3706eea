"""One swarm peer: wires the training loop (peer.train) to the swarm (sync/) — DHT, ownership, rounds.

With `sync.every > 0` the peer starts a hivemind DHT node: without initial peers it starts a new swarm and logs
one `initial peer: MADDR` line per address for others to pass to `--initial-peers`. Every `sync.every` local
steps it runs a SPES round (sync/rounds.py). With `sync.every: 0` it trains alone and starts nothing.

The swarm reaches the training loop as a stateful trainer callback (`SyncCallback`, peer/callbacks.py): rounds
after steps, the last round drained at the end, a rollback on a non-finite loss, and the sync state (round id,
outer optimizer, ownership history) written into and restored from the trainer's checkpoints. It also feeds
the peer's Prometheus metrics (peer/metrics.py) when given a PeerMetrics (`MetricsCallback`), and adds the sync
counters (bytes by kind, blocked seconds) to every metrics.jsonl record.
"""
from __future__ import annotations

import hashlib
import os
import json
import time
from typing import Sequence

from hivemind.utils.logging import get_logger

from peer.callbacks import Callback
from peer.config import ConfigError, RunConfig, run_settings
from peer.metrics import PeerMetrics
from peer.optim import expert_moments, load_expert_moments
from peer.train import Trainer
from sync.merge import merge_alpha
from sync.rounds import RoundReport, SparseSync
from sync.reach import NetworkMode, PeerDialer, reachability_line
from sync.relay import RelayKeeper
from sync.swarm import Swarm, SwarmError, start_dht
from sync.validate import RejectCounter

logger = get_logger(__name__)


def round_token_cap(cfg: RunConfig) -> int:
    """The most tokens one peer can train between two rounds at the run's batch settings: the cap on any peer's
    contribution weight (a claimed weight of 1e9 counts as this much, issue 9). Sequences are seq_len + 1 tokens
    long for next-token targets, so seq_len tokens per sequence is an upper bound of what a step trains. A peer
    of K torchrun processes trains K batches per step (peer/ranks.py): up to `sync.max_peer_processes` of them
    count, the same cap at every peer."""
    t = cfg.train
    return cfg.sync.every * t.grad_accum * t.batch_size * cfg.model.seq_len * max(1, cfg.sync.max_peer_processes)


def _data_seed(cfg: RunConfig, identity_path: str | None) -> int:
    """This peer's order of the data: each peer reads its own; the model init (train.seed) is the same
    everywhere. Derived from the peer ID when the identity is kept (--identity-path: the same peer reads the same
    order), random otherwise (its peer ID is random too). Known before the DHT starts. A resumed peer keeps the
    seed its checkpoint holds."""
    if identity_path:
        from sync.admission import peer_id_from_identity
        peer_id = peer_id_from_identity(identity_path, create=True)
        digest = hashlib.sha256(f"{cfg.train.seed}:{peer_id}".encode()).digest()
        return int.from_bytes(digest[:4], "little")
    return int.from_bytes(os.urandom(4), "little")


def _load_admission(cfg: RunConfig, identity_path: str | None):
    """A closed run's policy (sync.admission) or None for an open run."""
    admission_cfg = getattr(cfg, "admission", None)
    if admission_cfg is None or not getattr(admission_cfg, "organizer_key", ""):
        return None
    from sync.admission import load_admission
    return load_admission(admission_cfg, cfg.run_id, identity_path)


class PeerNode:
    """A Trainer plus (optionally) its swarm membership. Use as a context manager or call shutdown()."""

    def __init__(self, cfg: RunConfig, initial_peers: Sequence[str] = (),
                 host_maddrs: Sequence[str] = ("/ip4/0.0.0.0/tcp/0",), announce_maddrs: Sequence[str] = (),
                 identity_path: str | None = None, metrics: PeerMetrics | None = None, ranks=None):
        """`metrics`: where to report (its HTTP endpoint, if any, is the caller's to start and stop);
        `ranks`: this is rank 0 of a peer spanning several torchrun processes (peer/ranks.py)."""
        self.cfg = cfg
        self.metrics = metrics
        self.swarm: Swarm | None = None
        self.dialer: PeerDialer | None = None
        self.relay_keeper: RelayKeeper | None = None
        self.sync: SparseSync | None = None
        self.blocked_seconds = 0.0
        self.moments_taken_over: set[int] = set()  # experts whose AdamW moments came from their previous owner
        self._started = time.perf_counter()
        self._tokens_at_round, self._step_at_round = 0, 0
        data_seed = None
        # Shared memory, created before the DHT process forks: it counts refused records into it too.
        self.rejects = RejectCounter()
        self.admission = None
        syncing = cfg.sync.every > 0
        if syncing:
            self.admission = _load_admission(cfg, identity_path)
            data_seed = _data_seed(cfg, identity_path)
        self._dht_args = (initial_peers, host_maddrs, announce_maddrs, identity_path)
        try:
            # Everything offline first (device, tokenizer, checkpoint, dataset): a bad path or device costs one
            # line instead of a DHT start and a join. The DHT starts when `--experts auto` asks the swarm, or after.
            self.trainer = Trainer(cfg, data_seed=data_seed, choose_auto=self._choose_auto if syncing else None,
                                   ranks=ranks)
            if syncing:
                self._start_swarm()
            self.trainer.log_prefix = f"{cfg.run_id} {self.short_id}"
            if self.swarm is not None:
                gate = None
                if self.admission is not None:
                    from sync.admission import Gate
                    gate = Gate(self.swarm.dht, self.admission)
                self.sync = SparseSync(self.trainer.model, self.swarm, cfg.sync, rejects=self.rejects,
                                       max_weight=round_token_cap(cfg), gate=gate)
                # Before join: a restarted peer's round id and caretaking are restored, then published.
                if self.trainer.add_callback(SyncCallback(self)):
                    logger.info(f"[{self.trainer.log_prefix}] sync state restored: round {self.sync.round_id}, "
                                f"taking care of experts {self.sync.ownership.caretaking or 'none'}")
                self.sync.round_id = max(self.sync.round_id, self.trainer.rounds)  # never backwards
                trainer = self.trainer
                # Handoff: this peer serves its experts' AdamW moments to a peer taking one over (sync/fetch.py).
                self.sync.exchange.moments_provider = lambda e: expert_moments(trainer.optimizer, trainer.model, e)
                self.trainer.rounds = self.sync.join(self.trainer.step, self.trainer.tokens,
                                                     alone_takes_all=cfg.sync.experts == "auto",
                                                     take_over_moments=not self.trainer.resumed)
                self._load_handed_over()
                if self.dialer is not None:
                    self.dialer.start()
                want = cfg.sync.wait_for_peers
                if want > 1:
                    seen = self.sync.wait_for_peers(want, cfg.sync.round_timeout)
                    if seen < want:
                        logger.warning(f"[{self.trainer.log_prefix}] only {seen} of {want} peers after "
                                       f"{cfg.sync.round_timeout:.0f}s: starting anyway")
                    else:
                        logger.info(f"[{self.trainer.log_prefix}] {seen} peers in the run: starting")
                self._tokens_at_round, self._step_at_round = self.trainer.tokens, self.trainer.step
            if self.metrics is not None:
                # After the sync callback, so a round applied at this step is already counted.
                self.trainer.add_callback(MetricsCallback(self))
                self._update_metrics(self.trainer)
                if self.swarm is not None:
                    swarm, progress = self.swarm, self.sync.progress if self.sync is not None else None
                    # The records' background reader's view when it runs (a read of its own would carry every
                    # record once more every 5 s, docs/DESIGN.md "DHT records"), else a read.
                    self.metrics.start_peer_refresh(
                        lambda: (progress.peer_count() if progress is not None else None) or len(swarm.peers()))
        except BaseException:
            self.shutdown()
            raise

    def _load_handed_over(self) -> None:
        """Install the optimizer moments fetched for experts this peer took over, at join or from a leaving owner
        (peer/optim.py checks that AdamW could have made them); the others start fresh, as after a death."""
        trainer, taken = self.trainer, []
        trainer.follow_ownership()
        betas = (self.cfg.train.beta1, self.cfg.train.beta2)
        for expert, tensors in sorted(self.sync.handed_over.items()):
            problem = load_expert_moments(trainer.optimizer, trainer.model, expert, tensors, betas)
            if problem is None:
                taken.append(expert)
            else:
                self.rejects.add("norm")
                logger.warning(f"refused the optimizer moments received for expert {expert}: {problem}")
        self.sync.handed_over.clear()
        self.moments_taken_over.update(taken)
        if taken:
            logger.info(f"[{trainer.log_prefix}] took over the optimizer state (AdamW moments) of experts {taken} "
                        f"from the peers that trained them")

    def _choose_auto(self, count: int) -> list[int]:
        """`--experts auto` for the trainer: start the swarm (after the trainer's offline checks) and ask it."""
        self._start_swarm()
        return self.swarm.choose_auto(count)

    def _start_swarm(self) -> None:
        """Start the DHT node and this peer's membership (once): refuse a peer ID live elsewhere, log the
        addresses to join and the reachability, and behind a NAT dial the run's peers."""
        if self.swarm is not None:
            return
        cfg = self.cfg
        initial_peers, host_maddrs, announce_maddrs, identity_path = self._dht_args
        mode = NetworkMode(cfg.network.use_auto_relay, cfg.network.client_mode)
        dht = start_dht(initial_peers, host_maddrs, announce_maddrs, identity_path, run_id=cfg.run_id,
                        num_experts=cfg.model.num_experts, record_ttl=cfg.sync.record_ttl,
                        admission=self.admission, rejects=self.rejects, use_auto_relay=mode.use_auto_relay,
                        client_mode=mode.client_mode, join_timeout=cfg.network.join_timeout_s)
        ticket = getattr(self.admission, "own_ticket", None) or b""
        swarm = Swarm(dht, cfg.run_id, cfg.model.num_experts, ttl=cfg.sync.record_ttl, ticket=ticket,
                      admission=self.admission, initial_peers=initial_peers, settings=run_settings(cfg),
                      shard=cfg.sync.roster_shard)
        if swarm.live_elsewhere():
            swarm.shutdown(withdraw=False)  # the record is the other process's: leave it alone
            raise SwarmError(f"peer ID {swarm.peer_id} is already live in run {cfg.run_id}: another process "
                             f"uses this identity (give each peer its own --identity-path)")
        records = swarm.peers()  # one read for both checks below
        if self.admission is None:
            from sync.admission import looks_closed
            if looks_closed([bool(r.ticket) for p, r in records.items() if p != swarm.peer_id]):
                swarm.shutdown(withdraw=False)
                raise SwarmError(f"run {cfg.run_id} is closed: its peers hold organizer tickets; ask the organizer "
                                 f"for a ticket for this peer's ID, then pass --organizer-key KEY --ticket FILE "
                                 f"--identity-path FILE (README, \"Closed runs\")")
        mismatch = swarm.settings_mismatch(records)  # before this peer publishes anything or downloads a tensor
        if mismatch is not None:
            swarm.shutdown(withdraw=False)
            raise SwarmError(mismatch)
        try:
            swarm.publish_settings()
        except Exception as e:  # a joiner that differs then gets the fingerprint only; the heartbeat retries
            logger.warning(f"could not store this run's settings: {e!r}")
        self.swarm = swarm
        visible = swarm.visible_maddrs()
        for maddr in visible:
            logger.info(f"initial peer: {maddr}")
        if not swarm.on_its_own():  # the offline default has no one to be reachable by
            logger.info(reachability_line(mode, visible, relays=initial_peers))
        if mode.use_auto_relay:
            # p2pd's autorelay asks a relay once and never again within an hour after a failure or a dropped
            # connection: this peer keeps its reservations itself (sync/relay.py).
            self.relay_keeper = RelayKeeper(dht, initial_peers).start()
        if mode.behind_nat:
            # Nobody can open a connection to this peer except through a (limited) relay: it opens one to
            # every peer of the run itself, before joining and then continuously (docs/DESIGN.md).
            self.dialer = PeerDialer(dht, lambda: swarm.peers().keys(), interval=cfg.sync.record_ttl / 3)
            try:
                logger.info(f"opened connections to {self.dialer.dial_now()} peer(s) of the run")
            except Exception as e:  # its thread retries after join; a failed first pass is not fatal
                logger.warning(f"could not dial the run's peers: {e}")

    @property
    def short_id(self) -> str:
        return self.swarm.peer_id[-6:] if self.swarm else "solo"

    def _rollback(self, trainer: Trainer, loss: float) -> bool:
        """A non-finite loss right after a round was applied: restore the values from before it, train on."""
        if self.sync is None or not self.sync.rollback():
            return False
        logger.warning(f"[{self.cfg.run_id} {self.short_id}] loss {loss} at step {trainer.step + 1} right after "
                       f"applying round {trainer.rounds}: rolled back to the values before that round "
                       f"({self.sync.rollbacks} rollback(s) so far)")
        return True

    def _maybe_sync(self, trainer: Trainer) -> None:
        """After every step: apply a finished round; every `sync.every` steps start the next one."""
        start = time.perf_counter()
        if self.swarm.twin is not None:  # read by the swarm's reader within a second of the other's store
            identity = self._dht_args[3]
            raise ConfigError(f"peer ID {self.swarm.peer_id} is live in another process of run {self.cfg.run_id} "
                              f"that started first (identity file {identity}): this one stops; give each peer its "
                              f"own --identity-path")
        self.sync.step_done()  # this step's loss was finite: the round applied before it is kept
        self._log_round(self.sync.finish_round(block=False), trainer)
        if self.sync.handed_over:  # moments of experts a round just adopted from a leaving peer (sync/leave.py)
            self._load_handed_over()
        if self.sync.round_due(trainer.step - self._step_at_round):
            self._step_at_round = trainer.step - self.sync.round_shift
            if self.dialer is not None:
                self.dialer.poke()  # peers that joined since the last pass get a connection for this round
            # Claimed as the others will count it: at most the run's cap (a K-process peer above
            # sync.max_peer_processes, a peer that ran far past a due round), not refused as an outlier there.
            since = min(trainer.tokens - self._tokens_at_round, round_token_cap(self.cfg))
            self._tokens_at_round = trainer.tokens
            self._log_round(self.sync.start_round(trainer.step, trainer.tokens, since), trainer)
            if not self.cfg.sync.overlap:
                if trainer.step >= self.cfg.train.max_steps:
                    self._log_round(self.sync.drain(self.cfg.sync.matchmaking_time + 5.0), trainer)
                else:
                    self._log_round(self.sync.finish_round(block=True), trainer)
                if self.sync.handed_over:
                    self._load_handed_over()
        # Step time, and when its next round is due (sync/schedule.py).
        self.sync.note_step(trainer.step - self._step_at_round, steps_left=self.cfg.train.max_steps - trainer.step)
        self.blocked_seconds += time.perf_counter() - start

    def _finish(self, trainer: Trainer) -> None:
        start = time.perf_counter()
        self._log_round(self.sync.drain(self.cfg.sync.matchmaking_time + 5.0), trainer)
        self.blocked_seconds += time.perf_counter() - start
        wall = time.perf_counter() - self._started
        held = (f"; trained {self.sync.held_steps} step(s) in {self.sync.held_rounds} round(s) while a later peer "
                f"got ready (sync.start_together)" if self.sync.held_rounds else "")
        logger.info(f"[{self.cfg.run_id} {self.short_id}] sync blocked the training loop {self.blocked_seconds:.2f}s "
                    f"of {wall:.1f}s ({100 * self.blocked_seconds / max(wall, 1e-9):.1f}%){held}")

    def _sync_fields(self, trainer: Trainer) -> dict:
        """Extra metrics.jsonl fields of a syncing peer (the benchmarks read them)."""
        return {"bytes_sent": self.sync.bytes_sent(), "bytes_received": self.sync.bytes_received(),
                "blocked_s": self.blocked_seconds, "rejected": self.sync.rejects.counts(),
                "rollbacks": self.sync.rollbacks, "alone_rounds": self.sync.rounds_alone,
                "held_steps": self.sync.held_steps,
                "relay_reservations": self.relay_keeper.held_count() if self.relay_keeper is not None else 0,
                "divergent_rounds": self.sync.divergent_rounds, "synced_digest": self.sync.synced_digest,
                "unserved_claims": self.sync.unserved_claims, "moments_taken_over": sorted(self.moments_taken_over)}

    def _update_metrics(self, trainer: Trainer) -> None:
        """After every step: cheap reads only (the live-peer count is refreshed on its own thread)."""
        syncing = self.sync is not None
        alpha = merge_alpha(trainer.step, self.cfg.sync.merge) if syncing else 0.0
        self.metrics.observe_trainer(trainer, merge_alpha=alpha)
        if syncing:
            self.metrics.observe_sync(self.blocked_seconds, self.sync.bytes_sent(), self.sync.bytes_received(),
                                      self.sync.rejects.counts(), alone_rounds=self.sync.rounds_alone,
                                      rollbacks=self.sync.rollbacks, relay_reservations=self.relay_keeper.held_count()
                                      if self.relay_keeper is not None else 0,
                                      unserved_claims=self.sync.unserved_claims)

    def _log_round(self, report: RoundReport | None, trainer: Trainer) -> None:
        if report is None:
            return
        trainer.rounds = report.round_id
        if self.metrics is not None:
            self.metrics.observe_round(report.seconds)
        # One structured line per applied round (rounds.jsonl beside metrics.jsonl): what the log line says, for
        # tools and tests that should not parse log text (peer.plot).
        line = {"round": report.round_id, "step": trainer.step, "time": time.time(), "seconds": report.seconds,
                "blocked_s": report.blocked_seconds, "contributions": report.group_size, "peers": report.peers_seen,
                "drawn": report.contributed,
                "experts_synced": report.experts_synced, "missing": report.experts_missing,
                "rejected": report.rejected, "adopted": report.adopted, "given_back": report.given_back,
                "redownloaded": report.redownloaded, "merge_alpha": report.merge_alpha,
                "base_digest": report.base_digest, "blobs": report.blobs, "digest": report.digest,
                "timing": {k: round(v, 4) for k, v in report.timing.items()}}
        with open(trainer.run_dir / "rounds.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        logger.info(f"[{self.cfg.run_id} {self.short_id}] round {report.round_id} applied at step {trainer.step}: "
                    f"shared group {report.group_size}"
                    f"{'' if report.contributed else ' (not drawn: own round dropped)'}, "
                    f"experts synced {len(report.experts_synced)}, "
                    f"missing {report.experts_missing or 'none'}, rejected {report.rejected}, "
                    f"adopted {report.adopted or 'none'}{f', gave back {report.given_back}' if report.given_back else ''}"
                    f"{', re-downloaded' if report.redownloaded else ''}"
                    f"{f', merged (alpha {report.merge_alpha:.4f})' if report.merge_alpha else ''}, "
                    f"{report.seconds:.2f}s ({report.blocked_seconds:.2f}s blocked)"
                    + (" [" + ", ".join(f"{k} {v:.2f}s" for k, v in report.timing.items()) + "]" if report.timing else ""))

    def run(self) -> None:
        self.trainer.run()

    def shutdown(self) -> None:
        """Leave the swarm cleanly (record withdrawn, exchanges and DHT stopped). Idempotent."""
        if self.metrics is not None:
            self.metrics.stop_peer_refresh()  # it reads the DHT that is about to stop
        if self.swarm is None:
            return
        start = time.perf_counter()
        if self.dialer is not None:
            self.dialer.shutdown()  # it uses the DHT that is about to stop
            self.dialer = None
        if self.relay_keeper is not None:
            self.relay_keeper.shutdown()  # likewise
            self.relay_keeper = None
        if self.sync is not None:
            # A peer that completed its run (not stopped, not failed) says so: the peers still running do not
            # adopt its experts for their last steps.
            trainer = getattr(self, "trainer", None)
            done = trainer is not None and trainer.step >= self.cfg.train.max_steps and not trainer.stopped
            self.sync.shutdown(finished=done)
        else:
            self.swarm.shutdown(withdraw=False)
        logger.info(f"[{self.cfg.run_id} {self.short_id}] left the swarm: DHT stopped in "
                    f"{time.perf_counter() - start:.1f}s")
        self.sync = None
        self.swarm = None

    def __enter__(self) -> "PeerNode":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


class SyncCallback(Callback):
    """The swarm in the training loop: a round after steps, the last one drained at the end, a rollback on a
    non-finite loss right after a round, and the sync state in the trainer's checkpoints (sync/durable.py)."""

    name = "sync"

    def __init__(self, node: PeerNode):
        self.node = node

    def post_step(self, trainer: Trainer) -> None:
        self.node._maybe_sync(trainer)

    def needs_checked_step(self, trainer: Trainer) -> bool:
        # The step after a round was applied decides whether that round is kept or rolled back.
        return self.node.sync is not None and self.node.sync.awaiting_check

    def on_nonfinite(self, trainer: Trainer, loss: float) -> bool:
        return self.node._rollback(trainer, loss)

    def on_stop_requested(self) -> None:
        sync = self.node.sync
        if sync is not None:
            sync.leave_soon()

    def post_train(self, trainer: Trainer) -> None:
        self.node._finish(trainer)

    def record_fields(self, trainer: Trainer) -> dict:
        return self.node._sync_fields(trainer)

    def state_dict(self):
        return self.node.sync.state_dict() if self.node.sync is not None else ({}, {})

    def load_state_dict(self, tensors, meta) -> None:
        self.node.sync.load_state_dict(tensors, meta)


class MetricsCallback(Callback):
    """The peer's Prometheus metrics, updated after every step and at the end (cheap reads only)."""

    name = "metrics"

    def __init__(self, node: PeerNode):
        self.node = node

    def post_step(self, trainer: Trainer) -> None:
        self.node._update_metrics(trainer)

    def post_train(self, trainer: Trainer) -> None:
        self.node._update_metrics(trainer)
