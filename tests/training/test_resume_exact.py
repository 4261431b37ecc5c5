"""An interrupted run, resumed, ends where the unbroken run ends: weights, optimiser, schedule,
RNG states, the metrics file record for record, wherever the interruption came (mid-epoch, at an
epoch end, a KeyboardInterrupt or a SIGTERM from inside a step). What it keeps is never NaN, and
what a user stopped or saved is never started over."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import torchvote.training.loop as loop_module
from conftest import tiny_config_values
from torchvote.training import (
    StepInfo,
    TrainingDivergedError,
    find_checkpoint,
    load_run_config,
    read_metrics,
    train,
)
from torchvote.training.config import ConfigError, apply_overrides, config_from_dict
from torchvote.training.results import find_resumable_checkpoint

from .test_loop import _assert_same_weights, _PoisonAt, _StopAfter, _weights

#: The parts of a metrics record that are not a function of the steps taken.
_CLOCK = ("time", "img_per_second")


def _records(path: Path) -> list[dict[str, Any]]:
    return [{k: v for k, v in record.items() if k not in _CLOCK} for record in read_metrics(path)]


def _assert_same(a: Any, b: Any, where: str = "state") -> None:
    """Nested containers of tensors and numbers, equal exactly (tensors bit for bit)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{index}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


class _InsideStep:
    """Wraps the loop's ``build_optimizer``: the optimiser's ``step()`` number ``step`` (after the
    weights moved, before the loop counts the step) calls ``action``."""

    def __init__(self, step: int, action) -> None:
        self.step, self.action, self.calls = step, action, 0
        self.build = loop_module.build_optimizer

    def __call__(self, *args, **kwargs):
        optimizer = self.build(*args, **kwargs)
        optimizer.register_step_post_hook(self._hook)
        return optimizer

    def _hook(self, optimizer, args, kwargs) -> None:
        self.calls += 1
        if self.calls == self.step:
            self.action()


def _raise_keyboard_interrupt() -> None:
    raise KeyboardInterrupt


def _send_sigterm() -> None:
    os.kill(os.getpid(), signal.SIGTERM)  # the loop's handler: finish the step, save, stop


@pytest.fixture(scope="module")
def unbroken(tiny_mnist_root, tmp_path_factory):
    """``unbroken(*overrides)``: the uninterrupted run of 12 steps (two epochs of six), once per
    module and overrides."""
    runs: dict[tuple[str, ...], Any] = {}
    folder = tmp_path_factory.mktemp("unbroken")

    def run(*overrides: str):
        if overrides not in runs:
            values = tiny_config_values(tiny_mnist_root, folder / f"run-{len(runs)}")
            runs[overrides] = train(apply_overrides(config_from_dict(values), overrides), verbose=False)
        return runs[overrides]

    return run


@pytest.mark.parametrize(
    ("interrupt", "resumed_from", "overrides"),
    [
        ("callback-5", 5, ()),  # mid-epoch
        ("callback-6", 6, ()),  # at the epoch end
        # inside step 9, after the update: not saved, the run resumes from step 6; the killed
        # run's metrics record of step 8 is written once, by the resumed run
        ("keyboard-9", 6, ("checkpoint_every=5",)),
        ("sigterm-9", 9, ("checkpoint_every=5",)),  # finishes step 9, saves it
        ("callback-7", 7, ("optim.name=sgd", "optim.schedule=onecycle", "log_every=3")),
    ],
)
def test_a_resumed_run_ends_in_the_state_of_the_unbroken_run(
    unbroken, tiny_config, monkeypatch, interrupt, resumed_from, overrides, capsys
):
    """Weights, optimiser and scheduler state, the RNG states of torch, numpy and python and
    every metrics record (but its clock) equal the unbroken run's: the data order, the dropout
    masks and the metrics window of the steps between the checkpoint and the next record
    continue as if nothing had happened. The metrics record after an interrupt between two
    records used to cover only the resumed steps, and a record written after the checkpoint
    the run resumed from appeared twice."""
    reference = unbroken(*overrides)
    how, step = interrupt.split("-")
    callbacks = []
    if how == "callback":
        callbacks.append(_StopAfter(int(step)))
    else:
        action = _raise_keyboard_interrupt if how == "keyboard" else _send_sigterm
        monkeypatch.setattr(loop_module, "build_optimizer", _InsideStep(int(step), action))
    killed = train(tiny_config("killed", *overrides), callbacks=callbacks, verbose=False)
    assert killed.interrupted
    monkeypatch.undo()
    capsys.readouterr()
    resumed = train(load_run_config(killed.run_dir), resume=killed.run_dir, verbose=False)
    assert f"from step {resumed_from} " in capsys.readouterr().err
    assert not resumed.interrupted and resumed.step == reference.step == 12

    _assert_same_weights(_weights(reference.model), _weights(resumed.model))
    assert _records(resumed.metrics_path) == _records(reference.metrics_path)
    _, expected, _ = find_resumable_checkpoint(reference.run_dir)
    _, state, _ = find_resumable_checkpoint(resumed.run_dir)
    for part in ("step", "epoch", "data_order", "optimizer", "scheduler", "rng", "metrics_window"):
        _assert_same(expected[part], state[part], part)


