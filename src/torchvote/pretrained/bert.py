"""A BERT-style encoder (Devlin et al. 2019) on torchvote's attention, recording what it computes.

Post-norm layers as in BERT: ``x = LN(x + Dropout(Attention(x)))``, ``x = LN(x + FFN(x))`` with
an exact-erf GELU feed-forward. Every layer's attention is a :class:`torchvote.nn.MultiHeadAttention`
(one pass of weighted voting, softmax over the senders); :meth:`BertEncoder.with_routing` swaps
chosen layers for :class:`torchvote.nn.RoutingAttention` with the same weights, so the same
pretrained model votes for several passes without retraining ("Self-Attention is fundamentally a
Weighted Voting", Mr. For Example, 2023).

Index legend: ``b`` batch, ``h`` heads, ``i`` receivers (queries), ``j`` senders (keys), ``d``
features. ``L`` is the padded token length.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchvote.nn import MultiHeadAttention, RoutingAttention
from torchvote.nn.modes import evaluating
from torchvote.tracing import register_output
from torchvote.validation import (
    check_choice,
    check_device,
    check_flag,
    check_index_range,
    check_positive_float,
    check_positive_int,
    check_probability,
    check_tensor_values,
)

if TYPE_CHECKING:  # the tokenizer needs the optional `tokenizers` package at run time
    from torchvote.pretrained.tokenizer import WordPieceTokenizer

__all__ = ["BertConfig", "BertEmbeddings", "BertEncoder", "BertLayer", "EncoderOutput", "mean_pool"]

# config.json switches of Hugging Face's BertModel that change what it computes and are not built
# here: a decoder is causal, cross-attention adds a sub-layer.
_UNSUPPORTED_SWITCHES = ("is_decoder", "add_cross_attention")


@dataclass(frozen=True)
class BertConfig:
    """Sizes of a BERT-style encoder, named as in Hugging Face's ``config.json``.

    Args:
        vocab_size: word-piece vocabulary size.
        hidden_size: model width ``E``.
        num_hidden_layers: number of encoder layers.
        num_attention_heads: heads per layer; must divide ``hidden_size``.
        intermediate_size: feed-forward width.
        max_position_embeddings: learned positions, the longest input in tokens.
        type_vocab_size: number of segment (token-type) embeddings.
        layer_norm_eps: LayerNorm epsilon.
        hidden_dropout_prob: dropout after embeddings, attention output and feed-forward.
        attention_probs_dropout_prob: dropout on the attention weights.
        pad_token_id: id of ``[PAD]``, in ``[0, vocab_size)``.

    Raises:
        ValueError: a size that is not a positive integer, ``num_attention_heads`` that does not
            divide ``hidden_size``, ``layer_norm_eps`` that is not a finite number above 0, a
            dropout outside ``[0, 1)``, or ``pad_token_id`` outside the vocabulary (each named).
    """

    vocab_size: int = 30522
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
            "type_vocab_size",
        ):
            check_positive_int(getattr(self, name), name)
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads})"
            )
        check_positive_float(self.layer_norm_eps, "layer_norm_eps")
        check_probability(self.hidden_dropout_prob, "hidden_dropout_prob")
        check_probability(self.attention_probs_dropout_prob, "attention_probs_dropout_prob")
        check_positive_int(self.pad_token_id, "pad_token_id", minimum=0)
        if self.pad_token_id >= self.vocab_size:
            raise ValueError(
                f"pad_token_id must be below vocab_size={self.vocab_size}, got {self.pad_token_id}"
            )

    @classmethod
    def from_dict(cls, values: Mapping) -> BertConfig:
        """Build from a ``config.json`` dictionary, keeping only the fields above.

        Fields it lacks take the defaults above (all-MiniLM-L6-v2's sizes), as does a
        ``pad_token_id`` of ``null`` (padding is masked: its id changes no output); other keys
        are ignored, except the ones that would make Hugging Face's ``BertModel`` compute
        something else, and a ``model_type`` other than ``"bert"`` (RoBERTa's tensors carry
        BERT's names, but it numbers positions from ``pad_token_id + 1``: it would load without
        a word and compute something else).

        Args:
            values: the parsed ``config.json``.

        Returns:
            The config.

        Raises:
            TypeError: ``values`` is not a mapping.
            ValueError: ``model_type`` is not ``"bert"``, ``hidden_act`` is not ``"gelu"``,
                ``position_embedding_type`` is not ``"absolute"``, or ``is_decoder`` /
                ``add_cross_attention`` is set (none of those variants is built here); or a field
                value refused by the class (named).
        """
        if not isinstance(values, Mapping):
            raise TypeError(f"values must be a config.json dictionary, got {type(values).__name__}")
        if values.get("model_type", "bert") != "bert":
            raise ValueError(
                f"config model_type must be 'bert', got {values['model_type']!r}: its weights would "
                "load into this encoder and compute something else"
            )
        if values.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"config hidden_act must be 'gelu', got {values['hidden_act']!r}")
        if values.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(
                "config position_embedding_type must be 'absolute', got "
                f"{values['position_embedding_type']!r}"
            )
        for switch in _UNSUPPORTED_SWITCHES:
            if values.get(switch):
                raise ValueError(
                    f"config {switch} must be false: this encoder is bidirectional self-attention "
                    f"only, got {switch}={values[switch]!r}"
                )
        names = cls.__dataclass_fields__
        given = {key: value for key, value in values.items() if key in names}
        if given.get("pad_token_id", 0) is None:
            del given["pad_token_id"]
        return cls(**given)


@dataclass
class EncoderOutput:
    """Everything one forward pass computed, for pictures that never re-run the model.

    Attributes:
        hidden_states: ``num_layers + 1`` tensors ``(b, L, E)``: the embeddings, then every layer.
        attentions: ``num_layers`` tensors ``(b, h, L, L)`` (the last pass's weights for a layer
            that routes), or empty when not recorded.
        key_mask: ``(b, L)`` bool, True for a real token.
        tokens: word pieces per sentence, without padding (``[CLS] ... [SEP]``).
        truncated: per sentence, whether it was cut to the model's length limit.
    """

    hidden_states: tuple[Tensor, ...]
    attentions: tuple[Tensor, ...]
    key_mask: Tensor
    tokens: list[list[str]] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)

    @property
    def last_hidden_state(self) -> Tensor:
        """``(b, L, E)``, the last layer's output."""
        return self.hidden_states[-1]


register_output(EncoderOutput)  # a pytree node: torch.export can return it


class BertEmbeddings(nn.Module):
    """Word + position + token-type embeddings, then LayerNorm and dropout (BERT, sec. 3).

    Args:
        config: the table sizes (``vocab_size``, ``max_position_embeddings``,
            ``type_vocab_size``), the width ``hidden_size``, ``layer_norm_eps`` and the dropout
            ``hidden_dropout_prob``.
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        """Embed ids (checked by :meth:`BertEncoder.forward`, the public entry).

        Args:
            input_ids: ``(b, L)`` token ids, ``L <= max_position_embeddings``.
            token_type_ids: ``(b, L)`` segment ids; default zeros.

        Returns:
            ``(b, L, E)`` embeddings; position ``n`` is the ``n``-th token.
        """
        length = input_ids.shape[1]
        positions = torch.arange(length, device=input_ids.device)  # (L,)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = (
            self.word_embeddings(input_ids)  # (b, L, E)
            + self.position_embeddings(positions)  # (L, E), broadcast over b
            + self.token_type_embeddings(token_type_ids)  # (b, L, E)
        )
        return self.dropout(self.norm(x))


class BertLayer(nn.Module):
    """One post-norm encoder layer; ``attention`` may be any module with MultiHeadAttention's forward.

    Args:
        config: sizes and dropout.
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attention: MultiHeadAttention = MultiHeadAttention(
            config.hidden_size,
            config.num_attention_heads,
            bias=True,
            dropout=config.attention_probs_dropout_prob,
            batch_first=True,
        )
        self.attention_dropout = nn.Dropout(config.hidden_dropout_prob)
        self.attention_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.ffn_in = nn.Linear(config.hidden_size, config.intermediate_size)
        self.ffn_out = nn.Linear(config.intermediate_size, config.hidden_size)
        self.ffn_dropout = nn.Dropout(config.hidden_dropout_prob)
        self.ffn_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: Tensor, key_mask: Tensor, *, need_weights: bool) -> tuple[Tensor, Tensor | None]:
        """Attention, then the feed-forward, each added to its input and normalised.

        Args:
            x: ``(b, L, E)`` token states.
            key_mask: ``(b, L)`` bool, True for a real token.
            need_weights: also return the attention weights.

        Returns:
            ``(b, L, E)`` states and the ``(b, h, L, L)`` weights, or ``None`` without
            ``need_weights``.

        Raises:
            TypeError: ``need_weights`` that is not a bool (from the attention).
        """
        attended, weights = self.attention(
            x, key_mask=key_mask, need_weights=need_weights, average_weights=False
        )  # (b, L, E), (b, h, i, j) | None
        x = self.attention_norm(x + self.attention_dropout(attended))
        hidden = F.gelu(self.ffn_in(x))  # (b, L, 4E), exact erf GELU as BERT
        x = self.ffn_norm(x + self.ffn_dropout(self.ffn_out(hidden)))
        return x, weights


