"""The demo job (`python -m asyncstate.demo`): its command line and printed report, and its
`ClickStats` function against a sequential model on the heap and RocksDB backends."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import asyncstate as ast
from asyncstate.demo import ClickStats, _events, main

ROOT = Path(__file__).resolve().parent.parent

# With seed 7, 8,000 clicks of 50 users give user-1 over 4,000 clicks and user-2 over 1,000,
# so two keys emit milestones (test_job_sizes_produce_milestones_of_several_users checks it).
RECORDS, USERS, SEED = 8_000, 50, 7

Event = tuple[str, str, str, int]


@pytest.fixture(scope="module")
def events() -> list[Event]:
    """The demo's own click stream at the sizes above."""
    return _events(RECORDS, USERS, SEED)


class ClickStatsProbe(ClickStats):
    """ClickStats that also answers ("pages", user) with that user's pages map as a dict."""

    async def process_element(self, value: Any, ctx: ast.RecordContext) -> None:
        if value[0] == "pages":
            entries = await self.pages.entries()
            ctx.emit(("pages", ctx.current_key, dict(await entries.to_list())))
            return
        await super().process_element(value, ctx)


async def run_job(backend: Any, events: list[Event]) -> list[Any]:
    """Every click, then a report and a pages probe per user, through one KeyedOperator.

    Unlike the demo, nothing drains between the clicks and the reports: a report must see
    every earlier click of its key because records of one key run in arrival order.
    """
    users = sorted({e[1] for e in events})
    async with ast.KeyedOperator(ClickStatsProbe(), key_selector=lambda r: r[1],
                                 backend=backend) as op:
        for event in events:
            await op.process(event)
        for user in users:
            await op.process(("report", user))
            await op.process(("pages", user))
    return op.outputs()


def model(events: list[Event]) -> dict[str, list[Any]]:
    """Per user, what the job emits when clicks are handled one at a time in order."""
    clicks: dict[str, int] = {}
    dwell: dict[str, int] = {}
    pages: dict[str, dict[str, int]] = {}
    out: dict[str, list[Any]] = {}
    for _, user, page, dwell_ms in events:
        n = clicks[user] = clicks.get(user, 0) + 1
        dwell[user] = dwell.get(user, 0) + dwell_ms
        seen = pages.setdefault(user, {})
        seen[page] = seen.get(page, 0) + 1
        if n % 1000 == 0:
            out.setdefault(user, []).append(("milestone", user, n))
    for user in sorted(clicks):
        out.setdefault(user, []).extend([("summary", user, clicks[user], dwell[user]),
                                         ("pages", user, pages[user])])
    return out


def by_user(outputs: list[Any]) -> dict[str, list[Any]]:
    """Outputs grouped by user (their second field), each group in emission order."""
    grouped: dict[str, list[Any]] = {}
    for out in outputs:
        grouped.setdefault(out[1], []).append(out)
    return grouped


def of_kind(outputs: dict[str, list[Any]], kind: str) -> dict[str, list[Any]]:
    return {user: [o for o in outs if o[0] == kind] for user, outs in outputs.items()}


# -- the job against a sequential model ---------------------------------------------------


def test_job_sizes_produce_milestones_of_several_users(events: list[Event]) -> None:
    milestones = [o for outs in model(events).values() for o in outs if o[0] == "milestone"]
    assert len({user for _, user, _ in milestones}) >= 2
    assert max(n for *_, n in milestones) >= 2000


async def test_summaries_and_milestones_match_a_sequential_model(events: list[Event]) -> None:
    outputs = await run_job(ast.HeapBackend(), events)
    expected = model(events)
    got = by_user(outputs)
    assert got.keys() == expected.keys()
    # Clicks and total dwell of every user.
    assert of_kind(got, "summary") == of_kind(expected, "summary")
    # Exactly the model's milestones, none twice, each user's in click order.
    milestones = [o for o in outputs if o[0] == "milestone"]
    assert len(milestones) == len(set(milestones))
    assert set(milestones) == {o for outs in expected.values() for o in outs
                               if o[0] == "milestone"}
    # Per user, the whole sequence: milestones in order, then the summary, then the pages.
    assert got == expected


