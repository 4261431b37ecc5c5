"""Turn a row's finished runs into its table: mean, spread and count over every seed run.

No run is left out: each variant's cell is the mean and the sample standard deviation over all
the ``result.json`` files found for it (any seed), with their count, so a table never shows a
chosen seed. The summary goes to ``summary.md`` (the table as it appears in docs/results.md, with
the commands and the device) and ``summary.json`` beside it.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from torchvote.data.errors import CorruptDataError
from torchvote.experiments.rows import Metric, Row
from torchvote.files import atomic_write_bytes
from torchvote.validation import as_path

__all__ = ["format_cell", "metric_value", "read_result", "summarize", "write_summary"]


def metric_value(results: dict[str, dict[str, float]], metric: Metric) -> float | None:
    """The value of ``metric`` in a run's final evaluations, transformed; ``None`` if absent.

    Args:
        results: ``{"mnist/test": {"accuracy": ...}, ...}``, the run's main evaluation first.
        metric: what to read.
    """
    if not results:
        return None
    name = metric.dataset if metric.dataset is not None else next(iter(results))
    value = results.get(name, {}).get(metric.key)
    if value is None:
        return None
    if metric.transform == "error_percent":
        return 100.0 * (1.0 - value)
    if metric.transform == "percent":
        return 100.0 * value
    if metric.transform == "bits":
        return value / math.log(2.0)
    return value


def _stats(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return {
        "n": len(values),
        "mean": statistics.fmean(values),
        "std": spread,
        "min": min(values),
        "max": max(values),
    }


_RESULT_KEYS = ("variant", "seed", "results", "wall_s", "command", "device")
#: What a summary says of a run whose record predates records naming their code.
UNRECORDED_CODE = "code not recorded: a run made before records named it"


def read_result(path: str | Path) -> dict[str, Any]:
    """One finished run's ``result.json``, as :func:`~torchvote.experiments.runner.reproduce`
    writes it.

    Args:
        path: the file.

    Returns:
        Its record.

    Raises:
        TypeError: ``path`` neither a ``str`` nor an ``os.PathLike`` (``''`` is a ValueError).
        CorruptDataError: (a ``ValueError``) the file is not JSON or lacks a field of a run's record
            (named with the file, and how to run that seed again).
    """
    path = as_path(path, "path")
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        problem = f"is unreadable ({error})"
    else:
        missing = [key for key in _RESULT_KEYS if key not in record] if isinstance(record, dict) else None
        if missing == []:
            return record
        kind = type(record).__name__
        problem = f"lacks {', '.join(missing)}" if missing else f"holds a {kind}, not a record"
    raise CorruptDataError(  # a failure while running (exit status 1), not a bad command line
        f"{path} {problem}: it is not a run's record as reproduce writes it; delete it to run that seed again"
    )


def _read_results(base: Path) -> list[dict[str, Any]]:
    return [read_result(path) for path in sorted(base.glob("*/seed-*/result.json"))]


def summarize(row: Row, budget: str, base: str | Path) -> dict[str, Any]:
    """Statistics of every finished run of ``row`` under ``base`` (``<out>/<row>/<budget>``).

    Args:
        row: the experiment.
        budget: the budget the runs used; recorded in the summary (the runs are read from
            ``base`` alone).
        base: the row's folder for that budget, holding ``<variant>/seed-<n>/result.json`` (or a
            measuring row's ``result.json``); a missing folder gives empty statistics.

    Returns:
        ``{"row", "letter", "title", "budget", "variants": [{"label", "paper", "seeds",
        "metrics": {label: {"n", "mean", "std", "min", "max"}}, "wall_s": {...}, "commands",
        "devices", "code"}]}`` (``code``: what :func:`~torchvote.experiments.runner.describe_code`
        said of each run); a measuring row gives ``"table"``, ``"device"`` and ``"code"`` instead
        of ``"variants"``.
    """
    base = Path(base)
    summary: dict[str, Any] = {"row": row.name, "letter": row.letter, "title": row.title, "budget": budget}
    if row.measure is not None:
        path = base / "result.json"
        record = json.loads(path.read_text()) if path.is_file() else {}
        summary |= {
            "table": record.get("table", []),
            "device": record.get("device"),
            "code": record.get("code", UNRECORDED_CODE) if record else None,
            "wall_s": record.get("wall_s"),
        }
        return summary
    records = _read_results(base)
    variants = []
    for variant in row.variants:
        runs = [r for r in records if r["variant"] == variant.label]
        metrics = {}
        for metric in row.metrics:
            values = [v for r in runs if (v := metric_value(r["results"], metric)) is not None]
            metrics[metric.label] = _stats(values)
        variants.append(
            {
                "label": variant.label,
                "paper": variant.paper,
                "seeds": sorted(r["seed"] for r in runs),
                "metrics": metrics,
                "wall_s": _stats([r["wall_s"] for r in runs]),
                "commands": [r["command"] for r in sorted(runs, key=lambda r: r["seed"])],
                "devices": sorted({r["device"] for r in runs}),
                "code": sorted({r.get("code", UNRECORDED_CODE) for r in runs}),
            }
        )
    summary["variants"] = variants
    return summary


def format_cell(stats: dict[str, Any], digits: int = 2) -> str:
    """``mean +/- std (n)``, or a dash when nothing was measured."""
    if not stats.get("n"):
        return "-"
    if stats["n"] == 1:
        return f"{stats['mean']:.{digits}f} (n=1)"
    return f"{stats['mean']:.{digits}f} +/- {stats['std']:.{digits}f} (n={stats['n']})"


def _markdown(row: Row, summary: dict[str, Any]) -> str:
    lines = [f"### {row.letter}. {row.title} (budget: {summary['budget']})", ""]
    lines += [f"Command: `torchvote reproduce {row.name} --budget {summary['budget']}`", ""]
    if "table" in summary:
        table = summary["table"]
        if table:
            columns = list(table[0])
            lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            for entry in table:
                cells = [f"{v:.4f}" if isinstance(v, float) else str(v) for v in entry.values()]
                lines.append("| " + " | ".join(cells) + " |")
        lines += ["", f"Device: {summary.get('device')}; wall time {summary.get('wall_s') or 0:.0f} s."]
        if summary.get("code"):
            lines += ["", f"Code: {summary['code']}."]
    else:
        metric_labels = [
            m.label for m in row.metrics if any(v["metrics"][m.label].get("n") for v in summary["variants"])
        ]
        heading = ["variant", *metric_labels, "paper", "wall time per run (s)"]
        lines += ["| " + " | ".join(heading) + " |", "|" + "---|" * len(heading)]
        for variant in summary["variants"]:
            cells = [variant["label"], *(format_cell(variant["metrics"][m]) for m in metric_labels)]
            cells += [variant["paper"] or "-", format_cell(variant["wall_s"], 0)]
            lines.append("| " + " | ".join(cells) + " |")
        devices = sorted({d for v in summary["variants"] for d in v["devices"]})
        lines += [
            "",
            f"Device: {'; '.join(devices) or '-'}. Mean +/- sample standard deviation over every seed run.",
        ]
        code = sorted({c for v in summary["variants"] for c in v.get("code", [])})
        if code:
            lines += ["", f"Code: {'; '.join(code)}."]
        commands = [c for v in summary["variants"] for c in v["commands"][:1]]
        if commands:  # each variant's lowest seed run: 0 unless --seeds left it out
            first = sorted({v["seeds"][0] for v in summary["variants"] if v["seeds"]})
            which = f"seed {first[0]}" if len(first) == 1 else "each variant's lowest seed"
            lines += ["", f"Commands ({which}; the other seeds change `seed=`):", "", "```"]
            lines += commands + ["```"]
    if row.note:
        lines += ["", row.note]
    return "\n".join(lines) + "\n"


def write_summary(row: Row, base: str | Path, summary: dict[str, Any]) -> Path:
    """Write ``summary.json`` and ``summary.md`` into ``base``, atomically; return the markdown path.

    Args:
        row: the experiment (its title, metrics and note make the markdown).
        base: the folder to write into (created if missing).
        summary: what :func:`summarize` returned for ``row``.

    Returns:
        The path of ``summary.md``.
    """
    base = Path(base)
    markdown = _markdown(row, summary)  # first: a summary it cannot show leaves neither file written
    atomic_write_bytes(base / "summary.json", json.dumps(summary, indent=1).encode())
    path = base / "summary.md"
    atomic_write_bytes(path, markdown.encode())
    return path
