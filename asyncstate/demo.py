"""Demo job: per-user click statistics on the embedded heap backend.

Run with ``python -m asyncstate.demo [--records N] [--users U] [--seed S]`` (N and U are
integers >= 1). Each click updates three states of its user (a counter, a running total
through a ReducingState and a map of pages seen); every 1000th click of a user emits a
milestone. At the end the job prints the top users and a short metrics table.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Callable
from typing import Any

import asyncstate as ast

__all__ = ["ClickStats", "main"]


class ClickStats(ast.KeyedProcessFunction):
    """Per user: click count, total dwell time and pages seen; emits milestones, and a
    summary when a ("report", user) record arrives."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.clicks = ctx.get_state(ast.ValueStateDescriptor("clicks"))
        self.dwell = ctx.get_reducing_state(
            ast.ReducingStateDescriptor("dwell_ms", lambda a, b: a + b))
        self.pages = ctx.get_map_state(ast.MapStateDescriptor("pages"))

    async def process_element(self, value: Any, ctx: ast.RecordContext) -> None:
        if value[0] == "report":
            clicks = await self.clicks.value() or 0
            dwell = await self.dwell.get() or 0
            ctx.emit(("summary", ctx.current_key, clicks, dwell))
            return
        _, _, page, dwell_ms = value
        n = (await self.clicks.value() or 0) + 1
        self.clicks.update(n)  # not awaited: later reads of this record still see it
        self.dwell.add(dwell_ms)
        seen = await self.pages.get(page)
        self.pages.put(page, (seen or 0) + 1)
        if n % 1000 == 0:
            ctx.emit(("milestone", ctx.current_key, n))


def _events(records: int, users: int, seed: int) -> list[tuple[str, str, str, int]]:
    rng = random.Random(seed)
    pages = [f"/page/{i}" for i in range(50)]
    return [("click", f"user-{int(rng.paretovariate(1.2)) % users}", rng.choice(pages),
             rng.randint(50, 5000)) for _ in range(records)]


async def _run(events: list[tuple[str, str, str, int]]
               ) -> tuple[list[Any], dict[str, Any], float]:
    operator = ast.KeyedOperator(ClickStats(), key_selector=lambda e: e[1],
                                 backend=ast.HeapBackend())
    async with operator:
        started = time.perf_counter()
        for event in events:
            await operator.process(event)
        await operator.drain()
        seconds = time.perf_counter() - started
        metrics = operator.metrics
        for user in sorted({e[1] for e in events}):
            await operator.process(("report", user))
    return operator.outputs(), metrics, seconds


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


def main(argv: list[str] | None = None) -> int:
    """Run the demo and print its results; 0 when the per-user counts match a plain count.

    Bad arguments exit through argparse with status 2 and a message naming the option.
    """
    parser = argparse.ArgumentParser(prog="python -m asyncstate.demo", description=__doc__)
    # At least one record: an empty run has no users to report and no meaningful rate.
    parser.add_argument("--records", type=_int_at_least(1), default=200_000, metavar="N",
                        help="clicks to generate, an integer >= 1 (default: %(default)s)")
    # At least one user: user ids are drawn modulo --users.
    parser.add_argument("--users", type=_int_at_least(1), default=5_000, metavar="U",
                        help="user ids to draw clicks from, an integer >= 1; fewer may "
                             "appear in the output (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=7, metavar="S",
                        help="seed of the generated clicks (default: %(default)s)")
    args = parser.parse_args(argv)
    events = _events(args.records, args.users, args.seed)
    outputs, metrics, seconds = asyncio.run(_run(events))
    milestones = [o for o in outputs if o[0] == "milestone"]
    summary = {o[1]: (o[2], o[3]) for o in outputs if o[0] == "summary"}
    expected: dict[str, int] = {}
    for _, user, _, _ in events:
        expected[user] = expected.get(user, 0) + 1
    ok = summary.keys() == expected.keys() and all(
        summary[u][0] == n for u, n in expected.items())
    print(f"asyncstate demo: {args.records:,} clicks of {len(expected):,} users "
          f"on HeapBackend in {seconds:.2f} s ({args.records / seconds:,.0f} records/s)")
    print(f"milestones emitted: {len(milestones):,}; per-user counts "
          f"{'match' if ok else 'DO NOT match'} a plain count")
    print("\ntop users       clicks   dwell (s)")
    for user, (clicks, dwell) in sorted(summary.items(), key=lambda kv: -kv[1][0])[:5]:
        print(f"  {user:<12} {clicks:>8,} {dwell / 1000:>11,.1f}")
    print("\nmetric              value")
    for name in ("records_in", "records_done", "in_flight_peak", "requests", "batches"):
        print(f"  {name:<17} {metrics[name]:>8,}")
    if metrics["batches"] == 0:
        print("    (HeapBackend answers each state request at once: nothing to batch)")
    print(f"  {'blocked_seconds':<17} {metrics['blocked_seconds']:>8.3f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
