"""Replies of the pipelined connection (``pipelined.py``), parsed from the
bytes the socket had: one read, then every whole reply taken out of it
with no further await. redis-py's parser awaits a stream read per line; on
a draining worker that reading of the starts' and acks' replies was a
fifth of the worker's CPU (py-spy, ``benchmarks/hotpath.py``).

RESP2 and RESP3 both; error replies become the exception redis-py would
raise for them (a value, not raised: the caller decides); push messages
(RESP3 out-of-band notices) are skipped, as no call awaits them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from redis._parsers.base import BaseParser
from redis.exceptions import InvalidResponse

_CRLF = b"\r\n"


class _IncompleteError(Exception):
    """The buffer ends inside a reply: more bytes are needed."""


class _Push:
    __slots__ = ()


_PUSH = _Push()


class ReplyBuffer:
    """Bytes read off one connection, and the replies whole in them."""

    __slots__ = ("_data", "_pos")

    def __init__(self) -> None:
        self._data = b""
        self._pos = 0

    def feed(self, chunk: bytes) -> None:
        self._data = self._data[self._pos :] + chunk
        self._pos = 0

    @property
    def empty(self) -> bool:
        """Every byte fed was part of a reply taken out."""
        return self._pos >= len(self._data)

    def pop(self) -> tuple[bool, Any]:
        """(True, the next reply), or (False, None) until more is fed."""
        while True:
            if self._pos >= len(self._data):
                return False, None  # the usual end: no exception raised
            try:
                value, pos = _parse(self._data, self._pos)
            except _IncompleteError:
                return False, None
            self._pos = pos
            if value is not _PUSH:
                return True, value


def _parse(data: bytes, pos: int) -> tuple[Any, int]:
    """The reply starting at ``pos``, and where the next one starts."""
    end = data.find(_CRLF, pos)
    if end < 0:
        raise _IncompleteError
    kind = data[pos]
    line = data[pos + 1 : end]
    pos = end + 2
    scalar = _SCALARS.get(kind)
    if scalar is not None:
        return scalar(line), pos
    if kind in _BULK:
        return _bulk(data, pos, kind, int(line))
    if kind in _AGGREGATES:
        return _aggregate(data, pos, kind, int(line))
    raise InvalidResponse(f"unexpected reply type {chr(kind)!r}")


def _error(message: bytes) -> Exception:
    # The exception redis-py raises for this reply (ReadOnlyError, ...).
    error: Exception = BaseParser.parse_error(message.decode("utf-8", "replace"))  # type: ignore[no-untyped-call]
    return error


_SCALARS: dict[int, Callable[[bytes], Any]] = {
    ord(":"): int,
    ord("("): int,  # big number
    ord("+"): bytes,
    ord("-"): _error,
    ord("_"): lambda line: None,
    ord(","): float,
    ord("#"): lambda line: line == b"t",
}
_BULK = frozenset(b"$=!")  # string, verbatim string, error
_AGGREGATES = frozenset(b"*~>%|")  # array, set, push, map, attributes


def _bulk(data: bytes, pos: int, kind: int, size: int) -> tuple[Any, int]:
    if size < 0:
        return None, pos
    if len(data) < pos + size + 2:
        raise _IncompleteError
    value = data[pos : pos + size]
    pos += size + 2
    return (_error(value) if kind == ord("!") else value), pos


def _aggregate(data: bytes, pos: int, kind: int, count: int) -> tuple[Any, int]:
    if count < 0:
        return None, pos
    if kind in b"%|":
        mapping = {}
        for _ in range(count):
            key, pos = _parse(data, pos)
            mapping[key], pos = _parse(data, pos)
        if kind == ord("|"):
            # Attributes annotate the reply that follows: that is the reply.
            return _parse(data, pos)
        return mapping, pos
    items = []
    for _ in range(count):
        item, pos = _parse(data, pos)
        items.append(item)
    return (_PUSH if kind == ord(">") else items), pos
