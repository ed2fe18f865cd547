"""``AtomicRedisStreamBroker``: taskiq-redis's stream broker, unwedgeable reclaim."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from taskiq import AckableMessage
from taskiq_redis import RedisStreamBroker

from taskiq_atomic_claim.claim import ClaimOutcome, claim_idle_entries
from taskiq_atomic_claim.dead_letters import move_to_dead_letters
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.scripts import ScriptRunner
from taskiq_atomic_claim.settings import (
    DEFAULT_MAX_DELIVERIES,
    ClaimSettings,
    require_name,
    require_positive_int,
)

logger = logging.getLogger("taskiq.atomic_claim")

_DATA_FIELD = b"data"


class AtomicRedisStreamBroker(RedisStreamBroker):
    """A drop-in ``RedisStreamBroker`` whose reclaim runs on its own schedule.

    Every ``claim_interval`` ms, whether or not new messages arrive, each
    stream gets one call of the server-side claim script: lease check,
    expiring lease and XAUTOCLAIM in one atomic step, so no worker crash can
    leave a key that blocks reclaiming.
    """

    def __init__(
        self,
        url: str,
        queue_name: str = "taskiq",
        max_connection_pool_size: int | None = None,
        consumer_group_name: str = "taskiq",
        consumer_name: str | None = None,
        consumer_id: str = "$",
        mkstream: bool = True,
        xread_block: int = 2000,
        maxlen: int | None = None,
        approximate: bool = True,
        idle_timeout: int = 600000,
        unacknowledged_batch_size: int = 100,
        unacknowledged_lock_timeout: float | None = None,
        xread_count: int | None = 100,
        additional_streams: dict[str, str | int] | None = None,
        claim_interval: int | None = None,
        max_deliveries: int | None = DEFAULT_MAX_DELIVERIES,
        **connection_kwargs: Any,
    ) -> None:
        """Take the parent's arguments, in its units, plus ``claim_interval``.

        :param idle_timeout: ms an entry must sit unacknowledged before it is
            reclaimed from a consumer that stopped (as in the parent).
        :param unacknowledged_lock_timeout: seconds the claim lease lives
            (as in the parent); by default one claim interval, never forever.
        :param claim_interval: ms between reclaim cycles; by default
            min(1000, idle_timeout // 2). Must be below idle_timeout.
        :param max_deliveries: an entry delivered more often than this
            (worker crashes included) goes to the dead-letter stream instead
            of crash-looping the fleet; None never gives up.
        """
        self.claim_settings = ClaimSettings.from_broker_arguments(
            idle_timeout=idle_timeout,
            claim_interval=claim_interval,
            unacknowledged_batch_size=unacknowledged_batch_size,
            unacknowledged_lock_timeout=unacknowledged_lock_timeout,
            max_deliveries=max_deliveries,
        )
        _check_stream_arguments(
            queue_name=queue_name,
            consumer_group_name=consumer_group_name,
            consumer_name=consumer_name,
            xread_block=xread_block,
            maxlen=maxlen,
            xread_count=xread_count,
            additional_streams=additional_streams,
        )
        super().__init__(
            url,
            queue_name=queue_name,
            max_connection_pool_size=max_connection_pool_size,
            consumer_group_name=consumer_group_name,
            consumer_name=consumer_name,
            consumer_id=consumer_id,
            mkstream=mkstream,
            xread_block=xread_block,
            maxlen=maxlen,
            approximate=approximate,
            idle_timeout=idle_timeout,
            unacknowledged_batch_size=unacknowledged_batch_size,
            unacknowledged_lock_timeout=unacknowledged_lock_timeout,
            xread_count=xread_count,
            additional_streams=additional_streams,
            **connection_kwargs,
        )
        self.claim_interval = self.claim_settings.claim_interval
        self.scripts = ScriptRunner()

    @property
    def streams(self) -> list[str]:
        return [self.queue_name, *self.additional_streams]

    async def claim(self, redis_conn: Redis, stream: str) -> ClaimOutcome:
        """One claim cycle for one stream: one script call, one round trip."""
        outcome = await claim_idle_entries(
            self.scripts,
            redis_conn,
            StreamKeys(stream, self.consumer_group_name),
            self.consumer_name,
            self.claim_settings,
        )
        if outcome.trimmed:
            logger.warning(
                "%d pending entries of stream %r were trimmed before anyone acked"
                " them; their tasks are lost: %s",
                len(outcome.trimmed),
                stream,
                ", ".join(outcome.trimmed),
            )
        if outcome.dead_lettered:
            logger.error(
                "%d entries of stream %r were delivered more than %d times and"
                " moved to dead letters %r: %s",
                len(outcome.dead_lettered),
                stream,
                self.claim_settings.max_deliveries,
                StreamKeys(stream, self.consumer_group_name).dead_letters,
                ", ".join(outcome.dead_lettered),
            )
        if outcome.entries:
            logger.debug(
                "Reclaimed %d idle entries from stream %r", len(outcome.entries), stream
            )
        return outcome

    async def listen(self) -> AsyncGenerator[AckableMessage, None]:
        """Yield new messages and, every claim interval, reclaimed ones."""
        interval = self.claim_settings.claim_interval / 1000
        read_from = {self.queue_name: ">", **self.additional_streams}
        next_claim = time.monotonic()
        outage_started: float | None = None
        backoff = 0.05
        async with Redis(connection_pool=self.connection_pool) as redis_conn:
            while True:
                try:
                    if time.monotonic() >= next_claim:
                        next_claim = time.monotonic() + interval
                        for stream in self.streams:
                            outcome = await self.claim(redis_conn, stream)
                            for entry in outcome.entries:
                                message = await self._deliverable(
                                    redis_conn, stream, entry.id, entry.fields
                                )
                                if message is not None:
                                    yield message
                    # Never block past the next claim: reclaim must not wait
                    # for traffic.
                    until_claim = max(1, int((next_claim - time.monotonic()) * 1000))
                    block = min(self.block, until_claim) if self.block else until_claim
                    fetched: Any = await redis_conn.xreadgroup(
                        self.consumer_group_name,
                        self.consumer_name,
                        read_from,  # type: ignore[arg-type]
                        block=block,
                        count=self.count,
                    )
                except (RedisConnectionError, RedisTimeoutError, OSError) as error:
                    if outage_started is None:
                        outage_started = time.monotonic()
                        logger.warning("Redis unreachable, retrying: %s", error)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 5.0)
                    continue
                if outage_started is not None:
                    logger.warning(
                        "Redis reachable again after %.1f s",
                        time.monotonic() - outage_started,
                    )
                    outage_started, backoff = None, 0.05
                for stream, messages in fetched or []:
                    for entry_id, fields in messages:
                        message = await self._deliverable(
                            redis_conn, stream, entry_id, fields
                        )
                        if message is not None:
                            yield message

    async def _deliverable(
        self,
        redis_conn: Redis,
        stream: str | bytes,
        entry_id: str | bytes,
        fields: dict[Any, Any],
    ) -> AckableMessage | None:
        """The entry as a message, or None once an entry taskiq cannot run is
        moved to the dead letters (written by something other than a broker)."""
        stream_name = stream.decode() if isinstance(stream, bytes) else stream
        message_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        data = fields.get(_DATA_FIELD, fields.get(_DATA_FIELD.decode()))
        if isinstance(data, str):
            data = data.encode()
        if not isinstance(data, bytes):
            keys = StreamKeys(stream_name, self.consumer_group_name)
            await move_to_dead_letters(
                self.scripts, redis_conn, keys, message_id, "no data field"
            )
            logger.error(
                "Entry %s of stream %r has no %r field; moved to dead letters %r",
                message_id,
                stream_name,
                _DATA_FIELD.decode(),
                keys.dead_letters,
            )
            return None
        return AckableMessage(
            data=data,
            ack=self._ack_generator(id=message_id, queue_name=stream_name),
        )


def _check_stream_arguments(
    *,
    queue_name: object,
    consumer_group_name: object,
    consumer_name: object,
    xread_block: object,
    maxlen: object,
    xread_count: object,
    additional_streams: object,
) -> None:
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
