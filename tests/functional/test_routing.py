"""Dynamic routing and the unmaterialised capsule votes against loops written from the paper.

References here are literal transcriptions of Sabour, Frosst & Hinton 2017, Procedure 1, in the
papers' indices: ``i`` input capsule, ``j`` output capsule, votes ``u_hat[i, j]``. They take and
return torchvote's receivers-first layout, converting once at their edge (``reference_batch``).
"""

from __future__ import annotations

import math

import pytest
import torch
from einops import rearrange
from hypothesis import given, settings
from hypothesis import strategies as st

import torchvote.functional.routing_votes as routing_votes_module
from torchvote.functional.routing import (
    as_routing_votes,
    dynamic_routing,
    inverted_dot_product_routing,
    list_routers,
    self_attention_routing,
    uniform_routing,
)
from torchvote.functional.routing_votes import LinearVotes, SharedLinearVotes
from torchvote.functional.voting import PairwiseVotes

DOUBLE = torch.float64


def paper_squash(s: torch.Tensor) -> torch.Tensor:
    """Eq. 1, ``||s||^2 / (1 + ||s||^2) s / ||s||``, exactly (zero for the zero vector)."""
    n2 = (s * s).sum()
    return s * (n2 / (1 + n2)) / torch.sqrt(n2) if n2 > 0 else torch.zeros_like(s)


def procedure1(u_hat, iterations, *, agreement="dot", bias=None, detach=False):
    """Procedure 1 for one example. u_hat: (in, out, d). Returns v (out, d) and c (in, out)."""
    n_in, n_out, _ = u_hat.shape
    b = [[torch.zeros((), dtype=u_hat.dtype) for _ in range(n_out)] for _ in range(n_in)]
    for r in range(iterations):
        last = r == iterations - 1
        u = u_hat if (last or not detach) else u_hat.detach()
        c = []
        for i in range(n_in):  # c_i = softmax(b_i) over the outputs
            exps = [torch.exp(b[i][j]) for j in range(n_out)]
            total = sum(exps)
            c.append([exps[j] / total for j in range(n_out)])
        v = []
        for j in range(n_out):
            s = sum(c[i][j] * u[i, j] for i in range(n_in))
            if bias is not None:
                s = s + bias[j]
            v.append(paper_squash(s))
        if not last:
            for i in range(n_in):
                for j in range(n_out):
                    if agreement == "dot":
                        b[i][j] = b[i][j] + (u[i, j] * v[j]).sum()
                    else:
                        b[i][j] = b[i][j] - ((u[i, j] - v[j]) ** 2).sum()
    couplings = torch.stack([torch.stack(row) for row in c])
    return torch.stack(v), couplings


def reference_batch(votes, iterations, **options):
    """Procedure 1 per example. votes: (b, out, in, d), receivers first; couplings (b, out, in)."""
    u_hat = rearrange(votes, "b o i d -> b i o d")  # the paper's (in, out)
    outs, cs = zip(*(procedure1(u_hat[n], iterations, **options) for n in range(votes.shape[0])),
                   strict=True)
    return torch.stack(outs), rearrange(torch.stack(cs), "b i o -> b o i")


@pytest.mark.parametrize("iterations", [1, 2, 3])
@pytest.mark.parametrize("agreement", ["dot", "distance"])
@pytest.mark.parametrize("detach", [False, True])
def test_dynamic_routing_matches_procedure1(iterations, agreement, detach):
    torch.manual_seed(iterations)
    votes = (torch.randn(2, 3, 5, 4, dtype=DOUBLE) * 0.6).requires_grad_(True)
    outputs, couplings = dynamic_routing(votes, iterations=iterations, agreement=agreement,
                                         detach_votes=detach)
    ref_out, ref_c = reference_batch(votes, iterations, agreement=agreement, detach=detach)
    torch.testing.assert_close(outputs, ref_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(couplings, ref_c, rtol=1e-10, atol=1e-12)
    weights = torch.randn_like(outputs)
    (grad,) = torch.autograd.grad((outputs * weights).sum(), votes)
    (ref_grad,) = torch.autograd.grad((ref_out * weights).sum(), votes)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)


def test_detach_changes_the_gradient_but_not_the_outputs():
    torch.manual_seed(0)
    votes = torch.randn(2, 3, 6, 4, dtype=DOUBLE, requires_grad=True)
    exact, _ = dynamic_routing(votes, iterations=3)
    fast, _ = dynamic_routing(votes, iterations=3, detach_votes=True)
    torch.testing.assert_close(exact, fast, rtol=0, atol=0)
    g_exact = torch.autograd.grad(exact.sum(), votes)[0]
    g_fast = torch.autograd.grad(fast.sum(), votes)[0]
    assert not torch.allclose(g_exact, g_fast)


