"""The `asyncstate` command line: the console script `asyncstate`, and `python -m asyncstate`.

Subcommands::

    asyncstate demo [options]              the demo job (asyncstate.demo)
    asyncstate checkpoint inspect PATH     what a checkpoint holds, checked before a restore
    asyncstate experiment backpressure     back-pressure experiments: table, CSV, JSON, PNGs

Each subcommand lives in its own module of `asyncstate.commands`, listed in
`SUBCOMMAND_MODULES`. A module adds its parser in `register(commands)` with
``commands.add_parser(name, help=..., description=...)`` and sets the function that runs it
with ``parser.set_defaults(handler=fn)``, where ``fn(args) -> int`` returns the exit status.
Adding a subcommand is one more such module and one more line in `SUBCOMMAND_MODULES`.

Conventions: results on stdout, progress and errors on stderr; exit status 0 for success,
1 when the command ran and found a problem, 2 for bad usage (argparse's own). A closed
stdout (``asyncstate ... | head``) ends the command quietly with status 141, as a Unix tool
ended by SIGPIPE; Ctrl-C ends it with status 130.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable

__all__ = ["SUBCOMMAND_MODULES", "build_parser", "main", "run_command"]

SUBCOMMAND_MODULES: tuple[str, ...] = (
    "asyncstate.commands.demo",
    "asyncstate.commands.checkpoint",
    "asyncstate.commands.experiment",
)

EXIT_BROKEN_PIPE = 128 + 13  # what a shell reports for a process ended by SIGPIPE
EXIT_INTERRUPTED = 128 + 2  # SIGINT

Handler = Callable[[argparse.Namespace], int]


def build_parser(prog: str = "asyncstate") -> argparse.ArgumentParser:
    """The parser of the `asyncstate` command, with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog=prog, description="asyncstate: asynchronous keyed state for Python.")
    parser.set_defaults(handler=None)
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(commands)
    return parser


def usage(parser: argparse.ArgumentParser) -> int:
    """The handler of a command given without its subcommand: its help, exit status 2."""
    parser.print_help(sys.stderr)
    return 2


def _silence_stdout() -> None:
    # Later writes, and the flush at interpreter exit, go nowhere instead of raising
    # BrokenPipeError again (the recipe of Python's signal module documentation).
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def run_command(handler: Handler, args: argparse.Namespace) -> int:
    """Run `handler(args)` and return its exit status, ending quietly when the reader of
    stdout goes away or the user presses Ctrl-C."""
    try:
        status = handler(args)
        sys.stdout.flush()  # a closed pipe must show up here, not at interpreter exit
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    return status


def main(argv: list[str] | None = None, prog: str = "asyncstate") -> int:
    """Parse `argv` (default: the process arguments) and run the subcommand; its exit
    status."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    handler: Handler | None = args.handler
    if handler is None:
        return usage(parser)
    return run_command(handler, args)
