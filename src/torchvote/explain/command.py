"""``torchvote explain [SENTENCE ...] [--out DIR] [--checkpoint RUN] [--device auto]``: the report from
the command line.

``--checkpoint`` takes a record file (``.safetensors`` / ``.pt`` of named tensors), or a training
run's folder, its ``checkpoints/`` folder or one checkpoint's file (``step-N.safetensors`` /
``step-N.state.pt``), from which :func:`torchvote.explain.from_run.record_from_run` makes the
record. ``--device`` is where the pretrained encoder runs (``auto``: CUDA where torch sees it),
and where a training checkpoint's model makes its record (returned on the CPU, where the
pictures are drawn).

Exit statuses, as ``torchvote --help`` lists them: 2 when the command line is wrong (a bad option
or value, an ``--out`` in the way, a ``--checkpoint`` that does not exist or is a folder that holds
no run and no record), 1 when running failed, that is once the options passed their checks
(:func:`torchvote.cli.mark_running`): a checkpoint or record that cannot be read or drawn, a run
stopped before its first checkpoint, a file error, a missing optional package.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from torchvote.cli import (
    DEVICE_HELP,
    EXIT_FAILURE,
    check_checkpoint_argument,
    exit_status_of,
    is_running,
    mark_running,
    resolve_device_option,
)
from torchvote.files import file_in_the_way, folder_failure

if TYPE_CHECKING:
    import torch
    from torch import Tensor

__all__ = ["add_explain_arguments", "run_explain"]


def add_explain_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``explain`` arguments to ``parser`` and return it.

    Args:
        parser: an (sub)parser.

    Returns:
        ``parser``.
    """
    parser.add_argument(
        "sentences",
        nargs="*",
        metavar="SENTENCE",
        help="sentences to explain (default: the reference articles' examples)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("runs/explain"),
        metavar="DIR",
        help="folder for index.html and the PNG/SVG files (default: runs/explain)",
    )
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        metavar="RUN",
        help="a training run's folder (e.g. runs/main-...) of a capsnet or efficient-capsnet model, its "
        "checkpoints/ folder or one checkpoint's file (step-N.safetensors or step-N.state.pt), or a "
        "record of its tensors (.safetensors/.pt): adds routing, reconstruction and perturbation pictures",
    )
    parser.add_argument(
        "--layer", type=int, default=2, help="layer shown in the heatmaps and made to route (default: 2)"
    )
    parser.add_argument(
        "--iterations",
        type=_pass_count,
        nargs="+",
        default=[2, 3, 5],
        metavar="R",
        help="passes of voting for the routing variant (default: 2 3 5)",
    )
    parser.add_argument("--device", default="auto", help=DEVICE_HELP)
    return parser


def _pass_count(text: str) -> int:
    """argparse type of ``--iterations``: an integer (its range is checked with the rest).

    Raises:
        argparse.ArgumentTypeError: ``text`` is no integer; the message says that a sentence
            after the option's values is read as one of them.
    """
    try:
        return int(text)
    except ValueError:
        try:
            float(text)  # a number all the same ('2.5'): nothing was misplaced
            hint = ""
        except ValueError:
            hint = " (a sentence after --iterations is read as one of its values: put the sentences first)"
        raise argparse.ArgumentTypeError(f"expected whole numbers of passes, got {text!r}{hint}") from None


_TITLE = "torchvote explain: attention as weighted voting"


def _check_out_dir(out_dir: Path) -> None:
    """``--out`` is a folder, or will be one, that is new, empty or holds a report this command
    wrote (rewritten on each run): a user's own page or pictures there (``--out .``: an
    ``index.html``, a ``couplings.png``) were overwritten.

    Raises:
        ValueError: naming ``--out`` and what is in the way.
    """
    blocking = file_in_the_way(out_dir)
    if blocking is not None:  # a parent too: it failed after the pictures were drawn
        raise ValueError(f"--out: {blocking} is a file; expected a folder for index.html and the pictures")
    from torchvote.explain.report import STAGING_PREFIX

    page = out_dir / "index.html"
    others = [] if not out_dir.is_dir() else [
        entry for entry in out_dir.iterdir() if not entry.name.startswith(STAGING_PREFIX)  # a killed run's
    ]
    if not page.exists() and others:
        raise ValueError(
            f"--out: {out_dir} holds other files and no explain report; its pictures would overwrite "
            "files of the same names: choose a new or empty folder"
        )
    if page.exists():
        with open(page, "rb") as file:
            head = file.read(4096)
        if f"<title>{_TITLE}</title>".encode() not in head:
            raise ValueError(
                f"--out: {page} exists and is not a torchvote explain report; it would be "
                "overwritten: choose another folder"
            )


class _RunFailure(Exception):
    """A failure while running (exit status 1), its message for the user."""


def _make_out_dir(out_dir: Path) -> None:
    """Make ``--out`` (and its parents), naming it if that fails.

    Raises:
        _RunFailure: the folder cannot be made (a read-only current folder under the default
            ``runs/explain``, a current folder deleted ...): the message names ``--out``, the
            folder as given and absolute, and why; it said only "[Errno 30] Read-only file
            system: 'runs'".
    """
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise _RunFailure(f"--out: cannot make the folder {folder_failure(out_dir, error)}") from error


