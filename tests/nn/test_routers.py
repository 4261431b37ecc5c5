"""Router modules and the standalone SlotAttention against Algorithm 1 written as a loop."""

from __future__ import annotations

import math

import pytest
import torch

from torchvote.functional.routing import list_routers
from torchvote.functional.routing_votes import LinearVotes
from torchvote.nn.routers import EMRouter, RoutingResult, SlotAttention, make_router

DOUBLE = torch.float64


@pytest.mark.parametrize("name", sorted(list_routers()))
def test_every_router_accepts_tensors_and_votes_objects(name):
    torch.manual_seed(0)
    router = make_router(name, in_caps=6, out_caps=3, out_dim=4, iterations=2).double()
    weight = torch.randn(3, 6, 4, 2, dtype=DOUBLE, requires_grad=True)
    inputs = torch.randn(2, 6, 2, dtype=DOUBLE)
    from_votes = router(LinearVotes(weight, inputs))
    tensor = torch.einsum("ijde,bje->bijd", weight, inputs)  # (b, out, in, d)
    from_tensor = router(tensor)
    assert isinstance(from_votes, RoutingResult)
    torch.testing.assert_close(from_votes.outputs, from_tensor.outputs)
    torch.testing.assert_close(from_votes.couplings, from_tensor.couplings)
    assert from_votes.outputs.shape == (2, 3, 4) and from_votes.couplings.shape == (2, 3, 6)
    assert (from_votes.activations is not None) == (name == "em")
    from_votes.outputs.sum().backward()
    assert torch.isfinite(weight.grad).all()


def test_make_router_rejects_unknown_names_and_options():
    with pytest.raises(ValueError, match="routing must be one of"):
        make_router("capsule", in_caps=2, out_caps=2, out_dim=2)
    with pytest.raises(ValueError, match="bad option"):
        make_router("uniform", in_caps=2, out_caps=2, out_dim=2, agreement="dot")
    with pytest.raises(ValueError, match="agreement"):
        make_router("dynamic", in_caps=2, out_caps=2, out_dim=2, agreement="cosine")


def test_em_router_uses_the_given_activations():
    router = EMRouter(out_caps=3, inverse_temperature=lambda t: 1.0)
    torch.manual_seed(3)
    votes = torch.randn(2, 3, 5, 16) * 2  # (b, out, in, pose), spread enough not to saturate
    default = router(votes)
    ones = router(votes, activations=torch.ones(2, 5))
    torch.testing.assert_close(default.outputs, ones.outputs)
    halved = router(votes, activations=torch.full((2, 5), 0.5))
    assert not torch.allclose(halved.activations, ones.activations)


