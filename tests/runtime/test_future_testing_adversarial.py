"""Adversarial probes of StateFuture, asyncstate.testing, the pytest plugin and asyncstate.log.

Every test asserts the documented behaviour (docs/api.md, the module docstrings).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest

import asyncstate as ast
import asyncstate.log as aslog
from asyncstate.runtime.future import StateFuture, failed_future
from asyncstate.runtime.requests import StateKind, StateRequestType
from asyncstate.testing import ManualExecutor, ManualScheduler, ManualTimerHandle

GET = StateRequestType.VALUE_GET
UPDATE = StateRequestType.VALUE_UPDATE


class Boom(Exception):
    pass


class Boom1(Exception):
    pass


class Boom2(Exception):
    pass


def _boom1(_: Any) -> Any:
    raise Boom1("first")


def _boom2(_: Any) -> Any:
    raise Boom2("second")


def _run_python(code: str, *, pure: bool, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("ASYNCSTATE_PURE_PYTHON", None)
    if pure:
        env["ASYNCSTATE_PURE_PYTHON"] = "1"
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


# == StateFuture: callback order and failure isolation =======================================


def test_callbacks_added_after_completion_run_inline_in_registration_order() -> None:
    seen: list[str] = []
    fut = ast.completed_future(1)
    a = fut.then_apply(lambda v: seen.append("apply") or v + 1)
    assert seen == ["apply"]
    b = fut.then_accept(lambda v: seen.append("accept"))
    assert seen == ["apply", "accept"]
    c = fut.then_compose(lambda v: seen.append("compose") or ast.completed_future(v * 10))
    d = fut.then_conditionally_accept(lambda v: seen.append("cond") or True, seen.append)
    assert seen == ["apply", "accept", "compose", "cond", 1]
    assert (a.result(), b.result(), c.result(), d.result()) == (2, None, 10, True)


def test_many_callbacks_on_one_pending_future_keep_registration_order() -> None:
    seen: list[int] = []
    fut: StateFuture[int] = StateFuture()
    outs = []
    for i in range(1000):
        if i % 3 == 0:
            outs.append(fut.then_apply(lambda v, i=i: seen.append(i) or i))
        elif i % 3 == 1:
            outs.append(fut.then_accept(lambda v, i=i: seen.append(i)))
        else:
            outs.append(fut.then_compose(lambda v, i=i: seen.append(i) or ast.completed_future(i)))
    assert seen == []
    fut._complete(0)
    assert seen == list(range(1000))
    assert all(o.done() for o in outs)


def test_callback_raising_fails_only_its_own_chained_future() -> None:
    fut: StateFuture[int] = StateFuture()
    before = fut.then_apply(lambda v: v + 1)
    bad = fut.then_apply(lambda v: (_ for _ in ()).throw(Boom("cb")))
    after = fut.then_accept(lambda v: None)
    downstream_of_bad = bad.then_apply(lambda v: pytest.fail("must be skipped"))
    fut._complete(1)
    assert fut.result() == 1
    assert before.result() == 2
    assert after.result() is None
    assert isinstance(bad.exception(), Boom)
    assert downstream_of_bad.exception() is bad.exception()


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit, asyncio.CancelledError])
def test_base_exception_from_then_combine_fn_propagates(exc_type: type[BaseException]) -> None:
    def fn(a: Any, b: Any) -> Any:
        raise exc_type()

    with pytest.raises(exc_type):
        ast.completed_future(1).then_combine(ast.completed_future(2), fn)


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit, asyncio.CancelledError])
def test_base_exception_from_pending_callback_propagates_from_completion(
        exc_type: type[BaseException]) -> None:
    fut: StateFuture[int] = StateFuture()

    def cb(v: int) -> None:
        raise exc_type()

    out = fut.then_accept(cb)
    with pytest.raises(exc_type):
        fut._complete(1)
    # The future itself completed; the exception was never captured into the chain.
    assert fut.result() == 1
    assert not out.done()


def test_chain_of_200_then_apply_on_pending_future() -> None:
    fut: StateFuture[int] = StateFuture()
    end = fut
    for _ in range(200):
        end = end.then_apply(lambda v: v + 1)
    fut._complete(0)
    assert end.result() == 200


# == then_combine ==========================================================================


def test_then_combine_with_itself() -> None:
    fut: StateFuture[int] = StateFuture()
    out = fut.then_combine(fut, lambda a, b: (a, b))
    assert not out.done()
    fut._complete(3)
    assert out.result() == (3, 3)
    assert ast.completed_future(4).then_combine(ast.completed_future(4), int.__add__).result() == 8


def test_then_combine_with_failed_other_fails_with_others_exception() -> None:
    exc = Boom("other")
    out = ast.completed_future(1).then_combine(failed_future(exc), lambda a, b: pytest.fail("no"))
    assert out.exception() is exc
    pend: StateFuture[int] = StateFuture()
    other: StateFuture[int] = StateFuture()
    out2 = pend.then_combine(other, lambda a, b: pytest.fail("no"))
    other._fail(exc)
    assert not out2.done()
    pend._complete(1)
    assert out2.exception() is exc


@pytest.mark.timeout(60)
def test_then_combine_with_non_state_future_raises_type_error_in_both_builds() -> None:
    code = """
    import warnings
    warnings.simplefilter("ignore", RuntimeWarning)  # no compiled build: the sources run
    import asyncstate as ast
    from asyncstate import _compiled
    print("MODE", _compiled.mode())
    try:
        ast.completed_future(1).then_combine(1, lambda a, b: (a, b))
    except TypeError as exc:
        print("RAISED TypeError", exc)
    """
    for pure in (False, True):
        proc = _run_python(code, pure=pure)
        assert "RAISED TypeError" in proc.stdout, (pure, proc.stderr[-1500:])
        # A checkout without the compiled build runs its sources even when not asked to.
        python = pure or "MODE python" in proc.stdout
        assert ("then_combine() expects a StateFuture" in proc.stdout) == python  # compiled:
        # mypyc's own message at the call (docs/api.md, differences between the builds)


def test_then_combine_fn_raising_fails_the_result() -> None:
    a: StateFuture[int] = StateFuture()
    b: StateFuture[int] = StateFuture()
    out = a.then_combine(b, lambda x, y: x / y)
    b._complete(0)
    a._complete(1)
    assert isinstance(out.exception(), ZeroDivisionError)


# == combine_all ===========================================================================


def test_combine_all_of_empty_list_and_empty_generator() -> None:
    assert ast.combine_all([]).result() == []
    assert ast.combine_all(x for x in ()).result() == []


def test_combine_all_of_duplicates_of_one_pending_future() -> None:
    fut: StateFuture[str] = StateFuture()
    out = ast.combine_all([fut, fut, fut])
    assert not out.done()
    fut._complete("v")
    assert out.result() == ["v", "v", "v"]
    done = ast.completed_future(7)
    assert ast.combine_all([done, done]).result() == [7, 7]


def test_combine_all_consumes_a_generator_once() -> None:
    futs: list[StateFuture[int]] = [StateFuture() for _ in range(3)]
    out = ast.combine_all(f for f in futs)
    for i, f in enumerate(reversed(futs)):
        f._complete(i)
    assert out.result() == [2, 1, 0]


@pytest.mark.parametrize("bad", [1, None, "s"])
def test_combine_all_refuses_non_futures_with_type_error(bad: Any) -> None:
    # (The Python build names combine_all; the compiled build raises mypyc's own message.)
    with pytest.raises(TypeError):
        ast.combine_all([ast.completed_future(1), bad])


def test_combine_all_of_already_failed_futures_fails_with_first_in_input_order() -> None:
    e1, e2 = Boom1(), Boom2()
    out = ast.combine_all([ast.completed_future(0), failed_future(e1), failed_future(e2)])
    assert out.exception() is e1


def test_combine_all_of_pending_futures_fails_with_first_failure_in_time() -> None:
    a: StateFuture[int] = StateFuture()
    b: StateFuture[int] = StateFuture()
    out = ast.combine_all([a, b])
    e2 = Boom2()
    b._fail(e2)
    assert out.exception() is e2
    a._fail(Boom1())  # a later failure is ignored, not raised
    assert out.exception() is e2


class _CombineAllHandlesFailures(ast.KeyedProcessFunction):
    def open(self, ctx: Any) -> None:
        self.s = ctx.get_state(ast.ValueStateDescriptor("s"))

    async def process_element(self, value: Any, ctx: Any) -> None:
        a = self.s.value().then_apply(_boom1)
        b = self.s.value().then_apply(_boom2)
        try:
            await ast.combine_all([a, b])
        except Boom1:
            ctx.emit("handled")


@pytest.mark.timeout(30)
def test_combine_all_handled_failure_with_remote_backend() -> None:
    # Pending inputs: combine_all looks at every input, so handling its failure is enough.
    backend = ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0)
    out = ast.run(_CombineAllHandlesFailures(), [1], key_selector=lambda r: r, backend=backend)
    assert out == ["handled"]


@pytest.mark.timeout(30)
def test_combine_all_handled_failure_with_heap_backend() -> None:
    out = ast.run(_CombineAllHandlesFailures(), [1], key_selector=lambda r: r,
                  backend=ast.HeapBackend())
    assert out == ["handled"]


# == inspection, repr, cancel ================================================================


def test_result_and_exception_before_completion_raise_invalid_state_error() -> None:
    fut: StateFuture[int] = StateFuture()
    with pytest.raises(ast.InvalidStateError):
        fut.result()
    with pytest.raises(RuntimeError):  # InvalidStateError is also a RuntimeError
        fut.exception()
    assert not fut.done()


def test_repr_of_each_state() -> None:
    assert repr(StateFuture()) == "<StateFuture pending>"
    assert repr(ast.completed_future([1])) == "<StateFuture done result=[1]>"
    assert repr(failed_future(ValueError("z"))) == "<StateFuture failed exception=ValueError('z')>"


def test_cancel_is_refused_and_does_not_change_state() -> None:
    fut: StateFuture[int] = StateFuture()
    assert fut.cancel() is False
    assert fut.cancel(msg="x") is False
    assert not fut.cancelled()
    assert not fut.done()
    fut._complete(1)
    assert fut.result() == 1
    assert not fut.cancelled()


def test_repeated_result_does_not_grow_the_traceback() -> None:
    fut = failed_future(Boom("x"))

    def depth() -> int:
        try:
            fut.result()
        except Boom as exc:
            tb, n = exc.__traceback__, 0
            while tb is not None:
                n, tb = n + 1, tb.tb_next
            return n
        raise AssertionError("unreachable")

    first = depth()
    for _ in range(10):
        depth()
    assert depth() == first


def test_then_compose_does_not_mask_downstream_errors_as_invalid_state() -> None:
    loop = asyncio.new_event_loop()
    src: StateFuture[int] = StateFuture()
    out = src.then_compose(lambda v: ast.completed_future(v))

    async def register() -> None:
        out.add_done_callback(lambda f: None)

    loop.run_until_complete(register())
    loop.close()
    with pytest.raises(RuntimeError, match="closed") as info:
        src._complete(1)
    assert not isinstance(info.value, ast.InvalidStateError)


# == deep chains (subprocess: they may crash the interpreter) ================================

_DEEP_APPLY = """
from asyncstate.runtime.future import StateFuture
fut = StateFuture()
end = fut
for _ in range({n}):
    end = end.then_apply(lambda v: v + 1)
