"""StateFuture and its helpers: combinators, failures and inspection.

Pending futures are completed with the controller-side `_complete` / `_fail`: that is how
the controller delivers results, and no loop is needed for either path."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest
from shared_functions import Boom, run_python

import asyncstate as ast
from asyncstate.runtime.context import RecordContext
from asyncstate.runtime.future import StateFuture, failed_future


def pending() -> StateFuture[Any]:
    return StateFuture()


def test_then_apply_on_pending_runs_when_completed() -> None:
    seen: list[int] = []
    fut = pending()
    result = fut.then_apply(lambda v: seen.append(v) or v * 2)
    assert seen == []
    assert not result.done()
    fut._complete(21)
    assert seen == [21]
    assert result.done()
    assert result.result() == 42


def test_then_apply_on_completed_runs_before_returning() -> None:
    seen: list[int] = []
    result = ast.completed_future(4).then_apply(lambda v: seen.append(v) or v + 1)
    assert seen == [4]
    assert result.done()
    assert result.result() == 5


def test_then_accept_on_pending_and_completed_yields_none() -> None:
    seen: list[str] = []
    fut = pending()
    accepted = fut.then_accept(seen.append)
    fut._complete("a")
    assert accepted.result() is None
    accepted2 = ast.completed_future("b").then_accept(seen.append)
    assert seen == ["a", "b"]
    assert accepted2.done()
    assert accepted2.result() is None


def test_callbacks_on_one_future_run_in_registration_order() -> None:
    order: list[int] = []
    fut = pending()
    for i in range(5):
        fut.then_accept(lambda _v, i=i: order.append(i))
    fut._complete(None)
    assert order == [0, 1, 2, 3, 4]


def test_chain_of_pending_callbacks_runs_in_chain_order() -> None:
    fut = pending()
    result = fut.then_apply(lambda v: v + 1).then_apply(lambda v: v * 10).then_apply(str)
    fut._complete(1)
    assert result.result() == "20"


def test_then_compose_on_pending_waits_for_the_inner_future() -> None:
    outer = pending()
    inner = pending()
    result = outer.then_compose(lambda v: inner.then_apply(lambda w: v + w))
    outer._complete(1)
    assert not result.done()
    inner._complete(10)
    assert result.result() == 11


def test_then_compose_on_pending_with_completed_inner() -> None:
    outer = pending()
    result = outer.then_compose(lambda v: ast.completed_future(v * 3))
    outer._complete(5)
    assert result.result() == 15


def test_then_compose_on_completed_with_pending_inner() -> None:
    inner = pending()
    result = ast.completed_future(2).then_compose(lambda v: inner)
    assert not result.done()
    inner._complete("x")
    assert result.result() == "x"


def test_then_compose_inner_failure_fails_result() -> None:
    outer = pending()
    inner = pending()
    result = outer.then_compose(lambda _v: inner)
    outer._complete(None)
    err = Boom("inner")
    inner._fail(err)
    assert result.exception() is err


def named_non_future_callback(value: Any) -> Any:
    return value


@pytest.mark.parametrize("already_done", [False, True], ids=["pending", "completed"])
def test_then_compose_with_non_future_fails_with_type_error_naming_fn(already_done: bool) -> None:
    fut = ast.completed_future(3) if already_done else pending()
    result = fut.then_compose(named_non_future_callback)  # returns an int, not a future
    if not already_done:
        fut._complete(3)
    exc = result.exception()
    assert isinstance(exc, TypeError)
    assert "named_non_future_callback" in str(exc)
    assert re.search(r"\bint\b", str(exc))


@pytest.mark.parametrize("already_done", [False, True], ids=["pending", "completed"])
def test_conditional_compose_with_non_future_branch_fails_with_type_error(
        already_done: bool) -> None:
    fut = ast.completed_future(3) if already_done else pending()
    result = fut.then_conditionally_compose(lambda _v: True, named_non_future_callback)
    if not already_done:
        fut._complete(3)
    exc = result.exception()
    assert isinstance(exc, TypeError)
    assert "named_non_future_callback" in str(exc)


@pytest.mark.parametrize("first", ["self", "other"])
def test_then_combine_fires_once_both_are_done(first: str) -> None:
    a, b = pending(), pending()
    result = a.then_combine(b, lambda x, y: (x, y))
    if first == "self":
        a._complete(1)
        assert not result.done()
        b._complete(2)
    else:
        b._complete(2)
        assert not result.done()
        a._complete(1)
    assert result.result() == (1, 2)


def test_then_combine_on_completed_futures_is_immediate() -> None:
    result = ast.completed_future(3).then_combine(ast.completed_future(4), lambda x, y: x * y)
    assert result.result() == 12


@pytest.mark.parametrize("failing", ["self", "other"])
def test_then_combine_failure_of_either_side_skips_fn(failing: str) -> None:
    calls: list[Any] = []
    a, b = pending(), pending()
    result = a.then_combine(b, lambda x, y: calls.append((x, y)))
    err = Boom(failing)
    if failing == "self":
        a._fail(err)
        b._complete(2)
    else:
        a._complete(1)
        b._fail(err)
    assert calls == []
    assert result.exception() is err


@pytest.mark.parametrize("already_done", [False, True], ids=["pending", "completed"])
@pytest.mark.parametrize(
    ("value", "with_false", "expected"),
    [(5, True, (True, "big 5")), (1, True, (False, "small 1")), (1, False, (False, None)),
     (5, False, (True, "big 5"))],
)
def test_then_conditionally_apply(already_done: bool, value: int, with_false: bool,
                                  expected: tuple[bool, Any]) -> None:
    fut = ast.completed_future(value) if already_done else pending()
    if_false = (lambda v: f"small {v}") if with_false else None
    result = fut.then_conditionally_apply(lambda v: v > 3, lambda v: f"big {v}", if_false)
    if not already_done:
        assert not result.done()
        fut._complete(value)
    assert result.result() == expected


@pytest.mark.parametrize("already_done", [False, True], ids=["pending", "completed"])
@pytest.mark.parametrize(("value", "with_false"), [(5, True), (1, True), (1, False), (5, False)])
def test_then_conditionally_accept(already_done: bool, value: int, with_false: bool) -> None:
    ran: list[str] = []
    fut = ast.completed_future(value) if already_done else pending()
    if_false = (lambda v: ran.append(f"false {v}")) if with_false else None
    result = fut.then_conditionally_accept(lambda v: v > 3,
                                           lambda v: ran.append(f"true {v}"), if_false)
    if not already_done:
        assert ran == []
        fut._complete(value)
    assert result.result() is (value > 3)
    if value > 3:
        assert ran == [f"true {value}"]
    elif with_false:
        assert ran == [f"false {value}"]
    else:
        assert ran == []


@pytest.mark.parametrize("already_done", [False, True], ids=["pending", "completed"])
@pytest.mark.parametrize(
    ("value", "with_false", "expected"),
    [(5, True, (True, 50)), (1, True, (False, -1)), (1, False, (False, None)),
     (5, False, (True, 50))],
)
def test_then_conditionally_compose(already_done: bool, value: int, with_false: bool,
                                    expected: tuple[bool, Any]) -> None:
    inner_true, inner_false = pending(), pending()
    fut = ast.completed_future(value) if already_done else pending()
    result = fut.then_conditionally_compose(
        lambda v: v > 3, lambda _v: inner_true,
        (lambda _v: inner_false) if with_false else None)
    if not already_done:
        fut._complete(value)
    if value > 3 or with_false:
        assert not result.done()  # waits for the chosen branch's future
        (inner_true if value > 3 else inner_false)._complete(expected[1])
    assert result.result() == expected


def test_conditional_callback_exception_fails_result() -> None:
    err = Boom("cond")

    def cond(_v: Any) -> bool:
        raise err

    fut = pending()
    results = [fut.then_conditionally_apply(cond, lambda v: v),
               fut.then_conditionally_accept(cond, lambda v: v),
               fut.then_conditionally_compose(cond, ast.completed_future)]
    fut._complete(1)
    assert [r.exception() for r in results] == [err, err, err]


def test_failure_skips_every_callback_down_the_chain() -> None:
    called: list[str] = []
    head = pending()
    tail = (head.then_apply(lambda v: called.append("apply"))
            .then_compose(lambda v: called.append("compose") or ast.completed_future(v))
            .then_combine(ast.completed_future(1), lambda a, b: called.append("combine"))
            .then_conditionally_apply(lambda v: called.append("cond") or True, lambda v: v)
            .then_accept(lambda v: called.append("accept")))
    err = Boom("head")
    head._fail(err)
    assert called == []
    assert tail.exception() is err
    with pytest.raises(Boom) as info:
        tail.result()
    assert info.value is err


def test_failure_on_already_failed_future_skips_callbacks() -> None:
    called: list[str] = []
    err = Boom("done")
    fut = failed_future(err)
    results = [fut.then_apply(lambda v: called.append("a")),
               fut.then_accept(lambda v: called.append("b")),
               fut.then_compose(lambda v: called.append("c")),
               fut.then_combine(ast.completed_future(1), lambda a, b: called.append("d"))]
    assert called == []
    assert all(r.exception() is err for r in results)


@pytest.mark.parametrize("already_done", [False, True], ids=["pending", "completed"])
@pytest.mark.parametrize("combinator", ["apply", "accept", "compose", "combine",
                                        "cond_apply", "cond_accept", "cond_compose"])
def test_callback_exception_fails_returned_future_and_is_not_raised(
        already_done: bool, combinator: str) -> None:
    err = Boom(combinator)

    def bad(*_args: Any) -> Any:
        raise err

    fut = ast.completed_future(1) if already_done else pending()
    calls = {
        "apply": lambda: fut.then_apply(bad),
        "accept": lambda: fut.then_accept(bad),
        "compose": lambda: fut.then_compose(bad),
        "combine": lambda: fut.then_combine(ast.completed_future(2), bad),
        "cond_apply": lambda: fut.then_conditionally_apply(lambda _v: True, bad),
        "cond_accept": lambda: fut.then_conditionally_accept(lambda _v: False, bad, bad),
        "cond_compose": lambda: fut.then_conditionally_compose(lambda _v: True, bad),
    }
    result = calls[combinator]()  # must not raise
    if not already_done:
        fut._complete(1)  # must not raise either
    assert result.done()
    assert result.exception() is err
    # the failure travels on down the chain, skipping later callbacks
    later: list[Any] = []
    assert result.then_apply(later.append).exception() is err
    assert later == []


@pytest.mark.parametrize("already_done", [False, True], ids=["pending", "completed"])
@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit, asyncio.CancelledError])
def test_base_exceptions_from_callbacks_propagate(already_done: bool,
                                                  exc_type: type[BaseException]) -> None:
    def bad(_v: Any) -> Any:
        raise exc_type("stop")

    if already_done:
        with pytest.raises(exc_type):
            ast.completed_future(1).then_apply(bad)
    else:
        fut = pending()
        result = fut.then_apply(bad)
        with pytest.raises(exc_type):
            fut._complete(1)
        assert not result.done()  # never captured into the future


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit, asyncio.CancelledError])
@pytest.mark.parametrize("bad_at", [0, 1, 2])
def test_callbacks_after_one_raising_a_base_exception_still_run(
        exc_type: type[BaseException], bad_at: int) -> None:
    """A BaseException from one callback propagates out of the completing call only after
    the future's other callbacks ran, so no future chained on it stays pending forever."""
    fut = pending()
    seen: list[int] = []

    def callback(i: int) -> Any:
        def run(v: Any) -> Any:
            seen.append(i)
            if i == bad_at:
                raise exc_type(f"callback {i}")
            return v + i
        return run

    results = [fut.then_apply(callback(i)) for i in range(3)]
    with pytest.raises(exc_type, match=f"^callback {bad_at}$"):
        fut._complete(10)
    assert seen == [0, 1, 2]
    for i, result in enumerate(results):
        assert result.done() is (i != bad_at)  # the raising one is never captured
        if i != bad_at:
            assert result.result() == 10 + i


