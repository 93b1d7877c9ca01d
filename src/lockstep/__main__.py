"""`python -m lockstep ...`: the same as the `lockstep` console script."""

from __future__ import annotations

import sys

from lockstep.cli import main

if __name__ == "__main__":
    sys.exit(main())
