"""Benchmarks for taskiq-atomic-claim: ``python -m benchmarks --help``.

The atomic claim script against client-side locking, under injected round-trip
latency and contention, plus end-to-end crash recovery and throughput against
taskiq-redis 1.2.4. See ``benchmarks/README.md``.
"""
