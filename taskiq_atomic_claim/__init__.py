"""Crash recovery for taskiq's Redis Streams broker that no client crash can wedge."""

import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from taskiq_atomic_claim.compat import UnsupportedStackError, check_stack

# Before the brokers import taskiq-redis: see compat.
try:
    check_stack()
except UnsupportedStackError as error:
    if Path(sys.argv[0]).name == "taskiq-atomic-claim":
        # The command's one-line error (cli/arguments.py), not a traceback:
        # nothing of the CLI can load on this stack.
        print(f"taskiq-atomic-claim: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    raise

from taskiq_atomic_claim.broker import AtomicRedisStreamBroker
from taskiq_atomic_claim.cluster_broker import AtomicRedisStreamClusterBroker
from taskiq_atomic_claim.dead_letter_results import DeadLettered
from taskiq_atomic_claim.kicking import UncertainKickError
from taskiq_atomic_claim.sentinel_broker import AtomicRedisStreamSentinelBroker

try:
    __version__ = version("taskiq-atomic-claim")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"

__all__ = [
    "AtomicRedisStreamBroker",
    "AtomicRedisStreamClusterBroker",
    "AtomicRedisStreamSentinelBroker",
    "DeadLettered",
    "UncertainKickError",
    "__version__",
]
