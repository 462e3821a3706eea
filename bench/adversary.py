"""Hostile swarm participants for measuring the defences of issue 9 (one attack per name).

    python -m bench.adversary --attack c_scale --initial-peers MADDR --config configs/tiny.yaml [--set KEY=VALUE ...]

Each attacker is built the way a real one would be: from plain hivemind classes and this project's own code, so
it speaks the wire protocol of whatever build it runs next to. Where a peer-like attacker is needed it is a
`SparseSync` on a model of the run's shape (its DHT record is published, and signed once records are signed,
by the project's `Swarm` with the attacker's *own* key); the forged-record attack uses a raw `hivemind.DHT`.

Attacks on the records and the expert exchange (`--param KEY=VALUE` changes the value in brackets). The
peer-like ones (expert, round, silent) join with a `SparseSync` and a record, serve their claimed experts
through its `ExpertExchange` (what a joining or adopting peer fetches) and never contribute to a round:
- `expert`: claims an expert an honest peer owns and serves `factor` (-9) x its initial value: finite,
  right-shaped and within the 10x norm bound;
- `round`: a record (claiming one expert, so that readers count it) with round `value` (2**62 - 1);
- `tombstone`: one raw DHT store per honest peer under that peer's subkey, `experts: []`, expiring in `ttl` (3600 s);
- `silent`: claims an expert and never answers requests for it.

Attacks on the contribution rounds (c_silent, c_slow, c_garbage, c_huge, c_copyset, c_stale, c_reverse, c_scale,
c_init): see bench/adversary_contrib.py. Floods of records and junk, and ghost owners (d_junk, d_records,
d_ghosts): see bench/adversary_doors.py.

Attackers that need a claimed expert take one nobody owns when there is one ("spare"), so that what they serve
for it (the initial value every peer already holds) changes nothing but the attack itself; `--param expert=E`
chooses. The Python API (`start_attacker`) runs everything on background threads and processes of the calling
process, for tests; the CLI runs until SIGTERM/SIGINT, `--max-seconds` or `--max-rounds`, then shuts its DHT and
exchanges down (their p2pd daemon exits with them) and exits 0.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from hivemind.utils import get_dht_time
from hivemind.utils.logging import get_logger

from bench.adversary_contrib import CONTRIB_ATTACKS, ContribAttacks, supported_kwargs
from bench.adversary_doors import DOOR_ATTACKS, DOOR_DEFAULTS, DoorAttacks
from peer.config import RunConfig

logger = get_logger(__name__)

# Attacks on the records and the expert exchange (see the module doc) and on the contribution rounds.
RECORD_ATTACKS = ("expert", "round", "tombstone", "silent")
ATTACKS = RECORD_ATTACKS + CONTRIB_ATTACKS + DOOR_ATTACKS
DEFAULTS: dict[str, dict[str, Any]] = {
    "expert": {"factor": -9.0}, "round": {"value": 2**62 - 1}, "tombstone": {"ttl": 3600.0}, "silent": {},
    "c_silent": {}, "c_slow": {"interval": 1.0, "part": 1}, "c_garbage": {}, "c_huge": {"size": 200e6},
    "c_copyset": {}, "c_stale": {}, "c_reverse": {"strength": 3.0, "fit": 1}, "c_scale": {"factor": 100.0},
    "c_init": {"weight": 2**62}, **DOOR_DEFAULTS,
}
LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)


@dataclass
class AttackStats:
    """What the attacker did, for the benchmark's table and the tests' checks."""

    attack: str
    peer_id: str = ""
    claimed: list[int] = field(default_factory=list)
    group_sizes: list[int] = field(default_factory=list)  # contributions aggregated in each of its rounds
    targets: list[str] = field(default_factory=list)  # honest subkeys the tombstone was stored under
    stores_accepted: int = 0
    stores_refused: int = 0
    served_rounds: int = 0                          # (expert, round) entries published for fetchers
    contrib_rounds: int = 0                         # contribution rounds the attacker took part in
    contrib_sizes: list[int] = field(default_factory=list)  # bytes announced per round
    contrib_norms: list[float] = field(default_factory=list)  # shared-tensor norm of each crafted contribution
    honest_norms: list[float] = field(default_factory=list)   # lower median of honest decoded norms it saw
    honest_seen: list[int] = field(default_factory=list)      # honest blobs decoded before building its own
    serves_stalled: int = 0                         # requests c_silent / c_slow held
    copied: list[int] = field(default_factory=list)  # c_copyset: the expert set copied
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class Attacker(ContribAttacks, DoorAttacks):
    """One hostile participant. `start()` blocks until it is in the swarm; `shutdown()` leaves. See module doc."""

    def __init__(self, attack: str, initial_peers: Sequence[str], cfg: RunConfig,
                 params: dict[str, Any] | None = None, host_maddrs: Sequence[str] = LOOPBACK,
                 wait_peers: int = 1, max_rounds: int = 0, poll_s: float = 0.5):
        """`wait_peers`: honest records to wait for before choosing targets; `max_rounds`: stop after taking
        part in that many contribution rounds (0 = never; contribution attacks only)."""
        if attack not in ATTACKS:
            raise ValueError(f"unknown attack {attack!r}; choose one of {', '.join(ATTACKS)}")
        self.attack, self.cfg = attack, cfg
        self.params = {**DEFAULTS[attack], **(params or {})}
        self.initial_peers, self.host_maddrs = list(initial_peers), list(host_maddrs)
        self.wait_peers, self.max_rounds, self.poll_s = wait_peers, max_rounds, poll_s
        self.stats = AttackStats(attack)
        self.log_prefix = f"attacker {attack}"  # for peer.stop.StopOnSignal
        self.served: dict[int, dict[str, torch.Tensor]] = {}  # what this attacker serves per claimed expert
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._raw_dht = None
        self.swarm = self.sync = self.model = None
        self._init_shared: list[torch.Tensor] = []
        self._init_experts: dict[int, dict[str, torch.Tensor]] = {}

    # ---- lifetime -----------------------------------------------------------------------------------------

    def start(self, timeout: float = 120.0) -> "Attacker":
        """Join the swarm and start the attack; raises (after cleaning up) if it cannot within `timeout`."""
        deadline = time.monotonic() + timeout
        try:
            if self.attack == "tombstone":
                self._start_tombstone(deadline)
            elif self.attack == "c_copyset":
                self._start_copyset(deadline)
            elif self.attack in DOOR_ATTACKS:
                self._start_doors(deadline)
            else:
                self._start_peer(deadline)
        except BaseException:
            self.shutdown()
            raise
        logger.info(f"{self.log_prefix} ready: peer ...{self.stats.peer_id[-6:]}, claims {self.stats.claimed}")
        return self

    def request_stop(self) -> None:
        """Stop attacking (from a signal handler or any thread); `shutdown()` still has to be called."""
        self._stop.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until stopped (request_stop or max_rounds); True if stopped."""
        return self._stop.wait(timeout)

    def shutdown(self) -> None:
        """Stop every thread, exchange and DHT this attacker started. Idempotent."""
        self.request_stop()
        # The sync first: a round or fetch the attack thread is blocked in ends with its exchanges (else it would
        # wait for its timeout); the threads see the stop flag and exit, errors after it are expected and quiet.
        if self.sync is not None:
            try:
                self.sync.shutdown()  # exchanges, heartbeat, record withdrawal, DHT
            except Exception as e:
                logger.warning(f"{self.log_prefix}: shutdown: {e}")
            self.sync = None
        elif self.swarm is not None:
            self.swarm.shutdown(withdraw=False)
        self.swarm = None
        if self._raw_dht is not None:
            self._raw_dht.shutdown()
            self._raw_dht = None
        # Daemon threads: one still waiting on a (now stopped) exchange's bounded future dies with the process.
        for thread in self._threads:
            thread.join(timeout=2.0)
        self._threads = []

    def __enter__(self) -> "Attacker":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- a peer-like attacker (SparseSync) ----------------------------------------------------------------

    def _join_dht(self, deadline: float) -> dict:
        """Start this attacker's DHT node and Swarm; returns the honest peers' records once they are there."""
        from sync.swarm import Swarm, start_dht

        # Whatever the project's peers pass to start their DHT node (run_id, ... once records are signed and
        # validated), the attacker passes too: its record is then signed with its own key, as a real one's is.
        dht = start_dht(self.initial_peers, self.host_maddrs, **supported_kwargs(
            start_dht, run_id=self.cfg.run_id, num_experts=self.cfg.model.num_experts,
            record_ttl=self.cfg.sync.record_ttl))
        self.swarm = Swarm(dht, self.cfg.run_id, self.cfg.model.num_experts, ttl=self.cfg.sync.record_ttl)
        self.stats.peer_id = self.swarm.peer_id
        return self._wait_for_honest(deadline)

    def _start_peer(self, deadline: float) -> None:
        from model.model import SpesMoE
        from sync.rounds import SparseSync

        others = self._join_dht(deadline)
        claims = self._choose_claims(others)
        self.stats.claimed = claims
        self.model = SpesMoE(self.cfg.model, owned_experts=claims, seed=self.cfg.train.seed)
        # The untrained values, before join() downloads the swarm's: `c_init` sends them, `expert` scales them.
        self._init_shared = [p.detach().float().clone() for _, p in self.model.shared_parameters()]
        self._init_experts = {e: {k: v.detach().float().clone() for k, v in self.model.expert_tensors(e).items()}
                              for e in claims}
        contrib = self.attack in CONTRIB_ATTACKS
        # As peer/node.py builds an honest peer's (the weight cap matters for the attacker's own aggregate).
        from peer.node import round_token_cap
        self.sync = SparseSync(self.model, self.swarm, self.cfg.sync, **supported_kwargs(
            SparseSync, max_weight=round_token_cap(self.cfg)))
        if self.attack == "silent":
            self._make_silent()
        if contrib:
            self._install_contrib_attack()
        self.sync.join(step=0, tokens=0)  # downloads the swarm's state, publishes the record, starts the heartbeat
        if contrib:  # a real peer's rounds: the record, expert serving and contribution all go through SparseSync
            self._spawn(self._contrib_loop, "contrib")
            return
        for e in claims:
            self.served[e] = self._served_tensors(e)
        self._spawn(self._mirror_loop, "mirror")

    def _wait_for_honest(self, deadline: float) -> dict:
        others: dict = {}
        while time.monotonic() < deadline and not self._stop.is_set():
            others = {p: r for p, r in self.swarm.peers().items() if p != self.swarm.peer_id}
            if len(others) >= self.wait_peers:
                return others
            time.sleep(self.poll_s)
        if not others:
            raise TimeoutError(f"{self.log_prefix}: no honest peer record appeared")
        logger.warning(f"{self.log_prefix}: only {len(others)} of {self.wait_peers} honest peers seen: attacking")
        return others

    def _choose_claims(self, others: dict) -> list[int]:
        num_experts = self.cfg.model.num_experts
        if "expert" in self.params:
            return [int(self.params["expert"])]
        owned_sets = [set(r.experts) for r in others.values()]
        owned = set().union(*owned_sets) if owned_sets else set()
        spare = [e for e in range(num_experts) if e not in owned]
        if self.attack == "expert":
            # An expert whose owner also owns others: claiming exactly an owner's set would make the attacker a
            # replica of that owner, a second channel this attack does not need.
            for candidates in ([e for e in sorted(owned) if not any(s == {e} for s in owned_sets)], sorted(owned)):
                if candidates:
                    return [candidates[0]]
            raise RuntimeError("expert attack: no honest peer owns an expert")
        if spare:
            return [spare[0]]
        # No spare expert: a peer-like attacker must claim one to be counted as a peer at all.
        return [min(owned)] if owned and (self.attack in ("round", "silent") or self.attack in CONTRIB_ATTACKS) else []

    def _served_tensors(self, expert: int) -> dict[str, torch.Tensor]:
        if self.attack == "expert":
            return {k: v * float(self.params["factor"]) for k, v in self._init_experts[expert].items()}
        # Everyone else serves its honest copy (for a spare expert: the initial value every peer holds).
        return {k: v.detach().float().clone() for k, v in self.model.expert_tensors(expert).items()}

    def _make_silent(self) -> None:
        """Answer expert requests never: every fetch from this peer waits for its full timeout."""
        exchange = self.sync.exchange
        if not hasattr(exchange, "_serve"):
            raise RuntimeError("silent attack: sync.transfer.ExpertExchange no longer has _serve; update the attack")
        stop = self._stop

        async def never(uid: str, metadata: bytes = b"", requester=None):
            import asyncio
            while not stop.is_set():
                await asyncio.sleep(0.5)
            return
            yield  # an async generator, as _serve is

        exchange._serve = never

    def _spawn(self, target, name: str) -> None:
        thread = threading.Thread(target=self._guard, args=(target,), name=f"attacker-{name}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def _guard(self, target) -> None:
        try:
            target()
        except Exception as e:  # a dying attacker thread must not take the process (or the test) with it
            if not self._stop.is_set():
                logger.warning(f"{self.log_prefix}: {target.__name__} failed: {type(e).__name__}: {e}")
                self.stats.errors.append(f"{type(e).__name__}: {e}")

    def _mirror_loop(self) -> None:
        """Keep the record's round where the attack wants it and serve the claimed experts for every round
        honest peers may ask for (their own round and the next: fetchers ask for min(theirs, ours))."""
        lie = self.params.get("value") if self.attack == "round" else None
        served: set[tuple[int, int]] = set()
        while not self._stop.wait(self.poll_s):
            others = [r for p, r in self.swarm.peers().items() if p != self.swarm.peer_id]
            if not others:
                continue
            honest_round = int(statistics.median_low([r.round for r in others]))
            for expert, tensors in self.served.items():
                for round_id in (honest_round, honest_round + 1):
                    if (expert, round_id) not in served:
                        self.sync.exchange.publish(round_id, expert, tensors)
                        served.add((expert, round_id))
                        self.stats.served_rounds += 1
            want = int(lie) if lie is not None else honest_round
            if self.swarm.record.round != want:
                try:
                    self.swarm.publish(round=want)
                except Exception as e:  # e.g. a build whose own record schema refuses the lie: keep serving
                    logger.warning(f"{self.log_prefix}: could not publish round {want}: {type(e).__name__}: {e}")
                    self.stats.errors.append(f"publish round {want}: {type(e).__name__}: {e}")
                    self.swarm.record.round = want  # do not retry every poll

    # ---- forged records on a raw hivemind DHT -------------------------------------------------------------

    def _start_tombstone(self, deadline: float) -> None:
        import hivemind

        self._raw_dht = hivemind.DHT(initial_peers=self.initial_peers, host_maddrs=self.host_maddrs, start=True,
                                     record_validators=[_signature_stripper()])
        self.stats.peer_id = str(self._raw_dht.peer_id)
        try:
            from sync.records import peers_key
            self._key = peers_key(self.cfg.run_id)
        except ImportError:  # builds before signed records: sync.swarm.Swarm.key
            self._key = f"{self.cfg.run_id}_peers"
        while time.monotonic() < deadline and len(self._honest_subkeys()) < self.wait_peers:
            time.sleep(self.poll_s)
        self._plant()
        if not self.stats.targets:
            raise TimeoutError(f"{self.log_prefix}: no honest record found under {self._key!r}")
        self._spawn(self._tombstone_loop, "tombstone")

    def _honest_subkeys(self) -> list:
        """Live subkeys of the run's record key that are not tombstones already (whatever their value's form:
        a node without the run's validators may not even decode a signed value)."""
        try:
            found = self._raw_dht.get(self._key, latest=True)
        except Exception as e:
            logger.debug(f"{self.log_prefix}: get failed: {e}")
            return []
        value = getattr(found, "value", None)
        if not isinstance(value, dict):
            return []
        now = get_dht_time()
        subkeys = []
        for subkey, item in value.items():
            record = getattr(item, "value", None)
            if getattr(item, "expiration_time", 0) < now or (isinstance(record, dict) and not record.get("experts")):
                continue
            subkeys.append(subkey)
        return subkeys

    def _plant(self) -> None:
        """One store per honest subkey not yet targeted, with exactly the subkey (str or bytes) found."""
        for subkey in self._honest_subkeys():
            name = subkey.decode(errors="replace") if isinstance(subkey, bytes) else str(subkey)
            if name in self.stats.targets:
                continue
            tombstone = {"experts": [], "round": 0, "step": 0, "tokens": 0}
            ok = self._raw_dht.store(self._key, subkey=subkey, value=tombstone,
                                     expiration_time=get_dht_time() + float(self.params["ttl"]))
            self.stats.targets.append(name)
            if ok:
                self.stats.stores_accepted += 1
            else:
                self.stats.stores_refused += 1
            logger.info(f"{self.log_prefix}: tombstone under ...{name[-6:]}: {'stored' if ok else 'refused'}")

    def _tombstone_loop(self) -> None:
        while not self._stop.wait(2.0):
            self._plant()  # honest peers that join later get theirs too


def _signature_stripper():
    """A validator that lets the raw DHT *read* records signed in hivemind's RSASignatureValidator format (their
    value bytes carry a signature suffix that msgpack alone cannot decode) while checking and signing nothing:
    the attacker's own node keeps and serves its forged values; honest nodes are the ones that must refuse them."""
    from hivemind.dht.crypto import RSASignatureValidator

    class Stripper(RSASignatureValidator):
        def validate(self, record) -> bool:
            return True

        def sign_value(self, record) -> bytes:
            return record.value

    return Stripper()


def start_attacker(name: str, initial_peers: Sequence[str], cfg: RunConfig, params: dict[str, Any] | None = None,
                   wait_peers: int = 1, timeout: float = 120.0, **kwargs: Any) -> Attacker:
    """Start attack `name` against the swarm reachable through `initial_peers` (same process); returns once it
    is in the swarm. Call `.shutdown()` (or use it as a context manager) to stop it."""
    return Attacker(name, initial_peers, cfg, params=params, wait_peers=wait_peers, **kwargs).start(timeout)


def _parse_params(items: Sequence[str]) -> dict[str, Any]:
    import yaml
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"bad --param {item!r}: expected KEY=VALUE")
        value = yaml.safe_load(raw)
        if isinstance(value, str):  # YAML 1.1 reads 1e9 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.adversary", description=__doc__.split("\n\n")[0])
    p.add_argument("--attack", required=True, choices=ATTACKS, help="which attack to run")
    p.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR", help="multiaddrs of the swarm")
    p.add_argument("--config", metavar="FILE", help="the run's YAML config (model shape, run_id, sync settings)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="attack parameter, e.g. factor=1e3, expert=2, value=1000 (repeatable)")
    p.add_argument("--host-maddrs", nargs="+", default=list(LOOPBACK), metavar="MADDR", help="where to listen")
    p.add_argument("--wait-peers", type=int, default=1, help="honest records to wait for before attacking")
    p.add_argument("--max-seconds", type=float, default=0, help="stop after this many seconds (0 = never)")
    p.add_argument("--max-rounds", type=int, default=0,
                   help="contribution attacks: stop after taking part in this many rounds (0 = never)")
    p.add_argument("--stats-out", metavar="FILE", help="write what the attacker did as JSON here on exit")
    args = p.parse_args(argv)
    from peer.config import ConfigError, load_config, parse_override
    from peer.run import keep_p2pd_out_of_terminal_signals, setup_logging
    from peer.stop import StopOnSignal

    setup_logging()
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` dumps every thread's stack (a hung shutdown)
    try:
        cfg = load_config(args.config, [parse_override(s) for s in args.set])
        params = _parse_params(args.param)
    except (ConfigError, ValueError) as e:
        logger.error(f"error: {e}")
        return 2
    keep_p2pd_out_of_terminal_signals()  # p2pd dies with its DHT, whatever kills them
    attacker = Attacker(args.attack, args.initial_peers, cfg, params=params, host_maddrs=args.host_maddrs,
                        wait_peers=args.wait_peers, max_rounds=args.max_rounds)
    started = time.monotonic()
    with StopOnSignal(attacker):  # first SIGTERM/SIGINT: stop and leave cleanly; forked children die as usual
        try:
            start_timeout = max(60.0, 2 * cfg.sync.round_timeout)
            attacker.start(timeout=min(start_timeout, args.max_seconds) if args.max_seconds else start_timeout)
            while not attacker.wait(1.0):
                if args.max_seconds and time.monotonic() - started > args.max_seconds:
                    break
        except Exception as e:
            logger.error(f"{attacker.log_prefix}: {type(e).__name__}: {e}")
            attacker.stats.errors.append(f"{type(e).__name__}: {e}")
        finally:
            attacker.shutdown()
    if args.stats_out:
        with open(args.stats_out, "w") as f:
            json.dump(attacker.stats.to_dict(), f, indent=1)
    logger.info(f"{attacker.log_prefix}: left; {json.dumps(attacker.stats.to_dict())[:400]}")
    return 0


if __name__ == "__main__":
    code = main()
    # Everything is shut down and the stats are written. Exit without the interpreter's finalization: it ends
    # daemon threads still inside a torch op (an attack thread given up after its join timeout) by unwinding
    # them through C++ noexcept frames, which aborts the process ("terminate called without an active
    # exception", rc -6, seen once in CI after "left").
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
