"""Rounds as signed, compressed contributions (docs/DESIGN.md, "Rounds as contributions"), the SparseSync side.

A round, for each peer, with no group and no reducer:
1. contribute (round thread), if drawn (sync/draw.py: in a run of more than `sync.contributors` peers about that
   many are; one not drawn publishes its round without a contribution and drops its round's training at apply):
   its change since the last synchronized values, per shared tensor and per expert it owns, plus its error
   feedback, compressed (sync/sparse.py; `sync.compression`). What compression left out stays in the error
   feedback for later rounds. The blob is served by this peer's ContributionExchange and its round, size, sha256
   and weight are announced in its signed DHT record (`contrib`);
2. gather (sync/gather.py): it waits (at most `matchmaking_time`) until every live peer that may be drawn
   announced this round or reached it without a contribution, then fetches every announced blob (from its
   origin, or from a peer that already holds it: the digest from the signed record makes a passed-on blob as good
   as the origin's), until a deadline derived from the blobs' sizes and the measured download rate (at most
   `round_timeout`); a blob not in by then is left out of this round;
3. aggregate (sync/aggregate.py): every contribution decoded strictly against the names and shapes this peer
   holds, the shared tensors' robust mean over all contributors (each clipped to the median norm, weights capped
   at one round's tokens), each expert's over its owners (a single owner's change bounded by the relative change
   of this peer's own round);
4. apply (training thread): new synchronized values = last synchronized + outer(aggregate) — bit-identical on
   every peer that aggregated the same contributions — and the live model moves by (new synchronized -
   snapshot), keeping what it trained during the round. Experts' synchronized values are held in their storage
   dtype (bf16 by default) on every peer, owners included, so owners and non-owners agree bit for bit. A digest
   of all synchronized tensors goes into the record (`synced`); a peer whose digest differs from the others' for
   the same round counts it (`divergent_rounds`).

Blob tensor names: "s/{shared parameter name}" and "e{expert}/{expert tensor name}".
"""
from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import torch
from hivemind.utils.logging import get_logger

from sync.codec import SHARED_KEY
from sync.aggregate import Announcement, aggregate, change_within, norm64
from sync.contrib_exchange import ContributionExchange
from sync.delta import apply_rebased_
from sync.draw import Drawing
from sync.gather import Gathering
from sync.records import MAX_BLOB_BYTES
from sync.repair import Repair
from sync.sourcelog import SourceLog
from sync.sparse import CodecError, SparseSpec, blob_digest, decode, encode

if TYPE_CHECKING:
    from sync.peer_record import PeerRecord
    from sync.report import RoundReport

logger = get_logger(__name__)

Snapshot = dict[str, torch.Tensor]
METHOD_OF = {"none": "fp32", "fp16": "fp16", "8bit": "8bit", "sparse": "sparse"}


