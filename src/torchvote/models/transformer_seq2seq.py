"""The Transformer encoder-decoder (Vaswani et al. 2017) with swappable attention.

Vaswani, Shazeer, Parmar, Uszkoreit, Jones, Gomez, Kaiser & Polosukhin 2017, "Attention Is All
You Need": token embeddings scaled by ``sqrt(d_model)`` plus sinusoidal positions (sec. 3.4, 3.5),
an encoder stack of self-attention layers, a decoder stack of causal self-attention and
cross-attention layers (sec. 3.1), and a linear output layer that shares its weights with the
target embedding (sec. 3.4). The defaults are the paper's base model (``d_model`` 512, 8 heads,
6 + 6 post-norm layers, feed-forward 2048, dropout 0.1, a shared 37000-token vocabulary); the
``small`` and ``tiny`` presets are CPU and test sizes for the generated sequence tasks (copy,
reverse, sort, addition).

Every attention of both stacks is :class:`~torchvote.nn.MultiHeadAttention` with
``attention="softmax"`` or :class:`~torchvote.nn.routing_attention.RoutingAttention` (``routing_iterations``
passes of the voting operator) with ``attention="routing"``, through the layers' ``attention=``
hook; nothing else changes. ``routing_normalize_over="receivers"`` normalises the routing over
the receivers (the queries) in the encoder's self-attention only: the decoder's causal
self-attention and its cross-attention stay over the senders, because their queries are target
positions decoded one at a time (a softmax over them sums over later positions, which would
leak later target tokens into earlier predictions under teacher forcing).

Padding (``pad_id``) in the source is masked out of every attention over it, so appending padding
leaves the outputs unchanged. The decoder's input is not masked for padding: its padding only
follows the real tokens, and the causal mask already hides later positions from earlier ones.

``generate`` decodes with a key/value cache (``use_cache=True``, the default): the decoder's
self-attention keeps the keys and values of past target tokens and every cross-attention
projects the memory once (:class:`~torchvote.nn.kv_cache.TransformerCache`); the tokens are those
of ``use_cache=False``. This holds with ``routing_normalize_over="receivers"`` too: the encoder
runs once on the whole source (nothing is cached there), and the decoder's attentions, the only
ones cached, normalise over the senders.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from torchvote.models.registry import SequenceOutput, register_model
from torchvote.models.transformer_backbone import (
    TransformerBackboneFields,
    check_cache,
    check_max_new_tokens,
    check_special_ids,
    check_token_ids,
    evaluating,
    greedy_decode,
    run_stack,
)
from torchvote.nn.kv_cache import TransformerCache
from torchvote.nn.transformer import AttentionIntermediates
from torchvote.nn.transformer_stack import TransformerDecoder, TransformerEncoder
from torchvote.validation import check_bool_fields, check_flag, check_float_dtype, check_input_dtype

__all__ = ["TransformerSeq2Seq", "TransformerSeq2SeqConfig"]


@dataclass
class TransformerSeq2SeqConfig(TransformerBackboneFields):
    """Sizes and choices of the Transformer encoder-decoder; the defaults are Vaswani et al.'s base.

    Args:
        src_vocab_size: source token ids (filled from the data set when training).
        tgt_vocab_size: target token ids (filled from the data set when training).
        max_len: longest source or target sequence (the positions the model knows).
        pad_id: the padding id of both sequences.
        bos_id: the id that starts every target (the decoder's first input in ``generate``).
        eos_id: the id that ends every target (``generate`` stops after it).
        d_model: feature size ``E``.
        num_heads: attention heads; must divide ``d_model``.
        num_encoder_layers: encoder layers.
        num_decoder_layers: decoder layers.
        dim_feedforward: hidden size of the feed-forward networks; ``None`` for ``4 * d_model``.
        dropout: on the embeddings, the attention weights and every sublayer's output.
        activation: ``"relu"`` (the paper) or ``"gelu"``.
        norm_first: pre-norm layers instead of the paper's post-norm.
        positional: ``"sinusoidal"`` (the paper) or ``"learned"``.
        share_embeddings: the source and target embeddings are one matrix (needs equal
            vocabulary sizes; the paper shares them over its joint BPE vocabulary).
        tie_output: the output layer shares the target embedding's weights.
        attention: ``"softmax"`` (multi-head attention) or ``"routing"`` (iterative
            routing-style attention) in every attention of both stacks.
        routing_iterations: voting passes of the routing attention (1 equals softmax;
            unused by ``attention="softmax"``).
        routing_normalize_over: the routing attention's softmax axis in the encoder's
            self-attention: ``"senders"`` (attention) or ``"receivers"`` (capsule routing: every
            source token spends one unit of vote over the source positions; needs
            ``attention="routing"``). The decoder's attentions always normalise over the
            senders: its causal self-attention must, and its cross-attention's receivers are
            the same target positions, so a softmax over them would let later target tokens
            change earlier predictions.

    Raises:
        ValueError: a field out of range or inconsistent, naming it (``pad_id``, ``bos_id`` and
            ``eos_id`` must be distinct integer ids).
    """

    src_vocab_size: int = 37000
    tgt_vocab_size: int = 37000
    max_len: int = 256
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    d_model: int = 512
    num_heads: int = 8
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    dim_feedforward: int | None = 2048
    dropout: float = 0.1
    activation: Literal["relu", "gelu"] = "relu"
    norm_first: bool = False
    positional: Literal["learned", "sinusoidal"] = "sinusoidal"
    share_embeddings: bool = True
    tie_output: bool = True
    attention: Literal["softmax", "routing"] = "softmax"
    routing_iterations: int = 3
    routing_normalize_over: Literal["senders", "receivers"] = "senders"

    def __post_init__(self) -> None:
        check_bool_fields(self)
        self.check_backbone(
            "src_vocab_size", "tgt_vocab_size", "max_len", "num_encoder_layers", "num_decoder_layers"
        )
        if self.max_len < 2:
            raise ValueError(f"max_len must be at least 2 (<bos> and one token), got {self.max_len}")
        check_special_ids(self)
        if self.share_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            raise ValueError(
                f"share_embeddings=True needs src_vocab_size == tgt_vocab_size, got "
                f"{self.src_vocab_size} and {self.tgt_vocab_size}"
            )


@register_model(
    "transformer-seq2seq",
    config=TransformerSeq2SeqConfig,
    presets={
        "base": {},
        # Small and tiny: the 15 symbols of the sequence tasks (torchvote.data.SEQ_SYMBOLS); a
        # training run takes the vocabulary sizes and max_len from its data set anyway.
        "small": {
            "src_vocab_size": 15,
            "tgt_vocab_size": 15,
            "max_len": 64,
            "d_model": 128,
            "num_heads": 4,
            "num_encoder_layers": 3,
            "num_decoder_layers": 3,
            "dim_feedforward": 256,
            "dropout": 0.1,
            "norm_first": True,
        },
        "tiny": {
            "src_vocab_size": 15,
            "tgt_vocab_size": 15,
            "max_len": 32,
            "d_model": 32,
            "num_heads": 2,
            "num_encoder_layers": 1,
            "num_decoder_layers": 1,
            "dim_feedforward": 64,
            "dropout": 0.0,
            "norm_first": True,
        },
    },
    task="seq2seq",
    loss="cross-entropy",
)
class TransformerSeq2Seq(nn.Module):
    """Transformer encoder-decoder (Vaswani et al. 2017), softmax or routing attention.

    Args:
        config: a :class:`TransformerSeq2SeqConfig`.
        device: where to create the parameters and buffers.
        dtype: their dtype.

    Raises:
        TypeError: a ``dtype`` that is not a floating-point ``torch.dtype``.
    """

    def __init__(
        self,
        config: TransformerSeq2SeqConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        factory = {"device": device, "dtype": check_float_dtype(dtype)}
        # N(0, 1 / d_model): scaled by sqrt(d_model) (sec. 3.4) the embeddings have unit variance.
        self.target_embedding = nn.Embedding(config.tgt_vocab_size, config.d_model, **factory)
        nn.init.normal_(self.target_embedding.weight, std=config.d_model**-0.5)
        if config.share_embeddings:
            self.source_embedding = self.target_embedding
        else:
            self.source_embedding = nn.Embedding(config.src_vocab_size, config.d_model, **factory)
            nn.init.normal_(self.source_embedding.weight, std=config.d_model**-0.5)
        self.positions = config.make_positions(config.max_len, **factory)
        self.dropout = nn.Dropout(config.dropout)  # on the sums of embeddings and positions (sec. 5.4)
        layer = config.layer_config(norm_first=config.norm_first)
        self.encoder = TransformerEncoder(layer, config.num_encoder_layers, **factory)
        self.decoder = TransformerDecoder(layer, config.num_decoder_layers, **factory)
        self.output = nn.Linear(config.d_model, config.tgt_vocab_size, bias=False, **factory)
        if config.tie_output:
            self.output.weight = self.target_embedding.weight
        self.embed_scale = math.sqrt(config.d_model)

    def _embed(self, embedding: nn.Embedding, tokens: Tensor, offset: int = 0) -> Tensor:
        scaled = embedding(tokens) * self.embed_scale  # (b, t, E)
        return self.dropout(self.positions(scaled, offset=offset))  # (b, t, E)

    def encode(self, source: Tensor) -> tuple[Tensor, Tensor]:
        """Encode the source once (``generate`` reuses it for every decoding step).

        Args:
            source: ``(b, s)`` integer ids, padded with ``pad_id``.

        Returns:
            ``(memory, source_mask)``: ``(b, s, E)`` and boolean ``(b, s)``, True for real tokens.

        Raises:
            ValueError: a ``source`` of the wrong rank, dtype or length.
        """
        self._check_source(source)
        memory, source_mask, _ = self._encode(source, need_weights=False)
        return memory, source_mask

    @property
    def max_source_length(self) -> int:
        """The longest source the model reads: its positions end at ``max_len``."""
        return self.config.max_len

    def _check_source(self, source: Tensor) -> None:
        check_token_ids(
            source, "source", self.max_source_length, vocab_size=self.config.src_vocab_size,
            device=self.target_embedding.weight.device,
        )

    def _encode(
        self, source: Tensor, *, need_weights: bool
    ) -> tuple[Tensor, Tensor, AttentionIntermediates | None]:
        """:meth:`encode` (with the weights' record) on a checked ``source``."""
        source_mask = source != self.config.pad_id  # (b, s)
        memory, record = run_stack(
            self.encoder,
            self._embed(self.source_embedding, source),
            key_mask=source_mask,
            need_weights=need_weights,
        )  # (b, s, E)
        return memory, source_mask, record

    def decode(
        self,
        target_input: Tensor,
        memory: Tensor,
        source_mask: Tensor,
        *,
        cache: TransformerCache | None = None,
    ) -> Tensor:
        """Next-token logits of every target position, attending to an encoded source.

        Args:
            target_input: ``(b, t)`` integer ids, starting with ``bos_id``; with a ``cache``,
                the tokens after the ``P`` it holds (positions ``P .. P + t - 1``).
            memory: ``(b, s, E)`` from :meth:`encode`.
            source_mask: ``(b, s)`` from :meth:`encode`.
            cache: the decoder's keys and values so far (:meth:`new_cache`), extended in place;
                the memory's keys and values are projected on its first call only, so every
                call with one cache must pass the same ``memory``.

        Returns:
            ``(b, t, tgt_vocab_size)`` logits.

        Raises:
            ValueError: a ``target_input`` of the wrong rank, dtype or length; a ``memory`` or
                ``source_mask`` that is not what :meth:`encode` returns for the same batch.
            TypeError: a ``cache`` that is not a :class:`TransformerCache`; a ``memory`` that is
                not floating point of the parameters' dtype (outside ``torch.autocast``).
        """
        check_cache(cache)
        self._check_target_input(target_input, 0 if cache is None else cache.length)
        self._check_memory(memory, source_mask, target_input.shape[0])
        return self._decode(target_input, memory, source_mask, need_weights=False, cache=cache)[0]

    def new_cache(self) -> TransformerCache:
        """An empty key/value cache for :meth:`decode` (incremental decoding)."""
        return self.decoder.new_cache()

    def _check_memory(self, memory: Tensor, source_mask: Tensor, batch: int) -> None:
        """``memory`` ``(b, s, d_model)`` and ``source_mask`` boolean ``(b, s)``, as :meth:`encode`
        returns them, for ``batch`` target sequences."""
        d_model = self.config.d_model
        if not isinstance(memory, Tensor) or memory.dim() != 3 or memory.shape[-1] != d_model:
            shape = tuple(memory.shape) if isinstance(memory, Tensor) else type(memory).__name__
            raise ValueError(f"memory must be encode()'s (batch, s, {d_model}) tensor, got {shape}")
        check_input_dtype(memory, self.output.weight.dtype, "memory")
        if memory.shape[0] != batch:
            raise ValueError(
                f"memory and target_input must have the same batch size, got {memory.shape[0]} "
                f"and {batch}"
            )
        if (
            not isinstance(source_mask, Tensor)
            or source_mask.dtype != torch.bool
            or tuple(source_mask.shape) != tuple(memory.shape[:2])
        ):
            mask = source_mask
            got = f"{mask.dtype} {tuple(mask.shape)}" if isinstance(mask, Tensor) else type(mask).__name__
            raise ValueError(
                f"source_mask must be encode()'s boolean (batch, s) = {tuple(memory.shape[:2])} mask, "
                f"got {got}"
            )

    def _check_target_input(self, target_input: Tensor, offset: int) -> None:
        """``offset``: the positions a cache already holds."""
        check_token_ids(
            target_input,
            "target_input",
            self.config.max_len,
            cached=offset,
            vocab_size=self.config.tgt_vocab_size,
            device=self.target_embedding.weight.device,
        )

    def _decode(
        self,
        target_input: Tensor,
        memory: Tensor,
        source_mask: Tensor,
        *,
        need_weights: bool,
        cache: TransformerCache | None = None,
    ) -> tuple[Tensor, AttentionIntermediates | None]:
        """:meth:`decode` (with the weights' record) on a checked ``target_input``; ``generate``
        calls it directly, its tokens being the model's own (no range check read back a step)."""
        offset = 0 if cache is None else cache.length
        target = self._embed(self.target_embedding, target_input, offset)  # (b, t, E)
        options = {} if cache is None else {"cache": cache}
        hidden, record = run_stack(
            self.decoder,
            target,
            memory,
            memory_key_mask=source_mask,
            is_causal=True,
            need_weights=need_weights,
            **options,
        )  # (b, t, E)
        return self.output(hidden), record  # (b, t, vocab)

    def forward(self, source: Tensor, target_input: Tensor, *, need_weights: bool = False) -> SequenceOutput:
        """Teacher-forced logits: the decoder reads ``target_input`` and predicts its next tokens.

        Args:
            source: ``(b, s)`` integer ids, padded with ``pad_id``.
            target_input: ``(b, t)`` integer ids (``target[:, :-1]``: ``<bos> y_1 ... y_{t-1}``).
            need_weights: record every attention's weights (averaged over the heads).

        Returns:
            A :class:`~torchvote.models.SequenceOutput` with ``logits`` ``(b, t, tgt_vocab_size)``;
            with ``need_weights``, ``attention`` holds, in call order, the encoder layers'
            ``(b, s, s)``, then per decoder layer the self-attention's ``(b, t, t)`` and the
            cross-attention's ``(b, t, s)``, and ``intermediates`` the same by module name.

        Raises:
            ValueError: inputs of the wrong rank, dtype, length, or batch sizes that differ; ids
                outside the vocabularies.
            TypeError: a ``need_weights`` that is not a bool.
        """
        check_flag(need_weights, "need_weights")
        self._check_source(source)
        self._check_target_input(target_input, 0)
        if source.shape[0] != target_input.shape[0]:
            raise ValueError(
                f"source and target_input must have the same batch size, got {source.shape[0]} "
                f"and {target_input.shape[0]}"
            )
        memory, source_mask, encoder_record = self._encode(source, need_weights=need_weights)
        logits, decoder_record = self._decode(target_input, memory, source_mask, need_weights=need_weights)
        if encoder_record is None or decoder_record is None:
            return SequenceOutput(logits=logits)
        record = AttentionIntermediates()
        record.add("encoder", encoder_record)
        record.add("decoder", decoder_record)
        return SequenceOutput(
            logits=logits, attention=list(record.weights.values()), intermediates=record.weights
        )

    @torch.no_grad()
    def generate(
        self, source: Tensor, *, max_new_tokens: int | None = None, use_cache: bool = True
    ) -> Tensor:
        """Greedy decoding: from ``<bos>``, append the most likely token (never ``<pad>`` or
        ``<bos>``) until ``<eos>``.

        Runs in evaluation mode (no dropout) and returns the model to its previous mode.

        Args:
            source: ``(b, s)`` integer ids, padded with ``pad_id``.
            max_new_tokens: most tokens to generate after ``<bos>``; default ``max_len - 1``.
            use_cache: keep the decoder's past keys and values and the memory's projections
                (same tokens, far faster; False reruns the whole target for every token).

        Returns:
            ``(b, 1 + n)`` ids laid out as the targets, ``<bos> y_1 ... <eos>`` then ``pad_id``
            after each sequence's end; ``n <= max_new_tokens`` (decoding stops once every
            sequence has produced ``<eos>``).

        Raises:
            ValueError: a bad ``source``, or a ``max_new_tokens`` that is not an integer (a bool
                or a float) in ``[0, max_len - 1]``.
            TypeError: a ``use_cache`` that is not a bool.
        """
        limit = check_max_new_tokens(max_new_tokens, self.config.max_len)
        check_flag(use_cache, "use_cache")
        with evaluating(self):
            memory, source_mask = self.encode(source)
            cache = self.new_cache() if use_cache else None

            def next_logits(tokens: Tensor) -> Tensor:  # (b, t) -> (b, vocab)
                new = tokens if cache is None else tokens[:, cache.length :]  # <bos>, then 1 a step
                return self._decode(new, memory, source_mask, need_weights=False, cache=cache)[0][:, -1]

            return greedy_decode(
                next_logits,
                source.shape[0],
                limit,
                bos_id=self.config.bos_id,
                eos_id=self.config.eos_id,
                pad_id=self.config.pad_id,
                device=source.device,
            )
