"""Metrics out of a run: JSON lines, TensorBoard when installed, and the plain-text result table."""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torchvote.files import atomic_write_bytes, make_folder, open_no_follow
from torchvote.validation import as_path, check_positive_int, check_texts

__all__ = ["MetricsWriter", "format_table", "read_metrics"]


class MetricsWriter:
    """Appends one JSON object per line to ``<run>/metrics.jsonl`` (and TensorBoard scalars).

    Each line has an ``event`` (``train``, ``eval``, ``final``), the ``step`` and ``epoch``, a wall
    clock ``time`` and the metrics. ``step`` counts the optimiser steps taken; a ``train``
    record's ``epoch`` is the epoch in progress, from 0, and its ``lr`` the learning rate its last
    step used; an ``eval`` record's ``epoch`` is the epochs completed (the evaluation after the
    first epoch says 1, as the printed line does). A resumed run appends to the same file, after cutting off a
    last line torn by the killed run (else the first new record would run on from it and both be
    lost). TensorBoard events go to ``<run>/tensorboard`` when ``tensorboard=True`` and the
    ``tensorboard`` package is importable.

    A run resumed from its checkpoint of step ``k`` takes the later steps again and records them
    again: the records a killed run wrote after that checkpoint (or after the one a resume fell
    back to, past a torn newer one) are cut from the file first (``dropped`` counts them), and
    TensorBoard's events after ``k`` are purged, so both read as the unbroken run's.

    Args:
        run_dir: the run's folder (created if missing); the file is opened for appending at once.
        tensorboard: also write TensorBoard scalars (silently skipped without the package).
        resume_step: the step the run continues from: records (and TensorBoard events) of later
            steps are cut (0 for a run that starts over in a folder without a checkpoint);
            ``None`` appends to whatever the file holds.

    Raises:
        TypeError: ``run_dir`` neither a ``str`` nor an ``os.PathLike`` (``''`` is a ValueError).
        ValueError: ``resume_step`` not an integer >= 0.
        OSError: ``metrics.jsonl`` is a symbolic link: refused, not written through
            (:func:`~torchvote.files.open_no_follow`; a linked run folder is fine).
    """

    def __init__(
        self, run_dir: str | Path, *, tensorboard: bool = False, resume_step: int | None = None
    ) -> None:
        if resume_step is not None:  # "3" failed in a comparison deep in the file's records
            check_positive_int(resume_step, "resume_step", minimum=0)
        self.path = as_path(run_dir, "run_dir") / "metrics.jsonl"
        make_folder(self.path.parent)
        _drop_torn_last_line(self.path)
        self.dropped = 0 if resume_step is None else _drop_records_after(self.path, resume_step)
        append = os.O_WRONLY | os.O_APPEND | os.O_CREAT
        self._file = os.fdopen(open_no_follow(self.path, append), "a", encoding="utf-8")
        self.tensorboard_dir: Path | None = None
        self._writer: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional
                pass
            else:
                self.tensorboard_dir = self.path.parent / "tensorboard"
                purge_step = None if resume_step is None else resume_step + 1  # events after it
                self._writer = SummaryWriter(log_dir=str(self.tensorboard_dir), purge_step=purge_step)

    def write(self, event: str, step: int, metrics: Mapping[str, Any], **context: Any) -> None:
        """Append one record (and its scalars to TensorBoard).

        Raises:
            ValueError: a metric that is a tensor of more than one value (torch's error named
                no metric), checked before anything is written.
            TypeError: a metric or context value JSON cannot hold (json's "Object of type ... is
                not JSON serializable" named none), or a metric name that is no string, checked
                before anything is written.
        """
        for key, value in metrics.items():
            if isinstance(value, torch.Tensor) and value.numel() != 1:
                raise ValueError(
                    f"metric {key!r} must be one number, got a tensor of shape {tuple(value.shape)}"
                )
        record = {"event": event, "step": step, **context, "time": round(time.time(), 3)}
        record.update({key: _plain(value) for key, value in metrics.items()})
        try:
            line = json.dumps(record)
        except (TypeError, ValueError) as error:  # ValueError: a value that holds itself
            key = next(key for key, value in record.items() if not _json_holds({key: value}))
            if not _json_holds({key: None}):  # json's own: "keys must be str, int, ..."
                raise TypeError(f"metric names must be strings, got {key!r}") from error
            what = "metric" if key in metrics else "context value"
            raise TypeError(
                f"{what} {key!r} must be a number, a string or a list or dict of them, got "
                f"{type(record[key]).__name__}"
            ) from error
        self._file.write(line + "\n")
        self._file.flush()
        if self._writer is not None:
            prefix = f"{event}/{context['dataset']}" if "dataset" in context else event
            for key, value in metrics.items():
                value = _plain(value)
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._writer.add_scalar(f"{prefix}/{key}", value, step)
            self._writer.flush()

    def sync(self) -> None:
        """Make the records written so far durable (``os.fsync``). The loop calls it before each
        checkpoint, which is fsynced: after a power loss a checkpoint could otherwise survive the
        records of its own steps, and a resume drops only records after the checkpoint, never
        fills a gap before it."""
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()
        if self._writer is not None:
            self._writer.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _drop_torn_last_line(path: Path) -> None:
    """Cut off an unterminated last line of ``path``: every record is written with its newline,
    so one without is a record torn by a killed process."""
    if not path.is_file():
        return
    with os.fdopen(open_no_follow(path, os.O_RDWR), "rb+") as handle:
        content = handle.read()
        if content and not content.endswith(b"\n"):
            handle.truncate(content.rfind(b"\n") + 1)


