"""Benchmarks: `python -m worker bench` (see bench/run.py and the README)."""
