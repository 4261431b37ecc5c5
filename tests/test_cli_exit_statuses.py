"""Exit statuses of ``torchvote``: 2 when the command line itself is wrong (argparse's usage error),
1 when the command line is fine but running it failed (training diverged, out of memory, a damaged
checkpoint, a file or download error, a missing optional package). Status 2 covered both before,
and a script could not tell a typo from a full disk."""

from __future__ import annotations

import re

import pytest
import torch

from torchvote import cli
from torchvote.data.errors import CorruptDataError, DownloadError
from torchvote.training.checkpoint import CheckpointError
from torchvote.training.config import ConfigError
from torchvote.training.loop import TrainingDivergedError, TrainingOutOfMemoryError


def _rows(table: str) -> dict[str, str]:
    """The rows of the exit-status table, by status, continuation lines joined."""
    rows: dict[str, str] = {}
    status = None
    for line in table.splitlines()[1:]:
        found = re.match(r"  (\d+)\s+(.*)", line)
        if found:
            status, text = found.groups()
            rows[status] = text
        elif status is not None and line.startswith("     "):
            rows[status] += " " + line.strip()
        else:
            status = None
    return rows


def test_the_table_keeps_2_for_usage_errors_and_states_the_rule():
    rows = _rows(cli.EXIT_STATUSES)
    assert set(rows) == {"0", "1", "2", "130", "143"}
    assert "command line itself is wrong" in cli.EXIT_STATUSES.splitlines()[0]
    assert rows["2"].startswith("a usage error")
    for failure in ("diverged", "out of memory", "download", "package", "damaged checkpoint"):
        assert failure not in rows["2"], rows["2"]
        assert failure in rows["1"], rows["1"]
    assert cli.EXIT_USAGE == 2 and cli.EXIT_FAILURE == 1
    assert cli.EXIT_MISSING_DATA == cli.EXIT_BROKEN_PIPE == cli.EXIT_FAILURE


def test_help_ends_with_the_table(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["--help"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.rstrip().endswith(cli.EXIT_STATUSES.splitlines()[-1])


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (ValueError("--limit must be a positive integer, got 0"), 2),
        (ConfigError("unknown key 'epoch'; keys: epochs, ..."), 2),
        (OSError(28, "No space left on device"), 1),
        (FileNotFoundError("benchmark script benchmarks/em.py not found"), 1),
        (DownloadError("no mirror served train-images-idx3-ubyte.gz"), 1),
        (ModuleNotFoundError("No module named 'scipy'", name="scipy"), 1),
        (TrainingDivergedError("the training loss is nan at step 12"), 1),
        (TrainingOutOfMemoryError("out of memory at step 3; lower batch_size"), 1),
        (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), 1),
        (CheckpointError("runs/r/checkpoints/step-1.safetensors is corrupt or not a safetensors file"), 1),
        (CorruptDataError("~/.cache/torchvote/mnist/train-images-idx3-ubyte.gz: truncated IDX data"), 1),
        (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 GB"), 1),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, BaseException) else str(value),
)
def test_a_usage_error_exits_2_and_a_failure_while_running_exits_1(monkeypatch, capsys, error, status):
    def fails(args):
        raise error

    monkeypatch.setattr(cli, "_list", fails)
    assert cli.main(["list"]) == status
    err = capsys.readouterr().err
    assert err.startswith("torchvote list: error: ") and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (ValueError("x"), 2),
        (ConfigError("x"), 2),
        (CheckpointError("x"), 1),
        (CorruptDataError("x"), 1),
        (OSError("x"), 1),
        (ImportError("x"), 1),
        (TypeError("x"), 1),
        (TrainingDivergedError("x"), 1),
    ],
)
def test_exit_status_of(error, status):
    assert cli.exit_status_of(error, failures=(CheckpointError,)) == status


def test_exit_status_of_a_value_error_subclass_without_failures():
    assert cli.exit_status_of(CheckpointError("x")) == 2  # a ValueError unless named a failure
    assert cli.exit_status_of(CorruptDataError("x")) == 1  # a ValueError, but always a failure


