"""Random state programs: records that each run one step against value, list, map and
reducing state, and emit what they read. Running the same program on two backends and
comparing what each key emitted (in order) compares the backends' answers to every request
type; per-key order is fixed, so the comparison is exact whatever the batches and their
timing were.

Some steps issue a write and a read of the same state without awaiting the write first (a
record reads its own writes), and every read of a list value mutates what it got back (a
cache that handed out its own object would then answer differently).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from hypothesis import strategies as st
from shared_functions import run_on_loop, run_records

import asyncstate as ast

KEYS = ["a", "b", "c", "d"]
USER_KEYS = [1, "x", (2, "y")]

_small = st.integers(-3, 50)
_value = st.one_of(_small, st.none(), st.lists(_small, max_size=3))
_element = st.one_of(_small, st.lists(_small, max_size=2))
_user_key = st.sampled_from(USER_KEYS)

VALUE_STEPS = [
    st.tuples(st.just("vget")),
    st.tuples(st.just("vset"), _value),
    st.tuples(st.just("vclear")),
    st.tuples(st.just("vset_get"), _value),
    st.tuples(st.just("vget_set"), _value),
    st.tuples(st.just("vinc")),
]
LIST_STEPS = [
    st.tuples(st.just("lget")),
    st.tuples(st.just("ladd"), _element),
    st.tuples(st.just("laddall"), st.lists(_element, max_size=3)),
    st.tuples(st.just("lupdate"), st.lists(_element, max_size=4)),
    st.tuples(st.just("lclear")),
    st.tuples(st.just("ladd_get"), _element),
    st.tuples(st.just("lget_add"), _element),
]
MAP_STEPS = [
    st.tuples(st.just("mget"), _user_key),
    st.tuples(st.just("mput"), _user_key, st.one_of(_small, st.none(),
                                                    st.lists(_small, max_size=2))),
    st.tuples(st.just("mputall"), st.dictionaries(_user_key, st.one_of(_small, st.none()),
                                                  max_size=3)),
    st.tuples(st.just("mremove"), _user_key),
    st.tuples(st.just("mcontains"), _user_key),
    st.tuples(st.just("mentries")),
    st.tuples(st.just("mkeys")),
    st.tuples(st.just("mvalues")),
    st.tuples(st.just("misempty")),
    st.tuples(st.just("mput_get"), _user_key, _small),
    st.tuples(st.just("mget_put"), _user_key, _small),
    st.tuples(st.just("mclear")),
]
REDUCING_STEPS = [
    st.tuples(st.just("rget")),
    st.tuples(st.just("radd"), _small),
]
_FAMILIES = [VALUE_STEPS, LIST_STEPS, MAP_STEPS, REDUCING_STEPS,
             VALUE_STEPS + LIST_STEPS + MAP_STEPS + REDUCING_STEPS]


@st.composite
def programs(draw: st.DrawFn) -> list[tuple[str, tuple[Any, ...]]]:
    """A program: steps of one state kind (or of all), over one to four keys; narrow
    programs revisit the same entries often, where a stale cache would show."""
    steps = st.one_of(*draw(st.sampled_from(_FAMILIES)))
    keys = KEYS[:draw(st.integers(1, len(KEYS)))]
    return draw(st.lists(st.tuples(st.sampled_from(keys), steps), min_size=1, max_size=40))


PROGRAMS = programs()

# Read every state of every key at the end: the final state is compared too.
FINAL_READS = [(k, step) for k in KEYS for step in
               (("vget",), ("lget",), ("mentries",), ("rget",))]


def _sorted(items: list[Any]) -> list[Any]:
    return sorted(items, key=repr)


class Program(ast.KeyedProcessFunction):
    """Runs one step per record (callback style); record: (key, index, step)."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.v = ctx.get_state(ast.ValueStateDescriptor("v"))
        self.l = ctx.get_list_state(ast.ListStateDescriptor("l"))
        self.m = ctx.get_map_state(ast.MapStateDescriptor("m"))
        self.r = ctx.get_reducing_state(ast.ReducingStateDescriptor("r", lambda a, b: a + b))

    def process_element(self, record: Any, ctx: ast.RecordContext) -> Any:
        key, index, step = record
        op, *args = step

        def emit(value: Any) -> None:
            ctx.emit((key, index, op, value))

        def emit_mutating(value: Any) -> None:
            emit(repr(value))
            if isinstance(value, list):
                value.append("mutated")  # must not change what the state holds

        def emit_list(items: list[Any]) -> None:
            emit(repr(items))
            for item in items:
                if isinstance(item, list):
                    item.append("mutated")

        if op == "vget":
            return self.v.value().then_accept(emit_mutating)
        if op == "vset":
            return self.v.update(args[0])
        if op == "vclear":
            return self.v.clear()
        if op == "vset_get":
            first = self.v.update(args[0])
            return ast.combine_all([first, self.v.value()]).then_accept(
                lambda both: emit_mutating(both[1]))
        if op == "vget_set":  # the write is issued before the read's answer is back
            read = self.v.value()
            return ast.combine_all([read, self.v.update(args[0])]).then_accept(
                lambda both: emit_mutating(both[0]))
        if op == "vinc":
            return self.v.value().then_compose(
                lambda x: self.v.update((x if isinstance(x, int) else 0) + 1))
        if op == "lget":
            return self.l.get().then_compose(lambda it: it.to_list()).then_accept(emit_list)
        if op == "ladd":
            return self.l.add(args[0])
        if op == "laddall":
            return self.l.add_all(args[0])
        if op == "lupdate":
            return self.l.update(args[0])
        if op == "lclear":
            return self.l.clear()
        if op == "ladd_get":
            first = self.l.add(args[0])
            items = self.l.get().then_compose(lambda it: it.to_list())
            return ast.combine_all([first, items]).then_accept(lambda both: emit_list(both[1]))
        if op == "lget_add":
            items = self.l.get().then_compose(lambda it: it.to_list())
            return ast.combine_all([items, self.l.add(args[0])]).then_accept(
                lambda both: emit_list(both[0]))
        if op == "mget":
            return self.m.get(args[0]).then_accept(emit_mutating)
        if op == "mput":
            return self.m.put(args[0], args[1])
        if op == "mputall":
            return self.m.put_all(args[0])
        if op == "mremove":
            return self.m.remove(args[0])
        if op == "mcontains":
            return self.m.contains(args[0]).then_accept(emit)
        if op == "mentries":
            return self.m.entries().then_compose(lambda it: it.to_list()).then_accept(
                lambda items: emit(repr(_sorted([list(e) for e in items]))))
        if op == "mkeys":
            return self.m.keys().then_compose(lambda it: it.to_list()).then_accept(
                lambda items: emit(repr(_sorted(items))))
        if op == "mvalues":
            return self.m.values().then_compose(lambda it: it.to_list()).then_accept(
                lambda items: emit(repr(_sorted(items))))
        if op == "misempty":
            return self.m.is_empty().then_accept(emit)
        if op == "mput_get":
            first = self.m.put(args[0], args[1])
            return ast.combine_all([first, self.m.get(args[0])]).then_accept(
                lambda both: emit(both[1]))
        if op == "mget_put":
            read = self.m.get(args[0])
            return ast.combine_all([read, self.m.put(args[0], args[1])]).then_accept(
                lambda both: emit(both[0]))
        if op == "mclear":
            return self.m.clear()
        if op == "rget":
            return self.r.get().then_accept(emit)
        if op == "radd":
            return self.r.add(args[0])
        raise AssertionError(f"unknown step {op!r}")


