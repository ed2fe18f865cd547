"""``serve``: the live page of one server, its JSON and its gauges, over
HTTP (``taskiq_atomic_claim.web``; the ``web`` extra)."""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

from taskiq_atomic_claim.cli.arguments import CommandError, milliseconds
from taskiq_atomic_claim.cli.servers import (
    add_scope_options,
    connected,
    resolve_targets,
)
from taskiq_atomic_claim.settings import DEFAULT_IDLE_TIMEOUT_MS

TOKEN_VARIABLE = "TASKIQ_ATOMIC_CLAIM_TOKEN"  # noqa: S105 (a name, not a token)


def add_parser(commands: Any) -> None:
    serve = commands.add_parser(
        "serve",
        help="a live web page of streams, groups, consumers and dead letters",
        description="Serve a page that shows one server live (what inspect"
        " shows, refreshed in place), its JSON at /api/state and Prometheus"
        " gauges at /metrics. Read-only unless --allow-changes. Needs the web"
        " extra: pip install 'taskiq-atomic-claim[web]'.",
    )
    add_scope_options(serve)
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only)",
    )
    serve.add_argument("--port", type=int, default=8765, help="default 8765")
    serve.add_argument(
        "--refresh",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="read the server at most this often, whoever asks (default 2)",
    )
    serve.add_argument(
        "--consumers",
        type=int,
        default=200,
        metavar="N",
        help="list at most N consumers per group: those holding most (default 200)",
    )
    serve.add_argument(
        "--idle-timeout-ms",
        type=milliseconds,
        default=DEFAULT_IDLE_TIMEOUT_MS,
        help="the workers' idle_timeout: what the diagnosis measures overdue"
        f" entries and dead consumers against (default: {DEFAULT_IDLE_TIMEOUT_MS})",
    )
    serve.add_argument(
        "--sample",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="sample the server this often for the page's history of the last"
        " hour (default 10)",
    )
    serve.add_argument(
        "--allow-changes",
        action="store_true",
        help=f"allow requeue and delete of dead letters, by POSTs carrying the"
        f" token in ${TOKEN_VARIABLE} (at least 16 characters)",
    )
    serve.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn  # noqa: PLC0415

        from taskiq_atomic_claim.web import create_app  # noqa: PLC0415
    except ImportError as error:
        raise CommandError(
            f"serve needs the web extra ({error.name} is missing):"
            " pip install 'taskiq-atomic-claim[web]'"
        ) from None
    token = None
    if args.allow_changes:
        token = os.environ.get(TOKEN_VARIABLE)
        if not token or len(token) < 16:
            raise CommandError(
                f"--allow-changes needs ${TOKEN_VARIABLE} set to a token of at"
                " least 16 characters"
            )
    if not args.sample > 0 or not args.refresh > 0:
        raise CommandError("--sample and --refresh must be > 0 seconds")
    if args.cluster:
        raise CommandError(
            "serve shows one server: run one per primary, each with --url"
        )

    async def serve() -> None:
        (target,) = await resolve_targets(args, args.queues)
        async with connected(target.options) as client:
            app = create_app(
                client,
                streams=target.streams,
                group=args.group,
                refresh_s=args.refresh,
                consumer_limit=args.consumers,
                token=token,
                node=target.where,
                idle_timeout_ms=args.idle_timeout_ms,
                sample_s=args.sample,
            )
            app.state.reader.sample()  # history from the start, not first view
            config = uvicorn.Config(
                app, host=args.host, port=args.port, log_level="warning"
            )
            print(f"serving {target.where} at http://{args.host}:{args.port}/")
            await uvicorn.Server(config).serve()

    asyncio.run(serve())
    return 0
