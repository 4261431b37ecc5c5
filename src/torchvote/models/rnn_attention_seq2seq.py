"""A GRU encoder-decoder with attention: Bahdanau (additive) or Luong (dot, general, concat).

Attention began here, before Transformers: at every output step the decoder weighs the encoder's
states by how well each agrees with its own state and reads their weighted sum (one pass of
weighted voting, normalised over the source positions). Two decoders, following the two papers:

``attention="additive"`` -- Bahdanau, Cho & Bengio 2015, "Neural Machine Translation by Jointly
Learning to Align and Translate" (RNNsearch). The previous decoder state ``s_{i-1}`` is the query
(:class:`~torchvote.nn.AdditiveAttention`, ``e_ij = v^T tanh(W s_{i-1} + U h_j)``, app. A.1.2); the
context ``c_i`` enters the recurrence, ``s_i = GRU([E y_{i-1}; c_i], s_{i-1})``; and a deep
output layer (app. A.2.2, with tanh in place of the maxout) reads ``[s_i; c_i; E y_{i-1}]``.
The encoder is bidirectional. The decoder's first state is the paper's with ``bridge="backward"``:
``s_0 = tanh(W_s h<-_1)`` (app. A.2.2), from the backward direction's final state ``h<-_1`` (of
each layer, with ``num_layers > 1``). The default, ``bridge="both"``, departs from it (as this
model always did, so its checkpoints load unchanged): ``s_0 = tanh(W_s [h->_Tx; h<-_1])``, the
final states in both directions, one bridge for both decoders (Luong's unidirectional encoder has
the one state, ``h->_Tx``, and takes ``"both"`` only).

``attention="dot" | "general" | "concat"`` -- Luong, Pham & Manning 2015, "Effective Approaches to
Attention-based Neural Machine Translation" (global attention). The current state ``h_t`` is the
query (:class:`~torchvote.nn.LuongAttention`, eq. 8); the attentional state
``h~_t = tanh(W_c [c_t; h_t])`` (eq. 5) gives the logits (eq. 6) and is fed to the next step
(input feeding, sec. 3.3). Luong et al. use LSTMs; here both decoders are GRUs.

``forward`` is teacher-forced (the decoder reads the true previous tokens); ``generate`` decodes
greedily, with the arguments of the Transformer encoder-decoder's (its ``use_cache`` is accepted
and changes nothing: the recurrent state is the cache). The source is packed, so padding
(``pad_id``, after the tokens) changes nothing.

Packing needs each source's length on the host (``pack_padded_sequence`` takes CPU lengths and
sizes its batches by them). Counted from a source on a GPU, they are read back at every call: one
synchronisation, the host waiting for every kernel queued before it. ``source_lengths=`` (of
:meth:`~RNNAttentionSeq2Seq.encode`, ``forward`` and ``generate``) takes them on the CPU, as a
data loader that built the padded batch knows them, and then nothing is read back: the model
checks them against the padding with an assertion queued on the device. The sorting by length
that packing needs is done on the host too (``torch.nn.utils.rnn``'s own unsorted packing moves
its permutation to the device and back, two more synchronisations). Results are the same
either way, bit for bit.

Under a ``torch.func`` transform (``vmap``, ``grad``, per-sample gradients) and forward-mode AD
the GRUs run as plain operations (:func:`_plain_gru`): packing reads the lengths on the host,
which ``vmap`` cannot do with per-example sources, and ``nn.GRU``'s fused kernel fails in
``vmap``'s batching fallback. A padded step keeps its row's state, as packing skips it: the same
numbers.

The defaults are RNNsearch's sizes (620-dimensional embeddings, 1000 hidden units, 30000-word
vocabularies, sentences up to 50 words); ``luong`` is Luong et al.'s (4 layers of 1000 units,
50000 words, dropout 0.2, unidirectional, general score); ``small`` and ``tiny`` are CPU and test
sizes for the generated sequence tasks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn
from torch.nn.utils.rnn import invert_permutation, pack_padded_sequence, pad_packed_sequence

from torchvote.models.registry import SequenceOutput, register_model
from torchvote.models.transformer_backbone import (
    check_config_ints,
    check_max_new_tokens,
    check_special_ids,
    check_token_ids,
    evaluating,
    greedy_decode,
)
from torchvote.nn.scoring_attention import AdditiveAttention, LuongAttention
from torchvote.tracing import is_exporting, under_autograd_transforms
from torchvote.validation import (
    check_bool_fields,
    check_choice,
    check_flag,
    check_float_dtype,
    check_integer_tensor,
    check_positive_int,
    check_probability,
    check_tensor_values,
)

__all__ = ["RNNAttentionSeq2Seq", "RNNAttentionSeq2SeqConfig"]


def _plain_gru(
    gru: nn.GRU, inputs: Tensor, hidden: Tensor | None = None, *, steps: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """A ``batch_first`` ``nn.GRU`` in plain operations, for ``torch.func`` transforms and
    forward-mode AD: ``vmap`` cannot read the lengths that packing sizes its batches by, and
    ``nn.GRU``'s fused kernel fails in ``vmap``'s batching fallback (per-sample gradients of its
    weights). Each cell is ``nn.GRU``'s (Cho et al. 2014 as torch documents it: gates reset,
    update, new), layer by layer, forward then backward; dropout between the layers as
    ``nn.GRU`` applies it in training.

    Args:
        gru: the module whose weights run (``batch_first=True``).
        inputs: ``(b, s, in)``.
        hidden: ``(layers * directions, b, H)`` initial states, or ``None`` for zeros.
        steps: boolean ``(b, s)``, True at the steps packing would run (each row's leading
            tokens), or ``None`` for all: a step that is not run keeps its row's state and
            outputs zeros, as a packed sequence padded back does, so the backward direction
            starts at a row's last token and the final states are those after it.

    Returns:
        ``(outputs, final)``: ``(b, s, directions * H)`` the last layer's states, and
        ``(layers * directions, b, H)`` the final state of each layer and direction.
    """
    directions = 2 if gru.bidirectional else 1
    batch, length = inputs.shape[:2]
    if hidden is None:
        hidden = inputs.new_zeros(gru.num_layers * directions, batch, gru.hidden_size)
    run = None if steps is None else steps.unsqueeze(-1)  # (b, s, 1)
    layer_input, finals = inputs, []
    for layer in range(gru.num_layers):
        if layer > 0 and gru.dropout > 0:
            layer_input = F.dropout(layer_input, gru.dropout, gru.training)
        outputs = []
        for direction in range(directions):
            suffix = f"_l{layer}" + ("_reverse" if direction else "")
            weight_ih, weight_hh = getattr(gru, f"weight_ih{suffix}"), getattr(gru, f"weight_hh{suffix}")
            bias_ih = getattr(gru, f"bias_ih{suffix}") if gru.bias else None
            bias_hh = getattr(gru, f"bias_hh{suffix}") if gru.bias else None
            gates_in = F.linear(layer_input, weight_ih, bias_ih)  # (b, s, 3H), every step at once
            state = hidden[layer * directions + direction]  # (b, H)
            states: list[Tensor] = [state] * length
            for t in reversed(range(length)) if direction else range(length):
                reset_in, update_in, new_in = gates_in[:, t].chunk(3, dim=-1)  # (b, H) each
                reset_h, update_h, new_h = F.linear(state, weight_hh, bias_hh).chunk(3, dim=-1)
                reset = torch.sigmoid(reset_in + reset_h)
                update = torch.sigmoid(update_in + update_h)
                new = torch.tanh(new_in + reset * new_h)
                stepped = (1 - update) * new + update * state  # (b, H)
                if run is None:
                    state, states[t] = stepped, stepped
                else:  # a padded step: the state carries over, the output is zero
                    state = torch.where(run[:, t], stepped, state)
                    states[t] = torch.where(run[:, t], stepped, torch.zeros_like(stepped))
            outputs.append(torch.stack(states, dim=1))  # (b, s, H)
            finals.append(state)
        layer_input = torch.cat(outputs, dim=-1)  # (b, s, directions * H)
    return layer_input, torch.stack(finals)  # (b, s, directions * H), (layers * directions, b, H)

RNNAttention = Literal["additive", "dot", "general", "concat"]
_ATTENTIONS: tuple[str, ...] = ("additive", "dot", "general", "concat")
RNNBridge = Literal["both", "backward"]
_BRIDGES: tuple[str, ...] = ("both", "backward")

# One decoder step: (logits (b, 1, vocab), hidden (layers, b, H), feed (b, 1, H) | None,
# weights (b, 1, s)).
_Step = tuple[Tensor, Tensor, Tensor | None, Tensor]


@dataclass
class RNNAttentionSeq2SeqConfig:
    """Sizes and choices of the GRU encoder-decoder with attention; the defaults are RNNsearch's
    sizes, with one departure: ``bridge="both"`` (the paper's first decoder state reads the
    backward encoder's only: ``bridge="backward"``, app. A.2.2).

    Args:
        src_vocab_size: source token ids (filled from the data set when training).
        tgt_vocab_size: target token ids (filled from the data set when training).
        max_len: the longest target ``generate`` writes (its default length); the GRUs take
            sequences of any length, so the forward pass does not limit them (the Transformer's,
            whose positions are learned up to ``max_len``, does).
        pad_id: the padding id of both sequences.
        bos_id: the id that starts every target (the decoder's first input in ``generate``).
        eos_id: the id that ends every target (``generate`` stops after it).
        embed_dim: size of the token embeddings.
        hidden_size: size ``H`` of the GRU states (per direction in the encoder).
        num_layers: GRU layers of the encoder and of the decoder.
        bidirectional: bidirectional encoder (its states have ``2 H`` features).
        attention: ``"additive"`` (Bahdanau) or Luong's ``"dot"``, ``"general"``, ``"concat"``.
        attention_dim: hidden size of the additive and concat scores; ``None`` for ``hidden_size``.
        dropout: on the embeddings, between GRU layers and before the output layer.
        bridge: which of the encoder's final states give the decoder's first one:
            ``"backward"``, the backward direction's, ``s_0 = tanh(W_s h<-_1)`` (Bahdanau et al.
            2015, app. A.2.2; needs ``bidirectional=True``), or ``"both"`` (the default), every
            direction's, ``s_0 = tanh(W_s [h->_Tx; h<-_1])`` (``W_s``: ``H -> H`` and
            ``directions * H -> H``).

    Raises:
        ValueError: a field out of range or inconsistent, naming it (``pad_id``, ``bos_id`` and
            ``eos_id`` must be distinct integer ids; ``bridge="backward"`` needs
            ``bidirectional=True``).
    """

    src_vocab_size: int = 30000
    tgt_vocab_size: int = 30000
    max_len: int = 50
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    embed_dim: int = 620
    hidden_size: int = 1000
    num_layers: int = 1
    bidirectional: bool = True
    attention: RNNAttention = "additive"
    attention_dim: int | None = None
    dropout: float = 0.0
    bridge: RNNBridge = "both"

    def __post_init__(self) -> None:
        check_bool_fields(self)
        check_config_ints(
            self, ("src_vocab_size", "tgt_vocab_size", "max_len", "embed_dim", "hidden_size", "num_layers")
        )
        if self.max_len < 2:
            raise ValueError(f"max_len must be at least 2 (<bos> and one token), got {self.max_len}")
        check_special_ids(self)
        check_choice(self.attention, _ATTENTIONS, "attention")
        if self.attention == "dot" and self.bidirectional:
            raise ValueError(
                "attention='dot' compares the decoder state (hidden_size features) with the "
                "encoder states (2 * hidden_size with bidirectional=True): set bidirectional=False "
                "or use attention='general'"
            )
        if self.attention_dim is not None:
            if self.attention not in ("additive", "concat"):
                raise ValueError(
                    f"attention_dim only applies to attention='additive' or 'concat', got "
                    f"attention={self.attention!r}"
                )
            check_positive_int(self.attention_dim, "attention_dim")
        check_probability(self.dropout, "dropout")
        check_choice(self.bridge, _BRIDGES, "bridge")
        if self.bridge == "backward" and not self.bidirectional:
            raise ValueError(
                "bridge='backward' reads the encoder's backward final state, which a unidirectional "
                "encoder (bidirectional=False) has not: set bidirectional=True or bridge='both'"
            )


@register_model(
    "rnn-attention-seq2seq",
    config=RNNAttentionSeq2SeqConfig,
    presets={
        # the paper's sizes; its decoder starts from both encoder directions (bridge="both", the
        # default, as checkpoints of this preset were trained): model.bridge=backward gives A.2.2's
        "bahdanau": {},
        "luong": {
            "src_vocab_size": 50000,
            "tgt_vocab_size": 50000,
            "embed_dim": 1000,
            "hidden_size": 1000,
            "num_layers": 4,
            "bidirectional": False,
            "attention": "general",
            "dropout": 0.2,
        },
        # Small and tiny: the 15 symbols of the sequence tasks (torchvote.data.SEQ_SYMBOLS); a
        # training run takes the vocabulary sizes and max_len from its data set anyway.
        "small": {
            "src_vocab_size": 15,
            "tgt_vocab_size": 15,
            "max_len": 64,
            "embed_dim": 64,
            "hidden_size": 128,
            "dropout": 0.1,
        },
        "tiny": {
            "src_vocab_size": 15,
            "tgt_vocab_size": 15,
            "max_len": 32,
            "embed_dim": 16,
            "hidden_size": 32,
        },
    },
    task="seq2seq",
    loss="cross-entropy",
)
class RNNAttentionSeq2Seq(nn.Module):
    """GRU encoder-decoder with Bahdanau (additive) or Luong (dot, general, concat) attention.

    Args:
        config: a :class:`RNNAttentionSeq2SeqConfig`.
        device: where to create the parameters.
        dtype: the parameters' dtype.

    Raises:
        TypeError: a ``dtype`` that is not a floating-point ``torch.dtype``.
    """

    def __init__(
        self,
        config: RNNAttentionSeq2SeqConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        factory = {"device": device, "dtype": check_float_dtype(dtype)}
        directions = 2 if config.bidirectional else 1
        memory_dim = directions * config.hidden_size
        between_layers = config.dropout if config.num_layers > 1 else 0.0
        self.source_embedding = nn.Embedding(config.src_vocab_size, config.embed_dim, **factory)
        self.target_embedding = nn.Embedding(config.tgt_vocab_size, config.embed_dim, **factory)
        self.dropout = nn.Dropout(config.dropout)
        self.encoder = nn.GRU(
            config.embed_dim,
            config.hidden_size,
            config.num_layers,
            batch_first=True,
            bidirectional=config.bidirectional,
            dropout=between_layers,
            **factory,
        )
        # s_0 = tanh(W_s h): h = h<-_1 (bridge="backward", app. A.2.2) or every direction's final state
        bridge_dim = config.hidden_size if config.bridge == "backward" else memory_dim
        self.bridge = nn.Linear(bridge_dim, config.hidden_size, **factory)
        self.output = nn.Linear(config.hidden_size, config.tgt_vocab_size, **factory)
        self.attention: nn.Module
        if config.attention == "additive":
            self.attention = AdditiveAttention(
                config.hidden_size, memory_dim, config.attention_dim or config.hidden_size, **factory
            )
            self.decoder = nn.GRU(
                config.embed_dim + memory_dim,
                config.hidden_size,
                config.num_layers,
                batch_first=True,
                dropout=between_layers,
                **factory,
            )
            # Deep output (Bahdanau et al. 2015, app. A.2.2): [s_i; c_i; E y_{i-1}] -> hidden.
            self.readout = nn.Linear(
                config.hidden_size + memory_dim + config.embed_dim, config.hidden_size, **factory
            )
            self._step = self._bahdanau_step
        else:
            hidden_dim = config.attention_dim if config.attention == "concat" else None
            self.attention = LuongAttention(
                config.hidden_size, memory_dim, score=config.attention, hidden_dim=hidden_dim, **factory
            )
            # Input feeding (Luong et al. 2015, sec. 3.3): the previous h~ joins the input.
            self.decoder = nn.GRU(
                config.embed_dim + config.hidden_size,
                config.hidden_size,
                config.num_layers,
                batch_first=True,
                dropout=between_layers,
                **factory,
            )
            self.combine = nn.Linear(memory_dim + config.hidden_size, config.hidden_size, **factory)  # W_c
            self._step = self._luong_step

    # --- encoder ---------------------------------------------------------------------------------

    @property
    def max_source_length(self) -> None:
        """``None``: the GRUs read sources of any length."""
        return None

    def encode(
        self, source: Tensor, *, source_lengths: Tensor | Sequence[int] | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Run the encoder over the (packed) source.

        Args:
            source: ``(b, s)`` integer ids, padding (``pad_id``) only after the tokens.
            source_lengths: ``(b,)`` the number of tokens (not ``pad_id``) of each source row,
                an integer tensor on the CPU or a sequence of ints; ``None`` counts them from
                ``source``, which on an accelerator reads them back (a synchronisation: see the
                module docstring), and on ``"meta"``, which has no values, reads every row whole
                (the shapes are the same). Given, they must be those counts (checked without
                reading the device: on a GPU an assertion fails the stream at the next
                synchronisation).

        Returns:
            ``(memory, source_mask, hidden)``: the encoder states ``(b, s, directions * H)`` (zero
            at padding), boolean ``(b, s)`` True for real tokens, and the decoder's initial state
            ``s_0`` ``(num_layers, b, H)`` (from the final states the config's ``bridge`` names).

        Raises:
            ValueError: a ``source`` of the wrong rank or dtype, or with padding before a token;
                ``source_lengths`` not ``(b,)``, not on the CPU, or (on the CPU) not the counts
                of the source's tokens.
            TypeError: ``source_lengths`` that are not integers.
            NotImplementedError: under ``torch.export`` (the packing, below).

        Under ``torch.compile`` ``pack_padded_sequence`` is a graph break that must stay (dynamo
        skips it: the packing reads the lengths on the host and sizes its batches by them); see
        :meth:`forward` for the breaks of the whole model. For the same reason ``torch.export``,
        which needs one graph whose shapes do not hang on the values, cannot trace this model.
        """
        if is_exporting():  # (on torch 2.5, which cannot tell, export fails inside the packing)
            raise NotImplementedError(
                "rnn-attention-seq2seq cannot be exported with torch.export: its encoder packs the "
                "source (pack_padded_sequence), whose sizes depend on the token values; run it "
                "eagerly or with torch.compile, or export transformer-seq2seq"
            )
        device = self.source_embedding.weight.device
        check_token_ids(source, "source", vocab_size=self.config.src_vocab_size, device=device)
        source_mask = source != self.config.pad_id  # (b, s)
        check_tensor_values(
            ~(source_mask[:, 1:] & ~source_mask[:, :-1]).any(),
            "source has padding (pad_id) before a real token; pad only at the end",
        )
        embedded = self.dropout(self.source_embedding(source))  # (b, s, E)
        if under_autograd_transforms(embedded):  # no packing: it reads the lengths on the host
            # the steps packing runs: each row's tokens, at least one (an all-padding row reads one);
            # source_lengths, which must equal these counts, cannot be checked here and are not read
            lengths = source_mask.sum(dim=1).clamp_min(1)  # (b,), nothing read back
            steps = torch.arange(source.shape[1], device=source.device) < lengths[:, None]  # (b, s)
            memory, final = _plain_gru(self.encoder, embedded, steps=steps)
            hidden = torch.tanh(self.bridge(self._bridged_states(final)))  # (layers, b, H): s_0
            return memory, source_mask, hidden
        lengths = self._packing_lengths(source_mask, source_lengths)  # (b,) on the CPU
        # What pack_padded_sequence(enforce_sorted=False) does, with the permutations made on the
        # host and sent without waiting (torch's sends them with a blocking copy and reads the
        # inverse back in pad_packed_sequence): the same operations, so the same numbers
        lengths, order = torch.sort(lengths, descending=True)  # (b,) each, longest first
        inverse = invert_permutation(order)  # (b,): sorted -> source order
        order, inverse = (t.to(device, non_blocking=True) for t in (order, inverse))
        embedded = embedded.index_select(0, order)  # (b, s, E), sorted by length
        packed = pack_padded_sequence(embedded, lengths, batch_first=True, enforce_sorted=True)
        states, final = self.encoder(packed)  # final: (layers * directions, b, H), sorted
        memory, _ = pad_packed_sequence(
            states, batch_first=True, total_length=source.shape[1]
        )  # (b, s, directions * H), sorted
        memory, final = memory.index_select(0, inverse), final.index_select(1, inverse)  # source order
        hidden = torch.tanh(self.bridge(self._bridged_states(final)))  # (layers, b, H): s_0
        return memory, source_mask, hidden

    def _bridged_states(self, final: Tensor) -> Tensor:
        """What the bridge reads of the encoder's final states ``final`` ``(layers * directions,
        b, H)`` (torch's order: layer by layer, forward then backward): ``(layers, b, H)`` the
        backward direction's, ``h<-_1`` (``bridge="backward"``, Bahdanau et al. 2015, app.
        A.2.2), or ``(layers, b, directions * H)`` every direction's, ``[h->_Tx; h<-_1]``."""
        directions = 2 if self.config.bidirectional else 1
        final = rearrange(final, "(l d) b h -> l b d h", d=directions)  # (layers, b, directions, H)
        if self.config.bridge == "backward":
            return final[:, :, 1]  # (layers, b, H): h<-_1
        return rearrange(final, "l b d h -> l b (d h)")  # (layers, b, directions * H)

    def _packing_lengths(self, source_mask: Tensor, source_lengths: Tensor | Sequence[int] | None) -> Tensor:
        """The ``(b,)`` int64 lengths the packing reads, on the CPU: ``source_lengths`` after
        checking them against ``source_mask`` ``(b, s)``, or the mask's counts (read back from an
        accelerator: a synchronisation). An all-padding row reads one (padding) token. On the
        ``"meta"`` device there are no tokens to count (nor to read back): every row is read
        whole, ``s``, which gives the encoder's outputs the shapes they have on any device."""
        if source_lengths is None:
            if source_mask.device.type == "meta":  # nothing to count: every row whole
                batch, length = source_mask.shape
                return torch.full((batch,), max(length, 1), dtype=torch.int64)  # (b,) on the CPU
            return source_mask.sum(dim=1).clamp_min(1).cpu()  # (b,)
        if not isinstance(source_lengths, Tensor):
            source_lengths = torch.as_tensor(source_lengths)
        expected = "a (batch,) integer tensor on the CPU (or a sequence of ints): each source's token count"
        check_integer_tensor(source_lengths, "source_lengths", expected)
        if source_lengths.device.type != "cpu":
            raise ValueError(
                f"source_lengths must be on the CPU, where the packing reads them, got "
                f"{source_lengths.device}: reading them from there would wait for the device (omit "
                f"them to count the source's tokens instead)"
            )
        batch = source_mask.shape[0]
        if source_lengths.shape != (batch,):
            raise ValueError(
                f"source_lengths must have shape ({batch},), one count per source row, got "
                f"{tuple(source_lengths.shape)}"
            )
        counts = source_mask.sum(dim=1)  # (b,), on the source's device
        check_tensor_values(
            (counts == source_lengths.to(counts.device, non_blocking=True)).all(),
            f"source_lengths must count the tokens of each source row (those not pad_id="
            f"{self.config.pad_id})",
            detail=lambda: f": got {source_lengths.tolist()}, the source has {counts.tolist()}",
        )
        return source_lengths.to(torch.int64).clamp_min(1)  # (b,)

    # --- one decoder step, chosen once in __init__ ------------------------------------------------

    def _bahdanau_step(
        self, embedded: Tensor, hidden: Tensor, feed: Tensor | None, memory: Tensor, source_mask: Tensor
    ) -> _Step:
        """Attend with ``s_{i-1}``, then ``s_i = GRU([E y_{i-1}; c_i], s_{i-1})``, then read out."""
        query = rearrange(hidden[-1], "b h -> b 1 h")  # s_{i-1} of the top layer: (b, 1, H)
        context, weights = self.attention(query, memory, key_mask=source_mask)  # (b, 1, M), (b, 1, s)
        inputs = torch.cat([embedded, context], dim=-1)  # (b, 1, E + M)
        if under_autograd_transforms(inputs, hidden):  # nn.GRU fails in vmap's batching fallback
            state, hidden = _plain_gru(self.decoder, inputs, hidden)
        else:  # (the call stays in this function: tests/test_graph_breaks.py pins its graph break)
            state, hidden = self.decoder(inputs, hidden)  # state (b, 1, H), hidden (layers, b, H)
        readout = torch.tanh(self.readout(torch.cat([state, context, embedded], dim=-1)))
        return self.output(self.dropout(readout)), hidden, None, weights

    def _luong_step(
        self, embedded: Tensor, hidden: Tensor, feed: Tensor | None, memory: Tensor, source_mask: Tensor
    ) -> _Step:
        """``h_t = GRU([E y_{t-1}; h~_{t-1}])``, attend with ``h_t``, ``h~_t = tanh(W_c [c_t; h_t])``."""
        if feed is None:  # h~_0 = 0
            feed = embedded.new_zeros(embedded.shape[0], 1, self.config.hidden_size)  # (b, 1, H)
        inputs = torch.cat([embedded, feed], dim=-1)  # (b, 1, E + H)
        if under_autograd_transforms(inputs, hidden):  # nn.GRU fails in vmap's batching fallback
            state, hidden = _plain_gru(self.decoder, inputs, hidden)
        else:
            state, hidden = self.decoder(inputs, hidden)  # state (b, 1, H), hidden (layers, b, H)
        context, weights = self.attention(state, memory, key_mask=source_mask)  # (b, 1, M), (b, 1, s)
        attentional = torch.tanh(self.combine(torch.cat([context, state], dim=-1)))  # (b, 1, H)
        return self.output(self.dropout(attentional)), hidden, attentional, weights

    # --- teacher forcing and greedy decoding -------------------------------------------------------

    def forward(
        self,
        source: Tensor,
        target_input: Tensor,
        *,
        need_weights: bool = False,
        source_lengths: Tensor | Sequence[int] | None = None,
    ) -> SequenceOutput:
        """Teacher-forced logits: step ``t`` reads the true token ``target_input[:, t]``.

        Args:
            source: ``(b, s)`` integer ids, padded with ``pad_id`` after the tokens.
            target_input: ``(b, t)`` integer ids (``target[:, :-1]``: ``<bos> y_1 ... y_{t-1}``).
            need_weights: return the attention weights.
            source_lengths: ``(b,)`` each source's token count on the CPU (see :meth:`encode`):
                given, a forward pass on a GPU reads nothing back; ``None`` counts them, one
                synchronisation per call. The same results either way.

        Returns:
            A :class:`~torchvote.models.SequenceOutput` with ``logits`` ``(b, t, tgt_vocab_size)``;
            with ``need_weights``, ``attention`` is ``[weights]`` with the ``(b, t, s)`` weights
            of every step over the source, also in ``intermediates["attention"]``.

        Raises:
            ValueError: inputs of the wrong rank or dtype, batch sizes that differ, ids outside
                the vocabularies, padding before a source token, or bad ``source_lengths`` (as
                :meth:`encode` lists).
            TypeError: a ``need_weights`` that is not a bool, ``source_lengths`` that are not
                integers.

        Under ``torch.compile`` (``compile=true``) this model is not one graph, by design of
        its recurrent layers: the packing of the source (:meth:`encode`) is a graph break, and
        dynamo does not trace ``nn.GRU`` unless ``torch._dynamo.config.allow_rnn`` is set (off by
        default, experimental: a process-wide switch the library leaves to the user). That
        break falls inside the decoder's loop over the target, so the loop runs eagerly: three
        breaks, whatever the target length (``tests/test_graph_breaks.py`` holds them to that).
        """
        check_flag(need_weights, "need_weights")
        device = self.source_embedding.weight.device
        check_token_ids(source, "source", device=device)  # its ids' range: in encode, below
        check_token_ids(target_input, "target_input", vocab_size=self.config.tgt_vocab_size, device=device)
        if source.shape[0] != target_input.shape[0]:
            raise ValueError(
                f"source and target_input must have the same batch size, got {source.shape[0]} "
                f"and {target_input.shape[0]}"
            )
        memory, source_mask, hidden = self.encode(source, source_lengths=source_lengths)
        embedded = self.dropout(self.target_embedding(target_input))  # (b, t, E)
        feed: Tensor | None = None
        logits, weights = [], []
        for t in range(target_input.shape[1]):
            step_logits, hidden, feed, step_weights = self._step(
                embedded[:, t : t + 1], hidden, feed, memory, source_mask
            )  # step_logits (b, 1, vocab), hidden (layers, b, H), step_weights (b, 1, s)
            logits.append(step_logits)
            weights.append(step_weights)
        all_logits = torch.cat(logits, dim=1)  # (b, t, vocab)
        if not need_weights:
            return SequenceOutput(logits=all_logits)
        all_weights = torch.cat(weights, dim=1)  # (b, t, s)
        return SequenceOutput(
            logits=all_logits, attention=[all_weights], intermediates={"attention": all_weights}
        )

    @torch.no_grad()
    def generate(
        self,
        source: Tensor,
        *,
        max_new_tokens: int | None = None,
        use_cache: bool = True,
        source_lengths: Tensor | Sequence[int] | None = None,
    ) -> Tensor:
        """Greedy decoding: from ``<bos>``, feed back the most likely token (never ``<pad>`` or
        ``<bos>``) until ``<eos>``.

        Runs in evaluation mode (no dropout) and returns the model to its previous mode. Takes
        the arguments of
        :meth:`~torchvote.models.transformer_seq2seq.TransformerSeq2Seq.generate`, checked the
        same way, so one call decodes with either model.

        Args:
            source: ``(b, s)`` integer ids, padded with ``pad_id`` after the tokens.
            max_new_tokens: most tokens to generate after ``<bos>``, in ``[0, max_len - 1]``
                (the targets are at most ``max_len`` tokens, ``<bos>`` included); default
                ``max_len - 1``.
            use_cache: a bool, for the Transformer's call; it changes nothing here. The GRU's
                state already carries the past: every step reads the last token and that state,
                so there is no prefix to recompute and nothing more to keep. The tokens are the
                same either way.
            source_lengths: ``(b,)`` each source's token count on the CPU (see :meth:`encode`),
                which spares the encoder's synchronisation; decoding still reads whether every
                sequence has ended (every 8 tokens on an accelerator: see
                :func:`~torchvote.models.transformer_backbone.greedy_decode`).

        Returns:
            ``(b, 1 + n)`` ids laid out as the targets, ``<bos> y_1 ... <eos>`` then ``pad_id``
            after each sequence's end; ``n <= max_new_tokens`` (decoding stops once every
            sequence has produced ``<eos>``).

        Raises:
            ValueError: a bad ``source`` or ``source_lengths`` (as :meth:`encode` lists), or a
                ``max_new_tokens`` that is not an integer (a bool or a float) in
                ``[0, max_len - 1]``.
            TypeError: a ``use_cache`` that is not a bool, ``source_lengths`` that are not
                integers.
        """
        config = self.config
        limit = check_max_new_tokens(max_new_tokens, config.max_len)
        check_flag(use_cache, "use_cache")
        with evaluating(self):
            memory, source_mask, hidden = self.encode(source, source_lengths=source_lengths)
            feed: Tensor | None = None

            def next_logits(tokens: Tensor) -> Tensor:
                nonlocal hidden, feed
                embedded = self.target_embedding(tokens[:, -1:])  # (b, 1, E)
                logits, hidden, feed, _ = self._step(embedded, hidden, feed, memory, source_mask)
                return logits[:, -1]  # (b, vocab)

            return greedy_decode(
                next_logits,
                source.shape[0],
                limit,
                bos_id=config.bos_id,
                eos_id=config.eos_id,
                pad_id=config.pad_id,
                device=source.device,
            )
