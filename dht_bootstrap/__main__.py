"""`python -m dht_bootstrap`: a long-lived DHT node for a run (README, "Join a swarm").

Logs one `initial peer: MADDR` line per visible address at start (what peers pass to `--initial-peers`), then a
status line every `--status-every` seconds; with `--metrics-port` serves the swarm-level gauges (README); with
`--organizer-key` it enforces a closed run (docs/DESIGN.md, "Closed runs") like every peer. Exit codes: 0 after SIGINT/SIGTERM (DHT and
p2pd shut down); 2 with one line naming the cause for bad input (bad multiaddr, port in use, metrics port in use,
unreachable initial peer, bad organizer key); 1 if the DHT process dies.
"""
from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
import threading

from hivemind.utils.logging import get_logger

from dht_bootstrap import DEFAULT_PORT, default_host_maddrs
from dht_bootstrap.node import BootstrapError, BootstrapNode
from peer.cli import OneLineParser
from peer.logs import setup_logging

logger = get_logger(__name__)


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError(text)
    return value


_port.__name__ = "port"  # argparse names the type in its message: "invalid port value: 'x'"


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(text)
    return value


_positive.__name__ = "positive number"


def _count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


_count.__name__ = "positive integer"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m dht_bootstrap",
                description="A long-lived hivemind DHT node for a SPES run: peers join through it; it reports the "
                            "run's peers, expert coverage and tokens from the DHT records.")
    listen = p.add_mutually_exclusive_group()
    listen.add_argument("--host-maddrs", nargs="+", metavar="MADDR",
                        help=f"multiaddrs to listen on (default: all interfaces on TCP port {DEFAULT_PORT}: "
                             f"{' '.join(default_host_maddrs())})")
    listen.add_argument("--port", type=_port, metavar="N",
                        help="shortcut for --host-maddrs /ip4/0.0.0.0/tcp/N /ip6/::/tcp/N")
    p.add_argument("--announce-maddrs", nargs="+", metavar="MADDR", default=[],
                   help="public multiaddrs to announce to other peers (e.g. /ip4/203.0.113.7/tcp/31337)")
    p.add_argument("--identity-path", metavar="FILE",
                   help="private key file for a stable peer ID (and so the same initial peer: lines) across "
                        "restarts; created if missing. The addresses of known DHT nodes are kept in FILE.peers "
                        "so that they take this node back after a restart")
    p.add_argument("--initial-peers", nargs="+", metavar="MADDR", default=[],
                   help="other bootstrap nodes of the same run to join, for redundancy")
    p.add_argument("--use-relay", action=argparse.BooleanOptionalAction, default=True,
                   help="libp2p circuit relay: reach peers behind NAT through relays (hivemind's use_relay)")
    p.add_argument("--use-auto-relay", action="store_true",
                   help="look for libp2p relays to become reachable when behind NAT (hivemind's use_auto_relay)")
    p.add_argument("--force-reachability", choices=("public", "private", "auto"), default="public",
                   help="what libp2p assumes about this node's reachability (default: public — a bootstrap node runs "
                        "on a public host, and only a node that deems itself public serves as a full circuit relay "
                        "for peers behind NAT; AutoNAT may take minutes to decide, or never on a private network). "
                        "auto: let AutoNAT decide")
    p.add_argument("--run-id", default="spes-demo", metavar="ID",
                   help="run whose DHT records to read (default: spes-demo, as configs/small.yaml)")
    p.add_argument("--num-experts", type=_count, default=8, metavar="N",
                   help="experts in the run's model, for coverage (default: 8, as configs/small.yaml)")
    p.add_argument("--metrics-port", type=_port, default=0, metavar="PORT",
                   help="serve the swarm gauges for Prometheus on this port (0 = off, the default)")
    p.add_argument("--record-ttl", type=_positive, default=30.0, metavar="SECONDS",
                   help="the run's sync.record_ttl: records expiring later than now + this + 10 s are refused "
                        "(default 30, as peer.run)")
    p.add_argument("--organizer-key", metavar="KEY_OR_FILE", default="",
                   help="a closed run: the organizer's public key (base64, as python -m peer.admit keygen prints "
                        "it) or a file holding it; this node then stores and serves only the records that the "
                        "run's validator accepts (default: an open run)")
    p.add_argument("--status-every", type=_positive, default=60.0, metavar="SECONDS",
                   help="log a status line this often (default: 60)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # What is loaded by now (hivemind, torch) lives as long as the process: frozen, it is skipped by every garbage
    # collection, including the one at exit that otherwise takes seconds after the DHT is already down.
    gc.freeze()
    setup_logging(libraries=False)  # one line per expected network failure (peer/logs.py)

    # Handlers first, so a signal during the (seconds-long) start still ends in a clean shutdown.
    stop = threading.Event()
    received: list[str] = []
    main_pid = os.getpid()

    def on_signal(signum: int, _frame: object) -> None:
        if os.getpid() != main_pid:
            # The forked DHT process inherits this handler; there the signal must act as by default, or
            # DHT.shutdown's terminate() (and a signal to the whole process group) could never end it.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        received.append(signal.Signals(signum).name)  # logged by the main loop, not inside the handler
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)

    host_maddrs = args.host_maddrs or default_host_maddrs(DEFAULT_PORT if args.port is None else args.port)
    # As for a peer (docs/DESIGN.md "Run safety"): killed outright, its DHT process and p2pd must not live on.
    from peer.run import children_die_with_this_peer, keep_p2pd_out_of_terminal_signals
    keep_p2pd_out_of_terminal_signals()
    children_die_with_this_peer()
    try:
        node = BootstrapNode(args.run_id, args.num_experts, host_maddrs, args.announce_maddrs, args.identity_path,
                             args.initial_peers, args.metrics_port, organizer_key=args.organizer_key,
                             record_ttl=args.record_ttl,
                             use_relay=args.use_relay, use_auto_relay=args.use_auto_relay,
                             **({} if args.force_reachability == "auto" else
                                {"force_reachability": args.force_reachability}))
    except BootstrapError as e:
        logger.error(f"error: {e}")
        return 2
    try:
        for maddr in node.visible_maddrs():
            logger.info(f"initial peer: {maddr}")
        if args.use_relay and args.force_reachability == "public":
            logger.info("relay: serving as a libp2p circuit relay for peers behind NAT (--force-reachability public)")
        if args.metrics_port:
            logger.info(f"serving swarm metrics on port {args.metrics_port}")
        if node.admission is not None:
            logger.info(f"closed run {args.run_id}: only peers with the organizer's tickets take part")
        node.reconnect()
        node.serve_forever(stop, args.status_every)
    except BootstrapError as e:
        logger.error(f"error: {e}")
        return 1
    finally:
        node.shutdown()
    logger.info(f"{received[0] if received else 'stop'} received: DHT node shut down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
