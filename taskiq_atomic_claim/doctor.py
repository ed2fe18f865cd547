"""Health checks behind ``doctor``, their fixes, and the ACL a worker needs.

Findings, each with what to do (``--fix`` fixes those marked fixable):

- ``legacy-lock`` (fixable): an ``autoclaim:*`` key without an expiry, left
  by a taskiq-redis <= 1.1.x worker killed inside its claim lock; it blocks
  those workers' reclaim forever. The fix gives it an expiry (the idle
  timeout by default) instead of deleting it: a live old worker may hold it
  this very moment, and it will have released it long before then.
- ``idle-consumer`` (fixable): a consumer with nothing pending that has not
  talked to the server for longer than a threshold; every restart of a
  worker with a random consumer name leaves one. The fix deletes it
  (XGROUP DELCONSUMER), atomically only if it still has nothing pending.
- ``library`` (fixable): this release's script library is missing or only
  other versions are loaded. The fix loads it.
- ``misplaced-dead-letters`` (fixable): a dead-letter stream holding entries
  of another stream or group: written under the key names of earlier
  releases, where streams ``s`` and ``{s}`` shared one. The fix moves each
  entry to the key of the stream and group it records, one atomic batch at
  a time, so no entry is ever lost or in both.
- ``pel-size``: a PEL past a threshold: workers fall behind or keep dying.
- ``stale-pending``: an entry pending for far longer than any idle timeout:
  nobody reclaims this group (no worker runs, or only taskiq-redis 1.2.x
  workers, which never reclaim on an idle queue).
- ``dead-letters``: entries the group gave up on wait for a person.
- ``missing-stream`` / ``no-group``: a named stream that does not exist, a
  stream without the named group, or (when discovering) without any group:
  nothing consumes it.

Warnings, printed but not failing the check (``durability``):
``eviction-policy`` (maxmemory-policy is not noeviction) and
``no-persistence`` (neither AOF nor RDB save points).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from taskiq_atomic_claim.durability import durability_risks
from taskiq_atomic_claim.inspection import (
    MAX_SCAN_CALLS,
    SCAN_COUNT,
    duration,
    inspect_server,
    plural,
    text,
)
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.legacy_dead_letters import (
    DEAD_LETTER_PATTERN,
    find_misplaced_dead_letters,
    migrate_dead_letters,
)
from taskiq_atomic_claim.scripts import LibraryState, ScriptRunner
from taskiq_atomic_claim.server_info import ServerInfo

# taskiq-redis's RedisStreamBroker default idle_timeout (ms).
DEFAULT_LOCK_EXPIRY_MS = 600_000
DEFAULT_CONSUMER_IDLE_MS = 24 * 3600 * 1000
DEFAULT_MAX_PENDING = 10_000
DEFAULT_STALE_PENDING_MS = 3600 * 1000
LEGACY_LOCK_PATTERN = "autoclaim:*"
MAX_LEGACY_LOCKS = 10_000

# Deletes a consumer only while it has nothing pending, in one atomic step:
# checking first and deleting after would drop entries it read in between
# from the PEL, and nothing would ever reclaim them.
# KEYS[1] stream; ARGV[1] group; ARGV[2] consumer. Returns -1 when the
# consumer has pending entries (left alone), else what DELCONSUMER returns.
_DELETE_IDLE_CONSUMER = """
if #redis.call("XPENDING", KEYS[1], ARGV[1], "-", "+", 1, ARGV[2]) > 0 then
  return -1
