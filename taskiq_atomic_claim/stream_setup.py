"""What a worker checks and repairs about its streams and consumer groups,
part of every atomic broker (``ReclaimingListener`` mixes this in): key types
and server durability at startup, groups lost to an empty restart or a
deletion while it runs (``group_recovery``)."""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

from redis.exceptions import ResponseError

from taskiq_atomic_claim.durability import warn_about_durability
from taskiq_atomic_claim.group_recovery import (
    GroupPositions,
    create_group,
    first_position,
    recreate_group,
)
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.server_errors import UNREACHABLE, stream_missing

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


class StreamSetup:
    """Startup checks of the stream keys and servers; group re-creation."""

    queue_name: str
    consumer_group_name: str
    consumer_id: str
    mkstream: bool
    group_positions: GroupPositions
    if TYPE_CHECKING:

        @property
        def streams(self) -> list[str]: ...

        def _connection(self) -> contextlib.AbstractAsyncContextManager[Any]: ...

    async def check_stream_types(self) -> None:
        """Fail at startup, naming the key, if a stream key holds another type."""
        async with self._connection() as client:
            for stream in self.streams:
                await require_stream_type(client, stream)

    async def _declare_consumer_group(self) -> None:
        """Startup: create the group where missing, as the parent does, but
        never after accepted tasks no worker has seen (``first_position``)."""
        async with self._connection() as client:
            await self.declare_groups(client)

    async def declare_groups(self, client: Any) -> None:
        """Create each stream's group where missing; a refusal that retrying
        cannot heal (NOPERM, ...) fails the start (``GroupCreationError``)."""
        for stream in self.streams:
            # A key of another type is named as such, not as a refused group.
            await require_stream_type(client, stream)
            start = await first_position(client, stream, self.consumer_id)
            try:
                await create_group(
                    client, stream, self.consumer_group_name, start, self.mkstream
                )
            except ResponseError as error:
                # No stream (mkstream=False) or an outage: the listen loop
                # creates the group once it can.
                logger.debug("Group on %r not created yet: %s", stream, error)

    async def recreate_groups(self, client: Any) -> None:
        """Re-create the consumer group on every stream that lost it, never
        after entries it holds (see ``group_recovery``)."""
        for stream in self.streams:
            try:
                start = await recreate_group(
                    client,
                    stream,
                    self.consumer_group_name,
                    self.group_positions.get(stream),
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
                    self.consumer_group_name,
                    stream,
                    start,
                )

    def _servers(self, client: Any) -> list[tuple[str, Any]]:
        """The servers behind ``client``, each with a name for the log."""
        return [(f"server of queue {self.queue_name!r}", client)]

    async def check_durability(self) -> None:
        """Startup: remember where the groups are, and warn about server
        settings that lose tasks. Never fails the start."""
        try:
            async with self._connection() as client:
                await self.group_positions.learn(
                    client, self.streams, self.consumer_group_name
                )
                for where, server in self._servers(client):
                    await warn_about_durability(server, where)
        except UNREACHABLE as error:
            logger.debug("Durability not checked at start-up: %s", error)
