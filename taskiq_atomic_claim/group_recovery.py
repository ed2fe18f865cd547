"""Re-creating a consumer group that vanished, without skipping anything.

A group vanishes when the server restarts empty (no persistence), when its
stream is evicted or deleted, or when an operator deletes it. Producers may
have recreated the stream with new entries before a worker notices
(NOGROUP): re-creating the group at ``$``, as taskiq-redis does, would put
it after those entries, and they would never be delivered.

Each worker remembers, per stream, the last id it knows the group delivered:
the group's ``last-delivered-id`` read once at startup (XINFO GROUPS), then
raised by every id it reads. On NOGROUP the group is re-created at

- that remembered id, when the stream still holds the entry with that id:
  the old history survived (the group alone was deleted, on purpose or
  not), so entries the old group had delivered are not run again, and
  every entry after it is delivered;
- ``0`` otherwise: the stream is new (an empty restart, an evicted or
  deleted stream recreated by XADD), so nothing in it was delivered before
  whatever its ids (a server clock behind the old one's gives smaller
  ids); or nothing is remembered; or the remembered entry was trimmed or
  deleted, and old history cannot be told from new. Every entry in the
  stream is delivered: at least once, never skipped.

The old group's pending list went with it. The entries it had started and
not acked (still named in the started hash, a key of its own) are given to
the orphans' consumer in the step that creates the group
(``lua/recreate_group.lua``): a live worker takes its own back at its next
heartbeat, a dead worker's are reclaimed once idle and run again, counted
as crashes. Entries a dead worker had read and not started are named
nowhere: not re-run. Several workers may race: the first XGROUP CREATE wins
(BUSYGROUP for the others); each candidate id is at most what the group had
delivered before, and every entry after it is delivered.
"""

from __future__ import annotations

import logging
from typing import Any

from redis.exceptions import RedisError, ResponseError

from taskiq_atomic_claim.clients import ScriptClient
from taskiq_atomic_claim.keys import ORPHANS_CONSUMER, StreamKeys
from taskiq_atomic_claim.operations import recreate_group_call
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.scripts import ScriptRunner
from taskiq_atomic_claim.server_errors import (
    group_exists,
    is_missing_key,
    is_outage,
    refused_inside_script,
    reply_text,
    stream_missing,
)

logger = logging.getLogger("taskiq.atomic_claim")


class GroupCreationError(RuntimeError):
    """The server refused to create a consumer group for a reason other
    than its existing (say NOPERM: the worker's user lacks XGROUP CREATE)."""


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _groups(reply: Any) -> list[dict[str, Any]]:
    """XINFO GROUPS as dicts, whether RESP2 (flat lists) or RESP3 (maps)."""
    groups = []
    for entry in reply or []:
        group = (
            entry
            if isinstance(entry, dict)
            else dict(zip(entry[::2], entry[1::2], strict=True))
        )
        groups.append({text(k): v for k, v in group.items()})
    return groups


class GroupPositions:
    """Per stream, the highest id this worker knows its group delivered."""

    def __init__(self) -> None:
        self._last: dict[str, str] = {}

    def get(self, stream: str) -> str | None:
        return self._last.get(stream)

    def advance(self, stream: str, entry_id: str) -> None:
        known = self._last.get(stream)
        if known is None or _id_key(entry_id) > _id_key(known):
            self._last[stream] = entry_id

    async def learn(self, client: ScriptClient, streams: list[str], group: str) -> None:
        """Read each group's last-delivered-id; never raises (a refused
        XINFO leaves only what reads teach, logged at debug)."""
        for stream in streams:
            try:
                reply = await client.execute_command("XINFO", "GROUPS", stream)
            except (RedisError, OSError) as error:
                logger.debug("Group position of %r not read: %s", stream, error)
                continue
            for info in _groups(reply):
                if text(info.get("name")) == group:
                    self.advance(stream, text(info["last-delivered-id"]))


async def recreate_group(
    client: ScriptClient,
    scripts: ScriptRunner,
    keys: StreamKeys,
    remembered: str | None,
    mkstream: bool,
) -> str | None:
    """Create the group of ``keys`` where it skips nothing, its started
    entries adopted (module doc).

    Returns the id it was created at; None when it already existed
    (BUSYGROUP: another worker re-created it first).
    """
    start = "0"
    if remembered is not None:
        survived = await client.execute_command(
            "XRANGE", keys.stream, remembered, remembered
        )
        if survived:
            start = remembered
    call = recreate_group_call(
        stream=keys.stream,
        started=keys.started,
        group=keys.group,
        start=start,
        orphans=ORPHANS_CONSUMER,
        mkstream=mkstream,
    )
    try:
        adopted = await scripts.run(client, call)
    except ResponseError as error:
        if not refused_inside_script(error):
            raise
        # An ACL from before the script (re-run `acl`): the group comes
        # back without the started entries, as before it; XGROUP CREATE
        # itself refused raises GroupCreationError.
        created = await create_group(client, keys.stream, keys.group, start, mkstream)
        if created:
            logger.warning(
                "Consumer group %r on stream %r re-created without its started"
                " entries (%s): re-run `taskiq-atomic-claim acl`",
                keys.group,
                keys.stream,
                reply_text(error),
            )
        return start if created else None
    if adopted < 0:
        return None
    if adopted:
        logger.warning(
            "%d entries the vanished group %r had started on stream %r are"
            " pending again: each runs once its worker is found dead",
            adopted,
            keys.group,
            keys.stream,
        )
    return start


async def create_group(
    client: ScriptClient, stream: str, group: str, start: str, mkstream: bool
) -> bool:
    """XGROUP CREATE; False when the group exists already (BUSYGROUP).

    A stream missing without ``mkstream`` and an outage (OOM, LOADING, ...)
    raise as the server replied: the listen loop retries both. Any other
    refusal (NOPERM, ...) cannot heal by retrying: ``GroupCreationError``,
    naming the group and the stream.
    """
    args = ["XGROUP", "CREATE", stream, group, start]
    if mkstream:
        args.append("MKSTREAM")
    try:
        await client.execute_command(*args)
    except ResponseError as error:
        if group_exists(error):
            return False
        if stream_missing(error) or is_outage(error):
            raise
        raise GroupCreationError(
            f"consumer group {group!r} on stream {stream!r} could not be"
            f" created: {error}"
        ) from error
    return True


async def first_position(client: ScriptClient, stream: str, consumer_id: str) -> str:
    """Where a worker starting up creates a group that does not exist.

    ``consumer_id`` (taskiq-redis's ``$`` by default: only new entries),
    unless nobody ever consumed the stream: no group at all, so every entry
    in it is an accepted task no worker has seen yet (producers kicked before
    the first worker started, or after an empty restart wiped the groups
    with everything else). Then ``0``: they are delivered, not skipped. A
    stream another group reads keeps ``consumer_id``.
    """
    if consumer_id != "$":
        return consumer_id
    try:
        groups = _groups(await client.execute_command("XINFO", "GROUPS", stream))
    except ResponseError as error:
        if not is_missing_key(error):
            raise
        return "0"  # no stream: "$" and "0" are the same
    return consumer_id if groups else "0"
