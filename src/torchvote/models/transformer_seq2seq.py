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
hook; nothing else changes.

Padding (``pad_id``) in the source is masked out of every attention over it, so appending padding
leaves the outputs unchanged. The decoder's input is not masked for padding: its padding only
follows the real tokens, and the causal mask already hides later positions from earlier ones.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from torchvote.models.registry import SequenceOutput, register_model
from torchvote.nn.positional import LearnedPositionalEmbedding, SinusoidalPositionalEncoding
from torchvote.nn.routing_attention import ATTENTION_KINDS, AttentionRecorder, attention_factory
from torchvote.nn.transformer import TransformerConfig, TransformerDecoder, TransformerEncoder

__all__ = ["TransformerSeq2Seq", "TransformerSeq2SeqConfig"]


@dataclass
class TransformerSeq2SeqConfig:
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
        routing_iterations: voting passes of the routing attention (1 equals softmax).

    Raises:
        ValueError: a field out of range or inconsistent, naming it.
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

    def __post_init__(self) -> None:
        for name in (
            "src_vocab_size",
            "tgt_vocab_size",
            "max_len",
            "d_model",
            "num_heads",
            "num_encoder_layers",
            "num_decoder_layers",
            "routing_iterations",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_len < 2:
            raise ValueError(f"max_len must be at least 2 (<bos> and one token), got {self.max_len}")
        for name in ("pad_id", "bos_id", "eos_id"):
            value = getattr(self, name)
            if not 0 <= value < self.tgt_vocab_size:
                raise ValueError(
                    f"{name} must be a target id in [0, tgt_vocab_size={self.tgt_vocab_size}), got {value}"
                )
        if len({self.pad_id, self.bos_id, self.eos_id}) != 3:
            raise ValueError(
                f"pad_id, bos_id and eos_id must differ, got {self.pad_id}, {self.bos_id}, {self.eos_id}"
            )
        if self.pad_id >= self.src_vocab_size:
            raise ValueError(
                f"pad_id ({self.pad_id}) must be a source id too, < src_vocab_size={self.src_vocab_size}"
            )
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads})")
        if self.dim_feedforward is not None and self.dim_feedforward < 1:
            raise ValueError(f"dim_feedforward must be positive or None, got {self.dim_feedforward}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if self.activation not in ("relu", "gelu"):
            raise ValueError(f"activation must be 'relu' or 'gelu', got {self.activation!r}")
        if self.positional not in ("learned", "sinusoidal"):
            raise ValueError(f"positional must be 'learned' or 'sinusoidal', got {self.positional!r}")
        if self.share_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            raise ValueError(
                f"share_embeddings=True needs src_vocab_size == tgt_vocab_size, got "
                f"{self.src_vocab_size} and {self.tgt_vocab_size}"
            )
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {self.attention!r}")


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
    """

    def __init__(self, config: TransformerSeq2SeqConfig) -> None:
        super().__init__()
        self.config = config
        # N(0, 1 / d_model): scaled by sqrt(d_model) (sec. 3.4) the embeddings have unit variance.
        self.target_embedding = nn.Embedding(config.tgt_vocab_size, config.d_model)
        nn.init.normal_(self.target_embedding.weight, std=config.d_model**-0.5)
        if config.share_embeddings:
            self.source_embedding = self.target_embedding
        else:
            self.source_embedding = nn.Embedding(config.src_vocab_size, config.d_model)
            nn.init.normal_(self.source_embedding.weight, std=config.d_model**-0.5)
        self.positions: nn.Module
        if config.positional == "sinusoidal":
            self.positions = SinusoidalPositionalEncoding(config.d_model, max_len=config.max_len)
        else:
            self.positions = LearnedPositionalEmbedding(config.max_len, config.d_model)
        self.dropout = nn.Dropout(config.dropout)  # on the sums of embeddings and positions (sec. 5.4)
        layer = TransformerConfig(
            d_model=config.d_model,
            num_heads=config.num_heads,
            dim_feedforward=config.dim_feedforward,
            dropout=config.dropout,
            activation=config.activation,
            norm_first=config.norm_first,
            attention=attention_factory(config.attention, iterations=config.routing_iterations),
        )
        self.encoder = TransformerEncoder(layer, config.num_encoder_layers)
        self.decoder = TransformerDecoder(layer, config.num_decoder_layers)
        self.output = nn.Linear(config.d_model, config.tgt_vocab_size, bias=False)
        if config.tie_output:
            self.output.weight = self.target_embedding.weight
        self.embed_scale = math.sqrt(config.d_model)

    def _embed(self, embedding: nn.Embedding, tokens: Tensor) -> Tensor:
        return self.dropout(self.positions(embedding(tokens) * self.embed_scale))  # (b, t, E)

    def encode(self, source: Tensor) -> tuple[Tensor, Tensor]:
        """Encode the source once (``generate`` reuses it for every decoding step).

        Args:
            source: ``(b, s)`` integer ids, padded with ``pad_id``.

        Returns:
            ``(memory, source_mask)``: ``(b, s, E)`` and boolean ``(b, s)``, True for real tokens.

        Raises:
            ValueError: a ``source`` of the wrong rank, dtype or length.
        """
        _check_ids(source, "source", self.config.max_len)
        source_mask = source != self.config.pad_id  # (b, s)
        memory = self.encoder(self._embed(self.source_embedding, source), key_mask=source_mask)
        return memory, source_mask

    def decode(self, target_input: Tensor, memory: Tensor, source_mask: Tensor) -> Tensor:
        """Next-token logits of every target position, attending to an encoded source.

        Args:
            target_input: ``(b, t)`` integer ids, starting with ``bos_id``.
            memory: ``(b, s, E)`` from :meth:`encode`.
            source_mask: ``(b, s)`` from :meth:`encode`.

        Returns:
            ``(b, t, tgt_vocab_size)`` logits.

        Raises:
            ValueError: a ``target_input`` of the wrong rank, dtype or length.
        """
        _check_ids(target_input, "target_input", self.config.max_len)
        target = self._embed(self.target_embedding, target_input)  # (b, t, E)
        hidden = self.decoder(target, memory, memory_key_mask=source_mask, is_causal=True)
        return self.output(hidden)  # (b, t, vocab)

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
            ValueError: inputs of the wrong rank, dtype, length, or batch sizes that differ.
        """
        _check_ids(source, "source", self.config.max_len)
        _check_ids(target_input, "target_input", self.config.max_len)
        if source.shape[0] != target_input.shape[0]:
            raise ValueError(
                f"source and target_input must have the same batch size, got {source.shape[0]} "
                f"and {target_input.shape[0]}"
            )
        recorder = AttentionRecorder(self) if need_weights else None
        with recorder if recorder is not None else contextlib.nullcontext():
            memory, source_mask = self.encode(source)
            logits = self.decode(target_input, memory, source_mask)
        if recorder is None:
            return SequenceOutput(logits=logits)
        return SequenceOutput(
            logits=logits, attention=[w for _, w in recorder.calls], intermediates=recorder.weights
        )

    @torch.no_grad()
    def generate(self, source: Tensor, *, max_new_tokens: int | None = None) -> Tensor:
        """Greedy decoding: from ``<bos>``, append the most likely token until ``<eos>``.

        Runs in evaluation mode (no dropout) and returns the model to its previous mode.

        Args:
            source: ``(b, s)`` integer ids, padded with ``pad_id``.
            max_new_tokens: most tokens to generate after ``<bos>``; default ``max_len - 1``.

        Returns:
            ``(b, 1 + n)`` ids laid out as the targets, ``<bos> y_1 ... <eos>`` then ``pad_id``
            after each sequence's end; ``n <= max_new_tokens`` (decoding stops once every
            sequence has produced ``<eos>``).

        Raises:
            ValueError: a bad ``source``, or ``max_new_tokens`` beyond ``max_len - 1``.
        """
        limit = self.config.max_len - 1 if max_new_tokens is None else max_new_tokens
        if isinstance(limit, bool) or not isinstance(limit, int) or not 0 <= limit < self.config.max_len:
            raise ValueError(
                f"max_new_tokens must be an integer in [0, max_len - 1 = {self.config.max_len - 1}], "
                f"got {max_new_tokens!r}"
            )
        was_training = self.training
        self.eval()
        try:
            memory, source_mask = self.encode(source)
            return _greedy(
                lambda tokens: self.decode(tokens, memory, source_mask)[:, -1],
                source.shape[0],
                limit,
                self.config.bos_id,
                self.config.eos_id,
                self.config.pad_id,
                source.device,
            )
        finally:
            self.train(was_training)


def _greedy(
    next_logits, batch: int, limit: int, bos_id: int, eos_id: int, pad_id: int, device: torch.device
) -> Tensor:
    """Greedy decoding loop; ``next_logits(tokens (b, t)) -> (b, vocab)``."""
    tokens = torch.full((batch, 1), bos_id, dtype=torch.long, device=device)  # (b, 1)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    for _ in range(limit):
        next_token = next_logits(tokens).argmax(dim=-1)  # (b,)
        next_token = next_token.masked_fill(finished, pad_id)
        tokens = torch.cat([tokens, next_token[:, None]], dim=1)  # (b, t + 1)
        finished |= next_token == eos_id
        if bool(finished.all()):
            break
    return tokens


def _check_ids(tokens: Tensor, argument: str, max_len: int) -> None:
    """Raise a ValueError naming ``argument`` unless it is a ``(b, t)`` integer tensor that fits."""
    if not isinstance(tokens, Tensor) or tokens.dim() != 2:
        shape = tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__
        raise ValueError(f"{argument} must be a (batch, length) tensor of token ids, got {shape}")
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise ValueError(f"{argument} must hold integer token ids, got dtype {tokens.dtype}")
    if not 1 <= tokens.shape[1] <= max_len:
        raise ValueError(
            f"{argument} must hold 1 to max_len={max_len} tokens, got shape {tuple(tokens.shape)}"
        )
