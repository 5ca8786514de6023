"""ListState through a real KeyedOperator: get / add / add_all / update / clear and the
inputs they refuse."""

from __future__ import annotations

import pytest
from shared_functions import (
    to_list,
)

import asyncstate as ast

L = ast.ListStateDescriptor


async def test_list_empty_inputs_none_items_and_iterables(sh):
    async def step(s, ctx):
        await s.l.add_all([])
        ctx.emit(("empty add_all", (await s.l.get()).is_empty()))
        await s.l.update([])
        ctx.emit(("empty update", (await s.l.get()).is_empty()))
        await s.l.add(None)
        await s.l.add_all([None, None])
        ctx.emit(("nones", await to_list(s.l.get())))
        await s.l.update(x for x in (1, 2))
        await s.l.add_all(range(3, 5))
        await s.l.add_all((5, (6,)))
        ctx.emit(("iterables", await to_list(s.l.get())))
        for bad in (None, "ab", b"ab", {"a": 1}, 3):
            for call in (s.l.add_all, s.l.update):
                try:
                    call(bad)
                except TypeError:
                    ctx.emit(("TypeError", type(bad).__name__))
        await s.l.add_all([])
        ctx.emit(("after", await to_list(s.l.get())))
        await s.l.update([])
        ctx.emit(("cleared", await to_list(s.l.get()), (await s.l.get()).is_empty()))

    out = await sh.run(sh.AsyncScript(l=L("l")), [("k", step)], iterator_chunk_size=2)
    assert out == [
        ("empty add_all", True), ("empty update", True), ("nones", [None, None, None]),
        ("iterables", [1, 2, 3, 4, 5, [6]]),
        *[("TypeError", t) for t in ("NoneType", "str", "bytes", "dict", "int") for _ in "ab"],
        ("after", [1, 2, 3, 4, 5, [6]]), ("cleared", [], True),
    ]


async def items(state):
    """The list state's items, through get() and the iterator's to_list()."""
    it = await state.get()
    assert isinstance(it, ast.StateIterator)
    return await it.to_list()


async def test_get_on_unset_is_an_empty_iterator(sh):
    async def step(s, ctx):
        it = await s.l.get()
        ctx.emit((isinstance(it, ast.StateIterator), it.is_empty(), await it.to_list()))

    out = await sh.run(sh.AsyncScript(l=L("l")), [("k", step)])
    assert out == [(True, True, [])]


async def test_add_appends_in_order(sh):
    async def step(s, ctx):
        await s.l.add(1)
        await s.l.add("two")
        await s.l.add([3])
        ctx.emit(await items(s.l))

    async def more(s, ctx):
        await s.l.add(4)
        ctx.emit(await items(s.l))

    out = await sh.run(sh.AsyncScript(l=L("l")), [("k", step), ("k", more)])
    assert out == [[1, "two", [3]], [1, "two", [3], 4]]


async def test_add_all_appends_and_empty_is_a_no_op(sh):
    async def step(s, ctx):
        await s.l.add_all([1, 2])
        await s.l.add_all([])
        ctx.emit(await items(s.l))
        await s.l.add_all((3, 4))
        await s.l.add_all([])
        ctx.emit(await items(s.l))

    async def empty_on_unset(s, ctx):
        await s.l.add_all([])
        it = await s.l.get()
        ctx.emit(("unset", it.is_empty()))

    out = await sh.run(sh.AsyncScript(l=L("l")), [("k", step), ("j", empty_on_unset)])
    assert sorted(out, key=repr) == sorted([[1, 2], [1, 2, 3, 4], ("unset", True)], key=repr)
    assert [o for o in out if isinstance(o, list)] == [[1, 2], [1, 2, 3, 4]]


async def test_update_replaces_and_empty_update_clears(sh):
    async def step(s, ctx):
        await s.l.add_all([1, 2, 3])
        await s.l.update(["x", "y"])
        ctx.emit(await items(s.l))
        await s.l.update([])
        it = await s.l.get()
        ctx.emit((it.is_empty(), await it.to_list()))
        await s.l.add(5)
        ctx.emit(await items(s.l))

    out = await sh.run(sh.AsyncScript(l=L("l")), [("k", step)])
    assert out == [["x", "y"], (True, []), [5]]


async def test_clear_empties_and_list_is_reusable(sh):
    async def fill(s, ctx):
        await s.l.add_all(["a", "b"])

    async def clear(s, ctx):
        await s.l.clear()
        it = await s.l.get()
        ctx.emit(("cleared", it.is_empty()))
        await s.l.add("c")

    async def read(s, ctx):
        ctx.emit(await items(s.l))

    out = await sh.run(sh.AsyncScript(l=L("l")),
                       [("k", fill), ("k", read), ("k", clear), ("k", read)])
    assert out == [["a", "b"], ("cleared", True), ["c"]]


