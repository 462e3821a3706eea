"""`python -m peer.run`: train one peer (README, "Join a swarm"). With no arguments: the default small model on the built-in
corpus, on CPU or GPU, with no network access.

Exit codes: 0 on a clean finish (max steps reached, or Ctrl-C/SIGTERM handled after finishing the step and
writing a checkpoint); 2 with a one-line message naming the cause for bad input.
"""
from __future__ import annotations

import argparse
import asyncio.subprocess
import ctypes
import gc
import os
import re
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Sequence

from hivemind.utils.logging import get_logger
from hivemind.utils.multiaddr import Multiaddr

from peer.cli import OneLineParser
from peer.config import ConfigError, RunConfig, load_config, parse_override

if TYPE_CHECKING:
    from peer.metrics import PeerMetrics
    from peer.ranks import PeerRanks
    from peer.train import Trainer

logger = get_logger(__name__)

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# What p2pd says when a listen address is taken: "listen tcp4 127.0.0.1:41965: bind: address already in use".
_DAEMON_PORT_IN_USE = re.compile(r"listen \S+ \S*:(\d+): bind: address already in use")


def _built_in_defaults() -> dict[str, Any]:
    """The values the flags take when neither they nor --config set them (the built-in config), for --help."""
    cfg = load_config(None, [])
    return {"run_id": cfg.run_id, "sync.experts": cfg.sync.experts, "train.max_steps": cfg.train.max_steps,
            "sync.every": cfg.sync.every, "metrics.port": cfg.metrics.port, "train.device": cfg.train.device,
            "data.dataset": cfg.data.dataset, "data.tokenizer": cfg.data.tokenizer}


def build_parser() -> argparse.ArgumentParser:
    d = _built_in_defaults()

    def config(key: str) -> str:  # where a flag's default comes from, and what it is without --config
        return f"(config: {key}; default {d[key]!r})"
    p = OneLineParser(prog="python -m peer.run", description="Train one SPES peer (Mixture-of-Experts, sparse expert sync). "
                "Flags override the config file; every config field can be set with --set.")
    p.add_argument("--config", metavar="FILE", help="YAML run config (configs/*.yaml); flags override it "
                   "(default: the built-in small config, which trains on built-in data)")
    p.add_argument("--initial-peers", nargs="+", metavar="MADDR",
                   help="multiaddrs of peers of an existing swarm to join, each ending in /p2p/PEER_ID as the first "
                        "peer's 'initial peer:' log line prints it (default: none, start a new swarm)")
    p.add_argument("--run-id", help=f"run name; namespaces every DHT key and the default run dir {config('run_id')}")
    p.add_argument("--experts", help="experts to own: auto (least covered), all, or a list like 0-3,8 "
                   + config("sync.experts"))
    p.add_argument("--max-steps", type=int, metavar="N",
                   help=f"stop after N local optimizer steps {config('train.max_steps')}")
    p.add_argument("--sync-every", type=int, metavar="H", help=f"sync every H local steps, 0 = never, no swarm "
                   f"{config('sync.every')}")
    p.add_argument("--run-dir", metavar="DIR", help="where config, metrics and checkpoints go (default: runs/RUN_ID)")
    p.add_argument("--metrics-port", type=int, metavar="PORT",
                   help=f"serve Prometheus metrics on this port, 0 = off {config('metrics.port')}")
    p.add_argument("--metrics-host", metavar="HOST",
                   help="address the metrics endpoint listens on (default: the address the peer listens on, "
                        "see --host-maddrs)")
    p.add_argument("--host-maddrs", nargs="+", metavar="MADDR",
                   help="multiaddrs to listen on for the swarm (default: /ip4/0.0.0.0/tcp/0 when joining with "
                        "--initial-peers, else loopback only, /ip4/127.0.0.1/tcp/0: pass /ip4/0.0.0.0/tcp/PORT to "
                        "let other machines join a run you start)")
    p.add_argument("--announce-maddrs", nargs="+", metavar="MADDR",
                   help="public multiaddrs to announce to other peers, e.g. /ip4/203.0.113.7/tcp/31337 behind a "
                        "forwarded port (default: the listening addresses)")
    p.add_argument("--identity-path", metavar="FILE", help="private key file for a stable peer ID, created if missing; "
                   "one per peer (default: a new random peer ID each start)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), help=f"where to train {config('train.device')}")
    p.add_argument("--dataset", metavar="NAME_OR_PATH",
                   help=f"hub dataset name, local path (txt/jsonl/parquet), or builtin {config('data.dataset')}")
    p.add_argument("--tokenizer", metavar="NAME_OR_PATH",
                   help=f"HF tokenizer name/path or builtin {config('data.tokenizer')}")
    p.add_argument("--organizer-key", metavar="KEY_OR_FILE",
                   help="a closed run: the organizer's public key (base64, as python -m peer.admit keygen prints it) "
                        "or a file holding it; needs --ticket and --identity-path (config: admission.organizer_key)")
    p.add_argument("--ticket", metavar="TICKET",
                   help="this peer's ticket for a closed run (python -m peer.admit sign): a file or its base64 text, "
                        "signed for the peer ID of --identity-path (config: admission.ticket)")
    p.add_argument("--use-auto-relay", action="store_true", default=None,
                   help="behind NAT without port forwarding: reserve a slot on the initial peers as libp2p relays so "
                        "that every peer can reach this one by peer ID; tensors still go over connections this peer "
                        "opens itself (config: network.use_auto_relay)")
    p.add_argument("--client-mode", action="store_true", default=None,
                   help="behind NAT without port forwarding: run the DHT as a hivemind client, which "
                        "only makes requests; contributions and experts are served over connections this peer opens to the run's "
                        "peers (config: network.client_mode)")
    p.add_argument("--init-from", metavar="DIR",
                   help="start a new run from the weights python -m model.upcycle wrote to DIR (ignored when the run "
                        "dir has a checkpoint to resume from) (config: train.init_from)")
    p.add_argument("--fresh", action="store_true",
                   help="start over: move an existing run dir aside to RUN_DIR.old-TIME (never deleted) instead of "
                        "resuming from it")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config field by dotted path, e.g. --set model.d_model=512 (repeatable); every "
                        "key with its meaning: peer/config.py (run, train., data., network., metrics., admission.), "
                        "model/config.py (model.), sync/config.py (sync.)")
    return p


