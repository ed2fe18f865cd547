"""A worker's consumer groups: created at startup where missing, re-created
when lost to an empty restart or a deletion while it runs
(``group_recovery``); and the check that a stream key holds a stream."""

from __future__ import annotations

import logging
from typing import Any

from redis.exceptions import ResponseError

from taskiq_atomic_claim.group_recovery import (
    GroupPositions,
    create_group,
    first_position,
    recreate_group,
)
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.scripts import ScriptRunner
from taskiq_atomic_claim.server_errors import stream_missing

logger = logging.getLogger("taskiq.atomic_claim")


class StreamTypeError(RuntimeError):
    """A key the broker must read as a stream holds another type (WRONGTYPE)."""


async def require_stream_type(client: Any, stream: str) -> None:
    """Raise ``StreamTypeError``, naming the key, if ``stream`` holds another
    type than a stream (no key at all is fine)."""
    kind = text(await client.type(stream))
    if kind not in ("stream", "none"):
        raise StreamTypeError(
            f"key {stream!r} holds a {kind}, not a stream: pick another"
            " queue_name / additional_streams key or remove that key"
        )


class ConsumerGroups:
    """One consumer group over a worker's streams."""

    def __init__(
        self,
        streams: list[str],
        group: str,
        consumer_id: str,
        mkstream: bool,
        positions: GroupPositions,
        scripts: ScriptRunner,
    ) -> None:
        self.scripts = scripts
        self.streams = streams
        self.group = group
        self.consumer_id = consumer_id
        self.mkstream = mkstream
        self.positions = positions

    async def declare(self, client: Any) -> None:
        """Startup: create each stream's group where missing, as the parent
        does, but never after accepted tasks no worker has seen
        (``first_position``). A refusal that retrying cannot heal (NOPERM,
        ...) raises ``GroupCreationError``; an outage raises as it came
        (a worker waits it out: ``AtomicParts.startup``)."""
        for stream in self.streams:
            await self._declare(client, stream)

    async def _declare(self, client: Any, stream: str) -> None:
        # A key of another type is named as such, not as a refused group.
        await require_stream_type(client, stream)
        start = await first_position(client, stream, self.consumer_id)
        try:
            await create_group(client, stream, self.group, start, self.mkstream)
        except ResponseError as error:
            # No stream (mkstream=False) or an outage: the listen loop
            # creates the group once it can.
            logger.debug("Group on %r not created yet: %s", stream, error)

    async def recreate(self, client: Any) -> None:
        """Re-create the consumer group on every stream that lost it, never
        after entries it holds (see ``group_recovery``)."""
        for stream in self.streams:
            try:
                start = await recreate_group(
                    client,
                    self.scripts,
                    StreamKeys(stream, self.group),
                    self.positions.get(stream),
                    self.mkstream,
                )
            except ResponseError as error:
                if not stream_missing(error):
                    raise
                # mkstream=False and the stream gone: tried again later.
                logger.debug("Group on %r not re-created: %s", stream, error)
                continue
            if start is not None:
                logger.warning(
                    "Re-created consumer group %r on stream %r at id %s",
                    self.group,
                    stream,
                    start,
                )
