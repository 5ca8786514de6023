"""The public surface promised by API.md: names, `__all__`, errors, config and key groups."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import os
import pickle
import subprocess
import sys
import types

import mmh3
import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st
from shared_functions import Sum

import asyncstate as ast

# Every name API.md promises from `asyncstate` at this stage (Spark arrives with a later issue
# and is added here then).
PROMISED = [
    # errors
    "AsyncStateError", "SerializationError", "CheckpointError", "KeyGroupError",
    "InvalidStateError", "InjectedFailure", "ConfigError",
    # futures
    "StateFuture", "completed_future", "completed_void_future", "combine_all",
    # descriptors and states
    "ValueStateDescriptor", "ListStateDescriptor", "MapStateDescriptor",
    "ReducingStateDescriptor", "AggregatingStateDescriptor", "AggregateFunction",
    "ValueState", "ListState", "MapState", "ReducingState", "AggregatingState", "StateIterator",
    # functions and running
    "KeyedProcessFunction", "RuntimeContext", "TimeDomain", "AsyncStateConfig", "run",
    "KeyedOperator", "ManualClock",
    # backends
    "HeapBackend", "SimulatedRemoteBackend", "RocksDBBackend", "checkpoint_path",
    # controller
    "AsyncExecutionController", "RecordContext", "StateRequestType",
    # key groups
    "assign_to_key_group", "KeyGroupRange", "compute_key_group_range_for_operator_index",
    "compute_operator_index_for_key_group",
    # TTL
    "StateTtlConfig", "UpdateType", "StateVisibility", "TtlTimeCharacteristic",
]

# FLINK_AEC_REFERENCE.md §4: StateRequestType in Flink 2.0's declaration order.
FLINK_REQUEST_TYPES = [
    "SYNC_POINT", "CLEAR", "VALUE_GET", "VALUE_UPDATE", "LIST_GET", "LIST_ADD", "LIST_UPDATE",
    "LIST_ADD_ALL", "MAP_GET", "MAP_CONTAINS", "MAP_PUT", "MAP_PUT_ALL", "MAP_ITER",
    "MAP_ITER_KEY", "MAP_ITER_VALUE", "MAP_REMOVE", "MAP_IS_EMPTY", "ITERATOR_LOADING",
    "REDUCING_GET", "REDUCING_ADD", "AGGREGATING_GET", "AGGREGATING_ADD",
]

ERRORS = ["SerializationError", "CheckpointError", "KeyGroupError", "InvalidStateError",
          "InjectedFailure", "ConfigError"]


# -- names --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", PROMISED)
def test_promised_name_is_importable_and_exported(name):
    namespace: dict[str, object] = {}
    exec(f"from asyncstate import {name}", namespace)
    assert namespace[name] is getattr(ast, name)
    assert name in ast.__all__


def test_all_is_sorted_and_lists_exactly_the_public_names():
    # RocksDB names load on first use (optional dependency), so they join after a lookup.
    lazy = {"RocksDBBackend", "RocksDBOptions"}
    public = {name for name, value in vars(ast).items()
              if not name.startswith("_") and not isinstance(value, types.ModuleType)} | lazy
    assert ast.__all__ == sorted(ast.__all__)
    assert len(ast.__all__) == len(set(ast.__all__))
    assert set(ast.__all__) == public
    for name in ast.__all__:
        assert getattr(ast, name) is not None


def test_state_request_type_has_flinks_members_in_flinks_order():
    assert issubclass(ast.StateRequestType, enum.Enum)
    assert [m.name for m in ast.StateRequestType] == FLINK_REQUEST_TYPES


def test_time_domain_members():
    assert {m.name for m in ast.TimeDomain} == {"EVENT_TIME", "PROCESSING_TIME"}
    assert ast.TimeDomain.EVENT_TIME is not ast.TimeDomain.PROCESSING_TIME


def test_future_helpers_work_without_a_loop():
    assert ast.completed_future(5).result() == 5
    assert ast.completed_void_future().result() is None
    combined = ast.combine_all([ast.completed_future(1), ast.completed_future("b")])
    assert combined.done() and combined.result() == [1, "b"]
    assert ast.completed_future(2).then_apply(lambda v: v * 3).result() == 6
    assert isinstance(ast.completed_future(1), ast.StateFuture)


def test_descriptors_and_aggregate_function_base():
    descriptors = [ast.ValueStateDescriptor("v"), ast.ListStateDescriptor("l"),
                   ast.MapStateDescriptor("m"), ast.ReducingStateDescriptor("r", max),
                   ast.AggregatingStateDescriptor("a", Sum())]
    assert [d.name for d in descriptors] == ["v", "l", "m", "r", "a"]
    for d in descriptors:
        assert callable(d.enable_time_to_live)


def test_manual_clock():
    clock = ast.ManualClock()
    assert clock.now_ms() == 0
    clock.advance(5)
    clock.set(12)
    assert clock.now_ms() == 12
    with pytest.raises(ValueError):
        clock.set(11)
    with pytest.raises(ValueError):
        clock.advance(-1)
    assert ast.ManualClock(start_ms=100).now_ms() == 100


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


# -- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ERRORS)
def test_errors_derive_from_async_state_error(name):
    cls = getattr(ast, name)
    assert issubclass(cls, ast.AsyncStateError)
    assert issubclass(ast.AsyncStateError, Exception)


def test_config_error_is_also_a_value_error():
    assert issubclass(ast.ConfigError, ValueError)
    with pytest.raises(ValueError):
        ast.AsyncStateConfig(batch_size=0)


def _real_errors():
    """One error of each kind, raised by the library itself where it can be provoked."""
    errors = {}
    try:
        ast.AsyncStateConfig(max_in_flight=0)
    except ast.ConfigError as exc:
        errors["config"] = exc

    class Fn(ast.KeyedProcessFunction):
        def open(self, ctx):
            self.v = ctx.get_state(ast.ValueStateDescriptor("the_state"))

        def process_element(self, value, ctx):
            self.v.update({1, 2})

    try:
        ast.run(Fn(), [1], key_selector=lambda r: r)
    except ast.SerializationError as exc:
        errors["serialization"] = exc

    class Counter(ast.KeyedProcessFunction):
        def open(self, ctx):
            self.v = ctx.get_state(ast.ValueStateDescriptor("v"))

        def process_element(self, value, ctx):
            return self.v.value()

    try:
        ast.run(Counter(), [1], key_selector=lambda r: r,
                backend=ast.SimulatedRemoteBackend(ast.HeapBackend(), latency_ms=0,
                                                   failure_probability=1.0))
    except ast.InjectedFailure as exc:
        errors["injected"] = exc
    try:
        ast.StateFuture().result()  # a pending future's result()
    except ast.InvalidStateError as exc:
        errors["invalid_state"] = exc
    foreign = next(k for k in range(1000) if ast.compute_operator_index_for_key_group(
        128, 2, ast.assign_to_key_group(k, 128)) == 1)

    async def key_group_error():
        async with ast.KeyedOperator(Counter(), key_selector=lambda r: r,
                                     backend=ast.HeapBackend(), parallelism=2,
                                     operator_index=0) as op:
            await op.process(foreign)

    try:
        asyncio.run(key_group_error())
    except ast.KeyGroupError as exc:
        errors["key_group"] = exc
    errors["checkpoint"] = ast.CheckpointError("checkpoint 3 is missing part-2-1",
                                               path="/ckpt/chk-3/part-2-1")
    return errors


def test_errors_carry_context_and_name_it():
    errors = _real_errors()
    assert set(errors) == {"config", "serialization", "injected", "invalid_state", "key_group",
                           "checkpoint"}
    config = errors["config"]
    assert config.option == "max_in_flight"
    assert "max_in_flight" in str(config)
    ser = errors["serialization"]
    assert (ser.state_name, ser.type_name) == ("the_state", "set")
    assert "the_state" in str(ser) and "set" in str(ser)
    kg = errors["key_group"]
    assert isinstance(kg.key_group, int)
    assert str(kg.key_group) in str(kg)
    assert errors["checkpoint"].path == "/ckpt/chk-3/part-2-1"


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_errors_survive_pickling_with_their_attributes(protocol):
    for kind, exc in _real_errors().items():
        clone = pickle.loads(pickle.dumps(exc, protocol=protocol))
        assert type(clone) is type(exc), kind
        assert str(clone) == str(exc), kind
        assert clone.args == exc.args, kind
        for attr in ("option", "state_name", "type_name", "key_group", "path"):
            if hasattr(exc, attr):
                assert getattr(clone, attr) == getattr(exc, attr), (kind, attr)


# -- AsyncStateConfig ---------------------------------------------------------------------


def test_config_defaults():
    config = ast.AsyncStateConfig()
    assert (config.batch_size, config.buffer_timeout_ms, config.max_in_flight,
            config.max_parallelism) == (1000, 1000, 6000, 128)
    assert config.iterator_chunk_size >= 1
    assert dataclasses.is_dataclass(config)


@pytest.mark.parametrize(("option", "lowest", "highest"), [
    ("batch_size", 1, None),
    ("max_in_flight", 1, None),
    ("iterator_chunk_size", 1, None),
    ("buffer_timeout_ms", 0, None),
    ("max_parallelism", 1, 32768),
])
def test_config_bounds(option, lowest, highest):
    assert getattr(ast.AsyncStateConfig(**{option: lowest}), option) == lowest
    for bad in (lowest - 1, -(2**40)):
        with pytest.raises(ast.ConfigError) as info:
            ast.AsyncStateConfig(**{option: bad})
        assert isinstance(info.value, ValueError)
        assert option in str(info.value)
        assert info.value.option == option
    if highest is not None:
        assert getattr(ast.AsyncStateConfig(**{option: highest}), option) == highest
        with pytest.raises(ast.ConfigError):
            ast.AsyncStateConfig(**{option: highest + 1})
    else:
        assert getattr(ast.AsyncStateConfig(**{option: 10**6}), option) == 10**6


@pytest.mark.parametrize("option", ["batch_size", "max_in_flight", "iterator_chunk_size",
                                    "buffer_timeout_ms", "max_parallelism"])
@pytest.mark.parametrize("bad", [True, False, 1.5, "10", None], ids=repr)
def test_config_rejects_non_ints_including_bools(option, bad):
    with pytest.raises(ast.ConfigError) as info:
        ast.AsyncStateConfig(**{option: bad})
    assert info.value.option == option


def test_config_is_frozen_and_replace_revalidates():
    config = ast.AsyncStateConfig(batch_size=10)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.batch_size = 20  # type: ignore[misc]
    assert dataclasses.replace(config, batch_size=20).batch_size == 20
    assert config.batch_size == 10
    with pytest.raises(ast.ConfigError):
        dataclasses.replace(config, batch_size=0)
    assert ast.AsyncStateConfig(batch_size=10) == config


# -- key groups ---------------------------------------------------------------------------


def spec_key_group(key, max_parallelism):
    """The spec: unsigned murmur3 x86 32 (seed 0) of msgpack(key, use_bin_type=True)."""
    return mmh3.hash(msgpack.packb(key, use_bin_type=True), 0, signed=False) % max_parallelism


def test_murmur3_reference_vectors():
    """Anchor the spec's hash itself to published MurmurHash3_x86_32 (seed 0) vectors."""
    assert mmh3.hash(b"", 0, signed=False) == 0
    assert mmh3.hash(b"hello", 0, signed=False) == 0x248BFA47
    assert mmh3.hash(b"The quick brown fox jumps over the lazy dog", 0,
                     signed=False) == 0x2E4FF723


