"""Driver and worker set-up: the workers' interpreter, quiet Spark logs, logging in workers.

- `use_driver_python(sc)`: PySpark's workers run `sc.pythonExec`, fixed when the context is
  made from `PYSPARK_PYTHON` or else "python3" on the PATH, which is often another
  interpreter than the driver's (a virtualenv not activated), one without asyncstate. When it
  was left at that default, the bridge points it at the driver's interpreter and logs it.
- `quiet_conf()`: Spark settings that keep the JVM's console output to errors (a log4j2 file
  shipped in this package) and drop the progress bar.
- `configure_worker_logging(level)`: asyncstate's log level set inside the worker process,
  since the driver's does not reach it.
"""

from __future__ import annotations

import os
import shutil
import sys
from importlib import resources
from typing import Any

from asyncstate import log as _log
from asyncstate.log import get_logger

__all__ = [
    "DEFAULT_WORKER_PYTHON",
    "configure_worker_logging",
    "driver_log_level",
    "log4j2_properties",
    "quiet_conf",
    "use_driver_python",
]

log = get_logger("asyncstate.spark")

# PySpark's default worker interpreter when PYSPARK_PYTHON is unset.
DEFAULT_WORKER_PYTHON = "python3"
_LOG4J2_NAME = "log4j2-quiet.properties"


def log4j2_properties() -> str:
    """Path of the log4j2 file shipped with asyncstate: Spark's JVM logs errors only."""
    return str(resources.files("asyncstate.spark").joinpath(_LOG4J2_NAME))


def quiet_conf() -> dict[str, str]:
    """Spark settings for a quiet console: the JVM logs errors only (driver and executors),
    no progress bar. Apply them before the session starts::

        builder = SparkSession.builder
        for key, value in asyncstate.spark.quiet_conf().items():
            builder = builder.config(key, value)
    """
    option = f"-Dlog4j.configurationFile=file:{log4j2_properties()}"
    return {
        "spark.driver.extraJavaOptions": option,
        "spark.executor.extraJavaOptions": option,
        "spark.ui.showConsoleProgress": "false",
    }


def _same_environment(command: str) -> bool:
    """Whether `command` (a worker interpreter setting) runs the driver's environment: the
    same file, or a file in the same bin directory (a virtualenv's python and python3)."""
    found = shutil.which(command)
    if found is None:
        return False
    found = os.path.abspath(found)
    here = os.path.abspath(sys.executable)
    return found == here or os.path.dirname(found) == os.path.dirname(here)


def use_driver_python(sc: Any) -> bool:
    """Point `sc`'s workers at the driver's interpreter when their interpreter was left at
    PySpark's default and is another environment; returns whether it changed anything.

    An explicit `PYSPARK_PYTHON` (or a `pythonExec` set by hand) is left alone.
    """
    current = getattr(sc, "pythonExec", None)
    if current != DEFAULT_WORKER_PYTHON or os.environ.get("PYSPARK_PYTHON"):
        return False
    if _same_environment(current):
        return False
    sc.pythonExec = sys.executable
    log.warning("spark.worker_python", was=current, now=sys.executable,
                reason="PYSPARK_PYTHON is unset and python3 on the PATH is another "
                       "environment than the driver's; set PYSPARK_PYTHON to choose")
    return True


def driver_log_level() -> str:
    """The asyncstate log level the driver runs with, for the workers to use."""
    return _log.get_level()


def configure_worker_logging(level: str) -> None:
    """Set asyncstate's level in this worker process (a separate process: the driver's
    setting does not reach it). Records go to stderr, which Spark keeps in the executor's
    log, unless the worker's logging has handlers of its own."""
    _log.set_level(level)
