"""AsyncStateConfig: defaults, bounds, types and replace()."""

from __future__ import annotations

import dataclasses

import pytest

import asyncstate as ast


def test_config_defaults():
    config = ast.AsyncStateConfig()
    assert (config.batch_size, config.buffer_timeout_ms, config.max_in_flight,
            config.max_parallelism) == (1000, 1000, 6000, 128)
    assert config.iterator_chunk_size >= 1
    assert dataclasses.is_dataclass(config)


@pytest.mark.parametrize(("option", "lowest", "highest"), [
    ("batch_size", 1, None),
    ("max_in_flight", 1, None),
    ("iterator_chunk_size", 1, 2**31 - 1),
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
