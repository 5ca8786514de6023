"""Record contexts: compared by identity, and refused once their record finished or outside
any record (in open(), from Tasks and callbacks that outlive it)."""

from __future__ import annotations

import asyncio
import contextvars

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


ORPHAN = r"^state 'v' accessed for the record with key 'a' after that record finished"


async def test_state_access_from_a_task_that_outlived_its_record_fails_the_run(make_backend):
    tasks = []
    release = asyncio.Event()

    async def later(fn):
        await release.wait()
        return await fn.v.value()

    async def spawn(fn, ctx):
        await fn.v.update(1)
        tasks.append(asyncio.get_running_loop().create_task(later(fn)))

    with pytest.raises(ast.InvalidStateError, match=ORPHAN) as failed:
        async with keyed_operator(Step(), make_backend()) as op:
            await op.process(("a", spawn))
            await op.drain()
            release.set()
            with pytest.raises(ast.InvalidStateError, match=ORPHAN) as raised:
                await asyncio.wait_for(tasks[0], 10)
            # The task's error is the run's: the operator refuses further calls with it.
            with pytest.raises(ast.InvalidStateError, match=ORPHAN):
                await op.process(("b", spawn))
    assert failed.value is raised.value


async def test_state_access_from_a_callback_that_outlived_its_record_fails_the_run(
        make_backend):
    results = []

    def later(fn):
        try:
            fn.v.update(2)
        except ast.InvalidStateError as exc:
            results.append(exc)

    class Fn(Step):
        def process_element(self, record, ctx):
            # What a callback scheduled now (call_later, a client's hook) would run in.
            self.scheduled = contextvars.copy_context()
            return self.v.update(1)

    fn = Fn()
    with pytest.raises(ast.InvalidStateError, match=ORPHAN) as failed:
        async with keyed_operator(fn, make_backend()) as op:
            await op.process(("a", None))
            await op.drain()
            fn.scheduled.run(later, fn)  # the record is over when the callback runs
    assert results == [failed.value]


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