class Contributions(Repair, Gathering, Drawing):
    """Mixin of SparseSync (sync/rounds.py): the contribution round. Uses `model`, `swarm`, `cfg`, `shared`
    (sync/shared_tensors.py: `params`, `snapshot`, `synced`, `momentum`), `exchange`, `_expert_synced`,
    `rejects`, `max_weight`, `gate`, `round_id`."""

    def _init_contributions(self) -> None:
        self._init_repair()
        self._init_drawing()
        self.exchange.synced_provider = self._serve_synced
        sp = self.cfg.sparse
        self._spec = SparseSpec(method=METHOD_OF[self.cfg.compression], chunk=sp.chunk, topk=sp.topk, bits=sp.bits)
        self.contrib_exchange = ContributionExchange(self.swarm.dht, namespace=self.swarm.run_id, gate=self.gate,
                                                     max_blob_bytes=MAX_BLOB_BYTES)
        self._shared_names = [f"s/{name}" for name, _ in self.model.shared_parameters()]
        self._ef: dict[str, torch.Tensor] = {}  # error feedback per blob tensor name (fp32, CPU)
        self._own_blob: tuple[int, str, dict[str, torch.Tensor]] | None = None  # (round, digest, decoded)
        self._shared_result: dict[str, torch.Tensor] | None = None  # the round's shared aggregate, for apply
        self._download_rate: float | None = None  # bytes/s measured over the last round's fetches
        self.synced_digest = ""
        # Peers that failed to contribute (no announcement in time, no blob, an undecodable one): strikes in a
        # row, and the round until which they are neither waited for nor asked (sync.aggregate.rounds_to_skip).
        self._misses: dict[str, int] = {}
        self._skip_until: dict[str, int] = {}
        self._delivered_ever: set[str] = set()
        self._discounted: set[str] = set()  # peers already logged as claimants without deeds
        self._source_log = SourceLog()  # one line per misbehaving peer per minute (the counters count every time)
        self.unserved_claims = 0  # live records claiming experts, not owners by deeds (spes_unserved_claims)
        # peer -> (the last round it was behind and silent in, its record's round then)
        self._silent_behind: dict[str, tuple[int, int]] = {}
        self._kept: dict[str, torch.Tensor] = {}  # the last contribution's unsent part (sync.sparse.keep_residual)
        self._solo: set[int] = set()  # owned experts only this peer contributed to in the last round
        self._received = {"shared": 0.0, "expert": 0.0}  # blob bytes fetched, split by their tensors' make-up
        self._expert_share = 0.0
        # A contribution's deltas are measured from canonical values: experts as stored on non-owners.
        self._reset_expert_references()
        self._serve_synced_state()

    # ---- canonical synchronized values -----------------------------------------------------------------------

    def _canonical(self, tensor: torch.Tensor) -> torch.Tensor:
        """A synchronized expert tensor as every peer holds it: rounded to the frozen-expert storage dtype."""
        return tensor.detach().to("cpu", self.model.frozen_dtype).float().clone()  # never an alias of a live tensor

    def _synced_expert(self, expert: int) -> Snapshot:
        """The synchronized value of any expert: an owner's reference, or a non-owner's frozen storage."""
        if expert in self._expert_synced:
            return self._expert_synced[expert]
        return {k: v.detach().float().cpu() for k, v in self.model.expert_tensors(expert).items()}

    def _digest_synced(self) -> str:
        """sha256 (first 32 hex digits) of every synchronized tensor (sync/repair.py `_digest_of`)."""
        return self._digest_of(self.shared.synced,
                               {e: self._synced_expert(e) for e in range(self.model.cfg.num_experts)})

    def _serve_synced_state(self) -> None:
        """Joiners (and a repairing peer) download the synchronized shared values from the expert exchange
        (sync/fetch.py `_download_shared`), exact (fp32), labelled with the round they are of."""
        names = [n for n, _ in self.model.shared_parameters()]
        self.exchange.publish(self.round_id, SHARED_KEY, dict(zip(names, self.shared.synced)), codec="none")

    # ---- 1. contribute ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def _contribute(self, own: dict[int, Snapshot], weight: int) -> tuple[int, str, int]:
        """Build, keep and serve this round's blob (round thread). Returns (size, digest, expert bytes)."""
        decay = self.cfg.sparse.ef_decay
        deltas: dict[str, torch.Tensor] = {}
        for name, snap, ref in zip(self._shared_names, self.shared.snapshot, self.shared.synced):
            deltas[name] = snap - ref
        solo = set()
        for expert, snapshot in sorted(own.items()):
            ref = self._expert_synced[expert]
            if not self._co_owned(expert):
                solo.add(expert)
            for k in sorted(ref):
                deltas[f"e{expert}/{k}"] = snapshot[k].float() - ref[k]
        keep = self.cfg.sparse.keep_residual
        for name, delta in deltas.items():
            ef = self._ef.get(name)
            if ef is not None and ef.shape == delta.shape:
                delta.add_(ef.mul(decay))
        blob, decoded = encode(deltas, self._spec)
        # What did not go out is sent later (error feedback); the residual of an expert no longer owned is dropped.
        # An expert nobody else owns needs none: its owner keeps training its own values (_live_updates), so the
        # part not sent yet stays in (live - synchronized) and goes out in later rounds by itself.
        unsent = {name: deltas[name].sub_(decoded[name]) for name in deltas}
        # sync.sparse.keep_residual: what was not sent stays in the live model (_apply_contributions,
        # _live_updates) instead of in a separate error feedback; kept for a sole owner's experts too, for the
        # rounds this peer is not drawn in (sync/draw.py: then its live model goes back to synchronized + this).
        self._ef = {} if keep else {name: v for name, v in unsent.items()
                                    if not (name.startswith("e") and int(name[1:name.index("/")]) in solo)}
        self._kept = unsent if keep else {}
        digest = blob_digest(blob)
        self._own_blob = (self.round_id, digest, decoded)
        self.contrib_exchange.publish(self.round_id, blob, digest)
        expert_elems = sum(d.numel() for n, d in deltas.items() if not n.startswith("s/"))
        total_elems = max(1, sum(d.numel() for d in deltas.values()))
        return len(blob), digest, int(len(blob) * expert_elems / total_elems)

    # ---- 2. + 3. gather and aggregate (round thread) --------------------------------------------------------

    def _contribution_round(self, report: "RoundReport", own: dict[int, Snapshot], weight: int, step: int,
                            tokens: int, rel_change: float, others_at_start: dict[str, "PeerRecord"] | None = None,
                            ) -> tuple[dict[str, "PeerRecord"], dict[int, Snapshot]]:
        """The network part of a contribution round. Returns (records read, {expert: new synchronized value});
        the records are {} when the read was incomplete (SparseSync._checked_read: no ownership change)."""
        started = time.perf_counter()
        drawn = report.contributed = self._decide_draw(others_at_start if others_at_start is not None
                                                       else self._others())
        announcement: dict = {}
        if drawn:
            size, digest, expert_bytes = self._contribute(own, weight)
            self._expert_share = expert_bytes / max(size, 1)  # splits the served bytes by kind (contribution_bytes)
            newest = self.swarm.record.contrib  # announced on as `prev`: a peer still gathering that round finds it
            announcement = {"contrib": [self.round_id, size, digest, int(weight), sorted(own)],
                            "prev": list(newest) if newest and newest[0] < self.round_id else []}
        else:  # its record at this round without a contribution to it says so: nobody waits for it (sync/draw.py)
            self._own_blob, digest = None, ""
        self.swarm.publish(wait=False, experts=sorted(own), round=self.round_id, step=step, tokens=tokens,
                           **announcement)
        report.timing["contribute"] = time.perf_counter() - started
        # Waiting, all of it, is bounded: announcements within round_timeout, blobs by matchmaking_time more.
        ends = time.monotonic() + self.cfg.round_timeout + self.cfg.matchmaking_time
        waiting = time.perf_counter()
        records, announced = self._await_announcements(report)
        report.timing["wait"] = time.perf_counter() - waiting
        self._check_divergence(self._others(records))  # sync/repair.py: before aggregating onto the references
        gathering = time.perf_counter()
        blobs = self._fetch_blobs(announced, ends)
        report.timing["gather"] = time.perf_counter() - gathering
        aggregating = time.perf_counter()
        decoded = {self.swarm.peer_id: self._own_blob[2]} if drawn else {}
        weights = {self.swarm.peer_id: float(weight)} if drawn else {}
        for peer_id, blob in blobs.items():
            ann = announced[peer_id]
            shapes = self._expected_shapes(ann.experts)
            elems = {n: math.prod(s) for n, s in shapes.items()}
            expert_part = sum(v for n, v in elems.items() if not n.startswith("s/")) / max(1, sum(elems.values()))
            self._received["expert"] += len(blob) * expert_part
            self._received["shared"] += len(blob) * (1 - expert_part)
            try:
                decoded[peer_id] = decode(blob, shapes, max_bytes=ann.size)
                weights[peer_id] = float(ann.weight)
                if ann.weight > self.max_weight * 1.01:  # counted as one round's worth (sync.aggregate.capped_weights)
                    self.rejects.add("weight")
                self._delivered(peer_id)
            except CodecError as e:
                self.rejects.add("malformed")
                if self._source_log.allow(peer_id):
                    logger.warning(f"refused the contribution of peer ...{peer_id[-6:]} to round {self.round_id}: {e}")
                self._missed(peer_id, "sent an undecodable contribution")
        report.group_size = len(decoded)
        report.expected = len(announced) + int(drawn)
        report.base_digest = self._base_digest
        report.blobs = sorted([digest] * drawn + [announced[p].digest for p in decoded if p != self.swarm.peer_id])
        self._shared_result = self._aggregate_shared(decoded, weights)
        # A single owner's expert change is judged against how much an honest round changes things: the
        # contributors' median relative change (each one's largest over its shared tensors and experts), the same
        # number on every peer that got the same contributions (this peer's own round would make peers decide
        # differently, and their synchronized tensors differ); one liar among three or more cannot move it.
        experts_of = {p: a.experts for p, a in announced.items()}
        experts_of[self.swarm.peer_id] = tuple(sorted(own)) if drawn else ()
        # The references' norms once per round, not once per contributor (a full pass over the model each).
        ref_norms = {e: max(norm64(self._repaired_expert(e).values()), 1e-12)
                     for e in sorted({e for p in decoded for e in experts_of.get(p, ())})}
        shared_norm = max(norm64(self.shared.synced), 1e-12)
        rel = sorted(self._relative_change_of(d, experts_of.get(p, ()), shared_norm, ref_norms)
                     for p, d in decoded.items())
        means = self._aggregate_experts(decoded, weights, announced, own, rel[len(rel) // 2] if rel else 0.0)
        report.timing["aggregate"] = time.perf_counter() - aggregating
        records, others = self._checked_read(report, records, others_at_start)
        owned_elsewhere = {e for r in others.values() for e in r.experts} - set(own)
        report.experts_synced = sorted(set(means))
        report.experts_missing = sorted(owned_elsewhere - set(means))
        for expert, value in self._repaired_experts.items():  # repaired, though nobody contributed to it
            means.setdefault(expert, value)
        return records, means

    def _co_owned(self, expert: int) -> bool:
        """Another live peer's record (the background reader's view, refreshed at the round's start) owns it."""
        return any(expert in r.experts for r in self.progress.others().values())

    def _live_updates(self, means: dict[int, Snapshot]) -> dict[int, Snapshot]:
        """The experts whose new synchronized value the live model takes: all but those only this peer
        contributed to this round. Their owner keeps its own values (ahead of what the others hold by what
        compression has not sent yet); every other peer holds, and every digest covers, the synchronized value,
        and an owner takes it plus the unsent part of its last contribution."""
        out = {}
        for expert, mean in means.items():
            if expert in self._solo:
                continue
            kept = {k: self._kept.get(f"e{expert}/{k}") for k in mean}
            out[expert] = mean if any(v is None for v in kept.values()) else {k: mean[k] + kept[k] for k in mean}
        return out

    def _relative_change_of(self, delta: Snapshot, experts: tuple[int, ...], shared_norm: float,
                            ref_norms: dict[int, float]) -> float:
        """The largest relative change a contribution makes: over the shared tensors, and over each expert
        (`shared_norm`, `ref_norms`: the synchronized references' norms)."""
        values = [norm64(delta[n] for n in self._shared_names) / shared_norm]
        for expert in experts:
            names = [n for n in delta if n.startswith(f"e{expert}/")]
            values.append(norm64(delta[n] for n in names) / ref_norms[expert])
        return max(values)

    def _expected_shapes(self, experts: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        shapes = {n: tuple(p.shape) for n, (_, p) in zip(self._shared_names, self.model.shared_parameters())}
        for expert in experts:
            for k, t in self.model.expert_tensors(expert).items():
                shapes[f"e{expert}/{k}"] = tuple(t.shape)
        return shapes

    def _aggregate_shared(self, decoded: dict[str, Snapshot], weights: dict[str, float]) -> dict[str, torch.Tensor]:
        order = sorted(decoded)
        if not order:  # nobody drawn delivered (sync/draw.py): the synchronized values stay
            return {}
        mean, scales = aggregate([decoded[p] for p in order], [weights[p] for p in order], self.max_weight,
                                 self._shared_names)
        self._note_left_out(order, scales, "shared tensors")
        return mean

    def _note_left_out(self, order: list[str], scales: list[float], what: str) -> None:
        left_out = [p for p, s in zip(order, scales) if s == 0.0]
        for peer_id in left_out:
            self.rejects.add("direction")
            if self._source_log.allow(peer_id):
                logger.warning(f"left out peer ...{peer_id[-6:]}'s change of the {what} in round {self.round_id}: "
                               f"it points away from the others'")

    def _aggregate_experts(self, decoded: dict[str, Snapshot], weights: dict[str, float],
                           announced: dict[str, Announcement], own: dict[int, Snapshot],
                           rel_change: float) -> dict[int, Snapshot]:
        """Each expert's new synchronized value from its owners' deltas (this peer's own included)."""
        experts_of = {p: set(a.experts) for p, a in announced.items()}
        experts_of[self.swarm.peer_id] = set(own) if self.contributing else set()
        means: dict[int, Snapshot] = {}
        self._solo = set()
        for expert in range(self.model.cfg.num_experts):
            owners = sorted(p for p in decoded if expert in experts_of.get(p, ()))
            if not owners:
                continue
            if owners == [self.swarm.peer_id] and not self._co_owned(expert):
                self._solo.add(expert)
            ref = self._repaired_expert(expert)
            names = sorted(ref)
            blob_names = [f"e{expert}/{k}" for k in names]
            if len(owners) == 1:  # the owner judges its own change too: every peer must decide alike
                delta = decoded[owners[0]]
                ok = change_within(norm64(delta[n] for n in blob_names), norm64(ref.values()), rel_change,
                                   self.cfg.max_delta_ratio)
                if not ok:
                    self.rejects.add("delta")
                    if self._source_log.allow(owners[0]):
                        logger.warning(f"refused expert {expert}'s change from its owner ...{owners[0][-6:]}: "
                                       f"out of proportion to the round's median change")
                    continue
            mean, scales = aggregate([decoded[p] for p in owners], [weights[p] for p in owners], self.max_weight,
                                     blob_names)
            self._note_left_out(owners, scales, f"expert {expert}")
            if not mean:
                continue
            new = {k: self._canonical(ref[k] + mean[b]) for k, b in zip(names, blob_names)}
            if not all(bool(torch.isfinite(t).all()) for t in new.values()):
                self.rejects.add("nonfinite")
                continue
            means[expert] = new
        return means

    # ---- 4. apply (training thread) -------------------------------------------------------------------------

    @torch.no_grad()
    def _apply_contributions(self) -> int:
        """Shared tensors: synced += outer(aggregate); live += new synced - snapshot. Returns refused tensors."""
        self._apply_repair()
        result, self._shared_result = self._shared_result, None
        refused = 0
        keep = self.cfg.sparse.keep_residual
        own = self._own_blob[2] if keep and self.contributing and self._own_blob is not None else None
        if not result and self.contributing:
            return refused
        lr, mu = self.cfg.outer_lr, self.cfg.outer_momentum
        nesterov = self.shared.momentum is not None
        for i, (name, param, snap, synced) in enumerate(zip(self._shared_names, self.shared.params,
                                                             self.shared.snapshot, self.shared.synced)):
            agg = result.get(name) if result else None
            if agg is not None and not bool(torch.isfinite(agg).all()):
                refused += 1
                self.rejects.add("nonfinite")
                continue
            if self.contributing:
                # sync.sparse.keep_residual: the part of its own change not sent yet stays in its live model
                # (then it needs no error feedback: it is in live - synchronized, like a sole owner's expert).
                residual = snap.sub(synced).sub(own[name]) if own is not None else None
            else:  # not drawn (sync/draw.py): its round's training goes, not what its codec has not sent yet
                residual = self._kept.get(name) if keep else None
            if agg is not None and nesterov:  # DiLoCo's outer step on the pseudo-gradient -agg; separate IEEE
                # operations, so every peer computes the same bits (sync/aggregate.py, "Determinism")
                buf = self.shared.momentum[i]
                buf.mul_(mu).sub_(agg)
                synced.add_(agg.sub(buf.mul(mu)).mul(lr))
                self.shared.anchor[i].copy_(synced)
            elif agg is not None:
                synced.add_(agg)
            apply_rebased_(param, synced if residual is None else synced.add(residual), snap)
        return refused

    def _after_contribution_apply(self) -> None:
        """Once experts are applied too: the new digest goes into the record (stored by the heartbeat or the next
        round's publish; round_id is this applied round)."""
        self._serve_synced_state()
        self.synced_digest, self._digest_round = self._digest_synced(), self.round_id
        self.swarm.record.synced = [self.round_id, self.synced_digest]
        # A joiner (or a repairing peer) downloads the experts' synchronized values as of this round.
        for expert, synced in self._expert_synced.items():
            self.exchange.publish(self.round_id, expert, synced)

    def contribution_bytes(self) -> tuple[dict[str, int], dict[str, int]]:
        """(sent, received) payload bytes of contribution blobs so far, by kind ("shared", "expert"): a blob holds
        both, so its bytes are split by the share of expert elements in it (sent: this peer's newest blob's)."""
        sent = self.contrib_exchange.bytes_sent()
        expert = int(sent * self._expert_share)
        return ({"shared": sent - expert, "expert": expert},
                {k: int(v) for k, v in self._received.items()})

    def bytes_sent(self) -> dict[str, int]:
        """Tensor payload bytes (after compression) this peer sent so far, by kind ("shared", "expert"):
        contribution blobs and state served to joiners."""
        blobs = self.contribution_bytes()[0]
        return {kind: self.exchange.bytes_sent.get(kind, 0) + blobs[kind] for kind in ("shared", "expert")}

    def bytes_received(self) -> dict[str, int]:
        """Tensor payload bytes (after compression) this peer received so far, by kind ("shared", "expert")."""
        blobs = self.contribution_bytes()[1]
        return {kind: self.exchange.bytes_received.get(kind, 0) + blobs[kind] for kind in ("shared", "expert")}

    def bytes_on_wire(self) -> dict[str, int]:
        """Tensor payload bytes this peer sent + received so far, by kind ("shared", "expert")."""
        sent, received = self.bytes_sent(), self.bytes_received()
        return {kind: sent[kind] + received[kind] for kind in sent}

    def _linger_for_last_contribution(self) -> None:
        """A peer that finished its run keeps serving its last contribution (and its record) until every other
        live peer still at that round or before got it, at most matchmaking_time + 10 s (within round_timeout):
        peers finishing the same round a moment later otherwise read a tombstone, leave it out and end the run
        with other synchronized tensors than the rest (bench.convergence's smoke run, under load)."""
        if self._own_blob is None:
            return
        last = self._own_blob[0]
        deadline = time.monotonic() + min(self.cfg.round_timeout, self.cfg.matchmaking_time + 10.0)
        while time.monotonic() < deadline:
            served = self.contrib_exchange.served_to(self.swarm.peer_id, last)
            waiting = [p for p, r in self._others().items() if p not in served and r.round <= last
                       and not (r.synced and int(r.synced[0]) >= last) and not self._skipped(p)]
            if not waiting:
                return
            time.sleep(0.2)
        logger.info(f"stopped serving round {last}'s contribution: {len(waiting)} peer(s) did not fetch it in time")

    def _shutdown_contributions(self) -> None:
        self.contrib_exchange.shutdown()
