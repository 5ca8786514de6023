"""TTL state across checkpoints and RocksDB directories: timestamps kept on both backends
and across rescaling, config changes allowed, migration to and from TTL (or a refusal saying
how), and never a misread of timestamped bytes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import rocksdict
from ttl_harness import NOTHING, At, Steps, advance, play

import asyncstate as ast
from asyncstate.checkpoint.reader import open_checkpoint

EVENT = ast.TtlTimeCharacteristic.EVENT_TIME


def _config(ttl_ms: int = 100, **options: Any) -> ast.StateTtlConfig:
    builder = ast.StateTtlConfig.new_builder(ttl_ms).disable_cleanup_in_background()
    if options.get("event_time"):
        builder.set_ttl_time_characteristic(EVENT)
    if options.get("on_read"):
        builder.update_ttl_on_read_and_write()
    return builder.build()


def _function(config: ast.StateTtlConfig | None) -> Steps:
    return Steps(v=ast.ValueStateDescriptor("v", ttl=config),
                 m=ast.MapStateDescriptor("m", ttl=config))


async def _write(s: Any, ctx: Any) -> Any:
    await s.v.update(ctx.current_key)
    await s.m.put("x", ctx.current_key)
    return NOTHING


async def _read(s: Any, ctx: Any) -> Any:
    return (ctx.current_key, await s.v.value(), await s.m.get("x"))


KEYS = range(12)


def _backend(kind: str, directory: Path) -> Any:
    if kind == "heap":
        return ast.HeapBackend()
    directory.mkdir(parents=True, exist_ok=True)
    return ast.RocksDBBackend(str(directory / f"db-{len(os.listdir(directory))}"))


async def _snapshot(kind: str, tmp_path: Path, config: ast.StateTtlConfig | None,
                    writes: list[tuple[int, range]], at: int) -> str:
    """A checkpoint of `writes` ((time, keys) each) taken at `at`."""
    async with ast.KeyedOperator(_function(config), key_selector=lambda r: r[0],
                                 backend=_backend(kind, tmp_path / "dbs"),
                                 clock=ast.ManualClock()) as op:
        for time, keys in writes:
            await play(op, [At(time, _write, key=k) for k in keys])
        await advance(op, at, False)
        return await op.snapshot(tmp_path / "chk", 1)


async def _restore_and_read(kind: str, tmp_path: Path, path: str,
                            config: ast.StateTtlConfig | None, start: int,
                            times: list[int], parallelism: int = 1) -> list[list[Any]]:
    """Restore into `parallelism` operators on clocks at `start`; each of `times` reads
    every key; the reads of each time, by key."""
    ops = [ast.KeyedOperator(_function(config), key_selector=lambda r: r[0],
                             backend=_backend(kind, tmp_path / "dbs"),
                             clock=ast.ManualClock(start), parallelism=parallelism,
                             operator_index=i, restore_from=path)
           for i in range(parallelism)]
    results: list[list[Any]] = [[] for _ in times]
    for op in ops:
        async with op:
            for i, time in enumerate(times):
                await advance(op, time, False)
                for key in KEYS:
                    if ast.assign_to_key_group(key, 128) in op.key_group_range:
                        await op.process((key, _read, time))
                await op.drain()
                results[i] += op.outputs()
    return [sorted(r) for r in results]


@pytest.mark.parametrize(("source", "target"), [("heap", "rocksdb"), ("rocksdb", "heap"),
                                                ("rocksdb", "rocksdb")])
async def test_timestamps_survive_a_checkpoint_between_backends_and_a_rescale(
        tmp_path, source, target):
    config = _config(100)
    path = await _snapshot(source, tmp_path, config, [(0, range(6)), (50, range(6, 12))], 60)
    assert open_checkpoint(path).state_ttl == {"v": "processing_time", "m": "processing_time"}
    reads = await _restore_and_read(target, tmp_path, path, config, 60, [99, 100, 150],
                                    parallelism=2)
    fresh = [(k, k, k) for k in KEYS]
    assert reads[0] == fresh
    assert reads[1] == [(k, None, None) if k < 6 else (k, k, k) for k in KEYS]
    assert reads[2] == [(k, None, None) for k in KEYS]


@pytest.mark.parametrize("kind", ["heap", "rocksdb"])
async def test_duration_and_update_type_may_change_between_snapshot_and_restore(
        tmp_path, kind):
    path = await _snapshot(kind, tmp_path, _config(100), [(0, KEYS)], 10)
    # Ten times longer, refreshed on read: the timestamps of 0 are kept.
    reads = await _restore_and_read(kind, tmp_path, path, _config(1000, on_read=True), 10,
                                    [999, 1999])
    assert reads[0] == [(k, k, k) for k in KEYS]  # written at 0: lives until 1000; refreshed
    assert reads[1] == [(k, None, None) for k in KEYS]  # refreshed at 999: gone at 1999


@pytest.mark.parametrize("kind", ["heap", "rocksdb"])
async def test_state_written_without_ttl_is_stamped_with_the_restore_time(tmp_path, kind):
    path = await _snapshot(kind, tmp_path, None, [(0, KEYS)], 10)
    assert open_checkpoint(path).state_ttl == {}
    reads = await _restore_and_read(kind, tmp_path, path, _config(100), 5_000,
                                    [5_099, 5_100])
    assert reads == [[(k, k, k) for k in KEYS], [(k, None, None) for k in KEYS]]


@pytest.mark.parametrize("kind", ["heap", "rocksdb"])
async def test_declaring_ttl_state_without_ttl_drops_the_timestamps(tmp_path, kind):
    path = await _snapshot(kind, tmp_path, _config(100), [(0, KEYS)], 10)
    async with ast.KeyedOperator(_function(None), key_selector=lambda r: r[0],
                                 backend=_backend(kind, tmp_path / "dbs"),
                                 clock=ast.ManualClock(10_000), restore_from=path) as op:
        out = await play(op, [At(10_000, _read, key=k) for k in KEYS])
        assert sorted(out) == [(k, k, k) for k in KEYS]  # values, not [timestamp, value]
        again = await op.snapshot(tmp_path / "chk2", 1)
    assert open_checkpoint(again).state_ttl == {}


@pytest.mark.parametrize("kind", ["heap", "rocksdb"])
async def test_event_time_ttl_refuses_state_written_without_timestamps(tmp_path, kind):
    path = await _snapshot(kind, tmp_path, None, [(0, KEYS)], 10)
    with pytest.raises(ast.CheckpointError,
                       match=r"^state 'v' of checkpoint '.*' is stored without timestamps, "
                             r"and event-time TTL has no time to stamp its entries with "):
        await _restore_and_read(kind, tmp_path, path, _config(100, event_time=True), 0, [0])


@pytest.mark.parametrize("kind", ["heap", "rocksdb"])
async def test_a_change_of_time_characteristic_is_refused(tmp_path, kind):
    path = await _snapshot(kind, tmp_path, _config(100), [(0, KEYS)], 10)
    with pytest.raises(ast.CheckpointError,
                       match=r"^state 'v' of checkpoint '.*' is stored with processing_time "
                             r"timestamps and cannot be declared with event_time TTL: "):
        await _restore_and_read(kind, tmp_path, path, _config(100, event_time=True), 0, [0])


async def test_an_empty_state_takes_event_time_ttl_after_a_plain_checkpoint(tmp_path):
    # Nothing to stamp: a state declared but never written may start with event-time TTL.
    async with ast.KeyedOperator(_function(None), key_selector=lambda r: r[0],
                                 backend=ast.HeapBackend(), clock=ast.ManualClock()) as op:
        path = await op.snapshot(tmp_path / "chk", 1)
    assert await _restore_and_read("heap", tmp_path, path, _config(100, event_time=True),
                                   0, [0]) == [[(k, None, None) for k in KEYS]]


async def test_a_checkpoint_mixing_layouts_of_one_state_is_refused(tmp_path):
    for index, config in enumerate((_config(100), None)):
        async with ast.KeyedOperator(_function(config), key_selector=lambda r: r[0],
                                     backend=ast.HeapBackend(), clock=ast.ManualClock(),
                                     parallelism=2, operator_index=index) as op:
            path = await op.snapshot(tmp_path / "chk", 1)
    with pytest.raises(ast.CheckpointError,
                       match=r"stores state 'm' with TTL timestamps in some parts and not in "
                             r"others \(part-2-0: processing_time, part-2-1: no timestamps\)"):
        open_checkpoint(path)


@pytest.mark.parametrize("kind", ["heap", "rocksdb"])
async def test_values_a_manifest_claims_timestamped_but_are_not_fail_the_restore(
        tmp_path, kind):
    path = await _snapshot(kind, tmp_path, None, [(0, KEYS)], 10)
    manifest = Path(path) / "part-1-0" / "_MANIFEST.json"
    data = json.loads(manifest.read_text())
    data["state_ttl"] = {"v": "processing_time"}
    manifest.write_text(json.dumps(data))
    with pytest.raises(ast.CheckpointError,
                       match=r"malformed state entries \(ValueError: stored bytes .* are not a "
                             r"timestamped value"):
        await _restore_and_read(kind, tmp_path, path, _config(100), 0, [0])


async def test_a_manifest_with_an_unknown_time_domain_is_refused(tmp_path):
    path = await _snapshot("heap", tmp_path, _config(100), [(0, KEYS)], 10)
    manifest = Path(path) / "part-1-0" / "_MANIFEST.json"
    data = json.loads(manifest.read_text())
    data["state_ttl"] = {"v": "wall_time"}
    manifest.write_text(json.dumps(data))
    with pytest.raises(ast.CheckpointError, match=r"has invalid state_ttl \(want states of "
                                                  r"'states' mapped to one of "):
        open_checkpoint(path)


# -- a RocksDB directory reopened --------------------------------------------------------------

async def _in_directory(directory: str, config: ast.StateTtlConfig | None, start: int,
                        plan: list[At]) -> list[Any]:
    async with ast.KeyedOperator(_function(config), key_selector=lambda r: r[0],
                                 backend=ast.RocksDBBackend(directory),
                                 clock=ast.ManualClock(start)) as op:
        return await play(op, plan)


async def test_a_reopened_directory_keeps_the_layout_and_migrates_both_ways(tmp_path):
    directory = str(tmp_path / "db")
    await _in_directory(directory, _config(100), 0, [At(0, _write, key=1)])
    # Timestamps kept across the reopen: expired at 100.
    assert await _in_directory(directory, _config(100), 99, [At(99, _read, key=1)]) \
        == [(1, 1, 1)]
    assert await _in_directory(directory, _config(100), 0, [At(100, _read, key=1)]) \
        == [(1, None, None)]
    await _in_directory(directory, _config(100), 200, [At(200, _write, key=2)])
    # Declared without TTL: the timestamps are dropped, in the directory too ...
    assert await _in_directory(directory, None, 0, [At(0, _read, key=2)]) == [(2, 2, 2)]
    backend = ast.RocksDBBackend(directory)
    try:
        assert backend.ttl_layouts() == {}
    finally:
        backend.close()
    # ... and stamped again with the time of the next declaration with TTL.
    assert await _in_directory(directory, _config(100), 1_000,
                               [At(1_099, _read, key=2), At(1_100, _read, key=2)]) \
        == [(2, 2, 2), (2, None, None)]


async def test_a_directory_left_midway_through_a_layout_change_is_refused(tmp_path):
    directory = str(tmp_path / "db")
    await _in_directory(directory, _config(100), 0, [At(0, _write, key=1)])
    families = {name: rocksdict.Options(raw_mode=True)
                for name in rocksdict.Rdict.list_cf(directory) if name != "default"}
    raw = rocksdict.Rdict(directory, rocksdict.Options(raw_mode=True),
                          column_families=families)
    raw.put(b"state-ttl:v", b"migrating")
    raw.close()
    with pytest.raises(ast.BackendError,
                       match=r"holds state 'v' whose entries were being rewritten \(TTL "
                             r"timestamps added or dropped\) when that stopped"):
        await _in_directory(directory, _config(100), 0, [At(0, _read, key=1)])
