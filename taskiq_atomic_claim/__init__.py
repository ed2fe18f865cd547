"""Crash recovery for taskiq's Redis Streams broker that no client crash can wedge."""

from importlib.metadata import PackageNotFoundError, version

from taskiq_atomic_claim.compat import check_stack

# Before the brokers import taskiq-redis: see compat.
check_stack()

from taskiq_atomic_claim.broker import AtomicRedisStreamBroker  # noqa: E402
from taskiq_atomic_claim.cluster_broker import AtomicRedisStreamClusterBroker  # noqa: E402
from taskiq_atomic_claim.dead_letter_results import DeadLettered  # noqa: E402
from taskiq_atomic_claim.sentinel_broker import AtomicRedisStreamSentinelBroker  # noqa: E402

try:
    __version__ = version("taskiq-atomic-claim")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"

__all__ = [
    "AtomicRedisStreamBroker",
    "AtomicRedisStreamClusterBroker",
    "AtomicRedisStreamSentinelBroker",
    "DeadLettered",
    "__version__",
]
