"""Gaps a mutation review of ``functional/scores.py`` found: an explicit ``scale`` of
:func:`scaled_dot_score` must be used, and :func:`default_scale` follows Vaswani et al. eq. 1."""

from __future__ import annotations

import math

import pytest
import torch

from torchvote.functional import scaled_dot_score
from torchvote.functional.scores import default_scale


@pytest.mark.parametrize("scale", [0.3, 2.0, -1.5])
def test_scaled_dot_score_multiplies_by_an_explicit_scale(scale):
    """``scaled_dot_score(q, k, scale)`` is ``q . k * scale`` (a plain loop), not ``1/sqrt(E)``."""
    torch.manual_seed(0)
    q = torch.randn(2, 3, 4, dtype=torch.float64)
    k = torch.randn(2, 5, 4, dtype=torch.float64)
    expected = torch.empty(2, 3, 5, dtype=torch.float64)
    for b in range(2):
        for i in range(3):
            for j in range(5):
                expected[b, i, j] = float((q[b, i] * k[b, j]).sum()) * scale
    torch.testing.assert_close(scaled_dot_score(q, k, scale), expected)


def test_default_scale_is_one_over_root_features_and_one_without_features():
    """``1/sqrt(E)`` for ``E > 0`` (Vaswani et al. 2017, eq. 1); ``E = 0`` gives 1 as documented."""
    assert default_scale(16) == 0.25
    assert default_scale(3) == pytest.approx(1 / math.sqrt(3))
    assert default_scale(0) == 1.0
