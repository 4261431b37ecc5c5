"""The training loop: a tiny run end to end, kill-and-resume, Ctrl-C, bf16, workers."""

from __future__ import annotations

import itertools
import math
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from torchvote.training import (
    CheckpointError,
    StepInfo,
    TrainingDivergedError,
    evaluate,
    find_checkpoint,
    get_task_handler,
    load_data,
    load_model_from_checkpoint,
    load_run_config,
    read_metrics,
    train,
)
from torchvote.training.checkpoint import checkpoint_name
from torchvote.training.config import ConfigError, config_to_dict
from torchvote.training.optim import lr_multiplier
from torchvote.training.plots import plot_run


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def _assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"tensors differ: {different}"


def test_train_gives_the_callers_random_state_back(tiny_config):
    """``train()`` seeded Python's, NumPy's and torch's global generators from its config and left
    them so: in a notebook or a sweep every draw after a run repeated the same numbers after each
    run. Now the draws after it are those the caller's generators give without the run between,
    after a run that ends and after one that fails."""

    def seeded_draws(run=None):
        random.seed(11)
        np.random.seed(11)  # noqa: NPY002 (the global state is what is tested)
        torch.manual_seed(11)
        if run is not None:
            run()
        return torch.rand(4), np.random.rand(4), [random.random() for _ in range(4)]  # noqa: NPY002

    def failing(info: StepInfo) -> None:
        raise RuntimeError("a callback fails")

    def fails():
        with pytest.raises(RuntimeError, match="a callback fails"):
            train(tiny_config("failed", "max_steps=2"), callbacks=[failing], verbose=False)

    expected = seeded_draws()
    for run in (lambda: train(tiny_config("run", "max_steps=2"), verbose=False), fails):
        drawn = seeded_draws(run)
        assert torch.equal(drawn[0], expected[0])
        assert np.array_equal(drawn[1], expected[1])
        assert drawn[2] == expected[2]


