"""A decoder-only, character-level Transformer language model (GPT-style) with swappable attention.

Tokens are embedded, positions added, and a stack of pre-norm Transformer layers (Vaswani et al.
2017, "Attention Is All You Need", sec. 3; pre-norm as in GPT-2 and Xiong et al. 2020) runs with
a causal mask, so position ``t`` hears only positions ``<= t``; a linear head, sharing its weights
with the token embedding (Press & Wolf 2017, as Vaswani et al. sec. 3.4), gives next-token logits.

``attention="softmax"`` uses :class:`~torchvote.nn.MultiHeadAttention`; ``attention="routing"``
uses :class:`~torchvote.nn.routing_attention.RoutingAttention`, ``routing_iterations`` passes of
the voting operator with agreement updates (normalised over the senders in every pass, which keeps
the model causal). Everything else is identical, so the two can be trained and compared through
the same command::

    torchvote train lm-shakespeare model.attention=routing model.routing_iterations=3

The defaults are the character-level Shakespeare configuration of Karpathy's nanoGPT
(``shakespeare_char``: 6 layers, 6 heads, 384 features, 256 characters of context, dropout 0.2);
there is no paper size for this task. ``small`` is the CPU-sized preset, ``tiny`` the test one.

``generate`` keeps every layer's keys and values in a
:class:`~torchvote.nn.kv_cache.TransformerCache` (``use_cache=True``, the default), so each new
token costs one position's work instead of the whole context's; the tokens are those of
``use_cache=False``. Routing attention caches too (it normalises over the senders). Each token is
drawn by :func:`~torchvote.models.sampling.sample_next_token` (greedy, temperature, top-k and
top-p sampling). ``stream`` hands over each step's tokens as they are drawn (``torchvote
generate`` prints text as it is written); ``generate`` is that stream, collected.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from torchvote.models.registry import SequenceOutput, register_model
from torchvote.models.sampling import check_sampling, sample_checked
from torchvote.models.transformer_backbone import (
    TransformerBackboneFields,
    check_cache,
    check_token_ids,
    evaluating,
    run_stack,
)
from torchvote.nn.kv_cache import TransformerCache
from torchvote.nn.transformer_stack import TransformerEncoder
from torchvote.validation import (
    check_bool_fields,
    check_flag,
    check_float_dtype,
    check_positive_int,
)

__all__ = ["TransformerLM", "TransformerLMConfig"]


@dataclass
class TransformerLMConfig(TransformerBackboneFields):
    """Sizes and choices of the character-level Transformer language model.

    Args:
        vocab_size: number of token ids (filled from the data set when training).
        context_length: longest input sequence (the positions the model knows).
        d_model: feature size ``E``.
        num_heads: attention heads; must divide ``d_model``.
        num_layers: Transformer layers.
        dim_feedforward: hidden size of the feed-forward networks; ``None`` for ``4 * d_model``.
        dropout: on the embeddings, the attention weights and every sublayer's output.
        activation: ``"relu"`` or ``"gelu"``.
        positional: ``"learned"`` (one vector per position, GPT-2) or ``"sinusoidal"`` (Vaswani
            et al. 2017, sec. 3.5).
        tie_weights: the output head shares the token embedding's weights.
        attention: ``"softmax"`` (multi-head attention) or ``"routing"`` (iterative
            routing-style attention).
        routing_iterations: voting passes of the routing attention (1 equals softmax;
            unused by ``attention="softmax"``).
        routing_normalize_over: only ``"senders"``: every attention of the language model is
            causal, and a softmax over the receivers sums over later positions (the field is
            shared with the other Transformer configs, so a sweep can name it).

    Raises:
        ValueError: a field out of range, naming it; ``routing_normalize_over="receivers"``.
    """

    vocab_size: int = 65
    context_length: int = 256
    d_model: int = 384
    num_heads: int = 6
    num_layers: int = 6
    dim_feedforward: int | None = None
    dropout: float = 0.2
    activation: Literal["relu", "gelu"] = "gelu"
    positional: Literal["learned", "sinusoidal"] = "learned"
    tie_weights: bool = True
    attention: Literal["softmax", "routing"] = "softmax"
    routing_iterations: int = 3
    routing_normalize_over: Literal["senders", "receivers"] = "senders"

    def __post_init__(self) -> None:
        check_bool_fields(self)
        if self.routing_normalize_over == "receivers":
            raise ValueError(
                "routing_normalize_over='receivers' is not possible in transformer-lm: every "
                "attention of a language model is causal (position t hears only positions <= t), "
                "and a softmax over the receivers sums over the later positions too, so later "
                "tokens would change earlier predictions; use 'senders'"
            )
        self.check_backbone("vocab_size", "context_length", "num_layers")


@register_model(
    "transformer-lm",
    config=TransformerLMConfig,
    presets={
        "nanogpt-char": {},
        "small": {"context_length": 128, "d_model": 128, "num_heads": 4, "num_layers": 4, "dropout": 0.1},
        "tiny": {"context_length": 32, "d_model": 32, "num_heads": 2, "num_layers": 2, "dropout": 0.0},
    },
    task="language-model",
    loss="cross-entropy",
)
class TransformerLM(nn.Module):
    """Decoder-only causal Transformer language model over characters, softmax or routing attention.

    Args:
        config: a :class:`TransformerLMConfig`.
        device: where to create the parameters and buffers.
        dtype: their dtype.

    Raises:
        TypeError: a ``dtype`` that is not a floating-point ``torch.dtype``.
    """

    def __init__(
        self,
        config: TransformerLMConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        factory = {"device": device, "dtype": check_float_dtype(dtype)}
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model, **factory)
        nn.init.normal_(self.token_embedding.weight, std=0.02)  # GPT-2's initialisation
        self.positions = config.make_positions(config.context_length, **factory)
        self.dropout = nn.Dropout(config.dropout)
        layer = config.layer_config(norm_first=True)
        # Self-attention layers run with a causal mask: a decoder without cross-attention. Being
        # pre-norm, the stack ends in one more layer norm (GPT-2).
        self.decoder = TransformerEncoder(layer, config.num_layers, **factory)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False, **factory)
        if config.tie_weights:
            self.head.weight = self.token_embedding.weight

    def forward(
        self, tokens: Tensor, *, need_weights: bool = False, cache: TransformerCache | None = None
    ) -> SequenceOutput:
        """Next-token logits for every position.

        Args:
            tokens: ``(b, t)`` integer ids, ``1 <= t <= context_length``; with a ``cache``, the
                tokens after the ``P`` it holds (positions ``P .. P + t - 1``, ``P + t <=
                context_length``).
            need_weights: record every layer's attention weights (averaged over the heads;
                ``(b, t, P + t)`` with a cache).
            cache: every layer's keys and values so far (:meth:`new_cache`), extended in place.

        Returns:
            A :class:`~torchvote.models.SequenceOutput` with ``logits`` ``(b, t, vocab_size)``;
            with ``need_weights``, ``attention`` holds one ``(b, t, t)`` tensor per layer
            (``(b, t, P + t)`` with a cache) and
            ``intermediates`` the same under the modules' names.

        Raises:
            ValueError: ``tokens`` of the wrong rank, dtype or length, or ids outside the
                vocabulary.
            TypeError: a ``cache`` that is not a :class:`TransformerCache`, a ``need_weights``
                that is not a bool.
        """
        check_flag(need_weights, "need_weights")
        check_cache(cache)
        check_token_ids(
            tokens,
            "tokens",
            self.config.context_length,
            length_name="context_length",
            cached=0 if cache is None else cache.length,
            vocab_size=self.config.vocab_size,
            device=self.token_embedding.weight.device,
        )
        return self._logits(tokens, need_weights=need_weights, cache=cache)

    def _logits(
        self, tokens: Tensor, *, need_weights: bool, cache: TransformerCache | None
    ) -> SequenceOutput:
        """:meth:`forward` on ids already checked (``generate`` checks its prompt once; the tokens
        it appends are the model's own, so no step reads a range check back from the device)."""
        offset = 0 if cache is None else cache.length
        x = self.dropout(self.positions(self.token_embedding(tokens), offset=offset))  # (b, t, E)
        options = {} if cache is None else {"cache": cache}
        hidden, record = run_stack(
            self.decoder, x, is_causal=True, need_weights=need_weights, **options
        )  # (b, t, E)
        logits = self.head(hidden)  # (b, t, vocab)
        if record is None:
            return SequenceOutput(logits=logits)
        return SequenceOutput(
            logits=logits, attention=list(record.weights.values()), intermediates=record.weights
        )

    def new_cache(self) -> TransformerCache:
        """An empty key/value cache for :meth:`forward` (incremental decoding)."""
        return self.decoder.new_cache()

    def stream(
        self,
        prompt: Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
    ) -> Iterator[Tensor]:
        """Continue ``prompt`` one token at a time, handing each over as it is drawn: what
        :meth:`generate` returns, as an iterator (text that appears as it is written).

        Every argument is checked when ``stream`` is called, before the first token. Each token
        is computed in evaluation mode (no dropout) and every submodule is given back its mode
        before the token is handed over: between tokens the model is in the caller's mode (a
        ``model.train()`` or ``model.eval()`` called then stays; the next token is still computed
        in evaluation mode), and an iterator left unfinished changes no mode.

        Args:
            prompt, max_new_tokens, temperature, top_k, top_p, generator, use_cache: as
                :meth:`generate` takes them.

        Returns:
            An iterator of ``max_new_tokens`` tensors: each step's new ids, ``(b,)`` (or a
            0-dim tensor for a ``(t,)`` prompt), on the model's device.

        Raises:
            ValueError, TypeError: as :meth:`generate` raises them, when ``stream`` is called.
        """
        if isinstance(prompt, (list, tuple)):
            raise ValueError(
                f"prompt must be one (batch, length) or (length,) tensor of token ids, got a "
                f"{type(prompt).__name__}: the model has no padding, so prompts of different "
                "lengths cannot share a batch; generate each on its own (or stack prompts of one "
                "length into a tensor)"
            )
        unbatched = isinstance(prompt, Tensor) and prompt.dim() == 1
        if unbatched and prompt.shape[0] == 0:  # named as given, not as the (1, 0) batch it becomes
            raise ValueError(f"prompt must hold at least one token, got shape {tuple(prompt.shape)}")
        tokens = prompt.unsqueeze(0) if unbatched else prompt  # (b, t)
        device = self.token_embedding.weight.device
        check_token_ids(tokens, "prompt", vocab_size=self.config.vocab_size, device=device)
        check_positive_int(max_new_tokens, "max_new_tokens", minimum=0)
        # checked once here; every step samples without checking again
        temperature, top_k, top_p, generator = check_sampling(temperature, top_k, top_p, generator)
        check_flag(use_cache, "use_cache")
        sampling = (temperature, top_k, top_p, generator)
        return self._stream(tokens, max_new_tokens, *sampling, use_cache, unbatched)

    @torch.no_grad()
    def _stream(
        self,
        tokens: Tensor,
        max_new_tokens: int,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        generator: torch.Generator | None,
        use_cache: bool,
        unbatched: bool,
    ) -> Iterator[Tensor]:
        """:meth:`stream`'s steps on checked arguments, ``tokens`` ``(b, t)``."""
        context = self.config.context_length
        cache = self.new_cache() if use_cache and tokens.shape[1] < context else None
        for _ in range(max_new_tokens):
            if cache is not None and tokens.shape[1] <= context:
                inputs, step_cache = tokens[:, cache.length :], cache  # (b, t - P): prompt, then 1
            else:
                inputs, step_cache = tokens[:, -context:], None  # (b, <= context_length)
            # evaluation mode for the step only, never across a yield: between tokens the model is
            # in the caller's mode, and a stream dropped later puts back no mode over one the
            # caller has set since (model.eval() undone: dropout on again)
            with evaluating(self):
                output = self._logits(inputs, need_weights=False, cache=step_cache)
            logits = output.logits[:, -1]  # (b, vocab)
            next_token = sample_checked(logits, temperature, top_k, top_p, generator).to(tokens)  # (b, 1)
            tokens = torch.cat([tokens, next_token], dim=1)  # (b, t + 1)
            yield next_token[0, 0] if unbatched else next_token[:, 0]

    def generate(
        self,
        prompt: Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
    ) -> Tensor:
        """Continue ``prompt`` by sampling one token at a time.

        The model reads at most the last ``context_length`` tokens. It runs in evaluation mode
        (no dropout) and is returned to its previous mode afterwards. With ``use_cache`` the
        keys and values of past tokens are kept (:class:`~torchvote.nn.kv_cache.TransformerCache`)
        and only the new token is run, while the sequence fits the context; beyond it the window
        slides, every position changes, and each step reruns the window as without a cache.

        Args:
            prompt: ``(b, t)`` or ``(t,)`` integer ids, ``t >= 1``. The rows of a batch share
                one length: the model has no padding, so prompts of different lengths are
                generated one call each.
            max_new_tokens: tokens to append, ``>= 0``.
            temperature: a finite number ``>= 0`` (or a one-element tensor of one) that divides
                the logits; ``0`` takes the most likely token (greedy, no sampling).
            top_k: a positive integer: sample only among the ``top_k`` most likely tokens (one
                of ``vocab_size`` or more keeps them all, as nanoGPT's ``min(top_k, vocab)``, so
                one setting serves data sets of different vocabularies); ``None`` for all.
                Ignored when ``temperature`` is 0 (greedy).
            top_p: a number in ``(0, 1]``: after ``top_k``, sample only among the smallest set of
                most likely tokens whose probability reaches ``top_p`` (nucleus sampling,
                Holtzman et al. 2020; ties to the lowest id, the most likely token always kept,
                ``1`` keeps them all); ``None`` for all. Ignored when ``temperature`` is 0.
            generator: the ``torch.Generator`` of the sampling, on any device (the draw happens there,
                so a CPU generator serves a CUDA model); ``None`` for PyTorch's global one.
            use_cache: keep past keys and values (same tokens, far faster; False reruns the
                whole context for every token).

        Returns:
            ``(b, t + max_new_tokens)`` (or ``(t + max_new_tokens,)``): the prompt and its
            continuation.

        Raises:
            ValueError: a bad ``prompt`` (a list of prompts included), ``max_new_tokens``
                (negative, a bool or a float), ``temperature`` (negative, NaN or infinite),
                ``top_k``, or ``top_p`` (outside ``(0, 1]``, NaN, a bool).
            TypeError: a ``temperature`` or ``top_p`` that is not a number (``"1"``; for
                ``temperature`` ``None`` or a tensor of several values), a ``generator`` that is
                not a ``torch.Generator``, a ``use_cache`` that is not a bool.
        """
        steps = self.stream(
            prompt, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            generator=generator, use_cache=use_cache,
        )
        new = list(steps)  # (b,) or () each
        if not new:  # a new tensor, as with new tokens: never the caller's prompt
            return prompt.clone()
        return torch.cat([prompt.to(new[0].device), torch.stack(new, dim=-1)], dim=-1)

