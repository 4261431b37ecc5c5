"""Run a row of docs/results.md: every variant, every seed, resumable.

``torchvote reproduce NAME`` calls :func:`reproduce`. Runs go to
``<out>/<row>/<budget>/<variant>/seed-<n>/`` (a normal run folder: config, metrics, checkpoints).
A run that finished holds ``result.json`` (written atomically) and is not run again; a run that
stopped (Ctrl-C, a killed process, a full disk) is resumed from its newest intact checkpoint (or
trained afresh when it was killed while writing its first), so rerunning the same command after
any stop carries on where it stopped. A run folder, finished or stopped, whose config no longer
matches the row (the row was edited) is refused with the keys that differ, never overwritten nor
counted with the new runs. The summary (:mod:`torchvote.experiments.report`) is rewritten after every run.
"""

from __future__ import annotations

import json
import platform
import re
import shlex
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchvote.data.errors import CorruptDataError
from torchvote.experiments.report import UNRECORDED_CODE, read_result, summarize, write_summary
from torchvote.experiments.rows import Row, Variant
from torchvote.files import atomic_write_bytes, file_in_the_way
from torchvote.provenance import describe_code
from torchvote.training.checkpoint import CheckpointError
from torchvote.training.config import (
    RESUMABLE_KEYS,
    ConfigError,
    TrainConfig,
    config_diff,
    load_config,
    saved_config,
)
from torchvote.training.results import find_resumable_checkpoint
from torchvote.training.stopping import RunInterrupted
from torchvote.validation import as_path, check_device_name, check_seed, check_texts, resolve_device

__all__ = [
    "RESULT_FILE",
    "PlannedRun",
    "check_request",
    "describe_device",
    "measured_result_of",
    "plan_run",
    "reproduce",
    "run_dir_of",
    "select_variants",
    "train_command",
]

#: The file that marks a finished run.
RESULT_FILE = "result.json"


