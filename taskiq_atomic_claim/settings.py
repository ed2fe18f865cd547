"""Validated reclaim settings, in the parent broker's units (milliseconds)."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import secrets
import socket
from dataclasses import dataclass

logger = logging.getLogger("taskiq.atomic_claim")

# XAUTOCLAIM scans COUNT*10 PEL entries per call; beyond this a single claim
# call would block the server for a noticeable time.
MAX_BATCH_SIZE = 10_000
# ms. taskiq-redis's 600000 had to outlast the longest pause of any live
# worker's event loop; here a thread keeps a live process's entries (see
# liveness.py), so the default is set by what it costs instead:
# - a SIGKILLed worker's task runs again within idle_timeout + claim_interval,
#   two if it was the one looking (6.25-7.5 s; claim_gate.py);
# - a server stall (DEBUG SLEEP, a slow script or command, CLIENT PAUSE during a
#   failover), a restart, or a worker cut off from the server, for longer than
#   this makes every entry held through it look idle when it ends: it may
#   then be reclaimed and run a second time. 5 s is Redis's own threshold for
#   calling a server busy (busy-reply-threshold).
DEFAULT_IDLE_TIMEOUT_MS = 5000
# By default a claim runs every idle_timeout / 4: an entry left by a killed
# worker re-runs within 1.25 * idle_timeout, and an idle fleet claims rarely.
DEFAULT_CLAIM_INTERVAL_DIVISOR = 4
DEFAULT_MAX_DELIVERIES = 5
# Redis refuses an expiry whose deadline (now + PX) passes 2**63-1 ms since
# the epoch; 2**62 ms leaves the clock room for ~146 million years.
MAX_EXPIRY_MS = 2**62
# The cursor key lives idle_timeout + 2 * claim_interval (< 3 * idle_timeout).
MAX_IDLE_TIMEOUT_MS = MAX_EXPIRY_MS // 3
# COUNT, MAXLEN: Redis parses them as signed 64-bit integers.
MAX_REDIS_INT = 2**63 - 1
# What a reply may take beyond the longest blocking read before a socket
# timeout would call a healthy server unreachable.
SOCKET_TIMEOUT_MARGIN_MS = 500
# A kick rides out an outage this long by default (a restart, a Sentinel
# failover with short timeouts); 0 tries once, as taskiq-redis does.
DEFAULT_KICK_PATIENCE_S = 5.0
MAX_KICK_PATIENCE_S = 3600
# How long Redis >= 8.6 remembers a kicked task id (XCFGSET IDMP-DURATION,
# whose range is 1..86400 s; Redis's own default is 100 s).
DEFAULT_IDEMPOTENCY_WINDOW_S = 100
MAX_IDEMPOTENCY_WINDOW_S = 86_400
# keep_acked: ten years, far past any history a task queue keeps.
MAX_KEEP_ACKED_S = 10 * 365 * 86_400
_MAX_ID_PART = 2**64 - 1
_STREAM_ID = re.compile(r"(\d+)(?:-(\d+))?")


def is_stream_id(value: object) -> bool:
    """An explicit stream id as Redis parses it: ``ms``, ``ms-seq`` or an int."""
    if isinstance(value, int) and not isinstance(value, bool):
        return 0 <= value <= _MAX_ID_PART
    if not isinstance(value, str):
        return False
    match = _STREAM_ID.fullmatch(value)
    return match is not None and all(
        int(part) <= _MAX_ID_PART for part in match.groups() if part is not None
    )


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


def default_consumer_name() -> str:
    """``<host>-<pid>-<6 hex>``, where the parent uses a random UUID: an
    operator can tell which host and process a consumer was; the random part
    keeps it unique across pid reuse and containers sharing host and pid."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


