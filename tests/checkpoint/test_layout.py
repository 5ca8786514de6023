"""Checkpoint paths and ids (checkpoint/layout.py)."""

from __future__ import annotations

import os

import pytest
from checkpoint_files import (
    read_consistent,
    write_attempt,
)

from asyncstate.checkpoint.format import (
    checkpoint_path,
)
from asyncstate.errors import ConfigError


def test_checkpoint_path_is_chk_id_under_directory(tmp_path):
    assert checkpoint_path(tmp_path, 7) == os.path.join(str(tmp_path), "chk-7")
    assert checkpoint_path(str(tmp_path), 0).endswith("chk-0")


@pytest.mark.parametrize("bad", [-1, True, "3", 1.0, None])
def test_checkpoint_path_rejects_bad_ids(tmp_path, bad):
    with pytest.raises(ConfigError, match=r"^checkpoint_id must be"):
        checkpoint_path(tmp_path, bad)
    with pytest.raises(ValueError):
        checkpoint_path(tmp_path, bad)


@pytest.mark.parametrize("bad", [-1, True, False, "1", 1.0, None, 2**63 * -1])
def test_checkpoint_ids_that_are_not_non_negative_ints_are_refused(tmp_path, bad):
    with pytest.raises(ConfigError, match=r"^checkpoint_id must be"):
        checkpoint_path(tmp_path, bad)


@pytest.mark.parametrize("good", [0, 2**63, 10**40])
def test_edge_checkpoint_ids_round_trip(tmp_path, good):
    chk = checkpoint_path(tmp_path, good)
    assert os.path.basename(chk) == f"chk-{good}"
    write_attempt(chk, 0, good % 7)
    assert read_consistent(chk) == (0, good % 7)
