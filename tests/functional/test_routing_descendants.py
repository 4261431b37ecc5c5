"""The attention-style descendants of routing against loops written from their papers.

Papers' indices: ``i`` / ``l`` input capsule, ``j`` / ``n`` output capsule, votes ``v[i, j]``.
The references keep that (in, out) layout; :func:`receivers_first` converts at their edge to
torchvote's ``(out_caps, in_caps)``.
"""

from __future__ import annotations

import math

import pytest
import torch
from einops import rearrange

from torchvote.functional.routing import (
    efficient_squash,
    inverted_dot_product_routing,
    self_attention_routing,
    slot_attention,
    slot_routing,
)

DOUBLE = torch.float64


def layer_norm(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    mean = sum(x[k] for k in range(len(x))) / len(x)
    var = sum((x[k] - mean) ** 2 for k in range(len(x))) / len(x)
    return (x - mean) / torch.sqrt(var + eps)


def receivers_first(reference, votes, *args):
    """Run a papers'-layout reference (votes (in, out, d) -> outputs, couplings (in, out)) on
    receivers-first votes (out, in, d); the couplings come back (out, in)."""
    outputs, couplings = reference(rearrange(votes, "o i d -> i o d"), *args)
    return outputs, rearrange(couplings, "i o -> o i")


def tsai_procedure1(votes, iterations):
    """Tsai et al. 2020, Procedure 1, one example: votes (in, out, d)."""
    n_in, n_out, d = votes.shape
    poses = [torch.zeros(d, dtype=votes.dtype) for _ in range(n_out)]  # p_j = 0
    for _ in range(iterations):
        r = []
        for i in range(n_in):
            agreement = [(poses[j] * votes[i, j]).sum() for j in range(n_out)]
            exps = [torch.exp(a) for a in agreement]
            r.append([e / sum(exps) for e in exps])  # softmax over the output capsules
        poses = [layer_norm(sum(r[i][j] * votes[i, j] for i in range(n_in))) for j in range(n_out)]
    return torch.stack(poses), torch.stack([torch.stack(row) for row in r])


@pytest.mark.parametrize("iterations", [1, 2, 3])
def test_inverted_dot_product_routing_matches_procedure1(iterations):
    torch.manual_seed(iterations)
    votes = torch.randn(2, 3, 5, 4, dtype=DOUBLE, requires_grad=True)  # (b, out, in, d)
    poses, couplings = inverted_dot_product_routing(votes, iterations=iterations)
    refs = [receivers_first(tsai_procedure1, votes[n], iterations) for n in range(2)]
    ref_poses = torch.stack([p for p, _ in refs])
    torch.testing.assert_close(poses, ref_poses, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(couplings, torch.stack([c for _, c in refs]), rtol=1e-10, atol=1e-12)
    grad = torch.autograd.grad(poses.pow(3).sum(), votes)[0]
    ref_grad = torch.autograd.grad(ref_poses.pow(3).sum(), votes)[0]
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-11)


def test_inverted_dot_product_first_pass_is_uniform_and_a_callable_norm_is_used():
    votes = torch.randn(2, 4, 6, 3)  # (b, out, in, d)
    _, couplings = inverted_dot_product_routing(votes, iterations=3, all_passes=True)
    torch.testing.assert_close(couplings[0], torch.full((2, 4, 6), 0.25))
    torch.testing.assert_close(couplings.sum(-2), torch.ones(3, 2, 6))
    doubled, _ = inverted_dot_product_routing(votes, iterations=1, normalization=lambda s: 2 * s)
    torch.testing.assert_close(doubled, 2 * votes.mean(2) * 6 / 4)


def efficient_reference(votes, log_prior):
    """Mazzia et al. 2021, eqs. 3-6 as in the authors' code, one example: votes (in, out, d)."""
    n_in, n_out, d = votes.shape
    logits = [[sum((votes[m, n] * votes[k, n]).sum() for k in range(n_in)) / math.sqrt(d)
               for n in range(n_out)] for m in range(n_in)]  # the paper's l is m here
    c = []
    for m in range(n_in):
        exps = [torch.exp(logits[m][n]) for n in range(n_out)]
        c.append([e / sum(exps) for e in exps])  # softmax over the output capsules
    outputs = []
    for n in range(n_out):
        s = sum(votes[m, n] * (c[m][n] + log_prior[m, n]) for m in range(n_in))
        norm = torch.sqrt((s * s).sum())
        outputs.append((1 - 1 / torch.exp(norm)) * s / norm)
    return torch.stack(outputs), torch.stack([torch.stack(row) for row in c])


@pytest.mark.parametrize("with_prior", [False, True])
def test_self_attention_routing_matches_efficient_capsnet(with_prior):
    torch.manual_seed(int(with_prior))
    votes = (torch.randn(2, 3, 5, 4, dtype=DOUBLE) * 0.5).requires_grad_(True)  # (b, out, in, d)
    prior = torch.randn(3, 5, dtype=DOUBLE, requires_grad=True) if with_prior else None  # (out, in)
    outputs, couplings = self_attention_routing(votes, log_prior=prior)
    paper_prior = prior.T if with_prior else torch.zeros(5, 3, dtype=DOUBLE)  # the paper's (in, out)
    refs = [receivers_first(efficient_reference, votes[n], paper_prior) for n in range(2)]
    ref_out = torch.stack([o for o, _ in refs])
    torch.testing.assert_close(outputs, ref_out, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(couplings, torch.stack([c for _, c in refs]), rtol=1e-10, atol=1e-12)
    leaves = [votes] + ([prior] if with_prior else [])
    grads = torch.autograd.grad(outputs.sum(), leaves)
    ref_grads = torch.autograd.grad(ref_out.sum(), leaves)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-8, atol=1e-10)


def test_self_attention_routing_rejects_a_mis_shaped_prior():
    with pytest.raises(ValueError, match="log_prior"):
        self_attention_routing(torch.randn(2, 3, 5, 4), log_prior=torch.randn(5, 3))


def test_efficient_squash_lengths_and_zero():
    s = torch.randn(100, 8, dtype=DOUBLE) * torch.logspace(-3, 1, 100, dtype=DOUBLE).unsqueeze(-1)
    lengths = efficient_squash(s).norm(dim=-1)
    assert bool((lengths < 1).all()) and bool((lengths >= 0).all())
    assert bool((efficient_squash(s.float() * 1e3).norm(dim=-1) <= 1 + 1e-6).all())
    # eq. 6, (1 - e^-||s||) s / ||s||, with the documented ||s|| = sqrt(sum s^2 + 1e-12): exact in
    # float64 (rtol 1e-4 let the eps go unseen)
    norm, smoothed = s.norm(dim=-1), torch.sqrt(s.pow(2).sum(-1) + 1e-12)
    torch.testing.assert_close(lengths, norm * -torch.expm1(-smoothed) / smoothed, rtol=1e-13, atol=0)
    zero = torch.zeros(3, 4, requires_grad=True)
    efficient_squash(zero).sum().backward()
    assert torch.equal(efficient_squash(zero), zero) and torch.isfinite(zero.grad).all()
    with pytest.raises(ValueError, match="eps"):
        efficient_squash(s, eps=0)


def slot_loop(keys, values, slots, query, update, iterations, eps=1e-8):
    """Locatello et al. 2020, Algorithm 1, one example, the projections given as callables."""
    n_in, n_slots = keys.shape[0], slots.shape[0]
    scale = 1 / math.sqrt(keys.shape[-1])
    attn = None
    for _ in range(iterations):
        q = query(slots)
        attn = torch.zeros(n_slots, n_in, dtype=keys.dtype)
        rows = []
        for j in range(n_in):
            logits = [(q[i] * keys[j]).sum() * scale for i in range(n_slots)]
            exps = [torch.exp(x) for x in logits]
            rows.append(torch.stack([e / sum(exps) for e in exps]))  # softmax over the slots
        attn = torch.stack(rows, dim=1)  # (slots, inputs)
        updates = []
        for i in range(n_slots):
            w = [attn[i, j] + eps for j in range(n_in)]
            updates.append(sum(w[j] * values[j] for j in range(n_in)) / sum(w))
        slots = update(torch.stack(updates), slots)
    return slots, attn


def test_slot_attention_matches_algorithm1():
    torch.manual_seed(10)
    keys = torch.randn(2, 6, 4, dtype=DOUBLE, requires_grad=True)
    values = torch.randn(2, 6, 3, dtype=DOUBLE, requires_grad=True)
    slots = torch.randn(2, 3, 3, dtype=DOUBLE)
    to_query = torch.randn(3, 4, dtype=DOUBLE)
    mix = torch.randn(3, 3, dtype=DOUBLE) * 0.5

    def query(s):
        return torch.tanh(s) @ to_query

    def update(u, prev):
        return torch.tanh(u @ mix + prev)

    out, attention = slot_attention(keys, values, slots, query=query, update=update, iterations=3)
    refs = [slot_loop(keys[n], values[n], slots[n], query, update, 3) for n in range(2)]
    ref_out = torch.stack([s for s, _ in refs])
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)  # the paper's eps on the weights
    torch.testing.assert_close(attention, torch.stack([a for _, a in refs]), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(attention.sum(-2), torch.ones(2, 6, dtype=DOUBLE))
    grads = torch.autograd.grad(out.sum(), [keys, values])
    ref_grads = torch.autograd.grad(ref_out.sum(), [keys, values])
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, DOUBLE])
def test_a_slot_every_input_left_takes_the_mean_of_the_values(dtype):
    """Its weights summed to 8e-9, under float32's epsilon, where the denominator was clamped: the
    "mean" of values 1 to 4 came out 0.17. Algorithm 1's eps on each weight gives their mean."""
    keys = torch.ones(1, 4, 1, dtype=dtype)
    values = torch.tensor([[[1.0], [2.0], [3.0], [4.0]]], dtype=dtype)
    slots = torch.tensor([[[-20.0], [0.0]]], dtype=dtype)  # slot 0 loses every input to slot 1
    out, attention = slot_attention(keys, values, slots, query=lambda s: s, update=lambda u, p: u,
                                    iterations=1, scale=1.0)
    assert float(attention[0, 0].sum()) < 1e-8
    weights = attention[0, 0] + 1e-8
    expected = (weights * values[0, :, 0]).sum() / weights.sum()
    torch.testing.assert_close(out[0, 0, 0], expected)
    assert 1.0 <= float(out[0, 0, 0]) <= 4.0


