"""``drill``: SIGKILL a worker mid-task and time the recovery."""

from __future__ import annotations

import argparse
from typing import Any

from taskiq_atomic_claim.cli.arguments import CommandError, rounds
from taskiq_atomic_claim.cli.servers import ConnectionOptions, connect


def add_parser(commands: Any) -> None:
    drill = commands.add_parser(
        "drill",
        help="SIGKILL a worker mid-task and time the recovery",
        description="Start real `taskiq worker` processes, SIGKILL one mid-task"
        " on an idle queue, and time until a fresh worker re-runs the task."
        " Without --url an embedded server is started on loopback.",
    )
    drill.add_argument("--url", help="server to use (default: an embedded one)")
    drill.add_argument("--rounds", type=rounds, default=3, help="kills (1..100)")
    drill.add_argument(
        "--broker",
        choices=("atomic", "upstream"),
        default="atomic",
        help="atomic: this package; upstream: taskiq-redis's RedisStreamBroker",
    )
    drill.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    return _drill(args.url, args.rounds, args.broker)


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
