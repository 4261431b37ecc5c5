"""Transformer encoder and decoder layers (Vaswani et al. 2017, sec. 3.1) around pluggable attention.

Each layer is attention (one pass of weighted voting), a position-wise feed-forward network, and
a residual connection with layer norm around each: post-norm ``x = norm(x + sublayer(x))`` as in
the paper, or pre-norm ``x = x + sublayer(norm(x))`` (Xiong et al. 2020, "On Layer Normalization
in the Transformer Architecture"), whose stacks end in one more layer norm.

The ``attention`` hook: a callable ``attention(embed_dim, num_heads, *, dropout)`` returning a
module with :class:`~torchvote.nn.MultiHeadAttention`'s ``forward`` signature
(``forward(query, key, value, *, attn_mask, key_mask, is_causal, need_weights) -> (output,
weights)``, batch first). It replaces softmax attention with any other voting, e.g. an iterative
routing-style attention. By default it is :class:`~torchvote.nn.MultiHeadAttention`. A layer
built with ``device=`` or ``dtype=`` passes on to the factory those of the two it was given, as
keywords, so the attention creates its parameters there (both torchvote attentions take them; a
factory that does not still serves layers built without them). For
incremental decoding the layers take a ``cache`` (:class:`~torchvote.nn.kv_cache.LayerCache`)
and hand its key/value caches to their attentions as ``cache=`` (only when one is given, so an
attention without caching still plugs in).

Decoder layers may take another factory (:class:`TransformerConfig`'s ``decoder_attention``):
their receivers are the target positions, decoded one at a time, so their attentions must keep
every position independent of the later ones. An attention that normalises over the receivers
(routing, bottom-up) sums over all the queries, later ones included; it fits an encoder's
self-attention but not a decoder's causal self-attention, nor its cross-attention, whose
queries are the same target positions (a later target token would change earlier outputs).

All inputs are batch first ``(b, T, E)`` (a layer built with ``batch_first=False``, torch's
default, takes and returns torch's ``(T, b, E)`` around the same computation). The layers take
torch's spellings of their arguments too (``nhead`` for ``num_heads``, ``batch_first``,
``bias=True``). Masks follow torchvote's convention: True = may attend;
``key_mask`` True = real token, False = padding. The stacks of these layers are in
:mod:`torchvote.nn.transformer_stack`. ``from_torch`` copies ``torch.nn``'s layers (and stacks)
exactly, optionally building the attentions with another factory (softmax attention turned into
routing-style voting, same weights); a copied layer keeps torch's layout unless told
``batch_first=`` (the stacks take batch-first inputs only: ``allow_sequence_first=True`` copies a
sequence-first stack batch first).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchvote.functional.masks import check_attention_mask, check_key_mask
from torchvote.nn.attention import MultiHeadAttention
from torchvote.nn.kv_cache import KVCache, LayerCache
from torchvote.tracing import register_output
from torchvote.validation import (
    check_choice,
    check_flag,
    check_float_dtype,
    check_input_dtype,
    check_inputs_beside,
    check_positive_float,
    check_positive_int,
    check_probability,
)

__all__ = [
    "AttentionFactory",
    "AttentionIntermediates",
    "TransformerConfig",
    "TransformerEncoderLayer",
    "TransformerDecoderLayer",
]

Activation = Literal["relu", "gelu"]
Factory = dict[str, Any]  # torch's factory keywords: {"device": ..., "dtype": ...}
_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"relu": F.relu, "gelu": F.gelu}


class AttentionFactory(Protocol):
    """Builds the attention of a transformer layer (see the module docstring); called with
    ``device=`` and ``dtype=`` too when the layer was given them."""

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
        decoder_attention: the :class:`AttentionFactory` of decoder layers (their causal
            self-attention and their cross-attention, whose queries are the target positions
            decoded one at a time); ``None`` for ``attention``. It lets a model normalise its
            encoder's attention over the receivers while its decoder keeps a causal one (over the
            senders). Encoder layers ignore it.
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
    decoder_attention: AttentionFactory | None = None

    def __post_init__(self) -> None:
        """Check the fields now, named as the config names them (a bad value failed only when a
        stack was built from the config, and then inside the attention, as its ``embed_dim``).

        Raises:
            TypeError, ValueError: a field of the wrong type or out of range, or an attention
                factory that is not callable.
        """
        _check_layer_options(
            self.d_model, self.num_heads, self.dim_feedforward, self.dropout, self.activation,
            self.norm_first, self.shared_qkv, self.layer_norm_eps,
        )
        for name in ("attention", "decoder_attention"):
            factory = getattr(self, name)
            if factory is not None and not callable(factory):
                raise TypeError(f"{name} must be a callable returning an nn.Module or None, got {factory!r}")


def _check_layer_options(
    d_model: Any,
    num_heads: Any,
    dim_feedforward: Any,
    dropout: Any,
    activation: Any,
    norm_first: Any,
    shared_qkv: Any,
    layer_norm_eps: Any,
) -> int:
    """Check a layer's options (a :class:`TransformerConfig`'s fields, or the layer's arguments
    of the same names); return ``dim_feedforward`` with its default (``4 * d_model``) filled in."""
    check_positive_int(d_model, "d_model")
    check_positive_int(num_heads, "num_heads")
    dim_feedforward = check_positive_int(
        4 * d_model if dim_feedforward is None else dim_feedforward, "dim_feedforward"
    )
    check_probability(dropout, "dropout")
    check_choice(activation, sorted(_ACTIVATIONS), "activation")
    check_positive_float(layer_norm_eps, "layer_norm_eps")  # 0 divides a constant input by 0
    check_flag(norm_first, "norm_first")  # "no" would have meant pre-norm
    check_flag(shared_qkv, "shared_qkv")
    return dim_feedforward


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


def _given(factory: Factory) -> Factory:
    """The factory keywords that were given (not None), for an attention factory: one that takes
    no ``device`` or ``dtype`` still builds the attention of a layer built without them."""
    return {name: value for name, value in factory.items() if value is not None}


def _torch_spelling(ours: Any, theirs: Any, our_name: str, their_name: str) -> Any:
    """One argument given by our name or by ``torch.nn``'s (``num_heads`` or torch's ``nhead``).

    Args:
        ours: the value under our name, ``None`` when not given.
        theirs: the value under torch's name, ``None`` when not given.
        our_name: our name, for the messages.
        their_name: torch's name, for the messages.

    Returns:
        The value given (checked by the caller).

    Raises:
        TypeError: neither was given (Python's own error for a missing argument).
        ValueError: both were given, with different values.
    """
    if ours is None and theirs is None:
        raise TypeError(f"missing the argument {our_name} (or torch's spelling, {their_name})")
    if ours is not None and theirs is not None and ours != theirs:
        raise ValueError(
            f"{our_name}={ours!r} and {their_name}={theirs!r} name one argument ({their_name} is "
            f"torch's spelling of {our_name}): give one of them"
        )
    return ours if ours is not None else theirs


def _sequence_layout(batch_first: bool, length: str, batch: Any = "batch", features: Any = "d_model") -> str:
    """A batched sequence's axes in a layer's layout, for messages: ``(batch, T, d_model)``, or
    torch's ``(T, batch, d_model)`` for a sequence-first layer (sizes in place of the names
    where given: ``(S, 3, 8)``)."""
    return f"({batch}, {length}, {features})" if batch_first else f"({length}, {batch}, {features})"


def _check_sequence(
    sequence: Any, argument: str, d_model: int, batch_first: bool, length: str, dtype: torch.dtype
) -> None:
    """Refuse what is not a sequence of ``d_model`` features, batched in the layer's layout or
    unbatched, before a sequence-first layer transposes it (the attention inside, batch first,
    would show the transposed shape, and name its own ``query`` or ``key``).

    Args:
        sequence: the input given.
        argument: its name in the layer's ``forward``, for the message.
        d_model: the feature size it must have.
        batch_first: the layer's layout.
        length: the name of its length axis, ``"T"`` or ``"S"``.
        dtype: the dtype of the layer's weights (its feed-forward's; layer norms kept in float32
            beside them take inputs of the weights' dtype), which it must have outside
            ``torch.autocast``.

    Raises:
        TypeError: not a floating-point tensor, or not of ``dtype``.
        ValueError: not 2-D or 3-D, or not ``d_model`` features (last axis); the message shows
            the shape as given.
    """
    check_input_dtype(sequence, dtype, argument)
    if sequence.dim() not in (2, 3) or sequence.shape[-1] != d_model:
        raise ValueError(
            f"{argument} must have shape {_sequence_layout(batch_first, length)} "
            f"(batch_first={batch_first}) or unbatched ({length}, d_model), with d_model = {d_model}, "
            f"got {tuple(sequence.shape)}"
        )


def _check_masks(
    masks: tuple[tuple[str, Any], tuple[str, Any]],
    batch: int | None,
    heads: int,
    length: int,
    source_len: int,
) -> None:
    """Refuse one attention's ``(attention mask, key mask)`` of the wrong type or shape, named as
    the layer's ``forward`` names them (the attention inside would name its own ``attn_mask`` and
    ``key_mask``), the sizes read from the inputs in the layer's layout, batched or not.

    Args:
        masks: ``((name, attention mask), (name, key mask))``, each mask ``None`` when not given.
        batch: the inputs' batch size ``b``; ``None`` for unbatched inputs.
        heads: the attention's heads ``h``.
        length: the queries' length ``L``.
        source_len: the keys' length ``S`` (cached keys included).

    Raises:
        TypeError: a mask that is not a tensor, or of the wrong dtype.
        ValueError: an attention mask that does not broadcast to the logits ``(b, h, L, S)``
            (``(h, L, S)`` unbatched), a key mask that is not
            ``(b, S)`` (``(S,)`` unbatched); the message shows the shape given and the one
            expected.
    """
    (attn_name, attn_mask), (key_name, key_mask) = masks
    check_attention_mask(attn_mask, (1 if batch is None else batch, heads, length, source_len), attn_name,
                         unbatched=batch is None)
    check_key_mask(key_mask, batch, source_len, key_name)


def _batch_first(tensor: Tensor, batch_first: bool) -> Tensor:
    """A batched ``(T, b, E)`` input of a sequence-first layer as ``(b, T, E)`` (and an output
    back: the swap is its own inverse); batch-first or unbatched ``(T, E)`` tensors as they are."""
    if batch_first or not isinstance(tensor, Tensor) or tensor.dim() != 3:
        return tensor
    return tensor.transpose(0, 1)  # (T, b, E) <-> (b, T, E)


def _check_torch_module(module: nn.Module, torch_class: type[nn.Module], steps: tuple[str, ...]) -> None:
    """Refuse for ``from_torch`` what is not ``torch_class`` or a subclass that changes its math.

    Args:
        module: the module to copy.
        torch_class: the ``torch.nn`` class it must be.
        steps: the methods of ``torch_class`` that compute its output; a subclass overriding one
            computes something ``from_torch`` cannot know.

    Raises:
        TypeError: ``module`` is not a ``torch_class``.
        ValueError: ``module``'s class overrides one of ``steps``.
    """
    if not isinstance(module, torch_class):
        raise TypeError(f"module must be a torch.nn.{torch_class.__name__}, got {type(module).__name__}")
    overridden = [step for step in steps if getattr(type(module), step) is not getattr(torch_class, step)]
    if overridden:
        raise ValueError(
            f"from_torch: {type(module).__name__} overrides torch.nn.{torch_class.__name__}'s "
            f"{', '.join(overridden)}; only torch's own computation can be copied"
        )


def _torch_layer_norm_eps(norm: object, name: str, d_model: int) -> float:
    """The epsilon of a torch layer's ``nn.LayerNorm`` ``name``, after checking that a torchvote
    layer norm (over ``d_model`` features, with a learned scale and bias) can take its place.

    Raises:
        ValueError: ``norm`` is not an ``nn.LayerNorm`` over ``(d_model,)``, or it has no learned
            scale (``elementwise_affine=False``) or no bias (``bias=False``).
    """
    if not isinstance(norm, nn.LayerNorm) or tuple(norm.normalized_shape) != (d_model,):
        raise ValueError(
            f"from_torch: {name} must be an nn.LayerNorm over ({d_model},) features, got {norm!r}"
        )
    if not norm.elementwise_affine:
        raise ValueError(
            f"from_torch: {name}.elementwise_affine=False is not supported: torchvote's layer norms "
            "learn a scale and a bias"
        )
    if norm.bias is None:
        raise ValueError(f"from_torch: bias=False is not supported ({name} has no bias)")
    return float(norm.eps)


def _torch_activation(activation: object) -> Activation:
    """The name of a torch layer's ``activation`` (torch turns ``"relu"``/``"gelu"`` into
    ``F.relu``/``F.gelu`` when it builds the layer).

    Raises:
        ValueError: any other callable, ``nn.GELU(approximate="tanh")`` included.
    """
    if activation is F.relu or activation is torch.relu or type(activation) is nn.ReLU:
        return "relu"
    if activation is F.gelu or (type(activation) is nn.GELU and activation.approximate == "none"):
        return "gelu"
    raise ValueError(
        f"from_torch: activation={activation!r} is not supported: torchvote's layers take relu "
        "('relu', F.relu, nn.ReLU()) or exact gelu ('gelu', F.gelu, nn.GELU()); "
        "nn.GELU(approximate='tanh') and other callables have no equivalent"
    )


@dataclass(frozen=True)
class _TorchNames:
    """Where a ``torch.nn`` transformer layer keeps what :meth:`_TransformerLayer.from_torch`
    copies: its class, the methods that compute its output, and torch's name for each of our
    attentions and norms (ours -> torch's), and its dropouts."""

    torch_class: type[nn.Module]
    steps: tuple[str, ...]
    attentions: dict[str, str]
    norms: dict[str, str]
    dropouts: tuple[str, ...]


def _torch_layouts(module: nn.Module, names: _TorchNames) -> dict[str, bool]:
    """The ``batch_first`` of each attention of torch's layer ``module``, by torch's name
    (``{"self_attn": True, "multihead_attn": False}``): torch builds them all with the layer's,
    but an attention replaced or reset after construction may differ."""
    return {theirs: bool(getattr(module, theirs).batch_first) for theirs in names.attentions.values()}


def _torch_batch_first(module: nn.Module, names: _TorchNames) -> bool:
    """The layout of torch's layer ``module``: its attentions' ``batch_first``.

    Raises:
        ValueError: attentions of different layouts (set by hand after construction): ``module``
            has no one layout for a copy to keep.
    """
    layouts = _torch_layouts(module, names)
    if len(set(layouts.values())) > 1:
        raise ValueError(
            f"from_torch: the attentions' layouts differ ({_listed(layouts, '.batch_first')}), so the "
            "copy has no one layout to keep; give batch_first=True or False to set it (the weights "
            "are the same in either layout)"
        )
    return next(iter(layouts.values()))


def _torch_settings(module: nn.Module, names: _TorchNames, batch_first: bool | None) -> dict[str, Any]:
    """The constructor arguments of the torchvote layer equivalent to torch's layer ``module``
    (its layout, ``batch_first``, included), after checking that it can express everything
    ``module`` does.

    Args:
        module: torch's layer.
        names: where ``module`` keeps what is copied.
        batch_first: the copy's layout; ``None`` for ``module``'s (its attentions', which must
            agree). Given, ``module``'s attentions' layouts are not read: they do not change the
            weights.

    Raises:
        ValueError: as :meth:`_TransformerLayer.from_torch` lists, the message naming the attribute.
    """
    first = getattr(module, next(iter(names.attentions.values())))
    d_model, num_heads = first.embed_dim, first.num_heads
    for theirs in names.attentions.values():
        mha = getattr(module, theirs)
        if (mha.embed_dim, mha.num_heads, mha.kdim, mha.vdim) != (d_model, num_heads, d_model, d_model):
            raise ValueError(
                f"from_torch: {theirs} has embed_dim={mha.embed_dim}, num_heads={mha.num_heads}, "
                f"kdim={mha.kdim}, vdim={mha.vdim}; torchvote's layers need every attention "
                f"with embed_dim = kdim = vdim = d_model = {d_model} and num_heads={num_heads}"
            )
        if mha.in_proj_bias is None or mha.out_proj.bias is None:
            raise ValueError(f"from_torch: bias=False is not supported ({theirs} has no bias)")
    expand, contract = module.linear1, module.linear2
    if not (isinstance(expand, nn.Linear) and isinstance(contract, nn.Linear)):
        raise ValueError(
            f"from_torch: linear1 and linear2 must be nn.Linear, got {type(expand).__name__} "
            f"and {type(contract).__name__}"
        )
    if expand.bias is None or contract.bias is None:
        raise ValueError("from_torch: bias=False is not supported (linear1 or linear2 has no bias)")
    epsilons = {theirs: _torch_layer_norm_eps(getattr(module, theirs), theirs, d_model)
                for theirs in names.norms.values()}
    if len(set(epsilons.values())) > 1:
        raise ValueError(
            f"from_torch: the norms' eps differ ({_listed(epsilons, '.eps')}); torchvote's "
            "layers take one layer_norm_eps"
        )
    dropouts = {f"{theirs}.dropout": float(getattr(module, theirs).dropout)
                for theirs in names.attentions.values()}
    for name in names.dropouts:
        dropout = getattr(module, name)
        if not isinstance(dropout, nn.Dropout):
            raise ValueError(f"from_torch: {name} must be an nn.Dropout, got {dropout!r}")
        dropouts[f"{name}.p"] = float(dropout.p)
    if len(set(dropouts.values())) > 1:
        raise ValueError(
            f"from_torch: the dropout probabilities differ ({_listed(dropouts)}); torchvote's "
            "layers take one dropout for the attention, the feed-forward network and the residuals"
        )
    return {
        "d_model": d_model,
        "num_heads": num_heads,
        "dim_feedforward": expand.out_features,
        "dropout": next(iter(dropouts.values())),
        "activation": _torch_activation(module.activation),
        "norm_first": module.norm_first,
        "layer_norm_eps": next(iter(epsilons.values())),
        "batch_first": _torch_batch_first(module, names) if batch_first is None else batch_first,
    }


def _listed(values: Mapping[str, object], suffix: str = "") -> str:
    """``"name=value, ..."`` for an error message."""
    return ", ".join(f"{name}{suffix}={value}" for name, value in values.items())


def _cache(cache: KVCache | None) -> dict[str, KVCache]:
    """``{"cache": cache}`` for the attention's call, or nothing (attentions without a cache)."""
    return {} if cache is None else {"cache": cache}


class _FeedForward(nn.Module):
    """Position-wise ``linear -> activation -> dropout -> linear`` (sec. 3.3)."""

    def __init__(
        self, d_model: int, dim_feedforward: int, activation: Activation, dropout: float, factory: Factory
    ) -> None:
        super().__init__()
        self.expand = nn.Linear(d_model, dim_feedforward, **factory)
        self.contract = nn.Linear(dim_feedforward, d_model, **factory)
        self.activation = _ACTIVATIONS[activation]
        self.dropout = nn.Dropout(dropout)

    def forward(self, inputs: Tensor) -> Tensor:
        return self.contract(self.dropout(self.activation(self.expand(inputs))))


@dataclass
class AttentionIntermediates:
    """Attention weights a forward pass returned, by module name, in call order.

    The record a layer or stack returns with ``return_intermediates=True`` (as x-transformers'
    ``Intermediates``); plots and models read it instead of hooking the attention modules.

    Attributes:
        weights: module name (relative to the module that returned the record, e.g.
            ``"layers.0.self_attention"``) -> ``(b, L, S)`` weights averaged over the heads (or
            whatever the attention module returns for ``need_weights=True``).
    """

    weights: dict[str, Tensor] = field(default_factory=dict)

    def add(self, prefix: str, other: AttentionIntermediates) -> None:
        """Append ``other``'s weights under ``prefix.`` + their names, keeping the call order."""
        for name, weights in other.weights.items():
            self.weights[f"{prefix}.{name}"] = weights

    @property
    def last(self) -> Tensor:
        """The weights of the last attention call.

        Raises:
            ValueError: nothing was recorded.
        """
        if not self.weights:
            raise ValueError("no attention weights were recorded")
        return next(reversed(self.weights.values()))


register_output(AttentionIntermediates)  # a pytree node: torch.export can return it


_Layer = TypeVar("_Layer", bound="_TransformerLayer")


class _TransformerLayer(nn.Module):
    """What the encoder and decoder layers share: sizes, feed-forward network, residual sublayer.

    Every sublayer (attention or feed-forward) runs through :meth:`_residual`, the one place that
    knows pre- and post-norm::

        post-norm:  x = norm(x + dropout(sublayer(x)))           (Vaswani et al. 2017)
        pre-norm:   x = x + dropout(sublayer(norm(x)))           (Xiong et al. 2020)

    The norms stay attributes of the concrete layers, so the state-dict keys name the sublayer
    they belong to (``attention_norm``, ``feedforward_norm``, ...).
    """

    _torch: ClassVar[_TorchNames]  # the torch.nn layer that from_torch copies

    def __init__(
        self,
        d_model: int,
        num_heads: int | None = None,
        *,
        nhead: int | None = None,
        dim_feedforward: int | None = None,
        dropout: float = 0.1,
        activation: Activation = "relu",
        norm_first: bool = False,
        shared_qkv: bool = False,
        layer_norm_eps: float = 1e-5,
        batch_first: bool = True,
        bias: bool = True,
        attention: AttentionFactory | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        num_heads = _torch_spelling(num_heads, nhead, "num_heads", "nhead")
        dim_feedforward = _check_layer_options(
            d_model, num_heads, dim_feedforward, dropout, activation, norm_first, shared_qkv, layer_norm_eps
        )
        self.batch_first = check_flag(batch_first, "batch_first")
        if not check_flag(bias, "bias"):
            raise ValueError(
                "bias=False is not supported: torchvote's transformer layers always learn the "
                "biases of their attentions, feed-forward network and layer norms"
            )
        self.make_attention = _attention_factory(attention, shared_qkv)
        self.d_model, self.norm_first, self.num_heads = d_model, norm_first, num_heads
        # Attentions before the feed-forward network: the order the parameters draw their
        # initial values in (and so a seeded model's numbers) stays as it was.
        factory: Factory = {"device": device, "dtype": check_float_dtype(dtype)}
        self._build_sublayers(num_heads, dropout, layer_norm_eps, factory)
        self.feedforward = _FeedForward(d_model, dim_feedforward, activation, dropout, factory)
        self.dropout = nn.Dropout(dropout)

    def extra_repr(self) -> str:
        # the layout a layer takes (its attentions, inside, are batch first whatever it is)
        return (
            f"d_model={self.d_model}, num_heads={self.num_heads}, norm_first={self.norm_first}, "
            f"batch_first={self.batch_first}"
        )

    def _build_sublayers(
        self, num_heads: int, dropout: float, layer_norm_eps: float, factory: Factory
    ) -> None:
        """Create the attentions and the norms (named after their sublayers), passing them
        ``factory`` (the ``device`` and ``dtype``)."""
        raise NotImplementedError

    def _attention(self, num_heads: int, dropout: float, factory: Factory) -> nn.Module:
        """One attention from the factory, given the factory keywords only when they were given."""
        return self.make_attention(self.d_model, num_heads, dropout=dropout, **_given(factory))

    @staticmethod
    def _config_attention(config: TransformerConfig) -> AttentionFactory | None:
        """The attention factory of this kind of layer in ``config``."""
        return config.attention

    @classmethod
    def from_config(
        cls,
        config: TransformerConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> _TransformerLayer:
        """Build a layer from a :class:`TransformerConfig`, its parameters on ``device`` in
        ``dtype`` (where to build is no part of the architecture, so not a field of the config)."""
        return cls(
            config.d_model,
            config.num_heads,
            dim_feedforward=config.dim_feedforward,
            dropout=config.dropout,
            activation=config.activation,
            norm_first=config.norm_first,
            shared_qkv=config.shared_qkv,
            layer_norm_eps=config.layer_norm_eps,
            attention=cls._config_attention(config),
            device=device,
            dtype=dtype,
        )

    @classmethod
    def from_torch(
        cls: type[_Layer],
        module: nn.Module,
        *,
        attention: AttentionFactory | None = None,
        batch_first: bool | None = None,
        allow_sequence_first: bool = False,
    ) -> _Layer:
        """A layer with exactly the weights and settings of torch's layer ``module``.

        Copies the attentions (through :meth:`MultiHeadAttention.from_torch
        <torchvote.nn.MultiHeadAttention.from_torch>`), the feed-forward network, the norms, the
        sizes, ``activation``, ``dropout``, ``norm_first``, ``layer_norm_eps``, the layout
        (``batch_first``), the training flag, device and dtype. The forward passes then agree
        (the class docstring names the parameters; translate the masks as
        :class:`~torchvote.nn.MultiHeadAttention` shows: ``key_mask=~src_key_padding_mask``,
        ``is_causal=True`` for torch's causal mask; torch's decoder layer is causal only when
        given a causal ``tgt_mask``, ours by default).

        Args:
            module: a ``torch.nn.TransformerEncoderLayer`` (for this encoder layer) or
                ``torch.nn.TransformerDecoderLayer`` (for the decoder layer).
            attention: an :class:`AttentionFactory` to build the attentions with instead of
                :class:`~torchvote.nn.MultiHeadAttention`, e.g.
                ``attention_factory("routing", iterations=3)``: each attention then loads the
                copied attention's state dict, so it must take
                :class:`~torchvote.nn.MultiHeadAttention`'s parameters (as
                :class:`~torchvote.nn.RoutingAttention` does).
            batch_first: the copy's layout: ``None`` keeps ``module``'s (the copy then takes
                the inputs ``module`` takes, ``(T, b, E)`` for torch's default; refused when
                ``module``'s attentions have different layouts); True or False sets it (the
                weights are the same in either layout). For a ``module`` whose attentions have
                mixed layouts the copy computes what a one-layout torch layer with the same
                weights computes (torch's mixed layer reads a batched input in each attention's
                own layout).
            allow_sequence_first: ``batch_first=True`` under its earlier name (the stacks'
                ``from_torch`` keeps it), from when a sequence-first ``module`` was refused
                without it.

        Returns:
            The equivalent layer (a copy: later changes to ``module`` do not carry over).

        Raises:
            TypeError: ``module`` is not torch's layer of this kind (or it holds an attention
                that is not an ``nn.MultiheadAttention``); ``batch_first`` that is not a bool or
                None; ``allow_sequence_first`` that is not a bool.
            ValueError: ``allow_sequence_first=True`` with ``batch_first=False``; what this
                layer cannot express, the message naming the attribute: attentions of different
                layouts with ``batch_first=None``, an ``activation`` other than relu or
                exact gelu, ``bias=False``, a norm that is not an ``nn.LayerNorm`` with
                ``elementwise_affine=True``, norms with different ``eps``, dropout
                probabilities that differ between the attention and the rest, attentions with
                other sizes or heads than each other or ``kdim``/``vdim`` other than
                ``d_model``, what :meth:`MultiHeadAttention.from_torch
                <torchvote.nn.MultiHeadAttention.from_torch>` refuses (``add_bias_kv``,
                ``add_zero_attn``), a subclass of torch's layer that overrides its computation,
                or an ``attention`` whose modules do not take the copied parameters.
        """
        names = cls._torch
        _check_torch_module(module, names.torch_class, names.steps)
        check_flag(allow_sequence_first, "allow_sequence_first")
        if batch_first is not None:
            check_flag(batch_first, "batch_first")
        if allow_sequence_first:
            if batch_first is False:
                raise ValueError("from_torch: allow_sequence_first=True asks for a batch-first copy; "
                                 "batch_first=False contradicts it")
            batch_first = True
        copies: dict[str, MultiHeadAttention] = {}
        for ours, theirs in names.attentions.items():
            try:
                copies[ours] = MultiHeadAttention.from_torch(getattr(module, theirs))
            except (TypeError, ValueError) as error:  # name the attention: the message says "module"
                raise type(error)(f"{theirs}: {error}") from error
        settings = _torch_settings(module, names, batch_first)
        reference = module.linear1.weight
        layer = cls(**settings, attention=attention, device=reference.device, dtype=reference.dtype)
        for ours, copy in copies.items():
            try:
                getattr(layer, ours).load_state_dict(copy.state_dict())
            except RuntimeError as error:  # a factory's module without MultiHeadAttention's parameters
                raise ValueError(
                    f"from_torch: the attention factory's {type(getattr(layer, ours)).__name__} does "
                    f"not take MultiHeadAttention's parameters: {error}"
                ) from error
        layer.feedforward.expand.load_state_dict(module.linear1.state_dict())
        layer.feedforward.contract.load_state_dict(module.linear2.state_dict())
        for ours, theirs in names.norms.items():
            getattr(layer, ours).load_state_dict(getattr(module, theirs).state_dict())
        return layer.train(module.training)

    def _residual(
        self, x: Tensor, norm: nn.Module, sublayer: Callable[[Tensor], tuple[Tensor, Tensor | None]]
    ) -> tuple[Tensor, Tensor | None]:
        """One residual sublayer: ``(b, T, E) -> (b, T, E)`` and the sublayer's weights, if any."""
        if self.norm_first:
            out, weights = sublayer(norm(x))
            return x + self.dropout(out), weights
        out, weights = sublayer(x)
        return norm(x + self.dropout(out)), weights

    def _feedforward(self, x: Tensor) -> tuple[Tensor, None]:
        return self.feedforward(x), None


class TransformerEncoderLayer(_TransformerLayer):
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
    ``feedforward_norm``); :meth:`from_torch` copies one.

    Args:
        d_model: model feature size ``E`` (as every argument here but ``nhead``,
            ``batch_first`` and ``bias``, a field of :class:`TransformerConfig`).
        num_heads: attention heads.
        nhead: torch's spelling of ``num_heads``: give either (both only with one value).
        dim_feedforward: hidden size of the feed-forward network; default ``4 * d_model``
            (torch's is 2048 whatever ``d_model``).
        dropout: on the attention weights, inside the feed-forward network, and on each
            sublayer's output before the residual sum.
        activation: ``"relu"`` (the paper) or ``"gelu"``.
        norm_first: pre-norm (True) or post-norm (False, the paper).
        shared_qkv: one matrix for queries, keys and values in the default attention.
        layer_norm_eps: the layer norms' epsilon.
        batch_first: inputs and outputs ``(b, T, E)`` (True, the default, unlike torch's);
            ``False`` takes and returns torch's default layout ``(T, b, E)`` (the layer
            transposes around the same computation; masks, key masks and the attention weights
            of ``return_intermediates`` stay batch first, as torch's are).
        bias: torch's option; only ``True`` (the layers always learn their biases).
        attention: an :class:`AttentionFactory` replacing the default attention.
        device: where to create the parameters (passed to ``attention`` when given).
        dtype: the parameters' dtype (passed to ``attention`` when given).

    Raises:
        ValueError: bad sizes, dropout or activation, ``shared_qkv`` with a custom
            ``attention``, ``num_heads`` and ``nhead`` with different values, or
            ``bias=False``.
        TypeError: ``norm_first``, ``shared_qkv``, ``batch_first`` or ``bias`` that is not a
            bool; neither ``num_heads`` nor ``nhead``.
    """

    _torch = _TorchNames(
        torch_class=nn.TransformerEncoderLayer,
        steps=("forward", "_sa_block", "_ff_block"),
        attentions={"self_attention": "self_attn"},
        norms={"attention_norm": "norm1", "feedforward_norm": "norm2"},
        dropouts=("dropout", "dropout1", "dropout2"),
    )

    def _build_sublayers(
        self, num_heads: int, dropout: float, layer_norm_eps: float, factory: Factory
    ) -> None:
        self.self_attention = self._attention(num_heads, dropout, factory)
        self.attention_norm = nn.LayerNorm(self.d_model, eps=layer_norm_eps, **factory)
        self.feedforward_norm = nn.LayerNorm(self.d_model, eps=layer_norm_eps, **factory)

    def forward(
        self,
        inputs: Tensor,
        *,
        attn_mask: Tensor | None = None,
        key_mask: Tensor | None = None,
        is_causal: bool = False,
        return_intermediates: bool = False,
        cache: LayerCache | None = None,
    ) -> Tensor | tuple[Tensor, AttentionIntermediates]:
        """Encode ``inputs``.

        Args:
            inputs: ``(b, T, E)``; ``(T, b, E)`` for a layer built with ``batch_first=False``.
            attn_mask: boolean (True = may attend) or float, ``(T, T)`` or broadcastable to
                ``(b, h, T, T)``.
            key_mask: boolean ``(b, T)``, True for a real token, False for padding.
            is_causal: token ``t`` attends only to tokens ``<= t``.
            return_intermediates: also return the attention weights (the attention is then
                asked for them, which forms the ``(b, h, T, T)`` matrix).
            cache: the layer's caches (incremental causal decoding with a stack of these layers,
                as a decoder-only language model): ``inputs`` are the new tokens only; the
                masks then cover every key, cached and new (see
                :meth:`~torchvote.nn.MultiHeadAttention.forward`).

        Returns:
            ``(b, T, E)`` (``(T, b, E)`` with ``batch_first=False``); with
            ``return_intermediates``, ``(output, record)`` with the record's
            ``weights["self_attention"]`` (batch first).

        Raises:
            TypeError: ``inputs`` that is not a floating-point tensor, or not of the layer's
                weights' dtype (outside ``torch.autocast``); ``is_causal`` or
                ``return_intermediates`` that is not a bool; and what the attention raises for its
                inputs and masks.
            ValueError: ``inputs`` that is not ``(b, T, d_model)`` (``(T, b, d_model)`` with
                ``batch_first=False``) or unbatched ``(T, d_model)``, its shape shown as given;
                and what the attention raises for its masks (batch first in either layout).
        """
        check_flag(is_causal, "is_causal")
        check_flag(return_intermediates, "return_intermediates")
        _check_sequence(  # as given, not transposed
            inputs, "inputs", self.d_model, self.batch_first, "T", self.feedforward.expand.weight.dtype
        )
        inputs = _batch_first(inputs, self.batch_first)  # (b, T, E)

        def attend(x: Tensor) -> tuple[Tensor, Tensor | None]:
            return self.self_attention(
                x, x, x, attn_mask=attn_mask, key_mask=key_mask, is_causal=is_causal,
                need_weights=return_intermediates, **_cache(cache and cache.self_attention),
            )

        x, weights = self._residual(inputs, self.attention_norm, attend)  # (b, T, E)
        x, _ = self._residual(x, self.feedforward_norm, self._feedforward)  # (b, T, E)
        x = _batch_first(x, self.batch_first)  # (b, T, E), or back to (T, b, E) for a sequence-first layer
        if not return_intermediates:
            return x
        return x, AttentionIntermediates({"self_attention": weights})


class TransformerDecoderLayer(_TransformerLayer):
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
    causal ``tgt_mask``; :meth:`from_torch` copies one.

    Args:
        d_model: model feature size ``E`` (as every argument here but ``nhead``,
            ``batch_first`` and ``bias``, a field of :class:`TransformerConfig`).
        num_heads: attention heads.
        nhead: torch's spelling of ``num_heads``: give either (both only with one value).
        dim_feedforward: hidden size of the feed-forward network; default ``4 * d_model``
            (torch's is 2048 whatever ``d_model``).
        dropout: on the attention weights, inside the feed-forward network, and on each
            sublayer's output before the residual sum.
        activation: ``"relu"`` (the paper) or ``"gelu"``.
        norm_first: pre-norm (True) or post-norm (False, the paper).
        shared_qkv: one matrix for queries, keys and values in the default attentions (in
            cross-attention it projects the target and the memory alike).
        layer_norm_eps: the layer norms' epsilon.
        batch_first: ``target``, ``memory`` and the output ``(b, T, E)`` (True, the default,
            unlike torch's); ``False`` takes and returns torch's default layout ``(T, b, E)``
            (``memory`` ``(S, b, E)``; the layer transposes around the same computation; masks,
            key masks and the attention weights stay batch first, as torch's are).
        bias: torch's option; only ``True`` (the layers always learn their biases).
        attention: an :class:`AttentionFactory` replacing the default attention; it serves both
            attentions. Built from a config (:meth:`from_config`, the stacks), the layer takes
            ``decoder_attention`` when it is set: both attentions' queries are target positions
            decoded one at a time.
        device: where to create the parameters (passed to ``attention`` when given).
        dtype: the parameters' dtype (passed to ``attention`` when given).

    Raises:
        ValueError: bad sizes, dropout or activation, ``shared_qkv`` with a custom
            ``attention``, ``num_heads`` and ``nhead`` with different values, or
            ``bias=False``.
        TypeError: ``norm_first``, ``shared_qkv``, ``batch_first`` or ``bias`` that is not a
            bool; neither ``num_heads`` nor ``nhead``.
    """

    _torch = _TorchNames(
        torch_class=nn.TransformerDecoderLayer,
        steps=("forward", "_sa_block", "_mha_block", "_ff_block"),
        attentions={"self_attention": "self_attn", "cross_attention": "multihead_attn"},
        norms={"self_attention_norm": "norm1", "cross_attention_norm": "norm2", "feedforward_norm": "norm3"},
        dropouts=("dropout", "dropout1", "dropout2", "dropout3"),
    )

    @staticmethod
    def _config_attention(config: TransformerConfig) -> AttentionFactory | None:
        """``config.decoder_attention``, or ``config.attention`` when it is not set."""
        return config.attention if config.decoder_attention is None else config.decoder_attention

    def _build_sublayers(
        self, num_heads: int, dropout: float, layer_norm_eps: float, factory: Factory
    ) -> None:
        self.self_attention = self._attention(num_heads, dropout, factory)
        self.cross_attention = self._attention(num_heads, dropout, factory)
        self.self_attention_norm = nn.LayerNorm(self.d_model, eps=layer_norm_eps, **factory)
        self.cross_attention_norm = nn.LayerNorm(self.d_model, eps=layer_norm_eps, **factory)
        self.feedforward_norm = nn.LayerNorm(self.d_model, eps=layer_norm_eps, **factory)

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
        return_intermediates: bool = False,
        cache: LayerCache | None = None,
    ) -> Tensor | tuple[Tensor, AttentionIntermediates]:
        """Decode ``target`` attending to ``memory``.

        Args:
            target: ``(b, T, E)``; ``(T, b, E)`` for a layer built with ``batch_first=False``.
            memory: ``(b, S, E)``, the encoder's output; ``(S, b, E)`` with ``batch_first=False``.
            target_mask: self-attention mask, ``(T, T)`` or broadcastable to ``(b, h, T, T)``,
                combined with causality when ``is_causal``.
            target_key_mask: boolean ``(b, T)`` (``(T,)`` for an unbatched target), True for a
                real target token.
            memory_mask: cross-attention mask, ``(T, S)`` or broadcastable to ``(b, h, T, S)``.
            memory_key_mask: boolean ``(b, S)`` (``(S,)`` for an unbatched target), True for a
                real memory token.
            is_causal: target token ``t`` attends only to target tokens ``<= t`` (default).
            return_intermediates: also return both attentions' weights.
            cache: the layer's caches (incremental decoding): ``target`` holds the new tokens
                only (positions after the cached ones; ``target_mask`` and ``target_key_mask``
                then cover every target key, cached and new), and the memory's keys and values
                are projected on the first call only.

        Returns:
            ``(b, T, E)`` (``(T, b, E)`` with ``batch_first=False``); with
            ``return_intermediates``, ``(output, record)`` with the record's
            ``weights["self_attention"]`` ``(b, T, T)`` and ``weights["cross_attention"]``
            ``(b, T, S)``.

        Raises:
            TypeError: ``target`` or ``memory`` that is not a floating-point tensor, or of
                another dtype than the other or than the layer's weights (outside
                ``torch.autocast``); ``is_causal`` or ``return_intermediates`` that is
                not a bool; a mask that is not a tensor or of the wrong dtype (named as this
                method names it); and what the attentions raise for their inputs.
            ValueError: ``target`` that is not ``(b, T, d_model)`` or unbatched
                ``(T, d_model)``; ``memory`` that is not ``(b, S, d_model)`` for ``b`` target
                sequences (``(T, b, d_model)`` and ``(S, b, d_model)`` with
                ``batch_first=False``), or not ``(S, d_model)`` for an unbatched target; a mask
                of the wrong shape (batch first in either layout, without the batch axis for an
                unbatched target). Each named as this method names it, its shape shown as given
                beside the shape expected.
        """
        check_flag(is_causal, "is_causal")
        check_flag(return_intermediates, "return_intermediates")
        self._check_decoder_inputs(target, memory, target_mask, target_key_mask, memory_mask, memory_key_mask,
                                   0 if cache is None else cache.self_attention.length)
        target = _batch_first(target, self.batch_first)  # (b, T, E)
        memory = _batch_first(memory, self.batch_first)  # (b, S, E)

        def self_attend(x: Tensor) -> tuple[Tensor, Tensor | None]:
            return self.self_attention(
                x, x, x, attn_mask=target_mask, key_mask=target_key_mask, is_causal=is_causal,
                need_weights=return_intermediates, **_cache(cache and cache.self_attention),
            )

        def cross_attend(x: Tensor) -> tuple[Tensor, Tensor | None]:
            return self.cross_attention(
                x, memory, memory, attn_mask=memory_mask, key_mask=memory_key_mask,
                is_causal=False, need_weights=return_intermediates,
                **_cache(cache and cache.cross_attention),
            )

        x, self_weights = self._residual(target, self.self_attention_norm, self_attend)  # (b, T, E)
        x, cross_weights = self._residual(x, self.cross_attention_norm, cross_attend)  # (b, T, E)
        x, _ = self._residual(x, self.feedforward_norm, self._feedforward)  # (b, T, E)
        x = _batch_first(x, self.batch_first)  # (b, T, E), or back to (T, b, E) for a sequence-first layer
        if not return_intermediates:
            return x
        return x, AttentionIntermediates({"self_attention": self_weights, "cross_attention": cross_weights})

    def _check_decoder_inputs(
        self,
        target: Tensor,
        memory: Tensor,
        target_mask: Tensor | None,
        target_key_mask: Tensor | None,
        memory_mask: Tensor | None,
        memory_key_mask: Tensor | None,
        past: int,
    ) -> None:
        """The target, the memory and the masks of a call, in the layer's layout (before a
        sequence-first layer transposes them), named as :meth:`forward` names them (the
        attentions inside would name their own ``query``, ``key``, ``key_mask`` and
        ``attn_mask``, and show the transposed shapes), batched or unbatched. ``past``: the target
        keys a cache holds before this call."""
        if not isinstance(memory, Tensor):  # None was read as "no key": self-attention, silently
            raise TypeError(
                f"memory must be a tensor, the encoder's output {_sequence_layout(self.batch_first, 'S')}, "
                f"got {type(memory).__name__}"
            )
        parameters = self.feedforward.expand.weight.dtype
        _check_sequence(target, "target", self.d_model, self.batch_first, "T", parameters)
        check_inputs_beside(target, [("memory", memory)], where="the target's features")
        batch: int | None
        if target.dim() == 2:  # unbatched: (T, E) and (S, E), in either layout
            if memory.dim() != 2 or memory.shape[-1] != self.d_model:
                raise ValueError(
                    f"memory must have shape (S, d_model) = (S, {self.d_model}) for an unbatched "
                    f"target of shape {tuple(target.shape)}, got {tuple(memory.shape)}"
                )
            batch, length, source_len = None, target.shape[0], memory.shape[0]
        else:
            batch_axis = 0 if self.batch_first else 1  # the other of the first two axes is the length
            batch, length = target.shape[batch_axis], target.shape[1 - batch_axis]
            if memory.dim() != 3 or memory.shape[batch_axis] != batch or memory.shape[-1] != self.d_model:
                # the memory's shape in the layer's layout: (b, S, E), or (S, b, E) sequence first
                expected = _sequence_layout(self.batch_first, "S", batch, self.d_model)
                raise ValueError(
                    f"memory must have shape {_sequence_layout(self.batch_first, 'S')} = {expected} for "
                    f"a target of shape {tuple(target.shape)}, got {tuple(memory.shape)}"
                )
            source_len = memory.shape[1 - batch_axis]
        _check_masks((("target_mask", target_mask), ("target_key_mask", target_key_mask)),
                     batch, self.num_heads, length, past + length)
        _check_masks((("memory_mask", memory_mask), ("memory_key_mask", memory_key_mask)),
                     batch, self.num_heads, length, source_len)
