"""The demo job (`asyncstate demo`, `python -m asyncstate.demo`): its `ClickStats` function
against a sequential model on every backend, the order probe, and the printed report."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import asyncstate as ast
from asyncstate import demo
from asyncstate.demo import BackendRun, ClickStats, OrderProbe, _events, main

ROOT = Path(__file__).resolve().parent.parent

RECORDS, USERS, SEED = 4_000, 300, 7

Click = tuple[str, str, str, int, int]


@pytest.fixture(scope="module")
def events() -> list[Click]:
    """The demo's own click stream at the sizes above."""
    return _events(RECORDS, USERS, SEED)


def backend(name: str, tmp_path: Path) -> Any:
    if name == "heap":
        return ast.HeapBackend()
    if name == "rocksdb":
        return ast.RocksDBBackend(tmp_path / "db")
    return ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0)


async def run_job(store: Any, events: list[Click], probe: OrderProbe | None = None
                  ) -> list[Any]:
    """Every click, then a report per user, through one KeyedOperator.

    Unlike the demo, nothing drains between the clicks and the reports: a report must see
    every earlier click of its user because records of one key run in arrival order.
    """
    users = sorted({e[1] for e in events})
    async with ast.KeyedOperator(ClickStats(probe), key_selector=lambda r: r[1],
                                 backend=store) as op:
        for event in events:
            await op.process(event)
        for user in users:
            await op.process(("report", user))
    return op.outputs()


def model(events: list[Click]) -> dict[str, tuple[Any, ...]]:
    """Per user, the summary when clicks are handled one at a time in order."""
    clicks: dict[str, int] = {}
    dwell: dict[str, int] = {}
    pages: dict[str, dict[str, int]] = {}
    for _, user, page, dwell_ms, _ in events:
        clicks[user] = clicks.get(user, 0) + 1
        dwell[user] = dwell.get(user, 0) + dwell_ms
        seen = pages.setdefault(user, {})
        seen[page] = seen.get(page, 0) + 1
    summaries = {}
    for user, n in clicks.items():
        top_page, visits = max(pages[user].items(), key=lambda kv: (kv[1], kv[0]))
        summaries[user] = (n, dwell[user], len(pages[user]), top_page, visits)
    return summaries


def ordinals(events: list[Click]) -> dict[int, int]:
    """Arrival number -> which click of its user it is (1, 2, ...), in arrival order."""
    seen: dict[str, int] = {}
    out = {}
    for _, user, _, _, arrival in events:
        out[arrival] = seen[user] = seen.get(user, 0) + 1
    return out


# -- the generated clicks -----------------------------------------------------------------


