"""``iterations`` and the one-pass routers: a capsule layer told to route a one-pass router
several times says that the count has no effect; the model configs, whose one ``iterations``
field serves every router (the router swap of row f), build them without a word."""

from __future__ import annotations

import warnings

import pytest
import torch

from torchvote.functional.routing import efficient_squash, self_attention_routing, uniform_routing
from torchvote.models import create_model
from torchvote.nn.capsules import CapsuleLinear
from torchvote.nn.routers import make_router, registered_routers

DOUBLE = torch.float64
ONE_PASS = ("self_attention", "uniform")
ITERATIVE = ("dynamic", "em", "inverted_dot_product", "slot")


def is_iterative(name: str) -> bool:
    return make_router(name, in_caps=5, out_caps=3, out_dim=4).iterative


def test_the_registry_splits_the_routers_as_these_tests_do():
    from torchvote.nn.routers.base import is_iterative as registered_iterative

    assert {name for name in registered_routers() if not is_iterative(name)} == set(ONE_PASS)
    assert all(is_iterative(name) for name in ITERATIVE)
    assert all(registered_iterative(name) == is_iterative(name) for name in registered_routers())
    assert not registered_iterative("no such router")


def _reference(routing: str, layer: CapsuleLinear, inputs: torch.Tensor) -> torch.Tensor:
    """The one pass, from the functional routing on votes formed by an einsum."""
    votes = torch.einsum("ijde,bje->bijd", layer.weight, inputs)  # (b, out_caps, in_caps, out_dim)
    if routing == "uniform":
        return uniform_routing(votes)[0]
    return self_attention_routing(votes, log_prior=layer.router.log_prior, nonlinearity=efficient_squash)[0]


@pytest.mark.parametrize("iterations", [2, 3, 7])
@pytest.mark.parametrize("routing", ONE_PASS)
def test_explicit_iterations_on_a_one_pass_router_warn_and_change_nothing(routing, iterations):
    torch.manual_seed(0)
    message = rf"iterations={iterations} .*{routing!r} router.*one pass"
    with pytest.warns(UserWarning, match=message) as record:
        layer = CapsuleLinear(6, 4, 3, 5, routing=routing, iterations=iterations, dtype=DOUBLE)
    assert len(record) == 1  # once per layer built
    assert record[0].filename == __file__  # points at the caller's line
    inputs = torch.randn(2, 6, 4, dtype=DOUBLE)
    outputs = layer(inputs)  # (b, out_caps, out_dim)
    torch.testing.assert_close(outputs, _reference(routing, layer, inputs), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("iterations", [None, 1])
@pytest.mark.parametrize("routing", ONE_PASS)
def test_unset_or_one_iteration_on_a_one_pass_router_is_silent(routing, iterations):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CapsuleLinear(6, 4, 3, 5, routing=routing, iterations=iterations)


@pytest.mark.parametrize("routing", ITERATIVE)
def test_iterative_routers_take_their_iterations_silently(routing):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer = CapsuleLinear(6, 4, 3, 5, routing=routing, iterations=4)
    assert layer.router.iterations == 4


def test_bad_iterations_are_still_refused_before_the_router_is_looked_at():
    from torchvote.nn.routers.base import layer_iterations

    for routing in ONE_PASS:
        with pytest.raises(ValueError, match="iterations"):
            CapsuleLinear(6, 4, 3, 5, routing=routing, iterations=0)
    with pytest.raises(ValueError, match="routing must be one of"):  # an unknown name: make_router's error
        CapsuleLinear(6, 4, 3, 5, routing="no such router", iterations=3)
    assert layer_iterations("uniform", None) == 3


@pytest.mark.parametrize("router", sorted(ONE_PASS + ITERATIVE))
@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_a_model_config_swaps_every_router_with_its_one_iterations_field_silently(router, preset):
    # row f: one backbone, every router, the preset's iterations (tiny: 2); and an explicit one
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = create_model("capsnet", preset, router=router)
        explicit = create_model("capsnet", "tiny", router=router, iterations=5)
    if is_iterative(router):
        assert model.head.router.iterations == (2 if preset == "tiny" else 3)
        assert explicit.head.router.iterations == 5


def test_the_efficient_capsnet_default_keeps_its_one_pass_router_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = create_model("efficient-capsnet", iterations=5)
    assert not model.head.router.iterative


def test_make_router_the_factory_of_the_configs_leaves_the_count_unused_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        router = make_router("uniform", in_caps=5, out_caps=3, out_dim=4, iterations=5)
        create_model("em-capsnet", "tiny", router="uniform")  # its iterations count its EM layers too
    assert not router.iterative
