"""Closed runs (docs/DESIGN.md): tickets and revocations, `python -m peer.admit`, peer.run's admission flags, and the
door check (sync.admission.Gate) against real hivemind DHTs on 127.0.0.1 in this process.

Every DHT started here is shut down; p2pd daemons started from this module carry an environment marker, and the
module fails if one of them is left behind.
"""
from __future__ import annotations

import logging
import base64
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import hivemind
import msgpack
import pytest
from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_dht_time

from dht_bootstrap.node import BootstrapError, BootstrapNode
from sync.admission import (REVOCATION_TTL_DAYS, Admission, AdmissionError, Gate, check_peer_id,
                            generate_organizer_key, load_admission, load_organizer_public_key, peer_id_from_identity,
                            publish_revocation, read_signed, sign_revocation, sign_ticket)
from tests.conftest import REPO, peer_cmd

RUN = "closed-test"
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
MARK = ("SPES_ADMISSION_TEST", uuid.uuid4().hex)
PEER_A = "QmXfCrWyR4MUYwEbx5ZsbCCGXEvzJ1fqJW4ut3Jkzgjpyf"
PEER_B = "12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA"


def _our_p2pds() -> set[int]:
    found = subprocess.run(["pgrep", "-x", "p2pd"], capture_output=True, text=True).stdout.split()
    marker = f"{MARK[0]}={MARK[1]}".encode()
    ours = set()
    for pid in map(int, found):
        try:
            if marker in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                ours.add(pid)
        except OSError:  # gone meanwhile, or another user's
            pass
    return ours


@pytest.fixture(scope="module", autouse=True)
def no_leftover_p2pd():
    """Every p2pd started from this module (hivemind passes os.environ on) is gone when the module ends."""
    os.environ[MARK[0]] = MARK[1]
    try:
        yield
    finally:
        del os.environ[MARK[0]]
        deadline = time.monotonic() + 10
        while _our_p2pds() and time.monotonic() < deadline:  # shutdowns finish asynchronously
            time.sleep(0.2)
        left = _our_p2pds()
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, f"p2pd left behind: {left}"


@pytest.fixture(scope="module")
def org(tmp_path_factory) -> SimpleNamespace:
    """One organizer key pair for the module: its private key file, public key (base64) and an Admission."""
    path = str(tmp_path_factory.mktemp("org") / "org.key")
    public = generate_organizer_key(path)
    return SimpleNamespace(key=path, public=public, admission=Admission(load_organizer_public_key(public), RUN))


@pytest.fixture(scope="module")
def dhts():
    """Two DHT nodes of one swarm (the second joined through the first)."""
    first = hivemind.DHT(host_maddrs=LOOPBACK, start=True)
    nodes = [first]
    try:
        nodes.append(hivemind.DHT(initial_peers=first.get_visible_maddrs(), host_maddrs=LOOPBACK, start=True))
        yield nodes
    finally:
        for node in nodes:
            node.shutdown()


def _admit_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "peer.admit", *args]