def test_clicks_are_skewed_numbered_and_within_the_user_range(events: list[Click]) -> None:
    assert [e[4] for e in events] == list(range(1, RECORDS + 1))
    counts: dict[str, int] = {}
    for _, user, _, _, _ in events:
        assert 0 <= int(user.removeprefix("user-")) < USERS
        counts[user] = counts.get(user, 0) + 1
    ranked = sorted(counts.values(), reverse=True)
    # A few users are far more active than the median one, and most ids appear.
    assert ranked[0] >= 5 * ranked[len(ranked) // 2]
    assert len(counts) > USERS // 2
    assert _events(RECORDS, USERS, SEED) == events  # the seed fixes the stream


# -- the job against a sequential model ---------------------------------------------------


@pytest.mark.parametrize("name", ["heap", "rocksdb", "remote"])
async def test_summaries_match_a_sequential_model(
        name: str, events: list[Click], tmp_path: Path) -> None:
    outputs = await run_job(backend(name, tmp_path), events)
    assert all(o[0] == "summary" for o in outputs)
    got = {o[1]: tuple(o[2:]) for o in outputs}
    assert len(got) == len(outputs)  # one summary per user
    assert got == model(events)


async def test_probe_sees_each_users_clicks_in_arrival_order_while_users_overlap(
        events: list[Click], tmp_path: Path) -> None:
    traced = ["user-0", "user-1"]
    probe = OrderProbe(traced)
    await run_job(ast.RocksDBBackend(tmp_path / "db"), events, probe)
    # The k-th click of a user wrote clicks = k.
    assert probe.written == ordinals(events)
    assert sorted(probe.started) == list(range(1, RECORDS + 1))
    # A traced user's records alternate start, finish, start, ... in arrival order.
    for user in traced:
        steps = [(kind, arrival) for kind, arrival, u, _ in probe.steps if u == user]
        arrivals = [e[4] for e in events if e[1] == user]
        assert steps == [(kind, a) for a in arrivals for kind in ("start", "finish")]
    # Batching lets later clicks of other users start before an earlier click of a
    # traced user: some start step was overtaken.
    overtaken = [sum(1 for a in probe.started[:before] if a > arrival)
                 for kind, arrival, _, before in probe.steps if kind == "start"]
    assert max(overtaken) > 0


# -- the checks behind the exit status ----------------------------------------------------


def fake_run(written: dict[int, int], summaries: dict[str, tuple[Any, ...]]) -> BackendRun:
    probe = OrderProbe([])
    probe.written = written
    return BackendRun(backend="rocksdb", seconds=1.0, metrics={}, summaries=summaries,
                      probe=probe)


def test_order_check_names_a_click_applied_out_of_order() -> None:
    events = [("click", "u", "/p", 1, 1), ("click", "v", "/p", 1, 2),
              ("click", "u", "/p", 1, 3)]
    assert demo._order_problems(fake_run({1: 1, 2: 1, 3: 2}, {}), events) == []
    assert demo._order_problems(fake_run({1: 2, 2: 1, 3: 1}, {}), events) == [
        "RocksDBBackend: click #1 was u's click 1 but wrote clicks = 2",
        "RocksDBBackend: click #3 was u's click 2 but wrote clicks = 1"]


def test_count_check_names_a_user_whose_summary_differs() -> None:
    events = [("click", "u", "/p", 10, 1), ("click", "u", "/p", 5, 2)]
    assert demo._count_problems(fake_run({}, {"u": (2, 15, 1, "/p", 2)}), events) == []
    assert demo._count_problems(fake_run({}, {"u": (2, 14, 1, "/p", 2)}), events) == [
        "RocksDBBackend: u has clicks and dwell (2, 14), a plain count gives (2, 15)"]
    assert demo._count_problems(fake_run({}, {}), events) == [
        "RocksDBBackend: u has clicks and dwell None, a plain count gives (2, 15)"]


# -- main() and its report ----------------------------------------------------------------


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(["--records", str(RECORDS), "--users", str(USERS), "--seed", str(SEED),
                   *argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def table_row(out: str, label: str) -> list[str]:
    match = re.search(rf"^  {re.escape(label)} +(.+)$", out, re.MULTILINE)
    assert match is not None, f"no row {label!r} in:\n{out}"
    return match[1].split()


def test_report_header_counts_the_users_present(
        events: list[Click], capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run_main(capsys, "--backend", "heap")
    assert status == 0, out
    present = len({e[1] for e in events})
    assert present < USERS  # the header must not repeat --users as the user count
    assert out.startswith(f"asyncstate demo: {RECORDS:,} clicks of {present:,} users (user "
                          f"ids drawn from {USERS:,}, seed {SEED})\n")
    assert err == "running on HeapBackend ...\n"


def test_report_side_by_side_with_every_state_and_the_top_users(
        events: list[Click], capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_main(capsys, "--backend", "all")
    assert status == 0, out
    assert re.search(r"^ +HeapBackend +RocksDBBackend +SimulatedRemoteBackend$", out,
                     re.MULTILINE), out
    assert table_row(out, "records_done") == [f"{RECORDS:,}"] * 3
    heap_batches, rocks_batches, remote_batches = table_row(out, "batches")
    assert heap_batches == "0" and rocks_batches != "0" and remote_batches != "0"
    assert table_row(out, "per-user order") == ["kept"] * 3
    # Every state of the job is named, and the metrics are explained.
    for state in ("clicks (ValueState)", "dwell_ms (ReducingState)", "pages (MapState)"):
        assert state in " ".join(out.split())
    for metric in ("requests", "batches", "in_flight_peak", "blocked_seconds"):
        assert re.search(rf"^  {metric} {{2,}}\S", out, re.MULTILINE), metric
    assert "back-pressure, not a stall" in " ".join(out.split())
    assert ("results: HeapBackend and RocksDBBackend and SimulatedRemoteBackend agree, "
            "each user's clicks were applied in arrival order and match a plain count") \
        in " ".join(out.split())
    # The top users: clicks, dwell, distinct pages (the map state) and the most visited.
    expected = sorted(model(events).items(), key=lambda kv: (-kv[1][0], kv[0]))[:5]
    rows = re.findall(r"^  (user-\d+) +([\d,]+) +([\d,.]+) +(\d+)  (\S+) \((\d+)\)$", out,
                      re.MULTILINE)
    assert rows == [(u, f"{c:,}", f"{d / 1000:,.1f}", str(p), top, str(v))
                    for u, (c, d, p, top, v) in expected]


def test_report_traces_the_most_active_users_in_arrival_order(
        events: list[Click], capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_main(capsys)  # heap and the batching backend side by side
    assert status == 0, out
    counts: dict[str, int] = {}
    for e in events:
        counts[e[1]] = counts.get(e[1], 0) + 1
    top = sorted(counts, key=lambda u: (-counts[u], u))[:3]
    assert f"Order on RocksDBBackend, for the most active users {', '.join(top)} " \
           "(#: arrival number)." in " ".join(out.split())
    steps = re.findall(r"^  (start|finish) +#([\d,]+) +(user-\d+) +(.*)$", out, re.MULTILINE)
    assert len(steps) == 14
    order = ordinals(events)
    previous: dict[str, int] = {}
    user_of = {e[4]: e[1] for e in events}
    for kind, arrival_text, user, note in steps:
        arrival = int(arrival_text.replace(",", ""))
        assert user in top and user_of[arrival] == user
        if kind == "finish":
            assert note == f"wrote clicks = {order[arrival]}"
            previous[user] = arrival
        elif user not in previous:
            assert note == "its first click"
            assert order[arrival] == 1
        else:
            match = re.fullmatch(r"once #([\d,]+) finished; ([\d,]+) later clicks of other "
                                 r"users started first", note)
            assert match is not None, note
            assert int(match[1].replace(",", "")) == previous[user]
            assert order[arrival] == order[previous[user]] + 1


def test_without_rocksdict_the_default_uses_the_simulated_remote_store(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "rocksdict", None)  # importing it now fails
    status, out, err = run_main(capsys)
    assert status == 0, out
    assert re.search(r"^ +HeapBackend +SimulatedRemoteBackend$", out, re.MULTILINE), out
    assert err == "running on HeapBackend ...\nrunning on SimulatedRemoteBackend ...\n"
    status, out, err = run_main(capsys, "--backend", "rocksdb")
    assert (status, out) == (2, "")
    assert err == ("asyncstate demo: the rocksdb backend needs rocksdict: pip install "
                   "'asyncstate[rocksdb]' (or use --backend remote)\n")


def test_module_runs_as_a_script() -> None:
    # -W error: the demo is held to the suite's `filterwarnings = error`.
    proc = subprocess.run(
        [sys.executable, "-W", "error", "-m", "asyncstate.demo",
         "--records", "2000", "--users", "50"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("asyncstate demo: 2,000 clicks of ")
    assert table_row(proc.stdout, "per-user order") == ["kept", "kept"]


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


def test_unknown_backend_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--backend", "disk"])
    assert info.value.code == 2
    assert "argument --backend: invalid choice: 'disk'" in capsys.readouterr().err
