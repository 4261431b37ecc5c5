"""Shared matplotlib plumbing: a headless figure factory and PNG + SVG saving.

matplotlib is an optional dependency (``pip install "torchvote[plots]"``); it is imported when a
figure is first made, with the Agg backend so nothing needs a display.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

__all__ = ["literal_text", "new_figure", "pyplot", "save_figure"]


def literal_text(text: object) -> str:
    """``text`` as matplotlib must show it, dollar signs included: a label with two ``$`` would
    start mathtext, and a bad expression between them (``$\\frac{1``) fails the whole figure."""
    return str(text).replace("$", r"\$")


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
    """``(figure, axes)`` from :func:`matplotlib.pyplot.subplots` with a constrained layout."""
    plt = pyplot()
    return plt.subplots(rows, cols, figsize=size, layout="constrained", squeeze=False, **kwargs)


def save_figure(
    figure, stem: str | Path, *, formats: Sequence[str] = ("png", "svg"), dpi: int = 120
) -> list[Path]:
    """Save ``figure`` as ``stem.png`` and ``stem.svg`` (folders created), then close it.

    Args:
        figure: a matplotlib Figure.
        stem: path without suffix.
        formats: file formats to write.
        dpi: resolution of raster formats.

    Returns:
        The written paths, in ``formats`` order.

    Raises:
        ValueError: an unknown format.
    """
    allowed = {"png", "svg", "pdf"}
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:
        if fmt not in allowed:
            raise ValueError(f"formats must be among {sorted(allowed)}, got {fmt!r}")
        path = stem.with_name(f"{stem.name}.{fmt}")
        figure.savefig(path, format=fmt, dpi=dpi, metadata={"Date": None} if fmt == "svg" else None)
        paths.append(path)
    pyplot().close(figure)
    return paths
