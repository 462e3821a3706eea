"""Attacks on what a stranger can make a peer hold or compute (docs/DESIGN.md, "Every door bounded"): the d_*
attacks of bench/adversary.py, a mixin of its `Attacker`.

Each stores through one raw `hivemind.DHT` node of its own that signs every record with the key of the identity
it belongs to (so the records are as valid as a real peer's), and joins no round:
- `d_junk`: `count` (120) values of `size` (32 KiB) random bytes under keys outside the run's namespace, expiring
  in a year, stored again every `every` (20) s. (hivemind's DHT client process dies on values of 64 KiB and more,
  so the attacker stays below that; an honest node refuses such keys whatever their size.)
- `d_records`: `count` (1100) fresh identities each publish a validly signed peer record under `{run_id}_peers`
  (one random expert, the honest peers' round), stored again every `every` (20) s; `costly` (100) of them are
  RSA keys whose public exponent has ~2040 bits instead of 65537 (verifying grows with the exponent).
- `d_ghosts`: `count` (8) fresh identities claim for good every expert no honest peer owns for good, publish the
  highest honest round + `ahead` (3), and never serve anything (they have no libp2p host at all).

Identities are built from a small pool of 1024-bit primes (every pair is a distinct 2048-bit modulus), so a
thousand of them need a few dozen key generations, not a thousand.
"""
from __future__ import annotations

import itertools
import math
import os
import random
import time
from functools import partial
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time
from hivemind.utils.logging import get_logger

logger = get_logger(__name__)

DOOR_ATTACKS = ("d_junk", "d_records", "d_ghosts")
DOOR_DEFAULTS: dict[str, dict[str, Any]] = {
    "d_junk": {"count": 120, "size": 32 * 1024, "every": 20.0},
    "d_records": {"count": 1100, "costly": 100, "every": 20.0},
    "d_ghosts": {"count": 8, "ahead": 3},
}
# The identities' peer IDs, set before the attacker's DHT process is forked from this one (so it has them too).
_FORKED_IDS: list[str] = []
STORE_BATCH = 100  # records per store_many call: keeps each rpc_store message well under hivemind's limits


def identities(count: int, costly: int = 0, seed: int | None = None) -> list[rsa.RSAPrivateKey]:
    """`count` distinct 2048-bit RSA keys, the last `costly` of them with a ~2040-bit public exponent."""
    need = 2
    while need * (need - 1) // 2 < count:
        need += 2
    primes: list[int] = []
    while len(primes) < need:
        numbers = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_numbers()
        primes += [numbers.p, numbers.q]
    rng = random.Random(seed)
    keys = []
    for i, (p, q) in enumerate(itertools.combinations(primes, 2)):
        if len(keys) == count:
            break
        n = p * q
        if n.bit_length() != 2048:
            continue
        phi = math.lcm(p - 1, q - 1)
        e = 65537
        if i >= count - costly:
            e = rng.getrandbits(2040) | 1 | (1 << 2039)
            while math.gcd(e, phi) != 1:
                e += 2
        d = pow(e, -1, phi)
        public = rsa.RSAPublicNumbers(e, n)
        keys.append(rsa.RSAPrivateNumbers(p, q, d, d % (p - 1), d % (q - 1), pow(q, -1, p), public).private_key(
            unsafe_skip_rsa_key_validation=True))  # our own primes: OpenSSL would re-test each for primality
    if len(keys) < count:
        raise RuntimeError(f"only {len(keys)} of {count} identities from {need} primes")
    return keys


class MultiSigner(RecordValidatorBase):
    """The attacker's own DHT node: signs each peer record with the key of the identity named by its subkey,
    stores anything (it is the honest nodes that must refuse) and reads signed values like an honest node."""

    def __init__(self, run_id: str, num_experts: int, keys: list[rsa.RSAPrivateKey]):
        from sync.records import RunRecordValidator, peer_id_of_public_key
        from hivemind.utils.serializer import MSGPackSerializer

        self.reader = RunRecordValidator(run_id, num_experts)
        self.signers: dict[bytes, Any] = {}
        self.peer_ids: list[str] = []
        for key in keys:
            der = key.public_key().public_bytes(serialization.Encoding.DER,
                                                serialization.PublicFormat.SubjectPublicKeyInfo)
            peer_id = peer_id_of_public_key(der).to_base58()
            self.peer_ids.append(peer_id)
            self.signers[MSGPackSerializer.dumps(peer_id)] = RunRecordValidator(run_id, num_experts, private_key=key)

    @property
    def priority(self) -> int:
        return 20

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False

    def validate(self, record: DHTRecord) -> bool:
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        signer = self.signers.get(record.subkey)
        return signer.sign_value(record) if signer is not None else record.value

    def strip_value(self, record: DHTRecord) -> bytes:
        return self.reader.strip_value(record)


async def _store_all(dht, node, keys: list, subkeys: list, values: list, expiration: float) -> int:
    """In the DHT's process: store every (key, subkey, value) on the other nodes; how many at least one took."""
    stored = 0
    for start in range(0, len(keys), STORE_BATCH):
        sl = slice(start, start + STORE_BATCH)
        result = await node.store_many(keys[sl], values[sl], expiration, subkeys=subkeys[sl], exclude_self=True)
        stored += sum(bool(ok) for ok in result.values())
    return stored


