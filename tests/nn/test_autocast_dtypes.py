"""Routing under ``torch.autocast`` returns what it returns without autocast, in that dtype.

Routing is a normalisation (a softmax over the output capsules, and a squash, a layer norm or EM's
statistics), as softmax and layer norm are, which CUDA autocast runs in float32 (its "float32
list"). So every router, routing function and capsule layer returns its outputs, activations and
couplings in the dtype of the same call without autocast: the votes' dtype for the functions and
the routers, the promotion of the inputs' and the parameters' for the layers (float32 for a
float32 module), whatever the router and the strategy. Votes may still be formed in autocast's
dtype (the ``"materialize"`` strategy's einsum, the class capsules' votes): only the small results
are cast back. Before, the dtype depended on the router and the strategy (float32 from the streamed
kernels, bfloat16 from EM and from the materialised votes, bfloat16 couplings beside float32
outputs from the slot router), so that swapping a CapsNet's router, or running ``strategy="auto"``
on a GPU instead of a CPU, changed the dtype of its scores and of the loss under ``bf16=true``.

Each case runs one call without autocast and the same call under CPU bfloat16 autocast, on float32
modules and inputs: every returned tensor must have the first call's dtype, and lie within
bfloat16's rounding of its values, ``|got - expected| <= 3e-2 |expected|`` (norm-wise). Where the
3e-2 comes from: autocast rounds the inputs and the weights of each product to bfloat16 (8
significant bits, ``eps = 2**-7 = 7.8e-3``), and routing, iterated and normalised, passes that
rounding on amplified. The same float32 network run on bfloat16-rounded weights and inputs, with
no autocast at all, is already that far from the float32 one: 1.5e-2 on the scores and 3e-2 on
the couplings of the tiny EMCapsNet (measured in float64 on the rounded weights and inputs when
the dtypes were made consistent, 2026-11-30). The largest error of the cases here is 2.5e-2, the poses of the
inverted dot-product routing of shared-weight votes: its layer norm divides by the poses' small
spread, and autocast rounds the weighted sums too (the float32 routing of the rounded inputs alone
is 8e-3 off); most cases are below 1.2e-2. The cases are seeded: the errors do not vary by run.

The capsule layer's strategies checked are ``"stream"`` (what ``"auto"`` picks on a CPU) and
``"materialize"`` (what it picks on a GPU); ``"compiled"`` (the materialised routing under
``torch.compile``) is left out: compiling every router takes minutes on a 2-core CPU, and it runs
the materialised routing, whose results are cast back by the same line of ``CapsuleLinear.forward``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor

from torchvote.functional import (
    LinearVotes,
    SharedLinearVotes,
    dynamic_routing,
    em_routing,
    inverted_dot_product_routing,
    list_routers,
    self_attention_routing,
    slot_routing,
    uniform_routing,
)
from torchvote.models import create_model
from torchvote.nn import CapsuleLinear, ClassMatrixCapsules, ConvMatrixCapsules, MatrixCapsules, make_router

BF16 = torch.bfloat16
#: bfloat16's rounding of the inputs and weights, passed on by the routing (module docstring)
TOLERANCE = 3e-2
ROUTERS = list(list_routers())
STRATEGIES = ["stream", "materialize"]  # not "compiled": see the module docstring


def _tensors(value: object) -> list[Tensor]:
    """Every tensor a call returned, in order (tuples, named tuples, dataclasses)."""
    if isinstance(value, Tensor):
        return [value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = [getattr(value, field.name) for field in dataclasses.fields(value)]
    if isinstance(value, (tuple, list)):
        return [tensor for item in value for tensor in _tensors(item)]
    return []


def _randn(*shape: int, seed: int = 0) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def assert_autocast_keeps_the_dtype(call) -> None:
    """``call()`` under CPU bfloat16 autocast: the tensors of the call without autocast, in their
    dtypes, within bfloat16's rounding."""
    torch.manual_seed(0)
    expected = _tensors(call())
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=BF16):
        got = _tensors(call())
    assert expected and len(got) == len(expected)
    for index, (mine, reference) in enumerate(zip(got, expected, strict=True)):
        assert mine.dtype == reference.dtype, (
            f"result {index}: {mine.dtype} under autocast, {reference.dtype} without"
        )
        error = (mine.double() - reference.double()).norm() / reference.double().norm().clamp_min(1e-30)
        assert error <= TOLERANCE, f"result {index}: relative error {error:.1e}"


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("routing", ROUTERS)
def test_capsule_linear_returns_its_dtype_under_autocast_whatever_the_router_and_strategy(routing, strategy):
    torch.manual_seed(0)
    layer = CapsuleLinear(6, 4, 3, 8, routing=routing, strategy=strategy, init_std=0.2).eval()
    inputs = _randn(2, 6, 4)
    assert_autocast_keeps_the_dtype(lambda: layer(inputs, return_routing=True))
    assert_autocast_keeps_the_dtype(lambda: layer(inputs))


