"""Explain sentences with the pretrained encoder: one HTML page of attention and routing pictures.

The model runs once per variant and records everything (:class:`~torchvote.pretrained.EncoderOutput`);
the pictures and tables are drawn from those records. The routing section re-runs the encoder
with one layer's attention voting for several passes (same weights, no retraining) and reports
how far the sentence embeddings move (cosine similarity to the softmax embeddings).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from torchvote.explain.attention_plots import attention_grid, attention_heatmap, token_attention_lines
from torchvote.explain.figures import literal_text, new_figure
from torchvote.explain.report import HtmlReport
from torchvote.explain.statistics import attention_rollout, top_attended
from torchvote.pretrained.tokenizer import check_sentences
from torchvote.validation import is_integer

__all__ = ["EXAMPLES", "Example", "explain_sentences"]

SHOWN_TOKENS = 40  # pictures show at most this many tokens; tables and rollout use all


@dataclass(frozen=True)
class Example:
    """A sentence, the token to follow, and where it comes from."""

    sentence: str
    focus: str
    source: str


EXAMPLES: tuple[Example, ...] = (
    Example(
        "the train left the station on time",
        "train",
        "the article 'Self-Attention', its 7x7 attention score matrix example",
    ),
    Example(
        "Alice wrote a note and gave it to Bob",
        "it",
        "the article 'Self-Attention Explained', where context should resolve 'it' to the note",
    ),
    Example(
        "She cashed a check at the bank",
        "check",
        "the article 'Self-Attention', which says 'check' attends to 'cashed' and 'bank' (the tables "
        "below show whether this encoder's heads do; the sentence of the article's figure is not in "
        "its text, so this one is composed from those three words)",
    ),
)


def _focus_index(tokens: list[str], focus: str | None) -> int:
    """The focus token's index, else the longest real word piece (ties: the first)."""
    words = [k for k, token in enumerate(tokens) if token not in ("[CLS]", "[SEP]") and token.isalnum()]
    if focus is not None and focus.lower() in tokens:
        return tokens.index(focus.lower())
    if not words:
        return min(1, len(tokens) - 1)
    return max(words, key=lambda k: (len(tokens[k]), -k))


def check_iterations(iterations: Sequence[int], argument: str = "iterations") -> list[int]:
    """The passes of voting to run, sorted without repeats (the cosine curve is drawn through
    them in this order).

    Args:
        iterations: a non-empty sequence of ints >= 1.
        argument: the name in the message (``--iterations`` on the command line).

    Returns:
        The sorted distinct values.

    Raises:
        ValueError: an empty sequence or a value that is not an int >= 1.
    """
    values = None
    if isinstance(iterations, Sequence) and not isinstance(iterations, str):
        values = list(iterations)
    if not values or any(not is_integer(r) or r < 1 for r in values):
        raise ValueError(f"{argument} must be integers >= 1, got {iterations!r}")
    return sorted({int(r) for r in values})


def check_layer(layer: int, count: int, argument: str = "layer") -> int:
    """``layer`` of an encoder of ``count`` layers as an index in ``[0, count)``.

    Args:
        layer: an int in ``[-count, count)`` (negative counts from the end).
        count: the encoder's number of layers.
        argument: the name in the message (``--layer`` on the command line).

    Returns:
        ``layer % count``.

    Raises:
        ValueError: anything else, with the allowed range.
    """
    if not is_integer(layer) or not -count <= layer < count:
        raise ValueError(
            f"{argument} must be in [-{count}, {count}) (the encoder has {count} layers), got {layer!r}"
        )
    return int(layer) % count