def test_base_exception_from_compose_propagates() -> None:
    def bad(_v: Any) -> Any:
        raise KeyboardInterrupt

    fut = pending()
    fut.then_compose(bad)
    with pytest.raises(KeyboardInterrupt):
        fut._complete(None)


def test_result_and_exception_raise_invalid_state_error_while_pending() -> None:
    fut = pending()
    assert not fut.done()
    with pytest.raises(ast.InvalidStateError, match=r"^StateFuture\.result\(\)"):
        fut.result()
    with pytest.raises(ast.InvalidStateError, match=r"^StateFuture\.exception\(\)"):
        fut.exception()
    fut._complete(None)
    assert fut.exception() is None
    assert fut.result() is None


def test_exception_returns_the_original_object_and_result_raises_it() -> None:
    err = Boom("x")
    fut = pending()
    fut._fail(err)
    assert fut.done()
    assert fut.exception() is err
    with pytest.raises(Boom) as info:
        fut.result()
    assert info.value is err


def test_future_completes_only_once() -> None:
    fut = pending()
    fut._complete(1)
    with pytest.raises(ast.InvalidStateError):
        fut._complete(2)
    with pytest.raises(ast.InvalidStateError):
        fut._fail(Boom())
    assert fut.result() == 1


def test_completed_and_void_helpers() -> None:
    assert ast.completed_future("v").result() == "v"
    void = ast.completed_void_future()
    assert void.done()
    assert void.result() is None
    assert void.exception() is None
    seen: list[Any] = []
    assert void.then_accept(seen.append).result() is None
    assert seen == [None]
    assert isinstance(void, ast.StateFuture)


