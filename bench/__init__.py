"""Benchmarks that print tables comparing SPES with its baselines (run from the repository root)."""