class BertEncoder(nn.Module):
    """Embeddings and a stack of :class:`BertLayer`, returning every layer's states and attention.

    Tokenisation is attached by :func:`torchvote.pretrained.load_pretrained` (``self.tokenizer``);
    :meth:`forward` takes ids, :meth:`explain` and :meth:`encode` take sentences.

    Args:
        config: the sizes.
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))
        self.tokenizer: WordPieceTokenizer | None = None  # set by the loader

    def forward(
        self,
        input_ids: Tensor,
        key_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        *,
        record_attention: bool = True,
    ) -> EncoderOutput:
        """Run the encoder once.

        Args:
            input_ids: ``(b, L)`` token ids.
            key_mask: ``(b, L)`` bool, True for a real token (or integers, 1 for a real token,
                Hugging Face's ``attention_mask``); default all real.
            token_type_ids: ``(b, L)`` segment ids; default zeros.
            record_attention: also return every layer's ``(b, h, L, L)`` weights (otherwise the
                softmax layers run on the fused kernel).

        Returns:
            An :class:`EncoderOutput` (``tokens`` left empty: ids carry no text).

        Raises:
            TypeError: ``input_ids``, ``key_mask`` or ``token_type_ids`` is not a tensor,
                ``key_mask`` is floating point (an additive mask, 0 for a token and -10000 for
                padding, would otherwise be read backwards), or ``record_attention`` is not a bool.
            ValueError: ``input_ids`` or ``token_type_ids`` is not 2-D integer ids (int64 or
                int32, what ``nn.Embedding`` takes), ``input_ids`` is longer than
                ``max_position_embeddings``, ``key_mask`` or ``token_type_ids`` has another
                shape than ``input_ids``, or (on the CPU) an id outside ``[0, vocab_size)`` or a
                segment id outside ``[0, type_vocab_size)``, or an integer ``key_mask`` with
                values other than 0 and 1. On an accelerator the range check
                is queued on the device (nothing is read back) and fails at the next
                synchronisation (:func:`~torchvote.validation.check_index_range`).
        """
        check_flag(record_attention, "record_attention")
        _check_ids(input_ids, "input_ids")
        if input_ids.shape[1] > self.config.max_position_embeddings:
            raise ValueError(
                f"input_ids has {input_ids.shape[1]} tokens, more than the model's limit of "
                f"{self.config.max_position_embeddings}"
            )
        if key_mask is None:
            key_mask = torch.ones_like(input_ids, dtype=torch.bool)
        if not isinstance(key_mask, Tensor):
            raise TypeError(f"key_mask must be a boolean tensor or None, got {type(key_mask).__name__}")
        if key_mask.shape != input_ids.shape:
            raise ValueError(
                f"key_mask must have input_ids' shape {tuple(input_ids.shape)}, got {tuple(key_mask.shape)}"
            )
        _check_token_mask_values(key_mask)
        if token_type_ids is not None:
            _check_ids(token_type_ids, "token_type_ids")
            if token_type_ids.shape != input_ids.shape:
                raise ValueError(
                    f"token_type_ids must have input_ids' shape {tuple(input_ids.shape)}, got "
                    f"{tuple(token_type_ids.shape)}"
                )
        check_index_range(
            input_ids, self.config.vocab_size, f"input_ids must be in [0, {self.config.vocab_size})"
        )
        if token_type_ids is not None:
            check_index_range(
                token_type_ids,
                self.config.type_vocab_size,
                f"token_type_ids must be in [0, {self.config.type_vocab_size})",
            )
        key_mask = key_mask.bool()
        x = self.embeddings(input_ids, token_type_ids)  # (b, L, E)
        states, attentions = [x], []
        for layer in self.layers:
            x, weights = layer(x, key_mask, need_weights=record_attention)
            states.append(x)
            if weights is not None:
                attentions.append(weights)
        return EncoderOutput(tuple(states), tuple(attentions), key_mask)

    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(
                "this encoder has no tokenizer; build it with torchvote.pretrained.load_pretrained"
            )
        return self.tokenizer

    @torch.no_grad()
    def explain(self, sentences: str | Sequence[str], *, record_attention: bool = True) -> EncoderOutput:
        """Tokenise ``sentences`` and run once in eval mode, recording states and attention.

        Args:
            sentences: one sentence or a list; longer ones are truncated with a warning.
            record_attention: return every layer's attention weights too.

        Returns:
            An :class:`EncoderOutput` with ``tokens`` and ``truncated`` filled in.

        Raises:
            ValueError: an empty sentence or an empty list (see the tokenizer), or an encoder
                without a tokenizer.
            TypeError: a sentence that is not a string, or ``record_attention`` not a bool.
        """
        batch = self._require_tokenizer()(sentences)
        output = self._run(
            batch.input_ids, batch.key_mask, batch.token_type_ids, record_attention=record_attention
        )
        output.tokens, output.truncated = batch.tokens, batch.truncated
        return output

    @torch.no_grad()
    def encode(self, sentences: str | Sequence[str], *, batch_size: int = 32) -> Tensor:
        """Sentence embeddings as sentence-transformers computes them (Reimers & Gurevych 2019).

        The mean of the last layer's token states over the real tokens, then L2-normalised. The
        sentences are tokenised together and run ``batch_size`` at a time (in eval mode, no
        gradients), each batch padded only to its own longest sentence, so memory does not grow
        with the number of sentences.

        Args:
            sentences: one sentence or a list; longer ones are truncated with a warning.
            batch_size: sentences per forward pass, a positive integer.

        Returns:
            ``(N, E)`` unit vectors, in the order of ``sentences``.

        Raises:
            ValueError: a ``batch_size`` that is not a positive integer, an empty sentence or an
                empty list (see the tokenizer), or an encoder without a tokenizer.
            TypeError: a sentence that is not a string.
        """
        check_positive_int(batch_size, "batch_size")
        batch = self._require_tokenizer()(sentences)
        lengths = batch.key_mask.sum(dim=1)  # (N,), on the CPU
        pooled = []
        for start in range(0, len(batch.tokens), batch_size):
            rows = slice(start, start + batch_size)
            length = int(lengths[rows].max())  # this batch's longest sentence
            output = self._run(
                batch.input_ids[rows, :length],  # (n, length)
                batch.key_mask[rows, :length],
                batch.token_type_ids[rows, :length],
                record_attention=False,
            )
            pooled.append(mean_pool(output.last_hidden_state, output.key_mask))  # (n, E)
        return torch.cat(pooled)  # (N, E)

    @torch.no_grad()
    def _run(
        self, input_ids: Tensor, key_mask: Tensor, token_type_ids: Tensor, *, record_attention: bool
    ) -> EncoderOutput:
        """Run once in eval mode on the model's device, then give every part back its mode."""
        with evaluating(self):
            device = self.embeddings.word_embeddings.weight.device
            return self(
                input_ids.to(device),
                key_mask.to(device),
                token_type_ids.to(device),
                record_attention=record_attention,
            )

    def layer_index(self, index: object) -> int:
        """``index`` of one of :attr:`layers` (negative counts from the end), as ``0 .. n - 1``.

        Args:
            index: an integer (Python's or NumPy's).

        Returns:
            The non-negative index.

        Raises:
            ValueError: not an integer, or out of range (as :meth:`with_routing` says it).
        """
        return _layer_index(index, len(self.layers)) % len(self.layers)

    def with_routing(
        self,
        layers: Sequence[int] | None = None,
        *,
        iterations: int = 3,
        normalize_over: Literal["senders", "receivers"] = "senders",
    ) -> BertEncoder:
        """A copy whose chosen layers' attention votes for ``iterations`` passes, same weights.

        Each chosen layer's :class:`~torchvote.nn.MultiHeadAttention` becomes a
        :class:`~torchvote.nn.RoutingAttention` loaded from its state dict (the two share
        parameter names), so nothing is retrained: the first pass is the pretrained attention,
        later passes raise the logits of values that agree with the consensus.

        Args:
            layers: layer indices (negative counts from the end); default all layers.
            iterations: passes of voting, at least 1.
            normalize_over: ``"senders"`` (attention) or ``"receivers"`` (capsule routing).

        Returns:
            A new :class:`BertEncoder` (this one is unchanged), sharing the tokenizer.

        Raises:
            TypeError: ``layers`` that is not a sequence of indices (a single ``3`` must be
                ``[3]``).
            ValueError: a layer index that is not an integer (Python's or NumPy's) or is out of
                range, or an invalid ``iterations`` / ``normalize_over`` (from
                :class:`~torchvote.nn.RoutingAttention`).
        """
        count = len(self.layers)
        if layers is not None and (
            isinstance(layers, (str, bytes, Mapping))  # a dict's keys were taken as the layers
            or not isinstance(layers, Iterable)
            or (isinstance(layers, Tensor) and layers.dim() == 0)  # "iteration over a 0-d tensor"
        ):
            raise TypeError(
                f"layers must be a sequence of layer indices (e.g. [{layers!r}]) or None, got "
                f"{type(layers).__name__}"
            )
        chosen = range(count) if layers is None else [_layer_index(index, count) for index in layers]
        check_positive_int(iterations, "iterations")  # checked here too when no layer is chosen
        check_choice(normalize_over, ("senders", "receivers"), "normalize_over")
        tokenizer, self.tokenizer = self.tokenizer, None  # do not deep-copy the Rust tokenizer
        try:
            routed = copy.deepcopy(self)
        finally:
            self.tokenizer = tokenizer
        routed.tokenizer = tokenizer
        for index in chosen:
            old = routed.layers[index].attention
            weight = old.out_proj.weight
            new = RoutingAttention(
                old.embed_dim,
                old.num_heads,
                iterations=iterations,
                normalize_over=normalize_over,
                bias=True,
                dropout=old.dropout,
                batch_first=True,
                device=weight.device,
                dtype=weight.dtype,
            )
            new.load_state_dict(old.state_dict())
            routed.layers[index].attention = new.train(old.training)
        return routed