end
return redis.call("XGROUP", "DELCONSUMER", KEYS[1], ARGV[1], ARGV[2])
"""


@dataclass(frozen=True)
class Thresholds:
    consumer_idle_ms: int = DEFAULT_CONSUMER_IDLE_MS
    max_pending: int = DEFAULT_MAX_PENDING
    stale_pending_ms: int = DEFAULT_STALE_PENDING_MS
    lock_expiry_ms: int = DEFAULT_LOCK_EXPIRY_MS


@dataclass
class Finding:
    kind: str
    subject: str
    problem: str
    advice: str
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


async def find_legacy_locks(client: Any) -> tuple[list[str], bool]:
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
    client: Any,
    streams: list[str] | None = None,
    group: str | None = None,
    thresholds: Thresholds | None = None,
    prog: str = "taskiq-atomic-claim",
    reach: str = "--url URL",
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
                f"run `{prog} load {reach}` (workers also load it on demand"
                " if their ACL allows FUNCTION LOAD / SCRIPT LOAD)",
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
                f"`{prog} doctor --fix` gives it a {duration(limits.lock_expiry_ms)}"
                " expiry (--lock-expiry-ms); upgrade those workers",
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
                "run doctor again after --fix",
            )
        )

    misplaced, cut = await find_misplaced_dead_letters(client)
    for found in misplaced:
        findings.append(
            Finding(
                "misplaced-dead-letters",
                found.key,
                f"holds dead letters of other streams or groups ({found.sampled}"
                " among its first entries): written under an earlier release's"
                " key names, which `dead-letters` and `requeue` no longer read",
                f"`{prog} doctor --fix` moves each to its stream's and group's key",
                fixable=True,
                key=found.key,
            )
        )
    if cut:
        findings.append(
            Finding(
                "misplaced-dead-letters",
                DEAD_LETTER_PATTERN,
                "too many keys to check; the scan stopped",
                "run doctor again after --fix",
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
            findings += _group_findings(stream.name, view, limits, prog, reach)
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


def _group_findings(
    stream: str, view: Any, limits: Thresholds, prog: str, reach: str
) -> Iterable[Finding]:
    subject = f"{stream} / {view.name}"
    scope = f"{reach} --queue={shlex.quote(stream)} --group={shlex.quote(view.name)}"
    if view.pending > limits.max_pending:
        yield Finding(
            "pel-size",
            subject,
            f"{plural(view.pending, 'pending entry')} (threshold {limits.max_pending})",
            "workers fall behind or keep dying: check worker logs and"
            " dead letters, add workers (--max-pending to tune)",
        )
    oldest = view.oldest_pending_idle_ms
    if oldest is not None and oldest > limits.stale_pending_ms:
        yield Finding(
            "stale-pending",
            subject,
            f"an entry has been pending for {duration(oldest)}: nobody reclaims"
            " this group",
            "start AtomicRedisStreamBroker workers (taskiq-redis 1.2.x never"
            " reclaims on an idle queue) (--stale-pending-ms to tune)",
        )
    if view.dead_letters:
        yield Finding(
            "dead-letters",
            subject,
            f"{plural(view.dead_letters, 'dead letter')} in {view.dead_letters_key}",
            f"review: `{prog} dead-letters {scope}`; then"
            f" `{prog} requeue {scope} --all`, or delete them",
        )
    for consumer in view.consumers:
        if consumer.pending == 0 and consumer.idle_ms > limits.consumer_idle_ms:
            yield Finding(
                "idle-consumer",
                f"{subject} / {consumer.name}",
                f"nothing pending and idle for {duration(consumer.idle_ms)}",
                f"`{prog} doctor --fix` deletes it (--consumer-idle-ms to tune)",
                fixable=True,
                stream=stream,
                group=view.name,
                consumer=consumer.name,
            )


async def apply_fixes(
    client: Any, diagnosis: Diagnosis, thresholds: Thresholds | None = None
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
        elif finding.kind == "misplaced-dead-letters" and finding.key is not None:
            moved = await migrate_dead_letters(ScriptRunner(), client, finding.key)
            finding.fixed, finding.outcome = True, f"moved {plural(moved, 'entry')}"


async def _expire_lock(
    client: Any, key: str, expiry_ms: int, major: int
) -> tuple[bool, str]:
    # NX (Redis >= 7) never shortens an expiry an old worker set meanwhile;
    # on 6.2 the race is harmless: such a lock lives a round trip.
    args: list[Any] = ["PEXPIRE", key, expiry_ms]
    if major >= 7:
        args.append("NX")
    set_now = await client.execute_command(*args)
    if set_now:
        return True, f"expires in {duration(expiry_ms)}"
    if int(await client.pttl(key)) == -2:
        return True, "already gone"
    return True, "already has an expiry"


async def _delete_consumer(client: Any, finding: Finding) -> tuple[bool, str]:
    reply = await client.eval(
        _DELETE_IDLE_CONSUMER, 1, finding.stream, finding.group, finding.consumer
    )
    if int(reply) == -1:
        return False, "it read entries meanwhile; left alone"
    return True, "deleted"


# The ACL a worker needs.

WORKER_COMMANDS: tuple[tuple[str, str], ...] = (
    ("xreadgroup", "read new entries"),
    ("xack", "acknowledge (inside ack)"),
    ("xadd", "kick; dead letters (inside the scripts)"),
    ("xgroup|create", "create the group at startup and after it vanished"),
    ("type", "refuse to start on a key that is not a stream"),
    ("xinfo|groups", "where the group is, to re-create it there if it vanishes"),
    ("info", "INFO server: functions (>= 7) or cached scripts (6.2)"),
    ("xautoclaim", "inside claim"),
    ("xpending", "inside claim (6.2), set_idle, hand_back, dead_letter"),
    ("xclaim", "inside set_idle (heartbeat, hand back)"),
    ("xrange", "inside claim, dead_letter"),
    ("get", "inside claim: lease holder, cursor"),
    ("set", "inside claim: lease, cursor (always with PX)"),
    ("del", "inside claim: finished cursor"),
    ("pttl", "inside claim: lease lifetime"),
    ("pexpire", "inside claim: bound a lease written without expiry; start"),
    ("hincrby", "inside start, hand_back: count a task's starts"),
    ("hmget", "inside claim: start counts of the claimed entries"),
    ("hdel", "inside ack, claim, hand_back, dead_letter: forget a start count"),
)
# taskiq-redis's RedisAsyncResultBackend, beyond GET and SET above: the
# worker SETs results (with EX/PX when given), whoever waits reads them.
RESULT_BACKEND_COMMANDS = (
    ("exists", "result backend: is_result_ready"),
    ("getdel", "result backend: get_result with keep_results=False"),
)
# Only lua/claim.lua issues these (XAUTOCLAIM; the lease and cursor keys).
CLAIM_ONLY_COMMANDS = frozenset({"xautoclaim", "get", "set", "del", "pttl"})
FUNCTION_COMMANDS = (("fcall", "call the library"), ("function|load", "reload it"))
SCRIPT_COMMANDS = (("evalsha", "call the scripts"), ("script|load", "reload them"))
# redis-py's connect handshake (RESP3): CLIENT SETINFO and, in "auto" mode,
# CLIENT MAINT_NOTIFICATIONS. It ignores a refusal, so these are not needed;
# granting them keeps every connect out of ACL LOG. A server checks ACL before
# looking up the subcommand only on 6.2 (which grants any name); 7.x rejects
# unknown subcommands, and grants setinfo from 7.2 on.
HANDSHAKE_62 = ("client|setinfo", "client|maint_notifications")
HANDSHAKE_72 = ("client|setinfo",)

WORKER_ACL = """The ACL a worker needs, for group G and queue (or additional stream) S.

