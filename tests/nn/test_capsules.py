"""PrimaryCapsules and CapsuleLinear against loops and the functional routers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import routing_passes
from torchvote.functional import squash
from torchvote.functional.em import em_routing
from torchvote.functional.routing import (
    dynamic_routing,
    inverted_dot_product_routing,
    list_routers,
    self_attention_routing,
    slot_routing,
    uniform_routing,
)
from torchvote.nn.capsules import CapsuleLinear, PrimaryCapsules, check_feature_maps
from torchvote.nn.routers import DynamicRouter, make_router

DOUBLE = torch.float64


def test_primary_capsules_group_channels_at_one_position():
    torch.manual_seed(0)
    layer = PrimaryCapsules(3, num_types=4, caps_dim=5, kernel_size=3, stride=2).double()
    images = torch.randn(2, 3, 11, 9, dtype=DOUBLE)
    capsules = layer(images)
    rows, cols = layer.output_size(11, 9)
    assert capsules.shape == (2, layer.num_capsules(11, 9), 5) == (2, 4 * rows * cols, 5)
    maps = layer.conv(images)  # (b, types * dim, rows, cols)
    for b in range(2):
        for t in range(4):
            for r in range(rows):
                for c in range(cols):
                    vector = maps[b, t * 5 : (t + 1) * 5, r, c]  # the channels of one position
                    index = (t * rows + r) * cols + c
                    torch.testing.assert_close(capsules[b, index], squash(vector))
    assert bool((capsules.norm(dim=-1) < 1).all())


def test_primary_capsules_derive_their_count_from_the_input():
    layer = PrimaryCapsules(256, 32, 8)  # Sabour et al.: 9x9, stride 2 on 20x20 -> 32 x 6 x 6
    assert layer.num_capsules(20, 20) == 1152
    with pytest.raises(ValueError, match="caps_dim"):
        PrimaryCapsules(3, 4, 0)


def votes_of(layer: CapsuleLinear, inputs: torch.Tensor) -> torch.Tensor:
    """The layer's votes by einsum, receivers first (batch, out_caps, in_caps, out_dim)."""
    if layer.shared_weights:
        return torch.einsum("ide,bje->bijd", layer.weight, inputs)
    return torch.einsum("ijde,bje->bijd", layer.weight, inputs)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("routing", sorted(list_routers()))
def test_capsule_linear_equals_its_router_on_materialised_votes(routing, shared):
    torch.manual_seed(1)
    passes = routing_passes(routing, 3)  # unset for a one-pass router
    layer = CapsuleLinear(6, 3, 4, 5, routing=routing, iterations=passes, shared_weights=shared,
                          init_std=0.5).double()
    inputs = torch.randn(2, 6, 3, dtype=DOUBLE)
    result = layer(inputs, return_routing=True)
    votes = votes_of(layer, inputs)
    router = layer.router
    if routing == "dynamic":
        expected = dynamic_routing(votes, iterations=3)
    elif routing == "uniform":
        expected = uniform_routing(votes)
    elif routing == "inverted_dot_product":
        expected = inverted_dot_product_routing(votes, iterations=3, normalization=router.norm)
    elif routing == "self_attention":
        expected = self_attention_routing(votes, log_prior=router.log_prior)
    elif routing == "slot":
        slots, couplings = slot_routing(router.norm_votes(votes), router.initial_slots,
                                        query=lambda s: router.to_query(router.norm(s)), update=router.update)
        expected = (squash(slots, dim=-1), couplings)
    else:
        poses, activations, assignments = em_routing(votes, torch.ones(2, 6, dtype=DOUBLE), router.beta_u,
                                                     router.beta_a, return_assignments=True)
        expected = (poses, assignments)
        torch.testing.assert_close(result.activations, activations)
    torch.testing.assert_close(result.outputs, expected[0])
    torch.testing.assert_close(result.couplings, expected[1])
    assert result.outputs.shape == (2, 4, 5) and result.couplings.shape == (2, 4, 6)
    torch.testing.assert_close(result.couplings.sum(-2), torch.ones(2, 6, dtype=DOUBLE))
    (result.outputs.sum() + (0 if result.activations is None else result.activations.sum())).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all()
               for p in layer.parameters() if p.requires_grad and p.grad is not None)
    assert layer.weight.grad is not None


