"""The ``torchvote`` command line.

::

    torchvote main [key=value ...]                      # the README's main job
    torchvote --version
    torchvote demo                                      # the operator as attention and routing
    torchvote train PRESET [key=value ...]              # PRESET: a shipped name or a .yaml path
    torchvote train --resume RUN_DIR [key=value ...]    # continue a stopped run
    torchvote evaluate CHECKPOINT [--on mnist --on affnist-style]   # default: the run's own sets
    torchvote generate RUN_DIR --prompt "To be" [--temperature 0.8 --top-p 0.9 --samples 3]
    torchvote generate RUN_DIR --prompt 12345 --prompt 907       # a seq2seq run decodes sources
    torchvote reproduce NAME [--budget cpu|paper] [--seeds 0 1 2]   # a row of docs/results.md
    torchvote list [models|routers|presets|datasets]
    torchvote data [list|mnist|affnist|shakespeare] [--download] [--verify]
    torchvote explain [SENTENCE ...] [--checkpoint RUN_DIR]          # offline HTML report
    torchvote bench attention|em|generation|routing|training [args ...]

The same ``train`` command runs on N processes with
``torchrun --nproc_per_node=N -m torchvote.cli train PRESET ...`` (``batch_size`` is global).

Status 2 means the command line itself is wrong, 1 that it was fine but running it failed: the line
between them is where a command's checks end and its work begins (:func:`mark_running`). A bad
option, name, key or value prints one line saying what exists and exits with status 2 (a key given
twice, too: ``epochs=1 epochs=2`` is refused, not settled by order; a folder that holds no run); missing
data prints where it was looked for and the command that provides it (status 1), and so does every
other failure while running, in one line: training diverged, out of memory, a damaged checkpoint, a
run stopped before its first checkpoint, a file or download error, a missing optional package, any
error raised once the work has begun (status 1). A run stopped with Ctrl-C saves a checkpoint and exits
with status 130 (143 after a SIGTERM, 128 plus the signal's number as a shell reports it).
``TORCHVOTE_DEBUG=1`` shows tracebacks. ``torchvote --help`` ends with the table of exit statuses
(:data:`EXIT_STATUSES`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchvote import __version__

if TYPE_CHECKING:
    import torch

__all__ = [
    "EXIT_STATUSES",
    "build_parser",
    "check_checkpoint_argument",
    "exit_status_of",
    "is_running",
    "main",
    "mark_running",
    "resolve_device_option",
]

EXIT_FAILURE = 1  # the command line was fine; running it failed
EXIT_USAGE = 2  # the command line itself is wrong (argparse's status)
EXIT_MISSING_DATA = EXIT_FAILURE
EXIT_BROKEN_PIPE = EXIT_FAILURE
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 128 + int(signal.SIGTERM)  # 143, as torchvote.training.stopping.exit_status says

#: The exit statuses ``main`` returns, as the epilog of ``torchvote --help`` lists them. The rule:
#: the command line itself is wrong -> 2; the command line is fine but running it failed -> 1. The
#: line between them is where each command's checks end and its work begins (:func:`mark_running`).
EXIT_STATUSES = f"""exit status (2: the command line itself is wrong; 1: it is fine, but running it failed):
  0    success
  {EXIT_FAILURE}    a failure while running: missing data (the message says where it looked and what
       fetches it); training diverged; out of memory; a file that exists but cannot be read as
       what it should be (a damaged checkpoint), a run stopped before its first checkpoint; a
       write or download error; a missing optional package; data --verify found a copy that
       differs from the published set; the output's reader left (broken pipe); any error once
       the command's checks passed and its work began (a bad value met in a training step, say);
       a traceback (an unexpected error, or any error under TORCHVOTE_DEBUG=1)
  {EXIT_USAGE}    a usage error, found before the work begins: a bad option, name, key or value (a
       device this machine does not have, a checkpoint or run folder named that does not exist or
       holds no run, a key given twice, a config value the data or model refuse while the run is
       set up ...; evaluate and data NAME check values as they load: a bad value there is one)
  {EXIT_INTERRUPTED}  Ctrl-C (train, main and reproduce save a checkpoint first)
  {EXIT_TERMINATED}  SIGTERM: train, main and reproduce save a checkpoint and exit with it (it kills the
       other commands, which a shell reports as {EXIT_TERMINATED} too)
