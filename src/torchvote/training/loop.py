"""The training loop: one plain PyTorch loop for every registered model.

``train(config)`` loads the data, builds the model from the registry, and runs
``forward -> loss -> backward -> step`` with a progress bar, evaluation each epoch, metrics as
JSON lines (and TensorBoard), atomic checkpoints, ``--resume``, Ctrl-C handling and data
parallelism under ``torchrun``.

**Determinism.** The model is initialised from ``seed``; the data order of each epoch comes from
``(seed, epoch)``; each augmentation from ``(seed, epoch, position)``; and before each step the
global torch RNG (dropout, sampling inside models) is reseeded from ``(seed, step, rank)``. A
resumed run therefore takes exactly the steps the killed run would have taken, and reaches
bit-identical weights. The RNG states of torch, numpy and python are saved as well, for code
that draws from them outside the steps.

**Data parallelism.** Under ``torchrun`` each of the N processes takes a contiguous ``1 / N`` of
every global batch (``batch_size`` is global), DDP averages the gradients, so one process and N
processes take the same steps up to floating-point summation order. Only rank 0 writes
checkpoints, metrics and the progress bar.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from torchvote.models.registry import get_model_spec
from torchvote.training.checkpoint import (
    CheckpointError,
    CheckpointPaths,
    capture_rng_state,
    find_checkpoint,
    load_model_weights,
    load_training_state,
    restore_rng_state,
    save_checkpoint,
)
from torchvote.training.config import (
    RESUMABLE_KEYS,
    ConfigError,
    TrainConfig,
    config_diff,
    config_from_dict,
    config_to_dict,
    model_config_from,
)
from torchvote.training.data import STEP_STREAM, BatchPlan, TaskData, derive_seed, iterate_batches
from torchvote.training.distributed import DistributedContext, all_reduce_sum, any_process, setup_distributed
from torchvote.training.evaluate import autocast, evaluate, load_data, parse_eval_entry, result_row
from torchvote.training.metrics import MetricsWriter, format_table
from torchvote.training.optim import build_optimizer, build_scheduler
from torchvote.training.tasks import get_task_handler, make_objective

__all__ = ["StepInfo", "TrainResult", "load_run_config", "train"]


@dataclass
class StepInfo:
    """What a callback sees after each optimiser step.

    Attributes:
        step: optimiser steps completed so far.
        epoch: the epoch the step belongs to (from 0).
        loss: the loss of this process's part of the batch.
        model: the model (not the DDP wrapper).
    """

    step: int
    epoch: int
    loss: float
    model: nn.Module


@dataclass
class TrainResult:
    """The outcome of :func:`train`.

    Attributes:
        run_dir: where checkpoints, metrics and plots went.
        checkpoint: the last checkpoint written (``None`` on ranks other than 0).
        metrics_path: the ``metrics.jsonl`` file (rank 0).
        results: evaluation metrics per data set (``"mnist/test"`` -> metrics).
        step, epoch: progress reached.
        interrupted: the run stopped on Ctrl-C / SIGTERM / KeyboardInterrupt.
        model: the trained model (not the DDP wrapper).
        config: the run's config.
        plots: plot files written at the end (rank 0, with matplotlib).
    """

    run_dir: Path
    checkpoint: CheckpointPaths | None
    metrics_path: Path | None
    results: dict[str, dict[str, float]]
    step: int
    epoch: int
    interrupted: bool
    model: nn.Module
    config: TrainConfig
    plots: list[Path] = field(default_factory=list)

    def table(self) -> str:
        """The plain-text result table."""
        return format_table([{"data": name, **result_row(metrics)} for name, metrics in self.results.items()])


def load_run_config(run_dir: str | Path, overrides: Sequence[str] = ()) -> TrainConfig:
    """The config a run was started with (from its latest checkpoint), plus ``overrides`` of the
    keys a resumed run may change (:data:`~torchvote.training.config.RESUMABLE_KEYS`).

    Raises:
        CheckpointError: no readable checkpoint in ``run_dir``.
        ConfigError: an override of a key that would change the weights.
    """
    from torchvote.training.config import apply_overrides

    state = load_training_state(find_checkpoint(run_dir).state)
    saved = config_from_dict(state["config"])
    config = apply_overrides(saved, overrides)
    _check_resumable(saved, config)
    return config


def _check_resumable(saved: TrainConfig, config: TrainConfig) -> None:
    changed = {
        k: v
        for k, v in config_diff(saved, config).items()
        if k not in RESUMABLE_KEYS | {"run_dir", "out_dir"}
    }
    if changed:
        details = ", ".join(f"{k} (run: {a!r}, now: {b!r})" for k, (a, b) in changed.items())
        raise ConfigError(
            f"cannot resume with a different config: {details}; a resumed run may only change "
            f"{', '.join(sorted(RESUMABLE_KEYS))}"
        )


def train(
    config: TrainConfig,
    *,
    resume: str | Path | None = None,
    callbacks: Sequence[Callable[[StepInfo], None]] = (),
    verbose: bool = True,
) -> TrainResult:
    """Train (or, with ``resume``, continue training) as ``config`` says.

    Args:
        config: the run config.
        resume: a run folder to continue from its latest checkpoint. ``config`` must equal the
            run's config except for :data:`~torchvote.training.config.RESUMABLE_KEYS`
            (:func:`load_run_config` gives such a config).
        callbacks: called after every optimiser step with a :class:`StepInfo`; one that raises
            ``KeyboardInterrupt`` stops the run the way Ctrl-C does (checkpoint, then return).
        verbose: print the result table and where things went (rank 0).

    Returns:
        a :class:`TrainResult`; ``interrupted`` tells whether it stopped early.

    Raises:
        ConfigError: a config that does not fit the data or the model.
        CheckpointError: a resume checkpoint that is missing, corrupt or does not fit.
        ValueError: an unknown data set, model or preset.
    """
    context = setup_distributed(config.device)
    try:
        return _Run(config, context, resume, callbacks, verbose).run()
    finally:
        context.close()


class _Run:
    """One training run; the methods are the phases of :func:`train`."""

    def __init__(
        self,
        config: TrainConfig,
        context: DistributedContext,
        resume: str | Path | None,
        callbacks: Sequence[Callable[[StepInfo], None]],
        verbose: bool,
    ) -> None:
        self.config = config
        self.context = context
        self.callbacks = list(callbacks)
        self.verbose = verbose and context.is_main
        self.stop_requested = False
        self.stop_reason = ""
        self.resume_paths = find_checkpoint(resume) if resume is not None else None
        self.run_dir = Path(resume) if resume is not None else self._new_run_dir()
        self.writer: MetricsWriter | None = None
        self.last_checkpoint: CheckpointPaths | None = None
        self.last_saved_step = -1
        self.evaluations: dict[tuple[str, str, int], dict[str, float]] = {}

    # --- set-up ---------------------------------------------------------------------------------

    def _new_run_dir(self) -> Path:
        if self.config.run_dir is not None:
            path = Path(self.config.run_dir)
            if (path / "checkpoints" / "latest").exists():
                raise ConfigError(
                    f"run folder {path} already holds a run; continue it with "
                    f"`torchvote train --resume {path}` or choose another run_dir"
                )
        else:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            prefix = self.config.preset or self.config.model.name
            path = Path(self.config.out_dir) / f"{prefix}-{stamp}"
            suffix = 1
            while path.exists():
                suffix += 1
                path = Path(self.config.out_dir) / f"{prefix}-{stamp}-{suffix}"
        if self.context.is_distributed:  # every process uses rank 0's choice
            chosen = [str(path)]
            dist.broadcast_object_list(chosen, src=0)
            path = Path(chosen[0])
        return path

    def _log(self, message: str) -> None:
        if self.context.is_main:
            from tqdm import tqdm

            tqdm.write(message, file=sys.stderr)

    def _setup(self) -> None:
        config, context = self.config, self.context
        random.seed(config.seed)
        np.random.seed(config.seed % 2**32)  # noqa: NPY002 (code that uses the global state)
        torch.manual_seed(config.seed)
        if config.deterministic:
            if context.device.type == "cuda":  # cuBLAS needs a fixed workspace to be deterministic
                os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)

        self.spec = get_model_spec(config.model.name)
        self.handler = get_task_handler(self.spec.task)
        data = config.data
        self.train_data = load_data(
            self.handler, data.name, "train", options=data.options, root=data.root, limit=data.limit
        )
        eval_name = data.eval_name or data.name
        eval_options = data.options if eval_name == data.name else {}
        self.eval_data = load_data(
            self.handler,
            eval_name,
            data.eval_split,
            options=eval_options,
            root=data.root,
            limit=data.eval_limit,
        )

        fields = dict(self.train_data.fields)
        if data.canvas is not None:
            if data.canvas < fields.get("image_size", 0):
                raise ConfigError(
                    f"data.canvas={data.canvas} is smaller than the {fields['image_size']}-pixel images"
                )
            fields["image_size"] = data.canvas
        self.model_config = model_config_from(config, **fields)
        self.augment = self.handler.augment(data, self.train_data)
        self.train_data = self.handler.finalize(self.train_data, self.model_config)
        self.eval_data = self.handler.finalize(self.eval_data, self.model_config)

        self.model = self.spec.model_cls(self.model_config).to(context.device)
        self.plan = BatchPlan(
            len(self.train_data), config.batch_size, config.seed, context.world_size, context.rank
        )
        steps = config.epochs * self.plan.steps_per_epoch
        self.total_steps = min(steps, config.max_steps) if config.max_steps is not None else steps
        self.optimizer = build_optimizer(self.model.parameters(), config.optim)
        self.scheduler = build_scheduler(self.optimizer, config.optim, self.total_steps)
        self.objective = make_objective(config.loss, self.spec, self.total_steps, fields.get("pad_id"))
        self.step = 0
        if self.resume_paths is not None:
            self._restore()
        self.ddp_model: nn.Module = self.model
        if context.is_distributed:
            device_ids = [context.device] if context.device.type == "cuda" else None
            self.ddp_model = nn.parallel.DistributedDataParallel(self.model, device_ids=device_ids)

    def _restore(self) -> None:
        paths = self.resume_paths
        assert paths is not None
        state = load_training_state(paths.state)
        _check_resumable(config_from_dict(state["config"]), self.config)
        order = state["data_order"]
        if order["num_examples"] != len(self.train_data) or order["global_batch"] != self.config.batch_size:
            raise CheckpointError(
                f"{paths.state} was written for {order['num_examples']} training examples in batches of "
                f"{order['global_batch']}; this run has {len(self.train_data)} in batches of "
                f"{self.config.batch_size}"
            )
        if self.config.optim.schedule == "onecycle" and state.get("total_steps") != self.total_steps:
            raise ConfigError(
                f"the onecycle schedule of this run was set for {state.get('total_steps')} steps; "
                f"it cannot be stretched to {self.total_steps} (keep epochs and max_steps as they were)"
            )
        load_model_weights(self.model, paths.weights)
        try:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
        except (ValueError, KeyError, RuntimeError) as err:
            raise CheckpointError(
                f"{paths.state}: optimiser or scheduler state does not fit: {err}"
            ) from None
        restore_rng_state(state["rng"])
        self.step = int(state["step"])
        self._log(f"resuming {self.run_dir} from step {self.step} ({paths.weights.name})")

    # --- checkpoints and metrics ------------------------------------------------------------------

    def _save(self, epoch: int, position: int) -> None:
        if self.step == self.last_saved_step:
            return
        if not self.context.is_main:
            self.last_saved_step = self.step
            return
        metadata = {
            "model": self.spec.name,
            "model_config": json.dumps(_plain(dataclasses.asdict(self.model_config))),
            "task": self.spec.task,
            "step": str(self.step),
            "data": self.config.data.name,
        }
        state = {
            "step": self.step,
            "epoch": epoch,
            "data_order": {
                "seed": self.config.seed,
                "epoch": epoch,
                "position": position,
                "num_examples": len(self.train_data),
                "global_batch": self.config.batch_size,
            },
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": capture_rng_state(),
            "config": config_to_dict(self.config),
            "world_size": self.context.world_size,
            "total_steps": self.total_steps,
        }
        self.last_checkpoint = save_checkpoint(
            self.run_dir / "checkpoints",
            step=self.step,
            model=self.model,
            model_metadata=metadata,
            state=state,
            keep=self.config.keep_checkpoints,
        )
        self.last_saved_step = self.step

    def _evaluate(self, data: TaskData) -> dict[str, float]:
        key = (data.name, data.split, self.step)
        if key not in self.evaluations:  # the last epoch's evaluation is also the final one
            self.evaluations[key] = evaluate(
                self.model,
                data,
                self.handler,
                objective=self.objective,
                batch_size=self.config.eval_batch_size,
                device=self.context.device,
                context=self.context,
                bf16=self.config.bf16,
                step=self.step,
            )
        return self.evaluations[key]

    # --- signals ------------------------------------------------------------------------------------

    def _install_signal_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def request_stop(signum: int, frame: Any) -> None:
            if self.stop_requested and signum == signal.SIGINT:
                raise KeyboardInterrupt  # a second Ctrl-C: stop now
            self.stop_requested = True
            self.stop_reason = signal.Signals(signum).name
            self._log(
                f"{self.stop_reason} received: saving a checkpoint after this step "
                "(press Ctrl-C again to stop at once without saving)"
            )

        previous = {}
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, request_stop)
        return previous

    # --- the loop -------------------------------------------------------------------------------------

    def _train_step(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor], int]:
        device = self.context.device
        batch = {key: value.to(device, non_blocking=True) for key, value in batch.items()}
        torch.manual_seed(derive_seed(self.config.seed, STEP_STREAM, self.step, self.context.rank))
        self.ddp_model.train()
        with autocast(device, self.config.bf16):
            output = self.handler.forward(self.ddp_model, batch)
            loss, _ = self.objective(output, batch, self.step)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.config.optim.grad_clip is not None:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.config.optim.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        sums = self.handler.metric_sums(output, batch)
        return loss.detach(), sums, self.handler.items(batch)

    def run(self) -> TrainResult:
        self._setup()
        config, context = self.config, self.context
        if context.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            import yaml

            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))
            self.writer = MetricsWriter(self.run_dir, tensorboard=config.tensorboard)
            self._log(
                f"training {self.spec.name} on {config.data.name} ({len(self.train_data)} examples, "
                f"{self.total_steps} steps of {config.batch_size} on {context.world_size} process(es), "
                f"{context.device}) -> {self.run_dir}"
            )
        previous_handlers = self._install_signal_handlers()
        try:
            interrupted, epoch = self._loop()
            results: dict[str, dict[str, float]] = {}
            if not interrupted:
                results = self._final_evaluation()
        finally:
            for signum, handler in previous_handlers.items():
                signal.signal(signum, handler)
            if self.writer is not None:
                self.writer.close()
        plots = self._plots() if context.is_main and not interrupted else []
        result = TrainResult(
            run_dir=self.run_dir,
            checkpoint=self.last_checkpoint,
            metrics_path=self.writer.path if self.writer is not None else None,
            results=results,
            step=self.step,
            epoch=epoch,
            interrupted=interrupted,
            model=self.model,
            config=config,
            plots=plots,
        )
        if self.verbose and not interrupted:
            print(result.table())
        context.barrier()
        return result

    def _loop(self) -> tuple[bool, int]:
        config, context, plan = self.config, self.context, self.plan
        steps_per_epoch = plan.steps_per_epoch
        epoch, position = divmod(self.step, steps_per_epoch)
        from tqdm import tqdm

        bar = tqdm(
            total=self.total_steps,
            initial=self.step,
            unit="step",
            dynamic_ncols=True,
            file=sys.stderr,
            disable=not (context.is_main and config.progress),
            leave=True,
        )
        window: dict[str, Tensor] = {}
        window_start, window_items = time.perf_counter(), 0
        in_step = False
        try:
            while self.step < self.total_steps:
                batches = iterate_batches(
                    self.train_data,
                    plan,
                    epoch,
                    position,
                    augment=self.augment,
                    num_workers=config.num_workers,
                )
                for batch in batches:
                    in_step = True
                    loss, sums, items = self._train_step(batch)
                    in_step = False
                    self.step += 1
                    position += 1
                    window_items += items
                    count = sums["count"]
                    sums = {**sums, "loss_sum": loss.float() * count, "loss_count": count}
                    for key, value in sums.items():
                        window[key] = window.get(key, 0) + value.float()
                    bar.update(1)
                    try:
                        for callback in self.callbacks:
                            callback(StepInfo(self.step, epoch, float(loss), self.model))
                    except KeyboardInterrupt:
                        self.stop_requested, self.stop_reason = True, "KeyboardInterrupt"
                    end_of_epoch = position == steps_per_epoch
                    if self.step % config.log_every == 0 or end_of_epoch or self.step == self.total_steps:
                        self._log_window(window, window_items, time.perf_counter() - window_start, epoch, bar)
                        window, window_items, window_start = {}, 0, time.perf_counter()
                    if end_of_epoch and config.eval_every and (epoch + 1) % config.eval_every == 0:
                        self._log_eval(self.eval_data, epoch + 1, bar)
                    if end_of_epoch or (config.checkpoint_every and self.step % config.checkpoint_every == 0):
                        self._save(*((epoch + 1, 0) if end_of_epoch else (epoch, position)))
                    if any_process(self.stop_requested, context):
                        self._save(*((epoch + 1, 0) if end_of_epoch else (epoch, position)))
                        bar.close()
                        self._report_interrupt()
                        return True, epoch
                    if self.step >= self.total_steps:
                        break
                if position == steps_per_epoch:
                    epoch, position = epoch + 1, 0
        except KeyboardInterrupt:
            bar.close()
            if in_step:  # the weights may be half-updated: keep the last checkpoint as it is
                self._report_interrupt(saved=False)
                return True, epoch
            self._save(epoch, position)
            self._report_interrupt()
            return True, epoch
        finally:
            bar.close()
        self._save(epoch, position)
        return False, epoch

    def _log_window(
        self, window: dict[str, Tensor], items: int, seconds: float, epoch: int, bar: Any
    ) -> None:
        keys = sorted(window)
        totals = all_reduce_sum(torch.stack([window[k] for k in keys]), self.context)
        metrics = self.handler.summarize(dict(zip(keys, totals.tolist(), strict=True)))
        global_items = items * self.context.world_size
        rate = global_items / max(seconds, 1e-9)
        unit = self.handler.unit
        record = {
            "loss": metrics["loss"],
            "accuracy": metrics["accuracy"],
            "lr": self.optimizer.param_groups[0]["lr"],
            f"{unit}_per_second": rate,
        }
        if self.writer is not None:
            self.writer.write("train", self.step, record, epoch=epoch)
        bar.set_postfix(
            {
                "loss": f"{metrics['loss']:.4f}",
                "acc": f"{100 * metrics['accuracy']:.2f}%",
                f"{unit}/s": f"{rate:,.0f}",
            },
            refresh=False,
        )

    def _log_eval(self, data: TaskData, epoch: int, bar: Any) -> dict[str, float]:
        metrics = self._evaluate(data)
        label = f"{data.name}/{data.split}"
        if self.writer is not None:
            self.writer.write("eval", self.step, metrics, epoch=epoch, dataset=label)
        if self.context.is_main:
            message = f"step {self.step} epoch {epoch}: {label} accuracy {100 * metrics['accuracy']:.2f}%"
            if "loss" in metrics:
                message += f", loss {metrics['loss']:.4f}"
            (bar.write if bar is not None else self._log)(message, file=sys.stderr)
        return metrics

    def _final_evaluation(self) -> dict[str, dict[str, float]]:
        results = {f"{self.eval_data.name}/{self.eval_data.split}": self._evaluate(self.eval_data)}
        for entry in self.config.eval_on:
            name, options = parse_eval_entry(entry)
            data = load_data(
                self.handler,
                name,
                None,
                options=options,
                root=self.config.data.root,
                limit=self.config.data.eval_limit,
            )
            results[f"{data.name}/{data.split}"] = self._evaluate(
                self.handler.finalize(data, self.model_config)
            )
        if self.writer is not None:
            for label, metrics in results.items():
                self.writer.write("final", self.step, metrics, dataset=label)
        return results

    def _plots(self) -> list[Path]:
        from torchvote.training.plots import plot_training_curves

        if self.writer is None:
            return []
        path = plot_training_curves(self.writer.path, self.run_dir / "plots" / "training_curves.png")
        return [path] if path is not None else []

    def _report_interrupt(self, saved: bool = True) -> None:
        if not self.context.is_main:
            return
        reason = self.stop_reason or "KeyboardInterrupt"
        if saved and self.last_checkpoint is not None:
            where = f"checkpoint saved at step {self.step}: {self.last_checkpoint.weights}"
        elif self.last_checkpoint is not None:
            where = f"interrupted inside a step; the last checkpoint is {self.last_checkpoint.weights}"
        else:
            where = "no checkpoint was written"
        self._log(
            f"{reason}: stopped at step {self.step} of {self.total_steps}; {where}\n"
            f"resume with: torchvote train --resume {self.run_dir}"
        )


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
