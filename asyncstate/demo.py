"""Demo job: per-user click statistics, the same job on the heap backend and on RocksDB.

Run with ``asyncstate demo`` or ``python -m asyncstate.demo`` (options: ``--records N``,
``--users U``, ``--seed S``, ``--backend heap|rocksdb|remote|all``). Each click updates three
states of its user: a counter (ValueState), the total dwell time (ReducingState) and the
pages seen (MapState); a ("report", user) record emits the user's summary. The report shows
the backends side by side, what their metrics mean in this run, the order in which a few users'
records ran, and the top users.

Exit status: 0 when every backend kept each user's records in arrival order and gave the
results of a plain sequential count; 1 otherwise; 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import random
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import Any

import asyncstate as ast
from asyncstate.config import DEFAULT_MAX_IN_FLIGHT

__all__ = ["BACKENDS", "ClickStats", "OrderProbe", "add_arguments", "main", "run"]

BACKENDS = ("heap", "rocksdb", "remote")
_NAMES = {"heap": "HeapBackend", "rocksdb": "RocksDBBackend",
          "remote": "SimulatedRemoteBackend"}
REMOTE_LATENCY_MS = 1.0  # per batch, for the simulated remote store
_SKEW = 0.5  # Zipf exponent of the users' activity
_TRACE_STEPS = 14
_WIDTH = 96  # of the report's wrapped paragraphs
_TRACED_USERS = 3

Click = tuple[str, str, str, int, int]  # ("click", user, page, dwell_ms, arrival number)


class OrderProbe:
    """What a run did, as seen from inside the function: the order in which records started,
    the clicks count each wrote, and the steps of the records of the `traced` users."""

    __slots__ = ("started", "steps", "traced", "written")

    def __init__(self, traced: Collection[str]) -> None:
        self.traced = frozenset(traced)
        self.started: list[int] = []  # arrival numbers, in the order the records started
        # ("start" or "finish", arrival number, user, clicks written (finish) or how many
        # records had started before (start))
        self.steps: list[tuple[str, int, str, int]] = []
        self.written: dict[int, int] = {}  # arrival number -> clicks written


class ClickStats(ast.KeyedProcessFunction):
    """Per user: click count, total dwell time and pages seen; emits the user's summary when a
    ("report", user) record arrives."""

    def __init__(self, probe: OrderProbe | None = None) -> None:
        self.probe = probe

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.clicks = ctx.get_state(ast.ValueStateDescriptor("clicks"))
        self.dwell = ctx.get_reducing_state(
            ast.ReducingStateDescriptor("dwell_ms", lambda a, b: a + b))
        self.pages = ctx.get_map_state(ast.MapStateDescriptor("pages"))

    async def process_element(self, value: Any, ctx: ast.RecordContext) -> None:
        if value[0] == "report":
            await self._report(ctx)
            return
        _, user, page, dwell_ms, arrival = value
        probe = self.probe
        if probe is not None:
            if user in probe.traced:
                probe.steps.append(("start", arrival, user, len(probe.started)))
            probe.started.append(arrival)
        # Both reads are issued before either is awaited, so they travel in one batch.
        clicks, seen = await ast.combine_all([self.clicks.value(), self.pages.get(page)])
        n = (clicks or 0) + 1
        # Writes are not awaited: they join the next batch, and later reads of this key
        # (by this record or the next) see them.
        self.clicks.update(n)
        self.dwell.add(dwell_ms)
        self.pages.put(page, (seen or 0) + 1)
        if probe is not None:
            probe.written[arrival] = n
            if user in probe.traced:
                probe.steps.append(("finish", arrival, user, n))

    async def _report(self, ctx: ast.RecordContext) -> None:
        clicks = await self.clicks.value() or 0
        dwell = await self.dwell.get() or 0
        pages = await (await self.pages.entries()).to_list()
        top_page, top_visits = max(pages, key=lambda kv: (kv[1], kv[0]), default=("-", 0))
        ctx.emit(("summary", ctx.current_key, clicks, dwell, len(pages), top_page, top_visits))


def _events(records: int, users: int, seed: int) -> list[Click]:
    """`records` clicks of users drawn from `users` ids with a Zipf-like skew (user-0 the
    most active, then user-1, ...), each on one of 50 pages."""
    rng = random.Random(seed)
    pages = [f"/page/{i}" for i in range(50)]
    # Inverse of the continuous Zipf CDF with exponent _SKEW: a few users get many clicks,
    # most get a few, without a weight table per user id.
    span = (users + 1) ** (1 - _SKEW) - 1
    return [("click", f"user-{_user_rank(rng.random(), span, users)}", rng.choice(pages),
             rng.randint(50, 5000), arrival) for arrival in range(1, records + 1)]


def _user_rank(u: float, span: float, users: int) -> int:
    return min(int((u * span + 1) ** (1 / (1 - _SKEW))) - 1, users - 1)


@dataclasses.dataclass
class BackendRun:
    """One backend's run of the job: timings, metrics, outputs and what the probe saw."""

    backend: str
    seconds: float
    metrics: dict[str, Any]
    summaries: dict[str, tuple[Any, ...]]
    probe: OrderProbe

    @property
    def name(self) -> str:
        return _NAMES[self.backend]


