"""PNG figures of an experiment (matplotlib, headless Agg backend).

- ``throughput_vs_latency.png``: records/s of each arm over the store latency (log-log), with
  each arm's Little's-law bound dashed, and the asyncstate figure at 0 ms dotted;
- ``p99_vs_max_in_flight.png``: p99 latency and throughput over max_in_flight;
- ``batch_size_vs_buffer_timeout.png``: mean batch size and p99 latency over the buffer
  timeout (open loop at a fixed rate, so batches fill only as fast as records arrive);
- ``open_loop_latency_vs_rate.png``: p50 and p99 latency over the offered rate, rates that
  were not sustainable marked with a cross.

A figure whose sweep did not run is left out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncstate.experiments.sweep import Run

__all__ = ["FIGURES", "missing_extra", "write_plots"]

FIGURES = ("throughput_vs_latency.png", "p99_vs_max_in_flight.png",
           "batch_size_vs_buffer_timeout.png", "open_loop_latency_vs_rate.png")
_SIZE = (7.0, 4.2)
_DPI = 90


def missing_extra() -> str | None:
    """None when matplotlib and rich import; else the message naming the extra."""
    missing = []
    for module in ("matplotlib", "rich"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if not missing:
        return None
    return (f"asyncstate experiment needs {' and '.join(missing)}: "
            "pip install 'asyncstate[experiments]'")


def _series(runs: Sequence[Run], sweep: str) -> dict[str, list[tuple[Any, Any]]]:
    """arm -> [(sweep value, result)] of the runs of `sweep`, by value."""
    found: dict[str, list[tuple[Any, Any]]] = {}
    for item in runs:
        if item.result is None:
            continue
        for name, value in item.sweeps:
            if name == sweep:
                found.setdefault(item.arm, []).append((value, item.result))
    for points in found.values():
        points.sort(key=lambda p: p[0])
    return found


def _finish(fig: Any, ax: Any, path: Path, title: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)


def write_plots(directory: Path, runs: Sequence[Run]) -> list[Path]:
    """Write the figures whose sweeps ran into `directory`; returns their paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    # 1. throughput over latency
    series = _series(runs, "latency_ms")
    if series:
        fig, ax = plt.subplots(figsize=_SIZE)
        for i, (arm, points) in enumerate(sorted(series.items())):
            color = colors[i % len(colors)]
            shown = [(v, r) for v, r in points if v > 0]
            if shown:
                ax.plot([v for v, _ in shown], [r.throughput for _, r in shown], "o-",
                        color=color, label=arm)
                bounded = [(v, r.bound) for v, r in shown if math.isfinite(r.bound)]
                if bounded and "rocksdb" not in arm:
                    ax.plot([v for v, _ in bounded], [b for _, b in bounded], "--",
                            color=color, alpha=0.6, label=f"{arm}: bound")
            zero = [r for v, r in points if v == 0]
            if zero and arm == "asyncstate":
                ax.axhline(zero[0].throughput, color=color, linestyle=":", alpha=0.8,
                           label="asyncstate at 0 ms")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("store latency per call (ms, configured)")
        ax.set_ylabel("records/s")
        ax.legend(fontsize=7, loc="lower left")
        path = directory / FIGURES[0]
        _finish(fig, ax, path, "Throughput vs store latency (closed loop)")
        plt.close(fig)
        written.append(path)

    # 2. p99 latency and throughput over max_in_flight
    series = _series(runs, "max_in_flight")
    if series:
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(_SIZE[0], _SIZE[1]))
        for i, (arm, points) in enumerate(sorted(series.items())):
            xs = [v for v, _ in points]
            ax.plot(xs, [r.latency_ms["p99"] for _, r in points], "o-",
                    color=colors[i % len(colors)], label=arm)
            ax2.plot(xs, [r.throughput for _, r in points], "o-",
                     color=colors[i % len(colors)], label=arm)
        for a, label in ((ax, "p99 latency (ms)"), (ax2, "records/s")):
            a.set_xscale("log")
            a.set_xlabel("max_in_flight")
            a.set_ylabel(label)
            a.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fig.suptitle("p99 latency and throughput vs max_in_flight (closed loop)", fontsize=10)
        fig.tight_layout()
        path = directory / FIGURES[1]
        fig.savefig(path, dpi=_DPI)
        plt.close(fig)
        written.append(path)

    # 3. batch size over the buffer timeout
    series = _series(runs, "buffer_timeout_ms")
    if series:
        fig, ax = plt.subplots(figsize=_SIZE)
        ax2 = ax.twinx()
        for arm, points in sorted(series.items()):
            xs = [v for v, _ in points]
            ax.plot(xs, [r.batch_size["mean"] for _, r in points], "o-", color=colors[0],
                    label=f"{arm}: mean batch size")
            ax2.plot(xs, [r.latency_ms["p99"] for _, r in points], "s--", color=colors[1],
                     label=f"{arm}: p99 latency")
            rate = points[0][1].point.rate
        ax.set_xscale("log")
        ax.set_xlabel("buffer_timeout_ms")
        ax.set_ylabel("mean requests per batch")
        ax2.set_ylabel("p99 latency (ms)")
        lines = ax.get_legend_handles_labels()
        more = ax2.get_legend_handles_labels()
        ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7, loc="upper left")
        path = directory / FIGURES[2]
        _finish(fig, ax, path, f"Batch size vs buffer timeout (open loop, {rate:,.0f} rec/s)")
        plt.close(fig)
        written.append(path)

    # 4. open-loop latency over the offered rate
    series = _series(runs, "rate")
    if series:
        fig, ax = plt.subplots(figsize=_SIZE)
        for i, (arm, points) in enumerate(sorted(series.items())):
            color = colors[i % len(colors)]
            xs = [v for v, _ in points]
            ax.plot(xs, [r.latency_ms["p50"] for _, r in points], "o-", color=color,
                    label=f"{arm}: p50")
            ax.plot(xs, [r.latency_ms["p99"] for _, r in points], "s--", color=color,
                    alpha=0.7, label=f"{arm}: p99")
            bad = [(v, r.latency_ms["p99"]) for v, r in points if r.sustainable is False]
            if bad:
                ax.plot([v for v, _ in bad], [y for _, y in bad], "x", color="red",
                        markersize=10, mew=2, label=f"{arm}: not sustainable")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("offered rate (records/s)")
        ax.set_ylabel("latency from intended arrival (ms)")
        ax.legend(fontsize=7, loc="upper left")
        path = directory / FIGURES[3]
        _finish(fig, ax, path, "Open loop: latency vs offered rate")
        plt.close(fig)
        written.append(path)
    return written
