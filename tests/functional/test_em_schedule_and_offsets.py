"""Gaps a mutation review of ``functional/em.py`` found: the inverse-temperature schedule's
documented range and length checks, and EM routing's use of ``beta_u`` versus ``beta_a`` and of
empty batches."""

from __future__ import annotations

import math

import pytest
import torch

from torchvote.functional import em_routing
from torchvote.functional.em import inverse_temperature_schedule


def test_a_zero_inverse_temperature_is_allowed():
    """``lambda_t = 0`` is finite and ``>= 0``: accepted as documented (a flat activation)."""
    assert inverse_temperature_schedule(0.0, 3) == [0.0, 0.0, 0.0]
    assert inverse_temperature_schedule([0.0, 0.5], 2) == [0.0, 0.5]


@pytest.mark.parametrize("values", [[0.1, 0.2, 0.3, 0.4], [0.1]])
def test_a_schedule_of_the_wrong_length_is_refused(values):
    """One value per iteration: a longer sequence is refused too, not silently cut."""
    with pytest.raises(ValueError, match="one value per iteration"):
        inverse_temperature_schedule(values, 3)


def _reference_one_pass(votes, a_in, beta_u, beta_a, lam, eps):
    """Procedure 1, one M-step from ``R = 1/|out|`` (a plain loop, one batch element)."""
    out_caps, in_caps, pose = votes.shape
    poses, acts = torch.empty(out_caps, pose, dtype=votes.dtype), torch.empty(out_caps, dtype=votes.dtype)
    for i in range(out_caps):
        r = [a_in[j] / out_caps for j in range(in_caps)]
        total = sum(r)
        mu = sum(r[j] * votes[i, j] for j in range(in_caps)) / total
        var = sum(r[j] * (votes[i, j] - mu) ** 2 for j in range(in_caps)) / total + eps
        cost = ((beta_u + 0.5 * torch.log(var)) * total).sum()
        poses[i] = mu
        acts[i] = 1 / (1 + math.exp(-lam * (beta_a - float(cost))))
    return poses, acts


def test_beta_u_and_beta_a_enter_the_cost_and_the_activation_as_documented():
    """One iteration against Procedure 1 by hand, with ``beta_u != beta_a``: swapping them shows."""
    torch.manual_seed(0)
    votes = torch.randn(1, 3, 5, 4, dtype=torch.float64)
    a_in = torch.rand(1, 5, dtype=torch.float64) * 0.8 + 0.1
    poses, acts = em_routing(votes, a_in, 0.7, -2.0, iterations=1, inverse_temperature=1.0,
                             strategy="vectorized")
    ref_poses, ref_acts = _reference_one_pass(votes[0], a_in[0], 0.7, -2.0, 1.0, 1e-6)
    torch.testing.assert_close(poses[0], ref_poses)
    torch.testing.assert_close(acts[0], ref_acts)


@pytest.mark.parametrize("strategy", ["auto", "blocked"])
def test_an_empty_batch_gives_empty_outputs_for_every_strategy(strategy):
    """An empty batch returns empty outputs of the documented shapes, whatever the strategy."""
    votes = torch.randn(0, 3, 5, 4)
    poses, acts = em_routing(votes, torch.rand(0, 5), 0.0, 0.0, strategy=strategy)
    assert poses.shape == (0, 3, 4) and acts.shape == (0, 3)


@pytest.mark.parametrize("argument", ["beta_u", "beta_a"])
def test_a_bool_offset_is_refused(argument):
    """``beta_u=True`` is not a real number here (it would have been a silent 1.0): TypeError."""
    votes, a_in = torch.randn(1, 2, 3, 4), torch.rand(1, 3)
    offsets = {"beta_u": 0.0, "beta_a": 0.0, argument: True}
    with pytest.raises(TypeError, match=argument):
        em_routing(votes, a_in, offsets["beta_u"], offsets["beta_a"])


def test_a_bool_inverse_temperature_is_refused():
    """``inverse_temperature=True`` is not a number (as documented): TypeError, not a constant 1.0."""
    with pytest.raises(TypeError, match="inverse_temperature"):
        inverse_temperature_schedule(True, 2)
    with pytest.raises(TypeError, match="inverse_temperature"):
        inverse_temperature_schedule(lambda t: True, 2)


def test_an_inverse_temperature_that_would_want_a_gradient_is_refused():
    """The schedule is made of floats: a tensor that requires a gradient lost it (autograd's "not
    used in the graph" later; under torch.func.grad a silent 0 where a finite difference gives
    about -0.2). Refused; the same tensor without a gradient is a number as any other."""
    votes, a_in = torch.randn(2, 3, 4, 4, dtype=torch.float64), torch.rand(2, 4, dtype=torch.float64)
    learned = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    for value in (learned, [0.1, learned], lambda t: learned):
        with pytest.raises(TypeError, match="inverse_temperature.*requires a gradient"):
            em_routing(votes, a_in, 0.0, 0.0, iterations=2, inverse_temperature=value)
    with pytest.raises(TypeError, match="inverse_temperature.*torch.func"):
        torch.func.grad(lambda lam: em_routing(votes, a_in, 0.0, 0.0, iterations=2, strategy="vectorized",
                                               inverse_temperature=lam)[1].sum())(torch.tensor(0.5))
    assert inverse_temperature_schedule(learned.detach(), 2) == [0.5, 0.5]


def test_activations_of_the_right_size_but_the_wrong_shape_are_refused():
    """``(in_caps, batch)`` activations hold as many numbers as ``(batch, in_caps)`` ones: refused
    by shape, never reshaped into the wrong inputs' weights."""
    votes = torch.randn(2, 3, 5, 4)
    with pytest.raises(ValueError, match="activations must have shape"):
        em_routing(votes, torch.rand(5, 2), 0.0, 0.0)
