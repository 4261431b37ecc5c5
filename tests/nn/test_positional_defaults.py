"""Defaults and initialisation of the positional modules that the formula tests leave open (found
by a mutation review). References: the docstrings (GPT-2's ``N(0, 0.02^2)``, ``max_len=5000``)
and sample statistics of the drawn embeddings."""

from __future__ import annotations

import math

import pytest
import torch

from torchvote.nn import LearnedPositionalEmbedding, SinusoidalPositionalEncoding


def test_learned_embeddings_are_drawn_from_gpt2_normal():
    """Guards ``reset_parameters``'s ``std=0.02``: 65536 draws have a sample mean within 5
    standard errors of 0 and a standard deviation within 3% of 0.02, after construction and after
    a redraw."""
    torch.manual_seed(0)
    module = LearnedPositionalEmbedding(4096, 16, dtype=torch.float64)
    for _ in range(2):
        weight = module.weight.detach()
        assert abs(float(weight.mean())) < 5 * 0.02 / math.sqrt(weight.numel())
        assert abs(float(weight.std()) / 0.02 - 1) < 0.03
        module.reset_parameters()


def test_sinusoidal_default_table_covers_5000_positions():
    """Guards the documented default ``max_len=5000``: positions up to 4999 are served (as
    ``sin(4999)`` and ``cos(4999)`` in the first pair) and 5000 is refused."""
    module = SinusoidalPositionalEncoding(4)
    assert module.max_len == 5000
    out = module(torch.zeros(1, 1, 4, dtype=torch.float64), offset=4999)
    assert math.isclose(float(out[0, 0, 0]), math.sin(4999), abs_tol=1e-6)
    assert math.isclose(float(out[0, 0, 1]), math.cos(4999), abs_tol=1e-6)
    with pytest.raises(ValueError, match="max_len=5000"):
        module(torch.zeros(1, 1, 4), offset=5000)
