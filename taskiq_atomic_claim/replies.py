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