def test_bias_is_added_before_the_squash_every_iteration():
    torch.manual_seed(1)
    votes = torch.randn(2, 3, 5, 4, dtype=DOUBLE, requires_grad=True)
    bias = torch.randn(3, 4, dtype=DOUBLE, requires_grad=True)
    outputs, couplings = dynamic_routing(votes, iterations=3, bias=bias)
    ref_out, ref_c = reference_batch(votes, 3, bias=bias)
    torch.testing.assert_close(outputs, ref_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(couplings, ref_c, rtol=1e-10, atol=1e-12)
    grads = torch.autograd.grad(outputs.sum(), [votes, bias])
    ref_grads = torch.autograd.grad(ref_out.sum(), [votes, bias])
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-12)


def test_couplings_sum_to_one_over_the_outputs_and_squash_norms_below_one():
    torch.manual_seed(2)
    votes = torch.randn(4, 3, 7, 5) * 3
    outputs, couplings = dynamic_routing(votes, iterations=3)
    assert couplings.shape == (4, 3, 7)  # (batch, out_caps, in_caps)
    torch.testing.assert_close(couplings.sum(-2), torch.ones(4, 7))
    assert not torch.allclose(couplings.sum(-1), torch.ones(4, 3))  # not over the inputs
    assert bool((outputs.norm(dim=-1) < 1).all())


def test_all_passes_stacks_every_iteration():
    votes = torch.randn(2, 3, 5, 4)
    _, couplings = dynamic_routing(votes, iterations=3, all_passes=True)
    assert couplings.shape == (3, 2, 3, 5)
    torch.testing.assert_close(couplings[0], torch.full((2, 3, 5), 1 / 3))


def test_one_iteration_is_the_uniform_average_squashed():
    torch.manual_seed(3)
    votes = torch.randn(3, 4, 6, 5, dtype=DOUBLE, requires_grad=True)  # (b, out, in, d)
    outputs, couplings = dynamic_routing(votes, iterations=1)
    expected = torch.stack([
        torch.stack([paper_squash(votes[n, j].sum(0) / 4) for j in range(4)]) for n in range(3)
    ])
    torch.testing.assert_close(outputs, expected)
    torch.testing.assert_close(couplings, torch.full_like(couplings, 1 / 4))
    uniform, uniform_c = uniform_routing(votes)
    torch.testing.assert_close(uniform, expected)
    torch.testing.assert_close(uniform_c, couplings)
    grad = torch.autograd.grad(uniform.pow(2).sum(), votes)[0]
    torch.testing.assert_close(grad, torch.autograd.grad(expected.pow(2).sum(), votes)[0])


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), in_caps=st.integers(1, 8), out_caps=st.integers(1, 5),
       iterations=st.integers(1, 4), agreement=st.sampled_from(["dot", "distance"]))
def test_permuting_input_capsules_leaves_outputs_unchanged(seed, in_caps, out_caps, iterations, agreement):
    generator = torch.Generator().manual_seed(seed)
    votes = torch.randn(2, out_caps, in_caps, 3, generator=generator, dtype=DOUBLE)
    order = torch.randperm(in_caps, generator=generator)
    outputs, couplings = dynamic_routing(votes, iterations=iterations, agreement=agreement)
    permuted, permuted_c = dynamic_routing(votes[:, :, order], iterations=iterations, agreement=agreement)
    torch.testing.assert_close(permuted, outputs)
    torch.testing.assert_close(permuted_c, couplings[:, :, order])
    torch.testing.assert_close(couplings.sum(-2), torch.ones(2, in_caps, dtype=DOUBLE))
    assert bool((outputs.norm(dim=-1) < 1).all())


def test_zero_votes_give_zeros_and_finite_gradients():
    votes = torch.zeros(2, 3, 5, 4, requires_grad=True)
    outputs, couplings = dynamic_routing(votes, iterations=3)
    assert torch.equal(outputs, torch.zeros(2, 3, 4))
    outputs.sum().backward()
    assert torch.isfinite(votes.grad).all()
    torch.testing.assert_close(couplings, torch.full((2, 3, 5), 1 / 3))