def test_capsule_linear_returns_outputs_by_default_and_takes_extra_batch_dims():
    layer = CapsuleLinear(5, 2, 3, 4)
    assert layer(torch.randn(7, 5, 2)).shape == (7, 3, 4)
    assert layer(torch.randn(2, 3, 5, 2)).shape == (2, 3, 3, 4)


def test_capsule_linear_router_options_and_instances():
    layer = CapsuleLinear(5, 2, 3, 4, router_options={"agreement": "distance", "bias": True})
    assert layer.router.agreement == "distance" and layer.router.bias.shape == (3, 4)
    custom = DynamicRouter(iterations=2, detach_votes=True)
    assert CapsuleLinear(5, 2, 3, 4, routing=custom).router is custom
    with pytest.raises(ValueError, match="routing"):
        CapsuleLinear(5, 2, 3, 4, routing="kmeans")
    with pytest.raises(ValueError, match="option"):
        CapsuleLinear(5, 2, 3, 4, router_options={"temperature": 2.0})
    with pytest.raises(ValueError, match="router_options"):
        CapsuleLinear(5, 2, 3, 4, routing=custom, router_options={"bias": True})


def test_capsule_linear_iterations_reach_a_router_given_by_name_and_never_an_instance():
    """``iterations`` defaults to None (3 for a router built by name); with a Router module, whose
    iterations are its own, an explicit ``iterations=7`` was silently ignored and is now refused."""
    assert CapsuleLinear(5, 2, 3, 4).router.iterations == 3
    assert CapsuleLinear(5, 2, 3, 4, iterations=5).router.iterations == 5
    assert CapsuleLinear(5, 2, 3, 4, routing="slot", iterations=2).router.iterations == 2
    custom = DynamicRouter(iterations=2)
    assert CapsuleLinear(5, 2, 3, 4, routing=custom).router.iterations == 2
    with pytest.raises(ValueError, match="the Router module has its own iterations"):
        CapsuleLinear(5, 2, 3, 4, routing=custom, iterations=7)
    with pytest.raises(ValueError, match="router_options must not set 'iterations'"):
        CapsuleLinear(5, 2, 3, 4, router_options={"iterations": 2})


def test_capsule_linear_rejects_mismatched_inputs():
    layer = CapsuleLinear(5, 2, 3, 4)
    with pytest.raises(ValueError, match="in_caps=5"):
        layer(torch.randn(2, 6, 2))
    with pytest.raises(ValueError, match="in_dim=2"):
        layer(torch.randn(2, 5, 3))
    with pytest.raises(ValueError, match="out_caps"):
        CapsuleLinear(5, 2, 0, 4)
    with pytest.raises(ValueError, match="iterations"):
        CapsuleLinear(5, 2, 3, 4, iterations=0)


def test_capsule_linear_zero_capsules_give_zeros_and_finite_gradients():
    for routing in sorted(list_routers()):
        layer = CapsuleLinear(5, 2, 3, 4, routing=routing)
        inputs = torch.zeros(2, 5, 2, requires_grad=True)
        out = layer(inputs, return_routing=True)
        if routing in ("dynamic", "uniform", "em", "self_attention"):
            assert torch.equal(out.outputs, torch.zeros(2, 3, 4)), routing
        loss = out.outputs.sum() + (0 if out.activations is None else out.activations.sum())
        loss.backward()
        assert torch.isfinite(inputs.grad).all(), routing
        assert torch.isfinite(layer.weight.grad).all(), routing


def test_capsule_linear_follows_the_inputs_dtype():
    layer = CapsuleLinear(5, 2, 3, 4, dtype=DOUBLE)
    assert layer(torch.randn(2, 5, 2, dtype=DOUBLE)).dtype == DOUBLE



@pytest.mark.parametrize("routing", sorted(set(list_routers()) - {"em"}))
def test_capsule_linear_refuses_activations_its_router_would_ignore(routing):
    layer = CapsuleLinear(6, 4, 3, 5, routing=routing)
    assert not layer.router.uses_activations
    with pytest.raises(ValueError, match="activations apply only to routers that use them"):
        layer(torch.randn(2, 6, 4), activations=torch.rand(2, 6))


