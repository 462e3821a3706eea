"""Averaging of the shared (non-expert) tensors: one hivemind DecentralizedAverager per peer.

The averager all-reduces a snapshot of the shared parameters taken at the round boundary, weighted by the
tokens each peer trained on since the last round. `apply()` then adds (result - snapshot) to the live
parameters, so training may continue while the all-reduce runs (a one-round-delayed update); with no training
in between it is exactly "parameters := average". `outer: nesterov` instead treats (anchor - average) as
DiLoCo's pseudo-gradient and takes an SGD step with Nesterov momentum from the previous round's anchor.
"""
from __future__ import annotations

import math
import signal
import threading
import time
from typing import AsyncIterator, Callable

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import AveragingStage
from hivemind.compression import NoCompression
from hivemind.averaging.partition import AllreduceException
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import achain, as_aiter
from hivemind.utils.logging import get_logger
from hivemind.utils.mpfuture import MPFuture

from model.model import SpesMoE
from sync.carry import CarriedChange, fold_changes, fold_room
from sync.delta import apply_rebased_, rebased
from sync.matchmaking import could_be_in, drain, heard_from, install_group_forming, linger_after_answers
from sync.wire import COMPRESSIONS, CountingCompression, WireCounter, install_wire_counting
from sync.config import SyncConfig
from sync.swarm import Swarm
from sync.transfer import patch_hivemind_8bit_decoder
from sync.robust import AggregationPolicy, install_robust_reducer
from sync.shared_tensors import load_shared_state
from sync.validate import RejectCounter

logger = get_logger(__name__)

# A tensor this peer did not change, averaged with identical copies, comes back within float32 rounding of its
# snapshot, not always exactly on it (weighted sums, then a division, in an order that depends on the group): a
# [64, 32] tensor of norm 0.9 came back 4.0e-8 away, refused as "delta" against the absolute floor alone (1e-8 x
# max_delta_ratio) in a round where the peers had moved only their experts (tests/test_carry.py, 6 runs of 26 on
# two busy cores; none of 12 with this floor). A change within a few ulps of the tensor's own norm is accepted.
FP32_ROUNDING = 2.0 ** -20

class _CountingAverager(DecentralizedAverager):
    """A DecentralizedAverager whose process counts its wire bytes into `wire`.

    In a closed run (`gate` given) it is also the door of the averaging protocol: a join request, an all-reduce
    part or a state download from a peer the gate does not admit is refused, and this averager never runs an
    all-reduce in a group that contains one (the leader chooses the group, so a leader may have let one in).
    """

    def __init__(self, *args, wire: WireCounter, gate=None, rejects: RejectCounter | None = None,
                 policy: AggregationPolicy | None = None, begin_grace: float = 0.0, **kwargs):
        # Set before start(): the forked process needs them.
        self._wire, self._gate, self._rejects, self._policy = wire, gate, rejects, policy
        self._begin_grace = begin_grace
        super().__init__(*args, **kwargs)

    def set_expected_group_size(self, size: int) -> None:
        """(Calling process) A group this peer leads starts its all-reduce once `size` peers are in it. hivemind
        fixes target_group_size at construction; the live peer count changes, so it is set before each step."""
        future = MPFuture()
        self._outer_pipe.send(("_set_expected_group_size", [], dict(size=size, future=future)))
        future.result(timeout=10)

    async def _set_expected_group_size(self, size: int, future: MPFuture) -> None:
        # The matchmaking reads target_group_size on every join request (start when full, refuse beyond it).
        self._matchmaking.target_group_size = size
        future.set_result(None)

    async def _admits(self, peer_id) -> bool:
        if self._gate is None or await self._gate.admits(peer_id):
            return True
        if self._rejects is not None:
            self._rejects.add("unauthorized")
        logger.debug(f"averager {self.prefix}: refusing unadmitted peer {peer_id}")
        return False

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest, context: P2PContext
                             ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if not await self._admits(context.remote_id):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
            return
        # Kept open after the answers until the asker closes it: closing first can lose them (sync/matchmaking.py).
        async for response in linger_after_answers(super().rpc_join_group(request, context)):
            yield response

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.AveragingData]:
        if not await self._admits(context.remote_id):
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        request = await anext(stream)
        if not await could_be_in(self, request.group_id, patience=self._allreduce_timeout or 60.0):
            # Not this averager's group: said at once (sync/matchmaking.py), not when its next group forms.
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            await drain(stream)
            return
        async for response in super().rpc_aggregate_part(achain(as_aiter(request), stream), context):
            yield response

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest, context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.DownloadData]:
        if not await self._admits(context.remote_id):
            return  # an empty stream: hivemind's downloader moves on to the next peer
        async for response in super().rpc_download_state(request, context):
            yield response

    async def _aggregate_with_group(self, group_info, *args, **kwargs):
        for peer_id in group_info.peer_ids:
            if peer_id != self.peer_id and not await self._admits(peer_id):
                raise AllreduceException(f"group {group_info.group_id.hex()[:8]} has an unadmitted member {peer_id}")
        gathered = await super()._aggregate_with_group(group_info, *args, **kwargs)
        # A member that had left the group (sync/matchmaking.py) is not counted as averaged with.
        runner = self._running_groups.get(group_info.group_id)
        if runner is None or not runner.done() or runner.cancelled() or runner.exception() is not None:
            return gathered
        return heard_from(runner.result(), gathered)

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        # hivemind names rpc handlers after the class: keep DecentralizedAverager's names so this averager
        # stays wire-compatible with plain hivemind averagers (and peers of earlier builds).
        return DecentralizedAverager._get_handle_name.__func__(DecentralizedAverager, namespace, method_name)

    async def _shutdown(self, timeout: float | None) -> None:
        # hivemind 1.1.12's own _shutdown calls finalize() on the values of _running_groups, which are Futures
        # whose results are the all-reduce runners (and finalize returns nothing to wait for): shutting down while
        # a group is registered raised an AttributeError in this process (seen in CI: a peer stopping right after
        # a re-join exited -6). Here the runners that exist are cancelled and the groups being set up too.
        if not self.client_mode:
            await self.remove_p2p_handlers(self._p2p, namespace=self.prefix)
        for group in list(self._running_groups.values()):
            if not group.done():
                group.cancel()
            elif not group.cancelled() and group.exception() is None and hasattr(group.result(), "finalize"):
                group.result().finalize(cancel=True)

    def run(self) -> None:
        install_wire_counting(self._wire)
        if self._policy is not None:
            install_robust_reducer(self._policy)
        install_group_forming(self._begin_grace)
        super().run()