bench exits with its script's status (128 + N when signal N ended it, as a shell reports it)."""
#: The help of ``--device`` where its default is ``auto`` (evaluate, generate, reproduce, demo, explain).
DEVICE_HELP = "auto (default), cpu, cuda or cuda:<index>"
LIST_WHAT = ("models", "routers", "presets", "datasets")
BENCHMARKS = ("attention", "em", "generation", "routing", "training")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and still exit status 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``torchvote`` parser, its subcommands and their options (imports torch)."""
    from torchvote.data.command import DESCRIPTION as data_description
    from torchvote.data.command import add_data_arguments
    from torchvote.explain.command import add_explain_arguments

    parser = _Parser(
        prog="torchvote",
        description="Train and evaluate attention and capsule models.",
        epilog=EXIT_STATUSES,
        formatter_class=argparse.RawDescriptionHelpFormatter,  # the epilog's table as written
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    main_job = commands.add_parser("main", help="train the default preset, evaluate it, print the results")
    main_job.add_argument("overrides", nargs="*", metavar="key=value", help="overrides of the main preset")
    main_job.add_argument("--device", help="auto (cuda if available), cpu, cuda or cuda:<index>")
    main_job.add_argument(
        "--no-report",
        action="store_true",
        help="skip the explain report (attention and routing pictures) at the end",
    )

    demo = commands.add_parser("demo", help="the voting operator as attention and as routing on MNIST")
    demo.add_argument(  # --out as explain and reproduce spell it; --output-dir, its first name, kept
        "--out",
        "--output-dir",
        dest="output_dir",
        metavar="DIR",
        default="runs/demo",
        help="this folder: the plots go straight into it (default: runs/demo)",
    )
    demo.add_argument("--no-plots", action="store_true", help="print only")
    demo.add_argument("--device", default="auto", help=DEVICE_HELP)

    train = commands.add_parser("train", help="train from a preset with key=value overrides")
    train.add_argument(
        "args",
        nargs="*",
        metavar="PRESET [key=value ...]",
        help="a shipped preset (torchvote list presets) or a .yaml file, then overrides "
        "such as epochs=3 optim.lr=3e-4 model.dropout=0.2 (each key once)",
    )
    train.add_argument("--device", help="auto (cuda if available), cpu, cuda or cuda:<index>")
    train.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR (the folder holding checkpoints/) from its latest "
        "checkpoint; overrides may change only what does not change the weights (epochs, eval_on ...), "
        "and are saved in RUN_DIR/config.yaml: a later --resume keeps them",
    )

    evaluate = commands.add_parser(
        "evaluate",
        help="evaluate a checkpoint on test sets",
        description="Rebuild the model of a checkpoint and print one row per --on data set (its test "
        "split): accuracy, loss and the number of examples (plus task extras such as "
        "sequence_accuracy). The loss is the run's own objective at the checkpoint's step, as "
        "training's table reports it; the weights record the run's loss settings and length, so a "
        ".safetensors file copied alone reports it too (a checkpoint written before they did reads "
        "them from the training state, <name>.state.pt, beside the weights).",
    )
    evaluate.add_argument("checkpoint", help="a run folder, its checkpoints folder or a .safetensors file")
    evaluate.add_argument(
        "--on",
        action="append",
        metavar="DATASET",
        help="data set to evaluate on (repeat or comma-separate; torchvote list datasets), with "
        "options of its own as in eval_on (affnist-style:canvas=28) and its split (default test: "
        "mnist:split=train); default: the run's own data sets, as its training evaluated them "
        "(its data set and eval_on, with its data options, root and eval_limit)",
    )
    evaluate.add_argument(
        "--limit",
        type=int,
        metavar="N",
        help="evaluate on the first N examples only (of a text stream: its first N tokens, cut into "
        "the model's context windows, which the table's examples column counts); default: every "
        "example (without --on: the run's own data.eval_limit)",
    )
    evaluate.add_argument(
        "--batch-size", type=int, default=500, metavar="N", help="examples per batch (default: 500)"
    )
    evaluate.add_argument("--device", default="auto", help=DEVICE_HELP)
    precision = evaluate.add_mutually_exclusive_group()  # one autocast dtype
    precision.add_argument("--bf16", action="store_true", help="evaluate under bfloat16 autocast")
    precision.add_argument(
        "--fp16", action="store_true", help="evaluate under float16 autocast (GPUs without fast bfloat16)"
    )
    evaluate.add_argument(
        "--root",
        metavar="DIR",
        help="folder of the data files (MNIST IDX files ...); default: $TORCHVOTE_DATA/<data set>, else "
        "~/.cache/torchvote/<data set> (without --on: the run's own data.root, if it set one)",
    )
    evaluate.add_argument(
        "--data-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keyword argument of the data sets, e.g. max_len=6 (repeatable)",
    )

    generate = commands.add_parser(
        "generate",
        help="continue text with a language model run, or decode sources with a seq2seq run",
        description="Rebuild the model of a checkpoint and generate: a language model "
        "(transformer-lm) continues each --prompt, sampling one character at a time with its "
        "key/value cache (--samples continuations each); a seq2seq model trained on a sequence task "
        "decodes each --prompt greedily, one output per source (digits for copy, reverse and sort; "
        "12+34 for addition, whose = is added). The texts go to standard output, the "
        "checkpoint's summary to standard error; a language model's text appears as it is written "
        "(with --samples above 1, each prompt's continuations as soon as they are complete). The "
        "sampling options are a language model's.",
    )
    generate.add_argument("checkpoint", help="a run folder, its checkpoints folder or a .safetensors file")
    generate.add_argument(
        "--prompt",
        action="append",
        default=[],
        metavar="TEXT",
        help="text to continue, or a source to decode (repeatable); a language model's default is "
        "a newline (the vocabulary's first character if it has none)",
    )
    generate.add_argument(
        "--max-new-tokens",
        type=int,
        metavar="N",
        help="tokens to add (default: 200 for a language model; for seq2seq its longest target, "
        "also its most)",
    )
    generate.add_argument(
        "--temperature",
        type=float,
        metavar="T",
        help="language models: divides the logits; 0: greedy (default 1)",
    )
    generate.add_argument(
        "--top-k",
        type=int,
        metavar="K",
        help="language models: sample among the K most likely tokens (default: off, every token)",
    )
    generate.add_argument(
        "--top-p",
        type=float,
        metavar="P",
        help="language models: sample within the smallest set of most likely tokens whose "
        "probability reaches P (0 < P <= 1; default: off, every token)",
    )
    generate.add_argument(
        "--samples", type=int, metavar="N", help="language models: continuations per prompt (default 1)"
    )
    generate.add_argument(
        "--seed",
        type=int,
        metavar="N",
        help="language models: seed of the sampling, afresh for each prompt, so a command repeats its text "
        "(default: unseeded, a new text each time)",
    )
    generate.add_argument("--device", default="auto", help=DEVICE_HELP)
    precision = generate.add_mutually_exclusive_group()  # one autocast dtype
    precision.add_argument("--bf16", action="store_true", help="generate under bfloat16 autocast")
    precision.add_argument(
        "--fp16", action="store_true", help="generate under float16 autocast (GPUs without fast bfloat16)"
    )
    generate.add_argument(
        "--no-cache",
        action="store_true",
        help="rerun the whole context for every token (same text, slower; for comparison)",
    )

    listing = commands.add_parser("list", help="list models, routers, presets or data sets")
    listing.add_argument("what", nargs="?", choices=LIST_WHAT, help="what to list (default: everything)")

    data = commands.add_parser(
        "data", help="prepare and verify the offline data", description=data_description
    )
    add_data_arguments(data)

    reproduce = commands.add_parser(
        "reproduce",
        help="rerun an experiment of docs/results.md (resumes where it stopped)",
        description="Train every variant and seed of an experiment of docs/results.md, then print its "
        "summary table (written to <out>/<name>/<budget>/summary.md). Runs that finished are not "
        "run again; after Ctrl-C (or a killed process) run the same command again: the stopped run "
        "resumes from its last checkpoint.",
    )
    reproduce.add_argument("name", nargs="?", help="the experiment (torchvote reproduce --list)")
    reproduce.add_argument(
        "--list",
        action="store_true",
        help="list the experiments; with NAME, its variants (as --variant, --budget and --seeds choose)",
    )
    reproduce.add_argument(
        "--budget",
        default="cpu",
        choices=("cpu", "paper"),
        help="cpu (default): minutes per run on a laptop (a row of many variants and seeds takes "
        "hours); paper: the papers' sizes (for a GPU)",
    )
    reproduce.add_argument("--seeds", type=int, nargs="+", metavar="N", help="seeds to run (default: 0 1 2)")
    reproduce.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="TEXT",
        help="run only variants whose label (uniform / MNIST) or run folder (uniform-mnist) contains "
        "TEXT (repeatable)",
    )
    reproduce.add_argument(
        "--out",
        default="runs/reproduce",
        metavar="OUT",
        help="the parent folder: runs go to OUT/NAME/BUDGET/VARIANT/seed-N, the summary to "
        "OUT/NAME/BUDGET/summary.md (default: runs/reproduce)",
    )
    reproduce.add_argument("--device", default="auto", help=DEVICE_HELP)
    reproduce.add_argument(
        "--dry-run",
        action="store_true",
        help="print the training commands only (as they would run: run folder and device included; "
        "runs that finished earlier are marked '# finished')",
    )

    explain = commands.add_parser(
        "explain", help="write an offline HTML report of attention and routing (pretrained encoder)"
    )
    add_explain_arguments(explain)

    bench = commands.add_parser("bench", help="run a benchmark script from benchmarks/")
    bench.add_argument("name", choices=BENCHMARKS)
    rest = bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the benchmark script")
    rest.required = False  # argparse makes a REMAINDER positional required: "required: name, args"
    return parser


def _explain(args: argparse.Namespace) -> int:
    from torchvote.explain.command import run_explain

    return run_explain(args)


def _demo(args: argparse.Namespace) -> int:
    from torchvote.demo import run_demo
    from torchvote.files import file_in_the_way
    from torchvote.validation import as_path

    device = resolve_device_option(args.device)  # before MNIST is read
    blocking = None if args.no_plots else file_in_the_way(as_path(args.output_dir, "--out"))
    if blocking is not None:  # as run_demo would refuse it, named as the command line names it
        raise ValueError(f"--out: {blocking} is a file; expected a folder for the plots")
    mark_running(args)  # the options it passes on are checked: run_demo's refusals are its own
    run_demo(output_dir=args.output_dir, make_plots=not args.no_plots, device=device)
    return 0


def resolve_device_option(name: str, argument: str = "--device") -> torch.device:
    """The device a ``--device`` option names (``explain``, ``demo``): checked by
    :func:`~torchvote.validation.check_device_name` (the rule ``train``, ``evaluate`` and
    ``generate`` check theirs by), then resolved by :func:`~torchvote.validation.resolve_device`
    (``auto``: CUDA where torch sees it). Both live outside :mod:`torchvote.training`, which
    imports omegaconf, so the commands that train nothing read the option the same way.

    Args:
        name: ``auto``, ``cpu``, ``cuda`` or ``cuda:<index>``.
        argument: the option's name, for the message.

    Returns:
        The ``torch.device``.

    Raises:
        ValueError: another name, or a CUDA device this machine does not have (a usage error:
            status 2), the message naming ``argument``.
    """
    from torchvote.validation import check_device_name, resolve_device  # no omegaconf: any command

    check_device_name(name, argument)
    try:
        return resolve_device(name)
    except ValueError as error:  # "device 'cuda' requested but CUDA is not available ..."
        raise ValueError(f"{argument}: {error}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); return the exit status.

    Ctrl-C ends any command with one line and status 130, also while torch is still importing
    (the first second or two): this module imports nothing heavy until here.
    """
    import warnings

    default_format, warnings.formatwarning = warnings.formatwarning, _format_warning
    escaped = _escape_what_the_output_cannot_encode()
    try:
        return _run_command(argv)
    except KeyboardInterrupt:  # before a command's own handler took over: parsing, importing torch
        if os.environ.get("TORCHVOTE_DEBUG"):
            raise
        print("torchvote: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        warnings.formatwarning = default_format
        for stream, errors in escaped:
            with contextlib.suppress(OSError, ValueError):  # its flush: a reader gone, a stream closed
                stream.reconfigure(errors=errors)


def _escape_what_the_output_cannot_encode() -> list[tuple[Any, str]]:
    """Make ``sys.stdout`` and ``sys.stderr`` write a character their encoding lacks as a
    backslash escape (their encoding kept); :func:`main` gives them their setting back at its end
    (a caller's streams, ``main`` called from Python, are left as they were).

    Under ``PYTHONIOENCODING=ascii`` (or a C / latin-1 locale) a path with ``é`` or ``运行`` in
    it raised UnicodeEncodeError at its print: a finished training reported "error: 'ascii'
    codec can't encode" with status 1 and lost its last lines, and evaluate's, a ValueError,
    came out as a usage error (status 2). An escaped path still says which file it is.

    Returns:
        ``(stream, errors)`` of each stream changed, with its setting before.
    """
    changed = []
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)  # a TextIOWrapper's; None: a test's object
        # "strict" only: surrogateescape (a C locale, PYTHONUTF8) writes a path's own bytes back
        if reconfigure is not None and getattr(stream, "errors", None) == "strict":
            changed.append((stream, stream.errors))
            reconfigure(errors="backslashreplace")
    return changed