@pytest.mark.parametrize("strategy", ["materialize", "stream"])
def test_capsule_linear_checks_the_shape_of_activations_its_router_uses(strategy):
    layer = CapsuleLinear(6, 4, 3, 5, routing="em", strategy=strategy)
    inputs = torch.randn(2, 6, 4)
    with pytest.raises(ValueError, match=r"activations must have shape \(batch\.\.\., in_caps\) = \(2, 6\)"):
        layer(inputs, activations=torch.rand(3, 99))
    assert layer(inputs, activations=torch.rand(2, 6)).shape == (2, 3, 5)


@pytest.mark.parametrize("strategy", ["materialize", "stream", "compiled"])
def test_every_strategy_refuses_inputs_the_weights_cannot_take(strategy):
    """Stream once promoted float64 and int64 inputs where materialize failed deep in its einsum."""
    layer = CapsuleLinear(6, 4, 3, 5, strategy=strategy)
    with pytest.raises(TypeError, match="inputs must be a floating-point tensor, got torch.int64"):
        layer(torch.ones(2, 6, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="inputs has dtype torch.float64 but the module's parameters are "
                                        "torch.float32"):
        layer(torch.randn(2, 6, 4, dtype=DOUBLE))
    with pytest.raises(TypeError, match="inputs has dtype"):
        layer.votes(torch.randn(2, 6, 4, dtype=DOUBLE))


def test_capsule_linear_refuses_a_router_built_for_other_sizes():
    def built_for(name, **sizes):
        return make_router(name, **{"in_caps": 6, "out_caps": 3, "out_dim": 5, **sizes},
                           **({"bias": True} if name in ("dynamic", "uniform") else {}))

    for name, sizes, match in [
        ("dynamic", {"out_caps": 7}, "routing was built for out_caps=7, but the layer has out_caps=3"),
        ("uniform", {"out_dim": 2}, "out_dim=2"),
        ("inverted_dot_product", {"out_dim": 2}, "out_dim=2"),
        ("self_attention", {"in_caps": 8}, "in_caps=8"),
        ("slot", {"out_caps": 4}, "out_caps=4"),
        ("em", {"out_caps": 4}, "out_caps=4"),
    ]:
        with pytest.raises(ValueError, match=match):
            CapsuleLinear(6, 4, 3, 5, routing=built_for(name, **sizes))
        assert CapsuleLinear(6, 4, 3, 5, routing=built_for(name))(torch.randn(2, 6, 4)).shape == (2, 3, 5)
    unsized = DynamicRouter()  # no bias: fits any layer
    assert CapsuleLinear(6, 4, 3, 5, routing=unsized).router is unsized


def test_capsule_linear_and_primary_capsules_check_their_other_arguments():
    for init_std in (float("nan"), float("inf"), -1.0, 0.0):
        with pytest.raises(ValueError, match="init_std"):
            CapsuleLinear(6, 4, 3, 5, init_std=init_std)
    with pytest.raises(ValueError, match="iterations"):  # checked even where the router ignores it
        CapsuleLinear(6, 4, 3, 5, routing="uniform", iterations=-1)
    with pytest.raises(ValueError, match="padding must be an integer >= 0, got -1"):
        PrimaryCapsules(1, 2, 4, padding=-1)
    assert PrimaryCapsules(1, 2, 4, kernel_size=3, padding=1).num_capsules(5, 5) == 2 * 3 * 3


def test_capsule_counts_agree_with_forward_and_refuse_what_it_refuses():
    """num_capsules(5, 5) of a 9x9 kernel said 32 (two grid sizes of -1 multiplied), and
    output_size(5, 5) (-1, -1), for an input forward refuses; num_capsules(0, 0) said 512."""
    from torchvote.nn.em_capsules import ConvMatrixCapsules

    layer = PrimaryCapsules(1, 32, 8)  # 9x9, stride 2: the paper's
    for size in (9, 10, 20, 28):  # the counts of the capsules forward makes, down to the kernel's size
        assert layer(torch.rand(1, 1, size, size)).shape[1] == layer.num_capsules(size, size)
    for bad, message in (((5, 5), "5x5 .* smaller than the 9x9 kernel"), ((0, 0), "height must be")):
        with pytest.raises(ValueError, match=message):
            layer.num_capsules(*bad)
        with pytest.raises(ValueError, match=message):
            layer.output_size(*bad)
    with pytest.raises(ValueError, match="smaller than the kernel's extent"):  # forward agrees
        layer(torch.rand(1, 1, 5, 5))
    conv = ConvMatrixCapsules(2, 2, kernel_size=3, pose_dim=4, stride=2)
    assert conv.output_size(3, 7) == (1, 3)
    for bad, message in (((1, 1), "1x1 is smaller than the kernel_size=3"), ((0, 4), "rows must be")):
        with pytest.raises(ValueError, match=message):
            conv.output_size(*bad)


def test_inputs_on_another_device_than_the_parameters_are_refused_by_name():
    """Nothing checked the device: CPU inputs of a layer on another device failed deep in torch,
    and beside a meta layer an einsum computed on uninitialised memory without a word (the meta
    device stands in here for a GPU, which this test cannot assume)."""
    from torchvote.nn.em_capsules import ClassMatrixCapsules, ConvMatrixCapsules, MatrixCapsules

    meta = torch.device("meta")
    for strategy in ("materialize", "stream"):
        layer = CapsuleLinear(5, 4, 3, 4, strategy=strategy, device=meta)
        with pytest.raises(ValueError, match="inputs is on cpu but the module's parameters are on meta"):
            layer(torch.randn(2, 5, 4))
    em_layer = CapsuleLinear(5, 4, 3, 4, routing="em")
    with pytest.raises(ValueError, match="activations is on meta but the inputs are on cpu"):
        em_layer(torch.randn(2, 5, 4), activations=torch.ones(2, 5, device=meta))
    with pytest.raises(ValueError, match="features is on cpu but the module's parameters are on meta"):
        PrimaryCapsules(1, 2, 4, kernel_size=3, device=meta)(torch.rand(1, 1, 5, 5))
    grid = MatrixCapsules(torch.randn(1, 3, 3, 2, 4, 4), torch.rand(1, 3, 3, 2))
    with pytest.raises(ValueError, match="capsules.poses is on cpu but the module's parameters are on meta"):
        ConvMatrixCapsules(2, 2, kernel_size=3, pose_dim=4, device=meta)(grid)
    with pytest.raises(ValueError, match="capsules.poses is on cpu"):
        ClassMatrixCapsules(2, 3, pose_dim=4, device=meta)(grid)
    mixed = MatrixCapsules(grid.poses, grid.activations.to(meta))
    with pytest.raises(ValueError, match="capsules.activations is on meta but the poses are on cpu"):
        ConvMatrixCapsules(2, 2, kernel_size=3, pose_dim=4)(mixed)


@pytest.mark.parametrize("strategy", ["materialize", "stream"])
@pytest.mark.parametrize("routing", sorted(list_routers()))
def test_an_empty_batch_gives_empty_outputs(routing, strategy):
    layer = CapsuleLinear(6, 4, 3, 5, routing=routing, strategy=strategy)
    inputs = torch.randn(0, 6, 4, requires_grad=True)
    result = layer(inputs, return_routing=True)
    assert result.outputs.shape == (0, 3, 5) and result.couplings.shape == (0, 3, 6)
    if routing == "em":
        assert result.activations.shape == (0, 3)
    result.outputs.sum().backward()
    assert inputs.grad.shape == inputs.shape


@pytest.mark.parametrize(
    ("conv", "size", "message"),
    [
        (nn.Conv2d(3, 8, 3, padding="same"), 2, None),  # any map: the output keeps its size
        (nn.Conv2d(3, 8, 3, padding="valid"), 2, "features of 2x2 .* kernel's extent 3x3"),
        (nn.Conv2d(3, 8, 3, dilation=2), 4, "features of 4x4 .* kernel's extent 5x5"),
        (nn.Conv2d(3, 8, 3, dilation=2), 5, None),
    ],
)
def test_check_feature_maps_reads_string_padding_and_dilation(conv, size, message):
    """padding="same"/"valid" raised 'too many values to unpack' (no argument named), and a
    dilated kernel passed the check and failed inside the convolution."""
    features = torch.zeros(1, 3, size, size)
    if message is None:
        check_feature_maps(features, conv)
        conv(features)  # the check let through what the convolution takes
    else:
        with pytest.raises(ValueError, match=message):
            check_feature_maps(features, conv)
        with pytest.raises(RuntimeError):
            conv(features)  # and refused only what it does not
