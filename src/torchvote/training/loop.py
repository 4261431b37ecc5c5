"""The training loop: one plain PyTorch loop for every registered model.

``train(config)`` loads the data, builds the model from the registry, and runs
``forward -> loss -> backward -> step`` with a progress bar, evaluation each epoch, metrics as
JSON lines (and TensorBoard), atomic checkpoints, ``--resume``, Ctrl-C handling and data
parallelism under ``torchrun``.

**Determinism.** The model is initialised from ``seed``; the data order of each epoch comes from
``(seed, epoch)``, and so do the examples of data drawn afresh each epoch (MultiMNIST's training
pairs); each augmentation from ``(seed, epoch, position)``; and before each step the
global torch RNG (dropout, sampling inside models) is reseeded from ``(seed, step, rank)``. A
resumed run therefore takes exactly the steps the killed run would have taken, and reaches
bit-identical weights. The RNG states of torch, numpy and python are saved as well, for code
that draws from them outside the steps, and so are the metric sums since the last metrics record;
records a killed run wrote after the checkpoint it resumes from are dropped and written again, so
``metrics.jsonl`` reads as the unbroken run's (but for the clock).

**Host-device syncs.** A step only queues work on the device: it reads nothing back, so on a GPU
the host runs ahead and queues the next step while this one computes (with ``fp16=true`` it reads
one flag, in ``GradScaler.step``: whether a gradient overflowed and the update is skipped). The
loss and the metric sums of a step are added up on the device
(:class:`~torchvote.training.progress.Progress`) and read once per metrics record (``log_every``)
and at each checkpoint. So is the divergence check: a loss that turns NaN or infinite stops the run
at the next record or checkpoint, not at the step it appeared (the weights are checked before each
checkpoint, so NaN weights are never saved). A callback that reads :attr:`StepInfo.loss` makes its
step wait for the device (a callback that does not read it costs no sync); batches bound for a GPU
come in pinned memory, so their copy to it is asynchronous too.

**Data parallelism.** Under ``torchrun`` each of the N processes takes a contiguous ``1 / N`` of
every global batch (``batch_size`` is global), DDP averages the gradients, so one process and N
processes take the same steps up to floating-point summation order (a loss averaged over a
number of targets that differs between the shares, seq2seq's tokens, is weighted by each share's
count first). Only rank 0 writes
checkpoints, metrics and the progress bar.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import re
import shlex
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from torchvote.files import FolderInUseError, FolderLock, atomic_write_bytes
from torchvote.models.registry import get_model_spec
from torchvote.provenance import describe_code
from torchvote.training.checkpoint import (
    LATEST,
    CheckpointPaths,
    save_checkpoint,
    whole_checkpoints_past_latest,
)
from torchvote.training.config import TrainConfig, config_to_dict, model_config_from, saved_config
from torchvote.training.data import (
    STEP_STREAM,
    BatchPlan,
    TaskData,
    derive_seed,
    iterate_batches,
    pin_memory_for,
)
from torchvote.training.distributed import (
    DistributedContext,
    all_reduce_sum,
    any_process,
    max_over_processes,
    setup_distributed,
)
from torchvote.training.evaluation import (
    autocast,
    build_float32_model,
    evaluate_loss_where_it_applies,
    load_eval_entry,
)
from torchvote.training.metrics import MetricsWriter, read_metrics
from torchvote.training.objectives import spread_margin_schedule
from torchvote.training.optim import build_optimizer, build_scheduler, lr_multiplier
from torchvote.training.progress import LOG_STREAM, Progress
from torchvote.training.results import (
    StepInfo,
    TrainResult,
    check_resumable,
    find_resumable_checkpoint,
    load_run_config,
)
from torchvote.training.setup import (
    compile_model,
    load_run_data,
    model_metadata,
    new_run_dir,
    restore_state,
    seed_everything,
    training_state,
)
from torchvote.training.stopping import StopRequest
from torchvote.training.tasks import get_task_handler, make_objective
from torchvote.validation import as_path

__all__ = [
    "StepInfo",
    "TrainResult",
    "TrainingDivergedError",
    "TrainingOutOfMemoryError",
    "load_run_config",
    "train",
]


class TrainingDivergedError(RuntimeError):
    """The training loss or the weights became NaN or infinite: the run stops before it saves
    such weights."""


class TrainingOutOfMemoryError(torch.cuda.OutOfMemoryError):
    """The device ran out of memory in a training step or an evaluation. The message says where
    the run stopped, its last checkpoint, and what to lower: ``batch_size`` (a new run, since its
    batches differ) or ``eval_batch_size`` (the same run, resumed). A
    ``torch.cuda.OutOfMemoryError`` (``torch.OutOfMemoryError``), so code that catches that
    catches this; the original error is its ``__cause__``."""


#: The keys of a ``final`` metrics record that say what was evaluated; the rest are the metrics.
_FINAL_RECORD_CONTEXT = frozenset({"event", "step", "time", "dataset", "source", "eval_limit"})


def train(
    config: TrainConfig,
    *,
    resume: str | Path | None = None,
    callbacks: Sequence[Callable[[StepInfo], None]] = (),
    verbose: bool = True,
    resume_hint: bool = True,
    on_start: Callable[[], None] | None = None,
) -> TrainResult:
    """Train (or, with ``resume``, continue training) as ``config`` says.

    Args:
        config: the run config.
        resume: a run folder (``~`` expanded) to continue from its newest intact checkpoint (a
            truncated or corrupt newer one is skipped, said in one line on stderr, and kept).
            ``config`` must equal the run's config except for
            :data:`~torchvote.training.config.RESUMABLE_KEYS` (:func:`load_run_config` gives
            such a config).
        callbacks: called after every optimiser step with a :class:`StepInfo` (the callbacks of
            one step share it); one that raises ``KeyboardInterrupt`` stops the run the way
            Ctrl-C does (checkpoint, then return). Its ``loss`` is read from the device when a
            callback first reads it: on a GPU that waits for the step to finish, so a callback
            that needs the loss only now and then should read it only then.
        verbose: print the result table (rank 0).
        resume_hint: after a stop, end the line that says where the run stopped with the
            command that continues it (``torchvote train --resume RUN_DIR``); ``False`` for a
            caller that continues runs its own way and says so itself (``torchvote reproduce``:
            rerun the same command), so that the user sees one instruction.
        on_start: called once (on every process) when the set-up is done (config checked
            against the data and the model, run folder opened, checkpoint restored) and the
            training begins; what is raised before it is a config that does not fit, after it a
            failure while training (the command line's exit status tells them apart).

    The run seeds Python's ``random``, NumPy's and torch's global generators from
    ``config.seed``; when it returns (or raises) they are given back the states they had when it
    was called (torch's on the CPU, and on every CUDA device where the run uses CUDA or CUDA was
    initialised before), so that what a notebook or a sweep draws after a run does not repeat
    after every run.

    Returns:
        a :class:`TrainResult`; ``interrupted`` tells whether it stopped early. Plots are drawn
        afterwards, by :func:`~torchvote.training.plots.plot_run`.

    Raises:
        ConfigError: a config that does not fit the data or the model.
        CheckpointError: no intact checkpoint to resume from, or one that does not fit.
        ValueError: an unknown data set, model or preset.
        TrainingDivergedError: the loss or the weights became NaN or infinite.
        TrainingOutOfMemoryError: the device ran out of memory (the message says what to lower).
        OSError: a file could not be written (a full disk ...): the last checkpoint is intact,
            and one line on stderr says where the run stopped and how to continue it.
        TypeError: ``config`` no :class:`TrainConfig`, ``callbacks`` not a list of callables,
            ``on_start`` not callable (before anything is written).
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig (load_config builds one), got {type(config).__name__}")
    given = callbacks  # each was called only after the first step: a run folder without a checkpoint
    callbacks = [] if callable(given) or not isinstance(given, Iterable) else list(given)
    if callable(given) or not isinstance(given, Iterable) or not all(map(callable, callbacks)):
        raise TypeError(f"callbacks must be a list of callables taking a StepInfo, got {given!r}")
    if on_start is not None and not callable(on_start):
        raise TypeError(f"on_start must be a callable taking no argument or None, got {on_start!r}")
    context = setup_distributed(config.device)
    deterministic = torch.are_deterministic_algorithms_enabled()  # deterministic=true sets it
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()  # and makes it strict
    ended, run = False, None
    try:
        with _callers_random_state(context.device):
            run = _Run(config, context, resume, callbacks, verbose, resume_hint, on_start)
            result = run.run()
        ended = True  # on every process: a stop is agreed by all of them
        return result
    finally:
        if run is not None:
            run.release()  # before its process group goes
        context.close(together=ended)
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)  # the caller's again


