"""`ast.run`: a job over an iterable of records, on a fresh event loop.

With `parallelism` N the job runs N operators in one loop, each owning its range of key
groups; every record goes to the operator whose range holds its key's group, as a keyed
exchange would route it. At the end of input every operator drains and advances its
watermark to the maximum (every event-time timer fires), then, when a checkpoint is asked
for, each writes its part. Tasks that records spawned and left running are waited for
before the operators close, so a state call they make fails the run instead of being lost.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterable
from typing import Any

from asyncstate.backends.base import StateExecutor
from asyncstate.backends.heap import HeapBackend
from asyncstate.checkpoint.writer import remove_superseded_parts
from asyncstate.clock import Clock
from asyncstate.config import AsyncStateConfig
from asyncstate.errors import InvalidStateError
from asyncstate.function import KeyedProcessFunction
from asyncstate.keygroups import compute_operator_index_for_key_group
from asyncstate.operator import arguments
from asyncstate.operator.keyed import KeyedOperator
from asyncstate.operator.progress import MAX_WATERMARK
from asyncstate.serde import canonical_key, key_group_of_bytes

__all__ = ["feed", "new_event_loop", "run"]

BackendFactory = Callable[[int], StateExecutor]


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new uvloop loop where uvloop is installed, else a new asyncio loop (the global
    event loop policy is left alone)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency where it installs
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(function: KeyedProcessFunction | Callable[[], KeyedProcessFunction],
        records: Iterable[Any], *, key_selector: Callable[[Any], Any],
        timestamp_selector: Callable[[Any], int | None] | None = None,
        backend: StateExecutor | BackendFactory | None = None,
        config: AsyncStateConfig | None = None, clock: Clock | None = None,
        parallelism: object = 1, checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_id: object = None,
        restore_from: str | os.PathLike[str] | None = None) -> list[Any]:
    """Run `function` over `records` on a fresh event loop; the emitted values in order.

    `parallelism` N > 1 runs N operators in one loop, records routed by key group; then
    `function` is a function object used by operator 0 or a factory called once per operator
    (a function object serves one operator), and `backend` a factory called with each
    operator index (None: a HeapBackend each). `restore_from` restores every operator from
    a checkpoint written at any parallelism; `checkpoint_dir` with `checkpoint_id` writes a
    checkpoint at the end of input, after every event-time timer fired. Returns the path
    only through `ast.checkpoint_path(checkpoint_dir, checkpoint_id)`.
    """
    if asyncio._get_running_loop() is not None:
        raise InvalidStateError(
            "ast.run() cannot be called from a running event loop; inside async code use "
            "`async with ast.KeyedOperator(...) as op: await op.process(record)`")
    # compiled: typed as object (parallelism, checkpoint_id: ints), so both builds raise
    # the errors of `arguments`.
    n = arguments.check_parallelism(parallelism)
    checkpoint = arguments.check_run_checkpoint(checkpoint_dir, checkpoint_id)
    functions = arguments.check_run_functions(function, n)
    backends = arguments.check_run_backends(backend, n)
    outputs: list[Any] = []
    operators = [
        KeyedOperator(functions[i], key_selector=key_selector,
                      backend=_or_heap(backends[i]),
                      config=config, clock=clock, timestamp_selector=timestamp_selector,
                      parallelism=n, operator_index=i, restore_from=restore_from,
                      output_list=outputs)
        for i in range(n)]
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(_run(operators, records, key_selector, checkpoint))
    return outputs


def _or_heap(backend: StateExecutor | None) -> StateExecutor:
    return HeapBackend() if backend is None else backend


async def _run(operators: list[KeyedOperator], records: Iterable[Any],
               key_selector: Callable[[Any], Any],
               checkpoint: tuple[str, int] | None) -> None:
    entered: list[KeyedOperator] = []
    error: BaseException | None = None
    try:
        for operator in operators:
            await operator.__aenter__()
            entered.append(operator)
        if len(operators) == 1:
            await feed(operators[0], records)
        else:
            await _feed_routed(operators, records, key_selector)
        await _settle(operators)
        for operator in operators:
            await operator.advance_watermark(MAX_WATERMARK)
        await _settle(operators)
        if checkpoint is not None:
            for operator in operators:
                path = await operator.snapshot(*checkpoint)
            # Every part of this run is committed: parts of an earlier run of the same id at
            # another parallelism are superseded (the reader leaves them out already).
            remove_superseded_parts(path, len(operators))
    except BaseException as exc:  # noqa: BLE001 - every operator closes, then it is raised
        error = exc
    for operator in reversed(entered):
        try:
            if error is None:
                await operator.__aexit__(None, None, None)
            else:
                await operator.__aexit__(type(error), error, error.__traceback__)
        except BaseException as exc:  # noqa: BLE001 - the first error is raised
            if error is None:
                error = exc
    if error is not None:
        raise error


async def _settle(operators: list[KeyedOperator]) -> None:
    """Drain every operator, then wait for the tasks records spawned and left running."""
    for operator in operators:
        await operator.drain()
    await _wait_for_spawned_tasks(operators)
    for operator in operators:
        await operator.drain()


async def feed(operator: KeyedOperator, records: Iterable[Any]) -> None:
    """Admit `records` into `operator` (open) in order, as `process(record)` would each,
    in one compiled loop: `ast.run`'s input, and each chunk of a Spark partition's. Only
    from outside the operator's records: it never admits beyond `max_in_flight`, so called
    from inside a record it could wait for that record itself."""
    controller = operator.controller
    prepare = operator.records.prepare
    gate = operator.admission
    for record in records:
        failure = controller.failure
        if failure is not None:
            raise failure
        ctx = prepare(record)
        if not gate.try_admit(ctx):
            await gate.admit(ctx)


async def _feed_routed(operators: list[KeyedOperator], records: Iterable[Any],
                       key_selector: Callable[[Any], Any]) -> None:
    parallelism = len(operators)
    max_parallelism = operators[0].config.max_parallelism
    controllers = [op.controller for op in operators]
    prepares = [op.records.prepare for op in operators]
    gates = [op.admission for op in operators]
    for record in records:
        for controller in controllers:
            failure = controller.failure
            if failure is not None:
                raise failure
        key_group = key_group_of_bytes(canonical_key(key_selector(record)), max_parallelism)
        i = compute_operator_index_for_key_group(max_parallelism, parallelism, key_group)
        ctx = prepares[i](record)
        if not gates[i].try_admit(ctx):
            await gates[i].admit(ctx)


async def _wait_for_spawned_tasks(operators: list[KeyedOperator]) -> None:
    """Wait for tasks that records spawned and did not await (this loop runs nothing else):
    a state call they make fails the run, and so does an exception they raise."""
    current = asyncio.current_task()
    spawned = [t for t in asyncio.all_tasks() if t is not current]
    if not spawned:
        return
    timeout_ms = operators[0].config.record_timeout_ms
    await asyncio.wait(spawned, timeout=None if timeout_ms is None else timeout_ms / 1000.0)
    for task in spawned:
        if not task.done():
            raise InvalidStateError(
                f"a task that a record spawned and did not await ({task.get_name()}) was "
                f"still running record_timeout_ms={timeout_ms} after the input ended")
        if not task.cancelled() and task.exception() is not None:
            for operator in operators:
                operator.controller.fail(task.exception())  # type: ignore[arg-type]
    for operator in operators:
        failure = operator.controller.failure
        if failure is not None:
            raise failure
