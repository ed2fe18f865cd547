"""The ACL a worker needs: the rules ``acl`` prints and the tests apply."""

from __future__ import annotations

import re
from collections.abc import Sequence

from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.server_info import ServerInfo

WORKER_COMMANDS: tuple[tuple[str, str], ...] = (
    ("xreadgroup", "read new entries"),
    ("xack", "acknowledge"),
    ("xadd", "kick; dead letters (inside the scripts)"),
    (
        "xgroup|create",
        "create the group at startup; inside recreate_group, after it vanished",
    ),
    ("type", "refuse to start on a key that is not a stream"),
    (
        "xinfo|groups",
        "where the group is, to re-create it there if it vanishes; inside"
        " trim_consumed",
    ),
    ("info", "INFO server: functions (>= 7) or cached scripts (6.2)"),
    ("xautoclaim", "inside claim"),
    (
        "xpending",
        "inside set_idle, hand_back, dead_letter, decline, drop_trimmed,"
        " trim_consumed, recreate_group",
    ),
    (
        "xclaim",
        "fetch what claim took; inside set_idle, hand_back, decline,"
        " drop_trimmed, recreate_group",
    ),
    (
        "xrange",
        "inside claim (dead letters), dead_letter, drop_trimmed (6.2), recreate_group",
    ),
    ("get", "inside claim: lease holder, cursor; the fleet's claim gate"),
    (
        "set",
        "inside claim: lease, cursor; trim_consumed: its gate; the fleet's"
        " claim gate; the alive key (always PX)",
    ),
    ("del", "inside claim: finished cursor; the claim gate opened by a backlog"),
    ("pttl", "inside claim: lease lifetime"),
    (
        "pexpire",
        "inside claim: bound a lease written without expiry, the reclaimed"
        " count's expiry; start; after a read that reclaimed",
    ),
    ("incrby", "inside claim, after a read that reclaimed: count reclaims"),
    ("hincrby", "start; inside hand_back: count a task's starts"),
    ("hsetnx", "start: the field that keeps the started hash a hash table"),
    ("hmget", "inside claim: start counts of the claimed entries"),
    ("hkeys", "inside recreate_group: the entries a vanished group had started"),
    ("hdel", "ack; inside claim, hand_back, dead_letter: forget a start count"),
    ("multi", "start: its count and the hash's expiry in one transaction"),
    ("exec", "start: its count and the hash's expiry in one transaction"),
    (
        "xgroup|delconsumer",
        "inside leave_group: a worker exiting, consumers owning nothing",
    ),
    ("xinfo|consumers", "inside leave_group: which consumers own nothing"),
    ("xtrim", "inside trim_consumed: entries every group read and acked"),
)
# taskiq-redis's RedisAsyncResultBackend, beyond GET and SET above: the
# worker SETs results (with EX/PX when given), whoever waits reads them.
RESULT_BACKEND_COMMANDS = (
    ("exists", "result backend: is_result_ready"),
    ("getdel", "result backend: get_result with keep_results=False"),
)
# Only lua/claim.lua issues these (XAUTOCLAIM; the lease and cursor keys).
CLAIM_ONLY_COMMANDS = frozenset({"xautoclaim", "del", "pttl"})
# delete_acked=True: acks and dead-lettering delete with XACKDEL (Redis >= 8.2).
DELETE_ACKED_COMMANDS = (("xackdel", "ack; inside claim, dead_letter"),)
# Redis >= 8.6: kicks set how long the stream remembers task ids (IDMP).
IDEMPOTENCY_COMMANDS = (
    ("xcfgset", "inside set_idempotency: the stream's IDMP retention"),
)
# The ServerGauges middleware (gauges.py), beyond type, xinfo|groups and
# xpending above.
GAUGE_COMMANDS = (
    ("xlen", "ServerGauges: stream and dead-letter lengths"),
    ("xinfo|consumers", "ServerGauges: how long since a consumer last read"),
)
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
    ~taskiq-atomic-claim:reclaimed:{S}:S:G
    ~taskiq-atomic-claim:trim:{S}:S
    ~taskiq-atomic-claim:gate:{S}:S:G:*
  and once:
    ~taskiq-atomic-claim:alive:{G}:G:*
  (Inside the braces, the part of S Redis hashes: its hash tag, or all of
  S; after them, S with % and : percent-encoded; see keys.py.)
  Glob characters * ? [ ] \\ in names are escaped; ASCII whitespace and
  NUL, which ACL patterns cannot hold, become ? (any one byte).
Channels: none (resetchannels).
Commands: -@all, then
    +xreadgroup +xack +xadd +xgroup|create +type +xinfo|groups +info
    +xautoclaim +xpending +xclaim +xrange +get +set +del +pttl +pexpire
    +incrby +hincrby +hsetnx +hmget +hkeys +hdel +xgroup|delconsumer
    +xinfo|consumers +multi +exec +xtrim
  except on Redis >= 8.4, where the read reclaims: no +xautoclaim
  +del +pttl (with additional_streams read from explicit ids the claim
  script still runs: keep the full list). delete_acked=True (Redis >= 8.2;
  acl --delete-acked) adds +xackdel; the ServerGauges middleware (acl
  --gauges) adds +xlen. On Redis >= 8.6, +xcfgset (kicks
  set how long the stream remembers task ids).
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
        for key in (
            stream,
            keys.lease,
            keys.cursor,
            keys.dead_letters,
            keys.started,
            keys.reclaimed,
            keys.trim_gate,
        ):
            patterns.append("~" + (acl_pattern(key) if literal else key))
        for prefix in (keys.alive_prefix, keys.claim_gate_prefix):
            patterns.append("~" + (acl_pattern(prefix) if literal else prefix) + "*")
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
    delete_acked: bool = False,
    gauges: bool = False,
) -> list[str]:
    """``+command`` rules for a server of that version (``INFO`` redis_version)."""
    major, minor = _version(server_version)
    if delete_acked and not ServerInfo("Redis", f"{major}.{minor}").acked_trimming:
        raise ValueError(
            "delete_acked needs XACKDEL (Redis >= 8.2), and a server of version"
            f" {server_version} has none"
        )
    calls = FUNCTION_COMMANDS if major >= 7 else SCRIPT_COMMANDS
    names = [name for name, _ in WORKER_COMMANDS] + [calls[0][0]]
    if (major, minor) >= (8, 4):
        # The read reclaims (XREADGROUP ... CLAIM): no claim script runs.
        names = [name for name in names if name not in CLAIM_ONLY_COMMANDS]
    if delete_acked:
        names += [name for name, _ in DELETE_ACKED_COMMANDS]
    if (major, minor) >= (8, 6):
        names += [name for name, _ in IDEMPOTENCY_COMMANDS]
    if gauges:
        names += [name for name, _ in GAUGE_COMMANDS if name not in names]
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
    delete_acked: bool = False,
    gauges: bool = False,
) -> list[str]:
    """The ACL SETUSER rules (after the user's name and password) for a worker
    reading ``streams`` (queue_name first, then additional_streams) as
    ``group``, writing results under ``result_backend_prefix`` (the result
    backend's ``prefix_str``), with the broker's ``delete_acked`` and, with
    ``gauges``, the ``ServerGauges`` middleware; see ``WORKER_ACL``."""
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
            delete_acked=delete_acked,
            gauges=gauges,
        ),
    ]
