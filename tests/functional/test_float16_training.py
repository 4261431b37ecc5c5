"""Float16 autocast (``fp16=true``: ``torch.autocast`` with a gradient scaler) at the values a
training run can reach.

Under ``torch.autocast(dtype=torch.float16)`` every einsum runs in float16 whatever its inputs'
dtype, so a reduction that is safe for a float16 *model* (upcast inputs) still overflowed past
65504 under autocast. Each test runs the float32 code under float16 autocast at values where the
old code gave inf or NaN, against an independent reference: the same product in float64, or the
same float32 layer with autocast off. They take the ``device`` fixture: ``fp16=true`` is meant for
GPUs, where the materialised votes (``strategy="auto"``) take the float16 tensor-core products.
"""

from __future__ import annotations

import pytest
import torch

from torchvote.functional.voting import PairwiseVotes, SharedVotes
from torchvote.nn.capsules import CapsuleLinear

HALF_EPS = torch.finfo(torch.float16).eps


@pytest.mark.parametrize("kind", ["pairwise", "shared"])
@pytest.mark.parametrize("autocast", [True, False])
def test_the_dot_of_long_votes_is_the_float64_dot(kind, autocast, device):
    """Votes with entries near 100 (float16 numbers) against outputs alike: at 16 dimensions their
    dot products, about 16 * 100^2 = 1.6e5, pass 65504, and the float16 einsum gave inf. The dot
    is now formed in float32 (the ``Votes.dot`` contract), equal to the float64 product of the same
    numbers up to float32 rounding."""
    generator = torch.Generator().manual_seed(3)
    shape = (2, 4, 6, 16) if kind == "pairwise" else (2, 6, 16)
    votes = (100 + torch.rand(shape, generator=generator)).half().to(device)  # (b, i, j, d) or (b, j, d)
    outputs = (100 + torch.rand(2, 4, 16, generator=generator)).half().to(device)  # (b, i, d)
    if autocast:  # a float32 model under autocast: its tensors are float32 until a product
        votes, outputs = votes.float(), outputs.float()
    wrapped = PairwiseVotes(votes) if kind == "pairwise" else SharedVotes(votes)
    pattern = "bijd,bid->bij" if kind == "pairwise" else "bjd,bid->bij"
    expected = torch.einsum(pattern, votes.double(), outputs.double())  # (b, i, j)
    assert expected.min() > torch.finfo(torch.float16).max
    with torch.autocast(device.type, dtype=torch.float16, enabled=autocast):
        dot = wrapped.dot(outputs)
    assert dot.dtype == torch.float32
    torch.testing.assert_close(dot.double(), expected, rtol=16 * torch.finfo(torch.float32).eps, atol=0.0)


@pytest.mark.parametrize("kind", ["pairwise", "shared"])
@pytest.mark.parametrize("autocast", [True, False])
def test_the_dot_stays_bfloat16_where_it_cannot_overflow(kind, autocast, device):
    """bfloat16 has float32's range: its dot is not copied to float32 (the copies, twice the votes'
    bytes, would be kept for backward on the GPU's bf16 path), and equals the bfloat16 einsum."""
    generator = torch.Generator().manual_seed(4)
    shape = (2, 4, 6, 16) if kind == "pairwise" else (2, 6, 16)
    votes = (100 + torch.rand(shape, generator=generator)).bfloat16().to(device)
    outputs = (100 + torch.rand(2, 4, 16, generator=generator)).bfloat16().to(device)
    if autocast:
        votes, outputs = votes.float(), outputs.float()
    wrapped = PairwiseVotes(votes) if kind == "pairwise" else SharedVotes(votes)
    pattern = "bijd,bid->bij" if kind == "pairwise" else "bjd,bid->bij"
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        dot = wrapped.dot(outputs)
        expected = torch.einsum(pattern, votes, outputs)  # (b, i, j), bfloat16 either way
    assert dot.dtype == expected.dtype == torch.bfloat16
    assert torch.isfinite(dot).all()
    torch.testing.assert_close(dot, expected, rtol=0.0, atol=0.0)


def _float16_numbers(layer: CapsuleLinear) -> CapsuleLinear:
    """The layer with float16-representable weights: autocast then rounds only the products."""
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.copy_(parameter.half().float())
    return layer


@pytest.mark.parametrize("shared_weights", [False, True])
@pytest.mark.parametrize("strategy", ["stream", "materialize"])
def test_the_distance_agreement_of_a_float32_layer_under_float16_autocast(strategy, shared_weights, device):
    """Long votes (entries past 1000, squared lengths past 65504) through a float32 layer with
    ``agreement="distance"`` under float16 autocast, as ``fp16=true`` trains: the streamed squared
    lengths (``LinearVotes`` / ``SharedLinearVotes.squared_norm``: their inputs were upcast, but
    autocast ran the einsums in float16 again) were inf, every logit NaN. Outputs and gradients
    against the same layer with autocast off, to the rounding of the float16 products (two float16
    epsilons, relative to the largest entry); formed votes (``materialize``) are checked alike."""
    with torch.random.fork_rng():
        torch.manual_seed(1)
        layer = CapsuleLinear(
            30,
            8,
            4,
            16,
            shared_weights=shared_weights,
            strategy=strategy,
            router_options={"agreement": "distance"},
            init_std=16.0,
        )
    _float16_numbers(layer).to(device)
    generator = torch.Generator().manual_seed(12)
    inputs = (torch.randn(2, 30, 8, generator=generator) * 8).half().float().to(device)  # (b, j, e)
    votes = torch.einsum(
        "ide,bje->bijd" if shared_weights else "ijde,bje->bijd", layer.weight.detach(), inputs
    )
    assert votes.pow(2).sum(-1).min() > torch.finfo(torch.float16).max  # every squared length
    direction = torch.linspace(-1, 1, 64, device=device).reshape(4, 16)  # a loss reading every entry

    def run(autocast: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = inputs.clone().requires_grad_()
        layer.zero_grad()
        with torch.autocast(device.type, dtype=torch.float16, enabled=autocast):
            outputs = layer(x)  # (b, i, d)
        (outputs.float() * direction).sum().backward()
        return outputs.detach().float(), layer.weight.grad.clone(), x.grad

    reference = run(False)
    got = run(True)
    for value, expected in zip(got, reference, strict=True):
        assert torch.isfinite(value).all()
        atol = 2 * HALF_EPS * float(expected.abs().max())
        torch.testing.assert_close(value, expected, rtol=0.0, atol=atol)
