import sys

from taskiq_atomic_claim.cli.main import main

sys.exit(main())