KNOWN_KEYS = [0, 1, -1, 2**63 - 1, -(2**63), 2**64 - 1, 1.0, 0.5, True, False, None, "", "a",
              "hello", "ünïcødé", b"", b"\x00\xff", (1, 2), [1, 2], ("a", (b"b", None)),
              [[1.5], "x"], 127, 128, 255, 256, 65536]


@pytest.mark.parametrize("max_parallelism", [1, 2, 7, 128, 4096, 32768])
def test_assign_to_key_group_matches_the_spec(max_parallelism):
    for key in KNOWN_KEYS:
        assert ast.assign_to_key_group(key, max_parallelism) == spec_key_group(
            key, max_parallelism), key


def test_assign_to_key_group_literal_values():
    """Literal values (the spec applied by hand once), so a change in msgpack or mmh3 that
    would silently move keys between key groups is caught."""
    assert msgpack.packb("a", use_bin_type=True) == b"\xa1a"
    assert msgpack.packb(1) == b"\x01"
    assert msgpack.packb(1.0) == b"\xcb?\xf0\x00\x00\x00\x00\x00\x00"
    assert msgpack.packb(True) == b"\xc3"
    for key in ("a", 1, 1.0, True, (1, 2)):
        h = mmh3.hash(msgpack.packb(key, use_bin_type=True), 0, signed=False)
        assert ast.assign_to_key_group(key, 2**15) == h % 2**15