def overrides_from_args(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Flags as config overrides, applied after the config file; --set items last."""
    flat = {
        "run_id": args.run_id, "run_dir": args.run_dir,
        "sync.experts": args.experts, "sync.every": args.sync_every,
        "train.max_steps": args.max_steps, "train.device": args.device, "train.init_from": args.init_from,
        "data.dataset": args.dataset, "data.tokenizer": args.tokenizer, "metrics.port": args.metrics_port,
        "metrics.host": args.metrics_host,
        "admission.organizer_key": args.organizer_key, "admission.ticket": args.ticket,
        "network.use_auto_relay": args.use_auto_relay, "network.client_mode": args.client_mode,
    }
    overrides: list[dict[str, Any]] = []
    for key, value in flat.items():
        if value is not None:
            nested: dict[str, Any] = {}
            cursor = nested
            parts = key.split(".")
            for part in parts[:-1]:
                cursor = cursor.setdefault(part, {})
            cursor[parts[-1]] = value
            overrides.append(nested)
    overrides.extend(parse_override(item) for item in args.set)
    return overrides


def setup_logging() -> None:
    """One log format for hivemind, transformers and this project, one line per expected failure (peer/logs.py)."""
    from peer.logs import setup_logging as setup
    setup()


def parse_maddrs(flag: str, maddrs: Sequence[str]) -> list[Multiaddr]:
    """Parse multiaddrs given on the command line; ConfigError naming the bad one."""
    parsed = []
    for maddr in maddrs:
        try:
            parsed.append(Multiaddr(maddr))
        except Exception as e:  # multiaddr raises its own StringParseError/ValueError family
            raise ConfigError(f"bad multiaddr {maddr!r} ({flag}): {e}") from None
    return parsed


def check_host_ports(maddrs: Sequence[Multiaddr]) -> None:
    """Fail now, with the port named, if a fixed TCP port to listen on is already taken (see busy_tcp_port)."""
    from sync.swarm import busy_tcp_port
    busy = busy_tcp_port(maddrs)
    if busy is not None:
        raise ConfigError(f"port {busy[0]} is in use ({busy[1]})")


def explain_swarm_error(message: str) -> str:
    """hivemind's daemon errors, made to name the cause the way the other errors here do."""
    match = _DAEMON_PORT_IN_USE.search(message)
    if match:
        return f"port {match.group(1)} is in use"
    return message


_prctl = None  # libc's prctl, looked up before any fork: a dlopen between fork and exec could deadlock


def _p2pd_preexec() -> None:
    os.setpgid(0, 0)  # its own process group: a terminal's Ctrl-C reaches the peer, not its daemon
    if _prctl is not None:  # ...and it still dies with the DHT process that started it, whatever kills that one
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def keep_p2pd_out_of_terminal_signals() -> None:
    """Start hivemind's p2pd daemons outside the terminal's process group. Idempotent.

    Ctrl-C in a terminal sends SIGINT to the whole foreground process group. hivemind's DHT process
    ignores it, but p2pd exits at once, so the peer could not finish its round, withdraw its record
    or shut down cleanly. hivemind offers no option for this, so the one asyncio call that spawns p2pd gets
    a preexec_fn (inherited by the DHT process forked later).
    """
    global _prctl
    original = asyncio.subprocess.create_subprocess_exec
    if getattr(original, "_spes_p2pd_isolated", False):
        return
    if sys.platform.startswith("linux"):
        _prctl = ctypes.CDLL(None, use_errno=True).prctl

    async def create_subprocess_exec(program, *args, **kwargs):
        if os.path.basename(str(program)) == "p2pd" and "preexec_fn" not in kwargs:
            kwargs["preexec_fn"] = _p2pd_preexec
        return await original(program, *args, **kwargs)

    create_subprocess_exec._spes_p2pd_isolated = True
    asyncio.subprocess.create_subprocess_exec = create_subprocess_exec


_dies_with_peer = False


def children_die_with_this_peer() -> None:
    """Every process forked from the calling (main) thread from now on gets SIGTERM when this process dies,
    however it dies. Idempotent; Linux only.

    hivemind's DHT process is a multiprocessing child: a clean exit stops it, but a peer
    killed with SIGKILL (the kernel's OOM killer) left them running with parent PID 1, minutes later, holding
    gigabytes and the port. SIGTERM ends them (StopOnSignal restores the default action in forked children), and
    their p2pd dies with them (`_p2pd_preexec`). Only forks from this thread: the kernel sends the signal when the
    forking *thread* exits, so a child forked from a short-lived thread would die with that thread.
    """
    global _dies_with_peer
    if _dies_with_peer or not sys.platform.startswith("linux"):
        return
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    forking_thread, peer, forker = threading.get_ident(), os.getpid(), [0]

    def before() -> None:  # hooks are inherited: the children's own forks (their p2pd) must be left alone
        forker[0] = os.getpid()

    def in_child() -> None:
        if forker[0] == peer and threading.get_ident() == forking_thread:
            prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != peer:  # the peer died between the fork and the prctl: follow it now
                os._exit(1)

    os.register_at_fork(before=before, after_in_child=in_child)
    _dies_with_peer = True


def check_admission(cfg: RunConfig, identity_path: str | None) -> None:
    """A closed run: its ticket must be for this run, this peer (the identity's peer ID) and unexpired; checked
    here, before the DHT starts, so a wrong ticket costs one line instead of a peer refused at every door."""
    if not (cfg.admission.organizer_key or cfg.admission.ticket):
        return
    from sync.admission import load_admission
    admission = load_admission(cfg.admission, cfg.run_id, identity_path)  # AdmissionError: a ValueError
    if admission is not None:
        expiry = admission.ticket_expiry(admission.own_ticket)
        logger.info(f"closed run {cfg.run_id}: ticket valid until "
                    f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(expiry))}")


