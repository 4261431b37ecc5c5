"""Option checks and edge cases of :func:`~torchvote.models.sampling.sample_next_token` that the
nucleus tests leave open (found by a mutation review): ``top_k`` must be a positive integer, and a
temperature must be finite. References are the docstring's contract and hand-computed cases."""

from __future__ import annotations

import pytest
import torch

from torchvote.models.sampling import sample_next_token


@pytest.mark.parametrize("temperature", [1.0, 0.0])
@pytest.mark.parametrize("top_k", [0, -1])
def test_top_k_below_one_is_refused_by_name(top_k, temperature):
    """Guards the ``top_k < 1`` check: ``top_k=0`` would keep no token (a NaN softmax that fails
    inside ``torch.multinomial``); the docstring promises a ValueError naming ``top_k``."""
    with pytest.raises(ValueError, match=r"top_k must be a positive integer or None"):
        sample_next_token(torch.zeros(2, 4), temperature=temperature, top_k=top_k)


def test_top_k_one_is_greedy_whatever_the_temperature():
    """Guards the smallest allowed ``top_k``: keeping exactly one token draws the argmax, ties to
    the lowest id (hand-computed rows)."""
    logits = torch.tensor([[0.1, 2.0, -1.0, 2.0], [3.0, 0.0, 1.0, 0.5]])
    tokens = sample_next_token(logits, temperature=5.0, top_k=1, generator=torch.Generator().manual_seed(0))
    assert tokens.flatten().tolist() == [1, 0]


@pytest.mark.parametrize("temperature", [float("inf"), float("nan"), -0.5])
def test_a_temperature_that_is_not_finite_and_non_negative_is_refused(temperature):
    """Guards the finiteness check of the temperature: ``inf`` divided every logit to 0 (uniform
    draws) and NaN poisoned them, in silence."""
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        sample_next_token(torch.zeros(1, 3), temperature=temperature)


def test_a_temperature_below_float32s_range_takes_the_peak_not_nan():
    """Guards the shift by the row's largest logit before the division: at a temperature of
    ``1e-310`` (a float64 subnormal, still ``> 0``) ``logit / temperature`` overflows, and without
    the shift ``inf - inf`` made the row NaN. From the peak every other token is ``-inf``, so the
    draw is the argmax (hand-computed rows without ties)."""
    logits = torch.tensor([[0.0, 1.0, -1.0], [2.5, -3.0, 0.5]], dtype=torch.float64)
    tokens = sample_next_token(logits, temperature=1e-310, generator=torch.Generator().manual_seed(0))
    assert tokens.flatten().tolist() == [1, 0]