def test_one_one_point_zero_and_true_are_hashed_apart():
    groups = {ast.assign_to_key_group(k, 32768) for k in (1, 1.0, True)}
    assert len(groups) == 3
    assert ast.assign_to_key_group((1, "a"), 128) == ast.assign_to_key_group([1, "a"], 128)


_keys = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
    | st.text() | st.binary(),
    lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner), max_leaves=6)


@given(key=_keys, max_parallelism=st.integers(1, 32768))
def test_property_assign_to_key_group_is_the_spec(key, max_parallelism):
    kg = ast.assign_to_key_group(key, max_parallelism)
    assert kg == spec_key_group(key, max_parallelism)
    assert 0 <= kg < max_parallelism


def test_key_groups_are_deterministic_across_processes():
    keys = ["alpha", "beta", b"gamma", ("delta", 4), 12345, 1.25]
    code = (f"import asyncstate as ast; "
            f"print([ast.assign_to_key_group(k, 32768) for k in {keys!r}])")
    results = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=env, timeout=60, check=True)
        results.add(proc.stdout.strip())
    assert results == {str([spec_key_group(k, 32768) for k in keys])}


@pytest.mark.parametrize("bad", [{"a": 1}, [1, {"a": 1}], {1}, object(), 2**64])
def test_assign_to_key_group_rejects_non_keys(bad):
    with pytest.raises(ast.SerializationError):
        ast.assign_to_key_group(bad, 128)