Keys, per stream S:
    ~S
    ~taskiq-atomic-claim:lease:{S}:S:G
    ~taskiq-atomic-claim:cursor:{S}:S:G
    ~taskiq-atomic-claim:dead:{S}:S:G
    ~taskiq-atomic-claim:started:{S}:S:G
  (Inside the braces, the part of S Redis hashes: its hash tag, or all of
  S; after them, S with % and : percent-encoded; see keys.py.)
  Glob characters * ? [ ] \\ in names are escaped; ASCII whitespace and
  NUL, which ACL patterns cannot hold, become ? (any one byte).
Channels: none (resetchannels).
Commands: -@all, then
    +xreadgroup +xack +xadd +xgroup|create +type +xinfo|groups +info
    +xautoclaim +xpending +xclaim +xrange +get +set +del +pttl +pexpire
    +hincrby +hmget +hdel
  except on Redis >= 8.4, where the read reclaims: no +xautoclaim +get +set
  +del +pttl (with additional_streams read from explicit ids the claim
  script still runs: keep the full list). delete_acked=True adds +xackdel.
  And, to call the library and reload it when lost (restart, flush, failover):
    Redis/Valkey >= 7:  +fcall +function|load
    Redis 6.2:          +evalsha +script|load
  and, optional, so redis-py's connect is not logged as refused in ACL LOG:
    Redis 6.2:          +client|setinfo +client|maint_notifications
    Redis >= 7.2/Valkey: +client|setinfo