@contextmanager
def _backend(name: str) -> Iterator[Any]:
    if name == "heap":
        yield ast.HeapBackend()
    elif name == "remote":
        yield ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=REMOTE_LATENCY_MS)
    else:
        with tempfile.TemporaryDirectory(prefix="asyncstate-demo-") as path:
            yield ast.RocksDBBackend(path)


async def _run(backend_name: str, events: list[Click], traced: Collection[str]) -> BackendRun:
    probe = OrderProbe(traced)
    with _backend(backend_name) as backend:
        operator = ast.KeyedOperator(ClickStats(probe), key_selector=lambda e: e[1],
                                     backend=backend)
        async with operator:
            started = time.perf_counter()
            for event in events:
                await operator.process(event)
            await operator.drain()
            seconds = time.perf_counter() - started
            metrics = operator.metrics
            for user in sorted({e[1] for e in events}):
                await operator.process(("report", user))
    outputs = operator.outputs()
    return BackendRun(
        backend=backend_name, seconds=seconds, metrics=metrics,
        summaries={o[1]: tuple(o[2:]) for o in outputs if o[0] == "summary"}, probe=probe)


def _order_problems(run: BackendRun, events: list[Click]) -> list[str]:
    """Where the k-th click of a user (in arrival order) did not write clicks = k."""
    seen: dict[str, int] = {}
    problems = []
    for _, user, _, _, arrival in events:
        k = seen[user] = seen.get(user, 0) + 1
        wrote = run.probe.written.get(arrival)
        if wrote != k:
            problems.append(f"{run.name}: click #{arrival} was {user}'s click {k} but wrote "
                            f"clicks = {wrote}")
    return problems


def _count_problems(run: BackendRun, events: list[Click]) -> list[str]:
    """Where a user's summary differs from a plain count of the clicks."""
    clicks: dict[str, int] = {}
    dwell: dict[str, int] = {}
    for _, user, _, dwell_ms, _ in events:
        clicks[user] = clicks.get(user, 0) + 1
        dwell[user] = dwell.get(user, 0) + dwell_ms
    got = {user: (s[0], s[1]) for user, s in run.summaries.items()}
    expected = {user: (clicks[user], dwell[user]) for user in clicks}
    return [f"{run.name}: {user} has clicks and dwell {got.get(user)}, a plain count gives "
            f"{expected.get(user)}" for user in sorted(got.keys() | expected.keys())
            if got.get(user) != expected.get(user)]


def _table(runs: list[BackendRun], rows: list[tuple[str, Callable[[BackendRun], str]]]
           ) -> list[str]:
    width = max(16, *(len(r.name) + 2 for r in runs))
    lines = [" " * 20 + "".join(f"{r.name:>{width}}" for r in runs)]
    lines += [f"  {label:<18}" + "".join(f"{cell(r):>{width}}" for r in runs)
              for label, cell in rows]
    return lines