def explain_sentences(
    sentences: Sequence[str] | None,
    out_dir: str | Path,
    *,
    model=None,
    layer: int = 2,
    iterations: Sequence[int] = (2, 3, 5),
    report: HtmlReport | None = None,
) -> Path:
    """Write the attention report for ``sentences`` (default: the reference articles' examples).

    Per sentence: the chosen layer's head-averaged attention heatmap, the grid of every layer x
    head, the focus token's attention as weighted lines (with the top-3 keys of every head),
    attention rollout (Abnar & Zuidema 2020), and the chosen layer run as r passes of voting.
    Then the cosine similarity between softmax and r-pass sentence embeddings, for routing over
    the senders and over the receivers.

    Args:
        sentences: sentences to explain, or None for :data:`EXAMPLES`.
        out_dir: folder for ``index.html`` and the PNG/SVG files.
        model: a :class:`~torchvote.pretrained.BertEncoder`; default
            ``load_pretrained("all-MiniLM-L6-v2")``.
        layer: the layer shown in the heatmaps and made to route (negative counts from the end).
        iterations: passes of voting for the routing variant, each at least 1 (run and drawn in
            increasing order, repeats once).
        report: add to this report instead of a new one (the caller writes it then).

    Returns:
        The written ``index.html`` (or ``report.out_dir / "index.html"`` to be written).

    Raises:
        ValueError: an empty sentence, an empty list, a bad ``layer`` or ``iterations``.
        ModuleNotFoundError: a missing optional package (the message names the extra).
    """
    if sentences is None:
        examples = list(EXAMPLES)
    else:
        examples = [Example(s, "", "given on the command line") for s in check_sentences(sentences)]
    iterations = check_iterations(iterations)
    if model is None:
        from torchvote.pretrained import load_pretrained

        model = load_pretrained("all-MiniLM-L6-v2")
    count = len(model.layers)
    layer = check_layer(layer, count)
    own_report = report is None
    report = report or HtmlReport("torchvote explain: attention as weighted voting", Path(out_dir))
    report.text(
        f"Encoder: all-MiniLM-L6-v2 ({count} layers x {model.config.num_attention_heads} heads, "
        f"{model.config.hidden_size} wide) rebuilt on torchvote.nn.MultiHeadAttention. Every picture is "
        "drawn from tensors recorded in one forward pass; tables give the numbers behind them."
    )
    texts = [example.sentence for example in examples]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record = model.explain(texts)  # one pass: states and (b, h, L, L) attention of every layer
    for warning in caught:
        warnings.warn(warning.message, warning.category, stacklevel=2)
    try:
        for number, example in enumerate(examples):
            _sentence_section(report, record, number, example, layer)
        _routing_section(report, model, record, examples, layer, iterations)
    except BaseException:
        if own_report:  # the folder keeps its last report; a caller's report is the caller's
            report.discard()
        raise
    return report.write() if own_report else report.out_dir / "index.html"


