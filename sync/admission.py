"""Closed runs (docs/DESIGN.md, "Closed runs"): organizer keys, tickets, revocations and the admission check at every door.

A run is closed when it has an organizer key (Ed25519). The organizer signs a *ticket* for each admitted peer:
its signature over (run id, peer ID, expiry). A *revocation* is the organizer's signature over (run id, peer ID)
and wins over any ticket. Each signed message carries a domain tag ("spes-ticket-v1" / "spes-revocation-v1")
inside the signed bytes, so a ticket's signature can never be replayed as a revocation or the other way round.

Wire format (msgpack, never pickle): `[payload, signature]` where `payload = msgpack([tag, run_id, peer_id, t])`
(t: the ticket's expiry, or the revocation's issue time, unix seconds) and `signature = Ed25519(payload)`. The
signature is checked before the payload is parsed any further.

`Gate` is the door check: is the libp2p-authenticated remote peer admitted right now? It reads the run's peer
records (each carrying the peer's ticket) and revocations from the DHT. hivemind is imported lazily, so that
`python -m peer.admit` starts in a fraction of a second.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import inspect
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import msgpack
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from sync.sourcelog import SourceLog

if TYPE_CHECKING:
    import hivemind
    from hivemind.p2p import PeerID

TICKET_TAG = "spes-ticket-v1"
REVOCATION_TAG = "spes-revocation-v1"
# A ticket or revocation is ~200 bytes; anything much larger is refused before msgpack even looks at it.
MAX_SIGNED_BYTES = 1024
# How long a published revocation lives in the DHT (the record validator accepts up to this, see publish_revocation).
REVOCATION_TTL_DAYS = 7.0
REFUSED_LOG_INTERVAL = 60.0  # seconds between two log lines about the same refused peer (Gate)
_DAY = 86400.0
_MEMO_SIZE = 4096


class AdmissionError(ValueError):
    """Bad closed-run input (key, ticket, identity); the one-line message names the cause and the fix."""


def _logger():
    # Lazy: see the module docstring. Every caller of this runs in a process that has hivemind loaded anyway.
    from hivemind.utils.logging import get_logger
    return get_logger(__name__)


# ---- keys -----------------------------------------------------------------------------------------------------


def generate_organizer_key(path: str) -> str:
    """Create an organizer key pair: the private key goes to `path` (PEM, mode 0600; an existing file is never
    overwritten: FileExistsError); returns the base64 public key, which is what peers pass as --organizer-key."""
    private_key = Ed25519PrivateKey.generate()
    pem = private_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
    # O_EXCL: refusing to overwrite is atomic, and the file is 0600 from its first byte (no chmod race).
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    return _public_b64(private_key.public_key())


def _public_b64(public_key: Ed25519PublicKey) -> str:
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def _load_private_key(path: str) -> Ed25519PrivateKey:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise AdmissionError(f"cannot read organizer key file {path}: {e.strerror}") from None
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        key = None
    if not isinstance(key, Ed25519PrivateKey):
        raise AdmissionError(f"{path} is not an organizer private key (python -m peer.admit keygen writes one)")
    return key


def _b64_decode(text: str) -> bytes | None:
    try:
        return base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None


def load_organizer_public_key(key_or_file: str) -> bytes:
    """The organizer's raw 32-byte public key from base64 text, a file holding it (or keygen's printed line), or
    the organizer's private key file. AdmissionError (a ValueError) with a one-line message otherwise."""
    text = str(key_or_file).strip()
    if not text:
        raise AdmissionError("empty organizer key")
    path = Path(text)
    if path.is_file():
        try:
            data = path.read_bytes()
        except OSError as e:
            raise AdmissionError(f"cannot read organizer key file {text}: {e.strerror}") from None
        if b"PRIVATE KEY" in data:
            private_key = _load_private_key(text)
            return private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        if b"PUBLIC KEY" in data:
            try:
                public_key = serialization.load_pem_public_key(data)
            except ValueError:
                public_key = None
            if not isinstance(public_key, Ed25519PublicKey):
                raise AdmissionError(f"{text} is not an Ed25519 organizer public key")
            return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        content = data.decode("utf-8", "replace").strip()
        content = content.split("organizer key:", 1)[-1]  # keygen's printed line, saved as is, works too
        raw = _b64_decode(content)
        if raw is None or len(raw) != 32:
            raise AdmissionError(f"{text} holds no organizer key (expected the base64 key that keygen prints)")
        return raw
    raw = _b64_decode(text)
    if raw is not None and len(raw) == 32:
        return raw
    raise AdmissionError(f"organizer key {text!r} is neither a base64 Ed25519 public key nor an existing key file")


