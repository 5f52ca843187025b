"""Benchmarks: `python -m worker bench` (see bench/run.py and docs/performance.md)."""
