"""Shared matplotlib plumbing: a headless figure factory, PNG + SVG saving, and the rules every
picture follows for text, size and values it cannot colour.

matplotlib is an optional dependency (``pip install "torchvote[plots]"``); it is imported when a
figure is first made, with the Agg backend so nothing needs a display.

- Text is drawn as given: :func:`literal_text` escapes ``$`` so that a label or title is never
  parsed as mathtext.
- A figure side is at most :data:`MAX_INCHES` (a 600-token heatmap asked for 250 inches, 30,000
  pixels a side at the report's dpi); axes with more labels than fit show every k-th
  (:func:`tick_positions`).
- A value that is not finite (NaN, +-inf: a masked position) is drawn in :data:`BAD_COLOUR`,
  never in the colour of 0; :func:`finite_range` gives colour limits from the finite values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from torch import Tensor

from torchvote.files import atomic_write, make_folder
from torchvote.validation import as_path, is_integer

__all__ = [
    "BAD_COLOUR",
    "MAX_INCHES",
    "PICTURE_FORMATS",
    "close_figure",
    "colormap",
    "finite_range",
    "literal_labels",
    "literal_text",
    "new_figure",
    "pyplot",
    "save_figure",
    "tick_positions",
]

MAX_INCHES = 24.0  # longest figure side: 2,880 pixels at the report's 120 dpi
BAD_COLOUR = "0.72"  # grey for NaN / inf cells: no colour map here has it at 0
PICTURE_FORMATS = ("png", "svg", "pdf")  # what save_figure writes, by their suffixes


def literal_text(text: object) -> str:
    """``text`` as matplotlib must show it, dollar signs included: a label with two ``$`` would
    start mathtext, and a bad expression between them (``$\\frac{1``) fails the whole figure."""
    return str(text).replace("$", r"\$")


def literal_labels(
    labels: Sequence[object] | None, count: int, name: str, *, each: str = ""
) -> list[str] | None:
    """``labels`` as ``count`` strings drawn as written (:func:`literal_text`), or ``None``.

    Args:
        labels: one label per row (column, capsule ...), or ``None`` for no labels.
        count: how many there must be.
        name: the argument's name, for the message.
        each: added to the count in the message (e.g. ``" (one per row/column)"``).

    Returns:
        The labels, or ``None``.

    Raises:
        TypeError: one string instead of a sequence of labels.
        ValueError: not ``count`` labels.
    """
    if labels is None:
        return None
    if isinstance(labels, str):
        raise TypeError(f"{name} must be a sequence of labels, not the string {labels!r}")
    labels = list(labels)
    if len(labels) != count:
        raise ValueError(f"{name} must have {count} entries{each}, got {len(labels)}")
    return [literal_text(label) for label in labels]


def tick_positions(count: int, limit: int) -> list[int]:
    """Every k-th of ``count`` positions, the smallest k that keeps at most ``limit`` of them.

    Args:
        count: positions (tokens, capsules) along the axis.
        limit: most labels the axis has room for, at least 1.

    Returns:
        ``[0, k, 2k, ...]``; every position when ``count <= limit``.
    """
    step = max(1, math.ceil(count / max(limit, 1)))
    return list(range(0, count, step))


def finite_range(values: Tensor, *, lowest: float | None = 0.0) -> tuple[float, float, bool]:
    """Colour limits from the finite values: ``(vmin, vmax, has_non_finite)``.

    Args:
        values: any tensor (NaN and +-inf are left out of the limits).
        lowest: ``vmin`` is at most this (0: the scale starts at zero weight); ``None``: the
            smallest finite value.

    Returns:
        ``vmin < vmax`` (a constant or empty tensor gets a small span), and whether any value is
        not finite.
    """
    finite = values[values.isfinite()]
    low = float(finite.min()) if finite.numel() else 0.0
    high = float(finite.max()) if finite.numel() else 0.0
    if lowest is not None:
        low = min(low, lowest)
    high = max(high, low + 1e-6)
    return low, high, bool(finite.numel() < values.numel())


def colormap(name: str):
    """The matplotlib colour map ``name`` with non-finite values drawn in :data:`BAD_COLOUR`
    (matplotlib's default leaves them transparent: white, the colour of 0 in ``Blues``)."""
    pyplot()
    import matplotlib

    return matplotlib.colormaps[name].with_extremes(bad=BAD_COLOUR)


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend.

    Raises:
        ModuleNotFoundError: matplotlib is missing; the message names the extra.
    """
    try:
        import matplotlib
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            'the explanation pictures need matplotlib: pip install "torchvote[plots]"', name="matplotlib"
        ) from error
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def new_figure(rows: int = 1, cols: int = 1, *, size: tuple[float, float], **kwargs):
    """``(figure, axes)`` from :func:`matplotlib.pyplot.subplots` with a constrained layout.

    Each side of ``size`` (inches) is capped at :data:`MAX_INCHES`; ``axes`` is always 2-D.
    """
    plt = pyplot()
    width, height = (min(float(side), MAX_INCHES) for side in size)
    return plt.subplots(rows, cols, figsize=(width, height), layout="constrained", squeeze=False, **kwargs)


def save_figure(
    figure, stem: str | Path, *, formats: Sequence[str] = ("png", "svg"), dpi: int = 120
) -> list[Path]:
    """Save ``figure`` as ``stem.png`` and ``stem.svg`` (folders created), then close it.

    Each file is written under a temporary name and renamed into place, so a reader never sees
    half a picture; the figure is closed whether saving worked or not.

    Args:
        figure: a matplotlib Figure.
        stem: path without suffix.
        formats: file formats to write, among ``png``, ``svg`` and ``pdf``.
        dpi: resolution of raster formats, a positive integer.

    Returns:
        The written paths, in ``formats`` order.

    Raises:
        TypeError: ``stem`` neither a ``str`` nor an ``os.PathLike`` (``''`` is a ValueError).
        ValueError: an unknown or repeated format, a bad ``dpi`` or a ``stem`` that ends in a
            format's suffix (``b.png``) (nothing written).
        TypeError: ``figure`` not a matplotlib Figure, or ``formats`` given as one string.
        ModuleNotFoundError: matplotlib is missing; the message names the extra.
    """
    pyplot()  # the message naming the extra when matplotlib is missing
    from matplotlib.figure import Figure

    try:
        if not isinstance(figure, Figure):
            raise TypeError(f"figure must be a matplotlib Figure, got {type(figure).__name__}")
        if isinstance(formats, str):
            raise TypeError(f"formats must be a sequence of format names such as ('png',), got {formats!r}")
        formats = list(formats)
        unknown = [fmt for fmt in formats if fmt not in PICTURE_FORMATS]
        if unknown or not formats or len(set(formats)) != len(formats):
            raise ValueError(
                f"formats must be distinct names among {sorted(PICTURE_FORMATS)}, got {formats!r}"
            )
        if not is_integer(dpi) or dpi < 1:
            raise ValueError(f"dpi must be a positive integer, got {dpi!r}")
        stem = as_path(stem, "stem")
        if stem.suffix.lower().lstrip(".") in PICTURE_FORMATS:  # "b.png" was written as b.png.png
            raise ValueError(
                f"stem must be the path without its suffix ({str(stem.with_suffix(''))!r}; formats= "
                f"chooses the files), got {str(stem)!r}"
            )
        make_folder(stem.parent)
        paths = []
        for fmt in formats:
            path = stem.with_name(f"{stem.name}.{fmt}")
            metadata = {"Date": None} if fmt == "svg" else None
            atomic_write(path, lambda handle, fmt=fmt, metadata=metadata: figure.savefig(
                handle, format=fmt, dpi=dpi, metadata=metadata
            ))
            paths.append(path)
        return paths
    finally:
        close_figure(figure)


def close_figure(figure) -> None:
    """Close ``figure`` if it is a matplotlib Figure; anything else is left alone (``plt.close``
    of ``None`` or ``"all"`` would close the caller's other figures).

    Args:
        figure: the figure to close.
    """
    from matplotlib.figure import Figure

    if isinstance(figure, Figure):
        pyplot().close(figure)