# ---- peer IDs --------------------------------------------------------------------------------------------------


def check_peer_id(peer_id: str) -> str:
    """`peer_id` if it is a base58 libp2p peer ID (a sha2-256 or identity multihash); AdmissionError otherwise."""
    import base58
    import multihash
    try:
        decoded = multihash.decode(base58.b58decode(peer_id))
        ok = base58.b58encode(multihash.encode(decoded.digest, decoded.code)).decode() == peer_id and (
            decoded.name == "sha2-256" and len(decoded.digest) == 32 or decoded.code == 0 and decoded.digest)
    except Exception:  # base58 / multihash raise ValueError, TypeError, KeyError... all mean "not a peer ID"
        ok = False
    if not ok:
        raise AdmissionError(f"bad peer id {peer_id!r}: expected a base58 libp2p peer ID like 12D3KooW... or Qm...")
    return peer_id


def peer_id_from_identity(identity_path: str, create: bool = False) -> str:
    """The base58 peer ID of a libp2p identity file (hivemind's --identity-path); with `create`, a missing file is
    generated first (and its folder). AdmissionError naming the file if it is missing or not an identity."""
    from hivemind.p2p import PeerID

    from sync.records import create_identity
    path = Path(identity_path)
    if not path.exists():
        if not create:
            raise AdmissionError(f"identity file {identity_path} does not exist: create it and get its peer ID with "
                                 f"python -m peer.admit peer-id --identity-path {identity_path}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            create_identity(str(path))
        except OSError as e:
            raise AdmissionError(f"cannot create identity file {identity_path}: {e.strerror or e}") from None
    try:
        return PeerID.from_identity(path.read_bytes()).to_base58()
    except OSError as e:
        raise AdmissionError(f"cannot read identity file {identity_path}: {e.strerror}") from None
    except Exception:  # protobuf / DER parse errors of a file that is not a libp2p private key
        raise AdmissionError(f"{identity_path} is not a libp2p identity file") from None


# ---- signing ---------------------------------------------------------------------------------------------------


def _sign(private_key_path: str, fields: list) -> bytes:
    private_key = _load_private_key(private_key_path)
    payload = msgpack.packb(fields, use_bin_type=True)
    return msgpack.packb([payload, private_key.sign(payload)], use_bin_type=True)


def looks_closed(ticketed: list[bool]) -> bool:
    """Whether a peer without an organizer key is joining a closed run: most of the other live records it reads
    carry a ticket (one stranger's record with a made-up ticket cannot turn an open run away)."""
    return bool(ticketed) and 2 * sum(ticketed) > len(ticketed)


def _check_run_id(run_id: str) -> None:
    if not isinstance(run_id, str) or not run_id or any(c in run_id for c in " ./\\"):
        raise AdmissionError(f"run id must be non-empty without spaces, dots or slashes, got {run_id!r}")


def sign_ticket(private_key_path: str, run_id: str, peer_id: str, days: float) -> bytes:
    """The organizer's ticket for `peer_id` in `run_id`, valid for `days` from now (msgpack bytes)."""
    _check_run_id(run_id)
    check_peer_id(peer_id)
    if not (isinstance(days, (int, float)) and math.isfinite(days) and days > 0):
        raise AdmissionError(f"--days must be a positive number, got {days!r}")
    return _sign(private_key_path, [TICKET_TAG, run_id, peer_id, float(time.time() + days * _DAY)])


def sign_revocation(private_key_path: str, run_id: str, peer_id: str) -> bytes:
    """The organizer's revocation of `peer_id` in `run_id` (msgpack bytes); it outlives any ticket of the peer."""
    _check_run_id(run_id)
    check_peer_id(peer_id)
    return _sign(private_key_path, [REVOCATION_TAG, run_id, peer_id, float(time.time())])


def encode_signed(blob: bytes) -> str:
    """A ticket or revocation as one line of base64 text (what the CLI writes: safe to paste into a chat)."""
    return base64.b64encode(blob).decode()


def read_signed(ticket_or_file: str, what: str = "ticket") -> bytes:
    """A ticket (or revocation) from a file (base64 text or raw msgpack bytes) or from base64 text itself."""
    text = str(ticket_or_file).strip()
    path = Path(text)
    if text and path.is_file():
        try:
            data = path.read_bytes()
        except OSError as e:
            raise AdmissionError(f"cannot read {what} file {text}: {e.strerror}") from None
        decoded = _b64_decode(data.decode("ascii", "replace")) if data.isascii() else None
        return decoded if decoded else data
    decoded = _b64_decode(text) if text else None
    if not decoded:
        raise AdmissionError(f"{what} {text!r} is neither an existing {what} file nor base64 {what} text")
    return decoded


# ---- checking --------------------------------------------------------------------------------------------------


class _AdmissionSettings(Protocol):
    """What load_admission reads from the config (peer.config.AdmissionConfig)."""

    organizer_key: str
    ticket: str


class Admission:
    """Closed-run policy of one process: organizer public key, run id and (for a peer) its own ticket.

    Every check takes anything (DHT values are written by strangers) and answers False / None for garbage; it
    never raises. Signature checks are memoized (bounded), so re-reading the same records costs no crypto.
    No locks or threads: plain data, usable from any process.
    """

    def __init__(self, organizer_public_key: bytes, run_id: str, own_ticket: bytes | None = None):
        if not isinstance(organizer_public_key, (bytes, bytearray)) or len(organizer_public_key) != 32:
            raise AdmissionError("an organizer public key is 32 raw bytes (see load_organizer_public_key)")
        self.organizer_public_key = bytes(organizer_public_key)
        self.run_id = run_id
        self.own_ticket = own_ticket
        self._key = Ed25519PublicKey.from_public_bytes(self.organizer_public_key)
        self._memo: dict[tuple[str, bytes], list | None] = {}

    def __getstate__(self) -> dict[str, Any]:
        # cryptography's key objects do not pickle: keep the raw key and rebuild it.
        return {"organizer_public_key": self.organizer_public_key, "run_id": self.run_id,
                "own_ticket": self.own_ticket}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["organizer_public_key"], state["run_id"], state["own_ticket"])

    def _open(self, blob: object, tag: str) -> list | None:
        """The payload fields of an organizer-signed message with this tag, or None."""
        if not isinstance(blob, (bytes, bytearray, memoryview)) or len(blob) > MAX_SIGNED_BYTES:
            return None
        blob = bytes(blob)
        memo_key = (tag, blob)
        if memo_key in self._memo:
            return self._memo[memo_key]
        fields = None
        try:
            outer = msgpack.unpackb(blob, raw=False)
            if isinstance(outer, list) and len(outer) == 2 and all(isinstance(x, bytes) for x in outer):
                payload, signature = outer
                self._key.verify(signature, payload)  # before parsing anything the signer did not vouch for
                parsed = msgpack.unpackb(payload, raw=False)
                if (isinstance(parsed, list) and len(parsed) == 4 and parsed[0] == tag
                        and isinstance(parsed[1], str) and isinstance(parsed[2], str)
                        and isinstance(parsed[3], float) and math.isfinite(parsed[3])):
                    fields = parsed
        except Exception:  # InvalidSignature, or any of msgpack's many error types: all mean garbage
            fields = None
        if len(self._memo) >= _MEMO_SIZE:
            self._memo.clear()
        self._memo[memo_key] = fields
        return fields

    def explain_ticket(self, peer_id: str | PeerID, ticket: object, now: float | None = None) -> str | None:
        """Why `ticket` does not admit `peer_id` now ("is for run 'x', not 'y'", "expired at ..."), or None."""
        fields = self._open(ticket, TICKET_TAG)
        if fields is None:
            return "is not a ticket signed by this run's organizer key"
        _, run_id, ticket_peer, expires = fields
        if run_id != self.run_id:
            return f"is for run {run_id!r}, not {self.run_id!r}"
        if ticket_peer != str(peer_id):
            return f"is for peer {ticket_peer}, not {peer_id}"
        now = time.time() if now is None else now
        if expires <= now:
            return f"expired at {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(expires))}"
        return None

    def ticket_valid(self, peer_id: str | PeerID, ticket: object, now: float | None = None) -> bool:
        """True iff `ticket` is the organizer's unexpired ticket for exactly this peer in this run."""
        try:
            return self.explain_ticket(peer_id, ticket, now) is None
        except Exception:  # e.g. a peer_id whose str() fails: garbage in, False out
            return False

    def ticket_expiry(self, ticket: object) -> float | None:
        """The expiry (unix seconds) of an organizer-signed ticket of this run (expired or not), else None."""
        fields = self._open(ticket, TICKET_TAG)
        return fields[3] if fields is not None and fields[1] == self.run_id else None

    def revocation_valid(self, peer_id: str | PeerID, revocation: object) -> bool:
        """True iff `revocation` is the organizer's revocation of exactly this peer in this run."""
        try:
            fields = self._open(revocation, REVOCATION_TAG)
            return fields is not None and fields[1] == self.run_id and fields[2] == str(peer_id)
        except Exception:
            return False


