"""The in-flight entries of a consumer are held by ``EntryLifecycle``
(``entry_lifecycle.py``); these names stay importable from here for the
modules that still use them."""

from taskiq_atomic_claim.entry_lifecycle import (
    MIN_STARTED_TTL_MS,
    SCRIPT_BATCH,
    Connect,
)
from taskiq_atomic_claim.entry_lifecycle import EntryLifecycle as InFlight

__all__ = ["MIN_STARTED_TTL_MS", "SCRIPT_BATCH", "Connect", "InFlight"]
