"""The public surface of asyncstate.spark: what API.md promises, listed in a sorted __all__."""

from __future__ import annotations

import inspect

import asyncstate.spark as aspark

PROMISED = ["process_keyed", "partition_runner"]
PROCESS_KEYED_KEYWORDS = ["key_selector", "num_partitions", "checkpoint_dir", "checkpoint_id",
                          "restore_from", "backend", "config", "output_schema"]


def test_all_lists_the_public_names_sorted() -> None:
    assert aspark.__all__ == sorted(aspark.__all__)
    public = {name for name in vars(aspark) if not name.startswith("_")} - {"annotations"}
    submodules = {name for name in public if inspect.ismodule(getattr(aspark, name))}
    assert set(aspark.__all__) == public - submodules
    assert set(PROMISED) <= set(aspark.__all__)


def test_process_keyed_takes_the_promised_arguments_and_defaults() -> None:
    params = inspect.signature(aspark.process_keyed).parameters
    assert list(params)[:2] == ["data", "function_factory"]
    for name in PROCESS_KEYED_KEYWORDS:
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    assert params["backend"].default == "rocksdb"
    for name in ("checkpoint_dir", "checkpoint_id", "restore_from", "config", "output_schema"):
        assert params[name].default is None, name
