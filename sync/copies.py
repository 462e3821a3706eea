"""Expert copies passed on by the peers that hold them (docs/DESIGN.md, "Copies passed on").

A peer whose uplink is slow would otherwise send its bf16 expert copies once per requester every round (three
requesters: three times the bytes through a 5 Mbit/s uplink). Instead it serves each (expert, round) copy to the
first requester that may pass it on and answers every later one with a redirect to a peer that already holds the
copy, or is receiving it. The bf16 bytes are the same on every holder, so the redirect carries the owner's digest
of them and the requester checks what the holder sends against it: a holder can only waste a requester's time,
never change a value. A requester that comes back to the owner without leave to redirect (its holder failed it)
is served directly, and that holder is not named again for the entry.

- `digest_serialized` / `digest_parts`: the owner's digest of its serialized tensors, and the same digest over
  the streamed parts a fetcher received (header fields of each tensor, then its bytes);
- `PassOn`: the owner's bookkeeping for one published entry (who holds it with leave, whom it sent where);
- `HeldCopies`: the holder's side, the copies it fetched with leave to pass on, kept as the parts that arrived
  (not re-serialized) for the newest `keep_rounds` rounds per expert.

Everything here runs on the exchange's event loop thread (sync/transfer.py), so nothing is locked.
"""
from __future__ import annotations

import asyncio
import hashlib
import struct

from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

DIGEST_BYTES = 32
# How long a holder's handler waits for a copy it is still receiving before it says "missing" (the requester's
# own fetch timeout usually ends the wait first).
HOLD_WAIT_S = 60.0


def _header(h: "hashlib._Hash", name: str, dtype: str, compression: int, size: list[int], nbytes: int) -> None:
    # Length-prefixed fields: no two different tensors share a byte sequence up to their payloads.
    for field in (name.encode(), dtype.encode()):
        h.update(struct.pack("<I", len(field)) + field)
    h.update(struct.pack(f"<iI{len(size)}qQ", compression, len(size), *size, nbytes))


def digest_serialized(names: list[str], tensors: list[runtime_pb2.Tensor]) -> bytes:
    """SHA-256 over the serialized tensors an owner serves (the same value as `digest_parts` of their stream)."""
    h = hashlib.sha256()
    for name, tensor in zip(names, tensors, strict=True):
        _header(h, name, tensor.dtype, tensor.compression, list(tensor.size), len(tensor.buffer))
        h.update(tensor.buffer)
    return h.digest()


def digest_parts(names: list[str], groups: list[list[runtime_pb2.Tensor]]) -> bytes:
    """SHA-256 over received streamed parts, one group per tensor (the header fields ride on each first part)."""
    h = hashlib.sha256()
    for name, group in zip(names, groups, strict=True):
        head = group[0]
        _header(h, name, head.dtype, head.compression, list(head.size), sum(len(p.buffer) for p in group))
        for part in group:
            h.update(part.buffer)
    return h.digest()


class PassOn:
    """Owner side, for one published (expert, round): the peers given its bf16 copy with leave to pass it on, in
    the order they asked, and which holder each redirected requester was sent to."""

    def __init__(self) -> None:
        self.holders: list[PeerID] = []
        self.sent_to: dict[PeerID, PeerID] = {}

    def target(self, requester: PeerID, may_redirect: bool) -> PeerID | None:
        """The holder to send `requester` to, or None: serve it directly."""
        failed = self.sent_to.pop(requester, None)
        if failed is not None and not may_redirect:
            # It came back without leave: the holder we named did not deliver (gone, slow, or lying).
            self.holders = [h for h in self.holders if h != failed]
        if not may_redirect:
            return None
        # The earliest holder first: it has the most of the copy, or all of it.
        target = next((h for h in self.holders if h != requester), None)
        if target is not None:
            self.sent_to[requester] = target
        return target

    def serving(self, requester: PeerID) -> None:
        if requester not in self.holders:
            self.holders.append(requester)

    def failed(self, requester: PeerID) -> None:
        """The stream to `requester` ended before the whole copy went out: it holds nothing to pass on."""
        self.holders = [h for h in self.holders if h != requester]


class HeldCopy:
    """A copy this peer fetches (or fetched) from its owner: `announced` once the owner's first message said it
    may be passed on (round, names, digest known), `done` once complete (`ok`) or given up."""

    def __init__(self, expert: int) -> None:
        self.expert = expert
        self.round: int | None = None
        self.names: list[str] = []
        self.digest = b""
        self.groups: list[list[runtime_pb2.Tensor]] = []
        self.ok = False
        self.announced, self.done = asyncio.Event(), asyncio.Event()


class HeldCopies:
    """Holder side: copies fetched with the owner's leave to pass them on, served to the requesters it sends."""

    def __init__(self, keep_rounds: int) -> None:
        self.keep_rounds = keep_rounds
        self._by_expert: dict[int, list[HeldCopy]] = {}

    def start(self, expert: int) -> HeldCopy:
        """A fetch that may be given leave begins: requesters sent here before its first message wait for it."""
        held = HeldCopy(expert)
        self._by_expert.setdefault(expert, []).append(held)
        return held

    def announce(self, held: HeldCopy, meta: dict) -> None:
        """The owner's first message arrived: keep the copy if it gives leave (and a digest), else forget it."""
        if meta.get("relay") is True and isinstance(meta.get("digest"), bytes):
            held.round, held.names, held.digest = meta["round"], list(meta["names"]), meta["digest"]
            held.announced.set()
        else:
            self.drop(held)

    def complete(self, held: HeldCopy, groups: list[list[runtime_pb2.Tensor]]) -> None:
        """Every part arrived and matched the digest: serve it; keep the newest keep_rounds rounds per expert."""
        held.groups, held.ok = groups, True
        held.announced.set()
        held.done.set()
        copies = self._by_expert.get(held.expert, [])
        rounds = sorted({c.round for c in copies if c.ok})
        stale = set(rounds[:-self.keep_rounds])
        for old in [c for c in copies if c.ok and c.round in stale]:
            copies.remove(old)

    def drop(self, held: HeldCopy) -> None:
        """The fetch ended without a copy to pass on (no leave, error, cut short); no-op once complete."""
        if held.ok:
            return
        held.announced.set()
        held.done.set()
        copies = self._by_expert.get(held.expert, [])
        if held in copies:
            copies.remove(held)

    async def find(self, expert: int, round_id: int, wait_s: float = HOLD_WAIT_S) -> HeldCopy | None:
        """The complete copy of `expert@round_id` this peer holds, waiting up to `wait_s` for one on its way."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        for held in list(self._by_expert.get(expert, [])):
            for event in (held.announced, held.done):
                if held.round not in (None, round_id):
                    break
                try:
                    await asyncio.wait_for(event.wait(), max(deadline - loop.time(), 0.0))
                except asyncio.TimeoutError:
                    return None
            if held.ok and held.round == round_id:
                return held
        return None

    def count(self) -> int:
        """Copies held complete (for tests and logs)."""
        return sum(c.ok for copies in self._by_expert.values() for c in copies)
