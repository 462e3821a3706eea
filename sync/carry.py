"""A follower's shared changes, carried into the all-reduce by a peer that joins it (docs/DESIGN.md, "Carried
changes").

A follower (sync.follow_below_mbit: an uplink too slow to join all-reduce groups without making each of them as
slow as itself) downloads the swarm's shared tensors every round instead of all-reducing them. Without more, its
own shared changes were dropped: the tokens it trained counted for its experts only. Here it sends its change
since the shared tensors it last took (`delta = snapshot - synced`, plus whatever it could not send before) to
one peer that joins the groups, the *carrier*, 8-bit (a quarter of the fp32 bytes; the rounding error stays with
the follower and goes out with its next change, so none is lost). The carrier folds every change it holds into
its next round's contribution, as if the follower had been in its group:

    contribution = synced_C + (w_C * d_C + sum_F w_F * d_F) / (w_C + sum_F w_F),  weight w_C + sum_F w_F

where d_C = snapshot_C - synced_C is its own change. The reducers cap that weight at one round's tokens as any
other (a carrier and its followers share one peer's cap: never more weight than a liar could claim).

Wire: a client stream on the expert exchange's handler (`rpc_carry_shared`): the first message's `metadata` is
MSGPack `{"round": r, "weight": w}`, then the tensors in the order of the model's shared parameters, each
serialized with hivemind's codecs and cut by `split_for_streaming`; the answer is `{"ok": true}` or
`{"error": ...}`. A carrier takes changes only from peers whose signed record says they follow, at most
`MAX_CONCURRENT` at once and `MAX_SENDERS` held, each of exactly the shared tensors' shapes and finite, and
checks each change's size against its own at fold time (sync/shared.py `fold_carried`). Nothing is unpickled.
"""
from __future__ import annotations

import asyncio
import math
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

import torch
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.logging import get_logger
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.streaming import split_for_streaming

from sync.codec import MalformedResponse, deserialize_parts, serialize_tensor
from sync.validate import RejectCounter

logger = get_logger(__name__)

MAX_CONCURRENT = 2  # changes being received at once (each up to one fp32 copy of the shared tensors)
MAX_SENDERS = 4  # followers whose changes a carrier holds until its next round
# A change labelled more than this many rounds before the carrier's round is dropped. Changes are late by
# design: a 5 Mbit/s uplink needed 10-30 s for one beside its expert copies, 2-6 of the public peers' rounds
# (with 2, none of them arrived in time in a bench.wan `mixed` run). Its pull is bounded however old it is.
MAX_AGE_ROUNDS = 8
# How far the changes folded into one round may move a carrier's contribution, in units of its own distance from
# the last average (`fold_room`): with its own at about 1x that, the contribution stays under the
# reducers' clip (2.5x the median distance) and far from their drop (5x).
FOLD_ROOM = 1.5
PARTS_PER_MESSAGE = 16
_EIGHT_BIT = runtime_pb2.CompressionType.UNIFORM_8BIT


@dataclass
class CarriedChange:
    sender: str  # base58 peer ID
    round_id: int
    weight: float  # tokens, capped at one round's (the most any peer's contribution may claim)
    tensors: list[torch.Tensor]


def encode_change(delta: list[torch.Tensor]) -> tuple[list[runtime_pb2.Tensor], list[torch.Tensor]]:
    """8-bit serialized change (16-bit for tensors too small for a codebook) and what the rounding left out,
    which the follower adds to its next change (error feedback: nothing it trained is lost, only delayed)."""
    serialized = [serialize_tensor(d.float(), _EIGHT_BIT) for d in delta]
    residual = [d.float() - deserialize_parts(list(split_for_streaming(s))).float() for d, s in zip(delta, serialized)]
    return serialized, residual


async def send_change(call: Callable[[AsyncIterator[runtime_pb2.ExpertRequest]], Awaitable],
                      round_id: int, weight: float, serialized: list[runtime_pb2.Tensor]) -> str | None:
    """Stream one change to a carrier; None once it took it, else its reason (or the transport's)."""
    async def messages() -> AsyncIterator[runtime_pb2.ExpertRequest]:
        yield runtime_pb2.ExpertRequest(metadata=MSGPackSerializer.dumps({"round": round_id, "weight": weight}))
        batch: list[runtime_pb2.Tensor] = []
        for tensor in serialized:
            for part in split_for_streaming(tensor):
                batch.append(part)
                if len(batch) >= PARTS_PER_MESSAGE:
                    yield runtime_pb2.ExpertRequest(tensors=batch)
                    batch = []
        if batch:
            yield runtime_pb2.ExpertRequest(tensors=batch)

    response = await call(messages())
    try:
        answer = MSGPackSerializer.loads(response.metadata)
    except Exception:
        return "malformed answer"
    if isinstance(answer, dict) and answer.get("ok") is True:
        return None
    return str(answer.get("error", "refused"))[:80] if isinstance(answer, dict) else "malformed answer"


