"""Every task's start and ack, sent through redis-py's pipelines: the calls
made in one turn of the event loop (under load, within a millisecond)
go out together (``TurnBatch``), in one pipeline (``TaskCalls``).

Each caller awaits its own reply: a start is on the server before its task
runs (so a worker killed by its task at once has the crash counted), an
ack before its task's slot is free. While a call is in flight the next one
gathers, so a busy worker's calls share round trips.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

from taskiq_atomic_claim.connection import Connect
from taskiq_atomic_claim.server_calls import within
from taskiq_atomic_claim.task_records import (
    ack_commands,
    record_many_starts,
    start_commands,
)

Item = TypeVar("Item")
# Seconds a call waits for company when the last one went out less than
# this long ago: each call costs the worker a pipeline (a connection from
# the pool, a write, a read), and taskiq hands over its tasks one at a time.
GATHER_S = 0.001
Waiting = list[tuple[Item, asyncio.Future[None]]]


class TurnBatch(Generic[Item]):
    """Items added in one turn of the loop (or, under load, within
    ``GATHER_S`` of the last call), sent by one call of ``send``; one call
    at a time, within ``deadline_s``. ``send`` settles each item's future;
    those it leaves unsettled share its outcome."""

    def __init__(
        self,
        send: Callable[[Waiting[Item]], Awaitable[None]],
        deadline_s: float,
    ) -> None:
        self.send = send
        self.deadline_s = deadline_s
        self.queued: Waiting[Item] = []
        self.sending: asyncio.Task[None] | None = None
        self.last_sent = float("-inf")

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
            loop = asyncio.get_running_loop()
            while self.queued:
                # Calls closer together than GATHER_S (a busy worker) wait
                # for company; an idle worker's call goes at once.
                wait = self.last_sent + GATHER_S - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                self.last_sent = loop.time()
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
                            if not future.done():
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
AckGroup = tuple[str, str, str, bool]


class TaskCalls:
    """Starts and acks through ``connect``'s client, those of one loop turn
    in one call. On one server that call is one pipeline: the starts'
    MULTI ... EXEC, then the acks (outside the transaction: out of memory
    the server refuses the starts, never the acks). ``per_slot`` (Cluster):
    a transaction per started hash and a pipeline of acks, concurrently."""

    def __init__(self, connect: Connect, deadline_s: float, per_slot: bool) -> None:
        self.connect = connect
        self.per_slot = per_slot
        self.calls: TurnBatch[Start | Ack] = TurnBatch(self.send, deadline_s)

    def start(self, started: str, ttl_ms: int, entry_id: str) -> Awaitable[None]:
        return self.calls.add((started, ttl_ms, entry_id))

    def ack(
        self, stream: str, started: str, group: str, delete_acked: bool, entry_id: str
    ) -> Awaitable[None]:
        return self.calls.add((stream, started, group, delete_acked, entry_id))

    async def settled(self) -> None:
        await self.calls.settled()

    async def send(self, batch: Waiting[Start | Ack]) -> None:
        hashes: dict[str, tuple[str, int, list[str]]] = {}
        acks: dict[AckGroup, list[str]] = {}
        for call, _ in batch:
            if len(call) == 3:
                started, ttl_ms, entry_id = call
                hashes.setdefault(started, (started, ttl_ms, []))[2].append(entry_id)
            else:
                stream, started, group, delete_acked, entry_id = call
                key = (stream, started, group, delete_acked)
                acks.setdefault(key, []).append(entry_id)
        async with self.connect() as client:
            if self.per_slot:
                failed = await _per_slot(client, hashes, acks)
            else:
                failed = await _one_pipeline(client, hashes, acks)
        if not failed:
            return
        for call, future in batch:
            error = failed.get(call[0] if len(call) == 3 else call[:4])
            if error is not None and not future.done():  # else cancelled
                future.set_exception(error)


async def _one_pipeline(
    client: Any,
    hashes: dict[str, tuple[str, int, list[str]]],
    acks: dict[AckGroup, list[str]],
) -> dict[Any, Exception]:
    """Starts and acks in one pipeline; what failed, by started hash or
    ack group."""
    async with client.pipeline(transaction=False) as pipe:
        if hashes:
            pipe.execute_command("MULTI")
            for started, ttl_ms, ids in hashes.values():
                for command in start_commands(started, ttl_ms, ids):
                    pipe.execute_command(*command)
            pipe.execute_command("EXEC")
        for (stream, started, group, delete_acked), ids in acks.items():
            for command in ack_commands(stream, started, group, ids, delete_acked):
                pipe.execute_command(*command)
        replies = await pipe.execute(raise_on_error=False)
    failed: dict[Any, Exception] = {}
    acked = replies
    if hashes:
        queued = sum(len(ids) + 2 for _, _, ids in hashes.values())
        # A command refused as queued (out of memory) aborts the EXEC.
        exec_reply = replies[queued + 1]
        if isinstance(exec_reply, Exception):
            # EXECABORT says only that; the refused command's reply says why
            # (OOM, or the ACL naming the command).
            cause = next(
                (r for r in replies[1 : queued + 1] if isinstance(r, Exception)),
                exec_reply,
            )
            failed.update(dict.fromkeys(hashes, cause))
        acked = replies[queued + 2 :]
    # The XACK's reply says whether the ack worked; a failed HDEL only
    # leaves a count in an expiring hash, counting nothing.
    for key, reply in zip(acks, acked[::2], strict=True):
        if isinstance(reply, Exception):
            failed[key] = reply
    return failed


async def _per_slot(
    client: Any,
    hashes: dict[str, tuple[str, int, list[str]]],
    acks: dict[AckGroup, list[str]],
) -> dict[Any, Exception]:
    """Cluster: a transaction's keys share one slot; a plain pipeline is
    routed by key."""
    failed: dict[Any, Exception] = {}

    async def start(started: str, each: tuple[str, int, list[str]]) -> None:
        try:
            await record_many_starts(client, [each])
        except Exception as error:
            failed[started] = error

    async def ack() -> None:
        try:
            failed.update(await _one_pipeline(client, {}, acks))
        except Exception as error:
            failed.update(dict.fromkeys(acks, error))

    await asyncio.gather(
        *(start(started, each) for started, each in hashes.items()),
        *([ack()] if acks else []),
    )
    return failed
