"""Votes a router's parameters cannot take are refused by the votes' name.

Found by review: ``meta`` votes beside a router's CPU parameters were routed without a word (EM,
self-attention) or failed inside a layer norm naming nothing (inverted dot-product, slot, a
router's bias); half votes to a float32 :class:`~torchvote.nn.SelfAttentionRouter` blamed its
``log_prior``, the router's own parameter; integer votes were a ``ValueError`` here and a
``TypeError`` in ``vote``. A router now names the votes, both devices or both dtypes, and a wrong
votes dtype is an ``ArgumentTypeError`` (a ``TypeError`` and a ``ValueError``).
"""

from __future__ import annotations

import pytest
import torch

from torchvote.functional import LinearVotes
from torchvote.nn import (
    DynamicRouter,
    EMRouter,
    InvertedDotProductRouter,
    SelfAttentionRouter,
    SlotAttention,
    SlotRouter,
)
from torchvote.nn.routers import UniformRouter
from torchvote.validation import ArgumentTypeError

U = torch.randn(2, 3, 5, 4, generator=torch.Generator().manual_seed(0))  # (b, out_caps, in_caps, out_dim)

ROUTERS = {
    "inverted_dot_product": lambda: InvertedDotProductRouter(out_dim=4),
    "slot": lambda: SlotRouter(out_caps=3, out_dim=4),
    "slot without normalize_votes": lambda: SlotRouter(out_caps=3, out_dim=4, normalize_votes=False),
    "self_attention": lambda: SelfAttentionRouter(in_caps=5, out_caps=3),
    "em": lambda: EMRouter(out_caps=3),
    "dynamic with a bias": lambda: DynamicRouter(bias=True, out_caps=3, out_dim=4),
    "uniform with a bias": lambda: UniformRouter(bias=True, out_caps=3, out_dim=4),
}


@pytest.mark.parametrize("name", sorted(ROUTERS))
@pytest.mark.parametrize("streamed", [False, True], ids=["tensor", "LinearVotes"])
def test_votes_on_another_device_than_the_router_are_refused(name, streamed):
    router = ROUTERS[name]()
    votes = U.to("meta")
    if streamed:
        votes = LinearVotes(torch.zeros(3, 5, 4, 2, device="meta"), torch.zeros(2, 5, 2, device="meta"))
    with pytest.raises(ValueError, match=r"votes (is|are) on meta but the router's parameters are on cpu"):
        router(votes)


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_votes_of_another_dtype_than_the_router_name_the_votes(name):
    """Half votes to a float32 router (was, for self-attention: "log_prior has dtype ..."; for a
    router's bias: "bias has dtype ...", the router's own parameters blamed)."""
    refused = r"votes (has|have) dtype torch.float16 but the router's parameters are torch.float32"
    with pytest.raises(TypeError, match=refused):
        ROUTERS[name]()(U.half())


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_integer_votes_are_a_type_error_and_a_value_error(name):
    with pytest.raises(ArgumentTypeError, match="votes must be floating point, got dtype torch.int32"):
        ROUTERS[name]()(U.int())


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_votes_beside_the_router_still_route(name):
    """The checks refuse only a mismatch: votes of the router's dtype and device route, and under
    autocast votes of another dtype do."""
    router = ROUTERS[name]()
    assert torch.isfinite(router(U).outputs).all()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.isfinite(router(U.bfloat16()).outputs.float()).all()


def test_slot_attention_refuses_inputs_and_masks_on_another_device():
    module = SlotAttention(3, 6, slot_dim=4, hidden_dim=8)
    inputs = torch.randn(2, 7, 6)
    with pytest.raises(ValueError, match="inputs is on meta but the module's parameters are on cpu"):
        module(inputs.to("meta"))
    with pytest.raises(ValueError, match="mask is on meta but the module's parameters are on cpu"):
        module(inputs, mask=torch.ones(2, 7, dtype=torch.bool, device="meta"))
    with pytest.raises(ArgumentTypeError, match="mask must be a boolean tensor"):
        module(inputs, mask=torch.ones(2, 7))
