"""What every command shares: the program's name, its one-line errors and
the argument types that check a value as argparse reads it."""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from taskiq_atomic_claim.settings import require_name

PROG = "taskiq-atomic-claim"


class CommandError(Exception):
    """A failure to report as one line, without a traceback."""


class Parser(argparse.ArgumentParser):
    """Usage errors as one line, like every other error of the CLI."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def rounds(text: str) -> int:
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


def milliseconds(text: str) -> int:
    return _whole_number(text, 1, " of ms")


def count(text: str) -> int:
    return _whole_number(text, 0)


def valid_name(option: str) -> Any:
    def check(text: str) -> str:
        try:
            return require_name(option, text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return check