def _run(cmd: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _run_together(cmds: list[list[str]], timeout: float = 60) -> list[subprocess.CompletedProcess]:
    """Run commands side by side (each pays its own hivemind/torch import: in parallel, once in wall time)."""
    procs = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd in cmds]
    done = []
    try:
        for cmd, proc in zip(cmds, procs):
            out, err = proc.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(cmd, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return errors[0]


# ---- tickets and revocations ---------------------------------------------------------------------------------


def test_ticket_round_trip(org):
    ticket = sign_ticket(org.key, RUN, PEER_A, days=2)
    assert org.admission.ticket_valid(PEER_A, ticket)
    assert org.admission.ticket_valid(PeerID.from_base58(PEER_A), ticket)
    assert abs(org.admission.ticket_expiry(ticket) - (time.time() + 2 * 86400)) < 60
    payload, _ = msgpack.unpackb(ticket)
    assert msgpack.unpackb(payload)[:3] == ["spes-ticket-v1", RUN, PEER_A]  # the domain tag is what is signed


def test_bad_tickets_are_refused(org, tmp_path):
    ticket = sign_ticket(org.key, RUN, PEER_A, days=1)
    other_org = str(tmp_path / "other.key")
    generate_organizer_key(other_org)
    tampered = bytearray(ticket)
    tampered[len(ticket) // 3] ^= 0x01  # inside the signed payload
    payload, signature = msgpack.unpackb(ticket)
    forged_payload = msgpack.packb(["spes-ticket-v1", RUN, PEER_B, 1e12])
    admission = org.admission
    assert not admission.ticket_valid(PEER_A, bytes(tampered))
    assert not admission.ticket_valid(PEER_B, msgpack.packb([forged_payload, signature]))  # a signature moved over
    assert not admission.ticket_valid(PEER_A, ticket, now=admission.ticket_expiry(ticket) + 1)
    assert "expired at" in admission.explain_ticket(PEER_A, ticket, now=admission.ticket_expiry(ticket) + 1)
    assert not admission.ticket_valid(PEER_B, ticket)
    assert not Admission(admission.organizer_public_key, "another-run").ticket_valid(PEER_A, ticket)
    assert Admission(admission.organizer_public_key, "another-run").ticket_expiry(ticket) is None
    assert not admission.ticket_valid(PEER_A, sign_ticket(other_org, RUN, PEER_A, days=1))
    garbage = [None, b"", b"\x00" * 64, ticket[:-1], ticket + b"\x00", ticket * 10, "text", 7, {"a": 1},
               [payload, signature], msgpack.packb([payload]), msgpack.packb([payload, signature, b""]),
               msgpack.packb({"payload": payload}), os.urandom(150)]
    for item in garbage:
        assert not admission.ticket_valid(PEER_A, item)
        assert admission.ticket_expiry(item) is None
        assert not admission.revocation_valid(PEER_A, item)
    assert not admission.ticket_valid(object(), ticket)


def test_revocations(org):
    revocation = sign_revocation(org.key, RUN, PEER_A)
    ticket = sign_ticket(org.key, RUN, PEER_A, days=1)
    admission = org.admission
    assert admission.revocation_valid(PEER_A, revocation)
    assert not admission.revocation_valid(PEER_B, revocation)
    assert not Admission(admission.organizer_public_key, "another-run").revocation_valid(PEER_A, revocation)
    # Domain separation both ways: a revocation admits nobody, a ticket revokes nobody.
    assert not admission.ticket_valid(PEER_A, revocation)
    assert admission.ticket_expiry(revocation) is None
    assert not admission.revocation_valid(PEER_A, ticket)


def test_keys_and_peer_ids(org, tmp_path):
    assert oct(os.stat(org.key).st_mode & 0o777) == "0o600"
    raw = load_organizer_public_key(org.public)
    assert len(raw) == 32 and base64.b64encode(raw).decode() == org.public
    assert load_organizer_public_key(org.key) == raw  # the private key file works as KEY_OR_FILE too
    (tmp_path / "pub.txt").write_text(f"organizer key: {org.public}\n")  # keygen's line, saved as is
    assert load_organizer_public_key(str(tmp_path / "pub.txt")) == raw
    with pytest.raises(FileExistsError):
        generate_organizer_key(org.key)
    for bad in ("", "abc", str(tmp_path / "missing.key"), base64.b64encode(b"x" * 31).decode()):
        with pytest.raises(ValueError) as info:
            load_organizer_public_key(bad)
        assert "\n" not in str(info.value)
    assert check_peer_id(PEER_A) == PEER_A and check_peer_id(PEER_B) == PEER_B
    for bad in ("", "abc", PEER_A[:-1], PEER_A + "1", "0" + PEER_A):
        with pytest.raises(AdmissionError, match="bad peer id"):
            check_peer_id(bad)


def test_load_admission(org, tmp_path):
    identity = str(tmp_path / "id.key")
    P2P.generate_identity(identity)
    peer_id = peer_id_from_identity(identity)
    ticket_file = tmp_path / "ticket"
    ticket_file.write_text(base64.b64encode(sign_ticket(org.key, RUN, peer_id, days=1)).decode() + "\n")

    def load(key: str = org.public, ticket: str = str(ticket_file), path: str | None = identity, run: str = RUN):
        return load_admission(SimpleNamespace(organizer_key=key, ticket=ticket), run, path)

    assert load(key="", ticket="") is None  # an open run
    admission = load()
    assert admission.run_id == RUN and admission.ticket_valid(peer_id, admission.own_ticket)
    assert load(ticket=ticket_file.read_text()).own_ticket == admission.own_ticket  # base64 text instead of a file
    for kwargs, message in [(dict(key=""), "is for a closed run"), (dict(ticket=""), "pass --ticket"),
                            (dict(path=None), "--identity-path"), (dict(run="other"), "is for run"),
                            (dict(path=str(tmp_path / "nope.key")), "does not exist"),
                            (dict(ticket=str(tmp_path / "nope")), "neither an existing ticket file")]:
        with pytest.raises(AdmissionError, match=message):
            load(**kwargs)


# ---- python -m peer.admit --------------------------------------------------------------------------------------


def test_cli_keygen_peer_id_sign_revoke(org, tmp_path, capsys):
    key = tmp_path / "org.key"
    proc = _run(_admit_cmd("keygen", "--out", str(key)))
    assert proc.returncode == 0, proc.stderr
    match = re.fullmatch(r"organizer key: (\S+)\n", proc.stdout)
    assert match and load_organizer_public_key(match.group(1)) == load_organizer_public_key(str(key))
    assert "refusing to overwrite" in _one_error_line(_run(_admit_cmd("keygen", "--out", str(key))))

    identity = tmp_path / "ids" / "peer.key"  # its folder is created too
    proc = _run(_admit_cmd("peer-id", "--identity-path", str(identity)))  # creates it
    assert proc.returncode == 0, proc.stderr
    peer_id = re.fullmatch(r"peer id: (\S+)\n", proc.stdout).group(1)
    assert peer_id == peer_id_from_identity(str(identity))
    from peer.admit import main  # again, in this process (one hivemind import less): the same file, the same ID
    assert main(["peer-id", "--identity-path", str(identity)]) == 0
    assert capsys.readouterr().out == proc.stdout

    admission = Admission(load_organizer_public_key(match.group(1)), RUN)
    proc = _run(_admit_cmd("sign", "--key", str(key), "--run-id", RUN, "--peer-id", peer_id, "--days", "3",
                           "--out", str(tmp_path / "ticket")))
    assert proc.returncode == 0 and proc.stdout.startswith("ticket: "), proc.stderr
    ticket = read_signed(str(tmp_path / "ticket"))
    assert admission.ticket_valid(peer_id, ticket)
    assert abs(admission.ticket_expiry(ticket) - time.time() - 3 * 86400) < 120
    proc = _run(_admit_cmd("revoke", "--key", str(key), "--run-id", RUN, "--peer-id", peer_id,
                           "--out", str(tmp_path / "revocation")))
    assert proc.returncode == 0 and proc.stdout.startswith("revocation: "), proc.stderr
    assert admission.revocation_valid(peer_id, read_signed(str(tmp_path / "revocation"), "revocation"))


@pytest.mark.parametrize("args, cause", [
    (["sign", "--key", "{dir}/missing.key", "--run-id", RUN, "--peer-id", PEER_A, "--out", "{dir}/t"],
     "cannot read organizer key file"),
    (["sign", "--key", "{key}", "--run-id", RUN, "--peer-id", "not-a-peer", "--out", "{dir}/t"], "bad peer id"),
    (["sign", "--key", "{key}", "--run-id", "a.b", "--peer-id", PEER_A, "--out", "{dir}/t"], "run id"),
    (["sign", "--key", "{key}", "--run-id", RUN, "--peer-id", PEER_A, "--days", "-1", "--out", "{dir}/t"], "--days"),
    (["sign", "--key", "{key}", "--run-id", RUN, "--peer-id", PEER_A, "--out", "{dir}/no/such/dir/t"],
     "cannot write"),
    (["sign", "--key", "{key}", "--run-id", RUN, "--peer-id", PEER_A], "--out"),
    (["frobnicate"], "invalid choice"),
])
def test_cli_errors_are_one_line(org, tmp_path, args, cause):
    args = [a.format(dir=tmp_path, key=org.key) for a in args]
    assert cause in _one_error_line(_run(_admit_cmd(*args)))
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("args, cause", [
    (["revoke", "--key", "{key}", "--run-id", RUN, "--peer-id", PEER_A, "--out", "{dir}/r", "--initial-peers",
      "garbage"], "bad multiaddr 'garbage'"),
    (["revoke", "--key", "{key}", "--run-id", RUN, "--peer-id", PEER_A, "--out", "{dir}/r", "--initial-peers",
      "/ip4/127.0.0.1/tcp/1/p2p/" + PEER_A], "cannot reach any initial peer"),
    (["peer-id", "--identity-path", "{key}"], "is not a libp2p identity file"),
])
def test_cli_errors_that_load_hivemind(org, tmp_path, capsys, args, cause):
    """The same one-line errors from the commands that need hivemind (run in this process: it is loaded here)."""
    from peer.admit import main
    assert main([a.format(dir=tmp_path, key=org.key) for a in args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: " in err and cause in err, err


def test_cli_help_covers_every_flag():
    for command in ("keygen", "peer-id", "sign", "revoke"):
        text = _run(_admit_cmd(command, "--help")).stdout
        flags = set(re.findall(r"(--[a-z-]+) [A-Z_]+", text))
        assert flags, text
        for flag in flags:
            assert re.search(rf"{flag} [A-Z_]+(?: \[[A-Z_ .]+\])?\s+\S", text), (flag, text)


# ---- peer.run and dht_bootstrap flags --------------------------------------------------------------------------


def test_peer_run_refuses_bad_admission_before_starting(org, tmp_path):
    identity = str(tmp_path / "id.key")
    P2P.generate_identity(identity)
    other_peer_ticket = tmp_path / "ticket"
    other_peer_ticket.write_bytes(sign_ticket(org.key, RUN, PEER_A, days=1))  # raw msgpack bytes work too
    base = ["--config", "configs/tiny.yaml", "--run-id", RUN, "--run-dir", str(tmp_path / "run"),
            "--organizer-key", org.public, "--identity-path", identity]
    cases = [([], "pass --ticket"), (["--ticket", str(other_peer_ticket)], f"is for peer {PEER_A}")]
    start = time.monotonic()
    procs = _run_together([peer_cmd(*base, *extra) for extra, _ in cases])
    assert time.monotonic() - start < 30
    for proc, (_, cause) in zip(procs, cases):
        assert cause in _one_error_line(proc)
    assert not (tmp_path / "run").exists()  # before the run dir, the model or the DHT


def test_bootstrap_organizer_key(org):
    with pytest.raises(BootstrapError, match="organizer key 'garbage'"):
        BootstrapNode(RUN, 4, LOOPBACK, organizer_key="garbage")  # refused before any process starts
    with BootstrapNode(RUN, 4, LOOPBACK, organizer_key=org.key) as node:
        assert node.admission is not None and node.admission.own_ticket is None
        assert node.admission.organizer_public_key == org.admission.organizer_public_key
        assert node.dht.is_alive()


# ---- the door: Gate against a real DHT -------------------------------------------------------------------------


def _fork_admits(gate: Gate, peer_ids: list[str], conn) -> None:
    conn.send([gate.admits_sync(p) for p in peer_ids])
    conn.close()


@pytest.mark.unit
def test_a_run_looks_closed_when_most_other_records_carry_tickets():
    from sync.admission import looks_closed
    assert looks_closed([True, True]) and looks_closed([True, True, False])
    assert not looks_closed([]) and not looks_closed([True, False]) and not looks_closed([False, False, True])


def test_gate_admits_ticket_holders_until_revoked(org, dhts):
    holder, stranger = dhts
    holder_id, stranger_id = str(holder.peer_id), str(stranger.peer_id)
    ttl = get_dht_time() + 60
    holder.store(f"{RUN}_peers", subkey=holder_id, expiration_time=ttl,
                 value={"experts": [0], "ticket": sign_ticket(org.key, RUN, holder_id, days=1)})
    stranger.store(f"{RUN}_peers", subkey=stranger_id, value={"experts": [1]}, expiration_time=ttl)
    # A ticket copied from someone else, and one for another run, admit nobody.
    stranger.store(f"{RUN}_peers", subkey=PEER_B, value={"ticket": sign_ticket(org.key, RUN, PEER_A, days=1)},
                   expiration_time=ttl)
    stranger.store(f"{RUN}_peers", subkey=PEER_A, value={"ticket": sign_ticket(org.key, "other", PEER_A, days=1)},
                   expiration_time=ttl)
    refresh = 1.0
    gate = Gate(stranger, Admission(org.admission.organizer_public_key, RUN), refresh=refresh)
    assert gate.admits_sync(holder.peer_id)
    assert not gate.admits_sync(stranger.peer_id)
    assert not gate.admits_sync(PEER_A) and not gate.admits_sync(PEER_B) and not gate.admits_sync("garbage")

    # Each refused peer is named in the log once a minute, however often it knocks (issue 34 item 2).
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("sync.admission").addHandler(handler)
    try:
        fresh = Gate(stranger, Admission(org.admission.organizer_public_key, RUN), refresh=refresh)
        for _ in range(5):
            assert not fresh.admits_sync(stranger.peer_id)
    finally:
        logging.getLogger("sync.admission").removeHandler(handler)
    lines = [m for m in logged if "no valid ticket" in m and stranger_id[-6:] in m]
    assert len(lines) == 1 and RUN in lines[0], logged

    # The gate must answer from a forked process as well (the DHT process validates records).
    receiver, sender = mp.get_context("fork").Pipe(duplex=False)
    child = mp.get_context("fork").Process(target=_fork_admits, args=(gate, [holder_id, stranger_id], sender))
    child.start()
    try:
        assert receiver.poll(30)
        assert receiver.recv() == [True, False]
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()

    # A revocation that is not the organizer's (here: a ticket in its place) changes nothing...
    stranger.store(f"{RUN}_revoked", subkey=holder_id, value=sign_ticket(org.key, RUN, holder_id, days=1),
                   expiration_time=get_dht_time() + 30)
    time.sleep(refresh)
    assert gate.admits_sync(holder_id)
    # ...the organizer's revocation refuses the peer within the refresh time (plus one DHT read).
    assert publish_revocation(holder, RUN, holder_id, sign_revocation(org.key, RUN, holder_id))
    published = time.monotonic()
    while gate.admits_sync(holder_id):
        assert time.monotonic() - published < refresh + 2.0, "a revoked peer is still admitted"
        time.sleep(0.1)
    found = stranger.get(f"{RUN}_revoked", latest=True).value[holder_id]
    assert abs(found.expiration_time - get_dht_time() - REVOCATION_TTL_DAYS * 86400) < 60


def test_cli_revoke_publishes_into_the_live_run(org, dhts, tmp_path, capsys):
    first, second = dhts
    run_id = "closed-test-cli"
    peer_id = str(second.peer_id)
    second.store(f"{run_id}_peers", subkey=peer_id, value={"ticket": sign_ticket(org.key, run_id, peer_id, days=1)},
                 expiration_time=get_dht_time() + 60)
    gate = Gate(first, Admission(org.admission.organizer_public_key, run_id), refresh=0.5)
    assert gate.admits_sync(peer_id)
    from peer.admit import main  # in this process (hivemind is loaded here); its DHT client is shut down by main
    assert main(["revoke", "--key", org.key, "--run-id", run_id, "--peer-id", peer_id,
                 "--out", str(tmp_path / "revocation"), "--initial-peers", *map(str, first.get_visible_maddrs())]) == 0
    assert "revocation stored in the run's DHT" in capsys.readouterr().out
    time.sleep(0.5)
    assert not gate.admits_sync(peer_id)