@dataclass(frozen=True)
class ClaimSettings:
    """How the broker reclaims: every value is checked once, here."""

    idle_timeout: int
    claim_interval: int
    batch_size: int
    lease: int
    # 0: never dead-letter.
    max_deliveries: int = DEFAULT_MAX_DELIVERIES
    # Acks delete the entry once every group acked it (XACKDEL ... ACKED).
    delete_acked: bool = False
    # Seconds a kick retries through an outage; 0: one attempt.
    kick_patience: float = DEFAULT_KICK_PATIENCE_S
    # Seconds Redis >= 8.6 remembers a kicked task id (IDMP-DURATION).
    idempotency_window: int = DEFAULT_IDEMPOTENCY_WINDOW_S
    # ms the workers' trim keeps entries every group acked; 0: none.
    keep_acked: int = 0

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
        if (
            not isinstance(idle_timeout, int)
            or isinstance(idle_timeout, bool)
            or not 2 <= idle_timeout <= MAX_IDLE_TIMEOUT_MS
        ):
            raise ValueError(
                f"idle_timeout must be an integer >= 2 and <= {MAX_IDLE_TIMEOUT_MS}"
                " (ms; the claim cursor expires after up to 3 * idle_timeout ms and"
                f" Redis refuses expiries beyond 2**63-1 ms), got {idle_timeout!r}"
            )
        idle = idle_timeout
        if idle < 1000:
            # idle_timeout=60 meant as seconds is a claim call every 30 ms.
            logger.warning(
                "idle_timeout=%d is in milliseconds (as in taskiq-redis): an entry"
                " is reclaimed after %d ms, not %d seconds",
                idle,
                idle,
                idle,
            )
        if claim_interval is None:
            interval = max(1, idle // DEFAULT_CLAIM_INTERVAL_DIVISOR)
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
                or not 0 < unacknowledged_lock_timeout <= MAX_EXPIRY_MS / 1000
            ):
                raise ValueError(
                    "unacknowledged_lock_timeout must be a number of seconds > 0 and"
                    f" <= {MAX_EXPIRY_MS // 1000} (the lease's PX; Redis refuses"
                    f" expiries beyond 2**63-1 ms), got {unacknowledged_lock_timeout!r}"
                )
            lease = max(1, round(unacknowledged_lock_timeout * 1000))
        deliveries = (
            0
            if max_deliveries is None
            else require_positive_int("max_deliveries", max_deliveries)
        )
        return cls(idle, interval, batch, lease, deliveries)

    @property
    def skip_wait(self) -> int:
        """ms a consumer told of another's lease waits past its end before
        claiming again. A holder that dies lets its lease lapse; someone
        claims again by lease + skip_wait <= idle_timeout after, before its
        entries are even idle: the re-run bound stays idle_timeout + claim
        interval, while non-holders call rarely."""
        room = self.idle_timeout - self.lease - self.claim_interval
        return max(0, min(2 * self.claim_interval, room))

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
    consumer_id: object,
    socket_timeout: object,
    delete_acked: object = False,
    kick_patience: object = DEFAULT_KICK_PATIENCE_S,
    idempotency_window: object = DEFAULT_IDEMPOTENCY_WINDOW_S,
    keep_acked: object = 0,
) -> ClaimSettings:
    """Every check the brokers share; a ValueError names the parameter."""
    if not isinstance(delete_acked, bool):
        raise ValueError(f"delete_acked must be True or False, got {delete_acked!r}")
    if (
        not isinstance(kick_patience, int | float)
        or isinstance(kick_patience, bool)
        or not 0 <= kick_patience <= MAX_KICK_PATIENCE_S
    ):
        raise ValueError(
            "kick_patience must be a number of seconds >= 0 and"
            f" <= {MAX_KICK_PATIENCE_S} (how long a kick retries through an"
            f" outage; 0 tries once), got {kick_patience!r}"
        )
    window = require_positive_int(
        "idempotency_window", idempotency_window, MAX_IDEMPOTENCY_WINDOW_S
    )
    keep_acked_ms = _keep_acked_ms(keep_acked, maxlen)
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
        require_positive_int("maxlen", maxlen, MAX_REDIS_INT)
    if xread_count is not None:
        require_positive_int("xread_count", xread_count, MAX_REDIS_INT)
    if consumer_id != "$" and not is_stream_id(consumer_id):
        raise ValueError(
            "consumer_id must be '$' (only new entries) or a stream id such as"
            " '0', '1700000000000' or '1700000000000-0' (each part <= 2**64-1),"
            f" as XGROUP CREATE accepts, got {consumer_id!r}"
        )
    _check_socket_timeout(socket_timeout, xread_block, settings.claim_interval)
    if additional_streams is not None:
        if not isinstance(additional_streams, dict):
            raise ValueError(
                "additional_streams must be a dict of stream name to start id,"
                f" got {additional_streams!r}"
            )
        for stream, start in additional_streams.items():
            require_name("additional_streams key", stream)
            if start != ">" and not is_stream_id(start):
                raise ValueError(
                    f"additional_streams[{stream!r}] must be '>' (new entries) or a"
                    " stream id such as '0' or '1700000000000-0' (each part"
                    f" <= 2**64-1), as XREADGROUP accepts, got {start!r}"
                )
    lease = _bounded_lease(settings)
    return dataclasses.replace(
        settings,
        lease=lease,
        delete_acked=delete_acked,
        kick_patience=float(kick_patience),
        idempotency_window=window,
        keep_acked=keep_acked_ms,
    )