def metrics_host(cfg: RunConfig, hosts: Sequence[Multiaddr]) -> str:
    """Where the metrics endpoint listens: `metrics.host` if set, else where the peer itself listens (the first
    host multiaddr's IP), so a peer on loopback opens no metrics port to the network either."""
    if cfg.metrics.host:
        return cfg.metrics.host
    for maddr in hosts:
        for proto in ("ip4", "ip6"):
            try:
                return maddr.value_for_protocol(proto)
            except Exception:  # no such part in this address
                continue
    return "127.0.0.1"


def start_metrics(cfg: RunConfig, host: str = "127.0.0.1") -> "PeerMetrics | None":
    """The metrics endpoint on `host`, started before anything heavy so a taken port costs nothing; None if
    off."""
    if not cfg.metrics.port:
        return None
    from peer.metrics import MetricsPortInUse, PeerMetrics
    metrics = PeerMetrics(cfg.model.num_experts)
    try:
        metrics.serve(cfg.metrics.port, addr=host)
    except MetricsPortInUse as e:
        raise ConfigError(e.strerror) from None
    except OSError as e:
        raise ConfigError(f"cannot serve metrics on port {cfg.metrics.port}: {e.strerror or e}") from None
    return metrics


def start_replicas(trainer: "Trainer", ranks: "PeerRanks") -> None:
    """Rank 0 of a K-process peer, once its trainer (and swarm membership) is up: hand every other rank its data
    order and position, wait for all of them, then send them the model and optimizer state (peer/ranks.py)."""
    states = list(trainer.resumed_data_ranks or [])
    if trainer.resumed and len(states) != ranks.world_size - 1:
        logger.warning(f"the checkpoint holds the data positions of {len(states) + 1} process(es), this peer has "
                       f"{ranks.world_size}: the others start their data order from the beginning")
    states = [None] + (states + [None] * ranks.world_size)[:ranks.world_size - 1]
    ranks.start({"data_seed": trainer.data_seed, "data_states": states})
    if not ranks.all_ready(True):
        raise ConfigError("another process of this peer could not start (its log line above says why)")
    ranks.sync_state(trainer, initial=True)
    logger.info(f"[{trainer.log_prefix}] one peer over {ranks.world_size} processes: each trains "
                f"{trainer.cfg.train.batch_size} sequences per micro-step, gradients averaged over all")
    cap = trainer.cfg.sync.max_peer_processes
    if trainer.cfg.sync.every > 0 and ranks.world_size > cap:
        logger.warning(f"[{trainer.log_prefix}] this run counts a peer's round as at most {cap} process(es)' tokens "
                       f"(sync.max_peer_processes): the {ranks.world_size} processes of this peer weigh that much in "
                       f"the averages; the run's config should set sync.max_peer_processes={ranks.world_size}")