class CarryInbox:
    """Carrier side: the followers' changes until this peer's next round takes them (one per sender: a newer
    change is merged with the one held, `merge_changes`).

    `shapes`: the shared tensors' shapes (set by the peer); `follows(peer_id)`: whether the sender's signed record
    says it follows (set by the peer; a peer that all-reduces itself must not be counted twice); `max_weight`:
    the most tokens one round can hold (a claim above it counts as that)."""

    def __init__(self, rejects: RejectCounter) -> None:
        self.rejects = rejects  # a malformed change counts as "malformed"
        self.shapes: list[tuple[int, ...]] | None = None
        self.follows: Callable[[str], bool] = lambda peer_id: False
        self.max_weight = math.inf
        self.received = 0  # changes taken in, for the log and tests
        self._held: dict[str, CarriedChange] = {}
        self._active: set[str] = set()
        self._lock = threading.Lock()

    def _max_bytes(self) -> int:
        # fp32 of every tensor plus its serialization header: the most an honest change can take (8-bit or not).
        return sum(4 * math.prod(s) + 4096 for s in self.shapes or [])

    async def absorb(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], sender: PeerID,
                     count: Callable[[int], None]) -> runtime_pb2.ExpertResponse:
        """One follower's change (the rpc handler's body); never raises. `count(n)`: bytes received."""
        def answer(**meta) -> runtime_pb2.ExpertResponse:
            return runtime_pb2.ExpertResponse(metadata=MSGPackSerializer.dumps(meta))

        peer_id = sender.to_base58()
        shapes = self.shapes
        if shapes is None or not self.follows(peer_id):
            logger.debug(f"not carrying the change of {peer_id}: {'its record does not say it follows' if shapes else 'not ready'}")
            return answer(error="not a follower" if shapes is not None else "not ready")
        if len(self._active) >= MAX_CONCURRENT or peer_id in self._active:
            return answer(error="busy")
        self._active.add(peer_id)
        try:
            change = await self._receive(requests, peer_id, shapes, count)
        except MalformedResponse as e:
            logger.debug(f"refused a carried change from {peer_id}: {e}")
            self.rejects.add("malformed")
            return answer(error="malformed")
        finally:
            self._active.discard(peer_id)
        with self._lock:
            if peer_id not in self._held and len(self._held) >= MAX_SENDERS:
                return answer(error="busy")
            held = self._held.get(peer_id)
            # Replacing an older change of the sender by its newer one dropped the older one's work.
            self._held[peer_id] = change if held is None else merge_changes(held, change)
            self.received += 1
        return answer(ok=True)

    def put_back(self, rest: list[CarriedChange]) -> None:
        """(Round start) what a fold left for the next round (sync/shared.py `fold_carried`): held again, added
        to a newer change of the same sender if one arrived meanwhile."""
        with self._lock:
            for change in rest:
                held = self._held.get(change.sender)
                if held is not None:
                    self._held[change.sender] = merge_changes(change, held)
                elif len(self._held) < MAX_SENDERS:
                    self._held[change.sender] = change

    async def _receive(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], peer_id: str,
                       shapes: list[tuple[int, ...]], count: Callable[[int], None]) -> CarriedChange:
        meta, groups, received, limit = None, [], 0, self._max_bytes()
        async for message in requests:
            if meta is None:
                meta = _parse_meta(message.metadata)
            elif message.metadata:
                raise MalformedResponse("metadata after the first message")
            for part in message.tensors:
                received += len(part.buffer)
                count(len(part.buffer))
                if received > limit:
                    raise MalformedResponse(f"change exceeds {limit} bytes")
                if part.dtype:  # hivemind's streaming marks the first part of each tensor by its dtype
                    if len(groups) >= len(shapes):
                        raise MalformedResponse("more tensors than shared parameters")
                    groups.append([part])
                elif groups:
                    groups[-1].append(part)
                else:
                    raise MalformedResponse("continuation part before any tensor header")
        if meta is None or len(groups) != len(shapes):
            raise MalformedResponse(f"{len(groups)} tensors, expected {len(shapes)}")
        tensors = await asyncio.get_running_loop().run_in_executor(None, _decode, groups, shapes)
        return CarriedChange(peer_id, meta["round"], min(meta["weight"], self.max_weight), tensors)

    def take(self, round_id: int) -> list[CarriedChange]:
        """(Round start) every change held, once; those older than MAX_AGE_ROUNDS before `round_id` are dropped."""
        with self._lock:
            held, self._held = list(self._held.values()), {}
        fresh = [c for c in held if c.round_id >= round_id - MAX_AGE_ROUNDS and c.weight > 0]
        if len(fresh) < len(held):
            logger.info(f"dropped {len(held) - len(fresh)} carried change(s) labelled more than {MAX_AGE_ROUNDS} "
                        f"rounds before round {round_id}, or of no tokens")
        return fresh