def test_tiny_run_trains_evaluates_and_writes_everything(tiny_config):
    config = tiny_config("run", "epochs=3")
    result = train(config, verbose=False)
    assert not result.interrupted
    assert result.step == 3 * (240 // 40)
    accuracy = result.results["mnist/test"]["accuracy"]
    # Guessing among 10 classes gets 17 or more of the 60 test digits right with probability 6e-5.
    assert round(accuracy * 60) >= 17, "three epochs on 240 digits should beat chance clearly"
    # Checkpoint files, the pointer, the config, metrics and the plot.
    assert (
        result.checkpoint is not None
        and result.checkpoint.weights.is_file()
        and result.checkpoint.state.is_file()
    )
    assert (result.run_dir / "checkpoints" / "latest").read_text().strip() == result.checkpoint.name
    assert len(list((result.run_dir / "checkpoints").glob("*.safetensors"))) == config.keep_checkpoints
    assert yaml.safe_load((result.run_dir / "config.yaml").read_text()) == config_to_dict(config)
    records = read_metrics(result.metrics_path)
    events = [r["event"] for r in records]
    assert events.count("eval") == 3 and events.count("final") == 1 and "train" in events
    train_record = next(r for r in records if r["event"] == "train")
    assert {"loss", "accuracy", "lr", "img_per_second", "step", "epoch"} <= train_record.keys()
    assert not result.plots, "the loop draws nothing; the command line plots after training"
    plot_run(result)
    assert result.plots and result.plots[0].stat().st_size > 0
    assert "mnist/test" in result.table() and "accuracy" in result.table()
    # The saved model evaluates to the same accuracy.
    model, spec, metadata = load_model_from_checkpoint(result.run_dir)
    assert spec.name == "cnn-baseline" and metadata["step"] == str(result.step)
    handler = get_task_handler(spec.task)
    data = load_data(handler, "mnist", "test", options={"source": "idx"}, root=config.data.root)
    assert evaluate(model, data, handler)["accuracy"] == pytest.approx(accuracy)


def test_training_is_deterministic_given_the_seed(tiny_config):
    first = _weights(train(tiny_config("a", "epochs=1"), verbose=False).model)
    second = _weights(train(tiny_config("b", "epochs=1"), verbose=False).model)
    _assert_same_weights(first, second)
    third = train(tiny_config("c", "epochs=1", "seed=4"), verbose=False).model
    assert not torch.equal(first["classifier.weight"], third.state_dict()["classifier.weight"])


class _StopAfter:
    """A callback that simulates a kill: KeyboardInterrupt once ``step`` steps are done."""

    def __init__(self, step: int) -> None:
        self.step = step

    def __call__(self, info: StepInfo) -> None:
        if info.step == self.step:
            raise KeyboardInterrupt


@pytest.mark.parametrize(
    ("stop_at", "extra"),
    [(4, ()), (6, ()), (9, ("checkpoint_every=4",)), (5, ("optim.schedule=onecycle", "optim.name=sgd"))],
    ids=["mid-epoch", "epoch-end", "after-periodic-checkpoint", "onecycle-sgd"],
)
def test_kill_and_resume_reaches_bit_identical_weights(tiny_config, stop_at, extra, capsys):
    unbroken = train(tiny_config("unbroken", *extra), verbose=False)
    assert unbroken.step == 12

    killed = train(tiny_config("killed", *extra), callbacks=[_StopAfter(stop_at)], verbose=False)
    assert killed.interrupted and killed.step == stop_at
    assert killed.checkpoint is not None and killed.checkpoint.name == f"step-{stop_at:08d}"
    message = capsys.readouterr().err
    assert f"torchvote train --resume {killed.run_dir}" in message

    resumed = train(load_run_config(killed.run_dir), resume=killed.run_dir, verbose=False)
    assert not resumed.interrupted and resumed.step == 12
    _assert_same_weights(_weights(unbroken.model), _weights(resumed.model))
    assert resumed.results["mnist/test"] == unbroken.results["mnist/test"]
    # The resumed run appended to the same metrics file: one final record.
    assert [r["event"] for r in read_metrics(resumed.metrics_path)].count("final") == 1


def test_resume_may_extend_but_not_change_the_run(tiny_config):
    first = train(tiny_config("run", "epochs=1"), verbose=False)
    with pytest.raises(ConfigError, match=r"optim.lr \(run: 0.003, now: 0.1\)"):
        load_run_config(first.run_dir, ["optim.lr=0.1"])
    with pytest.raises(ConfigError, match="cannot resume with a different config"):
        train(tiny_config("run", "epochs=2", "batch_size=20"), resume=first.run_dir, verbose=False)
    longer = train(load_run_config(first.run_dir, ["epochs=2"]), resume=first.run_dir, verbose=False)
    assert longer.step == 12


def test_a_config_yaml_edited_past_reading_is_said_to_be_ignored_on_resume(tiny_config):
    """A hand-edited config.yaml naming a preset that does not exist was dropped without a word,
    then overwritten by the resume: the edit vanished. Said now; the checkpoint's config is used."""
    first = train(tiny_config("run", "max_steps=2"), verbose=False)
    path = first.run_dir / "config.yaml"
    path.write_text(path.read_text().replace("preset: tiny", "preset: gigantic", 1))
    said = r"config.yaml is not read: it is no config this version reads .*gigantic"
    with pytest.warns(UserWarning, match=said):
        config = load_run_config(first.run_dir, ["max_steps=3"])
    assert config.model.preset == "tiny" and config.max_steps == 3


def test_a_run_resumed_by_a_home_relative_path_stays_in_one_folder(tiny_config, tmp_path, monkeypatch):
    """resume='~/run' found the checkpoint under $HOME while the lock and config.yaml went to a
    folder named '~' in the working folder: one run split across two."""
    from torchvote.cli import main

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    first = train(tiny_config("run", "max_steps=2", "eval_every=0"), verbose=False)
    longer = train(load_run_config("~/run", ["max_steps=4"]), resume="~/run", verbose=False)
    assert longer.step == 4 and longer.run_dir == first.run_dir == tmp_path / "run"
    assert not (tmp_path / "~").exists()
    assert main(["train", "--resume", "~/run", "max_steps=4"]) == 0  # the CLI reads it alike
    assert main(["evaluate", "~/run", "--limit", "10"]) == 0  # its check said "does not exist"


def test_resuming_a_finished_run_reports_its_recorded_evaluation(tiny_config, monkeypatch, capsys):
    import torchvote.training.loop as loop_module

    first = train(tiny_config("run", "epochs=1", "data.eval_limit=30"), verbose=False)
    evaluated = []
    real_evaluate = loop_module.evaluate_loss_where_it_applies

    def spy(model, data, *args, **kwargs):
        evaluated.append(f"{data.name}/{data.split}")
        return real_evaluate(model, data, *args, **kwargs)

    monkeypatch.setattr(loop_module, "evaluate_loss_where_it_applies", spy)

    def finals() -> list[tuple[str, int]]:
        return [(r["dataset"], r["count"]) for r in read_metrics(first.metrics_path) if r["event"] == "final"]

    # Nothing left to train or evaluate: the recorded figures, no second record (and no progress
    # bar, which a log file got twice, full: "100%|...| 40/40 100%|...| 40/40").
    again = train(load_run_config(first.run_dir, ["progress=true"]), resume=first.run_dir, verbose=False)
    assert evaluated == [] and again.step == first.step
    err = capsys.readouterr().err
    assert f"has finished its {first.step} steps: nothing to train" in err and "step/s" not in err
    assert again.results.keys() == first.results.keys()
    for name, metrics in first.results.items():
        assert again.results[name] == pytest.approx(metrics, abs=1e-6)  # as recorded: 6 decimals
    assert finals() == [("mnist/test", 30)]
    # A data set added on resume is evaluated; the recorded one is not.
    more = train(
        load_run_config(first.run_dir, ["eval_on=[affnist-style:canvas=28]"]),
        resume=first.run_dir,
        verbose=False,
    )
    assert evaluated == ["affnist-style/test"] and more.results["mnist/test"] == again.results["mnist/test"]
    assert finals() == [("mnist/test", 30), ("affnist-style/test", 30)]
    # Another eval_limit is another evaluation, of every set the run last ran with: the eval_on
    # entry the last resume added stays (it wrote no checkpoint; its config.yaml records it).
    evaluated.clear()
    fewer = train(load_run_config(first.run_dir, ["data.eval_limit=20"]), resume=first.run_dir, verbose=False)
    assert evaluated == ["mnist/test", "affnist-style/test"] and fewer.results["mnist/test"]["count"] == 20
    assert finals()[-2:] == [("mnist/test", 20), ("affnist-style/test", 20)]


def test_a_finished_run_resumed_for_more_epochs_reports_its_new_final_evaluation(tiny_config):
    """A resumed finished run with more epochs reported the old step's final results (mutation review)."""
    first = train(tiny_config("run", "epochs=1", "data.eval_limit=30"), verbose=False)
    more = train(load_run_config(first.run_dir, ["epochs=2"]), resume=first.run_dir, verbose=False)
    assert more.step > first.step
    finals = [r["step"] for r in read_metrics(first.metrics_path) if r["event"] == "final"]
    assert finals == [first.step, more.step]


def test_a_finished_run_resumed_with_another_eval_split_evaluates_it_anew(tiny_config):
    """A resumed finished run reused the recorded final of another data set under its old label
    (mutation review)."""
    first = train(tiny_config("run", "epochs=1", "data.eval_limit=30"), verbose=False)
    config = load_run_config(first.run_dir, ["data.eval_split=train"])
    again = train(config, resume=first.run_dir, verbose=False)
    assert again.step == first.step and list(again.results) == ["mnist/train"]
    finals = [(r["dataset"], r["step"]) for r in read_metrics(first.metrics_path) if r["event"] == "final"]
    assert finals == [("mnist/test", first.step), ("mnist/train", first.step)]


def test_eval_every_2_evaluates_after_epochs_2_and_4(tiny_config):
    """eval_every counts epochs from 1: evaluations after epochs 2 and 4, not 1 and 3 (mutation review)."""
    run = train(tiny_config("run", "epochs=4", "eval_every=2"), verbose=False)
    assert [r["epoch"] for r in read_metrics(run.metrics_path) if r["event"] == "eval"] == [2, 4]


def test_the_last_step_gets_a_train_record(tiny_config):
    """A run ending between log_every steps logged nothing for its last steps (mutation review)."""
    run = train(tiny_config("run", "max_steps=5", "log_every=2", "eval_every=0"), verbose=False)
    assert [r["step"] for r in read_metrics(run.metrics_path) if r["event"] == "train"] == [2, 4, 5]


def _a_folder_with_notes(path: Path) -> Path:
    path.mkdir()
    (path / "notes.txt").write_text("mine")
    return path / "notes.txt"


def _a_file(path: Path) -> Path:
    path.write_text("mine")
    return path


@pytest.mark.parametrize(
    ("prepare", "message"), [(_a_folder_with_notes, r"is not empty \(notes.txt\)"), (_a_file, "is a file")]
)
def test_a_fresh_run_never_writes_over_a_users_files(tiny_config, tmp_path, prepare, message, monkeypatch):
    config = tiny_config("mine", "max_steps=1", "eval_every=0")
    users_file = prepare(Path(config.run_dir))
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(ConfigError, match=f"run_dir:? {config.run_dir} {message}"):
        train(config, verbose=False)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    assert users_file.read_text() == "mine"
    monkeypatch.chdir(tmp_path)  # should the check below fail, the run lands here, not in the repository
    config.run_dir = ""  # Path("") is the working directory
    with pytest.raises(ConfigError, match="run_dir must name a folder"):
        train(config, verbose=False)


def test_a_run_stopped_before_its_first_checkpoint_starts_over(tiny_config):
    # Killed inside the first checkpoint interval: config.yaml and metrics, no checkpoint. A rerun
    # (as `torchvote reproduce` does) must start over there, not call the folder a user's.
    config = tiny_config("early", "max_steps=1", "eval_every=0")
    run_dir = Path(config.run_dir)
    (run_dir / "checkpoints").mkdir(parents=True)
    # a run writes its config.yaml whole (atomically), every key in it
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))
    (run_dir / "metrics.jsonl").write_text("")
    assert train(config, verbose=False).checkpoint is not None
    other = tiny_config("mixed", "max_steps=1", "eval_every=0")
    Path(other.run_dir).mkdir()
    (Path(other.run_dir) / "config.yaml").write_text("{}")
    (Path(other.run_dir) / "thesis.tex").write_text("mine")
    with pytest.raises(ConfigError, match="is not empty"):
        train(other, verbose=False)
    # a user's own config.yaml and notes, under a run's file names: not a stopped run
    users = tiny_config("users", "max_steps=1", "eval_every=0")
    Path(users.run_dir).mkdir()
    for name, text in (("config.yaml", "mycfg: 1\n"), ("metrics.jsonl", "my notes\n")):
        (Path(users.run_dir) / name).write_text(text)
    with pytest.raises(ConfigError, match="is not empty"):
        train(users, verbose=False)
    assert (Path(users.run_dir) / "config.yaml").read_text() == "mycfg: 1\n"
    assert (Path(users.run_dir) / "metrics.jsonl").read_text() == "my notes\n"
    # a user's preset of a few config keys, with comments, trained into its own folder: it was
    # taken for a stopped run's and overwritten by the full dumped config
    notes = tiny_config("notes", "max_steps=1", "eval_every=0")
    Path(notes.run_dir).mkdir()
    preset = "# my notes\nmodel:\n  name: cnn-baseline\n  preset: tiny\nmax_steps: 1  # quick\n"
    (Path(notes.run_dir) / "config.yaml").write_text(preset)
    with pytest.raises(ConfigError, match="is not empty"):
        train(notes, verbose=False)
    assert (Path(notes.run_dir) / "config.yaml").read_text() == preset


