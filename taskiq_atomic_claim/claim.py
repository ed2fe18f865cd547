"""One claim cycle for one or several streams: a single call of
``lua/claim.lua``, then, only for streams where it claimed something, one
pipeline that reads the claimed entries' fields and who owns them now.

The script claims ids only (XAUTOCLAIM ... JUSTID): fields passed through
Lua are converted to Lua values and back, which blocks the server far
longer than the plain read of the same entries. The read changes no owner
(XRANGE, then XPENDING of the same id, in one pipeline): a claimer delayed
between the two steps for longer than idle_timeout finds an entry another
consumer claimed meanwhile owned by that consumer, and leaves it to it; one
acked meanwhile is no longer pending, and is not reported lost. Entries it
still owns but finds gone from the stream (trimmed or XDEL'd; Redis 6.2's
XAUTOCLAIM claims those too) are acked and reported as trimmed, as the
script does with the ones it finds.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from redis.exceptions import ResponseError

from taskiq_atomic_claim.clients import ScriptClient
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.operations import ClaimKeys, claim_call
from taskiq_atomic_claim.reclaim_count import RECLAIMED_TTL_MS
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.scripts import ScriptRunner
from taskiq_atomic_claim.settings import ClaimSettings
from taskiq_atomic_claim.task_records import ack


class ClaimedEntry(NamedTuple):
    # A tuple, not a dataclass: ten or more are built per claim, on the hot path.
    id: str
    fields: dict[bytes, bytes]
    # Starts in workers that died running it (counted when max_deliveries > 0).
    crashes: int = 0


@dataclass(frozen=True)
class ClaimOutcome:
    skipped: bool
    entries: list[ClaimedEntry] = field(default_factory=list)
    # Pending entries whose stream data was gone: removed from the PEL.
    trimmed: list[str] = field(default_factory=list)
    # Started max_deliveries times in workers that died: moved to the dead
    # letters.
    dead_lettered: list[str] = field(default_factory=list)
    # Their "data" fields, by id (those that had one): what their task's
    # waiters learn from (dead_letter_results.py).
    dead_lettered_data: dict[str, bytes] = field(default_factory=dict)
    next_cursor: str = "0-0"
    lease_holder: str | None = None
    lease_ttl_ms: int | None = None
    # XAUTOCLAIM filled its COUNT: more may be idle, and no lease was taken.
    full: bool = False
    # The server refused this stream's claim (e.g. NOGROUP); nothing changed.
    error: ResponseError | None = None


def _as_bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


# Entries per transaction that reads them: each reply stays bounded.
FETCH_CHUNK = 1000


def _fields(flat: list[Any] | dict[Any, Any]) -> dict[bytes, bytes]:
    if isinstance(flat, dict):
        fields = flat
    else:
        pairs = iter(flat)
        fields = dict(zip(pairs, pairs, strict=True))
    # Clients without decode_responses (the brokers') get bytes already: no
    # per-field conversion on the claim's hot path.
    for key, value in fields.items():
        if type(key) is not bytes or type(value) is not bytes:
            return {_as_bytes(k): _as_bytes(v) for k, v in fields.items()}
    return fields


def _parse(reply: list[Any]) -> ClaimOutcome:
    status = text(reply[0])
    if status == "failed":
        return ClaimOutcome(skipped=False, error=ResponseError(text(reply[1])))
    if status == "skipped":
        return ClaimOutcome(
            skipped=True, lease_holder=text(reply[1]), lease_ttl_ms=int(reply[2])
        )
    return ClaimOutcome(
        skipped=False,
        # Fields come from the read that follows (see _fetch_fields).
        entries=[ClaimedEntry(text(entry[0]), {}, *entry[1:2]) for entry in reply[2]],
        trimmed=[text(entry_id) for entry_id in reply[3]],
        dead_lettered=[text(entry_id) for entry_id, _ in reply[4]],
        dead_lettered_data={
            text(entry_id): _as_bytes(data) for entry_id, data in reply[4] if data
        },
        next_cursor=text(reply[1]),
        full=bool(reply[5]),
    )


@functools.lru_cache(maxsize=1024)
def _script_keys(keys: StreamKeys) -> ClaimKeys:
    # Built once per stream, not per claim: claims are a hot path.
    return ClaimKeys(
        keys.stream,
        keys.lease,
        keys.cursor,
        keys.dead_letters,
        keys.started,
        keys.reclaimed,
    )


async def claim_idle_entries(
    runner: ScriptRunner,
    client: ScriptClient,
    keys: StreamKeys,
    consumer: str,
    settings: ClaimSettings,
) -> ClaimOutcome:
    """Take the stream's lease and its idle entries, or learn who holds it."""
    (outcome,) = await claim_streams(runner, client, [keys], consumer, settings)
    if outcome.error is not None:
        raise outcome.error
    return outcome