def load_admission(cfg_admission: _AdmissionSettings, run_id: str, identity_path: str | None) -> Admission | None:
    """The Admission of a peer from its config section `admission` (None for an open run).

    A closed run needs the peer's ticket and its identity file (the ticket is signed for that identity's peer ID);
    the ticket must be for this run and this peer and unexpired. Otherwise AdmissionError with a one-line message,
    raised before anything is started.
    """
    key = (cfg_admission.organizer_key or "").strip()
    ticket_ref = (cfg_admission.ticket or "").strip()
    if not key:
        if ticket_ref:
            raise AdmissionError("--ticket (admission.ticket) is for a closed run: pass the run's --organizer-key too")
        return None
    public_key = load_organizer_public_key(key)
    if not ticket_ref:
        raise AdmissionError("this run is closed (admission.organizer_key is set): pass --ticket TICKET, the "
                             "organizer's ticket for this peer's ID (admission.ticket)")
    if not identity_path:
        raise AdmissionError("a closed run needs --identity-path FILE: the ticket is signed for the peer ID of that "
                             "identity (python -m peer.admit peer-id --identity-path FILE prints it)")
    peer_id = peer_id_from_identity(identity_path, create=False)
    ticket = read_signed(ticket_ref, "ticket")
    admission = Admission(public_key, run_id, own_ticket=ticket)
    problem = admission.explain_ticket(peer_id, ticket)
    if problem is not None:
        whose = f" (the peer ID of --identity-path {identity_path})" if problem.startswith("is for peer") else ""
        raise AdmissionError(f"ticket {ticket_ref} {problem}{whose}")
    return admission


