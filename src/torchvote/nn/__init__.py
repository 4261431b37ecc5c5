"""Modules that own parameters, built on :mod:`torchvote.functional`.

Mask convention everywhere: True = may attend; ``key_mask`` True = real key, False = padding.
"""

from torchvote.nn.attention import MultiHeadAttention
from torchvote.nn.capsules import CapsuleLinear, PrimaryCapsules
from torchvote.nn.em_capsules import (
    ClassMatrixCapsules,
    ConvMatrixCapsules,
    MatrixCapsules,
    PrimaryMatrixCapsules,
)
from torchvote.nn.kernel_regression import NadarayaWatson
from torchvote.nn.positional import LearnedPositionalEmbedding, SinusoidalPositionalEncoding
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
from torchvote.nn.routing_attention import (
    ATTENTION_KINDS,
    AttentionKind,
    RoutingAttention,
    ScaledDotAgreement,
    attention_factory,
)
from torchvote.nn.scoring_attention import AdditiveAttention, LuongAttention, ScoredAttention
from torchvote.nn.transformer import (
    AttentionFactory,
    AttentionIntermediates,
    TransformerConfig,
    TransformerDecoderLayer,
    TransformerEncoderLayer,
)
from torchvote.nn.transformer_stack import TransformerDecoder, TransformerEncoder

__all__ = [
    "ATTENTION_KINDS",
    "AdditiveAttention",
    "AttentionKind",
    "ScaledDotAgreement",
    "attention_factory",
    "AttentionFactory",
    "AttentionIntermediates",
    "CapsuleLinear",
    "ClassMatrixCapsules",
    "ConvMatrixCapsules",
    "DynamicRouter",
    "EMRouter",
    "InvertedDotProductRouter",
    "MatrixCapsules",
    "PrimaryCapsules",
    "PrimaryMatrixCapsules",
    "Router",
    "RoutingAttention",
    "RoutingResult",
    "ScoredAttention",
    "SelfAttentionRouter",
    "SlotAttention",
    "SlotRouter",
    "UniformRouter",
    "make_router",
    "LearnedPositionalEmbedding",
    "LuongAttention",
    "MultiHeadAttention",
    "NadarayaWatson",
    "SinusoidalPositionalEncoding",
    "TransformerConfig",
    "TransformerDecoder",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerEncoderLayer",
]
