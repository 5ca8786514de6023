"""Per-attempt working directories of bridge partitions (RocksDB's files), under Spark's
local directories.

Each task attempt gets a fresh directory named by stage, partition, attempt number and the
worker's process id. A retried or speculative attempt never reuses another attempt's
directory, so a RocksDB lock left by an attempt that is still closing, or by a worker that
was killed (SIGKILL, `os._exit`: no `finally` runs), never blocks it. The directory is removed
when the attempt ends; directories of dead processes are removed by the next attempt that
starts on the same executor (and Spark deletes its local directories when the application
ends).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import uuid

from asyncstate.log import get_logger

__all__ = ["ROOT_NAME", "make_attempt_directory", "remove_attempt_directory", "spark_local_dir"]

log = get_logger("asyncstate.spark")

ROOT_NAME = "asyncstate-partitions"
_NAME_RE = re.compile(r"stage(\d+)-part(\d+)-attempt(\d+)-pid(\d+)-[0-9a-f]{8}")


def spark_local_dir() -> str:
    """The first of the executor's local directories (Spark gives them to Python workers as
    SPARK_LOCAL_DIRS), or the system's temporary directory outside Spark."""
    dirs = [d for d in os.environ.get("SPARK_LOCAL_DIRS", "").split(",") if d]
    return dirs[0] if dirs else tempfile.gettempdir()


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # "pid (comm) state ...": the state follows the last parenthesis.
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def _remove_dead(root: str) -> None:
    """Remove the directories of attempts whose worker process is gone."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        match = _NAME_RE.fullmatch(name)
        if match is None or _alive(int(match[4])):
            continue
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        log.info("spark.workdir_removed", directory=name, reason="its worker process is gone")


def make_attempt_directory(stage: int, partition: int, attempt: int,
                           base: str | None = None) -> str:
    """Create and return a fresh directory for this task attempt under `base` (default: the
    executor's first local directory)."""
    root = os.path.join(base if base is not None else spark_local_dir(), ROOT_NAME)
    os.makedirs(root, exist_ok=True)
    _remove_dead(root)
    name = f"stage{stage}-part{partition}-attempt{attempt}-pid{os.getpid()}-{uuid.uuid4().hex[:8]}"
    path = os.path.join(root, name)
    os.mkdir(path)
    return path


def remove_attempt_directory(path: str) -> None:
    """Remove an attempt's directory (after its database is closed). The common root stays:
    a concurrent attempt may be creating its directory in it."""
    shutil.rmtree(path, ignore_errors=True)
