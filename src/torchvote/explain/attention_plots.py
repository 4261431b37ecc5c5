"""Attention pictures drawn from recorded weights (never by re-running a model).

Each function returns a matplotlib Figure; save it with
:func:`torchvote.explain.figures.save_figure` (PNG and SVG). Index legend: ``h`` heads, ``i``
receivers (queries, rows), ``j`` senders (keys, columns); attention rows sum to one.

Tokens and titles are drawn as given (``$`` is not mathtext); a weight that is NaN or infinite
(a masked position) is drawn grey and written as it is, never as 0; a long sentence keeps the
figure at most :data:`~torchvote.explain.figures.MAX_INCHES` a side and labels every k-th token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch import Tensor

from torchvote.explain.figures import (
    colormap,
    finite_range,
    literal_labels,
    literal_text,
    new_figure,
    tick_positions,
)
from torchvote.explain.statistics import checked_index, checked_tensor
from torchvote.validation import check_flag, check_in_range

if TYPE_CHECKING:  # matplotlib is optional: imported when a picture is drawn
    from matplotlib.figure import Figure

__all__ = ["attention_grid", "attention_heatmap", "head_average", "token_attention_lines"]

CMAP = "Blues"
LABEL_LIMIT = 60  # most token labels along one heatmap axis; beyond, every k-th is labelled
CELL_INCHES = 0.42  # a heatmap cell's side, until the matrix reaches HEATMAP_INCHES
HEATMAP_INCHES = 14.0  # longest side of a heatmap's matrix: a page shows it without shrinking labels away
GRID_LABEL_LIMIT = 14  # most tokens the grid's bottom-left map labels; beyond, none


def _check_tokens(tokens: Sequence[str] | None, count: int, name: str) -> list[str] | None:
    """:func:`literal_labels` of token labels, one per row/column of a weights matrix."""
    return literal_labels(tokens, count, name, each=f" (one per row/column): expected {count} labels")


def _key_tokens(tokens, key_tokens, count: int) -> list[str] | None:
    """The column labels: ``key_tokens``, else ``tokens`` (self-attention), checked against ``count``."""
    if key_tokens is not None:
        return _check_tokens(key_tokens, count, "key_tokens")
    return _check_tokens(tokens, count, "tokens (also the key labels when key_tokens is None)")


def _label_axis(ax, axis: str, labels: list[str], limit: int, **style) -> int:
    """Put ``labels`` on ``axis`` ("x" or "y") of ``ax``, every k-th when more than ``limit``;
    return k."""
    positions = tick_positions(len(labels), limit)
    setter = ax.set_xticks if axis == "x" else ax.set_yticks
    setter(positions, [labels[p] for p in positions], **style)
    return positions[1] - positions[0] if len(positions) > 1 else 1


def attention_heatmap(
    weights: Tensor,
    tokens: Sequence[str] | None = None,
    key_tokens: Sequence[str] | None = None,
    *,
    title: str = "",
    annotate: bool | None = None,
    xlabel: str = "key (sender j)",
    ylabel: str = "query (receiver i)",
    vmax: float | None = 1.0,
) -> Figure:
    """One attention matrix as a heatmap, queries down, keys across, labelled with tokens.

    The colour scale runs from 0 (or the smallest value, if negative) to ``vmax`` (or the
    largest finite weight, if larger): with the default 1, every map of attention weights reads
    on the same scale; the colour bar's label says which. NaN and infinite weights are grey (the
    label says so too). With more than :data:`LABEL_LIMIT` tokens an axis labels every k-th (its
    axis label says which).

    Args:
        weights: ``(i, j)`` weights (average heads before if needed), any real dtype or device.
        tokens: ``i`` query tokens (row labels); ``None``: no labels.
        key_tokens: ``j`` key tokens; default ``tokens`` (self-attention).
        title: axes title, drawn as given.
        annotate: write each weight in its cell; default when the matrix is at most 16 x 16.
        xlabel: what the columns are, drawn as given (e.g. a rollout's input tokens).
        ylabel: what the rows are, drawn as given.
        vmax: the top of the colour scale, a finite number > 0 (1: attention weights, comparable
            across maps); ``None``: this map's largest finite weight.

    Returns:
        The Figure.

    Raises:
        ValueError: token counts that do not match the shape, not 2-D, empty or on the meta device,
            or ``vmax`` not a finite number > 0.
        TypeError: not a real tensor, or tokens given as one string.
    """
    weights = checked_tensor(weights, "weights", dims=(2,), nonempty=True)
    if vmax is not None:
        vmax = check_in_range(vmax, "vmax", 0.0, include_low=False)
    if tokens is not None and not isinstance(tokens, str):  # a generator: read once, for both axes
        tokens = list(tokens)
    rows = _check_tokens(tokens, weights.shape[0], "tokens")
    cols = _key_tokens(tokens, key_tokens, weights.shape[1])
    annotate = max(weights.shape) <= 16 if annotate is None else check_flag(annotate, "annotate")
    vmin, largest, non_finite = finite_range(weights)
    scale = "0 to this map's max" if vmax is None or largest > vmax else f"0 to {vmax:g}"
    vmax = largest if vmax is None else max(vmax, largest)
    scale = f"{vmin:.2g} to {vmax:.2g}" if vmin < 0 else scale
    # each side by its own count of cells (a square by the larger one left a wide matrix between
    # bands of white), capped at HEATMAP_INCHES; the width also holds the colour bar and the row
    # labels, the height the title and the rotated key labels
    cell = min(CELL_INCHES, HEATMAP_INCHES / max(weights.shape))
    rows_inches, columns_inches = (cell * count for count in weights.shape)
    figure, axes = new_figure(size=(columns_inches + 3.0, rows_inches + 2.0))
    ax = axes[0, 0]
    image = ax.imshow(weights.numpy(), cmap=colormap(CMAP), vmin=vmin, vmax=vmax)
    xlabel, ylabel = literal_text(xlabel), literal_text(ylabel)
    if cols is not None:
        step = _label_axis(ax, "x", cols, LABEL_LIMIT, rotation=60, ha="right", rotation_mode="anchor")
        xlabel += f", 1 in {step} labelled" if step > 1 else ""
    if rows is not None:
        step = _label_axis(ax, "y", rows, LABEL_LIMIT)
        ylabel += f", 1 in {step} labelled" if step > 1 else ""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(literal_text(title))
    if annotate:
        threshold = vmin + 0.6 * (vmax - vmin)
        for i in range(weights.shape[0]):
            for j in range(weights.shape[1]):
                value = float(weights[i, j])
                ax.text(
                    j,
                    i,
                    f"{value:.2f}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if math.isfinite(value) and value > threshold else "black",
                )
    label = f"weight (scale {scale})" + ("; grey: NaN or inf (masked)" if non_finite else "")
    # a colour bar of about half an inch: its default share of the axes' width grew with the matrix
    inches = max(columns_inches, 0.1)
    figure.colorbar(image, ax=ax, shrink=0.8, label=label, fraction=min(0.15, 0.5 / inches),
                    pad=min(0.05, 0.2 / inches))
    return figure


def attention_grid(
    attentions: Tensor,
    tokens: Sequence[str] | None = None,
    *,
    key_tokens: Sequence[str] | None = None,
    title: str = "",
) -> Figure:
    """Every layer x head attention map of one input, as a grid of small heatmaps.

    One colour scale for every panel, 0 (white) to 1 (dark blue) (wider if a weight lies
    outside), shown by one colour bar; NaN and infinite weights are grey. In every map rows are
    queries ``i`` and columns keys ``j`` (the figure's axis labels say so).

    Args:
        attentions: ``(layers, h, i, j)`` weights of one input (unpadded), or ``(h, i, j)`` of
            one layer (one row of heads); any real dtype or device.
        tokens: ``i`` query tokens (labels on the bottom-left panel when there are at most
            :data:`GRID_LABEL_LIMIT`); ``None``: no labels.
        key_tokens: ``j`` key tokens; default ``tokens`` (self-attention).
        title: figure title, drawn as given.

    Returns:
        The Figure.

    Raises:
        ValueError: wrong rank, empty, or a token count that does not match the shape.
        TypeError: not a real tensor, or tokens given as one string.
    """
    attentions = checked_tensor(attentions, "attentions", dims=(3, 4), nonempty=True)
    if attentions.dim() == 3:
        attentions = attentions[None]  # (1, h, i, j): one layer
    layers, heads = attentions.shape[:2]
    rows = _check_tokens(tokens, attentions.shape[-2], "tokens")
    cols = _key_tokens(tokens, key_tokens, attentions.shape[-1])
    show_labels = rows is not None and cols is not None and max(len(rows), len(cols)) <= GRID_LABEL_LIMIT
    low, high, non_finite = finite_range(attentions)
    vmin, vmax = min(low, 0.0), max(high, 1.0)
    cmap = colormap(CMAP)
    # room for 7-point token labels on the bottom-left map (10 points a token)
    cell = max(1.25, 0.3 + 0.14 * max(len(rows), len(cols))) if show_labels else 0.9
    figure, axes = new_figure(layers, heads, size=(1.6 + cell * heads, 0.8 + cell * layers))
    for layer in range(layers):
        for head in range(heads):
            ax = axes[layer, head]
            image = ax.imshow(attentions[layer, head].numpy(), cmap=cmap, vmin=vmin, vmax=vmax)
            ax.set_xticks([])
            ax.set_yticks([])
            if layer == 0:
                ax.set_title(f"head {head}", fontsize=8)
            if head == 0:
                ax.set_ylabel(f"layer {layer}", fontsize=8)
            if show_labels and layer == layers - 1 and head == 0:
                ax.set_xticks(range(len(cols)), cols, rotation=90, fontsize=7)
                ax.set_yticks(range(len(rows)), rows, fontsize=7)
    label = f"weight (scale {vmin:g} to {vmax:g})" + ("; grey: NaN or inf" if non_finite else "")
    figure.colorbar(image, ax=axes.ravel().tolist(), shrink=0.6, label=label)
    figure.supxlabel("in each map: key j \u2192 (columns)", fontsize=9)
    figure.supylabel("in each map: query i \u2193 (rows)", fontsize=9)
    if title:
        figure.suptitle(literal_text(title))
    return figure


def token_attention_lines(
    weights: Tensor,
    tokens: Sequence[str],
    query: int,
    *,
    key_tokens: Sequence[str] | None = None,
    title: str = "",
) -> Figure:
    """One query token's attention drawn as lines to every key, thickness and opacity by weight.

    Two columns of tokens, queries left and keys right, in the style of the reference articles'
    "check" -> "cashed", "bank" figure. Width and opacity scale with the weight itself (a row
    sums to 1: a weight of 0.5 draws the same line in every row; negative weights draw as 0,
    weights above 1 as 1); a NaN or infinite weight (a masked key) gets no line and its value
    written in grey. The columns are headed "query" and "keys (weight)". With many tokens the
    figure stops growing at :data:`~torchvote.explain.figures.MAX_INCHES` and the font shrinks
    to fit.

    Args:
        weights: ``(i, j)`` (average heads first) or ``(h, i, j)`` (heads averaged here); any
            real dtype or device.
        tokens: ``i`` query tokens.
        query: index of the query token to draw (negative counts from the end).
        key_tokens: ``j`` key tokens; default ``tokens``.
        title: axes title, drawn as given; default ``attention from '<query token>'``.

    Returns:
        The Figure.

    Raises:
        ValueError: ``query`` out of range, token counts that do not match, wrong rank or empty.
        TypeError: ``tokens`` missing or one string, ``query`` not an integer, not a real tensor.
    """
    weights = checked_tensor(weights, "weights", dims=(2, 3), nonempty=True)
    if weights.dim() == 3:
        weights = weights.mean(dim=0)  # (i, j)
    if tokens is None:
        raise TypeError("tokens must be a sequence of the i query tokens, got None")
    left = _check_tokens(tokens, weights.shape[0], "tokens")
    right = _key_tokens(tokens, key_tokens, weights.shape[1])
    query = checked_index(query, len(left), "query")
    row = weights[query]  # (j,)
    lines = max(len(left), len(right))
    height = 1.1 + 0.36 * lines
    figure, axes = new_figure(size=(4.8, height))
    spacing = (figure.get_size_inches()[1] - 1.1) / lines  # inches per token row once capped
    fontsize = max(1.0, min(10.0, 0.75 * 72 * spacing))
    ax = axes[0, 0]
    top = lines - 1
    for i, token in enumerate(left):
        ax.text(
            0.0,
            top - i,
            token,
            ha="right",
            va="center",
            fontsize=fontsize,
            fontweight="bold" if i == query else "normal",
            color="black" if i == query else "0.55",
        )
    for j, token in enumerate(right):
        value = float(row[j])
        if not math.isfinite(value):
            ax.text(1.0, top - j, f"{token}  {value:.2f}", ha="left", va="center", fontsize=fontsize,
                    color="0.45", fontstyle="italic")
            continue
        share = min(max(value, 0.0), 1.0)  # the weight itself: rows sum to 1
        ax.text(
            1.0,
            top - j,
            f"{token}  {value:.2f}",
            ha="left",
            va="center",
            fontsize=fontsize,
            color=(0.05, 0.2 + 0.2 * (1 - share), 0.5 + 0.3 * share) if share > 0.2 else "0.45",
        )
        ax.plot(
            [0.04, 0.96],
            [top - query, top - j],
            color="tab:blue",
            alpha=0.15 + 0.85 * share,
            linewidth=0.5 + 7.0 * share,
            solid_capstyle="round",
        )
    header = dict(va="bottom", fontsize=min(fontsize, 9.0), color="0.3", fontstyle="italic")
    ax.text(0.0, top + 0.6, "query", ha="right", **header)
    ax.text(1.0, top + 0.6, "keys (weight)", ha="left", **header)
    ax.set_xlim(-0.9, 1.9)
    ax.set_ylim(-0.7, top + 1.4)
    ax.axis("off")
    ax.set_title(literal_text(title) if title else f"attention from '{left[query]}'", fontsize=10)
    return figure


def head_average(attentions: Tensor) -> Tensor:
    """``(..., h, i, j) -> (..., i, j)``: the mean over heads (each head's rows sum to one).

    Args:
        attentions: ``(h, i, j)`` or ``(layers, h, i, j)``, any real dtype or device.

    Returns:
        The float32 CPU mean over ``h``.

    Raises:
        ValueError: not 3-D or 4-D; TypeError: not a real tensor.
    """
    return checked_tensor(attentions, "attentions", dims=(3, 4)).mean(dim=-3)