def test_a_run_stopped_before_its_first_checkpoint_says_how_to_start_it_again(
    tiny_config, monkeypatch, capsys
):
    """It said "resume with: torchvote train --resume RUN", which then failed: nothing to resume."""
    from torchvote.cli import main
    from torchvote.training import loop

    config = tiny_config("first", "max_steps=2", "eval_every=0")
    run_dir = Path(config.run_dir)

    def interrupted(self, batch):
        raise KeyboardInterrupt  # inside the first step: no checkpoint may be written

    with monkeypatch.context() as patch:
        patch.setattr(loop._Run, "_train_step", interrupted)
        result = train(config, verbose=False)
    assert result.interrupted and result.checkpoint is None
    err = capsys.readouterr().err
    assert "resume with" not in err
    command = f"torchvote train {run_dir / 'config.yaml'}"
    assert f"start it again with: {command}" in err
    assert main(command.split()[1:]) == 0  # the instruction works: the same run, in the same folder
    assert find_checkpoint(run_dir).weights.is_file()


def test_a_generated_run_folder_stopped_before_its_first_checkpoint_starts_again_in_itself(
    tiny_config, tmp_path, monkeypatch, capsys
):
    """The saved config of a generated folder says run_dir: null: "torchvote train RUN/config.yaml"
    made a second folder and left the stopped one behind."""
    from torchvote.cli import main
    from torchvote.training import loop

    outs = tmp_path / "outs"
    config = tiny_config("unused", "max_steps=2", "eval_every=0", "run_dir=null", f"out_dir={outs}")

    def interrupted(self, batch):
        raise KeyboardInterrupt  # inside the first step: no checkpoint may be written

    with monkeypatch.context() as patch:
        patch.setattr(loop._Run, "_train_step", interrupted)
        result = train(config, verbose=False)
    assert result.checkpoint is None and result.run_dir.parent == outs
    line = next(line for line in capsys.readouterr().err.splitlines() if "start it again with: " in line)
    command = shlex.split(line.split("start it again with: ", 1)[1])
    assert command[:2] == ["torchvote", "train"] and f"run_dir={result.run_dir}" in command
    assert main(command[1:]) == 0
    assert [path.name for path in outs.iterdir()] == [result.run_dir.name]  # no second folder
    assert find_checkpoint(result.run_dir).weights.is_file()


def test_a_fresh_run_may_use_an_empty_folder(tiny_config):
    config = tiny_config("empty", "max_steps=1", "eval_every=0")
    Path(config.run_dir).mkdir()
    assert train(config, verbose=False).checkpoint is not None


