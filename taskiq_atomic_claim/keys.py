"""Names of the keys this package writes beside a stream.

Every key for a stream carries that stream's hash slot, so a script that
touches the stream and its keys runs on one Cluster node:

- a stream with a hash tag (``jobs{eu}``) is embedded as it is and its tag
  decides the slot;
- a stream without one is wrapped in braces (``{taskiq}``), and a tag equal
  to the whole name hashes exactly like the bare name.

The prefix has no braces, so the first ``{`` in a key is always the stream's.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.crc import key_slot

PREFIX = "taskiq-atomic-claim"


def _has_hash_tag(name: str) -> bool:
    """Redis's rule: something between the first ``{`` and the next ``}``."""
    start = name.find("{")
    if start < 0:
        return False
    end = name.find("}", start + 1)
    return end > start + 1


def slot_anchor(stream: str) -> str:
    """The part of every key for ``stream`` that fixes its hash slot."""
    return stream if _has_hash_tag(stream) else "{" + stream + "}"


@dataclass(frozen=True)
class StreamKeys:
    """Coordination keys for one (stream, consumer group) pair."""

    stream: str
    group: str

    @property
    def lease(self) -> str:
        return f"{PREFIX}:lease:{slot_anchor(self.stream)}:{self.group}"

    @property
    def cursor(self) -> str:
        return f"{PREFIX}:cursor:{slot_anchor(self.stream)}:{self.group}"

    @property
    def dead_letters(self) -> str:
        """A stream (data, never expires) of entries the group gave up on."""
        return f"{PREFIX}:dead:{slot_anchor(self.stream)}:{self.group}"

    @property
    def started(self) -> str:
        """A hash (coordination, always expires): entry id -> starts of its
        task not followed by an ack; what max_deliveries counts."""
        return f"{PREFIX}:started:{slot_anchor(self.stream)}:{self.group}"

    def colocated(self) -> bool:
        """Whether every key hashes to the stream's slot (Cluster needs this)."""
        slot = key_slot(self.stream.encode())
        keys = (self.lease, self.cursor, self.dead_letters, self.started)
        return all(key_slot(key.encode()) == slot for key in keys)