def test_a_missing_checkpoint_is_a_usage_error_and_a_damaged_one_a_failure(tmp_path, capsys):
    """The rule at its edge: a path on the command line that names nothing is the command line's
    mistake (2); a file that is there but cannot be read is a failure while running (1)."""
    code = cli.main(["evaluate", str(tmp_path / "no-run"), "--on", "mnist"])
    assert code == 2 and "does not exist" in capsys.readouterr().err
    damaged = tmp_path / "step-1.safetensors"
    damaged.write_bytes(b"not a safetensors file")
    code = cli.main(["evaluate", str(damaged), "--on", "mnist"])
    err = capsys.readouterr().err
    assert code == 1 and "torchvote evaluate: error:" in err and "Traceback" not in err


def test_a_missing_benchmark_script_is_a_failure(tmp_path, capsys, monkeypatch):
    """``bench NAME`` with a NAME the parser accepts: the script missing here (an installed
    package, no checkout) is no mistake of the command line."""
    monkeypatch.setattr(cli, "_benchmarks_dir", lambda: tmp_path)
    assert cli.main(["bench", "routing"]) == 1
    assert "benchmark script" in capsys.readouterr().err


def test_explain_statuses(tmp_path, capsys, monkeypatch):
    """``explain`` returns its own status: 2 for its options' values (--out in the way, a
    --checkpoint that names nothing), 1 for a record that cannot be read or a missing package."""
    pytest.importorskip("matplotlib", reason='the report needs matplotlib: pip install "torchvote[plots]"')
    out = str(tmp_path / "out")
    code = cli.main(["explain", "x", "--out", out, "--checkpoint", str(tmp_path / "none.pt")])
    err = capsys.readouterr().err
    assert code == 2 and "--checkpoint: " in err and "does not exist" in err
    (tmp_path / "afile").write_text("mine")
    assert cli.main(["explain", "x", "--out", str(tmp_path / "afile")]) == 2
    assert "--out: " in capsys.readouterr().err
    garbage = tmp_path / "record.pt"
    garbage.write_bytes(b"garbage")
    assert cli.main(["explain", "x", "--out", out, "--checkpoint", str(garbage)]) == 1
    err = capsys.readouterr().err
    assert "--checkpoint: " in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    import torchvote.pretrained as pretrained

    def missing(*args, **kwargs):
        raise ModuleNotFoundError('the encoder needs "tokenizers": pip install "torchvote[pretrained]"')

    monkeypatch.setattr(pretrained, "load_pretrained", missing)
    assert cli.main(["explain", "x", "--out", out]) == 1
    assert "torchvote[pretrained]" in capsys.readouterr().err


# --- the phase of a command: its checks (2), then its work (1) ----------------------------------------
# A ValueError raised once a command's checks passed and its work began was read as a usage error
# (2) like any other ValueError; it is a failure while running (1). Each command marks the point
# (cli.mark_running); the tests raise one on each side of it.

FAST = ["progress=false", "tensorboard=false"]


