"""``AtomicRedisStreamSentinelBroker``: the atomic reclaim behind Redis Sentinel.

taskiq-redis's ``RedisStreamSentinelBroker`` never reclaims. This broker runs
the shared listen loop (``reclaiming.Listener``) on a client from
``self.sentinel.master_for(self.master_name)``. Two things a failover does
need handling beyond what redis-py's Sentinel pool does by itself:

- the listen loop keeps one client for its whole life, and its pool asks
  the sentinels for the master only when it opens a connection. After a
  failover the old master keeps answering until the sentinels demote it
  (about ten seconds later with the default settings), so without a nudge
  the loop would read and claim on a server whose writes are about to be
  thrown away. Once per claim interval the pool re-asks the sentinels, and
  drops its connections when the master moved;
- a read blocked on a master that is demoted fails with UNBLOCKED, which is
  a reply, not a broken connection. The connection class here treats every
  reply that says "not a primary now" (``server_errors.Fault.DEMOTED``:
  UNBLOCKED, READONLY also from inside a 6.2 script, MASTERDOWN) as redis-py
  already treats READONLY: disconnect, and raise ``ConnectionError`` so the
  loop reconnects, through the sentinels, to the new master.

The library is loaded on the master and replicates with the data (functions)
or is reloaded on the new master when it is missing (6.2's cached scripts).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.connection import SSLConnection
from redis.asyncio.sentinel import Sentinel, SentinelManagedConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from taskiq_redis import RedisStreamSentinelBroker

from taskiq_atomic_claim.atomic_parts import AtomicBroker, AtomicParts
from taskiq_atomic_claim.connection import Connection
from taskiq_atomic_claim.server_errors import UNREACHABLE, Fault, classify
from taskiq_atomic_claim.settings import (
    DEFAULT_IDEMPOTENCY_WINDOW_S,
    DEFAULT_IDLE_TIMEOUT_MS,
    DEFAULT_KICK_PATIENCE_S,
    DEFAULT_MAX_DELIVERIES,
    check_broker_arguments,
    default_consumer_name,
    require_name,
)


class MasterFollowingConnection(SentinelManagedConnection):
    """A Sentinel-managed connection that also gives up on UNBLOCKED, and
    reconnects before writing when the pool has learned of another master.

    The broker's calls share one pool: when a look-up finds the master
    moved, the pool closes only its idle connections, and one busy then (a
    blocked read) would go back to the pool still on the old master, which
    takes writes until it is demoted and then throws them away.
    """

    async def send_packed_command(self, *args: Any, **kwargs: Any) -> None:
        master = self.connection_pool.master_address
        if (
            self.is_connected
            and self.connection_pool.is_master
            and master is not None
            and (self.host, self.port) != tuple(master)
        ):
            # connect() asks the sentinels: the parent's own reconnect goes
            # back to the last address, whose handshake would land here again.
            await self.disconnect()
            await self.connect()  # type: ignore[no-untyped-call, unused-ignore]
        await super().send_packed_command(*args, **kwargs)

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)
        except ResponseError as error:
            if classify(error) is not Fault.DEMOTED:
                raise
            await self.disconnect()
            raise RedisConnectionError(
                f"the master was demoted under a blocked read: {error}"
            ) from error


class MasterFollowingSSLConnection(MasterFollowingConnection, SSLConnection):
    pass


# The parent annotates additional_streams as dict[str, str], the loop as
# dict[str, str | int] (what XREADGROUP takes): the same object either way.
class AtomicRedisStreamSentinelBroker(AtomicBroker, RedisStreamSentinelBroker):
    """A drop-in ``RedisStreamSentinelBroker`` that reclaims, as
    ``AtomicRedisStreamBroker`` does on a single server, and follows the
    master across failovers."""

    def __init__(
        self,
        sentinels: list[tuple[str, int]],
        master_name: str,
        min_other_sentinels: int = 0,
        queue_name: str = "taskiq",
        consumer_group_name: str = "taskiq",
        consumer_name: str | None = None,
        consumer_id: str = "$",
        mkstream: bool = True,
        xread_block: int = 10000,
        maxlen: int | None = None,
        approximate: bool = True,
        additional_streams: dict[str, str | int] | None = None,
        *,
        idle_timeout: int = DEFAULT_IDLE_TIMEOUT_MS,
        unacknowledged_batch_size: int = 100,
        unacknowledged_lock_timeout: float | None = None,
        xread_count: int | None = 100,
        claim_interval: int | None = None,
        max_deliveries: int | None = DEFAULT_MAX_DELIVERIES,
        delete_acked: bool = False,
        kick_patience: float = DEFAULT_KICK_PATIENCE_S,
        idempotency_window: int = DEFAULT_IDEMPOTENCY_WINDOW_S,
        keep_acked: float = 0,
        **connection_kwargs: Any,
    ) -> None:
        """Take the parent's arguments, in its order and units; the reclaim
        arguments, keyword-only, are ``AtomicRedisStreamBroker``'s.

        :param idle_timeout: ms an entry must sit unacknowledged before it is
            reclaimed from a consumer that stopped; by default 5000, as in
            ``AtomicRedisStreamBroker``.
        :param unacknowledged_batch_size: entries one claim takes at most.
        :param unacknowledged_lock_timeout: seconds the claim lease lives;
            by default one claim interval, never forever; at most
            idle_timeout (a longer one is cut, with a warning).
        :param xread_count: entries one XREADGROUP returns at most.
        :param claim_interval: ms between reclaim cycles; by default
            idle_timeout // 4. Must be below idle_timeout. The loop leaves a
            master the sentinels replaced within min(claim_interval, 1 s)
            plus one read (xread_block).
        :param max_deliveries: an entry whose task started this many times
            in workers that died running it goes to the dead-letter stream
            at the next reclaim; deliveries never started do not count.
            None never gives up.
        :param delete_acked: acks also delete the entry from the stream once
            every consumer group acked it (XACKDEL ... ACKED), keeping the
            stream bounded without maxlen. Needs Redis >= 8.2; elsewhere the
            broker refuses to start.
        :param kick_patience: seconds a kick retries through an outage,
            and
        :param idempotency_window: seconds Redis >= 8.6 remembers a kicked
            task id, and
        :param keep_acked: seconds the workers' trim keeps acked entries:
            as in ``AtomicRedisStreamBroker``.
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
        require_name("master_name", master_name)
        super().__init__(
            sentinels,
            master_name,
            min_other_sentinels=min_other_sentinels,
            queue_name=queue_name,
            consumer_group_name=consumer_group_name,
            consumer_name=(
                default_consumer_name() if consumer_name is None else consumer_name
            ),
            consumer_id=consumer_id,
            mkstream=mkstream,
            xread_block=xread_block,
            maxlen=maxlen,
            approximate=approximate,
            # The parent annotates start ids as str only; ints work as well.
            additional_streams=additional_streams,  # type: ignore[arg-type]
            **connection_kwargs,
        )
        self.atomic = AtomicParts(
            self,
            claim_settings,
            SentinelConnection(
                self.sentinel,
                master_name,
                queue_name,
                claim_settings.claim_interval,
                # As the parent builds its own: for the liveness thread.
                functools.partial(
                    Sentinel,
                    sentinels=sentinels,
                    min_other_sentinels=min_other_sentinels,
                    **connection_kwargs,
                ),
            ),
            xread_count,
        )