def _metrics_table(runs: list[BackendRun], order_ok: dict[str, bool]) -> list[str]:
    def metric(name: str, fmt: str = ",") -> Callable[[BackendRun], str]:
        return lambda r: format(r.metrics[name], fmt)

    return _table(runs, [
        ("seconds", lambda r: f"{r.seconds:.2f}"),
        ("records/s", lambda r: f"{r.metrics['records_done'] / r.seconds:,.0f}"),
        ("records_done", metric("records_done")),
        ("requests", metric("requests")),
        ("batches", metric("batches")),
        ("max_batch_size", metric("max_batch_size")),
        ("in_flight_peak", metric("in_flight_peak")),
        ("blocked_seconds", metric("blocked_seconds", ".3f")),
        ("per-user order", lambda r: "kept" if order_ok[r.backend] else "BROKEN"),
    ])


def _para(label: str, text: str) -> str:
    return textwrap.fill(text, width=_WIDTH, initial_indent=f"  {label:<17}",
                         subsequent_indent=" " * 19)


def _explain(runs: list[BackendRun]) -> list[str]:
    """The metrics in words, with this run's numbers."""
    first = runs[0].metrics
    per_click = first["requests"] / max(first["records_done"], 1)
    lines = ["What the numbers mean in this run:",
             _para("requests", f"the state reads and writes the clicks issued, "
                               f"{per_click:.0f} per click.")]
    for r in runs:
        m = r.metrics
        if m["batches"] == 0:
            lines.append(_para("batches", f"{r.name}: none. It answers each request as it is "
                                          "issued; with no I/O to wait for there is nothing "
                                          "to batch."))
        else:
            lines.append(_para("batches", f"{r.name}: {m['batches']:,} calls to the store, "
                                          f"{m['requests'] / m['batches']:,.0f} requests each "
                                          f"on average (at most {m['max_batch_size']:,}): the "
                                          "reads and writes of many records of many users "
                                          "went together."))
    peaks = ", ".join(f"{r.metrics['in_flight_peak']:,} on {r.name}" for r in runs)
    lines.append(_para("in_flight_peak", f"the most records admitted and not yet finished at "
                                         f"once ({peaks}; the limit, max_in_flight, is "
                                         f"{DEFAULT_MAX_IN_FLIGHT:,}, and a store with I/O "
                                         "slots admits only as many records as keep them "
                                         "busy). Records of different users overlap; two "
                                         "records of one user never do (below)."))
    blocked = ", ".join(f"{r.metrics['blocked_seconds']:.3f} s of {r.seconds:.2f} s on "
                        f"{r.name}" for r in runs)
    lines.append(_para("blocked_seconds", f"how long the loop feeding clicks waited in "
                                          f"process() for room: under max_in_flight, or "
                                          f"while the store had enough to do ({blocked}). "
                                          "The operator runs on that same thread, so this "
                                          "is the time it spent working through admitted "
                                          "records and waiting for their batches: "
                                          "back-pressure, not a stall."))
    return lines


def _trace(run: BackendRun) -> list[str]:
    """The first steps of the traced users' records, in the order they happened."""
    probe = run.probe
    lines = textwrap.wrap(
        f"Order on {run.name}, for the most active users "
        f"{', '.join(sorted(probe.traced, key=_rank))} (#: arrival number). A record starts "
        "when its user's previous record has finished; records of other users go on "
        "meanwhile:", width=_WIDTH)
    previous: dict[str, int] = {}  # user -> arrival number of its last finished record
    for kind, arrival, user, n in probe.steps[:_TRACE_STEPS]:
        if kind == "finish":
            previous[user] = arrival
            lines.append(f"  finish #{arrival:<6,} {user:<8} wrote clicks = {n}")
            continue
        after = previous.get(user)
        if after is None:
            note = "its first click"
        else:
            overtaken = sum(1 for a in probe.started[:n] if a > arrival)
            note = (f"once #{after:,} finished; {overtaken:,} later clicks of other users "
                    "started first")
        lines.append(f"  start  #{arrival:<6,} {user:<8} {note}")
    return lines


def _rank(user: str) -> int:
    return int(user.rsplit("-", 1)[1])


