"""Moved to ``taskiq_atomic_claim.harness.drill_app``; this shim keeps
``taskiq worker taskiq_atomic_claim.drill_app:broker`` working for one release
(until 0.2)."""

from taskiq_atomic_claim.harness.drill_app import *  # noqa: F403
from taskiq_atomic_claim.harness.drill_app import broker

__all__ = ["broker"]
