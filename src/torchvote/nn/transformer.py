"""Transformer encoder and decoder layers (Vaswani et al. 2017, sec. 3.1) around pluggable attention.

Each layer is attention (one pass of weighted voting), a position-wise feed-forward network, and
a residual connection with layer norm around each: post-norm ``x = norm(x + sublayer(x))`` as in
the paper, or pre-norm ``x = x + sublayer(norm(x))`` (Xiong et al. 2020, "On Layer Normalization
in the Transformer Architecture"), whose stacks end in one more layer norm.

The ``attention`` hook: a callable ``attention(embed_dim, num_heads, *, dropout)`` returning a
module with :class:`~torchvote.nn.MultiHeadAttention`'s ``forward`` signature
(``forward(query, key, value, *, attn_mask, key_mask, is_causal, need_weights) -> (output,
weights)``, batch first). It replaces softmax attention with any other voting, e.g. an iterative
routing-style attention. By default it is :class:`~torchvote.nn.MultiHeadAttention`.

All inputs are batch first ``(b, T, E)``. Masks follow torchvote's convention: True = may attend;
``key_mask`` True = real token, False = padding.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import torch.nn.functional as F
from torch import Tensor, nn

from torchvote.nn.attention import MultiHeadAttention

__all__ = [
    "AttentionFactory",
    "TransformerConfig",
    "TransformerEncoderLayer",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerDecoder",
]

Activation = Literal["relu", "gelu"]
_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"relu": F.relu, "gelu": F.gelu}


class AttentionFactory(Protocol):
    """Builds the attention of a transformer layer (see the module docstring)."""

    def __call__(self, embed_dim: int, num_heads: int, *, dropout: float) -> nn.Module: ...


@dataclass(frozen=True)
class TransformerConfig:
    """Every knob of a transformer layer; the arguments of the layer constructors.

    Attributes:
        d_model: model feature size ``E``.
        num_heads: attention heads.
        dim_feedforward: hidden size of the feed-forward network; default ``4 * d_model``.
        dropout: on the attention weights, inside the feed-forward network, and on each
            sublayer's output before the residual sum.
        activation: ``"relu"`` (the paper) or ``"gelu"``.
        norm_first: pre-norm (True) or post-norm (False, the paper).
        shared_qkv: one matrix for queries, keys and values in the default attention.
        layer_norm_eps: the layer norms' epsilon.
        attention: an :class:`AttentionFactory` replacing the default attention.
    """

    d_model: int
    num_heads: int
    dim_feedforward: int | None = None
    dropout: float = 0.1
    activation: Activation = "relu"
    norm_first: bool = False
    shared_qkv: bool = False
    layer_norm_eps: float = 1e-5
    attention: AttentionFactory | None = None


def _attention_factory(attention: AttentionFactory | None, shared_qkv: bool) -> AttentionFactory:
    if attention is None:
        return functools.partial(MultiHeadAttention, shared_qkv=shared_qkv, batch_first=True)
    if shared_qkv:
        raise ValueError(
            "shared_qkv configures the default attention; with a custom attention factory, "
            "set it in the factory instead"
        )
    if not callable(attention):
        raise TypeError(f"attention must be a callable returning an nn.Module, got {attention!r}")
    return attention


class _FeedForward(nn.Module):
    """Position-wise ``linear -> activation -> dropout -> linear`` (sec. 3.3)."""

    def __init__(self, d_model: int, dim_feedforward: int, activation: Activation, dropout: float) -> None:
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        self.expand = nn.Linear(d_model, dim_feedforward)
        self.contract = nn.Linear(dim_feedforward, d_model)
        self.activation = _ACTIVATIONS[activation]
        self.dropout = nn.Dropout(dropout)

    def forward(self, inputs: Tensor) -> Tensor:
        return self.contract(self.dropout(self.activation(self.expand(inputs))))


def _check_layer_sizes(d_model: int, num_heads: int, dim_feedforward: int | None, dropout: float) -> int:
    if d_model <= 0 or num_heads <= 0:
        raise ValueError(f"d_model and num_heads must be positive, got {d_model}, {num_heads}")
    dim_feedforward = 4 * d_model if dim_feedforward is None else dim_feedforward
    if dim_feedforward <= 0:
        raise ValueError(f"dim_feedforward must be positive, got {dim_feedforward}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
    return dim_feedforward


class TransformerEncoderLayer(nn.Module):
    """Self-attention and a feed-forward network, each in a residual block with layer norm.

    Post-norm (``norm_first=False``)::

        x = attention_norm(x + dropout(self_attention(x)))
        x = feedforward_norm(x + dropout(feedforward(x)))

    Pre-norm (``norm_first=True``)::

        x = x + dropout(self_attention(attention_norm(x)))
        x = x + dropout(feedforward(feedforward_norm(x)))

    Numerically the same as ``torch.nn.TransformerEncoderLayer(batch_first=True)`` with the same
    weights (its ``self_attn``, ``linear1``, ``linear2``, ``norm1``, ``norm2`` are our
    ``self_attention``, ``feedforward.expand``, ``feedforward.contract``, ``attention_norm``,
    ``feedforward_norm``).

    Args:
        d_model: feature size ``E``.
        num_heads: attention heads.
        dim_feedforward: feed-forward hidden size; default ``4 * d_model``.
        dropout: see :class:`TransformerConfig`.
        activation: ``"relu"`` or ``"gelu"``.
        norm_first: pre-norm instead of post-norm.
        shared_qkv: one matrix for Q, K and V in the default attention.
        layer_norm_eps: the layer norms' epsilon.
        attention: an attention factory (module docstring); ``None`` for
            :class:`~torchvote.nn.MultiHeadAttention`.

    Raises:
        ValueError: bad sizes, dropout or activation, or ``shared_qkv`` with a custom
            ``attention``.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        dim_feedforward: int | None = None,
        dropout: float = 0.1,
        activation: Activation = "relu",
        norm_first: bool = False,
        shared_qkv: bool = False,
        layer_norm_eps: float = 1e-5,
        attention: AttentionFactory | None = None,
    ) -> None:
        super().__init__()
        dim_feedforward = _check_layer_sizes(d_model, num_heads, dim_feedforward, dropout)
        make_attention = _attention_factory(attention, shared_qkv)
        self.d_model, self.norm_first = d_model, norm_first
        self.self_attention = make_attention(d_model, num_heads, dropout=dropout)
        self.feedforward = _FeedForward(d_model, dim_feedforward, activation, dropout)
        self.attention_norm = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.feedforward_norm = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.dropout = nn.Dropout(dropout)

    @classmethod
    def from_config(cls, config: TransformerConfig) -> TransformerEncoderLayer:
        """Build a layer from a :class:`TransformerConfig`."""
        return cls(
            config.d_model,
            config.num_heads,
            dim_feedforward=config.dim_feedforward,
            dropout=config.dropout,
            activation=config.activation,
            norm_first=config.norm_first,
            shared_qkv=config.shared_qkv,
            layer_norm_eps=config.layer_norm_eps,
            attention=config.attention,
        )

    def _attend(
        self, inputs: Tensor, attn_mask: Tensor | None, key_mask: Tensor | None, is_causal: bool
    ) -> Tensor:
        attended, _ = self.self_attention(
            inputs,
            inputs,
            inputs,
            attn_mask=attn_mask,
            key_mask=key_mask,
            is_causal=is_causal,
            need_weights=False,
        )
        return self.dropout(attended)

    def forward(
        self,
        inputs: Tensor,
        *,
        attn_mask: Tensor | None = None,
        key_mask: Tensor | None = None,
        is_causal: bool = False,
    ) -> Tensor:
        """Encode ``inputs``.

        Args:
            inputs: ``(b, T, E)``.
            attn_mask: boolean (True = may attend) or float, ``(T, T)`` or broadcastable to
                ``(b, h, T, T)``.
            key_mask: boolean ``(b, T)``, True for a real token, False for padding.
            is_causal: token ``t`` attends only to tokens ``<= t``.

        Returns:
            ``(b, T, E)``.
        """
        x = inputs
        if self.norm_first:
            x = x + self._attend(self.attention_norm(x), attn_mask, key_mask, is_causal)
            x = x + self.dropout(self.feedforward(self.feedforward_norm(x)))
        else:
            x = self.attention_norm(x + self._attend(x, attn_mask, key_mask, is_causal))
            x = self.feedforward_norm(x + self.dropout(self.feedforward(x)))
        return x


