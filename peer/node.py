"""One swarm peer: wires the training loop (peer.train) to the swarm (sync/) — DHT, ownership, rounds.

With `sync.every > 0` the peer starts a hivemind DHT node: without initial peers it starts a new swarm and logs
one `initial peer: MADDR` line per address for others to pass to `--initial-peers`. Every `sync.every` local
steps it runs a SPES round (sync/rounds.py). With `sync.every: 0` it trains alone and starts nothing.

It also feeds the peer's Prometheus metrics (peer/metrics.py) when given a PeerMetrics, and adds the sync
counters (bytes by kind, blocked seconds) to every metrics.jsonl record.
"""
from __future__ import annotations

import hashlib
import time
from typing import Sequence

from hivemind.utils.logging import get_logger

from peer.config import RunConfig
from peer.metrics import PeerMetrics
from peer.train import Trainer
from sync.merge import merge_alpha
from sync.rounds import RoundReport, SparseSync
from sync.reach import NetworkMode, PeerDialer, reachability_line
from sync.swarm import Swarm, start_dht
from sync.validate import RejectCounter

logger = get_logger(__name__)


def round_token_cap(cfg: RunConfig) -> int:
    """The most tokens one peer can train between two rounds at the run's batch settings: the cap on any peer's
    all-reduce weight (a claimed weight of 1e9 counts as this much, issue 9). Sequences are seq_len + 1 tokens
    long for next-token targets, so seq_len tokens per sequence is an upper bound of what a step trains."""
    t = cfg.train
    return cfg.sync.every * t.grad_accum * t.batch_size * cfg.model.seq_len * max(1, getattr(t, "world_size", 1))


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
                 identity_path: str | None = None, metrics: PeerMetrics | None = None):
        """`metrics`: where to report (its HTTP endpoint, if any, is the caller's to start and stop)."""
        self.cfg = cfg
        self.metrics = metrics
        self.swarm: Swarm | None = None
        self.dialer: PeerDialer | None = None
        self.sync: SparseSync | None = None
        self.blocked_seconds = 0.0
        self._started = time.perf_counter()
        self._tokens_at_round, self._step_at_round = 0, 0
        data_seed = None
        # Shared memory, created before the DHT and averager processes fork: they count refusals into it too.
        self.rejects = RejectCounter()
        self.admission = None
        if cfg.sync.every > 0:
            self.admission = _load_admission(cfg, identity_path)
            mode = NetworkMode(cfg.network.use_auto_relay, cfg.network.client_mode)
            dht = start_dht(initial_peers, host_maddrs, announce_maddrs, identity_path, run_id=cfg.run_id,
                            num_experts=cfg.model.num_experts, record_ttl=cfg.sync.record_ttl,
                            admission=self.admission, rejects=self.rejects, use_auto_relay=mode.use_auto_relay,
                            client_mode=mode.client_mode)
            ticket = getattr(self.admission, "own_ticket", None) or b""
            self.swarm = Swarm(dht, cfg.run_id, cfg.model.num_experts, ttl=cfg.sync.record_ttl, ticket=ticket,
                               admission=self.admission, initial_peers=initial_peers)
            visible = self.swarm.visible_maddrs()
            for maddr in visible:
                logger.info(f"initial peer: {maddr}")
            logger.info(reachability_line(mode, visible, relays=initial_peers))
            if mode.behind_nat:
                # Nobody can open a connection to this peer except through a (limited) relay: it opens one to
                # every peer of the run itself, before joining and then continuously (docs/DESIGN.md).
                swarm = self.swarm
                self.dialer = PeerDialer(dht, lambda: swarm.peers().keys(), interval=cfg.sync.record_ttl / 3)
                try:
                    logger.info(f"opened connections to {self.dialer.dial_now()} peer(s) of the run")
                except Exception as e:  # its thread retries after join; a failed first pass is not fatal
                    logger.warning(f"could not dial the run's peers: {e}")
            # Each peer reads its own order of the data; the model init (train.seed) stays the same everywhere.
            digest = hashlib.sha256(f"{cfg.train.seed}:{self.swarm.peer_id}".encode()).digest()
            data_seed = int.from_bytes(digest[:4], "little")
        try:
            self.trainer = Trainer(cfg, data_seed=data_seed,
                                   choose_auto=self.swarm.choose_auto if self.swarm else None)
            self.trainer.log_prefix = f"{cfg.run_id} {self.short_id}"
            if self.swarm is not None:
                gate = None
                if self.admission is not None:
                    from sync.admission import Gate
                    gate = Gate(self.swarm.dht, self.admission)
                self.sync = SparseSync(self.trainer.model, self.swarm, cfg.sync,
                                       set_owned=self.trainer.set_owned_experts, rejects=self.rejects,
                                       max_weight=round_token_cap(cfg), gate=gate,
                                       bandwidth=cfg.network.upload_mbit or None)
                self.trainer.rounds = self.sync.join(self.trainer.step, self.trainer.tokens) or self.trainer.rounds
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
                self.trainer.step_hooks.append(self._maybe_sync)
                self.trainer.nonfinite_hooks.append(self._rollback)
                self.trainer.end_hooks.append(self._finish)
                self.trainer.stop_hooks.append(self.sync.leave_soon)
                self.trainer.record_fields.append(self._sync_fields)
            if self.metrics is not None:
                # After the sync hook, so a round applied at this step is already counted.
                self.trainer.step_hooks.append(self._update_metrics)
                self.trainer.end_hooks.append(self._update_metrics)
                self._update_metrics(self.trainer)
                if self.swarm is not None:
                    swarm = self.swarm
                    self.metrics.start_peer_refresh(lambda: len(swarm.peers()))
        except BaseException:
            self.shutdown()
            raise

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
        self.sync.step_done()  # this step's loss was finite: the round applied before it is kept
        self._log_round(self.sync.finish_round(block=False), trainer)
        if self.sync.round_due(trainer.step - self._step_at_round):
            self._step_at_round = trainer.step
            if self.dialer is not None:
                self.dialer.poke()  # peers that joined since the last pass get a connection for this round
            since = trainer.tokens - self._tokens_at_round
            self._tokens_at_round = trainer.tokens
            self._log_round(self.sync.start_round(trainer.step, trainer.tokens, since), trainer)
            if not self.cfg.sync.overlap:
                self._log_round(self.sync.finish_round(block=True), trainer)
        self.blocked_seconds += time.perf_counter() - start

    def _finish(self, trainer: Trainer) -> None:
        start = time.perf_counter()
        # The last round gets matchmaking_time + 5 s to find its group (peers that finished first are gone).
        self._log_round(self.sync.drain(self.cfg.sync.matchmaking_time + 5.0), trainer)
        self.blocked_seconds += time.perf_counter() - start
        wall = time.perf_counter() - self._started
        logger.info(f"[{self.cfg.run_id} {self.short_id}] sync blocked the training loop {self.blocked_seconds:.2f}s "
                    f"of {wall:.1f}s ({100 * self.blocked_seconds / max(wall, 1e-9):.1f}%)")

    def _sync_fields(self, trainer: Trainer) -> dict:
        """Extra metrics.jsonl fields of a syncing peer (the benchmarks read them)."""
        return {"bytes_sent": self.sync.bytes_sent(), "bytes_received": self.sync.bytes_received(),
                "blocked_s": self.blocked_seconds, "rejected": self.sync.rejects.counts(),
                "rollbacks": self.sync.rollbacks, "alone_rounds": self.sync.rounds_alone}

    def _update_metrics(self, trainer: Trainer) -> None:
        """After every step: cheap reads only (the live-peer count is refreshed on its own thread)."""
        syncing = self.sync is not None
        alpha = merge_alpha(trainer.step, self.cfg.sync.merge) if syncing else 0.0
        self.metrics.observe_trainer(trainer, merge_alpha=alpha)
        if syncing:
            self.metrics.observe_sync(self.blocked_seconds, self.sync.bytes_sent(), self.sync.bytes_received(),
                                      self.sync.rejects.counts(), alone_rounds=self.sync.rounds_alone,
                                      rollbacks=self.sync.rollbacks)

    def _log_round(self, report: RoundReport | None, trainer: Trainer) -> None:
        if report is None:
            return
        trainer.rounds = report.round_id
        if self.metrics is not None:
            self.metrics.observe_round(report.seconds)
        logger.info(f"[{self.cfg.run_id} {self.short_id}] round {report.round_id} applied at step {trainer.step}: "
                    f"shared group {report.group_size}, experts synced {len(report.experts_synced)}, "
                    f"missing {report.experts_missing or 'none'}, rejected {report.rejected}, "
                    f"adopted {report.adopted or 'none'}{f', gave back {report.given_back}' if report.given_back else ''}"
                    f"{', re-downloaded' if report.redownloaded else ''}"
                    f"{f', merged (alpha {report.merge_alpha:.4f})' if report.merge_alpha else ''}, "
                    f"{report.seconds:.2f}s ({report.blocked_seconds:.2f}s blocked)"
                    + (" [" + ", ".join(f"{k} {v:.2f}s" for k, v in report.timing.items()) + "]" if report.timing else ""))

    def run(self) -> None:
        self.trainer.run()

    def shutdown(self) -> None:
        """Leave the swarm cleanly (record withdrawn, averager and DHT stopped). Idempotent."""
        if self.metrics is not None:
            self.metrics.stop_peer_refresh()  # it reads the DHT that is about to stop
        if self.swarm is None:
            return
        start = time.perf_counter()
        if self.dialer is not None:
            self.dialer.shutdown()  # it uses the DHT that is about to stop
            self.dialer = None
        if self.sync is not None:
            self.sync.shutdown()
        else:
            self.swarm.shutdown(withdraw=False)
        logger.info(f"[{self.cfg.run_id} {self.short_id}] left the swarm: DHT and averagers stopped in "
                    f"{time.perf_counter() - start:.1f}s")
        self.sync = None
        self.swarm = None

    def __enter__(self) -> "PeerNode":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
