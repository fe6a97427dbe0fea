"""``python -m parallel.plan``: the table of splits (see ``parallel.plan``)."""

import sys

from parallel.plan.cli import main

sys.exit(main())
