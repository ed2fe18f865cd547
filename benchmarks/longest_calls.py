"""Part: longest calls. How long each server-side operation blocks the
server at most, in a mass recovery with large payloads, next to the read
that reclaims.

The scene: ``longest_orphans`` entries of ``longest_payload`` bytes each,
pending on dead consumers, long idle (made with XCLAIM ... FORCE JUSTID, so
the harness never reads them), one entry in a hundred deleted while
pending. For each batch size (``unacknowledged_batch_size`` and
``xread_count`` alike) one consumer calls every operation with the
arguments and in the shape the broker does:

1. drop_trimmed pages through the PEL, one page of ``batch`` a call (the
   sweep where reads reclaim); before it, as a baseline, the same pages
   with each entry's existence tested by XRANGE id id, which reads the
   entry in full (what the sweep did before, and does on Redis 6.2);
2. claim.lua takes the idle entries, ``batch`` a call, until none is left,
   each call followed by the XCLAIM that fetches the claimed entries'
   fields (timed on its own); start records each batch's ids; set_idle
   (the heartbeat) and hand_back (a graceful shutdown) go over what it
   holds, 1000 ids a call, as the broker sends them;
3. the reads alone, each over the handed-back entries, ``batch`` a call,
   then handed back again: XAUTOCLAIM (the read inside claim.lua) and,
   where reads reclaim (Redis >= 8.4), XREADGROUP ... CLAIM: what the
   scripts serve;
4. ack per entry; dead_letter and decline for one entry.

SLOWLOG at a threshold of 0 records every command's time on the server;
after each call the harness reads the newest entry, which is that call
(commands a script runs are logged before it). Figures per batch size and
operation: calls, the median and longest call and the total, in ms. On a
busy machine a call can be preempted: the longest is an upper bound.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from redis.asyncio import Redis

from benchmarks.config import AGED_IDLE_MS, BrokerArguments, Mode
from benchmarks.stats import p50
from taskiq_atomic_claim.claim import claim_streams
from taskiq_atomic_claim.entry_lifecycle import MIN_STARTED_TTL_MS, SCRIPT_BATCH
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.operations import (
    OperationCall,
    dead_letter_call,
    decline_call,
    drop_trimmed_call,
    hand_back_call,
    set_idle_call,
)
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.scripts import ScriptRunner
from taskiq_atomic_claim.task_records import ack, record_starts, start_commands

GROUP = "taskiq"
ALIVE = "alive"
DEAD_CONSUMERS = 4
# The broker's default idle_timeout (ms); the orphans are far older.
IDLE_TIMEOUT = 600_000
NATIVE_READ = "XREADGROUP ... CLAIM"
XRANGE_SWEEP = "sweep by XRANGE (baseline)"
# The baseline: drop_trimmed's page, each entry tested with XRANGE id id;
# counts the entries gone and changes nothing.
XRANGE_SWEEP_SCRIPT = """
local pending = redis.call("XPENDING", KEYS[1], ARGV[1], "IDLE", ARGV[2], ARGV[4],
  "+", ARGV[3])
local gone = 0
for _, row in ipairs(pending) do
  if #redis.call("XRANGE", KEYS[1], row[1], row[1]) == 0 then
    gone = gone + 1
  end