def test_slot_attention_ignores_masked_inputs():
    torch.manual_seed(11)
    keys, values = torch.randn(1, 5, 4), torch.randn(1, 5, 4)
    slots = torch.randn(1, 2, 4)
    mask = torch.tensor([[True, True, True, False, False]])

    def update(u, prev):
        return u + prev

    masked, attention = slot_attention(keys, values, slots, query=lambda s: s, update=update, mask=mask)
    short, _ = slot_attention(keys[:, :3], values[:, :3], slots, query=lambda s: s, update=update)
    torch.testing.assert_close(masked, short)
    assert torch.equal(attention[..., 3:], torch.zeros(1, 2, 2))
    with pytest.raises(ValueError, match="mask"):
        slot_attention(keys, values, slots, query=lambda s: s, update=update, mask=mask.float())


def test_slot_routing_matches_a_loop():
    torch.manual_seed(12)
    votes = torch.randn(2, 3, 5, 4, dtype=DOUBLE, requires_grad=True)  # (b, out, in, d)
    slots = torch.randn(3, 4, dtype=DOUBLE)

    def update(means, prev):
        return 0.5 * means + prev

    out, couplings = slot_routing(votes, slots, query=torch.tanh, update=update, iterations=3)
    expected_out, expected_couplings = [], []
    for n in range(2):
        current = slots
        for _ in range(3):
            q = torch.tanh(current)
            paper_votes = rearrange(votes[n], "o i d -> i o d")  # the paper's (in, out)
            logits = torch.einsum("jd,ijd->ij", q, paper_votes) / 2.0  # (in, out), scale 1/sqrt(4)
            c = torch.softmax(logits, dim=1)  # over the output capsules
            w = c + 1e-8  # Locatello et al. 2020, Algorithm 1: the weighted mean's eps
            means = torch.einsum("ij,ijd->jd", w, paper_votes) / w.sum(0).unsqueeze(-1)
            current = update(means, current)
        expected_out.append(current)
        expected_couplings.append(rearrange(c, "i o -> o i"))
    expected_out, expected_couplings = torch.stack(expected_out), torch.stack(expected_couplings)
    torch.testing.assert_close(out, expected_out, rtol=1e-12, atol=1e-12)  # eps left out: 3e-8 off
    torch.testing.assert_close(couplings, expected_couplings, rtol=1e-12, atol=1e-12)
    # and the gradients of both, through every pass
    ramp = torch.linspace(0, 1, 5, dtype=DOUBLE)
    ours = torch.autograd.grad(out.pow(2).sum() + (couplings * ramp).sum(), votes)[0]
    loop = torch.autograd.grad(expected_out.pow(2).sum() + (expected_couplings * ramp).sum(), votes)[0]
    torch.testing.assert_close(ours, loop, rtol=1e-10, atol=1e-12)


