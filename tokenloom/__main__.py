"""`python -m tokenloom ...`: the same as the `tokenloom` command (tokenloom/cli.py)."""

import sys

from tokenloom.cli import main

if __name__ == "__main__":
    sys.exit(main())
