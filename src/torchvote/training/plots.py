"""Training curves drawn from a run's ``metrics.jsonl`` (never by re-running the model)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from torchvote.training.metrics import read_metrics
from torchvote.validation import as_path

__all__ = ["plot_run", "plot_training_curves"]

LOG_SPAN = 10.0  # a loss axis turns logarithmic when the largest loss is this many times the smallest


def plot_training_curves(metrics_path: str | Path, out_path: str | Path) -> Path | None:
    """Loss and accuracy against the step, one line per series (training, each evaluated data
    set) and a star per final evaluation, in one picture written atomically: a PNG, or the
    format ``out_path``'s suffix names (``.svg``, ``.pdf``). A series of one point is drawn as a
    marker (a line of one point is invisible); a series has one colour in both panels, the steps
    are whole numbers, and the loss axis is logarithmic only when the positive losses span a
    factor of :data:`LOG_SPAN` or more (its ticks plain decimals).

    Each panel reads its own field (an evaluation without a loss still draws its accuracy), in
    step order with a step logged twice kept once, and a non-finite value leaves a gap
    (:func:`torchvote.explain.metric_plots.metric_points`).

    Returns:
        the picture written, or ``None`` when matplotlib is not installed or nothing was logged.

    Raises:
        TypeError: ``metrics_path`` or ``out_path`` neither a ``str`` nor an ``os.PathLike``
            (``''`` is a ValueError).
        ValueError: ``out_path`` with a suffix that is no picture format (``curves.v2`` was
            written as ``curves.png``, ``curves.svg`` as a PNG beside it).
    """
    from torchvote.explain.figures import (  # matplotlib: in new_figure
        PICTURE_FORMATS,
        new_figure,
        save_figure,
    )
    from torchvote.explain.metric_plots import draw_series, metric_points, series_colours

    out_path = as_path(out_path, "out_path")
    picture_format = out_path.suffix.lower().lstrip(".") or "png"
    if picture_format not in PICTURE_FORMATS:
        raise ValueError(
            f"out_path must end in one of {['.' + name for name in PICTURE_FORMATS]} (or have no suffix: "
            f".png), got {str(out_path)!r}"
        )

    records = read_metrics(as_path(metrics_path, "metrics_path"))
    records = [r for r in records if r.get("event") in ("train", "eval", "final")]
    losses, accuracies = metric_points(records, "loss"), metric_points(records, "accuracy")
    if not any(losses.values()) and not any(accuracies.values()):
        return None
    try:
        figure, axes = new_figure(1, 2, size=(10, 4))
    except ImportError:
        return None
    loss_axis, accuracy_axis = axes[0]
    colours = series_colours([*losses, *accuracies])
    for axis, lines, key in ((loss_axis, losses, "loss"), (accuracy_axis, accuracies, "accuracy")):
        draw_series(axis, lines, key, colours)
        axis.set_title(key)
    finite = [v for points in losses.values() for _, v in points if math.isfinite(v)]
    if finite and min(finite) > 0 and max(finite) / min(finite) >= LOG_SPAN:
        from matplotlib.ticker import FormatStrFormatter  # matplotlib is there: new_figure worked

        loss_axis.set_yscale("log")
        loss_axis.yaxis.set_major_formatter(FormatStrFormatter("%g"))  # 0.1, not 10^-1
    (written,) = save_figure(figure, out_path.with_suffix(""), formats=(picture_format,), dpi=100)
    return written


def plot_run(result: Any) -> list[Path]:
    """Draw the plots of a finished run into ``<run>/plots/`` and record them in ``result.plots``.

    The command line calls this after :func:`~torchvote.training.train` returns; the loop
    itself draws nothing.

    Args:
        result: a :class:`~torchvote.training.TrainResult`.

    Returns:
        The files drawn (none on ranks other than 0, after an interrupted run, or without
        matplotlib).

    Raises:
        TypeError: ``result`` is no :class:`~torchvote.training.TrainResult`.
    """
    from torchvote.training.results import TrainResult

    if not isinstance(result, TrainResult):
        raise TypeError(f"result must be the TrainResult train() returns, got {type(result).__name__}")
    if result.interrupted or result.metrics_path is None:
        return []
    path = plot_training_curves(result.metrics_path, Path(result.run_dir) / "plots" / "training_curves.png")
    result.plots = [path] if path is not None else []
    return result.plots
