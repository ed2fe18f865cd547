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
    Inspection,
    duration,
    inspect_server,
    plural,
)
from taskiq_atomic_claim.durability import durability_risks
from taskiq_atomic_claim.gauges import ConsumerReading
from taskiq_atomic_claim.operations import delete_idle_consumer_call
from taskiq_atomic_claim.replies import text
from taskiq_atomic_claim.scripts import LibraryState, ScriptRunner
from taskiq_atomic_claim.server_info import ServerInfo
from taskiq_atomic_claim.settings import DEFAULT_IDLE_TIMEOUT_MS

# taskiq-redis's RedisStreamBroker default idle_timeout (ms).
DEFAULT_LOCK_EXPIRY_MS = 600_000
DEFAULT_CONSUMER_IDLE_MS = 24 * 3600 * 1000
DEFAULT_MAX_PENDING = 10_000
DEFAULT_STALE_PENDING_MS = 3600 * 1000
# How many idle_timeouts (the brokers' default unless told) without a read,
# with entries waiting, make a backlog nobody reads.
UNREAD_TIMEOUTS = 2
# Entries a stream keeps after every group is done with them (acked, not
# deleted): past this it grows without bound.
DEFAULT_MAX_RETAINED = 100_000
LEGACY_LOCK_PATTERN = "autoclaim:*"
MAX_LEGACY_LOCKS = 10_000


@dataclass(frozen=True)
class Thresholds:
    consumer_idle_ms: int = DEFAULT_CONSUMER_IDLE_MS
    max_pending: int = DEFAULT_MAX_PENDING
    stale_pending_ms: int = DEFAULT_STALE_PENDING_MS
    lock_expiry_ms: int = DEFAULT_LOCK_EXPIRY_MS
    idle_timeout_ms: int = DEFAULT_IDLE_TIMEOUT_MS
    max_retained: int = DEFAULT_MAX_RETAINED


class Severity(Enum):
    """How urgent a finding is; findings are ranked by it, most urgent first."""

    CRITICAL = "critical"  # tasks are not being run now
    WARNING = "warning"  # tasks are late, lost or piling up
    NOTICE = "notice"  # tidy up when convenient


class Liveness(Enum):
    LIVE = "live"  # its process marks itself alive, or it talked lately
    DEAD = "dead"  # holds entries idle past the idle timeout, and is silent
    QUIET = "quiet"  # silent past the idle timeout, holding nothing overdue


def consumer_liveness(consumer: ConsumerReading, idle_timeout_ms: int) -> Liveness:
    """Whether a consumer's worker is alive, from what the server shows now.

    A worker of this package marks itself alive (its liveness thread renews
    a key that lapses within idle_timeout once the process is gone): that
    decides. Without it (a worker of another release or package), idle time
    alone cannot tell: on Redis < 7.2 a live worker blocked on an empty
    queue can look idle for minutes. A worker that holds an entry idle past
    the idle timeout is gone, though: a live one's heartbeat keeps its
    entries fresh. The one place that decides; the page and doctor ask it.
    """
    if consumer.alive or consumer.idle_ms <= idle_timeout_ms:
        return Liveness.LIVE
    overdue = consumer.oldest_pending_idle_ms or 0
    if consumer.pending and overdue > idle_timeout_ms:
        return Liveness.DEAD
    return Liveness.QUIET


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
    severity: Severity = Severity.WARNING
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
    findings, groups_checked = await inspection_findings(client, inspection, limits)

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
    warnings = [
        Finding(risk.kind, "server", risk.problem, risk.advice)
        for risk in await durability_risks(client)
    ]
    return Diagnosis(
        inspection.server,
        len(inspection.streams),
        groups_checked,
        rank(findings),
        warnings,
    )


def rank(findings: list[Finding]) -> list[Finding]:
    """Most urgent first: a server refusing writes, then a backlog nobody
    reads (a stable sort keeps the order within each rank)."""
    order = list(Severity)
    first = ("refusing-writes", "unread-backlog")

    def urgency(finding: Finding) -> tuple[int, int]:
        kind = finding.kind
        return order.index(finding.severity), (
            first.index(kind) if kind in first else len(first)
        )

    return sorted(findings, key=urgency)


async def inspection_findings(
    client: Redis,
    inspection: Inspection,
    limits: Thresholds,
    dead_letters_added: dict[tuple[str, str], tuple[int, int]] | None = None,
) -> tuple[list[Finding], int]:
    """What is wrong in one reading, ranked, and how many groups were
    checked: what ``doctor`` and ``serve``'s page both show.
    ``dead_letters_added``: per (stream, group), dead letters added over how
    many ms (serve's history); without it, dead letters are not told apart
    from growing ones."""
    findings: list[Finding] = []
    refusal = await refused_writes(client)
    if refusal is not None:
        findings.append(refusal)
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
        needed: list[int | None] = []  # per group: entries it still needs
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
            needed.append(None if waiting is None else waiting + view.pending)
            findings += _backlog_findings(stream.name, view, waiting, limits)
            added = (dead_letters_added or {}).get((stream.name, view.name))
            findings += _group_findings(stream.name, view, limits, added)
        if needed and None not in needed:
            findings += _retained_findings(stream, max(n or 0 for n in needed), limits)
    return rank(findings), groups_checked


