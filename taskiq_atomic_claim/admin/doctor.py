"""Health checks behind ``doctor`` and their fixes (the ACL a worker needs: acl.py).

Findings are data: a kind, a subject, the problem, advice in words and the
``Action`` it points to; ``cli/doctor.py`` spells the command to run.
An outage comes first: ``unread-backlog``, entries waiting in a group that
no consumer has read for ``UNREAD_TIMEOUTS`` idle timeouts (or that has no
consumer): its workers are gone or stuck. A live worker, even one busy with
long tasks, talks to the server at least every heartbeat.
``apply_fixes`` fixes those marked fixable:

- ``legacy-lock`` (fixable): an ``autoclaim:*`` key without an expiry, left
  by a taskiq-redis <= 1.1.x worker killed inside its claim lock; it blocks
  those workers' reclaim forever. The fix gives it an expiry (the idle
  timeout by default) instead of deleting it: a live old worker may hold it
  this very moment, and it will have released it long before then.
- ``idle-consumer`` (fixable): a consumer with nothing pending that has not
  talked to the server for longer than a threshold, left by a worker that
  crashed or exited owning entries others took since (a graceful exit
  deletes its own and such idle empty ones), or by taskiq-redis's. The fix deletes it
  (``lua/delete_idle_consumer.lua``), atomically only if it still has
  nothing pending.
- ``library`` (fixable): this release's script library is missing or only
  other versions are loaded. The fix loads it.
- ``pel-size``: a PEL past a threshold: workers fall behind or keep dying.
- ``stale-pending``: an entry pending for far longer than any idle timeout:
  nobody reclaims this group (no worker runs, or only taskiq-redis 1.2.x
  workers, which never reclaim on an idle queue).
- ``dead-letters``: entries the group gave up on wait for a person.
- ``missing-stream`` / ``no-group``: a named stream that does not exist, a
  stream without the named group, or (when discovering) without any group:
  nothing consumes it.

Warnings, reported but not failing the check (``durability``):
``eviction-policy`` (maxmemory-policy is not noeviction) and
``no-persistence`` (neither AOF nor RDB save points).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from redis.asyncio import Redis

from taskiq_atomic_claim.admin.inspection import (
    MAX_SCAN_CALLS,
    SCAN_COUNT,
    duration,
    inspect_server,
    plural,
)
from taskiq_atomic_claim.durability import durability_risks
from taskiq_atomic_claim.operations import delete_idle_consumer_call
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.scripts import LibraryState, ScriptRunner
from taskiq_atomic_claim.server_info import ServerInfo

# taskiq-redis's RedisStreamBroker default idle_timeout (ms).
DEFAULT_LOCK_EXPIRY_MS = 600_000
DEFAULT_CONSUMER_IDLE_MS = 24 * 3600 * 1000
DEFAULT_MAX_PENDING = 10_000
DEFAULT_STALE_PENDING_MS = 3600 * 1000
# taskiq-redis's RedisStreamBroker default idle_timeout (ms), and how many of
# them without a read, with entries waiting, make a backlog nobody reads.
DEFAULT_IDLE_TIMEOUT_MS = 600_000
UNREAD_TIMEOUTS = 2
LEGACY_LOCK_PATTERN = "autoclaim:*"
MAX_LEGACY_LOCKS = 10_000


@dataclass(frozen=True)
class Thresholds:
    consumer_idle_ms: int = DEFAULT_CONSUMER_IDLE_MS
    max_pending: int = DEFAULT_MAX_PENDING
    stale_pending_ms: int = DEFAULT_STALE_PENDING_MS
    lock_expiry_ms: int = DEFAULT_LOCK_EXPIRY_MS
    idle_timeout_ms: int = DEFAULT_IDLE_TIMEOUT_MS


class Action(Enum):
    """The CLI command a finding points to; the CLI spells it out."""

    LOAD = "load the library"
    FIX = "doctor --fix"
    RERUN_AFTER_FIX = "run doctor again after --fix"
    REVIEW_DEAD_LETTERS = "list, then requeue or delete, the dead letters"


@dataclass
class Finding:
    kind: str
    subject: str
    problem: str
    # What to do, in words: what the fix does, or what a person should do.
    advice: str = ""
    action: Action | None = None
    fixable: bool = False
    # What the fix acts on.
    key: str | None = None
    stream: str | None = None
    group: str | None = None
    consumer: str | None = None
    # Set by apply_fixes.
    fixed: bool = False
    outcome: str | None = None


@dataclass(frozen=True)
class Diagnosis:
    server: ServerInfo
    streams_checked: int
    groups_checked: int
    findings: list[Finding]
    # Server settings that can lose tasks: reported, not counted as unhealthy
    # (a deliberate choice for a cache-like deployment).
    warnings: list[Finding] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return all(finding.fixed for finding in self.findings)


async def find_legacy_locks(client: Redis) -> tuple[list[str], bool]:
    """``autoclaim:*`` strings without an expiry; True when the scan was cut."""
    found: list[str] = []
    cursor: Any = 0
    for _ in range(MAX_SCAN_CALLS):
        cursor, keys = await client.scan(
            cursor, match=LEGACY_LOCK_PATTERN, count=SCAN_COUNT, _type="string"
        )
        for key in keys:
            if int(await client.pttl(key)) == -1:
                found.append(text(key))
        if int(cursor) == 0:
            return sorted(found), False
        if len(found) >= MAX_LEGACY_LOCKS:
            break
    return sorted(found), True


async def diagnose(
    client: Redis,
    streams: list[str] | None = None,
    group: str | None = None,
    thresholds: Thresholds | None = None,
) -> Diagnosis:
    limits = thresholds or Thresholds()
    inspection = await inspect_server(client, streams, group)
    findings: list[Finding] = []

    library = inspection.library
    if library.state != LibraryState.CURRENT.value:
        others = (
            f" (loaded: {', '.join(library.other_versions)})"
            if library.other_versions
            else ""
        )
        findings.append(
            Finding(
                "library",
                library.name,
                f"this release's library is {library.state}{others}",
                "workers also load it on demand if their ACL allows FUNCTION"
                " LOAD / SCRIPT LOAD",
                Action.LOAD,
                fixable=True,
            )
        )

    locks, cut = await find_legacy_locks(client)
    for key in locks:
        findings.append(
            Finding(
                "legacy-lock",
                key,
                "no expiry: left by a taskiq-redis <= 1.1.x worker killed inside"
                " its claim lock; old workers never reclaim while it exists",
                f"gives it a {duration(limits.lock_expiry_ms)} expiry; upgrade"
                " those workers",
                Action.FIX,
                fixable=True,
                key=key,
            )
        )
    if cut:
        findings.append(
            Finding(
                "legacy-lock",
                LEGACY_LOCK_PATTERN,
                f"more than {len(locks)} keys to check; the scan stopped",
                action=Action.RERUN_AFTER_FIX,
            )
        )

    groups_checked = 0
    for stream in inspection.streams:
        if stream.type not in ("stream", "none"):
            findings.append(
                Finding(
                    "missing-stream",
                    stream.name,
                    f"key holds a {stream.type}, not a stream",
                    "pick another queue_name or remove that key",
                )
            )
            continue
        if stream.type == "none":
            findings.append(
                Finding(
                    "missing-stream",
                    stream.name,
                    "stream does not exist",
                    "start a worker on it (it creates stream and group), or"
                    " check the --queue name",
                )
            )
        elif not stream.groups:
            findings.append(
                Finding(
                    "no-group",
                    stream.name,
                    f"{plural(stream.length, 'entry')} and no consumer group: nothing"
                    " consumes this stream",
                    "start a worker (it creates its group), or ignore if the"
                    " stream is not a task queue",
                )
            )
        for view in stream.groups:
            subject = f"{stream.name} / {view.name}"
            if not view.exists:
                if stream.type == "stream":
                    findings.append(
                        Finding(
                            "no-group",
                            subject,
                            "the stream has no such consumer group",
                            "start a worker with this consumer_group_name, or"
                            f" XGROUP CREATE {stream.name} {view.name} 0 to"
                            " deliver what is already there",
                        )
                    )
                continue
            groups_checked += 1
            waiting = await _waiting(client, stream.name, view)
            findings += _backlog_findings(stream.name, view, waiting, limits)
            findings += _group_findings(stream.name, view, limits)
    # Ranked: an outage first (the sort keeps the order within each rank).
    findings.sort(key=lambda finding: finding.kind != "unread-backlog")
    warnings = [
        Finding(risk.kind, "server", risk.problem, risk.advice)
        for risk in await durability_risks(client)
    ]
    return Diagnosis(
        inspection.server,
        len(inspection.streams),
        groups_checked,
        findings,
        warnings,
    )


def _entry_id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


async def _waiting(client: Redis, stream: str, view: Any) -> int | None:
    """Entries the group has not been delivered yet; None: some, how many
    unknown (Redis 6.2 has no lag, nor has 7+ after some deletions)."""
    if view.lag is not None:
        return int(view.lag)
    last = await client.xrevrange(stream, count=1)
    if not last or view.last_delivered_id is None:
        return 0
    newest = _entry_id(text(last[0][0]))
    return None if newest > _entry_id(view.last_delivered_id) else 0


def _backlog_findings(
    stream: str, view: Any, waiting: int | None, limits: Thresholds
) -> Iterable[Finding]:
    if waiting == 0:
        return
    unread_ms = UNREAD_TIMEOUTS * limits.idle_timeout_ms
    idle = view.last_read_idle_ms
    if view.consumer_count and idle is not None and idle <= unread_ms:
        return
    entries = "entries" if waiting is None else plural(waiting, "entry")
    if not view.consumer_count:
        why = "no consumer has ever read it"
    else:
        why = (
            f"none of its {plural(view.consumer_count, 'consumer')} has talked"
            f" to the server for {duration(idle or 0)}"
        )
    yield Finding(
        "unread-backlog",
        f"{stream} / {view.name}",
        f"{entries} waiting and {why}: no live worker reads this group",
        f"start workers with queue_name={stream!r} and"
        f" consumer_group_name={view.name!r}, or find why they stopped"
        " (crashed, scaled to 0, blocked); delete dead consumers with"
        " --fix once they hold nothing",
        stream=stream,
        group=view.name,
    )


def _group_findings(stream: str, view: Any, limits: Thresholds) -> Iterable[Finding]:
    subject = f"{stream} / {view.name}"
    if view.pending > limits.max_pending:
        yield Finding(
            "pel-size",
            subject,
            f"{plural(view.pending, 'pending entry')} (threshold {limits.max_pending})",
            "workers fall behind or keep dying: check worker logs and"
            " dead letters, add workers",
        )
    oldest = view.oldest_pending_idle_ms
    if oldest is not None and oldest > limits.stale_pending_ms:
        holder = max(view.consumers, key=lambda c: c.oldest_pending_idle_ms or -1)
        yield Finding(
            "stale-pending",
            subject,
            f"an entry held by consumer {holder.name!r} has been pending for"
            f" {duration(oldest)}: nobody reclaims this group",
            "start AtomicRedisStreamBroker workers (taskiq-redis 1.2.x never"
            " reclaims on an idle queue)",
            stream=stream,
            group=view.name,
            consumer=holder.name,
        )
    if view.dead_letters:
        yield Finding(
            "dead-letters",
            subject,
            f"{plural(view.dead_letters, 'dead letter')} in {view.dead_letters_key}",
            action=Action.REVIEW_DEAD_LETTERS,
            stream=stream,
            group=view.name,
        )
    for consumer in view.consumers:
        if consumer.pending == 0 and consumer.idle_ms > limits.consumer_idle_ms:
            yield Finding(
                "idle-consumer",
                f"{subject} / {consumer.name}",
                f"nothing pending and idle for {duration(consumer.idle_ms)}",
                "deletes it",
                Action.FIX,
                fixable=True,
                stream=stream,
                group=view.name,
                consumer=consumer.name,
            )


async def apply_fixes(
    client: Redis, diagnosis: Diagnosis, thresholds: Thresholds | None = None
) -> None:
    """Fix what is fixable, recording each outcome on its finding."""
    limits = thresholds or Thresholds()
    # 0 for a version that cannot be read: the fixes then use what 6.2 has.
    major = diagnosis.server.major
    for finding in diagnosis.findings:
        if not finding.fixable:
            continue
        if finding.kind == "library":
            mode = await ScriptRunner().load(client)
            finding.fixed, finding.outcome = True, f"loaded as {mode.value}"
        elif finding.kind == "legacy-lock" and finding.key is not None:
            finding.fixed, finding.outcome = await _expire_lock(
                client, finding.key, limits.lock_expiry_ms, major
            )
        elif finding.kind == "idle-consumer":
            finding.fixed, finding.outcome = await _delete_consumer(client, finding)


async def _expire_lock(
    client: Redis, key: str, expiry_ms: int, major: int
) -> tuple[bool, str]:
    # NX (Redis >= 7) never shortens an expiry an old worker set meanwhile;
    # on 6.2 the race is harmless: such a lock lives a round trip.
    set_now = await client.pexpire(key, expiry_ms, nx=major >= 7)
    if set_now:
        return True, f"expires in {duration(expiry_ms)}"
    if int(await client.pttl(key)) == -2:
        return True, "already gone"
    return True, "already has an expiry"


async def _delete_consumer(client: Redis, finding: Finding) -> tuple[bool, str]:
    reply = await ScriptRunner().run(
        client,
        delete_idle_consumer_call(
            stream=str(finding.stream),
            group=str(finding.group),
            consumer=str(finding.consumer),
        ),
    )
    if int(reply) == -1:
        return False, "it read entries meanwhile; left alone"
    return True, "deleted"
