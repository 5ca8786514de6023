"""Benchmarks of asyncstate: `python scripts/bench.py SCENARIO [--quick]`.

docs/performance.md describes the scenarios and their goals. Each scenario is one
function registered with `@scenario(...)`; it runs its arms (time-bounded, best of several
runs), checks every arm's answer, prints one rich table whose key column is a ratio measured
in the same run, and writes the raw figures to `bench-results/<scenario>-<timestamp>.json`.

Exit status: 0 when every arm ran and computed the right answer (goal misses are reported in
the table and the JSON, not in the status: they depend on the machine), 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import gc
import heapq
import importlib.metadata
import json
import logging
import math
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import msgpack
import rocksdict
import structlog
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import asyncstate as ast
from asyncstate import _compiled
from asyncstate.experiments import keys as key_streams
from asyncstate.experiments.arms import ARMS, Point
from asyncstate.experiments.driver import run as run_point
from asyncstate.keygroups import KeyGroupRange, key_group_of_bytes
from asyncstate.runtime import gc_threshold
from asyncstate.serde import NONE_BYTES, canonical_key
from asyncstate.timers.batch import BatchExecutionPriorityQueueSet
from asyncstate.timers.heap_set import HeapPriorityQueueSet
from asyncstate.timers.partitioned import KeyGroupPartitionedPriorityQueue
from asyncstate.timers.rocksdb_set import DEFAULT_CACHE_SIZE, RocksDBPriorityQueueSet
from asyncstate.timers.timer import InternalTimer

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench-results"
CHUNK = 10_000  # records fed between two deadline checks (and progress refreshes)
PROGRESS_EVERY_S = 0.5  # rendering from inside a timed arm at most this often


# -- the scenario registry ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    summary: str
    run: Callable[[Bench], dict[str, Any]]


SCENARIOS: dict[str, Scenario] = {}


def scenario(name: str, summary: str) -> Callable[[Callable[[Bench], dict[str, Any]]],
                                                  Callable[[Bench], dict[str, Any]]]:
    """Register a scenario: a function of a Bench returning its JSON-ready result (with an
    `"ok"` field: every arm ran and checked its answer)."""
    def register(fn: Callable[[Bench], dict[str, Any]]) -> Callable[[Bench], dict[str, Any]]:
        if name in SCENARIOS:
            raise ValueError(f"scenario {name!r} is registered twice")
        SCENARIOS[name] = Scenario(name, summary, fn)
        return fn
    return register


# -- what every scenario shares -------------------------------------------------------------

class Bench:
    """The parsed command line, the console, the loop factory and the progress display."""

    def __init__(self, args: argparse.Namespace, console: Console) -> None:
        self.args = args
        self.console = console
        self.quick: bool = args.quick
        self.loop_name: str = args.loop
        self.loop_factory = _loop_factory(args.loop)
        self.progress: Progress | None = None
        self._task: Any = None
        self._last_refresh = 0.0

    def config(self, **fields: Any) -> ast.AsyncStateConfig:
        """The AsyncStateConfig of asyncstate arms: `fields`, then `--gc-threshold` and
        `--max-in-flight` if given."""
        if self.args.gc_threshold != "default":
            fields["gc_threshold"] = self.args.gc_threshold
        if self.args.max_in_flight is not None:
            fields["max_in_flight"] = self.args.max_in_flight
        return ast.AsyncStateConfig(**fields)

    def sizes(self) -> tuple[int, int, int, float]:
        """(records, keys, repeats, seconds per run) of a time-bounded scenario: the command
        line's, else 1 M records (200 K with --quick) over a tenth as many keys, best of 3
        runs (1) of at most 30 s (10) each."""
        args = self.args
        records = args.records or (200_000 if self.quick else 1_000_000)
        return (records, args.keys or (records // 10), args.repeats or (1 if self.quick else 3),
                args.max_seconds or (10.0 if self.quick else 30.0))

    def environment(self) -> dict[str, Any]:
        """Interpreter, loop and machine, as printed above each table and stored in JSON."""
        env: dict[str, Any] = {
            "python": platform.python_version(),
            "implementation": platform.python_implementation(),
            "loop": self.loop_name,
            "asyncstate": ast.__version__,
            "cores": os.cpu_count(),
            "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count(),
            "machine": platform.machine(),
            "platform": platform.platform(),
            "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg")
            else None,
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "asyncstate_modules": _compiled.mode(),  # compiled, or the Python sources
            "gc_threshold_default": ast.AsyncStateConfig().gc_threshold,
            "gc_threshold_default_resolved": ast.AsyncStateConfig().resolved_gc_threshold(),
        }
        if self.loop_name == "uvloop":
            env["uvloop"] = importlib.metadata.version("uvloop")
        return env

    def describe_environment(self) -> str:
        env = self.environment()
        loop = env["loop"] + (f" {env['uvloop']}" if "uvloop" in env else "")
        load = env["load_average_at_start"]
        return (f"{env['implementation']} {env['python']}, loop {loop}, asyncstate "
                f"{env['asyncstate_modules']}, "
                f"{env['cores_usable']} of {env['cores']} cores usable, {env['machine']}"
                + (f", load average {load[0]:.2f}" if load else ""))

    def run_async(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run `coro` on a fresh event loop of the chosen kind."""
        with asyncio.Runner(loop_factory=self.loop_factory) as runner:
            return runner.run(coro)

    # Progress: one bar per scenario counting records over all runs. Rendering happens
    # outside timed code except from `tick`, which renders at most every PROGRESS_EVERY_S
    # (auto-refresh is off: a refresh thread would take the GIL during timed runs).
    def start_progress(self, total: int) -> None:
        self.progress = Progress(
            TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), console=self.console, auto_refresh=False, transient=True)
        self.progress.start()
        self._task = self.progress.add_task("starting", total=total)

    def stop_progress(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def describe(self, text: str) -> None:
        if self.progress is not None:
            self.progress.update(self._task, description=text, refresh=True)

    def tick(self, records: int) -> None:
        """Count `records` done; render if the display is stale."""
        progress = self.progress
        if progress is None:
            return
        progress.advance(self._task, records)
        now = time.perf_counter()
        if now - self._last_refresh >= PROGRESS_EVERY_S:
            self._last_refresh = now
            progress.refresh()


def _loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop]:
    if name == "asyncio":
        return asyncio.new_event_loop
    try:
        import uvloop
    except ImportError:
        sys.exit("--loop uvloop needs uvloop installed (pip install uvloop), "
                 "or run with --loop asyncio")
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


@dataclasses.dataclass
class RunResult:
    """One timed run of one arm."""

    records: int  # records processed (fewer than offered when the time bound hit)
    seconds: float
    bounded: bool  # stopped by the time bound
    answer_ok: bool
    answer_detail: str
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.records / self.seconds if self.seconds > 0 else 0.0


def best_of(runs: Sequence[RunResult]) -> RunResult | None:
    """The fastest run with a right answer, if any."""
    good = [r for r in runs if r.answer_ok]
    return max(good, key=lambda r: r.rate) if good else None


def check_counts(got: dict[Any, int], expected: Counter[Any]) -> tuple[bool, str]:
    """Compare final counts per key; a short description of the first differences."""
    if got == expected:
        return True, f"{len(expected)} keys, {sum(expected.values())} records: counts match"
    missing = [k for k in expected if k not in got]
    extra = [k for k in got if k not in expected]
    wrong = [k for k in expected if k in got and got[k] != expected[k]]
    parts = []
    if missing:
        parts.append(f"{len(missing)} keys missing (e.g. {missing[0]!r})")
    if extra:
        parts.append(f"{len(extra)} unexpected keys (e.g. {extra[0]!r})")
    if wrong:
        k = wrong[0]
        parts.append(f"{len(wrong)} keys wrong (e.g. {k!r}: got {got[k]}, want {expected[k]})")
    return False, "; ".join(parts)


def write_results(name: str, result: dict[str, Any]) -> Path:
    """Write `result` to bench-results/<name>-<timestamp>.json and return the path."""
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2, sort_keys=False, default=str) + "\n")
    return path


def fmt_rate(rate: float) -> str:
    if rate >= 1e6:
        return f"{rate / 1e6:.2f} M"
    if rate >= 1e4:
        return f"{rate / 1e3:.0f} K"
    if rate >= 1e3:
        return f"{rate / 1e3:.1f} K"
    return f"{rate:.0f}"


def run_rounds(bench: Bench, arms: dict[str, Callable[[float], RunResult]], *, repeats: int,
               max_seconds: float, records: int) -> tuple[dict[str, list[RunResult]],
                                                          dict[str, str]]:
    """Run every arm `repeats` times, each run bounded by `max_seconds`.

    An arm is a function of the run's deadline (a `time.perf_counter()` value) that processes
    up to `records` records, calling `bench.tick` as it goes. Runs go in rounds over all arms
    (so a slow spell of the machine spreads over the arms instead of hitting one), after one
    untimed warm-up run per arm of a single chunk. Returns the runs of each arm and the
    traceback of each arm that crashed (it is not run again).
    """
    runs: dict[str, list[RunResult]] = {name: [] for name in arms}
    errors: dict[str, str] = {}
    warmup = min(CHUNK, records)
    bench.start_progress(total=len(arms) * (warmup + repeats * records))
    try:
        for round_no in range(-1, repeats):
            expected = warmup if round_no < 0 else records
            for name, run in arms.items():
                if name in errors:
                    bench.tick(expected)
                    continue
                bench.describe(f"{name} " + (f"({round_no + 1}/{repeats})" if round_no >= 0
                                             else "(warm-up)"))
                gc.collect()
                # A deadline already past stops the warm-up after its first chunk.
                deadline = time.perf_counter() + (max_seconds if round_no >= 0 else 0.0)
                try:
                    result = run(deadline)
                except Exception:  # noqa: BLE001 - report the arm as crashed, keep the others
                    errors[name] = traceback.format_exc()
                    bench.tick(expected)
                    continue
                bench.tick(expected - result.records)
                if round_no >= 0:
                    runs[name].append(result)
    finally:
        bench.stop_progress()
    return runs, errors


