"""What the docstrings promise about precision, checked: statistics in float32 for half inputs,
under ``torch.autocast`` too, and outputs in the inputs' dtype.

The references are the same functions run in float32 (or float64) on the inputs rounded to the
half dtype: what is compared is then only the rounding the half run adds. bfloat16 keeps 8
significant bits (``eps = 2**-7``), float16 11 (``eps = 2**-10``); a result computed in float32 and
rounded once to the half dtype is within ``eps / 2`` of the float32 result, relative to its
magnitude. Where a docstring says "computed in float32", that single rounding is the tolerance:
a half-precision intermediate would miss it by far (each of the cases below is built so that it
would: logits of order 300 in bfloat16 are rounded by whole units, float16 overflows past 65504).
"""

from __future__ import annotations

import pytest
import torch

from torchvote.functional import (
    DotProductScores,
    SharedVotes,
    dynamic_routing,
    masked_softmax,
    softmax_attention,
    vote,
)
from torchvote.functional.em import em_routing
from torchvote.functional.routing_votes import LinearVotes

HALF = [torch.float16, torch.bfloat16]


def _rounding(dtype: torch.dtype, reference: torch.Tensor) -> float:
    """One rounding to ``dtype`` of values as large as ``reference``'s (plus float32's own)."""
    return torch.finfo(dtype).eps / 2 * reference.abs().max().item() + 1e-6


@pytest.mark.parametrize("dtype", HALF)
def test_masked_softmax_returns_float32_weights_for_half_logits(dtype):
    # seeded (it drew from the global generator, so other tests' draws changed its logits), and
    # within a few float32 roundings of torch's float32 softmax: a half-precision softmax is off
    # by its own eps (1e-3 and more)
    logits = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)).to(dtype)
    weights = masked_softmax(logits, -1)
    assert weights.dtype == torch.float32
    torch.testing.assert_close(
        weights, torch.softmax(logits.float(), -1), rtol=0, atol=4 * torch.finfo(torch.float32).eps
    )


def _offset_scores(dtype: torch.dtype, seed: int = 0):
    """bfloat16-exact queries and keys whose dot products are ~300 + O(1): in float32 the logits
    are exact (products of 8-bit significands, summed in float32), in bfloat16 they would be
    rounded to multiples of 2."""
    generator = torch.Generator().manual_seed(seed)
    direction = torch.zeros(16)
    direction[0] = 1.0
    queries = (17.0 * direction + torch.randn(2, 4, 16, generator=generator) * 0.3).to(dtype)
    keys = (17.0 * direction + torch.randn(2, 6, 16, generator=generator) * 0.3).to(dtype)
    values = torch.randn(2, 6, 8, generator=generator).to(dtype)
    return queries, keys, values


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("dtype", HALF)
def test_the_voting_loop_forms_and_normalises_half_logits_in_float32(dtype, autocast):
    """``DotProductScores.materialize``: "computed in at least float32", under autocast too."""
    queries, keys, values = _offset_scores(dtype)
    expected = vote(SharedVotes(values.float()), DotProductScores(queries.float(), keys.float(), scale=1.0),
                    normalize_over="senders", iterations=2, record=True)
    with torch.autocast("cpu", dtype=dtype, enabled=autocast):
        result = vote(SharedVotes(values), DotProductScores(queries, keys, scale=1.0),
                      normalize_over="senders", iterations=2, record=True)
    assert result.weights[0].dtype == values.dtype
    for ours, theirs in zip(result.weights, expected.weights, strict=True):
        torch.testing.assert_close(ours.float(), theirs, rtol=0, atol=_rounding(dtype, theirs))


def test_float16_logits_do_not_overflow_under_autocast():
    """float16 autocast (the usual mixed precision on a GPU) computed the "float32" logits of the
    voting loop in float16: past 65504 they were ``inf`` and every weight NaN. ``softmax_attention``
    forms float16 logits and clamps them to float16's range, under autocast as without."""
    generator = torch.Generator().manual_seed(0)
    queries = (torch.randn(1, 4, 16, generator=generator) * 200).half().requires_grad_()
    keys = (torch.randn(1, 4, 16, generator=generator) * 200).half().requires_grad_()
    values = torch.randn(1, 4, 16, generator=generator).half()
    plain_output, plain_weights = softmax_attention(queries, keys, values, scale=1.0)  # no autocast: finite
    scores = DotProductScores(queries, keys, scale=1.0)
    plain_vote = vote(SharedVotes(values), scores, normalize_over="senders", record=True)
    assert torch.isfinite(plain_weights).all() and torch.isfinite(plain_vote.outputs).all()
    with torch.autocast("cpu", dtype=torch.float16):
        output, weights = softmax_attention(queries, keys, values, scale=1.0)
        voted = vote(SharedVotes(values), scores, normalize_over="senders", record=True)
    torch.testing.assert_close(weights, plain_weights, rtol=0, atol=0)
    torch.testing.assert_close(output, plain_output, rtol=0, atol=0)
    torch.testing.assert_close(voted.weights[0], plain_vote.weights[0], rtol=0, atol=0)
    output.float().sum().backward()
    assert torch.isfinite(queries.grad).all() and torch.isfinite(keys.grad).all()


