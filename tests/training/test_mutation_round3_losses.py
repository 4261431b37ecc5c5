"""Mutation review, round 3: the losses of :mod:`torchvote.losses` where the earlier tests left a
mutant alive: equal margins, and sums that pass float16's range.

Each test names its mutant; the references are PyTorch's own float32 loss and a float64 sum.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchvote.losses import cross_entropy, margin_loss, reconstruction_loss


def test_margin_loss_refuses_equal_margins():
    """Mutant: ``negative_margin >= positive_margin`` relaxed to ``>``. The docstring asks
    ``0 <= m- < m+ <= 1``: with ``m- == m+`` every length is penalised on one side or the other."""
    lengths, targets = torch.tensor([[0.5, 0.5]]), torch.tensor([0])
    with pytest.raises(ValueError, match="negative_margin must be below positive_margin"):
        margin_loss(lengths, targets, positive_margin=0.5, negative_margin=0.5)


def test_reconstruction_loss_of_float16_images_sums_past_float16s_range():
    """Mutant: the squared errors summed in float16. A 300 x 300 reconstruction off by 1 in every
    pixel sums to 90,000, past float16's 65,504 (inf); the weighted loss, 45, is a float16 number."""
    reconstructions = torch.ones(2, 1, 300, 300, dtype=torch.float16)
    images = torch.zeros(2, 1, 300, 300, dtype=torch.float16)
    loss = reconstruction_loss(reconstructions, images, weight=0.0005)
    expected = 0.0005 * reconstructions.double().sub(images.double()).square().flatten(1).sum(1).mean()
    assert loss.dtype == torch.float16
    assert torch.isfinite(loss)
    assert float(loss) == pytest.approx(float(expected), rel=1e-3)


def test_cross_entropy_of_float16_logits_is_computed_in_float32():
    """Mutant: float16 logits left in float16. The loss is a sum over the counted positions divided
    by their number; over 40,000 tokens the float16 sum overflows to inf, where PyTorch's float32
    mean is about 2.3 (and the docstring promises at least float32)."""
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(1, 40_000, 10, generator=generator)).half()
    targets = torch.randint(10, (1, 40_000), generator=generator)
    for smoothing in (0.0, 0.1):
        expected = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), label_smoothing=smoothing)
        actual = cross_entropy(logits, targets, label_smoothing=smoothing)
        assert torch.isfinite(actual)
        torch.testing.assert_close(actual.float(), expected, rtol=1e-4, atol=1e-4)
