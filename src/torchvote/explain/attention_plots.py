"""Attention pictures drawn from recorded weights (never by re-running a model).

Each function returns a matplotlib Figure; save it with
:func:`torchvote.explain.figures.save_figure` (PNG and SVG). Index legend: ``h`` heads, ``i``
receivers (queries, rows), ``j`` senders (keys, columns); attention rows sum to one.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from torchvote.explain.figures import literal_text, new_figure
from torchvote.explain.statistics import checked_tensor

__all__ = ["attention_grid", "attention_heatmap", "head_average", "token_attention_lines"]

CMAP = "Blues"


def _check_tokens(tokens: Sequence[str] | None, count: int, name: str) -> list[str] | None:
    """``tokens`` as literal label strings (``$`` shown as it is), or ``None`` (no labels); a
    ``ValueError`` unless there are ``count``."""
    if tokens is None:
        return None
    if len(tokens) != count:
        raise ValueError(
            f"{name} must have {count} entries (one per row/column): "
            f"expected {count} labels, got {len(tokens)}"
        )
    return [literal_text(token) for token in tokens]


def attention_heatmap(
    weights: Tensor,
    tokens: Sequence[str] | None = None,
    key_tokens: Sequence[str] | None = None,
    *,
    title: str = "",
    annotate: bool | None = None,
):
    """One attention matrix as a heatmap, queries down, keys across, labelled with tokens.

    Args:
        weights: ``(i, j)`` weights (average heads before if needed).
        tokens: ``i`` query tokens (row labels); ``None``: no labels.
        key_tokens: ``j`` key tokens; default ``tokens`` (self-attention).
        title: axes title.
        annotate: write each weight in its cell; default when the matrix is at most 16 x 16.

    Returns:
        The Figure.

    Raises:
        ValueError: token counts that do not match the shape; TypeError: not a tensor.
    """
    weights = checked_tensor(weights, "weights", dims=(2,))
    rows = _check_tokens(tokens, weights.shape[0], "tokens")
    cols = _check_tokens(key_tokens if key_tokens is not None else tokens, weights.shape[1], "key_tokens")
    annotate = max(weights.shape) <= 16 if annotate is None else annotate
    side = 1.6 + 0.42 * max(weights.shape)
    figure, axes = new_figure(size=(side + 1.0, side))
    ax = axes[0, 0]
    image = ax.imshow(weights.numpy(), cmap=CMAP, vmin=0.0, vmax=max(float(weights.max()), 1e-6))
    if cols is not None:
        ax.set_xticks(range(len(cols)), cols, rotation=60, ha="right", rotation_mode="anchor")
    if rows is not None:
        ax.set_yticks(range(len(rows)), rows)
    ax.set_xlabel("key (sender j)")
    ax.set_ylabel("query (receiver i)")
    if title:
        ax.set_title(title)
    if annotate:
        threshold = 0.6 * float(weights.max())
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
                    color="white" if value > threshold else "black",
                )
    figure.colorbar(image, ax=ax, shrink=0.8, label="weight")
    return figure


def attention_grid(attentions: Tensor, tokens: Sequence[str] | None = None, *, title: str = ""):
    """Every layer x head attention map of one input, as a grid of small heatmaps.

    Args:
        attentions: ``(layers, h, i, j)`` weights of one input (unpadded), or ``(h, i, j)`` of
            one layer (one row of heads).
        tokens: ``i`` tokens (labels on the left column and bottom row when short enough);
            ``None``: no labels.
        title: figure title.

    Returns:
        The Figure.

    Raises:
        ValueError: wrong rank or token count.
    """
    attentions = checked_tensor(attentions, "attentions", dims=(3, 4))
    if attentions.dim() == 3:
        attentions = attentions[None]  # (1, h, i, j): one layer
    layers, heads = attentions.shape[:2]
    labels = _check_tokens(tokens, attentions.shape[-1], "tokens")
    show_labels = labels is not None and len(labels) <= 14
    cell = 1.25 if show_labels else 0.9
    figure, axes = new_figure(layers, heads, size=(0.8 + cell * heads, 0.8 + cell * layers))
    for layer in range(layers):
        for head in range(heads):
            ax = axes[layer, head]
            ax.imshow(attentions[layer, head].numpy(), cmap=CMAP, vmin=0.0, vmax=1.0)
            ax.set_xticks([])
            ax.set_yticks([])
            if layer == 0:
                ax.set_title(f"head {head}", fontsize=8)
            if head == 0:
                ax.set_ylabel(f"layer {layer}", fontsize=8)
            if show_labels and layer == layers - 1 and head == 0:
                ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=5)
                ax.set_yticks(range(len(labels)), labels, fontsize=5)
    if title:
        figure.suptitle(title)
    return figure


def token_attention_lines(
    weights: Tensor,
    tokens: Sequence[str],
    query: int,
    *,
    key_tokens: Sequence[str] | None = None,
    title: str = "",
):
    """One query token's attention drawn as lines to every key, thickness and opacity by weight.

    Two columns of tokens, queries left and keys right, in the style of the reference articles'
    "check" -> "cashed", "bank" figure.

    Args:
        weights: ``(i, j)`` (average heads first) or ``(h, i, j)`` (heads averaged here).
        tokens: ``i`` query tokens.
        query: index of the query token to draw.
        key_tokens: ``j`` key tokens; default ``tokens``.
        title: axes title.

    Returns:
        The Figure.

    Raises:
        ValueError: ``query`` out of range or token counts that do not match.
    """
    weights = checked_tensor(weights, "weights", dims=(2, 3))
    if weights.dim() == 3:
        weights = weights.mean(dim=0)  # (i, j)
    left = _check_tokens(tokens, weights.shape[0], "tokens")
    right = _check_tokens(key_tokens if key_tokens is not None else tokens, weights.shape[1], "key_tokens")
    if not -len(left) <= query < len(left):
        raise ValueError(f"query must index one of {len(left)} tokens, got {query}")
    query = query % len(left)
    row = weights[query]  # (j,)
    strongest = max(float(row.max()), 1e-6)
    height = 0.8 + 0.36 * max(len(left), len(right))
    figure, axes = new_figure(size=(4.8, height))
    ax = axes[0, 0]
    top = max(len(left), len(right)) - 1
    for i, token in enumerate(left):
        ax.text(
            0.0,
            top - i,
            token,
            ha="right",
            va="center",
            fontsize=10,
            fontweight="bold" if i == query else "normal",
            color="black" if i == query else "0.55",
        )
    for j, token in enumerate(right):
        share = float(row[j]) / strongest
        ax.text(
            1.0,
            top - j,
            f"{token}  {float(row[j]):.2f}",
            ha="left",
            va="center",
            fontsize=10,
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
    ax.set_xlim(-0.9, 1.9)
    ax.set_ylim(-0.7, top + 0.7)
    ax.axis("off")
    ax.set_title(title or f"attention from '{left[query]}'", fontsize=10)
    return figure


def head_average(attentions: Tensor) -> Tensor:
    """``(..., h, i, j) -> (..., i, j)``: the mean over heads (each head's rows sum to one)."""
    return checked_tensor(attentions, "attentions", dims=(3, 4)).mean(dim=-3)
