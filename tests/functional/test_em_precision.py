"""Float32 precision of ``em_routing`` when inactive senders vote far from the active ones.

The kernel sums statistics of votes centred on a shift per receiver and uses the expanded forms
``E_w[c^2] - E_w[c]^2`` (M-step) and ``k + c . (mu / s2) + c^2 . (-1 / (2 s2))`` (E-step). Their
terms are about ``|mu - shift|^2 / s2`` and cancel, so a shift far from the weighted mean ``mu``
costs about ``eps * |mu - shift|^2 / s2`` in the logits. Centred on the plain mean of the votes,
inactive senders (activation 0: no weight, mathematically absent) far away at distance ``D`` moved
the shift by about ``D`` and, for ``D = 10`` and a cluster of spread ``1e-3``, flipped the
assignments in float32 (``R`` 0 or 1 where it is exactly 1/2). Centred on the first M-step's own
weighted mean, they cost nothing.

The references are float64 runs of the same call on the same float32-rounded inputs (the float64
results match Procedure 1 to 1e-10: ``test_em_kernel.py``, ``test_em_routing.py``), so the
differences measured here are the float32 kernel's rounding alone.

``"compiled"`` (about 10 s to compile a shape on a CPU) runs one symmetric case; the other tests
leave it out: it runs the vectorized loop (``_DenseStatistics(fused=True)``), with the same shift.
"""

from __future__ import annotations

import pytest
import torch

from torchvote.functional.em import em_routing
from torchvote.functional.em_kernel import conv_sender_groups

STRATEGIES = ["blocked", "vectorized"]
EPS32 = torch.finfo(torch.float32).eps  # 1.19e-7


def clustered_votes(seed, rows, receivers, senders, active, pose_dim, centre, spread, far):
    """Float64 votes ``(n, i, j, h)``: the first ``active`` senders of every receiver in a cluster
    of ``spread`` around a point at scale ``centre``; the others scattered at scale ``far``.
    Activations ``(n, j)``: 1 for the cluster, exactly 0 for the scattered votes."""
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    votes = far * normal(rows, receivers, senders, pose_dim)
    votes[:, :, :active] = (centre * normal(rows, receivers, 1, pose_dim)
                            + spread * normal(rows, receivers, active, pose_dim))
    activations = torch.zeros(rows, senders, dtype=torch.float64)
    activations[:, :active] = 1.0
    return votes, activations


def symmetric_votes(seed, far, spread):
    """Receiver 1's votes are receiver 0's with the pose entries permuted: every statistic and
    every likelihood is the same for both, so each sender's two logits are equal."""
    pose_dim = 16
    votes, activations = clustered_votes(seed, rows=4, receivers=1, senders=8, active=4, pose_dim=pose_dim,
                                         centre=far, spread=spread, far=far)
    permutation = torch.randperm(pose_dim, generator=torch.Generator().manual_seed(seed + 1))
    votes = torch.cat([votes, votes[..., permutation]], dim=1)  # (4, 2, 8, 16)
    return votes.float(), activations.float()


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(("far", "spread"), [(1.0, 1e-3), (10.0, 1e-2), (10.0, 1e-3), (1e3, 1e-1)])
def test_symmetric_receivers_get_equal_assignments_despite_far_inactive_votes(strategy, far, spread):
    votes, activations = symmetric_votes(0, far, spread)
    _, _, assignments = em_routing(votes, activations, 0.5, 1.0, iterations=2, strategy=strategy,
                                   return_assignments=True)
    active = assignments[:, :, :4].double()
    # The two logits of a sender are the same sums in another order. Each logit is about
    # 1e2 (the constant -0.5 sum_h log(2 pi s2), s2 ~ spread^2, plus 16 terms (c - mu)^2 / s2
    # of order 1), formed from 2h = 32 products each rounded to EPS32: they differ by at most
    # about 32 * 1e2 * EPS32 = 4e-4, and R = sigmoid(difference) moves by a quarter of that.
    # The plain-mean centring missed by 0.18 (far=1, spread=1e-3) and 0.49 to 0.5 (far >= 10).
    tolerance = 32 * 1e2 * EPS32 / 4
    torch.testing.assert_close(active, torch.full_like(active, 0.5), rtol=0.0, atol=tolerance)


