"""`asyncstate experiment backpressure [options]`: back-pressure and latency-hiding experiments.

Sweeps the keyed job over store latency, batch size, buffer timeout, max_in_flight, key
distribution and count, cache size, I/O parallelism and the offered rate of an open loop
(`asyncstate.experiments.sweep` says which arms each sweep compares). Shows progress on
stderr, prints a table on stdout, and writes results.csv, results.json and PNG figures under
``./experiment-results/<timestamp>/`` (or ``--out DIR``). Needs the ``experiments`` extra
(matplotlib, rich).

Exit status: 0 when every run completed and read its state back right; 1 otherwise, or when
the extra is missing; 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from asyncstate.cli import usage

__all__ = ["register"]

_T = TypeVar("_T")
_REFRESH_S = 0.25


def _value(text: str, convert: Callable[[str], _T], low: float | None, above: bool,
           choices: tuple[str, ...] | None) -> _T:
    """One option value: `convert(text)`, finite, at least `low` (above it when `above`),
    one of `choices`; argparse's error naming the value otherwise."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a valid value") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number")
    if low is not None:
        if above and value <= low:  # type: ignore[operator]
            raise argparse.ArgumentTypeError(f"{text} is not above {low:g}")
        if value < low:  # type: ignore[operator]
            raise argparse.ArgumentTypeError(f"{text} is below {low:g}")
    if choices is not None and value not in choices:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(choices)}")
    return value


def _one(convert: Callable[[str], _T], low: float | None = None, *,
         above: bool = False) -> Callable[[str], _T]:
    def parse(text: str) -> _T:
        return _value(text.strip(), convert, low, above, None)
    return parse


