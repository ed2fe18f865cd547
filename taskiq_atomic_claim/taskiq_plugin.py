"""``taskiq atomic-claim COMMAND``: this package's CLI as a taskiq CLI plugin.

taskiq's own CLI finds subcommands in the ``taskiq_cli`` entry-point group
(see pyproject.toml) and hands each the arguments after its name.
"""

from __future__ import annotations

from collections.abc import Sequence

from taskiq.abc.cmd import TaskiqCMD

from taskiq_atomic_claim.cli import main


class AtomicClaimCMD(TaskiqCMD):
    """The commands of ``taskiq-atomic-claim``, under ``taskiq atomic-claim``."""

    short_help = "set up, inspect and repair atomic claim; the crash drill"

    def exec(self, args: Sequence[str]) -> int:
        return main(args, prog="taskiq atomic-claim")