def _expected_range(max_parallelism, parallelism, index):
    q, r = divmod(max_parallelism, parallelism)
    start = index * q + min(index, r)
    return start, start + q + (1 if index < r else 0) - 1


def _check_split(max_parallelism, parallelism, key_groups=None):
    covered = []
    for i in range(parallelism):
        rng = ast.compute_key_group_range_for_operator_index(max_parallelism, parallelism, i)
        assert isinstance(rng, ast.KeyGroupRange)
        assert (rng.start, rng.end) == _expected_range(max_parallelism, parallelism, i)
        assert len(rng) == rng.end - rng.start + 1
        if key_groups is None:
            covered.extend(rng)
            for kg in rng:
                assert ast.compute_operator_index_for_key_group(
                    max_parallelism, parallelism, kg) == i
    if key_groups is None:
        assert covered == list(range(max_parallelism))
    else:
        for kg in key_groups:
            i = ast.compute_operator_index_for_key_group(max_parallelism, parallelism, kg)
            rng = ast.compute_key_group_range_for_operator_index(max_parallelism, parallelism, i)
            assert rng.contains(kg) and kg in rng


def test_range_split_and_inverse_exhaustive_for_small_max_parallelism():
    for max_parallelism in range(1, 65):
        for parallelism in range(1, max_parallelism + 1):
            _check_split(max_parallelism, parallelism)


