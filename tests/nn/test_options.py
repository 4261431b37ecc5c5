"""Every constructor option of every router and capsule layer takes effect.

Each option is set to a non-default value and the module is compared with the functional
reference (itself tested against the papers' loops in ``tests/functional``) called with that
value; each test also checks that the value changes the result, so an option the module ignored
would fail it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchvote.functional import squash
from torchvote.functional.em import em_routing
from torchvote.functional.routing import (
    dynamic_routing,
    inverted_dot_product_routing,
    self_attention_routing,
    slot_attention,
    slot_routing,
    uniform_routing,
)
from torchvote.nn import (
    CapsuleLinear,
    ClassMatrixCapsules,
    ConvMatrixCapsules,
    DynamicRouter,
    EMRouter,
    InvertedDotProductRouter,
    MatrixCapsules,
    PrimaryCapsules,
    PrimaryMatrixCapsules,
    SelfAttentionRouter,
    SlotAttention,
    SlotRouter,
    UniformRouter,
)

DOUBLE = torch.float64


def votes(seed: int = 0, out_caps: int = 3, in_caps: int = 5, dim: int = 4, scale: float = 1.0):
    generator = torch.Generator().manual_seed(seed)
    tensor = torch.randn(2, out_caps, in_caps, dim, generator=generator, dtype=DOUBLE) * scale
    return tensor.requires_grad_(True)


def randomize(module: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """Non-zero values for every parameter (zeros would hide an ignored bias or prior)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * 0.5)
    return module


def assert_differs(a: torch.Tensor, b: torch.Tensor) -> None:
    assert not torch.allclose(a, b), "the option changes nothing here: the test could not see it ignored"


