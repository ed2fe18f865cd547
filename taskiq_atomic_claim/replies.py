"""Server replies as Python values, whichever way the client decodes them."""

from __future__ import annotations

from typing import Any


def text(value: Any) -> str:
    """A reply item as ``str``: bytes (a client without ``decode_responses``)
    are decoded as UTF-8; anything else (str, int) goes through ``str``."""
    return value.decode() if isinstance(value, bytes) else str(value)
