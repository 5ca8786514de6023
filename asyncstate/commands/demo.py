"""`asyncstate demo`: the demo job of `asyncstate.demo`."""

from __future__ import annotations

import argparse

from asyncstate import demo

__all__ = ["register"]


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `demo` subcommand to `commands` (an argparse subparsers object)."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "demo", help="run the demo job on the heap backend and on RocksDB side by side",
        description=demo.__doc__.split("\n\n")[0] if demo.__doc__ else None)
    demo.add_arguments(parser)
    parser.set_defaults(handler=demo.run)
