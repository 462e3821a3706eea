"""The run's settings in the DHT, for a Swarm (sync/settings.py has the settings themselves; docs/DESIGN.md,
"Closed runs" and the run settings every peer shares): each peer stores its settings under their fingerprint and
publishes the fingerprint in its record; a joiner whose fingerprint differs from most live peers' is told the
first setting that differs."""
from __future__ import annotations

import time
from typing import Any, Iterable

from hivemind.utils import get_dht_time

from sync.dht import read_latest
from sync.peer_record import PeerRecord
from sync.settings import SETTINGS_LIFETIME, first_difference, is_settings, run_fingerprint, settings_key


class RunSettings:
    """Mixin of sync.swarm.Swarm. Uses `dht`, `run_id`, `peer_id`, `settings`, `record`, `_store_at`."""

    def publish_settings(self) -> None:
        """Store this peer's settings under their fingerprint, for a joiner whose own differ to compare with."""
        if self.settings:
            self._store_at(settings_key(self.run_id), self.record.cfg, dict(self.settings),
                           get_dht_time() + SETTINGS_LIFETIME)
            self._settings_stored_at = time.monotonic()

    def run_settings(self, others: Iterable[PeerRecord]) -> tuple[str | None, dict[str, Any] | None]:
        """(the fingerprint most of `others` publish, the settings stored under it if found and valid)."""
        run = run_fingerprint(r.cfg for r in others)
        if run is None:
            return None, None
        found = read_latest(self.dht, settings_key(self.run_id))
        entry = found.value.get(run) if found is not None and isinstance(found.value, dict) else None
        settings = getattr(entry, "value", None)
        return run, settings if is_settings(settings) else None

    def settings_mismatch(self, records: dict[str, PeerRecord]) -> str | None:
        """Why this peer cannot take part in the run (its settings are not those most live `records` publish),
        naming the first setting that differs and the run's value; None when they agree or nobody else is there."""
        if not self.settings:
            return None
        others = [r for p, r in records.items() if p != self.peer_id]
        run = run_fingerprint(r.cfg for r in others)
        if run is None or run == self.record.cfg:
            return None
        count = sum(r.cfg == run for r in others)
        _, theirs = self.run_settings(others)
        difference = first_difference(theirs, self.settings) if theirs is not None else None
        if difference is None:
            return (f"this peer's settings differ from those of run {self.run_id} ({count} live peer(s); "
                    f"fingerprint {run}, this peer {self.record.cfg}): start it with the run's config")
        name, value, mine = difference
        return (f"run {self.run_id} ({count} live peer(s)) uses {name} = {value!r}, this peer {mine!r}: start it "
                f"with the run's config (--config FILE or --set {name}=...)")