async def test_pages_map_matches_a_sequential_model(events: list[Event]) -> None:
    got = of_kind(by_user(await run_job(ast.HeapBackend(), events)), "pages")
    expected = of_kind(model(events), "pages")
    assert got == expected
    assert sum(sum(p.values()) for outs in got.values() for *_, p in outs) == RECORDS


async def test_rocksdb_backend_gives_the_heap_outputs(
        events: list[Event], tmp_path: Path) -> None:
    heap = await run_job(ast.HeapBackend(), events)
    rocks = await run_job(ast.RocksDBBackend(tmp_path / "db"), events)
    # Order across keys may differ between backends; order within a key may not.
    assert sorted(rocks) == sorted(heap)
    assert by_user(rocks) == by_user(heap)


# -- main() and the command line ----------------------------------------------------------


def test_main_reports_matching_counts_and_consistent_header(
        capsys: pytest.CaptureFixture[str]) -> None:
    records, users, seed = 3000, 20, 7
    assert main(["--records", str(records), "--users", str(users), "--seed", str(seed)]) == 0
    out = capsys.readouterr().out
    clicks: dict[str, int] = {}
    for _, user, _, _ in _events(records, users, seed):
        clicks[user] = clicks.get(user, 0) + 1
    assert len(clicks) <= users

    header = re.search(r"^asyncstate demo: ([\d,]+) clicks of ([\d,]+) users on HeapBackend in ",
                       out, re.MULTILINE)
    assert header is not None, out
    assert int(header[1].replace(",", "")) == records
    assert int(header[2].replace(",", "")) == len(clicks)

    milestones = sum(n // 1000 for n in clicks.values())
    assert re.search(rf"^milestones emitted: {milestones:,}; per-user counts match a plain "
                     r"count$", out, re.MULTILINE), out

    rows = re.findall(r"^  (user-\d+) +([\d,]+) +[\d,.]+$", out, re.MULTILINE)
    assert [int(n.replace(",", "")) for _, n in rows] == sorted(clicks.values(),
                                                                reverse=True)[:5]
    assert all(clicks[user] == int(n.replace(",", "")) for user, n in rows)
    for metric in ("records_in", "records_done"):
        assert re.search(rf"^  {metric} +{records:,}$", out, re.MULTILINE), out
    # On the heap every request is answered at once, and the table says why none batched.
    assert re.search(r"^  batches +0\n    \(HeapBackend answers each state request at once: "
                     r"nothing to batch\)$", out, re.MULTILINE), out


def test_module_runs_as_a_script() -> None:
    # -W error: the demo is held to the suite's `filterwarnings = error`.
    proc = subprocess.run(
        [sys.executable, "-W", "error", "-m", "asyncstate.demo",
         "--records", "3000", "--users", "20"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^milestones emitted: [\d,]+; per-user counts match a plain count$",
                     proc.stdout, re.MULTILINE), proc.stdout


@pytest.mark.parametrize(("argv", "option", "shown"), [
    (["--users", "0"], "--users", "0"),
    (["--records", "-1"], "--records", "-1"),
    (["--records", "0"], "--records", "0"),
    (["--users", "abc"], "--users", "'abc'"),
    (["--records", "1.5"], "--records", "'1.5'"),
])
def test_bad_arguments_exit_2_naming_the_option(
        argv: list[str], option: str, shown: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # rejected before the job starts
    assert re.search(rf"^python -m asyncstate\.demo: error: argument {option}: must be an "
                     rf"integer >= 1, got {re.escape(shown)}$", captured.err, re.MULTILINE), (
        captured.err)
