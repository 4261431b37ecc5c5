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


def test_float16_scores_past_65504_stay_finite_and_a_scaled_one_that_fits_is_exact():
    """float16 products ran in float16: a dot product past 65504 was inf (NaN weights in
    ``attend``), and ``scaled_dot_score`` scaled after that product, so a scaled logit of 16410,
    which fits, was inf too. Formed in float32, scaled there, clamped to +-65504."""
    from torchvote.functional import attend, dot_score, general_score

    torch.manual_seed(0)
    q = (70 * torch.randn(1, 2, 16)).half()
    k = (70 * torch.randn(1, 3, 16)).half()
    k[0, 0] = q[0, 0]  # a score of |q|^2, past 65504
    v = torch.randn(1, 3, 4).half()
    exact = q.double() @ k.double().mT  # float64 on the same float16 inputs
    assert float(exact[0, 0, 0]) > 65504
    scores = dot_score(q, k)
    assert scores.dtype == torch.float16 and float(scores[0, 0, 0]) == 65504  # clamped, not inf
    scaled = scaled_dot_score(q, k)
    torch.testing.assert_close(scaled.double(), exact / 4, rtol=2**-10, atol=0.0)  # 1/sqrt(16); fits float16
    weight = torch.eye(16).half()
    assert bool(torch.isfinite(general_score(q, k, weight)).all())
    for logits in (scores, scaled, general_score(q, k, weight)):
        output, weights = attend(logits, v)
        assert bool(torch.isfinite(output).all()) and bool(torch.isfinite(weights).all())


def test_float16_autocast_scores_are_float16_and_broadcast_general_scores_contiguous():
    """Under float16 autocast the scores are autocast's float16 (as bfloat16 autocast gives
    bfloat16), clamped as float16 inputs' are; general_score's two products keep broadcast batch
    axes contiguous (an einsum returned them transposed in memory)."""
    from torchvote.functional import dot_score, general_score

    torch.manual_seed(0)
    q, k, w = 70 * torch.randn(1, 2, 16), 70 * torch.randn(1, 3, 16), torch.eye(16)
    k[0, 0] = q[0, 0]
    with torch.autocast("cpu", dtype=torch.float16):
        scores = [dot_score(q, k), scaled_dot_score(q, k), general_score(q, k, w)]
    assert [s.dtype for s in scores] == [torch.float16] * 3
    assert all(bool(torch.isfinite(s).all()) for s in scores)
    with torch.autocast("cpu", dtype=torch.float16):  # which autocast leaves in float64
        assert dot_score(q.double(), k.double()).dtype == torch.float64
    broadcast = general_score(torch.randn(2, 1, 3, 4), torch.randn(1, 7, 5, 6), torch.randn(4, 6))
    assert broadcast.shape == (2, 7, 3, 5) and broadcast.is_contiguous()
