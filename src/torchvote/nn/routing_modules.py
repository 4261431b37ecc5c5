"""Where the routers lived before :mod:`torchvote.nn.routers` split them one per file; the names
stay importable from here."""

from torchvote.nn.routers import (
    DynamicRouter,
    EMRouter,
    InvertedDotProductRouter,
    Router,
    RoutingResult,
    SelfAttentionRouter,
    SlotAttention,
    SlotRouter,
    UniformRouter,
    make_router,
)

__all__ = [
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
]