@contextlib.contextmanager
def _callers_random_state(device: torch.device) -> Iterator[None]:
    """Python's, NumPy's and torch's global generators given back, at the end of the block, the
    states they had at its start: a run seeds them all from its config (and torch's again every
    step), so that without this every draw after :func:`train` repeated the same numbers after
    each run. Torch's CUDA generators are kept (all of them: ``torch.manual_seed`` seeds every
    device) where CUDA is initialised already or the run uses it; elsewhere not, because reading
    them would initialise CUDA (a context on the GPU) for a run on the CPU."""
    cuda = torch.cuda.is_initialized() or device.type == "cuda"
    cuda_devices = range(torch.cuda.device_count()) if cuda else []
    python_state = random.getstate()
    numpy_state = np.random.get_state()  # noqa: NPY002 (the global state, which the run seeds)
    try:
        with torch.random.fork_rng(cuda_devices, device_type="cuda"):  # the CPU's and these devices'
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)  # noqa: NPY002 (as above)


class _Run:
    """One training run; the methods are the phases and the steps of :func:`train`."""

    def __init__(
        self,
        config: TrainConfig,
        context: DistributedContext,
        resume: str | Path | None,
        callbacks: Sequence[Callable[[StepInfo], None]],
        verbose: bool,
        resume_hint: bool = True,
        on_start: Callable[[], None] | None = None,
    ) -> None:
        self.started = time.perf_counter()
        self.on_start = on_start
        self.earlier_s = 0.0  # wall seconds of earlier segments, up to the checkpoint resumed from
        self.config = config
        self.context = context
        self.callbacks = list(callbacks)
        self.verbose = verbose and context.is_main
        self.resume_hint = resume_hint
        self.stop = StopRequest(self._log)
        self.resume_from: tuple[CheckpointPaths, dict[str, Any]] | None = None
        # The run folder's lock (rank 0), taken before the folder is read when it exists (the
        # checkpoint to resume from, a run stopped before its first checkpoint that starts over):
        # a process still writing there would change what was read. A folder made now is locked
        # before the first write (_open_run_dir). Released by release(), which train() calls.
        # one path for the lock, the checkpoints and the files ('~' expanded everywhere: the
        # checkpoint search expanded it while the lock and config.yaml took it literally)
        resume = None if resume is None else as_path(resume, "resume")
        named = resume if resume is not None else config.run_dir and Path(config.run_dir).expanduser()
        self.lock = FolderLock(named, "run folder") if named else None
        try:
            # os.path.isdir: False, not an OSError, for a name the file system refuses (a part
            # over 255 bytes), which new_run_dir below then refuses naming run_dir
            if self.lock is not None and context.is_main and os.path.isdir(named):
                self.lock.acquire()
            if resume is not None:
                paths, state, skipped = find_resumable_checkpoint(resume)
                # before any data loads: a config of another model or data set is refused by
                # name, not by whatever its data or model would fail on first
                check_resumable(saved_config(state["config"]), config)
                if skipped:
                    self._log(
                        f"skipping unreadable checkpoint(s), kept as they are: {'; '.join(skipped)}; "
                        f"resuming from {paths.name}"
                    )
                past = whole_checkpoints_past_latest(paths.weights.parent) if resume.is_dir() else []
                if past:  # a kill between a checkpoint's files and its pointer: said, not taken
                    pointer = paths.weights.parent / LATEST
                    self._log(
                        f"resuming from {paths.name}" + ("" if skipped else f", as {pointer} says")
                        + f"; newer checkpoint(s) {', '.join(past)} look whole but are not resumed "
                        f"from (to resume from {past[0]}, write {past[0]} into {pointer}); when the "
                        "run writes their step again their files are renamed to .old, and deleted "
                        "with that step's checkpoint by keep_checkpoints: copy them elsewhere to keep them"
                    )
                self.resume_from = paths, state
            self.run_dir = resume if resume is not None else new_run_dir(config, context)
        except BaseException:  # refused (a user's folder, a foreign run): the folder as it was
            if self.lock is not None:
                self.lock.release(discard=True)
            raise
        if self.lock is None:  # a folder made for this run
            self.lock = FolderLock(self.run_dir, "run folder")
        self.writer: MetricsWriter | None = None
        self.last_checkpoint: CheckpointPaths | None = None
        self.last_saved_step = -1
        self._described_code: str | None = None  # describe_code(), at the first checkpoint
        self.evaluations: dict[tuple[str, int], dict[str, float]] = {}  # (eval_on entry or "", step)
        self.step = self.epoch = self.position = 0
        self.in_step = False
        self.step_lr = 0.0  # the learning rate the last optimiser step used (set by each step)
        self.step_margin: float | None = None  # the spread loss's margin at the last step, if any
        self.evaluating = False  # inside an evaluation (what an out-of-memory error advises)
        self.last_save_time = time.monotonic()  # for checkpoint_minutes
        # {"step", "accuracy", "target"} once an evaluation reached stop_at_accuracy (checkpointed)
        self.reached_target: dict[str, Any] | None = None

    # --- set-up ---------------------------------------------------------------------------------

    def _log(self, message: str) -> None:
        if self.context.is_main:
            from tqdm import tqdm

            tqdm.write(message, file=LOG_STREAM)  # stderr, whose reader may leave: the run goes on

    def _setup(self) -> None:
        config, context = self.config, self.context
        seed_everything(config, context.device)
        self.spec = get_model_spec(config.model.name)
        self.handler = get_task_handler(self.spec.task)
        self.train_data, self.eval_data, fields = load_run_data(config, self.handler)
        self.model_config = model_config_from(config, **fields)
        self.augment = self.handler.augment(config.data, self.train_data)
        self.train_data = self.train_data.map(lambda data: self.handler.finalize(data, self.model_config))
        self.eval_data = self.handler.finalize(self.eval_data, self.model_config)
        for entry in config.eval_on:  # a wrong name, option, task or image size fails now, not
            self._load_eval_entry(entry)  # after the training (loaded again at the end: memory)

        self.model = build_float32_model(self.spec, self.model_config).to(context.device)
        self.pin_memory = pin_memory_for(context.device)  # for the asynchronous copy of each batch
        self.plan = BatchPlan(
            len(self.train_data),
            config.batch_size,
            config.seed,
            context.world_size,
            context.rank,
            noun=self.handler.training_examples(self.model_config),
        )
        steps = config.epochs * self.plan.steps_per_epoch
        self.total_steps = min(steps, config.max_steps) if config.max_steps is not None else steps
        self.optimizer = build_optimizer(self.model.parameters(), config.optim)
        self.scheduler = build_scheduler(self.optimizer, config.optim, self.total_steps)
        warmup = config.optim.warmup_steps
        if config.optim.schedule != "onecycle" and self.total_steps < warmup and not self.resume_from:
            # a short trial of a preset (max_steps=20) trained at a fraction of its rate, unsaid
            self._log(
                f"note: optim.warmup_steps={warmup} is longer than this run's {self.total_steps} steps: "
                f"the learning rate ends at {self.total_steps / warmup:.0%} of optim.lr={config.optim.lr:g} "
                "(optim.warmup_steps=0, or fewer, for a short run)"
            )
        epochs_run = -(-self.total_steps // self.plan.steps_per_epoch)  # begun; the last perhaps cut short
        if config.eval_every > epochs_run and not self.resume_from:  # eval_every counts epochs, not steps
            self._log(
                f"note: eval_every={config.eval_every} counts epochs and this run trains {epochs_run}: it "
                "evaluates at its end only"
            )
        # fp16's loss scaling; with fp16=false every call of it is the plain one (see _train_step)
        self.scaler = torch.amp.GradScaler(context.device.type, enabled=config.fp16)
        self.objective = make_objective(
            config.loss,
            self.spec,
            self.total_steps,
            fields.get("pad_id"),
            model_config=self.model_config,
            data=[data for data in (self.eval_data, self.train_data) if isinstance(data, TaskData)],
        )
        if self.resume_from is not None:
            paths, state = self.resume_from
            self.step = restore_state(self, paths, state)
            self.last_checkpoint, self.last_saved_step = paths, self.step  # never rewritten as it is
            self._log(f"resuming {self.run_dir} from step {self.step} ({paths.weights.name})")
            self._note_a_redrawn_schedule(state.get("total_steps"))
            self._reached_target(state.get("reached_target"))
        self.epoch, self.position = divmod(self.step, self.plan.steps_per_epoch)
        self.ddp_model: nn.Module = self.model
        if context.is_distributed:
            device_ids = [context.device] if context.device.type == "cuda" else None
            self.ddp_model = nn.parallel.DistributedDataParallel(self.model, device_ids=device_ids)
        self.ddp_model = compile_model(self.ddp_model, config.compile)  # the step's module only

    def _reached_target(self, reached: dict[str, Any] | None) -> None:
        """End a resumed run at its checkpoint's step if an evaluation there reached this run's
        ``stop_at_accuracy`` (a run that stopped at its target is finished; a higher target, or
        none, trains on)."""
        target = self.config.stop_at_accuracy
        if reached is None or target is None or reached["accuracy"] < target:
            return
        self.reached_target = {**reached, "target": target}
        self.total_steps = self.step

    def _release_unused_run_dir(self) -> None:
        """Remove the folder :func:`new_run_dir` claimed for this run if nothing was written to it
        (the set-up failed: bad data, a bad config), so a failed start leaves no empty run."""
        if self.resume_from is None and self.config.run_dir is None and self.context.is_main:
            with contextlib.suppress(OSError):  # not empty, or already gone: leave it
                self.run_dir.rmdir()

    def _open_run_dir(self) -> None:
        """Rank 0: the run folder, its ``config.yaml``, the metrics writer, one line of what runs."""
        config, context = self.config, self.context
        if not context.is_main:
            return
        self.lock.acquire()  # before anything is written (run() releases it if this fails)
        import yaml

        text = yaml.safe_dump(config_to_dict(config), sort_keys=False)
        atomic_write_bytes(self.run_dir / "config.yaml", text.encode())  # a resumed run's: whole or old
        records_gone = self.step > 0 and not (self.run_dir / "metrics.jsonl").exists()
        self.writer = MetricsWriter(self.run_dir, tensorboard=config.tensorboard, resume_step=self.step)
        if records_gone:  # deleted or moved: the plots will start here, which a user should hear now
            self._log(
                f"metrics.jsonl: not in {self.run_dir}; the records of steps 1 to {self.step} are gone, "
                f"a new file starts at step {self.step + 1}"
            )
        if self.writer.dropped:  # a run killed after its checkpoint, or resumed from an older one
            dropped = self.writer.dropped
            self._log(f"metrics.jsonl: dropped {dropped} record(s) after step {self.step} (taken again)")
        if self.reached_target is not None and self.step >= self.total_steps:
            accuracy = 100 * self.reached_target["accuracy"]
            self._log(
                f"{self.run_dir} reached stop_at_accuracy={self.config.stop_at_accuracy} at step "
                f"{self.step} ({accuracy:.2f}%): nothing to train"
            )
            return
        if self.step >= self.total_steps:  # a finished run, resumed: nothing left to train
            self._log(f"{self.run_dir} has finished its {self.total_steps} steps: nothing to train")
            return
        steps = f"{self.total_steps} step{'s' if self.total_steps != 1 else ''}"
        processes = f"{context.world_size} process{'es' if context.world_size != 1 else ''}"
        self._log(
            f"training {self.spec.name} on {config.data.name} ({len(self.train_data):,} examples, "
            f"{steps} of {config.batch_size} on {processes}, {context.device}) -> {self.run_dir}"
        )

    # --- checkpoints and evaluation ---------------------------------------------------------------

    def wall_s(self) -> float:
        """Seconds this run has taken, over every segment (checkpoints carry the running total)."""
        return self.earlier_s + time.perf_counter() - self.started

    def _resume_point(self) -> tuple[int, int]:
        """``(epoch, position)`` where a run resumed from the current step starts."""
        if self.position == self.plan.steps_per_epoch:
            return self.epoch + 1, 0
        return self.epoch, self.position

    def _code(self) -> str:
        """:func:`~torchvote.provenance.describe_code`, asked once per run (git runs in a
        subprocess): what each checkpoint's weights record of the code that trained them."""
        if self._described_code is None:
            self._described_code = describe_code()
        return self._described_code

    def _save(self, progress: Progress) -> None:
        """Checkpoint the current step (once; every process calls it), if its weights are worth
        keeping: stop with :class:`TrainingDivergedError` if a loss since the last report, or the
        weights the last step made, are NaN or infinite (a non-finite gradient of a finite loss
        poisons the weights before any loss shows it)."""
        if self.step == self.last_saved_step:
            return
        window = progress.window_totals(self.context)  # every process: an all-reduce
        self._check_finite(math.isfinite(window["loss_sum"]) if window else True, "training loss")
        self._check_finite(_weights_finite(self.model), "weights")
        if not self.context.is_main:
            self.last_saved_step = self.step
            return
        if self.writer is not None:  # the records up to this step reach the disk before it
            self.writer.sync()
        epoch, position = self._resume_point()
        metadata = {
            **model_metadata(
                self.spec, self.model_config, self.config, self.total_steps,
                vocab=self.train_data.extras.get("vocab"), code=self._code(),
            ),
            "step": str(self.step),
        }
        state = training_state(self, epoch, position, window)
        self.last_checkpoint = save_checkpoint(
            self.run_dir / "checkpoints",
            step=self.step,
            model=self.model,
            model_metadata=metadata,
            state=state,
            keep=self.config.keep_checkpoints,
        )
        self.last_saved_step, self.last_save_time = self.step, time.monotonic()

    def _evaluate(self, data: TaskData, source: str = "") -> dict[str, float]:
        """``data``'s metrics at this step, evaluated once: ``source`` is the ``eval_on`` entry it
        came from (``""`` for the run's own test set), since entries of one data set and split
        with other options (``canvas=``, ``size=``) are other examples."""
        key = (source, self.step)
        if key not in self.evaluations:  # the last epoch's evaluation is also the final one
            self.evaluating = True  # reset only when it returns: an error leaves it set
            self.evaluations[key] = evaluate_loss_where_it_applies(  # an eval_on set's labels may not fit
                self.model,
                data,
                self.handler,
                self.objective,
                echo=self._log,
                batch_size=self.config.eval_batch_size,
                device=self.context.device,
                context=self.context,
                bf16=self.config.bf16,
                fp16=self.config.fp16,
                step=self.step,
            )
            self.evaluating = False
        return self.evaluations[key]

    # --- the run and its loop -----------------------------------------------------------------------

    def release(self) -> None:
        """Let the run folder's lock go (if still held), and drop the DDP wrapper, whose reducer
        holds the process group. The run outlives
        :func:`train` in a reference cycle (its stop request logs through it) until the garbage
        collector runs, at the latest at interpreter exit, after the group was destroyed: a
        reducer freed then can abort the process ("terminate called without an active
        exception") after a finished torchrun run."""
        self.ddp_model = None
        self.lock.release()

    def run(self) -> TrainResult:
        try:
            self._setup()
        except BaseException:  # nothing written yet: the folder as it was, a lock file it made gone too
            self.lock.release(discard=True)
            self._release_unused_run_dir()
            raise
        try:
            self._open_run_dir()  # takes the folder's lock (rank 0) if not yet taken
        except BaseException as err:
            # a full disk: said as in a step (a bare "[Errno 28]" was). Not for a folder another
            # process holds: its checkpoints are that run's, and a command to go on would point at
            # it; nor a command for a folder this process may not write: it would fail as this did
            if isinstance(err, OSError) and not isinstance(err, FolderInUseError):
                where = self._kept() if isinstance(err, PermissionError) else self._where_to_go_on()
                self._log(f"{type(err).__name__} opening the run folder {self.run_dir}: {where}")
            self.lock.release()
            if self.writer is not None:
                self.writer.close()
            raise
        try:
            if self.on_start is not None:
                self.on_start()
            with self.stop:
                interrupted = self._loop()
            results = {} if interrupted else self._final_results()
        except torch.cuda.OutOfMemoryError as err:
            raise TrainingOutOfMemoryError(self._out_of_memory_advice()) from err
        except (OSError, RuntimeError) as err:  # a full disk, a data file gone, a kernel error ...
            if not isinstance(err, TrainingDivergedError):  # that one says where the run stopped
                self._log(f"{type(err).__name__} at step {self.step}: {self._where_to_go_on()}")
            raise
        finally:
            if self.writer is not None:
                self.writer.close()
            self.lock.release()
        result = TrainResult(
            run_dir=self.run_dir,
            checkpoint=self.last_checkpoint if self.context.is_main else None,
            metrics_path=self.writer.path if self.writer is not None else None,
            results=results,
            step=self.step,
            epoch=self.epoch,
            interrupted=interrupted,
            model=self.model,
            config=self.config,
            wall_s=self.wall_s(),
            reached_target=self.reached_target,
            stop_signal=self.stop.signal_name if interrupted else "",
        )
        if self.verbose and not interrupted:
            print(result.table())
        self.context.barrier()
        return result

    def _loop(self) -> bool:
        """Train to ``total_steps`` or a stop request; return whether the run was interrupted."""
        progress = Progress(
            total=self.total_steps,
            initial=self.step,
            # a finished run resumed (to evaluate anew) trains nothing: no full bar drawn twice
            enabled=self.context.is_main and self.config.progress and self.step < self.total_steps,
        )
        if self.resume_from is not None and self.context.is_main:  # the checkpoint's metrics window
            progress.restore(self.resume_from[1].get("metrics_window", {}), self.context.device)
        with progress:
            try:
                while self.step < self.total_steps:
                    for batch in self._epoch_batches():
                        self._step(batch, progress)
                        self._maybe_log(progress)
                        with progress.paused():  # no training: out of the next window's rate
                            reached = self._maybe_evaluate(progress)
                            self._maybe_checkpoint(progress)
                        # one exchange: the highest signal number any process received (SIGTERM
                        # over SIGINT, 0: none), so that all stop and exit with its status
                        signum, due = max_over_processes(
                            (self.stop.signum, int(self._checkpoint_due())), self.context
                        )
                        if signum:
                            self.stop.agree(signum)
                            self._save(progress)
                            return self._stopped(progress, saved=True)
                        if due:
                            with progress.paused():
                                self._save(progress)
                        if reached:
                            self.total_steps = self.step  # the run ends here (see _reached_target)
                        if self.step >= self.total_steps:
                            break
                    if self.position == self.plan.steps_per_epoch:
                        self.epoch, self.position = self.epoch + 1, 0
            except KeyboardInterrupt:
                # Inside a step the weights may be half-updated: keep the last checkpoint. After a
                # stop was requested, this is the second Ctrl-C: stop at once, without saving.
                saved = not self.in_step and not self.stop.requested
                if saved:
                    self._save(progress)
                return self._stopped(progress, saved=saved)
            self._save(progress)
        return False

    def _note_a_redrawn_schedule(self, saved_total: int | None) -> None:
        """Say so when a resume with other ``epochs`` / ``max_steps`` redraws a schedule over the
        new length: a cosine learning rate (onecycle refuses it; the other schedules do not depend
        on it) or the spread loss's margin ramp (unless ``loss.spread_ramp_steps`` fixes it). The
        value jumps at the resumed step."""
        if saved_total in (None, self.total_steps):
            return
        optim, loss, lengths = self.config.optim, self.config.loss, (saved_total, self.total_steps)
        if optim.schedule == "cosine":
            before, after = (optim.lr * lr_multiplier(optim, total)(self.step) for total in lengths)
            self._log(
                f"the cosine schedule is redrawn over {self.total_steps} steps (was {saved_total}): "
                f"{_change_at('learning rate', before, after, self.step)}"
            )
        if loss.name == "spread" and not loss.spread_ramp_steps:
            before, after = (spread_margin_schedule(loss, total)(self.step) for total in lengths)
            self._log(
                f"the spread loss's margin ramp is redrawn over {self.total_steps} steps (was "
                f"{saved_total}): {_change_at('margin', before, after, self.step)}"
            )

    def _epoch_batches(self) -> Any:
        """The batches of the current epoch from the current position (a resumed run starts
        mid-epoch)."""
        return iterate_batches(
            self.train_data,
            self.plan,
            self.epoch,
            self.position,
            augment=self.augment,
            num_workers=self.config.num_workers,
            pin_memory=self.pin_memory,
        )

    def _step(self, batch: dict[str, Tensor], progress: Progress) -> None:
        """One optimiser step; then the metrics window, the bar and the callbacks."""
        self.in_step = True
        loss, sums, items = self._train_step(batch)
        self.in_step = False
        self.step += 1
        self.position += 1
        progress.add(loss, sums, items)
        if not self.callbacks:
            return
        info = _StepInfo(self.step, self.epoch, loss, self.model)
        try:
            for callback in self.callbacks:
                callback(info)
        except KeyboardInterrupt:
            self.stop.request("KeyboardInterrupt")

    def _train_step(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor], int]:
        device = self.context.device
        items = self.handler.items(batch)  # counted on the host copy: no read from the device
        host_arguments = self.handler.host_arguments(self.ddp_model, batch)  # e.g. source_lengths, on the CPU
        # asynchronous where the batch is pinned (on CUDA: see pin_memory_for)
        batch = {key: value.to(device, non_blocking=True) for key, value in batch.items()}
        _reseed(derive_seed(self.config.seed, STEP_STREAM, self.step, self.context.rank), device)
        self.ddp_model.train()
        with autocast(device, self.config.bf16, self.config.fp16):
            output = self.handler.forward(self.ddp_model, batch, **host_arguments)
            loss, terms = self.objective(output, batch, self.step)
        # a CPU scalar (whatever the default device): reading it makes no device wait
        margin = terms.get("spread_margin")
        self.step_margin = None if margin is None else float(margin)
        self.optimizer.zero_grad(set_to_none=True)
        # fp16 (torch.amp's recipe): backward from the loss scaled up, so that small float16
        # gradients do not flush to zero; the gradients unscaled before clipping, so grad_clip
        # clips the true ones; step() skips the update when a gradient overflowed, and update()
        # then lowers the scale. The step reads one flag from the device, inside step() (whether
        # any gradient was inf or NaN): GradScaler's own sync, the only one fp16 adds. Under DDP
        # the gradients are all-reduced before unscale_, so every process skips the same steps.
        # Without fp16 the scaler is disabled and each call is the plain one.
        self.scaler.scale(self._share_of_the_global_mean(loss, batch)).backward()
        if self.config.optim.grad_clip is not None:
            self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.model.parameters(), self.config.optim.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.step_lr = self.optimizer.param_groups[0]["lr"]  # this step's: the record's, not the next's
        with _scheduler_after_a_skipped_step(self.scaler.is_enabled()):
            self.scheduler.step()  # by the step count, also after a skipped update (as a resume counts)
        sums = self.handler.metric_sums(output, batch)
        return loss.detach(), sums, items

    def _share_of_the_global_mean(self, loss: Tensor, batch: dict[str, Tensor]) -> Tensor:
        """The loss whose gradient, averaged by DDP over the processes, is the gradient of the
        global batch's mean: ``loss * n_local * N / n_global`` where the processes' shares hold
        different numbers of targets (seq2seq's tokens; DDP's average of the per-process means
        weighted a token of a short share more). One all-reduce of a count, on the device."""
        units = self.handler.loss_units(batch) if self.context.is_distributed else None
        if units is None:
            return loss
        units = units.to(loss.dtype)
        total = all_reduce_sum(units, self.context)  # () targets of the global batch
        return loss * (units * self.context.world_size / total.clamp_min(1))

    @property
    def _end_of_epoch(self) -> bool:
        return self.position == self.plan.steps_per_epoch

    def _maybe_log(self, progress: Progress) -> None:
        """Every ``log_every`` steps, at each epoch end and at the last step: one metrics record
        of the steps since the last one (summed over processes), and the bar's figures."""
        last = self.step == self.total_steps
        if not (self.step % self.config.log_every == 0 or self._end_of_epoch or last):
            return
        record = progress.report(self.handler, self.context, lr=self.step_lr)
        self._check_finite(math.isfinite(record["loss"]))
        if self.step_margin is not None:  # the spread loss rises with its margin (0.2 -> 0.9): say so
            record["spread_margin"] = self.step_margin
        if self.writer is not None:
            self.writer.write("train", self.step, record, epoch=self.epoch)

    def _maybe_evaluate(self, progress: Progress) -> bool:
        """At the end of every ``eval_every``-th epoch: evaluate, record and print one line.
        Return whether the evaluation reached ``stop_at_accuracy`` (and say so)."""
        every = self.config.eval_every
        if not (self._end_of_epoch and every and (self.epoch + 1) % every == 0):
            return False
        metrics = self._evaluate(self.eval_data)
        label = f"{self.eval_data.name}/{self.eval_data.split}"
        if self.writer is not None:
            self.writer.write("eval", self.step, metrics, epoch=self.epoch + 1, dataset=label)
        if self.context.is_main:
            accuracy = 100 * metrics["accuracy"]
            message = f"step {self.step} epoch {self.epoch + 1}: {label} accuracy {accuracy:.2f}%"
            if "loss" in metrics:
                message += f", loss {metrics['loss']:.4f}"
            progress.write(message)
        target = self.config.stop_at_accuracy
        if target is None or metrics["accuracy"] < target:
            return False
        # recorded (and checkpointed) at the last step too: a resume with more epochs then ends
        self.reached_target = {"step": self.step, "accuracy": float(metrics["accuracy"]), "target": target}
        if self.step >= self.total_steps:  # the run ends here anyway
            return False
        self._log(f"stop_at_accuracy={target} reached at step {self.step}: the run ends here")
        return True

    def _checkpoint_due(self) -> bool:
        """Whether ``checkpoint_minutes`` have passed since the last checkpoint (or the start), by
        the main process's clock: :func:`max_over_processes` makes every process save with it."""
        minutes = self.config.checkpoint_minutes
        if not (minutes and self.context.is_main) or self.step == self.last_saved_step:
            return False
        return time.monotonic() - self.last_save_time >= 60 * minutes

    def _maybe_checkpoint(self, progress: Progress) -> None:
        """At each epoch end and every ``checkpoint_every`` steps (unless the loss diverged)."""
        every = self.config.checkpoint_every
        if self._end_of_epoch or (every and self.step % every == 0):
            self._save(progress)

    def _check_finite(self, finite: bool, what: str = "training loss") -> None:
        """Stop the run when ``what`` (a loss since the last check, the weights) was NaN or
        infinite: the weights that step made are not worth keeping, and every later step would
        only spread the NaN.

        Raises:
            TrainingDivergedError: naming the steps, the last checkpoint and what to change.
        """
        if finite:
            return
        kept = f"the last checkpoint is {self.last_checkpoint.weights}" if self.last_checkpoint else (
            "no checkpoint was written"
        )
        lower = f"a lower optim.lr (now {self.config.optim.lr})"
        advice = {  # float16 overflows past 65504; bfloat16 has float32's range
            "fp16": f"{lower}, optim.grad_clip=1.0, or fp16=false (bf16=true on a GPU with fast bfloat16)",
            "bf16": f"{lower}, optim.grad_clip=1.0, or bf16=false",
            None: f"{lower} or optim.grad_clip=1.0",
        }[self._mixed_precision]
        raise TrainingDivergedError(
            f"the {what} became NaN or infinite by step {self.step}: stopped without "
            f"saving these weights; {kept}. Try {advice}"
        )

    @property
    def _mixed_precision(self) -> str | None:
        """``"bf16"`` or ``"fp16"``, the config's autocast flag that is on; ``None``: neither."""
        return "bf16" if self.config.bf16 else "fp16" if self.config.fp16 else None

    def _stopped(self, progress: Progress, *, saved: bool) -> bool:
        """Close the bar and say where the run stopped and how to resume it; return ``True``."""
        progress.close()
        if not self.context.is_main:
            return True
        reason = self.stop.signal_name or "KeyboardInterrupt"
        if saved and self.last_checkpoint is not None:
            where = f"checkpoint saved at step {self.step}: {self.last_checkpoint.weights}"
        elif self.last_checkpoint is not None:
            how = "stopped at once" if self.stop.requested else "interrupted inside a step"
            where = f"{how}; the last checkpoint is {self.last_checkpoint.weights}"
        else:
            where = "no checkpoint was written"
        self._log(
            f"{reason}: stopped at step {self.step} of {self.total_steps}; {where}"
            + (f"\n{command}" if self.resume_hint and (command := self._continue_command()) else "")
        )
        return True

    def _continue_command(self, *overrides: str) -> str:
        """``resume with: torchvote train --resume RUN [overrides]`` (a checkpoint of this segment,
        or the one it resumed from), or, before the first checkpoint (nothing to resume),
        ``start it again with: torchvote train RUN/config.yaml`` (the saved config starts the run
        over in the same folder; ``run_dir=RUN`` is added when the folder was generated, as the
        saved config then names none and would make another); ``""`` where ``config.yaml`` was
        never written (a read-only folder), since that command would name a file that is not there."""
        if self.last_checkpoint is not None or self.resume_from is not None:
            command = ["torchvote", "train", "--resume", str(self.run_dir), *overrides]
            return f"resume with: {shlex.join(command)}"
        if not (self.run_dir / "config.yaml").is_file():
            return ""
        same_folder = [f"run_dir={self.run_dir}"] if self.config.run_dir is None else []
        command = ["torchvote", "train", str(self.run_dir / "config.yaml"), *same_folder, *overrides]
        return f"start it again with: {shlex.join(command)}"

    def _kept(self) -> str:
        """``the last checkpoint is PATH, intact`` (this segment's, or the one it resumed from) or
        ``no checkpoint was written``."""
        last = self.last_checkpoint or (self.resume_from[0] if self.resume_from is not None else None)
        if last is None:
            return "no checkpoint was written"
        return f"the last checkpoint is {last.weights}, intact"

    def _where_to_go_on(self) -> str:
        """Where a run stopped by an error stands: its last checkpoint and the command that
        continues it (without the command when the caller says how, ``resume_hint=False``)."""
        command = self._continue_command() if self.resume_hint else ""
        return self._kept() + (f"; {command}" if command else "")

    def _out_of_memory_advice(self) -> str:
        """What to lower after the device ran out of memory, and how to go on."""
        config, device, precision = self.config, self.context.device, self._mixed_precision
        if self.evaluating:  # a resumed run may change the evaluation batch: the same run
            smaller = max(1, config.eval_batch_size // 2)
            advice = f"lower eval_batch_size (now {config.eval_batch_size})"
            if self.resume_hint:
                advice += f": {self._continue_command(f'eval_batch_size={smaller}')}"
            return f"{device} ran out of memory evaluating at step {self.step}; {advice}"
        stopped = (
            f"{device} ran out of memory in training step {self.step + 1} "
            f"(batch_size={config.batch_size}{f', {precision}' if precision else ''}); {self._kept()}"
        )
        if not self.resume_hint:  # the caller's runs have their sizes: no command of ours fits
            return f"{stopped}; it needs a device with more free memory"
        smaller = max(1, config.batch_size // 2)
        new_run = ["torchvote", "train", str(self.run_dir / "config.yaml"), f"batch_size={smaller}",
                   f"run_dir={self.run_dir}-batch{smaller}"]
        return (
            f"{stopped}. A smaller batch trains on other batches, so it is a new run: "
            f"{shlex.join(new_run)}"
            # float16 and bfloat16 activations take half float32's memory
            + ("" if precision else " (bf16=true, or fp16=true on GPUs without fast bfloat16, "
               "also halves the activations' memory)")
            + (f"; or, with more free memory on the device, {self._continue_command()}"
               if self.last_checkpoint is not None else "")
        )

    def _final_results(self) -> dict[str, dict[str, float]]:
        """:meth:`_final_evaluation`, run outside the stop request: the last checkpoint is written,
        so Ctrl-C stops the evaluation at once (saying so; a resume runs the evaluations not yet
        recorded) and SIGTERM ends the process, instead of a request nothing would read."""
        try:
            return self._final_evaluation()
        except KeyboardInterrupt:
            self._log(f"KeyboardInterrupt: stopped in the final evaluation at step {self.step}; "
                      f"{self._where_to_go_on()}")
            raise

    def _final_evaluation(self) -> dict[str, dict[str, float]]:
        """Evaluate on the run's test set and each ``eval_on`` entry; write one ``final`` record
        each. An evaluation already recorded at this step (a finished run resumed, or one killed
        during its final evaluation) is reported from ``metrics.jsonl``, not run again; one whose
        data set, entry or ``data.eval_limit`` changed on resume is run."""
        limit = self.config.data.eval_limit
        recorded = self._recorded_final_evaluations()
        results: dict[str, dict[str, float]] = {}

        def evaluate_once(source: str, label: str | None, load: Callable[[], TaskData]) -> None:
            earlier = recorded.get((source, limit))
            reuse = earlier is not None and (label is None or earlier[0] == label)
            if any_process(not reuse, self.context):  # every process evaluates, or none does
                data = load()
                label = f"{data.name}/{data.split}"
                if label in results:  # another entry of one data set (other options): both stay
                    label = f"{label} ({source})"
                results[label] = self._evaluate(data, source)
                if self.writer is not None:
                    self.writer.write(
                        "final", self.step, results[label], dataset=label, source=source, eval_limit=limit
                    )
            else:
                assert earlier is not None
                results[earlier[0]] = earlier[1]
                self._log(
                    f"{earlier[0]}: the final evaluation recorded at step {self.step} "
                    f"in {self.run_dir / 'metrics.jsonl'}"
                )

        main_label = f"{self.eval_data.name}/{self.eval_data.split}"
        evaluate_once("", main_label, lambda: self.eval_data)
        for entry in self.config.eval_on:
            evaluate_once(entry, None, lambda entry=entry: self._load_eval_entry(entry))
        return results

    def _load_eval_entry(self, entry: str) -> TaskData:
        """The finalised test set an ``eval_on`` entry names (``data.root`` unless its own)."""
        config = self.config
        return load_eval_entry(
            self.handler, entry, self.model_config, root=config.data.root, limit=config.data.eval_limit
        )

    def _recorded_final_evaluations(self) -> dict[tuple[str, int | None], tuple[str, dict[str, float]]]:
        """``(source, eval_limit) -> (data set label, metrics)`` of the ``final`` records this run
        already wrote at the current step (``source``: the ``eval_on`` entry, ``""`` for the run's
        own test set); empty for a new run or where the file cannot be read (this process is not
        the one that writes it)."""
        path = self.run_dir / "metrics.jsonl"
        if self.resume_from is None or not path.is_file():
            return {}
        recorded = {}
        for record in read_metrics(path):
            if record.get("event") != "final" or record.get("step") != self.step or "source" not in record:
                continue  # records written before the source was recorded are not reused
            metrics = {key: value for key, value in record.items() if key not in _FINAL_RECORD_CONTEXT}
            recorded[(record["source"], record.get("eval_limit"))] = (record["dataset"], metrics)
        return recorded


class _StepInfo(StepInfo):
    """The :class:`StepInfo` the loop gives its callbacks: ``loss`` stays the step's loss tensor
    on the device until a callback reads it, then becomes (and stays) a ``float``. A run whose
    callbacks never look at the loss (a stop after some steps, a timer) so never waits for the
    device; one that does pays one read per step, as it asked."""

    def __init__(self, step: int, epoch: int, loss: Tensor, model: nn.Module) -> None:
        super().__init__(step, epoch, loss, model)  # type: ignore[arg-type]  # read on first use

    @property  # type: ignore[override]
    def loss(self) -> float:
        if isinstance(self._loss, Tensor):
            self._loss = float(self._loss)  # the host-device sync, once per step at most
        return self._loss

    @loss.setter
    def loss(self, value: float | Tensor) -> None:
        self._loss = value


@contextlib.contextmanager
def _scheduler_after_a_skipped_step(scaling: bool) -> Iterator[None]:
    """Where the loss is scaled (fp16), a context without torch's warning that the scheduler
    stepped before the optimiser: GradScaler skips the first updates of a run by design (their
    scaled gradients overflow while it finds its scale), and the warning would call that a
    misordered loop. Elsewhere the warning means what it says, and is left alone."""
    if not scaling:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()` before"))
        yield


def _reseed(seed: int, device: torch.device) -> None:
    """Seed the generators a step draws from, the CPU's and (on CUDA) the step's device's, as
    :func:`torch.manual_seed` seeds them. ``torch.manual_seed`` also queues the seed for every
    backend not initialised (XPU and MTIA on a CUDA machine; CUDA too on a CPU run), each with a
    ``traceback.format_stack()`` of the caller: 0.2-1.6 ms a step. Other device types keep
    ``torch.manual_seed``."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.default_generators[index].manual_seed(seed)
    elif device.type != "cpu":
        torch.manual_seed(seed)


def _weights_finite(model: nn.Module) -> bool:
    """Whether every floating-point tensor of ``model``'s state (parameters, running statistics)
    is finite: one read of one flag."""
    tensors = [tensor for tensor in model.state_dict().values() if tensor.is_floating_point()]
    flags = [torch.isfinite(tensor).all() for tensor in tensors]
    return not flags or bool(torch.stack(flags).all())


def _change_at(what: str, before: float, after: float, step: int) -> str:
    """How a redrawn schedule's ``what`` moves at the resumed ``step``: a jump, or none there (a
    resume inside the warm-up, whose rate does not depend on the length: "goes from 0.00021 to
    0.00021" said a jump that was not)."""
    if math.isclose(before, after, rel_tol=1e-6, abs_tol=1e-12):
        return f"the {what} at step {step} is the same ({before:.3g}); the new length shapes it from there"
    return f"the {what} goes from {before:.3g} to {after:.3g} at step {step}"