def _format_warning(message, category, filename, lineno, line=None) -> str:  # noqa: ANN001 (warnings' own)
    """A warning as the command line shows it: one line, the message first. Python's format put a
    source path before torchvote's notes to the user and a line of its code after them; one raised
    outside torchvote's package keeps its origin at the end. (A warning torch raises from C++
    carries the line of Python that called it, which may be torchvote's.)"""
    import torchvote

    if Path(filename).resolve().is_relative_to(Path(torchvote.__file__).resolve().parent):
        return f"torchvote: warning: {message}\n"
    return f"warning: {message} ({category.__name__}, {filename}:{lineno})\n"


def _run_command(argv: Sequence[str] | None) -> int:
    # Transparent huge pages for PyTorch's large CPU tensors (read at its first allocation, so
    # before any): a capsule layer's step allocates and frees hundreds of MB of votes, and with
    # 4 KB pages the page faults alone took 20% of an EM layer's step on a 2-core CPU (4.5 s ->
    # 3.7 s, 360k -> 5k faults). THP_MEM_ALLOC_ENABLE=0 turns it off.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    prog = f"{parser.prog} {args.command}"
    if extra:  # overrides after an option (train PRESET --resume DIR epochs=3) are still overrides
        target = {"train": "args", "main": "overrides"}.get(args.command)
        if target is None or any(item.startswith("-") for item in extra):
            hint = _override_hint(list(sys.argv[1:] if argv is None else argv), extra) if target else ""
            parser.exit(
                EXIT_USAGE,
                f"{prog}: error: unrecognized arguments: {' '.join(extra)} ({hint}see {prog} --help)\n",
            )
        setattr(args, target, [*getattr(args, target), *extra])
    if args.command in ("train", "main") and args.device is not None:  # --device X: device=X
        target = "args" if args.command == "train" else "overrides"
        if any(item.partition("=")[0].strip() == "device" for item in getattr(args, target)):
            parser.exit(EXIT_USAGE, f"{prog}: error: --device and device= both given; give one\n")
        setattr(args, target, [*getattr(args, target), f"device={args.device}"])
    handlers = {
        "main": _main_job,
        "demo": _demo,
        "train": _train,
        "evaluate": _evaluate,
        "generate": _generate,
        "list": _list,
        "data": _data,
        "bench": _bench,
        "reproduce": _reproduce,
        "explain": _explain,
    }
    import torch

    from torchvote.data.errors import DataNotFoundError

    try:
        from torchvote.training.checkpoint import CheckpointError
        from torchvote.training.loop import TrainingDivergedError, TrainingOutOfMemoryError
    except ModuleNotFoundError:  # without the train extra: explain, list, data still run

        class TrainingDivergedError(Exception):  # never raised: no run trains
            pass

        TrainingOutOfMemoryError = CheckpointError = TrainingDivergedError

    try:
        return handlers[args.command](args)
    except DataNotFoundError as err:
        if os.environ.get("TORCHVOTE_DEBUG"):
            raise
        print(f"torchvote: {err}", file=sys.stderr)
        return EXIT_MISSING_DATA
    except KeyboardInterrupt:  # Ctrl-C outside a training loop (loading data, evaluating, drawing)
        if os.environ.get("TORCHVOTE_DEBUG"):
            raise
        print(f"torchvote {args.command}: interrupted", file=sys.stderr)  # not a traceback
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `torchvote list | head`: the reader left, nothing to say
        from torchvote.files import discard_output

        discard_output(sys.stdout)  # so that the exit's flush does not fail again
        return EXIT_BROKEN_PIPE
    except torch.cuda.OutOfMemoryError as err:  # out of device memory: one line, what to lower
        if os.environ.get("TORCHVOTE_DEBUG"):
            raise
        message = " ".join(str(err).split())  # torch's own is a paragraph
        if not isinstance(err, TrainingOutOfMemoryError) and getattr(args, "batch_size", None):
            message = f"the device ran out of memory: lower --batch-size (now {args.batch_size}); {message}"
        print(f"torchvote {args.command}: error: {message}", file=sys.stderr)
        return EXIT_FAILURE
    except (ValueError, OSError, ImportError, TrainingDivergedError) as err:  # ImportError: scipy for affNIST
        if os.environ.get("TORCHVOTE_DEBUG"):
            raise
        message = " ".join(str(err).split())  # one line
        extra = _EXTRA_OF_MODULE.get((getattr(err, "name", None) or "").partition(".")[0])
        if isinstance(err, ModuleNotFoundError) and extra and "pip install" not in message:
            message += f': pip install "torchvote[{extra}]"'
        print(f"torchvote {args.command}: error: {message}", file=sys.stderr)
        return exit_status_of(err, failures=(CheckpointError,), running=is_running(args))
    except RuntimeError as err:  # last: TrainingDivergedError is caught above, whatever its base
        if os.environ.get("TORCHVOTE_DEBUG") or "can't allocate memory" not in str(err):
            raise
        # the CPU allocator's refusal (the device's is torch.cuda.OutOfMemoryError): one line
        sizes = {"--batch-size": getattr(args, "batch_size", None),
                 "--samples": getattr(args, "samples", None)}
        lower = " or ".join(f"{flag} (now {value})" for flag, value in sizes.items() if value)
        hint = f": lower {lower}" if lower else ""
        message = " ".join(str(err).split())
        print(f"torchvote {args.command}: error: out of memory{hint}; {message}", file=sys.stderr)
        return EXIT_FAILURE


