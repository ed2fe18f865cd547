"""Moved to ``taskiq_atomic_claim.harness.soak``; this shim keeps
``python -m taskiq_atomic_claim.soak`` working for one release (until 0.2)."""

import sys

from taskiq_atomic_claim.harness.soak import *  # noqa: F403
from taskiq_atomic_claim.harness.soak import main

if __name__ == "__main__":
    sys.exit(main())
