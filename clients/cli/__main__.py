"""`python -m lethe.clients.cli`, as the `lethe` command (the server's replicas start so)."""

import sys

from lethe.clients.cli import main

sys.exit(main())