def _error_line(err: str, command: str) -> str:
    """The one ``torchvote COMMAND: error:`` line of ``err`` (other lines, the run's own notes,
    may come before it), with no traceback."""
    lines = [line for line in err.splitlines() if line.startswith(f"torchvote {command}: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _raises(message: str):
    def fails(*args, **kwargs):
        raise ValueError(message)

    return fails


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A trained run, a run stopped before its first checkpoint, and a folder that holds no run."""
    import shutil

    root = tmp_path_factory.mktemp("runs")
    trained = root / "trained"
    assert cli.main(["train", "smoke", "max_steps=1", "eval_every=0", f"run_dir={trained}", *FAST]) == 0
    stopped = root / "stopped"  # its config.yaml and metrics, no checkpoints/ yet
    shutil.copytree(trained, stopped)
    shutil.rmtree(stopped / "checkpoints")
    not_a_run = root / "notes"
    not_a_run.mkdir()
    (not_a_run / "todo.txt").write_text("mine")
    return {"trained": trained, "stopped": stopped, "not_a_run": not_a_run}


def test_exit_status_of_a_value_error_while_running_is_a_failure():
    assert cli.exit_status_of(ValueError("x"), running=True) == 1
    assert cli.exit_status_of(ConfigError("x"), running=True) == 1
    assert cli.exit_status_of(ValueError("x"), running=False) == 2
    assert cli.exit_status_of(OSError("x"), running=False) == 1


def test_a_command_is_running_once_marked():
    import argparse

    args = argparse.Namespace(command="list")
    assert not cli.is_running(args)
    cli.mark_running(args)
    cli.mark_running(args)  # a mark stays
    assert cli.is_running(args)


def test_list_a_value_error_while_listing_is_a_failure(monkeypatch, capsys):
    monkeypatch.setitem(cli._LISTERS, "models", _raises("a broken registry entry"))
    assert cli.main(["list", "models"]) == 1
    assert "a broken registry entry" in _error_line(capsys.readouterr().err, "list")
    with pytest.raises(SystemExit) as stop:  # the command line wrong: still 2
        cli.main(["list", "gadgets"])
    assert stop.value.code == 2


def test_train_a_value_error_in_the_training_loop_is_a_failure(tmp_path, monkeypatch, capsys):
    import importlib

    loop = importlib.import_module("torchvote.training.loop")  # the module, not train()
    monkeypatch.setattr(loop, "evaluate_loss_where_it_applies", _raises("logits of shape (0,)"))
    argv = ["train", "smoke", "max_steps=1", "eval_every=0", f"run_dir={tmp_path / 'r'}", *FAST]
    assert cli.main(argv) == 1  # the final evaluation, after the step
    assert "logits of shape (0,)" in _error_line(capsys.readouterr().err, "train")


def test_train_a_config_value_refused_while_the_run_is_set_up_is_a_usage_error(tmp_path, monkeypatch, capsys):
    """The data, model and optimiser are built inside train(): a config value refused there is
    still the command line's mistake, whether a real check or any ValueError of the set-up."""
    argv = ["train", "smoke", "max_steps=1", "data.eval_split=dev", f"run_dir={tmp_path / 'a'}", *FAST]
    assert cli.main(argv) == 2
    assert "data.eval_split: 'dev' is not a split" in _error_line(capsys.readouterr().err, "train")
    import importlib

    loop = importlib.import_module("torchvote.training.loop")
    monkeypatch.setattr(loop, "load_run_data", _raises("data.options.size: must be positive"))
    assert cli.main(["train", "smoke", "max_steps=1", f"run_dir={tmp_path / 'b'}", *FAST]) == 2
    assert "data.options.size" in _error_line(capsys.readouterr().err, "train")


@pytest.mark.parametrize(("started", "status"), [(False, 2), (True, 1)], ids=["in-set-up", "training"])
def test_main_marks_running_when_the_run_is_set_up(monkeypatch, capsys, started, status):
    """train() calls on_start when its set-up is done: the CLI's marks the command running."""
    import torchvote.training as training

    def train(config, *, resume=None, on_start=None):
        if started:
            on_start()
        raise ValueError("a value met inside the run")

    monkeypatch.setattr(training, "train", train)
    assert cli.main(["main", "--no-report", "max_steps=1", *FAST]) == status
    assert "a value met inside the run" in _error_line(capsys.readouterr().err, "main")


def test_train_a_value_error_in_the_first_step_is_a_failure(tmp_path, monkeypatch, capsys):
    """The first step runs after the set-up: a ValueError there is running's (1), before any
    step has ended (a callback after each step marked the command running one step too late)."""
    import importlib

    loop = importlib.import_module("torchvote.training.loop")
    monkeypatch.setattr(loop._Run, "_train_step", _raises("a batch the model cannot take"))
    argv = ["train", "smoke", "max_steps=2", "eval_every=0", f"run_dir={tmp_path / 'r'}", *FAST]
    assert cli.main(argv) == 1
    assert "a batch the model cannot take" in _error_line(capsys.readouterr().err, "train")


def test_mains_report_runs_as_part_of_its_work(tmp_path, monkeypatch):
    """``torchvote main``'s explain report is its work: its errors are failures, not usage errors."""
    from types import SimpleNamespace

    import torchvote.training as training
    import torchvote.training.plots as plots
    from torchvote.training.config import load_config

    marked = []
    monkeypatch.setattr(cli, "_explain", lambda args: marked.append(cli.is_running(args)) or 0)
    run_dir = tmp_path / "run"
    result = SimpleNamespace(interrupted=False, checkpoint=SimpleNamespace(weights=run_dir / "w"),
                             metrics_path=run_dir / "m", run_dir=run_dir, plots=[])
    def train(config, *, resume=None, on_start):
        on_start()  # the set-up done, as train() says it
        return result

    monkeypatch.setattr(training, "train", train)
    monkeypatch.setattr(plots, "plot_run", lambda result: None)
    args = cli.build_parser().parse_args(["main"])
    config = load_config("smoke", ["device=cpu", "tensorboard=false"])
    assert cli._run_training(config, None, args=args, explain=True) == 0
    assert marked == [True] and cli.is_running(args)


@pytest.mark.parametrize("samples", [[], ["--samples", "2"]], ids=["streamed", "whole"])
def test_generate_a_value_error_once_generation_started_is_a_failure(runs, monkeypatch, capsys, samples):
    from types import SimpleNamespace

    import torchvote.training.generation as generation

    def generates(location, prompts, *, on_text=None, on_generation=None, on_start, **kwargs):
        on_start()  # every argument checked, as generate_from_checkpoint says it
        if on_text is not None:
            on_text(0, "To be", "!")
        else:
            on_generation(0, SimpleNamespace(task="language-model", prompt="To be", text="!"))
        raise ValueError("sampled a token past the vocabulary")

    monkeypatch.setattr(generation, "generate_from_checkpoint", generates)
    assert cli.main(["generate", str(runs["trained"]), "--prompt", "To be", *samples]) == 1
    assert "sampled a token past" in _error_line(capsys.readouterr().err, "generate")


def test_generate_a_value_error_before_generation_starts_is_a_usage_error(runs, monkeypatch, capsys):
    import torchvote.training.generation as generation

    monkeypatch.setattr(generation, "generate_from_checkpoint", _raises("prompt 'X': the model knows no 'X'"))
    assert cli.main(["generate", str(runs["trained"]), "--prompt", "X"]) == 2
    assert "knows no 'X'" in _error_line(capsys.readouterr().err, "generate")


@pytest.mark.parametrize(
    "argv",
    [["evaluate", "{run}", "--on", "mnist"], ["generate", "{run}"]],
    ids=["evaluate", "generate"],
)
def test_a_folder_that_holds_no_run_is_a_usage_error_and_a_run_without_a_checkpoint_a_failure(
    runs, capsys, argv
):
    """As ``train --resume`` reads them: a folder that is no run is the command line's mistake
    (it was status 1 here, "no checkpoint in ..."); a run stopped before its first checkpoint is
    a run all the same, and finding none in it a failure."""
    command = argv[0]
    code = cli.main([word.replace("{run}", str(runs["not_a_run"])) for word in argv])
    line = _error_line(capsys.readouterr().err, command)
    assert code == 2 and f"{runs['not_a_run']} is not a run folder" in line, line
    code = cli.main([word.replace("{run}", str(runs["stopped"])) for word in argv])
    line = _error_line(capsys.readouterr().err, command)
    assert code == 1 and "no checkpoint in" in line, line


def test_train_resume_reads_the_two_folders_the_same_way(runs, capsys):
    code = cli.main(["train", "--resume", str(runs["not_a_run"]), *FAST])
    assert code == 2 and "is not a run folder" in _error_line(capsys.readouterr().err, "train")
    code = cli.main(["train", "--resume", str(runs["stopped"]), *FAST])
    assert code == 1 and "no checkpoint in" in _error_line(capsys.readouterr().err, "train")
    # a user's own config.yaml makes no run (train --resume read it as a stopped run's: status 1)
    mine = runs["not_a_run"].parent / "mine"
    mine.mkdir(exist_ok=True)
    (mine / "config.yaml").write_text("epochs: 3\n")
    for argv in (["train", "--resume", str(mine), *FAST], ["evaluate", str(mine), "--on", "mnist"]):
        assert cli.main(argv) == 2
        assert "is not a run folder" in _error_line(capsys.readouterr().err, argv[0])


def test_explain_a_folder_that_holds_no_run_is_a_usage_error_and_a_run_without_a_checkpoint_a_failure(
    runs, tmp_path, monkeypatch, capsys
):
    pytest.importorskip("matplotlib", reason='the report needs matplotlib: pip install "torchvote[plots]"')
    import torchvote.pretrained as pretrained

    def no_encoder(*args, **kwargs):  # the sentence section is skipped: quicker, and beside the point
        raise ModuleNotFoundError("no tokenizers here")

    monkeypatch.setattr(pretrained, "load_pretrained", no_encoder)
    out = str(tmp_path / "out")
    code = cli.main(["explain", "x", "--out", out, "--checkpoint", str(runs["not_a_run"])])
    line = _error_line(capsys.readouterr().err, "explain")
    assert code == 2 and "--checkpoint: " in line and "is not a run folder" in line, line
    code = cli.main(["explain", "x", "--out", out, "--checkpoint", str(runs["stopped"])])
    line = _error_line(capsys.readouterr().err, "explain")
    assert code == 1 and "no checkpoint in" in line, line


@pytest.mark.parametrize(
    "argv",
    [
        ["evaluate", "{run}", "--on", "mnist"],
        ["generate", "{run}"],
        ["explain", "x", "--out", "{out}", "--checkpoint", "{run}"],
        ["train", "--resume", "{run}", *FAST],
    ],
    ids=["evaluate", "generate", "explain", "train-resume"],
)
def test_a_folder_whose_checkpoints_folder_holds_no_checkpoint_is_no_run(
    runs, tmp_path, monkeypatch, capsys, argv
):
    """A user's project folder with an empty ``checkpoints/`` (and no run's config.yaml) read as a
    run folder: "no checkpoint in ..." (status 1) instead of "not a run folder" (2). A run stopped
    before its first checkpoint is a run with one beside its config.yaml too."""
    import shutil

    if argv[0] == "explain":
        pytest.importorskip("matplotlib", reason="the report needs matplotlib")
        import torchvote.pretrained as pretrained

        def no_encoder(*args, **kwargs):
            raise ModuleNotFoundError("no tokenizers here")

        monkeypatch.setattr(pretrained, "load_pretrained", no_encoder)
    project = tmp_path / "project"
    (project / "checkpoints").mkdir(parents=True)
    (project / "notes.txt").write_text("mine")
    stopped = tmp_path / "stopped"
    shutil.copytree(runs["stopped"], stopped)
    (stopped / "checkpoints").mkdir()
    command, out = argv[0], str(tmp_path / "out")
    code = cli.main([word.replace("{run}", str(project)).replace("{out}", out) for word in argv])
    line = _error_line(capsys.readouterr().err, command)
    assert code == 2 and f"{project} is not a run folder" in line, line
    if command == "train":
        assert "its checkpoints/ holds no checkpoint, and no config.yaml in it" in line, line
    code = cli.main([word.replace("{run}", str(stopped)).replace("{out}", out) for word in argv])
    line = _error_line(capsys.readouterr().err, command)
    assert code == 1 and "no checkpoint in" in line, line


def test_the_checkpoint_argument_is_checked_by_one_function_for_every_command(tmp_path):
    """evaluate and generate (a checkpoint's stem counts) and explain (a record, or a folder holding
    one, counts) refuse a checkpoint argument with one function, each message naming the argument
    and what was expected."""
    from torchvote.explain.record import RECORD_FILE
    from torchvote.training.checkpoint import NOT_A_RUN_FOLDER

    def refusal(*args, **kwargs) -> str:
        with pytest.raises(ValueError) as caught:
            cli.check_checkpoint_argument(*args, **kwargs)
        return str(caught.value)

    expected = "expected a run folder, its checkpoints folder or a .safetensors file"
    with_records = (
        "expected a run folder, its checkpoints folder, a checkpoint's file or a record (.safetensors/.pt)"
    )
    missing = tmp_path / "none"
    assert refusal(str(missing), "checkpoint") == f"checkpoint: {missing} does not exist; {expected}"
    assert refusal(missing, "--checkpoint", records=True) == (
        f"--checkpoint: {missing} does not exist; {with_records}"
    )
    (tmp_path / "step-1.safetensors").write_bytes(b"weights")
    cli.check_checkpoint_argument(str(tmp_path / "step-1"), "checkpoint")  # a stem: find_checkpoint reads it
    assert "does not exist" in refusal(tmp_path / "step-1", "--checkpoint", records=True)  # read as named
    folder = tmp_path / "folder"
    folder.mkdir()
    assert refusal(str(folder), "checkpoint") == f"checkpoint: {folder} is {NOT_A_RUN_FOLDER}; {expected}"
    assert refusal(folder, "--checkpoint", records=True) == (
        f"--checkpoint: {folder} is {NOT_A_RUN_FOLDER} and holds no {RECORD_FILE}; {with_records}"
    )
    (folder / RECORD_FILE).write_bytes(b"a record")
    cli.check_checkpoint_argument(folder, "--checkpoint", records=True)
    assert "is not a run folder" in refusal(str(folder), "checkpoint")  # evaluate reads no record


def test_the_checkpoint_argument_is_checked_without_the_train_extra(tmp_path):
    """explain runs without the train extra: the one check imports nothing of it, says what does
    not exist, and leaves a folder it cannot judge to the reader (which names the extra)."""
    import subprocess
    import sys

    script = (
        "import sys; sys.modules['omegaconf'] = None\n"  # as if it were not installed
        "from torchvote.cli import check_checkpoint_argument as check\n"
        "check(sys.argv[2], '--checkpoint', records=True)\n"
        "try:\n"
        "    check(sys.argv[1], '--checkpoint', records=True)\n"
        "except ValueError as error:\n"
        "    print(error)\n"
    )
    folder = tmp_path / "folder"
    folder.mkdir()
    argv = [sys.executable, "-c", script, str(tmp_path / "none"), str(folder)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"--checkpoint: {tmp_path / 'none'} does not exist; expected"), done.stdout


def test_explain_a_value_error_while_drawing_is_a_failure(runs, tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib", reason='the report needs matplotlib: pip install "torchvote[plots]"')
    import torchvote.explain.record as record
    import torchvote.pretrained as pretrained

    def no_encoder(*args, **kwargs):
        raise ModuleNotFoundError("no tokenizers here")

    monkeypatch.setattr(pretrained, "load_pretrained", no_encoder)
    monkeypatch.setattr(record, "load_record", _raises("couplings of shape (0, 3)"))
    out = str(tmp_path / "out")
    assert cli.main(["explain", "x", "--out", out, "--checkpoint", str(runs["trained"])]) == 1
    assert "couplings of shape" in _error_line(capsys.readouterr().err, "explain")
    assert cli.main(["explain", "x", "--out", out, "--iterations", "0"]) == 2  # a bad value: still 2


def test_is_run_folder_reads_folders_as_runs_are_made(runs, tmp_path):
    """The one rule (is_run_folder) the command line and explain's record loader read folders
    with: a run's folder (checkpoints or its own config.yaml), its checkpoints folder (with or
    without the pointer); not a user's config.yaml, not an empty folder."""
    import shutil

    from torchvote.explain.record import _is_checkpoint_folder
    from torchvote.training.checkpoint import is_run_folder

    user_config = tmp_path / "mine"
    user_config.mkdir()
    (user_config / "config.yaml").write_text("epochs: 3\n")
    no_pointer = tmp_path / "no-pointer"
    shutil.copytree(runs["trained"] / "checkpoints", no_pointer)
    (no_pointer / "latest").unlink()
    project = tmp_path / "project"  # a user's folder with an empty checkpoints/: no run
    (project / "checkpoints").mkdir(parents=True)
    stopped_beside_empty = tmp_path / "stopped"  # a stopped run's config.yaml beside one: a run
    shutil.copytree(runs["stopped"], stopped_beside_empty)
    (stopped_beside_empty / "checkpoints").mkdir()
    folders = {
        runs["trained"]: True,
        runs["trained"] / "checkpoints": True,
        runs["stopped"]: True,
        no_pointer: True,
        stopped_beside_empty: True,
        runs["not_a_run"]: False,
        user_config: False,
        project: False,
        project / "checkpoints": False,
    }
    for folder, expected in folders.items():
        assert is_run_folder(folder) is expected, folder
        assert _is_checkpoint_folder(folder) is expected, folder


def test_evaluate_a_value_error_while_evaluating_is_a_failure(runs, monkeypatch, capsys):
    import importlib

    evaluation = importlib.import_module("torchvote.training.evaluation")
    monkeypatch.setattr(evaluation, "evaluate_loss_where_it_applies", _raises("logits of shape (0,)"))
    assert cli.main(["evaluate", str(runs["trained"]), "--on", "small-digits"]) == 1
    assert "logits of shape (0,)" in _error_line(capsys.readouterr().err, "evaluate")


def test_evaluate_a_data_set_that_does_not_fit_is_a_usage_error_after_one_that_does(runs, capsys):
    """Each --on data set is loaded, and checked against the model, after the one before it was
    evaluated: a misfit is the command line's (2) wherever it stands in the list."""
    code = cli.main(["evaluate", str(runs["trained"]), "--on", "small-digits,affnist-style", "--limit", "5"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "the model takes" in _error_line(err, "evaluate")


def test_demo_a_value_error_while_running_is_a_failure(tmp_path, monkeypatch, capsys):
    import torchvote.demo as demo

    monkeypatch.setattr(demo, "run_demo", _raises("num_keys must be at most 5000 (the MNIST train split)"))
    assert cli.main(["demo", "--out", str(tmp_path / "demo"), "--device", "cpu"]) == 1
    assert "num_keys must be at most" in _error_line(capsys.readouterr().err, "demo")


def test_demo_an_out_in_the_way_is_refused_before_it_runs(tmp_path, monkeypatch, capsys):
    import torchvote.demo as demo

    ran = []
    monkeypatch.setattr(demo, "run_demo", lambda **kwargs: ran.append(kwargs))
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    assert cli.main(["demo", "--out", str(a_file), "--device", "cpu"]) == 2
    assert "--out: " in _error_line(capsys.readouterr().err, "demo") and ran == []
    assert cli.main(["demo", "--device", "gpu"]) == 2 and ran == []


@pytest.mark.parametrize(("lines", "status"), [(0, 2), (1, 1)], ids=["before-the-first-run", "in-a-run"])
def test_reproduce_marks_running_at_its_first_run(tmp_path, monkeypatch, capsys, lines, status):
    import torchvote.experiments as experiments

    def reproduce(row, *, echo=print, **request):  # its default: print
        for _ in range(lines):
            echo(f"[{row.name} 1/1] a variant, seed 0: torchvote train ...")
        raise ValueError("a value met inside the run")

    monkeypatch.setattr(experiments, "reproduce", reproduce)
    argv = ["reproduce", "capsnet-routing", "--seeds", "0", "--variant", "1 iteration, no", "--out",
            str(tmp_path)]
    assert cli.main(argv) == status
    assert "a value met inside the run" in _error_line(capsys.readouterr().err, "reproduce")


def test_reproduce_refuses_a_device_this_machine_lacks_before_any_run(tmp_path, monkeypatch, capsys):
    import torchvote.experiments as experiments

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ran = []
    summary = tmp_path / "summary.md"
    summary.write_text("| variant | accuracy |\n")
    monkeypatch.setattr(experiments, "reproduce", lambda row, **request: ran.append(row) or summary)
    argv = ["reproduce", "capsnet-routing", "--seeds", "0", "--out", str(tmp_path), "--device", "cuda"]
    assert cli.main(argv) == 2 and ran == []
    assert "--device: " in _error_line(capsys.readouterr().err, "reproduce")


def test_reproduce_refuses_a_stopped_run_of_an_edited_row_before_any_run(runs, tmp_path, monkeypatch, capsys):
    """reproduce planned each run as it reached it, after the runs before it trained: the refusal
    of seed 1's folder came after seed 0 had run (and would have read as running's). Now every
    run with a folder is planned before the first trains."""
    import shutil

    import torchvote.experiments as experiments
    import torchvote.experiments.runner as runner

    row = experiments.get_row("capsnet-routing")
    variant = experiments.select_variants(row, ["1 iteration, no"])[0]
    shutil.copytree(runs["trained"], experiments.run_dir_of(tmp_path, row, "cpu", variant, 1))  # a smoke run
    ran = []
    monkeypatch.setattr(runner, "_train_one", lambda *args: ran.append(args) or pytest.fail("a run trained"))
    argv = ["reproduce", "capsnet-routing", "--seeds", "0", "1", "--variant", "1 iteration, no", "--out",
            str(tmp_path)]
    assert cli.main(argv) == 2 and ran == []
    assert "was run with another configuration" in _error_line(capsys.readouterr().err, "reproduce")
    with pytest.raises(ConfigError, match="was run with another configuration"):  # the library's own
        experiments.reproduce(row, seeds=[0, 1], variants=["1 iteration, no"], out_dir=tmp_path,
                              echo=lambda line: pytest.fail(f"a run began: {line}"))
    assert ran == []


def test_data_a_value_error_while_listing_is_a_failure(monkeypatch, capsys):
    import torchvote.data.command as command

    monkeypatch.setattr(command, "_files_found", _raises("affNIST's manifest holds no size"))
    assert cli.main(["data", "list"]) == 1
    assert "manifest holds no size" in _error_line(capsys.readouterr().err, "data")
    assert cli.main(["data", "list", "--verify"]) == 2  # an option that does not apply: still 2
    assert "name the data set" in _error_line(capsys.readouterr().err, "data")


def _run_with_its_newest_checkpoint_truncated(run_dir, capsys):
    """A two-step smoke run in ``run_dir`` with a checkpoint at each step, the newer one truncated:
    ``(newest, intact)`` weights files. The run's own output is read off ``capsys``."""
    argv = ["train", "smoke", "max_steps=2", "checkpoint_every=1", "eval_every=0", f"run_dir={run_dir}"]
    assert cli.main([*argv, *FAST]) == 0
    newest = run_dir / "checkpoints" / "step-00000002.safetensors"
    newest.write_bytes(newest.read_bytes()[:100])  # truncated
    capsys.readouterr()
    return newest, run_dir / "checkpoints" / "step-00000001.safetensors"


def test_evaluate_on_a_run_whose_newest_checkpoint_is_damaged_names_the_intact_one(tmp_path, capsys):
    """It said only that the newest file was unreadable, where ``train --resume`` goes on from the
    newest intact checkpoint beside it: the message names that one and the command that takes it,
    and the command works."""
    import shlex

    run_dir = tmp_path / "run"
    newest, intact = _run_with_its_newest_checkpoint_truncated(run_dir, capsys)
    assert cli.main(["evaluate", str(run_dir), "--on", "small-digits", "--limit", "20"]) == 1
    line = _error_line(capsys.readouterr().err, "evaluate")
    assert f"{newest} is not a readable safetensors file" in line
    command = f"torchvote evaluate {shlex.quote(str(intact))}"
    assert line.endswith(f"the newest intact checkpoint is {intact}: {command}")
    assert cli.main(["evaluate", str(intact), "--on", "small-digits", "--limit", "20"]) == 0
    assert cli.main(["evaluate", str(newest), "--on", "small-digits"]) == 1  # a file named: no hint
    assert "newest intact" not in capsys.readouterr().err


def test_evaluate_hint_quotes_a_path_with_a_space_and_is_left_out_where_nothing_is_intact(tmp_path, capsys):
    """The suggested command is quoted for the shell (a folder with a space), and a run whose only
    checkpoint is damaged gets the plain error, not the search's (mutation review)."""
    import shlex

    run_dir = tmp_path / "my run"
    newest, older = _run_with_its_newest_checkpoint_truncated(run_dir, capsys)
    assert cli.main(["evaluate", str(run_dir), "--on", "small-digits", "--limit", "20"]) == 1
    line = _error_line(capsys.readouterr().err, "evaluate")
    assert line.endswith(f": torchvote evaluate {shlex.quote(str(older))}") and "'" in line
    older.write_bytes(older.read_bytes()[:100])  # now none is intact
    assert cli.main(["evaluate", str(run_dir), "--on", "small-digits", "--limit", "20"]) == 1
    line = _error_line(capsys.readouterr().err, "evaluate")
    assert line.startswith(f"torchvote evaluate: error: {newest} is not a readable safetensors file")
    assert "newest intact" not in line