def _keep_acked_ms(keep_acked: object, maxlen: object) -> int:
    """``keep_acked`` seconds as ms; refused beside ``maxlen``, which bounds
    the same acked entries by count (on Redis >= 8.2 only)."""
    if (
        not isinstance(keep_acked, int | float)
        or isinstance(keep_acked, bool)
        or not 0 <= keep_acked <= MAX_KEEP_ACKED_S
    ):
        raise ValueError(
            f"keep_acked must be a number of seconds >= 0 and <= {MAX_KEEP_ACKED_S}"
            " (how long the workers' trim keeps entries every group acked; 0"
            f" keeps none), got {keep_acked!r}"
        )
    if keep_acked and maxlen is not None:
        raise ValueError(
            f"keep_acked={keep_acked!r} and maxlen={maxlen!r} both bound the acked"
            " entries a stream keeps, by age and by count: set one"
        )
    return round(keep_acked * 1000)


def _bounded_lease(settings: ClaimSettings) -> int:
    """The lease, at most idle_timeout: a longer one lets a worker that dies
    holding it keep every other claimer off past the time its entries turn
    idle, and a SIGKILLed worker's tasks would re-run after lease + claim
    interval instead of idle_timeout + claim_interval. Cut, with one warning
    (a value kept from taskiq-redis must not stop the worker)."""
    idle, interval, lease = (
        settings.idle_timeout,
        settings.claim_interval,
        settings.lease,
    )
    if lease <= idle:
        return lease
    logger.warning(
        "unacknowledged_lock_timeout=%g s is longer than idle_timeout (%d ms):"
        " a worker that dies holding the claim lease would keep others from"
        " reclaiming for up to %g s. The lease is cut to idle_timeout, so a"
        " killed worker's tasks re-run within idle_timeout + claim_interval"
        " (%g s)",
        lease / 1000,
        idle,
        (lease + interval) / 1000,
        (idle + interval) / 1000,
    )
    return idle


def _check_socket_timeout(
    socket_timeout: object, xread_block: int, claim_interval: int
) -> None:
    """A read blocks up to min(xread_block, claim_interval) ms; a socket
    timeout shorter than that plus a margin reports a healthy server as
    unreachable."""
    if socket_timeout is None:
        return
    blocking_ms = min(xread_block, claim_interval) if xread_block else claim_interval
    least_s = (blocking_ms + SOCKET_TIMEOUT_MARGIN_MS) / 1000
    if (
        not isinstance(socket_timeout, int | float)
        or isinstance(socket_timeout, bool)
        or not socket_timeout > least_s
    ):
        raise ValueError(
            f"socket_timeout must be a number of seconds > {least_s:g}: a blocking"
            f" read waits up to {blocking_ms} ms (min of xread_block and"
            f" claim_interval) and the reply needs {SOCKET_TIMEOUT_MARGIN_MS} ms"
            f" more; got {socket_timeout!r}"
        )