#: The attribute of a command's namespace that :func:`mark_running` sets.
_RUNNING = "torchvote_running"


def mark_running(args: argparse.Namespace, running: bool = True) -> None:
    """Say that the command of ``args`` passed its checks and began its work: from now on a
    ``ValueError`` it raises is a failure while running (status 1), no longer a usage error (2).

    Each command marks itself where its checks end (before, a ``ValueError`` is the command line's
    mistake): ``list`` at once; ``demo`` and ``reproduce`` once the options they pass on are
    checked; ``train`` and ``main`` once the run is set up (a config value the data or
    model refuse is found while the run is set up: still the command line's), ``generate`` at the
    first token it draws, ``data list`` at once, ``data NAME --verify`` once the data found was
    checked against ``--root`` (before it is read), ``explain`` when its options passed their
    checks; ``evaluate`` while it evaluates a data set, not while it loads the next (a data set
    that does not fit the model is the command line's ``--on``). Not marked, so every
    ``ValueError`` reads as the command line's: ``data NAME`` without ``--verify`` (it says where
    the data is, or downloads it), ``bench`` (its script's status is its own). Marking twice
    changes nothing.

    Args:
        args: the command's parsed arguments.
        running: False to say that the command checks the command line's values again (as
            ``evaluate`` does before each data set).
    """
    setattr(args, _RUNNING, running)


def is_running(args: argparse.Namespace) -> bool:
    """Whether :func:`mark_running` marked ``args``' command as running."""
    return bool(getattr(args, _RUNNING, False))


def exit_status_of(
    error: BaseException, failures: tuple[type[BaseException], ...] = (), *, running: bool = False
) -> int:
    """The exit status of a command that ``error`` ended (:data:`EXIT_STATUSES`' rule): 2 when
    the command line itself is wrong, 1 when it was fine but running it failed.

    Args:
        error: what the command raised.
        failures: types that are failures while running although they derive from ``ValueError``
            (:class:`~torchvote.training.CheckpointError`: a checkpoint found damaged, or none
            where one was expected).
        running: whether the command had passed its checks and begun its work when ``error``
            was raised (:func:`is_running`): any error is then a failure while running.

    Returns:
        :data:`EXIT_USAGE` (2) for a ``ValueError`` (a ``ConfigError`` included) raised before
        the work began: a bad option, name, key or value on the command line;
        :data:`EXIT_FAILURE` (1) for one raised while ``running``, and for anything else (a file
        or download error, a missing package, out of memory, a damaged data file
        (:class:`~torchvote.data.CorruptDataError`), ``failures``).

    Raises:
        Nothing: every error has a status.
    """
    from torchvote.data.errors import CorruptDataError  # here: the data package imports numpy

    if running or not isinstance(error, ValueError) or isinstance(error, (CorruptDataError, *failures)):
        return EXIT_FAILURE
    return EXIT_USAGE


#: The extra of pyproject.toml that installs a module a command may miss.
_EXTRA_OF_MODULE = {"omegaconf": "train", "yaml": "train", "tqdm": "train", "safetensors": "train",
                    "matplotlib": "plots", "tokenizers": "pretrained", "scipy": "affnist",
                    "tensorboard": "tensorboard"}


# --- train / main ---------------------------------------------------------------------------------


def _override_hint(argv: Sequence[str], extra: Sequence[str]) -> str:
    """``"overrides are key=value: epochs=3; "`` when an unrecognised option of ``train`` or ``main``
    names a config key (``--epochs 3``, ``--batch-size=64``, ``--optim.lr 1e-3``), else ``""``.

    argparse took ``--epochs 3`` for an unknown option (and ``3`` for an override), and said only
    "unrecognized arguments: --epochs".
    """
    from dataclasses import fields

    from torchvote.training.config import TrainConfig

    keys = {item.name for item in fields(TrainConfig)}
    for item in extra:
        name, equals, value = item.removeprefix("--").partition("=")
        key = name.replace("-", "_")
        if not item.startswith("--") or key.split(".")[0] not in keys:
            continue
        if not equals and item in argv:  # --epochs 3: the value is the next word, if it is one
            following = list(argv[argv.index(item) + 1 :])
            value = following[0] if following and not following[0].startswith("-") else ""
        return f"overrides are key=value: {key}={shlex.quote(value) if value else 'VALUE'}; "
    return ""


def _split_train_args(values: Sequence[str]) -> tuple[str | None, list[str]]:
    from torchvote.training.config import ConfigError

    preset = None
    overrides = []
    for index, value in enumerate(values):
        if "=" in value and not (index == 0 and _names_a_preset_file(value)):
            overrides.append(value)
        elif index == 0:
            preset = value
        else:
            raise ConfigError(f"expected key=value after the preset, got {value!r}")
    _check_keys_given_once(overrides)
    return preset, overrides


def _names_a_preset_file(value: str) -> bool:
    """Whether a first argument holding ``=`` is a preset file's path, not an override: a
    ``.yaml`` / ``.yml`` path or an existing file (sweep folders are often named ``lr=0.1``; the
    commands a run prints, ``torchvote train RUN/config.yaml ...``, name such paths). An override's
    key is never a path: ``a/b=1`` is refused as a key anyway."""
    from pathlib import Path

    key = value.partition("=")[0]
    return "/" in key or os.sep in key or Path(value).suffix in (".yaml", ".yml") or Path(value).is_file()


def _override_key(text: str) -> str:
    from torchvote.training.config import parse_override

    parts, _ = parse_override(text)
    return ".".join(part.strip() for part in parts)


