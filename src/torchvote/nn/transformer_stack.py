"""Stacks of Transformer layers (Vaswani et al. 2017, sec. 3.1), with a final norm for pre-norm.

A stack runs its layers in turn and, with ``return_intermediates=True``, returns every layer's
attention weights in one :class:`~torchvote.nn.transformer.AttentionIntermediates` record, named
``"layers.{n}.self_attention"`` (and ``"layers.{n}.cross_attention"`` in the decoder).

All inputs are batch first ``(b, T, E)``; masks as in :mod:`torchvote.nn.transformer`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from torchvote.nn.kv_cache import TransformerCache
from torchvote.nn.transformer import (
    AttentionFactory,
    AttentionIntermediates,
    TransformerConfig,
    TransformerDecoderLayer,
    TransformerEncoderLayer,
    _check_torch_module,
    _listed,
    _torch_layer_norm_eps,
    _torch_layouts,
)
from torchvote.validation import check_flag, check_positive_float, check_positive_int

__all__ = ["TransformerDecoder", "TransformerEncoder"]


def _build_layers(
    layer: TransformerConfig | Callable[[], nn.Module],
    num_layers: int,
    layer_class: type,
    device: torch.device | str | None,
    dtype: torch.dtype | None,
) -> nn.ModuleList:
    check_positive_int(num_layers, "num_layers")
    if isinstance(layer, TransformerConfig):
        factory = functools.partial(layer_class.from_config, layer, device=device, dtype=dtype)
    elif isinstance(layer, nn.Module):  # torch.nn's stacks take a layer and copy it: called, it ran
        raise TypeError(
            f"layer must be a TransformerConfig or a zero-argument callable returning a new layer, got a "
            f"{type(layer).__name__} module: pass its config, or a factory such as "
            f"lambda: copy.deepcopy(layer) for {num_layers!r} independent copies"
        )
    elif callable(layer):
        factory = layer
    else:
        raise TypeError(
            f"layer must be a TransformerConfig or a zero-argument callable returning a layer, got {layer!r}"
        )
    layers = []
    for _ in range(num_layers):
        built = factory()
        if not isinstance(built, nn.Module):
            raise TypeError(f"the layer factory must return an nn.Module, got {type(built).__name__}")
        layers.append(built)
    layers = nn.ModuleList(layers)
    if len({id(m) for m in layers}) != num_layers:
        raise ValueError(
            "the layer factory returned the same module twice; it must build a new layer on every call"
        )
    return layers


def _final_norm(
    layers: nn.ModuleList,
    final_norm: bool | None,
    layer_norm_eps: float,
    device: torch.device | str | None,
    dtype: torch.dtype | None,
) -> nn.Module:
    if final_norm is not None:
        check_flag(final_norm, "final_norm")
    check_positive_float(layer_norm_eps, "layer_norm_eps")  # 0 divides a constant input by 0
    first = layers[0]
    if final_norm is None:
        final_norm = bool(getattr(first, "norm_first", False))
    if not final_norm:
        return nn.Identity()
    if not hasattr(first, "d_model"):
        raise ValueError("final_norm needs the layers to expose d_model")
    return nn.LayerNorm(first.d_model, eps=layer_norm_eps, device=device, dtype=dtype)


_Stack = TypeVar("_Stack", bound="_TransformerStack")


class _TransformerStack(nn.Module):
    """Layers built from a config or factory, run in turn, then the final norm (if any)."""

    layer_class: type
    torch_class: type[nn.Module]  # the torch.nn stack that from_torch copies

    def __init__(
        self,
        layer: TransformerConfig | Callable[[], nn.Module],
        num_layers: int,
        *,
        final_norm: bool | None = None,
        layer_norm_eps: float = 1e-5,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.layers = _build_layers(layer, num_layers, self.layer_class, device, dtype)
        self.norm = _final_norm(self.layers, final_norm, layer_norm_eps, device, dtype)

    @classmethod
    def from_torch(
        cls: type[_Stack],
        module: nn.Module,
        *,
        attention: AttentionFactory | None = None,
        allow_sequence_first: bool = False,
    ) -> _Stack:
        """A stack with exactly the layers, final norm, training flag, device and dtype of
        torch's stack ``module``, every layer copied by the layer class's ``from_torch``.

        Torch's ``norm`` (None, or an ``nn.LayerNorm``) becomes ``final_norm`` and its epsilon
        ``layer_norm_eps``. Translate the masks as the layers' ``from_torch`` says. In inference
        with a key padding mask, torch's encoder may run its nested-tensor fast path, which
        returns zeros at the padded positions; the real positions agree.

        Args:
            module: a ``torch.nn.TransformerEncoder`` (for this encoder stack) or
                ``torch.nn.TransformerDecoder`` (for the decoder stack).
            attention: the attention factory of every layer, as in the layers' ``from_torch``.
            allow_sequence_first: copy layers built with ``batch_first=False`` (torch's default),
                or holding an attention with ``batch_first=False`` beside a batch-first one, as
                batch-first layers, as the layers' ``from_torch`` does given
                ``batch_first=True``; without it they are refused: the stacks take batch-first
                inputs only.

        Returns:
            The equivalent stack (a copy: later changes to ``module`` do not carry over).

        Raises:
            TypeError: ``module`` is not torch's stack of this kind; ``allow_sequence_first``
                that is not a bool.
            ValueError: a final ``norm`` that is not an ``nn.LayerNorm`` over ``d_model`` with a
                learned scale and bias, a subclass that overrides ``forward``, no layers,
                layers with a sequence-first attention (unless ``allow_sequence_first``), and
                whatever the layers' ``from_torch`` refuses in any layer (the message names it).
        """
        _check_torch_module(module, cls.torch_class, ("forward",))
        check_flag(allow_sequence_first, "allow_sequence_first")
        layers = []
        for index, torch_layer in enumerate(module.layers):
            try:
                # batch first whatever torch's layout: the stack's checks, masks and caches read (b, T, E)
                layer = cls.layer_class.from_torch(torch_layer, attention=attention, batch_first=True)
                layouts = _torch_layouts(torch_layer, cls.layer_class._torch)
                if not allow_sequence_first and not all(layouts.values()):
                    raise ValueError(
                        f"from_torch: {_listed(layouts, '.batch_first')}: the stacks take batch-first "
                        "(b, T, E) inputs; pass allow_sequence_first=True (a batch-first copy: transpose "
                        "torch's (T, b, E) inputs), or copy the layers one by one "
                        f"({cls.layer_class.__name__}.from_torch keeps torch's layout, or sets it)"
                    )
                layers.append(layer)
            except (TypeError, ValueError) as error:
                raise type(error)(f"layers.{index}: {error}") from error
        if not layers:
            raise ValueError("from_torch: module has no layers (num_layers=0)")
        norm, reference = module.norm, next(layers[0].parameters())
        eps = 1e-5 if norm is None else _torch_layer_norm_eps(norm, "norm", layers[0].d_model)
        handed_out = iter(layers)
        stack = cls(
            lambda: next(handed_out),
            len(layers),
            final_norm=norm is not None,
            layer_norm_eps=eps,
            device=reference.device,
            dtype=reference.dtype,
        )
        if norm is not None:
            stack.norm.load_state_dict(norm.state_dict())
        return stack.train(module.training)

    def forward(
        self,
        x: Tensor,
        *args: Tensor,
        return_intermediates: bool = False,
        cache: TransformerCache | None = None,
        **options: Any,
    ) -> Tensor | tuple[Tensor, AttentionIntermediates]:
        """Run ``x`` ``(b, T, E)`` (and any further inputs, e.g. the memory) through every layer.

        Args:
            x: ``(b, T, E)``.
            *args: further positional inputs of every layer (the decoder's ``memory``).
            return_intermediates: also return every layer's attention weights.
            cache: one cache per layer (incremental decoding, :meth:`new_cache`), filled in
                place; ``x`` then holds the new tokens only. With more than one layer the
                self-attention must be causal (``is_causal=True``). A call that raises leaves
                the cache as it found it (outside ``torch.compile``).
            **options: the masks and ``is_causal``, passed to every layer as its ``forward``
                names them.

        Returns:
            ``(b, T, E)``; with ``return_intermediates``, ``(output, record)``, the record
            holding each layer's weights under ``"layers.{n}."`` + the layer's names.

        Raises:
            ValueError: a ``cache`` that is not a :class:`TransformerCache` of one entry per
                layer, or a cache for several layers with ``is_causal=False``.
            TypeError: a ``return_intermediates`` that is not a bool.
        """
        check_flag(return_intermediates, "return_intermediates")
        if cache is not None and (
            not isinstance(cache, TransformerCache) or len(cache.layers) != len(self.layers)
        ):
            raise ValueError(
                f"cache must be a TransformerCache with one entry per layer ({len(self.layers)}), "
                f"got {cache!r:.80}"
            )
        if cache is not None and len(self.layers) > 1 and self._causality(options) is False:
            raise ValueError(
                "a cache in a stack of several layers needs is_causal=True: it keeps the earlier "
                "tokens' states, which attention to later tokens would change in every layer above "
                "the first (call without a cache instead)"
            )
        if cache is None or torch.compiler.is_compiling():  # nothing to put back (or no try to trace)
            return self._run_layers(x, args, return_intermediates, cache, options)
        held = cache.held()
        try:
            return self._run_layers(x, args, return_intermediates, cache, options)
        except Exception:  # e.g. the second layer refusing a memory the first layer's cache took
            cache.restore(held)
            raise

    def _run_layers(
        self,
        x: Tensor,
        args: tuple[Tensor, ...],
        return_intermediates: bool,
        cache: TransformerCache | None,
        options: dict[str, Any],
    ) -> Tensor | tuple[Tensor, AttentionIntermediates]:
        """The layers in turn, then the final norm (see :meth:`forward`)."""
        record = AttentionIntermediates()
        if return_intermediates:  # only then: a custom layer need not know the argument
            options["return_intermediates"] = True
        for index, layer in enumerate(self.layers):
            if cache is not None:  # only then: a custom layer need not know the argument
                options["cache"] = cache.layers[index]
            x = layer(x, *args, **options)
            if return_intermediates:
                x, layer_record = x
                record.add(f"layers.{index}", layer_record)
        x = self.norm(x)  # (b, T, E)
        return (x, record) if return_intermediates else x

    def _causality(self, options: dict[str, Any]) -> bool | None:
        """The ``is_causal`` the layers run with: the call's, or their ``forward``'s default;
        ``None`` for layers that take no such argument (custom layers decide for themselves)."""
        if "is_causal" in options:  # as the models decode: no signature to read every token
            return options["is_causal"]
        parameter = inspect.signature(self.layers[0].forward).parameters.get("is_causal")
        return None if parameter is None else parameter.default

    def new_cache(self) -> TransformerCache:
        """An empty key/value cache for incremental decoding with this stack."""
        return TransformerCache.empty(len(self.layers))


class TransformerEncoder(_TransformerStack):
    """A stack of encoder layers, with a final layer norm for pre-norm layers.

    Args:
        layer: a :class:`TransformerConfig` (every layer built from it) or a zero-argument
            callable returning a new layer on every call (e.g.
            ``lambda: TransformerEncoderLayer(512, 8, norm_first=True)``).
        num_layers: number of layers.
        final_norm: end with a layer norm; default: when the layers are pre-norm (post-norm
            layers end in a norm already).
        layer_norm_eps: the final norm's epsilon.
        device: where to create the parameters: those of the layers built from a config and of
            the final norm (a callable ``layer`` places its layers itself).
        dtype: the parameters' dtype, likewise.

    ``forward(x, *, attn_mask, key_mask, is_causal, return_intermediates, cache)`` takes the masks
    of :meth:`TransformerEncoderLayer.forward`; the record names ``"layers.{n}.self_attention"``.

    Raises:
        ValueError: ``num_layers < 1``, a factory that returns the same module twice, or a
            ``layer_norm_eps`` that is not positive and finite.
        TypeError: ``layer`` is neither a config nor a callable, ``final_norm`` neither None nor
            a bool.

    Examples:
        >>> import torch
        >>> from torchvote.nn import TransformerConfig, TransformerEncoder
        >>> _ = torch.manual_seed(0)
        >>> config = TransformerConfig(d_model=16, num_heads=4, dropout=0.0)
        >>> encoder = TransformerEncoder(config, num_layers=2)
        >>> x = torch.randn(2, 5, 16)  # (batch, T, d_model)
        >>> encoder(x).shape
        torch.Size([2, 5, 16])
        >>> y = x.clone()
        >>> y[:, -1] += 1.0  # change the last token only
        >>> torch.allclose(encoder(x, is_causal=True)[:, :-1], encoder(y, is_causal=True)[:, :-1], atol=1e-6)
        True
    """

    layer_class = TransformerEncoderLayer
    torch_class = nn.TransformerEncoder


class TransformerDecoder(_TransformerStack):
    """A stack of decoder layers, with a final layer norm for pre-norm layers.

    Args:
        layer: a :class:`TransformerConfig` or a zero-argument callable returning a new
            decoder layer on every call.
        num_layers: number of layers.
        final_norm: end with a layer norm; default: when the layers are pre-norm.
        layer_norm_eps: the final norm's epsilon.
        device: where to create the parameters: those of the layers built from a config and of
            the final norm (a callable ``layer`` places its layers itself).
        dtype: the parameters' dtype, likewise.

    ``forward(x, memory, *, target_mask, target_key_mask, memory_mask, memory_key_mask,
    is_causal, return_intermediates, cache)`` (``x`` the target, passed by position) takes the
    masks of :meth:`TransformerDecoderLayer.forward` (causal by default); the record names
    ``"layers.{n}.self_attention"`` and ``"layers.{n}.cross_attention"`` in call order.

    Raises:
        ValueError: ``num_layers < 1``, a factory that returns the same module twice, or a
            ``layer_norm_eps`` that is not positive and finite.
        TypeError: ``layer`` is neither a config nor a callable, ``final_norm`` neither None nor
            a bool.
    """

    layer_class = TransformerDecoderLayer
    torch_class = nn.TransformerDecoder
