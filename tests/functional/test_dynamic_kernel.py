"""The dynamic routing kernel on linear votes (``functional/dynamic_kernel.py``) against the
paper's loop: outputs, couplings of every pass, and the gradients of weight, inputs and bias, in
float64, with the products' tiles forced small. The references (Procedure 1 as literal loops, the
votes materialised by loops) are those of ``test_routing.py``."""

from __future__ import annotations

import pytest
import torch
from test_routing import materialised, reference_batch

import torchvote.functional.routing as routing_module
import torchvote.functional.routing_votes as routing_votes_module
from torchvote.functional.dynamic_kernel import uniform_sum
from torchvote.functional.routing import dynamic_routing
from torchvote.functional.routing_votes import LinearVotes
from torchvote.functional.voting import PairwiseVotes

DOUBLE = torch.float64


@pytest.fixture(params=[None, 16], ids=["one-tile", "many-tiles"])
def tiles(request, monkeypatch):
    if request.param is not None:  # receiver groups and batch-row splits in every product
        monkeypatch.setattr(routing_votes_module, "_BLOCK_ELEMENTS", request.param)
        monkeypatch.setattr(routing_votes_module, "_DEVICE_BLOCK_ELEMENTS", request.param)  # on a GPU too


def _layer(seed: int, batch_shape: tuple[int, ...], bias: bool):
    """Weight (out 3, in 5, d 4, e 2), inputs, and a bias (3, 4) or None, all leaves."""
    torch.manual_seed(seed)
    weight = (torch.randn(3, 5, 4, 2, dtype=DOUBLE) * 0.7).requires_grad_(True)
    inputs = torch.randn(*batch_shape, 5, 2, dtype=DOUBLE, requires_grad=True)
    offset = torch.randn(3, 4, dtype=DOUBLE, requires_grad=True) if bias else None
    return weight, inputs, offset


def _loss(outputs: torch.Tensor, couplings: torch.Tensor) -> torch.Tensor:
    """A loss through the outputs and the couplings, so both gradients are checked."""
    probe = torch.linspace(-1, 1, couplings.numel(), dtype=couplings.dtype).view_as(couplings)
    return outputs.pow(2).sum() + (couplings * probe).sum()


@pytest.mark.parametrize("batch_shape", [(3,), (2, 2)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("detach", [False, True])
@pytest.mark.parametrize("iterations", [1, 2, 3])
def test_kernel_matches_procedure1(iterations, detach, bias, batch_shape, tiles):
    weight, inputs, offset = _layer(iterations, batch_shape, bias)
    outputs, couplings = dynamic_routing(
        LinearVotes(weight, inputs), iterations=iterations, bias=offset, detach_votes=detach
    )
    votes = materialised(weight, inputs).reshape(-1, 3, 5, 4)  # (b, out, in, d)
    ref_out, ref_c = reference_batch(votes, iterations, bias=offset, detach=detach)
    torch.testing.assert_close(outputs.reshape(-1, 3, 4), ref_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(couplings.reshape(-1, 3, 5), ref_c, rtol=1e-10, atol=1e-12)
    leaves = [weight, inputs] + ([offset] if bias else [])
    grads = torch.autograd.grad(_loss(outputs.reshape(-1, 3, 4), couplings.reshape(-1, 3, 5)), leaves)
    ref_grads = torch.autograd.grad(_loss(ref_out, ref_c), leaves)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("detach", [False, True])
def test_every_pass_matches_the_voting_loop(detach, tiles):
    weight, inputs, offset = _layer(5, (4,), bias=True)
    fast = dynamic_routing(
        LinearVotes(weight, inputs), iterations=3, bias=offset, detach_votes=detach, all_passes=True
    )
    slow = dynamic_routing(
        PairwiseVotes(materialised(weight, inputs)),
        iterations=3,
        bias=offset,
        detach_votes=detach,
        all_passes=True,
    )
    assert fast[1].shape == (3, 4, 3, 5)  # (passes, b, out, in)
    for ours, theirs in zip(fast, slow, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
    grads = torch.autograd.grad(_loss(*fast), [weight, inputs, offset])
    ref_grads = torch.autograd.grad(_loss(*slow), [weight, inputs, offset])
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)


def test_kernel_gradcheck(monkeypatch):
    monkeypatch.setattr(routing_votes_module, "_BLOCK_ELEMENTS", 8)
    monkeypatch.setattr(routing_votes_module, "_DEVICE_BLOCK_ELEMENTS", 8)
    weight, inputs, offset = _layer(6, (2,), bias=True)

    def route(w, x, b):
        return dynamic_routing(LinearVotes(w, x), iterations=3, bias=b, all_passes=True)

    assert torch.autograd.gradcheck(route, (weight, inputs, offset))


def test_uniform_sum_is_the_mean_vote():
    weight, inputs, _ = _layer(7, (2, 3), bias=False)
    votes = LinearVotes(weight, inputs)
    got = uniform_sum(votes)
    want = materialised(weight, inputs).sum(-2) / 3  # (..., out, d): c_ij = 1 / out_caps
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    probe = torch.randn_like(got)
    grads = torch.autograd.grad((got * probe).sum(), [weight, inputs])
    ref_grads = torch.autograd.grad((want * probe).sum(), [weight, inputs])
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)


def test_the_dot_agreement_on_linear_votes_runs_in_the_kernel(monkeypatch):
    weight, inputs, _ = _layer(8, (2,), bias=False)
    calls = []
    loop = routing_module.vote
    monkeypatch.setattr(routing_module, "vote", lambda *a, **k: calls.append(k) or loop(*a, **k))
    dynamic_routing(LinearVotes(weight, inputs), iterations=3)
    assert calls == []  # the kernel, not the voting loop
    dynamic_routing(LinearVotes(weight, inputs), iterations=3, agreement="distance")
    assert len(calls) == 1  # the distance agreement takes the loop


def test_backward_keeps_no_votes_sized_tensor():
    torch.manual_seed(9)
    weight = torch.randn(3, 40, 8, 4, requires_grad=True)
    inputs = torch.randn(16, 40, 4)
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        outputs, _ = dynamic_routing(LinearVotes(weight, inputs), iterations=3)
    votes = 16 * 3 * 40 * 8  # (b, out, in, d)
    assert saved and max(saved) <= votes // 4
    outputs.sum().backward()
    assert torch.isfinite(weight.grad).all()


def test_an_empty_batch_routes_to_empty_outputs():
    weight, _, offset = _layer(10, (2,), bias=True)
    inputs = torch.randn(0, 5, 2, dtype=DOUBLE, requires_grad=True)
    outputs, couplings = dynamic_routing(LinearVotes(weight, inputs), iterations=3, bias=offset)
    assert outputs.shape == (0, 3, 4) and couplings.shape == (0, 3, 5)
    outputs.sum().backward()
    assert inputs.grad.shape == (0, 5, 2) and torch.count_nonzero(weight.grad) == 0


@pytest.mark.parametrize("shape", [(0, 4, 6, 5), (3, 0, 6, 5), (3, 4, 0, 5), (3, 4, 6, 0)])
def test_linear_votes_refuse_an_empty_weight(shape):
    """A size-0 weight axis is refused where the votes are made, naming the weight's shape (the
    blocked kernels would fail in a reshape deep inside routing)."""
    inputs = torch.randn(2, shape[1], shape[3])
    with pytest.raises(ValueError, match=r"every size >= 1, got \(" + ", ".join(map(str, shape))):
        LinearVotes(torch.randn(shape), inputs)