def test_zero_capsules_give_zeros_and_finite_gradients():
    weight = torch.randn(3, 5, 4, 2, requires_grad=True)
    inputs = torch.zeros(2, 5, 2, requires_grad=True)
    outputs, _ = dynamic_routing(LinearVotes(weight, inputs), iterations=3)
    assert torch.equal(outputs, torch.zeros(2, 3, 4))
    outputs.sum().backward()
    assert torch.isfinite(weight.grad).all() and torch.isfinite(inputs.grad).all()


@pytest.mark.parametrize("iterations", [0, -1, 1.5, True])
def test_bad_iterations_are_rejected(iterations):
    with pytest.raises(ValueError, match="iterations"):
        dynamic_routing(torch.randn(1, 2, 3, 4), iterations=iterations)


def test_bad_votes_are_rejected():
    with pytest.raises(ValueError, match="votes"):
        dynamic_routing(torch.randn(3, 4))
    with pytest.raises(ValueError, match="agreement"):
        dynamic_routing(torch.randn(1, 2, 3, 4), agreement="cosine")


def test_as_routing_votes_wraps_receivers_first_votes_without_a_copy():
    votes = torch.randn(2, 3, 5, 4)  # (b, out_caps, in_caps, d)
    routed = as_routing_votes(votes)
    assert isinstance(routed, PairwiseVotes)
    assert routed.votes.shape == (2, 3, 5, 4)
    assert routed.votes.data_ptr() == votes.data_ptr()


def test_dynamic_routing_gradcheck():
    torch.manual_seed(4)
    votes = torch.randn(1, 4, 3, 2, dtype=DOUBLE, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v: dynamic_routing(v, iterations=3), (votes,))


# --- unmaterialised votes ----------------------------------------------------------------------------


def materialised(weight, inputs):
    """u_hat[..., i, j, :] = weight[i, j] @ inputs[..., j, :] by loops (receivers first)."""
    out_caps, in_caps = weight.shape[:2]
    rows = []
    for i in range(out_caps):
        rows.append(torch.stack([inputs[..., j, :] @ weight[i, j].T for j in range(in_caps)], dim=-2))
    return torch.stack(rows, dim=-3)


@pytest.mark.parametrize("block", [None, 16, 200])
@pytest.mark.parametrize("batch_shape", [(3,), (2, 2), ()])
def test_linear_votes_match_materialised_votes(block, batch_shape, monkeypatch):
    if block is not None:  # force receiver groups and batch-row splits
        monkeypatch.setattr(routing_votes_module, "_BLOCK_ELEMENTS", block)
        monkeypatch.setattr(routing_votes_module, "_DEVICE_BLOCK_ELEMENTS", block)  # on a GPU too
    torch.manual_seed(5)
    weight = torch.randn(4, 6, 3, 2, dtype=DOUBLE, requires_grad=True)
    inputs = torch.randn(*batch_shape, 6, 2, dtype=DOUBLE, requires_grad=True)
    weights = torch.rand(*batch_shape, 4, 6, dtype=DOUBLE, requires_grad=True)
    outputs = torch.randn(*batch_shape, 4, 3, dtype=DOUBLE, requires_grad=True)
    fast, slow = LinearVotes(weight, inputs), PairwiseVotes(materialised(weight, inputs))
    for name in ("weighted_sum", "dot", "squared_norm", "materialize"):
        if name == "weighted_sum":
            got, want = fast.weighted_sum(weights), slow.weighted_sum(weights)
        elif name == "dot":
            got, want = fast.dot(outputs), slow.dot(outputs)
        elif name == "squared_norm":
            got, want = fast.squared_norm(), slow.squared_norm()
        else:
            got, want = fast.materialize(), slow.votes
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        probe = torch.randn_like(got)
        leaves = [weight, inputs, weights, outputs]
        g_got = torch.autograd.grad(got, leaves, probe, allow_unused=True, retain_graph=True)
        g_want = torch.autograd.grad(want, leaves, probe, allow_unused=True, retain_graph=True)
        for a, b in zip(g_got, g_want, strict=True):
            if b is None:
                assert a is None or torch.count_nonzero(a) == 0
            else:
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def _tile_count(batch: int, receivers: int, per_row: int, device: str) -> int:
    """How many tiles the streamed kernels cut ``(receivers, batch)`` into on ``device``."""
    group, rows = routing_votes_module._blocks(
        batch, receivers, per_row, routing_votes_module._block_elements(torch.device(device))
    )
    return math.ceil(receivers / group) * math.ceil(batch / rows)


