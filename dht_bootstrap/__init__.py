"""`python -m dht_bootstrap`: a long-lived DHT node with a stable identity for a run."""