fut._complete(0)
print("RESULT", end.result())
"""

_DEEP_COMPOSE = """
from asyncstate.runtime.future import StateFuture, completed_future
N = {n}
pend = [StateFuture() for _ in range(N)]
def step(i):
    if i == N:
        return completed_future(i)
    return pend[i].then_compose(lambda v: step(i + 1))
top = step(0)
for p in pend:
    p._complete(None)
print("RESULT", top.result())
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("template", "n", "pure"), [
    pytest.param(_DEEP_APPLY, 150, True, id="apply-150-pure"),
    pytest.param(_DEEP_COMPOSE, 100, True, id="compose-100-pure"),
    pytest.param(_DEEP_APPLY, 10_000, False, id="apply-10k-compiled"),
    pytest.param(_DEEP_COMPOSE, 10_000, False, id="compose-10k-compiled"),
])
def test_chains_within_the_documented_depth_complete(template: str, n: int, pure: bool) -> None:
    """docs/api.md: callbacks on one pending future complete recursively, a few hundred
    links deep in the Python build and tens of thousands in the compiled one."""
    if not pure:
        mode = _run_python("import asyncstate._compiled as c, asyncstate; print(c.mode())",
                           pure=False)
        if mode.stdout.strip() != "compiled":
            pytest.skip("the compiled modules are not built here")
    proc = _run_python(template.format(n=n), pure=pure, timeout=100)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert f"RESULT {n}" in proc.stdout


