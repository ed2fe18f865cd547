"""The parser, assembled from one module per command, and ``main``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from redis.exceptions import MovedError, RedisError

from taskiq_atomic_claim import __version__
from taskiq_atomic_claim.cli import (
    acl,
    dead_letters,
    doctor,
    drill,
    inspect,
    load,
    serve,
)
from taskiq_atomic_claim.cli.arguments import PROG, CommandError, Parser

# In the order --help lists them.
COMMANDS = (load, inspect, serve, doctor, acl, dead_letters, drill)


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """``prog``: how the user called it (``taskiq atomic-claim`` as a plugin)."""
    parser = Parser(
        prog=prog,
        description=(
            "Set up and check the server-side claim library used by"
            " AtomicRedisStreamBroker, or run the crash drill."
        ),
    )
    parser.add_argument("--version", action="version", version=__version__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        code: int = args.run(args)
        return code
    except CommandError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
    except MovedError as error:
        print(
            f"{prog}: error: --url is a cluster node; slot {error.slot_id} is"
            f" served by {error.host}:{error.port}: add --cluster",
            file=sys.stderr,
        )
    except (RedisError, OSError) as error:
        print(f"{prog}: error: {type(error).__name__}: {error}", file=sys.stderr)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
