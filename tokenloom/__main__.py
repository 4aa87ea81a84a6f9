"""`python -m tokenloom ...`: the same as the `tokenloom` command (tokenloom/cli.py)."""

from tokenloom.cli import entry

if __name__ == "__main__":
    entry()
