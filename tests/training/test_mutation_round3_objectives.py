"""Mutation review, round 3: every option of the loss config reaches the objective, and the
optimiser and schedule options reach the optimiser.

The earlier tests built the objectives at the default margins, without label smoothing and on one
image per reconstruction, and stepped the optimisers once on zero gradients (where Adam's betas
and SGD's momentum cancel out): a mutant that dropped any of those options lived. The references
here are the papers' formulas written as loops, PyTorch's own ``F.cross_entropy`` and optimisers.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchvote.models.registry import ClassifierOutput, get_model_spec
from torchvote.training.config import build_model_config, load_config
from torchvote.training.objectives import make_objective
from torchvote.training.optim import build_optimizer, build_scheduler, lr_multiplier
from torchvote.training.schema import OptimConfig


def _objective(preset, overrides, total_steps=10):
    config = load_config(preset, overrides)
    spec = get_model_spec(config.model.name)
    return make_objective(config.loss, spec, total_steps, model_config=build_model_config(config.model))


def _margin_loop(lengths, present, m_plus, m_minus, lam):
    """Sabour et al. 2017, eq. 4, one example and one class at a time, averaged over the batch."""
    total = 0.0
    for b in range(lengths.shape[0]):
        for k in range(lengths.shape[1]):
            v, t = float(lengths[b, k]), float(present[b, k])
            total += t * max(0.0, m_plus - v) ** 2 + lam * (1 - t) * max(0.0, v - m_minus) ** 2
    return total / lengths.shape[0]


def test_the_margin_objective_takes_the_configured_margins_and_down_weight():
    """Mutants: ``positive_margin`` or ``down_weight`` not passed on to the margin loss (its
    defaults used instead); the tests used the defaults."""
    objective = _objective("capsnet-mnist", ["loss.name=margin", "loss.reconstruction_weight=0",
                                             "loss.positive_margin=0.7", "loss.negative_margin=0.2",
                                             "loss.down_weight=0.25"])
    generator = torch.Generator().manual_seed(0)
    scores = torch.rand(6, 10, generator=generator, dtype=torch.float64)
    targets = torch.tensor([0, 3, 5, 7, 9, 2])
    value, parts = objective(ClassifierOutput(scores=scores), {"targets": targets}, 0)
    expected = _margin_loop(scores, F.one_hot(targets, 10), 0.7, 0.2, 0.25)
    assert value.item() == pytest.approx(expected, rel=1e-12)
    assert set(parts) == {"margin"}


def test_the_cross_entropy_objective_smooths_its_labels():
    """Mutant: ``label_smoothing`` not passed on to the cross-entropy. PyTorch's own loss is the
    reference."""
    objective = _objective("mnist-cnn", ["loss.label_smoothing=0.2"])
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 10, generator=generator)
    targets = torch.tensor([1, 0, 4, 9, 3])
    value, parts = objective(ClassifierOutput(scores=logits), {"targets": targets}, 0)
    expected = F.cross_entropy(logits, targets, label_smoothing=0.2)
    torch.testing.assert_close(value, expected)
    assert not math.isclose(value.item(), F.cross_entropy(logits, targets).item(), rel_tol=1e-3)


def test_the_spread_margin_ramps_over_the_configured_steps_not_the_run():
    """Mutant: ``loss.spread_ramp_steps`` ignored (the ramp spans the run). Hinton et al. 2018's
    margin rises linearly from 0.2 to 0.9, here over 4 of the run's 100 steps."""
    objective = _objective("capsnet-mnist", ["model.router=em", "loss.spread_ramp_steps=4"], total_steps=100)
    scores = torch.rand(2, 10, generator=torch.Generator().manual_seed(3))
    output, batch = ClassifierOutput(scores=scores), {"targets": torch.tensor([1, 2])}
    for step, margin in [(0, 0.2), (2, 0.55), (4, 0.9), (50, 0.9)]:
        _, parts = objective(output, batch, step)
        assert parts["spread_margin"].item() == pytest.approx(margin)


def _two_steps(optimizer_config: OptimConfig, reference_class, **reference_options):
    """The parameters after two steps on fixed, non-zero gradients: ours and a reference
    optimiser's built directly from PyTorch."""
    results = []
    for build in (lambda ps: build_optimizer(ps, optimizer_config),
                  lambda ps: reference_class(ps, lr=optimizer_config.lr, **reference_options)):
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        optimizer = build(list(model.parameters()))
        for scale in (1.0, -0.3):
            for p in model.parameters():
                p.grad = torch.full_like(p, scale) + 0.1 * torch.arange(p.numel()).view_as(p)
            optimizer.step()
        results.append([p.detach().clone() for p in model.parameters()])
    return results


def test_adam_takes_its_betas_in_order():
    """Mutant: ``betas=(beta2, beta1)``. One step on zero gradients does not see the betas (the
    bias-corrected first step is ``lr * sign(g)``); two steps on changing gradients do."""
    config = OptimConfig(name="adam", lr=0.1, beta1=0.5, beta2=0.9)
    ours, reference = _two_steps(config, torch.optim.Adam, betas=(0.5, 0.9))
    for a, b in zip(ours, reference, strict=True):
        torch.testing.assert_close(a, b)


def test_sgd_takes_its_momentum():
    """Mutant: SGD built without the configured momentum. The second step carries
    ``momentum * g_1`` along (Sutskever et al. 2013, PyTorch's form)."""
    config = OptimConfig(name="sgd", lr=0.1, momentum=0.8)
    ours, reference = _two_steps(config, torch.optim.SGD, momentum=0.8)
    for a, b in zip(ours, reference, strict=True):
        torch.testing.assert_close(a, b)
    plain, _ = _two_steps(OptimConfig(name="sgd", lr=0.1, momentum=0.0), torch.optim.SGD)
    assert not torch.allclose(ours[0], plain[0])


def test_onecycle_with_adam_leaves_beta1_alone():
    """Mutant: ``cycle_momentum=True`` for every optimiser. OneCycleLR then cycles Adam's beta1
    between 0.85 and 0.95 (Smith's momentum cycle, meant for SGD), overriding ``optim.beta1``."""
    model = nn.Linear(2, 2)
    config = OptimConfig(name="adam", lr=0.01, beta1=0.7, schedule="onecycle")
    optimizer = build_optimizer(model.parameters(), config)
    scheduler = build_scheduler(optimizer, config, 10)
    for _ in range(5):
        optimizer.step()
        scheduler.step()
        assert optimizer.param_groups[0]["betas"][0] == 0.7


def test_the_cosine_schedule_stays_at_its_floor_after_the_run():
    """Mutant: the cosine's progress not clamped at 1. Past ``total_steps`` (a step the loop takes
    when a last partial epoch runs on) the rate must stay at ``min_lr_ratio``, not climb back up
    the cosine: ``min + (1 - min) (1 + cos(pi * 1.5)) / 2`` is halfway up."""
    config = OptimConfig(schedule="cosine", warmup_steps=0, min_lr_ratio=0.1)
    multiplier = lr_multiplier(config, 10)
    assert multiplier(10) == pytest.approx(0.1)
    assert multiplier(15) == pytest.approx(0.1)
    assert multiplier(20) == pytest.approx(0.1)