def merge_changes(older: CarriedChange, newer: CarriedChange) -> CarriedChange:
    """Two changes of one sender as one, labelled with the newer round: both their tokens, and their
    token-weighted mean, so each keeps its weight x change in the fold. (Their sum was tried: a rest of an
    earlier change added to the next one lay 1.3x beyond the pull bound even for its tokens, and was refused.)"""
    total = older.weight + newer.weight
    if total <= 0:
        return newer
    a, b = older.weight / total, newer.weight / total
    return CarriedChange(newer.sender, max(older.round_id, newer.round_id), total,
                         [a * x + b * y for x, y in zip(older.tensors, newer.tensors)])


def _parse_meta(raw: bytes) -> dict:
    try:
        meta = MSGPackSerializer.loads(raw) if 0 < len(raw) <= 256 else None
    except Exception:
        meta = None
    if not isinstance(meta, dict):
        raise MalformedResponse("bad change metadata")
    round_id, weight = meta.get("round"), meta.get("weight")
    if (not isinstance(round_id, int) or isinstance(round_id, bool) or not 0 <= round_id < 2**40
            or not isinstance(weight, (int, float)) or isinstance(weight, bool)
            or not math.isfinite(weight) or weight < 0):
        raise MalformedResponse("bad change round or weight")
    return {"round": round_id, "weight": float(weight)}


