"""``AtomicRedisStreamClusterBroker``: the atomic reclaim on Redis Cluster.

taskiq-redis's ``RedisStreamClusterBroker`` never reclaims. This broker runs
the shared listen loop (``ReclaimingListener``) through ``SlotRoutedClient``,
which stands between the loop and redis-py's ``RedisCluster`` because:

- script administration (FUNCTION LOAD, SCRIPT LOAD, FUNCTION LIST, SCRIPT
  EXISTS) has no key, and must reach every primary, not one node; INFO is
  asked of every primary too, so one older node puts the whole broker on
  cached scripts;
- FCALL and XREADGROUP have "movable" keys, which redis-py resolves with
  COMMAND GETKEYS on one fixed node: once that node dies, every such call
  fails until some other command happens to refresh the topology. They are
  sent here to the primary of their first key's slot instead;
- XREADGROUP over streams in different slots is CROSSSLOT (the parent sends
  it anyway): streams are read per slot, concurrently;
- a topology change shows up as CLUSTERDOWN, TRYAGAIN, an uncovered slot or
  a node that cannot be reached; ``server_errors.classify`` calls those an
  outage, so the loop waits them out instead of stopping.

Every key a script touches carries its stream's hash slot (``keys.py``); the
constructor checks that for every stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from redis.asyncio import RedisCluster
from redis.asyncio.cluster import ClusterNode
from redis.crc import key_slot
from redis.exceptions import RedisClusterException, ResponseError
from taskiq_redis import RedisStreamClusterBroker

from taskiq_atomic_claim.backoff import Backoff
from taskiq_atomic_claim.claim import ClaimOutcome
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.reclaiming import (
    _UNREACHABLE,
    REPLY_MARGIN_S,
    ReclaimingListener,
    logger,
    read_entries,
    within,
)
from taskiq_atomic_claim.scripts import _library_name
from taskiq_atomic_claim.server_errors import is_outage
from taskiq_atomic_claim.settings import DEFAULT_MAX_DELIVERIES, check_broker_arguments

# (stream, [(entry id, fields), ...]) as XREADGROUP replies under RESP2.
StreamEntries = list[tuple[Any, Any]]

_SCRIPT_CALLS = frozenset({"FCALL", "FCALL_RO", "EVALSHA", "EVALSHA_RO", "EVAL"})
_EVERY_PRIMARY = frozenset({"FUNCTION", "SCRIPT", "INFO"})


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def slot_groups(streams: dict[str, str | int]) -> list[dict[str, str | int]]:
    """``streams`` split by hash slot, in order: one XREADGROUP per group."""
    groups: dict[int, dict[str, str | int]] = {}
    for stream, start in streams.items():
        groups.setdefault(key_slot(stream.encode()), {})[stream] = start
    return list(groups.values())


def _as_pairs(reply: Any) -> StreamEntries:
    # RESP3 replies map stream -> entries; the loop expects RESP2's pairs.
    if isinstance(reply, dict):
        return list(reply.items())
    return list(reply or [])


def _merge_per_node(args: tuple[Any, ...], replies: list[Any]) -> Any:
    """One reply for a command every primary answered."""
    name = " ".join(_text(arg).upper() for arg in args[:2])
    if name == "SCRIPT EXISTS":
        # Loaded only where every primary has it.
        return [all(flags) for flags in zip(*replies, strict=True)]
    if name == "FUNCTION LIST":
        # The libraries every primary has.
        present = [{_library_name(entry) for entry in reply} for reply in replies]
        everywhere = set.intersection(*present)
        return [entry for entry in replies[0] if _library_name(entry) in everywhere]
    if _text(args[0]).upper() == "INFO":
        # The oldest server decides which features may be used.
        return min(replies, key=_version_key)
    # FUNCTION LOAD, SCRIPT LOAD: every node answered alike (library name,
    # sha) or the gather raised.
    return replies[0]


def _version_key(info: Any) -> tuple[int, ...]:
    version = str(info.get("redis_version", "0")) if isinstance(info, dict) else "0"
    return tuple(int(part) for part in version.split(".") if part.isdigit())


class SlotRoutedClient:
    """What the listen loop and ``ScriptRunner`` talk to on a cluster.

    ``execute_command`` is ``RedisCluster.execute_command`` with the routing
    described in the module docstring; ``xreadgroup`` reads streams in
    several slots with one outstanding XREADGROUP per slot.

    An outstanding read is kept, never cancelled, across calls: a read the
    server served but whose reply was thrown away would leave its entries
    pending, unseen, until idle_timeout. ``on_delivered`` hears of every read
    as it completes, so entries that arrive while the consumer is not
    pulling are known (and heartbeated) at once.

    A slot whose primary cannot be reached rests, with its own capped
    backoff, while the other slots are still read: one failed primary out
    of several must not stop the streams on the others. Only when every
    slot fails does the error reach the loop, which then waits it out.
    """

    def __init__(
        self,
        cluster: RedisCluster,
        on_delivered: Callable[[StreamEntries], None] | None = None,
    ) -> None:
        self.cluster = cluster
        self._on_delivered = on_delivered
        self._reads: dict[tuple[str, ...], asyncio.Task[StreamEntries]] = {}
        # A failed read whose siblings brought entries: raised next call,
        # after those entries have been handed over.
        self._deferred: BaseException | None = None
        # Per slot group that failed to be read: the error, the backoff, and
        # when to try again.
        self._failing: dict[tuple[str, ...], BaseException] = {}
        self._backoff: dict[tuple[str, ...], Backoff] = {}
        self._resting_until: dict[tuple[str, ...], float] = {}

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        name = _text(args[0]).upper()
        if name in _EVERY_PRIMARY:
            return await self._on_every_primary(args, options)
        if name in _SCRIPT_CALLS and len(args) > 3 and int(args[2]) > 0:
            node = await self.primary_for(_text(args[3]))
            return await self.cluster.execute_command(
                *args, target_nodes=node, **options
            )
        return await self.cluster.execute_command(*args, **options)

    async def type(self, name: str) -> Any:
        """TYPE, for the loop's start-up check of the stream keys."""
        return await self.execute_command("TYPE", name)

    async def primary_for(self, key: str) -> ClusterNode:
        """The primary serving ``key`` as the client now knows the cluster."""
        # A no-op unless a failed command asked for the topology to be
        # refreshed; then it is refreshed before we pick a node from it.
        await self.cluster.initialize()
        node = self.cluster.get_node_from_key(key)
        if node is None:
            raise RedisClusterException(f"slot of {key!r} not covered")
        return node

    async def _on_every_primary(
        self, args: tuple[Any, ...], options: dict[str, Any]
    ) -> Any:
        await self.cluster.initialize()
        primaries = self.cluster.get_primaries()
        # One call per node, so the reply shape does not depend on how many
        # primaries there are; any failure fails the whole load, which the
        # caller retries: a script must be everywhere its keys may be.
        replies = await asyncio.gather(
            *(
                self.cluster.execute_command(*args, target_nodes=node, **options)
                for node in primaries
            )
        )
        return _merge_per_node(args, list(replies))

    async def xreadgroup(
        self,
        groupname: str,
        consumername: str,
        streams: dict[str, str | int],
        count: int | None = None,
        block: int | None = None,
        claim_min_idle_time: int | None = None,
    ) -> StreamEntries:
        """XREADGROUP for streams in any slots; replies as RESP2 pairs.
        ``claim_min_idle_time``: XREADGROUP ... CLAIM (Redis >= 8.4)."""
        read = functools.partial(
            self._read,
            groupname=groupname,
            consumername=consumername,
            count=count,
            block=block,
            claim_min_idle_time=claim_min_idle_time,
        )
        if self._deferred is not None:
            error, self._deferred = self._deferred, None
            raise error
        groups = slot_groups(streams)
        if len(groups) == 1:
            return await read(groups[0])
        now = time.monotonic()
        for group in groups:
            key = tuple(group)
            if key not in self._reads and self._resting_until.get(key, 0.0) <= now:
                self._reads[key] = asyncio.create_task(read(group))
        # block 0 is "forever" to Redis; None does not block at all.
        timeout = None if block in (None, 0) else block / 1000
        if not self._reads:
            # Every slot is resting after failures: wait for the first one
            # due, within the caller's block.
            due = min(self._resting_until.values()) - now
            await asyncio.sleep(max(0.0, due if timeout is None else min(due, timeout)))
            return []
        done, _ = await asyncio.wait(
            self._reads.values(), timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        return self._collect(done, len(groups))

    def _collect(
        self, done: Iterable[asyncio.Task[StreamEntries]], group_count: int
    ) -> StreamEntries:
        fetched: StreamEntries = []
        failure: BaseException | None = None
        for key, task in list(self._reads.items()):
            if task not in done:
                continue
            del self._reads[key]
            error = task.exception()
            if error is None:
                fetched += task.result()
                self._reachable(key)
            elif is_outage(error):
                self._unreachable(key, error)
            elif failure is None:
                failure = error
        if failure is None and len(self._failing) == group_count:
            # Nothing is reachable: the loop's own outage handling takes over
            # and every slot is tried again after it.
            failure = next(iter(self._failing.values()))
            self._failing.clear()
            self._backoff.clear()
            self._resting_until.clear()
        if failure is not None:
            if not fetched:
                raise failure
            self._deferred = failure
        return fetched

    def _unreachable(self, key: tuple[str, ...], error: BaseException) -> None:
        backoff = self._backoff.get(key)
        if backoff is None:
            backoff = self._backoff[key] = Backoff(
                f"streams {', '.join(key)}", consequence="reading the others meanwhile"
            )
        self._failing[key] = error
        self._resting_until[key] = time.monotonic() + backoff.failed(error)

    def _reachable(self, key: tuple[str, ...]) -> None:
        self._failing.pop(key, None)
        backoff = self._backoff.pop(key, None)
        if backoff is not None:
            backoff.succeeded()
        self._resting_until.pop(key, None)

    async def _read(
        self,
        group: dict[str, str | int],
        groupname: str,
        consumername: str,
        count: int | None,
        block: int | None,
        claim_min_idle_time: int | None,
    ) -> StreamEntries:
        pieces: list[Any] = ["XREADGROUP", "GROUP", groupname, consumername]
        options: dict[str, Any] = {}
        if count is not None:
            pieces += ["COUNT", count]
        if block is not None:
            pieces += ["BLOCK", block]
        if claim_min_idle_time is not None:
            pieces += ["CLAIM", claim_min_idle_time]
            # Tells redis-py's reply parser to keep each entry's idle time
            # and delivery count.
            options["claim_min_idle_time"] = claim_min_idle_time
        pieces += ["STREAMS", *group, *group.values()]
        node = await self.primary_for(next(iter(group)))
        # Bounded: on a half-open connection (socket_timeout None) the read
        # would wait for ever and its slot would never be read again.
        call = self.cluster.execute_command(*pieces, target_nodes=node, **options)
        reply = await (within(block / 1000 + REPLY_MARGIN_S, call) if block else call)
        fetched = _as_pairs(reply)
        if fetched and self._on_delivered is not None:
            self._on_delivered(fetched)
        return fetched

    async def close(self) -> None:
        """Stop outstanding reads (their entries, if any, were already
        reported to ``on_delivered``, so a hand-back still covers them)."""
        reads, self._reads = list(self._reads.values()), {}
        for task in reads:
            task.cancel()
        for task in reads:
            with contextlib.suppress(BaseException):
                await task


# The parent annotates additional_streams as dict[str, str], the loop as
# dict[str, str | int] (what XREADGROUP takes): the same object either way.
class _OneNode:
    """The slice of a client that durability checks need, bound to one node."""

    def __init__(self, cluster: RedisCluster, node: ClusterNode) -> None:
        self.cluster = cluster
        self.node = node

    async def execute_command(self, *args: Any) -> Any:
        return await self.cluster.execute_command(*args, target_nodes=self.node)


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
        **connection_kwargs: Any,
    ) -> None:
        """Take the parent's arguments, in its order and units; the reclaim
        arguments, keyword-only, are ``AtomicRedisStreamBroker``'s.

        :param idle_timeout: ms an entry must sit unacknowledged before it is
            reclaimed from a consumer that stopped.
        :param unacknowledged_batch_size: entries one claim takes at most.
        :param unacknowledged_lock_timeout: seconds the claim lease lives;
            by default one claim interval, never forever.
        :param xread_count: entries one XREADGROUP returns at most (per slot).
        :param claim_interval: ms between reclaim cycles; by default
            min(1000, idle_timeout // 2). Must be below idle_timeout.
        :param max_deliveries: an entry whose task started this many times
            in workers that died running it goes to the dead-letter stream
            at the next reclaim; deliveries never started do not count.
            None never gives up.
        :param delete_acked: acks also delete the entry from the stream once
            every consumer group acked it (XACKDEL ... ACKED), keeping the
            stream bounded without maxlen. Needs Redis >= 8.2; elsewhere the
            broker refuses to start.
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

    async def claim(self, client: Any, stream: str) -> ClaimOutcome:
        """A claim cycle for one stream; with several streams, one whose
        primary is unreachable is skipped this cycle instead of stopping the
        claims (and reads) of all the others."""
        try:
            outcome = await super().claim(client, stream)
        except Exception as error:
            if len(self.streams) == 1 or not is_outage(error):
                raise
            if stream not in self._unclaimable:
                self._unclaimable.add(stream)
                logger.warning(
                    "Cannot claim on stream %r, claiming the others meanwhile: %s",
                    stream,
                    error,
                )
            return ClaimOutcome(skipped=True)
        if stream in self._unclaimable:
            self._unclaimable.discard(stream)
            logger.warning("Claiming on stream %r again", stream)
        return outcome

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
                await self.redis.xgroup_create(
                    stream,
                    self.consumer_group_name,
                    id=self.consumer_id,
                    mkstream=self.mkstream,
                )
            except ResponseError as error:  # BUSYGROUP, mostly
                logger.debug("%s", error)
            except (*_UNREACHABLE, RedisClusterException) as error:
                logger.warning(
                    "Consumer group %r on stream %r not created yet: %s",
                    self.consumer_group_name,
                    stream,
                    error,
                )

    def _servers(self, client: Any) -> list[tuple[str, Any]]:
        # Every primary holds some queue: each gets its own settings check.
        return [
            (f"primary {node.host}:{node.port}", _OneNode(self.redis, node))
            for node in self.redis.get_primaries()
        ]

    async def startup(self) -> None:
        """Create the groups and check the stream keys, as the standalone
        broker does; a cluster that cannot be reached yet is waited out by
        the listen loop instead of failing the worker's start."""
        await super().startup()
        try:
            await self.check_stream_types()
        except Exception as error:
            if not is_outage(error):
                raise
            logger.warning("Stream keys not checked at start-up: %s", error)
            return await self.check_durability()
        await self.check_server_features()
        await self.check_durability()

    async def shutdown(self) -> None:
        """Hand unacked deliveries back, then close the client."""
        await self.hand_back()
        await super().shutdown()
