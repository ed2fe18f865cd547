"""Gauges of what the server holds per (stream, consumer group), for alerting.

The same numbers as ``taskiq-atomic-claim serve`` shows: stream length,
lag, pending entries, oldest pending age, consumers, how long since any
consumer last read, dead letters. A worker exports them with the
``ServerGauges`` middleware into the registry taskiq's
``PrometheusMiddleware`` serves; ``serve`` exports them at ``/metrics``.

They are read on an interval, not per scrape, and every series exists at 0
from the start: an alert can tell "0" from "absent". Without
``prometheus_client`` the middleware refuses at construction.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError
from taskiq import TaskiqMiddleware

from taskiq_atomic_claim.clients import ScriptClient
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.server_calls import raise_if_cancel_was_swallowed

# One XPENDING call per group: each consumer's idle times come from at most
# this many entries; the group's longest idle is searched over the whole PEL.
PEL_SCAN_LIMIT = 1000
# Beyond the scanned part, the longest idle is found by probes of one
# ``XPENDING IDLE t - + 1`` each (the server walks the PEL in C until an
# entry is that idle, the whole PEL when none is): one probe when none is
# idler than what the scan saw; else probes just above the idlest found so
# far, each stopping at the next idler entry, and after CHAIN_PROBES of
# those a doubling then halving search. To within IDLE_RESOLUTION_MS or
# 0.1%, whichever is larger.
MAX_IDLE_PROBES = 64
CHAIN_PROBES = 8
IDLE_RESOLUTION_MS = 100
GAUGES = {
    "stream_length": "Entries in the stream (XLEN)",
    "lag": "Entries the group has not been delivered yet (NaN where the server"
    " cannot say: Redis < 7, or after deletions)",
    "pending": "Entries delivered to the group and not acked (its PEL)",
    "oldest_pending_age_seconds": "Idle time of the longest-idle pending entry"
    " of the whole PEL (0 when none is pending)",
    "consumers": "Consumers registered in the group, dead ones included",
    "last_read_age_seconds": "Seconds since the most recently active consumer"
    " of the group talked to the server (+Inf without consumers)",
    "dead_letters": "Entries in the group's dead-letter stream",
}
PREFIX = "taskiq_atomic_claim_"
DEFAULT_INTERVAL = 15.0
# Reading takes at most this share of the time: XINFO CONSUMERS of thousands
# of consumers takes redis-py's parser about a second, and a reader should
# not spend its life on it.
MAX_READ_SHARE = 0.2

logger = logging.getLogger("taskiq.atomic_claim")


@dataclass(frozen=True)
class GroupGauges:
    """One reading of a (stream, group); None: unknown or absent."""

    length: int
    lag: int | None
    pending: int
    oldest_pending_idle_ms: int | None
    consumers: int
    last_read_idle_ms: int | None
    dead_letters: int

    def values(self) -> dict[str, float]:
        """Gauge name to value, in the units the names say."""
        return {
            "stream_length": self.length,
            "lag": math.nan if self.lag is None else self.lag,
            "pending": self.pending,
            "oldest_pending_age_seconds": (self.oldest_pending_idle_ms or 0) / 1000,
            "consumers": self.consumers,
            "last_read_age_seconds": (
                math.inf
                if self.last_read_idle_ms is None
                else self.last_read_idle_ms / 1000
            ),
            "dead_letters": self.dead_letters,
        }


# The reads below go through ``execute_command`` under the names redis-py's
# own ``xlen``, ``xinfo_groups``... send, so its reply parsers still apply:
# every broker's client has ``execute_command`` (Cluster's
# ``SlotRoutedClient`` routes these by key), not every one has those methods.
# ``inspect`` and ``serve`` read through them too: one reading, one rule for
# each number, whoever shows it.


@dataclass(frozen=True)
class StreamReading:
    type: str  # TYPE of the key: "stream", "none", ...
    length: int  # 0 unless a stream
    groups: dict[str, dict[str, Any]]  # XINFO GROUPS, by group name


@dataclass(frozen=True)
class ConsumerReading:
    name: str
    pending: int
    idle_ms: int
    # Among the PEL's first PEL_SCAN_LIMIT entries, and its longest-idle one.
    oldest_pending_idle_ms: int | None
    # Its worker's alive key (keys.StreamKeys.alive) exists: the process
    # lives. None where not read (the gauges do not).
    alive: bool | None = None


@dataclass(frozen=True)
class GroupReading:
    """One reading of a consumer group (``exists`` False: the stream has no
    such group; its dead letters are still counted)."""

    exists: bool
    pending: int
    last_delivered_id: str | None
    lag: int | None
    pel_scanned: int
    consumers: list[ConsumerReading]  # every one of the group's
    dead_letters: int
    # Entries delivered to the group since it was made (Redis >= 7; None
    # before, or where the server cannot say): what serve's history counts.
    entries_read: int | None = None

    @property
    def oldest_pending_idle_ms(self) -> int | None:
        idles = [c.oldest_pending_idle_ms for c in self.consumers]
        known = [idle for idle in idles if idle is not None]
        return max(known) if known else None

    @property
    def last_read_idle_ms(self) -> int | None:
        """Since the most recently active consumer talked to the server."""
        return min(c.idle_ms for c in self.consumers) if self.consumers else None


async def read_stream(client: ScriptClient, stream: str) -> StreamReading:
    call = client.execute_command
    kind = text(await call("TYPE", stream))
    if kind != "stream":
        return StreamReading(kind, 0, {})
    length = int(await call("XLEN", stream))
    infos = {text(raw["name"]): raw for raw in await call("XINFO GROUPS", stream)}
    return StreamReading(kind, length, infos)


async def pending_idle_by_consumer(
    client: ScriptClient, stream: str, group: str, pending: int
) -> tuple[dict[str, int], int]:
    """Per consumer, the idle ms of its longest-idle pending entry among the
    first ``PEL_SCAN_LIMIT`` of the PEL, and the consumer of the longest-idle
    entry of the whole PEL with that entry's idle; and how many entries were
    read."""
    if not pending:
        return {}, 0
    scanned = await client.execute_command(
        "XPENDING", stream, group, "-", "+", PEL_SCAN_LIMIT, parse_detail=True
    )
    oldest: dict[str, int] = {}
    for entry in scanned:
        name = text(entry["consumer"])
        idle = int(entry["time_since_delivered"])
        oldest[name] = max(idle, oldest.get(name, idle))
    if len(scanned) < pending:
        found = await longest_idle_beyond(
            client, stream, group, max(oldest.values(), default=0)
        )
        if found is not None:
            name, idle = found
            oldest[name] = max(idle, oldest.get(name, idle))
    return oldest, len(scanned)


async def _first_idle_at_least(
    client: ScriptClient, stream: str, group: str, idle_ms: int
) -> tuple[str, int] | None:
    found = await client.execute_command(
        "XPENDING", stream, group, "IDLE", idle_ms, "-", "+", 1, parse_detail=True
    )
    if not found:
        return None
    return text(found[0]["consumer"]), int(found[0]["time_since_delivered"])


async def longest_idle_beyond(
    client: ScriptClient, stream: str, group: str, known_ms: int
) -> tuple[str, int] | None:
    """The consumer and idle ms of the longest-idle entry of the whole PEL,
    when one is idler than ``known_ms`` by more than the resolution; else
    None. Idle times are as of the call: every entry ages while the PEL is
    probed, so each probe asks for its threshold plus the time gone by."""
    started = time.monotonic()
    best: tuple[str, int] | None = None
    low = known_ms  # an entry at least this idle exists (or none pends)
    high: int | None = None  # no entry is this idle
    for probes in range(MAX_IDLE_PROBES):
        step = max(IDLE_RESOLUTION_MS, low // 1000)
        if high is not None and high - low <= step:
            break
        if high is None:
            probe = low + step if probes < CHAIN_PROBES else 2 * low
        else:
            probe = (low + high) // 2
        aged = int((time.monotonic() - started) * 1000)
        found = await _first_idle_at_least(client, stream, group, probe + aged)
        if found is None:
            high = probe
        else:
            consumer, idle = found
            best, low = (consumer, idle - aged), max(low, idle - aged)
    return best


def _optional_text(value: Any) -> str | None:
    return None if value is None else text(value)


async def read_group(
    client: ScriptClient, stream: str, group: str, info: dict[str, Any] | None
) -> GroupReading:
    """The group ``info`` (its XINFO GROUPS entry, None when absent)
    describes: a handful of calls whatever the size of the stream (XINFO
    CONSUMERS lists every consumer, the PEL is read up to
    ``PEL_SCAN_LIMIT``, then probed for its longest idle)."""
    call = client.execute_command
    dead = int(await call("XLEN", StreamKeys(stream, group).dead_letters))
    if info is None:
        return GroupReading(False, 0, None, None, 0, [], dead)
    pending = int(info.get("pending", 0))
    oldest, scanned = await pending_idle_by_consumer(client, stream, group, pending)
    consumers = [
        ConsumerReading(
            name=text(raw["name"]),
            pending=int(raw.get("pending", 0)),
            idle_ms=int(raw.get("idle", 0)),
            oldest_pending_idle_ms=oldest.get(text(raw["name"])),
        )
        for raw in await call("XINFO CONSUMERS", stream, group)
    ]
    lag = info.get("lag")
    read = info.get("entries-read")
    return GroupReading(
        exists=True,
        pending=pending,
        last_delivered_id=_optional_text(info.get("last-delivered-id")),
        lag=None if lag is None else int(lag),
        pel_scanned=scanned,
        consumers=consumers,
        dead_letters=dead,
        entries_read=None if read is None else int(read),
    )


def group_gauges(stream: StreamReading, group: GroupReading) -> GroupGauges:
    """The gauges of one reading: the only place they are computed."""
    return GroupGauges(
        length=stream.length,
        lag=group.lag,
        pending=group.pending,
        oldest_pending_idle_ms=group.oldest_pending_idle_ms,
        consumers=len(group.consumers),
        last_read_idle_ms=group.last_read_idle_ms,
        dead_letters=group.dead_letters,
    )


async def read_group_gauges(
    client: ScriptClient, stream: str, group: str
) -> GroupGauges:
    """The gauges of one (stream, group), read from the server."""
    found = await read_stream(client, stream)
    reading = await read_group(client, stream, group, found.groups.get(group))
    return group_gauges(found, reading)


def next_gap(interval: float, took: float) -> float:
    """Seconds from the end of one reading to the next."""
    return max(interval - took, took / MAX_READ_SHARE - took, 0.0)


_families: dict[int, dict[str, Any]] = {}


def prometheus_gauges(registry: Any = None) -> dict[str, Any]:
    """The gauge families in ``registry`` (default: prometheus_client's),
    created once per registry: registering a name twice is an error."""
    from prometheus_client import REGISTRY, Gauge  # noqa: PLC0415

    registry = REGISTRY if registry is None else registry
    families = _families.get(id(registry))
    if families is None:
        families = {
            # Every worker process reads the same numbers: under taskiq's
            # multiprocess registry one series, the latest reading, not one
            # per process.
            name: Gauge(
                PREFIX + name,
                description,
                ["stream", "group"],
                registry=registry,
                multiprocess_mode="livemostrecent",
            )
            for name, description in GAUGES.items()
        }
        _families[id(registry)] = families
    return families


def declare(families: dict[str, Any], stream: str, group: str) -> None:
    """Make every series of (stream, group) exist, at 0 until first read."""
    for family in families.values():
        family.labels(stream=stream, group=group)


def publish(
    families: dict[str, Any], stream: str, group: str, gauges: GroupGauges
) -> None:
    for name, value in gauges.values().items():
        families[name].labels(stream=stream, group=group).set(value)


def forget(families: dict[str, Any], stream: str, group: str) -> None:
    """Drop the series of a (stream, group) that no longer exists."""
    for family in families.values():
        with contextlib.suppress(KeyError):
            family.remove(stream, group)


class ServerGauges(TaskiqMiddleware):
    """Exports the gauges of the broker's streams and group from a worker.

    ``broker.add_middlewares(PrometheusMiddleware(), ServerGauges())``: the
    worker reads the server every ``interval`` seconds and sets the gauges
    in prometheus_client's default registry, which taskiq's
    ``PrometheusMiddleware`` serves. Each worker process reads on its own:
    a handful of calls per stream per interval, one of them XINFO CONSUMERS;
    with thousands of consumers, prefer ``serve``'s ``/metrics`` (one reader).
    """

    def __init__(self, interval: float = DEFAULT_INTERVAL) -> None:
        super().__init__()
        if isinstance(interval, bool) or not isinstance(interval, (int, float)):
            raise TypeError(f"interval must be seconds (a number), got {interval!r}")
        if not interval > 0:
            raise ValueError(f"interval must be > 0 seconds, got {interval!r}")
        if importlib.util.find_spec("prometheus_client") is None:
            raise ImportError(
                "ServerGauges needs prometheus_client: pip install prometheus-client"
            )
        # Made at startup: taskiq's PrometheusMiddleware picks the
        # registry's (multiprocess) storage in its constructor.
        self.families: dict[str, Any] = {}
        self.interval = float(interval)
        self._task: asyncio.Task[None] | None = None
        self._problem: str | None = None  # why the last reading failed

    def set_broker(self, broker: Any) -> None:
        if not hasattr(broker, "atomic"):
            raise TypeError(
                "ServerGauges needs an atomic-claim broker"
                f" (AtomicRedisStreamBroker and kin), got {type(broker).__name__}"
            )
        super().set_broker(broker)

    @property
    def _pairs(self) -> list[tuple[str, str]]:
        group: str = self.broker.consumer_group_name  # type: ignore[attr-defined]
        streams: list[str] = self.broker.atomic.streams  # type: ignore[attr-defined]
        return [(stream, group) for stream in streams]

    async def startup(self) -> None:
        if not self.broker.is_worker_process:
            return
        self.families = prometheus_gauges()
        for stream, group in self._pairs:
            declare(self.families, stream, group)
        self._task = asyncio.create_task(self._refresh_forever())

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def refresh(self) -> None:
        """Read every (stream, group) once and set the gauges."""
        connection = self.broker.atomic.connection.connect()  # type: ignore[attr-defined]
        async with connection as client:
            for stream, group in self._pairs:
                gauges = await read_group_gauges(client, stream, group)
                publish(self.families, stream, group, gauges)

    async def _refresh_forever(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.refresh()
            except Exception as error:
                # The gauges keep their last values; the next round retries:
                # a failure nobody foresaw must not end the readings for the
                # worker's life. One line when it starts failing (with the
                # traceback when it is not the server's or the network's),
                # one when it reads again.
                problem = f"{type(error).__name__}: {error}"
                if problem != self._problem:
                    expected = isinstance(error, (RedisError, OSError))
                    logger.warning(
                        "server gauges not read: %s",
                        problem,
                        exc_info=None if expected else error,
                    )
                self._problem = problem
            else:
                if self._problem is not None:
                    logger.warning("server gauges read again")
                self._problem = None
            # Else a shutdown's cancel swallowed by redis-py sleeps on here
            # and the shutdown waits for ever.
            raise_if_cancel_was_swallowed()
            await asyncio.sleep(next_gap(self.interval, time.monotonic() - started))
