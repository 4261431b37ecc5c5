"""EM routing against a literal transcription of Hinton, Sabour & Frosst 2018, Procedure 1.

The reference works in the paper's own (not log) space, with the papers' indices: ``i`` input
capsule, ``j`` output capsule, ``h`` pose entry, votes ``V[i, j, h]``; it takes and returns
torchvote's receivers-first layout, converting once at its edge (``reference``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from einops import rearrange
from hypothesis import given, settings
from hypothesis import strategies as st

import torchvote.functional.em_kernel as kernel_module
from torchvote.functional.em import default_inverse_temperature, em_routing

DOUBLE = torch.float64
EPS = 1e-6


def procedure1(V, a, beta_u, beta_a, iterations, schedule=default_inverse_temperature, eps=EPS):
    """EM-routing(a, V) for one example. Returns poses (out, h), activations (out,), R (in, out)."""
    n_in, n_out, n_h = V.shape
    R = [[torch.tensor(1.0 / n_out, dtype=V.dtype) for _ in range(n_out)] for _ in range(n_in)]
    for t in range(iterations):
        lam = schedule(t)
        mu, sigma2, a_out, R_used = [], [], [], [row[:] for row in R]
        for j in range(n_out):  # M-step
            Rj = [R[i][j] * a[i] for i in range(n_in)]  # R_ij <- R_ij * a_i, not renormalised
            total = sum(Rj)
            mu_j = [sum(Rj[i] * V[i, j, h] for i in range(n_in)) / total for h in range(n_h)]
            s2_j = [sum(Rj[i] * (V[i, j, h] - mu_j[h]) ** 2 for i in range(n_in)) / total + eps
                    for h in range(n_h)]
            cost = [(beta_u[j] + torch.log(torch.sqrt(s2_j[h]))) * total for h in range(n_h)]
            a_out.append(torch.sigmoid(lam * (beta_a[j] - sum(cost))))
            mu.append(torch.stack(mu_j))
            sigma2.append(torch.stack(s2_j))
        if t < iterations - 1:
            for i in range(n_in):  # E-step
                p = []
                for j in range(n_out):
                    density = 1.0 / torch.sqrt(torch.prod(2 * math.pi * sigma2[j]))
                    p.append(density * torch.exp(-(((V[i, j] - mu[j]) ** 2) / (2 * sigma2[j])).sum()))
                total = sum(a_out[k] * p[k] for k in range(n_out))
                R[i] = [a_out[j] * p[j] / total for j in range(n_out)]
    assignments = torch.stack([torch.stack(row) for row in R_used])
    return torch.stack(mu), torch.stack(a_out), assignments


def reference(V, a, beta_u, beta_a, iterations, **kwargs):
    """Procedure 1 per example. V: (b, out, in, h), receivers first; R comes back (b, out, in)."""
    V = rearrange(V, "b o i h -> b i o h")  # the paper's (in, out)
    results = [procedure1(V[n], a[n], beta_u, beta_a, iterations, **kwargs) for n in range(V.shape[0])]
    poses, activations, R = (torch.stack(parts) for parts in zip(*results, strict=True))
    return poses, activations, rearrange(R, "b i o -> b o i")


def sample(seed, batch=2, n_in=5, n_out=3, n_h=4):
    generator = torch.Generator().manual_seed(seed)
    V = torch.randn(batch, n_out, n_in, n_h, generator=generator, dtype=DOUBLE)  # receivers first
    a = torch.rand(batch, n_in, generator=generator, dtype=DOUBLE) * 0.9 + 0.1
    beta_u = torch.randn(n_out, generator=generator, dtype=DOUBLE)
    beta_a = torch.randn(n_out, generator=generator, dtype=DOUBLE)
    return [t.requires_grad_(True) for t in (V, a, beta_u, beta_a)]


def steep(t):
    return 0.5 * (t + 1)  # a schedule that makes the activations vary in a small test


@pytest.mark.parametrize("iterations", [1, 2, 3])
@pytest.mark.parametrize("schedule", [default_inverse_temperature, steep])
def test_em_routing_matches_procedure1(iterations, schedule):
    V, a, beta_u, beta_a = sample(iterations)
    poses, activations, assignments = em_routing(V, a, beta_u, beta_a, iterations=iterations,
                                                 inverse_temperature=schedule, return_assignments=True)
    ref_poses, ref_act, ref_R = reference(V, a, beta_u, beta_a, iterations, schedule=schedule)
    torch.testing.assert_close(poses, ref_poses, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(activations, ref_act, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(assignments, ref_R, rtol=1e-10, atol=1e-12)
    probe_p, probe_a = torch.randn_like(poses), torch.randn_like(activations)
    leaves = [V, a, beta_u, beta_a]
    grads = torch.autograd.grad((poses * probe_p).sum() + (activations * probe_a).sum(), leaves)
    ref_grads = torch.autograd.grad((ref_poses * probe_p).sum() + (ref_act * probe_a).sum(), leaves)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-8, atol=1e-10)


def test_em_routing_in_blocks_matches_one_block(monkeypatch):
    V, a, beta_u, beta_a = sample(4, batch=5)
    whole = em_routing(V, a, beta_u, beta_a, inverse_temperature=steep, return_assignments=True)
    monkeypatch.setattr(kernel_module, "_BLOCK_ELEMENTS", 2 * 3 * 5 * 4)  # blocks of two examples
    blocked = em_routing(V, a, beta_u, beta_a, inverse_temperature=steep, return_assignments=True)
    for x, y in zip(whole, blocked, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-14)
    g_whole = torch.autograd.grad(whole[0].sum() + whole[1].sum(), [V, a])
    g_blocked = torch.autograd.grad(blocked[0].sum() + blocked[1].sum(), [V, a])
    for x, y in zip(g_whole, g_blocked, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-14)


def test_extra_batch_dimensions_and_all_passes():
    V = torch.randn(2, 3, 4, 6, 16)
    a = torch.rand(2, 3, 6)
    poses, activations, assignments = em_routing(V, a, 0.0, 0.0, return_assignments=True, all_passes=True)
    assert poses.shape == (2, 3, 4, 16) and activations.shape == (2, 3, 4)
    assert assignments.shape == (3, 2, 3, 4, 6)
    torch.testing.assert_close(assignments[0], torch.full((2, 3, 4, 6), 0.25))
    torch.testing.assert_close(assignments.sum(-2), torch.ones(3, 2, 3, 6))


def test_input_activations_are_not_renormalised_away():
    """Renormalising R_ij a_i over the outputs would make the result independent of a."""
    V, a, beta_u, beta_a = sample(5)
    poses, activations = em_routing(V, a, beta_u, beta_a, inverse_temperature=steep)
    half, half_act = em_routing(V, a * 0.5, beta_u, beta_a, inverse_temperature=steep)
    assert not torch.allclose(activations, half_act)
    silenced = a.detach().clone()
    silenced[:, 0] = 0.0  # an absent input capsule takes no part
    poses_0, act_0 = em_routing(V, silenced, beta_u, beta_a, inverse_temperature=steep)
    poses_1, act_1 = em_routing(V[:, :, 1:], silenced[:, 1:], beta_u, beta_a, inverse_temperature=steep)
    torch.testing.assert_close(poses_0, poses_1)
    torch.testing.assert_close(act_0, act_1)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), n_in=st.integers(2, 7), n_out=st.integers(1, 4))
def test_permuting_input_capsules_leaves_em_outputs_unchanged(seed, n_in, n_out):
    V, a, beta_u, beta_a = sample(seed, n_in=n_in, n_out=n_out)
    order = torch.randperm(n_in, generator=torch.Generator().manual_seed(seed))
    poses, act, R = em_routing(V, a, beta_u, beta_a, inverse_temperature=steep, return_assignments=True)
    poses_p, act_p, R_p = em_routing(V[:, :, order], a[:, order], beta_u, beta_a, inverse_temperature=steep,
                                     return_assignments=True)
    torch.testing.assert_close(poses_p, poses)
    torch.testing.assert_close(act_p, act)
    torch.testing.assert_close(R_p, R[:, :, order])
    torch.testing.assert_close(R.sum(-2), torch.ones(2, n_in, dtype=DOUBLE))


def test_log_space_survives_identical_votes_and_far_outliers():
    """Identical votes (zero variance) and votes far from every mean underflow p in the paper's
    space; in log space everything stays finite."""
    V = torch.ones(2, 3, 6, 16).requires_grad_(True)
    a = torch.ones(2, 6)
    poses, activations = em_routing(V, a, 1.0, 1.0, inverse_temperature=steep)
    (poses.sum() + activations.sum()).backward()
    torch.testing.assert_close(poses, torch.ones(2, 3, 16))
    assert torch.isfinite(activations).all() and torch.isfinite(V.grad).all()
    far = torch.randn(2, 3, 6, 16) * 1e3
    far[:, :, 0] = 0.0
    far.requires_grad_(True)
    poses, activations, R = em_routing(far, a, 1.0, 1.0, inverse_temperature=steep, return_assignments=True)
    (poses.sum() + activations.sum()).backward()
    assert torch.isfinite(poses).all() and torch.isfinite(R).all() and torch.isfinite(far.grad).all()
    torch.testing.assert_close(R.sum(-2), torch.ones(2, 6))


def test_zero_votes_and_zero_activations_give_zeros_and_finite_gradients():
    V = torch.zeros(2, 3, 5, 16, requires_grad=True)
    a = torch.zeros(2, 5, requires_grad=True)
    poses, activations = em_routing(V, a, 0.5, 0.5)
    assert torch.equal(poses, torch.zeros(2, 3, 16))
    (poses.sum() + activations.sum()).backward()
    assert torch.isfinite(V.grad).all() and torch.isfinite(a.grad).all()
    # no data: cost 0, so a_i = sigmoid(lambda_last beta_a), lambda of the third (last) pass
    expected = torch.sigmoid(torch.tensor(default_inverse_temperature(2) * 0.5))
    torch.testing.assert_close(activations, expected.expand(2, 3), rtol=1e-6, atol=0)


def test_float32_matches_float64():
    torch.manual_seed(6)
    V = torch.randn(4, 5, 20, 16, dtype=DOUBLE) * 0.3 + 2.0  # far from 0: moments must not cancel
    a = torch.rand(4, 20, dtype=DOUBLE)
    exact = em_routing(V, a, 0.1, 0.2, inverse_temperature=steep, return_assignments=True)
    single = em_routing(V.float(), a.float(), 0.1, 0.2, inverse_temperature=steep, return_assignments=True)
    for x, y in zip(single, exact, strict=True):
        torch.testing.assert_close(x.double(), y, rtol=1e-4, atol=1e-5)


def test_default_schedule():
    assert default_inverse_temperature(0) == pytest.approx(0.01 * 0.05)
    assert default_inverse_temperature(2) == pytest.approx(0.01 * (1 - 0.95**3))
    V, a, beta_u, beta_a = sample(7)
    default = em_routing(V, a, beta_u, beta_a)
    explicit = em_routing(V, a, beta_u, beta_a, inverse_temperature=[default_inverse_temperature(t)
                                                                      for t in range(3)])
    for x, y in zip(default, explicit, strict=True):
        torch.testing.assert_close(x, y)


def test_em_routing_gradcheck():
    V, a, beta_u, beta_a = sample(8, n_in=4, n_out=2, n_h=3)
    assert torch.autograd.gradcheck(
        lambda *args: em_routing(*args, inverse_temperature=steep, return_assignments=True),
        (V, a, beta_u, beta_a),
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"iterations": 0}, "iterations"),
        ({"eps": 0.0}, "eps"),
        ({"inverse_temperature": [0.1, 0.2]}, "inverse_temperature"),
        ({"inverse_temperature": -1.0}, "inverse_temperature"),
    ],
)
def test_bad_options_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        em_routing(torch.randn(2, 3, 5, 4), torch.rand(2, 5), 0.0, 0.0, **kwargs)


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match="activations"):
        em_routing(torch.randn(2, 3, 5, 4), torch.rand(2, 4), 0.0, 0.0)
    with pytest.raises(ValueError, match="votes"):
        em_routing(torch.randn(5, 3), torch.rand(5), 0.0, 0.0)
    with pytest.raises(ValueError, match="beta_u"):
        em_routing(torch.randn(2, 3, 5, 4), torch.rand(2, 5), torch.zeros(4), 0.0)


@pytest.mark.parametrize("strategy", ["auto", "blocked", "vectorized"])
def test_votes_gradient_after_a_partial_gradient_is_exact(strategy):
    """Issue 8's bug (float64, 2x5 -> 3 capsules, 3 iterations): ``autograd.grad`` for the
    activations alone with ``retain_graph``, then the votes' gradient, must equal a fresh one."""
    V, a, beta_u, beta_a = sample(9)
    poses, activations = em_routing(V, a, beta_u, beta_a, inverse_temperature=steep, strategy=strategy)
    probe_p, probe_a = torch.randn_like(poses), torch.randn_like(activations)
    loss = (poses * probe_p).sum() + (activations * probe_a).sum()
    fresh = torch.autograd.grad(loss, [V, a, beta_u], retain_graph=True)
    (partial,) = torch.autograd.grad(loss, [a], retain_graph=True)
    (votes_grad,) = torch.autograd.grad(loss, [V], retain_graph=True)
    torch.testing.assert_close(partial, fresh[1], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(votes_grad, fresh[0], rtol=1e-10, atol=1e-12)
    loss.backward()
    torch.testing.assert_close(V.grad, fresh[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(beta_u.grad, fresh[2], rtol=1e-10, atol=1e-12)


def test_the_authors_schedule_rescaled_to_end_at_a_value():
    from torchvote.functional.em import default_schedule_ending_at

    authors = [0.01 * (1 - 0.95 ** (t + 1)) for t in range(3)]  # 0.0005, 0.000975, 0.00142625
    assert default_schedule_ending_at(authors[-1], 3) == pytest.approx(authors)
    assert default_schedule_ending_at(0.003, 1) == pytest.approx([0.003])
    two = default_schedule_ending_at(0.003, 2)
    assert two[1] == pytest.approx(0.003) and two[0] / two[1] == pytest.approx(authors[0] / authors[1])
    with pytest.raises(ValueError, match="final must be a positive finite number, got 0.0"):
        default_schedule_ending_at(0.0, 2)
    with pytest.raises(ValueError, match="iterations must be a positive integer, got 0"):
        default_schedule_ending_at(0.001, 0)


@pytest.mark.parametrize("strategy", ["auto", "blocked", "vectorized", "compiled"])
def test_an_empty_batch_gives_empty_outputs(strategy):
    votes = torch.randn(0, 3, 5, 4, requires_grad=True)
    poses, activations, assignments = em_routing(votes, torch.rand(0, 5), torch.zeros(3), 0.0,
                                                 strategy=strategy, return_assignments=True)
    assert poses.shape == (0, 3, 4) and activations.shape == (0, 3) and assignments.shape == (0, 3, 5)
    poses.sum().backward()
    assert votes.grad.shape == votes.shape
    poses, _ = em_routing(torch.randn(2, 0, 3, 5, 4), torch.rand(2, 0, 5), 0.0, 0.0, strategy=strategy)
    assert poses.shape == (2, 0, 3, 4)
    groups = torch.arange(5).view(1, 5)  # sender_groups on an empty batch
    poses, _ = em_routing(torch.randn(0, 3, 5, 4), torch.rand(0, 5), 0.0, 0.0, strategy=strategy,
                          sender_groups=groups)
    assert poses.shape == (0, 3, 4)


def test_votes_without_senders_and_offsets_of_the_wrong_type_are_named():
    with pytest.raises(ValueError, match="at least one output capsule, input capsule and pose entry"):
        em_routing(torch.randn(2, 3, 0, 4), torch.rand(2, 0), 0.0, 0.0)
    with pytest.raises(ValueError, match="at least one output capsule"):
        em_routing(torch.randn(2, 0, 5, 4), torch.rand(2, 5), 0.0, 0.0)
    with pytest.raises(TypeError, match="beta_u must be a real number or a tensor, got str"):
        em_routing(torch.randn(2, 3, 5, 4), torch.rand(2, 5), "x", 0.0)
    with pytest.raises(TypeError, match="beta_a must be a real number or a tensor, got list"):
        em_routing(torch.randn(2, 3, 5, 4), torch.rand(2, 5), 0.0, [0.0, 0.0, 0.0])
    em_routing(torch.randn(2, 3, 5, 4), torch.rand(2, 5), 1, torch.zeros(3))  # an int and a tensor
    # NumPy's scalars are numbers (refused before as "got float32"); NumPy's bool is not
    votes, activations = torch.randn(2, 3, 5, 4, dtype=torch.float64), torch.rand(2, 5, dtype=torch.float64)
    for got, expected in zip(em_routing(votes, activations, np.int64(1), np.float32(0.5)),
                             em_routing(votes, activations, 1, 0.5), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    with pytest.raises(TypeError, match="beta_u must be a real number or a tensor, got bool"):
        em_routing(votes, activations, np.bool_(True), 0.0)


@pytest.mark.parametrize("strategy", ["vectorized", "blocked"])
def test_a_receiver_with_almost_no_data_gets_the_papers_pose_and_exact_gradients(strategy):
    """The weighted mean was divided by max(sum R a, eps) around a shift m that autograd takes as
    a constant: below eps of data the pose depended on m (votes 10 and 30 with activations 2e-7
    and 0 gave 18, the paper 10) and the gradient missed that dependence (0 where it is 0.5)."""
    votes = torch.tensor([10.0, 30.0], dtype=DOUBLE).view(1, 1, 2, 1)  # (n, i, j, h)
    poses, _ = em_routing(votes, torch.tensor([[2e-7, 0.0]], dtype=DOUBLE), 0.0, 0.0, iterations=1,
                          strategy=strategy)
    assert poses.item() == pytest.approx(10.0, rel=1e-9)  # sum_j R a V / sum_j R a (Procedure 1)
    generator = torch.Generator().manual_seed(0)
    votes = torch.randn(3, 2, 4, 2, generator=generator, dtype=DOUBLE, requires_grad=True)
    activations = torch.tensor([[3e-7, 0.0, 1e-9, 0.0], [0.0, 0.0, 0.0, 0.0], [0.5, 0.2, 0.9, 0.7]],
                               dtype=DOUBLE)  # tiny, none (pose 0: no data), ordinary
    for iterations in (1, 3):
        def route(votes, iterations=iterations):
            return em_routing(votes, activations, 0.1, 0.2, iterations=iterations, strategy=strategy)

        assert torch.autograd.gradcheck(route, (votes,))
    poses, _ = em_routing(votes, activations, 0.1, 0.2, iterations=3, strategy=strategy)
    assert torch.equal(poses[1], torch.zeros(2, 2, dtype=DOUBLE))  # no vote reaches them
    expected, _, _ = reference(votes.detach()[2:], activations[2:], torch.tensor([0.1, 0.1]),
                               torch.tensor([0.2, 0.2]), 3)
    torch.testing.assert_close(poses[2:].detach(), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("strategy", ["vectorized", "blocked"])
def test_a_receiver_with_subnormal_data_keeps_finite_exact_gradients(strategy):
    """Dividing by sum R a itself overflowed in backward when that sum was subnormal (g / 1e-40 =
    inf) although d mu / dV = R a / sum R a is at most 1: the weights are normalised in log space."""
    votes = torch.tensor([10.0, 30.0]).view(1, 1, 2, 1).requires_grad_(True)  # float32
    poses, _ = em_routing(votes, torch.tensor([[1e-40, 1e-40]]), 0.0, 0.0, iterations=1, strategy=strategy)
    poses.sum().backward()
    assert poses.item() == 20.0 and votes.grad.flatten().tolist() == [0.5, 0.5]
    generator = torch.Generator().manual_seed(0)
    smallest = []
    for pose_dim in range(10, 17):  # receiver 1's assignments from 1e-30 down to subnormal and 0
        votes = torch.randn(1, 2, 8, pose_dim, generator=generator)
        votes[:, 0] = 0.3  # receiver 0's votes all alike: it explains every sender far better
        votes.requires_grad_(True)
        poses, activations, assignments = em_routing(votes, torch.full((1, 8), 0.9), 0.0, 0.0, iterations=2,
                                                     strategy=strategy, return_assignments=True)
        smallest.append(float(assignments[0, 1].detach().max()))
        (poses.sum() + activations.sum()).backward()
        assert torch.isfinite(votes.grad).all(), pose_dim
    assert min(s for s in smallest if s > 0) < torch.finfo(torch.float32).tiny  # subnormal reached


@pytest.mark.parametrize("strategy", ["vectorized", "blocked"])
def test_a_nan_activation_gives_nan_outputs_and_one_of_zero_or_below_no_weight(strategy):
    """As the docstring says: NaN in, NaN out (a first log-space version weighed NaN as 0, hiding
    poisoned inputs); an activation of 0 or below gives its votes no weight."""
    generator = torch.Generator().manual_seed(5)
    votes = torch.randn(2, 3, 4, 2, generator=generator, dtype=DOUBLE)
    activations = torch.rand(2, 4, generator=generator, dtype=DOUBLE)
    poisoned = activations.clone()
    poisoned[0, 1] = float("nan")
    poses, acts = em_routing(votes, poisoned, 0.1, 0.2, strategy=strategy)
    assert torch.isnan(poses[0]).all() and torch.isnan(acts[0]).all()
    assert torch.isfinite(poses[1]).all()  # the other row is untouched
    zero, negative = activations.clone(), activations.clone()
    zero[0, 1], negative[0, 1] = 0.0, -0.5
    for result, expected in zip(em_routing(votes, negative, 0.1, 0.2, strategy=strategy),
                                em_routing(votes, zero, 0.1, 0.2, strategy=strategy), strict=True):
        torch.testing.assert_close(result, expected, rtol=0, atol=0)