async def test_lists_of_different_keys_are_separate(sh):
    async def add(s, ctx):
        await s.l.add(ctx.current_key)

    async def read(s, ctx):
        ctx.emit((ctx.current_key, await items(s.l)))

    records = [(k, add) for k in ["a", "b", "a", "c", "a"]] + [(k, read) for k in "abcd"]
    out = await sh.run(sh.AsyncScript(l=L("l")), records)
    assert sorted(out) == [("a", ["a", "a", "a"]), ("b", ["b"]), ("c", ["c"]), ("d", [])]


async def test_writes_without_awaiting_are_read_in_issue_order(sh):
    """Plain def: add, add_all, update, add issued back to back; get() sees all of them."""

    def step(s, ctx):
        s.l.add(1)
        s.l.add_all([2, 3])
        s.l.update([10])
        s.l.add(11)
        s.l.add_all([])
        return s.l.get().then_compose(lambda it: it.to_list()).then_accept(ctx.emit)

    out = await sh.run(sh.Script(l=L("l")), [("k", step)])
    assert out == [[10, 11]]


async def test_plain_def_returning_none_appends_land(sh):
    def add(s, ctx):
        s.l.add(ctx.current_key)
        s.l.add_all([0, 1])

    def read(s, ctx):
        return (s.l.get().then_compose(lambda it: it.to_list())
                .then_accept(lambda xs: ctx.emit((ctx.current_key, xs))))

    records = [(k, add) for k in range(10)] + [(k, read) for k in range(10)]
    out = await sh.run(sh.Script(l=L("l")), records)
    assert sorted(out) == [(k, [k, 0, 1]) for k in range(10)]


async def test_mutating_a_list_after_update_or_add_does_not_change_state(sh):
    async def step(s, ctx):
        values = [[1], [2]]
        await s.l.update(values)
        values.append([3])
        values[0].append(99)
        element = ["e"]
        await s.l.add(element)
        element.append(99)
        batch = [["f"]]
        await s.l.add_all(batch)
        batch[0].append(99)
        ctx.emit(await items(s.l))

    out = await sh.run(sh.AsyncScript(l=L("l")), [("k", step)])
    assert out == [[[1], [2], ["e"], ["f"]]]


async def test_list_values_keep_their_types(sh):
    values = [None, True, 0, -1.5, "s", b"b", [1, [2]], {"k": (1, 2)}, (3, 4)]

    async def step(s, ctx):
        await s.l.update(values)
        ctx.emit(await items(s.l))

    out = await sh.run(sh.AsyncScript(l=L("l")), [("k", step)])
    assert out == [sh.normalize(values)]
    assert [type(v) for v in out[0]] == [type(v) for v in sh.normalize(values)]


async def test_callback_style_list_chain(sh):
    def step(s, ctx):
        return (s.l.add(ctx.record[2])
                .then_compose(lambda _: s.l.get())
                .then_compose(lambda it: it.on_next(lambda v: v * 10))
                .then_accept(ctx.emit))

    out = await sh.run(sh.Script(l=L("l")), [("k", step, 1), ("k", step, 2), ("k", step, 3)])
    assert out == [[10], [10, 20], [10, 20, 30]]


# Not lists: str, bytes and mappings are iterable but rejected; 5 and None are not iterable
# at all (the compiled module once answered those with a type check of its own).
_NON_LISTS = ["abc", b"abc", {"a": 1}, 5, None]


class _ListAll(ast.KeyedProcessFunction):
    """Calls `<call>(bad)` on a keyed ListState; record = (call, bad)."""

    def open(self, ctx):
        self.items = ctx.get_list_state(ast.ListStateDescriptor("items"))

    def process_element(self, value, ctx):
        call, bad = value
        return getattr(self.items, call)(bad)


@pytest.mark.parametrize("call", ["add_all", "update"])
@pytest.mark.parametrize("bad", _NON_LISTS, ids=repr)
def test_keyed_list_state_rejects_non_lists_naming_the_call_and_state(call, bad):
    # The keyed ListState shares stored_list() with OperatorListState.
    with pytest.raises(TypeError, match=rf"^{call}\(\) of state 'items' expects a list of "
                                        rf"values, got {type(bad).__name__}$"):
        ast.run(_ListAll(), [(call, bad)], key_selector=lambda r: r[0])


@pytest.mark.timeout(30)
async def test_list_writes_refuse_a_bytearray_and_keep_the_list(sh):
    async def step(s, ctx):
        await s.l.add_all([1, 2])
        for call in (s.l.add_all, s.l.update):
            try:
                call(bytearray(b"ab"))
            except TypeError as exc:
                ctx.emit(str(exc))
        ctx.emit(await to_list(s.l.get()))

    out = await sh.run(sh.AsyncScript(l=L("l")), [("k", step)])
    assert out == [
        "add_all() of state 'l' expects a list of values, got bytearray",
        "update() of state 'l' expects a list of values, got bytearray",
        [1, 2],
    ]