def _check_token_mask_values(key_mask: Tensor) -> None:
    """A key mask of bools or 0/1 integers (a float mask is an additive one, -1 would flip a
    token's sign in a mean)."""
    if key_mask.is_floating_point() or key_mask.is_complex():
        raise TypeError(
            f"key_mask must be bool (True for a real token) or 0/1 integers, got {key_mask.dtype}: "
            "an additive mask (0 for a token, -10000 for padding) is not taken"
        )
    if key_mask.dtype != torch.bool:
        check_tensor_values(
            ((key_mask == 0) | (key_mask == 1)).all(), "key_mask must hold 0 and 1 only (1: a real token)"
        )


def mean_pool(hidden: Tensor, key_mask: Tensor) -> Tensor:
    """Mask-aware mean over tokens, then L2 normalisation (sentence-transformers' mean pooling).

    Args:
        hidden: ``(b, L, E)`` token states.
        key_mask: ``(b, L)`` bool (True for a real token) or 0/1 integers.

    Returns:
        ``(b, E)`` unit-norm embeddings.

    Raises:
        TypeError: ``hidden`` or ``key_mask`` is not a tensor, or ``key_mask`` is floating point.
        ValueError: ``hidden`` that is not 3-D, a ``key_mask`` of another shape than its first
            two dimensions, on another device, or with integers other than 0 and 1 (-1 flipped
            the embedding).
    """
    for value, argument in ((hidden, "hidden"), (key_mask, "key_mask")):
        if not isinstance(value, Tensor):
            raise TypeError(f"{argument} must be a tensor, got {type(value).__name__}")
    if hidden.dim() != 3 or tuple(key_mask.shape) != tuple(hidden.shape[:2]):
        raise ValueError(
            f"mean_pool needs hidden (b, L, E) and key_mask (b, L) of the same b and L, got "
            f"hidden {tuple(hidden.shape)} and key_mask {tuple(key_mask.shape)}"
        )
    check_device(key_mask, hidden.device, "key_mask", "hidden")
    _check_token_mask_values(key_mask)
    weights = key_mask.to(hidden.dtype).unsqueeze(-1)  # (b, L, 1)
    summed = (hidden * weights).sum(dim=1)  # (b, E)
    counts = weights.sum(dim=1).clamp(min=1e-9)  # (b, 1), as sentence-transformers clamps
    return F.normalize(summed / counts, p=2, dim=1)