def _em_inputs(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    votes = torch.randn(4, 3, 7, 16, generator=generator) * 3  # (n, i, j, h)
    activations = torch.rand(4, 7, generator=generator)  # (n, j)
    return votes, activations


@pytest.mark.parametrize("strategy", ["blocked", "vectorized"])
@pytest.mark.parametrize("dtype", HALF)
def test_em_routing_of_half_votes_uses_float32_statistics_and_returns_their_dtype(dtype, strategy):
    votes, activations = _em_inputs()
    votes, activations = votes.to(dtype), activations.to(dtype)
    poses, out_activations, assignments = em_routing(votes, activations, 0.1, 0.2, strategy=strategy,
                                                     return_assignments=True)
    expected = em_routing(votes.float(), activations.float(), 0.1, 0.2, strategy=strategy,
                          return_assignments=True)
    # was: the assignments came back float32 while the poses and activations were in the votes' dtype
    assert poses.dtype == out_activations.dtype == assignments.dtype == dtype
    for ours, theirs in zip((poses, out_activations, assignments), expected, strict=True):
        torch.testing.assert_close(ours.float(), theirs, rtol=0, atol=_rounding(dtype, theirs))


@pytest.mark.parametrize("strategy", ["blocked", "vectorized"])
def test_em_routing_under_autocast_gives_the_float32_numbers_and_gradients(strategy):
    """EM routing turns autocast off: its statistics stay float32. It was bfloat16 there (poses off
    by 0.1, activations by 0.15 at ``inverse_temperature=1``), and the blocked strategy's backward
    (the CPU default) failed with "expected scalar type Float but found BFloat16"."""
    votes, activations = _em_inputs()
    votes.requires_grad_(True)
    beta_u = torch.zeros(3, requires_grad=True)

    def run(autocast: bool):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            poses, out_activations = em_routing(votes, activations, beta_u, 0.2, strategy=strategy,
                                                inverse_temperature=1.0)
        loss = poses.pow(2).sum() + out_activations.sum()  # backward outside autocast, as torch advises
        return (poses, out_activations, *torch.autograd.grad(loss, [votes, beta_u]))

    expected, ours = run(autocast=False), run(autocast=True)
    for mine, theirs in zip(ours, expected, strict=True):
        assert mine.dtype == torch.float32
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


def test_em_blocked_backward_called_under_autocast_still_recomputes_in_float32():
    """The blocked strategy's backward recomputes every block; called inside an autocast region
    (``loss.backward()`` under ``with torch.autocast(...)``, a common pattern) it recomputed them
    in bfloat16, and the gradient of the votes was off by 6 in 95. (The vectorized strategy's
    backward is plain autograd, which autocast reaches as torch documents: not checked here.)"""
    votes, activations = _em_inputs()
    votes.requires_grad_(True)

    def gradient() -> torch.Tensor:
        poses, out_activations = em_routing(votes, activations, 0.0, 0.2, strategy="blocked",
                                            inverse_temperature=1.0)
        return torch.autograd.grad(poses.pow(2).sum() + out_activations.sum(), votes)[0]

    expected = gradient()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = gradient()
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


def test_em_routing_takes_number_offsets_in_the_votes_precision():
    """A Python ``beta_u`` / ``beta_a`` is filled in the statistics' dtype on the votes' device (was
    ``torch.as_tensor``: a float32 copy from the host, 1e-8 off in float64 routing, and on a GPU a
    copy that waits for every queued kernel)."""
    votes, activations = _em_inputs()
    votes, activations = votes.double(), activations.double()
    numbers = em_routing(votes, activations, 0.1, 0.3, inverse_temperature=1.0, return_assignments=True)
    tensors = em_routing(votes, activations, torch.tensor(0.1, dtype=torch.float64),
                         torch.tensor(0.3, dtype=torch.float64), inverse_temperature=1.0,
                         return_assignments=True)
    for ours, theirs in zip(numbers, tensors, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("iterations", [1, 3])
def test_dynamic_routing_kernel_of_bfloat16_votes_runs_in_float32(iterations):
    """``linear_dynamic_routing`` computes "in the promoted dtype of weight and inputs, at least
    float32": one rounding of the float32 result."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(3, 5, 6, 4, generator=generator).bfloat16()  # (i, j, d, e)
    inputs = torch.randn(2, 5, 4, generator=generator).bfloat16()  # (b, j, e)
    outputs, couplings = dynamic_routing(LinearVotes(weight, inputs), iterations=iterations)
    expected, expected_couplings = dynamic_routing(LinearVotes(weight.float(), inputs.float()),
                                                   iterations=iterations)
    assert outputs.dtype == couplings.dtype == torch.bfloat16
    torch.testing.assert_close(outputs.float(), expected, rtol=0, atol=_rounding(torch.bfloat16, expected))
    torch.testing.assert_close(couplings.float(), expected_couplings, rtol=0,
                               atol=_rounding(torch.bfloat16, expected_couplings))
