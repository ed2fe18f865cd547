"""``python -m benchmarks``: run the suite (see ``benchmarks.cli``)."""

from benchmarks.cli import main

raise SystemExit(main())
