"""``evaluating``: evaluation mode inside the block, each submodule's own mode afterwards."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchvote.nn.modes import evaluating


def _modes(module: nn.Module) -> dict[str, bool]:
    return {name: part.training for name, part in module.named_modules()}


def test_evaluation_mode_inside_and_every_part_its_own_mode_after():
    model = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5), nn.Sequential(nn.BatchNorm1d(3), nn.Dropout(0.5)))
    model.train()
    model[2][0].eval()  # a frozen batch norm inside a training model
    before = _modes(model)
    with evaluating(model):
        assert not any(_modes(model).values())
        x = torch.ones(4, 3)
        assert torch.equal(model[1](x), x)  # dropout off
    assert _modes(model) == before


def test_the_modes_come_back_when_the_block_raises():
    model = nn.Sequential(nn.Dropout(0.5), nn.Dropout(0.5)).train()
    model[1].eval()
    before = _modes(model)
    with pytest.raises(RuntimeError, match="inside"), evaluating(model):
        raise RuntimeError("inside")
    assert _modes(model) == before
