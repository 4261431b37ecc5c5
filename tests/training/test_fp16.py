"""``fp16=true``: float16 autocast with a gradient scaler (torch.amp's recipe), on the CPU.

The run trains in float16, clips the unscaled gradients, resumes with its scaler's state, and is
evaluated in float16 (during the run and by ``torchvote evaluate --fp16``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchvote.training.loop as loop_module
from conftest import tiny_config_values
from torchvote import cli
from torchvote.training import (
    TrainingDivergedError,
    evaluate_checkpoint,
    find_checkpoint,
    load_run_config,
    read_metrics,
    train,
)
from torchvote.training.config import ConfigError, apply_overrides, config_from_dict
from torchvote.training.evaluation import evaluate
from torchvote.training.results import find_resumable_checkpoint

from .test_loop import _assert_same_weights, _PoisonAt, _StopAfter, _weights
from .test_resume_exact import _assert_same, _records


class _Float16Seen:
    """A callback: after the first step, forward hooks on every ``nn.Linear`` of the model record
    the dtype of each output the later steps (and evaluations) compute."""

    def __init__(self) -> None:
        self.dtypes: list[torch.dtype] = []

    def __call__(self, info) -> None:
        if info.step == 1:
            for module in info.model.modules():
                if isinstance(module, nn.Linear):
                    module.register_forward_hook(lambda _m, _i, output: self.dtypes.append(output.dtype))


@pytest.fixture(scope="module")
def fp16_run(tiny_mnist_root, tmp_path_factory):
    """A 24-step fp16 run (four epochs of six) and the dtypes its ``nn.Linear`` layers computed."""
    values = tiny_config_values(tiny_mnist_root, tmp_path_factory.mktemp("fp16") / "run", epochs=4, fp16=True)
    seen = _Float16Seen()
    result = train(config_from_dict(values), callbacks=[seen], verbose=False)
    return result, seen.dtypes


def test_an_fp16_run_trains_in_float16(fp16_run):
    result, dtypes = fp16_run
    assert not result.interrupted and result.step == 24
    assert dtypes and set(dtypes) == {torch.float16}, "the forward ran under float16 autocast"
    assert all(parameter.dtype == torch.float32 for parameter in result.model.parameters())  # master weights
    losses = [record["loss"] for record in read_metrics(result.metrics_path) if record["event"] == "train"]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    _, state, _ = find_resumable_checkpoint(result.run_dir)
    # the scaler ran: its first steps overflowed at 2**16 and lowered the scale
    assert 1.0 <= state["scaler"]["scale"] < 2.0**16


def test_the_clipped_gradient_is_the_unscaled_one_clipped(tiny_config, monkeypatch):
    """With ``optim.grad_clip``, the gradient the optimiser steps with is torch.amp's recipe's: the
    loss scaled by S, backward, the gradients divided by S, then clipped to the global norm
    (Pascanu et al. 2013, "On the difficulty of training recurrent neural networks", Algorithm 2).
    Clipping the scaled gradients instead would leave them ``grad_clip / S`` long."""
    clip, checked_step = 0.05, 3
    seen: dict[str, object] = {}
    real = loop_module._Run._train_step

    def recording(run, batch):
        if run.step == checked_step:
            seen["model"], seen["batch"] = copy.deepcopy(run.model), dict(batch)
            seen["scale"], seen["objective"], seen["handler"] = (
                run.scaler.get_scale(),
                run.objective,
                run.handler,
            )
        result = real(run, batch)
        if run.step == checked_step:
            seen["grads"] = [parameter.grad.clone() for parameter in run.model.parameters()]
        return result

    monkeypatch.setattr(loop_module._Run, "_train_step", recording)
    config = tiny_config("run", "fp16=true", f"optim.grad_clip={clip}", "max_steps=4", "model.dropout=0.0")
    train(config, verbose=False)

    model, batch, scale = seen["model"], seen["batch"], seen["scale"]
    model.train()
    with torch.autocast("cpu", dtype=torch.float16):
        loss, _ = seen["objective"](seen["handler"].forward(model, batch), batch, checked_step)
    (loss * scale).backward()
    grads = [parameter.grad / scale for parameter in model.parameters()]
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    assert torch.isfinite(total) and total > clip  # a step that was taken, and clipped
    expected = [g * min(1.0, clip / (float(total) + 1e-6)) for g in grads]
    for got, want in zip(seen["grads"], expected, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("stop_at", [5, 6])
def test_a_resumed_fp16_run_ends_in_the_state_of_the_unbroken_run(fp16_run, tiny_config, stop_at):
    """The scaler's scale and growth count are checkpointed: a resumed run continues with the
    scale it had (a fresh scaler would start at 2**16 again and skip a step the unbroken run
    took)."""
    reference, _ = fp16_run
    killed = train(
        tiny_config("killed", "fp16=true", "epochs=4"), callbacks=[_StopAfter(stop_at)], verbose=False
    )
    assert killed.interrupted
    resumed = train(load_run_config(killed.run_dir), resume=killed.run_dir, verbose=False)
    assert resumed.step == reference.step == 24

    _assert_same_weights(_weights(reference.model), _weights(resumed.model))
    assert _records(resumed.metrics_path) == _records(reference.metrics_path)
    _, expected, _ = find_resumable_checkpoint(reference.run_dir)
    _, state, _ = find_resumable_checkpoint(resumed.run_dir)
    for part in ("step", "optimizer", "scheduler", "scaler", "rng", "metrics_window"):
        _assert_same(expected[part], state[part], part)


def test_a_checkpoint_without_scaler_state_resumes(tiny_mnist_root, tmp_path):
    """A training state written before the scaler was saved (a run without fp16) resumes."""
    values = tiny_config_values(tiny_mnist_root, tmp_path / "run", max_steps=8, checkpoint_every=4)
    killed = train(config_from_dict(values), callbacks=[_StopAfter(4)], verbose=False)
    paths = find_checkpoint(killed.run_dir)
    state = torch.load(paths.state, weights_only=True)
    assert state.pop("scaler") == {}  # the disabled scaler's
    torch.save(state, paths.state)
    resumed = train(load_run_config(killed.run_dir), resume=killed.run_dir, verbose=False)
    unbroken = train(config_from_dict({**values, "run_dir": str(tmp_path / "unbroken")}), verbose=False)
    assert resumed.step == 8
    _assert_same_weights(_weights(unbroken.model), _weights(resumed.model))


def test_bf16_and_fp16_together_are_refused(tiny_config, fp16_run):
    with pytest.raises(ConfigError, match="bf16 and fp16 are both true"):
        tiny_config("run", "bf16=true", "fp16=true")
    result, _ = fp16_run
    config = load_run_config(result.run_dir)
    assert config.fp16 and not config.bf16
    with pytest.raises(ConfigError, match="bf16 and fp16"):
        apply_overrides(config, ["bf16=true"])
    with pytest.raises(ValueError, match="bf16 and fp16 are both true"):
        evaluate(result.model, None, None, bf16=True, fp16=True)  # before the data are touched
    with pytest.raises(ValueError, match="bf16 and fp16 are both true"):
        evaluate_checkpoint(result.run_dir, ["mnist"], bf16=True, fp16=True)
    with pytest.raises(TypeError, match="fp16 must be True or False"):
        evaluate(result.model, None, None, fp16="yes")


def test_a_config_without_fp16_loads_as_fp16_false(tiny_mnist_root, tmp_path):
    values = tiny_config_values(tiny_mnist_root, tmp_path / "run")
    assert "fp16" not in values and config_from_dict(values).fp16 is False


def test_evaluate_fp16_reports_what_the_fp16_run_reported(fp16_run, tiny_mnist_root, capsys):
    """The run's own evaluation ran under float16 autocast, so ``evaluate --fp16`` (and only
    with it) gives its numbers again."""
    result, _ = fp16_run
    reported = result.results["mnist/test"]
    data = {"root": str(tiny_mnist_root), "options": {"source": "idx"}}
    (half,) = evaluate_checkpoint(result.run_dir, ["mnist"], fp16=True, **data)
    (full,) = evaluate_checkpoint(result.run_dir, ["mnist"], **data)
    assert half["loss"] == reported["loss"] and full["loss"] != reported["loss"]

    argv = ["evaluate", str(result.run_dir), "--on", "mnist", "--root", str(tiny_mnist_root)]
    argv += ["--data-option", "source=idx"]
    assert cli.main([*argv, "--fp16"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("mnist/test")).split()
    assert float(row[2]) == pytest.approx(reported["loss"], abs=5e-5)  # as the table rounds it

    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--fp16", "--bf16"])
    assert exit_info.value.code == 2
    assert "argument --bf16: not allowed with argument --fp16" in capsys.readouterr().err


def test_the_divergence_advice_names_fp16(tiny_config):
    """After NaN weights, an fp16 run is advised to turn fp16 off, not bf16 (which it never had
    on): the message used to say ``bf16=false`` whatever the run's precision."""
    config = tiny_config("run", "fp16=true", "max_steps=2")
    with pytest.raises(TrainingDivergedError, match=r"or fp16=false \(bf16=true on a GPU") as caught:
        train(config, callbacks=[_PoisonAt(2)], verbose=False)
    assert "bf16=false" not in str(caught.value)