# == asyncio interop ========================================================================


@pytest.mark.timeout(30)
async def test_plain_await_in_coroutine_and_from_task() -> None:
    loop = asyncio.get_running_loop()
    fut: StateFuture[int] = StateFuture()
    loop.call_soon(fut._complete, 5)
    assert await fut == 5  # plain await in the test's coroutine

    fut2: StateFuture[int] = StateFuture()

    async def waiter() -> int:
        return await fut2

    tasks = [asyncio.ensure_future(waiter()) for _ in range(3)]
    await asyncio.sleep(0)
    fut2._complete(11)
    assert await asyncio.gather(*tasks) == [11, 11, 11]


@pytest.mark.timeout(30)
async def test_shield_wait_as_completed_and_gather_return_exceptions() -> None:
    loop = asyncio.get_running_loop()
    f: StateFuture[int] = StateFuture()
    loop.call_soon(f._complete, 5)
    assert await asyncio.shield(f) == 5

    a: StateFuture[int] = StateFuture()
    b: StateFuture[int] = StateFuture()
    loop.call_soon(a._complete, 1)
    done, pending = await asyncio.wait({a, b}, return_when=asyncio.FIRST_COMPLETED)
    assert done == {a} and pending == {b}
    b._complete(2)

    c: StateFuture[str] = StateFuture()
    d: StateFuture[str] = StateFuture()
    loop.call_soon(d._complete, "d")
    loop.call_soon(loop.call_soon, c._complete, "c")  # one loop iteration after d
    assert [await x for x in asyncio.as_completed([c, d])] == ["d", "c"]

    e: StateFuture[int] = StateFuture()
    g: StateFuture[int] = StateFuture()
    exc = Boom("e")
    loop.call_soon(e._fail, exc)
    loop.call_soon(g._complete, 3)
    assert await asyncio.gather(e, g, e, return_exceptions=True) == [exc, 3, exc]