def test_routing_arguments_that_do_not_fit_the_votes_are_named():
    torch.manual_seed(13)
    votes = torch.randn(2, 3, 5, 4)  # (b, out, in, d)

    def update(means, prev):
        return means + prev

    with pytest.raises(ValueError, match=r"normalization must be one of .* got 'bogus'"):
        inverted_dot_product_routing(votes, normalization="bogus")
    with pytest.raises(ValueError, match="nonlinearity must be one of"):
        self_attention_routing(votes, nonlinearity="bogus")
    with pytest.raises(ValueError, match=r"log_prior must broadcast to \(batch\.\.\., out_caps, in_caps\) = "
                                         r"\(2, 3, 5\), got \(7, 3, 5\)"):
        self_attention_routing(votes, log_prior=torch.zeros(7, 3, 5))
    with pytest.raises(TypeError, match="log_prior has dtype torch.float64"):
        self_attention_routing(votes, log_prior=torch.zeros(3, 5, dtype=DOUBLE))
    with pytest.raises(ValueError, match=r"slots must broadcast to \(batch\.\.\., out_caps, out_dim\) = "
                                         r"\(2, 3, 4\), got \(7, 4\)"):
        slot_routing(votes, torch.randn(7, 4), query=lambda s: s, update=update)
    with pytest.raises(ValueError, match="query"):
        slot_routing(votes, torch.randn(3, 4), query=lambda s: s[..., :2], update=update)
    with pytest.raises(TypeError, match="slots has dtype torch.float64"):
        slot_routing(votes, torch.randn(3, 4, dtype=DOUBLE), query=lambda s: s, update=update)
    keys, values = torch.randn(2, 5, 4), torch.randn(2, 5, 4)
    with pytest.raises(ValueError, match=r"slots must have shape \(batch\.\.\., num_slots, slot_dim\) with "
                                         r"batch axes that broadcast to the keys' \(2,\), got \(3, 3, 4\)"):
        slot_attention(keys, values, torch.randn(3, 3, 4), query=lambda s: s, update=update)
    with pytest.raises(TypeError, match="values has dtype torch.float64"):
        slot_attention(keys, values.double(), torch.randn(2, 3, 4), query=lambda s: s, update=update)
    shared = slot_attention(keys, values, torch.randn(3, 4), query=lambda s: s, update=update)[0]
    assert shared.shape == (2, 3, 4)  # slots shared by the batch still broadcast


