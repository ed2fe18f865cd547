"""Server replies as Python values, whichever way the client decodes them."""

from __future__ import annotations

from typing import Any


def text(value: Any) -> str:
    """A reply item as ``str``: bytes (a client without ``decode_responses``)
    are decoded as UTF-8; anything else (str, int) goes through ``str``.

    Bytes that are not UTF-8 (a key or field another client wrote) come out
    backslash-escaped rather than raising: a report or a log line must not
    fail on them, and the names this package writes are always UTF-8."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    return str(value)


# (stream, entry id, fields, maybe reclaimed)
ReadEntry = tuple[str, str, dict[Any, Any], bool]


def read_entries(fetched: Any) -> list[ReadEntry]:
    """An XREADGROUP reply as (stream, id, fields, maybe reclaimed), whatever
    its shape: RESP2 pairs or a RESP3 map (which redis-py wraps in one more
    list), entries of (id, fields) or, read with CLAIM, (id, fields, idle ms,
    delivery count), where new entries carry 0, 0. An entry without those
    two (a redis-py that drops them) counts as maybe reclaimed."""
    pairs = fetched.items() if isinstance(fetched, dict) else fetched or []
    read = []
    for stream, listed in pairs:
        entries = listed
        if listed and isinstance(listed[0], list) and _is_entry_list(listed[0]):
            entries = listed[0]
        for entry in entries:
            fields = entry[1] if len(entry) > 1 else None
            if not isinstance(fields, dict):
                flat = list(fields or [])
                fields = dict(zip(flat[::2], flat[1::2], strict=True))
            reclaimed = len(entry) < 4 or int(entry[2]) > 0 or int(entry[3]) > 0
            read.append((text(stream), text(entry[0]), fields, reclaimed))
    return read


def _is_entry_list(value: list[Any]) -> bool:
    """A list of entries (each a list or tuple), not one entry (id first)."""
    return not value or isinstance(value[0], list | tuple)
