"""``taskiq-atomic-claim``: what an operator runs. Set up, inspect and
repair (the data and decisions come from ``admin/``), and the crash drill
(``harness/``, imported only when it runs).

One module per command, each with ``add_parser()`` and a ``run``;
``servers.py`` is the one place ``--url``/``--cluster``/``--sentinel``
become servers and clients. No worker imports this package.
"""

from taskiq_atomic_claim.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