def test_shared_initial_slots_reach_a_gru_update_with_the_batchs_shape():
    """Initial slots given once for the batch ((out_caps, dim), as documented: broadcastable)
    reached update unbroadcast on the first pass, and a GRUCell update, the documented one,
    failed inside torch ("Input batch size 6 doesn't match hidden0 batch size 3")."""
    torch.manual_seed(3)
    gru = torch.nn.GRUCell(4, 4)

    def update(means, previous):  # (b, i, d), (b, i, d): GRUCell over the b * i rows
        assert means.shape == previous.shape
        return gru(means.flatten(0, 1), previous.flatten(0, 1)).view_as(previous)

    votes, slots = torch.randn(2, 3, 5, 4), torch.randn(3, 4)
    out, _ = slot_routing(votes, slots, query=lambda s: s, update=update, iterations=2)
    expanded, _ = slot_routing(votes, slots.expand(2, 3, 4), query=lambda s: s, update=update, iterations=2)
    torch.testing.assert_close(out, expanded)
    keys, values = torch.randn(2, 5, 4), torch.randn(2, 5, 4)
    out, _ = slot_attention(keys, values, slots, query=lambda s: s, update=update, iterations=2)
    expanded, _ = slot_attention(keys, values, slots.expand(2, 3, 4), query=lambda s: s, update=update,
                                 iterations=2)
    torch.testing.assert_close(out, expanded)