def _list_of(convert: Callable[[str], _T], low: float | None = None,
             choices: tuple[str, ...] | None = None) -> Callable[[str], tuple[_T, ...]]:
    def parse(text: str) -> tuple[_T, ...]:
        values = [_value(part, convert, low, False, choices)
                  for part in (p.strip() for p in text.split(",")) if part]
        if not values:
            raise argparse.ArgumentTypeError("give at least one value")
        return tuple(values)
    return parse


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `experiment` subcommand (with its `backpressure` experiment) to `commands`."""
    experiment = commands.add_parser(
        "experiment", help="back-pressure and latency experiments with tables and plots",
        description="Experiments on a simulated remote (disaggregated) state store.")
    experiment.set_defaults(handler=lambda _args: usage(experiment))
    kinds = experiment.add_subparsers(title="experiments", metavar="EXPERIMENT")
    parser = kinds.add_parser(
        "backpressure", help="sweep latency, batching, in-flight limit, keys, cache, input",
        description=(__doc__ or "").split("\n\n")[1],
        epilog="Lists are comma-separated; the first value of each is its base, the value "
               "the other sweeps hold it at. docs/experiments.md explains every knob.")
    parser.set_defaults(handler=_run)
    add = parser.add_argument
    add("--quick", action="store_true",
        help="a small grid of short runs, under a minute (options below still apply)")
    add("--out", type=Path, default=None,
        help="directory for results.csv, results.json and the PNGs "
             "(default ./experiment-results/<timestamp>)")
    add("--seconds", type=_one(float, 0, above=True), default=None,
        help="time bound of each run (default 3, --quick 0.8)")
    add("--workload", choices=("counter", "list", "map"), default="counter",
        help="counter: value read then write; list: append; map: get then put")
    add("--latency-ms", type=_list_of(float, 0), default=None,
        help="store latency per call (default 1.5,0,0.2,5,23)")
    add("--latency-p99-ms", type=_one(float, 0, above=True), default=None,
        help="draw latencies lognormally with this p99 (median: --latency-ms)")
    add("--batch-size", type=_list_of(int, 1), default=None, help="default 1000,100,3000")
    add("--buffer-timeout-ms", type=_list_of(int, 0), default=None,
        help="default 1000,1,5,20,100 (the sweep runs open loop at the base --rate)")
    add("--max-in-flight", type=_list_of(int, 1), default=None,
        help="default 6000,100,300,1000,3000,12000")
    add("--io-parallelism", type=_list_of(int, 1), default=None, help="default 2,1,4")
    add("--keys", type=_list_of(int, 1), default=None, help="default 100000,1000,1000000")
    add("--distribution", type=_list_of(str, choices=("uniform", "zipf")), default=None,
        help="default uniform,zipf")
    add("--zipf-theta", type=_one(float, 0), default=0.99,
        help="Zipf exponent, at least 0 (0: uniform; default 0.99)")
    add("--cache-entries", type=_list_of(int, 0), default=None,
        help="cache size of the +cache arms; 0: 1%% of keys, at least 10,000 "
             "(default 0,1000,100000)")
    add("--cache-write-back", action="store_true",
        help="the +cache arms' cache writes back: value writes stay in it until evicted or "
             "drained (default: write-through)")
    add("--rate", type=_list_of(float, 1), default=None,
        help="offered records/s of open-loop runs (default 20000,5000,50000,100000,200000)")
    add("--open-buffer-timeout-ms", type=_one(int, 0), default=None,
        help="buffer timeout of the open-loop rate sweep (default 5)")
    add("--no-rocksdb", action="store_true", help="leave out the RocksDB arms")
    add("--sample-every", type=_one(int, 1), default=8,
        help="time every n-th record (every record when max_in_flight <= 64; default 8)")
    add("--seed", type=int, default=1, help="seed of keys and latencies (default 1)")


def _grid(args: argparse.Namespace) -> Any:
    from asyncstate.experiments.sweep import QUICK, STANDARD
    grid = QUICK if args.quick else STANDARD
    changes: dict[str, Any] = {"workload": args.workload, "zipf_theta": args.zipf_theta,
                               "rocksdb": not args.no_rocksdb,
                               "sample_every": args.sample_every, "seed": args.seed,
                               "latency_p99_ms": args.latency_p99_ms,
                               "cache_write_back": args.cache_write_back}
    for name in ("latency_ms", "batch_size", "buffer_timeout_ms", "max_in_flight",
                 "io_parallelism", "keys", "distribution", "cache_entries", "rate",
                 "seconds", "open_buffer_timeout_ms"):
        value = getattr(args, name)
        if value is not None:
            changes[name] = value
    return dataclasses.replace(grid, **changes)


def _run(args: argparse.Namespace) -> int:
    from asyncstate.experiments.plots import missing_extra
    problem = missing_extra()
    if problem is not None:
        print(f"asyncstate experiment: {problem}", file=sys.stderr)
        return 1
    grid = _grid(args)
    if grid.latency_p99_ms is not None and any(
            0 < lat > grid.latency_p99_ms for lat in grid.latency_ms):
        print("asyncstate experiment: --latency-p99-ms must be at least every --latency-ms",
              file=sys.stderr)
        return 2
    try:
        out, created = _make_out(args.out)
    except OSError as exc:
        print(f"asyncstate experiment: cannot write results to {exc.filename}: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return 2
    try:
        return _sweep(args, grid, out)
    except BaseException:
        if created and not any(out.iterdir()):
            out.rmdir()  # nothing written: leave no empty directory behind
        raise


def _make_out(out: Path | None) -> tuple[Path, bool]:
    """The results directory, ready to write into, and whether it was created now: `out`,
    or ./experiment-results/<timestamp> (with -2, -3, ... when a run started in the same
    second took that name). OSError (its filename set) when it cannot be written."""
    if out is not None:
        existed = out.is_dir()
        if out.exists() and not existed:
            raise OSError(errno.ENOTDIR, "it exists and is not a directory", str(out))
        out.mkdir(parents=True, exist_ok=True)
        if not os.access(out, os.W_OK | os.X_OK):
            raise OSError(errno.EACCES, "permission denied", str(out))
        return out, not existed
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1, 1000):
        candidate = Path("experiment-results") / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            candidate.mkdir(parents=True)
        except FileExistsError:
            continue
        return candidate, True
    raise OSError(errno.EEXIST, "too many runs started in this second", stamp)


def _sweep(args: argparse.Namespace, grid: Any, out: Path) -> int:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from asyncstate.experiments import report
    from asyncstate.experiments.plots import FIGURES, write_plots
    from asyncstate.experiments.sweep import plan, run_grid

    runs = plan(grid)
    err = Console(stderr=True)
    err.print(f"[bold]asyncstate experiment backpressure[/]: {len(runs)} runs of at most "
              f"{grid.seconds:g} s ({args.workload}), results in {out}")
    progress = Progress(TextColumn("{task.description:<58}"), BarColumn(),
                        MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.fields[live]}"), console=err, auto_refresh=False)
    task = progress.add_task("starting", total=len(runs), live="")
    last = [0.0]

    def starting(i: int, item: Any) -> None:
        p = item.point
        where = f"{p.latency_ms:g} ms" + ("" if p.rate is None else f", {p.rate:,.0f}/s open")
        label = ", ".join(f"{s}={v}" for s, v in item.sweeps[:1])
        progress.update(task, completed=i, description=f"{item.arm} @ {where} [{label}]",
                        live="", refresh=True)

    def live(fed: int, seconds: float) -> None:
        now = time.perf_counter()
        if now - last[0] >= _REFRESH_S:
            last[0] = now
            rate = fed / seconds if seconds > 0 else 0.0
            progress.update(task, live=f"{fed:,} rec, {rate:,.0f} rec/s", refresh=True)

    with progress:
        run_grid(grid, runs, starting=starting, progress=live)
        progress.update(task, completed=len(runs), description="done", live="", refresh=True)
    # Into a file or a pipe, the table takes its natural width: nothing is cut to fit.
    out_console = Console(width=max(Console().width, 400)) if not sys.stdout.isatty() \
        else Console()
    out_console.print(report.table(runs))
    command = " ".join(["asyncstate", *sys.argv[1:]]) if sys.argv else "asyncstate"
    report.write_csv(out / "results.csv", runs)
    report.write_json(out / "results.json", grid, runs, report.environment(command))
    figures = write_plots(out, runs)
    for name in set(FIGURES) - {path.name for path in figures}:
        (out / name).unlink(missing_ok=True)  # an earlier run's, in the same --out
    err.print(f"wrote {out / 'results.csv'}, {out / 'results.json'} and "
              f"{len(figures)} figures in {out}")
    failed = [r for r in runs if r.error is not None
              or (r.result is not None and r.result.answer_ok is False)]
    for r in failed:
        why = r.error if r.error is not None else r.result.answer_detail  # type: ignore[union-attr]
        err.print(f"[red]{r.arm} at {r.sweeps[0][0]}={r.sweeps[0][1]}: {why}[/]")
    return 1 if failed else 0
