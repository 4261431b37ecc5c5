"""Training curves drawn from a run's ``metrics.jsonl`` (never by re-running the model).

One panel per numeric field against the step; save it with
:func:`torchvote.explain.figures.save_figure`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from torchvote.explain.figures import new_figure
from torchvote.training.metrics import read_metrics

__all__ = ["metric_curves"]


def metric_curves(path: str | Path, *, keys: Sequence[str] | None = None):
    """Training curves from a ``metrics.jsonl`` file (one JSON object per line, with ``step``), read
    as :func:`~torchvote.training.metrics.read_metrics` reads it.

    Args:
        path: the metrics file.
        keys: which numeric fields to draw; default every numeric field but ``step``/``epoch``.

    Returns:
        The Figure, one panel per field.

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: if the file holds no records or a named key never appears.
    """
    path = Path(path)
    records = read_metrics(path)  # a run killed mid-write leaves a torn last line: skipped
    if not records:
        raise ValueError(f"{path} holds no metrics records")
    numeric = {k for r in records for k, v in r.items() if isinstance(v, int | float)}
    available = sorted(numeric - {"step", "epoch"})
    keys = list(keys) if keys is not None else available
    missing = [k for k in keys if k not in available]
    if missing:
        raise ValueError(f"keys {missing} not in {path}; available: {available}")
    figure, axes = new_figure(1, max(len(keys), 1), size=(4.0 * max(len(keys), 1), 3.0))
    for ax, key in zip(axes[0], keys, strict=False):
        points = [(r.get("step", index), r[key]) for index, r in enumerate(records) if key in r]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="." if len(points) < 50 else None)
        ax.set_title(key)
        ax.set_xlabel("step")
    return figure