class SentinelConnection(Connection):
    """The master behind the sentinels, followed across failovers."""

    waits_out_startup = True

    def __init__(
        self,
        sentinel: Sentinel,
        master_name: str,
        queue_name: str,
        claim_interval_ms: int,
        build_sentinel: Callable[[], Sentinel],
    ) -> None:
        super().__init__(queue_name)
        self.sentinel = sentinel
        self.build_sentinel = build_sentinel
        self.master_name = master_name
        # How often (s) the sentinels are asked for the master at most.
        self.check_every_s = min(claim_interval_ms, 1000) / 1000
        self._master_checked = 0.0
        self._master_client: Redis | None = None

    def _master(self) -> Redis:
        """The broker's one master client, made at first use: reads, claims,
        acks, start records and heartbeats share its pool, which asks the
        sentinels for the master when it opens a connection and drops its
        idle ones when ``before_call`` finds the master moved. Kicks go
        through it too, each checked the same way first."""
        if self._master_client is None:
            self._master_client = self._master_of(self.sentinel)
        return self._master_client

    def _master_of(self, sentinel: Sentinel) -> Redis:
        ssl = bool(sentinel.connection_kwargs.get("ssl"))
        connection_class = (
            MasterFollowingSSLConnection if ssl else MasterFollowingConnection
        )
        master: Redis = sentinel.master_for(
            self.master_name, connection_class=connection_class
        )
        return master

    @contextlib.asynccontextmanager
    async def liveness_client(self) -> AsyncIterator[MasterCheckedClient]:
        # Sentinels and a master client of its own, built as the broker's.
        sentinel = self.build_sentinel()
        master = self._master_of(sentinel)
        try:
            yield MasterCheckedClient(master)
        finally:
            await master.aclose()
            for client in sentinel.sentinels:
                await client.aclose()

    @contextlib.asynccontextmanager
    async def connect(self) -> AsyncIterator[Redis]:
        # Acks and heartbeats follow the master too: while every slot is
        # busy the listen loop is parked and checks nothing, and the old
        # master takes writes until it is demoted, then throws them away.
        # A failed look-up leaves the pool as it is (its connections may
        # still reach the master). Leaving the context closes nothing: the
        # pool is the broker's, and its shutdown disconnects it.
        client = self._master()
        with contextlib.suppress(*UNREACHABLE):
            await self.before_call(client)
        yield client

    async def before_call(self, client: Any) -> None:
        """Ask the sentinels for the master at most every claim interval or
        second, whichever is shorter; when it moved, the pool closes its idle
        connections, so the next command reaches the new one."""
        now = time.monotonic()
        if now - self._master_checked >= self.check_every_s:
            self._master_checked = now
            await client.connection_pool.get_master_address()

    async def close(self) -> None:
        """Close the master client's pool."""
        client, self._master_client = self._master_client, None
        if client is not None:
            await client.aclose()


class MasterCheckedClient:
    """The liveness thread's master client: before each beat it asks the
    sentinels where the master is, so a failover is followed within one beat
    (the old master takes heartbeats until it is demoted, then throws them
    away). A failed look-up leaves the pool as it is."""

    # At most one look-up per this many seconds (a beat makes a call per
    # stream).
    CHECK_EVERY_S = 1.0

    def __init__(self, master: Redis) -> None:
        # redis-py types neither the Sentinel pool's look-up nor the call.
        self.master: Any = master
        self.connection_pool: Any = master.connection_pool
        self._checked = -self.CHECK_EVERY_S

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        now = time.monotonic()
        if now - self._checked >= self.CHECK_EVERY_S:
            self._checked = now
            with contextlib.suppress(*UNREACHABLE):
                await self.connection_pool.get_master_address()
        return await self.master.execute_command(*args, **options)