class SharedAverager:
    """The shared tensors of the model in one DecentralizedAverager, with optional outer Nesterov."""

    def __init__(self, model: SpesMoE, swarm: Swarm, cfg: SyncConfig, params: list[torch.Tensor] | None = None,
                 prefix: str | None = None, outer: str | None = None, rejects: RejectCounter | None = None,
                 max_weight: float = float("inf"), gate=None, bandwidth: float | None = None):
        """Averages `params` (default: the model's shared parameters) under DHT prefix `prefix`; refusals are
        counted in `rejects` if given. `max_weight`: the most tokens one peer can have trained in one round
        (every reducer caps claimed weights at it); `gate`: a closed run's door check (sync.admission.Gate)."""
        self.cfg = cfg
        self.rejects = rejects
        self.max_weight = max_weight
        self.params = [p for _, p in model.shared_parameters()] if params is None else list(params)
        # Before the averager process forks, so it inherits the fix: whatever this peer sends, a peer on a slow
        # uplink sends its parts 8-bit (sync.slow_uplink_mbit), and hostile ones may anyway.
        patch_hivemind_8bit_decoder()
        self.wire = WireCounter()
        self.compression = CountingCompression(COMPRESSIONS[cfg.compression](), self.wire,
                                               switchable=cfg.compression != "8bit")
        # hivemind's averager sets SIGINT to SIG_IGN in the *calling* process (meant for the forked child) and
        # never restores it, which would make the peer deaf to Ctrl-C: keep the handler it had.
        sigint = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
        # An all-reduce may start as soon as the expected group is complete (sync.target_group_size: fixed, or
        # by default the live peers seen at the round's start, set per round in all_reduce). Replicas of an
        # expert set arrive straight from the shared all-reduce they left together: a short window suffices.
        shared = params is None
        matchmaking = cfg.matchmaking_time if shared else min(cfg.matchmaking_time, 5.0)
        self.matchmaking_time = matchmaking
        # A peer behind NAT in client mode (sync.reach) averages as a hivemind client: it never leads a group,
        # reduces a part or serves state, since nobody could open a connection to it for those.
        client_mode = bool(swarm.dht.client_mode if swarm.averages_as_client is None else swarm.averages_as_client)
        self.averager = _CountingAverager(
            [p.detach().to("cpu", torch.float32).clone() for p in self.params], swarm.dht,
            prefix=prefix or f"{swarm.run_id}_shared", start=True, min_group_size=2,
            target_group_size=cfg.target_group_size if shared and cfg.target_group_size >= 2 else None,
            min_matchmaking_time=matchmaking, request_timeout=min(3.0, matchmaking / 2), begin_grace=matchmaking,
            allreduce_timeout=cfg.round_timeout, next_chunk_timeout=min(10.0, cfg.round_timeout / 4),
            compression=self.compression, allow_state_sharing=shared and not client_mode, client_mode=client_mode,
            state_compression=CountingCompression(NoCompression(), self.wire), wire=self.wire,
            gate=gate, rejects=rejects, bandwidth=bandwidth,
            policy=AggregationPolicy(cfg.aggregation, max_weight, cfg.clip_factor, rejects),
        )
        if sigint is not None:
            signal.signal(signal.SIGINT, sigint)
        self.snapshot: list[torch.Tensor] | None = None
        self._control = None  # the running (or last) averaging step, for cancel_matchmaking
        self._ahead = None  # a step looking for the next round's group before the round starts (prepare)
        self._step_started, self._group_seconds = 0.0, None  # when it started, how long its group took to form
        self._expected = 0  # the expected group size last set in the averager process
        # The last all_reduce: seconds to form the group and to all-reduce, bytes received meanwhile.
        self.last_timing: dict[str, float] = {}
        self.refusals: list[tuple[int, tuple[int, ...], float]] = []
        # The last synchronized value of each tensor: a received result is judged by its change from the snapshot
        # against this peer's own change since then (check_result), as issue 9 asks.
        self.synced = [p.detach().to("cpu", torch.float32).clone() for p in self.params]
        # Per tensor, how far this peer's snapshot lay from the last all-reduce result it accepted: its share of
        # the honest spread, which bounds how far folded changes may move its contribution (carry.fold_room).
        self.spread: list[float] | None = None
        self.folded: list[CarriedChange] = []  # what fold_carried put into the pending all-reduce (take_folded)
        # DiLoCo's outer optimizer needs the params of the previous round (identical on every peer after a
        # successful round) and a momentum buffer.
        outer = cfg.outer if outer is None else outer
        self.anchor = [p.detach().to("cpu", torch.float32).clone() for p in self.params] if outer == "nesterov" else None
        self.momentum = [torch.zeros_like(a) for a in self.anchor] if self.anchor is not None else None

    def payload_bytes(self) -> int:
        """Bytes of one full copy of the shared tensors as they travel (fp32)."""
        return sum(p.numel() * 4 for p in self.params)

    def bytes_sent(self) -> int:
        """Tensor payload bytes (after compression) this averager sent so far: all-reduce parts and deltas,
        and shared state served to joining peers."""
        return self.wire.sent

    def bytes_received(self) -> int:
        """Tensor payload bytes (after compression) this averager received so far, state downloads included."""
        return self.wire.received

    def bytes_on_wire(self) -> int:
        """Sent + received payload bytes so far."""
        return self.wire.sent + self.wire.received

    def take_snapshot(self, tensors: list[torch.Tensor] | None = None) -> None:
        """At the round boundary (training thread): what this peer contributes to the average."""
        source = self.params if tensors is None else tensors
        self.snapshot = [p.detach().to("cpu", torch.float32).clone() for p in source]
        with self.averager.get_tensors() as tensors:
            for tensor, snap in zip(tensors, self.snapshot):
                tensor.copy_(snap)

    def fold_carried(self, changes: list[CarriedChange], weight: float) -> tuple[float, list[CarriedChange]]:
        """(Round start, after take_snapshot) fold followers' shared changes into what this peer contributes
        (sync/carry.py); its own snapshot, against which the result is applied, stays as it was. Returns the
        contribution's weight: this peer's tokens plus the kept changes', at most max_weight, the cap every reducer
        applies to any claim (a carrier and its followers share one peer's cap; claiming more would only be
        counted as a `weight` refusal at every reducer); and what did not fit into this round (fold_room), for
        the caller to hold for the next."""
        self.folded = []
        if not changes:
            return weight, []
        short = self.max_weight / max(weight, 1.0) if math.isfinite(self.max_weight) else 1.0
        contribution, total, refused, rest = fold_changes(self.snapshot, self.synced, weight, changes,
                                                          self.cfg.max_delta_ratio * max(1.0, short),
                                                          fold_room(self.spread, self.synced))
        if contribution is not None:
            refused_senders = {sender for sender, _ in refused}
            left = {c.sender: c.weight for c in rest}
            self.folded = [CarriedChange(c.sender, c.round_id, c.weight - left.get(c.sender, 0.0), c.tensors)
                           for c in changes if c.sender not in refused_senders]
        for sender, ratio in refused:
            self._reject("delta")
            logger.warning(f"refused the carried shared change of follower {sender[-6:]}: its pull on this peer's "
                           f"contribution is {ratio:.1f}x what this peer's own change allows")
        if contribution is not None:
            with self.averager.get_tensors() as tensors:
                for tensor, value in zip(tensors, contribution):
                    tensor.copy_(value)
            later = (f"; {sum(c.weight for c in rest):g} tokens of them wait for the next round (beyond this "
                     f"peer's room in the average)") if rest else ""
            logger.info(f"carrying {len(changes) - len(refused)} follower change(s) into this round's all-reduce "
                        f"(weight {weight:g} + {total - weight:g} tokens{later})")
        return min(total, self.max_weight), rest

    def take_folded(self) -> list[CarriedChange]:
        """(After a round) the changes folded into its all-reduce, once: the caller holds them again when that
        all-reduce did not average with anyone (a carrier alone dropped them before)."""
        folded, self.folded = self.folded, []
        return folded

    def prepare(self, expected: int, start: float, timeout: float) -> bool:
        """Look for the next all-reduce's group now, before its round starts at DHT time `start` (sync.schedule,
        "group ahead"): the group forms while this peer still trains its last steps, and its all-reduce waits for
        all_reduce() to release it with the snapshot and weight. False if one is prepared already or the
        averager refused."""
        if self._ahead is not None and not self._ahead.done():
            return False
        self._set_expected(expected)
        try:
            # The weight is a placeholder: hivemind reads it when the all-reduce is released, set by all_reduce().
            # A group this peer leads waits for late members until matchmaking_time after the expected start, as
            # a group looked for at the round's start would (not after the earlier moment it began looking).
            self._ahead = self.averager.step(weight=1.0, scheduled_time=start + self.matchmaking_time,
                                             timeout=timeout, require_trigger=True, wait=False)
        except Exception as e:  # the averager process is gone or busy: the round looks for its group as before
            logger.debug(f"could not look for a group ahead: {e!r}")
            self._ahead = None
            return False
        return True

    def prepared(self) -> bool:
        return self._ahead is not None and not self._ahead.done()

    def cancel_ahead(self) -> None:
        """Give up a group looked for ahead (the round will not all-reduce: leaving, behind, run over): released
        never, it would keep the others' all-reduce waiting on this peer until their timeouts."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and not ahead.done():
            ahead.cancel()

    def all_reduce(self, weight: float, timeout: float, expected: int = 0,
                   on_grouped: Callable[[bool], None] | None = None, nobody_left: Callable[[], bool] | None = None) -> int:
        """Run the all-reduce on the snapshot (any thread); returns the group size, 0 if it failed. `expected`:
        the peers (this one included) that should join, as the records show them; with sync.target_group_size 0
        a group this peer leads starts once that many joined. `on_grouped(first)` is called (in this thread) once
        the group has formed and its all-reduce runs (first=True), then every poll (20 ms) until it returns
        (first=False): the expert copies stream in meanwhile and are checked as they arrive. `nobody_left`: asked every half second once the group took longer
        than matchmaking_time; True (no other peer that could join is left in the run) ends the search at once
        instead of at `timeout` (hivemind retries matchmaking until then: a peer whose last round came after the
        others had finished their runs waited 60 s for nobody in bench.wan `mixed`)."""
        control, self.last_timing = None, {}
        ahead, self._ahead = self._ahead, None
        if ahead is None or ahead.done():  # none prepared, or it failed / was cancelled: look for a group now
            ahead = None
            self._set_expected(expected)
        try:
            started = self._step_started = time.perf_counter()
            self._group_seconds = None
            if ahead is not None:
                # Released before or after its group formed: the snapshot is in the averaged tensors already.
                ahead.weight = max(weight, 1e-6)
                ahead.allow_allreduce()
                control = self._control = ahead
            else:
                control = self._control = self.averager.step(weight=max(weight, 1e-6), timeout=timeout, wait=False)
            # Bounded even if the averager process itself dies (its future would never resolve otherwise).
            # Polled, to time how long the group took to form apart from the all-reduce itself (round log line).
            deadline, grouped, received = started + timeout + self.cfg.round_timeout, None, self.wire.received
            asked = started + self.cfg.matchmaking_time
            while not control.done() and time.perf_counter() < deadline:
                if grouped is None and nobody_left is not None and time.perf_counter() > asked:
                    asked = time.perf_counter() + 0.5
                    if control.stage in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP) and nobody_left():
                        logger.info("no other peer is left in the run to average with: stopped looking for a group")
                        control.cancel()
                        return 0
                first = grouped is None and control.stage in (AveragingStage.RUNNING_ALLREDUCE,
                                                              AveragingStage.FINISHED)
                if first:
                    grouped, received = time.perf_counter(), self.wire.received
                    self._group_seconds = grouped - started
                if grouped is not None and on_grouped is not None:
                    try:
                        on_grouped(first)
                    except Exception as e:  # the all-reduce is not this callback's to fail
                        logger.warning(f"expert copies during the all-reduce: {e!r}")
                        on_grouped = None
                time.sleep(0.02)
            gathered = control.result(timeout=max(0.0, deadline - time.perf_counter()))
            done = time.perf_counter()
            grouped = done if grouped is None else grouped
            self.last_timing = {"group": grouped - started, "all-reduce": done - grouped,
                                "received bytes": self.wire.received - received}
        except Exception as e:  # a peer died mid-round, matchmaking timed out, ...: keep local values
            logger.warning(f"averaging failed this round: {type(e).__name__}: {e}")
            if control is not None and not control.done():
                control.cancel()
            return 0
        return len(gathered) if gathered else 0

    def _set_expected(self, expected: int) -> None:
        if self.cfg.target_group_size == 0 and expected >= 2 and expected != self._expected:
            try:
                self.averager.set_expected_group_size(expected)
                logger.info(f"{self.averager.prefix}: an all-reduce starts once {expected} peers joined its group "
                            f"(was {self._expected or 'unset'}; at most {self.matchmaking_time:g} s)")
                self._expected = expected
            except Exception as e:  # the averager process is gone or busy: this round waits matchmaking_time
                logger.debug(f"could not set the expected group size: {e!r}")

    def group_wait(self) -> float:
        """Seconds the latest step waited for its group: so far while it still looks, else until it formed
        (0 when no step ran, or it failed without a group)."""
        control = self._control
        if control is None:
            return 0.0
        if self._group_seconds is not None:
            return self._group_seconds
        return 0.0 if control.done() else time.perf_counter() - self._step_started

    def cancel_matchmaking(self) -> bool:
        """Give up the running step if it is still looking for a group (a leaving peer: its partners may be
        leaving too, and hivemind would retry matchmaking until the round timeout). An all-reduce that already
        runs is left to finish: cancelling it would fail the round for the whole group."""
        cancelled = self.prepared()
        self.cancel_ahead()
        control = self._control
        if control is None or control.done():
            return cancelled
        if control.stage not in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP,
                                 AveragingStage.AWAITING_TRIGGER):
            return cancelled
        control.cancel()
        return True

    def check_result(self, averaged: list[torch.Tensor], tokens: float) -> list[bool]:
        """Which tensors of an all-reduce result to accept (training thread, before apply).

        A result's change from the snapshot must be finite and at most `sync.max_delta_ratio` times this peer's
        own change since the last synchronized value (scaled up if it trained less than a full round's tokens),
        with a floor of the run-wide relative change for tensors that barely moved here. Honest rounds change a
        tensor by about |mean - own| <= 2 |own|; a hostile reducer or a peer outside the clip is refused."""
        own = [float(torch.linalg.vector_norm(s - r)) for s, r in zip(self.snapshot, self.synced)]
        ref = [float(torch.linalg.vector_norm(r)) for r in self.synced]
        rel = math.sqrt(sum(o * o for o in own)) / max(math.sqrt(sum(r * r for r in ref)), 1e-12)
        short = self.max_weight / max(tokens, 1.0) if math.isfinite(self.max_weight) else 1.0
        scale = self.cfg.max_delta_ratio * max(1.0, short)
        accepted = []
        self.refusals = []  # (tensor index, shape, change / allowed) of the last check, for the log line
        for i, (avg, snap, own_t, ref_t) in enumerate(zip(averaged, self.snapshot, own, ref)):
            change = float(torch.linalg.vector_norm(avg - snap))
            allowed = scale * max(own_t, rel * ref_t, FP32_ROUNDING * ref_t, 1e-8)
            if not math.isfinite(change):
                self._reject("nonfinite")
                accepted.append(False)
            elif change > allowed:
                self._reject("delta")
                self.refusals.append((i, tuple(avg.shape), change / allowed))
                accepted.append(False)
            else:
                accepted.append(True)
        return accepted

    @torch.no_grad()
    def apply(self, tokens: float = float("inf")) -> int:
        """Training thread, after a successful all_reduce: live params += (new value - snapshot) for every
        tensor check_result accepts; the others keep their local values. Returns how many were refused."""
        with self.averager.get_tensors() as averaged:
            accepted = self.check_result(list(averaged), tokens)
            # A refused tensor is treated as if its average were this peer's own snapshot: no change.
            result = [avg if ok else snap for avg, snap, ok in zip(averaged, self.snapshot, accepted)]
            if self.anchor is None:
                targets = result
            else:
                lr, mu = self.cfg.outer_lr, self.cfg.outer_momentum
                for anchor, buf, avg in zip(self.anchor, self.momentum, result):
                    pseudo_grad = anchor - avg
                    buf.mul_(mu).add_(pseudo_grad)
                    anchor.sub_(pseudo_grad.add(buf, alpha=mu), alpha=lr)
                targets = self.anchor
            spread = [float(torch.linalg.vector_norm(avg - snap)) for avg, snap in zip(result, self.snapshot)]
            if self.spread is not None:  # a refused tensor (its result = its snapshot) keeps its last distance
                spread = [x if ok else old for x, old, ok in zip(spread, self.spread, accepted)]
            if any(accepted):
                self.spread = spread
            for param, snap, target, synced in zip(self.params, self.snapshot, targets, self.synced):
                apply_rebased_(param, target, snap)
                synced.copy_(target)
        refused = accepted.count(False)
        if refused:
            worst = ", ".join(f"#{i} {list(shape)} {ratio:.1f}x" for i, shape, ratio in
                              sorted(self.refusals, key=lambda r: -r[2])[:3])
            logger.warning(f"refused {refused} of {len(accepted)} averaged tensors: out of proportion to this "
                           f"peer's own change (kept local values); worst: {worst or 'non-finite'}")
        return refused

    def reset_reference(self) -> None:
        """The current parameters become the last synchronized value (after a state download or a rollback)."""
        for synced, param in zip(self.synced, self.params):
            synced.copy_(param.detach().float().cpu())
        if self.anchor is not None:
            for anchor, param in zip(self.anchor, self.params):
                anchor.copy_(param.detach())

    def rebase_on_snapshot(self) -> None:
        """A follower's round without a download: the snapshot becomes the base its next change is measured from."""
        for synced, snap in zip(self.synced, self.snapshot):
            synced.copy_(snap)

    @torch.no_grad()
    def apply_followed(self, candidates: list[list[torch.Tensor]]) -> bool:
        """A follower's round (sync.follow_below_mbit): the swarm's shared tensors, downloaded, take the place of
        an all-reduce result — live params += (downloaded - snapshot), keeping what this peer trained since the
        snapshot. Checked as a state download (shapes, finite, norms; the median of 3+ copies). False (local
        values kept) if no copy is valid."""
        live = [p.detach().clone() for p in self.params]
        for param, snap in zip(self.params, self.snapshot):
            param.copy_(snap.to(param.device, param.dtype))  # load_state judges and replaces the snapshot values
        if not self.load_state(candidates):
            for param, value in zip(self.params, live):
                param.copy_(value)
            return False
        for param, snap, value in zip(self.params, self.snapshot, live):
            param.copy_(rebased(value, param, snap).to(param.dtype))  # param holds the downloaded value here
        return True

    def load_state(self, candidates: list[list[torch.Tensor]]) -> bool:
        """Late joiner / fell behind: take the shared tensors from copies downloaded from several peers
        (sync.shared_tensors.load_shared_state: shapes, finite, norms, the median of three or more). Returns
        False (local values kept) if none is valid."""
        if not load_shared_state(self.params, candidates, self.cfg.max_norm_ratio, self._reject):
            return False
        self.reset_reference()
        return True

    def _reject(self, reason: str) -> None:
        if self.rejects is not None:
            self.rejects.add(reason)

    def shutdown(self) -> None:
        self.cancel_ahead()
        self.averager.shutdown()