def dht_admission_kwargs(run_id: str, admission: Admission | None) -> dict[str, Any]:
    """`run_id=` / `admission=` for sync.swarm.start_dht_node, as far as this build's start_dht_node takes them
    (it installs the run's record validator from them)."""
    from sync.swarm import start_dht_node
    params = inspect.signature(start_dht_node).parameters
    wanted = {"run_id": run_id, "admission": admission}
    return {name: value for name, value in wanted.items() if name in params}


# ---- the DHT side ----------------------------------------------------------------------------------------------


def publish_revocation(dht: "hivemind.DHT", run_id: str, peer_id: str, revocation: bytes,
                       ttl_days: float = REVOCATION_TTL_DAYS) -> bool:
    """Store a revocation in the live run (`{run_id}_revoked`, subkey = the revoked peer ID) for `ttl_days`.

    True if the run's DHT holds it afterwards. Re-publish before it expires if the peer's tickets live longer.
    """
    from hivemind.utils import get_dht_time

    from sync.dht import read_latest, store_record
    key, revocation = f"{run_id}_revoked", bytes(revocation)
    try:
        if store_record(dht, key, str(peer_id), revocation, get_dht_time() + ttl_days * _DAY):
            return True
        # Refused by every node it reached, or none answered: one that already held this revocation refuses it
        # again (it is no newer), so read it back instead.
        found = read_latest(dht, key)
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        return getattr(entries.get(str(peer_id)), "value", None) == revocation
    except Exception as e:  # a DHT that is down or refuses: the caller reports the failure
        _logger().warning(f"could not publish the revocation of {peer_id}: {e}")
        return False


def _entries(found: Any) -> dict[Any, Any]:
    """subkey -> value of a dictionary DHT value (hivemind's ValueWithExpiration items), live ones only."""
    if found is None or not isinstance(getattr(found, "value", None), dict):
        return {}
    now = time.time()
    return {subkey: getattr(item, "value", None) for subkey, item in found.value.items()
            if getattr(item, "expiration_time", 0) >= now}


