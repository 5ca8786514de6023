"""Operator list state (split and union): names, modes, and the list methods."""

from __future__ import annotations

from typing import Any

import pytest
from shared_functions import (
    UNSTORABLE_NAMES,
    StrNames,
    config_error_pattern,
    open_declaring,
)

import asyncstate as ast
from asyncstate.state.operator_state import OperatorListState, RedistributionMode

# Not lists: str, bytes and mappings are iterable but rejected; 5 and None are not iterable
# at all (the compiled module once answered those with a type check of its own).
_NON_LISTS = ["abc", b"abc", {"a": 1}, 5, None]


@pytest.mark.parametrize("method", ["get_operator_list_state", "get_union_list_state"])
@pytest.mark.parametrize("bad", ["", None, 3, b"offsets"], ids=repr)
async def test_operator_state_rejects_empty_or_non_str_names(method, bad):
    with pytest.raises(ast.ConfigError,
                       match=config_error_pattern("name", bad, "a non-empty str")) as info:
        await open_declaring(lambda ctx: getattr(ctx, method)(bad))
    assert info.value.option == "name"


@pytest.mark.parametrize("method", ["get_operator_list_state", "get_union_list_state"])
@pytest.mark.parametrize(("bad", "rule"), UNSTORABLE_NAMES)
async def test_operator_state_rejects_a_name_a_checkpoint_cannot_store(method, bad, rule):
    with pytest.raises(ast.ConfigError, match=config_error_pattern("name", bad, rule)):
        await open_declaring(lambda ctx: getattr(ctx, method)(bad))


async def test_operator_state_takes_a_str_enum_name_as_its_plain_str():
    state = await open_declaring(lambda ctx: ctx.get_operator_list_state(StrNames.COUNT))
    assert type(state.name) is str and state.name == "count"


@pytest.mark.parametrize(("first", "second", "first_mode", "second_mode"), [
    ("get_operator_list_state", "get_union_list_state", "split", "union"),
    ("get_union_list_state", "get_operator_list_state", "union", "split"),
])
async def test_operator_state_redeclared_with_the_other_mode_names_both_modes(
        first, second, first_mode, second_mode):
    def declare(ctx):
        getattr(ctx, first)("offsets")
        getattr(ctx, second)("offsets")

    with pytest.raises(ast.ConfigError, match=rf"^operator state 'offsets' is already "
                                              rf"declared with {first_mode} redistribution, "
                                              rf"not {second_mode}$"):
        await open_declaring(declare)


async def test_operator_state_redeclared_with_the_same_mode_is_the_same_state():
    def declare(ctx):
        return (ctx.get_operator_list_state("a"), ctx.get_operator_list_state("a"),
                ctx.get_union_list_state("b"), ctx.get_union_list_state("b"))

    a1, a2, b1, b2 = await open_declaring(declare)
    assert a1 is a2 and b1 is b2 and a1 is not b1
    assert (a1.mode, b1.mode) == (RedistributionMode.SPLIT, RedistributionMode.UNION)


async def _items(state: OperatorListState[Any]) -> list[Any]:
    return await (await state.get()).to_list()


@pytest.mark.parametrize("method", ["get_operator_list_state", "get_union_list_state"])
async def test_operator_list_state_get_add_add_all_update_clear(method):
    state = await open_declaring(lambda ctx: getattr(ctx, method)("offsets"))
    assert isinstance(state, OperatorListState)
    assert await _items(state) == []
    assert (await state.get()).is_empty()

    futures = [state.add(1), state.add_all([(2, "x"), {"k": 3}]), state.add_all([])]
    assert all(f.done() and f.result() is None for f in futures)
    # tuples read back as lists, as on every backend
    assert await _items(state) == [1, [2, "x"], {"k": 3}]

    read = await state.get()
    await state.add("later")
    assert await read.to_list() == [1, [2, "x"], {"k": 3}]  # an iterator is a snapshot

    await state.update(iter(["a", "b"]))
    assert await _items(state) == ["a", "b"]
    await state.update([])
    assert await _items(state) == []
    await state.add_all(x * 2 for x in range(3))
    assert await _items(state) == [0, 2, 4]

    await state.clear()
    assert await _items(state) == []
    assert (await state.get()).is_empty()


async def test_operator_list_state_is_usable_in_open():
    def declare(ctx):
        state = ctx.get_operator_list_state("offsets")
        state.add(1).result()
        state.add_all([2, 3]).result()
        return state.get().result().to_list().result()

    assert await open_declaring(declare) == [1, 2, 3]


@pytest.mark.parametrize("call", ["add_all", "update"])
@pytest.mark.parametrize("bad", _NON_LISTS, ids=repr)
async def test_operator_list_state_rejects_non_lists(call, bad):
    state = await open_declaring(lambda ctx: ctx.get_operator_list_state("offsets"))
    await state.add("kept")
    with pytest.raises(TypeError, match=rf"^{call}\(\) of state 'offsets' expects a list of "
                                        rf"values, got {type(bad).__name__}$"):
        getattr(state, call)(bad)
    assert await _items(state) == ["kept"]


@pytest.mark.parametrize("call", [
    pytest.param(lambda s, v: s.add(v), id="add"),
    pytest.param(lambda s, v: s.add_all([1, v]), id="add_all"),
    pytest.param(lambda s, v: s.update([1, v]), id="update"),
])
@pytest.mark.parametrize(("bad", "type_name"), [({1, 2}, "set"), (object(), "object"),
                                                (2**64, "int")], ids=["set", "object", "int"])
async def test_operator_list_state_rejects_unserializable_values_and_keeps_its_elements(
        call, bad, type_name):
    state = await open_declaring(lambda ctx: ctx.get_union_list_state("seen"))
    await state.add_all(["a", "b"])
    with pytest.raises(ast.SerializationError, match=rf"^value of state 'seen' cannot be "
                                                     rf"encoded with msgpack \({type_name}\)"
                       ) as info:
        call(state, bad)
    assert (info.value.state_name, info.value.type_name) == ("seen", type_name)
    assert await _items(state) == ["a", "b"]
