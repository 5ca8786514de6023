"""The results of an experiment: a table for the terminal, a CSV of every run's figures,
and a JSON file with the grid, the environment and every run (histograms included)."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncstate.experiments.sweep import Grid, Run

__all__ = ["COLUMNS", "environment", "rows", "table", "write_csv", "write_json"]

COLUMNS = ("sweep", "value", "arm", "workload", "mode", "offered_rate", "latency_ms",
           "latency_p99_ms", "measured_store_latency_ms", "batch_size", "buffer_timeout_ms",
           "max_in_flight", "io_parallelism", "keys", "distribution", "zipf_theta", "cache_entries",
           "cache_write_back", "records", "seconds", "throughput", "latency_p50_ms",
           "latency_p99_ms_measured", "latency_p99_9_ms", "latency_mean_ms", "latency_max_ms",
           "latency_samples", "in_flight_peak", "mean_in_flight", "mean_in_system",
           "blocked_seconds", "batches",
           "mean_batch_size", "p99_batch_size", "cache_hit_rate", "k", "bound", "ratio_to_bound",
           "hot_key_bound", "littles_law_error", "littles_law_ok", "sustainable", "backlog_end",
           "backlog_max", "rss_start_mb", "rss_peak_mb", "answer_ok", "error")


def rows(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """One row per (sweep, run), a run shared by several sweeps in each; grouped by sweep
    (in the order the sweeps first ran), then by the sweep's value, in run order."""
    order: dict[str, int] = {}
    keyed = []
    for n, item in enumerate(runs):
        figures = item.result.row() if item.result is not None else {"arm": item.arm}
        for sweep, value in item.sweeps:
            order.setdefault(sweep, len(order))
            row: dict[str, Any] = dict.fromkeys(COLUMNS)
            row.update(figures)
            row.update(sweep=sweep, value=value, error=item.error)
            rank = value if isinstance(value, (int, float)) else str(value)
            keyed.append(((order[sweep], isinstance(rank, str), rank, n), row))
    keyed.sort(key=lambda pair: pair[0])
    return [row for _key, row in keyed]


def _csv_value(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else ""
    return "" if value is None else value


def write_csv(path: Path, runs: Sequence[Run]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows(runs):
            writer.writerow({k: _csv_value(v) for k, v in row.items()})


def _json_ready(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no infinity: an unbounded figure is null
    if isinstance(value, dict):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    return value


def environment(command: str) -> dict[str, Any]:
    from asyncstate import __version__, _compiled
    return {"command": command, "python": platform.python_version(),
            "asyncstate": __version__, "asyncstate_modules": _compiled.mode(),
            "machine": platform.machine(), "cores": os.cpu_count(),
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "platform": platform.platform(), "executable": sys.executable}


def write_json(path: Path, grid: Grid, runs: Sequence[Run], env: dict[str, Any]) -> None:
    payload = {
        "grid": dataclasses.asdict(grid),
        "environment": env,
        "runs": [{"arm": r.arm, "point": dataclasses.asdict(r.point),
                  "sweeps": [list(s) for s in r.sweeps], "error": r.error,
                  "figures": r.result.row() if r.result is not None else None,
                  "latency_ms": r.result.latency_ms if r.result is not None else None,
                  "batch_size_histogram": [list(b) for b in r.result.batch_size_buckets]
                  if r.result is not None else None,
                  "answer": r.result.answer_detail if r.result is not None else None}
                 for r in runs],
        "rows": rows(runs),
    }
    path.write_text(json.dumps(_json_ready(payload), indent=1) + "\n", encoding="utf-8")


def _rate(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    if value >= 1e6:
        return f"{value / 1e6:.2f} M"
    if value >= 1e4:
        return f"{value / 1e3:.0f} K"
    if value >= 1e3:
        return f"{value / 1e3:.1f} K"
    return f"{value:.0f}"


def _ms(value: float) -> str:
    return f"{value:.3g}"


def table(runs: Sequence[Run]) -> Any:
    """A rich Table of every run (one line per (sweep, run), grouped by sweep)."""
    from rich.table import Table

    t = Table(title="asyncstate experiment backpressure", show_lines=False)
    for name, justify in (("sweep", "left"), ("arm", "left"), ("rec/s", "right"),
                          ("p50 ms", "right"), ("p99 ms", "right"), ("p99.9 ms", "right"),
                          ("in flight", "right"), ("blocked s", "right"),
                          ("batch", "right"), ("hit", "right"), ("bound", "right"),
                          ("vs bound", "right"), ("Little", "center"), ("note", "left")):
        t.add_column(name, justify=justify,  # type: ignore[arg-type]
                     no_wrap=name in ("sweep", "arm"))
    previous = None
    for row in rows(runs):
        sweep = f"{row['sweep']}={row['value']:g}" if isinstance(row["value"], (int, float)) \
            else f"{row['sweep']}={row['value']}"
        if previous is not None and row["sweep"] != previous:
            t.add_section()
        previous = row["sweep"]
        if row["error"] is not None or row["throughput"] is None:
            t.add_row(sweep, row["arm"], *["-"] * 11, f"[red]{row['error']}[/]")
            continue
        notes = []
        if row["answer_ok"] is False:
            notes.append("[red]WRONG ANSWER[/]")
        elif row["answer_ok"] is None:
            notes.append("drain cut short")
        if row["sustainable"] is not None:
            notes.append(f"{_rate(row['offered_rate'])}/s offered: " + (
                "sustainable" if row["sustainable"] else "[red]not sustainable[/]"))
        hit = row["cache_hit_rate"]
        ratio = row["ratio_to_bound"]
        t.add_row(
            sweep, row["arm"], _rate(row["throughput"]), _ms(row["latency_p50_ms"]),
            _ms(row["latency_p99_ms_measured"]), _ms(row["latency_p99_9_ms"]),
            f"{row['mean_in_flight']:.0f} ({row['in_flight_peak']})",
            f"{row['blocked_seconds']:.2f}", f"{row['mean_batch_size']:.0f}",
            "-" if hit is None else f"{hit:.0%}", _rate(row["bound"]),
            "-" if ratio is None else f"{ratio:.2f}x",
            "-" if row["littles_law_ok"] is None else "ok" if row["littles_law_ok"]
            else f"[red]{row['littles_law_error']:.0%}[/]",
            "; ".join(notes))
    t.caption = ("rec/s: records per second; latency: admission (closed loop) or intended "
                 "arrival (open loop) to completion, sampled; in flight: time-weighted mean "
                 "(peak), records admitted and not finished; batch: mean requests per executor "
                 "call; hit: cache hit rate; bound: min(N, R*B)/(k*L) with the measured store "
                 "latency L; Little: mean in the system (in flight, plus the source's backlog "
                 "in open loop) = throughput x mean latency within 5 %")
    return t