@pytest.mark.timeout(30)
@pytest.mark.skipif(sys.version_info >= (3, 12), reason="documented for Python 3.11")
async def test_wait_for_on_311_returns_the_result_after_the_deadline() -> None:
    # Documented: the cancel is refused, wait_for waits for the future and returns its result.
    fut: StateFuture[int] = StateFuture()
    asyncio.get_running_loop().call_later(0.05, fut._complete, 7)
    assert await asyncio.wait_for(fut, 0.001) == 7


@pytest.mark.timeout(30)
async def test_cancelled_task_is_cancelled_only_when_the_future_completes() -> None:
    fut: StateFuture[int] = StateFuture()

    async def waiter() -> int:
        return await fut

    task = asyncio.ensure_future(waiter())
    await asyncio.sleep(0)
    assert task.cancel()
    await asyncio.sleep(0.01)
    assert not task.done()
    fut._complete(3)
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.timeout(30)
async def test_add_done_callback_runs_in_the_given_context() -> None:
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="outer")
    ctx = contextvars.copy_context()
    ctx.run(var.set, "inner")
    seen: list[tuple[str, str]] = []
    pend: StateFuture[int] = StateFuture()
    pend.add_done_callback(lambda f: seen.append(("pending", var.get())), context=ctx)
    pend.add_done_callback(lambda f: seen.append(("pending-default", var.get())))
    pend._complete(1)
    assert seen == []  # through call_soon, not inline
    await asyncio.sleep(0)
    ast.completed_future(1).add_done_callback(
        lambda f: seen.append(("done", var.get())), context=ctx)
    await asyncio.sleep(0)
    assert seen == [("pending", "inner"), ("pending-default", "outer"), ("done", "inner")]


@pytest.mark.timeout(30)
async def test_remove_done_callback_removes_all_copies_and_keeps_then_callbacks() -> None:
    seen: list[str] = []
    fut: StateFuture[int] = StateFuture()

    def cb(f: Any) -> None:
        seen.append("cb")

    def other(f: Any) -> None:
        seen.append("other")

    fut.add_done_callback(cb)
    chained = fut.then_apply(lambda v: seen.append("then") or v)
    fut.add_done_callback(other)
    fut.add_done_callback(cb)
    assert fut.remove_done_callback(cb) == 2
    assert fut.remove_done_callback(cb) == 0
    fut._complete(1)
    assert seen == ["then"]
    await asyncio.sleep(0)
    assert seen == ["then", "other"]
    assert chained.result() == 1
    assert StateFuture().remove_done_callback(cb) == 0


