"""Training curves drawn from a run's ``metrics.jsonl`` (never by re-running the model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torchvote.training.metrics import read_metrics

__all__ = ["plot_run", "plot_training_curves"]


def plot_training_curves(metrics_path: str | Path, out_path: str | Path) -> Path | None:
    """Loss and accuracy against the step, training and evaluation, in one PNG.

    Returns:
        the PNG written, or ``None`` when matplotlib is not installed or nothing was logged.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    records = read_metrics(metrics_path)
    train = [r for r in records if r.get("event") == "train"]
    evals = [r for r in records if r.get("event") == "eval"]
    if not train and not evals:
        return None
    figure, (loss_axis, accuracy_axis) = plt.subplots(1, 2, figsize=(10, 4))
    for rows, label, style in ((train, "train", "-"), (evals, "eval", "o-")):
        rows = [r for r in rows if isinstance(r.get("loss"), (int, float))]
        if rows:
            loss_axis.plot([r["step"] for r in rows], [r["loss"] for r in rows], style, label=label)
            accuracy_axis.plot(
                [r["step"] for r in rows], [100 * r["accuracy"] for r in rows], style, label=label
            )
    loss_axis.set(xlabel="step", ylabel="loss", yscale="log", title="loss")
    accuracy_axis.set(xlabel="step", ylabel="accuracy (%)", title="accuracy")
    for axis in (loss_axis, accuracy_axis):
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out_path, dpi=100)
    plt.close(figure)
    return out_path


def plot_run(result: Any) -> list[Path]:
    """Draw the plots of a finished run into ``<run>/plots/`` and record them in ``result.plots``.

    The command line calls this after :func:`~torchvote.training.train` returns; the loop
    itself draws nothing.

    Args:
        result: a :class:`~torchvote.training.TrainResult`.

    Returns:
        The files drawn (none on ranks other than 0, after an interrupted run, or without
        matplotlib).
    """
    if result.interrupted or result.metrics_path is None:
        return []
    path = plot_training_curves(result.metrics_path, Path(result.run_dir) / "plots" / "training_curves.png")
    result.plots = [path] if path is not None else []
    return result.plots
