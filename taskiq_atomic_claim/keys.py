"""Names of the keys this package writes beside a stream.

A key is ``taskiq-atomic-claim:<kind>:{<tag>}:<stream>:<group>``:

- ``{<tag>}`` fixes the hash slot: the part of the stream's name Redis hashes
  (its hash tag, or the whole name), or, when that part holds a ``}`` and so
  cannot stand between braces, a short stand-in with the same slot. Every key
  for a stream thus lives in the stream's slot, on one Cluster node.
- ``<stream>`` is the full name with ``%`` and ``:`` percent-encoded, so the
  first ``:`` after it separates the group: different (stream, group) pairs
  never share a key (``s`` and ``{s}`` hash alike but are named apart).

The prefix has no braces, so the first ``{`` in a key is always the tag's.
Releases before this naming used ``{stream}`` alone (``legacy_*``), which let
``s`` and ``{s}`` share keys; ``doctor --fix`` moves dead letters from there.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import string
from dataclasses import dataclass

from redis.crc import key_slot

PREFIX = "taskiq-atomic-claim"
# The consumer a vanished group's started entries are given to when it is
# re-created (``lua/recreate_group.lua``): no worker's name, so they are
# reclaimed as a dead worker's, and a live worker takes back its own.
ORPHANS_CONSUMER = f"{PREFIX}:orphans"
_STAND_IN_ALPHABET = string.ascii_lowercase + string.digits


def _hash_tag(name: str) -> str | None:
    """Redis's rule: something between the first ``{`` and the next ``}``."""
    start = name.find("{")
    if start < 0:
        return None
    end = name.find("}", start + 1)
    return name[start + 1 : end] if end > start + 1 else None


@functools.cache
def _stand_in(slot: int) -> str:
    """The shortest brace-free tag that hashes to ``slot``."""
    for length in itertools.count(1):
        for letters in itertools.product(_STAND_IN_ALPHABET, repeat=length):
            candidate = "".join(letters)
            if key_slot(candidate.encode()) == slot:
                return candidate
    raise AssertionError("unreachable")  # pragma: no cover


def _slot_tag(stream: str) -> str:
    hashed = _hash_tag(stream) or stream
    if "}" in hashed:
        return _stand_in(key_slot(stream.encode()))
    return hashed


def _encoded(name: str) -> str:
    """``name`` with ``%`` and ``:`` percent-encoded: the next ``:`` in a key
    is always a separator."""
    return name.replace("%", "%25").replace(":", "%3A")


def slot_anchor(stream: str) -> str:
    """The part of every key for ``stream`` that fixes its slot and names it
    unambiguously: ``{tag}:encoded-stream``."""
    return "{" + _slot_tag(stream) + "}:" + _encoded(stream)


def trim_gate(stream: str) -> str:
    """A string (coordination, always expires): set while ``stream`` was
    trimmed within the last trim interval, by a broker of any group (one per
    stream, so no group in its name; see ``stream_trim.py``)."""
    return f"{PREFIX}:trim:{slot_anchor(stream)}"


def alive_prefix(group: str) -> str:
    """What every alive key of ``group`` starts with: a string (coordination,
    always expires within idle_timeout) per consumer, present while its
    worker process lives (its liveness thread renews it every beat); what
    operators read as alive. One per consumer whatever streams it reads, in
    the group's slot (so one MGET reads a group's on Cluster too)."""
    return f"{PREFIX}:alive:{slot_anchor(group)}:"


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

    @property
    def reclaimed(self) -> str:
        """A string (coordination, always expires): entries of the pair
        reclaimed lately, counted by the workers that reclaim them; see
        ``reclaim_count.py``."""
        return f"{PREFIX}:reclaimed:{slot_anchor(self.stream)}:{self.group}"

    @property
    def trim_gate(self) -> str:
        return trim_gate(self.stream)

    @property
    def alive_prefix(self) -> str:
        """What every consumer's ``alive`` key of the group starts with."""
        return alive_prefix(self.group)

    def alive(self, consumer: str) -> str:
        return alive_prefix(self.group) + consumer

    @property
    def claim_gate_prefix(self) -> str:
        """What the claim gate of every fleet whose first stream this is
        starts with."""
        return f"{PREFIX}:gate:{slot_anchor(self.stream)}:{_encoded(self.group)}:"

    def claim_gate(self, streams: list[str]) -> str:
        """A string (coordination, always expires within a claim interval):
        held by the consumer that checks ``streams`` for idle entries this
        interval, for every consumer of the group reading exactly those
        streams (``claim_gate.py``). In the first stream's slot; the streams
        named by a digest, as a fleet may read many."""
        digest = hashlib.sha256("\0".join(sorted(streams)).encode()).hexdigest()
        return self.claim_gate_prefix + digest[:16]

    def colocated(self) -> bool:
        """Whether every key hashes to the stream's slot (Cluster needs this)."""
        slot = key_slot(self.stream.encode())
        keys = (
            self.lease,
            self.cursor,
            self.dead_letters,
            self.started,
            self.reclaimed,
            self.trim_gate,
            self.claim_gate_prefix,
        )
        return all(key_slot(key.encode()) == slot for key in keys)
