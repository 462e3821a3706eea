"""Everything that crosses the network: DHT records, averaging, expert transfer, merge (hivemind)."""