def test_asyncio_protocol_methods_need_a_running_loop() -> None:
    fut: StateFuture[int] = StateFuture()
    with pytest.raises(RuntimeError):
        fut.get_loop()
    with pytest.raises(RuntimeError):
        fut.add_done_callback(lambda f: None)
    assert asyncio.isfuture(fut)


# == asyncstate.testing =====================================================================


def _bound_executor() -> tuple[ManualExecutor, ast.AsyncExecutionController, Any]:
    executor = ManualExecutor()
    aec = ast.AsyncExecutionController(executor, batch_size=100, buffer_timeout_ms=0,
                                       max_in_flight=100)

    class _State:
        def __init__(self, handle: Any) -> None:
            self.name = "v"
            self.handle = handle

    return executor, aec, _State(executor.register_state("v", StateKind.VALUE))


def test_manual_executor_unbound_and_empty_errors_are_clear() -> None:
    executor = ManualExecutor()
    with pytest.raises(ast.InvalidStateError, match="not bound"):
        executor.complete_next_batch()
    with pytest.raises(ast.InvalidStateError, match="not bound"):
        executor.fail_next_batch(Boom())
    with pytest.raises(ast.InvalidStateError, match="no batch"):
        executor.complete_random_batch()
    assert executor.complete_all() == 0
    bound, _, _ = _bound_executor()
    with pytest.raises(ast.InvalidStateError, match="no batch is pending"):
        bound.complete_next_batch()


def test_manual_executor_batch_index_range_and_negative_index() -> None:
    executor, aec, state = _bound_executor()
    for key in ("a", "b"):
        ctx = aec.build_context(key, key)
        aec.set_current_context(ctx)
        aec.handle_request(state, UPDATE, key)
        aec.trigger_if_needed(True)
    assert executor.pending_batch_num == 2
    with pytest.raises(IndexError, match="2 batches are pending"):
        executor.complete_batch(2)
    with pytest.raises(IndexError):
        executor.complete_batch(-3)
    assert executor.pending_batch_num == 2
    newest = executor.complete_batch(-1)
    assert [r.payload for r in newest] == ["b"]
    assert executor.delivered_batches == 1
    assert "pending_batches=1" in repr(executor)


def test_manual_executor_fail_next_batch_fails_its_futures_with_the_exception() -> None:
    executor, aec, state = _bound_executor()
    ctx = aec.build_context("r", "k")
    aec.set_current_context(ctx)
    read = aec.handle_request(state, GET, None)
    aec.trigger_if_needed(True)
    exc = Boom("lost reply")
    executor.fail_next_batch(exc)
    assert read.done()
    assert read.exception() is exc


def test_manual_executor_close_abandons_batches_and_refuses_new_ones() -> None:
    executor, aec, state = _bound_executor()
    ctx = aec.build_context("r", "k")
    aec.set_current_context(ctx)
    aec.handle_request(state, GET, None)
    aec.trigger_if_needed(True)
    executor.close()
    assert executor.closed
    assert executor.pending_batch_num == 0
    with pytest.raises(ast.InvalidStateError, match="closed"):
        executor.execute_batch([])


def test_manual_scheduler_refuses_negative_times_and_orders_ties() -> None:
    sched = ManualScheduler(start=10)
    with pytest.raises(ValueError, match="delay"):
        sched.call_later(-0.1, print)
    with pytest.raises(ValueError, match="backwards"):
        sched.advance(-1)
    ran: list[str] = []
    h1 = sched.call_later(1, ran.append, "a")
    sched.call_later(1, ran.append, "b")
    sched.call_later(0.5, ran.append, "c")
    cancelled = sched.call_later(0.1, ran.append, "x")
    cancelled.cancel()
    assert isinstance(h1, ManualTimerHandle)
    assert sched.pending_num == 3
    assert sched.next_deadline() == 10.5
    assert sched.advance(1) == 3
    assert ran == ["c", "a", "b"]
    assert sched.time() == 11
    assert sched.next_deadline() is None
    h1.cancel()  # no effect once it ran
    assert "cancelled" in repr(h1)


def test_manual_scheduler_nan_delay_is_refused_or_harmless() -> None:
    sched = ManualScheduler()
    ran: list[str] = []
    with contextlib.suppress(ValueError):
        sched.call_later(float("nan"), ran.append, "nan")
    sched.call_later(1, ran.append, "one")
    sched.advance(2)
    assert "one" in ran