def _keys_below(key: str, value: object) -> list[str]:
    """The dotted keys a ``{mapping}`` value sets below ``key`` (``[]`` for any other value)."""
    if not isinstance(value, dict):
        return []
    keys = []
    for name, inner in value.items():
        keys += _keys_below(f"{key}.{name}", inner) or [f"{key}.{name}"]
    return keys


def _check_keys_given_once(overrides: Sequence[str]) -> None:
    """Refuse a key set twice: ``epochs=1 epochs=2``, a key inside a mapping set before
    (``model.router_options={bias: true} model.router_options.bias=false``), or a whole mapping
    that replaces keys set before it. The later one won without a word, and a bad earlier value
    (``progress=maybe progress=false``) was never checked. Keys a mapping does not name may still
    be added one by one after it."""
    from torchvote.training.config import ConfigError, parse_override
    from torchvote.training.keyvalue import parse_value

    seen: dict[str, str] = {}  # dotted key -> the text that set it
    for text in overrides:
        key = _override_key(text)
        raw = parse_override(text)[1]
        below = _keys_below(key, parse_value(raw, key)) if raw.startswith("{") else []
        clash = next(
            (
                earlier
                for other, earlier in seen.items()
                if other == key or other in below or other.startswith(f"{key}.")
            ),
            None,
        )
        if clash is not None:
            raise ConfigError(f"{key} is set twice ({clash!r}, then {text!r}); give each key once")
        seen.update(dict.fromkeys([key, *below], text))


def _check_resume(run_dir: str, overrides: Sequence[str]) -> None:
    """``--resume`` names a run's folder (the one holding ``checkpoints/`` and ``config.yaml``)
    and the overrides leave it there.

    A checkpoints folder or a checkpoint file resumed into a new run nested inside it (or failed
    with "File exists"), a missing folder read as a checkpoint's stem, and ``run_dir=`` /
    ``out_dir=`` were ignored without a word.
    """
    from torchvote.training.config import ConfigError

    path = Path(run_dir).expanduser()  # as train() reads it
    if not run_dir.strip():
        raise ConfigError("--resume: expected a run folder, got ''")
    if not path.exists():
        raise ConfigError(f"--resume: {run_dir} does not exist; expected the folder of a run")
    if not path.is_dir():
        in_checkpoints = path.parent.name == "checkpoints"
        hint = f"; resume its run folder: --resume {path.parent.parent}" if in_checkpoints else ""
        raise ConfigError(f"--resume: {run_dir} is a file, expected the folder of a run{hint}")
    from torchvote.training.checkpoint import holds_checkpoints, is_run_folder

    has_config = (path / "config.yaml").is_file()
    if not is_run_folder(path):  # as evaluate, generate and explain read a folder
        config = "its config.yaml is not one a run wrote" if has_config else "no config.yaml in it"
        if (path / "checkpoints").is_dir():  # empty, or a user's own: a run makes it at its first save
            why = f"its checkpoints/ holds no checkpoint, and {config}"
        else:
            why = f"no checkpoints/, and {config}" if has_config else "no checkpoints/ or config.yaml in it"
        raise ConfigError(f"--resume: {run_dir} is not a run folder ({why})")
    if not has_config and not holds_checkpoints(path / "checkpoints"):  # a run's, by its latest or step-*
        raise ConfigError(
            f"--resume: {run_dir} is a run's checkpoints folder; resume its run folder: "
            f"--resume {path.resolve().parent}"
        )
    for text in overrides:
        key = _override_key(text)
        if key in ("run_dir", "out_dir"):
            value = text.partition("=")[2].strip()
            if key == "out_dir" or not value or Path(value).resolve() != path.resolve():
                raise ConfigError(f"{key}: a resumed run stays in its folder ({run_dir}); omit {key}=")


def _run_data_arguments(config) -> tuple[list[str], int | None, str | None, dict[str, Any]]:
    """How ``torchvote evaluate`` tests a run on its own data sets, read as the run read them: its
    evaluated split (``data.eval_split``) and every ``eval_on`` entry, with ``data.root``,
    ``data.eval_limit`` and ``data.options`` (which the run gave its evaluated set only when that
    is ``data.name``, and never the ``eval_on`` entries: beside those, the options go into the
    evaluated set's own entry where their text allows, else to every set).

    Returns:
        ``(entries, limit, root, options)``: the ``--on`` entries, ``--limit``, ``--root`` and the
        ``--data-option`` values.
    """
    data = config.data
    evaluated = data.eval_name or data.name
    options = dict(data.options) if evaluated == data.name else {}
    own = {} if data.eval_split is None else {"split": data.eval_split}
    if config.eval_on and all(_fits_an_entry(value) for value in options.values()):
        own, options = {**own, **options}, {}
    if own:
        evaluated += ":" + ",".join(f"{key}={_option_text(value)}" for key, value in own.items())
    root = None if data.root is None else str(data.root)
    return [evaluated, *config.eval_on], data.eval_limit, root, options


def _evaluate_command(config, run_dir: str | os.PathLike[str]) -> str:
    """The ``torchvote evaluate`` command that tests a run on its own data sets
    (:func:`_run_data_arguments`)."""
    return shlex.join(["torchvote", "evaluate", str(run_dir), *_evaluate_flags(*_run_data_arguments(config))])


def _evaluate_flags(
    entries: Sequence[str], limit: int | None, root: str | None, options: dict[str, Any]
) -> list[str]:
    """``evaluate``'s flags for these data arguments (:func:`_run_data_arguments`' order)."""
    words = [word for entry in entries for word in ("--on", entry)]
    if limit is not None:
        words += ["--limit", str(limit)]
    if root is not None:
        words += ["--root", root]
    for key, value in options.items():
        words += ["--data-option", f"{key}={_option_text(value)}"]
    return words


def _option_text(value: Any) -> str:
    """A data option as ``key=value`` text gives it back (YAML reads JSON)."""
    return value if isinstance(value, str) else json.dumps(value)


def _fits_an_entry(value: Any) -> bool:
    """Whether an option's text can stand in an ``eval_on``-style entry (no ``,`` or ``:``)."""
    text = _option_text(value)
    return "," not in text and ":" not in text


def _run_training(config, resume: str | None, *, args: argparse.Namespace, explain: bool = False) -> int:
    """Train; on rank 0, say where the checkpoint, metrics and plots went (and, with ``explain``,
    write the ``torchvote explain`` report of the trained model beside them).

    ``args``' command is marked running (:func:`mark_running`) when ``train`` has set the run
    up (data, model, optimiser, run folder) and begins training: a value of the config that the
    set-up refuses is the command line's mistake.
    """
    from torchvote.training import train
    from torchvote.training.plots import plot_run
    from torchvote.training.stopping import exit_status

    result = train(config, resume=resume, on_start=lambda: mark_running(args))
    if result.interrupted:
        return exit_status(result.stop_signal)
    plot_run(result)  # after training: the loop draws nothing
    if result.checkpoint is not None:
        print(f"\ncheckpoint: {result.checkpoint.weights}")
        print(f"metrics:    {result.metrics_path}")
        if config.tensorboard:  # the default: say where, or why nothing was written
            events = Path(result.run_dir) / "tensorboard"
            print(f"tensorboard: {events}" if events.is_dir() else
                  'tensorboard: not written, no tensorboard package (pip install "torchvote[tensorboard]"; '
                  "tensorboard=false hides this line)")
        if result.plots:
            print(f"plots:      {', '.join(str(p) for p in result.plots)}")
        elif not _can_draw():
            print('plots:      not drawn, no matplotlib (pip install "torchvote[plots]")')
        print(f"evaluate:   {_evaluate_command(config, result.run_dir)}")
        if explain:
            from torchvote.explain.command import add_explain_arguments

            run_dir = Path(result.run_dir)
            report = add_explain_arguments(argparse.ArgumentParser()).parse_args(
                ["--out", str(run_dir / "explain"), "--checkpoint", str(run_dir), "--device", config.device]
            )  # the command's own defaults for everything else
            mark_running(report)  # checked as part of this command's work, not its command line
            return _explain(report)  # prints "report: <path>"
    return 0