def _load_checkpoint(path: Path, device: torch.device) -> dict[str, Tensor]:
    """The record ``--checkpoint`` names (:func:`torchvote.explain.record.load_record`), a
    training checkpoint's model run on ``device`` (``--device``), the tensors returned on the CPU.

    Raises:
        _RunFailure: anything ``load_record`` refuses (a file that is neither a record nor a
            training checkpoint's, a folder that is no run's, a damaged file ...), its message
            led by ``--checkpoint``.
    """
    from torchvote.explain.record import load_record

    try:
        return load_record(path.expanduser(), device=device)
    except (ValueError, TypeError, OSError) as error:
        raise _RunFailure(f"--checkpoint: {error}") from error


def _checkpoint_named(location: Path) -> str:
    """``": capsnet at step N (path)"`` for a training checkpoint, ``""`` for a record file (or
    where the train extra that reads checkpoints is missing)."""
    try:
        from torchvote.training.evaluation import checkpoint_summary

        return f": {checkpoint_summary(location)}"
    except (ValueError, OSError, ImportError):  # a record, not a checkpoint: the path alone names it
        return ""


def run_explain(args: argparse.Namespace) -> int:
    """Write the report; print its path.

    Args:
        args: parsed by :func:`add_explain_arguments`.

    Returns:
        The exit status: 0; 2 (a usage error) when the command line is wrong: a bad option or
        value, an ``--out`` in the way, a ``--checkpoint`` that does not exist or is a folder
        holding neither a run nor a record; 1 when running failed, that is any error once the
        options passed their checks (:func:`torchvote.cli.mark_running`; ``args`` marked
        running before the call, as ``torchvote main`` marks its report's, counts every error as
        running's): a checkpoint or record that cannot be read or drawn, a run stopped before its
        first checkpoint, a file error, a missing optional package. A line on standard error
        says which.
    """
    from torchvote.explain.report import HtmlReport

    out_dir, report = Path(args.out), None
    had_folder = out_dir.exists()
    try:
        # Every check first, so that a refusal leaves no folder behind and costs no slow step.
        _check_out_dir(out_dir)
        from torchvote.explain.sentences import check_iterations, check_layer, explain_sentences
        from torchvote.pretrained import load_pretrained

        blank = next((index for index, sentence in enumerate(args.sentences) if not sentence.strip()), None)
        if blank is not None:  # named as the command line shows them, not as sentences[0]
            raise ValueError(f"SENTENCE {blank + 1} is empty ({args.sentences[blank]!r}): give a word")
        iterations = check_iterations(args.iterations, "--iterations")
        device = resolve_device_option(args.device)
        if args.checkpoint is not None:
            check_checkpoint_argument(args.checkpoint, "--checkpoint", records=True)
        try:
            model = load_pretrained("all-MiniLM-L6-v2", device=device)
        except ModuleNotFoundError as error:
            if args.checkpoint is None:
                raise
            model = None  # the routing pictures of --checkpoint need no encoder: drawn without it
            print(f"torchvote explain: notice: no sentence section ({error})", file=sys.stderr)
        except ValueError as error:  # the packaged weights do not fit: not the command line's doing
            raise _RunFailure(f"the pretrained encoder: {error}") from error
        layer = None if model is None else check_layer(args.layer, len(model.layers), "--layer")
        mark_running(args)  # the command line's values passed their checks: an error from now on is running's
        record = None
        if args.checkpoint is not None:
            record = _load_checkpoint(Path(args.checkpoint), device)  # its tensors checked too
        _make_out_dir(out_dir)
        report = HtmlReport(_TITLE, out_dir)
        if record is not None:  # the page says what it shows (one --out serves every call)
            named = _checkpoint_named(args.checkpoint)
            report.text(f"Capsule pictures from --checkpoint {args.checkpoint}{named}.")
        if model is not None:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                explain_sentences(
                    args.sentences or None,
                    args.out,
                    model=model,
                    layer=layer,
                    iterations=iterations,
                    report=report,
                )
            for warning in caught:
                print(f"torchvote explain: notice: {warning.message}", file=sys.stderr)
        if record is not None:
            from torchvote.explain.record import explain_record

            for notice in explain_record(record, report):
                print(f"torchvote explain: {notice}", file=sys.stderr)
        path = report.write()
    except ModuleNotFoundError as error:
        _discard_pictures(report, out_dir, had_folder)
        print(f"torchvote explain: missing optional dependency: {error}", file=sys.stderr)
        return EXIT_FAILURE
    except (ValueError, TypeError, OSError, _RunFailure) as error:
        _discard_pictures(report, out_dir, had_folder)
        if os.environ.get("TORCHVOTE_DEBUG"):
            raise
        message = " ".join(str(error).split())  # one line
        print(f"torchvote explain: error: {message}", file=sys.stderr)
        return exit_status_of(error, running=is_running(args))  # a ValueError before: usage, 2
    except BaseException:  # Ctrl-C, or an error of another kind: the staged pictures go too
        _discard_pictures(report, out_dir, had_folder)
        raise
    print(f"report: {path.resolve()}")
    return 0


def _discard_pictures(report, out_dir: Path, had_folder: bool) -> None:
    """After a failure while drawing: drop the report's staged pictures (the folder keeps the page
    and pictures it held), and the folder if this run made it and left it empty."""
    if report is not None:
        report.discard()
    if not had_folder and out_dir.is_dir() and not any(out_dir.iterdir()):
        out_dir.rmdir()


def main(argv: list[str] | None = None) -> int:
    """``python -m torchvote.explain.command``: the same as ``torchvote explain``."""
    parser = add_explain_arguments(argparse.ArgumentParser(prog="torchvote explain", description=__doc__))
    return run_explain(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