@pytest.mark.parametrize(("max_parallelism", "parallelism"), [
    (128, 3), (128, 5), (128, 127), (128, 128), (4096, 7), (32768, 1), (32768, 3),
    (32768, 1000), (32768, 32767), (32768, 32768), (1000, 999),
])
def test_range_split_and_inverse_for_large_combinations(max_parallelism, parallelism):
    if max_parallelism <= 5000:
        _check_split(max_parallelism, parallelism)
    else:
        # Ranges of every index; inverse at each range boundary and a stride of key groups.
        _check_split(max_parallelism, parallelism,
                     key_groups=sorted({0, max_parallelism - 1,
                                        *range(0, max_parallelism, 97)}))
        for i in range(parallelism):
            start, end = _expected_range(max_parallelism, parallelism, i)
            for kg in (start, end):
                assert ast.compute_operator_index_for_key_group(
                    max_parallelism, parallelism, kg) == i


@given(st.data())
def test_property_range_split_inverse(data):
    max_parallelism = data.draw(st.integers(1, 32768))
    parallelism = data.draw(st.integers(1, max_parallelism))
    index = data.draw(st.integers(0, parallelism - 1))
    rng = ast.compute_key_group_range_for_operator_index(max_parallelism, parallelism, index)
    assert (rng.start, rng.end) == _expected_range(max_parallelism, parallelism, index)
    for kg in {rng.start, rng.end, (rng.start + rng.end) // 2}:
        assert ast.compute_operator_index_for_key_group(max_parallelism, parallelism,
                                                        kg) == index


def test_first_r_ranges_are_one_larger():
    sizes = [len(ast.compute_key_group_range_for_operator_index(10, 4, i)) for i in range(4)]
    assert sizes == [3, 3, 2, 2]
    starts = [ast.compute_key_group_range_for_operator_index(10, 4, i).start for i in range(4)]
    assert starts == [0, 3, 6, 8]


def test_key_group_range():
    rng = ast.KeyGroupRange(3, 6)
    assert (rng.start, rng.end) == (3, 6)
    assert len(rng) == 4
    assert list(rng) == [3, 4, 5, 6]
    assert rng.contains(3) and rng.contains(6)
    assert not rng.contains(2) and not rng.contains(7)
    # contains() and `in` are one check: only ints are key groups.
    for other in (True, 4.0, 4.5, "4", None):
        assert not rng.contains(other) and other not in rng
    assert len(ast.KeyGroupRange(5, 5)) == 1


@pytest.mark.parametrize(("max_parallelism", "parallelism", "index"), [
    (128, 0, 0), (128, 129, 0), (128, -1, 0), (128, 2, 2), (128, 2, -1), (0, 1, 0),
    (32769, 1, 0), (128, True, 0), (128, 2, 1.0),
])
def test_range_split_validation(max_parallelism, parallelism, index):
    with pytest.raises(ValueError) as info:
        ast.compute_key_group_range_for_operator_index(max_parallelism, parallelism, index)
    assert isinstance(info.value, ast.AsyncStateError)


@pytest.mark.parametrize(("max_parallelism", "parallelism", "key_group"), [
    (128, 0, 0), (128, 129, 0), (128, 2, 128), (128, 2, -1), (0, 1, 0), (32769, 1, 0),
])
def test_operator_index_validation(max_parallelism, parallelism, key_group):
    with pytest.raises(ValueError) as info:
        ast.compute_operator_index_for_key_group(max_parallelism, parallelism, key_group)
    assert isinstance(info.value, ast.AsyncStateError)
