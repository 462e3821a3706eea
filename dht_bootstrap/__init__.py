"""`python -m dht_bootstrap`: a long-lived DHT node with a stable identity for a run.

Layout: node.py (the node: checks, DHT, status, gauges, reconnect after a restart), __main__.py (the CLI).
"""
from __future__ import annotations

DEFAULT_PORT = 31337


def default_host_maddrs(port: int = DEFAULT_PORT) -> list[str]:
    """All IPv4 and IPv6 interfaces on one TCP port (p2pd starts if at least one of them can listen)."""
    return [f"/ip4/0.0.0.0/tcp/{port}", f"/ip6/::/tcp/{port}"]
