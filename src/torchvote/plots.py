"""Pictures of the votes: attention maps, routing couplings per pass, training curves.

Plots read what a model recorded (``VoteResult.weights``, the couplings a routing layer returns,
``metrics.jsonl``); they never re-run a model's internals. matplotlib is imported lazily (the
``plots`` extra) and figures are drawn with the non-interactive Agg canvas, so nothing needs a
screen.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

__all__ = ["plot_attention", "plot_heads", "plot_routing", "plot_metrics", "save"]


def _figure(width: float, height: float) -> Figure:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "plots need matplotlib: pip install 'torchvote[plots]'"
        ) from error
    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _as_matrix(weights: Tensor, argument: str) -> Tensor:
    if not isinstance(weights, Tensor):
        raise TypeError(f"{argument} must be a tensor, got {type(weights).__name__}")
    if weights.dim() != 2:
        raise ValueError(f"{argument} must be 2-D (receivers, senders), got shape "
                         f"{tuple(weights.shape)}; index the batch and head first")
    return weights.detach().float().cpu()


def _label_axes(ax, matrix: Tensor, receivers: Sequence[str] | None,
                senders: Sequence[str] | None) -> None:
    for labels, count, setter, ticks in (
        (senders, matrix.shape[1], ax.set_xticklabels, ax.set_xticks),
        (receivers, matrix.shape[0], ax.set_yticklabels, ax.set_yticks),
    ):
        if labels is None:
            continue
        if len(labels) != count:
            raise ValueError(f"expected {count} labels, got {len(labels)}")
        ticks(range(count))
        setter(labels, rotation=90 if setter == ax.set_xticklabels else 0)


def plot_attention(
    weights: Tensor,
    *,
    receivers: Sequence[str] | None = None,
    senders: Sequence[str] | None = None,
    title: str = "attention weights (rows sum to 1)",
    annotate: bool | None = None,
) -> Figure:
    """Heat map of one ``(i, j)`` weight matrix: row ``i`` is what receiver ``i`` heard.

    Args:
        weights: ``(i, j)`` weights (one batch element, one head).
        receivers: ``i`` labels (queries, output capsules), top to bottom.
        senders: ``j`` labels (keys, input capsules), left to right.
        title: the axes title.
        annotate: write each weight in its cell (default: when the matrix is at most 12 x 12).

    Returns:
        The matplotlib ``Figure``.

    Raises:
        ValueError: if ``weights`` is not 2-D or a label list has the wrong length.
    """
    matrix = _as_matrix(weights, "weights")
    figure = _figure(1.2 + 0.45 * matrix.shape[1], 1.0 + 0.45 * matrix.shape[0])
    ax = figure.add_subplot()
    image = ax.imshow(matrix.numpy(), cmap="viridis", vmin=0.0, aspect="auto")
    figure.colorbar(image, ax=ax)
    _label_axes(ax, matrix, receivers, senders)
    ax.set_xlabel("senders j")
    ax.set_ylabel("receivers i")
    ax.set_title(title)
    if annotate if annotate is not None else max(matrix.shape) <= 12:
        for (i, j), value in _cells(matrix):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7,
                    color="white" if value < 0.5 * float(matrix.max()) else "black")
    return figure


def _cells(matrix: Tensor):
    for i in range(matrix.shape[0]):
        for j in range(matrix.shape[1]):
            yield (i, j), float(matrix[i, j])


def plot_heads(weights: Tensor, *, title: str = "attention per head") -> Figure:
    """One heat map per head, side by side.

    Args:
        weights: ``(h, i, j)`` weights of one batch element.
        title: the figure title.

    Returns:
        The matplotlib ``Figure``.

    Raises:
        ValueError: if ``weights`` is not 3-D.
    """
    if weights.dim() != 3:
        raise ValueError(f"weights must be (heads, receivers, senders), got {tuple(weights.shape)}")
    heads = weights.shape[0]
    columns = min(heads, 4)
    rows = math.ceil(heads / columns)
    figure = _figure(3.0 * columns, 3.0 * rows)
    for h in range(heads):
        ax = figure.add_subplot(rows, columns, h + 1)
        ax.imshow(weights[h].detach().float().cpu().numpy(), cmap="viridis", vmin=0.0)
        ax.set_title(f"head {h}")
        ax.set_xticks([])
        ax.set_yticks([])
    figure.suptitle(title)
    return figure


def plot_routing(
    couplings: Sequence[Tensor] | Tensor,
    *,
    receivers: Sequence[str] | None = None,
    title: str = "routing couplings per pass (each sender's column sums to 1)",
) -> Figure:
    """How the votes settle: the ``(i, j)`` couplings of every routing pass, side by side.

    Args:
        couplings: per pass, an ``(i, j)`` matrix (``VoteResult.weights`` of one batch
            element), or a single ``(passes, i, j)`` tensor.
        receivers: ``i`` labels (output capsules).
        title: the figure title.

    Returns:
        The matplotlib ``Figure``; below the maps, each receiver's total received weight per pass.

    Raises:
        ValueError: if there are no passes or the matrices are not 2-D.
    """
    passes = list(couplings) if not isinstance(couplings, Tensor) else list(couplings.unbind(0))
    if not passes:
        raise ValueError("couplings must hold at least one pass")
    matrices = [_as_matrix(c, f"couplings[{t}]") for t, c in enumerate(passes)]
    figure = _figure(2.6 * len(matrices) + 1.0, 5.0)
    grid = figure.add_gridspec(2, len(matrices), height_ratios=[3, 1])
    top = float(max(m.max() for m in matrices))
    for t, matrix in enumerate(matrices):
        ax = figure.add_subplot(grid[0, t])
        ax.imshow(matrix.numpy(), cmap="magma", vmin=0.0, vmax=top, aspect="auto")
        ax.set_title(f"pass {t + 1}")
        ax.set_xlabel("senders j")
        if t == 0:
            ax.set_ylabel("receivers i")
            _label_axes(ax, matrix, receivers, None)
        else:
            ax.set_yticks([])
    totals = torch.stack([m.sum(1) for m in matrices])  # (passes, i)
    ax = figure.add_subplot(grid[1, :])
    for i in range(totals.shape[1]):
        name = receivers[i] if receivers is not None else str(i)
        ax.plot(range(1, len(matrices) + 1), totals[:, i].numpy(), marker="o", label=name)
    ax.set_xlabel("pass")
    ax.set_ylabel("total weight")
    if totals.shape[1] <= 12:
        ax.legend(ncols=min(totals.shape[1], 6), fontsize=7)
    figure.suptitle(title)
    return figure


def plot_metrics(path: str | Path, *, keys: Sequence[str] | None = None) -> Figure:
    """Training curves from a ``metrics.jsonl`` file (one JSON object per line, with ``step``).

    Args:
        path: the metrics file.
        keys: which numeric fields to draw; default every numeric field but ``step``/``epoch``.

    Returns:
        The matplotlib ``Figure``, one panel per field.

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: if the file holds no records or a named key never appears.
    """
    path = Path(path)
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not records:
        raise ValueError(f"{path} holds no metrics records")
    available = sorted({k for r in records for k, v in r.items()
                        if isinstance(v, int | float) and k not in ("step", "epoch")})
    keys = list(keys) if keys is not None else available
    missing = [k for k in keys if k not in available]
    if missing:
        raise ValueError(f"keys {missing} not in {path}; available: {available}")
    figure = _figure(4.0 * max(len(keys), 1), 3.0)
    for n, key in enumerate(keys):
        ax = figure.add_subplot(1, len(keys), n + 1)
        points = [(r.get("step", index), r[key]) for index, r in enumerate(records) if key in r]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="." if len(points) < 50 else None)
        ax.set_title(key)
        ax.set_xlabel("step")
    return figure


def save(figure: Figure, path: str | Path, *, dpi: int = 120) -> Path:
    """Write ``figure`` to ``path`` (format from the suffix), creating folders; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=dpi)
    return path
