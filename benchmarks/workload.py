"""Pending entries to claim, built and restored on the server.

The claim-cycle workload keeps every cycle's work identical: the PEL holds N
entries owned by a consumer that died long ago, a cycle claims a batch of
them, and the harness then hands that batch back to the dead consumer with
XCLAIM IDLE (outside the timed call, on its own connection), so the batch
is idle again and the PEL never changes size. RETRYCOUNT 1 keeps the
delivery counter from growing, so the project's dead lettering, which is
part of the claim script's cost, never actually fires.
"""

from __future__ import annotations

from redis.asyncio import Redis

from benchmarks.config import AGED_IDLE_MS, PAYLOAD
from benchmarks.variants import Claimer

DEAD_CONSUMER = "bench-dead-consumer"
# Entries added per EVAL: keeps each populate call to tens of milliseconds.
_POPULATE_CHUNK = 10_000

# KEYS[1] stream; ARGV[1] group, ARGV[2] dead consumer, ARGV[3] how many,
# ARGV[4] payload, ARGV[5] idle ms to backdate the entries by.
_POPULATE = """
local n = tonumber(ARGV[3])
for _ = 1, n do
  redis.call('XADD', KEYS[1], '*', 'data', ARGV[4])
end
local read = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', n,
  'STREAMS', KEYS[1], '>')
if not read then
  return 0
end
local entries = read[1][2]
-- A call in the middle of an argument list expands to one value only, so
-- the XCLAIM argument list is built as a table, 500 ids at a time.
for first = 1, #entries, 500 do
  local args = {'XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0}
  for i = first, math.min(first + 499, #entries) do
    args[#args + 1] = entries[i][1]
  end
  args[#args + 1] = 'IDLE'
  args[#args + 1] = ARGV[5]
  args[#args + 1] = 'JUSTID'
  redis.call(unpack(args))
end
return #entries
"""


async def create(client: Redis, stream: str, group: str, extra_keys: list[str]) -> None:
    """An empty stream and group, and none of the variants' keys."""
    await client.delete(stream, *extra_keys)
    await client.xgroup_create(stream, group, id="0", mkstream=True)


async def add_pending(client: Redis, stream: str, group: str, count: int) -> int:
    """Add ``count`` entries, all pending on the dead consumer and long idle."""
    added = 0
    while added < count:
        chunk = min(_POPULATE_CHUNK, count - added)
        added += int(
            await client.eval(
                _POPULATE, 1, stream, group, DEAD_CONSUMER, chunk, PAYLOAD, AGED_IDLE_MS
            )
        )
    return added


async def pending_count(client: Redis, stream: str, group: str) -> int:
    summary = await client.xpending(stream, group)
    return int(summary["pending"])


async def claim_cycles(
    claimer: Claimer, harness: Redis, stream: str, group: str, cycles: int
) -> None:
    """``cycles`` claim cycles, each batch handed back so the next finds the
    same backlog."""
    for _ in range(cycles):
        result = await claimer.cycle()
        await hand_back(harness, stream, group, result.ids)


async def hand_back(client: Redis, stream: str, group: str, ids: list[str]) -> None:
    """Return claimed entries to the dead consumer, long idle again."""
    if not ids:
        return
    await client.xclaim(
        stream,
        group,
        DEAD_CONSUMER,
        0,
        ids,  # type: ignore[arg-type]
        idle=AGED_IDLE_MS,
        retrycount=1,
        justid=True,
    )
