"""`asyncstate experiment backpressure` end to end on a reduced grid, and the parts it runs
on: key streams, one run's figures in closed and open loop, the Little's-law self-check."""

from __future__ import annotations

import collections
import csv
import dataclasses
import json
import subprocess
import sys
import textwrap

import pytest

from asyncstate.cli import main
from asyncstate.experiments import keys
from asyncstate.experiments.arms import ARMS, Point, default_cache_entries
from asyncstate.experiments.driver import run
from asyncstate.experiments.plots import FIGURES
from asyncstate.experiments.report import COLUMNS

# Two latencies would double the longest sweep: one, and short runs, keep this under ~15 s.
_REDUCED = ["experiment", "backpressure", "--quick", "--seconds", "0.3", "--latency-ms", "0.2",
            "--max-in-flight", "200,40", "--buffer-timeout-ms", "5,1", "--rate", "3000,6000",
            "--keys", "2000", "--distribution", "uniform"]


@pytest.mark.timeout(120)
def test_the_command_writes_a_table_csv_json_and_figures(tmp_path, capsys):
    out = tmp_path / "results"
    assert main([*_REDUCED, "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    for arm in ("sync baseline", "asyncstate", "asyncstate+cache"):
        assert arm in stdout
    with open(out / "results.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == COLUMNS
        rows = list(reader)
    arms = {row["arm"] for row in rows}
    assert {"sync baseline", "asyncstate", "asyncstate+cache"} <= arms
    assert {"asyncstate (rocksdb)", "asyncstate+cache (rocksdb)"} <= arms  # rocksdict is here
    sweeps = collections.Counter(row["sweep"] for row in rows)
    assert sweeps == {"latency_ms": 5, "max_in_flight": 4, "buffer_timeout_ms": 2, "rate": 4}
    for row in rows:
        assert row["error"] == "" and row["answer_ok"] == "True", row
        assert float(row["throughput"]) > 0 and int(row["records"]) > 0
        assert int(row["in_flight_peak"]) <= int(row["max_in_flight"]) or \
            row["arm"].startswith("sync")
        assert row["littles_law_ok"] == "True", row  # mean in flight = throughput x latency
    sync = [r for r in rows if r["arm"] == "sync baseline"]
    assert sync and all(r["in_flight_peak"] == "1" and r["mean_batch_size"] == "1.0"
                        for r in sync)
    cached = [r for r in rows if r["arm"] == "asyncstate+cache"]
    assert all(r["cache_entries"] == str(default_cache_entries(2000)) for r in cached)
    assert all(r["sustainable"] in ("True", "False") for r in rows if r["mode"] == "open")
    payload = json.loads((out / "results.json").read_text())
    assert payload["grid"]["latency_ms"] == [0.2]
    # Runs shared by sweeps run once: the base point, and the open loop at 3,000/s with a
    # 5 ms buffer timeout (base of the buffer-timeout sweep, one of the rate sweep).
    assert len(payload["runs"]) == 12
    histogram = payload["runs"][1]["batch_size_histogram"]
    assert histogram and all(count > 0 for _lo, _hi, count in histogram)
    for name in FIGURES:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


@pytest.mark.timeout(60)
def test_the_command_names_the_extra_when_matplotlib_is_missing(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        sys.modules["matplotlib"] = None
        from asyncstate.cli import main
        sys.exit(main(["experiment", "backpressure", "--quick", "--out", {str(tmp_path)!r}]))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.strip() == ("asyncstate experiment: asyncstate experiment needs "
                                   "matplotlib: pip install 'asyncstate[experiments]'")
    assert not any(tmp_path.iterdir())  # nothing ran


def test_zipf_keys_have_the_hottest_share_they_promise():
    stream = keys.key_stream("zipf", 1000, 200_000, theta=0.99, seed=3)
    share = keys.hottest_share("zipf", 1000, 0.99)
    counts = collections.Counter(stream)
    assert counts.most_common(1)[0][0] == 0
    assert counts[0] / len(stream) == pytest.approx(share, rel=0.05)
    uniform = collections.Counter(keys.key_stream("uniform", 10, 100_000, seed=3))
    assert set(uniform) == set(range(10)) and max(uniform.values()) < 11_000
    assert keys.key_stream("zipf", 50, 100, seed=9) == keys.key_stream("zipf", 50, 100, seed=9)


def test_an_open_loop_beyond_capacity_is_not_sustainable_and_counts_the_source_wait():
    # Four records in flight, two 1 ms round trips each: well under 6,000 records/s.
    point = Point(rate=6000.0, latency_ms=1.0, max_in_flight=4, batch_size=4, keys=500)
    stream = keys.key_stream("uniform", 500, 20_000, seed=1)
    result = run(ARMS["asyncstate"], point, stream, 1 / 500, seconds=0.5)
    assert result.answer_ok is True
    assert result.sustainable is False and result.backlog_end > 0
    # Latency runs from each record's intended arrival: the time it waited in the source
    # counts, or the numbers in the system would not match throughput x latency.
    assert result.littles_law_ok


def test_a_closed_loop_paced_by_the_store_counts_the_wait_as_blocked():
    # One I/O slot, batches of 4: the operator admits while fewer than 8 requests are at
    # the store or on their way, far below max_in_flight. The source waits for that room
    # itself, so the wait is blocked time and each record's latency starts at admission.
    point = Point(latency_ms=1.0, max_in_flight=1000, batch_size=4, io_parallelism=1,
                  keys=500)
    stream = keys.key_stream("uniform", 500, 20_000, seed=1)
    result = run(ARMS["asyncstate"], point, stream, 1 / 500, seconds=0.3, sample_every=1)
    assert result.answer_ok is True and result.littles_law_ok
    assert result.in_flight_peak <= 16
    assert result.blocked_seconds > 0.2


def test_a_modest_open_loop_rate_is_sustainable():
    point = Point(rate=300.0, latency_ms=0.2, max_in_flight=100, buffer_timeout_ms=1,
                  keys=500)
    stream = keys.key_stream("uniform", 500, 2_000, seed=1)
    result = run(ARMS["asyncstate+cache"], point, stream, 1 / 500, seconds=0.5)
    assert result.answer_ok is True and result.littles_law_ok
    assert result.sustainable is True and result.backlog_end <= 6
    assert 120 <= result.records <= 160 and result.latency_ms["count"] == result.records


def test_the_bound_counts_the_round_trips_a_record_needs():
    stream = keys.key_stream("uniform", 100, 5_000, seed=1)
    point = Point(latency_ms=0.5, max_in_flight=8, batch_size=2, io_parallelism=3, keys=100)
    result = run(ARMS["asyncstate"], point, stream, 1 / 100, seconds=0.3)
    # min(N=8, R*B=6) requests at the store, two each per record (read, then write).
    assert result.k == 2
    assert result.bound == pytest.approx(6 / (2 * result.measured_store_latency_ms / 1000))
    sync = run(ARMS["sync baseline"], point, stream, 1 / 100, seconds=0.2)
    assert sync.bound == pytest.approx(1 / (2 * sync.measured_store_latency_ms / 1000))


def test_cache_write_back_reaches_the_cache_arms_backend_and_the_results(tmp_path):
    from asyncstate.cli import build_parser
    from asyncstate.commands.experiment import _grid
    args = build_parser().parse_args(["experiment", "backpressure", "--cache-write-back"])
    point = _grid(args).base()
    assert point.cache_write_back is True
    assert ARMS["asyncstate+cache"].backend(point, tmp_path, 1).state_cache.write_back
    assert ARMS["asyncstate"].backend(point, tmp_path, 1).state_cache is None
    stream = keys.key_stream("zipf", 500, 5_000, seed=1)
    small = Point(latency_ms=0.2, max_in_flight=100, keys=500, distribution="zipf",
                  cache_write_back=True)
    result = run(ARMS["asyncstate+cache"], small, stream,
                 keys.hottest_share("zipf", 500, 0.99), seconds=0.3)
    assert result.answer_ok is True and result.littles_law_ok
    assert result.row()["cache_write_back"] is True


def test_a_latency_p99_leaves_a_zero_latency_at_zero(tmp_path):
    # The default grids hold 0 ms beside other latencies: --latency-p99-ms shapes the others.
    from asyncstate.cli import build_parser
    from asyncstate.commands.experiment import _grid
    args = build_parser().parse_args(["experiment", "backpressure", "--latency-ms", "1.5,0",
                                      "--latency-p99-ms", "3"])
    base = _grid(args).base()
    for latency, p99 in [(0.0, None), (1.5, 3.0)]:
        point = dataclasses.replace(base, latency_ms=latency)
        backend = ARMS["asyncstate"].backend(point, tmp_path, 1)
        assert (backend.latency_ms, backend.latency_p99_ms) == (latency, p99)


# -- the command's arguments and its results directory --------------------------------------

_ONE_SWEEP = ["experiment", "backpressure", "--quick", "--seconds", "0.2", "--latency-ms",
              "0.2", "--max-in-flight", "100", "--buffer-timeout-ms", "1", "--rate", "3000",
              "--keys", "500", "--distribution", "uniform", "--no-rocksdb"]


@pytest.mark.parametrize(("option", "value", "says"), [
    ("--seconds", "0", "is not above 0"),
    ("--seconds", "-1", "is not above 0"),
    ("--seconds", "nan", "is not a finite number"),
    ("--latency-ms", "0.2,inf", "is not a finite number"),
    ("--latency-p99-ms", "nan", "is not a finite number"),
    ("--latency-p99-ms", "-2", "is not above 0"),
    ("--zipf-theta", "-1", "is below 0"),
    ("--zipf-theta", "inf", "is not a finite number"),
    ("--rate", "inf", "is not a finite number"),
    ("--open-buffer-timeout-ms", "-1", "is below 0"),
    ("--sample-every", "0", "is below 1"),
])
def test_an_option_out_of_range_stops_the_command_before_any_run(tmp_path, capsys, option,
                                                                  value, says):
    out = tmp_path / "results"
    with pytest.raises(SystemExit) as stopped:
        main(["experiment", "backpressure", "--quick", option, value, "--out", str(out)])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: " in err and says in err, err
    assert not out.exists()  # nothing ran, nothing was created


def test_a_steep_zipf_exponent_draws_the_hottest_key_almost_always():
    assert keys.hottest_share("zipf", 100_000, 100.0) == pytest.approx(1.0)
    assert set(keys.key_stream("zipf", 100_000, 1_000, theta=100.0)) == {0}
    assert keys.hottest_share("zipf", 1000, 0.0) == pytest.approx(1 / 1000)  # uniform


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_an_out_directory_that_cannot_be_written_stops_the_command(tmp_path, capsys, where):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory")
    out = blocker if where == "a file" else blocker / "results"
    assert main([*_ONE_SWEEP, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"asyncstate experiment: cannot write results to {out}"), err
    assert blocker.read_text() == "not a directory"


def test_runs_started_in_the_same_second_get_directories_of_their_own(tmp_path,
                                                                      monkeypatch):
    from asyncstate.commands import experiment
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(experiment.time, "strftime", lambda _fmt: "20260101-000000")
    made = [experiment._make_out(None) for _ in range(3)]
    base = tmp_path / "experiment-results"
    assert [(path.resolve(), created) for path, created in made] == [
        (base / "20260101-000000", True), (base / "20260101-000000-2", True),
        (base / "20260101-000000-3", True)]


@pytest.mark.timeout(120)
def test_a_run_into_an_earlier_runs_directory_replaces_its_files(tmp_path, capsys):
    out = tmp_path / "results"
    out.mkdir()
    for name in FIGURES:
        (out / name).write_bytes(b"an earlier run's figure")
    (out / "results.csv").write_text("earlier\n")
    (out / "notes.txt").write_text("the user's own file")
    # Single values: only the latency sweep runs, so only its figure is drawn.
    assert main([*_ONE_SWEEP, "--out", str(out)]) == 0
    capsys.readouterr()
    assert sorted(p.name for p in out.iterdir()) == [
        "notes.txt", "results.csv", "results.json", "throughput_vs_latency.png"]
    assert (out / "throughput_vs_latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "results.csv").read_text().startswith("sweep,")


@pytest.mark.timeout(120)
def test_rows_show_the_knobs_each_arm_ran_with_and_in_flight_stays_under_its_peak(
        tmp_path, capsys):
    out = tmp_path / "results"
    assert main([*_ONE_SWEEP, "--rate", "3000,200000", "--out", str(out)]) == 0
    capsys.readouterr()
    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    sync = [r for r in rows if r["arm"] == "sync baseline"]
    assert sync and all((r["batch_size"], r["buffer_timeout_ms"], r["max_in_flight"]) ==
                        ("1", "0", "1") for r in sync)
    for r in rows:
        if r["arm"] != "sync baseline":
            assert (r["batch_size"], r["max_in_flight"]) == ("1000", "100"), r
        # The mean in flight counts admitted records only; the self-check's side adds the
        # open loop's backlog, which at 200,000/s offered is far from empty.
        assert float(r["mean_in_flight"]) <= int(r["in_flight_peak"]), r
        assert float(r["mean_in_system"]) >= float(r["mean_in_flight"]), r
    flooded = [r for r in rows if r["offered_rate"] == "200000.0"]
    assert flooded and all(r["sustainable"] == "False" and
                           float(r["mean_in_system"]) > int(r["in_flight_peak"])
                           for r in flooded), flooded


def test_experiment_without_a_subcommand_prints_its_own_help(capsys):
    assert main(["experiment"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: asyncstate experiment [-h] EXPERIMENT") and \
        "backpressure" in err, err