def test_a_second_ctrl_c_stops_at_once_without_saving(tiny_config, monkeypatch, capsys):
    """The first Ctrl-C asks for a checkpoint after the step; a second one, while that checkpoint
    is being written, stops at once, as the message promises ("press Ctrl-C again to stop at once
    without saving"). The loop used to catch it and start the same checkpoint over."""
    saves: list[int] = []
    real_save = loop_module.save_checkpoint

    def slow_save(directory, *, step, **kwargs):
        saves.append(step)
        if saves.count(5) == 1 and step == 5:
            os.kill(os.getpid(), signal.SIGINT)  # the user presses Ctrl-C again, mid-write
        return real_save(directory, step=step, **kwargs)

    def ctrl_c(info: StepInfo) -> None:
        if info.step == 5:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(loop_module, "save_checkpoint", slow_save)
    result = train(tiny_config("run", "checkpoint_every=2"), callbacks=[ctrl_c], verbose=False)
    assert result.interrupted and result.step == 5
    assert saves == [2, 4, 5], "the checkpoint of step 5 was not started a second time"
    assert find_checkpoint(result.run_dir).name == "step-00000004"
    assert "stopped at once; the last checkpoint is" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("poisoned", "overrides"),
    [(6, ()), (5, ("max_steps=5",))],
    ids=["before-an-epoch-end-checkpoint", "before-the-last-checkpoint"],
)
def test_weights_made_non_finite_by_a_step_are_never_saved(tiny_config, poisoned, overrides):
    """A step whose loss is finite can still make the weights NaN (a non-finite gradient): the
    checkpoint after it used to keep them (the loss check comes a step later), and the error then
    named that checkpoint as the one to go back to."""
    config = tiny_config("run", *overrides)
    with pytest.raises(TrainingDivergedError, match=f"the weights became NaN or infinite by step {poisoned}"):
        train(config, callbacks=[_PoisonAt(poisoned)], verbose=False)
    for path in (Path(config.run_dir) / "checkpoints").glob("*.safetensors"):
        assert all(torch.isfinite(t).all() for t in load_file(path).values()), path


def test_a_run_started_over_before_its_first_checkpoint_records_each_step_once(tiny_config):
    """A run killed before its first checkpoint is started over in its folder (``torchvote
    reproduce`` does): its metrics file holds the new run's records only, not the killed one's
    twice."""
    config = tiny_config("run", "epochs=1", "checkpoint_every=100")
    first = train(config, callbacks=[_StopAfter(3)], verbose=False)
    for path in (first.run_dir / "checkpoints").iterdir():  # as if killed before the checkpoint
        path.unlink()
    assert [r["step"] for r in read_metrics(first.metrics_path)] == [2]
    again = train(tiny_config("run", "epochs=1"), verbose=False)
    steps = [(r["event"], r["step"]) for r in read_metrics(again.metrics_path)]
    assert steps == [("train", 2), ("train", 4), ("train", 6), ("eval", 6), ("final", 6)]


def test_a_fresh_run_refuses_a_folder_with_a_checkpoint_but_no_pointer(tiny_config):
    """Without ``checkpoints/latest`` (deleted, or not copied) the run's checkpoints are still
    there and ``--resume`` reads them: a fresh run must not start over on top of them."""
    config = tiny_config("run", "max_steps=2", "eval_every=0")
    first = train(config, verbose=False)
    (first.run_dir / "checkpoints" / "latest").unlink()
    with pytest.raises(ConfigError, match="already holds a run; continue it with"):
        train(config, verbose=False)
    assert find_resumable_checkpoint(first.run_dir)[0].name == "step-00000002"
    # torn checkpoints alone are no run: a fresh run starts and keeps them aside
    (first.run_dir / "checkpoints" / "step-00000002.state.pt").write_bytes(b"torn")
    assert train(config, verbose=False).step == 2
    assert (first.run_dir / "checkpoints" / "step-00000002.state.pt.old").read_bytes() == b"torn"


def test_resuming_with_another_model_names_the_fields_before_loading_data(tiny_config):
    """A config of another model and data set is refused by name, not by the first thing its data
    set fails on (here: a text data set given to a language model)."""
    first = train(tiny_config("run", "max_steps=2", "eval_every=0"), verbose=False)
    values = tiny_config_values(Path(first.config.data.root), first.run_dir, max_steps=2)
    values["model"], values["data"] = {"name": "transformer-lm"}, {"name": "copy"}
    with pytest.raises(ConfigError, match=r"model.name \(run: 'cnn-baseline', now: 'transformer-lm'\)"):
        train(config_from_dict(values), resume=first.run_dir, verbose=False)


def test_a_failed_write_leaves_a_resumed_runs_config_as_it_was(tiny_config, monkeypatch):
    """``config.yaml`` is replaced whole (``files.atomic_write``), like the checkpoints: a resumed
    run that fails while writing it (a full disk, a kill) leaves the run's config as it was. It
    was truncated and rewritten in place."""
    import torchvote.files as files_module

    first = train(tiny_config("run", "max_steps=2", "eval_every=0"), verbose=False)
    before = (first.run_dir / "config.yaml").read_bytes()

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files_module.os, "replace", no_space)
    with pytest.raises(OSError, match="No space left"):
        train(load_run_config(first.run_dir, ["max_steps=4"]), resume=first.run_dir, verbose=False)
    assert (first.run_dir / "config.yaml").read_bytes() == before
    assert not [p.name for p in first.run_dir.iterdir() if p.name.endswith(".tmp")]
