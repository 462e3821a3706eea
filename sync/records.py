"""Signed, schema-checked, time-bounded DHT records of a run (docs/DESIGN.md, "Hostile peers: DHT records").

Every DHT node of a run (peers and the bootstrap node) runs `RunRecordValidator`, so a record that fails it is
neither stored by an honest node nor accepted from any node's answer. For the run's keys:

- `{run_id}_peers` and its shards `{run_id}_peers_{level}_{prefix}` (sync/roster.py: only records of peers in
  that shard), and `{run_id}_drawn`; subkey = a base58 peer ID: the value must be signed by the libp2p identity
  key of exactly that peer ID (the public key travels in the value; the peer ID is the multihash of it, as
  libp2p derives it), so only the holder of a peer's key can write, replace or tombstone that peer's record. The payload must match
  the schema of `sync.swarm.PeerRecord` exactly (bounded ints, expert indices in range), and in a closed run it
  must carry a valid organizer ticket for that peer ID.
- `{run_id}_revoked`, subkey = a base58 peer ID: only organizer-signed revocations of that peer (closed runs).
- `{run_id}_settings`, subkey = a settings fingerprint (sync/settings.py): the value must be a bounded flat
  settings map whose fingerprint is the subkey (content-addressed: no signature needed, nothing false can be
  planted under a fingerprint).
- On all of them, an expiration later than now + the key's lifetime bound is refused: no far-future tombstone or
  claim can be planted, and whatever a peer wrote dies within `record_ttl` once it stops refreshing it.

Every other key is refused: a stranger cannot park junk on the run's DHT nodes (they store nothing else).

Verification is cheap first: a public key other than RSA 2048-4096 bits with exponent 65537 (what libp2p
identities use) is refused before its signature is checked (verifying costs grow with the exponent's size);
a value already verified (same key, subkey, value and expiration: the DHT hands the same
records back on every read) is not verified again; and at most `MAX_RUN_RECORDS` peer IDs hold live records on
one node (a flood of fresh identities fills that, not the node's memory and CPU).

Wire format of a signed value: MSGPack `[b"spes-record-v1", payload, public_key_der, signature]`, where the
signature (RSA PKCS#1 v1.5, SHA-256, as libp2p's RSA keys sign) covers MSGPack `[tag, dht key id, subkey bytes,
payload, expiration]`. Nothing here is unpickled.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from typing import Any

import multihash
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.logging import get_logger
from hivemind.utils.serializer import MSGPackSerializer

from sync.roster import MAX_ESTIMATE, MAX_LEVEL, drawn_key, peers_key, roster_key_names, shard_prefix  # noqa: F401 (peers_key: API)
from sync.settings import SETTINGS_LIFETIME, fingerprint, is_fingerprint, is_settings, settings_key
from sync.validate import RejectCounter

logger = get_logger(__name__)

RECORD_TAG = b"spes-record-v1"
# Schema bounds. Rounds stay far below 2**31 in any real run (a round every few seconds for a century is
# ~1e9) and far below anything that overflows a counter; steps and tokens have room for decades of training.
MAX_ROUND, MAX_STEP, MAX_TOKENS = 2**31 - 1, 2**40, 2**62
MAX_TICKET_BYTES, MAX_VALUE_BYTES = 2048, 16384
RSA_EXPONENT, RSA_BITS = 65537, (2048, 4096)  # libp2p RSA identities (hivemind makes 2048-bit ones)
# Live peer IDs with a record on one node. Every read of the run parses all of them; far above the swarms this
# protocol is measured with (issue "Many peers"), far below what costs a node noticeable memory or CPU.
MAX_RUN_RECORDS = 1024
VERIFIED_CACHE = 4 * MAX_RUN_RECORDS  # verified (key, subkey, value, expiration) digests remembered
# Revocations must outlive the tickets they revoke; they are organizer-signed, so a long bound plants nothing.
REVOCATION_LIFETIME = 366 * 86400.0
_RECORD_FIELDS = {"experts", "round", "step", "tokens"}
# budget: the most experts the peer may own; caretaking: owned experts it only holds until another peer takes them
# (sync.ownership, docs/DESIGN.md "Coverage").
# finished: the peer completed its fixed-length run and left; its experts are not adopted (docs/DESIGN.md
# "Coverage").
# claims: experts a joiner (owning none yet) means to take (sync.swarm.Swarm.choose_auto).
# origin: [machine hash, PID, start ms] of the publishing process (sync.peer_record.process_origin).
# left: in a clean leave's tombstone (no experts), the experts the peer owned (sync.ownership adopts them at once).
# due: [round, DHT time] when the peer expects to be ready to start that round (sync.schedule).
# contrib: [round, size, sha256 hex, weight, experts] of the peer's contribution blob (sync/contributions.py);
# prev: the contribution before `contrib`, same form, an older round (a peer behind still finds it).
# synced: [round, digest hex] of its synchronized tensors after applying that round.
# cfg: the fingerprint of the peer's run settings (sync/settings.py).
# lvl: the roster level the peer reads at, 1..MAX_LEVEL; est: N as its last shard read counted it (sync/roster.py).
_OPTIONAL_FIELDS = {"ticket", "budget", "caretaking", "finished", "claims", "origin", "left", "due",
                    "contrib", "prev", "synced", "cfg", "lvl", "est"}
MAX_BLOB_BYTES = 2**36  # a contribution of a model far beyond the paper's shapes, uncompressed, stays under it
MAX_DUE_TIME = 2.0 ** 34  # seconds since the epoch: year 2514; readers bound it by their own clock (sync.schedule)


def revoked_key(run_id: str) -> str:
    return f"{run_id}_revoked"


def _key_id(key: str) -> bytes:
    return DHTID.generate(source=key).to_bytes()


def peer_id_of_public_key(public_key_der: bytes) -> PeerID:
    """The libp2p peer ID of an RSA public key (DER SubjectPublicKeyInfo): sha2-256 multihash of its protobuf."""
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=public_key_der).SerializeToString()
    return PeerID(multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256")))


def load_identity(identity_path: str) -> rsa.RSAPrivateKey:
    """The RSA private key of a libp2p identity file written by hivemind (protobuf PrivateKey, DER data)."""
    with open(identity_path, "rb") as f:
        proto = crypto_pb2.PrivateKey.FromString(f.read())
    if proto.key_type != crypto_pb2.RSA:
        raise ValueError(f"identity {identity_path} is not an RSA key (hivemind identities are)")
    key = serialization.load_der_private_key(proto.data, password=None)
    if not isinstance(key, rsa.RSAPrivateKey):
        raise ValueError(f"identity {identity_path} holds no RSA private key")
    return key


def create_identity(identity_path: str) -> bool:
    """Write a fresh libp2p identity to `identity_path` unless a file is there already; True if this call wrote it.
    The key is written to a temp file in the same folder and then linked in place, which fails rather than
    overwrites: two processes started together with one path both end up with the one key that landed first.
    (hivemind's generate_identity truncates and rewrites the path: each process would load its own key, or half
    of the other's file, and the two would run as unrelated peers sharing one identity file.)"""
    if os.path.exists(identity_path):
        return False  # no RSA key generated for nothing
    fd, temp = tempfile.mkstemp(prefix=".identity-", dir=os.path.dirname(os.path.abspath(identity_path)))
    os.close(fd)
    try:
        P2P.generate_identity(temp)
        try:
            os.link(temp, identity_path)
            return True
        except FileExistsError:
            return False
        except OSError:  # a file system without hard links (some FAT and network mounts): exclusive create instead
            with open(temp, "rb") as f:
                return _create_exclusive(identity_path, f.read())
    finally:
        os.unlink(temp)


def _create_exclusive(path: str, data: bytes) -> bool:
    """Write `data` to a new file at `path` (mode 0400); False if a file is there already."""
    try:
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    except FileExistsError:
        return False
    with os.fdopen(out, "wb") as f:
        f.write(data)
    return True


def ephemeral_identity() -> tuple[str, str]:
    """A fresh identity file in a private temp dir (for a peer without --identity-path): (path, its dir).
    The peer must know its private key to sign its records, so p2pd may not generate one on its own."""
    directory = tempfile.mkdtemp(prefix="spes-identity-")
    path = os.path.join(directory, "identity.key")
    create_identity(path)
    return path, directory


def _expert_list(experts: Any, num_experts: int) -> bool:
    return (isinstance(experts, list) and len(experts) <= num_experts and len(set(experts)) == len(experts)
            and all(type(e) is int and 0 <= e < num_experts for e in experts))


def is_due(due: Any) -> bool:
    """A record's `due` field: [round, DHT time in seconds], both in range (a NaN is not: nan <= x is False)."""
    return (isinstance(due, list) and len(due) == 2 and type(due[0]) is int and 0 <= due[0] <= MAX_ROUND
            and type(due[1]) in (int, float) and 0 <= due[1] <= MAX_DUE_TIME)


def _is_hex(value: Any, length: int) -> bool:
    return isinstance(value, str) and len(value) == length and all(c in "0123456789abcdef" for c in value)


def is_contrib(value: Any, num_experts: int) -> bool:
    """A record's `contrib` field: [round, size, sha256 hex (64), weight, experts], each in range."""
    return (isinstance(value, list) and len(value) == 5 and type(value[0]) is int and 0 <= value[0] <= MAX_ROUND
            and type(value[1]) is int and 0 < value[1] <= MAX_BLOB_BYTES and _is_hex(value[2], 64)
            and type(value[3]) is int and 0 <= value[3] <= MAX_TOKENS and _expert_list(value[4], num_experts))


def is_origin(value: Any) -> bool:
    """A record's `origin` field: [machine hash (16 hex), PID] or [machine hash, PID, start ms]."""
    return (isinstance(value, list) and len(value) in (2, 3) and isinstance(value[0], str) and len(value[0]) == 16
            and type(value[1]) is int and 0 < value[1] < 2 ** 32
            and (len(value) == 2 or (type(value[2]) is int and 0 <= value[2] < 2 ** 53)))


def is_synced(value: Any) -> bool:
    """A record's `synced` field: [round, digest hex (32)]."""
    return (isinstance(value, list) and len(value) == 2 and type(value[0]) is int and 0 <= value[0] <= MAX_ROUND
            and _is_hex(value[1], 32))


def check_record_payload(value: Any, num_experts: int) -> bool:
    """The exact schema of a peer record's payload (see sync.swarm.PeerRecord.to_value)."""
    if not isinstance(value, dict) or not _RECORD_FIELDS <= set(value) <= _RECORD_FIELDS | _OPTIONAL_FIELDS:
        return False
    if "finished" in value and value["finished"] is not True:
        return False
    if "budget" in value and not (type(value["budget"]) is int and 1 <= value["budget"] <= num_experts):
        return False
    experts = value["experts"]
    if not _expert_list(experts, num_experts):
        return False
    caretaking = value.get("caretaking", [])
    if not _expert_list(caretaking, num_experts) or not set(caretaking) <= set(experts):
        return False
    if not _expert_list(value.get("claims", []), num_experts):
        return False
    if not _expert_list(value.get("left", []), num_experts) or (value.get("left") and experts):
        return False
    if "origin" in value and not is_origin(value["origin"]):
        return False
    if "due" in value and not is_due(value["due"]):
        return False
    if "contrib" in value and not is_contrib(value["contrib"], num_experts):
        return False
    if "prev" in value and not ("contrib" in value and is_contrib(value["prev"], num_experts)
                                and value["prev"][0] < value["contrib"][0]):
        return False
    if "synced" in value and not is_synced(value["synced"]):
        return False
    if "cfg" in value and not is_fingerprint(value["cfg"]):
        return False
    if "lvl" in value and not (type(value["lvl"]) is int and 1 <= value["lvl"] <= MAX_LEVEL):
        return False
    if "est" in value and not (type(value["est"]) is int and 1 <= value["est"] <= MAX_ESTIMATE):
        return False
    for name, bound in (("round", MAX_ROUND), ("step", MAX_STEP), ("tokens", MAX_TOKENS)):
        if type(value[name]) is not int or not 0 <= value[name] <= bound:
            return False
    ticket = value.get("ticket", b"")
    return isinstance(ticket, bytes) and len(ticket) <= MAX_TICKET_BYTES


class RunRecordValidator(RecordValidatorBase):
    """Signs this node's own peer record and validates every record of the run's keys (module docstring).

    private_key: this node's libp2p identity key (None for a node that publishes no record: the bootstrap);
    record_ttl + slack: the furthest future expiration accepted for a peer record;
    admission: a closed run's policy (sync.admission.Admission) or None for an open run;
    rejects: where refused records are counted (reason "record"); shared memory, works from the DHT process.
    """

    def __init__(self, run_id: str, num_experts: int, private_key: rsa.RSAPrivateKey | None = None,
                 record_ttl: float = 30.0, slack: float = 10.0, admission=None,
                 rejects: RejectCounter | None = None):
        self.run_id, self.num_experts = run_id, num_experts
        self.max_lifetime = record_ttl + slack
        self.admission, self.rejects = admission, rejects
        self._revoked_key = _key_id(revoked_key(run_id))
        # Every shard key -> (level, prefix), and the drawn key as (-1, 0): any peer's record may go there.
        self._record_keys = {_key_id(name): where for name, where in roster_key_names(run_id).items()}
        self._record_keys[_key_id(drawn_key(run_id))] = (-1, 0)
        self._settings_key = _key_id(settings_key(run_id))
        self._private_key = private_key
        self._own_subkey = self._public_der = None
        if private_key is not None:
            self._public_der = private_key.public_key().public_bytes(
                serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
            self._own_subkey = MSGPackSerializer.dumps(peer_id_of_public_key(self._public_der).to_base58())
        # Peers whose revocation this node has validated: their records are refused from then on.
        self._revoked: set[str] = set()
        # Digests of records that passed -> their peer ID, oldest first (VERIFIED_CACHE): a read hands every record
        # back from every node it asks, so a repeat costs a hash, not a base58 decode and a signature check.
        self._verified: dict[bytes, str] = {}
        self._live: dict[str, float] = {}  # peer ID -> the latest expiration of its record seen (MAX_RUN_RECORDS)

    @property
    def priority(self) -> int:
        return 20  # validate before any validator that would deserialize the value

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False

    # ---- signing ---------------------------------------------------------------------------------------

    @staticmethod
    def _signed_message(record: DHTRecord, payload: bytes) -> bytes:
        return MSGPackSerializer.dumps([RECORD_TAG, record.key, record.subkey, payload, record.expiration_time])

    def sign_value(self, record: DHTRecord) -> bytes:
        if record.key not in self._record_keys or self._private_key is None or record.subkey != self._own_subkey:
            return record.value  # not ours to sign: it will only pass if no signature is needed
        signature = self._private_key.sign(self._signed_message(record, record.value), padding.PKCS1v15(),
                                           hashes.SHA256())
        return MSGPackSerializer.dumps([RECORD_TAG, record.value, self._public_der, signature])

    def strip_value(self, record: DHTRecord) -> bytes:
        if record.key not in self._record_keys:
            return record.value
        try:
            return MSGPackSerializer.loads(record.value)[1]
        except Exception:  # only called after validate() passed, so this is unreachable for our key
            return record.value

    # ---- validation ------------------------------------------------------------------------------------

    def validate(self, record: DHTRecord) -> bool:
        where = self._record_keys.get(record.key)
        if where is not None:
            ok = self._validate_peer_record(record, where)
        elif record.key == self._revoked_key:
            ok = self._validate_revocation(record)
        elif record.key == self._settings_key:
            ok = self._validate_settings(record)
        else:
            ok = False  # not a key of this run: nothing of the run's is stored there
        if not ok and self.rejects is not None:
            self.rejects.add("record")
        return ok

    def _subkey_peer(self, record: DHTRecord) -> str | None:
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
            return subkey if isinstance(subkey, str) and len(subkey) < 100 and PeerID.from_base58(subkey) else None
        except Exception:
            return None

    def _validate_peer_record(self, record: DHTRecord, where: tuple[int, int] = (0, 0)) -> bool:
        now = get_dht_time()
        if record.expiration_time > now + self.max_lifetime or len(record.value) > MAX_VALUE_BYTES:
            return False
        digest = hashlib.sha256(MSGPackSerializer.dumps(
            [record.key, record.subkey, record.value, record.expiration_time])).digest()
        cached = self._verified.get(digest)
        peer_id = cached or self._subkey_peer(record)
        if peer_id is None or peer_id in self._revoked or not self._room_for(peer_id, now):
            return False
        if where[0] > 0 and shard_prefix(peer_id, where[0]) != where[1]:
            return False  # a shard holds only its own peers' records (sync/roster.py)
        if cached is not None:
            ok = True
        else:
            ok = self._verify_peer_record(record, peer_id)
            if ok:
                self._verified[digest] = peer_id
                while len(self._verified) > VERIFIED_CACHE:
                    del self._verified[next(iter(self._verified))]
        if ok:
            self._live[peer_id] = max(self._live.get(peer_id, 0.0), record.expiration_time)
        return ok

    def _room_for(self, peer_id: str, now: float) -> bool:
        """May this node hold (another) record of `peer_id`? Yes for a peer it holds one of, or while fewer than
        MAX_RUN_RECORDS peer IDs have unexpired records."""
        if peer_id in self._live or len(self._live) < MAX_RUN_RECORDS:
            return True
        for expired in [p for p, expiration in self._live.items() if expiration < now]:
            del self._live[expired]
        return len(self._live) < MAX_RUN_RECORDS

    def _verify_peer_record(self, record: DHTRecord, peer_id: str) -> bool:
        try:
            tag, payload, public_der, signature = MSGPackSerializer.loads(record.value)
            if tag != RECORD_TAG or not all(isinstance(x, bytes) for x in (payload, public_der, signature)):
                return False
            if peer_id_of_public_key(public_der).to_base58() != peer_id:
                return False  # signed by someone else's key: the forged-subkey attack
            public_key = serialization.load_der_public_key(public_der)
            if not isinstance(public_key, rsa.RSAPublicKey) or not RSA_BITS[0] <= public_key.key_size <= RSA_BITS[1]:
                return False
            if public_key.public_numbers().e != RSA_EXPONENT:
                return False  # checked before the signature: a huge exponent makes verifying costly
            # The payload's checks (schema; in a closed run the organizer's ticket for this peer ID, memoized)
            # before the RSA signature: a stranger's record costs no RSA verification.
            value = MSGPackSerializer.loads(payload)
            if not check_record_payload(value, self.num_experts):
                return False
            if self.admission is not None and not self.admission.ticket_valid(peer_id, value.get("ticket")):
                return False
            public_key.verify(signature, self._signed_message(record, payload), padding.PKCS1v15(), hashes.SHA256())
        except (InvalidSignature, ValueError, TypeError, Exception):  # any malformed input is just invalid
            return False
        return True

    def _validate_settings(self, record: DHTRecord) -> bool:
        if record.expiration_time > get_dht_time() + SETTINGS_LIFETIME or len(record.value) > MAX_VALUE_BYTES:
            return False
        try:
            subkey, value = MSGPackSerializer.loads(record.subkey), MSGPackSerializer.loads(record.value)
        except Exception:
            return False
        return is_fingerprint(subkey) and is_settings(value) and fingerprint(value) == subkey

    def _validate_revocation(self, record: DHTRecord) -> bool:
        if self.admission is None or record.expiration_time > get_dht_time() + REVOCATION_LIFETIME:
            return False  # an open run has no revocations
        if len(record.value) > MAX_VALUE_BYTES:
            return False
        peer_id = self._subkey_peer(record)
        try:
            revocation = MSGPackSerializer.loads(record.value)
        except Exception:
            return False
        if peer_id is None or not self.admission.revocation_valid(peer_id, revocation):
            return False
        self._revoked.add(peer_id)
        return True