def test_symmetric_receivers_get_equal_assignments_compiled(compiler):
    """The compiled loop (one shape, compiled once per process), as above."""
    votes, activations = symmetric_votes(0, far=10.0, spread=1e-3)
    _, _, assignments = em_routing(votes, activations, 0.5, 1.0, iterations=2, strategy="compiled",
                                   return_assignments=True)
    active = assignments[:, :, :4].double()
    torch.testing.assert_close(active, torch.full_like(active, 0.5), rtol=0.0, atol=32 * 1e2 * EPS32 / 4)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_symmetric_receivers_with_sender_groups(strategy):
    """The joint normalisation: the first pass's weights are ``R_init a`` with the initial ``R``
    differing between senders (1 / |parents|); the two receivers of a patch still tie."""
    ids = conv_sender_groups(3, 3, 2, 2, 1)  # (L = 4, j = 8): 2x2 kernel on a 3x3 grid, 2 types
    votes, activations = symmetric_votes(1, far=10.0, spread=1e-3)  # (4, 2, 8, 16): rows = L
    _, _, assignments = em_routing(votes, activations, 0.5, 1.0, iterations=2, strategy=strategy,
                                   sender_groups=ids, return_assignments=True)
    first, second = assignments[:, 0, :4].double(), assignments[:, 1, :4].double()
    # R is the tied share of its sender's parents, up to the logits' rounding (as above), as a
    # relative error: exp(difference) - 1 for a difference of at most 4e-4
    torch.testing.assert_close(first, second, rtol=32 * 1e2 * EPS32, atol=0.0)


