"""What the sequence and Transformer models share: config checks, set-up, token checks, decoding.

Four models are built from the same parts: the Vision Transformer classifier, the language model,
the Transformer encoder-decoder and the GRU encoder-decoder with attention. This module holds
those parts once:

* :class:`TransformerBackboneFields`, a mixin of the model configs that carry the Transformer
  fields (``d_model``, ``num_heads``, ``dim_feedforward``, ``dropout``, ``activation``,
  ``positional``, ``attention``, ``routing_iterations``, ``routing_normalize_over``): their
  checks, the layer config (:class:`~torchvote.nn.TransformerConfig` with the softmax or routing
  attention, the decoder layers' always over the senders) and the positional encoding. The
  fields stay declared on each config (each model has its own defaults), so config and preset
  names are unchanged.
* :func:`check_special_ids`: ``pad_id``, ``bos_id``, ``eos_id`` against the vocabularies.
* :func:`check_token_ids`: a ``(b, t)`` tensor of integer ids that fits.
* :func:`run_stack`: a Transformer stack with or without its attention record.
* :func:`greedy_decode`: the greedy loop of ``generate`` (in evaluation mode:
  :func:`~torchvote.nn.modes.evaluating`, re-exported here).

The modules keep their own attribute names (``token_embedding``, ``positions``, ``encoder``,
...), so state-dict keys of presets and checkpoints do not change.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, get_args

import torch
from torch import Tensor, nn

from torchvote.functional.voting import NormalizeOver
from torchvote.nn.kv_cache import TransformerCache
from torchvote.nn.modes import evaluating
from torchvote.nn.positional import LearnedPositionalEmbedding, SinusoidalPositionalEncoding
from torchvote.nn.routing_attention import ATTENTION_KINDS, attention_factory
from torchvote.nn.transformer import AttentionFactory, AttentionIntermediates, TransformerConfig
from torchvote.validation import (
    ArgumentTypeError,
    check_choice,
    check_device,
    check_index_range,
    check_positive_int,
    check_probability,
    is_integer,
)

__all__ = [
    "TransformerBackboneFields",
    "check_config_ints",
    "check_max_new_tokens",
    "check_special_ids",
    "check_token_ids",
    "evaluating",
    "greedy_decode",
    "run_stack",
]

_BACKBONE_INTS = ("d_model", "num_heads", "routing_iterations")


def check_config_ints(config: Any, names: Sequence[str]) -> None:
    """Raise a ValueError naming the first of ``names`` that is not a positive integer on ``config``."""
    for name in names:
        check_positive_int(getattr(config, name), name)


class TransformerBackboneFields:
    """Checks and builders for a model config that carries the Transformer fields.

    A mixin of the model configs (dataclasses); it declares no fields itself. The config calls
    :meth:`check_backbone` from its ``__post_init__``; the model calls :meth:`layer_config` and
    :meth:`make_positions`.
    """

    d_model: int
    num_heads: int
    dim_feedforward: int | None
    dropout: float
    activation: str
    positional: str
    attention: str
    routing_iterations: int
    routing_normalize_over: str

    def check_backbone(self, *more_ints: str) -> None:
        """Check the Transformer fields, and ``more_ints`` as positive integers.

        Raises:
            ValueError: a field out of range or inconsistent, naming it (among them
                ``routing_normalize_over="receivers"`` with ``attention="softmax"``).
        """
        check_config_ints(self, (*_BACKBONE_INTS, *more_ints))
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads})")
        if self.dim_feedforward is not None:
            check_positive_int(self.dim_feedforward, "dim_feedforward")
        check_probability(self.dropout, "dropout")
        check_choice(self.activation, ("relu", "gelu"), "activation")
        check_choice(self.positional, ("learned", "sinusoidal"), "positional")
        check_choice(self.attention, ATTENTION_KINDS, "attention")
        check_choice(self.routing_normalize_over, get_args(NormalizeOver), "routing_normalize_over")
        if self.attention == "softmax" and self.routing_normalize_over != "senders":
            raise ValueError(
                f"routing_normalize_over={self.routing_normalize_over!r} needs attention='routing': "
                "softmax attention normalises over the senders"
            )

    def layer_config(self, *, norm_first: bool) -> TransformerConfig:
        """The config of every Transformer layer, with the configured attention.

        Encoder layers normalise their routing attention over ``routing_normalize_over``. Decoder
        layers (their causal self-attention and their cross-attention) always normalise over the
        senders: their queries are target positions decoded one at a time, and a softmax over
        the receivers would sum over later positions, so a later target token would change the
        earlier predictions (a leak of the answer under teacher forcing) and no cache could
        hold the past.
        """

        def attention(normalize_over: str) -> AttentionFactory:
            routing = self.attention == "routing"  # softmax makes one pass: routing_iterations unused
            return attention_factory(
                self.attention,  # type: ignore[arg-type]
                iterations=self.routing_iterations if routing else None,
                normalize_over=normalize_over,  # type: ignore[arg-type]
            )

        return TransformerConfig(
            d_model=self.d_model,
            num_heads=self.num_heads,
            dim_feedforward=self.dim_feedforward,
            dropout=self.dropout,
            activation=self.activation,  # type: ignore[arg-type]
            norm_first=norm_first,
            attention=attention(self.routing_normalize_over),
            decoder_attention=attention("senders"),
        )

    def make_positions(
        self,
        max_len: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> nn.Module:
        """Learned or sinusoidal positions for sequences of up to ``max_len`` tokens, their
        parameter or table created on ``device`` in ``dtype``."""
        if self.positional == "learned":
            return LearnedPositionalEmbedding(max_len, self.d_model, device=device, dtype=dtype)
        return SinusoidalPositionalEncoding(self.d_model, max_len=max_len, device=device, dtype=dtype)


def check_special_ids(config: Any) -> None:
    """Check ``pad_id``, ``bos_id``, ``eos_id`` of a sequence-to-sequence config.

    Raises:
        ValueError: an id that is not an integer (a float or bool would never match a token id:
            ``pad_id=1.5`` masked nothing), an id outside the target vocabulary, ids that
            coincide, or a ``pad_id`` outside the source vocabulary, naming the field.
    """
    for name in ("pad_id", "bos_id", "eos_id"):
        value = check_positive_int(getattr(config, name), name, minimum=0)
        if not 0 <= value < config.tgt_vocab_size:
            raise ValueError(
                f"{name} must be a target id in [0, tgt_vocab_size={config.tgt_vocab_size}), got {value}"
            )
    if len({config.pad_id, config.bos_id, config.eos_id}) != 3:
        raise ValueError(
            f"pad_id, bos_id and eos_id must differ, got {config.pad_id}, {config.bos_id}, {config.eos_id}"
        )
    if config.pad_id >= config.src_vocab_size:
        raise ValueError(
            f"pad_id ({config.pad_id}) must be a source id too, < src_vocab_size={config.src_vocab_size}"
        )


def check_token_ids(
    tokens: Tensor,
    argument: str,
    max_length: int | None = None,
    *,
    length_name: str = "max_len",
    cached: int = 0,
    vocab_size: int | None = None,
    device: torch.device | None = None,
) -> None:
    """Raise a ValueError naming ``argument`` unless it is a non-empty ``(b, t)`` integer tensor
    of ids below ``vocab_size`` (on ``device``, the model's, when given).

    An id outside the embedding table would otherwise fail deep inside ``nn.Embedding``. The
    range check goes through :func:`~torchvote.validation.check_tensor_values`: a ValueError at
    once on the CPU; on a GPU (and under ``torch.compile``) an assertion queued on the device,
    which fails with this message without making every forward pass wait for the host; under a
    ``torch.func`` transform (per-sample gradients: one sequence's ids per example) none, as
    nothing can read them there. The training loop checks its data's ids once, at set-up, so it
    never trips there.

    Args:
        tokens: the ids to check.
        argument: the argument's name, for the message.
        max_length: the most tokens allowed; ``None`` for no limit.
        length_name: the config field ``max_length`` comes from, for the message.
        cached: positions a key/value cache already holds; ``tokens`` may fill the rest of
            ``max_length``.
        vocab_size: ids must lie in ``[0, vocab_size)``; ``None`` for no range check.
        device: the device of the model's parameters; ``None`` for no device check.

    Raises:
        ArgumentTypeError: (a ``TypeError`` and a ``ValueError``) not a tensor, or not int64/int32
            ids (what ``nn.Embedding`` takes).
        ValueError: not ``(b, t)``, no sequence or no token, too many tokens, an id out of range,
            or another device than ``device`` (ids on ``meta`` for a CPU model gave logits of
            uninitialised memory; on a GPU, torch's error named nothing).
    """
    if not isinstance(tokens, Tensor):
        raise ArgumentTypeError(
            f"{argument} must be a (batch, length) tensor of token ids, got {type(tokens).__name__}"
        )
    if tokens.dim() != 2:
        shape = tuple(tokens.shape)
        raise ValueError(f"{argument} must be a (batch, length) tensor of token ids, got {shape}")
    if device is not None:
        check_device(tokens, device, argument)
    if tokens.dtype not in (torch.int64, torch.int32):
        raise ArgumentTypeError(
            f"{argument} must hold integer token ids of dtype torch.int64 or torch.int32, got "
            f"dtype {tokens.dtype}"
        )
    if tokens.shape[0] < 1 or tokens.shape[1] < 1:
        raise ValueError(
            f"{argument} must hold at least one sequence of at least one token, got shape "
            f"{tuple(tokens.shape)}"
        )
    if max_length is not None and tokens.shape[1] > max_length - cached:
        limit = length_name if cached == 0 else f"{length_name} - {cached} cached"
        raise ValueError(f"{argument} has {tokens.shape[1]} tokens, more than {limit}={max_length - cached}")
    if vocab_size is not None:
        message = f"{argument} holds ids outside the vocabulary [0, {vocab_size})"
        check_index_range(tokens, vocab_size, message)


def check_cache(cache: Any) -> None:
    """Raise a TypeError unless ``cache`` is a :class:`~torchvote.nn.kv_cache.TransformerCache`
    or None."""
    if cache is not None and not isinstance(cache, TransformerCache):
        raise TypeError(
            f"cache must be a TransformerCache (the model's new_cache()) or None, got "
            f"{type(cache).__name__}"
        )


def run_stack(
    stack: nn.Module, *args: Tensor, need_weights: bool, **kwargs: Any
) -> tuple[Tensor, AttentionIntermediates | None]:
    """Run a Transformer stack; with ``need_weights``, also return its attention record.

    Returns:
        ``(hidden, record)``: the stack's output and its
        :class:`~torchvote.nn.AttentionIntermediates`, or ``None`` without ``need_weights``.
    """
    if not need_weights:
        return stack(*args, **kwargs), None
    return stack(*args, return_intermediates=True, **kwargs)


def check_max_new_tokens(max_new_tokens: Any, max_len: int) -> int:
    """The number of tokens a sequence-to-sequence ``generate`` may append after ``<bos>``.

    Both encoder-decoders (the Transformer's and the GRU's) check it here, so one call suits either: the
    targets they are trained on hold at most ``max_len`` tokens (the Transformer knows no later
    position), ``<bos>`` included.

    Args:
        max_new_tokens: an integer in ``[0, max_len - 1]``, or ``None`` for ``max_len - 1``.
        max_len: the config's ``max_len``.

    Returns:
        The limit, an int.

    Raises:
        ValueError: anything else (a bool or a float included), naming ``max_new_tokens`` and
            the range.
    """
    limit = max_len - 1 if max_new_tokens is None else max_new_tokens
    if not is_integer(limit) or not 0 <= limit < max_len:
        raise ValueError(
            f"max_new_tokens must be an integer in [0, max_len - 1 = {max_len - 1}], "
            f"got {max_new_tokens!r}"
        )
    return limit


def greedy_decode(
    next_logits: Callable[[Tensor], Tensor],
    batch: int,
    limit: int,
    *,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    device: torch.device,
    check_every: int | None = None,
) -> Tensor:
    """From ``<bos>``, append the most likely token until every sequence has produced ``<eos>``.

    ``<pad>`` and ``<bos>`` are never chosen (as fairseq's generator never picks padding): neither
    is a token of a sentence, and a ``<pad>`` before ``<eos>`` would read as the sequence's end.

    Whether every sequence has ended is read from the device every ``check_every`` tokens: each
    read makes the host wait for the queued kernels, so on an accelerator the next token's kernels
    are not launched while the last ones run. A sequence that ends between two reads is padded;
    the columns of padding after the last ``<eos>`` are cut at the end (one read), so the ids are
    the same for every ``check_every``.

    Args:
        next_logits: ``tokens (b, t) -> (b, vocab)``, the logits of the next token.
        batch: sequences decoded at once.
        limit: most tokens to append.
        bos_id, eos_id, pad_id: the start, end and padding ids (padding after a sequence ends).
        device: where the ids live.
        check_every: tokens between two reads; default 1 on a CPU (reads cost nothing there, and
            every token decoded after the end is wasted), 8 elsewhere.

    Returns:
        ``(b, 1 + n)`` ids, ``<bos> y_1 ... <eos>`` then ``pad_id``; ``n <= limit``.

    Raises:
        ValueError: ``check_every`` not a positive integer.
    """
    if check_every is None:
        check_every = 1 if device.type == "cpu" else 8
    check_positive_int(check_every, "check_every")  # 0 divided by zero, -1 read every token
    tokens = torch.full((batch, 1), bos_id, dtype=torch.long, device=device)  # (b, 1)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)  # (b,)
    never = torch.tensor([pad_id, bos_id], device=device)  # (2,)
    for step in range(limit):
        logits = next_logits(tokens)  # (b, vocab)
        next_token = logits.index_fill(-1, never, -math.inf).argmax(dim=-1)  # (b,)
        next_token = next_token.masked_fill(finished, pad_id)
        tokens = torch.cat([tokens, next_token[:, None]], dim=1)  # (b, t + 1)
        finished |= next_token == eos_id
        if (step + 1) % check_every == 0 and bool(finished.all()):
            break
    if check_every > 1 and tokens.shape[1] > 1:  # the columns decoded after every <eos>: padding, cut
        # a chosen token is never pad, so the first new column always holds one
        written = (tokens[:, 1:] != pad_id).any(dim=0)  # (n,)
        tokens = tokens[:, : 2 + int(written.nonzero().max())]
    return tokens