def _top_users(run: BackendRun) -> list[str]:
    lines = ["top users       clicks   dwell (s)  pages  most visited"]
    ranked = sorted(run.summaries.items(), key=lambda kv: (-kv[1][0], kv[0]))[:5]
    for user, (clicks, dwell, pages, top_page, visits) in ranked:
        lines.append(f"  {user:<12} {clicks:>8,} {dwell / 1000:>11,.1f} {pages:>6}  "
                     f"{top_page} ({visits:,})")
    return lines


def _rocksdb_installed() -> bool:
    return importlib.util.find_spec("rocksdict") is not None


def _backends(choice: str) -> list[str]:
    batching = "rocksdb" if _rocksdb_installed() else "remote"
    return {"both": ["heap", batching], "all": list(BACKENDS)}.get(choice, [choice])


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type=`` accepting integers >= `minimum`; argparse prefixes the option."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value}")
        return value

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options, on `parser` (the `asyncstate demo` subcommand or its own)."""
    # At least one record: an empty run has no users to report and no meaningful rate.
    parser.add_argument("--records", type=_int_at_least(1), default=20_000, metavar="N",
                        help="clicks to generate, an integer >= 1 (default: %(default)s)")
    # At least one user: user ids are drawn from 0..U-1.
    parser.add_argument("--users", type=_int_at_least(1), default=5_000, metavar="U",
                        help="user ids to draw clicks from, an integer >= 1; some users "
                             "are far more active than others, so fewer may appear "
                             "(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=7, metavar="S",
                        help="seed of the generated clicks (default: %(default)s)")
    parser.add_argument("--backend", choices=[*BACKENDS, "all"], default="both",
                        help="heap, rocksdb (needs rocksdict), remote (a simulated store "
                             f"with {REMOTE_LATENCY_MS:g} ms per batch) or all; default: "
                             "heap and rocksdb side by side (remote when rocksdict is "
                             "not installed)")


def run(args: argparse.Namespace) -> int:
    """Run the demo with parsed `args` and print its report; the exit status."""
    backends = _backends(args.backend)
    if "rocksdb" in backends and not _rocksdb_installed():
        print("asyncstate demo: the rocksdb backend needs rocksdict: pip install "
              "'asyncstate[rocksdb]' (or use --backend remote)", file=sys.stderr)
        return 2
    events = _events(args.records, args.users, args.seed)
    counts: dict[str, int] = {}
    for e in events:
        counts[e[1]] = counts.get(e[1], 0) + 1
    present = len(counts)
    traced = sorted(counts, key=lambda u: (-counts[u], u))[:_TRACED_USERS]
    runs = []
    for name in backends:
        print(f"running on {_NAMES[name]} ...", file=sys.stderr, flush=True)
        runs.append(asyncio.run(_run(name, events, traced)))
    order_problems = {r.backend: _order_problems(r, events) for r in runs}
    problems = [p for r in runs for p in order_problems[r.backend][:3]]
    problems += [p for r in runs for p in _count_problems(r, events)[:3]]
    problems += [f"{r.name} and {runs[0].name} report different summaries for some users"
                 for r in runs if r.summaries != runs[0].summaries]

    out = [f"asyncstate demo: {args.records:,} clicks of {present:,} users (user ids drawn "
           f"from {args.users:,}, seed {args.seed})",
           textwrap.fill("Each click updates three states of its user: clicks (ValueState), "
                         "dwell_ms (ReducingState), pages (MapState).", width=_WIDTH), ""]
    out += _metrics_table(runs, {b: not p for b, p in order_problems.items()})
    out += ["", *_explain(runs), ""]
    shown = next((r for r in runs if r.metrics["batches"] > 0), runs[0])
    out += [*_trace(shown), ""]
    if problems:
        out += ["", "PROBLEMS:", *(f"  {p}" for p in problems)]
    else:
        same = " and ".join(r.name for r in runs)
        out.append(textwrap.fill(f"results: {same} agree, each user's clicks were applied in "
                                 "arrival order and match a plain count", width=_WIDTH))
    out += ["", *_top_users(runs[0])]
    print("\n".join(out))
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    """``python -m asyncstate.demo``: parse `argv`, run, return the exit status (argparse
    exits with status 2 and a message naming the option for bad arguments)."""
    from asyncstate.cli import run_command

    parser = argparse.ArgumentParser(prog="python -m asyncstate.demo",
                                     description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run_command(run, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
