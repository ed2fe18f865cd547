"""One claim cycle for one stream: a single call of ``lua/claim.lua``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.operations import CLAIM
from taskiq_atomic_claim.scripts import ScriptClient, ScriptRunner
from taskiq_atomic_claim.settings import ClaimSettings


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class ClaimedEntry:
    id: str
    fields: dict[bytes, bytes]


@dataclass(frozen=True)
class ClaimOutcome:
    skipped: bool
    entries: list[ClaimedEntry] = field(default_factory=list)
    # Pending entries whose stream data was gone: removed from the PEL.
    trimmed: list[str] = field(default_factory=list)
    # Started max_deliveries times in workers that died: moved to the dead
    # letters.
    dead_lettered: list[str] = field(default_factory=list)
    next_cursor: str = "0-0"
    lease_holder: str | None = None
    lease_ttl_ms: int | None = None


def _as_bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def _parse(reply: list[Any]) -> ClaimOutcome:
    status = _text(reply[0])
    if status == "skipped":
        return ClaimOutcome(
            skipped=True, lease_holder=_text(reply[1]), lease_ttl_ms=int(reply[2])
        )
    entries = []
    for entry_id, flat in reply[2]:
        pairs = zip(flat[::2], flat[1::2], strict=True)
        entries.append(
            ClaimedEntry(
                _text(entry_id), {_as_bytes(k): _as_bytes(v) for k, v in pairs}
            )
        )
    return ClaimOutcome(
        skipped=False,
        entries=entries,
        trimmed=[_text(entry_id) for entry_id in reply[3]],
        dead_lettered=[_text(entry_id) for entry_id in reply[4]],
        next_cursor=_text(reply[1]),
    )


async def claim_idle_entries(
    runner: ScriptRunner,
    client: ScriptClient,
    keys: StreamKeys,
    consumer: str,
    settings: ClaimSettings,
) -> ClaimOutcome:
    """Take the stream's lease and its idle entries, or learn who holds it."""
    reply = await runner.call(
        client,
        CLAIM,
        [keys.stream, keys.lease, keys.cursor, keys.dead_letters, keys.started],
        [
            keys.group,
            consumer,
            settings.idle_timeout,
            settings.batch_size,
            settings.lease,
            settings.cursor_ttl,
            settings.max_deliveries,
        ],
    )
    return _parse(reply)