def test_a_future_that_a_then_callback_waits_on_refuses_cancel() -> None:
    fut = pending()
    chained = fut.then_apply(lambda v: v + 1)
    assert fut.cancel() is False
    assert fut.cancelled() is False
    assert not fut.done()
    fut._complete(1)
    assert chained.result() == 2


def test_combine_all_keeps_input_order_whatever_the_completion_order() -> None:
    futures = [pending() for _ in range(4)]
    combined = ast.combine_all(futures)
    for i in (3, 1, 0):
        futures[i]._complete(i * 10)
        assert not combined.done()
    futures[2]._complete(20)
    assert combined.result() == [0, 10, 20, 30]


def test_combine_all_mixes_completed_and_pending() -> None:
    p = pending()
    combined = ast.combine_all([ast.completed_future("a"), p, ast.completed_future("c")])
    assert not combined.done()
    p._complete("b")
    assert combined.result() == ["a", "b", "c"]


def test_combine_all_of_completed_and_empty() -> None:
    assert ast.combine_all([]).result() == []
    assert ast.combine_all([ast.completed_future(1), ast.completed_future(2)]).result() == [1, 2]
    assert ast.combine_all(iter([ast.completed_future(1)])).result() == [1]


def test_combine_all_fails_with_the_first_failure() -> None:
    futures = [pending() for _ in range(3)]
    combined = ast.combine_all(futures)
    first, second = Boom("first"), Boom("second")
    futures[1]._fail(first)
    assert combined.exception() is first
    futures[0]._fail(second)
    futures[2]._complete(1)
    assert combined.exception() is first


