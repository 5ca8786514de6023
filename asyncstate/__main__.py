"""`python -m asyncstate`: the `asyncstate` command line (see `asyncstate.cli`)."""

import sys

from asyncstate.cli import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main(prog="python -m asyncstate"))