def test_manual_scheduler_advance_nan_is_refused() -> None:
    sched = ManualScheduler()
    with pytest.raises(ValueError):
        sched.advance(float("nan"))
    assert sched.time() == 0.0


# == pytest plugin ==========================================================================


_seen_executors: list[ManualExecutor] = []


@pytest.mark.parametrize("round_", [0, 1])
def test_plugin_fixtures_are_fresh_per_test(manual_executor: ManualExecutor,
                                            manual_clock: ast.ManualClock, round_: int) -> None:
    assert manual_clock.now_ms() == 0
    manual_clock.advance(5)
    assert manual_executor.pending_batch_num == 0
    assert manual_executor.delivered_batches == 0
    assert manual_executor.rng.random() == pytest.approx(0.8444218515250481)
    assert all(e is not manual_executor for e in _seen_executors)
    _seen_executors.append(manual_executor)


def test_plugin_is_registered_as_pytest11_entry_point() -> None:
    from importlib.metadata import entry_points

    names = {ep.value for ep in entry_points(group="pytest11")}
    assert "asyncstate.pytest_plugin" in names


# == asyncstate.log =========================================================================


@pytest.fixture
def _restore_log_level() -> Iterator[None]:
    saved = aslog._threshold
    yield
    aslog._threshold = saved


@pytest.mark.usefixtures("_restore_log_level")
@pytest.mark.parametrize("bad", ["bogus", "", " debug", "warn", 10, None, logging.DEBUG])
def test_set_level_refuses_unknown_levels_with_config_error(bad: Any) -> None:
    before = aslog._threshold
    with pytest.raises(ast.ConfigError) as info:
        aslog.set_level(bad)
    assert isinstance(info.value, ValueError)
    assert info.value.option == "log level"
    assert "debug" in str(info.value)
    assert aslog._threshold == before  # a refused level changes nothing


@pytest.mark.usefixtures("_restore_log_level")
def test_set_level_is_case_insensitive_idempotent_and_filters(
        caplog: pytest.LogCaptureFixture) -> None:
    log = aslog.get_logger("asyncstate.adversarial")
    aslog.set_level("ERROR")
    aslog.set_level("error")
    caplog.set_level(logging.DEBUG)
    log.debug("d")
    log.info("i")
    log.warning("w")
    log.error("e", field=1)
    logs = [r for r in caplog.records if r.name == "asyncstate.adversarial"]
    assert [(r.asyncstate_event, r.levelname) for r in logs] == [("e", "ERROR")]
    assert logs[0].asyncstate_fields == {"field": 1}
    caplog.clear()
    aslog.set_level("Debug")
    log.debug("d")
    assert [r.asyncstate_event for r in caplog.records] == ["d"]


@pytest.mark.timeout(60)
def test_library_does_not_configure_structlog_or_logging() -> None:
    code = """
    import logging, structlog
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    import asyncstate as ast, asyncstate.log as aslog
    aslog.set_level("debug")
    class F(ast.KeyedProcessFunction):
        def open(self, ctx):
            self.s = ctx.get_state(ast.ValueStateDescriptor("s"))
        async def process_element(self, v, ctx):
            await self.s.update(v)
    ast.run(F(), [1, 2], key_selector=lambda r: r)
    assert not structlog.is_configured(), "structlog was configured"
    assert root.handlers == handlers and root.level == level, "logging root changed"
    print("OK")
    """
    proc = _run_python(code, pure=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "OK" in proc.stdout


@pytest.mark.timeout(60)
def test_invalid_log_level_env_var_fails_import_with_config_error() -> None:
    code = """
    import os
    os.environ["ASYNCSTATE_LOG_LEVEL"] = "bogus"
    try:
        import asyncstate
    except ValueError as exc:
        print("REFUSED", type(exc).__name__, exc)
    """
    proc = _run_python(code, pure=False)
    assert "REFUSED ConfigError log level must be one of" in proc.stdout, proc.stderr[-2000:]


@pytest.mark.timeout(60)
def test_empty_log_level_env_var_means_default() -> None:
    code = """
    import os
    os.environ["ASYNCSTATE_LOG_LEVEL"] = ""
    import asyncstate.log as aslog
    print("THRESHOLD", aslog._threshold)
    """
    proc = _run_python(code, pure=False)
    assert "THRESHOLD 30" in proc.stdout, proc.stderr[-2000:]