def _train(args: argparse.Namespace) -> int:
    from torchvote.training import load_run_config
    from torchvote.training.config import ConfigError, load_config

    preset, overrides = _split_train_args(args.args)
    if args.resume is None:
        if preset is None:
            raise ConfigError("name a preset (torchvote list presets) or --resume RUN_DIR")
        return _run_training(load_config(preset, overrides), None, args=args)
    _check_resume(args.resume, overrides)
    config = load_run_config(args.resume, overrides)
    if preset is not None and load_config(preset).preset != config.preset:
        raise ConfigError(
            f"run {args.resume} was started from preset {config.preset!r}, not {preset!r}; "
            "omit the preset to resume it"
        )
    return _run_training(config, args.resume, args=args)


def _main_job(args: argparse.Namespace) -> int:
    from torchvote.training.config import load_config

    _check_keys_given_once(args.overrides)
    config = load_config("main", args.overrides)
    if not args.no_report and not _can_draw():  # before the training, not after it
        raise ModuleNotFoundError(
            "the main job ends with the explain report, whose figures need matplotlib (--no-report "
            "trains without it)", name="matplotlib"
        )
    return _run_training(config, None, args=args, explain=not args.no_report)


def _can_draw() -> bool:
    """Whether the pictures can be drawn: matplotlib imports as the figures import it (pyplot on
    the Agg backend). A missing package, one whose import fails (a system library missing) and a
    test's ``None`` in ``sys.modules`` all say no."""
    from torchvote.explain.figures import pyplot

    try:
        pyplot()
    except ImportError:
        return False
    return True


# --- evaluate ---------------------------------------------------------------------------------------


def _evaluate(args: argparse.Namespace) -> int:
    from torchvote.data import list_datasets
    from torchvote.training.checkpoint import CheckpointError
    from torchvote.training.evaluation import checkpoint_summary, evaluate_checkpoint
    from torchvote.training.keyvalue import parse_entry, parse_options, split_entries
    from torchvote.training.metrics import format_table
    from torchvote.validation import check_device_name, check_positive_int

    known = list_datasets()
    datasets = split_entries(args.on or [])
    if args.on is not None and not datasets:  # --on "$UNSET": the run's own sets, in silence
        raise ValueError(f"--on names no data set (got {', '.join(map(repr, args.on))}); name one, or "
                         "leave --on out to evaluate on the run's own data sets")
    # every argument is checked before the checkpoint is read, each named by its option
    for entry in datasets:
        name, _ = parse_entry(entry, "--on")
        if name not in known:
            raise ValueError(f"--on: unknown data set {name!r}; data sets: {', '.join(known)}")
    if args.limit is not None:
        check_positive_int(args.limit, "--limit")
    check_positive_int(args.batch_size, "--batch-size")
    check_device_name(args.device, "--device")
    options = parse_options(args.data_option, "--data-option")
    check_checkpoint_argument(args.checkpoint, "checkpoint")
    try:
        print(f"checkpoint: {checkpoint_summary(args.checkpoint)}")
    except CheckpointError as err:  # a damaged newest checkpoint: name the intact one a resume takes
        raise CheckpointError(f"{err}{_intact_checkpoint_hint(args.checkpoint)}") from None
    limit, root = args.limit, args.root
    if not datasets:  # the run's own data sets, as it read them; what the user gave still counts
        datasets, run_limit, run_root, run_options = _run_data_arguments(_run_config(args.checkpoint, known))
        limit = run_limit if limit is None else limit
        root = run_root if root is None else root
        options = {**run_options, **options}
        # as they apply: the run's limit, root and options too (the limit was left out, and the flags
        # shown, copied, evaluated every example)
        print(f"data:       the run's own ({shlex.join(_evaluate_flags(datasets, limit, root, options))})")
    rows = evaluate_checkpoint(
        args.checkpoint,
        datasets,
        batch_size=args.batch_size,
        limit=limit,
        device=args.device,
        bf16=args.bf16,
        fp16=args.fp16,
        root=root,
        options=options,
        echo=print,  # why the table, or a row, has no loss
        # running while a data set is evaluated; loading the next checks the command line's --on
        on_phase=lambda phase: mark_running(args, phase == "evaluate"),
    )
    # the columns of the fullest row first: a row without a loss (a loss that does not take that
    # data set's labels) does not move the loss column behind the others
    columns = dict.fromkeys(key for row in sorted(rows, key=len, reverse=True) for key in row)
    print(format_table(rows, list(columns)))
    return 0


def _intact_checkpoint_hint(location: str) -> str:
    """For a run or checkpoints folder whose newest checkpoint cannot be read: ``"; the newest
    intact checkpoint is X: torchvote evaluate X"`` (the one ``train --resume`` goes on from), or
    ``""`` for a file, or where none is intact."""
    from torchvote.training.evaluation import newest_intact_checkpoint

    intact = newest_intact_checkpoint(location)
    if intact is None:
        return ""
    weights = str(intact.weights)
    return f"; the newest intact checkpoint is {weights}: torchvote evaluate {shlex.quote(weights)}"


def _run_config(checkpoint: str, known: Sequence[str]):
    """The run config recorded in a checkpoint's training state, for ``evaluate`` without ``--on``;
    in a run folder, as its last set-up ran (a resume that only evaluated a finished run on a new
    ``eval_on`` entry wrote its config there, and no checkpoint).

    Raises:
        ValueError: no training state beside the weights (a ``.safetensors`` file copied alone),
            or one without a readable config (another version's); the message asks for ``--on``.
        CheckpointError: a damaged training state (truncated, corrupt): a failure, as a damaged
            weights file is, naming the newest intact checkpoint where the folder has one.
    """
    from torchvote.training.checkpoint import CheckpointError, find_checkpoint, load_training_state
    from torchvote.training.evaluation import run_config_of_state
    from torchvote.training.results import last_set_up_config

    paths = find_checkpoint(checkpoint)
    ask = f"name the data sets with --on (data sets: {', '.join(known)})"
    if not paths.state.is_file():
        raise ValueError(f"{ask}: {paths.state}, the run's training state that records them, does not exist")
    try:
        state = load_training_state(paths.state)
    except CheckpointError as err:  # not the user's to fix with --on: "name the data sets" misled (status 2)
        raise CheckpointError(f"{err}{_intact_checkpoint_hint(checkpoint)}") from None
    try:
        config = run_config_of_state(state, paths.state, "data sets")
    except CheckpointError as err:  # a config of another version: the user names the sets instead
        raise ValueError(f"{ask}: {err}") from None
    if paths.weights.parent.name == "checkpoints":  # in a run folder: as its last set-up read them
        return last_set_up_config(paths.weights.parent.parent, config)
    return config


