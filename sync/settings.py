"""The settings every peer of a run must share, and their fingerprint (docs/DESIGN.md, "Joining and state
downloads").

A peer built with another model shape, tokenizer or round setting than the swarm's cannot take part: every
tensor it receives has the wrong shape, or its aggregates differ from the others' and its digests never match.
So each peer's record carries `cfg`, a fingerprint of its settings (a flat {dotted name: scalar} map chosen by
peer/, e.g. "model.d_model": 256), and the settings themselves are stored once per fingerprint under the DHT key
`{run_id}_settings`, subkey = the fingerprint. That entry is content-addressed: every node refuses one whose
fingerprint is not its value's (sync/records.py), so nobody can plant false settings under the run's
fingerprint. A joiner whose fingerprint is not the one most live peers publish reads the run's settings and
names the first that differs (sync.swarm.Swarm.settings_mismatch). Pure functions; no hivemind here.
"""
from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from typing import Any, Iterable, Mapping

Scalar = int | float | str | bool | None

SETTINGS_LIFETIME = 86400.0  # seconds a stored settings entry lives; live peers store theirs again hourly
FINGERPRINT_HEX = 16  # 64 bits of sha256: a second preimage of a run's fingerprint is out of reach
MAX_ENTRIES, MAX_NAME, MAX_STRING = 128, 64, 256


def settings_key(run_id: str) -> str:
    return f"{run_id}_settings"


def is_settings(value: Any) -> bool:
    """A flat map of at most MAX_ENTRIES dotted names to scalars (finite numbers, bounded strings)."""
    if not isinstance(value, dict) or len(value) > MAX_ENTRIES:
        return False
    for name, item in value.items():
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
            return False
        if isinstance(item, float) and not math.isfinite(item):
            return False
        if isinstance(item, str) and len(item) > MAX_STRING:
            return False
        if item is not None and not isinstance(item, (bool, int, float, str)):
            return False
    return True


def fingerprint(settings: Mapping[str, Scalar]) -> str:
    """sha256 (first FINGERPRINT_HEX hex digits) of the settings in a canonical form (sorted, JSON)."""
    canonical = json.dumps(sorted(settings.items()), separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest()[:FINGERPRINT_HEX]


def is_fingerprint(value: Any) -> bool:
    return (isinstance(value, str) and len(value) == FINGERPRINT_HEX
            and all(c in "0123456789abcdef" for c in value))


def run_fingerprint(fingerprints: Iterable[str]) -> str | None:
    """The fingerprint most of the run's other live peers publish (ties: the smallest, so every peer picks the
    same one); None when none publishes one."""
    counts = Counter(f for f in fingerprints if f)
    if not counts:
        return None
    top = max(counts.values())
    return min(f for f, n in counts.items() if n == top)


def first_difference(run: Mapping[str, Scalar], mine: Mapping[str, Scalar]) -> tuple[str, Scalar, Scalar] | None:
    """(name, the run's value, this peer's value) of the first setting, in name order, that differs; a name
    only one side has counts with None on the other. None when they are the same."""
    for name in sorted(set(run) | set(mine)):
        theirs, ours = run.get(name), mine.get(name)
        if theirs != ours or type(theirs) is not type(ours):
            return name, theirs, ours
    return None
