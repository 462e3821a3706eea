"""Fetching from other peers: owners' copies of experts in a round, and the swarm's state when joining (docs/DESIGN.md,
"Hostile peers").

`ExpertFetching` is a part of `sync.rounds.SparseSync`, kept in its own file: it uses the round's state
(`round_id`, `cfg`, `exchange`, `model`, `rejects`, the last synchronized experts `_expert_synced` and their
staleness `_stale`) and owns the owners' strike counts and running fetches. For each wanted expert every live
owner's copy for this round is fetched at once (one stream per owner and expert, `sync.transfer.ExpertExchange`),
each copy checked (shape, finiteness, norm, change in proportion to an honest round's) and 3+ copies combined
robustly. A fetch still running at the round's deadline stays in flight and is never asked again; its copy is
used in the round during which it arrives (late copies: one slow uplink must not hold every round up), and an
owner whose last copy took longer than a round's deadline is not waited for until one of its copies is quick. An owner
that let a fetch time out is skipped for 2, 4, 8.. rounds and then asked with a short timeout; its strikes are
forgotten when its record expires, so a peer whose link came back is asked like anyone else.
"""
from __future__ import annotations

import concurrent.futures
import math
import random
import threading
import time
from typing import Callable

import torch
from hivemind.p2p import PeerID
from hivemind.utils.logging import get_logger

from sync.robust import robust_mean
from sync.swarm import PeerRecord, median_round
from sync.validate import validate_tensors

logger = get_logger(__name__)

Snapshot = dict[str, torch.Tensor]
# Twice the relative rounding error bound of a dtype a frozen expert copy may be stored in.
_ROUNDING = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -10}


# Bytes per value of an expert copy on the wire, per sync.compression (8-bit: 1 byte + a small codebook).
_WIRE_BYTES = {"none": 4, "fp16": 2, "8bit": 1}
# How many times this peer's own pace a copy's owner may claim to have trained at (`_change_ok`).
OWNER_PACE_CAP = 10


class _Fetch:
    """One running fetch of an expert copy from one owner."""

    def __init__(self, future: concurrent.futures.Future, timeout: float, started: float, round_id: int) -> None:
        self.future, self.timeout, self.started, self.round_id = future, timeout, started, round_id
        self.finished: float | None = None
        self.late = False  # still running when a later round asked again (a slow owner's uplink)

    def done_at(self) -> None:
        self.finished = time.monotonic()

    def elapsed(self) -> float:
        return (self.finished if self.finished is not None else time.monotonic()) - self.started


def _resolve(future: concurrent.futures.Future, fn: Callable[[], object]) -> None:
    """Run `fn` (in its own thread) into `future`."""
    try:
        future.set_result(fn())
    except BaseException as e:  # handed to whoever waits for the future
        future.set_exception(e)


class CopiesDuring:
    """A round's expert copies asked once its all-reduce group formed (sync.copies_during_allreduce): the owners
    asked, the copies checked so far, and the records read started alongside (a future of `swarm.peers()`)."""

    def __init__(self) -> None:
        self.owners: dict[int, list[str]] = {}
        self.received: dict[int, list[tuple[int, Snapshot]]] = {}
        self.records: concurrent.futures.Future | None = None