def check_checkpoint_argument(
    location: str | os.PathLike[str], argument: str, *, records: bool = False
) -> None:
    """Refuse a checkpoint argument that names nothing, or a folder that holds no run, before
    anything is loaded: the command line's mistake (status 2). A run's folder without a checkpoint
    (stopped before its first) passes: the run is named right, and reading it ("no checkpoint in
    ...") fails while running (status 1). Needs no train extra: without it, a folder is not judged
    (reading it says what to install).

    Args:
        location: the path given ('~' expanded, as the readers expand it), named in the messages as
            given: ``evaluate``'s and ``generate``'s CHECKPOINT, ``explain``'s ``--checkpoint``.
        argument: its name on the command line, leading each message (``checkpoint``,
            ``--checkpoint``).
        records: whether a record of explain's tensors is read too
            (:func:`torchvote.explain.record.load_record`, which reads a file as it is named): a
            folder holding the record file then passes, and a checkpoint's stem without its suffix
            (which :func:`~torchvote.training.checkpoint.find_checkpoint` resolves) names nothing.

    Raises:
        ValueError: nothing at ``location`` (nor, unless ``records``, a checkpoint's weights
            ``<location>.safetensors``), or a folder that is no run's
            (:func:`torchvote.training.checkpoint.is_run_folder`) and holds no record file
            (``records``); the message names ``argument`` and what was expected.
    """
    path = Path(location).expanduser()
    if records:
        from torchvote.explain.record import RECORD_FILE

        expected = (
            "expected a run folder, its checkpoints folder, a checkpoint's file or a record "
            "(.safetensors/.pt)"
        )
        exists = path.exists()
    else:
        expected = "expected a run folder, its checkpoints folder or a .safetensors file"
        exists = path.exists() or path.with_name(f"{path.name}.safetensors").is_file()  # a checkpoint's stem
    if not exists:
        raise ValueError(f"{argument}: {location} does not exist; {expected}")
    if not path.is_dir() or (records and (path / RECORD_FILE).is_file()):
        return
    try:
        from torchvote.training.checkpoint import NOT_A_RUN_FOLDER, is_run_folder

        is_a_run = is_run_folder(path)
    except ModuleNotFoundError:  # no train extra (explain runs without it): reading the folder says so
        return
    if not is_a_run:
        record = f" and holds no {RECORD_FILE}" if records else ""
        raise ValueError(f"{argument}: {location} is {NOT_A_RUN_FOLDER}{record}; {expected}")


# --- generate -------------------------------------------------------------------------------------------


def _generate(args: argparse.Namespace) -> int:
    from torchvote.training.evaluation import checkpoint_summary
    from torchvote.training.generation import generate_from_checkpoint
    from torchvote.validation import check_device_name

    check_device_name(args.device, "--device")
    _check_generate_options(args)
    check_checkpoint_argument(args.checkpoint, "checkpoint")
    print(f"checkpoint: {checkpoint_summary(args.checkpoint)}", file=sys.stderr)
    streamed: list[int] = []  # a language model's generations shown as they were written
    shown: set[int] = set()  # generations shown whole, each as soon as it was complete
    empty = "(no token: --max-new-tokens 0)" if args.max_new_tokens == 0 else "(nothing before <eos>)"
    one_sample = args.samples in (None, 1)  # a language model's only sample streams character by character

    def show(index: int, prompt: str, character: str) -> None:
        if not streamed or streamed[-1] != index:
            sys.stdout.write(("\n" if streamed else "") + _separated(index, prompt))
            streamed.append(index)
        sys.stdout.write(character)
        sys.stdout.flush()

    def show_whole(index: int, generation: Any) -> None:
        if generation.task == "seq2seq":
            print(f"{generation.prompt} -> {generation.text or empty}")
        else:  # a language model's text, continuations apart
            print(_separated(index, generation.prompt) + generation.text)
        sys.stdout.flush()
        shown.add(index)

    try:
        generations = generate_from_checkpoint(
            args.checkpoint,
            args.prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            samples=args.samples,
            seed=args.seed,
            device=args.device,
            use_cache=not args.no_cache,
            bf16=args.bf16,
            fp16=args.fp16,
            # several samples are drawn together, their characters alternating: each prompt's shown
            # whole when its batch is done
            on_text=show if one_sample else None,
            on_generation=None if one_sample else show_whole,
            # every prompt and option checked (against the model's vocabulary, task and length)
            # and the model loaded: what fails from here on is running's
            on_start=lambda: mark_running(args),
        )
    except ValueError as error:  # the one check that needs the model: a seq2seq run's max_len
        if not str(error).startswith("max_new_tokens "):
            raise
        raise ValueError(f"--max-new-tokens{str(error).removeprefix('max_new_tokens')}") from None
    finally:  # the text written so far ends its line, also when Ctrl-C stopped it
        if streamed:
            print()
    for index, generation in enumerate(generations):
        if index not in streamed and index not in shown:
            show_whole(index, generation)
    return 0


def _separated(index: int, prompt: str) -> str:
    """A language model's generation starts with its prompt, a rule above all but the first."""
    return ("-" * 40 + "\n" if index else "") + prompt


def _check_generate_options(args: argparse.Namespace) -> None:
    """The options of ``generate`` that need no checkpoint, checked first and named as flags."""
    from torchvote.validation import check_in_range, check_positive_int, check_seed

    if any(not prompt for prompt in args.prompt):
        raise ValueError("--prompt: expected at least one character, got ''")
    if args.max_new_tokens is not None:
        check_positive_int(args.max_new_tokens, "--max-new-tokens", minimum=0)
    if args.temperature is not None:
        check_in_range(args.temperature, "--temperature", 0.0)
    if args.top_k is not None:
        check_positive_int(args.top_k, "--top-k")
    if args.top_p is not None:
        check_in_range(args.top_p, "--top-p", 0.0, 1.0, include_low=False)
    if args.samples is not None:
        check_positive_int(args.samples, "--samples")
    if args.seed is not None:
        check_seed(args.seed, "--seed")


# --- reproduce ------------------------------------------------------------------------------------------


def _list_row(row: Any, budget: str, seeds: Sequence[int], chosen: Sequence[Any]) -> None:
    """``reproduce --list NAME``: the row's ``chosen`` variants (as ``--variant`` chooses them),
    each with its preset and the overrides it trains with under ``budget`` (the seed's aside, the
    ``seeds`` counted), or what a measuring row measures."""
    print(f"{row.letter}  {row.name}: {row.title}")
    if row.measure is not None:
        print(f"trains nothing: measures in this process (budget {budget})")
        return
    default = list(seeds) == list(range(row.seeds))
    told = f"{len(seeds)} seeds" if default else f"seeds {' '.join(map(str, seeds))}"
    print(f"{len(chosen)} of {len(row.variants)} variants x {told} (budget {budget}):")
    for variant in chosen:
        overrides = [item for item in row.overrides(variant, budget, 0) if not item.startswith("seed=")]
        print(f"  {variant.label:32s} {variant.preset} {shlex.join(overrides)}")


