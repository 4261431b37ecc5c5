"""``stop_at_accuracy`` ends a run at the first evaluation that reaches it (the affNIST experiment
trains both models to the same accuracy), and ``checkpoint_minutes`` checkpoints a long epoch by the
clock, so that a hard kill loses at most that much of it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from torchvote.training import load_run_config, train
from torchvote.training.checkpoint import load_training_state
from torchvote.training.config import ConfigError

from .test_loop import _assert_same_weights, _weights


def _steps_per_epoch(run_dir) -> int:
    """The step of the first evaluation record, which comes at the first epoch's end."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(record["step"] for record in records if record["event"] == "eval")


@pytest.fixture
def reference(tiny_config):
    """Three epochs without a target, every epoch's checkpoint kept."""
    return train(tiny_config("reference", "epochs=3", "keep_checkpoints=5"), verbose=False)


def test_a_reached_target_ends_the_run_at_that_evaluation(tiny_config, reference, capsys):
    epoch = _steps_per_epoch(reference.run_dir)
    capsys.readouterr()
    # any accuracy above 0 reaches it: the run ends at its first evaluation, the first epoch's end
    stopped = train(tiny_config("stopped", "epochs=3", "stop_at_accuracy=1e-9"), verbose=False)
    assert f"stop_at_accuracy=1e-09 reached at step {epoch}" in capsys.readouterr().err
    assert not stopped.interrupted and stopped.step == epoch and reference.step == 3 * epoch
    # the weights of the reference run's first epoch (the cosine schedule is over 3 epochs in both)
    epoch_checkpoint = reference.run_dir / "checkpoints" / f"step-{epoch:08d}.safetensors"
    from safetensors.torch import load_file

    _assert_same_weights(load_file(epoch_checkpoint), _weights(stopped.model))
    assert stopped.checkpoint.weights.name == epoch_checkpoint.name
    state = load_training_state(stopped.checkpoint.state)
    assert state["reached_target"]["step"] == epoch and state["reached_target"]["target"] == 1e-9
    # the final evaluation is the evaluation of that step
    records = [json.loads(line) for line in (reference.run_dir / "metrics.jsonl").read_text().splitlines()]
    first_eval = next(record for record in records if record["event"] == "eval")
    assert stopped.results["mnist/test"]["accuracy"] == pytest.approx(first_eval["accuracy"], abs=1e-6)


def test_a_run_that_reached_its_target_is_finished_unless_the_target_changes(tiny_config, reference, capsys):
    epoch = _steps_per_epoch(reference.run_dir)
    stopped = train(tiny_config("stopped", "epochs=3", "stop_at_accuracy=1e-9"), verbose=False)
    capsys.readouterr()
    again = train(load_run_config(stopped.run_dir), resume=stopped.run_dir, verbose=False)
    assert again.step == epoch and "reached stop_at_accuracy=1e-09" in capsys.readouterr().err
    # without the target the run trains on, exactly as the unbroken run did
    config = load_run_config(stopped.run_dir, ["stop_at_accuracy=null"])
    on = train(config, resume=stopped.run_dir, verbose=False)
    assert on.step == 3 * epoch and not on.interrupted
    _assert_same_weights(_weights(reference.model), _weights(on.model))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("stop_at_accuracy=0.99", "eval_every=0"), "eval_every must be >= 1"),
        (("stop_at_accuracy=1.5",), "stop_at_accuracy must be a finite number in (0.0, 1.0]"),
        (("stop_at_accuracy=0",), "stop_at_accuracy must be a finite number in (0.0, 1.0]"),
        (("checkpoint_minutes=-1",), "checkpoint_minutes must be a finite number in [0.0, inf)"),
    ],
)
def test_bad_stop_and_checkpoint_options_are_named(tiny_config, overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        tiny_config("run", *overrides)


def test_checkpoint_minutes_checkpoints_inside_an_epoch(tiny_config):
    """A clock of 60 microseconds: every step is past it, so every step is checkpointed (the
    epoch's end too, once); with 0 only the epochs' ends are."""
    keep = "keep_checkpoints=100"
    timed = train(tiny_config("timed", "epochs=1", "checkpoint_minutes=1e-6", keep), verbose=False)
    steps = sorted(int(p.name[5:13]) for p in (timed.run_dir / "checkpoints").glob("*.safetensors"))
    assert steps == list(range(1, timed.step + 1)) and timed.step > 2
    plain = train(tiny_config("plain", "epochs=1", "checkpoint_minutes=0", keep), verbose=False)
    steps = sorted(int(p.name[5:13]) for p in (plain.run_dir / "checkpoints").glob("*.safetensors"))
    assert steps == [plain.step]
    _assert_same_weights(_weights(plain.model), _weights(timed.model))


def test_a_target_reached_at_the_last_evaluation_ends_a_longer_resume(tiny_config, capsys):
    """The target was recorded only before the last step: a run that reached it at its end,
    resumed with more epochs, trained on past it."""
    short = train(tiny_config("short", "epochs=1", "stop_at_accuracy=1e-9"), verbose=False)
    assert short.reached_target is not None and short.reached_target["step"] == short.step
    assert load_training_state(short.checkpoint.state)["reached_target"]["step"] == short.step
    capsys.readouterr()
    longer = train(load_run_config(short.run_dir, ["epochs=3"]), resume=short.run_dir, verbose=False)
    assert longer.step == short.step and "reached stop_at_accuracy=1e-09" in capsys.readouterr().err
    plain = train(tiny_config("plain", "epochs=1"), verbose=False)
    assert plain.reached_target is None


def test_a_target_equal_to_the_accuracy_reached_stops_the_run(tiny_config, reference):
    """An accuracy equal to stop_at_accuracy reaches it: the run ends there (mutation review)."""
    records = [json.loads(line) for line in (reference.run_dir / "metrics.jsonl").read_text().splitlines()]
    first = next(record for record in records if record["event"] == "eval")
    target = round(first["accuracy"] * first["count"]) / first["count"]  # exact, not the 6-decimal record
    assert 0 < target < 1
    run = train(tiny_config("target", "epochs=3", f"stop_at_accuracy={target!r}"), verbose=False)
    assert run.step == first["step"] < reference.step


def test_a_run_folder_of_an_older_version_stopped_before_its_first_checkpoint_starts_over(tiny_config):
    """The check that a folder holds a stopped run (not a user's files) wanted every key of
    today's config: a config.yaml without the keys added since was refused as foreign."""
    import yaml

    from torchvote.training.config import config_to_dict

    config = tiny_config("old", "epochs=1")
    values = config_to_dict(config)
    del values["stop_at_accuracy"], values["checkpoint_minutes"]
    folder = Path(config.run_dir)
    folder.mkdir()
    (folder / "config.yaml").write_text(yaml.safe_dump(values, sort_keys=False))
    (folder / "metrics.jsonl").write_text("")
    assert not train(config, verbose=False).interrupted