async def claim_streams(
    runner: ScriptRunner,
    client: ScriptClient,
    streams: Sequence[StreamKeys],
    consumer: str,
    settings: ClaimSettings,
    counts: Sequence[int] | None = None,
) -> list[ClaimOutcome]:
    """One claim cycle on each stream, all in one script call (so on Cluster
    only for streams in one slot). ``counts`` bounds each stream's batch,
    by default ``settings.batch_size``. A stream the server refused has its
    ``error`` set; the others' outcomes stand."""
    if not streams:
        return []
    group = streams[0].group
    if any(keys.group != group for keys in streams):
        raise ValueError("claim_streams: every stream must be of one consumer group")
    if counts is None:
        counts = [settings.batch_size] * len(streams)
    replies = await runner.run(
        client,
        claim_call(
            keys=[_script_keys(keys) for keys in streams],
            group=group,
            consumer=consumer,
            min_idle_ms=settings.idle_timeout,
            lease_ms=settings.lease,
            cursor_ttl_ms=settings.cursor_ttl,
            max_deliveries=settings.max_deliveries,
            delete_acked=settings.delete_acked,
            reclaimed_ttl_ms=RECLAIMED_TTL_MS,
            counts=counts,
        ),
    )
    outcomes = [_parse(reply) for reply in replies]
    # An idle cycle (nothing claimed) stays one round trip.
    claimed = [i for i, outcome in enumerate(outcomes) if outcome.entries]
    fetched = await asyncio.gather(
        *(
            _fetch_fields(client, streams[i], consumer, settings, outcomes[i])
            for i in claimed
        )
    )
    for i, outcome in zip(claimed, fetched, strict=True):
        outcomes[i] = outcome
    return outcomes


async def _fetch_fields(
    client: Any,
    keys: StreamKeys,
    consumer: str,
    settings: ClaimSettings,
    outcome: ClaimOutcome,
) -> ClaimOutcome:
    """The claimed entries this consumer still owns, with their fields (see
    the module docstring)."""
    ids = [entry.id for entry in outcome.entries]
    reads: list[Any] = []
    owners: list[Any] = []
    for first in range(0, len(ids), FETCH_CHUNK):
        chunk = ids[first : first + FETCH_CHUNK]
        # Not a MULTI: out of memory the server refuses whatever is queued in
        # one. The fields first, the owner after: an entry's fields never
        # change, so an owner seen after them is the owner of what was read.
        async with client.pipeline(transaction=False) as pipe:
            for entry_id in chunk:
                pipe.xrange(keys.stream, entry_id, entry_id, 1)
            for entry_id in chunk:
                pipe.xpending_range(keys.stream, keys.group, entry_id, entry_id, 1)
            replies = await pipe.execute()
        reads += replies[: len(chunk)]
        owners += replies[len(chunk) :]
    fields: dict[str, dict[bytes, bytes]] = {}
    gone = []
    for entry_id, pending, found in zip(ids, owners, reads, strict=True):
        if not pending or text(pending[0]["consumer"]) != consumer:
            # Another consumer's now, or acked: not this claimer's to run.
            continue
        if found:
            fields[entry_id] = _fields(found[0][1])
        else:
            gone.append(entry_id)
    if gone:
        # Rare: only entries trimmed or deleted while pending, still ours.
        await ack(
            client, keys.stream, keys.started, keys.group, gone, settings.delete_acked
        )
    return replace(
        outcome,
        entries=[
            entry._replace(fields=fields[entry.id])
            for entry in outcome.entries
            if entry.id in fields
        ],
        trimmed=[*outcome.trimmed, *gone],
    )