def test_em_router_gradients_after_a_partial_gradient():
    """Issue 8's bug through the module: the beta / votes gradients after a partial
    ``autograd.grad`` on the activations (retain_graph) equal a fresh full gradient."""
    torch.manual_seed(4)
    router = EMRouter(out_caps=3, inverse_temperature=lambda t: 0.5 * (t + 1), dtype=DOUBLE)
    votes = torch.randn(2, 3, 5, 4, dtype=DOUBLE, requires_grad=True)
    activations = torch.rand(2, 5, dtype=DOUBLE, requires_grad=True)
    result = router(votes, activations=activations)
    loss = (result.outputs * torch.randn_like(result.outputs)).sum() + (result.activations * 3).sum()
    leaves = [votes, router.beta_u, router.beta_a]
    fresh = torch.autograd.grad(loss, [activations, *leaves], retain_graph=True)
    torch.autograd.grad(loss, [activations], retain_graph=True)
    for g, r in zip(torch.autograd.grad(loss, leaves), fresh[1:], strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("strategy", ["vectorized", "blocked"])
def test_em_router_strategy(strategy):
    from torchvote.functional.em import em_routing

    router = EMRouter(out_caps=3, strategy=strategy, dtype=DOUBLE)
    assert f"strategy={strategy!r}" in repr(router)
    votes = torch.randn(2, 3, 5, 4, dtype=DOUBLE, requires_grad=True)
    result = router(votes)
    poses, acts = em_routing(votes, torch.ones(2, 5, dtype=DOUBLE), router.beta_u, router.beta_a)
    torch.testing.assert_close(result.outputs, poses)
    torch.testing.assert_close(result.activations, acts)
    if strategy == "vectorized":  # the strategy in use shows: only it is twice differentiable
        assert torch.autograd.grad(result.activations.sum(), votes, create_graph=True)[0].requires_grad
    else:
        with pytest.raises(RuntimeError, match="differentiated once only"):
            torch.autograd.grad(result.activations.sum(), votes, create_graph=True)
    with pytest.raises(ValueError, match="strategy"):
        EMRouter(out_caps=3, strategy="fast")


def algorithm1(module: SlotAttention, inputs, slots, iterations, eps=1e-8):
    """Locatello et al. 2020, Algorithm 1 for one example, with the module's own parameters."""
    inputs = module.norm_inputs(inputs)
    k, v = module.to_key(inputs), module.to_value(inputs)  # (N, D)
    n_in, n_slots, dim = inputs.shape[0], slots.shape[0], slots.shape[-1]
    attn = None
    for _ in range(iterations):
        slots_prev = slots
        q = module.to_query(module.norm_slots(slots))
        logits = [[(k[j] * q[i]).sum() / math.sqrt(dim) for i in range(n_slots)] for j in range(n_in)]
        attn = torch.stack([torch.softmax(torch.stack(row), 0) for row in logits], dim=1)  # over slots
        updates = []
        for i in range(n_slots):
            w = attn[i] + eps
            updates.append(sum(w[j] * v[j] for j in range(n_in)) / w.sum())
        slots = module.update.gru(torch.stack(updates), slots_prev)
        slots = slots + module.update.mlp(module.update.norm(slots))
    return slots, attn


def test_slot_attention_module_matches_algorithm1():
    torch.manual_seed(1)
    module = SlotAttention(3, 5, slot_dim=6, iterations=3, hidden_dim=8).double()
    inputs = torch.randn(2, 7, 5, dtype=DOUBLE)
    slots = module.initial_slots(2, 3)
    out, attention = module(inputs, slots=slots, return_attention=True)
    for n in range(2):
        ref, ref_attn = algorithm1(module, inputs[n], slots[n], 3)
        torch.testing.assert_close(out[n], ref, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(attention[n], ref_attn, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(attention.sum(-2), torch.ones(2, 7, dtype=DOUBLE))


def test_slot_attention_module_samples_slots_and_takes_masks():
    torch.manual_seed(2)
    module = SlotAttention(4, 5, slot_dim=8)
    inputs = torch.randn(3, 6, 5)
    assert module(inputs).shape == (3, 4, 8)
    assert module(inputs, num_slots=2).shape == (3, 2, 8)
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[:, 4:] = False
    slots = module.initial_slots(3, 4)
    masked = module(inputs, slots=slots, mask=mask)
    torch.testing.assert_close(masked, module(inputs[:, :4], slots=slots))
    masked.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in module.parameters() if p.grad is not None)
    with pytest.raises(ValueError, match="inputs"):
        module(torch.randn(3, 6, 4))
    with pytest.raises(ValueError, match="num_slots"):
        SlotAttention(0, 5)


def test_self_attention_router_loads_a_papers_layout_log_prior():
    """Checkpoints from before the receivers-first layout hold an (in_caps, out_caps) prior."""
    from torchvote.nn import SelfAttentionRouter

    router = SelfAttentionRouter(in_caps=6, out_caps=3)
    old = torch.randn(6, 3)
    router.load_state_dict({"log_prior": old})
    torch.testing.assert_close(router.log_prior.detach(), old.T)
    new = torch.randn(3, 6)
    router.load_state_dict({"log_prior": new})
    torch.testing.assert_close(router.log_prior.detach(), new)


def test_routers_declare_whether_they_iterate_and_use_activations():
    from torchvote.nn import ClassMatrixCapsules, ConvMatrixCapsules

    expected = {"dynamic": (True, False), "em": (True, True), "inverted_dot_product": (True, False),
                "self_attention": (False, False), "slot": (True, False), "uniform": (False, False)}
    assert set(expected) == set(list_routers())
    for name, (iterative, uses_activations) in expected.items():
        router = make_router(name, in_caps=4, out_caps=3, out_dim=4)
        assert (router.name, router.iterative, router.uses_activations) == (name, iterative, uses_activations)
    # One EM module for every layer that routes by EM.
    assert isinstance(ConvMatrixCapsules(2, 3).routing, EMRouter)
    assert isinstance(ClassMatrixCapsules(2, 3).routing, EMRouter)
