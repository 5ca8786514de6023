"""Record contexts: compared by identity, and refused once their record finished or outside
any record (in open(), from Tasks and callbacks that outlive it)."""

from __future__ import annotations

import asyncio

import pytest
from shared_functions import (
    Step,
    keyed_operator,
)

import asyncstate as ast


async def test_ctx_used_after_its_record_finished_raises(make_backend):
    stash = []

    class Fn(ast.KeyedProcessFunction):
        def process_element(self, value, ctx):
            if value[1] == "stash":
                stash.append(ctx)
                ctx.emit("stashed")
            else:
                try:
                    stash[0].emit("through a dead ctx")
                except ast.InvalidStateError:
                    ctx.emit("rejected")

    async with keyed_operator(Fn(), make_backend()) as op:
        await op.process(("a", "stash"))
        await op.drain()
        with pytest.raises(ast.InvalidStateError):
            stash[0].emit("late")
        with pytest.raises(ast.InvalidStateError):
            _ = stash[0].current_key
        await op.process(("a", "use"))
        await op.drain()
        assert op.outputs() == ["stashed", "rejected"]


async def test_ctx_used_after_record_finished_from_user_code_fails_the_operator(make_backend):
    stash = []

    class Fn(ast.KeyedProcessFunction):
        def process_element(self, value, ctx):
            if value[1] == "stash":
                stash.append(ctx)
            else:
                stash[0].emit("through a dead ctx")

    with pytest.raises(ast.InvalidStateError):
        async with keyed_operator(Fn(), make_backend()) as op:
            await op.process(("a", "stash"))
            await op.drain()
            await op.process(("b", "use"))
            await op.drain()


async def test_state_access_in_open_raises():
    class Fn(ast.KeyedProcessFunction):
        def open(self, ctx):
            self.v = ctx.get_state(ast.ValueStateDescriptor("v"))
            self.v.value()

        def process_element(self, value, ctx):
            pass

    with pytest.raises(ast.InvalidStateError):
        async with keyed_operator(Fn(), ast.HeapBackend()):
            pass


def test_state_access_in_open_fails_run():
    class Fn(ast.KeyedProcessFunction):
        def open(self, ctx):
            ctx.get_list_state(ast.ListStateDescriptor("l")).add(1)

        def process_element(self, value, ctx):
            pass

    with pytest.raises(ast.InvalidStateError):
        ast.run(Fn(), [1], key_selector=lambda r: r)


async def test_state_access_from_a_task_that_outlived_its_record_raises(make_backend):
    tasks = []
    record_done = asyncio.Event()

    async def later(fn):
        await record_done.wait()
        return await fn.v.value()

    async def spawn(fn, ctx):
        await fn.v.update(1)
        tasks.append(asyncio.get_running_loop().create_task(later(fn)))

    async with keyed_operator(Step(), make_backend()) as op:
        await op.process(("a", spawn))
        await op.drain()
        record_done.set()
        with pytest.raises(ast.InvalidStateError):
            await tasks[0]


async def test_state_access_from_a_callback_that_outlived_its_record_raises(make_backend):
    results = []
    called = asyncio.Event()

    def later(fn):
        try:
            fn.v.update(2)
        except ast.InvalidStateError as exc:
            results.append(exc)
        called.set()

    class Fn(Step):
        def process_element(self, record, ctx):
            # A loop callback created in the record (in its context), run after it finished.
            self.trigger = asyncio.get_running_loop().create_future()
            self.trigger.add_done_callback(lambda _: later(self))
            return self.v.update(1)

    fn = Fn()
    async with keyed_operator(fn, make_backend()) as op:
        await op.process(("a", None))
        await op.drain()
        fn.trigger.set_result(None)
        async with asyncio.timeout(5):
            await called.wait()
    assert len(results) == 1


def test_record_contexts_compare_by_identity():
    controller = ast.AsyncExecutionController(ast.HeapBackend(), batch_size=10,
                                              buffer_timeout_ms=0, max_in_flight=10)
    a = controller.build_context("record", "key")
    b = controller.build_context("record", "key")
    assert isinstance(a, ast.RecordContext)
    assert a == a
    assert a != b
    assert len({a, b}) == 2
    assert (a.record, a.key, a.ref_count) == ("record", "key", 0)
    assert a.key_group == ast.assign_to_key_group("key", 128)
    assert a.retain() == 1
    assert a.release() == 0