def test_combine_all_with_an_already_failed_input() -> None:
    err = Boom("early")
    combined = ast.combine_all([pending(), failed_future(err)])
    assert combined.exception() is err
    combined2 = ast.combine_all([ast.completed_future(1), failed_future(err)])
    assert combined2.exception() is err


def test_flink_scenario_35_combinators() -> None:
    counter = 0

    def add(v: int) -> None:
        nonlocal counter
        counter += v

    f1 = pending()
    f1.then_accept(add)
    f1._complete(5)
    assert counter == 5

    def add_and_str(v: int) -> str:
        add(v)
        return str(counter)

    def sub_str(s: str) -> None:
        nonlocal counter
        counter -= int(s)

    f2 = pending()
    f3 = f2.then_apply(add_and_str)
    f2._complete(3)
    assert counter == 8
    f3.then_accept(sub_str)
    assert counter == 0

    f4, f5 = pending(), pending()

    def compose(v: int) -> StateFuture[Any]:
        add(v)
        return f5

    f4.then_compose(compose).then_accept(add)
    f4._complete(6)
    assert counter == 6
    f5._complete(3)
    assert counter == 9

    f6, f7 = pending(), pending()
    f6.then_combine(f7, lambda a, b: add(a - b))
    f6._complete(4)
    assert counter == 9
    f7._complete(13)
    assert counter == 0

    ast.completed_future(3).then_accept(add)
    assert counter == 3

    counter = 0
    futures = [pending() for _ in range(5)]

    def digits(values: list[int]) -> None:
        nonlocal counter
        for v in values:
            counter = counter * 10 + v

    ast.combine_all(futures).then_accept(digits)
    for i, f in enumerate(futures[:-1]):
        f._complete(i + 1)
        assert counter == 0
    futures[-1]._complete(5)
    assert counter == 12345