def _planned_runs(row: Any, args: argparse.Namespace, seeds: Sequence[int], variants: Sequence[Any]) -> list:
    """The runs of ``row`` that ``reproduce`` makes, each planned as it plans them
    (:func:`~torchvote.experiments.runner.plan_run`: its command, and whether it is new,
    resumed or finished)."""
    from torchvote.experiments import run_dir_of
    from torchvote.experiments.runner import plan_run

    runs = [(variant, seed, run_dir_of(args.out, row, args.budget, variant, seed))
            for variant in variants for seed in seeds]
    return [plan_run(row, variant, args.budget, seed, folder, args.device)
            for variant, seed, folder in runs]


def _reproduce(args: argparse.Namespace) -> int:
    from torchvote.experiments import check_request, get_row, list_rows, reproduce
    from torchvote.experiments.runner import measured_result_of
    from torchvote.training.stopping import exit_status
    from torchvote.validation import check_device_name

    if args.name is None:
        for row in list_rows().values():
            print(f"{row.letter}  {row.name:24s} {row.title}")
        return 0
    row = get_row(args.name)
    check_device_name(args.device, "--device")
    request = {
        "budget": args.budget,
        "seeds": args.seeds,
        "device": args.device,
        "out_dir": args.out,
        "variants": args.variant or (),
    }
    if args.list:  # one row: what it trains under --budget, --seeds and --variant, checked as a run
        if args.dry_run:
            raise ValueError("--list and --dry-run: give one (--list says what a row trains, --dry-run "
                             "the commands it runs)")
        _list_row(row, args.budget, *check_request(row, **request))
        return 0
    if args.dry_run:  # checks what a real run checks (not whether --device exists here: the lines may be
        # for another machine), then says what it would run
        seeds, variants = check_request(row, **request)
        if row.measure is not None:
            measured = measured_result_of(args.out, row, args.budget)
            print(f"{row.name} trains nothing: it measures ({row.title}), in this process")
            if measured.is_file():  # as a training row's finished runs are marked
                print(f"# finished: measured earlier, {measured} (delete it to measure again)")
        for planned in _planned_runs(row, args, seeds, variants):  # as the runs make them: folder, device
            if planned.state == "finished":
                print(f"# finished: {planned.command}")
            else:
                print(planned.command + (f"  # {planned.note}" if planned.note else ""))
        return 0
    # refused before the first run trains (a usage error): the device on this machine; reproduce
    # itself plans every run that has a folder before its first line (an edited row's stopped run)
    resolve_device_option(args.device)

    def echo(line: str) -> None:  # reproduce's first line starts the first run (or the measuring)
        mark_running(args)
        print(line)

    try:
        summary = reproduce(row, **request, echo=echo)
    except KeyboardInterrupt as stop:
        # str(stop): a bare KeyboardInterrupt (Ctrl-C while a run loads its data) is truthy but
        # empty, and the line said only "torchvote reproduce: "
        message = f"torchvote reproduce: {str(stop) or 'interrupted; rerun the same command to continue'}"
        print(message, file=sys.stderr)
        return exit_status(getattr(stop, "stop_signal", ""))
    print(summary.read_text())
    print(f"summary: {summary}")
    return 0


# --- list ---------------------------------------------------------------------------------------------


def _list(args: argparse.Namespace) -> int:
    mark_running(args)  # argparse checked the one argument
    sections = [args.what] if args.what else list(LIST_WHAT)
    margin = "  " if len(sections) > 1 else ""
    # on a terminal, long entries wrap under their description (a preset's ran to 188 columns);
    # piped, one line per entry, for grep
    width = shutil.get_terminal_size().columns if sys.stdout.isatty() else None
    for index, what in enumerate(sections):
        if len(sections) > 1:
            print(f"{'' if index == 0 else chr(10)}{what}:")
        for line in _LISTERS[what]():
            if width is None or len(margin + line) <= width:
                print(margin + line)
            else:  # the name column is 24 characters and a space
                print(textwrap.fill(line, width=max(width, 40), initial_indent=margin,
                                    subsequent_indent=margin + " " * 25, break_on_hyphens=False))
    return 0


def _list_models() -> list[str]:
    from torchvote.models import get_model_spec, list_models

    lines = []
    for name in list_models():
        spec = get_model_spec(name)
        sizes = ", ".join(spec.presets) or "-"  # model sizes, not the training presets listed below
        lines.append(f"{name:24s} {spec.task:22s} loss={spec.loss:14s} model.preset: {sizes}")
    return lines


def _list_routers() -> list[str]:
    try:
        from torchvote.functional.routing import list_routers
    except ImportError:
        return ["(no router registry yet: torchvote.functional.routing.list_routers does not exist)"]
    routers = list_routers()
    if isinstance(routers, dict):
        return [f"{name:24s} {description}" for name, description in routers.items()]
    return [str(name) for name in routers]


def _list_presets() -> list[str]:
    try:
        from torchvote.training.config import list_presets
    except ModuleNotFoundError as error:  # the presets are read with the train extra's omegaconf
        return [f'(the training presets need the train extra: pip install "torchvote[train]"; {error})']

    return [f"{name:24s} {description}" for name, description in list_presets().items()]


def _list_datasets() -> list[str]:
    """One line per data set, and one naming its options (``data.options.KEY=...``, per split where
    the splits differ)."""
    from torchvote.data import dataset_options, dataset_splits, list_datasets

    lines = []
    for name, description in list_datasets().items():
        by_split = {split: ", ".join(dataset_options(name, split)) for split in dataset_splits(name)}
        if len(set(by_split.values())) == 1:
            options = f"options: {next(iter(by_split.values()))}"
        else:
            options = "; ".join(f"options ({split}): {text}" for split, text in by_split.items())
        lines += [f"{name:24s} {description}", f"{'':24s} {options}"]
    return lines


_LISTERS = {
    "models": _list_models,
    "routers": _list_routers,
    "presets": _list_presets,
    "datasets": _list_datasets,
}


# --- data ------------------------------------------------------------------------------------------------


def _data(args: argparse.Namespace) -> int:
    from torchvote.data.command import run_data

    return run_data(args)


# --- bench ------------------------------------------------------------------------------------------


def _benchmarks_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "benchmarks"


def _bench(args: argparse.Namespace) -> int:
    script = _benchmarks_dir() / f"{args.name}.py"
    if not script.is_file():
        folder = _benchmarks_dir()
        present = sorted(p.stem for p in folder.glob("[!_]*.py")) if folder.is_dir() else []  # not _common
        raise FileNotFoundError(
            f"benchmark script {script} not found (benchmarks run from a source checkout); "
            f"present: {', '.join(present) or 'none'}"
        )
    # the script's usage errors then start with the command the user typed, not its file name
    environment = {**os.environ, "TORCHVOTE_BENCH_PROG": f"torchvote bench {args.name}"}
    # not marked running (mark_running): the script's own errors are its exit status, and the one
    # ValueError here is subprocess's refusal of an argument (a NUL byte): the command line's
    status = subprocess.call([sys.executable, str(script), *args.args], env=environment)
    return 128 - status if status < 0 else status  # killed by signal N: 128 + N, as a shell says


if __name__ == "__main__":
    raise SystemExit(main())
