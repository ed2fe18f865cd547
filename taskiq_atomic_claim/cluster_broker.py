"""``AtomicRedisStreamClusterBroker``: the atomic reclaim on Redis Cluster.

taskiq-redis's ``RedisStreamClusterBroker`` never reclaims. This broker runs
the shared listen loop (``ReclaimingListener``) through ``SlotRoutedClient``
(``cluster_client.py``), which routes what redis-py's ``RedisCluster`` does
not route right: script calls by their keys' slot, XREADGROUP per slot, and
the server checks on every primary.

Every key a script touches carries its stream's hash slot (``keys.py``); the
constructor checks that for every stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from redis.exceptions import RedisClusterException, ResponseError
from taskiq_redis import RedisStreamClusterBroker

from taskiq_atomic_claim.claim import ClaimOutcome
from taskiq_atomic_claim.cluster_client import (
    OneNodeClient,
    SlotRoutedClient,
    StreamEntries,
    slot_groups,
)
from taskiq_atomic_claim.group_recovery import create_group, first_position
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.native_reads import read_entries
from taskiq_atomic_claim.reclaiming import ReclaimingListener, logger
from taskiq_atomic_claim.server_errors import Fault, classify, is_outage
from taskiq_atomic_claim.server_info import probe_scripting, read_server_info
from taskiq_atomic_claim.settings import (
    DEFAULT_IDEMPOTENCY_WINDOW_S,
    DEFAULT_KICK_PATIENCE_S,
    DEFAULT_MAX_DELIVERIES,
    check_broker_arguments,
    default_consumer_name,
)
from taskiq_atomic_claim.stream_setup import require_stream_type


class AtomicRedisStreamClusterBroker(  # type: ignore[misc]
    ReclaimingListener, RedisStreamClusterBroker
):
    """A drop-in ``RedisStreamClusterBroker`` that reclaims, as
    ``AtomicRedisStreamBroker`` does on a single server.

    Each stream's claim is one script call on the primary of that stream's
    slot; streams in different slots are claimed, and read, separately.
    """

    def __init__(
        self,
        url: str,
        queue_name: str = "taskiq",
        max_connection_pool_size: int = 2**31,
        consumer_group_name: str = "taskiq",
        consumer_name: str | None = None,
        consumer_id: str = "$",
        mkstream: bool = True,
        xread_block: int = 10000,
        maxlen: int | None = None,
        approximate: bool = True,
        additional_streams: dict[str, str | int] | None = None,
        *,
        idle_timeout: int = 600000,
        unacknowledged_batch_size: int = 100,
        unacknowledged_lock_timeout: float | None = None,
        xread_count: int | None = 100,
        claim_interval: int | None = None,
        max_deliveries: int | None = DEFAULT_MAX_DELIVERIES,
        delete_acked: bool = False,
        kick_patience: float = DEFAULT_KICK_PATIENCE_S,
        idempotency_window: int = DEFAULT_IDEMPOTENCY_WINDOW_S,
        **connection_kwargs: Any,
    ) -> None:
        """Take the parent's arguments, in its order and units; the reclaim
        arguments, keyword-only, are ``AtomicRedisStreamBroker``'s.

        :param idle_timeout: ms an entry must sit unacknowledged before it is
            reclaimed from a consumer that stopped.
        :param unacknowledged_batch_size: entries one claim takes at most.
        :param unacknowledged_lock_timeout: seconds the claim lease lives;
            by default one claim interval, never forever; at most
            idle_timeout (a longer one is cut, with a warning).
        :param xread_count: entries one XREADGROUP returns at most (per slot).
        :param claim_interval: ms between reclaim cycles; by default
            idle_timeout // 4. Must be below idle_timeout. A SIGKILLed
            worker's tasks re-run within idle_timeout + claim_interval.
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
            task id: as in ``AtomicRedisStreamBroker``.
        :raises ValueError: for a bad argument, or a stream whose keys would
            not all hash to its slot (the claim script could not run).
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
        )
        named = [("queue_name", queue_name)]
        named += [("additional_streams key", s) for s in additional_streams or {}]
        for argument, stream in named:
            if not StreamKeys(stream, consumer_group_name).colocated():
                raise ValueError(
                    f"{argument} {stream!r}: its claim keys would not share its"
                    " hash slot (Redis reads a different hash tag in the name);"
                    " rename it, e.g. with a single {tag}"
                )
        # redis-py's asyncio client answers an ASK (a slot migrating) with
        # ASKING on one pooled connection and the command on another, which
        # the target answers MOVED; every 5th MOVED it would then close every
        # connection of every node, failing calls under way (acks, reads)
        # that had nothing to do with the slot. MOVED still updates the slot.
        connection_kwargs.setdefault("reinitialize_steps", 0)
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
            # The parent annotates start ids as str only; ints work as well.
            additional_streams=additional_streams,  # type: ignore[arg-type]
            **connection_kwargs,
        )
        # The parent has no xread_count; the listen loop reads self.count.
        self.count = xread_count
        self._init_reclaim(claim_settings)
        # Streams whose last claim failed to reach their primary.
        self._unclaimable: set[str] = set()

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[SlotRoutedClient]:
        # Not ``async with self.redis``: leaving that closes the shared
        # client's connections whenever no other user holds it.
        client = SlotRoutedClient(self.redis, on_delivered=self._mark_in_flight)
        try:
            yield client
        finally:
            await client.close()

    def _claim_groups(self, streams: list[str]) -> list[list[str]]:
        """One script call per hash slot: its keys must share one."""
        return [list(group) for group in slot_groups(dict.fromkeys(streams, ">"))]

    async def claim_streams(
        self, client: Any, streams: list[str]
    ) -> list[ClaimOutcome]:
        """A claim cycle for streams of one slot, skipped this cycle (tried
        again the next) while the slot migrates, or, with several slots,
        while its primary is unreachable: the reads (and the other slots'
        claims) go on."""
        try:
            outcomes = await super().claim_streams(client, streams)
        except Exception as error:
            fault = classify(error)
            # A migrating slot refuses the claim (its keys are split between
            # two primaries) but serves reads: never stop them for it.
            everything = set(streams) == set(self.streams)
            if not fault.is_outage or (everything and fault is not Fault.MIGRATING):
                raise
            for stream in streams:
                if stream not in self._unclaimable:
                    self._unclaimable.add(stream)
                    logger.warning(
                        "Cannot claim on stream %r (%s), trying again every"
                        " claim interval: %s",
                        stream,
                        fault.value,
                        error,
                    )
            return [ClaimOutcome(skipped=True) for _ in streams]
        for stream in streams:
            if stream in self._unclaimable:
                self._unclaimable.discard(stream)
                logger.warning("Claiming on stream %r again", stream)
        return outcomes

    def _mark_in_flight(self, fetched: StreamEntries) -> None:
        for stream, entry_id, _, _ in read_entries(fetched):
            self.in_flight.add(stream, [entry_id])

    async def _declare_consumer_group(self) -> None:
        # As the parent, without its ``async with self.redis`` (see
        # ``_connection``), and a worker started mid-failover does not die
        # here: the listen loop waits the outage out and recreates a group
        # it finds missing.
        for stream in self.streams:
            try:
                await require_stream_type(self.redis, stream)
                await create_group(
                    self.redis,
                    stream,
                    self.consumer_group_name,
                    await first_position(self.redis, stream, self.consumer_id),
                    self.mkstream,
                )
            except ResponseError as error:  # no stream (mkstream=False), outage
                logger.debug("Group on %r not created yet: %s", stream, error)
            except Exception as error:
                # Unreachable, or the slot migrating ("TTL exhausted").
                if not (is_outage(error) or isinstance(error, RedisClusterException)):
                    raise
                logger.warning(
                    "Consumer group %r on stream %r not created yet: %s",
                    self.consumer_group_name,
                    stream,
                    error,
                )

    def _servers(self, client: Any) -> list[tuple[str, Any]]:
        # Every primary holds some queue: each gets its own settings check.
        return [
            (f"primary {node.host}:{node.port}", OneNodeClient(self.redis, node))
            for node in self.redis.get_primaries()
        ]

    async def require_scripting(self) -> None:
        """Startup: refuse, naming it, a primary where this user runs no
        scripts (every ack on its slots would fail), probing each as the
        broker will call it: FCALL, or EVALSHA when the oldest primary
        (``SlotRoutedClient``'s INFO) is 6.2."""
        async with self._connection() as client:
            self.server = await self.scripts.probe_server(client)
            for where, node in self._servers(client):
                problem = await probe_scripting(node, self.server.functions)
                if problem:
                    found = await read_server_info(node)
                    replace(found, scripting_problem=problem).require_scripting(where)

    async def startup(self) -> None:
        """Create the groups and check the stream keys, as the standalone
        broker does; a cluster that cannot be reached yet is waited out by
        the listen loop instead of failing the worker's start."""
        await super().startup()
        try:
            await self.check_stream_types()
            await self.require_scripting()
        except Exception as error:
            if not is_outage(error):
                raise
            logger.warning(
                "Stream keys and scripting not checked at start-up: %s", error
            )
            return await self.check_durability()
        await self.check_server_features()
        await self.check_durability()

    async def shutdown(self) -> None:
        """Hand back what no task runs; after the app's shutdown handlers
        (tasks run on through them), give back the rest and delete this
        consumer if it owns nothing pending (``finish_shutdown``)."""
        await self.hand_back()
        try:
            await super().shutdown()
        finally:
            await self.finish_shutdown()
            # Its calls reconnect what the parent closed: close it again.
            await self.redis.aclose()
