"""A run stopped by an error, not by the user: out of device memory in a training step or in an
evaluation, a full disk. Each says where the run stopped and gives a command that goes on, and
the command works (it is run here). The errors are raised by stand-ins for the step, the
evaluation and the checkpoint writer at a chosen step; CPU runs cannot run out of device memory."""

from __future__ import annotations

import errno
import shlex
from pathlib import Path

import pytest
import torch

from torchvote.cli import main
from torchvote.training import TrainingOutOfMemoryError, find_checkpoint, loop, train
from torchvote.training.checkpoint import checkpoint_name

OOM = "CUDA out of memory. Tried to allocate 2.00 GiB"  # what torch says, abridged


def _command_after(text: str, label: str) -> list[str]:
    """The command that follows ``label`` in ``text`` (up to the end of its line, or a ``;``)."""
    start = text.index(label) + len(label)
    return shlex.split(text[start:].splitlines()[0].split(";")[0].split(" (bf16")[0])


def _failing_at(call: int, real, error: BaseException):
    """``real`` (a function, or a method set on its class), raising ``error`` on its ``call``-th
    call."""
    calls = {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            raise error
        return real(*args, **kwargs)

    return failing


def test_out_of_memory_in_a_step_names_the_checkpoint_and_a_smaller_batch(tiny_config, monkeypatch):
    config = tiny_config("oom")  # 6 steps an epoch, a checkpoint at step 6, batch_size=40
    run_dir = Path(config.run_dir)
    with monkeypatch.context() as patch:
        patch.setattr(loop._Run, "_train_step",
                      _failing_at(8, loop._Run._train_step, torch.cuda.OutOfMemoryError(OOM)))
        with pytest.raises(TrainingOutOfMemoryError) as caught:
            train(config, verbose=False)
    error = caught.value
    assert isinstance(error, torch.cuda.OutOfMemoryError) and str(error.__cause__) == OOM
    message = str(error)
    assert message.startswith("cpu ran out of memory in training step 8 (batch_size=40)")
    assert f"the last checkpoint is {run_dir / 'checkpoints' / checkpoint_name(6)}.safetensors" in message
    assert "bf16=true" in message

    new_run = _command_after(message, "so it is a new run: ")
    assert new_run[:2] == ["torchvote", "train"] and "batch_size=20" in new_run
    assert main([*new_run[1:], "max_steps=2", "eval_every=0"]) == 0  # a new run, in a new folder
    assert find_checkpoint(Path(f"{run_dir}-batch20")).name == checkpoint_name(2)

    resume = _command_after(message, "or, with more free memory on the device, resume with: ")
    assert resume == ["torchvote", "train", "--resume", str(run_dir)]
    assert main(resume[1:]) == 0  # the same run, finished from step 6
    assert find_checkpoint(run_dir).name == checkpoint_name(12)


def test_out_of_memory_in_an_evaluation_resumes_with_a_smaller_evaluation_batch(tiny_config, monkeypatch):
    config = tiny_config("oom-eval")  # evaluated at the end of each epoch, eval_batch_size=50
    run_dir = Path(config.run_dir)
    with monkeypatch.context() as patch:
        evaluate = _failing_at(2, loop.evaluate_loss_where_it_applies, torch.cuda.OutOfMemoryError(OOM))
        patch.setattr(loop, "evaluate_loss_where_it_applies", evaluate)
        with pytest.raises(TrainingOutOfMemoryError) as caught:
            train(config, verbose=False)
    message = str(caught.value)
    assert message.startswith("cpu ran out of memory evaluating at step 12; lower eval_batch_size (now 50)")
    resume = _command_after(message, "resume with: ")
    assert resume == ["torchvote", "train", "--resume", str(run_dir), "eval_batch_size=25"]
    assert main(resume[1:]) == 0  # eval_batch_size may change on resume: the same run finishes
    assert find_checkpoint(run_dir).name == checkpoint_name(12)


def test_a_full_disk_keeps_the_last_checkpoint_and_says_how_to_resume(tiny_config, monkeypatch, capsys):
    config = tiny_config("full")
    run_dir = Path(config.run_dir)
    full = OSError(errno.ENOSPC, "No space left on device")
    with monkeypatch.context() as patch:  # the checkpoint of step 12 cannot be written
        patch.setattr(loop, "save_checkpoint", _failing_at(2, loop.save_checkpoint, full))
        with pytest.raises(OSError, match="No space left on device"):
            train(config, verbose=False)
    err = capsys.readouterr().err
    weights = run_dir / "checkpoints" / f"{checkpoint_name(6)}.safetensors"
    assert f"OSError at step 12: the last checkpoint is {weights}, intact; resume with: " in err
    resume = _command_after(err, "resume with: ")
    assert main(resume[1:]) == 0
    assert find_checkpoint(run_dir).name == checkpoint_name(12)


def test_the_command_line_prints_one_line_and_no_traceback(tiny_config, monkeypatch, capsys):
    config = tiny_config("cli")
    config_file = Path(config.run_dir).with_suffix(".yaml")
    import yaml

    from torchvote.training.config import config_to_dict

    config_file.write_text(yaml.safe_dump(config_to_dict(config)))
    monkeypatch.setattr(loop._Run, "_train_step",
                        _failing_at(3, loop._Run._train_step, torch.cuda.OutOfMemoryError(OOM)))
    assert main(["train", str(config_file)]) == 1  # a failure while running (2: a usage error)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("torchvote train: error:")]
    assert "ran out of memory in training step 3 (batch_size=40); no checkpoint was written" in line


def test_without_resume_hints_the_advice_names_no_command(tiny_config, monkeypatch):
    # `torchvote reproduce` runs rows of fixed sizes and says itself how to go on (rerun it)
    with monkeypatch.context() as patch:
        patch.setattr(loop._Run, "_train_step",
                      _failing_at(8, loop._Run._train_step, torch.cuda.OutOfMemoryError(OOM)))
        with pytest.raises(TrainingOutOfMemoryError) as caught:
            train(tiny_config("quiet"), verbose=False, resume_hint=False)
    message = str(caught.value)
    assert message.endswith("intact; it needs a device with more free memory")
    assert "torchvote train" not in message
