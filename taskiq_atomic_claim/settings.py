"""Validated reclaim settings, in the parent broker's units (milliseconds)."""

from __future__ import annotations

from dataclasses import dataclass

# XAUTOCLAIM scans COUNT*10 PEL entries per call; beyond this a single claim
# call would block the server for a noticeable time.
MAX_BATCH_SIZE = 10_000
DEFAULT_CLAIM_INTERVAL_MS = 1_000
DEFAULT_MAX_DELIVERIES = 5


def require_positive_int(name: str, value: object, maximum: int | None = None) -> int:
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or value < 1
        or (maximum is not None and value > maximum)
    ):
        upper = f" and <= {maximum}" if maximum is not None else ""
        raise ValueError(f"{name} must be an integer >= 1{upper}, got {value!r}")
    return value


def require_name(name: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    return value


@dataclass(frozen=True)
class ClaimSettings:
    """How the broker reclaims: every value is checked once, here."""

    idle_timeout: int
    claim_interval: int
    batch_size: int
    lease: int
    # 0: never dead-letter.
    max_deliveries: int = DEFAULT_MAX_DELIVERIES

    @classmethod
    def from_broker_arguments(
        cls,
        idle_timeout: object,
        claim_interval: object,
        unacknowledged_batch_size: object,
        unacknowledged_lock_timeout: object,
        max_deliveries: object = DEFAULT_MAX_DELIVERIES,
    ) -> ClaimSettings:
        """Check the broker's arguments; every error names its parameter.

        ``unacknowledged_lock_timeout`` keeps the parent's unit (seconds) and
        meaning (how long the claim lock lives); unset, the lease lives one
        claim interval, never forever. ``max_deliveries`` None never
        dead-letters.
        """
        idle = require_positive_int("idle_timeout", idle_timeout)
        if idle < 2:
            raise ValueError(
                f"idle_timeout must be >= 2 ms to leave room for a claim interval,"
                f" got {idle}"
            )
        if claim_interval is None:
            interval = min(DEFAULT_CLAIM_INTERVAL_MS, idle // 2)
        else:
            interval = require_positive_int("claim_interval", claim_interval)
            if interval >= idle:
                raise ValueError(
                    f"claim_interval must be < idle_timeout ({idle} ms), got {interval}"
                )
        batch = require_positive_int(
            "unacknowledged_batch_size", unacknowledged_batch_size, MAX_BATCH_SIZE
        )
        if unacknowledged_lock_timeout is None:
            lease = interval
        else:
            if (
                not isinstance(unacknowledged_lock_timeout, int | float)
                or isinstance(unacknowledged_lock_timeout, bool)
                or not unacknowledged_lock_timeout > 0
                or unacknowledged_lock_timeout == float("inf")
            ):
                raise ValueError(
                    "unacknowledged_lock_timeout must be a finite number of seconds"
                    f" > 0, got {unacknowledged_lock_timeout!r}"
                )
            lease = max(1, round(unacknowledged_lock_timeout * 1000))
        deliveries = (
            0
            if max_deliveries is None
            else require_positive_int("max_deliveries", max_deliveries)
        )
        return cls(idle, interval, batch, lease, deliveries)

    @property
    def cursor_ttl(self) -> int:
        # Outlives a few claim cycles; if it lapses the scan restarts at 0-0.
        return self.idle_timeout + 2 * self.claim_interval


def check_broker_arguments(
    *,
    idle_timeout: object,
    claim_interval: object,
    unacknowledged_batch_size: object,
    unacknowledged_lock_timeout: object,
    max_deliveries: object,
    queue_name: object,
    consumer_group_name: object,
    consumer_name: object,
    xread_block: object,
    maxlen: object,
    xread_count: object,
    additional_streams: object,
) -> ClaimSettings:
    """Every check the brokers share; a ValueError names the parameter."""
    settings = ClaimSettings.from_broker_arguments(
        idle_timeout=idle_timeout,
        claim_interval=claim_interval,
        unacknowledged_batch_size=unacknowledged_batch_size,
        unacknowledged_lock_timeout=unacknowledged_lock_timeout,
        max_deliveries=max_deliveries,
    )
    require_name("queue_name", queue_name)
    require_name("consumer_group_name", consumer_group_name)
    if consumer_name is not None:
        require_name("consumer_name", consumer_name)
    if (
        not isinstance(xread_block, int)
        or isinstance(xread_block, bool)
        or xread_block < 0
    ):
        raise ValueError(
            f"xread_block must be an integer >= 0 (ms), got {xread_block!r}"
        )
    if maxlen is not None:
        require_positive_int("maxlen", maxlen)
    if xread_count is not None:
        require_positive_int("xread_count", xread_count)
    if additional_streams is not None:
        if not isinstance(additional_streams, dict):
            raise ValueError(
                "additional_streams must be a dict of stream name to start id,"
                f" got {additional_streams!r}"
            )
        for stream in additional_streams:
            require_name("additional_streams key", stream)
    return settings
