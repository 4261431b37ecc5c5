"""The experiments of docs/results.md: the papers' tables and the articles' claim, rerunnable.

* :mod:`~torchvote.experiments.rows` -- each row as data (variants, metrics, budgets).
* :mod:`~torchvote.experiments.runner` -- :func:`reproduce`: every variant and seed, resumable.
* :mod:`~torchvote.experiments.report` -- mean, spread and count over every seed run.
* :mod:`~torchvote.experiments.pretrained_routing` -- row h: a pretrained encoder's attention run
  as several passes of voting.

``torchvote reproduce NAME`` is the command line.
"""

from torchvote.experiments.report import summarize, write_summary
from torchvote.experiments.rows import BUDGETS, Metric, Row, Variant, get_row, list_rows
from torchvote.experiments.runner import check_request, reproduce, run_dir_of, select_variants, train_command

__all__ = [
    "BUDGETS",
    "Metric",
    "Row",
    "Variant",
    "get_row",
    "list_rows",
    "check_request",
    "reproduce",
    "run_dir_of",
    "select_variants",
    "summarize",
    "train_command",
    "write_summary",
]
