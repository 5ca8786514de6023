"""StateFuture and its helpers: combinators, failures, inspection and the asyncio protocol.

Pending futures are completed with the controller-side `_complete` / `_fail`: that is how
the controller delivers results, and no loop is needed for either path.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest

import asyncstate as ast
from asyncstate.runtime.future import StateFuture, failed_future


def pending() -> StateFuture[Any]:
    return StateFuture()


class Boom(Exception):
    pass


# -- then_apply / then_accept ---------------------------------------------------------------


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


# -- then_compose -----------------------------------------------------------------------------


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


# -- then_combine ------------------------------------------------------------------------------


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


# -- conditionals ------------------------------------------------------------------------------


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


# -- failures ----------------------------------------------------------------------------------


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


# -- inspection -------------------------------------------------------------------------------


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


def test_state_futures_cannot_be_cancelled() -> None:
    fut = pending()
    assert fut.cancel() is False
    assert fut.cancelled() is False
    assert not fut.done()


# -- combine_all ---------------------------------------------------------------------------


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


# -- Flink scenario 35 ------------------------------------------------------------------------


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


# -- asyncio protocol ---------------------------------------------------------------------


async def test_await_completed_future_needs_no_loop_hop() -> None:
    fut = ast.completed_future(9)
    gen = fut.__await__()
    with pytest.raises(StopIteration) as info:
        next(gen)
    assert info.value.value == 9
    assert await ast.completed_future(10) == 10


async def test_awaiting_a_pending_future_inside_a_task() -> None:
    fut = pending()

    async def waiter() -> Any:
        return await fut

    task = asyncio.create_task(waiter())
    for _ in range(3):
        await asyncio.sleep(0)
    assert not task.done()
    fut._complete(7)
    assert await task == 7


async def test_awaiting_a_failed_future_raises_the_original_exception() -> None:
    fut = pending()
    err = Boom("await")

    async def waiter() -> Any:
        return await fut

    task = asyncio.create_task(waiter())
    await asyncio.sleep(0)
    asyncio.get_running_loop().call_soon(fut._fail, err)
    with pytest.raises(Boom) as info:
        await task
    assert info.value is err
    with pytest.raises(Boom):
        await failed_future(err)


async def test_awaiting_a_chain_completed_from_a_loop_callback() -> None:
    head = pending()
    chained = head.then_apply(lambda v: v + 1).then_compose(lambda v: ast.completed_future(v * 2))
    asyncio.get_running_loop().call_later(0.001, head._complete, 1)
    assert await chained == 4


async def test_asyncio_gather_on_state_futures() -> None:
    a, b = pending(), pending()
    loop = asyncio.get_running_loop()
    loop.call_soon(b._complete, "b")
    loop.call_soon(a._complete, "a")
    results = await asyncio.gather(a, ast.completed_future("c"), b)
    assert results == ["a", "c", "b"]


async def test_asyncio_gather_propagates_failure() -> None:
    a = pending()
    err = Boom("gather")
    asyncio.get_running_loop().call_soon(a._fail, err)
    with pytest.raises(Boom) as info:
        await asyncio.gather(ast.completed_future(1), a)
    assert info.value is err


async def test_asyncio_wait_for_on_state_futures() -> None:
    a = pending()
    asyncio.get_running_loop().call_later(0.001, a._complete, 5)
    assert await asyncio.wait_for(a, timeout=5) == 5
    assert await asyncio.wait_for(ast.completed_future(6), timeout=5) == 6
    b = pending()
    asyncio.get_running_loop().call_soon(b._fail, Boom("wait_for"))
    with pytest.raises(Boom):
        await asyncio.wait_for(b, timeout=5)


async def test_asyncio_wait_and_ensure_future_accept_state_futures() -> None:
    a = pending()
    assert asyncio.isfuture(a)
    assert asyncio.ensure_future(a) is a
    asyncio.get_running_loop().call_soon(a._complete, 1)
    done, not_done = await asyncio.wait([a], timeout=5)
    assert done == {a}
    assert not not_done


async def test_add_and_remove_done_callback() -> None:
    fut = pending()
    seen: list[Any] = []
    fut.add_done_callback(seen.append)
    fut.add_done_callback(seen.append)
    assert fut.remove_done_callback(seen.append) == 2
    fut.add_done_callback(lambda f: seen.append(f.result()))
    fut._complete(3)
    assert seen == []  # done callbacks run from the loop, not inline
    await asyncio.sleep(0)
    assert seen == [3]
    assert fut.get_loop() is asyncio.get_running_loop()
