"""End-to-end tests: the daemon as a subprocess (`python -m worker run`) against a
moto server over HTTP, through the `aws` and `start_daemon` fixtures of
tests/conftest.py. Every test here is marked `e2e`."""
