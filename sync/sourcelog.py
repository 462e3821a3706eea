"""One log line per hostile source per minute (docs/DESIGN.md, "Every door bounded"): refusals are counted
in full (spes_rejected_tensors_total), but a stranger refused every round or every request must not fill the
log. No torch, no hivemind: the admission gate uses it too."""
from __future__ import annotations

import math
import time


class SourceLog:
    """At most one log line per source (a peer ID) per `interval` seconds: a hostile peer refused every round is
    named once a minute, not once a round (how often it was refused is in the counters). The map is bounded:
    with more than `limit` sources the oldest half is forgotten."""

    def __init__(self, interval: float = 60.0, limit: int = 1024):
        self.interval, self.limit = float(interval), int(limit)
        self._last: dict[str, float] = {}  # source -> time.monotonic() of its last line

    def allow(self, source: str) -> bool:
        """True (and remembered) if a line about `source` may be logged now."""
        now = time.monotonic()
        if now - self._last.get(source, -math.inf) < self.interval:
            return False
        if len(self._last) >= self.limit:
            self._last = dict(sorted(self._last.items(), key=lambda kv: kv[1])[-(self.limit // 2):])
        self._last[source] = now
        return True