With taskiq-redis's RedisAsyncResultBackend(prefix_str=P) (acl
--result-backend-prefix P), for the worker and whoever waits for results:
    ~P:*  (its keys: P:<task id> and P:<task id>__progress)
    +exists +getdel
Scripts run with the caller's ACL, so the commands they issue are listed too.
Without +function|load / +script|load a worker cannot reload a lost library:
then run `taskiq-atomic-claim load` after every restart or flush.
"""

_GLOB = re.compile(r"([*?\[\]\\])")
# What ACL SETUSER refuses in a pattern (a syntax error): ASCII whitespace and
# NUL, each one byte, so one "?" matches it. Unicode spaces pass as they are.
_UNSAYABLE = re.compile(r"[ \t\n\v\f\r\x00]")


def acl_pattern(name: str) -> str:
    """A key name as an ACL pattern matching it; where it holds whitespace or
    NUL, which patterns cannot, "?" there matches any one byte."""
    return _UNSAYABLE.sub("?", _GLOB.sub(r"\\\1", name))


def worker_key_patterns(
    streams: Sequence[str], group: str, *, literal: bool = True
) -> list[str]:
    """``~`` rules for the streams and their keys; ``literal`` False takes the
    names as ready-made glob patterns (e.g. ``drill-*``)."""
    patterns: list[str] = []
    for stream in streams:
        keys = StreamKeys(stream, group)
        for key in (stream, keys.lease, keys.cursor, keys.dead_letters, keys.started):
            patterns.append("~" + (acl_pattern(key) if literal else key))
    return list(dict.fromkeys(patterns))


def _version(server_version: str) -> tuple[int, int]:
    parts = [*server_version.split("."), "0", "0"][:2]
    try:
        return int(parts[0]), int(parts[1])
    except ValueError:
        raise ValueError(
            f"server version must look like 7.2, got {server_version!r}"
        ) from None


def worker_commands(
    server_version: str,
    *,
    reload: bool = True,
    handshake: bool = True,
    result_backend: bool = False,
) -> list[str]:
    """``+command`` rules for a server of that version (``INFO`` redis_version)."""
    major, minor = _version(server_version)
    calls = FUNCTION_COMMANDS if major >= 7 else SCRIPT_COMMANDS
    names = [name for name, _ in WORKER_COMMANDS] + [calls[0][0]]
    if (major, minor) >= (8, 4):
        # The read reclaims (XREADGROUP ... CLAIM): no claim script runs;
        # a result backend still GETs and SETs.
        unused = CLAIM_ONLY_COMMANDS - ({"get", "set"} if result_backend else set())
        names = [name for name in names if name not in unused]
    if reload:
        names.append(calls[1][0])
    if result_backend:
        names += [name for name, _ in RESULT_BACKEND_COMMANDS]
    if handshake and major < 7:
        names += HANDSHAKE_62
    elif handshake and (major, minor) >= (7, 2):
        names += HANDSHAKE_72
    return ["+" + name for name in names]


def worker_acl_rule(
    streams: Sequence[str],
    group: str,
    server_version: str,
    *,
    reload: bool = True,
    handshake: bool = True,
    literal: bool = True,
    result_backend_prefix: str | None = None,
) -> list[str]:
    """The ACL SETUSER rules (after the user's name and password) for a worker
    reading ``streams`` (queue_name first, then additional_streams) as
    ``group``, and writing results under ``result_backend_prefix`` (the
    result backend's ``prefix_str``); see ``WORKER_ACL``."""
    if not streams:
        raise ValueError("streams must name at least the queue")
    if result_backend_prefix == "":
        raise ValueError(
            "result_backend_prefix must not be empty: without a prefix_str the"
            " result backend's keys are bare task ids, which no rule can scope"
        )
    results = (
        [f"~{acl_pattern(result_backend_prefix)}:*"]
        if result_backend_prefix is not None
        else []
    )
    return [
        "resetchannels",
        *worker_key_patterns(streams, group, literal=literal),
        *results,
        "-@all",
        *worker_commands(
            server_version,
            reload=reload,
            handshake=handshake,
            result_backend=result_backend_prefix is not None,
        ),
    ]
