"""A real Spark standalone cluster on 127.0.0.1: a master and two workers started from the
scripts pyspark ships, the rescale chain run against it with executors in separate processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from spark_functions import SPARK_TEST_TIMEOUT_S, read_counts

# A JVM on a busy 2-core machine can take minutes where it usually takes seconds.
pytestmark = [pytest.mark.spark, pytest.mark.timeout(SPARK_TEST_TIMEOUT_S)]

HERE = Path(__file__).resolve().parent
STARTUP_S = 90.0  # bound on the daemons' start-up on a busy 2-core machine
JOB_S = 150.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spark_class() -> str:
    import pyspark

    return str(Path(pyspark.__file__).parent / "bin" / "spark-class")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop a daemon and what it started (its executors): its whole process group."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=15)


def _alive_workers(web_port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{web_port}/json/", timeout=5) as resp:
            return int(json.load(resp).get("aliveworkers", 0))
    except OSError:
        return -1


@pytest.fixture(scope="module")
def standalone_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A master and two one-core workers on 127.0.0.1; always stopped at the end."""
    root = tmp_path_factory.mktemp("standalone")
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_LOG_DIR": str(root),
           "SPARK_NO_DAEMONIZE": "1"}
    port, web = _free_port(), _free_port()
    procs: list[subprocess.Popen[bytes]] = []

    def start(name: str, *args: str) -> None:
        log = (root / f"{name}.log").open("wb")
        procs.append(subprocess.Popen([_spark_class(), *args], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
        log.close()

    try:
        start("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
              "--port", str(port), "--webui-port", str(web))
        for i in range(2):
            start(f"worker-{i}", "org.apache.spark.deploy.worker.Worker",
                  f"spark://127.0.0.1:{port}", "--host", "127.0.0.1", "--cores", "1",
                  "--memory", "1g", "--webui-port", str(_free_port()),
                  "--work-dir", str(root / "work"))
        deadline = time.monotonic() + STARTUP_S
        while _alive_workers(web) < 2:
            dead = [p.args for p in procs if p.poll() is not None]
            assert not dead, f"a daemon exited: {dead}; logs in {root}"
            assert time.monotonic() < deadline, f"workers did not register; logs in {root}"
            time.sleep(0.5)  # polling the master's status page, bounded by the deadline
        yield f"spark://127.0.0.1:{port}"
    finally:
        for proc in reversed(procs):
            _stop(proc)


@pytest.mark.timeout(STARTUP_S + JOB_S + 30)
def test_rescale_on_a_standalone_cluster(standalone_master: str, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "SPARK_LOCAL_IP": "127.0.0.1"}
    done = subprocess.run(
        [sys.executable, str(HERE / "cluster_job.py"), standalone_master, str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=JOB_S, check=False)
    assert done.returncode == 0, done.stderr[-5000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    # Two executors (separate JVMs with their own working directories) ran partitions.
    assert len(result["executors"]) == 2, result["executors"]
    model = {k: v for k, v in result["model"]}
    assert read_counts(result["last"], model) == model
