"""Training curves drawn from a run's ``metrics.jsonl`` (never by re-running the model).

One panel per numeric field against the step, one line per series: a record's ``event``
(``train``, ``eval``, ``final``) and ``dataset`` (:class:`~torchvote.training.metrics.MetricsWriter`
writes both), so a training loss and an evaluation loss at the same step are two lines, not one
zigzag. Save the figure with :func:`torchvote.explain.figures.save_figure`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from torchvote.explain.figures import literal_text, new_figure
from torchvote.training.metrics import read_metrics
from torchvote.validation import as_path

if TYPE_CHECKING:  # matplotlib is optional: imported when a picture is drawn
    from matplotlib.figure import Figure

__all__ = ["draw_series", "metric_curves", "metric_points", "series_colours"]

# the x axis, its coarse twin, the wall clock, a setting MetricsWriter records beside results, and
# its bookkeeping of how many examples a record covers
NOT_CURVES = ("step", "epoch", "time", "eval_limit", "count", "examples")
PERCENT_FIELDS = ("accuracy",)  # fractions drawn as percentages
COLUMNS = 4  # panels per row
_NON_FINITE = ("nan", "inf", "-inf", "+inf", "infinity", "-infinity")  # json.dumps of a float's str


def _number(value: object) -> float | None:
    """``value`` as a float when it is a metric value: a number (not a bool), or the text
    ``"nan"`` / ``"inf"`` / ``"-inf"`` that :class:`~torchvote.training.metrics.MetricsWriter`
    writes for a non-finite float; else ``None``."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str) and value.strip().lower() in _NON_FINITE:
        return float(value)
    return None


def _series(record: dict) -> str:
    """The line a record belongs to: ``"train"``, ``"eval mnist/test"``, ... (``""`` without an event)."""
    parts = [str(record[key]) for key in ("event", "dataset") if record.get(key) is not None]
    return " ".join(parts)


def metric_points(records: Sequence[dict], key: str) -> dict[str, list[tuple[float, float]]]:
    """The ``(step, value)`` points of field ``key``, per series (:func:`_series`), in step order.

    A record without ``step`` is placed at its index; a step logged twice (a resumed run's log
    from an older writer) keeps its last value, so a line never runs back.

    Args:
        records: the records, as :func:`~torchvote.training.metrics.read_metrics` returns them.
        key: the field.

    Returns:
        Series name -> points (empty when no record holds a number under ``key``).
    """
    lines: dict[str, dict[float, float]] = {}
    for index, record in enumerate(records):
        value = _number(record.get(key))
        if value is not None:
            step = _number(record.get("step"))
            lines.setdefault(_series(record), {})[float(index) if step is None else step] = value
    return {name: sorted(points.items()) for name, points in lines.items()}


def series_colours(names: Sequence[str]) -> dict[str, str]:
    """One colour per series name, the same in every panel of a figure.

    Args:
        names: the series of every panel, in the order they are first met (repeats allowed).

    Returns:
        Name -> a matplotlib colour (``"C0"``, ``"C1"``, ... in that order, cycling after 10).
    """
    return {name: f"C{k % 10}" for k, name in enumerate(dict.fromkeys(names))}


def draw_series(ax, lines: dict[str, list[tuple[float, float]]], key: str, colours: dict[str, str]) -> None:
    """Draw one field's series on ``ax`` (steps across, whole numbers), labelled with the unit.

    Training (``train``) is a line, an evaluation a line with markers, a final evaluation a
    large star above every other mark (it shares its step with the last evaluation); a series of
    one point is a marker (a line through one point is invisible). Fields in
    :data:`PERCENT_FIELDS` are drawn in percent.

    Args:
        ax: the matplotlib axes.
        lines: series name -> ``(step, value)`` points (:func:`metric_points`).
        key: the field's name (the y label).
        colours: series name -> colour (:func:`series_colours`), holding every name of ``lines``.
    """
    from matplotlib.ticker import MaxNLocator

    scale = 100.0 if key in PERCENT_FIELDS else 1.0
    for name, points in lines.items():
        steps, values = [p[0] for p in points], [scale * p[1] for p in points]
        style = {"color": colours[name], "label": literal_text(name or key)}
        if name.startswith("final"):
            style.update(marker="*", markersize=14, markeredgecolor="black", linestyle="none", zorder=3)
        elif name == "train" and len(points) > 1:
            style.update(marker="none")
        else:
            style.update(marker="o" if len(points) < 50 else "none", markersize=5)
        ax.plot(steps, values, **style)
    ax.set_xlabel("step")
    ax.set_ylabel(literal_text(f"{key} (%)" if scale == 100.0 else key))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # whole steps: no 0.96 ... 1.04
    ax.grid(alpha=0.3)
    if lines:
        ax.legend(fontsize=7)


def metric_curves(path: str | Path, *, keys: Sequence[str] | None = None) -> Figure:
    """Training curves from a ``metrics.jsonl`` file (one JSON object per line, with ``step``), read
    as :func:`~torchvote.training.metrics.read_metrics` reads it.

    Each panel draws one line per series (``event`` and ``dataset`` of the records, named in a
    legend, one colour per series in every panel; :func:`draw_series`), in step order
    (:func:`metric_points`: a step logged twice keeps its last value); a
    record without ``step`` is placed at its line number. Non-finite values (written as
    ``"nan"``) leave a gap; other non-numeric values and booleans are not metrics.
    Panels wrap after :data:`COLUMNS` per row.

    Args:
        path: the metrics file.
        keys: which numeric fields to draw; default every numeric field but those in
            :data:`NOT_CURVES` (``step``, ``epoch``, the wall clock ``time``, ``eval_limit`` and
            the example counts ``count``, ``examples``).

    Returns:
        The Figure, one panel per field.

    Raises:
        TypeError: ``path`` neither a ``str`` nor an ``os.PathLike`` (``''`` is a ValueError).
        FileNotFoundError: if ``path`` does not exist.
        ValueError: if the file holds no records, ``keys`` is empty, or a named key never holds a
            number.
        TypeError: ``keys`` given as one string.
    """
    path = as_path(path, "path")
    if isinstance(keys, str):
        raise TypeError(f"keys must be a sequence of field names such as [{keys!r}], not one string")
    records = read_metrics(path)  # a run killed mid-write leaves a torn last line: skipped
    if not records:
        raise ValueError(f"{path} holds no metrics records")
    numeric = {k for r in records for k, v in r.items() if _number(v) is not None}
    available = sorted(numeric - set(NOT_CURVES))
    keys = list(keys) if keys is not None else available
    if not keys:
        raise ValueError(f"keys must name at least one field; {path} has {sorted(numeric)}")
    missing = [k for k in keys if k not in numeric]
    if missing:
        raise ValueError(f"keys {missing} not in {path}; available: {available}")
    columns = min(len(keys), COLUMNS)
    rows = math.ceil(len(keys) / columns)
    figure, axes = new_figure(rows, columns, size=(4.0 * columns, 3.0 * rows))
    for ax in axes.ravel()[len(keys):]:
        ax.remove()  # the last row's empty cells
    panels = {key: metric_points(records, key) for key in keys}
    colours = series_colours([name for lines in panels.values() for name in lines])
    for ax, (key, lines) in zip(axes.ravel(), panels.items(), strict=False):
        draw_series(ax, lines, key, colours)
        ax.set_title(literal_text(key))
    return figure
