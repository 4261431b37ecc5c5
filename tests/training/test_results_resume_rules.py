"""Gaps a mutation review of ``training/results.py`` found: which config changes a resume
accepts, and how the resumable checkpoint is found when the checkpoint file is named directly."""

from __future__ import annotations

import dataclasses

import pytest
from torch import nn

from torchvote.training.checkpoint import CheckpointError, save_checkpoint
from torchvote.training.config import TrainConfig
from torchvote.training.keyvalue import ConfigError
from torchvote.training.results import check_resumable, find_resumable_checkpoint


@pytest.mark.parametrize("change", [{"out_dir": "elsewhere"}, {"run_dir": "moved-run"}, {"epochs": 7}])
def test_where_a_run_lives_and_resumable_keys_may_change(change):
    """``run_dir`` and ``out_dir`` say where the run lives, not what it computes: a resume from a
    moved folder may change them, as it may the keys of ``RESUMABLE_KEYS``."""
    saved = TrainConfig()
    check_resumable(saved, dataclasses.replace(saved, **change))


def test_a_key_that_changes_the_weights_may_not():
    """A changed seed would change the run: refused, naming the key and both values."""
    saved = TrainConfig()
    with pytest.raises(ConfigError, match=r"seed \(run: 0, now: 1\)"):
        check_resumable(saved, dataclasses.replace(saved, seed=1))


def test_a_weights_file_named_directly_is_checked_too(tmp_path):
    """Named directly (no fallback), a checkpoint whose weights are corrupt is refused, even though
    its state file reads back whole."""
    paths = save_checkpoint(tmp_path, step=2, model=nn.Linear(2, 2), model_metadata={}, state={"step": 2})
    assert find_resumable_checkpoint(paths.weights)[1]["step"] == 2
    blob = bytearray(paths.weights.read_bytes())
    blob[-1] ^= 0xFF  # one flipped bit inside the last tensor
    paths.weights.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="corrupt"):
        find_resumable_checkpoint(paths.weights)


def test_without_a_pointer_the_newest_checkpoint_by_step_is_resumed(tmp_path):
    """The ``latest`` pointer deleted (a run killed between a checkpoint and its pointer): the
    newest checkpoint by step is the one resumed, not the oldest."""
    for step in (3, 12, 7):
        save_checkpoint(tmp_path, step=step, model=nn.Linear(2, 2), model_metadata={}, state={"step": step})
    (tmp_path / "latest").unlink()
    paths, state, skipped = find_resumable_checkpoint(tmp_path)
    assert (paths.name, state["step"], skipped) == ("step-00000012", 12, [])
