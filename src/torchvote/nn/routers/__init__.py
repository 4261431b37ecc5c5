"""Routers: the parameters of each routing method around one configuration of ``vote``.

One router per file; :mod:`~torchvote.nn.routers.base` holds what they share and says how to add
one. :class:`~torchvote.nn.capsules.CapsuleLinear` chooses a router by name through
:func:`make_router`. Votes are receivers first, ``(batch..., out_caps, in_caps, dim)`` (or a
:class:`~torchvote.functional.voting.Votes` object), couplings ``(batch..., out_caps, in_caps)``.
"""

from torchvote.nn.routers.base import (
    BiasedRouter,
    Router,
    RoutingResult,
    make_router,
    register_router,
    registered_routers,
)
from torchvote.nn.routers.dynamic import DynamicRouter
from torchvote.nn.routers.em import EMRouter
from torchvote.nn.routers.inverted_dot_product import InvertedDotProductRouter
from torchvote.nn.routers.self_attention import SelfAttentionRouter
from torchvote.nn.routers.slot import SlotRouter
from torchvote.nn.routers.slot_attention import SlotAttention
from torchvote.nn.routers.uniform import UniformRouter

__all__ = [
    "BiasedRouter",
    "DynamicRouter",
    "EMRouter",
    "InvertedDotProductRouter",
    "Router",
    "RoutingResult",
    "SelfAttentionRouter",
    "SlotAttention",
    "SlotRouter",
    "UniformRouter",
    "make_router",
    "register_router",
    "registered_routers",
]
