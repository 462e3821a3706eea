"""One peer: config, data, training loop, checkpoints, metrics, and the `python -m peer.run` CLI."""
