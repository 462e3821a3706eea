"""Prometheus metrics of one peer (README, "Operate a swarm"), served with prometheus_client on `--metrics-port`.

`PeerMetrics` owns its own CollectorRegistry (no process/GC collectors: the endpoint exposes exactly the documented
names). The peer (peer/node.py) feeds it: trainer state after every step, each RoundReport, and the cumulative
sync counters (blocked time, wire bytes, refusals) that sync/ keeps without knowing about Prometheus. Counters
here mirror those cumulative values (only their increases are added), so they always equal what the run's
metrics.jsonl says at the same moment.
"""
from __future__ import annotations

import collections
import errno
import threading
import time
from typing import TYPE_CHECKING, Callable, Mapping

from hivemind.utils.logging import get_logger
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client import start_http_server

from sync.validate import REJECT_REASONS

if TYPE_CHECKING:
    from peer.train import Trainer

logger = get_logger(__name__)

# prometheus_client adds a `*_created` series to every counter and histogram by default; the documented names are the
# series a peer exposes, and nobody graphs creation times. Process-wide, which is fine: a peer serves only these.
disable_created_metrics()

BYTE_KINDS = ("shared", "expert")
# Rounds take from well under a second (loopback, tiny model) to minutes (1B model over the internet).
ROUND_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
# tokens/s is measured over this many recent seconds (a single step is too noisy, the whole run too slow).
THROUGHPUT_WINDOW_S = 10.0
LOSS_SMOOTHING = 0.9


class MetricsPortInUse(OSError):
    """The metrics port is taken by another process."""


