"""``AtomicRedisStreamBroker``: taskiq-redis's stream broker, unwedgeable reclaim."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from redis.asyncio import ConnectionPool, Redis
from taskiq_redis import RedisStreamBroker

from taskiq_atomic_claim.atomic_parts import AtomicBroker, AtomicParts
from taskiq_atomic_claim.connection import Connection
from taskiq_atomic_claim.settings import (
    DEFAULT_IDEMPOTENCY_WINDOW_S,
    DEFAULT_IDLE_TIMEOUT_MS,
    DEFAULT_KICK_PATIENCE_S,
    DEFAULT_MAX_DELIVERIES,
    check_broker_arguments,
    default_consumer_name,
)


class AtomicRedisStreamBroker(AtomicBroker, RedisStreamBroker):
    """A drop-in ``RedisStreamBroker`` whose reclaim runs on its own schedule.

    Every ``claim_interval`` ms, whether or not new messages arrive, each
    stream gets one call of the server-side claim script: lease check,
    expiring lease and XAUTOCLAIM in one atomic step, so no worker crash can
    leave a key that blocks reclaiming. On Redis >= 8.4 the reads reclaim
    (XREADGROUP ... CLAIM) and no claim script runs at all.
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
        idle_timeout: int = DEFAULT_IDLE_TIMEOUT_MS,
        unacknowledged_batch_size: int = 100,
        unacknowledged_lock_timeout: float | None = None,
        xread_count: int | None = 100,
        additional_streams: dict[str, str | int] | None = None,
        claim_interval: int | None = None,
        max_deliveries: int | None = DEFAULT_MAX_DELIVERIES,
        delete_acked: bool = False,
        kick_patience: float = DEFAULT_KICK_PATIENCE_S,
        idempotency_window: int = DEFAULT_IDEMPOTENCY_WINDOW_S,
        keep_acked: float = 0,
        **connection_kwargs: Any,
    ) -> None:
        """Take the parent's arguments, in its units, plus ``claim_interval``.

        :param idle_timeout: ms an entry must sit unacknowledged before it is
            reclaimed from a consumer that stopped (as in the parent). By
            default 5000, not the parent's 600000: a live process keeps its
            entries from being reclaimed whatever its event loop does, but a
            server stall or outage longer than this lets entries held through
            it be reclaimed and run again.
        :param unacknowledged_lock_timeout: seconds the claim lease lives
            (as in the parent); by default one claim interval, never forever;
            at most idle_timeout (a longer one is cut, with a warning).
        :param claim_interval: ms between reclaim cycles; by default
            idle_timeout // 4. Must be below idle_timeout. A SIGKILLed
            worker's tasks re-run within idle_timeout + 2 x claim_interval.
        :param max_deliveries: an entry whose task started this many times
            in workers that died running it goes to the dead-letter stream
            at the next reclaim; deliveries never started do not count.
            None never gives up.
        :param delete_acked: acks also delete the entry from the stream once
            every consumer group acked it (XACKDEL ... ACKED), keeping the
            stream bounded without maxlen. Needs Redis >= 8.2; elsewhere the
            broker refuses to start.
        :param kick_patience: seconds a kick retries through an outage (a
            restart, a failover) before it raises; 0 tries once. Seconds, as
            socket_timeout: it is how long the caller of ``kiq()`` may wait,
            not a server-side argument. On Redis >= 8.6 every kick is
            idempotent and any outage is retried; elsewhere only failures
            that certainly wrote nothing are.
        :param idempotency_window: seconds Redis >= 8.6 remembers a kicked
            task id (XCFGSET IDMP-DURATION, 1..86400), so a kick resent with
            the same task id within it enqueues nothing; each remembered id
            costs the server about 72 bytes, at most 160,000 per stream.
        :param keep_acked: seconds the workers' trim keeps entries every
            consumer group acked (by their id's time); 0, the default, keeps
            none: the stream holds what is waiting and in flight, plus about
            one second of traffic. Not with maxlen (both bound the same).
        """
        claim_settings = check_broker_arguments(
            idle_timeout=idle_timeout,
            claim_interval=claim_interval,
            unacknowledged_batch_size=unacknowledged_batch_size,
            unacknowledged_lock_timeout=unacknowledged_lock_timeout,
            max_deliveries=max_deliveries,
            queue_name=queue_name,
            consumer_group_name=consumer_group_name,
            consumer_name=consumer_name,
            xread_block=xread_block,
            maxlen=maxlen,
            xread_count=xread_count,
            additional_streams=additional_streams,
            consumer_id=consumer_id,
            socket_timeout=connection_kwargs.get("socket_timeout"),
            delete_acked=delete_acked,
            kick_patience=kick_patience,
            idempotency_window=idempotency_window,
            keep_acked=keep_acked,
        )
        super().__init__(
            url,
            queue_name=queue_name,
            max_connection_pool_size=max_connection_pool_size,
            consumer_group_name=consumer_group_name,
            consumer_name=(
                default_consumer_name() if consumer_name is None else consumer_name
            ),
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
        self.atomic = AtomicParts(
            self,
            claim_settings,
            StandaloneConnection(self.connection_pool, queue_name),
            xread_count,
        )


class StandaloneConnection(Connection):
    """One server behind the parent's pool, which lives as long as the
    broker; every call takes a connection from it for that call only."""

    def __init__(self, pool: ConnectionPool, queue_name: str) -> None:
        super().__init__(queue_name)
        self.pool = pool
        # One client over the pool, made once: building a Redis object
        # costs about as much as a round trip, and every ack and task start
        # asks for one.
        self.client = Redis(connection_pool=pool)

    def connect(self) -> contextlib.AbstractAsyncContextManager[Redis]:
        # Leaving the context closes nothing (the pool belongs to the
        # broker; its shutdown disconnects it).
        return contextlib.nullcontext(self.client)

    def login(self) -> tuple[str, bool, str]:
        kwargs = self.pool.connection_kwargs
        where = kwargs.get("path") or f"{kwargs.get('host')}:{kwargs.get('port')}"
        user = kwargs.get("username") or "default"
        return str(where), kwargs.get("password") is not None, str(user)

    @contextlib.asynccontextmanager
    async def liveness_client(self) -> AsyncIterator[Redis]:
        # The parent's pool's settings (URL, TLS, auth, timeouts, its
        # connection class), in a pool of its own: one beat at a time.
        pool = ConnectionPool(
            connection_class=self.pool.connection_class,
            max_connections=2,
            **self.pool.connection_kwargs,
        )
        try:
            yield Redis(connection_pool=pool)
        finally:
            await pool.disconnect()

    async def close(self) -> None:
        # Its calls reconnect what the parent closed: close it again.
        await self.pool.disconnect()
