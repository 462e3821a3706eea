"""`python -m peer.admit`: the organizer's tools for a closed run (docs/DESIGN.md, "Closed runs").

    keygen  --out ORG_KEY                                   the organizer key pair; prints "organizer key: <BASE64>"
    peer-id --identity-path FILE                            a volunteer's peer ID (the identity is created if missing)
    sign    --key ORG_KEY --run-id ID --peer-id P [--days N] --out TICKET
    revoke  --key ORG_KEY --run-id ID --peer-id P --out REVOCATION [--initial-peers MADDR ...]

Tickets and revocations are written as one line of base64 text (msgpack inside, never pickle), so they can be sent
through any chat. Lines users read go to stdout; every error is one line on stderr with exit code 2.
Only `peer-id` and `revoke --initial-peers` load hivemind; the other commands start in a fraction of a second.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

from peer.cli import OneLineParser
from sync.admission import (REVOCATION_TTL_DAYS, Admission, AdmissionError, dht_admission_kwargs, encode_signed,
                            generate_organizer_key, load_organizer_public_key, peer_id_from_identity,
                            publish_revocation, sign_revocation, sign_ticket)

PROG = "python -m peer.admit"


def _days(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(text)
    return value


_days.__name__ = "positive number of days"  # argparse names the type in its message


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description="Closed runs: the organizer's key, volunteers' peer IDs, tickets and "
                                       "revocations (docs/DESIGN.md, section Closed runs).")
    commands = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=OneLineParser)

    keygen = commands.add_parser("keygen", help="create the organizer key pair and print its public key",
                                 description="Create the organizer key pair. The private key goes to --out (mode "
                                             "0600, never overwritten); the printed public key is what every peer "
                                             "and bootstrap node of the run passes as --organizer-key.")
    keygen.add_argument("--out", required=True, metavar="ORG_KEY",
                        help="where to write the private key (refused if the file exists)")

    peer_id = commands.add_parser("peer-id", help="print the peer ID of a libp2p identity file",
                                  description="Print the peer ID of an identity file, creating it if missing; "
                                              "a volunteer sends this ID to the organizer and runs peer.run with "
                                              "the same --identity-path.")
    peer_id.add_argument("--identity-path", required=True, metavar="FILE",
                         help="the libp2p private key file, as passed to peer.run --identity-path (created if missing)")

    sign = commands.add_parser("sign", help="sign a ticket that admits one peer to a closed run",
                               description="Sign a ticket: the organizer's signature over (run id, peer ID, expiry).")
    revoke = commands.add_parser("revoke", help="revoke a peer's admission (optionally in the live run at once)",
                                 description="Sign a revocation of one peer; it wins over any ticket of that peer. "
                                             "With --initial-peers it is also published into the live run's DHT "
                                             f"(where it lives {REVOCATION_TTL_DAYS:g} days: revoke again before "
                                             "then if the peer's tickets live longer).")
    for sub, what in ((sign, "ticket"), (revoke, "revocation")):
        sub.add_argument("--key", required=True, metavar="ORG_KEY", help="the organizer's private key file (keygen --out)")
        sub.add_argument("--run-id", required=True, metavar="ID", help="the run (peer.run --run-id / run_id)")
        sub.add_argument("--peer-id", required=True, metavar="PEER_ID",
                         help="the peer's base58 ID, as python -m peer.admit peer-id prints it")
    sign.add_argument("--days", type=_days, default=30.0, metavar="N",
                      help="how long the ticket stays valid, from now (default: 30)")
    sign.add_argument("--out", required=True, metavar="TICKET",
                      help="where to write the ticket (base64 text; the peer passes it to peer.run --ticket)")
    revoke.add_argument("--out", required=True, metavar="REVOCATION",
                        help="where to write the revocation (base64 text)")
    revoke.add_argument("--initial-peers", nargs="+", metavar="MADDR", default=[],
                        help="multiaddrs of the live run's DHT (e.g. its bootstrap node): publish the revocation "
                             "there with a short-lived DHT client, so every door refuses the peer within seconds")
    return p


def _write(path: str, text: str) -> None:
    """Write atomically: a reader never sees half a ticket."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, target)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise AdmissionError(f"cannot write {path}: {e.strerror or e}") from None


def _utc(unix: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(unix))


def _keygen(args: argparse.Namespace) -> None:
    if os.path.lexists(args.out):
        raise AdmissionError(f"{args.out} exists: refusing to overwrite an organizer key")
    try:
        public = generate_organizer_key(args.out)
    except FileExistsError:  # created meanwhile
        raise AdmissionError(f"{args.out} exists: refusing to overwrite an organizer key") from None
    except OSError as e:
        raise AdmissionError(f"cannot write {args.out}: {e.strerror or e}") from None
    print(f"organizer key: {public}")


def _peer_id(args: argparse.Namespace) -> None:
    print(f"peer id: {peer_id_from_identity(args.identity_path, create=True)}")


def _sign(args: argparse.Namespace) -> None:
    ticket = sign_ticket(args.key, args.run_id, args.peer_id, args.days)
    expiry = Admission(load_organizer_public_key(args.key), args.run_id).ticket_expiry(ticket)
    _write(args.out, encode_signed(ticket) + "\n")
    print(f"ticket: {args.out} (run {args.run_id}, peer {args.peer_id}, valid until {_utc(expiry)})")


def _revoke(args: argparse.Namespace) -> None:
    _check_maddrs(args.initial_peers)  # before anything is written: a typo costs nothing
    revocation = sign_revocation(args.key, args.run_id, args.peer_id)
    _write(args.out, encode_signed(revocation) + "\n")
    print(f"revocation: {args.out} (run {args.run_id}, peer {args.peer_id})")
    if args.initial_peers:
        if not _publish(args, revocation):
            raise AdmissionError(f"no DHT node of run {args.run_id} took the revocation (it is in {args.out}): "
                                 "try again, or through another initial peer")
        print(f"revocation stored in the run's DHT (for {REVOCATION_TTL_DAYS:g} days)")


def _check_maddrs(maddrs: list[str]) -> None:
    if not maddrs:
        return
    from hivemind.utils.multiaddr import Multiaddr
    for text in maddrs:
        try:
            Multiaddr(text)
        except Exception as e:  # multiaddr raises several exception types, all meaning "cannot parse"
            raise AdmissionError(f"bad multiaddr {text!r} (--initial-peers): {e}") from None


def _publish(args: argparse.Namespace, revocation: bytes) -> bool:
    """Join the live run as a DHT client just long enough to store the revocation."""
    from sync.swarm import SwarmError, start_dht_node
    admission = Admission(load_organizer_public_key(args.key), args.run_id, own_ticket=None)
    try:
        # client_mode: it serves nothing and is gone in a second, so no other node should route to it.
        dht = start_dht_node(args.initial_peers, client_mode=True, **dht_admission_kwargs(args.run_id, admission))
    except SwarmError as e:
        raise AdmissionError(f"{e} (the revocation is in {args.out})") from None
    try:
        return publish_revocation(dht, args.run_id, args.peer_id, revocation, REVOCATION_TTL_DAYS)
    finally:
        dht.shutdown()


COMMANDS = {"keygen": _keygen, "peer-id": _peer_id, "sign": _sign, "revoke": _revoke}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        COMMANDS[args.command](args)
    except (AdmissionError, ValueError) as e:
        sys.stderr.write(f"{PROG} {args.command}: error: {' '.join(str(e).split())}\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
