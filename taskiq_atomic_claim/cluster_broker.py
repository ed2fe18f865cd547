"""``AtomicRedisStreamClusterBroker``: the atomic reclaim on Redis Cluster.

taskiq-redis's ``RedisStreamClusterBroker`` never reclaims. This broker runs
the shared listen loop (``reclaiming.Listener``) through ``SlotRoutedClient``
(``cluster_client.py``), which routes what redis-py's ``RedisCluster`` does
not route right: script calls by their keys' slot, XREADGROUP per slot, and
the server checks on every primary.

Every key a script touches carries its stream's hash slot (``keys.py``); the
constructor checks that for every stream.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from redis.asyncio import RedisCluster
from taskiq_redis import RedisStreamClusterBroker

from taskiq_atomic_claim.atomic_parts import AtomicBroker, AtomicParts
from taskiq_atomic_claim.clients import ScriptClient
from taskiq_atomic_claim.cluster_client import (
    OneNodeClient,
    SlotRoutedClient,
    StreamEntries,
)
from taskiq_atomic_claim.connection import Connection
from taskiq_atomic_claim.finished import FinishedEntries
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.scripts import ScriptRunner
from taskiq_atomic_claim.server_info import (
    ServerInfo,
    probe_scripting,
    read_server_info,
)
from taskiq_atomic_claim.settings import (
    DEFAULT_IDEMPOTENCY_WINDOW_S,
    DEFAULT_IDLE_TIMEOUT_MS,
    DEFAULT_KICK_PATIENCE_S,
    DEFAULT_MAX_DELIVERIES,
    check_broker_arguments,
    default_consumer_name,
)


class AtomicRedisStreamClusterBroker(AtomicBroker, RedisStreamClusterBroker):
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
        :param xread_count: entries one XREADGROUP returns at most (per slot).
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
        :param kick_patience: seconds a kick retries through an outage,
            and
        :param idempotency_window: seconds Redis >= 8.6 remembers a kicked
            task id, and
        :param keep_acked: seconds the workers' trim keeps acked entries:
            as in ``AtomicRedisStreamBroker``.
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
            keep_acked=keep_acked,
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
        self.atomic = AtomicParts(
            self,
            claim_settings,
            ClusterConnection(
                self.redis,
                queue_name,
                # As the parent builds its own: for the liveness thread.
                functools.partial(
                    RedisCluster.from_url,
                    url,
                    max_connections=max_connection_pool_size,
                    **connection_kwargs,
                ),
            ),
            xread_count,
        )


class ClusterConnection(Connection):
    """Every primary of a cluster, through ``SlotRoutedClient``: script
    calls by their keys' slot, XREADGROUP per slot, server checks on every
    primary."""

    waits_out_startup = True
    per_slot = True

    def __init__(
        self,
        redis: RedisCluster,
        queue_name: str,
        build_cluster: Callable[[], RedisCluster],
    ) -> None:
        super().__init__(queue_name)
        self.redis = redis
        self.build_cluster = build_cluster

    @contextlib.asynccontextmanager
    async def listen_client(
        self,
        on_delivered: Callable[[StreamEntries], None] | None = None,
        finished: FinishedEntries | None = None,
    ) -> AsyncIterator[SlotRoutedClient]:
        # Not ``async with self.redis``: leaving that closes the shared
        # client's connections whenever no other user holds it.
        client = SlotRoutedClient(self.redis, on_delivered, finished)
        try:
            yield client
        finally:
            await client.close()

    def connect(self) -> contextlib.AbstractAsyncContextManager[SlotRoutedClient]:
        return self.listen_client()

    @contextlib.asynccontextmanager
    async def liveness_client(self) -> AsyncIterator[SlotRoutedClient]:
        # A cluster client of its own, routed as the broker's script calls.
        cluster = self.build_cluster()
        client = SlotRoutedClient(cluster)
        try:
            yield client
        finally:
            try:
                await client.close()
            finally:
                await cluster.aclose()

    def setup_client(self) -> contextlib.AbstractAsyncContextManager[RedisCluster]:
        # As the parent, without its ``async with self.redis`` (see
        # ``listen_client``).
        return contextlib.nullcontext(self.redis)

    def servers(self, client: Any) -> list[tuple[str, Any]]:
        # Every primary holds some queue: each gets its own settings check.
        return [
            (f"primary {node.host}:{node.port}", OneNodeClient(self.redis, node))
            for node in self.redis.get_primaries()
        ]

    async def require_scripting(
        self, scripts: ScriptRunner, client: ScriptClient
    ) -> ServerInfo:
        """Refuse, naming it, a primary where this user runs no scripts
        (every ack on its slots would fail), probing each as the broker will
        call it: FCALL, or EVALSHA when the oldest primary
        (``SlotRoutedClient``'s INFO) is 6.2."""
        server = await scripts.probe_server(client)
        for where, node in self.servers(client):
            problem = await probe_scripting(node, server.functions)
            if problem:
                found = await read_server_info(node)
                replace(found, scripting_problem=problem).require_scripting(where)
        return server

    async def close(self) -> None:
        # Its calls reconnect what the parent closed: close it again.
        await self.redis.aclose()