class PeerMetrics:
    """The metrics of one peer in their own registry; `serve(port)` exposes them over HTTP."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.registry = CollectorRegistry()
        r = self.registry
        self.train_step = Gauge("spes_train_step", "Local optimizer steps done", registry=r)
        self.train_loss = Gauge("spes_train_loss",
                                f"Latest training cross-entropy, exponentially smoothed (factor {LOSS_SMOOTHING})",
                                registry=r)
        # prometheus_client appends _total to counter names: "spes_tokens" is exposed as spes_tokens_total.
        self.tokens = Counter("spes_tokens", "Tokens trained on by this peer (run total, resumes included)",
                              registry=r)
        self.tokens_per_second = Gauge("spes_tokens_per_second",
                                       f"Local training throughput over the last {THROUGHPUT_WINDOW_S:.0f} s",
                                       registry=r)
        self.rounds = Counter("spes_sync_rounds", "Sync rounds this peer completed (the run's round number, as in "
                              "metrics.jsonl `rounds`)", registry=r)
        self.round_seconds = Histogram("spes_sync_round_seconds", "Wall time of each sync round, start to apply",
                                       buckets=ROUND_BUCKETS, registry=r)
        self.blocked = Counter("spes_sync_blocked_seconds", "Time the training loop waited on sync", registry=r)
        wire = "tensor payload bytes on the wire after compression (contributions, state downloads), " \
               "by kind"
        self.bytes_sent = Counter("spes_sync_bytes_sent", f"Sent {wire}", ["kind"], registry=r)
        self.bytes_received = Counter("spes_sync_bytes_received", f"Received {wire}", ["kind"], registry=r)
        self.owned_experts = Gauge("spes_owned_experts", "Number of experts this peer owns", registry=r)
        self.expert_owned = Gauge("spes_expert_owned", "1 for each expert this peer owns, 0 for the others",
                                  ["expert"], registry=r)
        self.peers = Gauge("spes_peers", "Live peers seen in the run's DHT records (this one included; 0 without "
                           "a swarm; above sync.roster_shard peers estimated from a shard of them)", registry=r)
        self.merge_alpha = Gauge("spes_merge_alpha", "Current expert-merging warm-up coefficient (0 after warm-up "
                                 "or with sync off)", registry=r)
        self.rejected = Counter("spes_rejected_tensors", "Received tensors refused by validation, by reason",
                                ["reason"], registry=r)
        self.alone_rounds = Gauge("spes_sync_alone_rounds", "Sync rounds in a row this peer aggregated no other "
                                  "peer's contribution "
                                  "while other peers were in the run", registry=r)
        self.unserved_claims = Gauge("spes_unserved_claims", "Live peers claiming experts none of whose contributions "
                                     "reached this peer within 3 rounds: not counted as owners (ghost owners)",
                                     registry=r)
        self.rollbacks = Counter("spes_sync_rollbacks", "Applied rounds rolled back after a non-finite loss",
                                 registry=r)
        self.parameters = Gauge("spes_parameters", "Parameter counts of the local model", ["kind"], registry=r)
        self.relay_reservations = Gauge("spes_relay_reservations", "Relays holding a reservation for this peer "
                                        "(--use-auto-relay; 0 otherwise): 0 with the flag = unreachable by strangers",
                                        registry=r)
        # Every label value exists from the start: a series that appears only on its first event breaks rate().
        for kind in BYTE_KINDS:
            self.bytes_sent.labels(kind=kind)
            self.bytes_received.labels(kind=kind)
        for reason in REJECT_REASONS:
            self.rejected.labels(reason=reason)
        for expert in range(num_experts):
            self.expert_owned.labels(expert=str(expert)).set(0)
        self._mirrored: dict[tuple, float] = {}
        self._lock = threading.Lock()
        self._loss_ema: float | None = None
        self._loss_step = -1
        self._throughput: collections.deque[tuple[float, int]] = collections.deque()
        self._owned: tuple[int, ...] | None = None
        self._server = None
        self._server_thread: threading.Thread | None = None
        self._refresh_stop = threading.Event()
        self._refresh_thread: threading.Thread | None = None

    # ---- serving ------------------------------------------------------------------------------------------

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Expose /metrics on `port`; MetricsPortInUse if another process holds it."""
        try:
            self._server, self._server_thread = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise MetricsPortInUse(e.errno, f"metrics port {port} is in use") from None
            raise
        logger.info(f"serving Prometheus metrics on http://{addr}:{port}/metrics")

    def shutdown(self) -> None:
        """Stop the peers refresher and the HTTP server. Idempotent."""
        self.stop_peer_refresh()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._server_thread is not None:
            self._server_thread.join(timeout=5)
            self._server_thread = None

    # ---- updates ------------------------------------------------------------------------------------------

    def _mirror(self, counter: Counter, value: float, **labels: str) -> None:
        """Advance `counter` to the cumulative `value` (never backwards: counters only grow)."""
        key = (id(counter), tuple(sorted(labels.items())))
        with self._lock:
            delta = value - self._mirrored.get(key, 0.0)
            if delta <= 0:
                return
            self._mirrored[key] = value
        (counter.labels(**labels) if labels else counter).inc(delta)

    def observe_trainer(self, trainer: "Trainer", merge_alpha: float = 0.0) -> None:
        """After every optimizer step (training thread): cheap reads of the trainer's state, no network."""
        now = time.monotonic()
        self.train_step.set(trainer.step)
        loss = getattr(trainer, "last_loss", None)
        # On a GPU the loss is read back on log steps only (peer/train.py): one EMA update per reading.
        loss_step = getattr(trainer, "last_loss_step", trainer.step)
        if loss is not None and loss_step != self._loss_step:
            self._loss_step = loss_step
            ema = self._loss_ema
            self._loss_ema = loss if ema is None else LOSS_SMOOTHING * ema + (1 - LOSS_SMOOTHING) * loss
            self.train_loss.set(self._loss_ema)
        self._mirror(self.tokens, trainer.tokens)
        self._mirror(self.rounds, trainer.rounds)
        window = self._throughput
        window.append((now, trainer.tokens))
        while len(window) > 2 and now - window[1][0] >= THROUGHPUT_WINDOW_S:
            window.popleft()
        (t0, tokens0), (t1, tokens1) = window[0], window[-1]
        if t1 > t0:
            self.tokens_per_second.set((tokens1 - tokens0) / (t1 - t0))
        owned = tuple(sorted(trainer.model.owned_experts))
        if owned != self._owned:  # parameter counts change only with ownership; not worth a walk every step
            self.set_owned(owned)
            self.parameters.labels(kind="total").set(trainer.model.num_parameters("total"))
            self.parameters.labels(kind="trainable").set(trainer.model.num_parameters("trainable"))
        self.merge_alpha.set(merge_alpha)

    def set_owned(self, owned: tuple[int, ...]) -> None:
        self._owned = owned
        self.owned_experts.set(len(owned))
        for expert in range(self.num_experts):
            self.expert_owned.labels(expert=str(expert)).set(1 if expert in owned else 0)

    def observe_round(self, seconds: float) -> None:
        """Once per completed round: its wall time."""
        self.round_seconds.observe(seconds)

    def observe_sync(self, blocked_seconds: float, bytes_sent: Mapping[str, int], bytes_received: Mapping[str, int],
                     rejected: Mapping[str, int], alone_rounds: int = 0, rollbacks: int = 0,
                     relay_reservations: int = 0, unserved_claims: int = 0) -> None:
        """The sync side's cumulative counters (any thread)."""
        self.unserved_claims.set(unserved_claims)
        self._mirror(self.blocked, blocked_seconds)
        self._mirror(self.rollbacks, rollbacks)
        self.alone_rounds.set(alone_rounds)
        self.relay_reservations.set(relay_reservations)
        for kind in BYTE_KINDS:
            self._mirror(self.bytes_sent, bytes_sent.get(kind, 0), kind=kind)
            self._mirror(self.bytes_received, bytes_received.get(kind, 0), kind=kind)
        for reason, count in rejected.items():
            self._mirror(self.rejected, count, reason=reason)

    # ---- live peers ---------------------------------------------------------------------------------------

    def start_peer_refresh(self, count_peers: Callable[[], int], interval: float = 5.0) -> None:
        """Refresh spes_peers from `count_peers()` (a DHT read) every `interval` s on a background thread, so
        the training loop never waits on the DHT for a metric."""
        def refresh() -> None:
            while True:
                try:
                    self.peers.set(count_peers())
                except Exception as e:  # a slow or failing DHT read only leaves the gauge stale
                    logger.debug(f"could not count live peers: {e}")
                if self._refresh_stop.wait(interval):
                    return
        self._refresh_stop.clear()
        self._refresh_thread = threading.Thread(target=refresh, name="spes-metrics-peers", daemon=True)
        self._refresh_thread.start()

    def stop_peer_refresh(self) -> None:
        """Stop the refresher (before the DHT it reads shuts down)."""
        self._refresh_stop.set()
        if self._refresh_thread is not None:
            self._refresh_thread.join(timeout=10)
            self._refresh_thread = None

    def value(self, name: str, **labels: str) -> float | None:
        """The current value of one exposed sample (e.g. "spes_tokens_total"), None if absent; for tests/tools."""
        return self.registry.get_sample_value(name, labels or None)