def grad(outputs: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    return torch.autograd.grad(outputs.pow(2).sum(), leaf, retain_graph=True)[0]


# --- routers ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("agreement", ["dot", "distance"])
def test_dynamic_router_options(agreement):
    router = randomize(DynamicRouter(iterations=2, agreement=agreement, detach_votes=True, bias=True,
                                     out_caps=3, out_dim=4, dtype=DOUBLE))
    u = votes(scale=0.5)
    got = router(u)
    outputs, couplings = dynamic_routing(u, iterations=2, agreement=agreement, detach_votes=True,
                                         bias=router.bias)
    torch.testing.assert_close(got.outputs, outputs)
    torch.testing.assert_close(got.couplings, couplings)
    torch.testing.assert_close(grad(got.outputs, u), grad(outputs, u))  # detach_votes: the gradient
    plain = dynamic_routing(u, iterations=2, agreement=agreement, detach_votes=True)[0]
    assert_differs(got.outputs, plain)  # the bias
    assert_differs(got.outputs, dynamic_routing(u, iterations=3, agreement=agreement, bias=router.bias)[0])
    attached = dynamic_routing(u, iterations=2, agreement=agreement, bias=router.bias)[0]
    assert_differs(grad(got.outputs, u), grad(attached, u))  # detach_votes
    other = "dot" if agreement == "distance" else "distance"
    assert_differs(got.outputs, dynamic_routing(u, iterations=2, agreement=other, bias=router.bias)[0])


@pytest.mark.parametrize("nonlinearity", ["identity", "layer_norm", "efficient_squash"])
def test_uniform_router_options(nonlinearity):
    router = randomize(UniformRouter(nonlinearity=nonlinearity, bias=True, out_caps=3, out_dim=4,
                                     dtype=DOUBLE))
    u = votes()
    got = router(u)
    outputs, couplings = uniform_routing(u, nonlinearity=nonlinearity, bias=router.bias)
    torch.testing.assert_close(got.outputs, outputs)
    torch.testing.assert_close(got.couplings, couplings)
    assert_differs(got.outputs, uniform_routing(u, nonlinearity=nonlinearity)[0])  # the bias
    assert_differs(got.outputs, uniform_routing(u, bias=router.bias)[0])  # the nonlinearity


@pytest.mark.parametrize("schedule", [[0.3, 0.8], lambda t: 0.5 * (t + 1), 0.4])
def test_em_router_options(schedule):
    router = randomize(EMRouter(out_caps=3, iterations=2, inverse_temperature=schedule, eps=1e-2,
                                dtype=DOUBLE))
    u = votes(scale=2.0)
    activations = torch.rand(2, 5, generator=torch.Generator().manual_seed(2), dtype=DOUBLE)
    got = router(u, activations=activations)
    poses, out_activations, assignments = em_routing(
        u, activations, router.beta_u, router.beta_a, iterations=2, inverse_temperature=schedule,
        eps=1e-2, return_assignments=True,
    )
    torch.testing.assert_close(got.outputs, poses)
    torch.testing.assert_close(got.activations, out_activations)
    torch.testing.assert_close(got.couplings, assignments)
    default = EMRouter(out_caps=3, dtype=DOUBLE)
    default.load_state_dict(router.state_dict())
    assert_differs(got.activations, default(u, activations=activations).activations)
    for changed in ({"iterations": 3, "inverse_temperature": 0.4},
                    {"iterations": 2, "inverse_temperature": schedule, "eps": 1e-6},
                    {"iterations": 2, "inverse_temperature": 0.05, "eps": 1e-2}):
        options = {"eps": 1e-2, **changed}
        other = em_routing(u, activations, router.beta_u, router.beta_a, **options)[1]
        assert_differs(got.activations, other)


@pytest.mark.parametrize("elementwise_affine", [False, True])
def test_inverted_dot_product_router_options(elementwise_affine):
    router = randomize(InvertedDotProductRouter(out_dim=4, iterations=2,
                                                elementwise_affine=elementwise_affine, dtype=DOUBLE))
    u = votes()
    got = router(u)

    def norm(s: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(s, (4,), router.norm.weight, router.norm.bias)

    outputs, couplings = inverted_dot_product_routing(u, iterations=2, normalization=norm)
    torch.testing.assert_close(got.outputs, outputs)
    torch.testing.assert_close(got.couplings, couplings)
    assert_differs(got.couplings, inverted_dot_product_routing(u, iterations=3, normalization=norm)[1])
    assert (router.norm.weight is not None) == elementwise_affine
    if elementwise_affine:
        assert_differs(got.outputs, inverted_dot_product_routing(u, iterations=2)[0])


@pytest.mark.parametrize("log_prior", [False, True])
def test_self_attention_router_options(log_prior):
    router = randomize(SelfAttentionRouter(in_caps=5, out_caps=3, log_prior=log_prior, dtype=DOUBLE))
    u = votes()
    got = router(u)
    outputs, couplings = self_attention_routing(u, log_prior=router.log_prior)
    torch.testing.assert_close(got.outputs, outputs)
    torch.testing.assert_close(got.couplings, couplings)
    assert (router.log_prior is None) == (not log_prior)
    if log_prior:
        assert_differs(got.outputs, self_attention_routing(u)[0])


def test_slot_router_options():
    router = randomize(SlotRouter(out_caps=3, out_dim=4, iterations=2, hidden_dim=5, dtype=DOUBLE))
    assert router.update.mlp[0].out_features == 5  # hidden_dim
    u = votes()

    def query(slots: torch.Tensor) -> torch.Tensor:
        return router.to_query(router.norm(slots))

    # Algorithm 1's layer norm of the inputs, here each vote over its features, by hand
    centred = u - u.mean(-1, keepdim=True)
    normed = centred / (centred.pow(2).mean(-1, keepdim=True) + router.norm_votes.eps).sqrt()
    normed = normed * router.norm_votes.weight + router.norm_votes.bias
    got = router(u)
    slots, couplings = slot_routing(normed, router.initial_slots, query=query, update=router.update,
                                    iterations=2)
    squared = slots.pow(2).sum(-1, keepdim=True)  # Sabour et al. 2017, eq. 1
    torch.testing.assert_close(got.outputs, squared / (1 + squared) * slots / squared.sqrt())
    torch.testing.assert_close(got.couplings, couplings)
    assert (got.outputs.norm(dim=-1) < 1).all()
    longer = slot_routing(normed, router.initial_slots, query=query, update=router.update, iterations=3)[0]
    assert_differs(got.outputs, squash(longer))

    plain = randomize(SlotRouter(out_caps=3, out_dim=4, iterations=2, hidden_dim=5, normalize_votes=False,
                                 squash_outputs=False, dtype=DOUBLE))
    assert plain.norm_votes is None and not any("norm_votes" in name for name in plain.state_dict())
    outputs, couplings = slot_routing(u, plain.initial_slots, query=lambda s: plain.to_query(plain.norm(s)),
                                      update=plain.update, iterations=2)
    torch.testing.assert_close(plain(u).outputs, outputs)
    torch.testing.assert_close(plain(u).couplings, couplings)
    with pytest.raises(TypeError, match="normalize_votes"):
        SlotRouter(out_caps=3, out_dim=4, normalize_votes="no")
    with pytest.raises(TypeError, match="squash_outputs"):
        SlotRouter(out_caps=3, out_dim=4, squash_outputs=1)


def test_slot_router_sees_votes_of_any_scale():
    """The layer norm makes the slots a function of the votes' directions, not their scale: votes
    ten times larger give the same capsules (the layer norm's eps aside). Without it, the small
    votes of a fresh capsule layer left the slots at their learned initial values."""
    router = SlotRouter(out_caps=3, out_dim=4, iterations=3, dtype=DOUBLE)
    u = votes()
    torch.testing.assert_close(router(u * 10).outputs, router(u).outputs, rtol=1e-4, atol=1e-5)
    tiny, other = router(u * 1e-3).outputs, router(votes(seed=5) * 1e-3).outputs
    assert (tiny - other).norm(dim=-1).min() > 1e-2  # the capsules still differ with the votes


def test_slot_attention_options():
    module = randomize(SlotAttention(2, 5, slot_dim=6, iterations=2, hidden_dim=7, dtype=DOUBLE))
    assert module.num_slots == 2 and module.update.mlp[0].out_features == 7
    inputs = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(3), dtype=DOUBLE)
    slots = module.initial_slots(3, 2)
    assert slots.shape == (3, 2, 6)
    got, attention = module(inputs, slots=slots, return_attention=True)
    normed = module.norm_inputs(inputs)

    def query(s: torch.Tensor) -> torch.Tensor:
        return module.to_query(module.norm_slots(s))

    keys, values = module.to_key(normed), module.to_value(normed)
    expected, expected_attention = slot_attention(keys, values, slots, query=query, update=module.update,
                                                  iterations=2)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(attention, expected_attention)
    longer = slot_attention(keys, values, slots, query=query, update=module.update, iterations=3)[0]
    assert_differs(got, longer)


# --- capsule layers -------------------------------------------------------------------------------------


def test_capsule_linear_options():
    torch.manual_seed(4)
    layer = CapsuleLinear(6, 3, 4, 5, iterations=2, shared_weights=True, init_std=0.5,
                          router_options={"agreement": "distance", "detach_votes": True, "bias": True},
                          dtype=DOUBLE)
    assert layer.weight.shape == (4, 5, 3)  # shared_weights: one matrix per output capsule
    assert 0.35 < float(layer.weight.detach().std()) < 0.65  # init_std
    randomize(layer.router)
    inputs = torch.randn(2, 6, 3, dtype=DOUBLE, requires_grad=True)
    got = layer(inputs, return_routing=True)
    u = torch.einsum("ide,bje->bijd", layer.weight, inputs)  # (b, out, in, d)
    outputs, couplings = dynamic_routing(u, iterations=2, agreement="distance", detach_votes=True,
                                         bias=layer.router.bias)
    torch.testing.assert_close(got.outputs, outputs)
    torch.testing.assert_close(got.couplings, couplings)
    torch.testing.assert_close(grad(got.outputs, inputs), grad(outputs, inputs))
    assert_differs(got.outputs, dynamic_routing(u, iterations=3, agreement="distance",
                                                bias=layer.router.bias)[0])


def test_primary_capsules_options():
    torch.manual_seed(5)
    layer = PrimaryCapsules(2, 3, 4, kernel_size=3, stride=2, padding=1, dtype=DOUBLE)
    images = torch.randn(2, 2, 7, 6, dtype=DOUBLE)
    maps = F.conv2d(images, layer.conv.weight, layer.conv.bias, stride=2, padding=1)  # (b, t*d, h, w)
    assert layer.output_size(7, 6) == maps.shape[-2:] == (4, 3)
    expected = maps.view(2, 3, 4, 4, 3).permute(0, 1, 3, 4, 2).reshape(2, -1, 4)  # (b, t h w, d)
    torch.testing.assert_close(layer(images), squash(expected))


def test_primary_matrix_capsules_options():
    torch.manual_seed(6)
    layer = PrimaryMatrixCapsules(3, 2, pose_dim=9, kernel_size=3, stride=2, dtype=DOUBLE)
    features = torch.randn(2, 3, 7, 7, dtype=DOUBLE)
    capsules = layer(features)
    assert capsules.poses.shape == (2, 3, 3, 2, 3, 3) and capsules.activations.shape == (2, 3, 3, 2)
    pose_maps = F.conv2d(features, layer.pose.weight, layer.pose.bias, stride=2)  # (b, t*9, 3, 3)
    act_maps = F.conv2d(features, layer.activation.weight, layer.activation.bias, stride=2)
    torch.testing.assert_close(capsules.poses[1, 2, 0, 1].flatten(), pose_maps[1, 9:18, 2, 0])
    torch.testing.assert_close(capsules.activations[1, 2, 0, 1], torch.sigmoid(act_maps[1, 1, 2, 0]))


def matrix_grid(rows: int, cols: int, types: int, side: int, seed: int = 7) -> MatrixCapsules:
    generator = torch.Generator().manual_seed(seed)
    poses = torch.randn(2, rows, cols, types, side, side, generator=generator, dtype=DOUBLE)
    activations = torch.rand(2, rows, cols, types, generator=generator, dtype=DOUBLE)
    return MatrixCapsules(poses, activations)


EM_OPTIONS = {"iterations": 2, "inverse_temperature": [0.2, 0.6], "eps": 1e-2}


def test_conv_matrix_capsules_options():
    layer = ConvMatrixCapsules(2, 3, kernel_size=2, stride=1, pose_dim=9, dtype=DOUBLE, **EM_OPTIONS)
    randomize(layer.routing)
    capsules = matrix_grid(3, 4, 2, 3)
    out = layer(capsules)
    assert out.poses.shape == (2, 2, 3, 3, 3, 3)  # kernel 2, stride 1 on 3x4; 3x3 poses
    u, activations, _ = layer.votes(capsules)  # (b, L, i, j, 9), (b, L, j)
    groups = layer.sender_groups(3, 4)  # joint normalisation, the default
    poses, out_activations = em_routing(u, activations, layer.routing.beta_u, layer.routing.beta_a,
                                        sender_groups=groups, **EM_OPTIONS)
    torch.testing.assert_close(out.poses.flatten(-2), poses.view(2, 2, 3, 3, 9))
    torch.testing.assert_close(out.activations, out_activations.view(2, 2, 3, 3))
    for changed in ({"iterations": 3, "inverse_temperature": 0.6}, {"inverse_temperature": [0.2, 0.05]},
                    {"eps": 1e-6}, {"sender_groups": None}):
        other = em_routing(u, activations, layer.routing.beta_u, layer.routing.beta_a,
                           **{**EM_OPTIONS, "sender_groups": groups, **changed})[1]
        assert_differs(out.activations, other.view(2, 2, 3, 3))
    per_patch = ConvMatrixCapsules(2, 3, kernel_size=2, stride=1, pose_dim=9, dtype=DOUBLE,
                                   normalization="per_patch", **EM_OPTIONS)
    per_patch.load_state_dict(layer.state_dict())
    torch.testing.assert_close(per_patch(capsules).activations,
                               em_routing(u, activations, layer.routing.beta_u, layer.routing.beta_a,
                                          **EM_OPTIONS)[1].view(2, 2, 3, 3))
    with pytest.raises(ValueError, match="normalization"):
        ConvMatrixCapsules(2, 3, normalization="patch")


@pytest.mark.parametrize("coordinate_addition", [False, True])
def test_class_matrix_capsules_options(coordinate_addition):
    layer = ClassMatrixCapsules(2, 3, pose_dim=9, coordinate_addition=coordinate_addition, dtype=DOUBLE,
                                **EM_OPTIONS)
    randomize(layer.routing)
    capsules = matrix_grid(2, 3, 2, 3)
    out = layer(capsules)
    assert out.poses.shape == (2, 3, 3, 3)
    u, activations = layer.votes(capsules)  # (b, i, j, 9), (b, j)
    plain = torch.einsum("bhwtpq,tiqr->bihwtpr", capsules.poses, layer.weight).flatten(-2).flatten(2, 4)
    if coordinate_addition:
        assert_differs(u, plain)
    else:
        torch.testing.assert_close(u, plain)
    poses, out_activations = em_routing(u, activations, layer.routing.beta_u, layer.routing.beta_a,
                                        **EM_OPTIONS)
    torch.testing.assert_close(out.poses.flatten(-2), poses)
    torch.testing.assert_close(out.activations, out_activations)
    for changed in ({"iterations": 3, "inverse_temperature": 0.6}, {"inverse_temperature": [0.2, 0.05]},
                    {"eps": 1e-6}):
        other = em_routing(u, activations, layer.routing.beta_u, layer.routing.beta_a,
                           **{**EM_OPTIONS, **changed})[1]
        assert_differs(out.activations, other)
