"""What the command line says when a run's folder, or a file in it, fails it.

- A damaged newest training state (``.state.pt``): ``evaluate RUN`` exited 2 asking to "name the
  data sets with --on"; it is a damaged checkpoint (status 1), named, with the intact one to use.
- A run folder that could not be opened: "start it again with: torchvote train RUN/config.yaml"
  was said for a ``config.yaml`` never written (a read-only folder), for a folder this process
  may not write, and for a folder another process holds (pointing at that process's run).
- A folder that cannot be made (a read-only current folder): "[Errno 30] Read-only file system:
  'runs'" named neither ``out_dir`` (``--out``) nor where ``runs`` was; a name part over 255
  bytes: "[Errno 36] File name too long" named no ``run_dir``.
"""

from __future__ import annotations

import errno
import pathlib
from pathlib import Path

import pytest

from torchvote import cli
from torchvote.files import FolderInUseError, FolderLock
from torchvote.training import loop as loop_module
from torchvote.training import train

FAST = ["progress=false", "tensorboard=false"]


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "error:" in line]


# --- 4: a damaged training state ---------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_evaluate_a_run_whose_newest_state_is_damaged_fails_naming_the_intact_one(
    tiny_config, capsys, damage
):
    result = train(tiny_config("run", "epochs=2"), verbose=False)  # keeps the checkpoints of steps 6, 12
    checkpoints = result.run_dir / "checkpoints"
    state = checkpoints / "step-00000012.state.pt"
    state.write_bytes(state.read_bytes()[:1000] if damage == "truncated" else b"")
    capsys.readouterr()
    code = cli.main(["evaluate", str(result.run_dir)])
    err = capsys.readouterr().err
    assert code == 1, err
    (line,) = _error_lines(err)
    assert "--on" not in line and f"{state} is corrupt" in line
    intact = checkpoints / "step-00000006.safetensors"
    assert f"the newest intact checkpoint is {intact}: torchvote evaluate {intact}" in line


# --- 5: no command to go on with where it would not work ------------------------------------------------


def _after_set_up(monkeypatch, then):
    """Run ``then(run)`` after the run's data and model are set up, before its folder is opened."""
    set_up = loop_module._Run._setup

    def patched(self):
        set_up(self)
        then(self)

    monkeypatch.setattr(loop_module._Run, "_setup", patched)


def test_a_folder_another_process_took_gets_no_command_to_go_on(tiny_config, monkeypatch, capsys):
    """Another process made and locked the folder while this one loaded its data (two commands
    started side by side): its checkpoints are that run's."""
    config = tiny_config("busy", "max_steps=1")
    held: list[FolderLock] = []
    _after_set_up(monkeypatch, lambda run: held.append(FolderLock(run.run_dir).acquire()))
    try:
        with pytest.raises(FolderInUseError):
            train(config, verbose=False)
    finally:
        for lock in held:
            lock.release()
    err = capsys.readouterr().err
    assert "start it again" not in err and "resume with" not in err and "no checkpoint was written" not in err


def test_a_run_folder_whose_config_was_never_written_gets_no_command_to_go_on(
    tiny_config, monkeypatch, capsys
):
    def read_only(path, data):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(loop_module, "atomic_write_bytes", read_only)
    config = tiny_config("ro", "max_steps=1")
    with pytest.raises(OSError, match="Read-only"):
        train(config, verbose=False)
    err = capsys.readouterr().err
    assert f"OSError opening the run folder {config.run_dir}: no checkpoint was written" in err
    assert "start it again" not in err and "config.yaml" not in err


def test_a_run_folder_this_process_may_not_write_gets_no_command_to_go_on(tiny_config, monkeypatch, capsys):
    """Even where a config.yaml is there (a stopped run started again): the command would fail
    as this did."""
    config = tiny_config("locked", "max_steps=1")

    def unwritable(run):
        Path(run.run_dir).mkdir()
        (Path(run.run_dir) / "config.yaml").write_text("model: {}\n")

        def refuse(self):
            raise PermissionError(f"run folder {self.folder} cannot be written (Permission denied)")

        monkeypatch.setattr(FolderLock, "acquire", refuse)

    _after_set_up(monkeypatch, unwritable)
    with pytest.raises(PermissionError):
        train(config, verbose=False)
    err = capsys.readouterr().err
    assert "PermissionError opening the run folder" in err and "start it again" not in err


# --- 6, 7: a folder that cannot be made, a name too long ----------------------------------------------


def _refuse_mkdir(monkeypatch, name: str) -> None:
    mkdir = pathlib.Path.mkdir

    def refused(self, *args, **kwargs):
        if self.name == name:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return mkdir(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "mkdir", refused)


def test_an_out_dir_that_cannot_be_made_is_named_with_its_absolute_path(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _refuse_mkdir(monkeypatch, "runs")  # as in a read-only current folder (root writes anywhere)
    code = cli.main(["train", "smoke", "max_steps=1", *FAST])
    err = capsys.readouterr().err
    assert code == 1
    (line,) = _error_lines(err)
    assert f"out_dir: cannot make the folder runs ({tmp_path / 'runs'}): Read-only file system" in line


def test_a_run_dir_with_a_part_too_long_is_named(tmp_path, capsys):
    too_long = tmp_path / ("b" * 256)
    code = cli.main(["train", "smoke", "max_steps=1", f"run_dir={too_long}", *FAST])
    err = capsys.readouterr().err
    assert code == 2, err
    (line,) = _error_lines(err)
    assert f"run_dir: {too_long}: File name too long" in line


def test_explain_an_out_that_cannot_be_made_is_named_with_its_absolute_path(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib", reason='the report needs matplotlib: pip install "torchvote[plots]"')
    import torchvote.explain.record as record
    import torchvote.pretrained as pretrained

    def no_encoder(*args, **kwargs):
        raise ModuleNotFoundError("no tokenizers here")

    monkeypatch.setattr(pretrained, "load_pretrained", no_encoder)  # the record's pictures alone
    monkeypatch.setattr(record, "load_record", lambda *args, **kwargs: {})
    given = tmp_path / "record.pt"
    given.write_bytes(b"a record")
    monkeypatch.chdir(tmp_path)
    _refuse_mkdir(monkeypatch, "runs")
    code = cli.main(["explain", "--checkpoint", str(given)])  # the default --out: runs/explain
    err = capsys.readouterr().err
    assert code == 1, err
    (line,) = _error_lines(err)
    where = f"runs/explain ({tmp_path / 'runs' / 'explain'})"
    assert f"--out: cannot make the folder {where}: Read-only file system" in line