def _decode(groups: list[list[runtime_pb2.Tensor]], shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    tensors = []
    for group, shape in zip(groups, shapes):
        tensor = deserialize_parts(group).float()
        if tuple(tensor.shape) != tuple(shape):
            raise MalformedResponse(f"tensor of shape {tuple(tensor.shape)}, expected {tuple(shape)}")
        if not bool(torch.isfinite(tensor).all()):
            raise MalformedResponse("non-finite values")
        tensors.append(tensor)
    return tensors


def fold_room(spread: list[float] | None, synced: list[torch.Tensor]) -> list[float] | None:
    """Per tensor, how far folded changes may move a carrier's contribution: FOLD_ROOM x its distance from the
    last result it accepted (`spread`; floored by that distance's run-wide relative size, for tensors that were
    equal everywhere). The reducers judge a contribution by its distance from the others' (sync/robust.py: a
    pull beyond 2.5x the median distance is clipped, beyond 5x dropped); the carrier's own lay at about 1x.
    None before its first all-reduce, or when that one's peers never differed: then only fold_changes' own
    bound applies."""
    if spread is None or not any(x > 0 for x in spread):
        return None
    ref = [float(torch.linalg.vector_norm(r)) for r in synced]
    rel = math.sqrt(sum(x * x for x in spread)) / max(math.sqrt(sum(r * r for r in ref)), 1e-12)
    return [FOLD_ROOM * max(x, rel * r, 1e-12) for x, r in zip(spread, ref)]


@torch.no_grad()
def fold_changes(snapshot: list[torch.Tensor], synced: list[torch.Tensor], weight: float,
                 changes: list[CarriedChange], max_ratio: float, room: list[float] | None = None,
                 ) -> tuple[list[torch.Tensor] | None, float, list[tuple[str, float]], list[CarriedChange]]:
    """The carrier's contribution with the followers' changes folded in (the module docstring's formula), its
    weight, the senders whose change was refused, each with its worst pull ÷ allowed, and what is left for later.

    What a change does to the contribution is its pull, `share * (d_F - d_C)` per tensor; it is kept while that is
    at most `max_ratio` times the carrier's own change of the tensor (floored by the carrier's overall relative
    change), the bound an all-reduce result's change is held to (sync/shared.py `check_result`). So a hostile
    follower moves its carrier's contribution no further than a result may move a peer, whatever its change;
    an honest change several rounds long, or from earlier in training, passes as long as its pull is in
    proportion. Shares are of the kept changes: refusing one raises the others' shares, so they are judged
    again. (None, weight, refused, []) when no change is kept.

    `room` (per tensor; `fold_room`) bounds the kept changes' combined pull by how far this
    carrier's contribution may move and still lie inside the reducers' honest spread: a change folded in whole
    (its full tokens against one round of the carrier's) put the carrier's parts 6.6-6.8x the median distance
    from the median in bench.wan `mixed`, and a reducer dropped them (sync/robust.py), the follower's work and
    the carrier's own with them. Beyond the room, every kept change is folded with the same fraction of its
    tokens, and each one's rest (the same tensors, the rest of its tokens) is returned to be held for the
    carrier's next round (`CarryInbox.put_back`): the change arrives over several rounds, none of it lost. A
    change of more tokens than the carrier trained this round (such a rest merged with the sender's next change)
    spans that many rounds, and its bound above grows with them: an honest backlog measured 1.1-1.2x the
    one-round bound in bench.wan `mixed` and was refused whole."""
    own = [s - r for s, r in zip(snapshot, synced)]
    own_norms = [float(torch.linalg.vector_norm(o)) for o in own]
    ref_norms = [float(torch.linalg.vector_norm(r)) for r in synced]
    rel = math.sqrt(sum(o * o for o in own_norms)) / max(math.sqrt(sum(r * r for r in ref_norms)), 1e-12)
    allowed = [max_ratio * max(o, rel * r, 1e-8) for o, r in zip(own_norms, ref_norms)]
    distance = [[float(torch.linalg.vector_norm(d - o)) for d, o in zip(c.tensors, own)] for c in changes]
    spans = [max(1.0, c.weight / max(weight, 1.0)) for c in changes]  # rounds of the carrier's tokens in it
    kept, refused = list(range(len(changes))), []
    if room is not None:
        room = [min(r, a) for r, a in zip(room, allowed)]
    while kept:
        total = weight + sum(changes[i].weight for i in kept)
        pulls = {i: max(changes[i].weight / total * x / a for x, a in zip(distance[i], allowed)) / spans[i]
                 for i in kept}
        bad = [i for i in kept if pulls[i] > 1.0]
        if not bad:
            break
        refused += [(changes[i].sender, pulls[i]) for i in bad]
        kept = [i for i in kept if i not in bad]
    if not kept:
        return None, weight, refused, []
    fraction = 1.0
    if room is not None:
        # With fraction f of every kept change's tokens, tensor t moves by at most
        # sum_i f w_i / (w_C + f W) * distance_it <= room_t * f P / (w_C + f W), P = sum_i w_i max_t distance_it / room_t.
        kept_weight = sum(changes[i].weight for i in kept)
        reach = sum(changes[i].weight * max(x / max(r, 1e-12) for x, r in zip(distance[i], room)) for i in kept)
        if reach > kept_weight:
            fraction = min(1.0, weight / (reach - kept_weight))
    total = weight + fraction * sum(changes[i].weight for i in kept)
    contribution = [s.clone() for s in snapshot]
    rest = []
    for i in kept:
        share = fraction * changes[i].weight / total
        for out, d, o in zip(contribution, changes[i].tensors, own):
            out.add_(d - o, alpha=share)
        if fraction < 1.0:
            rest.append(CarriedChange(changes[i].sender, changes[i].round_id, (1.0 - fraction) * changes[i].weight,
                                      changes[i].tensors))
    return contribution, total, refused, rest


class ChangeSender:
    """Follower side: each round's change goes to one carrier in the background. What a send does not carry (the
    8-bit rounding, a round skipped while the previous send was still on its way on a slow uplink, a send that
    failed) stays here with its tokens and goes with the next send: nothing the follower trained is dropped."""

    def __init__(self) -> None:
        self.sent = 0
        self._residual: list[torch.Tensor] | None = None
        self._weight = 0.0
        self._inflight = None  # concurrent.futures.Future of the running send
        self._lock = threading.Lock()

    def busy(self) -> bool:
        return self._inflight is not None and not self._inflight.done()

    def holds(self) -> bool:
        """Whether something is kept for the next send."""
        with self._lock:
            return self._residual is not None

    def take(self, delta: list[torch.Tensor], weight: float) -> tuple[list[torch.Tensor], float]:
        """This round's change and tokens plus what earlier sends left behind (now owned by the caller)."""
        with self._lock:
            residual, self._residual = self._residual, None
            held, self._weight = self._weight, 0.0
        total = [d.float().clone() for d in delta] if residual is None else [d.float() + r for d, r in
                                                                            zip(delta, residual)]
        return total, weight + held

    def keep(self, change: list[torch.Tensor], weight: float = 0.0) -> None:
        """Not sent (or not all of it): it waits for the next send."""
        with self._lock:
            self._residual = change if self._residual is None else [a + b for a, b in zip(self._residual, change)]
            self._weight += weight

    def started(self, future, sent: list[torch.Tensor], weight: float) -> None:
        """`future` (-> None or the carrier's reason) carries `sent` (the decoded 8-bit change) and `weight`."""
        self._inflight, started_at = future, time.monotonic()

        def done(f) -> None:
            error = "failed" if f.cancelled() or f.exception() is not None else f.result()
            if error is None:
                self.sent += 1
                logger.debug(f"carried change delivered in {time.monotonic() - started_at:.1f}s")
            else:
                logger.info(f"a carrier did not take this peer's shared change ({error}): it goes with the next one")
                self.keep(sent, weight)
        future.add_done_callback(done)
