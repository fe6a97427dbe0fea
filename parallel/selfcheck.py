"""``python -m parallel.selfcheck``: the installation check under any launcher (its
options and what it prints: ``parallel.verify.selfcheck``)."""

import sys

from parallel.verify.selfcheck import main

if __name__ == "__main__":
    sys.exit(main())
