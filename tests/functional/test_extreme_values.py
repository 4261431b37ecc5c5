"""Values at the extremes a training run can reach: huge and tiny vectors, zeros, identical votes.

"Never a NaN" for valid input (a finite float tensor of the right shape and dtype) is checked
value by value: forward finite where the true answer is, gradients finite, and both equal to an
independent reference. The references are limits and symmetries that hold whatever the scale
(``squash(s) = s / ||s||`` to float precision once ``||s||`` is large, and ``s / ||s||`` is the
same for ``s`` and ``s * 2^-k``), Procedure 1 as a plain float64 loop (float64 holds the squares
and cubes of float32's largest vectors), and hand-computed cases.
"""

from __future__ import annotations

import math

import pytest
import torch

from torchvote.functional import dynamic_routing, efficient_squash, squash, uniform_routing
from torchvote.functional.em import em_routing
from torchvote.losses import reconstruction_loss
from torchvote.nn.capsules import CapsuleLinear

DOUBLE = torch.float64
# Norms past the overflows the squashes no longer have, up to where their limits begin (their
# docstrings): float32's squash formed ||s||^3, which overflowed past 7e12 (the output was zero);
# ||s||^2 itself overflows past 1.8e19 in float32 (bfloat16's squared length is float32's) and
# 1.3e154 in float64.
HUGE = [
    (torch.float32, 1e13),
    (torch.float32, 1e16),
    (torch.float32, 1e18),
    (torch.float64, 1e110),
    (torch.float64, 1e150),
    (torch.bfloat16, 1e13),
    (torch.bfloat16, 1e18),
]
# Norms up to where the gradient is still whole (||s||^-3 normal): about 3e12 in float32 and 1e102
# in float64, past the old formula's (it was 10x off at 1e12 in float32).
LONG_FOR_GRADIENTS = [
    (torch.float32, 1e6),
    (torch.float32, 1e11),
    (torch.float32, 5e11),
    (torch.float64, 1e50),
    (torch.float64, 1e100),
]


