"""Benchmarks for taskiq-atomic-claim: ``python -m benchmarks --help``.

This package against taskiq-redis 1.2.4, side by side in one run: the hot
path, crash recovery, mass recovery and an idle fleet's cost. See
``benchmarks/README.md``.
"""