async def _store_records(dht, node, key: str, claimed: list[int] | None, round_id: int, fingerprint: str,
                         num_experts: int, expiration: float) -> int:
    """In the DHT's process: one record per identity of _FORKED_IDS, claiming `claimed` (None: one random
    expert each). Built there: a thousand payloads pickled through hivemind's client pipe would break it."""
    payloads = [{"experts": claimed if claimed is not None else [random.randrange(num_experts)], "round": round_id,
                 "step": 0, "tokens": 0, **({"cfg": fingerprint} if fingerprint else {})} for _ in _FORKED_IDS]
    count = len(payloads)
    return await _store_all(dht, node, [key] * count, list(_FORKED_IDS), payloads, expiration)


async def _store_junk(dht, node, count: int, size: int, expiration: float, tag: str) -> int:
    """In the DHT's process (hivemind's client pipe dies on large values): `count` random values of `size` bytes
    under keys of no run."""
    keys = [f"junk-{tag}-{i}" for i in range(count)]
    values = [os.urandom(size) for _ in range(count)]
    return await _store_all(dht, node, keys, [None] * count, values, expiration)


class DoorAttacks:
    """Mixin of bench.adversary.Attacker: the d_* attacks (module doc)."""

    def _start_doors(self, deadline: float) -> None:
        import hivemind
        from sync.records import peers_key

        params, cfg = self.params, self.cfg
        count = int(params.get("count", 0))
        keys = [] if self.attack == "d_junk" else identities(count, int(params.get("costly", 0)))
        signer = MultiSigner(cfg.run_id, cfg.model.num_experts, keys)
        self._identity_ids = signer.peer_ids
        _FORKED_IDS[:] = signer.peer_ids
        self._key = peers_key(cfg.run_id)
        self._raw_dht = hivemind.DHT(initial_peers=self.initial_peers, host_maddrs=self.host_maddrs, start=True,
                                     record_validators=[signer])
        self.stats.peer_id = str(self._raw_dht.peer_id)
        while time.monotonic() < deadline and len(self._honest_records()) < self.wait_peers:
            time.sleep(self.poll_s)
        if not self._honest_records():
            raise TimeoutError(f"{self.log_prefix}: no honest record found under {self._key!r}")
        self._door_round()
        self._spawn(self._door_loop, "doors")

    def _honest_records(self) -> dict[str, dict]:
        """Live honest records (payload dicts) by peer ID: every record under the run's key not written by us."""
        try:
            found = self._raw_dht.get(self._key, latest=True)
        except Exception as e:
            logger.debug(f"{self.log_prefix}: get failed: {e}")
            return {}
        value = getattr(found, "value", None)
        if not isinstance(value, dict):
            return {}
        ours, now = set(self._identity_ids), get_dht_time()
        return {k: item.value for k, item in value.items()
                if isinstance(k, str) and k not in ours and isinstance(getattr(item, "value", None), dict)
                and item.expiration_time >= now and item.value.get("experts")}

    def _door_loop(self) -> None:
        every = float(self.params.get("every", self.cfg.sync.record_ttl / 3))
        while not self._stop.wait(every):
            self._door_round()

    def _door_round(self) -> None:
        """Store (again) what this attack stores; counts into stats.stores_accepted / stores_refused."""
        if self.attack == "d_junk":
            count, size = int(self.params["count"]), int(self.params["size"])
            expiration = get_dht_time() + 365 * 86400
            tag = f"{self.stats.peer_id[-6:]}-{int(time.time())}"
            stored = self._raw_dht.run_coroutine(partial(_store_junk, count=count, size=size, expiration=expiration,
                                                         tag=tag))
            self._count_stores(stored, count)
            return
        honest = self._honest_records()
        if not honest:
            return
        num_experts = self.cfg.model.num_experts
        rounds = [int(r.get("round", 0)) for r in honest.values()]
        fingerprint = next((r["cfg"] for r in honest.values() if isinstance(r.get("cfg"), str)), "")
        claimed, round_id = None, sorted(rounds)[len(rounds) // 2]
        if self.attack == "d_ghosts":
            for_good = set().union(*(set(r["experts"]) - set(r.get("caretaking", [])) for r in honest.values()))
            claimed = sorted(set(range(num_experts)) - for_good) or [0]
            self.stats.claimed = claimed
            round_id = max(rounds) + int(self.params["ahead"])
        count = len(self._identity_ids)
        stored = self._raw_dht.run_coroutine(partial(
            _store_records, key=self._key, claimed=claimed, round_id=round_id, fingerprint=fingerprint,
            num_experts=num_experts, expiration=get_dht_time() + self.cfg.sync.record_ttl))
        self._count_stores(stored, count)

    def _count_stores(self, stored: int, count: int) -> None:
        self.stats.stores_accepted += stored
        self.stats.stores_refused += count - stored
        self.stats.served_rounds += 1  # store rounds done
        logger.info(f"{self.log_prefix}: {stored} of {count} stores taken by another node")
