"""Turning ``--url``/``--cluster``/``--sentinel`` into servers: the one place
clients are made.

``targets`` resolves the options into the servers a command acts on (the
``--url`` server, the master the sentinels name, or every primary of a
cluster); ``connected`` makes a client of one of them and checks it is a
Redis or Valkey server.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.sentinel import Sentinel
from redis.exceptions import (
    AuthenticationError,
    RedisClusterException,
    RedisError,
    ResponseError,
)

from taskiq_atomic_claim.admin.inspection_json import FORMAT
from taskiq_atomic_claim.cli.arguments import CommandError, valid_name
from taskiq_atomic_claim.clients import ScriptClient
from taskiq_atomic_claim.keys import StreamKeys
from taskiq_atomic_claim.server_errors import is_permission_denied, login_problem

_SCHEMES = ("redis", "rediss", "unix")

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
        # From the environment, a password stays off command lines (and ps).
        url = args.url or os.environ.get("REDIS_URL") or None
        if url is None:
            if not args.sentinel:
                raise CommandError(
                    "--url (or REDIS_URL) is required (for Sentinel: --sentinel"
                    " HOST:PORT --master NAME)"
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
        help="redis://, rediss:// (TLS) or unix:// URL (default: $REDIS_URL);"
        " with --cluster any node; with --sentinel optional, its scheme and"
        " credentials reach the master",
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


def add_stream_options(command: argparse.ArgumentParser) -> None:
    """The server options and one stream and group (dead letters, requeue)."""
    add_server_options(command)
    command.add_argument(
        "--queue",
        type=valid_name("--queue"),
        default="taskiq",
        help="stream (queue_name)",
    )
    command.add_argument(
        "--group", type=valid_name("--group"), default="taskiq", help="consumer group"
    )


def add_scope_options(command: argparse.ArgumentParser) -> None:
    """The server options and which streams and group to look at (inspect,
    doctor)."""
    add_server_options(command)
    command.add_argument(
        "--queue",
        type=valid_name("--queue"),
        action="append",
        dest="queues",
        metavar="QUEUE",
        help="stream to look at (repeatable); default: every stream found",
    )
    command.add_argument(
        "--group", type=valid_name("--group"), help="only this consumer group"
    )


def connect(options: ConnectionOptions) -> Any:
    """The client for ``options``: the one place clients are made.

    Always a client of one server: with --cluster or --sentinel,
    ``targets`` first finds which servers (primaries, the master) to reach.
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
        try:
            await _require_redis(client, _address(options.url))
        except AuthenticationError as error:
            raise CommandError(_refused_login(options.url, error)) from None
        yield client


def _refused_login(url: str, error: AuthenticationError) -> str:
    """One line for a refused login, not the server's text about HELLO."""
    parts = urlsplit(url)
    has_password = parts.password is not None
    problem = login_problem(
        error, _address(url), has_password, parts.username or "default"
    )
    if has_password:
        return problem
    return f"{problem}, in REDIS_URL to keep it off the command line"


def _address(url: str) -> str:
    """host:port of ``url``, without credentials."""
    return urlsplit(url).netloc.rpartition("@")[2]


async def _require_redis(client: ScriptClient, where: str) -> None:
    try:
        info = await client.execute_command("INFO", "server")
    except ResponseError as error:
        if not is_permission_denied(error):
            raise
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


async def resolve_targets(
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
    sentinel = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]  # typed from redis 8.2
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


def _not_a_cluster_node(options: ConnectionOptions) -> NotRedisError:
    return NotRedisError(
        f"{_address(options.url)} speaks RESP but did not answer"
        " CLUSTER SLOTS as a Redis or Valkey cluster node does"
    )


async def _cluster_primaries(
    options: ConnectionOptions, streams: list[str] | None
) -> list[Target]:
    tls = _tls_arguments(options)
    try:
        startup = RedisCluster.from_url(
            options.url, socket_connect_timeout=5, socket_timeout=10, **tls
        )
    except RedisClusterException as error:  # e.g. a URL without a host
        # Its message goes on to explain the constructor: the first line says it.
        first_line = str(error).splitlines()[0]
        raise CommandError(f"bad --url {options.url!r}: {first_line}") from None
    try:
        await startup.initialize()
        primaries = startup.get_primaries()
        # A named stream lives on the primary serving its slot, nowhere else.
        owners = [startup.get_node_from_key(stream) for stream in streams or ()]
    except RedisClusterException as error:  # not a RedisError
        if not isinstance(error.__cause__, _UNPARSABLE):
            raise CommandError(f"--cluster: {error}") from None
        # redis-py wraps a reply it could not parse (in the handshake, say).
        raise _not_a_cluster_node(options) from None
    except AuthenticationError as error:
        raise CommandError(_refused_login(options.url, error)) from None
    except _UNPARSABLE:
        raise _not_a_cluster_node(options) from None
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


async def on_each_target(
    targets: list[Target],
    action: Callable[[Redis, Target], Awaitable[bool]],
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


async def print_json(
    args: argparse.Namespace,
    targets: list[Target],
    report: Callable[[Redis, Target], Awaitable[tuple[dict[str, Any], bool]]],
) -> int:
    """Print each target's JSON ``report`` (and whether it was fine) in the
    envelope of admin/inspection_json.py: with --cluster one per primary
    under "nodes" (the options decide the shape, not the count of nodes)."""
    reports: list[dict[str, Any]] = []

    async def one(client: Redis, target: Target) -> bool:
        payload, fine = await report(client, target)
        reports.append(payload)
        return fine

    def failed(target: Target, message: str) -> None:
        reports.append({"node": target.where, "error": message})

    code = await on_each_target(targets, one, None, failed)
    payload = {"format": FORMAT, "nodes": reports} if args.cluster else reports[0]
    print(json.dumps(payload, indent=2))
    return code


def reach(args: argparse.Namespace) -> str:
    """The connection options of a command, as advice should spell them."""
    if args.sentinel:
        return "--sentinel HOST:PORT --master NAME"
    return "--cluster --url URL" if args.cluster else "--url URL"


def heading(target: Target) -> None:
    if target.label is not None:
        print(f"== {target.label} ==")


async def server_of(args: argparse.Namespace, keys: StreamKeys) -> Target:
    """The one server holding ``keys.stream`` (on a cluster, its primary)."""
    (target,) = [t for t in await resolve_targets(args, [keys.stream]) if t.streams]
    return target