def ratio_table(bench: Bench, title: str, names: Sequence[str],
                runs: dict[str, list[RunResult]], errors: dict[str, str], *, reference: str,
                reference_word: str, goals: dict[str, float], unit: str,
                bounded_unit: str, rate_goals: dict[str, float] | None = None
                ) -> tuple[bool, dict[str, Any]]:
    """Print one table of the arms `names`: best rate, ratio to the arm `reference`, goal
    (a minimum ratio, from `goals`, or a minimum rate, from `rate_goals`) and result, then
    the traceback of each crashed arm. Returns whether every arm ran and answered right, and
    each arm's JSON figures."""
    rate_goals = rate_goals or {}
    ref = best_of(runs[reference])
    table = Table(title=title)
    for column, justify in (("arm", "left"), (f"{unit}/s", "right"),
                            (f"ratio to {reference_word}", "right"), ("goal", "right"),
                            ("result", "left")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    arms_json: dict[str, Any] = {}
    all_ok = True
    for name in names:
        best = best_of(runs[name])
        goal = goals.get(name)
        rate_goal = rate_goals.get(name)
        ratio = best.rate / ref.rate if best is not None and ref is not None else None
        wrong = [r for r in runs[name] if not r.answer_ok]
        if name in errors:
            result_text, passed = "[red]ERROR (traceback below)[/]", False
        elif wrong:
            result_text, passed = f"[red]WRONG ANSWER: {wrong[0].answer_detail}[/]", False
        elif rate_goal is not None and best is not None:
            passed = best.rate >= rate_goal
            result_text = "[green]pass[/]" if passed else "[red]FAIL[/]"
        elif goal is None:
            result_text, passed = "answer ok", None
        elif ratio is None:
            result_text, passed = f"[yellow]no {reference_word} figure to compare[/]", None
        else:
            passed = ratio >= goal
            result_text = "[green]pass[/]" if passed else "[red]FAIL[/]"
        if name in errors or wrong:
            all_ok = False
        if best is not None and best.bounded:
            result_text += f" (time-bounded: {best.records:,} {bounded_unit})"
        table.add_row(
            name, fmt_rate(best.rate) if best is not None else "-",
            f"{ratio:.2f}x" if ratio is not None else "-",
            f">= {goal:.2f}x" if goal is not None else
            f">= {fmt_rate(rate_goal)}/s" if rate_goal is not None else
            ("reference" if name == reference else "-"),
            result_text)
        arms_json[name] = {
            f"best_{unit}_per_s": best.rate if best is not None else None,
            f"ratio_to_{reference_word}": ratio, f"goal_ratio_to_{reference_word}": goal,
            f"goal_{unit}_per_s": rate_goal,
            "goal_passed": passed, "error": errors.get(name),
            "runs": [dataclasses.asdict(r) | {f"{unit}_per_s": r.rate} for r in runs[name]],
        }
    bench.console.print(table)
    print_errors(bench, errors)
    return all_ok, arms_json


# -- asyncstate through its public operator API ------------------------------------------

async def run_operator(bench: Bench, function: ast.KeyedProcessFunction,
                       backend: Any, records: Sequence[Any], deadline: float, *,
                       config: ast.AsyncStateConfig | None = None,
                       after: Callable[[ast.KeyedOperator, int], Coroutine[Any, Any, Any]]
                       | None = None) -> tuple[int, float, dict[str, Any], Any]:
    """Feed `records` to a KeyedOperator (as `ast.run` does, but through the public
    `process`), stopping at the first chunk boundary past `deadline`, then drain.

    Returns (records fed, seconds from the first record to the end of the drain, the
    operator's metrics after the drain, the cyclic GC's work in the timed part
    (`gc_collections` per generation, `gc_seconds`) and the CPU time it took
    (`loop_cpu_seconds`: the event loop's thread; `process_cpu_seconds`: every thread, the
    backend's and RocksDB's included), what `after(op, records fed)` returned). `after` runs
    untimed inside the same operator, e.g. to read the final state back.
    """
    op = ast.KeyedOperator(function, key_selector=_identity, backend=backend, config=config)
    async with op:
        with GCWatch() as collector:
            started = time.perf_counter()
            loop_cpu, process_cpu = time.thread_time(), time.process_time()
            fed = await feed(bench, op, records, deadline)
            seconds = time.perf_counter() - started
            cpu = {"loop_cpu_seconds": time.thread_time() - loop_cpu,
                   "process_cpu_seconds": time.process_time() - process_cpu}
        metrics = dict(op.metrics) | collector.figures() | cpu
        extra = await after(op, fed) if after is not None else None
    return fed, seconds, metrics, extra


class GCWatch:
    """Counts and times the cyclic GC's collections while the `with` block runs."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.seconds = 0.0
        self._began = 0.0

    def __enter__(self) -> GCWatch:
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc_info: object) -> None:
        gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.collections[info["generation"]] += 1
            self.seconds += time.perf_counter() - self._began

    def figures(self) -> dict[str, Any]:
        return {"gc_collections": list(self.collections), "gc_seconds": self.seconds}


async def feed(bench: Bench, op: ast.KeyedOperator, records: Sequence[Any],
               deadline: float = float("inf")) -> int:
    """Feed `records` to the open operator `op`, stopping at the first chunk boundary past
    `deadline`, then drain; returns the records fed."""
    process = op.process
    fed = 0
    n = len(records)
    tick = bench.tick
    clock = time.perf_counter
    while fed < n:
        for record in records[fed:fed + CHUNK]:
            await process(record)
        done = min(n, fed + CHUNK) - fed
        fed += done
        tick(done)
        if clock() >= deadline:
            break
    await op.drain()
    return fed


def _identity(record: Any) -> Any:
    return record


# -- overhead: keyed counter, no latency ------------------------------------------------------

# The lean pipeline (BENCHMARKS.md): the floor for any design with a future per state
# request in pure CPython. A minimal future, two per record (read, then write, chained with
# closures as in the callback style), requests resolved by a flush every 1000 requests; no
# per-key ordering, no reference counting, no contexts. Without ordering, two reads of one key
# inside one flush would lose an update: the key order below never repeats a key that soon.

LEAN_FLUSH_EVERY = 1000
PlainResult = tuple[int, float, dict[Any, Any]]  # records fed, seconds, final counts
_READ = object()


class LeanFuture:
    __slots__ = ("value", "done", "callbacks")

    def __init__(self) -> None:
        self.done = False
        self.callbacks: list[Callable[[Any], Any]] | None = None

    def then(self, fn: Callable[[Any], Any]) -> None:
        if self.done:
            fn(self.value)
        elif self.callbacks is None:
            self.callbacks = [fn]
        else:
            self.callbacks.append(fn)

    def complete(self, value: Any) -> None:
        self.value = value
        self.done = True
        if self.callbacks is not None:
            for fn in self.callbacks:
                fn(value)


class LeanStore:
    def __init__(self) -> None:
        self.data: dict[Any, Any] = {}
        self.pending: list[tuple[LeanFuture, Any, Any]] = []

    def get(self, key: Any) -> LeanFuture:
        fut = LeanFuture()
        self.pending.append((fut, key, _READ))
        return fut

    def put(self, key: Any, value: Any) -> LeanFuture:
        fut = LeanFuture()
        self.pending.append((fut, key, value))
        return fut

    def flush(self) -> None:
        # Requests issued by callbacks during the flush go to the next one.
        batch = self.pending[:]
        self.pending.clear()
        data = self.data
        for fut, key, value in batch:
            if value is _READ:
                fut.complete(data.get(key))
            else:
                data[key] = value
                fut.complete(None)


def lean_counter(bench: Bench, keys: Sequence[Any], deadline: float) -> PlainResult:
    store = LeanStore()
    get, put, flush, pending = store.get, store.put, store.flush, store.pending

    def process(key: Any) -> None:
        get(key).then(lambda v: put(key, (v or 0) + 1))

    fed, n, clock = 0, len(keys), time.perf_counter
    started = clock()
    while fed < n:
        for key in keys[fed:fed + CHUNK]:
            process(key)
            if len(pending) >= LEAN_FLUSH_EVERY:
                flush()
        done = min(n, fed + CHUNK) - fed
        fed += done
        bench.tick(done)
        if clock() >= deadline:
            break
    while pending:
        flush()
    return fed, clock() - started, store.data


def dict_counter(bench: Bench, keys: Sequence[Any], deadline: float) -> PlainResult:
    counts: dict[Any, int] = {}
    get = counts.get
    fed, n, clock = 0, len(keys), time.perf_counter
    started = clock()
    while fed < n:
        for key in keys[fed:fed + CHUNK]:
            counts[key] = get(key, 0) + 1
        done = min(n, fed + CHUNK) - fed
        fed += done
        bench.tick(done)
        if clock() >= deadline:
            break
    return fed, clock() - started, counts


# asyncstate counters. Each record is its key. After the timed part the same operator reads
# every key back (`probing`), so the check covers the state the backend holds; the flag costs
# one attribute test per record and keeps emits and list appends out of the timed part.

class CallbackCounter(ast.KeyedProcessFunction):
    probing = False

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

    def process_element(self, value: Any, ctx: ast.RecordContext) -> Any:
        if self.probing:
            return self.count.value().then_accept(lambda v: ctx.emit((value, v)))
        return self.count.value().then_compose(lambda v: self.count.update((v or 0) + 1))


class AsyncCounter(ast.KeyedProcessFunction):
    probing = False

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

    async def process_element(self, value: Any, ctx: ast.RecordContext) -> None:
        if self.probing:
            ctx.emit((value, await self.count.value()))
            return
        await self.count.update((await self.count.value() or 0) + 1)


def _probe(function: CallbackCounter | AsyncCounter, keys: Sequence[Any],
           choose: Callable[[int], Sequence[Any]] | None = None
           ) -> Callable[[ast.KeyedOperator, int], Coroutine[Any, Any, Any]]:
    """Read back the count of every key among the first `fed` records, or of the distinct
    keys `choose(fed)` returns; keys without a count are left out of the result."""
    async def probe(op: ast.KeyedOperator, fed: int) -> dict[Any, Any]:
        op.outputs()
        function.probing = True
        distinct = list(dict.fromkeys(keys[:fed] if choose is None else choose(fed)))
        for key in distinct:
            await op.process(key)
        await op.drain()
        outputs = op.outputs()
        if len(outputs) != len(distinct):
            raise AssertionError(f"the probe read {len(distinct)} keys back but got "
                                 f"{len(outputs)} outputs")
        return {k: v for k, v in outputs if v is not None}
    return probe


def overhead_keys(n_records: int, n_keys: int, seed: int) -> list[int]:
    """Keys 0..n_keys-1 in a seeded shuffled order, repeated round-robin: each key comes
    back exactly every n_keys records, so none repeats inside the lean pipeline's flush
    window (it has no per-key ordering), and a prefix of the stream has known counts."""
    order = list(range(n_keys))
    random.Random(seed).shuffle(order)
    return [order[i % n_keys] for i in range(n_records)]


OVERHEAD_GOALS = {  # arm -> minimum ratio to the lean pipeline
    "heap, callback": 1.0,
    "heap, async def": 0.8,
    "batched, callback": 0.35,
    "batched, async def": 0.35,
}


@scenario("overhead", "keyed counter, no latency: asyncstate vs the lean pipeline")
def overhead(bench: Bench) -> dict[str, Any]:
    args = bench.args
    n_records, n_keys, repeats, max_seconds = bench.sizes()
    if n_keys < LEAN_FLUSH_EVERY:
        sys.exit(f"--keys must be >= {LEAN_FLUSH_EVERY}, got {n_keys}: the lean pipeline has "
                 f"no per-key ordering, so a key repeating inside one flush of "
                 f"{LEAN_FLUSH_EVERY} requests would lose updates")
    if n_records < n_keys:
        sys.exit(f"--records ({n_records}) must be >= --keys ({n_keys})")
    keys = overhead_keys(n_records, n_keys, seed=args.seed)

    def asyncstate_arm(make_function: type[CallbackCounter] | type[AsyncCounter],
                       batched: bool) -> Callable[[float], RunResult]:
        def run(deadline: float) -> RunResult:
            function = make_function()
            backend: Any = ast.HeapBackend()
            if batched:
                backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0)
            fed, seconds, metrics, counts = bench.run_async(run_operator(
                bench, function, backend, keys, deadline, config=bench.config(),
                after=_probe(function, keys)))
            ok, detail = check_counts(counts, Counter(keys[:fed]))
            if batched and not metrics["batches"] > 0:
                ok, detail = False, f"metrics['batches'] == {metrics['batches']}: not batched"
            return RunResult(fed, seconds, fed < n_records, ok, detail, metrics)
        return run

    def plain_arm(fn: Callable[[Bench, Sequence[Any], float], PlainResult]
                  ) -> Callable[[float], RunResult]:
        def run(deadline: float) -> RunResult:
            fed, seconds, counts = fn(bench, keys, deadline)
            ok, detail = check_counts(counts, Counter(keys[:fed]))
            return RunResult(fed, seconds, fed < n_records, ok, detail)
        return run

    arms: dict[str, Callable[[float], RunResult]] = {
        "plain dict loop": plain_arm(dict_counter),
        "lean pipeline": plain_arm(lean_counter),
        "heap, callback": asyncstate_arm(CallbackCounter, batched=False),
        "heap, async def": asyncstate_arm(AsyncCounter, batched=False),
        "batched, callback": asyncstate_arm(CallbackCounter, batched=True),
        "batched, async def": asyncstate_arm(AsyncCounter, batched=True),
    }
    params = {"records": n_records, "keys": n_keys, "repeats": repeats,
              "max_seconds_per_run": max_seconds, "seed": args.seed,
              "key_order": "seeded shuffle of the keys, repeated round-robin",
              "lean_flush_every": LEAN_FLUSH_EVERY,
              "batched_backend": "SimulatedRemoteBackend(HeapBackend(), latency_ms=0)",
              "config": dataclasses.asdict(bench.config())}
    bench.console.print(f"[bold]overhead[/]: keyed counter, {n_records:,} records over "
                        f"{n_keys:,} keys, best of {repeats}, at most {max_seconds:g} s per run")
    bench.console.print(bench.describe_environment())

    runs, errors = run_rounds(bench, arms, repeats=repeats, max_seconds=max_seconds,
                              records=n_records)
    all_ok, arms_json = ratio_table(
        bench, f"overhead: keyed counter, {n_records:,} records / {n_keys:,} keys "
               f"(best of {repeats})", list(arms), runs, errors, reference="lean pipeline",
        reference_word="lean", goals=OVERHEAD_GOALS, unit="records", bounded_unit="rec")
    return {"scenario": "overhead", "ok": all_ok, "params": params,
            "environment": bench.environment(), "arms": arms_json}


# -- rocksdb: the keyed counter on RocksDB ---------------------------------------------------

ROCKSDB_UNBATCHED = "rocksdb, batch 1"
ROCKSDB_BATCHED = "rocksdb, batch 1000"
ROCKSDB_HEAP = "heap"
# The batched request path alone: the heap behind SimulatedRemoteBackend with no latency, so
# every request goes through a batch as on RocksDB, but storage costs what the heap costs.
ROCKSDB_HEAP_BATCHED = "heap via batches"
ROCKSDB_GOALS = {ROCKSDB_UNBATCHED: 1.5, ROCKSDB_HEAP: 0.5}  # batched arm: minimum ratio to each
ROCKSDB_IO_PARALLELISM = 2  # the default, stated
# BENCHMARKS.md wants the state larger than the memtable. 1 M counter entries take ~35 MiB of
# memtable (rocksdb.cur-size-all-mem-tables), which the default 64 MiB write buffer holds
# whole: no SST file before close, every read a memtable hit. A 4 MiB buffer makes the state
# ~9x the memtable, so reads and compactions reach SST files, as they would at scale.
ROCKSDB_WRITE_BUFFER_BYTES = 4 * 2**20
ROCKSDB_BATCH_SIZE = 1000
# Records in flight: one full batch per I/O thread. A multi-get of 1,000 keys takes ~1-2 ms
# here, so that keeps both I/O threads and the loop busy; records beyond it only wait
# longer, and their objects go cold in the CPU caches meanwhile (docs/concepts.md, "Pacing
# by the store"). With the config's default, 6,000, the operator's pacing admits up to
# (io_parallelism + 1) * batch_size records' requests; run it here with `--max-in-flight 6000`.
ROCKSDB_MAX_IN_FLIGHT = ROCKSDB_IO_PARALLELISM * ROCKSDB_BATCH_SIZE
PROBE_PRESENT = 20_000  # keys read back after a run: among the keys fed ...
PROBE_ABSENT = 1_000  # ... and keys no record had (they must hold no state)


def sample_chooser(keys: Sequence[int], n_keys: int, seed: int, present: int, absent: int
                   ) -> Callable[[int], list[int]]:
    """`choose(fed)`: up to `present` distinct keys among the first `fed` records and `absent`
    keys no record had (those of the next records not fed yet, then keys >= n_keys), in a
    seeded shuffled order. Deterministic: the check calls it again to know what was read."""
    def choose(fed: int) -> list[int]:
        rng = random.Random(seed)
        fed_keys = list(dict.fromkeys(keys[:fed]))
        chosen = rng.sample(fed_keys, min(present, len(fed_keys)))
        seen = set(fed_keys)
        never = [k for k in dict.fromkeys(keys[fed:fed + absent]) if k not in seen]
        never += range(n_keys, n_keys + absent - len(never))
        chosen += never
        rng.shuffle(chosen)
        return chosen
    return choose


def sst_files(directory: str | os.PathLike[str]) -> tuple[int, int]:
    """(count, bytes) of the SST files under `directory`."""
    sizes = [p.stat().st_size for p in Path(directory).rglob("*.sst")]
    return len(sizes), sum(sizes)


def tree_bytes(directory: str | os.PathLike[str]) -> int:
    """Bytes of the files under `directory`."""
    return sum(p.stat().st_size for p in Path(directory).rglob("*") if p.is_file())


def inplace_field(args: argparse.Namespace) -> dict[str, bool]:
    """RocksDBOptions' `inplace_updates` as `--inplace-updates` sets it (none: the option's
    default)."""
    return {} if args.inplace_updates is None else {"inplace_updates": args.inplace_updates == "on"}


def _ratio_text(ratio: float | None) -> str:
    return f"{ratio:.2f}x" if ratio is not None else "-"


@scenario("rocksdb", "keyed counter on RocksDB: batch_size 1000 vs batch_size 1 vs heap")
def rocksdb(bench: Bench) -> dict[str, Any]:
    args = bench.args
    n_records = args.records or (100_000 if bench.quick else 1_000_000)
    n_keys = args.keys or n_records
    repeats = args.repeats or (1 if bench.quick else 3)
    max_seconds = args.max_seconds or (10.0 if bench.quick else 30.0)
    if n_records < n_keys:
        sys.exit(f"--records ({n_records}) must be >= --keys ({n_keys})")
    keys = overhead_keys(n_records, n_keys, seed=args.seed)
    choose = sample_chooser(keys, n_keys, args.seed, PROBE_PRESENT, PROBE_ABSENT)
    option_fields: dict[str, Any] = {
        "write_buffer_bytes": args.write_buffer_bytes or ROCKSDB_WRITE_BUFFER_BYTES}
    if args.memtable_bloom_ratio is not None:  # otherwise the option's default
        option_fields["memtable_bloom_ratio"] = args.memtable_bloom_ratio
    option_fields |= inplace_field(args)
    try:
        rocksdb_options = ast.RocksDBOptions(**option_fields)
    except ast.ConfigError as exc:
        sys.exit(f"bench.py rocksdb: {exc}")

    def arm_config(batch_size: int) -> ast.AsyncStateConfig:
        return bench.config(batch_size=batch_size, max_in_flight=ROCKSDB_MAX_IN_FLIGHT)

    def arm(batch_size: int, on_rocksdb: bool, batched_heap: bool = False, *,
            keys: list[int] = keys, choose: Callable[[int], list[int]] = choose,
            cache_entries: int = 0, cache_write_back: bool = False,
            ) -> Callable[[float], RunResult]:
        config = arm_config(batch_size)
        n_records = len(keys)

        def run(deadline: float) -> RunResult:
            function = CallbackCounter()
            probe = _probe(function, keys, choose)
            disk: dict[str, Any] = {}
            with tempfile.TemporaryDirectory(prefix="asyncstate-bench-rocksdb-") as tmp:
                backend: Any = ast.HeapBackend()
                if batched_heap:
                    backend = ast.SimulatedRemoteBackend(backend, latency_ms=0)
                if on_rocksdb:
                    backend = ast.RocksDBBackend(Path(tmp) / "db", options=rocksdb_options,
                                                 io_parallelism=ROCKSDB_IO_PARALLELISM,
                                                 cache_entries=cache_entries,
                                                 cache_write_back=cache_write_back)

                async def after(op: ast.KeyedOperator, fed: int) -> Any:
                    if on_rocksdb:  # SST files before close: the memtable was flushed
                        disk["sst_files_before_close"], disk["sst_bytes_before_close"] = \
                            sst_files(backend.path)
                    return await probe(op, fed)

                fed, seconds, metrics, counts = bench.run_async(run_operator(
                    bench, function, backend, keys, deadline, config=config, after=after))
                if on_rocksdb:
                    disk["db_bytes_after_close"] = tree_bytes(backend.path)
            sample = set(choose(fed))
            ok, detail = check_counts(counts, Counter(k for k in keys[:fed] if k in sample))
            if ok:
                detail = f"{len(sample)} keys read back of {len(set(keys[:fed]))}: " + detail
            batches, requests = metrics["batches"], metrics["requests"]
            batched = on_rocksdb or batched_heap
            if batched and not 0 < metrics["max_batch_size"] <= batch_size:
                ok, detail = False, (f"metrics['max_batch_size'] == {metrics['max_batch_size']}"
                                     f", want 1..{batch_size}")
            elif batched and batch_size > 1 and not requests > 2 * batches:
                ok, detail = False, (f"{requests} requests in {batches} batches: hardly "
                                     f"batched")
            metrics |= disk
            metrics["mean_batch_size"] = requests / batches if batches else None
            return RunResult(fed, seconds, fed < n_records, ok, detail, metrics)
        return run

    if args.cache_keys:
        return rocksdb_cache_table(bench, arm, records=n_records, repeats=repeats,
                                   max_seconds=max_seconds, options=rocksdb_options)

    arms: dict[str, Callable[[float], RunResult]] = {
        ROCKSDB_UNBATCHED: arm(1, on_rocksdb=True),
        ROCKSDB_BATCHED: arm(ROCKSDB_BATCH_SIZE, on_rocksdb=True),
        ROCKSDB_HEAP: arm(ROCKSDB_BATCH_SIZE, on_rocksdb=False),
        ROCKSDB_HEAP_BATCHED: arm(ROCKSDB_BATCH_SIZE, on_rocksdb=False, batched_heap=True),
    }
    params = {"records": n_records, "keys": n_keys, "repeats": repeats,
              "max_seconds_per_run": max_seconds, "seed": args.seed,
              "key_order": "seeded shuffle of the keys, repeated round-robin",
              "function": "CallbackCounter (ValueState read-modify-write, callback style)",
              "probe": f"{PROBE_PRESENT} keys fed + {PROBE_ABSENT} keys never fed, read back "
                       f"through the operator after the drain",
              "rocksdb": {"io_parallelism": ROCKSDB_IO_PARALLELISM,
                          "options": dataclasses.asdict(rocksdb_options),
                          "directory": "a fresh tempfile.TemporaryDirectory per run"},
              "config": {name: dataclasses.asdict(arm_config(b))
                         for name, b in ((ROCKSDB_UNBATCHED, 1),
                                         (ROCKSDB_BATCHED, ROCKSDB_BATCH_SIZE),
                                         (ROCKSDB_HEAP, ROCKSDB_BATCH_SIZE),
                                         (ROCKSDB_HEAP_BATCHED, ROCKSDB_BATCH_SIZE))},
              "heap_via_batches": "SimulatedRemoteBackend(HeapBackend(), latency_ms=0): the "
                                  "batched request path with heap storage (no goal)"}
    in_flight = arm_config(ROCKSDB_BATCH_SIZE).max_in_flight
    bench.console.print(f"[bold]rocksdb[/]: keyed counter, {n_records:,} records over "
                        f"{n_keys:,} keys, max_in_flight {in_flight:,}, best of {repeats}, "
                        f"at most {max_seconds:g} s per run")
    bench.console.print(bench.describe_environment())

    runs, errors = run_rounds(bench, arms, repeats=repeats, max_seconds=max_seconds,
                              records=n_records)
    best = {name: best_of(runs[name]) for name in arms}
    table = Table(title=f"rocksdb: keyed counter, {n_records:,} records / {n_keys:,} keys "
                        f"(best of {repeats})")
    for column, justify in (("arm", "left"), ("records/s", "right"),
                            ("vs batch 1", "right"), ("vs heap", "right"),
                            ("goal", "left"), ("result", "left")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    arms_json: dict[str, Any] = {}
    all_ok = True
    for name in arms:
        mine = best[name]
        ratios = {other: mine.rate / best[other].rate  # type: ignore[union-attr]
                  if mine is not None and best[other] is not None else None
                  for other in (ROCKSDB_UNBATCHED, ROCKSDB_HEAP)}
        goals = ROCKSDB_GOALS if name == ROCKSDB_BATCHED else {}
        wrong = [r for r in runs[name] if not r.answer_ok]
        passed: bool | None = None
        if name in errors:
            result_text = "[red]ERROR (traceback below)[/]"
        elif wrong:
            result_text = f"[red]WRONG ANSWER: {wrong[0].answer_detail}[/]"
        elif not goals:
            result_text = "answer ok"
        elif any(ratios[other] is None for other in goals):
            result_text = "[yellow]no figure to compare with[/]"
        else:
            missed = [other for other, goal in goals.items()
                      if ratios[other] < goal]  # type: ignore[operator]
            passed = not missed
            result_text = "[green]pass[/]" if passed else \
                "[red]FAIL[/] (" + ", ".join(f"vs {m}" for m in missed) + ")"
        if name in errors or wrong:
            all_ok = False
        if mine is not None and mine.bounded:
            result_text += f" (time-bounded: {mine.records:,} rec)"
        table.add_row(
            name, fmt_rate(mine.rate) if mine is not None else "-",
            _ratio_text(ratios[ROCKSDB_UNBATCHED]), _ratio_text(ratios[ROCKSDB_HEAP]),
            " / ".join(f">= {goal:g}x" for goal in goals.values()) or "-",
            result_text)
        arms_json[name] = {
            "best_records_per_s": mine.rate if mine is not None else None,
            "ratio_to_batch_size_1": ratios[ROCKSDB_UNBATCHED],
            "ratio_to_heap": ratios[ROCKSDB_HEAP],
            "goal_ratio_to_batch_size_1": goals.get(ROCKSDB_UNBATCHED),
            "goal_ratio_to_heap": goals.get(ROCKSDB_HEAP),
            "goal_passed": passed,
            "error": errors.get(name),
            "runs": [dataclasses.asdict(r) | {"records_per_s": r.rate} for r in runs[name]],
        }
    batched = best[ROCKSDB_BATCHED]
    if batched is not None and "sst_files_before_close" in batched.metrics:
        m = batched.metrics
        table.caption = (f"{ROCKSDB_BATCHED}, best run: {m['sst_bytes_before_close'] / 1e6:.1f}"
                         f" MB in {m['sst_files_before_close']} SST files before close, "
                         f"{m['db_bytes_after_close'] / 1e6:.1f} MB on disk after; write "
                         f"buffer {rocksdb_options.write_buffer_bytes / 2**20:g} MiB, "
                         f"memtable bloom ratio {rocksdb_options.memtable_bloom_ratio:g}, "
                         f"in-place updates {'on' if rocksdb_options.inplace_updates else 'off'}; "
                         f"mean batch {m['mean_batch_size']:.0f} requests")
    bench.console.print(table)
    print_errors(bench, errors)
    return {"scenario": "rocksdb", "ok": all_ok, "params": params,
            "environment": bench.environment(), "arms": arms_json}


# The state cache in front of RocksDB, by number of keys: with few, hot keys every record
# of a key waits for the previous one's two round trips; a cache of 1 % of the keys (at
# least 10,000 entries) answers the reads.
ROCKSDB_CACHE_GOAL = 0.6  # rocksdb + cache: minimum ratio to the heap at the same keys
ROCKSDB_CACHE_MIN_ENTRIES = 10_000
ROCKSDB_CACHE_KEYS = (100, 1_000, 1_000_000)
ROCKSDB_CACHE_KEYS_QUICK = (100, 1_000, 100_000)


def cache_entries_for(n_keys: int) -> int:
    """The cache of the goal: 1 % of the keys or 10,000 entries, whichever is larger."""
    return max(n_keys // 100, ROCKSDB_CACHE_MIN_ENTRIES)


def rocksdict_floor_arm(bench: Bench, keys: Sequence[int], choose: Callable[[int], list[int]],
                        options: ast.RocksDBOptions) -> Callable[[float], RunResult]:
    """The storage work of the keyed counter on RocksDB, with nothing of asyncstate: per
    `ROCKSDB_BATCH_SIZE` records, one multi-get of their distinct keys and one WriteBatch of
    their new counts, on one thread, into a fresh database with `options` and the value
    state's column family options. Keys are laid out as `RocksDBBackend` lays them out
    (key group, key bytes, namespace bytes) and encoded before the clock starts. Reports
    the seconds spent in the multi-gets (`read_seconds`) and in building and applying the
    WriteBatches (`write_seconds`). Both of the latter hold the GIL (`Rdict.write` does not
    release it), so the writes stay on the thread that runs the records whatever the
    design."""
    max_parallelism = ast.AsyncStateConfig().max_parallelism
    n_records = len(keys)

    def storage_key(key: int) -> bytes:
        raw = canonical_key(key)
        return key_group_of_bytes(raw, max_parallelism).to_bytes(2, "big") + raw + NONE_BYTES

    def run(deadline: float) -> RunResult:
        encoded = {key: storage_key(key) for key in set(keys)}
        stream = [encoded[key] for key in keys]
        packb, unpackb = msgpack.Packer(use_bin_type=True).pack, msgpack.unpackb
        clock = time.perf_counter
        read_seconds = write_seconds = 0.0
        with tempfile.TemporaryDirectory(prefix="asyncstate-bench-rocksdict-") as tmp:
            db_options, write_options = options.to_rocksdict()
            db = rocksdict.Rdict(str(Path(tmp) / "db"), db_options)
            cf: Any = None
            handle: Any = None
            try:
                cf = db.create_column_family("state:count", options.family_options(True))
                handle = db.get_column_family_handle("state:count")
                fed = 0
                started = clock()
                while fed < n_records:
                    end = min(n_records, fed + CHUNK)
                    for start in range(fed, end, ROCKSDB_BATCH_SIZE):
                        batch = stream[start:min(end, start + ROCKSDB_BATCH_SIZE)]
                        distinct = list(dict.fromkeys(batch))
                        t0 = clock()
                        stored: list[bytes | None] = cf.get(distinct)
                        t1 = clock()
                        counts = {k: 0 if v is None else unpackb(v)
                                  for k, v in zip(distinct, stored, strict=True)}
                        for k in batch:
                            counts[k] += 1
                        t2 = clock()
                        wb = rocksdict.WriteBatch(raw_mode=True)
                        for k, count in counts.items():
                            wb.put(k, packb(count), handle)
                        db.write(wb, write_options)
                        read_seconds += t1 - t0
                        write_seconds += clock() - t2
                    bench.tick(end - fed)
                    fed = end
                    if clock() >= deadline:
                        break
                seconds = clock() - started
                sample = choose(fed)
                values: list[bytes | None] = cf.get(
                    [encoded.get(k) or storage_key(k) for k in sample])
                counts_read = {k: unpackb(v) for k, v in zip(sample, values, strict=True)
                               if v is not None}
            finally:
                # Column family objects keep the database's files open after close().
                cf = handle = None
                db.close()
        wanted = set(sample)
        ok, detail = check_counts(counts_read, Counter(k for k in keys[:fed] if k in wanted))
        return RunResult(fed, seconds, fed < n_records, ok, detail,
                         {"read_seconds": read_seconds, "write_seconds": write_seconds})
    return run


def rocksdb_cache_table(bench: Bench, arm: Callable[..., Callable[[float], RunResult]], *,
                        records: int, repeats: int, max_seconds: float,
                        options: ast.RocksDBOptions) -> dict[str, Any]:
    """`bench.py rocksdb --cache-keys 100,1000,1000000`: per number of keys, the heap, RocksDB
    and RocksDB behind the state cache, in one run; the cache arms' goal is a ratio to the
    heap at the same number of keys."""
    args = bench.args
    counts = args.cache_keys
    arms: dict[str, Callable[[float], RunResult]] = {}
    labels: dict[int, tuple[str, str, str, str]] = {}
    floors: dict[int, tuple[str, str]] = {}
    for n_keys in counts:
        n_records = max(records, n_keys)
        keys = overhead_keys(n_records, n_keys, seed=args.seed)
        choose = sample_chooser(keys, n_keys, args.seed, PROBE_PRESENT, PROBE_ABSENT)
        heap, plain, cached, back = (f"heap, {n_keys:,} keys", f"rocksdb, {n_keys:,} keys",
                                     f"rocksdb + cache, {n_keys:,} keys",
                                     f"rocksdb + write-back cache, {n_keys:,} keys")
        labels[n_keys] = (heap, plain, cached, back)
        arms[heap] = arm(ROCKSDB_BATCH_SIZE, on_rocksdb=False, keys=keys, choose=choose)
        arms[plain] = arm(ROCKSDB_BATCH_SIZE, on_rocksdb=True, keys=keys, choose=choose)
        arms[cached] = arm(ROCKSDB_BATCH_SIZE, on_rocksdb=True, keys=keys, choose=choose,
                           cache_entries=cache_entries_for(n_keys))
        arms[back] = arm(ROCKSDB_BATCH_SIZE, on_rocksdb=True, keys=keys, choose=choose,
                         cache_entries=cache_entries_for(n_keys), cache_write_back=True)
        floors[n_keys] = (f"rocksdict alone, {n_keys:,} keys",
                          f"heap via batches, {n_keys:,} keys")
        arms[floors[n_keys][0]] = rocksdict_floor_arm(bench, keys, choose, options)
        arms[floors[n_keys][1]] = arm(ROCKSDB_BATCH_SIZE, on_rocksdb=False, batched_heap=True,
                                      keys=keys, choose=choose)
    bench.console.print(f"[bold]rocksdb, state cache[/]: keyed counter, {records:,} records "
                        f"(or one per key) over {', '.join(f'{n:,}' for n in counts)} keys, "
                        f"batch {ROCKSDB_BATCH_SIZE}, max_in_flight {ROCKSDB_MAX_IN_FLIGHT:,}, "
                        f"best of {repeats}, at most {max_seconds:g} s per run")
    bench.console.print(bench.describe_environment())
    runs, errors = run_rounds(bench, arms, repeats=repeats, max_seconds=max_seconds,
                              records=max(records, *counts))
    table = Table(title=f"rocksdb with the state cache (1 % of keys, at least "
                        f"{ROCKSDB_CACHE_MIN_ENTRIES:,} entries), best of {repeats}")
    for column, justify in (("keys", "right"), ("heap rec/s", "right"),
                            ("rocksdb rec/s", "right"), ("vs heap", "right"),
                            ("+ cache rec/s", "right"), ("vs heap", "right"),
                            ("+ write-back rec/s", "right"), ("vs heap", "right"),
                            ("hit rate", "right"), ("goal", "left"), ("result", "left")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    arms_json: dict[str, Any] = {}
    all_ok = not errors
    for n_keys, names in labels.items():
        best = [best_of(runs[name]) for name in names]
        wrong = [r for name in names for r in runs[name] if not r.answer_ok]
        all_ok = all_ok and not wrong
        heap = best[0]
        ratios = [b.rate / heap.rate if b is not None and heap is not None else None
                  for b in best]
        cached, back = best[2], best[3]
        hit_rate = cached.metrics.get("cache_hit_rate") if cached is not None else None
        cache_ratios = [r for r in ratios[2:] if r is not None]
        passed = max(cache_ratios) >= ROCKSDB_CACHE_GOAL if cache_ratios and not wrong \
            else None
        crashed = [name for name in names if name in errors]
        result = ("[red]ERROR (traceback below)[/]" if crashed else
                  f"[red]WRONG ANSWER: {wrong[0].answer_detail}[/]" if wrong else
                  "[green]pass[/]" if passed else "[red]FAIL[/]" if passed is False else "-")
        table.add_row(f"{n_keys:,}", *(fmt_rate(b.rate) if b is not None else "-"
                                       for b in best[:2]),
                      _ratio_text(ratios[1]),
                      fmt_rate(cached.rate) if cached is not None else "-",
                      _ratio_text(ratios[2]),
                      fmt_rate(back.rate) if back is not None else "-",
                      _ratio_text(ratios[3]),
                      f"{hit_rate:.1%}" if hit_rate is not None else "-",
                      f">= {ROCKSDB_CACHE_GOAL:g}x", result)
        arms_json[str(n_keys)] = {
            "cache_entries": cache_entries_for(n_keys),
            "ratio_rocksdb_to_heap": ratios[1], "ratio_cached_to_heap": ratios[2],
            "ratio_write_back_to_heap": ratios[3],
            "goal_ratio_cached_to_heap": ROCKSDB_CACHE_GOAL, "goal_passed": passed,
            "cache_hit_rate": hit_rate,
            "arms": {name: {"best_records_per_s": b.rate if b is not None else None,
                            "error": errors.get(name),
                            "runs": [dataclasses.asdict(r) | {"records_per_s": r.rate}
                                     for r in runs[name]]}
                     for name, b in zip(names, best, strict=True)}}
    bench.console.print(table)
    floor_json = rocksdict_floor_table(bench, runs, errors, labels, floors)
    all_ok = all_ok and all(r.answer_ok for names in floors.values() for name in names
                            for r in runs[name])
    print_errors(bench, errors)
    return {"scenario": "rocksdb-cache", "ok": all_ok, "rocksdict_alone": floor_json,
            "params": {"records": records, "keys": list(counts), "repeats": repeats,
                       "max_seconds_per_run": max_seconds, "seed": args.seed,
                       "batch_size": ROCKSDB_BATCH_SIZE,
                       "max_in_flight": ROCKSDB_MAX_IN_FLIGHT,
                       "cache_entries": {str(n): cache_entries_for(n) for n in counts}},
            "environment": bench.environment(), "arms": arms_json}


def rocksdict_floor_table(bench: Bench, runs: dict[str, list[RunResult]], errors: dict[str, str],
                          labels: dict[int, tuple[str, str, str, str]],
                          floors: dict[int, tuple[str, str]]) -> dict[str, Any]:
    """What rocksdict itself allows, per number of keys: the storage work alone, and two
    bounds on the ratio to the heap when every record reads and writes the store. A record
    on RocksDB does what it does on the heap (ordering, futures, the function) and its share
    of the WriteBatches, both on the thread that runs the records, since rocksdict holds the
    GIL while it writes. It must also read: on that thread (bound: the heap's time, the
    multi-gets' and the writes'), or on other threads with each request's future completed
    later (bound: the batched request path's time, measured on the heap through batches at
    no latency, plus the writes'). The first bound is rocksdict's; the second also holds
    asyncstate's batched path as it is. Both include the heap stand-ins' own work (the
    heap's dict operations, the simulated backend's bookkeeping), which RocksDB does not
    do, so a design can pass them by about that much."""
    table = Table(title="what rocksdict allows: the storage work alone, one thread, in "
                        f"batches of {ROCKSDB_BATCH_SIZE} records")
    for column in ("keys", "heap rec/s", "rocksdict alone rec/s", "reads us/rec",
                   "writes us/rec", "heap via batches rec/s", "bound: reads on the thread",
                   "bound: batched reads", "bound", "rocksdb arms' best"):
        table.add_column(column, justify="right")
    out: dict[str, Any] = {}
    for n_keys, (name, batched_name) in floors.items():
        heap, floor, batched = (best_of(runs[labels[n_keys][0]]), best_of(runs[name]),
                                best_of(runs[batched_name]))
        wrong = [r for n in (name, batched_name) for r in runs[n] if not r.answer_ok]
        crashed = name in errors or batched_name in errors
        if heap is None or floor is None or batched is None or wrong or crashed:
            detail = ("ERROR (traceback below)" if crashed else
                      f"WRONG ANSWER: {wrong[0].answer_detail}" if wrong else "no figure")
            table.add_row(f"{n_keys:,}", "-", f"[red]{detail}[/]", *("-",) * 7)
            out[str(n_keys)] = {"error": errors.get(name) or errors.get(batched_name),
                                "detail": detail}
            continue
        reads = floor.metrics["read_seconds"] / floor.records
        writes = floor.metrics["write_seconds"] / floor.records
        per_heap = 1 / heap.rate
        on_thread = per_heap / (per_heap + writes + reads)
        via_batches = per_heap / (1 / batched.rate + writes)
        bound = max(on_thread, via_batches)
        rocksdb_best = [b.rate / heap.rate for b in map(best_of, (runs[n] for n in
                                                                  labels[n_keys][1:]))
                        if b is not None]
        table.add_row(f"{n_keys:,}", fmt_rate(heap.rate), fmt_rate(floor.rate),
                      f"{reads * 1e6:.2f}", f"{writes * 1e6:.2f}", fmt_rate(batched.rate),
                      _ratio_text(on_thread), _ratio_text(via_batches),
                      _ratio_text(bound),
                      _ratio_text(max(rocksdb_best) if rocksdb_best else None))
        out[str(n_keys)] = {
            "heap_records_per_s": heap.rate, "rocksdict_alone_records_per_s": floor.rate,
            "heap_via_batches_records_per_s": batched.rate,
            "read_us_per_record": reads * 1e6, "write_us_per_record": writes * 1e6,
            "bound_reads_on_thread": on_thread, "bound_batched_reads": via_batches,
            "bound": bound,
            "runs": {n: [dataclasses.asdict(r) | {"records_per_s": r.rate} for r in runs[n]]
                     for n in (name, batched_name)}}
    table.caption = ("ratios to the heap. bound, reads on the thread: a record costs what it "
                     "costs on the heap plus its share of the multi-gets and of the "
                     "WriteBatches (rocksdict builds and applies them holding the GIL); "
                     "batched reads: what it costs through batches on the heap plus its "
                     "share of the WriteBatches (this one holds asyncstate's batched path as "
                     "it is). bound: the better of the two, for keys that do not repeat (with "
                     "keys that do, a write-back cache writes each key once per drain, not "
                     "once per batch, and can pass it)")
    bench.console.print(table)
    return out


# -- checkpoint: snapshot, restore, rescale 2 -> 3 -------------------------------------------

CHECKPOINT_GOALS = {"snapshot": 2.0, "restore": 3.0, "rescale 2 -> 3": 5.0}  # RocksDB: at most s
CHECKPOINT_STEPS = ("snapshot", "restore", "snapshot, 2 parts", "rescale 2 -> 3")
CHECKPOINT_PROBE_PRESENT = 1_000  # keys read back after each restore ...
CHECKPOINT_PROBE_ABSENT = 100  # ... and keys never loaded (they must hold no state)


def loaded_value(key: int) -> int:
    """The value the checkpoint scenario stores under `key`: distinct per key and not the key
    itself, so a value restored under another key shows."""
    return key * 2_654_435_761 % 4_294_967_291


class ValueLoader(ast.KeyedProcessFunction):
    """Stores `loaded_value(key)` in one ValueState per key; `probing` reads it back and emits
    `(key, value)` instead."""

    probing = False

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.value = ctx.get_state(ast.ValueStateDescriptor("value"))

    def process_element(self, value: Any, ctx: ast.RecordContext) -> Any:
        if self.probing:
            return self.value.value().then_accept(lambda v: ctx.emit((value, v)))
        return self.value.update(loaded_value(value))


@dataclasses.dataclass
class StepRun:
    """One timed checkpoint step (a snapshot, a restore, or the three restores of a rescale)."""

    seconds: float
    checkpoint_bytes: int
    answer_ok: bool
    answer_detail: str
    detail: dict[str, Any] = dataclasses.field(default_factory=dict)


async def read_values(ops: Sequence[ast.KeyedOperator], functions: Sequence[ValueLoader],
                      owner: Callable[[Any], int], keys: Sequence[Any]) -> dict[Any, Any]:
    """Read `keys` back, each through the operator `owner(key)`; keys without a value are left
    out of the result."""
    for function in functions:
        function.probing = True
    for op in ops:
        op.outputs()
    for key in keys:
        await ops[owner(key)].process(key)
    outputs = []
    for op in ops:
        await op.drain()
        outputs += op.outputs()
    if len(outputs) != len(keys):
        raise AssertionError(f"read {len(keys)} keys back but got {len(outputs)} outputs")
    return {k: v for k, v in outputs if v is not None}


def check_values(got: dict[Any, Any], sample: Sequence[int], n_keys: int) -> tuple[bool, str]:
    expected = Counter({k: loaded_value(k) for k in sample if k < n_keys})
    ok, detail = check_counts(got, expected)
    if ok:
        detail = (f"{len(expected)} keys read back, values match; {len(sample) - len(expected)} "
                  f"keys never loaded, none has state")
    return ok, detail


def check_entries(path: str, n_keys: int) -> tuple[bool, str]:
    """Count the state entries of a checkpoint from its manifests (docs/checkpoints.md): each
    non-empty key group holds one section header, then its entries."""
    entries = 0
    for manifest in Path(path).glob("part-*/_MANIFEST.json"):
        groups = json.loads(manifest.read_text())["key_groups"]
        entries += sum(g["records"] for g in groups) - len(groups)
    if entries != n_keys:
        return False, f"checkpoint {path} holds {entries} entries, want {n_keys}"
    return True, f"{entries} entries in the checkpoint"


async def measure_checkpoints(bench: Bench, label: str, make_backend: Callable[[str], Any],
                              keys: Sequence[int], repeats: int, sample: Sequence[int],
                              directory: Path) -> tuple[dict[str, list[StepRun]],
                                                        dict[str, float]]:
    """Load every key into one operator and snapshot it `repeats` times; restore each
    checkpoint into a fresh operator. Then load the keys into two operators (parallelism 2,
    each fed its own keys), snapshot both into one checkpoint id `repeats` times, and restore
    each into three operators. Returns the runs of each step and the (untimed) load seconds."""
    config = ast.AsyncStateConfig()
    max_parallelism = config.max_parallelism
    n_keys = len(keys)
    clock = time.perf_counter
    steps: dict[str, list[StepRun]] = {step: [] for step in CHECKPOINT_STEPS}
    loads: dict[str, float] = {}

    def operator(function: ValueLoader, name: str, *, parallelism: int = 1, index: int = 0,
                 restore_from: str | None = None) -> ast.KeyedOperator:
        return ast.KeyedOperator(function, key_selector=_identity, backend=make_backend(name),
                                 config=config, parallelism=parallelism, operator_index=index,
                                 restore_from=restore_from)

    def owner(parallelism: int) -> Callable[[Any], int]:
        def index(key: Any) -> int:
            return ast.compute_operator_index_for_key_group(
                max_parallelism, parallelism, ast.assign_to_key_group(key, max_parallelism))
        return index

    # Same parallelism: snapshot one operator, restore one operator.
    paths: list[str] = []
    async with operator(ValueLoader(), "load-1") as op:
        bench.describe(f"{label}: load 1 operator")
        started = clock()
        await feed(bench, op, keys)
        loads["parallelism 1"] = clock() - started
        for r in range(repeats):
            bench.describe(f"{label}: snapshot ({r + 1}/{repeats})")
            gc.collect()
            started = clock()
            path = await op.snapshot(directory / "checkpoints", 1 + r)
            seconds = clock() - started
            steps["snapshot"].append(StepRun(seconds, tree_bytes(path),
                                             *check_entries(path, n_keys)))
            paths.append(path)
    for r, path in enumerate(paths):
        bench.describe(f"{label}: restore ({r + 1}/{repeats})")
        function = ValueLoader()
        gc.collect()
        started = clock()  # opening the backend counts: a restore starts from nothing
        op = operator(function, f"restore-1-{r}", restore_from=path)
        async with op:  # the restore runs on entry
            seconds = clock() - started
            got = await read_values([op], [function], owner(1), sample)
        steps["restore"].append(StepRun(seconds, tree_bytes(path),
                                        *check_values(got, sample, n_keys)))

    # Rescale 2 -> 3: two operators, each loaded with its own keys, snapshot into one
    # checkpoint id; three operators restore from it.
    of_two = owner(2)
    parts: list[list[int]] = [[], []]
    for key in keys:
        parts[of_two(key)].append(key)
    paths = []
    async with contextlib.AsyncExitStack() as stack:
        bench.describe(f"{label}: load 2 operators")
        ops = [await stack.enter_async_context(operator(ValueLoader(), f"load-2-{i}",
                                                        parallelism=2, index=i))
               for i in range(2)]
        started = clock()
        for op, part in zip(ops, parts, strict=True):
            await feed(bench, op, part)
        loads["parallelism 2"] = clock() - started
        for r in range(repeats):
            bench.describe(f"{label}: snapshot, 2 parts ({r + 1}/{repeats})")
            gc.collect()
            started = clock()
            for op in ops:
                path = await op.snapshot(directory / "checkpoints", 1 + repeats + r)
            seconds = clock() - started
            steps["snapshot, 2 parts"].append(StepRun(seconds, tree_bytes(path),
                                                      *check_entries(path, n_keys)))
            paths.append(path)
    of_three = owner(3)
    for r, path in enumerate(paths):
        bench.describe(f"{label}: rescale 2 -> 3 ({r + 1}/{repeats})")
        functions = [ValueLoader() for _ in range(3)]
        gc.collect()
        each: list[float] = []
        async with contextlib.AsyncExitStack() as stack:
            ops = []
            for i, function in enumerate(functions):
                started = clock()
                op = operator(function, f"restore-3-{r}-{i}", parallelism=3, index=i,
                              restore_from=path)
                await stack.enter_async_context(op)
                each.append(clock() - started)
                ops.append(op)
            got = await read_values(ops, functions, of_three, sample)
        steps["rescale 2 -> 3"].append(StepRun(sum(each), tree_bytes(path),
                                               *check_values(got, sample, n_keys),
                                               {"restore_seconds_per_operator": each}))
    return steps, loads


@scenario("checkpoint", "snapshot, restore and rescale 2 -> 3 of 1 M keys, heap and RocksDB")
def checkpoint(bench: Bench) -> dict[str, Any]:
    args = bench.args
    n_keys = args.keys or args.records or (100_000 if bench.quick else 1_000_000)
    repeats = args.repeats or (1 if bench.quick else 3)
    keys = overhead_keys(n_keys, n_keys, seed=args.seed)  # each key once, in a shuffled order
    sample = sample_chooser(keys, n_keys, args.seed, CHECKPOINT_PROBE_PRESENT,
                            CHECKPOINT_PROBE_ABSENT)(n_keys)
    rocksdb_options = ast.RocksDBOptions()
    params = {"keys": n_keys, "repeats": repeats, "seed": args.seed,
              "state": "one ValueState per key holding an int (loaded_value(key))",
              "load_order": "seeded shuffle of the keys",
              "probe": f"{CHECKPOINT_PROBE_PRESENT} keys loaded + {CHECKPOINT_PROBE_ABSENT} "
                       f"keys never loaded, read back after every restore through the "
                       f"operator that owns each",
              "config": dataclasses.asdict(ast.AsyncStateConfig()),
              "rocksdb": {"io_parallelism": ROCKSDB_IO_PARALLELISM,
                          "options": dataclasses.asdict(rocksdb_options)},
              "time_bound": None}
    bench.console.print(f"[bold]checkpoint[/]: {n_keys:,} keys in one ValueState each; "
                        f"snapshot, restore, rescale 2 -> 3; best of {repeats}")
    bench.console.print(bench.describe_environment())

    results: dict[str, dict[str, list[StepRun]]] = {}
    loads: dict[str, dict[str, float]] = {}
    errors: dict[str, str] = {}
    backends = ("heap", "rocksdb")
    bench.start_progress(total=len(backends) * 2 * n_keys)
    try:
        for label in backends:
            with tempfile.TemporaryDirectory(prefix="asyncstate-bench-checkpoint-") as tmp:
                def make_backend(name: str, label: str = label, tmp: str = tmp) -> Any:
                    if label == "heap":
                        return ast.HeapBackend()
                    return ast.RocksDBBackend(Path(tmp) / "db" / name, options=rocksdb_options,
                                              io_parallelism=ROCKSDB_IO_PARALLELISM)
                try:
                    results[label], loads[label] = bench.run_async(measure_checkpoints(
                        bench, label, make_backend, keys, repeats, sample, Path(tmp)))
                except Exception:  # noqa: BLE001 - report the backend as crashed, go on
                    errors[label] = traceback.format_exc()
    finally:
        bench.stop_progress()

    def best(label: str, step: str) -> StepRun | None:
        good = [r for r in results.get(label, {}).get(step, []) if r.answer_ok]
        return min(good, key=lambda r: r.seconds) if good else None

    table = Table(title=f"checkpoint: {n_keys:,} keys, one ValueState each (best of {repeats})")
    for column, justify in (("backend", "left"), ("step", "left"), ("seconds", "right"),
                            ("MB", "right"), ("keys/s", "right"),
                            ("vs heap", "right"), ("goal", "right"), ("result", "left")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    backends_json: dict[str, Any] = {}
    all_ok = not errors
    for label in backends:
        steps_json: dict[str, Any] = {}
        for step in CHECKPOINT_STEPS:
            mine = best(label, step)
            heap = best("heap", step)
            ratio = mine.seconds / heap.seconds if mine is not None and heap is not None \
                and label != "heap" else None
            goal = CHECKPOINT_GOALS.get(step) if label == "rocksdb" else None
            wrong = [r for r in results.get(label, {}).get(step, []) if not r.answer_ok]
            passed: bool | None = None
            if label in errors:
                result_text = "[red]ERROR (traceback below)[/]"
            elif wrong:
                result_text = f"[red]WRONG ANSWER: {wrong[0].answer_detail}[/]"
                all_ok = False
            elif mine is None:
                result_text = "[red]not run[/]"
                all_ok = False
            elif goal is None:
                result_text = "ok"
            else:
                passed = mine.seconds <= goal
                result_text = "[green]pass[/]" if passed else "[red]FAIL[/]"
            table.add_row(
                label, step, f"{mine.seconds:.2f}" if mine is not None else "-",
                f"{mine.checkpoint_bytes / 1e6:.1f}" if mine is not None else "-",
                fmt_rate(n_keys / mine.seconds) if mine is not None else "-",
                f"{ratio:.2f}x" if ratio is not None else "-",
                f"<= {goal:g} s" if goal is not None else "-", result_text,
                end_section=step == CHECKPOINT_STEPS[-1])
            steps_json[step] = {
                "best_seconds": mine.seconds if mine is not None else None,
                "checkpoint_bytes": mine.checkpoint_bytes if mine is not None else None,
                "keys_per_s": n_keys / mine.seconds if mine is not None else None,
                "seconds_ratio_to_heap": ratio, "goal_max_seconds": goal,
                "goal_passed": passed,
                "runs": [dataclasses.asdict(r) for r in results.get(label, {}).get(step, [])]}
        backends_json[label] = {"steps": steps_json, "load_seconds": loads.get(label),
                                "error": errors.get(label)}
    table.caption = ("snapshot: op.snapshot() (drain, encode, write, fsync); restore: a new "
                     "backend and KeyedOperator(restore_from=...) entered; rescale 2 -> 3: "
                     "three such restores at parallelism 3, added up; MB: the checkpoint's "
                     "files; loading is not timed; ok: sampled values and entry counts match")
    bench.console.print(table)
    for label, tb in errors.items():
        bench.console.print(f"[red bold]{label} crashed:[/]")
        bench.console.print(tb, markup=False, highlight=False)
    return {"scenario": "checkpoint", "ok": all_ok, "params": params,
            "environment": bench.environment(), "backends": backends_json}


# -- timers: register and fire event-time timers ----------------------------------------------

# Each record registers one event-time timer of its key, due up to TIMERS_WINDOW records later;
# every TIMERS_FIRE_EVERY records the watermark moves to the current record and the due timers
# fire; at the end the watermark moves to the maximum and the rest fires. So a queue holds
# about TIMERS_WINDOW timers, as a stream with bounded timer delays keeps it, and the timers
# fire in exactly their global order: (timestamp, key bytes, namespace bytes).
TIMERS_MAX_PARALLELISM = 128
TIMERS_WINDOW = 10_000
TIMERS_FIRE_EVERY = 1_000
TIMERS_FLOOR = "heapq on tuples"
TIMERS_GOALS = {"HeapPriorityQueueSet": 0.5}  # arm -> minimum ratio to the heapq floor
TIMERS_SERVICE_HEAP = "timer service, heap"
TIMERS_SERVICE_ROCKSDB = "timer service, RocksDB"
# arm -> minimum timers/s (register + fire) of the service end to end
TIMERS_RATE_GOALS = {TIMERS_SERVICE_HEAP: 150_000, TIMERS_SERVICE_ROCKSDB: 50_000}


@dataclasses.dataclass
class TimerLoad:
    """Timer `i` is due at `timestamps[i]` under key `keys[i]` (0..n_keys-1), whose
    canonical bytes and key group are `key_bytes[key]` and `key_groups[key]`."""

    timestamps: list[int]
    keys: list[int]
    key_bytes: list[bytes]
    key_groups: list[int]

    def expected(self, fed: int) -> list[tuple[int, int]]:
        """(timestamp, key) of the first `fed` timers in firing order."""
        key_bytes = self.key_bytes
        order = sorted(range(fed), key=lambda i: (self.timestamps[i], key_bytes[self.keys[i]]))
        return [(self.timestamps[i], self.keys[i]) for i in order]


def timer_load(n_timers: int, n_keys: int, seed: int, max_parallelism: int) -> TimerLoad:
    rng = random.Random(seed)
    key_bytes = [canonical_key(key) for key in range(n_keys)]
    # Keys round-robin over a seeded shuffle: two timers of one key are n_keys records
    # apart, more than the window, so no two timers are equal (none collapses).
    return TimerLoad(
        timestamps=[i + rng.randrange(TIMERS_WINDOW) for i in range(n_timers)],
        keys=overhead_keys(n_timers, n_keys, seed),
        key_bytes=key_bytes,
        key_groups=[key_group_of_bytes(data, max_parallelism) for data in key_bytes])


def heapq_timers(bench: Bench, load: TimerLoad, deadline: float,
                 fired_ts: list[int], fired_keys: list[int]) -> int:
    """The floor: (timestamp, key bytes, namespace bytes, key) tuples in a heapq list."""

    heap: list[tuple[int, bytes, bytes, int]] = []
    push, pop = heapq.heappush, heapq.heappop
    timestamps, keys, key_bytes = load.timestamps, load.keys, load.key_bytes
    fire_ts, fire_key = fired_ts.append, fired_keys.append
    fed, n, clock = 0, len(timestamps), time.perf_counter
    while fed < n:
        end = min(n, fed + CHUNK)
        for i in range(fed, end):
            key = keys[i]
            push(heap, (timestamps[i], key_bytes[key], NONE_BYTES, key))
            if i % TIMERS_FIRE_EVERY == TIMERS_FIRE_EVERY - 1:
                while heap and heap[0][0] <= i:
                    item = pop(heap)
                    fire_ts(item[0])
                    fire_key(item[3])
        bench.tick(end - fed)
        fed = end
        if clock() >= deadline:
            break
    while heap:
        item = pop(heap)
        fire_ts(item[0])
        fire_key(item[3])
    return fed


class TimerRegistrar(ast.KeyedProcessFunction):
    """The timer service end to end: record (key, ts) registers an event-time timer for ts;
    on_timer records the firing."""

    def __init__(self, fired_ts: list[int], fired_keys: list[int]) -> None:
        self.fire_ts, self.fire_key = fired_ts.append, fired_keys.append

    def process_element(self, record: Any, ctx: ast.RecordContext) -> None:
        ctx.timer_service.register_event_time_timer(record[1])

    def on_timer(self, timestamp: int, ctx: ast.RecordContext) -> None:
        self.fire_ts(timestamp)
        self.fire_key(ctx.current_key)


async def service_timers(bench: Bench, load: TimerLoad, deadline: float, backend: Any,
                         fired_ts: list[int], fired_keys: list[int]) -> int:
    """The same load through a KeyedOperator: every record registers its timer, and every
    TIMERS_FIRE_EVERY records the watermark advances to the record's index."""
    fn = TimerRegistrar(fired_ts, fired_keys)
    timestamps, keys = load.timestamps, load.keys
    fed, n, clock = 0, len(timestamps), time.perf_counter
    async with ast.KeyedOperator(fn, key_selector=_first, backend=backend) as op:
        process, advance = op.process, op.advance_watermark
        while fed < n:
            end = min(n, fed + CHUNK)
            for i in range(fed, end):
                await process((keys[i], timestamps[i]))
                if i % TIMERS_FIRE_EVERY == TIMERS_FIRE_EVERY - 1:
                    await advance(i)
            bench.tick(end - fed)
            fed = end
            if clock() >= deadline:
                break
        await advance(2**63 - 1)
    return fed


def _first(record: Any) -> Any:
    return record[0]


def queue_timers(bench: Bench, load: TimerLoad, deadline: float, queue: Any,
                 fired_ts: list[int], fired_keys: list[int], key_groups: list[int]) -> int:
    """The same load on one of asyncstate's timer queues (InternalTimers; `key_groups[key]`
    is the key group each key's timers carry)."""
    add, peek, poll = queue.add, queue.peek, queue.poll
    timestamps, keys, key_bytes = load.timestamps, load.keys, load.key_bytes
    fire_ts, fire_key = fired_ts.append, fired_keys.append
    fed, n, clock = 0, len(timestamps), time.perf_counter
    while fed < n:
        end = min(n, fed + CHUNK)
        for i in range(fed, end):
            key = keys[i]
            add(InternalTimer(timestamps[i], key, key_bytes[key], NONE_BYTES, key_groups[key]))
            if i % TIMERS_FIRE_EVERY == TIMERS_FIRE_EVERY - 1:
                while (head := peek()) is not None and head.timestamp <= i:
                    poll()
                    fire_ts(head.timestamp)
                    fire_key(head.key)
        bench.tick(end - fed)
        fed = end
        if clock() >= deadline:
            break
    while (head := poll()) is not None:
        fire_ts(head.timestamp)
        fire_key(head.key)
    return fed


@scenario("timers", "register and fire 1 M event-time timers over 100 K keys: heapq vs the "
                    "timer queues")
def timers(bench: Bench) -> dict[str, Any]:
    args = bench.args
    n_timers, n_keys, repeats, max_seconds = bench.sizes()
    if n_keys < TIMERS_WINDOW:
        sys.exit(f"--keys must be >= {TIMERS_WINDOW} (the timer window), got {n_keys}: with "
                 f"fewer keys two timers of one key could be equal and collapse")
    max_p = TIMERS_MAX_PARALLELISM
    load = timer_load(n_timers, n_keys, args.seed, max_p)
    in_group_zero = [0] * n_keys  # max_parallelism 1: every key is in key group 0
    all_groups = KeyGroupRange(0, max_p - 1)
    db_options, write_options = ast.RocksDBOptions().to_rocksdict()
    # Timers live inside an operator, which holds the config's first GC threshold while it
    # runs; every arm runs under it (--gc-threshold none: CPython's default).
    gc_hold = bench.config().resolved_gc_threshold()
    expected_cache: dict[int, list[tuple[int, int]]] = {}

    def check(fed: int, fired_ts: list[int], fired_keys: list[int]) -> tuple[bool, str]:
        if fed not in expected_cache:
            expected_cache.clear()
            expected_cache[fed] = load.expected(fed)
        expected = expected_cache[fed]
        got = list(zip(fired_ts, fired_keys, strict=False))
        if got == expected:
            return True, f"{fed:,} timers fired in (timestamp, key bytes) order"
        if len(got) != len(expected):
            return False, f"{len(got):,} timers fired, {len(expected):,} registered"
        at = next(i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b)
        return False, f"firing #{at} was {got[at]}, expected {expected[at]}"

    def arm(make: Callable[[Any], Any] | None, key_groups: list[int],
            rocksdb: bool = False) -> Callable[[float], RunResult]:
        """An arm building its queue with `make(db)` (db: a fresh RocksDB database if
        `rocksdb`, else None), or the heapq floor if `make` is None."""
        def run(deadline: float) -> RunResult:
            fired_ts: list[int] = []
            fired_keys: list[int] = []
            with contextlib.ExitStack() as stack:
                db = None
                if rocksdb:
                    directory = stack.enter_context(tempfile.TemporaryDirectory())
                    db = rocksdict.Rdict(directory, db_options)
                    stack.callback(db.close)
                if gc_hold is not None:
                    gc_threshold.hold(gc_hold)
                    stack.callback(gc_threshold.release, gc_hold)
                with GCWatch() as collector:
                    started = time.perf_counter()
                    if make is None:
                        fed = heapq_timers(bench, load, deadline, fired_ts, fired_keys)
                    else:
                        fed = queue_timers(bench, load, deadline, make(db), fired_ts,
                                           fired_keys, key_groups)
                    seconds = time.perf_counter() - started
            ok, detail = check(fed, fired_ts, fired_keys)
            return RunResult(fed, seconds, fed < n_timers, ok, detail, collector.figures())
        return run

    def service_arm(rocksdb: bool) -> Callable[[float], RunResult]:
        """The timer service end to end, on the heap or RocksDB."""
        def run(deadline: float) -> RunResult:
            fired_ts: list[int] = []
            fired_keys: list[int] = []
            with contextlib.ExitStack() as stack:
                backend: Any = ast.HeapBackend()
                if rocksdb:
                    directory = stack.enter_context(tempfile.TemporaryDirectory())
                    backend = ast.RocksDBBackend(directory)
                with GCWatch() as collector:
                    started = time.perf_counter()
                    fed = bench.run_async(service_timers(bench, load, deadline, backend,
                                                         fired_ts, fired_keys))
                    seconds = time.perf_counter() - started
            ok, detail = check(fed, fired_ts, fired_keys)
            return RunResult(fed, seconds, fed < n_timers, ok, detail, collector.figures())
        return run

    def rocksdb_sets(db: Any) -> KeyGroupPartitionedPriorityQueue:
        return KeyGroupPartitionedPriorityQueue(
            lambda kg: RocksDBPriorityQueueSet(db, kg, write_options=write_options),
            all_groups, max_p)

    arms: dict[str, Callable[[float], RunResult]] = {
        TIMERS_FLOOR: arm(None, load.key_groups),
        "HeapPriorityQueueSet": arm(lambda db: HeapPriorityQueueSet(all_groups, max_p),
                                    load.key_groups),
        "BatchExecutionPriorityQueueSet": arm(lambda db: BatchExecutionPriorityQueueSet(),
                                              load.key_groups),
        "KeyGroupPartitioned, heap sets": arm(
            lambda db: KeyGroupPartitionedPriorityQueue(
                lambda kg: HeapPriorityQueueSet(KeyGroupRange(kg, kg), max_p), all_groups,
                max_p), load.key_groups),
        # One key group (max_parallelism 1): the RocksDB set alone, without the heap of heads.
        "RocksDBPriorityQueueSet": arm(
            lambda db: RocksDBPriorityQueueSet(db, 0, write_options=write_options),
            in_group_zero, rocksdb=True),
        "KeyGroupPartitioned, RocksDB sets": arm(rocksdb_sets, load.key_groups, rocksdb=True),
        TIMERS_SERVICE_HEAP: service_arm(rocksdb=False),
        TIMERS_SERVICE_ROCKSDB: service_arm(rocksdb=True),
    }
    params = {"timers": n_timers, "keys": n_keys, "repeats": repeats,
              "max_seconds_per_run": max_seconds, "seed": args.seed,
              "max_parallelism": max_p, "window": TIMERS_WINDOW,
              "fire_every": TIMERS_FIRE_EVERY, "rocksdb_cache_size": DEFAULT_CACHE_SIZE,
              "gc_threshold": gc_hold,
              "rocksdb_options": dataclasses.asdict(ast.RocksDBOptions()),
              "load": "timer i of key order[i % keys] (seeded shuffle) due at i + "
                      "randrange(window); every fire_every timers the due ones fire"}
    bench.console.print(f"[bold]timers[/]: register + fire {n_timers:,} event-time timers over "
                        f"{n_keys:,} keys, best of {repeats}, at most {max_seconds:g} s per run")
    bench.console.print(bench.describe_environment())

    runs, errors = run_rounds(bench, arms, repeats=repeats, max_seconds=max_seconds,
                              records=n_timers)
    all_ok, arms_json = ratio_table(
        bench, f"timers: register + fire {n_timers:,} timers / {n_keys:,} keys "
               f"(best of {repeats})", list(arms), runs, errors, reference=TIMERS_FLOOR,
        reference_word="heapq", goals=TIMERS_GOALS, unit="timers", bounded_unit="timers",
        rate_goals=TIMERS_RATE_GOALS)
    return {"scenario": "timers", "ok": all_ok, "params": params,
            "environment": bench.environment(), "arms": arms_json}


# -- spark: the bridge against Spark's own stateful operators -------------------------------

SPARK_PARTITIONS = 4
SPARK_KEY_STRIDE = 7919  # record i has key (i * 7919) % keys: each key every `keys` records
SPARK_GOAL_VS_SPARK = 5.0  # asyncstate >= 5x the faster of Spark's operators
SPARK_GOAL_EFFICIENCY = 0.7  # per-partition rate in Spark / ast.run rate in one process
SPARK_PHASES = ("restore", "input_wait", "process", "drain", "commit", "output", "read")
SPARK_CACHED = "rocksdb + write-back cache"


def spark_cache_entries(n_keys: int) -> int:
    """The cached RocksDB arm's cache: a partition's share of the keys, plus a quarter."""
    return max(1, n_keys * 5 // (4 * SPARK_PARTITIONS))
SPARK_BACKENDS = ("rocksdb", SPARK_CACHED, "heap")


class SparkBenchCounter(ast.KeyedProcessFunction):
    """The keyed counter over rows (dicts): updates state, emits nothing; the answer is
    checked from the checkpoint each partition commits (inside the timed run)."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

    def process_element(self, value: Any, ctx: ast.RecordContext) -> Any:
        return self.count.value().then_compose(lambda v: self.count.update((v or 0) + 1))


class SparkBenchProbe(ast.KeyedProcessFunction):
    """Reads each key's count back from a restored checkpoint."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.count = ctx.get_state(ast.ValueStateDescriptor("count"))

    def process_element(self, value: Any, ctx: ast.RecordContext) -> Any:
        return self.count.value().then_accept(lambda v: ctx.emit((value, v)))


def _spark_row_key(row: Any) -> Any:
    return row["key"]


def _pandas_with_state_count(key: Any, frames: Any, state: Any) -> Any:
    import pandas as pd

    total = state.get[0] if state.exists else 0
    for frame in frames:
        total += len(frame)
    state.update((total,))
    yield pd.DataFrame({"key": [key[0]], "count": [total]})


def _tws_processor() -> Any:
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    class CountProcessor(StatefulProcessor):  # type: ignore[misc]
        def init(self, handle: Any) -> None:
            self.count = handle.getValueState("count", "count long")

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
            import pandas as pd

            total = self.count.get()[0] if self.count.exists() else 0
            for frame in rows:
                total += len(frame)
            self.count.update((total,))
            yield pd.DataFrame({"key": [key[0]], "count": [total]})

        def close(self) -> None:
            pass

    return CountProcessor()


def spark_checkpoint_counts(path: str, n_keys: int) -> dict[Any, Any]:
    """The counts a checkpoint holds for keys 0..n_keys-1, restored in one operator."""
    async def read() -> dict[Any, Any]:
        op = ast.KeyedOperator(SparkBenchProbe(), key_selector=_identity,
                               backend=ast.HeapBackend(), restore_from=path)
        async with op:
            for key in range(n_keys):
                await op.process(key)
            await op.drain()
            return {k: v for k, v in op.outputs() if v is not None}
    with asyncio.Runner() as runner:
        return runner.run(read())


def _drain_partition(rows: Any) -> list[int]:
    return [sum(1 for _ in rows)]


def spark_partition_rows(session: Any, data_dir: str, routing: str) -> list[dict[str, Any]]:
    """The rows partition 0 of the bridge receives, as dicts, in the order Spark hands
    them to it (the Arrow route's shuffle, or the RDD route's)."""
    from asyncstate.spark.routing import (
        ROUTE_COLUMN,
        Router,
        route_dataframe_arrow,
        route_rdd,
    )

    router = Router(_spark_row_key, ast.AsyncStateConfig().max_parallelism, SPARK_PARTITIONS)
    df = session.read.parquet(data_dir)
    if routing == "arrow":
        rdd = route_dataframe_arrow(df, router, SPARK_PARTITIONS).drop(ROUTE_COLUMN).rdd \
            .map(lambda row: row.asDict())
    else:
        rdd = route_rdd(df.rdd.map(lambda row: row.asDict()), router, SPARK_PARTITIONS) \
            .map(lambda pair: pair[1])
    rows: list[dict[str, Any]] = session.sparkContext.runJob(rdd, list, [0])
    return rows


def spark_session(local_dir: str) -> Any:
    import asyncstate.spark as aspark

    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.master("local[2]").appName("asyncstate-bench")
    for key, value in {**aspark.quiet_conf(), "spark.local.dir": local_dir,
                       "spark.sql.shuffle.partitions": str(SPARK_PARTITIONS),
                       "spark.driver.memory": "4g"}.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session


@scenario("spark", "keyed counter inside Spark: the bridge vs Spark's stateful operators")
def spark(bench: Bench) -> dict[str, Any]:
    import asyncstate.spark as aspark
    from asyncstate.spark.routing import arrow_available

    args = bench.args
    n_records = args.records or (200_000 if bench.quick else 2_000_000)
    n_keys = args.keys or (n_records // 20)
    repeats = args.repeats or 1
    if n_records % n_keys:
        sys.exit(f"--records ({n_records}) must be a multiple of --keys ({n_keys}): every key "
                 "then has records // keys records, which the answer check relies on")
    expected = Counter({k: n_records // n_keys for k in range(n_keys)})
    work = Path(tempfile.mkdtemp(prefix="asyncstate-bench-spark-"))
    bench.console.print(f"[bold]spark[/]: keyed counter, {n_records:,} rows over {n_keys:,} "
                        f"keys, {SPARK_PARTITIONS} partitions, local[2], best of {repeats}")
    bench.console.print(bench.describe_environment())
    session = spark_session(str(work / "spark-local"))
    try:
        data_dir = str(work / "data")
        (session.range(n_records)
         .selectExpr(f"(id * {SPARK_KEY_STRIDE}) % {n_keys} AS key", "id")
         .repartition(8).write.parquet(data_dir))
        schema = "key long, id long"
        arms: dict[str, Callable[[int], RunResult]] = {}

        # The state cache holds every key of a partition, with room for partitions that got
        # more key groups' keys than the average (an LRU cache a little smaller than a
        # cyclic working set misses every time).
        cache_entries = spark_cache_entries(n_keys)

        def bridge_backend(backend: str) -> Any:
            if backend == SPARK_CACHED:
                return functools.partial(ast.RocksDBBackend, cache_entries=cache_entries,
                                         cache_write_back=True)
            return backend

        def bridge_arm(backend: str, routing: str, alone: bool = False
                       ) -> Callable[[int], RunResult]:
            def run(run_no: int) -> RunResult:
                report = aspark.RunReport(session.sparkContext)
                checkpoint_id = run_no + (1000 if alone else 0)
                started = time.perf_counter()
                out = aspark.process_keyed(
                    session.read.parquet(data_dir), SparkBenchCounter,
                    key_selector=_spark_row_key, num_partitions=SPARK_PARTITIONS,
                    backend=bridge_backend(backend), checkpoint_dir=str(work / "checkpoints"),
                    checkpoint_id=checkpoint_id, output_schema="key long, count long",
                    routing=routing, report=report)
                if alone:
                    # One job per partition: the first also runs the routing stage (two
                    # tasks at a time), the others reuse its shuffle output; each partition
                    # runs while no other one does.
                    rdd = out.rdd
                    for index in range(SPARK_PARTITIONS):
                        session.sparkContext.runJob(rdd, _drain_partition, [index])
                else:
                    out.write.format("noop").mode("overwrite").save()
                seconds = time.perf_counter() - started
                path = aspark.verify_checkpoint(str(work / "checkpoints"), checkpoint_id,
                                                report)
                ok, detail = check_counts(spark_checkpoint_counts(path, n_keys), expected)
                shutil.rmtree(path, ignore_errors=True)
                return RunResult(n_records, seconds, False, ok, detail,
                                 {"partitions": report.partitions})
            return run

        def streaming_arm(kind: str) -> Callable[[int], RunResult]:
            def run(run_no: int) -> RunResult:
                from pyspark.sql.streaming.state import GroupStateTimeout

                name = f"{kind}-{run_no}"
                stream = session.readStream.schema(schema).parquet(data_dir).groupBy("key")
                if kind == "applyInPandasWithState":
                    out = stream.applyInPandasWithState(
                        _pandas_with_state_count, "key long, count long", "count long",
                        "Update", GroupStateTimeout.NoTimeout)
                else:
                    session.conf.set(
                        "spark.sql.streaming.stateStore.providerClass",
                        "org.apache.spark.sql.execution.streaming.state."
                        "RocksDBStateStoreProvider")
                    out = stream.transformWithStateInPandas(
                        _tws_processor(), "key long, count long", "Update", "None")
                started = time.perf_counter()
                query = (out.writeStream.outputMode("update").format("memory")
                         .queryName(name.replace("-", "_"))
                         .option("checkpointLocation", str(work / "queries" / name))
                         .trigger(availableNow=True).start())
                query.awaitTermination()
                seconds = time.perf_counter() - started
                session.conf.unset("spark.sql.streaming.stateStore.providerClass")
                rows = session.table(name.replace("-", "_")).collect()
                got: dict[Any, int] = {}
                for row in rows:
                    got[row["key"]] = max(got.get(row["key"], 0), row["count"])
                ok, detail = check_counts(got, expected)
                return RunResult(n_records, seconds, False, ok, detail)
            return run

        # Rows as dicts, in this process. The first quarter of the ids in order: every key,
        # each every n_keys rows. A partition's own rows in the order Spark hands them to
        # it: a quarter of the keys, and a key's records closer together (they often meet
        # the key's previous record still in flight, which then waits for it).
        share = n_records // SPARK_PARTITIONS
        id_rows = [{"key": (i * SPARK_KEY_STRIDE) % n_keys, "id": i} for i in range(share)]
        routings = ["rdd", "arrow"] if arrow_available() else ["rdd"]
        partition_rows = spark_partition_rows(session, data_dir, routings[-1])

        def local_arm(backend: str, rows: list[dict[str, Any]]) -> Callable[[int], RunResult]:
            def run(run_no: int) -> RunResult:
                directory = str(work / f"local-{run_no}")
                store: Any
                if backend == "heap":
                    store = ast.HeapBackend()
                elif backend == "rocksdb":
                    store = ast.RocksDBBackend(directory)
                else:
                    store = bridge_backend(backend)(directory)
                started = time.perf_counter()
                cpu = time.process_time()
                ast.run(SparkBenchCounter(), rows, key_selector=_spark_row_key, backend=store)
                cpu = time.process_time() - cpu
                seconds = time.perf_counter() - started
                shutil.rmtree(directory, ignore_errors=True)
                return RunResult(len(rows), seconds, False, True, "rate reference (no check)",
                                 {"cpu": cpu})
            return run

        for backend in SPARK_BACKENDS:
            for routing in routings if backend != SPARK_CACHED else routings[-1:]:
                arms[f"{backend}, {routing} route"] = bridge_arm(backend, routing)
            arms[f"{backend}, {routings[-1]} route, alone"] = bridge_arm(
                backend, routings[-1], alone=True)
            if backend != SPARK_CACHED:
                arms[f"ast.run, {backend}"] = local_arm(backend, id_rows)
            arms[f"ast.run, {backend}, partition rows"] = local_arm(backend, partition_rows)
        for kind in ("applyInPandasWithState", "transformWithStateInPandas"):
            arms[kind] = streaming_arm(kind)

        runs: dict[str, list[RunResult]] = {name: [] for name in arms}
        errors: dict[str, str] = {}
        bench.start_progress(total=len(arms) * repeats)
        try:
            for run_no in range(repeats):
                for name, arm in arms.items():
                    bench.describe(f"{name} ({run_no + 1}/{repeats})")
                    if name not in errors:
                        gc.collect()
                        try:
                            runs[name].append(arm(run_no + 1))
                        except Exception:  # noqa: BLE001 - report the arm, keep the others
                            errors[name] = traceback.format_exc()
                    bench.tick(1)
        finally:
            bench.stop_progress()
    finally:
        session.stop()
        shutil.rmtree(work, ignore_errors=True)
    return _spark_table(bench, runs, errors, n_records, n_keys, repeats)


def _partition_rates(partitions: list[dict[str, Any]]) -> tuple[float, float, float]:
    """Mean per-partition records/s: over the whole partition run, and over its processing
    alone (process + drain: without restore, commit, and the time the operator sat idle
    waiting for Spark's input); and the partitions' records per CPU second of their worker
    processes."""
    whole = [p["records"] / p["seconds"] for p in partitions if p["seconds"] > 0]
    busy = [p["records"] / (p["process"] + p["drain"])
            for p in partitions if p["process"] + p["drain"] > 0]
    cpu = sum(p["cpu"] for p in partitions)
    return (sum(whole) / len(whole) if whole else 0.0, sum(busy) / len(busy) if busy else 0.0,
            sum(p["records"] for p in partitions) / cpu if cpu > 0 else 0.0)


def _spark_efficiency(value: float | None, goal: bool = True) -> str:
    if value is None:
        return "-"
    if not goal:
        return f"{value:.2f}"
    return f"{value:.2f} " + ("[green]pass[/]" if value >= SPARK_GOAL_EFFICIENCY else
                              "[red]FAIL[/]")


def _spark_table(bench: Bench, runs: dict[str, list[RunResult]], errors: dict[str, str],
                 n_records: int, n_keys: int, repeats: int) -> dict[str, Any]:
    spark_best = [b.rate for b in (best_of(runs.get(k, [])) for k in
                                   ("applyInPandasWithState", "transformWithStateInPandas"))
                  if b is not None]
    spark_rate = max(spark_best) if spark_best else None
    table = Table(title=f"spark: keyed counter, {n_records:,} rows / {n_keys:,} keys, "
                        f"{SPARK_PARTITIONS} partitions, local[2] (best of {repeats})")
    for column in ("arm", "rows/s end to end", "vs faster Spark op", "per partition rows/s "
                   "(whole / processing)", "bridge efficiency", "same rows", "per CPU s",
                   "result"):
        table.add_column(column, justify="left" if column in ("arm", "result") else "right")
    arms_json: dict[str, Any] = {}
    all_ok = not errors
    for name, arm_runs in runs.items():
        best = best_of(arm_runs)
        wrong = [r for r in arm_runs if not r.answer_ok]
        all_ok = all_ok and not wrong
        row: dict[str, Any] = {"best_rows_per_s": best.rate if best else None,
                               "error": errors.get(name),
                               "runs": [dataclasses.asdict(r) | {"rows_per_s": r.rate}
                                        for r in arm_runs]}
        vs_spark = efficiency = same = same_cpu = None
        partition_text = efficiency_text = "-"
        alone = name.endswith(", alone")
        if best is not None and "route" in name:
            if not alone:
                vs_spark = best.rate / spark_rate if spark_rate else None
            whole, busy, per_cpu = _partition_rates(best.metrics["partitions"])
            backend = name.split(",")[0]
            local = best_of(runs.get(f"ast.run, {backend}", []))
            if local is not None and local.rate > 0:
                efficiency = busy / local.rate
                efficiency_text = (f"{_spark_efficiency(efficiency, not alone)} "
                                   f"(whole {whole / local.rate:.2f})")
            own = best_of(runs.get(f"ast.run, {backend}, partition rows", []))
            if own is not None and own.rate > 0:
                same = busy / own.rate
                if own.metrics.get("cpu"):
                    same_cpu = per_cpu / (own.records / own.metrics["cpu"])
            partition_text = f"{fmt_rate(whole)} / {fmt_rate(busy)}"
            phases = {phase: sum(p[phase] for p in best.metrics["partitions"])
                      for phase in (*SPARK_PHASES, "cpu")}
            row |= {"per_partition_rows_per_s": whole, "per_partition_busy_rows_per_s": busy,
                    "partition_rows_per_cpu_s": per_cpu,
                    "phase_seconds_summed_over_partitions": phases}
        elif best is not None and best.metrics.get("cpu"):
            row["rows_per_cpu_s"] = best.records / best.metrics["cpu"]
            partition_text = f"{fmt_rate(row['rows_per_cpu_s'])} per CPU s"
        row |= {"ratio_to_faster_spark_operator": vs_spark, "bridge_efficiency": efficiency,
                "efficiency_same_rows": same, "efficiency_same_rows_per_cpu_s": same_cpu}
        if name in errors:
            result = "[red]ERROR (traceback below)[/]"
        elif wrong:
            result = f"[red]WRONG ANSWER: {wrong[0].answer_detail}[/]"
        else:
            result = "answer ok" if best is not None and best.answer_ok else "-"
        vs_text = "-"
        if vs_spark is not None:
            vs_text = f"{vs_spark:.1f}x " + ("[green]pass[/]" if vs_spark >= SPARK_GOAL_VS_SPARK
                                             else "[red]FAIL[/]")
        table.add_row(name, fmt_rate(best.rate) if best and not alone else "-", vs_text,
                      partition_text, efficiency_text, _spark_efficiency(same, False),
                      _spark_efficiency(same_cpu, False), result)
        arms_json[name] = row
    bench.console.print(table)
    ceilings = _spark_cpu_ceilings(bench, runs, spark_rate)
    bench.console.print(
        f"goals: >= {SPARK_GOAL_VS_SPARK:g}x the faster Spark operator end to end; bridge "
        f"efficiency (per-partition processing rate / ast.run's rate on the same backend, "
        f"over the first quarter of the ids) >= {SPARK_GOAL_EFFICIENCY:g}. same rows: the "
        "per-partition processing rate / ast.run's over partition 0's own rows in Spark's "
        "order; per CPU s: the partitions' rows per CPU second of their worker processes / "
        "ast.run's on those rows. alone: a job per partition, so that no other partition "
        "runs meanwhile (the per-partition figures only)")
    phase_table = Table(title="where the time goes (seconds, summed over partitions)")
    phase_table.add_column("arm")
    for phase in (*SPARK_PHASES, "cpu"):
        phase_table.add_column(phase, justify="right")
    for name, row in arms_json.items():
        phases = row.get("phase_seconds_summed_over_partitions")
        if phases:
            phase_table.add_row(name, *(f"{phases[p]:.2f}" for p in (*SPARK_PHASES, "cpu")))
    bench.console.print(phase_table)
    bench.console.print("restore: open and restore; input_wait: the operator idle, waiting for "
                        "Spark's input (shuffle read); process: the rest until the input ends; "
                        "drain; commit: the checkpoint part; output: Spark consuming outputs; "
                        "read: the reader thread inside Spark's iterator (overlaps the others); "
                        "cpu: the CPU time of the partitions' worker processes")
    print_errors(bench, errors)
    return {"scenario": "spark", "ok": all_ok,
            "params": {"records": n_records, "keys": n_keys, "repeats": repeats,
                       "partitions": SPARK_PARTITIONS, "master": "local[2]",
                       "cache_entries": spark_cache_entries(n_keys)},
            "environment": bench.environment(), "arms": arms_json,
            "cpu_ceilings": ceilings}


def _spark_cpu_ceilings(bench: Bench, runs: dict[str, list[RunResult]],
                        spark_rate: float | None) -> dict[str, Any]:
    """Per backend, an estimate of the end-to-end rate the backend allows on this machine:
    `ast.run`'s rows per CPU second (all its threads) over a partition's rows, times the
    usable cores, as if a partition inside Spark spent the same CPU per row and the JVM
    none. The per CPU s column says how close the partitions came to that CPU per row."""
    cores = bench.environment()["cores_usable"]
    out: dict[str, Any] = {}
    for backend in SPARK_BACKENDS:
        rates = [r.records / r.metrics["cpu"] for r in
                 runs.get(f"ast.run, {backend}, partition rows", [])
                 if r.answer_ok and r.metrics.get("cpu")]
        if not rates:
            continue
        ceiling = cores * max(rates)
        vs_spark = ceiling / spark_rate if spark_rate else None
        out[backend] = {"rows_per_s": ceiling, "ratio_to_faster_spark_operator": vs_spark}
        bench.console.print(
            f"CPU ceiling, {backend}: {cores} cores x ast.run's "
            f"{fmt_rate(ceiling / cores)} rows per CPU second over a partition's rows = "
            f"{fmt_rate(ceiling)} rows/s end to end"
            + (f", {vs_spark:.1f}x the faster Spark operator" if vs_spark else ""))
    return out


# -- ttl: keyed counter with state TTL on vs off --------------------------------------------

TTL_GOAL = 1.2  # at most this much slower with TTL than without, on each backend
# Rounds of the four arms. The cost is the median over rounds of the ratio within a round:
# a slow spell of the machine moves single runs by tens of percent, and a best-of-N per arm
# lets one lucky run of either arm decide.
TTL_ROUNDS = 5
# Long enough that nothing expires during a run: the arms differ only by what TTL costs.
TTL_MS = 3_600_000


def ttl_config() -> ast.StateTtlConfig:
    """The TTL arms' config: refreshed on read, incremental cleanup (Flink's default size)."""
    return (ast.StateTtlConfig.new_builder(TTL_MS)
            .set_update_type(ast.UpdateType.ON_READ_AND_WRITE)
            .cleanup_incrementally(5, False).build())


class TtlCounter(CallbackCounter):
    """CallbackCounter whose count has `ttl` (None: no TTL)."""

    def __init__(self, ttl: ast.StateTtlConfig | None) -> None:
        self.ttl = ttl

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.count = ctx.get_state(ast.ValueStateDescriptor("count", ttl=self.ttl))


@scenario("ttl", "keyed counter with state TTL on vs off, heap and RocksDB")
def ttl(bench: Bench) -> dict[str, Any]:
    args = bench.args
    n_records = args.records or (200_000 if bench.quick else 1_000_000)
    n_keys = args.keys or min(n_records, 100_000)
    repeats = args.repeats or (1 if bench.quick else TTL_ROUNDS)
    max_seconds = args.max_seconds or (10.0 if bench.quick else 30.0)
    if n_records < n_keys:
        sys.exit(f"--records ({n_records}) must be >= --keys ({n_keys})")
    keys = overhead_keys(n_records, n_keys, seed=args.seed)
    choose = sample_chooser(keys, n_keys, args.seed, PROBE_PRESENT, PROBE_ABSENT)
    options = ast.RocksDBOptions(
        write_buffer_bytes=args.write_buffer_bytes or ROCKSDB_WRITE_BUFFER_BYTES,
        **inplace_field(args))
    heap_config = bench.config()
    rocksdb_config = bench.config(batch_size=ROCKSDB_BATCH_SIZE,
                                  max_in_flight=ROCKSDB_MAX_IN_FLIGHT)

    def arm(on_rocksdb: bool, with_ttl: bool) -> Callable[[float], RunResult]:
        def run(deadline: float) -> RunResult:
            function = TtlCounter(ttl_config() if with_ttl else None)
            probe = _probe(function, keys, choose)
            with tempfile.TemporaryDirectory(prefix="asyncstate-bench-ttl-") as tmp:
                backend: Any = ast.RocksDBBackend(
                    Path(tmp) / "db", options=options, io_parallelism=ROCKSDB_IO_PARALLELISM
                ) if on_rocksdb else ast.HeapBackend()
                fed, seconds, metrics, counts = bench.run_async(run_operator(
                    bench, function, backend, keys, deadline,
                    config=rocksdb_config if on_rocksdb else heap_config, after=probe))
            sample = set(choose(fed))
            ok, detail = check_counts(counts, Counter(k for k in keys[:fed] if k in sample))
            return RunResult(fed, seconds, fed < n_records, ok, detail, metrics)
        return run

    names = {(False, False): "heap, TTL off", (False, True): "heap, TTL on",
             (True, False): "rocksdb, TTL off", (True, True): "rocksdb, TTL on"}
    arms = {name: arm(on_rocksdb, with_ttl) for (on_rocksdb, with_ttl), name in names.items()}
    params = {"records": n_records, "keys": n_keys, "repeats": repeats,
              "max_seconds_per_run": max_seconds, "seed": args.seed,
              "function": "CallbackCounter (ValueState read-modify-write, callback style)",
              "ttl": {"ttl_ms": TTL_MS, "update_type": "ON_READ_AND_WRITE",
                      "cleanup": "incrementally(5, False)",
                      "time": "processing time, the system clock"},
              "rocksdb": {"io_parallelism": ROCKSDB_IO_PARALLELISM,
                          "options": dataclasses.asdict(options)},
              "config": {"heap": dataclasses.asdict(heap_config),
                         "rocksdb": dataclasses.asdict(rocksdb_config)}}
    bench.console.print(f"[bold]ttl[/]: keyed counter, {n_records:,} records over {n_keys:,} "
                        f"keys, TTL {TTL_MS:,} ms refreshed on read, {repeats} rounds, at "
                        f"most {max_seconds:g} s per run")
    bench.console.print(bench.describe_environment())
    runs, errors = run_rounds(bench, arms, repeats=repeats, max_seconds=max_seconds,
                              records=n_records)
    best = {name: best_of(runs[name]) for name in arms}
    table = Table(title=f"ttl: keyed counter, {n_records:,} records / {n_keys:,} keys "
                        f"({repeats} rounds)")
    for column, justify in (("arm", "left"), ("best records/s", "right"),
                            ("TTL cost (off / on), median of rounds", "right"),
                            ("per round", "right"), ("of the best runs", "right"),
                            ("goal", "left"), ("result", "left")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    arms_json: dict[str, Any] = {}
    all_ok = True
    for (on_rocksdb, with_ttl), name in names.items():
        mine = best[name]
        off = best[names[on_rocksdb, False]]
        best_cost = off.rate / mine.rate if with_ttl and mine is not None and off is not None \
            and mine.rate > 0 else None
        # Round i's TTL-on run against round i's TTL-off run (a round runs the four arms one
        # after the other: heap off, heap on, RocksDB off, RocksDB on).
        rounds = [a.rate / b.rate for a, b in zip(runs[names[on_rocksdb, False]], runs[name],
                                                  strict=False)
                  if with_ttl and a.answer_ok and b.answer_ok and b.rate > 0]
        cost = statistics.median(rounds) if rounds else None
        wrong = [r for r in runs[name] if not r.answer_ok]
        passed: bool | None = None
        if name in errors:
            result_text = "[red]ERROR (traceback below)[/]"
        elif wrong:
            result_text = f"[red]WRONG ANSWER: {wrong[0].answer_detail}[/]"
        elif not with_ttl:
            result_text = "answer ok"
        elif cost is None:
            result_text = "[yellow]no figure to compare with[/]"
        else:
            passed = cost <= TTL_GOAL
            result_text = "[green]pass[/]" if passed else "[red]FAIL[/]"
        if name in errors or wrong:
            all_ok = False
        if mine is not None and mine.bounded:
            result_text += f" (time-bounded: {mine.records:,} rec)"
        table.add_row(name, fmt_rate(mine.rate) if mine is not None else "-",
                      f"{cost:.2f}x" if cost is not None else "-",
                      " ".join(f"{r:.2f}" for r in rounds) or "-",
                      f"{best_cost:.2f}x" if best_cost is not None else "-",
                      f"<= {TTL_GOAL:g}x" if with_ttl else "-", result_text)
        arms_json[name] = {
            "best_records_per_s": mine.rate if mine is not None else None,
            "ttl_cost": cost, "ttl_cost_per_round": rounds, "ttl_cost_of_best_runs": best_cost,
            "goal_ttl_cost": TTL_GOAL if with_ttl else None,
            "goal_passed": passed, "error": errors.get(name),
            "runs": [dataclasses.asdict(r) | {"records_per_s": r.rate} for r in runs[name]],
        }
    bench.console.print(table)
    print_errors(bench, errors)
    return {"scenario": "ttl", "ok": all_ok, "params": params,
            "environment": bench.environment(), "arms": arms_json}


# -- latency, skew, backpressure: the experiment machinery ------------------------------------
#
# These scenarios run `asyncstate.experiments` (the machinery of `asyncstate experiment
# backpressure`): the keyed counter against SimulatedRemoteBackend over the heap, each run
# bounded in time, its answer read back, its Little's-law figures checked.

LATENCIES_MS = (0.0, 0.2, 1.5, 5.0, 23.0)
LATENCY_GOALS = {"vs 0 ms": 0.8, "vs sync": 300.0, "vs bound": 0.8}  # at 1.5, 1.5 and 23 ms
SKEW_CACHE_SHARES = (0.0, 0.01, 0.10)
SKEW_GOAL = 0.8  # skewed: minimum ratio to min(uniform, hot-key bound)
BACKPRESSURE_GOALS = {"ratio_to_bound": 0.8, "rss_growth_mb": 200.0}


class HashedKeys(Sequence[int]):
    """`n` keys in 0..n_keys-1, computed from their position (a multiplicative hash): a
    source of millions of records that takes no memory."""

    def __init__(self, n: int, n_keys: int) -> None:
        self.n, self.n_keys = n, n_keys

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n))]
        return (i * 2654435761 + 12345) % 4294967291 % self.n_keys


def experiment_runs(bench: Bench, jobs: dict[str, Callable[[], Any]], repeats: int
                    ) -> tuple[dict[str, Any], dict[str, str]]:
    """Run every job `repeats` times in rounds; the best run (highest throughput, answer
    read back right or not checked) of each, and the traceback of each that crashed."""
    best: dict[str, Any] = {}
    errors: dict[str, str] = {}
    bench.start_progress(total=len(jobs) * repeats)
    try:
        for round_no in range(repeats):
            for name, job in jobs.items():
                if name in errors:
                    bench.tick(1)
                    continue
                bench.describe(f"{name} ({round_no + 1}/{repeats})")
                gc.collect()
                try:
                    result = job()
                except Exception:  # noqa: BLE001 - reported as crashed, the others run on
                    errors[name] = traceback.format_exc()
                    bench.tick(1)
                    continue
                bench.tick(1)
                if result.answer_ok is False:
                    errors[name] = f"wrong answer: {result.answer_detail}"
                elif name not in best or result.throughput > best[name].throughput:
                    best[name] = result
    finally:
        bench.stop_progress()
    return best, errors


def _result_json(result: Any) -> dict[str, Any]:
    row = result.row()
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in row.items()}


def print_errors(bench: Bench, errors: dict[str, str]) -> None:
    """The traceback (or wrong answer) of each arm that failed, under the table."""
    for name, tb in errors.items():
        bench.console.print(f"[red bold]{name} crashed:[/]")
        bench.console.print(tb, markup=False, highlight=False)


def _goal_text(passed: bool | None) -> str:
    return "-" if passed is None else "[green]pass[/]" if passed else "[red]FAIL[/]"


@scenario("latency", "keyed counter behind 0-23 ms of store latency: asyncstate vs sync vs bound")
def latency(bench: Bench) -> dict[str, Any]:
    args = bench.args
    seconds = args.max_seconds or (1.0 if bench.quick else 3.0)
    repeats = args.repeats or (1 if bench.quick else 3)
    n_keys = args.keys or 100_000
    stream = key_streams.key_stream("uniform", n_keys, 2_000_000, seed=args.seed)
    jobs: dict[str, Callable[[], Any]] = {}
    for latency_ms in LATENCIES_MS:
        point = Point(latency_ms=latency_ms, io_parallelism=2, batch_size=1000,
                      max_in_flight=6000, keys=n_keys)
        for arm in ("sync baseline", "asyncstate"):
            jobs[f"{arm} @ {latency_ms:g} ms"] = functools.partial(
                run_point, ARMS[arm], point, stream, 1 / n_keys, seconds=seconds,
                seed=args.seed)
    bench.console.print(f"[bold]latency[/]: keyed counter over {n_keys:,} uniform keys, "
                        f"SimulatedRemoteBackend(HeapBackend()), io_parallelism 2, batch 1000,"
                        f" max_in_flight 6000; best of {repeats}, {seconds:g} s per run")
    bench.console.print(bench.describe_environment())
    best, errors = experiment_runs(bench, jobs, repeats)
    zero = best.get("asyncstate @ 0 ms")
    table = Table(title=f"latency: keyed counter (best of {repeats})")
    for column in ("latency", "measured", "sync rec/s", "asyncstate rec/s", "vs 0 ms",
                   "vs sync", "bound", "vs bound", "peak in flight", "goal", "result"):
        table.add_column(column, justify="left" if column in ("goal", "result") else "right")
    rows_json = []
    all_passed: list[bool] = []
    for latency_ms in LATENCIES_MS:
        sync, mine = best.get(f"sync baseline @ {latency_ms:g} ms"), \
            best.get(f"asyncstate @ {latency_ms:g} ms")
        vs_zero = mine.throughput / zero.throughput if mine and zero else None
        vs_sync = mine.throughput / sync.throughput if mine and sync else None
        vs_bound = mine.ratio_to_bound if mine else None
        goals, checks = [], []
        if latency_ms == 1.5:
            goals = [f">= {LATENCY_GOALS['vs 0 ms']:g}x 0 ms",
                     f">= {LATENCY_GOALS['vs sync']:g}x sync"]
            checks = [vs_zero is not None and vs_zero >= LATENCY_GOALS["vs 0 ms"],
                      vs_sync is not None and vs_sync >= LATENCY_GOALS["vs sync"]]
        elif latency_ms == 23.0:
            goals = [f">= {LATENCY_GOALS['vs bound']:g}x bound"]
            checks = [vs_bound is not None and vs_bound >= LATENCY_GOALS["vs bound"]]
        peak_ok = mine is None or mine.in_flight_peak <= mine.point.max_in_flight
        checks.append(peak_ok)
        passed = all(checks) if goals else (None if peak_ok else False)
        if passed is not None:
            all_passed.append(passed)
        table.add_row(
            f"{latency_ms:g} ms",
            f"{mine.measured_store_latency_ms:.2f} ms" if mine else "-",
            fmt_rate(sync.throughput) if sync else "-",
            fmt_rate(mine.throughput) if mine else "-",
            _ratio_text(vs_zero), _ratio_text(vs_sync),
            fmt_rate(mine.bound) if mine and math.isfinite(mine.bound) else "-",
            _ratio_text(vs_bound), f"{mine.in_flight_peak:,}" if mine else "-",
            " / ".join(goals) or "peak <= max_in_flight", _goal_text(passed))
        rows_json.append({"latency_ms": latency_ms, "ratio_to_0_ms": vs_zero,
                          "ratio_to_sync": vs_sync, "ratio_to_bound": vs_bound,
                          "goal_passed": passed,
                          "sync": _result_json(sync) if sync else None,
                          "asyncstate": _result_json(mine) if mine else None})
    table.caption = ("measured: mean latency each store call actually took (a pool thread "
                     "sleeps, then waits for the GIL); bound: min(N, R*B)/(k*L) with k = 2")
    bench.console.print(table)
    print_errors(bench, errors)
    return {"scenario": "latency", "ok": not errors, "goals_passed": all(all_passed),
            "params": {"keys": n_keys, "seconds_per_run": seconds, "repeats": repeats,
                       "latencies_ms": list(LATENCIES_MS), "seed": args.seed},
            "environment": bench.environment(), "rows": rows_json}


@scenario("skew", "Zipf 0.99 over 1 M keys at 1.5 ms, cache 0 / 1 / 10 % of keys (written "
                  "through and back) vs uniform")
def skew(bench: Bench) -> dict[str, Any]:
    args = bench.args
    seconds = args.max_seconds or (1.0 if bench.quick else 3.0)
    repeats = args.repeats or (1 if bench.quick else 3)
    n_keys = args.keys or 1_000_000
    theta = 0.99
    records = 2_000_000
    uniform = key_streams.key_stream("uniform", n_keys, records, seed=args.seed)
    zipf = key_streams.key_stream("zipf", n_keys, records, theta=theta, seed=args.seed)
    p_max = key_streams.hottest_share("zipf", n_keys, theta)
    base = Point(latency_ms=1.5, keys=n_keys, zipf_theta=theta)
    jobs: dict[str, Callable[[], Any]] = {
        "uniform": functools.partial(run_point, ARMS["asyncstate"], base, uniform, 1 / n_keys,
                                     seconds=seconds, seed=args.seed)}
    for share in SKEW_CACHE_SHARES:
        entries = int(n_keys * share)
        point = dataclasses.replace(base, distribution="zipf", cache_entries=entries)
        arm = ARMS["asyncstate+cache" if entries else "asyncstate"]
        jobs[f"zipf, cache {share:.0%}"] = functools.partial(
            run_point, arm, point, zipf, p_max, seconds=seconds, seed=args.seed)
        if entries:
            jobs[f"zipf, write-back cache {share:.0%}"] = functools.partial(
                run_point, arm, dataclasses.replace(point, cache_write_back=True), zipf,
                p_max, seconds=seconds, seed=args.seed)
    bench.console.print(f"[bold]skew[/]: keyed counter over {n_keys:,} keys, Zipf {theta} "
                        f"(hottest key {p_max:.1%} of records) vs uniform, latency 1.5 ms, "
                        f"best of {repeats}, {seconds:g} s per run")
    bench.console.print(bench.describe_environment())
    best, errors = experiment_runs(bench, jobs, repeats)
    ref = best.get("uniform")
    table = Table(title=f"skew: Zipf {theta} over {n_keys:,} keys (best of {repeats})")
    for column in ("arm", "rec/s", "hit rate", "hot-key bound", "min(uniform, hot)", "ratio",
                   "p99 ms", "goal", "result"):
        table.add_column(column, justify="left" if column in ("arm", "goal", "result")
                         else "right")
    arms_json = {}
    passes: list[bool] = []
    for name in jobs:
        r = best.get(name)
        hot = r.hot_key_bound if r else None
        target = min(ref.throughput, hot) if r and ref and hot is not None else None
        ratio = r.throughput / target if r and target else None
        passed = None if name == "uniform" or ratio is None else ratio >= SKEW_GOAL
        if passed is not None:
            passes.append(passed)
        table.add_row(name, fmt_rate(r.throughput) if r else "-",
                      f"{r.cache_hit_rate:.1%}" if r and r.cache_hit_rate is not None else "-",
                      fmt_rate(hot) if hot is not None and math.isfinite(hot) else "-",
                      fmt_rate(target) if target else "-", _ratio_text(ratio),
                      f"{r.latency_ms['p99']:.3g}" if r else "-",
                      "-" if name == "uniform" else f">= {SKEW_GOAL:g}x", _goal_text(passed))
        arms_json[name] = {"ratio_to_min_uniform_hot": ratio, "goal_passed": passed,
                           "result": _result_json(r) if r else None, "error": errors.get(name)}
    table.caption = ("hot-key bound: 1/(p_max*k*L), the hottest key's records one after "
                     "another; with the cache the hottest key is a hit and its writes are "
                     "buffered, so no such bound applies")
    bench.console.print(table)
    print_errors(bench, errors)
    return {"scenario": "skew", "ok": not errors, "goals_passed": all(passes),
            "params": {"keys": n_keys, "theta": theta, "p_max": p_max,
                       "seconds_per_run": seconds, "repeats": repeats, "seed": args.seed},
            "environment": bench.environment(), "arms": arms_json}


@scenario("backpressure", "store slower than the source: 5 ms, io_parallelism 1, batch 100")
def backpressure(bench: Bench) -> dict[str, Any]:
    args = bench.args
    seconds = args.max_seconds or (3.0 if bench.quick else 10.0)
    repeats = args.repeats or 1
    records = args.records or 5_000_000
    n_keys = args.keys or 100_000
    point = Point(latency_ms=5.0, io_parallelism=1, batch_size=100, max_in_flight=6000,
                  keys=n_keys)
    source = HashedKeys(records, n_keys)
    jobs: dict[str, Callable[[], Any]] = {"asyncstate": functools.partial(
        run_point, ARMS["asyncstate"], point, source, 1 / n_keys, seconds=seconds,
        seed=args.seed)}
    bench.console.print(f"[bold]backpressure[/]: keyed counter, a source of {records:,} records "
                        f"over {n_keys:,} keys, latency 5 ms, io_parallelism 1, batch 100, "
                        f"max_in_flight 6000, {seconds:g} s")
    bench.console.print(bench.describe_environment())
    best, errors = experiment_runs(bench, jobs, repeats)
    r = best.get("asyncstate")
    table = Table(title="backpressure: the store is slower than the source")
    for column in ("records", "rec/s", "bound", "vs bound", "peak in flight", "blocked s",
                   "RSS growth", "goals", "result"):
        table.add_column(column, justify="left" if column in ("goals", "result") else "right")
    passed = None
    growth = None
    if r is not None:
        growth = r.rss_peak_mb - r.rss_start_mb
        passed = (r.in_flight_peak <= point.max_in_flight
                  and growth <= BACKPRESSURE_GOALS["rss_growth_mb"]
                  and (r.ratio_to_bound or 0) >= BACKPRESSURE_GOALS["ratio_to_bound"])
        table.add_row(f"{r.records:,}", fmt_rate(r.throughput), fmt_rate(r.bound),
                      _ratio_text(r.ratio_to_bound), f"{r.in_flight_peak:,}",
                      f"{r.blocked_seconds:.1f}", f"{growth:.0f} MB",
                      "peak <= 6,000; RSS <= 200 MB; >= 0.8x bound", _goal_text(passed))
    table.caption = (f"the source offers {records:,} records as fast as admitted; the run "
                     f"stops after {seconds:g} s (at the bound, {records:,} records would take"
                     f" {records / r.bound if r else float('nan'):,.0f} s)")
    bench.console.print(table)
    print_errors(bench, errors)
    return {"scenario": "backpressure", "ok": not errors, "goals_passed": passed,
            "params": {"records_offered": records, "keys": n_keys, "seconds": seconds,
                       "latency_ms": 5.0, "io_parallelism": 1, "batch_size": 100,
                       "max_in_flight": 6000},
            "rss_growth_mb": growth, "environment": bench.environment(),
            "result": _result_json(r) if r else None}


# -- command line ---------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="asyncstate benchmarks (scenarios and goals: shared/design/BENCHMARKS.md)")
    parser.add_argument("scenario", choices=sorted(SCENARIOS),
                        help="; ".join(f"{s.name}: {s.summary}" for s in SCENARIOS.values())
                        .replace("%", "%%"))  # argparse formats help with %
    parser.add_argument("--quick", action="store_true", help="a smaller run, under 30 s")
    parser.add_argument("--records", type=_positive_int, default=None,
                        help="records per run (default: the scenario's)")
    parser.add_argument("--keys", type=_positive_int, default=None,
                        help="distinct keys (default: the scenario's)")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                        help="event loop for asyncstate arms (default: uvloop)")
    parser.add_argument("--repeats", type=_positive_int, default=None,
                        help="runs per arm, the best is reported (default 3, --quick 1)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="time bound per run; the rate covers the records done by then")
    parser.add_argument("--seed", type=int, default=1, help="seed of the key order")
    parser.add_argument("--cache-keys", type=_int_list, default=None,
                        help="rocksdb: instead of the main table, the state-cache table at "
                             "these numbers of keys, e.g. 100,1000,1000000 (heap, RocksDB and "
                             "RocksDB + cache of 1 %% of the keys or 10,000 entries each)")
    parser.add_argument("--gc-threshold", type=_gc_threshold, default="default",
                        help="AsyncStateConfig.gc_threshold of the overhead and rocksdb arms, "
                             "held by every timers arm: "
                             "an int >= 1, auto or none (default: the config's default)")
    parser.add_argument("--write-buffer-bytes", type=_positive_int, default=None,
                        help="RocksDBOptions.write_buffer_bytes of the rocksdb arms "
                             f"(default: {ROCKSDB_WRITE_BUFFER_BYTES})")
    parser.add_argument("--memtable-bloom-ratio", type=float, default=None,
                        help="RocksDBOptions.memtable_bloom_ratio of the rocksdb arms "
                             "(default: the option's default; 0 disables the filter)")
    parser.add_argument("--inplace-updates", choices=("on", "off"), default=None,
                        help="RocksDBOptions.inplace_updates of the rocksdb and ttl "
                             "scenarios' RocksDB arms (default: the option's default, on)")
    parser.add_argument("--max-in-flight", type=_positive_int, default=None,
                        help="AsyncStateConfig.max_in_flight of the overhead and rocksdb arms "
                             f"(default: {ROCKSDB_MAX_IN_FLIGHT} for rocksdb, the config's "
                             "default for overhead)")
    return parser.parse_args(argv)


def _gc_threshold(text: str) -> int | str | None:
    word = text.lower()
    if word in ("default", "auto"):
        return word  # "default": leave the config's default
    return None if word == "none" else _positive_int(text)


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(_positive_int(part) for part in text.split(",") if part)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # Quiet library logs (structlog prints every level unless configured).
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    console = Console()
    if not console.is_terminal:  # piped or redirected: wide enough for the widest table
        console = Console(width=150)
    bench = Bench(args, console)
    result = SCENARIOS[args.scenario].run(bench)
    path = write_results(args.scenario, result)
    console.print(f"raw figures: {path.relative_to(ROOT)}")
    if not result["ok"]:
        console.print("[red bold]some arms crashed or computed a wrong answer[/]")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