def far_outlier_case(seed, far):
    """6 rows of 3 receivers: 6 senders with activations in [0.5, 1) in a cluster of spread 0.1
    (relative 1e-4) around a point at 1e3, and 6 inactive senders (activation 0) scattered at
    ``far``."""
    votes, activations = clustered_votes(seed, rows=6, receivers=3, senders=12, active=6, pose_dim=4,
                                         centre=1e3, spread=0.1, far=far)
    activations[:, :6] = torch.rand(6, 6, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    activations[:, :6] = 0.5 + 0.5 * activations[:, :6]
    return votes.float(), activations.float()


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("iterations", [1, 3])
@pytest.mark.parametrize("far", [1e3, 1e6])
def test_float32_matches_float64_with_far_inactive_votes(strategy, iterations, far):
    votes, activations = far_outlier_case(0, far)
    beta_u, beta_a = torch.tensor([0.1, -0.2, 0.3]), torch.tensor([0.5, 1.0, -0.5])
    results = [em_routing(votes.to(dtype), activations.to(dtype), beta_u.to(dtype), beta_a.to(dtype),
                          iterations=iterations, strategy=strategy, return_assignments=True)
               for dtype in (torch.float32, torch.float64)]
    (poses, out_activations, assignments), (poses64, out_activations64, assignments64) = results
    # Centred on the first pass's weighted mean, every centred active vote is exact (V and the
    # shift agree to within a factor 2) and the statistics are sums of rounded products of order
    # 1: a logit of order 10 formed from 2h = 8 products carries about 8 * 10 * EPS32, which
    # moves R (and a) by a quarter of that per pass; 64 EPS32 (7.6e-6) covers three passes
    # (measured: 2.7e-7). The plain mean (about far/2 from the cluster: eps |m - mu|^2 / s2 of
    # about 3 in the logits at far = 1e3, 1e5 at far = 1e6) left R off by up to 1 and a by 5e-3.
    logit_error = 64 * EPS32
    torch.testing.assert_close(assignments.double(), assignments64, rtol=0.0, atol=logit_error)
    torch.testing.assert_close(out_activations.double(), out_activations64, rtol=0.0, atol=logit_error)
    # poses: the cluster's mean at 1e3, carried with float32's relative precision (a few EPS32)
    torch.testing.assert_close(poses.double(), poses64, rtol=8 * EPS32, atol=0.0)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_float32_gradients_match_float64_with_far_inactive_votes(strategy):
    """The blocked backward recomputes each block with the forward's shift and forms
    ``d/dV = sum P Q1 + 2 c sum P Q2`` from the centred votes ``c``; formed as
    ``sum P (Q1 - 2 m Q2) + 2 V sum P Q2`` its two terms were ``|m| / |c|`` (1e4 here) times the
    result, a 1e-2 relative error."""
    votes, activations = far_outlier_case(0, 1e3)
    beta_u, beta_a = torch.tensor([0.1, -0.2, 0.3]), torch.tensor([0.5, 1.0, -0.5])
    gradients = []
    for dtype in (torch.float32, torch.float64):
        inputs = [x.detach().to(dtype).requires_grad_() for x in (votes, activations)]
        poses, out_activations = em_routing(*inputs, beta_u.to(dtype), beta_a.to(dtype), iterations=3,
                                            strategy=strategy)
        weights = torch.linspace(-1.0, 1.0, poses.numel(), dtype=dtype).view_as(poses)
        loss = ((poses - poses.detach().mean()) * weights).sum() + out_activations.sum()
        gradients.append(torch.autograd.grad(loss, inputs))
    for low, high in zip(*gradients, strict=True):
        # products of quantities of order 1 (the centred votes over their spread, the
        # assignments), each rounded to EPS32, summed over a dozen senders and three passes: a
        # few tens of EPS32 of the gradient's scale (measured: 4 EPS32). With the plain-mean
        # shift the errors were 1e17 (both strategies); with the old blocked form above, 1e-2.
        torch.testing.assert_close(low.double(), high, rtol=0.0, atol=64 * EPS32 * high.abs().max().item())


# The remaining defect: an ACTIVE outlier. Its vote counts in the first M-step's weighted mean, so
# the shift lies about D / |senders| from the receiver's cluster; once the outlier's R falls, the
# later M-steps' mean moves to the cluster, and their expanded forms cancel terms of about
# |mu - shift|^2 / s2 (1e4 at D = 1 and spread 1e-3, 1e6 at D = 10): float32 loses about
# eps * D^2 / s2. Centring each M-step on its own weighted mean (formed again from the votes)
# removes it, but the prototype cost +16-20% time in "blocked" (each block's [c, c^2] formed again
# from its votes, and one more product, per later iteration) and +40% time, +58% peak memory in
# "vectorized" (two more saved (n, i, j, h) tensors per iteration) at the paper's ConvCaps1 shape:
# over budget, not merged. Strict: a fix makes these XPASS, which fails until the mark is removed.
ACTIVE_OUTLIER = pytest.mark.xfail(  # raises: a TypeError (a changed signature) is no expected failure
    strict=True, raises=AssertionError,
    reason="EM statistics stay centred on the first pass's weighted mean: an active outlier "
    "whose assignment falls costs float32 about eps * D^2 / s2 in the later passes")


def active_outlier_case(far, spread, rows=4, receivers=3, senders=8, pose_dim=16):
    """Receiver ``i``'s votes: a cluster of ``spread`` around a point at scale 1, but sender ``i``'s
    vote ``far`` away from it (each sender is the outlier of at most one receiver, so its ``R``
    there falls to about 0 after the first E-step). Activations in ``[0.5, 1)``: every sender is
    active. Float32-rounded, returned in float64."""
    generator = torch.Generator().manual_seed(0)

    def normal(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    votes = normal(rows, receivers, 1, pose_dim) + spread * normal(rows, receivers, senders, pose_dim)
    for receiver in range(receivers):
        direction = normal(rows, pose_dim)
        votes[:, receiver, receiver] += far * direction / direction.norm(dim=-1, keepdim=True)
    activations = 0.5 + 0.5 * torch.rand(rows, senders, generator=generator, dtype=torch.float64)
    beta_u = torch.linspace(-0.3, 0.3, receivers, dtype=torch.float64)
    beta_a = torch.linspace(0.5, -0.5, receivers, dtype=torch.float64)
    return [x.float().double() for x in (votes, activations, beta_u, beta_a)]


def routed_with_gradients(inputs, dtype, strategy):
    """Poses, activations, every pass's ``R`` and the gradients of a loss of the outputs with
    respect to the votes, the activations, ``beta_u`` and ``beta_a``."""
    leaves = [x.to(dtype).requires_grad_() for x in inputs]
    poses, activations, assignments = em_routing(*leaves, iterations=3, strategy=strategy,
                                                 return_assignments=True, all_passes=True)
    weights = torch.linspace(-1.0, 1.0, poses.numel(), dtype=dtype).view_as(poses)
    loss = ((poses - poses.detach().mean()) * weights).sum() + (activations * activations.detach()).sum()
    return [poses.detach(), activations.detach(), assignments.detach(), *torch.autograd.grad(loss, leaves)]


@ACTIVE_OUTLIER
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("far", [1.0, 10.0])
def test_float32_matches_float64_with_an_active_outlier(strategy, far):
    inputs = active_outlier_case(far, spread=1e-3)
    low = routed_with_gradients(inputs, torch.float32, strategy)
    high = routed_with_gradients(inputs, torch.float64, strategy)
    # A logit is about 1e2 (-0.5 sum_h log(2 pi s2) with s2 ~ 1e-6, plus 16 terms of order 1),
    # formed from 2h = 32 products each rounded to EPS32: 32 * 1e2 * EPS32, which moves R and a by
    # a quarter of that (9.5e-5). The gradients carry the same relative error (measured with each
    # M-step centred on its own mean: 25-60 EPS32 everywhere; as centred now, 5e3 EPS32 in R and
    # the votes' gradient at far = 1, 6e5 at far = 10).
    tolerance = 32 * 1e2 * EPS32 / 4
    (poses, activations, assignments), gradients = low[:3], low[3:]
    # poses: the cluster's mean at scale 1, carried with float32's relative precision (a few EPS32)
    torch.testing.assert_close(poses.double(), high[0], rtol=0.0, atol=8 * EPS32 * high[0].abs().max().item())
    torch.testing.assert_close(activations.double(), high[1], rtol=0.0, atol=tolerance)
    torch.testing.assert_close(assignments.double(), high[2], rtol=0.0, atol=tolerance)
    for gradient, reference in zip(gradients, high[3:], strict=True):
        torch.testing.assert_close(gradient.double(), reference, rtol=0.0,
                                   atol=tolerance * reference.abs().max().item())
