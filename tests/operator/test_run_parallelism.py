"""ast.run at parallelism > 1: records routed by key group, checkpoints and rescaling."""

from __future__ import annotations

import threading
from collections import Counter as Tally
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import asyncstate as ast


class Count(ast.KeyedProcessFunction):
    """Counts records per key; emits (key, n)."""

    def open(self, ctx: ast.RuntimeContext) -> None:
        self.n = ctx.get_state(ast.ValueStateDescriptor("n"))

    async def process_element(self, record: Any, ctx: ast.RecordContext) -> None:
        n = (await self.n.value() or 0) + 1
        await self.n.update(n)
        ctx.emit((ctx.current_key, n))


def key(record: Any) -> Any:
    return record


RECORDS = [f"k{i % 37}" for i in range(500)]


def per_key(outputs: list[tuple[str, int]]) -> dict[str, list[int]]:
    seen: dict[str, list[int]] = {}
    for k, n in outputs:
        seen.setdefault(k, []).append(n)
    return seen


@pytest.mark.parametrize("parallelism", [1, 2, 3, 5])
def test_every_parallelism_counts_each_key_in_arrival_order(parallelism: int) -> None:
    out = ast.run(Count, RECORDS, key_selector=key, parallelism=parallelism)
    expected = Tally(RECORDS)
    assert per_key(out) == {k: list(range(1, n + 1)) for k, n in expected.items()}


@pytest.mark.parametrize("backend", ["heap", "rocksdb"])
def test_rescale_is_three_lines(tmp_path: Path, backend: str) -> None:
    def backends(run: str) -> Any:
        if backend == "heap":
            return None
        return lambda i: ast.RocksDBBackend(tmp_path / f"{run}-{i}")

    ast.run(Count, RECORDS, key_selector=key, parallelism=2, backend=backends("a"),
            checkpoint_dir=tmp_path / "chk", checkpoint_id=1)
    out = ast.run(Count, RECORDS, key_selector=key, parallelism=3, backend=backends("b"),
                  restore_from=ast.checkpoint_path(tmp_path / "chk", 1),
                  checkpoint_dir=tmp_path / "chk", checkpoint_id=2)
    expected = Tally(RECORDS)
    assert per_key(out) == {k: list(range(n + 1, 2 * n + 1)) for k, n in expected.items()}
    # ... and back to one operator, from the checkpoint written at three.
    out = ast.run(Count, ["k0", "k1"], key_selector=key,
                  restore_from=ast.checkpoint_path(tmp_path / "chk", 2))
    assert out == [("k0", 2 * expected["k0"] + 1), ("k1", 2 * expected["k1"] + 1)]


@pytest.mark.parametrize(("first", "second"), [(3, 2), (2, 3), (1, 4)])
def test_a_checkpoint_id_written_again_at_another_parallelism_is_the_second_run(
        tmp_path: Path, first: int, second: int) -> None:
    chk = ast.checkpoint_path(tmp_path, 7)
    ast.run(Count, RECORDS, key_selector=key, parallelism=first, checkpoint_dir=tmp_path,
            checkpoint_id=7)
    ast.run(Count, RECORDS[:100], key_selector=key, parallelism=second,
            checkpoint_dir=tmp_path, checkpoint_id=7)
    assert sorted(p.name for p in Path(chk).iterdir()) == \
        [f"part-{second}-{i}" for i in range(second)]
    # The state of the second run (100 records), not of the first (500).
    out = ast.run(Count, ["k0", "k1"], key_selector=key, restore_from=chk)
    expected = Tally(RECORDS[:100])
    assert out == [("k0", expected["k0"] + 1), ("k1", expected["k1"] + 1)]


def test_a_function_object_is_copied_for_every_operator_but_the_first() -> None:
    fn = Count()
    out = ast.run(fn, RECORDS, key_selector=key, parallelism=3)
    assert len(out) == len(RECORDS)


def test_a_function_that_cannot_be_copied_names_the_fix() -> None:
    class Locked(Count):
        def __init__(self) -> None:
            self.lock = threading.Lock()

    with pytest.raises(TypeError, match=r"^the Locked object cannot be copied for 2 operators "
                       r".*pass its class or a factory instead"):
        ast.run(Locked(), RECORDS, key_selector=key, parallelism=2)


def test_a_backend_object_cannot_serve_several_operators() -> None:
    with pytest.raises(TypeError, match=r"^backend must be a factory called with each operator "
                       r"index when parallelism is 2"):
        ast.run(Count, RECORDS, key_selector=key, parallelism=2, backend=ast.HeapBackend())


@pytest.mark.parametrize("parallelism", [1, 2])
def test_a_backend_class_is_refused_naming_what_to_pass(parallelism: int) -> None:
    # Called as a factory, the class would get the operator index as its first argument
    # (RocksDBBackend's path), and fail with an error about that argument instead.
    with pytest.raises(TypeError, match=r"^backend must be a state backend object or a factory "
                       r"function, got the class RocksDBBackend: pass RocksDBBackend\(\.\.\.\)"):
        ast.run(Count, RECORDS, key_selector=key, parallelism=parallelism,
                backend=ast.RocksDBBackend)


def test_a_backend_factory_is_called_once_per_operator_index() -> None:
    made: list[int] = []

    def factory(i: int) -> ast.HeapBackend:
        made.append(i)
        return ast.HeapBackend()

    ast.run(Count, RECORDS, key_selector=key, parallelism=4, backend=factory)
    assert made == [0, 1, 2, 3]


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"checkpoint_dir": "x"}, r"^checkpoint_id must be given together with checkpoint_dir"),
    ({"checkpoint_id": 1}, r"^checkpoint_dir must be given together with checkpoint_id"),
    ({"parallelism": 0}, r"^parallelism must be in \[1, 32768\], got 0$"),
    ({"checkpoint_dir": "x", "checkpoint_id": -1}, r"^checkpoint_id must be >= 0, got -1$"),
])
def test_run_names_a_bad_checkpoint_or_parallelism_argument(kwargs: dict[str, Any],
                                                            error: str) -> None:
    with pytest.raises(ast.ConfigError, match=error):
        ast.run(Count, RECORDS, key_selector=key, **kwargs)


@given(st.one_of(st.text(max_size=8), st.integers(-(2**63), 2**63 - 1), st.binary(max_size=8)),
       st.integers(1, 130), st.sampled_from([1, 7, 128, 300]))
def test_operator_index_for_key_is_the_operator_owning_the_key_group(
        k: Any, parallelism: int, max_parallelism: int) -> None:
    if parallelism > max_parallelism:
        with pytest.raises(ast.ConfigError):
            ast.operator_index_for_key(k, max_parallelism, parallelism)
        return
    index = ast.operator_index_for_key(k, max_parallelism, parallelism)
    group = ast.assign_to_key_group(k, max_parallelism)
    assert group in ast.compute_key_group_range_for_operator_index(
        max_parallelism, parallelism, index)