class Boom1(Exception):
    pass


class Boom2(Exception):
    pass


def _boom1(_: Any) -> Any:
    raise Boom1("first")


def _boom2(_: Any) -> Any:
    raise Boom2("second")


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
        proc = run_python(code, pure=pure)
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


def test_result_and_exception_before_completion_raise_invalid_state_error() -> None:
    fut: StateFuture[int] = StateFuture()
    with pytest.raises(ast.InvalidStateError):
        fut.result()
    with pytest.raises(ast.InvalidStateError, match=r"exception\(\) called before the future "
                       "completed"):
        fut.exception()
    assert issubclass(ast.InvalidStateError, RuntimeError)  # as asyncio's is
    assert not fut.done()


def test_repr_of_each_state() -> None:
    assert repr(StateFuture()) == "<StateFuture pending>"
    assert repr(ast.completed_future([1])) == "<StateFuture done result=[1]>"
    assert repr(failed_future(ValueError("z"))) == "<StateFuture failed exception=ValueError('z')>"


def test_cancel_of_a_pending_future_keeps_its_record_until_the_backend_answers() -> None:
    ctx = RecordContext("r", "k", b"k", 0, None)
    fut: StateFuture[int] = StateFuture(ctx)
    assert ctx.ref_count == 1
    assert fut.cancel(msg="deadline") is True
    assert fut.cancelled() and fut.done()
    with pytest.raises(asyncio.CancelledError, match="deadline"):
        fut.result()
    assert fut.cancel() is False  # once
    assert ctx.ref_count == 1  # the request is still on its way
    fut._complete(1)  # the backend's answer goes nowhere, and the reference goes
    assert ctx.ref_count == 0
    assert fut.cancelled()
    with pytest.raises(asyncio.CancelledError):
        fut.result()
    failed: StateFuture[int] = StateFuture(ctx2 := RecordContext("r", "k", b"k", 0, None))
    assert failed.cancel()
    failed._fail(Boom("late"))  # a failure after the cancel is no unobserved failure
    assert ctx2.ref_count == 0 and ctx2.unobserved_failure() is None
    assert ast.completed_future(1).cancel() is False


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
