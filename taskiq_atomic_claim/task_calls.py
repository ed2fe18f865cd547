"""Every task's start and ack, sent through redis-py's pipelines: the calls
made in one turn of the event loop go out together (``TurnBatch``).

Starts go as one transaction (``task_records.py``'s commands; on Cluster
one per started hash, as a transaction's keys share one slot), acks as one
plain pipeline. Each caller awaits its own reply: a start is on the server
before its task runs (so a worker killed by its task at once has the crash
counted), an ack before its task's slot is free. While a batch is in
flight the next one gathers, so a busy worker's calls share round trips.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from taskiq_atomic_claim.connection import Connect
from taskiq_atomic_claim.server_calls import within
from taskiq_atomic_claim.task_records import ack_commands, record_many_starts

Item = TypeVar("Item")
Waiting = list[tuple[Item, asyncio.Future[None]]]


class TurnBatch(Generic[Item]):
    """Items added in one turn of the loop, sent by one call of ``send``;
    one call at a time, within ``deadline_s``. ``send`` settles each
    item's future; those it leaves unsettled share its outcome."""

    def __init__(
        self,
        send: Callable[[Waiting[Item]], Awaitable[None]],
        deadline_s: float,
    ) -> None:
        self.send = send
        self.deadline_s = deadline_s
        self.queued: Waiting[Item] = []
        self.sending: asyncio.Task[None] | None = None

    def add(self, item: Item) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self.queued.append((item, future))
        if self.sending is None:
            # Runs after the callbacks already due in this turn, which may
            # add theirs.
            self.sending = loop.create_task(self.send_all())
        return future

    async def send_all(self) -> None:
        try:
            while self.queued:
                batch, self.queued = self.queued, []
                try:
                    await within(self.deadline_s, self.send(batch))
                except BaseException as error:
                    failure = (
                        error
                        if isinstance(error, Exception)
                        else RuntimeError("the call was cancelled")
                    )
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(failure)
                    if not isinstance(error, Exception):
                        for _, future in self.queued:
                            future.set_exception(failure)
                        self.queued = []
                        raise
                for _, future in batch:
                    if not future.done():
                        future.set_result(None)
        finally:
            self.sending = None

    async def settled(self) -> None:
        """Once nothing added so far waits for its reply."""
        while self.sending is not None:
            await asyncio.wait([self.sending])


# (started hash, its ttl in ms, entry id)
Start = tuple[str, int, str]
# (stream, started hash, group, delete_acked, entry id)
Ack = tuple[str, str, str, bool, str]


class TaskCalls:
    """Starts and acks through ``connect``'s client, batched per loop
    turn. ``per_slot``: a transaction per started hash (Cluster)."""

    def __init__(self, connect: Connect, deadline_s: float, per_slot: bool) -> None:
        self.connect = connect
        self.per_slot = per_slot
        self.starts: TurnBatch[Start] = TurnBatch(self.send_starts, deadline_s)
        self.acks: TurnBatch[Ack] = TurnBatch(self.send_acks, deadline_s)

    def start(self, started: str, ttl_ms: int, entry_id: str) -> Awaitable[None]:
        return self.starts.add((started, ttl_ms, entry_id))

    def ack(
        self, stream: str, started: str, group: str, delete_acked: bool, entry_id: str
    ) -> Awaitable[None]:
        return self.acks.add((stream, started, group, delete_acked, entry_id))

    async def settled(self) -> None:
        await self.starts.settled()
        await self.acks.settled()

    async def send_starts(self, batch: Waiting[Start]) -> None:
        hashes: dict[str, tuple[str, int, list[str]]] = {}
        for (started, ttl_ms, entry_id), _ in batch:
            hashes.setdefault(started, (started, ttl_ms, []))[2].append(entry_id)
        async with self.connect() as client:
            if not self.per_slot:
                await record_many_starts(client, list(hashes.values()))
                return
            outcomes = await asyncio.gather(
                *(record_many_starts(client, [each]) for each in hashes.values()),
                return_exceptions=True,
            )
        failed = {
            started: outcome
            for started, outcome in zip(hashes, outcomes, strict=True)
            if isinstance(outcome, BaseException)
        }
        for (started, _, _), future in batch:
            if started in failed:
                future.set_exception(failed[started])

    async def send_acks(self, batch: Waiting[Ack]) -> None:
        acks: dict[tuple[str, str, str, bool], list[str]] = {}
        for (stream, started, group, delete_acked, entry_id), _ in batch:
            acks.setdefault((stream, started, group, delete_acked), []).append(entry_id)
        async with self.connect() as client, client.pipeline(transaction=False) as pipe:
            for (stream, started, group, delete_acked), ids in acks.items():
                for command in ack_commands(stream, started, group, ids, delete_acked):
                    pipe.execute_command(*command)
            replies = await pipe.execute(raise_on_error=False)
        # The XACK's reply says whether the ack worked; a failed HDEL only
        # leaves a count in an expiring hash, counting nothing.
        failed = {
            key: reply
            for key, reply in zip(acks, replies[::2], strict=True)
            if isinstance(reply, Exception)
        }
        for (stream, started, group, delete_acked, _), future in batch:
            error = failed.get((stream, started, group, delete_acked))
            if error is not None:
                future.set_exception(error)