def _layer_index(index: object, count: int) -> int:
    """``index`` as a Python int if it is an integer (not a bool) in ``[-count, count)``."""
    try:
        # NumPy ints and 0-d tensors too; bools of every kind refused (operator.index takes
        # np.True_ before NumPy 2.3, and a 0-d bool tensor or array always)
        dtype = getattr(index, "dtype", None)
        boolean = isinstance(index, (bool, np.bool_)) or dtype is torch.bool or (
            isinstance(dtype, np.dtype) and dtype == np.bool_)
        position = None if boolean else operator.index(index)
    except TypeError:
        position = None
    if position is None or not -count <= position < count:
        raise ValueError(f"layers must hold indices in [-{count}, {count}), got {index!r}")
    return position


def _check_ids(ids: Tensor, argument: str) -> None:
    """Raise unless ``ids`` is a ``(b, L)`` tensor of int64 or int32 ids (shape and dtype only)."""
    if not isinstance(ids, Tensor):
        raise TypeError(f"{argument} must be a (batch, length) tensor of token ids, got {type(ids).__name__}")
    if ids.dim() != 2:
        raise ValueError(f"{argument} must be (batch, length), got shape {tuple(ids.shape)}")
    if ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"{argument} must hold integer ids of dtype torch.int64 or torch.int32, got dtype {ids.dtype}"
        )