def _slug(label: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")


def measured_result_of(out_dir: str | Path, row: Row, budget: str) -> Path:
    """The result file of a row that measures instead of training: ``<out>/<row>/<budget>/result.json``
    (its presence means the row was measured and is not measured again).

    Args:
        out_dir: the folder all reproduced runs go to.
        row: the experiment (``row.measure`` set).
        budget: ``cpu`` or ``paper`` (not checked here).

    Returns:
        The path (not created).
    """
    return as_path(out_dir, "out_dir (--out)") / row.name / budget / RESULT_FILE


def run_dir_of(out_dir: str | Path, row: Row, budget: str, variant: Variant, seed: int) -> Path:
    """The folder of one run: ``<out>/<row>/<budget>/<variant slug>/seed-<seed>``.

    Args:
        out_dir: the folder all reproduced runs go to.
        row: the experiment.
        budget: ``cpu`` or ``paper`` (not checked here).
        variant: the configuration; its label, made file-safe, names the folder.
        seed: the run's seed.

    Returns:
        The path (not created).
    """
    return as_path(out_dir, "out_dir (--out)") / row.name / budget / _slug(variant.label) / f"seed-{seed}"


def train_command(
    row: Row,
    variant: Variant,
    budget: str,
    seed: int,
    *,
    run_dir: str | Path | None = None,
    device: str = "auto",
) -> str:
    """The ``torchvote train`` line that makes one run of a row (for the docs and ``--dry-run``),
    quoted for a POSIX shell (``eval_on=[...]`` is a glob pattern to zsh).

    Args:
        row: the experiment.
        variant: the configuration: its preset and overrides.
        budget: ``cpu`` or ``paper``; its overrides follow the variant's.
        seed: the run's seed (``seed=<seed>``, the last override unless ``run_dir`` or ``device``
            follow).
        run_dir: the run's folder (``run_dir=``, as :func:`reproduce` trains it, see
            :func:`run_dir_of`); ``None`` leaves it out (the docs' lines).
        device: ``device=`` unless ``auto``.

    Returns:
        The command line.

    Raises:
        ValueError: ``budget`` is not one of the row's budgets, a ``variant`` of another row, a
            row that measures instead of training, a seed below 0 or an unknown device.
        TypeError: a ``seed`` that is not an integer.
    """
    overrides = _run_overrides(row, variant, budget, seed, run_dir, device)
    return shlex.join(["torchvote", "train", variant.preset, *overrides])


def _run_overrides(
    row: Row, variant: Variant, budget: str, seed: int, run_dir: str | Path | None, device: str
) -> list[str]:
    """The overrides of one run: the row's, then its folder and device (the one list that both
    :func:`train_command` prints and :func:`reproduce` trains), checked as the run's config
    would check them, before a line is printed that would fail."""
    if row.measure is not None:
        raise ValueError(f"{row.name} trains nothing (it measures a pretrained model): no train line")
    if variant not in row.variants:
        raise ValueError(
            f"variant {getattr(variant, 'label', variant)!r} is not one of {row.name}'s: "
            f"{[v.label for v in row.variants]}"
        )
    seed = check_seed(seed)
    check_device_name(device)
    overrides = row.overrides(variant, budget, seed)
    if run_dir is not None:
        overrides.append(f"run_dir={run_dir}")
    if device != "auto":
        overrides.append(f"device={device}")
    return overrides


def check_request(
    row: Row,
    *,
    budget: str,
    seeds: Sequence[int] | None,
    device: str,
    out_dir: str | Path,
    variants: Sequence[str],
) -> tuple[list[int], list[Variant]]:
    """Check a request to reproduce ``row`` before anything runs (``--dry-run`` checks the same;
    whether ``device`` exists on this machine is left to the runs, so a dry run may print the
    lines for another machine).

    Args:
        row, budget, seeds, device, out_dir, variants: as :func:`reproduce` takes them.

    Returns:
        ``(seeds, variants)`` to run: the seeds (default ``0 .. row.seeds - 1``) and the chosen
        variants (none for a row that measures instead of training).

    Raises:
        ValueError: an unknown budget or device, seeds that are not distinct integers >= 0, an
            ``out_dir`` that is a file, variant filters that match nothing, or seeds, variants or
            a device for a row that measures (they would be ignored).
        TypeError: ``variants`` a single string rather than a list of them, an ``out_dir`` that
            is no path (``''`` is a ValueError).
    """
    if budget not in row.budgets:
        raise ValueError(f"budget: expected one of {sorted(row.budgets)}, got {budget!r}")
    check_device_name(device)
    out_dir = as_path(out_dir, "out_dir (--out)")  # '' planned the runs in the working folder
    blocking = file_in_the_way(out_dir)
    if blocking is not None:  # a parent too: the first run failed to make its folder, the row went on
        raise ValueError(f"out: {blocking} is a file; runs and summaries need a folder")
    if row.measure is not None:
        given = [name for name, value in (("--seeds", seeds), ("--variant", variants)) if value]
        given += ["--device"] if device not in ("auto", "cpu") else []
        if given:
            raise ValueError(
                f"{', '.join(given)}: {row.name} trains nothing (it measures a pretrained model on "
                f"the CPU); run it without them"
            )
        return [], []
    seeds = list(range(row.seeds)) if seeds is None else list(seeds)
    seeds = [check_seed(seed, f"seeds[{index}]") for index, seed in enumerate(seeds)]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must be distinct, got {seeds}")
    return seeds, select_variants(row, variants)


def describe_device(device: str) -> str:
    """The hardware a run uses, in words: the GPU's name, or the CPU and its thread count."""
    resolved = resolve_device(device)
    if resolved.type == "cuda":
        return f"{torch.cuda.get_device_name(resolved)} (torch {torch.__version__})"
    cpu = platform.processor() or platform.machine()
    return f"CPU {cpu}, {torch.get_num_threads()} threads (torch {torch.__version__})"


# Keys a rerun of a row may set otherwise than the run folder's config: where and how it runs and
# what it prints (those a resumed run may change, less those that change the row's numbers); any
# other difference means the row was edited and the folder's result is another configuration's.
_FREE_KEYS = (RESUMABLE_KEYS | {"run_dir", "out_dir"}) - {
    "epochs",
    "max_steps",
    "eval_on",
    "data.eval_name",
    "data.eval_split",
    "data.eval_limit",
    "stop_at_accuracy",  # where a run ends: its numbers
    "eval_every",  # when stop_at_accuracy is checked
}


@dataclass(frozen=True)
class PlannedRun:
    """What :func:`reproduce` does with one run of a row.

    Attributes:
        state: ``"finished"`` (its ``result.json`` stands), ``"resume"`` (from its newest intact
            checkpoint) or ``"new"``.
        config: the run's config, as the row makes it.
        command: the command that does the same by hand: the row's ``torchvote train`` line (run
            folder and device included), or ``torchvote train --resume RUN_DIR`` for a resumed run.
        note: a remark for the progress line (``""`` when there is none); for a finished run,
            the code its record says measured it.
    """

    state: str
    config: TrainConfig
    command: str
    note: str = ""


def plan_run(row: Row, variant: Variant, budget: str, seed: int, run_dir: Path, device: str) -> PlannedRun:
    """Whether one run of a row is finished, to resume or new, after checking that a finished or
    stopped run was made with the row's present configuration.

    Args:
        row, variant, budget, seed: the run.
        run_dir: its folder (:func:`run_dir_of`).
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:<index>``.

    Returns:
        The :class:`PlannedRun`.

    Raises:
        ConfigError: the folder's run (finished or stopped) was made with another configuration
            than the row's (the row was edited since), naming every key that differs; the folder
            is kept. Only where and how a run runs may differ (device, logging, checkpoints).
    """
    config = load_config(variant.preset, _run_overrides(row, variant, budget, seed, run_dir, device))
    command = train_command(row, variant, budget, seed, run_dir=run_dir, device=device)
    resume = ["torchvote", "train", "--resume", str(run_dir)]
    resume += [f"device={device}"] if device != "auto" else []
    if (run_dir / RESULT_FILE).is_file():
        finished = read_result(run_dir / RESULT_FILE)  # a torn or foreign file is refused, not counted
        saved = _finished_config(run_dir)
        _check_same_run(saved, config, run_dir)
        added = [entry for entry in config.eval_on if entry not in saved.eval_on]
        if added:  # the real affNIST downloaded since, say: the trained model is evaluated on it
            _check_final_checkpoint(run_dir, finished.get("steps"), added)
            # by hand: --resume reads the checkpoint's config, whose eval_on lacks the new entries
            by_hand = [*resume, *(o for o in _run_overrides(row, variant, budget, seed, None, "auto")
                                  if o.startswith("eval_on="))]
            return PlannedRun("resume", config, shlex.join(by_hand), f"evaluates {', '.join(added)} too")
        return PlannedRun("finished", config, command, finished.get("code", UNRECORDED_CODE))
    checkpoints = run_dir / "checkpoints"
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        try:
            _, state, _ = find_resumable_checkpoint(run_dir)
        except CheckpointError as error:  # killed while writing its first checkpoint
            note = f"no intact checkpoint to resume ({error}); trained afresh, the torn files set aside"
            return PlannedRun("new", config, command, note)
        _check_same_run(saved_config(state["config"]), config, run_dir)
        return PlannedRun("resume", config, shlex.join(resume), f"resumes from step {state.get('step', '?')}")
    return PlannedRun("new", config, command)


def _check_final_checkpoint(run_dir: Path, steps: Any, added: list[str]) -> None:
    """Refuse to evaluate a finished run on new test sets from anything but its last checkpoint
    (an older one, the last torn, would train the rest again and replace its result).

    Raises:
        ConfigError: naming the folder, the sets and what to do.
    """
    try:
        _, state, _ = find_resumable_checkpoint(run_dir)
        step = state.get("step")
    except CheckpointError as error:
        step, why = None, str(error)
    else:
        why = f"its newest intact checkpoint is at step {step}, the run ended at {steps}"
    if step is None or step != steps:
        raise ConfigError(
            f"{run_dir} is finished but cannot be evaluated on {', '.join(added)} without training "
            f"again ({why}); evaluate it with torchvote evaluate, or move the folder away to run it anew"
        )


def _finished_config(run_dir: Path) -> TrainConfig:
    """The config a finished run was made with (its ``config.yaml``).

    Raises:
        CorruptDataError: (a ``ValueError``) the file is missing or unreadable, a damaged run
            folder (exit status 1, not a usage error): the result cannot be told to be the row's.
    """
    path = run_dir / "config.yaml"
    try:
        return load_config(str(path))
    except (ConfigError, OSError) as error:
        raise CorruptDataError(
            f"{run_dir} holds {RESULT_FILE} but no readable config.yaml to tell which configuration "
            f"it ran ({error}); move the folder away to run it again"
        ) from None


def _check_same_run(saved: TrainConfig, config: TrainConfig, run_dir: Path) -> None:
    """Refuse a run folder made with another configuration than ``config``.

    Raises:
        ConfigError: naming every key that differs beyond :data:`_FREE_KEYS`, with both values
            (``eval_on`` may gain entries: the run is evaluated on them when resumed).
    """
    changed = {k: v for k, v in config_diff(saved, config).items() if k not in _FREE_KEYS}
    if "eval_on" in changed and set(saved.eval_on) <= set(config.eval_on):
        del changed["eval_on"]  # more test sets only (the real affNIST once downloaded): evaluated on resume
    if changed:
        details = ", ".join(f"{k} (run: {a!r}, row now: {b!r})" for k, (a, b) in changed.items())
        raise ConfigError(
            f"{run_dir} was run with another configuration than the row's now (the row was edited "
            f"since): {details}; its result would be mixed with the new runs'. Move that folder away, "
            "or give another --out, to run it as the row is now"
        )


def _train_one(
    row: Row, variant: Variant, budget: str, seed: int, run_dir: Path, planned: PlannedRun
) -> dict[str, Any]:
    """Train (or resume) one run and give its record.

    Raises:
        RunInterrupted: a signal stopped the run (its checkpoint is saved; rerun to continue).
    """
    from torchvote.training import train

    config = planned.config
    resume = run_dir if planned.state == "resume" else None
    # the loop's own "resume with: torchvote train --resume" is not the way on here: reproduce
    # says its own (rerun the same command), so that the user reads one instruction
    result = train(config, resume=resume, verbose=False, resume_hint=False)
    if result.interrupted:
        message = f"run {run_dir} interrupted; rerun the same command to continue"
        raise RunInterrupted(message, result.stop_signal)
    return {
        "row": row.name,
        "variant": variant.label,
        "budget": budget,
        "seed": seed,
        "command": train_command(row, variant, budget, seed),
        "results": result.results,
        "steps": result.step,
        # {"step", "accuracy", "target"} where stop_at_accuracy was reached, None where the
        # run ended at its last epoch without reaching it (or had no target)
        "reached_target": result.reached_target,
        "wall_s": result.wall_s,  # every segment's, not only the last one's
        "resumed": resume is not None,
        "device": describe_device(config.device),
        "code": describe_code(),
    }


def _names_variant(text: str, variant: Variant) -> bool:
    """``text`` is in the variant's label (``uniform / MNIST``) or, as a slug, in its run folder's
    name (``uniform-mnist``, the name ``--dry-run`` and ``runs/reproduce/`` show)."""
    slug = _slug(text)
    return text in variant.label or bool(slug) and slug in _slug(variant.label)


def select_variants(row: Row, texts: Sequence[str] = ()) -> list[Variant]:
    """The variants of ``row`` whose label, or run folder name, contains one of ``texts`` (all
    when empty).

    Args:
        row: the experiment.
        texts: substrings of the labels (``uniform / MNIST``) or of the folder names
            (``uniform-mnist``, see :func:`run_dir_of`) to keep; empty keeps every variant.

    Returns:
        The chosen variants, in the row's order.

    Raises:
        ValueError: ``texts`` match no label, or one is empty (it would match every label).
        TypeError: ``texts`` a single string (its characters would each match labels) or holding
            anything but strings.
    """
    texts = check_texts(texts, "variants")
    if any(not text.strip() for text in texts):  # `--variant ''` ran every variant without a word
        labels = [v.label for v in row.variants]
        raise ValueError(f"variants: an empty text matches every label; give part of one of {labels}")
    chosen = [v for v in row.variants if not texts or any(_names_variant(text, v) for text in texts)]
    if not chosen:
        labels = [v.label for v in row.variants]
        raise ValueError(f"variants: none of {list(texts)} is in a label of {labels}")
    return chosen


def _check_finished_runs(row: Row, budget: str, out_dir: str | Path, device: str) -> dict[Path, PlannedRun]:
    """:func:`plan_run`'s checks on every finished run of ``row`` under ``out_dir``, whatever its
    variant or seed: the summary averages them all, so one made before the row was edited, or a
    torn ``result.json``, is refused before anything runs.

    Returns:
        The plans, by run folder (each made once: :func:`reproduce` reuses them).

    Raises:
        ConfigError, ValueError: as :func:`plan_run`.
    """
    plans = {}
    for variant in row.variants:
        folder = run_dir_of(out_dir, row, budget, variant, 0).parent
        for result in sorted(folder.glob(f"seed-*/{RESULT_FILE}")):
            seed = result.parent.name.removeprefix("seed-")
            if seed.isdigit():
                plans[result.parent] = plan_run(row, variant, budget, int(seed), result.parent, device)
    return plans


def reproduce(
    row: Row,
    *,
    budget: str = "cpu",
    seeds: Sequence[int] | None = None,
    out_dir: str | Path = "runs/reproduce",
    device: str = "auto",
    variants: Sequence[str] = (),
    echo: Callable[[str], None] = print,
) -> Path:
    """Run (or continue) every run of ``row`` that has not finished, then write its summary.

    Args:
        row: the experiment (:func:`~torchvote.experiments.rows.get_row`).
        budget: ``cpu`` or ``paper`` (:data:`~torchvote.experiments.rows.BUDGETS`).
        seeds: the seeds to run (default ``0 .. row.seeds - 1``).
        out_dir: where runs and summaries go.
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:<index>``.
        variants: run only the variants whose label contains one of these texts (all when
            empty); the summary still covers every finished run of the row.
        echo: where progress lines go.

    Returns:
        The summary file (markdown); ``summary.json`` lies beside it.

    Raises:
        ValueError: a bad request (see :func:`check_request`), or a finished run's
            ``result.json`` that is not a run's record.
        ConfigError: a run folder, finished or stopped, whose config differs from the row's
            (:func:`plan_run`; it is kept).
        RunInterrupted: a signal stopped a run (its checkpoint is saved; rerun to continue); a
            ``KeyboardInterrupt`` before or between the runs' steps propagates as it is.
    """
    seeds, chosen = check_request(
        row, budget=budget, seeds=seeds, device=device, out_dir=out_dir, variants=variants
    )
    base = as_path(out_dir, "out_dir (--out)") / row.name / budget
    if row.measure is not None:
        result_path = measured_result_of(out_dir, row, budget)
        if not result_path.is_file():
            echo(f"[{row.name}] measuring")
            started = time.perf_counter()
            table = row.measure(budget)
            record = {
                "row": row.name,
                "budget": budget,
                "table": table,
                "wall_s": time.perf_counter() - started,
            }
            record["device"] = describe_device("cpu")
            record["code"] = describe_code()
            atomic_write_bytes(result_path, json.dumps(record, indent=1).encode())
        return write_summary(row, base, summarize(row, budget, base))
    plans = _check_finished_runs(row, budget, out_dir, device)  # the summary counts them all, chosen or not
    # every chosen run with a folder planned before the first trains: a stopped run of the row as
    # it was before an edit is refused now, not after the runs before it trained
    runs = [(variant, seed, run_dir_of(out_dir, row, budget, variant, seed))
            for variant in chosen for seed in seeds]
    plans.update({run_dir: plan_run(row, variant, budget, seed, run_dir, device)
                  for variant, seed, run_dir in runs if run_dir.exists() and run_dir not in plans})
    total = len(runs)
    for done, (variant, seed, run_dir) in enumerate(runs, start=1):
        planned = plans.get(run_dir) or plan_run(row, variant, budget, seed, run_dir, device)
        if planned.state == "finished":  # its note: the code that measured it
            where = f"[{row.name} {done}/{total}] {variant.label}, seed {seed}"
            echo(f"{where}: finished earlier ({planned.note})")
            continue
        # the command as it runs, as --dry-run prints it (run folder and device included)
        note = f" ({planned.note})" if planned.note else ""
        echo(f"[{row.name} {done}/{total}] {variant.label}, seed {seed}: {planned.command}{note}")
        record = _train_one(row, variant, budget, seed, run_dir, planned)
        atomic_write_bytes(run_dir / RESULT_FILE, json.dumps(record, indent=1).encode())
        write_summary(row, base, summarize(row, budget, base))
    return write_summary(row, base, summarize(row, budget, base))
