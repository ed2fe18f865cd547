"""``taskiq-atomic-claim``: set up, inspect and repair; the crash drill.

Every command that talks to a server gets its client from ``connect``, the
one place that turns the connection options into a client.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlsplit

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.sentinel import Sentinel
from redis.exceptions import (
    MovedError,
    NoPermissionError,
    RedisClusterException,
    RedisError,
)

from taskiq_atomic_claim import __version__
from taskiq_atomic_claim.dead_letters import (
    DeadLetter,
    dead_letter_ids_of_task,
    entry_time,
    list_dead_letters,
    preview,
    requeue_dead_letters,
)
from taskiq_atomic_claim.doctor import (
    DEFAULT_CONSUMER_IDLE_MS,
    DEFAULT_LOCK_EXPIRY_MS,
    DEFAULT_MAX_PENDING,
    DEFAULT_STALE_PENDING_MS,
    Diagnosis,
    Thresholds,
    apply_fixes,
    diagnose,
    worker_acl_rule,
)
from taskiq_atomic_claim.inspection import (
    FORMAT,
    inspect_server,
    inspection_to_json,
    plural,
    render_inspection,
    server_version,
)
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.scripts import LIBRARY, LibraryState, ScriptRunner
from taskiq_atomic_claim.settings import require_name

PROG = "taskiq-atomic-claim"
_SCHEMES = ("redis", "rediss", "unix")


class CommandError(Exception):
    """A failure to report as one line, without a traceback."""


# What redis-py's reply parsers raise on a reply of a shape Redis never sends.
_UNPARSABLE = (AttributeError, TypeError, ValueError, IndexError, KeyError)


class NotRedisError(RedisError):
    """A server that speaks RESP but does not answer as Redis or Valkey do."""


@dataclass(frozen=True)
class ConnectionOptions:
    """How to reach the server; the ``--url`` and TLS options of a command."""

    url: str
    tls_ca_cert: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ConnectionOptions:
        url = args.url
        if url is None:
            if not args.sentinel:
                raise CommandError(
                    "--url is required (for Sentinel: --sentinel HOST:PORT"
                    " --master NAME)"
                )
            url = "redis://"  # the sentinels name the master's host and port
        return cls(
            url=url,
            tls_ca_cert=args.tls_ca_cert,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
        )


@dataclass(frozen=True)
class Target:
    """One server a command acts on."""

    options: ConnectionOptions
    # How reports name it ("primary 10.0.0.1:6379"); None: the --url server.
    label: str | None = None
    # The named streams it holds; None: none were named, discover them.
    streams: list[str] | None = None

    @property
    def where(self) -> str:
        parts = urlsplit(self.options.url)
        return f"{parts.hostname}:{parts.port}" if parts.port else self.options.url


def add_server_options(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--url",
        help="redis://, rediss:// (TLS) or unix:// URL; with --cluster any node;"
        " with --sentinel optional, its scheme and credentials reach the master",
    )
    tls = command.add_argument_group("TLS (rediss:// URLs)")
    tls.add_argument("--tls-ca-cert", help="CA certificate file to verify the server")
    tls.add_argument("--tls-cert", help="client certificate file (mutual TLS)")
    tls.add_argument("--tls-key", help="client private key file (mutual TLS)")
    topology = command.add_argument_group("Cluster and Sentinel")
    topology.add_argument(
        "--cluster",
        action="store_true",
        help="--url is a cluster node: act on every primary, one report each",
    )
    topology.add_argument(
        "--sentinel",
        action="append",
        metavar="HOST:PORT",
        help="ask these sentinels for the master (repeatable); needs --master",
    )
    topology.add_argument("--master", metavar="NAME", help="the Sentinel master name")


def connect(options: ConnectionOptions) -> Any:
    """The client for ``options``: the one place clients are made.

    Always a client of one server: with --cluster or --sentinel,
    ``_targets`` first finds which servers (primaries, the master) to reach.
    """
    url = options.url
    try:
        scheme = urlsplit(url).scheme
    except ValueError as error:  # e.g. an unclosed "[" in the host
        raise CommandError(f"bad --url {url!r}: {error}") from None
    if scheme not in _SCHEMES:
        raise CommandError(
            f"bad --url {url!r}: scheme must be one of"
            f" {', '.join(s + '://' for s in _SCHEMES)}"
        )
    tls = _tls_arguments(options)
    try:
        return Redis.from_url(url, socket_connect_timeout=5, socket_timeout=10, **tls)
    except ValueError as error:
        raise CommandError(f"bad --url {url!r}: {error}") from None


@contextlib.asynccontextmanager
async def connected(options: ConnectionOptions) -> AsyncIterator[Any]:
    """``connect``, then make sure the peer is a Redis or Valkey server: the
    replies of anything else would fail somewhere deep in a parser."""
    async with connect(options) as client:
        await _require_redis(client, _address(options.url))
        yield client


def _address(url: str) -> str:
    """host:port of ``url``, without credentials."""
    return urlsplit(url).netloc.rpartition("@")[2]


async def _require_redis(client: Any, where: str) -> None:
    try:
        info = await client.execute_command("INFO", "server")
    except NoPermissionError:
        return  # a restricted user: the commands themselves will tell
    except _UNPARSABLE:
        info = None  # a reply no INFO parser could read
    if not isinstance(info, dict) or "redis_version" not in info:
        raise NotRedisError(
            f"{where} speaks RESP but is not a Redis or Valkey server"
            " (INFO server has no redis_version)"
        )


def _tls_arguments(options: ConnectionOptions) -> dict[str, Any]:
    url = options.url
    scheme = urlsplit(url).scheme
    tls: dict[str, Any] = {}
    for flag, value, name in (
        ("--tls-ca-cert", options.tls_ca_cert, "ssl_ca_certs"),
        ("--tls-cert", options.tls_cert, "ssl_certfile"),
        ("--tls-key", options.tls_key, "ssl_keyfile"),
    ):
        if value is None:
            continue
        if scheme != "rediss":
            raise CommandError(f"{flag} needs a rediss:// URL, got {url!r}")
        if not Path(value).is_file():
            raise CommandError(f"{flag}: no such file: {value!r}")
        tls[name] = value
    return tls


def _node_url(url: str, host: str, port: int) -> str:
    """``url`` pointed at another node: same scheme, credentials and options."""
    parts = urlsplit(url)
    credentials = parts.netloc.rpartition("@")[0]
    netloc = f"{credentials}@{host}:{port}" if credentials else f"{host}:{port}"
    return parts._replace(netloc=netloc).geturl()


async def _targets(
    args: argparse.Namespace, streams: list[str] | None = None
) -> list[Target]:
    """The servers a command acts on: the one of ``--url``, the master the
    sentinels name, or every primary of a cluster, each with those of the
    named ``streams`` it holds."""
    options = ConnectionOptions.from_args(args)
    connect(options)  # validates the URL and TLS options before any I/O
    if args.cluster and args.sentinel:
        raise CommandError("--cluster and --sentinel exclude each other")
    if args.sentinel:
        if args.master is None:
            raise CommandError("--sentinel needs --master NAME")
        host, port = await _discover_master(args.sentinel, args.master)
        return [
            Target(
                replace(options, url=_node_url(options.url, host, port)),
                f"master {args.master!r} at {host}:{port}",
                streams,
            )
        ]
    if args.master is not None:
        raise CommandError("--master needs --sentinel HOST:PORT")
    if not args.cluster:
        return [Target(options, None, streams)]
    return await _cluster_primaries(options, streams)


async def _discover_master(sentinels: list[str], master: str) -> tuple[str, int]:
    addresses = []
    for item in sentinels:
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise CommandError(f"--sentinel must be HOST:PORT, got {item!r}")
        addresses.append((host, int(port)))
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        addresses, socket_connect_timeout=5, socket_timeout=10
    )
    try:
        host, port = await sentinel.discover_master(master)
    except _UNPARSABLE:
        raise NotRedisError(
            "a --sentinel speaks RESP but did not answer SENTINEL MASTERS as a"
            " sentinel does"
        ) from None
    finally:
        for client in sentinel.sentinels:
            await client.aclose()
    return str(host), int(port)


async def _cluster_primaries(
    options: ConnectionOptions, streams: list[str] | None
) -> list[Target]:
    tls = _tls_arguments(options)
    startup = RedisCluster.from_url(
        options.url, socket_connect_timeout=5, socket_timeout=10, **tls
    )
    try:
        await startup.initialize()
        primaries = startup.get_primaries()
        # A named stream lives on the primary serving its slot, nowhere else.
        owners = [startup.get_node_from_key(stream) for stream in streams or ()]
    except RedisClusterException as error:  # not a RedisError
        raise CommandError(f"--cluster: {error}") from None
    except _UNPARSABLE:
        raise NotRedisError(
            f"{_address(options.url)} speaks RESP but did not answer"
            " CLUSTER SLOTS as a Redis or Valkey cluster node does"
        ) from None
    finally:
        await startup.aclose()
    targets = []
    for node in primaries:
        held = None
        if streams is not None:
            pairs = zip(streams, owners, strict=True)
            held = [stream for stream, owner in pairs if owner is node]
        url = _node_url(options.url, node.host, int(node.port))
        label = f"primary {node.host}:{node.port}"
        targets.append(Target(replace(options, url=url), label, held))
    return targets


async def _on_each_target(
    targets: list[Target],
    action: Callable[[Any, Target], Awaitable[bool]],
    done: str | None,
    on_error: Callable[[Target, str], None] | None = None,
) -> int:
    """Run ``action`` per node; one unreachable node does not hide the rest.

    Exit 0 when ``action`` returned True everywhere; a single target's
    errors are the command's errors (one line, exit 2). ``done`` names what
    the summary line counts; None prints none (JSON output).
    """
    succeeded = 0
    for target in targets:
        try:
            async with connected(target.options) as client:
                succeeded += await action(client, target)
        except (RedisError, OSError) as error:
            if len(targets) == 1:
                raise
            message = f"{type(error).__name__}: {error}"
            if on_error is None:
                print(f"{target.where}: error: {message}")
            else:
                on_error(target, message)
    if len(targets) > 1 and done is not None:
        print(f"{succeeded}/{len(targets)} primaries {done}")
    return 0 if succeeded == len(targets) else 1


def _reach(args: argparse.Namespace) -> str:
    """The connection options of a command, as advice should spell them."""
    if args.sentinel:
        return "--sentinel HOST:PORT --master NAME"
    return "--cluster --url URL" if args.cluster else "--url URL"


def _heading(target: Target) -> None:
    if target.label is not None:
        print(f"== {target.label} ==")


async def _load(args: argparse.Namespace) -> int:
    async def load(client: Any, target: Target) -> bool:
        mode = await ScriptRunner().load(client)
        print(
            f"loaded {LIBRARY.name} ({len(LIBRARY.scripts)} operations:"
            f" {', '.join(LIBRARY.scripts)}) as {mode.value} on {target.where}"
            f" [taskiq-atomic-claim {__version__}]"
        )
        return True

    return await _on_each_target(await _targets(args), load, "loaded")


async def _check(args: argparse.Namespace) -> int:
    targets = await _targets(args)

    async def check(client: Any, target: Target) -> bool:
        runner = ScriptRunner()
        server = await runner.probe_server(client)
        status = await runner.status(client)
        others = (
            f"; other versions present: {', '.join(status.other_versions)}"
            if status.other_versions
            else ""
        )
        where = f" on {target.where}" if len(targets) > 1 else ""
        print(server.describe())
        print(
            f"{LIBRARY.name} as {status.mode.value}{where}:"
            f" {status.state.value}{others}"
        )
        return status.state is LibraryState.CURRENT and not server.scripting_problem

    code = await _on_each_target(targets, check, "current")
    if code:
        print(f"run: {PROG} load {_reach(args)}", file=sys.stderr)
    return code


async def _server_of(args: argparse.Namespace, keys: StreamKeys) -> Target:
    """The one server holding ``keys.stream`` (on a cluster, its primary)."""
    (target,) = [t for t in await _targets(args, [keys.stream]) if t.streams]
    return target


def _when(entry_id: str) -> str:
    return f"{entry_time(entry_id):%Y-%m-%d %H:%M:%S} UTC"


def _describe(letter: DeadLetter) -> str:
    """Two lines: what the task was and why and when it died."""
    task = letter.task()
    if task is not None:
        what = f"task {task.name}  id {task.task_id}  args ({preview(task.arguments)})"
    elif b"data" in letter.fields:
        what = f"not a taskiq JSON message: {preview(repr(letter.data))}"
    else:
        what = f"fields {preview(repr(letter.fields))}"
    sent = f", sent {_when(letter.original_id)}" if letter.original_id else ""
    return (
        f"{letter.id}  {what}\n    {letter.reason} after"
        f" {plural(letter.deliveries, 'delivery')}; dead since {_when(letter.id)}"
        f"{sent} (original {letter.original_id or '?'})"
    )


async def _dead_letters(args: argparse.Namespace) -> int:
    keys = StreamKeys(args.queue, args.group)
    async with connected((await _server_of(args, keys)).options) as client:
        total = await client.exists(keys.dead_letters) and await client.xlen(
            keys.dead_letters
        )
        letters = await list_dead_letters(client, keys, args.count)
    print(f"{total} dead letters in {keys.dead_letters}")
    for letter in letters:
        print(_describe(letter))
    if total > len(letters):
        print(f"... {total - len(letters)} more (--count)")
    return 0


async def _requeue(args: argparse.Namespace) -> int:
    keys = StreamKeys(args.queue, args.group)
    ids: list[str] | None = args.ids
    async with connected((await _server_of(args, keys)).options) as client:
        if args.task is not None:
            ids = await dead_letter_ids_of_task(client, keys, args.task)
            if not ids:
                print(f"no dead letters of task {args.task!r} in {keys.dead_letters}")
                return 1
        moved = await requeue_dead_letters(ScriptRunner(), client, keys, ids)
    for old, new in moved:
        print(f"requeued {old} -> {keys.stream} {new}")
    print(f"{len(moved)} requeued to {keys.stream}")
    missing = sorted(set(ids or ()) - {old for old, _ in moved})
    if missing:
        print(
            f"not dead letters of {keys.stream}: {', '.join(missing)}", file=sys.stderr
        )
        return 1
    return 0


async def _inspect(args: argparse.Namespace) -> int:
    targets = await _targets(args, args.queues)
    reports: list[dict[str, Any]] = []

    async def inspect(client: Any, target: Target) -> bool:
        inspection = await inspect_server(client, target.streams, args.group)
        if args.json:
            reports.append(inspection_to_json(inspection, node=target.where))
        else:
            _heading(target)
            print(render_inspection(inspection) + ("\n" if len(targets) > 1 else ""))
        return True

    def failed(target: Target, message: str) -> None:
        reports.append({"node": target.where, "error": message})

    if not args.json:
        return await _on_each_target(targets, inspect, "inspected")
    code = await _on_each_target(targets, inspect, None, failed)
    # The shape follows the options, not the count of nodes: see inspection.py.
    payload = {"format": FORMAT, "nodes": reports} if args.cluster else reports[0]
    print(json.dumps(payload, indent=2))
    return code


def _report(diagnosis: Diagnosis, fixing: bool) -> None:
    for finding in diagnosis.findings:
        print(f"[{finding.kind}] {finding.subject}: {finding.problem}")
        if finding.fixed:
            print(f"    fixed: {finding.outcome}")
        else:
            if finding.outcome:
                print(f"    not fixed: {finding.outcome}")
            print(f"    what to do: {finding.advice}")
    checked = (
        f"{plural(diagnosis.streams_checked, 'stream')},"
        f" {plural(diagnosis.groups_checked, 'group')} checked on"
        f" {diagnosis.server.describe()}"
    )
    open_findings = [f for f in diagnosis.findings if not f.fixed]
    fixed = len(diagnosis.findings) - len(open_findings)
    if not diagnosis.findings:
        print(f"healthy: {checked}")
    elif not open_findings:
        print(f"healthy after fixing {fixed}: {checked}")
    else:
        fixable = sum(f.fixable for f in open_findings)
        hint = f" ({fixable} fixable with --fix)" if fixable and not fixing else ""
        print(
            f"{len(open_findings)} need attention{hint}"
            f"{f', {fixed} fixed' if fixed else ''}: {checked}"
        )
    for warning in diagnosis.warnings:
        print(f"warning [{warning.kind}] {warning.subject}: {warning.problem}")
        print(f"    to keep tasks: {warning.advice}")


async def _doctor(args: argparse.Namespace) -> int:
    thresholds = Thresholds(
        consumer_idle_ms=args.consumer_idle_ms,
        max_pending=args.max_pending,
        stale_pending_ms=args.stale_pending_ms,
        lock_expiry_ms=args.lock_expiry_ms,
    )
    targets = await _targets(args, args.queues)

    async def doctor(client: Any, target: Target) -> bool:
        diagnosis = await diagnose(
            client, target.streams, args.group, thresholds, PROG, _reach(args)
        )
        if args.fix:
            await apply_fixes(client, diagnosis, thresholds)
        _heading(target)
        _report(diagnosis, args.fix)
        if len(targets) > 1:
            print()
        return diagnosis.healthy

    return await _on_each_target(targets, doctor, "healthy")


def _cli_argument(value: str) -> str:
    """One argument as redis-cli reads it: quoted when it must be."""
    if value and all(c.isprintable() and c not in " \"'\\" for c in value):
        return value
    escaped = "".join(
        c
        if c.isprintable() and c not in '"\\'
        else ("\\" + c if c in '"\\' else "".join(f"\\x{b:02x}" for b in c.encode()))
        for c in value
    )
    return f'"{escaped}"'


async def _acl(
    options: ConnectionOptions | None,
    version: str | None,
    streams: list[str],
    group: str,
    user: str,
    reload: bool,
    result_backend_prefix: str | None = None,
) -> int:
    if options is not None:
        async with connected(options) as client:
            version = await server_version(client)
    version = version or "7.2"
    try:
        rule = worker_acl_rule(
            streams,
            group,
            version,
            reload=reload,
            result_backend_prefix=result_backend_prefix,
        )
    except ValueError as error:
        raise CommandError(str(error)) from None
    results = (
        f", results under {result_backend_prefix + ':'!r}"
        if result_backend_prefix is not None
        else ""
    )
    print(
        f"# a worker of queue {streams[0]!r}, group {group!r}{results} on a"
        f" {version} server; replace CHANGE-ME with its password"
    )
    words = ["ACL", "SETUSER", user, "reset", "on", ">CHANGE-ME", *rule]
    print(" ".join(_cli_argument(word) for word in words))
    return 0


def _drill(url: str | None, rounds: int, broker: str) -> int:
    # Imported here: the drill pulls in taskiq's worker machinery.
    from taskiq_atomic_claim.harness.drill import main_drill  # noqa: PLC0415
    from taskiq_atomic_claim.harness.embedded_server import (  # noqa: PLC0415
        LocalServer,
        default_binary,
    )

    if url is not None:
        connect(ConnectionOptions(url))  # validates the URL before workers start
        report = main_drill(url, rounds, broker)
    else:
        try:
            binary = default_binary()
        except RuntimeError as error:
            raise CommandError(str(error)) from None
        print(f"no --url: starting an embedded {binary.label} on loopback")
        with LocalServer(binary) as server:
            report = main_drill(server.url, rounds, broker)
    for number, result in enumerate(report.rounds, 1):
        if result.recovered:
            print(
                f"round {number}: SIGKILLed worker's task re-run by a fresh worker"
                f" {result.kill_to_rerun_s:.2f} s after the kill"
                f" ({result.delivery_to_rerun_s:.2f} s after first delivery)"
            )
        else:
            print(f"round {number}: task NOT recovered")
    print(report.summary())
    return 0 if report.recovered == len(report.rounds) else 1


def _rounds(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 100:
        raise argparse.ArgumentTypeError(f"must be 1..100, got {value}")
    return value


def _whole_number(text: str, minimum: int, unit: str = "") -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a whole number{unit}, got {text!r}"
        ) from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
    return value


def _milliseconds(text: str) -> int:
    return _whole_number(text, 1, " of ms")


def _count(text: str) -> int:
    return _whole_number(text, 0)


def _name(option: str) -> Any:
    def check(text: str) -> str:
        try:
            return require_name(option, text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return check


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line, like every other error of the CLI."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description=(
            "Set up and check the server-side claim library used by"
            " AtomicRedisStreamBroker, or run the crash drill."
        ),
    )
    parser.add_argument("--version", action="version", version=__version__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    load = commands.add_parser(
        "load",
        help="load the library on the server (idempotent)",
        description="Load this release's claim library on the server. Safe to"
        " repeat; other releases' libraries are left in place.",
    )
    add_server_options(load)

    check = commands.add_parser(
        "check",
        help="exit 1 if the library is missing or outdated",
        description="Exit 0 when this release's library is on the server,"
        " 1 when it is missing or only other versions are, 2 on errors.",
    )
    add_server_options(check)

    def stream_options(command: argparse.ArgumentParser) -> None:
        add_server_options(command)
        command.add_argument(
            "--queue",
            type=_name("--queue"),
            default="taskiq",
            help="stream (queue_name)",
        )
        command.add_argument(
            "--group", type=_name("--group"), default="taskiq", help="consumer group"
        )

    def scope_options(command: argparse.ArgumentParser) -> None:
        add_server_options(command)
        command.add_argument(
            "--queue",
            type=_name("--queue"),
            action="append",
            dest="queues",
            metavar="QUEUE",
            help="stream to look at (repeatable); default: every stream found",
        )
        command.add_argument(
            "--group", type=_name("--group"), help="only this consumer group"
        )

    inspect = commands.add_parser(
        "inspect",
        help="show streams, groups, consumers, leases and dead letters",
        description="Show per stream and consumer group: pending entries per"
        " consumer and their idle times, the claim lease and cursor, dead"
        " letters, and the library on the server. Read-only.",
    )
    scope_options(inspect)
    inspect.add_argument(
        "--json", action="store_true", help="stable JSON (see the inspection module)"
    )

    doctor = commands.add_parser(
        "doctor",
        help="find what needs attention; --fix repairs what is safe to",
        description="Check for no-expiry taskiq-redis <= 1.1.x locks, idle"
        " empty consumers, a missing or outdated library, large or stale PELs,"
        " dead letters and streams nobody consumes. Exit 0 healthy, 1 needs"
        " attention, 2 on errors.",
    )
    scope_options(doctor)
    doctor.add_argument(
        "--fix",
        action="store_true",
        help="expire legacy locks, delete idle empty consumers, load the library",
    )
    doctor.add_argument(
        "--consumer-idle-ms",
        type=_milliseconds,
        default=DEFAULT_CONSUMER_IDLE_MS,
        help="a consumer with nothing pending idle this long is stale (default: 24 h)",
    )
    doctor.add_argument(
        "--max-pending",
        type=_count,
        default=DEFAULT_MAX_PENDING,
        help=f"PEL size that needs attention (default: {DEFAULT_MAX_PENDING})",
    )
    doctor.add_argument(
        "--stale-pending-ms",
        type=_milliseconds,
        default=DEFAULT_STALE_PENDING_MS,
        help="an entry pending this long means nobody reclaims (default: 1 h)",
    )
    doctor.add_argument(
        "--lock-expiry-ms",
        type=_milliseconds,
        default=DEFAULT_LOCK_EXPIRY_MS,
        help="expiry --fix gives legacy locks: the old workers' idle_timeout"
        f" (default: {DEFAULT_LOCK_EXPIRY_MS})",
    )

    acl = commands.add_parser(
        "acl",
        help="print the ACL SETUSER line a worker needs",
        description="Print the minimal ACL rule for a worker of these streams"
        " and group. Give --url to read the server version, or --server-version.",
    )
    acl.add_argument("--url", help="read the server version from this server")
    acl.add_argument("--server-version", help="e.g. 6.2, 7.0, 7.2 (default 7.2)")
    acl.add_argument(
        "--queue",
        type=_name("--queue"),
        action="append",
        dest="queues",
        help="queue_name, then each additional stream (repeatable; default taskiq)",
    )
    acl.add_argument(
        "--group", type=_name("--group"), default="taskiq", help="consumer group"
    )
    acl.add_argument("--user", type=_name("--user"), default="taskiq-worker")
    acl.add_argument(
        "--result-backend-prefix",
        metavar="PREFIX",
        help="also the keys and commands of taskiq-redis's RedisAsyncResultBackend"
        " with this prefix_str",
    )
    acl.add_argument(
        "--no-reload",
        action="store_true",
        help="leave out FUNCTION LOAD / SCRIPT LOAD: run `load` after every"
        " restart or flush instead",
    )

    dead = commands.add_parser(
        "dead-letters",
        help="list the entries a consumer group gave up on",
        description="List dead letters (entries delivered more than"
        " max_deliveries times, or without a data field): task name and id,"
        " the start of the arguments, reason, deliveries, and when.",
    )
    stream_options(dead)
    dead.add_argument("--count", type=_rounds, default=20, help="how many (1..100)")

    requeue = commands.add_parser(
        "requeue",
        help="put dead letters back on their stream",
        description="Re-add chosen dead letters (by id, by task name, or all)"
        " to their stream as new entries, atomically per batch.",
    )
    stream_options(requeue)
    chosen = requeue.add_mutually_exclusive_group(required=True)
    chosen.add_argument("--id", action="append", dest="ids", help="dead letter id")
    chosen.add_argument(
        "--task", metavar="NAME", help="every dead letter of this task name"
    )
    chosen.add_argument("--all", action="store_true", help="every dead letter")

    drill = commands.add_parser(
        "drill",
        help="SIGKILL a worker mid-task and time the recovery",
        description="Start real `taskiq worker` processes, SIGKILL one mid-task"
        " on an idle queue, and time until a fresh worker re-runs the task."
        " Without --url an embedded server is started on loopback.",
    )
    drill.add_argument("--url", help="server to use (default: an embedded one)")
    drill.add_argument("--rounds", type=_rounds, default=3, help="kills (1..100)")
    drill.add_argument(
        "--broker",
        choices=("atomic", "upstream"),
        default="atomic",
        help="atomic: this package; upstream: taskiq-redis's RedisStreamBroker",
    )
    return parser


ServerCommand = Callable[[argparse.Namespace], Coroutine[Any, Any, int]]
_SERVER_COMMANDS: dict[str, ServerCommand] = {
    "load": _load,
    "check": _check,
    "inspect": _inspect,
    "doctor": _doctor,
    "dead-letters": _dead_letters,
    "requeue": _requeue,
}


def _run(args: argparse.Namespace) -> int:
    if args.command == "drill":
        return _drill(args.url, args.rounds, args.broker)
    if args.command == "acl":
        options = None if args.url is None else ConnectionOptions(args.url)
        return asyncio.run(
            _acl(
                options,
                args.server_version,
                args.queues or ["taskiq"],
                args.group,
                args.user,
                not args.no_reload,
                args.result_backend_prefix,
            )
        )
    return asyncio.run(_SERVER_COMMANDS[args.command](args))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except CommandError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
    except MovedError as error:
        print(
            f"{PROG}: error: --url is a cluster node; slot {error.slot_id} is"
            f" served by {error.host}:{error.port}: add --cluster",
            file=sys.stderr,
        )
    except (RedisError, OSError) as error:
        print(f"{PROG}: error: {type(error).__name__}: {error}", file=sys.stderr)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
