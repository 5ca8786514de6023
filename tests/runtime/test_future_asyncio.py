"""StateFuture as an asyncio awaitable: await, gather, wait_for, shield, done callbacks
and their contexts."""

from __future__ import annotations

import asyncio
import contextvars
import sys
from typing import Any

import pytest
from shared_functions import Boom

import asyncstate as ast
from asyncstate.runtime.future import StateFuture, failed_future


def pending() -> StateFuture[Any]:
    return StateFuture()


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
async def test_wait_for_times_out_on_a_future_that_never_completes() -> None:
    fut: StateFuture[int] = StateFuture()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(fut, 0.01)
    assert fut.cancelled()
    fut._complete(7)  # a late answer goes nowhere
    with pytest.raises(asyncio.CancelledError):
        fut.result()


@pytest.mark.timeout(30)
async def test_wait_for_returns_a_result_that_comes_in_time() -> None:
    fut: StateFuture[int] = StateFuture()
    asyncio.get_running_loop().call_soon(fut._complete, 7)
    assert await asyncio.wait_for(fut, 30) == 7
    assert not fut.cancelled()


@pytest.mark.timeout(30)
async def test_a_task_cancelled_while_it_awaits_a_future_is_cancelled_at_once() -> None:
    fut: StateFuture[int] = StateFuture()

    async def waiter() -> int:
        return await fut

    task = asyncio.ensure_future(waiter())
    await asyncio.sleep(0)
    assert task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert fut.cancelled() and task.cancelled()
    fut._complete(3)


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
    with pytest.raises(RuntimeError, match="no running event loop"):
        fut.get_loop()
    with pytest.raises(RuntimeError, match="no running event loop"):
        fut.add_done_callback(lambda f: None)
    assert asyncio.isfuture(fut)