class TransformerDecoderLayer(nn.Module):
    """Causal self-attention, cross-attention to the encoder's memory, and a feed-forward network.

    Post-norm (``norm_first=False``)::

        x = self_attention_norm(x + dropout(self_attention(x)))            (causal by default)
        x = cross_attention_norm(x + dropout(cross_attention(x, memory)))
        x = feedforward_norm(x + dropout(feedforward(x)))

    Pre-norm applies each norm to the sublayer's input instead. Numerically the same as
    ``torch.nn.TransformerDecoderLayer(batch_first=True)`` with the same weights (``self_attn``,
    ``multihead_attn``, ``linear1``, ``linear2``, ``norm1``, ``norm2``, ``norm3`` are our
    ``self_attention``, ``cross_attention``, ``feedforward.expand``, ``feedforward.contract``,
    ``self_attention_norm``, ``cross_attention_norm``, ``feedforward_norm``), given torch the
    causal ``tgt_mask``.

    Args:
        d_model: feature size ``E`` of the target and the memory.
        num_heads: attention heads (both attentions).
        dim_feedforward: feed-forward hidden size; default ``4 * d_model``.
        dropout: see :class:`TransformerConfig`.
        activation: ``"relu"`` or ``"gelu"``.
        norm_first: pre-norm instead of post-norm.
        shared_qkv: one matrix for Q, K and V in both default attentions (in cross-attention it
            projects the target and the memory alike).
        layer_norm_eps: the layer norms' epsilon.
        attention: an attention factory (module docstring), used for both attentions.

    Raises:
        ValueError: bad sizes, dropout or activation, or ``shared_qkv`` with a custom
            ``attention``.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        dim_feedforward: int | None = None,
        dropout: float = 0.1,
        activation: Activation = "relu",
        norm_first: bool = False,
        shared_qkv: bool = False,
        layer_norm_eps: float = 1e-5,
        attention: AttentionFactory | None = None,
    ) -> None:
        super().__init__()
        dim_feedforward = _check_layer_sizes(d_model, num_heads, dim_feedforward, dropout)
        make_attention = _attention_factory(attention, shared_qkv)
        self.d_model, self.norm_first = d_model, norm_first
        self.self_attention = make_attention(d_model, num_heads, dropout=dropout)
        self.cross_attention = make_attention(d_model, num_heads, dropout=dropout)
        self.feedforward = _FeedForward(d_model, dim_feedforward, activation, dropout)
        self.self_attention_norm = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.cross_attention_norm = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.feedforward_norm = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.dropout = nn.Dropout(dropout)

    @classmethod
    def from_config(cls, config: TransformerConfig) -> TransformerDecoderLayer:
        """Build a layer from a :class:`TransformerConfig`."""
        return cls(
            config.d_model,
            config.num_heads,
            dim_feedforward=config.dim_feedforward,
            dropout=config.dropout,
            activation=config.activation,
            norm_first=config.norm_first,
            shared_qkv=config.shared_qkv,
            layer_norm_eps=config.layer_norm_eps,
            attention=config.attention,
        )

    def _self_attend(
        self, x: Tensor, mask: Tensor | None, key_mask: Tensor | None, is_causal: bool
    ) -> Tensor:
        attended, _ = self.self_attention(
            x, x, x, attn_mask=mask, key_mask=key_mask, is_causal=is_causal, need_weights=False
        )
        return self.dropout(attended)

    def _cross_attend(
        self, x: Tensor, memory: Tensor, mask: Tensor | None, key_mask: Tensor | None
    ) -> Tensor:
        attended, _ = self.cross_attention(
            x, memory, memory, attn_mask=mask, key_mask=key_mask, is_causal=False, need_weights=False
        )
        return self.dropout(attended)

    def forward(
        self,
        target: Tensor,
        memory: Tensor,
        *,
        target_mask: Tensor | None = None,
        target_key_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        memory_key_mask: Tensor | None = None,
        is_causal: bool = True,
    ) -> Tensor:
        """Decode ``target`` attending to ``memory``.

        Args:
            target: ``(b, T, E)``.
            memory: ``(b, S, E)``, the encoder's output.
            target_mask: self-attention mask, ``(T, T)`` or broadcastable to ``(b, h, T, T)``,
                combined with causality when ``is_causal``.
            target_key_mask: boolean ``(b, T)``, True for a real target token.
            memory_mask: cross-attention mask, ``(T, S)`` or broadcastable to ``(b, h, T, S)``.
            memory_key_mask: boolean ``(b, S)``, True for a real memory token.
            is_causal: target token ``t`` attends only to target tokens ``<= t`` (default).

        Returns:
            ``(b, T, E)``.
        """
        x = target
        if self.norm_first:
            x = x + self._self_attend(self.self_attention_norm(x), target_mask, target_key_mask, is_causal)
            x = x + self._cross_attend(self.cross_attention_norm(x), memory, memory_mask, memory_key_mask)
            x = x + self.dropout(self.feedforward(self.feedforward_norm(x)))
        else:
            x = self.self_attention_norm(x + self._self_attend(x, target_mask, target_key_mask, is_causal))
            x = self.cross_attention_norm(x + self._cross_attend(x, memory, memory_mask, memory_key_mask))
            x = self.feedforward_norm(x + self.dropout(self.feedforward(x)))
        return x


def _build_layers(
    layer: TransformerConfig | Callable[[], nn.Module], num_layers: int, layer_class: type
) -> nn.ModuleList:
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be an integer >= 1, got {num_layers!r}")
    if isinstance(layer, TransformerConfig):
        factory = functools.partial(layer_class.from_config, layer)
    elif callable(layer):
        factory = layer
    else:
        raise TypeError(
            f"layer must be a TransformerConfig or a zero-argument callable returning a layer, got {layer!r}"
        )
    layers = nn.ModuleList(factory() for _ in range(num_layers))
    if len({id(m) for m in layers}) != num_layers:
        raise ValueError(
            "the layer factory returned the same module twice; it must build a new layer on every call"
        )
    return layers


def _final_norm(layers: nn.ModuleList, final_norm: bool | None, layer_norm_eps: float) -> nn.Module:
    first = layers[0]
    if final_norm is None:
        final_norm = bool(getattr(first, "norm_first", False))
    if not final_norm:
        return nn.Identity()
    if not hasattr(first, "d_model"):
        raise ValueError("final_norm needs the layers to expose d_model")
    return nn.LayerNorm(first.d_model, eps=layer_norm_eps)


class TransformerEncoder(nn.Module):
    """A stack of encoder layers, with a final layer norm for pre-norm layers.

    Args:
        layer: a :class:`TransformerConfig` (every layer built from it) or a zero-argument
            callable returning a new layer on every call (e.g.
            ``lambda: TransformerEncoderLayer(512, 8, norm_first=True)``).
        num_layers: number of layers.
        final_norm: end with a layer norm; default: when the layers are pre-norm (post-norm
            layers end in a norm already).
        layer_norm_eps: the final norm's epsilon.

    Raises:
        ValueError: ``num_layers < 1``, or a factory that returns the same module twice.
        TypeError: ``layer`` is neither a config nor a callable.
    """

    def __init__(
        self,
        layer: TransformerConfig | Callable[[], nn.Module],
        num_layers: int,
        *,
        final_norm: bool | None = None,
        layer_norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        self.layers = _build_layers(layer, num_layers, TransformerEncoderLayer)
        self.norm = _final_norm(self.layers, final_norm, layer_norm_eps)

    def forward(
        self,
        inputs: Tensor,
        *,
        attn_mask: Tensor | None = None,
        key_mask: Tensor | None = None,
        is_causal: bool = False,
    ) -> Tensor:
        """Encode ``inputs`` ``(b, T, E)`` through every layer; masks as in
        :meth:`TransformerEncoderLayer.forward`. Returns ``(b, T, E)``."""
        x = inputs
        for layer in self.layers:
            x = layer(x, attn_mask=attn_mask, key_mask=key_mask, is_causal=is_causal)
        return self.norm(x)


class TransformerDecoder(nn.Module):
    """A stack of decoder layers, with a final layer norm for pre-norm layers.

    Args:
        layer: a :class:`TransformerConfig` or a zero-argument callable returning a new
            decoder layer on every call.
        num_layers: number of layers.
        final_norm: end with a layer norm; default: when the layers are pre-norm.
        layer_norm_eps: the final norm's epsilon.

    Raises:
        ValueError: ``num_layers < 1``, or a factory that returns the same module twice.
        TypeError: ``layer`` is neither a config nor a callable.
    """

    def __init__(
        self,
        layer: TransformerConfig | Callable[[], nn.Module],
        num_layers: int,
        *,
        final_norm: bool | None = None,
        layer_norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        self.layers = _build_layers(layer, num_layers, TransformerDecoderLayer)
        self.norm = _final_norm(self.layers, final_norm, layer_norm_eps)

    def forward(
        self,
        target: Tensor,
        memory: Tensor,
        *,
        target_mask: Tensor | None = None,
        target_key_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        memory_key_mask: Tensor | None = None,
        is_causal: bool = True,
    ) -> Tensor:
        """Decode ``target`` ``(b, T, E)`` against ``memory`` ``(b, S, E)`` through every layer;
        masks as in :meth:`TransformerDecoderLayer.forward`. Returns ``(b, T, E)``."""
        x = target
        for layer in self.layers:
            x = layer(
                x,
                memory,
                target_mask=target_mask,
                target_key_mask=target_key_mask,
                memory_mask=memory_mask,
                memory_key_mask=memory_key_mask,
                is_causal=is_causal,
            )
        return self.norm(x)