def test_resume_without_checkpoint_is_an_error(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        load_run_config(tmp_path)


def test_a_fresh_run_never_overwrites_another_run(tiny_config):
    config = tiny_config("run", "max_steps=1", "eval_every=0")
    train(config, verbose=False)
    with pytest.raises(
        ConfigError, match=f"run folder {config.run_dir} already holds a run; continue it with"
    ):
        train(config, verbose=False)
    # Automatic names never collide.
    auto = tiny_config("ignored", "max_steps=1", "eval_every=0")
    auto.run_dir, auto.preset = None, "tiny"
    auto.out_dir = str(config.run_dir) + "-auto"
    a = train(auto, verbose=False)
    b = train(auto, verbose=False)
    assert a.run_dir != b.run_dir and a.run_dir.parent == b.run_dir.parent
    assert a.run_dir.name.startswith("tiny-")


def test_runs_started_in_the_same_second_get_folders_of_their_own(tiny_config, monkeypatch):
    """Seeds launched side by side: every new run claims its folder by creating it, so runs that
    start within one second (here: eight threads, one frozen clock) never share a folder."""
    from concurrent.futures import ThreadPoolExecutor

    from torchvote.training import setup
    from torchvote.training.distributed import DistributedContext

    monkeypatch.setattr(setup.time, "strftime", lambda _: "20261123-120000")
    config = tiny_config("ignored")
    config.run_dir, config.preset = None, "tiny"
    config.out_dir = str(config.data.root) + "-runs"
    with ThreadPoolExecutor(8) as pool:
        paths = list(pool.map(lambda _: setup.new_run_dir(config, DistributedContext()), range(8)))
    assert len(set(paths)) == 8 and all(path.is_dir() for path in paths)
    names = sorted(path.name for path in paths)
    assert names == sorted(["tiny-20261123-120000"] + [f"tiny-20261123-120000-{k}" for k in range(2, 9)])


def test_a_run_whose_set_up_fails_leaves_no_folder(tiny_config, tmp_path):
    config = tiny_config("ignored", "model.num_classes=5")
    config.run_dir, config.preset, config.out_dir = None, "tiny", str(tmp_path / "runs")
    with pytest.raises(ConfigError, match="model.num_classes=5 does not fit"):
        train(config, verbose=False)
    runs = tmp_path / "runs"
    assert not runs.exists() or list(runs.iterdir()) == []


@pytest.mark.parametrize("locking", [True, False], ids=["locked", "no-fcntl"])
def test_a_failed_set_up_leaves_the_empty_run_dir_the_user_made(tiny_config, tmp_path, monkeypatch, locking):
    """Only a folder made for the run is removed when its set-up fails: an empty one the user made
    and named as run_dir stays, and stays empty: the lock file the run made in it went too (it was
    left behind) (mutation review). Without fcntl (as on Windows) nothing is locked."""
    import sys

    if not locking:
        monkeypatch.setitem(sys.modules, "fcntl", None)  # `import fcntl` fails: nothing locked
    mine = tmp_path / "mine"
    mine.mkdir()
    config = tiny_config("mine", "model.num_classes=5")
    with pytest.raises(ConfigError, match="model.num_classes=5 does not fit"):
        train(config, verbose=False)
    assert mine.is_dir() and list(mine.iterdir()) == []


def test_onecycle_cannot_be_stretched_on_resume(tiny_config):
    first = train(tiny_config("run", "epochs=1", "optim.schedule=onecycle"), verbose=False)
    with pytest.raises(ConfigError, match="onecycle schedule of this run was set for 6 steps"):
        train(load_run_config(first.run_dir, ["epochs=2"]), resume=first.run_dir, verbose=False)


def test_a_resume_that_redraws_a_cosine_schedule_says_so(tiny_config, capsys):
    """Extending a cosine run redraws the curve over the new length: the learning rate jumps at
    the resumed step (from lr * min_lr_ratio = 0 at the end of 6 steps to the middle of 12)."""
    first = train(tiny_config("run", "epochs=1", "optim.lr=0.004", "optim.warmup_steps=0"), verbose=False)
    capsys.readouterr()
    train(load_run_config(first.run_dir, ["epochs=2"]), resume=first.run_dir, verbose=False)
    expected = "redrawn over 12 steps (was 6): the learning rate goes from 0 to 0.002 at step 6"
    assert f"the cosine schedule is {expected}" in capsys.readouterr().err


def test_a_resume_inside_the_warm_up_says_the_rate_does_not_jump(tiny_config, capsys):
    """Resumed inside its warm-up, whose rate does not depend on the run's length, a cosine run
    said "the learning rate goes from 0.00021 to 0.00021" (UX review)."""
    first = train(tiny_config("run", "epochs=1", "optim.lr=0.008", "optim.warmup_steps=8"), verbose=False)
    capsys.readouterr()
    train(load_run_config(first.run_dir, ["epochs=2"]), resume=first.run_dir, verbose=False)
    expected = "redrawn over 12 steps (was 6): the learning rate at step 6 is the same (0.007); the new"
    assert f"the cosine schedule is {expected}" in capsys.readouterr().err


def test_a_resume_that_redraws_the_spread_margin_ramp_says_so(tiny_config, capsys):
    """The margin ramp spans the run unless loss.spread_ramp_steps is set: a longer resumed run
    redrew it silently (the margin fell from 0.9 back to the middle of the ramp)."""
    first = train(tiny_config("run", "epochs=1", "loss.name=spread"), verbose=False)
    capsys.readouterr()
    train(load_run_config(first.run_dir, ["epochs=2"]), resume=first.run_dir, verbose=False)
    expected = "redrawn over 12 steps (was 6): the margin goes from 0.9 to 0.55 at step 6"
    assert f"the spread loss's margin ramp is {expected}" in capsys.readouterr().err
    fixed_ramp = tiny_config("fixed", "epochs=1", "loss.name=spread", "loss.spread_ramp_steps=4")
    fixed = train(fixed_ramp, verbose=False)
    capsys.readouterr()
    train(load_run_config(fixed.run_dir, ["epochs=2"]), resume=fixed.run_dir, verbose=False)
    assert "margin ramp" not in capsys.readouterr().err  # a ramp of its own length is not redrawn


def test_the_first_step_after_a_redrawn_schedule_takes_the_new_rate(tiny_config):
    """The optimiser kept its saved rate, the old curve's (0 at the end of 6 steps), for the first
    resumed step; the scheduler's new curve began one step late."""
    first = train(tiny_config("run", "epochs=1", "optim.lr=0.004", "optim.warmup_steps=0", "log_every=1"),
                  verbose=False)
    resumed = train(load_run_config(first.run_dir, ["epochs=2"]), resume=first.run_dir, verbose=False)
    rates = {r["step"]: r["lr"] for r in read_metrics(resumed.metrics_path) if r["event"] == "train"}
    multiplier = lr_multiplier(resumed.config.optim, 12)
    for step in (7, 8, 12):  # the rate a step trained with: the new curve's at its index (step - 1)
        assert rates[step] == pytest.approx(0.004 * multiplier(step - 1), abs=5e-7)  # records: 6 decimals
    assert rates[7] == pytest.approx(0.002, abs=5e-7)  # the old curve's was 0


def test_a_resume_that_ends_before_the_checkpoint_is_refused(tiny_config):
    """max_steps below the checkpoint's step was neither applied nor refused: the run said it had
    finished its 3 steps and reported the step-6 weights as its result."""
    first = train(tiny_config("run", "epochs=1"), verbose=False)
    with pytest.raises(ConfigError, match=r"step-00000006.safetensors is at step 6, past the 3 steps"):
        train(load_run_config(first.run_dir, ["max_steps=3"]), resume=first.run_dir, verbose=False)
    again = train(load_run_config(first.run_dir, ["max_steps=6"]), resume=first.run_dir, verbose=False)
    assert again.step == 6  # as many steps as were taken: finished, as before


def test_deterministic_algorithms_are_on_for_the_run_only(tiny_config):
    """``deterministic=true`` left torch's deterministic mode on for the rest of the process (a
    notebook's later code slowed or refused)."""
    seen = set()
    config = tiny_config("run", "deterministic=true", "max_steps=2")
    assert not torch.are_deterministic_algorithms_enabled()
    during = [lambda info: seen.add(torch.are_deterministic_algorithms_enabled())]
    train(config, callbacks=during, verbose=False)
    assert seen == {True} and not torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("deterministic", ["true", "false"])
def test_the_callers_warn_only_deterministic_mode_comes_back(tiny_config, deterministic):
    """A caller's ``use_deterministic_algorithms(True, warn_only=True)`` (usual on CUDA, where some
    ops have no deterministic kernel) came back strict after any run: those ops then raised."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        train(tiny_config("run", f"deterministic={deterministic}", "max_steps=1"), verbose=False)
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


def test_max_steps_stops_mid_epoch_and_saves(tiny_config):
    result = train(tiny_config("run", "max_steps=5", "epochs=10"), verbose=False)
    assert result.step == 5 and result.checkpoint.name == "step-00000005"


def test_bf16_autocast_trains(tiny_config):
    result = train(tiny_config("run", "bf16=true", "epochs=1"), verbose=False)
    assert all(torch.isfinite(p).all() for p in result.model.parameters())
    assert result.results["mnist/test"]["loss"] == result.results["mnist/test"]["loss"]  # not NaN


def test_worker_processes_give_the_same_batches(tiny_config):
    in_process = train(tiny_config("zero", "epochs=1"), verbose=False)
    with_workers = train(tiny_config("two", "epochs=1", "num_workers=1"), verbose=False)
    _assert_same_weights(_weights(in_process.model), _weights(with_workers.model))


@pytest.mark.slow  # a spawned worker imports torch: about 5 s
def test_workers_started_by_spawn_get_the_augmentation_too(tiny_config, monkeypatch):
    """macOS and Windows start DataLoader workers by ``spawn``, Linux from Python 3.14 by
    ``forkserver``: the dataset, its random shifts included (``data.shift=2`` here), reaches them
    pickled, and the shifts were a local function ("Can't pickle local object
    'ClassificationHandler.augment.<locals>.transform'"). Fork, Linux's default before 3.14,
    copies it without pickling, so the test above never saw it."""
    import functools

    from torchvote.training import data as training_data

    spawned = functools.partial(torch.utils.data.DataLoader, multiprocessing_context="spawn")
    monkeypatch.setattr(training_data.torch.utils.data, "DataLoader", spawned)
    in_process = train(tiny_config("zero", "max_steps=3"), verbose=False)
    with_workers = train(tiny_config("spawned", "max_steps=3", "num_workers=1"), verbose=False)
    _assert_same_weights(_weights(in_process.model), _weights(with_workers.model))


def test_data_that_does_not_fit_the_model_is_a_clear_error(tiny_config):
    with pytest.raises(
        ConfigError, match="model.num_classes=5 does not fit the data set, which needs num_classes=10 or more"
    ):
        train(tiny_config("run", "model.num_classes=5"), verbose=False)
    with pytest.raises(
        ConfigError, match="model.in_channels=3 does not fit the data set, which needs in_channels=1$"
    ):
        train(tiny_config("run", "model.in_channels=3"), verbose=False)
    with pytest.raises(ConfigError, match="model.image_size=20 does not fit the data set"):
        train(tiny_config("run", "model.image_size=20"), verbose=False)
    bigger = train(
        tiny_config("big", "model.image_size=32", "model.num_classes=12", "max_steps=1"), verbose=False
    )
    assert bigger.model.config.image_size == 32 and bigger.model.config.num_classes == 12
    with pytest.raises(ValueError, match="larger than the 240 training examples"):
        train(tiny_config("run", "batch_size=400"), verbose=False)


def test_margin_and_spread_losses_train_a_classifier(tiny_config):
    for loss in ("margin", "spread"):
        result = train(tiny_config(loss, f"loss.name={loss}", "epochs=1"), verbose=False)
        assert result.results["mnist/test"]["loss"] >= 0


def test_an_eval_on_entry_of_the_runs_own_data_set_is_reported_beside_it(tiny_config):
    """Results were keyed by "name/split" alone: an eval_on entry of the run's own data set with
    other options replaced the run's test result in the table (both records were written)."""
    result = train(tiny_config("run", "epochs=1", "eval_on=[mnist:source=idx,limit=10]"), verbose=False)
    labels = ["mnist/test", "mnist/test (mnist:source=idx,limit=10)"]
    assert list(result.results) == labels
    # and each has its own numbers: one cache entry per data set and split gave the entry the
    # run's own test result (its count too)
    own, entry = (result.results[label] for label in labels)
    assert entry["count"] == 10 and own["count"] > 10
    finals = [r for r in read_metrics(result.metrics_path) if r["event"] == "final"]
    assert [r["dataset"] for r in finals] == labels
    again = train(load_run_config(result.run_dir), resume=result.run_dir, verbose=False)  # recorded
    assert again.results.keys() == result.results.keys()


def test_canvas_trains_on_40x40_and_evaluates_on_affnist_style(tiny_config):
    config = tiny_config("run", "data.canvas=40", "epochs=1", "data.eval_limit=30")
    config.eval_on = ("affnist-style",)
    config.data.options = {"source": "idx"}
    result = train(config, verbose=False)
    assert result.model.config.image_size == 40
    assert {"mnist/test", "affnist-style/test"} <= result.results.keys()
    assert result.results["affnist-style/test"]["count"] == 30


@pytest.mark.parametrize(
    ("entry", "error"),
    [
        ("nosuch", "unknown data set 'nosuch'"),
        ("mnist:bogus=1", r"'mnist' \(test split\) takes no option 'bogus'; it takes limit, root, source"),
        ("copy", "image classifiers need an image data set"),
        ("affnist-style", "the model takes 28x28 images, the data has 40x40"),
    ],
)
def test_a_wrong_eval_on_entry_fails_before_the_training(tiny_config, tmp_path, entry, error):
    steps = []
    with pytest.raises(ValueError, match=error):  # an unknown name already when the config loads
        config = tiny_config("run", "epochs=1", f"eval_on=[{entry}]")
        train(config, callbacks=[lambda info: steps.append(info.step)], verbose=False)
    assert steps == [] and not (tmp_path / "run").exists()


def test_an_eval_on_set_whose_labels_the_loss_does_not_take_reports_its_accuracy(tiny_config, capsys):
    """A cross-entropy run with eval_on=[multimnist] (label pairs) trained to the end, then crashed
    in its final evaluation with the loss's error: the accuracy was lost with the run's table."""
    config = tiny_config("run", "max_steps=2", "data.canvas=36", "eval_on=[multimnist:num_pairs=20]")
    result = train(config, verbose=False)
    assert "loss" in result.results["mnist/test"]
    pairs = result.results["multimnist/test"]
    assert "loss" not in pairs and 0.0 <= pairs["accuracy"] <= 1.0
    assert "loss: not reported on multimnist/test: the run's loss does not apply" in capsys.readouterr().err


def test_an_eval_on_entry_reads_its_own_root(tiny_config, tmp_path):
    # The real affNIST lives apart from the MNIST folder of data.root: the entry's root= wins.
    from data.test_affnist import tiny_set, write_mat  # the .mat stand-ins of the affNIST tests
    from torchvote.data import DataNotFoundError

    folder = tmp_path / "affnist"
    write_mat(folder / "test.mat", *tiny_set(7))
    config = tiny_config("run", "data.canvas=40", "epochs=1", f"eval_on=[affnist:root={folder}]")
    result = train(config, verbose=False)
    assert result.results["affnist/test"]["count"] == 7
    with pytest.raises(DataNotFoundError, match="affNIST"):  # without it, data.root is searched
        train(tiny_config("again", "data.canvas=40", "epochs=1", "eval_on=[affnist]"), verbose=False)


def _wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow  # a fresh Python process importing torch, then a reference run
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_signal_saves_a_consistent_checkpoint_and_exits_cleanly(tiny_values, tmp_path, signum):
    run_dir = tmp_path / "signalled"
    values = tiny_values(run_dir, epochs=1000, log_every=1)
    values["optim"] = {"name": "adam", "lr": 0.003}  # constant: the schedule ignores the run length
    preset = tmp_path / "long.yaml"
    preset.write_text(yaml.safe_dump(values))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "torchvote.cli", "train", str(preset)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        metrics = run_dir / "metrics.jsonl"
        assert _wait_for(lambda: metrics.is_file() and metrics.read_text().count("\n") >= 3, 60)
        process.send_signal(signum)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 128 + signum, err  # as a shell reports the signal: 130, 143
    assert "Traceback" not in err
    assert f"resume with: torchvote train --resume {run_dir}" in err
    paths = find_checkpoint(run_dir)
    stopped_at = int(paths.name.split("-")[1])
    assert stopped_at >= 3
    # The saved weights are exactly those of an unbroken run of that many steps: not torn.
    from torchvote.training.config import config_from_dict

    reference = config_from_dict({**values, "run_dir": str(tmp_path / "reference"), "max_steps": stopped_at})
    expected = train(reference, verbose=False).model
    saved, _, _ = load_model_from_checkpoint(run_dir)
    _assert_same_weights(_weights(expected), _weights(saved))


def test_ctrl_c_in_the_final_evaluation_stops_it_and_a_resume_finishes_it(tiny_config, monkeypatch, capsys):
    """The stop request was still listening during the final evaluation: Ctrl-C printed "saving a
    checkpoint after this step" and the evaluation ran on to the end (SIGTERM was ignored too)."""
    from torchvote.training import loop

    config = tiny_config("run", "epochs=1", "eval_every=0")
    evaluate = loop._Run._evaluate

    def interrupted(self, data, source=""):  # the first evaluation is the final one (eval_every=0)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)  # the signal is handled here, as it would be inside a long evaluation
        return evaluate(self, data, source)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    try:
        with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
            patch.setattr(loop._Run, "_evaluate", interrupted)
            train(config, verbose=False)
    finally:
        signal.signal(signal.SIGINT, previous)
    err = capsys.readouterr().err
    assert "saving a checkpoint after this step" not in err
    assert "KeyboardInterrupt: stopped in the final evaluation at step 6; the last checkpoint is" in err
    assert f"resume with: torchvote train --resume {config.run_dir}" in err
    resumed = train(load_run_config(Path(config.run_dir)), resume=Path(config.run_dir), verbose=False)
    assert resumed.step == 6 and "mnist/test" in resumed.results


@dataclass
class _ImageModel40:
    """The fields of a model config that :meth:`finalize` reads: a 40x40 grey image model."""

    image_size: int = 40
    in_channels: int = 1
    num_classes: int = 10


def test_multimnist_batches_carry_the_digits_and_shift_them_with_the_image(tiny_config):
    import torchvote.data as data_package
    from torchvote.training.data import BatchPlan, iterate_batches

    handler = get_task_handler("image-classification")
    images, labels = data_package.load_small_digits("test", size=40)
    raw = tuple(data_package.make_multimnist(images, labels, num_pairs=8, seed=0))
    data = handler.build("multimnist", "train", raw)
    assert data.tensors["digits"].shape == (8, 2, 1, 36, 36) and data.fields["image_size"] == 36
    config = tiny_config("run", "data.shift=2")

    data = handler.finalize(data, _ImageModel40())
    assert data.tensors["digits"].shape == (8, 2, 1, 40, 40)
    augment = handler.augment(config.data, data)
    batch = next(iterate_batches(data, BatchPlan(8, 8, seed=0), 0, augment=augment))
    overlay = batch["digits"].sum(dim=1).clamp(max=1.0)
    torch.testing.assert_close(overlay, batch["images"])  # digits and image moved together
    assert not torch.equal(batch["images"], data.tensors["images"][BatchPlan(8, 8, seed=0).epoch_order(0)])


def test_a_canvas_places_the_whole_image_anywhere_on_it(tiny_config):
    """``data.canvas=40`` places a 28x28 image uniformly over the canvas's 13 x 13 positions
    (Sabour et al. 2017 sec. 5.2: "placed randomly on a black background"), never past its
    edge, whatever ``data.shift`` adds at 28x28: the two shifts were added, up to 8 pixels from
    the centre, and 0.7% of the MNIST digits lost ink."""
    from torchvote.training.data import BatchPlan, iterate_batches

    handler = get_task_handler("image-classification")
    frames = torch.ones(400, 1, 28, 28)  # ink up to the frame's border: any cut shows
    data = handler.build("mnist", "train", (frames, torch.arange(400) % 10))
    config = tiny_config("run", "data.shift=2", "data.canvas=40")

    data = handler.finalize(data, _ImageModel40())
    augment = handler.augment(config.data, data)
    batch = next(iterate_batches(data, BatchPlan(400, 400, seed=0), 0, augment=augment))
    images = batch["images"][:, 0]  # (400, 40, 40)
    assert torch.equal(images.sum(dim=(1, 2)), torch.full((400,), 28.0 * 28))  # no ink lost
    rows = images.amax(dim=2).argmax(dim=1)  # the top row of each frame
    columns = images.amax(dim=1).argmax(dim=1)
    assert set(rows.tolist()) == set(range(13)) == set(columns.tolist())  # every position is drawn


class _PoisonAt:
    """A callback that makes the model's weights NaN after step ``step`` (a diverged update)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def __call__(self, info: StepInfo) -> None:
        if info.step == self.step:
            with torch.no_grad():
                next(info.model.parameters()).fill_(float("nan"))


@pytest.mark.parametrize(
    ("overrides", "caught_at"),
    [
        (("log_every=2",), "step 8"),  # at the next metrics line
        (("log_every=100", "checkpoint_every=3"), "step 9"),  # before the next checkpoint
    ],
)
def test_a_diverged_run_stops_and_keeps_the_last_finite_checkpoint(tiny_config, overrides, caught_at):
    config = tiny_config("diverged", *overrides)  # 6 steps an epoch, a checkpoint at step 6
    with pytest.raises(TrainingDivergedError, match=f"NaN or infinite by {caught_at}: .*optim.lr"):
        train(config, callbacks=[_PoisonAt(7)], verbose=False)
    assert find_checkpoint(Path(config.run_dir)).name == checkpoint_name(6)
    weights = list((Path(config.run_dir) / "checkpoints").glob("*.safetensors"))
    assert weights, "the checkpoint of step 6 is kept"
    for path in weights:
        assert all(torch.isfinite(t).all() for t in load_file(path).values()), path


def test_a_train_record_gives_the_learning_rate_its_last_step_used(tiny_config):
    """The record read the optimiser's lr after the scheduler had stepped: one step ahead (the
    warm-up's first value never appeared, the last record showed the value after the last)."""
    config = tiny_config("lr", "max_steps=6", "log_every=1", "eval_every=0", "optim.schedule=cosine",
                         "optim.warmup_steps=2", "optim.lr=0.01")
    result = train(config, verbose=False)
    records = [r for r in read_metrics(result.metrics_path) if r["event"] == "train"]
    assert [r["step"] for r in records] == list(range(1, 7))
    # the record of step s holds the lr of step s - 1 (from 0), written out: warm-up (k + 1) / 2,
    # then cosine over the 4 steps left, 0.5 (1 + cos(pi (s - 2) / 4))
    expected = [0.005, 0.01, 0.01, 0.01 * (1 + math.cos(math.pi / 4)) / 2, 0.005,
                0.01 * (1 + math.cos(3 * math.pi / 4)) / 2]
    assert [r["lr"] for r in records] == pytest.approx(expected, rel=1e-3)  # records keep 4 digits


@pytest.mark.parametrize(
    ("schedule", "warmup", "expected"),
    [  # lr_multiplier(step) for steps 0..5 of a 6-step run, written out from the formulas
        ("constant", 2, [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]),
        ("exponential", 0, [0.5 ** (s / 2) for s in range(6)]),  # decay_rate ** (t / decay_steps)
        ("exponential", 2, [0.5, 1.0, 1.0, 0.5**0.5, 0.5, 0.5**1.5]),  # t counted from the warm-up's end
        ("cosine", 0, [0.1 + 0.9 * (1 + math.cos(math.pi * s / 6)) / 2 for s in range(6)]),
        ("cosine", 3, [1 / 3, 2 / 3, 1.0, 1.0, 0.1 + 0.9 * 0.75, 0.1 + 0.9 * 0.25]),
    ],
)
def test_the_schedules_follow_their_formulas(schedule, warmup, expected):
    """The schedule test compared the loop with lr_multiplier itself: a decay that forgot the
    warm-up, or a cosine over the whole run, passed."""
    from torchvote.training.optim import lr_multiplier
    from torchvote.training.schema import OptimConfig

    config = OptimConfig(
        schedule=schedule, warmup_steps=warmup, decay_rate=0.5, decay_steps=2, min_lr_ratio=0.1
    )
    multiplier = lr_multiplier(config, 6)
    assert [multiplier(step) for step in range(6)] == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("warmup", [0, 6])
def test_onecycle_rises_over_the_warmup_steps(tiny_config, warmup):
    """``optim.warmup_steps`` was ignored by the onecycle schedule (its rise took 30% of the run
    whatever the user set). Smith & Topin's cycle: from lr / 25 up to lr at the last warm-up step,
    then down; 30% of the 10 steps when warmup_steps is 0."""
    config = tiny_config("lr", "max_steps=10", "log_every=1", "eval_every=0", "optim.schedule=onecycle",
                         f"optim.warmup_steps={warmup}", "optim.lr=0.01")
    result = train(config, verbose=False)
    lrs = [r["lr"] for r in read_metrics(result.metrics_path) if r["event"] == "train"]  # step 1..10
    peak = warmup or 3  # the step (from 1) that runs at lr
    assert lrs[0] == pytest.approx(0.01 / 25)
    assert lrs[peak - 1] == pytest.approx(0.01)
    assert all(a < b for a, b in itertools.pairwise(lrs[:peak]))  # rising to the peak
    assert all(a > b for a, b in itertools.pairwise(lrs[peak - 1:]))  # then falling


def test_onecycle_refuses_a_warmup_as_long_as_the_run(tiny_config):
    config = tiny_config("lr", "max_steps=6", "optim.schedule=onecycle", "optim.warmup_steps=6")
    with pytest.raises(ConfigError, match=r"optim\.warmup_steps=6 leaves no step of the onecycle .*6 steps"):
        train(config, verbose=False)
    config = tiny_config("one", "max_steps=6", "optim.schedule=onecycle", "optim.warmup_steps=1")
    with pytest.raises(ConfigError, match=r"optim\.warmup_steps=1: the onecycle schedule rises .* 2 steps"):
        train(config, verbose=False)  # was: ZeroDivisionError inside OneCycleLR


def test_a_single_label_loss_on_label_sets_is_refused_before_the_run_starts(tiny_config, tmp_path):
    """Cross-entropy (or the spread loss) on MultiMNIST's two labels an image failed at the first
    step, after the run folder, its config.yaml and an empty metrics.jsonl were written."""
    config = tiny_config("mm", "data.name=multimnist", "data.limit=40", "data.eval_limit=20", "max_steps=1")
    config.run_dir = None
    config.out_dir = str(tmp_path / "runs")
    with pytest.raises(ValueError, match=r"take one label per image, got targets of shape \(20, 2\)"):
        train(config, verbose=False)
    assert not list((tmp_path / "runs").glob("*"))


def test_a_spread_loss_run_records_its_margin_beside_the_rising_loss(tiny_config):
    """The spread loss rises with its margin (0.2 -> 0.9 over the run, Hinton et al. 2018): an EM
    run's log showed a loss climbing 4x with nothing to say why. Each train record now holds the
    margin of its last step, the schedule's value."""
    from torchvote.losses import SpreadMarginSchedule

    config = tiny_config("run", "max_steps=6", "log_every=2", "eval_every=0", "data.eval_limit=20",
                         model={"name": "capsnet", "preset": "tiny", "router": "em"})
    result = train(config, verbose=False)
    records = [r for r in read_metrics(result.metrics_path) if r["event"] == "train"]
    schedule = SpreadMarginSchedule(steps=6, start=0.2, end=0.9)
    expected = [schedule(r["step"] - 1) for r in records]  # the last step of each record's window
    assert [r["spread_margin"] for r in records] == pytest.approx(expected, rel=1e-5)  # 6 digits kept
    assert records[0]["spread_margin"] < records[-1]["spread_margin"]
    cnn = train(tiny_config("cnn", "max_steps=2", "eval_every=0", "data.eval_limit=20"), verbose=False)
    assert all("spread_margin" not in r for r in read_metrics(cnn.metrics_path))  # no spread loss


@pytest.mark.parametrize("callbacks", [[1], lambda info: None, 5])
def test_callbacks_that_cannot_be_called_are_refused_before_the_run_starts(tiny_config, callbacks):
    # [1] failed with "'int' object is not callable" after the first step, leaving a run folder
    # with a config and metrics but no checkpoint; a lone function was "not iterable"
    config = tiny_config("run")
    with pytest.raises(TypeError, match="callbacks must be a list of callables taking a StepInfo"):
        train(config, callbacks=callbacks, verbose=False)
    assert not Path(config.run_dir).exists()


def test_on_start_is_called_once_after_the_set_up_and_refused_if_not_callable(tiny_config):
    seen = []
    config = tiny_config("run", "max_steps=2")
    train(config, callbacks=[lambda info: seen.append(info.step)], on_start=lambda: seen.append("start"),
          verbose=False)
    assert seen == ["start", 1, 2]
    other = tiny_config("other")
    with pytest.raises(TypeError, match="on_start must be a callable"):
        train(other, on_start="start", verbose=False)
    assert not Path(other.run_dir).exists()


def test_callbacks_may_be_any_iterable_of_callables(tiny_config):
    seen = []
    train(tiny_config("run", "max_steps=2"), callbacks=(f for f in [seen.append]), verbose=False)
    assert [info.step for info in seen] == [1, 2]  # a generator is read once, not used up by the check


def test_the_run_helpers_name_an_object_of_another_kind():
    """Review findings: dataclasses.asdict's error, 'NoneType' object has no attribute
    'interrupted' / 'state_dict'."""
    from torchvote.training.checkpoint import load_model_weights
    from torchvote.training.config import apply_overrides, config_diff
    from torchvote.training.plots import plot_run

    with pytest.raises(TypeError, match="config must be a TrainConfig"):
        apply_overrides({"epochs": 1}, ["epochs=2"])
    with pytest.raises(TypeError, match="config must be a TrainConfig"):
        config_diff(None, None)
    with pytest.raises(TypeError, match="result must be the TrainResult train\\(\\) returns, got NoneType"):
        plot_run(None)
    with pytest.raises(TypeError, match="model must be an nn.Module, got NoneType"):
        load_model_weights(None, "x.safetensors")


def test_a_run_shorter_than_its_warm_up_says_where_its_learning_rate_ends(tiny_config, capsys):
    """A 20-step trial of a preset with a 100-step warm-up trained at a fifth of its rate, unsaid
    (UX review); onecycle refuses such a run itself, a run that fits says nothing."""
    train(tiny_config("short", "max_steps=2", "optim.warmup_steps=8", "optim.lr=0.004"), verbose=False)
    assert ("note: optim.warmup_steps=8 is longer than this run's 2 steps: the learning rate ends at 25% "
            "of optim.lr=0.004") in capsys.readouterr().err
    train(tiny_config("fits", "max_steps=2", "optim.warmup_steps=2"), verbose=False)
    assert "note: optim.warmup_steps" not in capsys.readouterr().err


def test_an_eval_every_past_the_runs_epochs_says_it_evaluates_at_the_end_only(tiny_config, capsys):
    """eval_every=10 (epochs) on a run of one epoch evaluated nothing before the end, unsaid: a
    user reading it as steps waited for evaluations (UX review)."""
    run = train(tiny_config("late", "epochs=1", "eval_every=10"), verbose=False)
    assert "note: eval_every=10 counts epochs and this run trains 1: it evaluates at its end only" in (
        capsys.readouterr().err
    )
    events = [r["event"] for r in read_metrics(run.metrics_path)]
    assert "eval" not in events and events.count("final") == 1  # as the note says
    train(tiny_config("each", "epochs=2", "eval_every=2"), verbose=False)
    assert "note: eval_every" not in capsys.readouterr().err


def test_the_run_header_counts_in_words(tiny_config, capsys):
    """"1 steps of 8 on 1 process(es)" (UX review)."""
    train(tiny_config("one", "max_steps=1"), verbose=False)
    header = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("training "))
    assert " 1 step of " in header and " on 1 process, " in header, header


@pytest.fixture
def float64_default():
    """torch's default dtype set to float64 (as a user of float64 numerics may leave it) for one test."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def test_runs_train_and_load_in_float32_whatever_the_default_dtype(tiny_config, float64_default):
    """The model was built in the default dtype: under float64 the first step refused the task's
    float32 images, and a float32 checkpoint did not load (``the model expects torch.float64``)."""
    result = train(tiny_config("run", "max_steps=2"), verbose=False)
    assert result.step == 2
    weights = load_file(result.checkpoint.weights)
    assert {tensor.dtype for tensor in weights.values() if tensor.is_floating_point()} == {torch.float32}
    model, _, _ = load_model_from_checkpoint(result.run_dir)
    assert {parameter.dtype for parameter in model.parameters()} == {torch.float32}
    handler = get_task_handler("image-classification")
    data = load_data(handler, "mnist", "test", options={"source": "idx"}, root=result.config.data.root)
    accuracy = result.results["mnist/test"]["accuracy"]
    assert evaluate(model, data, handler)["accuracy"] == pytest.approx(accuracy)