class ExpertFetching:
    """Mixin of SparseSync: fetch, validate and aggregate the owners' copies of experts; download the swarm's
    state (shared tensors from up to 3 verified sources, experts from their owners) when joining or behind."""

    def _download_state(self, others: dict[str, PeerRecord]) -> None:
        # The median, never the max: a record claiming round 1e9 neither moves this counter nor is asked for
        # the state (sources are peers whose round is within one of the median). Never backwards.
        swarm_round = median_round(others.values())
        self.round_id = max(self.round_id, swarm_round)
        sources = [p for p, r in others.items() if abs(r.round - swarm_round) <= 1]
        random.shuffle(sources)
        copies = self._download_shared(sources, want=3)
        if self.shared.load_state(copies):
            logger.info(f"downloaded the shared tensors of round {self.round_id} from {len(copies)} peer(s)")
        else:
            logger.warning("no peer served valid shared tensors: keeping the local ones")
        means = self._fetch_means(others, set(range(self.model.cfg.num_experts)), own_snapshots={})
        for expert, mean in means.items():
            self.model.load_expert_tensors(expert, mean)
        # Contributions: an owned expert no other peer served keeps its synchronized reference (restored from the
        # checkpoint, or this peer's own): only its owner knows how far its live value is ahead of the others'.
        keep = frozenset(self.model.owned_experts) - set(means) if getattr(self, "contributing", False) else frozenset()
        self._reset_expert_references(keep)

    def _take_over_moments(self, experts: list[int], others: dict[str, PeerRecord]) -> None:
        """Handoff (docs/DESIGN.md, "Coverage"): the AdamW moments of experts this peer takes over, from a peer
        that trains them now (its caretaker first, else a co-owner), so the new owner does not restart them from
        zero. Checked here for names, shapes and finiteness; the optimizer's own invariant is checked where they
        are loaded (peer/optim.py). Kept in `handed_over` for the training loop."""
        timeout = min(self.cfg.round_timeout, 30.0)
        for expert in experts:
            holders = [p for p, r in others.items() if expert in r.experts]
            random.shuffle(holders)
            holders.sort(key=lambda p: expert not in others[p].caretaking)
            for peer_id in holders[:2]:  # a second source if the first has none or sends garbage
                tensors = self.exchange.fetch_moments(PeerID.from_base58(peer_id), expert, timeout)
                if tensors is None:
                    continue
                reason = self._moments_problem(expert, tensors)
                if reason is None:
                    self.handed_over[expert] = self._per_tensor_steps(expert, tensors)
                    break
                self.rejects.add(reason)
                logger.warning(f"refused the optimizer moments of expert {expert} from peer ...{peer_id[-6:]}: "
                               f"{reason}")

    def _moments_problem(self, expert: int, tensors: dict[str, torch.Tensor]) -> str | None:
        """Why a received set of moments is unusable (a REJECT_REASONS entry), or None. A step count per tensor
        (`{name}.step`, peer/optim.py) or, from owners of earlier builds, one `step` for all of them."""
        live = self.model.expert_tensors(expert)
        moments = {f"{n}.{k}" for n in live for k in ("exp_avg", "exp_avg_sq")}
        if set(tensors) not in (moments | {f"{n}.step" for n in live}, moments | {"step"}):
            return "malformed"
        steps = [t for k, t in tensors.items() if k == "step" or k.endswith(".step")]
        if any(t.numel() != 1 for t in steps) or any(tensors[f"{n}.{k}"].shape != t.shape for n, t in live.items()
                                                     for k in ("exp_avg", "exp_avg_sq")):
            return "shape"
        if not all(t.is_floating_point() and bool(torch.isfinite(t).all()) for t in tensors.values()):
            return "nonfinite"
        return None

    def _per_tensor_steps(self, expert: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checked moments in the per-tensor form the optimizer loads (an earlier build's one `step` for all)."""
        if "step" not in tensors:
            return tensors
        out = {k: t for k, t in tensors.items() if k != "step"}
        out.update({f"{n}.step": tensors["step"] for n in self.model.expert_tensors(expert)})
        return out

    def _download_shared(self, sources: list[str], want: int) -> list[list[torch.Tensor]]:
        """Shared-state copies from up to `want` of `sources` (fetched concurrently, more tried if some fail)."""
        timeout = min(self.cfg.round_timeout, 30.0)
        if getattr(self, "contributing", False):
            return self._download_synced_shared(sources, want, timeout)
        prefix = self.shared.averager.prefix
        copies: list[list[torch.Tensor]] = []
        with concurrent.futures.ThreadPoolExecutor(max(1, want)) as pool:
            for start in range(0, len(sources), want):
                batch = sources[start:start + want - len(copies)]
                results = pool.map(lambda p: self.exchange.download_state(PeerID.from_base58(p), prefix, timeout),
                                   batch)
                copies.extend(r for r in results if r is not None)
                if len(copies) >= want:
                    break
        return copies

    def _download_synced_shared(self, sources: list[str], want: int, timeout: float) -> list[list[torch.Tensor]]:
        """Contributions (sync/contributions.py): the synchronized shared values each source published with its
        latest apply, exact, from up to `want` sources at once (more tried if some fail); names must match."""
        names = [n for n, _ in self.model.shared_parameters()]
        copies: list[list[torch.Tensor]] = []
        for start in range(0, len(sources), want):
            batch = sources[start:start + want - len(copies)]
            futures = [self.exchange.fetch_shared_async(PeerID.from_base58(p), self.round_id, 0, timeout, bf16=False)
                       for p in batch]
            for future in futures:
                try:
                    fetched = future.result(timeout=timeout + 5.0)
                except Exception:
                    fetched = None
                if fetched is None:
                    continue
                if sorted(fetched) != sorted(names):
                    self.rejects.add("malformed")
                    continue
                copies.append([fetched[n] for n in names])
            if len(copies) >= want:
                break
        return copies

    def _forget_strikes_of_gone(self, records: dict[str, PeerRecord]) -> None:
        for peer_id in [p for p in self._strikes if p not in records]:
            # Its record expired (it left, or its link was down): if it comes back it is asked like anyone else.
            self._strikes.pop(peer_id, None)
            self._retry_at.pop(peer_id, None)
        for peer_id in [p for p in self._owner_seconds if p not in records]:
            del self._owner_seconds[peer_id]

    def _fetch_means(self, others: dict[str, PeerRecord], want: set[int], own_snapshots: dict[int, Snapshot],
                     rel_change: float | None = None) -> dict[int, Snapshot]:
        """Fetch and aggregate now (blocking, joining or behind): the owners' copies of each wanted expert that
        other peers own, validated; an expert whose every remote copy is missing or refused is left out."""
        # A download (joining, or behind) may be tried again within one round: every owner is asked anew.
        self._asked = {key: r for key, r in self._asked.items() if r != self.round_id}
        owners = self._start_fetches(others, want)
        longest = max((f.timeout for key, f in self._inflight.items() if key[0] in owners), default=0.0)
        return self._collect_means(owners, own_snapshots, rel_change, deadline=time.monotonic() + longest + 5)

    def _copies_while_reducing(self, others: dict[str, PeerRecord], want: set[int], own: dict[int, Snapshot],
                               rel_change: float | None, during: CopiesDuring) -> Callable[[bool], None]:
        """SharedAverager.all_reduce's `on_grouped`: once the group formed, ask for the copies and start the
        records read in the background; then, every poll, check the copies that arrived. With both transfers on
        the link at once the bytes go through at ≈ 1.2x link time, but checking the copies and reading the
        records after the all-reduce left every link idle for 0.5-1.9 s more (bench/README.md, issue 13
        session 14)."""
        def on_grouped(first: bool) -> None:
            if first:
                during.owners = self._start_fetches(others, want)
                during.records = concurrent.futures.Future()
                threading.Thread(target=_resolve, args=(during.records, self.swarm.peers), daemon=True,
                                 name="spes-records-read").start()
            self._check_arrived(during.owners, own, rel_change, during.received)
        return on_grouped

    def _start_fetches(self, others: dict[str, PeerRecord], want: set[int]) -> dict[int, list[str]]:
        """Ask every live owner of each wanted expert for its copy of this round (one stream per owner and
        expert), unless a fetch of that expert from that owner is still running (a slow owner's transfer of an
        earlier round: its copy is used when it arrives, never asked twice). An owner one round behind may serve
        its previous round's copy. Returns the owners asked per expert."""
        owners: dict[int, list[str]] = {}
        for record in others.values():
            for expert in record.experts:
                # An owner that let a fetch time out is skipped for 2, 4, 8.. rounds, then retried with a short
                # timeout: a claimed owner that never serves costs one timeout, not one per round.
                if expert not in want or self._retry_at.get(record.peer_id, 0) > self.round_id:
                    continue
                owners.setdefault(expert, []).append(record.peer_id)
                key = (expert, record.peer_id)
                if self._asked.get(key) == self.round_id:
                    continue  # asked already this round (its copy may have arrived and been checked: not twice)
                if key in self._inflight:
                    if self._inflight[key].round_id < self.round_id:
                        self._inflight[key].late = True  # from an earlier round: used if done, not waited for
                    continue
                timeout = self._fetch_timeout(record.peer_id)
                # An owner that is behind serves the newest round it has; one round of staleness is expected.
                future = self.exchange.fetch_async(PeerID.from_base58(record.peer_id), expert, self.round_id,
                                                   timeout=timeout, min_round=min(self.round_id, record.round),
                                                   bf16=self._stored_in_bf16(expert))
                fetch = _Fetch(future, timeout, time.monotonic(), self.round_id)
                future.add_done_callback(lambda f, fetch=fetch: fetch.done_at())
                self._inflight[key], self._asked[key] = fetch, self.round_id
        return owners

    def _stored_in_bf16(self, expert: int) -> bool:
        """Whether this peer keeps `expert` in bfloat16 (a frozen copy, model.frozen_expert_dtype's default): then
        an fp32 copy would cost twice the bytes for precision rounded away on arrival. An owned (trainable)
        expert is kept in fp32, and a co-owner's copy is averaged into it: asked at full precision."""
        tensors = self.model.expert_tensors(expert)
        return bool(tensors) and all(t.dtype == torch.bfloat16 for t in tensors.values())

    def _collect_means(self, owners: dict[int, list[str]], own_snapshots: dict[int, Snapshot],
                       rel_change: float | None, deadline: float,
                       checked: dict[int, list[tuple[int, Snapshot]]] | None = None) -> dict[int, Snapshot]:
        """Wait until `deadline` for the fetches of `owners`, then aggregate every finished copy (late ones of
        earlier rounds included) per expert; fetches still running stay in flight for a later round.

        `rel_change` (this peer's own relative change this round; None when joining, where there is no
        synchronized value to compare with): a copy whose change from the last synchronized value exceeds
        sync.max_delta_ratio x that (x rounds since the expert last synchronized) is refused as "delta".
        `checked`: copies already checked during the all-reduce (CopiesDuring.received), of experts still wanted."""
        # An owner whose last copy took longer than this round has left is not waited for at all (its fetch runs
        # on and is used when it arrives): a 5 Mbit/s uplink otherwise cost every fast peer the whole deadline in
        # every round that asked it anew. Its next quick copy makes it waited for again.
        left = deadline - time.monotonic()
        seconds = self._owner_seconds
        waiting = [self._inflight[(e, p)].future for e, peers in owners.items() for p in peers
                   if (e, p) in self._inflight and not self._inflight[(e, p)].late and seconds.get(p, 0.0) <= left]
        received = {e: copies for e, copies in (checked or {}).items() if e in owners}
        # Each copy is checked as soon as it arrives, while the others still stream in: checking them all after
        # the last one arrived added 0.1-0.3 s to every round on 2 shared cores.
        while True:
            self._check_arrived(owners, own_snapshots, rel_change, received)
            pending = [f for f in waiting if not f.done()]
            left = deadline - time.monotonic()
            if not pending or left <= 0:
                break
            concurrent.futures.wait(pending, timeout=left, return_when=concurrent.futures.FIRST_COMPLETED)
        self._check_arrived(owners, own_snapshots, rel_change, received)
        means = {}
        for expert, copies in received.items():
            # Only the newest copies count (a slow owner's late copy of an earlier round is used alone only when
            # nothing newer arrived); a co-owner's copy more than one round old is not averaged with this round's.
            newest = max(r for r, _ in copies)
            if expert in own_snapshots and newest < self.round_id - 1:
                continue
            tensors_list = ([own_snapshots[expert]] if expert in own_snapshots else []) + [t for r, t in copies
                                                                                           if r == newest]
            names = list(tensors_list[-1])
            if len(tensors_list) == 1:
                # One owner's copy is the value: stored as it came (bf16 into bf16), without a float32 stack and
                # mean of it (3 passes over 56 MB for 12 copies at bench.wan's issue shape, on the round's path).
                means[expert] = tensors_list[0]
            elif len(tensors_list) >= 3:
                means[expert] = robust_mean(tensors_list, self.cfg.clip_factor)
            else:
                means[expert] = {n: torch.stack([c[n].float() for c in tensors_list]).mean(dim=0) for n in names}
        return means

    def _check_arrived(self, owners: dict[int, list[str]], own_snapshots: dict[int, Snapshot],
                       rel_change: float | None, received: dict[int, list[tuple[int, Snapshot]]]) -> None:
        """Take every finished fetch (late ones of earlier rounds included) out of flight, note how its owner
        served, and file each valid copy of a wanted expert under `received` as (round served, tensors)."""
        for key in [k for k, f in self._inflight.items() if f.future.done()]:
            expert, peer_id = key
            fetch = self._inflight.pop(key)
            copy = fetch.future.result() if not fetch.future.cancelled() and not fetch.future.exception() else None
            self._note_serving(peer_id, copy is not None or fetch.elapsed() < 0.8 * fetch.timeout)
            if copy is not None:
                self._owner_seconds[peer_id] = fetch.elapsed()
            if copy is None or expert not in owners:
                continue  # unavailable, or a late copy of an expert no longer wanted here
            reference = own_snapshots.get(expert) or self.model.expert_tensors(expert)
            synced = self._expert_synced.get(expert) if expert in own_snapshots else self.model.expert_tensors(expert)
            tensors, reason = validate_tensors(copy, reference, max_norm_ratio=self.cfg.max_norm_ratio)
            if tensors is None and reason is not None:
                self.rejects.add(reason)
            elif rel_change is not None and synced is not None and not self._change_ok(expert, tensors, synced,
                                                                                       rel_change, peer_id):
                tensors, reason = None, "delta"
                self.rejects.add(reason)
            if tensors is None:
                logger.warning(f"refused expert {expert} from peer ...{peer_id[-6:]}: {reason}")
                continue
            if peer_id in self._owner_steps:
                self._taking[(expert, peer_id)] = self._owner_steps[peer_id]
            received.setdefault(expert, []).append((getattr(copy, "round", self.round_id), tensors))

    def _expert_grace(self, owners: dict[int, list[str]], own: dict[int, Snapshot]) -> float:
        """Seconds to wait for this round's expert copies: twice what their bytes take at the rate this peer's
        all-reduce just achieved, plus 1 s (2 s at least, round_timeout at most). A copy still on its way then
        (a slow owner's uplink) is used in a later round when it arrives, instead of holding this round, and
        every peer waiting for this one, up to the slowest link (sync/fetch.py, late copies)."""
        timing = self.shared.last_timing
        rate = timing.get("received bytes", 0) / max(timing.get("all-reduce", 0.0), 1e-3)
        if rate <= 0:
            return self.cfg.round_timeout
        numel = sum(t.numel() for t in self.model.expert_tensors(0).values())
        wire = {e: numel * min(_WIRE_BYTES[self.cfg.compression], 2 if self._stored_in_bf16(e) else 4) for e in owners}
        need = sum(wire[e] for e, peers in owners.items() if e not in own for p in peers
                   if (e, p) in self._inflight and not self._inflight[(e, p)].late)
        return min(self.cfg.round_timeout, max(2.0, 2.0 * need / rate + 1.0))

    def _owner_rounds(self, expert: int, peer_id: str) -> float | None:
        """Rounds' worth of steps (sync.every each) the owner's signed record says it trained since its copy of
        `expert` was last taken here; None if either step is unknown (its first copy, an owner of a new record)."""
        now, then = self._owner_steps.get(peer_id), self._taken_at_step.get((expert, peer_id))
        if now is None or then is None or now <= then:
            return None
        return (now - then) / max(self.cfg.every, 1)

    def _change_ok(self, expert: int, tensors: Snapshot, synced: Snapshot, rel_change: float,
                   peer_id: str | None = None) -> bool:
        """Is a copy's change from the expert's last synchronized value in proportion to an honest round's?"""
        change = math.sqrt(sum(float(torch.linalg.vector_norm(tensors[k].float() - synced[k].float())) ** 2
                               for k in synced))
        size = math.sqrt(sum(float(torch.linalg.vector_norm(synced[k].float())) ** 2 for k in synced))
        rounds = 1 + self._stale.get(expert, 0)
        # An owner that trained more steps than this peer did meanwhile (a follower joins no group and trains on
        # while the others wait for theirs: 80 steps to their 10 in a netns test) moved its expert by that many
        # rounds' worth; its record's step says how many. Believed up to OWNER_PACE_CAP times this peer's own
        # rounds, so a record that lies about its steps widens the bound by that much at most.
        owner_rounds = self._owner_rounds(expert, peer_id) if peer_id is not None else None
        if owner_rounds is not None:
            rounds = max(rounds, min(owner_rounds, OWNER_PACE_CAP * rounds))
        # A frozen copy kept in bf16/fp16 differs from the owner's fp32 tensor by its rounding error alone
        # (up to 2^-9 / 2^-11 of each element): early rounds change an expert by about that much, so without
        # this floor every honest copy of round 1 was refused as "delta".
        rounding = max((_ROUNDING.get(t.dtype, 0.0) for t in synced.values()), default=0.0)
        return change <= (self.cfg.max_delta_ratio * rounds * max(rel_change, 1e-4) + rounding) * max(size, 1e-12)

    def _fetch_timeout(self, peer_id: str) -> float:
        if self._strikes.get(peer_id, 0) == 0:
            return self.cfg.round_timeout
        return min(self.cfg.round_timeout, max(2.0, self.cfg.matchmaking_time))

    def _note_serving(self, peer_id: str, served: bool) -> None:
        if served:
            self._strikes.pop(peer_id, None)
            self._retry_at.pop(peer_id, None)
        else:
            strikes = self._strikes[peer_id] = self._strikes.get(peer_id, 0) + 1
            self._retry_at[peer_id] = self.round_id + 2 ** min(strikes, 5)
            if strikes == 1:
                logger.warning(f"peer ...{peer_id[-6:]} claims experts but let a fetch time out: skipped for a "
                               f"few rounds, then retried with a short timeout")