def run_replica(cfg: RunConfig, ranks: "PeerRanks") -> int:
    """Ranks 1..K-1 of a K-process peer: no network, no run dir; rank 0 says how to start and what to hold."""
    from peer.stop import StopOnSignal
    from peer.train import Trainer
    start = ranks.start()
    if "error" in start:
        logger.error(f"error: rank 0 could not start the peer: {start['error']}")
        return 2
    with StopOnSignal() as stop:
        try:
            trainer = Trainer(cfg, data_seed=ranks.rank_data_seed(int(start["data_seed"])), ranks=ranks)
            state = start["data_states"][ranks.rank]
            if state is not None:
                trainer.data.train.load_state_dict(state)
        except Exception as e:  # said here, where it happened; rank 0 then stops the peer with its own line
            logger.error(f"error: rank {ranks.rank} could not start: {e}")
            ranks.all_ready(False)
            return 2
        if not ranks.all_ready(True):
            return 2
        trainer.log_prefix = f"{cfg.run_id} rank {ranks.rank}"
        ranks.sync_state(trainer, initial=True)
        stop.attach(trainer)
        trainer.run()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    metrics = lock = ranks = None
    failed = False
    try:
        from peer.ranks import world_from_env
        world = world_from_env()
        cfg = load_config(args.config, overrides_from_args(args))
        if cfg.sync.experts not in ("auto", "all"):
            from sync.config import parse_expert_list
            parse_expert_list(cfg.sync.experts, cfg.model.num_experts)
        if args.initial_peers and cfg.sync.every == 0:
            raise ConfigError("--initial-peers needs synchronization on (sync.every > 0)")
        if cfg.network.use_auto_relay and not args.initial_peers:
            raise ConfigError("--use-auto-relay needs --initial-peers (they are the relays)")
        if cfg.network.client_mode and not args.initial_peers:
            raise ConfigError("--client-mode needs --initial-peers (a client cannot start a swarm)")
        # A peer that starts a run on its own listens on loopback unless told otherwise: the offline default job
        # should not open a port on every interface. One joining a swarm listens everywhere by default.
        host_maddrs = args.host_maddrs or (("/ip4/0.0.0.0/tcp/0",) if args.initial_peers else ("/ip4/127.0.0.1/tcp/0",))
        for maddr in parse_maddrs("--initial-peers", args.initial_peers or ()):
            if "/p2p/" not in str(maddr):
                raise ConfigError(f"--initial-peers {maddr} names no peer: the address must end with /p2p/<peer ID>, "
                                  f"as the first peer's 'initial peer:' log line prints it")
        parse_maddrs("--announce-maddrs", args.announce_maddrs or ())
        hosts = parse_maddrs("--host-maddrs", host_maddrs)
        if world is not None:
            # torchrun: K processes, one peer (SPEC 3a). Every rank checked the same flags above; from here on
            # rank 0 alone is the peer, the others follow it (peer/ranks.py).
            from peer.ranks import PeerRanks
            from peer.train import resolve_device
            ranks = PeerRanks(*world, device_kind=resolve_device(cfg.train.device).type)
            if not ranks.leader:
                return run_replica(cfg, ranks)
        check_admission(cfg, args.identity_path)
        if cfg.sync.every > 0:
            check_host_ports(hosts)
        metrics = start_metrics(cfg, metrics_host(cfg, hosts))
        from peer.rundir import RunDirLock, move_aside
        if args.fresh:
            move_aside(cfg.resolved_run_dir())
        # Held until the process ends: a second peer on this dir would resume and overwrite this one's work.
        lock = RunDirLock(cfg.resolved_run_dir()).acquire()
        # Heavy imports after argument checks so bad flags fail fast.
        from model.checkpoint import CheckpointError
        from peer.node import PeerNode
        from peer.stop import StopOnSignal
        from sync.swarm import SwarmError
        keep_p2pd_out_of_terminal_signals()
        children_die_with_this_peer()
        # Signals are handled from here on: one during start-up lets start-up finish, then stops cleanly.
        with StopOnSignal() as stop:
            try:
                node = PeerNode(cfg, initial_peers=args.initial_peers or (), host_maddrs=host_maddrs,
                                announce_maddrs=args.announce_maddrs or (), identity_path=args.identity_path,
                                metrics=metrics, ranks=ranks)
            except (CheckpointError, SwarmError) as e:
                raise ConfigError(explain_swarm_error(str(e))) from None
            with node:
                if ranks is not None:
                    start_replicas(node.trainer, ranks)
                stop.attach(node.trainer)
                node.run()
    except (ConfigError, ValueError, FloatingPointError) as e:
        logger.error(f"error: {e}")
        if ranks is not None and ranks.leader and not ranks.started:
            ranks.start({"error": str(e)})  # the other ranks wait for rank 0's start: they exit with it
        failed = True
        return 2
    except KeyboardInterrupt:
        logger.error("aborted by a second interrupt; the newest checkpoint on disk is still complete")
        return 130
    finally:
        if metrics is not None:
            metrics.shutdown()
        if lock is not None:
            lock.release(failed=failed)
        if ranks is not None:
            ranks.shutdown()
    return 0


if __name__ == "__main__":
    code = main()
    # Everything is shut down by now; what is left is the interpreter's own final garbage collections over
    # hundreds of thousands of torch/transformers/hivemind objects, seconds of CPU on a busy machine. Frozen
    # objects are skipped by them (an exiting process needs no cycle collection).
    gc.freeze()
    sys.exit(code)
