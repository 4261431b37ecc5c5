"""Deferred initialisation: a module built on the ``"meta"`` device, given memory with
``to_empty()`` and initialised by calling ``reset_parameters()`` on every submodule that has it
(the pattern of FSDP's default ``param_init_fn`` and of ``torch.nn.utils.skip_init`` users), holds
no uninitialised memory, and each module's own ``reset_parameters`` draws what its constructor
drew."""

from __future__ import annotations

import pytest
import torch

from torchvote.models import create_model, list_models
from torchvote.nn import CapsuleLinear, LearnedPositionalEmbedding, MultiHeadAttention
from torchvote.nn.em_capsules import ClassMatrixCapsules, ConvMatrixCapsules
from torchvote.nn.kernel_regression import NadarayaWatson
from torchvote.nn.routers.self_attention import SelfAttentionRouter
from torchvote.nn.routers.slot import SlotRouter
from torchvote.nn.routers.slot_attention import SlotAttention

MODULES = {
    "capsule-linear": lambda **f: CapsuleLinear(6, 4, 3, 5, **f),
    "capsule-linear-shared": lambda **f: CapsuleLinear(6, 4, 3, 5, shared_weights=True, **f),
    "capsule-linear-em": lambda **f: CapsuleLinear(6, 4, 3, 4, routing="em", **f),
    "capsule-linear-slot": lambda **f: CapsuleLinear(6, 4, 3, 4, routing="slot", **f),
    "capsule-linear-self-attention": lambda **f: CapsuleLinear(6, 4, 3, 4, routing="self_attention", **f),
    "conv-matrix-capsules": lambda **f: ConvMatrixCapsules(2, 3, kernel_size=3, stride=1, **f),
    "class-matrix-capsules": lambda **f: ClassMatrixCapsules(2, 3, **f),
    "multi-head-attention": lambda **f: MultiHeadAttention(8, 2, **f),
    "learned-positions": lambda **f: LearnedPositionalEmbedding(10, 6, **f),
    "slot-router": lambda **f: SlotRouter(out_caps=3, out_dim=4, **f),
    "slot-attention": lambda **f: SlotAttention(3, 5, slot_dim=4, hidden_dim=6, **f),
    "self-attention-router": lambda **f: SelfAttentionRouter(in_caps=5, out_caps=3, **f),
    "nadaraya-watson": lambda **f: NadarayaWatson(bandwidth=0.7, learnable=True, **f),
}


def _models():
    for name in list_models():
        yield pytest.param(lambda name=name, **f: create_model(name, "tiny", **f), id=name)


def _initialised_on_meta(build):
    module = build(device="meta").to_empty(device="cpu")
    with torch.no_grad():  # to_empty's memory is whatever was there: make it visible
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.is_floating_point():
                tensor.fill_(float("nan"))
    for submodule in module.modules():
        if hasattr(submodule, "reset_parameters"):
            submodule.reset_parameters()
    return module


@pytest.mark.parametrize("build", [*(pytest.param(b, id=n) for n, b in MODULES.items()), *_models()])
def test_every_parameter_is_drawn_again_after_to_empty(build):
    """Found in review: CapsuleLinear's weight, MultiHeadAttention's packed in_proj, EM's beta_u
    and activation bias, the slots, learned positions and the matrix capsules' weights kept
    to_empty's garbage."""
    module = _initialised_on_meta(build)
    left = [name for name, tensor in [*module.named_parameters(), *module.named_buffers()]
            if tensor.is_floating_point() and torch.isnan(tensor).any()]
    assert left == []


@pytest.mark.parametrize("name", [n for n in MODULES if n != "multi-head-attention"])
def test_reset_parameters_draws_what_the_constructor_drew(name):
    """Each module's constructor calls its reset_parameters where it drew before: a seeded module
    starts from the same weights, and one built on meta and reset matches one built on the CPU."""
    torch.manual_seed(0)
    on_cpu = MODULES[name]()
    torch.manual_seed(0)
    deferred = _initialised_on_meta(MODULES[name])
    for (key, expected), (_, got) in zip(on_cpu.state_dict().items(), deferred.state_dict().items(),
                                         strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=key)
