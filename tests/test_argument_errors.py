"""Both builds answer a wrong argument with the same error: the compiled modules must not
raise their own TypeError ("int object expected") before asyncstate's checks run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncstate import _compiled

ROOT = Path(__file__).resolve().parent.parent

# Each case is a statement run with `ast`, a key selector `key`, a function class `Fn`
# and a fresh directory `path` in scope; the error it raises is compared across builds.
CASES = {
    "operator parallelism": "ast.KeyedOperator(Fn(), key_selector=key, "
                            "backend=ast.HeapBackend(), parallelism='2')",
    "operator index": "ast.KeyedOperator(Fn(), key_selector=key, backend=ast.HeapBackend(), "
                      "operator_index='0')",
    "operator index float": "ast.KeyedOperator(Fn(), key_selector=key, "
                            "backend=ast.HeapBackend(), operator_index=0.0)",
    "operator config": "ast.KeyedOperator(Fn(), key_selector=key, backend=ast.HeapBackend(), "
                       "config={})",
    "operator clock": "ast.KeyedOperator(Fn(), key_selector=key, backend=ast.HeapBackend(), "
                      "clock=5)",
    "operator restore_from": "ast.KeyedOperator(Fn(), key_selector=key, "
                             "backend=ast.HeapBackend(), restore_from=5)",
    "operator output_list": "ast.KeyedOperator(Fn(), key_selector=key, "
                            "backend=ast.HeapBackend(), output_list=(1,))",
    "operator backend": "ast.KeyedOperator(Fn(), key_selector=key, backend='heap')",
    "operator function": "ast.KeyedOperator('fn', key_selector=key, backend=ast.HeapBackend())",
    "run parallelism": "ast.run(Fn(), [], key_selector=key, parallelism='2')",
    "run checkpoint_id": "ast.run(Fn(), [], key_selector=key, checkpoint_dir=path, "
                         "checkpoint_id='1')",
    "run checkpoint_dir": "ast.run(Fn(), [], key_selector=key, checkpoint_dir=1, "
                          "checkpoint_id=1)",
    "run records": "ast.run(Fn(), 5, key_selector=key)",
    "controller batch_size": "ast.AsyncExecutionController(ast.HeapBackend(), batch_size='1', "
                             "buffer_timeout_ms=0, max_in_flight=1)",
    "controller max_in_flight": "ast.AsyncExecutionController(ast.HeapBackend(), "
                                "batch_size=1, buffer_timeout_ms=0, max_in_flight=None)",
    "controller executor": "ast.AsyncExecutionController('x', batch_size=1, "
                           "buffer_timeout_ms=0, max_in_flight=1)",
    "controller executor None": "ast.AsyncExecutionController(None, batch_size=1, "
                                "buffer_timeout_ms=0, max_in_flight=1)",
    "controller record_timeout_ms str": "ast.AsyncExecutionController(ast.HeapBackend(), "
                                        "batch_size=1, buffer_timeout_ms=0, max_in_flight=1, "
                                        "record_timeout_ms='x')",
    "controller record_timeout_ms negative": "ast.AsyncExecutionController(ast.HeapBackend(), "
                                             "batch_size=1, buffer_timeout_ms=0, "
                                             "max_in_flight=1, record_timeout_ms=-5)",
    "controller timeout_scheduler": "ast.AsyncExecutionController(ast.HeapBackend(), "
                                    "batch_size=1, buffer_timeout_ms=0, max_in_flight=1, "
                                    "timeout_scheduler=5)",
    "controller iterator_chunk_size": "ast.AsyncExecutionController(ast.HeapBackend(), "
                                      "batch_size=1, buffer_timeout_ms=0, max_in_flight=1, "
                                      "iterator_chunk_size=2**63)",
    "rocksdb io_parallelism": "ast.RocksDBBackend(path, io_parallelism='2')",
    "rocksdb inline_read_keys": "ast.RocksDBBackend(path, inline_read_keys=1.5)",
    "rocksdb options": "ast.RocksDBBackend(path, options={})",
    "rocksdb path": "ast.RocksDBBackend(5)",
    "remote latency": "ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms='1')",
    "config batch_size": "ast.AsyncStateConfig(batch_size='1')",
    "key group range": "ast.KeyGroupRange('a', 3)",
    "key group": "ast.assign_to_key_group('k', '128')",
    "operator index for key": "ast.operator_index_for_key('k', 128, '2')",
    "combine_all": "ast.combine_all(5)",
    "then_apply": "ast.completed_future(1).then_apply(5).result()",
    "checkpoint_path": "ast.checkpoint_path('x', '1')",
    "operator parallelism bool": "ast.KeyedOperator(Fn(), key_selector=key, "
                                 "backend=ast.HeapBackend(), parallelism=True)",
    # Awaited inside an open KeyedOperator `op`:
    "watermark bool": "await op.advance_watermark(True)",
    "watermark str": "await op.advance_watermark('1')",
    "processing time float": "await op.advance_processing_time(1.0)",
    "snapshot id": "await op.snapshot(path, '1')",
}

_PROBE = r"""
import asyncio, json, shutil, sys, tempfile
import asyncstate as ast
from asyncstate import _compiled