class Gate:
    """Door check for closed runs: is the libp2p-authenticated remote peer admitted right now?

    Admitted = a live record under `{run_id}_peers` (subkey = its peer ID) whose "ticket" is valid, and no valid
    revocation under `{run_id}_revoked`. Both keys are read together into one snapshot, used for `refresh` seconds
    for every answer, positive and negative, then re-read at the next question (concurrent questions share one
    read). A failed read keeps the previous snapshot (none yet: nobody is admitted) until the next try, `refresh`
    seconds later. Ticket expiry is re-checked on every answer. `admits` never raises. Works on any asyncio loop
    of any process (the in-flight read is remembered per process and loop).
    """

    def __init__(self, dht: "hivemind.DHT", admission: Admission, refresh: float = 2.0, read_timeout: float = 10.0):
        self.dht, self.admission = dht, admission
        self.refresh, self.read_timeout = float(refresh), float(read_timeout)
        self.miss_refresh = min(0.25, self.refresh)
        self._admitted: dict[str, float] = {}  # peer ID -> its ticket's expiry, from the last good read
        self._read_at = -math.inf  # time.monotonic() of the last read attempt
        self._failing = False
        self._inflight: dict[tuple[int, int], tuple[asyncio.AbstractEventLoop, asyncio.Task]] = {}
        self._refused_log = SourceLog(REFUSED_LOG_INTERVAL)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_inflight"] = {}  # tasks belong to this process's loops
        return state

    async def admits(self, peer_id: "PeerID | str") -> bool:
        """Whether `peer_id` is admitted now (False for anything unexpected)."""
        try:
            key = peer_id.to_base58() if hasattr(peer_id, "to_base58") else str(peer_id)
            if time.monotonic() - self._read_at >= self.refresh:
                await self._refresh()
            elif key not in self._admitted and time.monotonic() - self._read_at >= self.miss_refresh:
                # A peer that just published its record (a joiner asking for the state) must not wait out the
                # whole refresh period; strangers can make this node re-read at most every miss_refresh s.
                await self._refresh()
            expiry = self._admitted.get(key)
            if expiry is not None and expiry > time.time():
                return True
            self._note_refused(key)
            return False
        except asyncio.CancelledError:
            raise
        except Exception as e:  # never let a door check take a handler down: refuse instead
            _logger().debug(f"admission check of {peer_id} failed: {e!r}")
            return False

    def _note_refused(self, peer_id: str) -> None:
        """One log line per refused peer per minute: who knocks without a ticket, not a line per request."""
        if self._refused_log.allow(peer_id):
            _logger().warning(f"refused peer ...{peer_id[-6:]}: no valid ticket for closed run "
                              f"{self.admission.run_id} (next line for it in a minute at the earliest)")

    def admits_sync(self, peer_id: "PeerID | str") -> bool:
        """admits() from code without an event loop (tests, CLIs); never call it from inside a loop."""
        return asyncio.run(self.admits(peer_id))

    async def _refresh(self) -> None:
        loop = asyncio.get_running_loop()
        slot = (os.getpid(), id(loop))
        entry = self._inflight.get(slot)
        if entry is None or entry[0] is not loop or entry[1].done():
            entry = (loop, loop.create_task(self._read()))
            self._inflight[slot] = entry
        try:
            await asyncio.shield(entry[1])  # one asker giving up must not cancel the others' read
        finally:
            if entry[1].done() and self._inflight.get(slot) is entry:
                del self._inflight[slot]

    async def _read(self) -> None:
        from sync.dht import read_latest
        run_id = self.admission.run_id
        try:
            peers_future = read_latest(self.dht, f"{run_id}_peers", return_future=True)
            revoked_future = read_latest(self.dht, f"{run_id}_revoked", return_future=True)
            peers, revoked = await asyncio.wait_for(asyncio.gather(peers_future, revoked_future), self.read_timeout)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # DHT down or slow: keep the last snapshot, try again after `refresh`
            if not self._failing:
                _logger().warning(f"closed run {run_id}: cannot read admissions from the DHT, keeping the last "
                                  f"answers: {e!r}")
            self._failing = True
            self._read_at = time.monotonic()
            return
        now = time.time()
        revoked_ids = {subkey for subkey, value in _entries(revoked).items()
                       if isinstance(subkey, str) and self.admission.revocation_valid(subkey, value)}
        admitted: dict[str, float] = {}
        for subkey, value in _entries(peers).items():
            if not isinstance(subkey, str) or subkey in revoked_ids or not isinstance(value, dict):
                continue
            ticket = value.get("ticket")
            # The record validator checked this already; checked again because the door must not rely on it.
            if self.admission.ticket_valid(subkey, ticket, now):
                admitted[subkey] = self.admission.ticket_expiry(ticket)
        if self._failing:
            _logger().info(f"closed run {run_id}: reading admissions from the DHT again")
        self._admitted, self._failing, self._read_at = admitted, False, time.monotonic()