def test_streamed_tiles_are_cache_sized_on_a_cpu_and_few_on_an_accelerator():
    """CapsNet's layer (1152 x 8 -> 10 capsules) at batch 2048, streamed: on a CPU tiles of about
    4 MB (180 of them; measured fastest there), elsewhere a few large ones (a GPU streams past
    its materialise budget, where each tile costs kernel launches, not cache misses). Each tile
    holds about its device's elements: at most one row more (the batch is cut in equal parts)."""
    per_row = 8 * 1152  # e * j: one row of coupling-scaled inputs for one receiver
    assert _tile_count(2048, 10, per_row, "cpu") >= 180
    for device in ("cuda", "meta"):  # any device but the CPU: its type is all that is read
        assert _tile_count(2048, 10, per_row, device) <= 20  # each receiver in two halves of the batch
    for device in ("cpu", "cuda"):
        elements = routing_votes_module._block_elements(torch.device(device))
        group, rows = routing_votes_module._blocks(2048, 10, per_row, elements)
        assert group * rows * per_row <= elements + per_row


def test_linear_votes_gradcheck(monkeypatch):
    monkeypatch.setattr(routing_votes_module, "_BLOCK_ELEMENTS", 8)
    monkeypatch.setattr(routing_votes_module, "_DEVICE_BLOCK_ELEMENTS", 8)
    torch.manual_seed(6)
    weight = torch.randn(3, 4, 2, 2, dtype=DOUBLE, requires_grad=True)
    inputs = torch.randn(3, 4, 2, dtype=DOUBLE, requires_grad=True)
    weights = torch.rand(3, 3, 4, dtype=DOUBLE, requires_grad=True)
    outputs = torch.randn(3, 3, 2, dtype=DOUBLE, requires_grad=True)
    assert torch.autograd.gradcheck(lambda w, x, c: LinearVotes(w, x).weighted_sum(c),
                                    (weight, inputs, weights))
    assert torch.autograd.gradcheck(lambda w, x, v: LinearVotes(w, x).dot(v), (weight, inputs, outputs))


def test_shared_linear_votes_match_materialised_votes():
    torch.manual_seed(7)
    shared = torch.randn(4, 3, 2, dtype=DOUBLE, requires_grad=True)
    inputs = torch.randn(2, 6, 2, dtype=DOUBLE, requires_grad=True)
    weights = torch.rand(2, 4, 6, dtype=DOUBLE)
    outputs = torch.randn(2, 4, 3, dtype=DOUBLE)
    full = shared.unsqueeze(1).expand(4, 6, 3, 2)
    fast, slow = SharedLinearVotes(shared, inputs), PairwiseVotes(materialised(full, inputs))
    torch.testing.assert_close(fast.weighted_sum(weights), slow.weighted_sum(weights))
    torch.testing.assert_close(fast.dot(outputs), slow.dot(outputs))
    torch.testing.assert_close(fast.squared_norm(), slow.squared_norm())
    torch.testing.assert_close(fast.materialize(), slow.votes)


@pytest.mark.parametrize("agreement", ["dot", "distance"])
@pytest.mark.parametrize("detach", [False, True])
def test_dynamic_routing_on_linear_votes_matches_the_reference(agreement, detach):
    torch.manual_seed(8)
    weight = (torch.randn(3, 5, 4, 2, dtype=DOUBLE) * 0.7).requires_grad_(True)
    inputs = torch.randn(2, 5, 2, dtype=DOUBLE, requires_grad=True)
    outputs, couplings = dynamic_routing(LinearVotes(weight, inputs), iterations=3, agreement=agreement,
                                         detach_votes=detach)
    votes = materialised(weight, inputs)  # (b, out, in, d)
    ref_out, ref_c = reference_batch(votes, 3, agreement=agreement, detach=detach)
    torch.testing.assert_close(outputs, ref_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(couplings, ref_c, rtol=1e-10, atol=1e-12)
    grads = torch.autograd.grad(outputs.pow(2).sum(), [weight, inputs])
    ref_grads = torch.autograd.grad(ref_out.pow(2).sum(), [weight, inputs])
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-12)


# the routers of list_routers() that take plain votes (EM needs activations, slot a query and an update)
PLAIN_VOTE_ROUTERS = {
    "dynamic": dynamic_routing,
    "inverted_dot_product": inverted_dot_product_routing,
    "self_attention": self_attention_routing,
    "uniform": uniform_routing,
}


