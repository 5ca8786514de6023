"""`RunReport` and `verify_checkpoint`: what the partitions of a job did, seen from the driver.

A bridge partition commits its part of the checkpoint on the executor that ran it, under
`checkpoint_dir`, which must therefore be storage that every executor and the driver share.
The driver checks completeness (every key group covered by a committed part) before it
restores, and `verify_checkpoint` checks it right after a job. With a `RunReport`, the check
also names the host and attempt that committed a part the driver cannot see.
"""

from __future__ import annotations

import os
from typing import Any

from asyncstate.checkpoint.format import checkpoint_path
from asyncstate.checkpoint.reader import open_checkpoint
from asyncstate.checkpoint.writer import remove_superseded_parts
from asyncstate.errors import CheckpointError

__all__ = ["RunReport", "verify_checkpoint"]


def _list_param() -> Any:
    from pyspark.accumulators import AccumulatorParam

    class _ListParam(AccumulatorParam):  # type: ignore[type-arg]
        def zero(self, value: list[Any]) -> list[Any]:
            return []

        def addInPlace(self, value1: list[Any], value2: list[Any]) -> list[Any]:
            value1.extend(value2)
            return value1

    return _ListParam()


class RunReport:
    """Per-partition reports of the bridge jobs it is passed to (``report=`` of
    `process_keyed`), collected through a Spark accumulator.

    Each entry is a dict: partition, attempt, stage, host, pid and working directory (cwd)
    of the worker, records, outputs, part (the
    checkpoint path it committed, or None), and seconds: `restore` (opening and restoring),
    `input_wait` (the operator idle, waiting for Spark's input), `process` (the rest until
    the input ends), `drain`, `commit` (the checkpoint part), `output` (Spark consuming the
    outputs), `read` (the reader thread's time inside Spark's iterator, which overlaps the
    others) and `seconds` (the whole partition); `cpu` is the CPU seconds the worker process
    used meanwhile (all its threads: the loop, the reader, the backend's); `max_timestamp` is
    the largest event time among its records (None without a timestamp selector or records).
    A partition computed again (a retry, speculation, a recomputed RDD) reports again.
    """

    def __init__(self, sc: Any) -> None:
        self._accumulator = sc.accumulator([], _list_param())

    @property
    def accumulator(self) -> Any:
        """The accumulator partitions add their reports to."""
        return self._accumulator

    def clear(self) -> None:
        """Forget the reports received so far (on the driver), to use it for another job."""
        self._accumulator.value = []

    @property
    def partitions(self) -> list[dict[str, Any]]:
        """The reports received so far, sorted by partition and attempt."""
        return sorted(self._accumulator.value, key=lambda r: (r["partition"], r["attempt"]))

    def committed(self, checkpoint: str) -> dict[int, dict[str, Any]]:
        """The last report of each partition that committed a part of `checkpoint`."""
        out: dict[int, dict[str, Any]] = {}
        for r in self.partitions:
            if r.get("part") is not None and os.path.normpath(r["part"]) == \
                    os.path.normpath(checkpoint):
                out[r["partition"]] = r
        return out


def verify_checkpoint(checkpoint_dir: str | os.PathLike[str], checkpoint_id: int,
                      report: RunReport | None = None) -> str:
    """Check on the driver that checkpoint `checkpoint_id` under `checkpoint_dir` is complete;
    returns its path.

    Raises CheckpointError naming the missing part. When `report` shows that the partition
    committed that part on an executor, the error says so: `checkpoint_dir` is not storage
    the driver and every executor share.
    """
    path = checkpoint_path(os.path.abspath(os.fspath(checkpoint_dir)), checkpoint_id)
    try:
        checkpoint = open_checkpoint(path)
    except CheckpointError as exc:
        committed = report.committed(path) if report is not None else {}
        if committed:
            hosts = ", ".join(sorted(
                {f"partition {p} on {r['host']}" for p, r in committed.items()}))
            raise CheckpointError(
                f"{exc}. The job's partitions committed their parts ({hosts}), but the driver "
                f"does not see them all: checkpoint_dir {os.fspath(checkpoint_dir)!r} must be "
                "a path every executor and the driver share (a network or cluster file "
                "system mounted at the same path everywhere)", path=path) from exc
        raise CheckpointError(
            f"{exc}. Either the job did not run every partition to its end (an action such as "
            "take() stops early; a failed job commits nothing for its failed partitions), or "
            f"checkpoint_dir {os.fspath(checkpoint_dir)!r} is not a path every executor and "
            "the driver share", path=path) from exc
    if checkpoint.superseded:
        # The checkpoint id was written again at another number of partitions: the parts of
        # the run before are left out, and go now.
        remove_superseded_parts(path, checkpoint.parts[0].parallelism)
    return path