def records_of(program: list[tuple[str, tuple[Any, ...]]]) -> list[tuple[str, int, Any]]:
    """The records of `program` followed by the final reads."""
    steps = [*program, *FINAL_READS]
    return [(key, i, step) for i, (key, step) in enumerate(steps)]


def per_key(outputs: list[Any]) -> dict[str, list[Any]]:
    """What each key emitted, in order."""
    grouped: dict[str, list[Any]] = defaultdict(list)
    for key, index, op, value in outputs:
        grouped[key].append((index, op, value))
    return dict(grouped)


def run_program(program: list[tuple[str, tuple[Any, ...]]], backend: Any, *,
                batch_size: int, max_in_flight: int, chunk: int = 2,
                checkpoint_dir: str | None = None, loop: str | None = None
                ) -> dict[str, list[Any]]:
    """Run `program` on `backend` and return what each key emitted. With `checkpoint_dir`,
    the final reads run on a heap backend restored from the checkpoint the program's run
    ends with, so they read what `backend` holds once drained, not what it answers. With
    `loop` (a key of LOOP_FACTORIES, no checkpoint), a KeyedOperator runs the program on a
    loop of that kind, else `ast.run` does (uvloop)."""
    config = ast.AsyncStateConfig(batch_size=batch_size, max_in_flight=max_in_flight,
                                  iterator_chunk_size=chunk)
    records = records_of(program)
    if loop is not None:
        assert checkpoint_dir is None, "a program runs on a chosen loop without a checkpoint"
        return per_key(run_on_loop(loop, run_records(Program(), records, backend,
                                                     config=config)))
    if checkpoint_dir is None:
        outputs = ast.run(Program(), records, key_selector=lambda r: r[0], backend=backend,
                          config=config)
        return per_key(outputs)
    outputs = ast.run(Program(), records[:len(program)], key_selector=lambda r: r[0],
                      backend=backend, config=config, checkpoint_dir=checkpoint_dir,
                      checkpoint_id=1)
    outputs += ast.run(Program(), records[len(program):], key_selector=lambda r: r[0],
                       backend=ast.HeapBackend(), config=config,
                       restore_from=ast.checkpoint_path(checkpoint_dir, 1))
    return per_key(outputs)
