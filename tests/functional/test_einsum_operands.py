"""No einsum in torchvote contracts three or more operands.

With opt_einsum installed (a common package; the image of the GPU machines has it),
``torch.einsum`` chooses the order of a contraction of three or more operands from their sizes.
Under ``torch.export`` that fixed the batch size of the exported CapsNet and Efficient-CapsNet (the
plain products of streamed votes), and Luong's general score came back transposed in memory, so
attention dropout drew another mask under the same seed. Two-operand products in a fixed order
behave the same with or without it. Swept: every model's ``tiny`` preset (forward and backward),
``CapsuleLinear`` with every router and every eager strategy, shared and not, the plain products
that ``torch.func`` and ``torch.export`` run, and the attention scores.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from conftest import routing_passes
from torchvote.functional import list_routers
from torchvote.functional.routing_votes import SharedLinearVotes, plain_agreement, plain_weighted_sum
from torchvote.functional.scores import general_score
from torchvote.models import create_model, get_model_spec, list_models
from torchvote.nn import CapsuleLinear, LuongAttention
from torchvote.training.tasks import get_task_handler


@pytest.fixture
def einsum_operands(monkeypatch) -> list[tuple[str, int]]:
    """Every ``torch.einsum`` call from now on, as ``(equation, number of operands)``."""
    calls: list[tuple[str, int]] = []
    real = torch.einsum

    def recording(equation: str, *operands: Any) -> torch.Tensor:
        listed = operands[0] if len(operands) == 1 and isinstance(operands[0], (list, tuple)) else operands
        calls.append((equation, len(listed)))
        return real(equation, *operands)

    monkeypatch.setattr(torch, "einsum", recording)
    return calls


def _assert_two_operands_at_most(calls: list[tuple[str, int]]) -> None:
    assert [call for call in calls if call[1] > 2] == []


@pytest.mark.parametrize("name", list_models())
def test_no_model_runs_an_einsum_of_three_operands(name, einsum_operands):
    torch.manual_seed(0)
    spec = get_model_spec(name)
    model = create_model(name, "tiny")
    handler = get_task_handler(spec.task)
    batch = handler.example_batch(model.config, 3, torch.Generator().manual_seed(0))
    output = handler.forward(model, batch)
    leaves = torch.utils._pytree.tree_leaves(output)
    sum(t.float().sum() for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad).backward()
    if not einsum_operands:
        pytest.skip(f"{name} runs no einsum")
    _assert_two_operands_at_most(einsum_operands)


@pytest.mark.parametrize(
    ("routing", "strategy", "shared"),
    list(itertools.product(sorted(list_routers()), ["stream", "materialize"], [False, True])),
)
def test_no_capsule_layer_runs_an_einsum_of_three_operands(routing, strategy, shared, einsum_operands):
    torch.manual_seed(0)
    passes = routing_passes(routing, 2)  # unset for a one-pass router
    layer = CapsuleLinear(7, 3, 4, 5, routing=routing, strategy=strategy, iterations=passes,
                          shared_weights=shared)
    layer(torch.randn(2, 7, 3)).square().sum().backward()
    _assert_two_operands_at_most(einsum_operands)


def test_the_plain_products_and_scores_use_two_operands_and_match_the_formulas(einsum_operands):
    """What ``torch.func`` transforms and ``torch.export`` run, and the squared lengths of shared
    votes (the distance agreement), against the formulas computed by hand (broadcast products
    summed, the materialised votes), in float64."""
    generator = torch.Generator().manual_seed(0)
    couplings, inputs = torch.rand(4, 2, 6, generator=generator), torch.randn(2, 3, 6, generator=generator)
    weight, outputs = torch.randn(4, 3 * 6, 5, generator=generator), torch.randn(4, 2, 5, generator=generator)
    couplings, inputs, weight, outputs = (t.double() for t in (couplings, inputs, weight, outputs))
    w = weight.unflatten(1, (3, 6))  # (i, e, j, d)
    summed = (couplings[:, :, None, :, None] * inputs[None, :, :, :, None] * w[:, None]).sum((2, 3))
    torch.testing.assert_close(plain_weighted_sum(couplings, inputs, weight), summed)
    agreed = (inputs[None, :, :, :, None] * w[:, None] * outputs[:, :, None, None, :]).sum((2, 4))
    torch.testing.assert_close(plain_agreement(inputs, weight, outputs), agreed)
    query, key = torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(2, 5, 6, dtype=torch.float64)
    matrix = torch.randn(4, 6, dtype=torch.float64)
    scores = general_score(query, key, matrix)
    by_hand = (query[:, :, None, :, None] * matrix * key[:, None, :, None, :]).sum((3, 4))  # (b, L, S)
    torch.testing.assert_close(scores, by_hand)
    assert scores.is_contiguous()
    LuongAttention(4, 6, score="general", dtype=torch.float64)(query, key)
    shared_weight = torch.randn(4, 5, 3, dtype=torch.float64)  # (i, d, e)
    shared = SharedLinearVotes(shared_weight, torch.randn(2, 6, 3, dtype=torch.float64))  # inputs (b, j, e)
    torch.testing.assert_close(shared.squared_norm(), shared.materialize().square().sum(-1))  # (b, i, j)
    _assert_two_operands_at_most(einsum_operands)