def _shortened(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, the cut marked with an ellipsis (a heading, legend or
    table cell that ends mid-word read as the whole sentence)."""
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "\u2026"


def _sentence_section(report: HtmlReport, record, number: int, example: Example, layer: int) -> None:
    tokens = record.tokens[number]
    length = len(tokens)
    weights = torch.stack([a[number, :, :length, :length] for a in record.attentions])  # (layers, h, i, j)
    focus = _focus_index(tokens, example.focus or None)
    report.heading(f"Sentence {number + 1}: {_shortened(example.sentence, 80)}")
    report.text(f"Source: {example.source}. {length} word pieces; followed token: {tokens[focus]!r}.")
    if record.truncated[number]:
        report.text(
            f"Notice: this sentence is longer than the model's limit and was truncated to its first "
            f"{length} tokens (the rest was not seen by the model).",
            notice=True,
        )
    shown = min(length, SHOWN_TOKENS)
    if shown < length:
        report.text(
            f"Pictures show the first {shown} of {length} tokens; tables use all of them.", notice=True
        )
    labels = tokens[:shown]
    crop = _crop_note(shown, length)
    averaged = weights[layer].mean(dim=0)  # (i, j)
    stem = f"s{number + 1}"
    rows = [
        [tokens[i], *(f"{t} {w:.3f}" for t, w in top_attended(averaged, tokens, i, k=3)[0])]
        for i in range(length)
    ]
    report.figure(
        attention_heatmap(averaged[:shown, :shown], labels, title=f"layer {layer}, mean of heads{crop}"),
        f"{stem}-heatmap-layer{layer}",
        caption=f"Layer {layer} attention averaged over heads; row i = how query i weighs every key j "
        "(colour 0 to 1, as every attention map of this page).",
        table=(["query", "top 1", "top 2", "top 3"], rows),
    )
    grid_rows = [
        [f"layer {n}", *(f"{t} {w:.3f}" for t, w in top_attended(weights[n].mean(0), tokens, focus, k=3)[0])]
        for n in range(weights.shape[0])
    ]
    report.figure(
        attention_grid(weights[:, :, :shown, :shown], labels, title=f"every layer x head{crop}"),
        f"{stem}-grid",
        caption="All layers (rows) x heads (columns); in each map, rows are queries and columns keys; "
        "colour 0 (white) to 1 (dark blue).",
        table=(["layer", f"{tokens[focus]!r} top 1 (mean of heads)", "top 2", "top 3"], grid_rows),
    )
    head_rows = [
        [f"head {h}", *(f"{t} {w:.3f}" for t, w in pairs)]
        for h, pairs in enumerate(top_attended(weights[layer], tokens, focus, k=3))
    ]
    if focus < shown:
        report.figure(
            token_attention_lines(
                averaged[:shown, :shown],
                labels,
                focus,
                title=f"{tokens[focus]!r} in layer {layer} (mean of heads){crop}",
            ),
            f"{stem}-lines-layer{layer}",
            caption=f"Where {tokens[focus]!r} looks in layer {layer}: line width and opacity follow the "
            "weight (the row sums to 1 over the keys).",
            table=(["head", "top 1", "top 2", "top 3"], head_rows),
        )
    else:
        report.text(
            f"The followed token {tokens[focus]!r} is token {focus + 1}, past the {shown} the pictures "
            f"show: its attention lines are not drawn. Its top keys per head in layer {layer}:",
            notice=True,
        )
        report.table(["head", "top 1", "top 2", "top 3"], head_rows)
    rollout = attention_rollout(weights)  # (i, j)
    report.figure(
        attention_rollout_figure(rollout[:shown, :shown], labels, crop=crop),
        f"{stem}-rollout",
        caption="Attention rollout (Abnar & Zuidema 2020): 0.5 W + 0.5 I per layer, rows renormalised, "
        "multiplied through all layers.",
        table=(
            ["key", f"rollout from {tokens[focus]!r}"],
            [[t, float(rollout[focus, j])] for j, t in enumerate(tokens)],
        ),
    )


def attention_rollout_figure(rollout, tokens, *, crop: str = ""):
    """Heatmap of a rollout matrix (rows: last-layer tokens, columns: input tokens).

    Args:
        rollout: ``(i, j)`` rollout weights, each row summing to 1 over the input tokens.
        tokens: the ``i`` (= ``j``) token labels.
        crop: appended to the title (e.g. ``" (tokens 1-40 of 200)"``).

    Returns:
        The Figure (:func:`~torchvote.explain.attention_plots.attention_heatmap`, colour 0 to 1).
    """
    return attention_heatmap(
        rollout,
        tokens,
        title=f"attention rollout through all layers{crop}",
        xlabel="input token j",
        ylabel="token i after the last layer",
    )


def _crop_note(shown: int, length: int) -> str:
    """A title's note on a cropped picture, ``" (tokens 1-40 of 200)"``; ``""`` when all are shown."""
    return f" (tokens 1-{shown} of {length})" if shown < length else ""


def _routing_section(report: HtmlReport, model, record, examples, layer: int, iterations) -> None:
    report.heading(f"Layer {layer} as r passes of voting")
    report.text(
        f"Layer {layer}'s attention replaced by torchvote.nn.RoutingAttention with the same weights: "
        "pass 1 is the pretrained attention; each later pass adds the agreement v_j . out_i / sqrt(d) "
        "to the logits (dynamic routing's update, Sabour et al. 2017). 'senders' keeps the softmax "
        "over keys (attention); 'receivers' normalises over queries (capsule routing). Nothing is retrained."
    )
    texts = [example.sentence for example in examples]
    with torch.no_grad():
        base = torch.nn.functional.normalize(
            _pool(record), dim=1
        )  # (N, E) softmax embeddings, from the recorded states
    # one pass over the senders is the pretrained softmax (cosine 1 by definition, not run); one
    # pass over the receivers is not: it is run too, so both lines start at r = 1
    computed_passes = {"senders": list(iterations), "receivers": sorted({1, *iterations})}
    similarities: dict[str, list[list[float]]] = {}  # normalize_over -> per pass: (N,) cosines
    routed_records = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # truncation was already reported
        for normalize_over, passes in computed_passes.items():
            per_r = []
            for r in passes:
                routed = model.with_routing([layer], iterations=r, normalize_over=normalize_over)
                routed_record = routed.explain(texts)
                routed_records[(normalize_over, r)] = routed_record
                embeddings = torch.nn.functional.normalize(_pool(routed_record), dim=1)  # (N, E)
                per_r.append((embeddings * base).sum(dim=1).tolist())  # (N,) cosine similarity
            similarities[normalize_over] = per_r
    figure, axes = new_figure(size=(9.6, 3.6))
    ax = axes[0, 0]
    for normalize_over, style in (("senders", "-o"), ("receivers", "--s")):
        for n, example in enumerate(examples):
            passes = computed_passes[normalize_over]
            values = [per_example[n] for per_example in similarities[normalize_over]]
            definitional = 1 not in passes  # the senders' one pass: the softmax embedding itself
            if definitional:  # the line starts there, its marker is drawn once for all (below)
                passes, values = [1, *passes], [1.0, *values]
            label = literal_text(f"{normalize_over}: {_shortened(example.sentence, 28)}")
            ax.plot(passes, values, style, label=label, alpha=0.8,
                    markevery=list(range(int(definitional), len(passes))))
    if 1 not in computed_passes["senders"]:
        ax.plot([1], [1.0], "o", markerfacecolor="none", markeredgecolor="black", markersize=8,
                label="senders, 1 pass = the softmax itself (every sentence)", zorder=3)
    ax.axhline(1.0, color="0.6", linewidth=0.8, linestyle=":")  # the softmax embedding itself
    ax.set_xlabel(f"passes of voting in layer {layer}")
    ax.set_ylabel("cosine to softmax embedding")
    ax.set_xticks(sorted({1, *iterations}))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)  # off the lines
    rows = [
        [_shortened(example.sentence, 60), normalize_over, r, similarities[normalize_over][k][n]]
        for n, example in enumerate(examples)
        for normalize_over, passes in computed_passes.items()
        for k, r in enumerate(passes)
    ]
    report.figure(
        figure,
        "routing-cosine",
        caption="How far the sentence embedding moves when one layer votes for r passes (cosine 1, the "
        "dotted line: unchanged; 1 pass over the senders is the softmax attention itself).",
        table=(["sentence", "normalize over", "passes", "cosine similarity"], rows),
    )
    r = max(iterations)
    for n in range(min(len(examples), 4)):
        tokens = record.tokens[n][:SHOWN_TOKENS]
        length = len(tokens)
        crop = _crop_note(length, len(record.tokens[n]))
        routed = routed_records[("senders", r)].attentions[layer][n, :, :length, :length].mean(0)  # (i, j)
        before = record.attentions[layer][n, :, :length, :length].mean(0)  # (i, j)
        change = (routed - before).abs().max(dim=-1)  # (i,): how far, and which key moved most
        moved = [(i, int(j)) for i, j in enumerate(change.indices) if float(change.values[i]) > 0]
        report.figure(
            attention_heatmap(routed, tokens, title=_routed_title(layer, r, crop)),
            f"s{n + 1}-routing-layer{layer}-r{r}",
            caption=f"Sentence {n + 1}: layer {layer}'s last-pass weights after {_passes(r)}, mean of heads, "
            "on the colour scale of its heatmap above (0 to 1).",
            table=(
                ["query", "largest change", "weight before", "weight after"],
                [[tokens[i], tokens[j], float(before[i, j]), float(routed[i, j])] for i, j in moved]
                or [["(none)", "no weight changed", "", ""]],
            ),
        )


def _passes(count: int) -> str:
    """``"1 pass"``, ``"3 passes"``."""
    return f"{count} pass" if count == 1 else f"{count} passes"


def _routed_title(layer: int, passes: int, crop: str) -> str:
    """The title of a routed layer's heatmap; one pass over the senders is the softmax map."""
    if passes == 1:
        return f"layer {layer} after 1 pass (senders): the softmax attention itself{crop}"
    return f"layer {layer} after {passes} passes (senders){crop}"


def _pool(record) -> torch.Tensor:
    """Mask-aware mean of the last hidden state, ``(N, E)`` (sentence-transformers' pooling)."""
    mask = record.key_mask.unsqueeze(-1).to(record.last_hidden_state.dtype)  # (N, L, 1)
    return (record.last_hidden_state * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
