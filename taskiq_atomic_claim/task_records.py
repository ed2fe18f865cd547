"""A task's start record and its ack: plain commands, defined once here and
sent batched per loop turn (``task_calls.py``).

Every task pays these two, so they are not scripts: a function call costs
the server several times the commands it runs (measured in
``benchmarks/hotpath_ops.py``).

- start: ``HINCRBY <started> <id> 1`` per entry, then ``HSETNX <started>
  <KEEP_HASHTABLE_FIELD> ..`` and ``PEXPIRE <started> <ttl_ms>``, in one
  ``MULTI``/``EXEC``. The HSETNX keeps one value longer than the server's
  ``hash-max-listpack-value`` (64 bytes by default) in the hash, so the
  server keeps it a hash table: a listpack hash is scanned end to end by
  every HINCRBY, and this one holds every running entry's count and those
  acked but not yet forgotten (``benchmarks/started_hash.py``, Redis 7.0,
  64 in flight: HINCRBY 6.0 us in a listpack, 2.1 us in a hash table). The
  field is no entry id, so nothing reads it as a count. The started hash is
  coordination: it never exists without an expiry, even if the client dies
  mid-write (the server discards a transaction whose ``EXEC`` never came). A start not
  followed by an ack (or a hand-back) is a crash while running: the claim
  dead-letters an entry once it has max_deliveries of them. Out of memory
  (``maxmemory``, ``noeviction``) the server refuses the whole transaction
  (HINCRBY may grow memory): the task runs anyway, its start uncounted, as
  ``entry_lifecycle`` logs.
- ack: ``XACK <stream> <group> <id>..`` (with delete_acked ``XACKDEL <stream>
  <group> ACKED IDS <n> <id>..``, Redis >= 8.2: the entry is deleted once
  no group still needs it), then ``HDEL <started> <id>..``. Not atomic, and
  need not be: a field left behind (a dying client) sits in a hash that
  expires, and its entry is no longer pending, so it counts nothing. Both
  free memory: allowed out of memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Command = tuple[str | int, ...]

# Not an entry id (those are <ms>-<seq>); its value says why it is there
# and is longer than any hash-max-listpack-value a server is likely set to.
KEEP_HASHTABLE_FIELD = "keep-hashtable"
KEEP_HASHTABLE_VALUE = (
    "this field's value is longer than hash-max-listpack-value, so the server"
    " keeps this hash a hash table: a start's HINCRBY takes O(1) time"
).ljust(160, ".")


def start_commands(
    started: str, ttl_ms: int, entry_ids: Sequence[str]
) -> list[Command]:
    """The start's commands, to run between MULTI and EXEC: a count per
    entry, then the hash's upkeep (the same for every start of the hash)."""
    return [
        *(count_start_command(started, entry_id) for entry_id in entry_ids),
        *start_upkeep_commands(started, ttl_ms),
    ]


def count_start_command(started: str, entry_id: str) -> Command:
    return ("HINCRBY", started, entry_id, 1)


def start_upkeep_commands(started: str, ttl_ms: int) -> list[Command]:
    """After the counts, in the same transaction: the hash stays a hash
    table and never outlives its expiry."""
    return [
        ("HSETNX", started, KEEP_HASHTABLE_FIELD, KEEP_HASHTABLE_VALUE),
        ("PEXPIRE", started, ttl_ms),
    ]


def ack_command(
    stream: str, group: str, entry_ids: Sequence[str], delete_acked: bool
) -> Command:
    """XACK, or with delete_acked XACKDEL ... ACKED."""
    if delete_acked:
        return ("XACKDEL", stream, group, "ACKED", "IDS", len(entry_ids), *entry_ids)
    return ("XACK", stream, group, *entry_ids)


def forget_command(started: str, entry_ids: Sequence[str]) -> Command:
    """Forget the start counts of acked entries: only once they are acked
    (a count goes while its entry is still pending only by a hand-back)."""
    return ("HDEL", started, *entry_ids)


def ack_commands(
    stream: str,
    started: str,
    group: str,
    entry_ids: Sequence[str],
    delete_acked: bool,
) -> list[Command]:
    """The ack's commands, in this order."""
    return [
        ack_command(stream, group, entry_ids, delete_acked),
        forget_command(started, entry_ids),
    ]


def acked_count(reply: Any) -> int:
    """How many of the ids were pending: XACK's count, or XACKDEL's per-id
    codes (-1 not pending, 1 acked and deleted, 2 acked and kept)."""
    if isinstance(reply, list):
        return sum(1 for code in reply if int(code) != -1)
    return int(reply)


async def record_starts(
    client: Any, started: str, ttl_ms: int, entry_ids: Sequence[str]
) -> None:
    """The start, awaited: one MULTI/EXEC (on Cluster on the slot's primary:
    every key is the started hash)."""
    await record_many_starts(client, [(started, ttl_ms, entry_ids)])


async def record_many_starts(
    client: Any, hashes: Sequence[tuple[str, int, Sequence[str]]]
) -> None:
    """Starts in several started hashes, as one MULTI/EXEC (one server)."""
    async with client.pipeline(transaction=True) as pipe:
        for started, ttl_ms, entry_ids in hashes:
            for command in start_commands(started, ttl_ms, entry_ids):
                pipe.execute_command(*command)
        await pipe.execute()


async def ack(
    client: Any,
    stream: str,
    started: str,
    group: str,
    entry_ids: Sequence[str],
    delete_acked: bool,
) -> int:
    """The ack, awaited, in one round trip; how many ids were pending."""
    async with client.pipeline(transaction=False) as pipe:
        for command in ack_commands(stream, started, group, entry_ids, delete_acked):
            pipe.execute_command(*command)
        replies = await pipe.execute()
    return acked_count(replies[0])