def _directions(*shape: int, seed: int = 0) -> torch.Tensor:
    """Float64 vectors of ordinary size (entries about 1), no zero vector."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator, dtype=DOUBLE) + 0.1


def _unit(vectors: torch.Tensor) -> torch.Tensor:
    """``s / ||s||`` of ordinary float64 vectors (the reference of every huge case)."""
    return vectors / vectors.norm(dim=-1, keepdim=True)


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    """One rounding to ``dtype`` of values of size about 1, and a few more for the sums."""
    return {"rtol": 0.0, "atol": 8 * torch.finfo(dtype).eps}


@pytest.mark.parametrize("function", [squash, efficient_squash])
@pytest.mark.parametrize(("dtype", "size"), HUGE)
def test_long_vectors_squash_to_their_direction(function, dtype, size):
    directions = _directions(6, 8)
    # exactly size * (a power of two) * directions rounded: the reference is that rounded direction
    inputs = (directions * size).to(dtype)
    outputs = function(inputs)
    assert outputs.dtype == dtype
    torch.testing.assert_close(outputs.double(), _unit(inputs.double() / size), **_tolerance(dtype))


@pytest.mark.parametrize("function", [squash, efficient_squash])
@pytest.mark.parametrize(("dtype", "size"), LONG_FOR_GRADIENTS)
def test_long_vectors_have_the_gradient_of_their_direction(function, dtype, size):
    """``d(s / ||s||)/ds = (I - u u^T) / ||s||``: the gradient of the direction at ``s / k`` over ``k``
    (the squash's own length factor differs from 1 by ``1 / ||s||`` at most, far below precision)."""
    directions = _directions(6, 8, seed=1)
    inputs = (directions * size).to(dtype).requires_grad_(True)
    upstream = _directions(6, 8, seed=2)
    (gradient,) = torch.autograd.grad(function(inputs), inputs, upstream.to(dtype))
    ordinary = (inputs.detach().double() / size).requires_grad_(True)
    (reference,) = torch.autograd.grad(_unit(ordinary), ordinary, upstream)
    assert torch.isfinite(gradient).all()
    # compared at the scale of the ordinary vectors: gradient * k against the direction's gradient
    torch.testing.assert_close(gradient.double() * size, reference, **_tolerance(dtype))


@pytest.mark.parametrize("function", [squash, efficient_squash])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("size", [0.0, 1e-45, 1e-20])
def test_zero_and_tiny_vectors_give_finite_outputs_and_gradients(function, dtype, size):
    """Zero, subnormal and tiny inputs: the documented formula in float64 (eps under the root)."""
    inputs = (_directions(4, 8, seed=5) * size).to(dtype).requires_grad_(True)
    outputs = function(inputs)
    (gradient,) = torch.autograd.grad(outputs.sum(), inputs)
    assert torch.isfinite(gradient).all()
    exact = inputs.detach().double()
    if function is squash:
        squared = exact.pow(2).sum(-1, keepdim=True)
        expected = exact * squared / ((1 + squared) * torch.sqrt(squared + 1e-20))
    else:
        norm = torch.sqrt(exact.pow(2).sum(-1, keepdim=True) + 1e-12)
        expected = exact * -torch.expm1(-norm) / norm
    # a few roundings to dtype, and underflow to zero below its smallest normal number
    torch.testing.assert_close(
        outputs.double(), expected, rtol=4 * torch.finfo(dtype).eps, atol=torch.finfo(dtype).tiny
    )


def _procedure1(votes: torch.Tensor, iterations: int) -> torch.Tensor:
    """Sabour et al. 2017, Procedure 1, a float64 loop over the examples: votes ``(b, i, j, d)``
    (receivers first) -> outputs ``(b, i, d)``. The softmax over the outputs subtracts its maximum
    (the logits of huge votes are huge); the squash is eq. 1 with ``||s||`` cancelled, so that an
    output no input votes for (its couplings saturate to 0) is the zero vector, eq. 1's limit."""
    outputs = []
    for example in votes.double():  # (i, j, d)
        logits = torch.zeros(example.shape[:2], dtype=DOUBLE)  # b_ij
        for t in range(iterations):
            exp = torch.exp(logits - logits.max(dim=0, keepdim=True).values)
            couplings = exp / exp.sum(dim=0, keepdim=True)  # over the outputs i
            sums = (couplings.unsqueeze(-1) * example).sum(dim=1)  # (i, d)
            length = sums.norm(dim=-1, keepdim=True)
            poses = sums * length / (1 + length**2)  # eq. 1, ||s||^2 / (1 + ||s||^2) s / ||s||
            if t < iterations - 1:
                logits = logits + (example * poses.unsqueeze(1)).sum(-1)
        outputs.append(poses)
    return torch.stack(outputs)


@pytest.mark.parametrize("iterations", [1, 3, 20])
@pytest.mark.parametrize("size", [1e11, 5e11])
def test_dynamic_routing_of_huge_float32_votes_matches_procedure1(iterations, size):
    votes = (_directions(2, 3, 5, 4, seed=6) * size).float().requires_grad_(True)
    outputs, couplings = dynamic_routing(votes, iterations=iterations)
    (gradient,) = torch.autograd.grad(outputs.sum(), votes)
    torch.testing.assert_close(
        outputs.double(), _procedure1(votes.detach(), iterations), **_tolerance(torch.float32)
    )
    assert torch.isfinite(couplings).all() and torch.isfinite(gradient).all()


@pytest.mark.parametrize("size", [1e13, 1e18])
def test_uniform_routing_of_huge_votes_is_the_direction_of_the_mean_vote(size):
    votes = (_directions(2, 3, 5, 4, seed=7) * size).float()
    outputs, _ = uniform_routing(votes)
    torch.testing.assert_close(
        outputs.double(), _unit(votes.double().mean(dim=2) / size), **_tolerance(torch.float32)
    )


@pytest.mark.parametrize("strategy", ["stream", "materialize"])
@pytest.mark.parametrize("iterations", [1, 3])
def test_capsule_layer_with_huge_inputs_matches_procedure1(strategy, iterations):
    """Both vote paths of ``CapsuleLinear``: the dynamic-routing kernel on ``LinearVotes`` (stream)
    and the voting loop on formed votes (materialize)."""
    with torch.random.fork_rng():  # the layer's initial weights, without moving the global generator
        torch.manual_seed(0)
        layer = CapsuleLinear(6, 4, 3, 5, iterations=iterations, strategy=strategy)
    inputs = (_directions(2, 6, 4, seed=8) * 1e11).float().requires_grad_(True)
    outputs = layer(inputs)
    (gradient,) = torch.autograd.grad(outputs.sum(), inputs)
    votes = torch.einsum(
        "jide,bje->bijd", layer.weight.detach().double().transpose(0, 1), inputs.detach().double()
    )  # (b, i, j, d): u_hat_ij = W_ij u_j
    torch.testing.assert_close(outputs.double(), _procedure1(votes, iterations), **_tolerance(torch.float32))
    assert torch.isfinite(gradient).all()


@pytest.mark.parametrize("strategy", ["blocked", "vectorized"])
def test_em_routing_of_identical_votes_at_saturated_temperature_and_many_iterations(strategy):
    """Identical votes: ``mu`` is that vote and the variance is ``eps`` alone (``log sigma`` finite),
    for 20 iterations at an inverse temperature of 1e4, with every activation 1."""
    vote = _directions(2, 3, 1, 16, seed=9).float()  # (b, i, 1, h)
    votes = vote.expand(2, 3, 7, 16).contiguous().requires_grad_(True)
    poses, activations = em_routing(
        votes, torch.ones(2, 7), 0.0, 0.0, iterations=20, inverse_temperature=1e4, strategy=strategy
    )
    (gradient,) = torch.autograd.grad(poses.sum() + activations.sum(), votes)
    torch.testing.assert_close(poses, vote.squeeze(2))
    # cost = (beta_u + log sigma) sum R per pose entry, sigma^2 = eps: a_i = sigmoid(-lambda cost)
    total = torch.full((2, 3), 7 / 3, dtype=DOUBLE)  # sum_j R_ij a_j with R = 1/3 from identical votes
    expected = torch.sigmoid(-1e4 * 16 * 0.5 * math.log(1e-6) * total)
    torch.testing.assert_close(activations.double(), expected)
    assert torch.isfinite(gradient).all()


@pytest.mark.parametrize("strategy", ["blocked", "vectorized"])
def test_em_routing_with_every_activation_zero(strategy):
    """No input votes (``sum_j R_ij a_j = 0``): the cost is 0, so ``a_i = sigmoid(lambda beta_a)``
    exactly, and nothing is NaN, gradients included."""
    votes = (_directions(2, 3, 5, 4, seed=10) * 1e4).float().requires_grad_(True)
    poses, activations = em_routing(
        votes, torch.zeros(2, 5), 0.5, 2.0, iterations=20, inverse_temperature=1e4, strategy=strategy
    )
    (gradient,) = torch.autograd.grad(poses.sum() + activations.sum(), votes)
    assert torch.isfinite(poses).all() and torch.isfinite(gradient).all()
    torch.testing.assert_close(activations, torch.full((2, 3), torch.sigmoid(torch.tensor(2e4)).item()))


def test_float16_reconstruction_loss_beyond_float16_per_image_sums():
    """A float16 image whose squared error sums past 65504 (784 pixels off by 10: 78400) while the
    loss itself, 0.0005 * 78400 = 39.2, is a float16 number: it was inf."""
    reconstructions = torch.full((2, 784), 10.0, dtype=torch.float16, requires_grad=True)
    images = torch.zeros(2, 1, 28, 28)
    loss = reconstruction_loss(reconstructions, images)
    (gradient,) = torch.autograd.grad(loss, reconstructions)
    expected = (
        0.0005 * (reconstructions.detach().double() - images.flatten(1).double()).square().sum(1).mean()
    )
    assert loss.dtype == torch.float16
    torch.testing.assert_close(loss.double(), expected, rtol=torch.finfo(torch.float16).eps, atol=0.0)
    # d/dr of 0.0005 * mean_b sum (r - x)^2 = 0.0005 * 2 (r - x) / b
    torch.testing.assert_close(gradient, torch.full_like(gradient, 0.0005 * 2 * 10 / 2))


def test_float16_self_attention_routing_of_many_senders_is_finite():
    """Efficient-CapsNet's routing behind CapsNet's 1152 primary capsules, in float16: the column
    sums ``sum_k u_ik`` and their dot products with the votes passed 65504 (NaN outputs). Outputs
    against the float32 routing of the same (float16-representable) votes; the couplings, a
    softmax of logits near 1e5, are saturated and only checked finite and normalised."""
    from torchvote.functional import self_attention_routing

    generator = torch.Generator().manual_seed(11)
    votes = ((torch.randn(2, 10, 1152, 16, generator=generator) + 1) * 2).half()
    outputs, couplings = self_attention_routing(votes)
    expected, _ = self_attention_routing(votes.float())
    assert outputs.dtype == torch.float16 and torch.isfinite(couplings).all()
    torch.testing.assert_close(couplings.float().sum(dim=-2), torch.ones(2, 1152), rtol=0.0, atol=4e-3)
    torch.testing.assert_close(outputs.float(), expected, rtol=0.0, atol=4 * torch.finfo(torch.float16).eps)


@pytest.mark.parametrize("shared_weights", [False, True])
@pytest.mark.parametrize("strategy", ["stream", "materialize"])
def test_float16_distance_agreement_of_long_votes_is_the_float32_routing(strategy, shared_weights):
    """``agreement="distance"`` forms ``2 u.v - ||u||^2 - ||v||^2``: in float16 the squared lengths
    passed 65504 once vote entries passed 64 (d = 16), and every logit became -inf or NaN. The
    float16 layer against the same layer in float32 (weights and inputs float16-representable),
    both strategies: streamed votes (``LinearVotes`` / ``SharedLinearVotes``) and formed ones."""
    with torch.random.fork_rng():
        torch.manual_seed(1)
        layer = CapsuleLinear(30, 8, 4, 16, iterations=3, shared_weights=shared_weights, strategy=strategy,
                              router_options={"agreement": "distance"}, init_std=16.0).half()
    inputs = (_directions(2, 30, 8, seed=12) * 8).half()
    reference = CapsuleLinear(30, 8, 4, 16, iterations=3, shared_weights=shared_weights, strategy=strategy,
                              router_options={"agreement": "distance"})
    reference.load_state_dict({k: v.float() for k, v in layer.state_dict().items()})
    pattern = "ide,bje->bijd" if shared_weights else "ijde,bje->bijd"
    votes = torch.einsum(pattern, reference.weight.detach(), inputs.float())  # (b, i, j, d)
    # every vote's squared length past float16's range: every logit was -inf, the couplings NaN
    assert votes.pow(2).sum(-1).min() > torch.finfo(torch.float16).max
    outputs = layer(inputs)
    assert outputs.dtype == torch.float16 and torch.isfinite(outputs).all()
    torch.testing.assert_close(
        outputs.float(), reference(inputs.float()), rtol=0.0, atol=8 * torch.finfo(torch.float16).eps
    )


@pytest.mark.parametrize(("length", "rtol"), [(1e-6, 1e-8), (1e-4, 1e-12), (1e-3, 1e-12), (1.0, 1e-12)])
def test_squash_of_short_vectors_is_eq1(length, rtol):
    """With 1e-8 under the root a vector of length 1e-4 came out 29% short of Sabour et al.'s
    eq. 1 (1e-3: 0.5%); freshly initialised layers route vectors that short."""
    s = _directions(4, 8, seed=2).double() * length  # (4, 8), each of length `length`
    norm = s.norm(dim=-1, keepdim=True)
    expected = norm**2 / (1 + norm**2) * s / norm  # eq. 1
    torch.testing.assert_close(squash(s), expected, rtol=rtol, atol=0)  # eps / (2 length^2) at most


@pytest.mark.parametrize("function", [squash, efficient_squash], ids=["squash", "efficient_squash"])
@pytest.mark.parametrize("length", [1e3, 5e4])
def test_float16_squash_rounds_once(function, length):
    """The float16 output was the input times a float16 factor near 1 / ||s||, itself rounded and
    subnormal past ||s|| = 2^14 (relative error 5.7e-3 at 2e5). Multiplied in float32 and rounded
    once, every entry is within float16's half-ulp (2^-11) of float64's on the same inputs."""
    generator = torch.Generator().manual_seed(0)
    s = torch.randn(64, 16, generator=generator, dtype=DOUBLE)
    s = (s / torch.linalg.vector_norm(s, dim=-1, keepdim=True) * length).half()
    out = function(s, dim=-1).double()
    expected = function(s.double(), dim=-1)
    large = expected.abs() > 1e-2  # entries that are not float16 subnormals themselves
    relative = ((out - expected).abs() / expected.abs())[large]
    assert float(relative.max()) <= 2.0**-11, float(relative.max())