@pytest.mark.parametrize("shared_weights", [False, True], ids=["per_pair", "shared"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_capsule_linear_with_shared_weights_too(strategy, shared_weights):
    torch.manual_seed(0)
    layer = CapsuleLinear(6, 4, 3, 8, routing="slot", strategy=strategy, shared_weights=shared_weights,
                          init_std=0.2)
    assert_autocast_keeps_the_dtype(lambda: layer(_randn(2, 6, 4), return_routing=True))


@pytest.mark.parametrize("routing", ROUTERS)
def test_every_router_returns_the_votes_dtype_under_autocast(routing):
    torch.manual_seed(0)
    router = make_router(routing, in_caps=5, out_caps=3, out_dim=6).eval()
    votes = _randn(2, 3, 5, 6)
    assert_autocast_keeps_the_dtype(lambda: router(votes))


@pytest.mark.parametrize("routing", ROUTERS)
def test_every_router_returns_the_dtype_of_votes_objects_under_autocast(routing):
    """Unformed votes (what ``"stream"`` hands the router): their dtype is the float32 promotion."""
    torch.manual_seed(0)
    router = make_router(routing, in_caps=5, out_caps=3, out_dim=6).eval()
    weight, inputs = 0.3 * _randn(3, 5, 6, 4), _randn(2, 5, 4, seed=1)
    assert_autocast_keeps_the_dtype(lambda: router(LinearVotes(weight, inputs)))


@pytest.mark.parametrize("strategy", ["blocked", "vectorized"])
@pytest.mark.parametrize("normalization", ["joint", "per_patch"])
def test_conv_matrix_capsules_return_their_dtype_under_autocast(normalization, strategy):
    torch.manual_seed(0)
    layer = ConvMatrixCapsules(2, 3, kernel_size=3, normalization=normalization, strategy=strategy)
    capsules = MatrixCapsules(_randn(2, 4, 5, 2, 4, 4), torch.rand(2, 4, 5, 2))
    assert_autocast_keeps_the_dtype(lambda: layer(capsules))


@pytest.mark.parametrize("strategy", ["blocked", "vectorized"])
def test_class_matrix_capsules_return_their_dtype_under_autocast(strategy):
    """Its votes are formed by an einsum, in bfloat16 under autocast: the results come back in
    float32, as the convolutional layer's (whose votes EM forms itself) always did."""
    torch.manual_seed(0)
    layer = ClassMatrixCapsules(2, 4, strategy=strategy)
    capsules = MatrixCapsules(_randn(2, 3, 3, 2, 4, 4), torch.rand(2, 3, 3, 2))
    assert_autocast_keeps_the_dtype(lambda: layer(capsules))
    assert_autocast_keeps_the_dtype(lambda: layer(capsules, return_routing=True))


def test_class_matrix_capsules_with_another_router_too():
    torch.manual_seed(0)
    layer = ClassMatrixCapsules(2, 4, routing=make_router("dynamic", in_caps=18, out_caps=4, out_dim=16))
    capsules = MatrixCapsules(_randn(2, 3, 3, 2, 4, 4), torch.rand(2, 3, 3, 2))
    assert_autocast_keeps_the_dtype(lambda: layer(capsules, return_routing=True))


def _linear(seed: int = 0) -> LinearVotes:
    return LinearVotes(0.3 * _randn(3, 5, 6, 4, seed=seed), _randn(2, 5, 4, seed=seed + 1))


def _shared(seed: int = 0) -> SharedLinearVotes:
    return SharedLinearVotes(0.3 * _randn(3, 6, 4, seed=seed), _randn(2, 5, 4, seed=seed + 1))


VOTES = {"tensor": lambda: _randn(2, 3, 5, 6), "LinearVotes": _linear, "SharedLinearVotes": _shared}


def _slots(votes):
    return slot_routing(votes, _randn(3, 6, seed=7), query=lambda s: 2 * s, update=lambda u, p: u + p)


FUNCTIONS = {
    "dynamic": lambda votes: dynamic_routing(votes),
    "dynamic bias": lambda votes: dynamic_routing(votes, bias=_randn(3, 6, seed=5)),
    "dynamic distance": lambda votes: dynamic_routing(votes, agreement="distance"),
    "dynamic all_passes": lambda votes: dynamic_routing(votes, all_passes=True),
    "uniform": lambda votes: uniform_routing(votes),
    "inverted_dot_product": lambda votes: inverted_dot_product_routing(votes),
    "self_attention": lambda votes: self_attention_routing(votes, log_prior=0.1 * _randn(3, 5, seed=6)),
    "slot": _slots,
}


@pytest.mark.parametrize("kind", list(VOTES))
@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_every_routing_function_returns_the_votes_dtype_under_autocast(name, kind):
    votes = VOTES[kind]()
    assert_autocast_keeps_the_dtype(lambda: FUNCTIONS[name](votes))


@pytest.mark.parametrize("strategy", ["blocked", "vectorized"])
def test_em_routing_returns_the_votes_dtype_under_autocast(strategy):
    votes, activations = _randn(2, 3, 5, 16), torch.rand(2, 5, generator=torch.Generator().manual_seed(1))
    beta_u = _randn(3, seed=2)
    assert_autocast_keeps_the_dtype(
        lambda: em_routing(votes, activations, beta_u, 0.5, strategy=strategy, return_assignments=True)
    )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_capsnet_scores_have_one_dtype_under_autocast_whatever_the_router(strategy):
    """A router swap under ``bf16=true`` no longer changes the dtype of the scores (and of the loss):
    float32, as without autocast, for every router and on either device's strategy."""
    images = torch.rand(2, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    dtypes = {}
    for router in ROUTERS:
        torch.manual_seed(0)
        model = create_model("capsnet", "tiny", router=router).eval()
        for module in model.modules():
            if isinstance(module, CapsuleLinear):
                module.strategy = strategy
        with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
            output = model(images)
        dtypes[router] = (output.scores.dtype, output.poses.dtype, output.couplings.dtype)
    assert set(dtypes.values()) == {(torch.float32,) * 3}, dtypes