end
local next_start = "-"
if #pending == tonumber(ARGV[3]) then
  next_start = "(" .. pending[#pending][1]
end
return {next_start, gone}
"""
BARE_READ = "XAUTOCLAIM"
# The claim's second call: the XCLAIM that fetches the claimed entries.
CLAIM_FETCH = "claim's XCLAIM (fields)"
# Slow-log entries read after a claim: its nested commands and its XCLAIMs.
# Room for the longest call: a start of SCRIPT_BATCH ids (the most one
# call records) is that many HINCRBYs and the hash's upkeep, each logged on
# its own.
SLOWLOG_LEN = 2048
_T = TypeVar("_T")


# Logged beside a claim's calls: our own reads of the log, and the handshake
# of a connection the pool opened for the claim (slowlog-log-slower-than 0).
_NOT_THE_CALLS = ("SLOWLOG", "HELLO", "CLIENT", "AUTH", "SELECT")


class Timings:
    """Each call's time on the server, by operation, from the slow log."""

    def __init__(self, client: Redis, runner: ScriptRunner) -> None:
        self.client = client
        self.runner = runner
        self.us: dict[str, list[int]] = {}

    async def timed(self, name: str, expected: str, call: Awaitable[_T]) -> _T:
        """Await ``call``, then record the newest slow-log entry, which must
        be a command named ``expected`` (first words)."""
        reply = await call
        entries: Any = await self.client.slowlog_get(1)
        command = text(entries[0]["command"])
        if not command.upper().startswith(expected.upper()):
            raise RuntimeError(f"slow log: wanted {expected!r}, got {command[:80]!r}")
        self.us.setdefault(name, []).append(int(entries[0]["duration"]))
        return reply

    async def commands(self, name: str, expected: list[str], call: Awaitable[_T]) -> _T:
        """Await ``call``, plain commands (no script), then record the sum
        of the newest slow-log entries, which must be ``expected`` in order
        (EXEC is never logged: the commands it ran are)."""
        reply = await call
        entries: Any = await self.client.slowlog_get(len(expected))
        names = [text(entry["command"]).split()[0].upper() for entry in entries]
        if names[::-1] != expected:
            raise RuntimeError(f"slow log: wanted {expected}, got {names[::-1]}")
        self.us.setdefault(name, []).append(sum(int(e["duration"]) for e in entries))
        return reply

    async def claim(self, call: Awaitable[_T]) -> _T:
        """Await a claim (``claim_streams``) and record its script and each
        XCLAIM that then fetched the claimed entries' fields, on its own."""
        invocation = (await self.invocation("claim")).upper()
        newest: Any = await self.client.slowlog_get(1)
        after = int(newest[0]["id"]) if newest else -1
        reply = await call
        logged: Any = await self.client.slowlog_get(SLOWLOG_LEN)
        calls = [
            entry
            for entry in reversed(logged)
            if int(entry["id"]) > after
            and not text(entry["command"]).upper().startswith(_NOT_THE_CALLS)
        ]
        scripts = [
            i
            for i, entry in enumerate(calls)
            if text(entry["command"]).upper().startswith(invocation)
        ]
        if len(scripts) != 1:
            raise RuntimeError(f"slow log: wanted one {invocation!r}")
        self.us.setdefault("claim", []).append(int(calls[scripts[0]]["duration"]))
        for entry in calls[scripts[0] + 1 :]:
            command = text(entry["command"])
            if not command.upper().startswith("XCLAIM"):
                raise RuntimeError(f"slow log: wanted XCLAIM, got {command[:80]!r}")
            self.us.setdefault(CLAIM_FETCH, []).append(int(entry["duration"]))
        return reply

    async def script(self, call: OperationCall[_T]) -> _T:
        name = call.operation.name
        return await self.timed(
            name, await self.invocation(name), self.runner.run(self.client, call)
        )

    async def invocation(self, name: str) -> str:
        """How a call of the operation shows in the slow log."""
        if (await self.runner.server(self.client)).functions:
            return f"FCALL {self.runner.library.function_name(name)}"
        return f"EVALSHA {self.runner.library.scripts[name].sha}"


async def make_orphans(
    client: Redis, stream: str, count: int, payload: bytes
) -> list[str]:
    """``count`` entries pending on dead consumers, a day idle, delivered once;
    every hundredth deleted from the stream while pending."""
    await client.delete(stream)
    ids: list[str] = []
    for first in range(0, count, 50):
        pipe = client.pipeline(transaction=False)
        for _ in range(first, min(first + 50, count)):
            pipe.xadd(stream, {b"data": payload})
        ids += [text(entry_id) for entry_id in await pipe.execute()]
    await client.xgroup_create(stream, GROUP, id="$")
    for first in range(0, count, SCRIPT_BATCH):
        await client.xclaim(
            stream,
            GROUP,
            f"dead-{first // SCRIPT_BATCH % DEAD_CONSUMERS}",
            0,
            ids[first : first + SCRIPT_BATCH],
            idle=AGED_IDLE_MS,
            retrycount=1,
            force=True,
            justid=True,
        )
    gone = set(ids[::100])
    await client.xdel(stream, *gone)
    return [entry_id for entry_id in ids if entry_id not in gone]


async def recover(
    client: Redis, batch: int, payload: bytes, orphans: int, log: Any
) -> dict[str, Any]:
    runner = ScriptRunner()
    await runner.load(client)
    server = await runner.server(client)
    keys = StreamKeys(f"bench-longest-{batch}", GROUP)
    settings = BrokerArguments(
        idle_timeout=IDLE_TIMEOUT, claim_interval=IDLE_TIMEOUT // 4, batch_size=batch
    ).settings()
    present = await make_orphans(client, keys.stream, orphans, payload)
    timings = Timings(client, runner)
    bound = orphans // batch + 3

    sha = await client.script_load(XRANGE_SWEEP_SCRIPT)
    start = "-"
    for _ in range(bound):
        start, _gone = await timings.timed(
            XRANGE_SWEEP,
            f"EVALSHA {sha}",
            client.evalsha(sha, 1, keys.stream, GROUP, IDLE_TIMEOUT, batch, start),
        )
        if text(start) == "-":
            break
    start = "-"
    for _ in range(bound):
        start, _dropped = await timings.script(
            drop_trimmed_call(
                stream=keys.stream,
                started=keys.started,
                group=GROUP,
                min_idle_ms=IDLE_TIMEOUT,
                count=batch,
                start=start,
                consumer=ALIVE,
            )
        )
        if text(start) == "-":
            break

    held: list[str] = []
    for _ in range(bound):
        (outcome,) = await timings.claim(
            claim_streams(runner, client, [keys], ALIVE, settings)
        )
        ids = [entry.id for entry in outcome.entries]
        # Recorded SCRIPT_BATCH at a time: a worker starts tasks one by one,
        # and a start of every id of a 10,000 batch outgrows the slow log.
        for first in range(0, len(ids), SCRIPT_BATCH):
            chunk = ids[first : first + SCRIPT_BATCH]
            commands = start_commands(keys.started, MIN_STARTED_TTL_MS, chunk)
            await timings.commands(
                "start",
                [str(command[0]) for command in commands],
                record_starts(client, keys.started, MIN_STARTED_TTL_MS, chunk),
            )
        held += ids
        if not outcome.full:
            break
    if sorted(held) != sorted(present):
        raise RuntimeError(f"claimed {len(held)} of {len(present)} entries")
    for first in range(0, len(held), SCRIPT_BATCH):
        chunk = held[first : first + SCRIPT_BATCH]
        await timings.script(
            set_idle_call(
                stream=keys.stream,
                group=GROUP,
                consumer=ALIVE,
                idle_ms=0,
                entry_ids=chunk,
            )
        )
    await hand_back_all(timings, keys, held)

    read, cursor = 0, "0-0"
    for _ in range(bound):
        cursor, entries, *_ = await timings.timed(
            BARE_READ,
            BARE_READ,
            client.xautoclaim(
                keys.stream, GROUP, ALIVE, IDLE_TIMEOUT, cursor, count=batch
            ),
        )
        read += len(entries)
        if text(cursor) == "0-0":
            break
    if read != len(present):
        raise RuntimeError(f"XAUTOCLAIM reclaimed {read} of {len(present)}")
    await hand_back_all(timings, keys, held)

    if server.native_claim:
        read = 0
        for _ in range(bound):
            reply: Any = await timings.timed(
                NATIVE_READ,
                "XREADGROUP",
                client.execute_command(
                    "XREADGROUP",
                    "GROUP",
                    GROUP,
                    ALIVE,
                    "COUNT",
                    batch,
                    "CLAIM",
                    IDLE_TIMEOUT,
                    "STREAMS",
                    keys.stream,
                    ">",
                ),
            )
            got = sum(len(entries) for _, entries in _streams(reply))
            read += got
            if got < batch:
                break
        if read != len(present):
            raise RuntimeError(f"the reads reclaimed {read} of {len(present)}")

    for entry_id in held[2:]:
        await timings.commands(
            "ack",
            ["XACK", "HDEL"],
            ack(client, keys.stream, keys.started, GROUP, [entry_id], False),
        )
    await timings.script(
        decline_call(
            stream=keys.stream,
            group=GROUP,
            consumer=ALIVE,
            idle_ms=IDLE_TIMEOUT,
            bound=1000,
            entry_id=held[0],
        )
    )
    await timings.script(
        dead_letter_call(
            stream=keys.stream,
            dead_letters=keys.dead_letters,
            started=keys.started,
            group=GROUP,
            entry_id=held[1],
            reason="bench",
            delete_acked=False,
        )
    )
    await client.delete(keys.stream, keys.dead_letters, keys.started)
    row = {
        "batch": batch,
        "orphans": orphans,
        "payload_bytes": len(payload),
        "calls": {
            name: {
                "calls": len(us),
                "p50_ms": round(p50(us) / 1000, 3),
                "longest_ms": round(max(us) / 1000, 3),
                "total_ms": round(sum(us) / 1000, 1),
            }
            for name, us in timings.us.items()
        },
    }
    longest = ", ".join(
        f"{name} {figures['longest_ms']}" for name, figures in row["calls"].items()
    )
    log(f"longest calls: batch {batch}: {longest} (ms)")
    return row


async def hand_back_all(timings: Timings, keys: StreamKeys, held: list[str]) -> None:
    """As a graceful shutdown: claimable at once, 1000 ids a call."""
    for first in range(0, len(held), SCRIPT_BATCH):
        chunk = held[first : first + SCRIPT_BATCH]
        await timings.script(
            hand_back_call(
                stream=keys.stream,
                started=keys.started,
                group=GROUP,
                consumer=ALIVE,
                idle_ms=IDLE_TIMEOUT,
                n_started=len(chunk),
                entry_ids=chunk,
            )
        )


def _streams(reply: Any) -> list[tuple[Any, list[Any]]]:
    """An XREADGROUP reply as (stream, entries) pairs: RESP2 or RESP3."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return list(reply.items())
    return [(stream, entries) for stream, entries in reply]


async def _run(url: str, mode: Mode, log: Any) -> list[dict[str, Any]]:
    # A claim of the largest batch of large entries runs for seconds.
    client = Redis.from_url(url, socket_timeout=300)
    payload = b"x" * mode.longest_payload
    config: Any = await client.config_get("slowlog-*")
    await client.config_set("slowlog-log-slower-than", 0)
    await client.config_set("slowlog-max-len", SLOWLOG_LEN)
    rows = []
    try:
        for batch in mode.longest_batches:
            rows.append(
                await recover(client, batch, payload, mode.longest_orphans, log)
            )
    finally:
        for name, value in config.items():
            await client.config_set(name, value)
        await client.aclose()
    return rows


def run(url: str, mode: Mode, log: Any) -> list[dict[str, Any]]:
    log(
        f"longest calls: {mode.longest_orphans} orphans of {mode.longest_payload}"
        f" bytes, batches {mode.longest_batches}"
    )
    return asyncio.run(_run(url, mode, log))
