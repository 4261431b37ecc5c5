"""Gaps a mutation review of ``training/checkpoint.py`` found: tensors that share a storage at
different offsets are not tied weights, every earlier file at a checkpoint's name is kept, and only
``step-<digits>`` names have a step."""

from __future__ import annotations

import torch
from torch import nn

from torchvote.training.checkpoint import (
    checkpoint_name,
    checkpoint_step,
    load_model_weights,
    load_training_state,
    save_checkpoint,
)


class _TwoViews(nn.Module):
    """Two buffers that are views of one storage at different offsets (same shape and stride)."""

    def __init__(self, base: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("first", base[:3])
        self.register_buffer("second", base[3:])


def test_views_of_one_storage_at_different_offsets_round_trip(tmp_path):
    """Only tensors at the same storage offset are one tied tensor: two halves of one storage
    come back as they were (compared with the saved model's own state_dict)."""
    source = _TwoViews(torch.arange(6, dtype=torch.float32))
    paths = save_checkpoint(tmp_path, step=1, model=source, model_metadata={}, state={})
    target = _TwoViews(torch.zeros(6))
    load_model_weights(target, paths.weights)
    for name, tensor in source.state_dict().items():
        torch.testing.assert_close(target.state_dict()[name], tensor)


def test_a_fourth_save_at_one_step_keeps_every_earlier_version(tmp_path):
    """Each save at a step already written moves the files there aside to the first free
    ``.old``, ``.old-2`` ...: nothing written earlier is lost (``save_checkpoint``'s docstring)."""
    model = nn.Linear(2, 2)
    for attempt in range(4):
        paths = save_checkpoint(tmp_path, step=5, model=model, model_metadata={}, state={"attempt": attempt})
    assert load_training_state(paths.state)["attempt"] == 3
    for attempt, suffix in enumerate([".old", ".old-2", ".old-3"]):
        assert load_training_state(tmp_path / f"step-00000005.state.pt{suffix}")["attempt"] == attempt
        assert (tmp_path / f"step-00000005.safetensors{suffix}").is_file()


def test_checkpoint_step_reads_only_step_names():
    """``checkpoint_step`` inverts ``checkpoint_name`` (any digit count) and gives -1 for a name of
    any other form, even one whose tail is digits (it never names a checkpoint)."""
    for step in (0, 7, 12_345_678, 123_456_789):
        assert checkpoint_step(checkpoint_name(step)) == step
    for name in ("best-00000012", "xtep-00000003", "step-", "step-12a", "step-١٢", "latest"):
        assert checkpoint_step(name) == -1