async def refused_writes(client: Redis) -> Finding | None:
    """Why the server refuses writes (no task can be kicked or acked), or
    None: out of memory under noeviction, a failed background save with
    stop-writes-on-bgsave-error, or a read-only replica."""
    memory = await client.info("memory")
    used, limit = int(memory.get("used_memory", 0)), int(memory.get("maxmemory", 0))
    policy = text(memory.get("maxmemory_policy", "noeviction"))
    if limit and used >= limit and policy == "noeviction":
        return Finding(
            "refusing-writes",
            "server",
            f"out of memory: {used} bytes used of maxmemory {limit} under"
            " noeviction: kicks, acks and claims fail with OOM",
            "raise maxmemory, or free memory: delete dead letters, trim"
            " streams that grow without bound",
            severity=Severity.CRITICAL,
        )
    persistence = await client.info("persistence")
    if text(persistence.get("rdb_last_bgsave_status", "ok")) == "err":
        return Finding(
            "refusing-writes",
            "server",
            "the last background save failed: with stop-writes-on-bgsave-error"
            " (the default) every write fails with MISCONF",
            "fix the disk (space, permissions) and BGSAVE, see the server's log",
            severity=Severity.CRITICAL,
        )
    replication = await client.info("replication")
    if text(replication.get("role", "master")) != "master":
        return Finding(
            "refusing-writes",
            "server",
            "a read-only replica: workers cannot claim or ack here",
            "point the brokers and this command at the primary",
            severity=Severity.CRITICAL,
        )
    return None


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
        severity=Severity.CRITICAL,
        stream=stream,
        group=view.name,
    )


def _retained_findings(
    stream: Any, needed: int, limits: Thresholds
) -> Iterable[Finding]:
    retained = stream.length - needed
    if retained > limits.max_retained:
        yield Finding(
            "unbounded-stream",
            stream.name,
            f"{plural(stream.length, 'entry')} of which {retained} no group needs"
            " (acked, never deleted): the stream grows without bound",
            "give the brokers maxlen= (approximate trimming) or delete_acked=True"
            " (Redis >= 8.2), or XTRIM it; memory runs out otherwise",
            stream=stream.name,
        )


def _group_findings(
    stream: str,
    view: Any,
    limits: Thresholds,
    dead_letters_added: tuple[int, int] | None = None,
) -> Iterable[Finding]:
    subject = f"{stream} / {view.name}"
    if view.pending > limits.max_pending:
        yield Finding(
            "pel-size",
            subject,
            f"{plural(view.pending, 'pending entry')} (threshold {limits.max_pending})",
            "workers fall behind or keep dying: check worker logs and"
            " dead letters, add workers",
        )
    dead = [
        c
        for c in view.consumers
        if consumer_liveness(c, limits.idle_timeout_ms) is Liveness.DEAD
    ]
    for consumer in dead:
        yield Finding(
            "dead-consumer",
            f"{subject} / {consumer.name}",
            f"holds {plural(consumer.pending, 'entry')}, one pending for"
            f" {duration(consumer.oldest_pending_idle_ms)}, and has not talked to"
            f" the server for {duration(consumer.idle_ms)}: its worker is gone",
            "live workers reclaim its entries once idle past idle_timeout; if"
            " they do not, start workers on this group. `doctor --fix` deletes"
            " the consumer once it holds nothing",
            stream=stream,
            group=view.name,
            consumer=consumer.name,
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
    elif oldest is not None and oldest > limits.idle_timeout_ms and not dead:
        yield Finding(
            "overdue-pending",
            subject,
            f"an entry has been pending for {duration(oldest)}, past the"
            f" {duration(limits.idle_timeout_ms)} idle timeout, and not reclaimed",
            "live workers reclaim it at their next claim cycle; if it stays,"
            " check that workers run on this group and their logs",
            stream=stream,
            group=view.name,
        )
    if view.dead_letters:
        growing = ""
        severity = Severity.WARNING
        if dead_letters_added is not None:
            added, over_ms = dead_letters_added
            if added > 0:
                growing = f", {added} added in the last {duration(over_ms)}"
            else:
                severity = Severity.NOTICE
        yield Finding(
            "dead-letters",
            subject,
            f"{plural(view.dead_letters, 'dead letter')}{growing}"
            f" in {view.dead_letters_key}",
            action=Action.REVIEW_DEAD_LETTERS,
            severity=severity,
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
                severity=Severity.NOTICE,
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