def _drop_records_after(path: Path, step: int) -> int:
    """Cut the records of steps after ``step`` out of ``path`` (atomically); lines that do not
    parse are left as they are.

    Args:
        path: the ``metrics.jsonl`` file (nothing happens if it does not exist).
        step: the step the run continues from.

    Returns:
        How many records were cut.
    """
    if not path.is_file():
        return 0
    lines = path.read_bytes().splitlines(keepends=True)
    kept = [line for line in lines if _record_step(line) <= step]
    if len(kept) < len(lines):
        atomic_write_bytes(path, b"".join(kept))
    return len(lines) - len(kept)


def _record_step(line: bytes) -> float:
    """The ``step`` of a metrics record; ``-inf`` for a line that is no record with a step."""
    try:
        record = json.loads(line)
    except ValueError:
        return -math.inf
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else -math.inf


def _scalar(value: Any) -> Any:
    """A NumPy scalar or one-element tensor as the Python number it holds (in a table an accuracy
    of ``np.float32(0.5)`` printed ``0.5`` and a tensor ``tensor(0.5000)``, not ``50.00%``);
    anything else as it is."""
    one_number = isinstance(value, np.generic) or (isinstance(value, torch.Tensor) and value.numel() == 1)
    return value.item() if one_number else value


def _json_holds(value: Any) -> bool:
    """Whether ``json.dumps`` writes ``value``."""
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _plain(value: Any) -> Any:
    """A metric as JSON takes it: a Python number rounded to 6 digits, ``"nan"`` / ``"inf"``."""
    value = _scalar(value)
    if isinstance(value, float):
        return round(value, 6) if math.isfinite(value) else str(value)
    return value


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file, in order.

    A last line that does not parse is a record torn by a run killed mid-write (it is still
    being written, or the run was not resumed): skipped silently. Any other line that does not
    parse is skipped with a warning naming the file and the line: the file was damaged, or
    written by an older :class:`MetricsWriter` that appended a resumed run's first record to the
    torn line. The log stays readable either way (a resumed run reads it to reuse its final
    evaluations, the plots read it), so it warns rather than raises.

    Args:
        path: the ``metrics.jsonl`` file.

    Returns:
        One dictionary per line that parses as JSON, blank lines and unparsable ones left out.

    Raises:
        TypeError: ``path`` neither a ``str`` nor an ``os.PathLike`` (``''`` is a ValueError).
        FileNotFoundError: ``path`` does not exist.

    Warns:
        RuntimeWarning: a line other than the last does not parse as JSON, or a line is JSON but
            not an object (skipped).
    """
    records = []
    lines = as_path(path, "path").read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if number < len(lines):
                warnings.warn(
                    f"{path}: line {number} is not JSON ({err.msg} at column {err.colno}); skipped it. "
                    "Only the last line may be torn (a run killed mid-write)",
                    RuntimeWarning,
                    stacklevel=2,
                )
            continue
        if isinstance(record, dict):
            records.append(record)
        else:  # JSON, but no record: every reader takes fields by name
            warnings.warn(
                f"{path}: line {number} is a JSON {type(record).__name__}, not a record (an object); "
                "skipped it",
                RuntimeWarning,
                stacklevel=2,
            )
    return records


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    """A plain-text table: one row per mapping, one column per key (first row's order).

    Floats in [0, 1] named ``*accuracy`` print as percentages; other floats with 4 decimals, whole
    ones too (a loss of 2.0 prints ``2.0000``, as its column's other values); integers as they are.

    Args:
        rows: the rows, each a mapping of column name to value (``None`` or a missing key prints
            ``-``).
        columns: the columns to show, in order; default every key of every row, in the order
            they first appear.

    Returns:
        The table: a header line, a rule and one line per row, numeric columns right-aligned;
        ``"(no results)"`` when ``rows`` is empty. NumPy and one-element tensor numbers print as
        Python's.

    Raises:
        TypeError: ``rows`` not a sequence of mappings, or ``columns`` one string (it was read as
            one column per character).
    """
    if isinstance(rows, (str, bytes, Mapping)) or not isinstance(rows, Sequence) or not all(
        isinstance(row, Mapping) for row in rows
    ):
        raise TypeError(f"rows must be a list of mappings (column -> value), got {type(rows).__name__}")
    if not rows:
        return "(no results)"
    if columns is None:
        columns = list(dict.fromkeys(key for row in rows for key in row))
    else:
        columns = list(check_texts(columns, "columns"))

    def cell(key: str, value: Any) -> str:
        value = _scalar(value)
        if value is None:
            return "-"
        if isinstance(value, float):
            if str(key).endswith("accuracy") and 0.0 <= value <= 1.0:
                return f"{100 * value:.2f}%"
            return f"{value:.4f}"
        return str(value)

    body = [[cell(key, row.get(key)) for key in columns] for row in rows]
    headers = [str(key) for key in columns]  # a row's keys may be any hashable (an int failed here)
    widths = [max(len(header), *(len(line[i]) for line in body)) for i, header in enumerate(headers)]
    numeric = [  # a missing value ("-") does not make a column of numbers text
        any(_is_number(_scalar(row.get(key))) for row in rows)
        and all(_is_number(_scalar(row.get(key))) or row.get(key) is None for row in rows)
        for key in columns
    ]

    def render(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if n else c.ljust(w) for c, w, n in zip(cells, widths, numeric, strict=True)
        ).rstrip()

    lines = [render(headers), "  ".join("-" * w for w in widths)]
    lines += [render(line) for line in body]
    return "\n".join(lines)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