@pytest.mark.parametrize("votes_class", [LinearVotes, SharedLinearVotes])
@pytest.mark.parametrize("weight_dtype", [DOUBLE, torch.float16], ids=["float64 weight", "float16 weight"])
def test_linear_votes_of_two_dtypes_are_refused_outside_autocast(votes_class, weight_dtype):
    """A float16 weight routed float32 inputs in float32 and float64 inputs gave float64 outputs
    (the promotion, silently): refused as vote and the attention modules refuse two dtypes."""
    shape = (3, 4, 5, 2) if votes_class is LinearVotes else (3, 5, 2)
    weight, inputs = torch.randn(shape).to(weight_dtype), torch.randn(2, 4, 2)
    with pytest.raises(TypeError, match=f"weight has dtype {weight_dtype} but the inputs are torch.float32"):
        votes_class(weight, inputs)
    with pytest.raises(TypeError, match="weight has dtype torch.float32 but the inputs are torch.float64"):
        votes_class(weight.float(), inputs.double())


@pytest.mark.parametrize("name", sorted(PLAIN_VOTE_ROUTERS))
@pytest.mark.parametrize("votes_class", [LinearVotes, SharedLinearVotes])
def test_linear_votes_of_two_dtypes_route_under_autocast(name, votes_class):
    """Under ``torch.autocast`` (bfloat16 inputs beside a float32 weight: a capsule layer after an
    autocast layer) the votes are taken, in their promotion, as autocast computes in mixed dtypes."""
    assert name in list_routers()
    route = PLAIN_VOTE_ROUTERS[name]
    torch.manual_seed(11)
    shape = (3, 4, 5, 2) if votes_class is LinearVotes else (3, 5, 2)
    weight, inputs = torch.randn(shape), torch.randn(2, 4, 2).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = votes_class(weight, inputs)
        assert mixed.dtype == torch.float32 and mixed.zero_logits().dtype == torch.float32
        outputs, couplings = route(mixed)
    expected_outputs, expected_couplings = route(votes_class(weight, inputs.float()))
    torch.testing.assert_close(outputs.float(), expected_outputs, rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(couplings.float(), expected_couplings, rtol=5e-2, atol=5e-2)


def test_linear_votes_reject_mismatched_shapes():
    with pytest.raises(ValueError, match="in_caps"):
        LinearVotes(torch.randn(3, 5, 4, 2), torch.randn(2, 6, 2))
    with pytest.raises(ValueError, match="weight"):
        LinearVotes(torch.randn(3, 5, 4), torch.randn(2, 5, 2))
    with pytest.raises(ValueError, match="in_dim"):
        SharedLinearVotes(torch.randn(3, 4, 2), torch.randn(2, 5, 3))


def test_linear_votes_in_float32_match_float64():
    torch.manual_seed(9)
    weight = torch.randn(10, 40, 16, 8, dtype=DOUBLE) * 0.1
    inputs = torch.randn(4, 40, 8, dtype=DOUBLE)
    exact, _ = dynamic_routing(LinearVotes(weight, inputs), iterations=3)
    single, _ = dynamic_routing(LinearVotes(weight.float(), inputs.float()), iterations=3)
    torch.testing.assert_close(single.double(), exact, rtol=1e-4, atol=1e-5)
    assert math.isfinite(float(single.sum()))


@pytest.mark.parametrize("as_linear", [False, True])
def test_a_bias_that_does_not_fit_the_votes_is_named(as_linear):
    torch.manual_seed(3)
    weight, inputs = torch.randn(3, 5, 4, 2), torch.randn(2, 5, 2)
    votes = LinearVotes(weight, inputs) if as_linear else torch.einsum("ijde,bje->bijd", weight, inputs)
    with pytest.raises(ValueError, match=r"bias must broadcast to \(batch\.\.\., out_caps, out_dim\) = "
                                         r"\(2, 3, 4\), got \(4, 4\)"):
        dynamic_routing(votes, bias=torch.zeros(4, 4))
    with pytest.raises(ValueError, match="bias must broadcast"):
        uniform_routing(votes, bias=torch.zeros(7, 3, 4))
    with pytest.raises(TypeError, match="bias has dtype torch.float64 but the votes are torch.float32"):
        dynamic_routing(votes, bias=torch.zeros(3, 4, dtype=DOUBLE))
    with pytest.raises(TypeError, match="bias must be a floating-point tensor"):
        uniform_routing(votes, bias=torch.zeros(3, 4, dtype=torch.int64))
    for bias in (torch.zeros(3, 4), torch.zeros(2, 3, 4), torch.zeros(1, 4)):
        assert dynamic_routing(votes, bias=bias)[0].shape == (2, 3, 4)