class Fn(ast.KeyedProcessFunction):
    def process_element(self, value, ctx):
        return None

def key(record):
    return record

async def in_operator(expression, path):
    async with ast.KeyedOperator(Fn(), key_selector=key, backend=ast.HeapBackend(),
                                 clock=ast.ManualClock()) as op:
        await eval(expression, {"op": op, "path": path})

out = {"mode": _compiled.mode(), "errors": {}}
for name, statement in json.loads(sys.argv[1]).items():
    path = tempfile.mkdtemp(prefix="asyncstate-args-")
    try:
        if statement.startswith("await "):
            asyncio.run(in_operator(statement[len("await "):], path))
        else:
            exec(statement)
        out["errors"][name] = None
    except Exception as exc:
        out["errors"][name] = [type(exc).__name__, str(exc).replace(path, "<path>")]
    finally:
        shutil.rmtree(path, ignore_errors=True)
print(json.dumps(out))
"""


def _errors(pure: bool) -> dict[str, list[str] | None]:
    env = dict(os.environ)
    env.pop("ASYNCSTATE_EXPECT_IMPLEMENTATION", None)
    if pure:
        env[_compiled.PURE_PYTHON_ENV] = "1"
    else:
        env.pop(_compiled.PURE_PYTHON_ENV, None)
    done = subprocess.run([sys.executable, "-W", "error", "-c", _PROBE, json.dumps(CASES)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
                          check=True)
    result = json.loads(done.stdout)
    assert result["mode"] == ("python" if pure else "compiled")
    return result["errors"]  # type: ignore[no-any-return]


@pytest.mark.skipif(bool(_compiled.problems()),
                    reason="the compiled modules are not built here")
def test_every_wrong_argument_raises_the_same_error_on_both_builds() -> None:
    compiled, python = _errors(pure=False), _errors(pure=True)
    for name in CASES:
        assert python[name] is not None, f"{name}: no error"
        assert compiled[name] == python[name], name


def test_the_controller_names_a_wrong_argument() -> None:
    errors = _errors(pure=True)
    assert errors["controller executor"] == [
        "TypeError", "executor must be a StateExecutor (a state backend), got str"]
    assert errors["controller executor None"] == [
        "TypeError", "executor must be a StateExecutor (a state backend), got NoneType"]
    for case in ("record_timeout_ms str", "record_timeout_ms negative",
                 "iterator_chunk_size"):
        kind, message = errors[f"controller {case}"]  # type: ignore[misc]
        assert kind == "ConfigError" and message.startswith(case.split()[0]), (case, message)
    kind, message = errors["controller timeout_scheduler"]  # type: ignore[misc]
    assert kind == "TypeError" and "timeout_scheduler must have call_later" in message
