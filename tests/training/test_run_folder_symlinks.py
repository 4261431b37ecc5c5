"""A run folder from someone else (an archive, a shared disk) may hold symbolic links where
torchvote writes in place: the lock file and the metrics log are refused, never written through,
while a run folder that is itself a link (a run kept on another disk) keeps working."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from torchvote.files import LOCK_NAME, FolderLock
from torchvote.training import load_run_config, read_metrics, train
from torchvote.training.metrics import MetricsWriter

pytestmark = pytest.mark.skipif(
    not hasattr(os, "O_NOFOLLOW"), reason="no O_NOFOLLOW here (Windows): links are followed"
)

USERS_FILE = "export IMPORTANT=1\nssh-ed25519 AAAA user@host"  # no final newline: looks torn


def _linked(run: Path, name: str, target: Path) -> Path:
    """``run / name`` made a symbolic link to ``target`` (``run`` made if missing)."""
    run.mkdir(parents=True, exist_ok=True)
    (run / name).symlink_to(target)
    return target


def test_open_no_follow_refuses_a_link_and_opens_a_file(tmp_path: Path) -> None:
    from torchvote.files import open_no_follow

    target = tmp_path / "target"
    target.write_text("kept")
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(OSError, match=f"{tmp_path / 'link'} is a symbolic link: .* remove it"):
        open_no_follow(tmp_path / "link", os.O_RDWR)
    descriptor = open_no_follow(tmp_path / "file", os.O_RDWR | os.O_CREAT)
    os.close(descriptor)
    assert (tmp_path / "file").is_file() and target.read_text() == "kept"


def test_a_linked_lock_file_is_refused_and_the_file_it_names_kept(tmp_path: Path) -> None:
    """The lock truncated the file its ``.lock`` named and wrote its pid there (~/.bashrc emptied)."""
    pytest.importorskip("fcntl")
    users = tmp_path / "bashrc"
    users.write_text(USERS_FILE)
    run = tmp_path / "run"
    _linked(run, LOCK_NAME, users)
    with pytest.raises(OSError, match=rf"{run / LOCK_NAME} is a symbolic link: torchvote does not write"):
        FolderLock(run, "run folder").acquire()
    assert users.read_text() == USERS_FILE


def test_a_lock_file_linked_to_nothing_creates_nothing(tmp_path: Path) -> None:
    pytest.importorskip("fcntl")
    run, missing = tmp_path / "run", tmp_path / "created-by-the-lock"
    _linked(run, LOCK_NAME, missing)
    with pytest.raises(OSError, match="is a symbolic link"):
        FolderLock(run, "run folder").acquire()
    assert not missing.exists()


@pytest.mark.parametrize("resume_step", [None, 0])
def test_a_linked_metrics_log_is_refused_and_the_file_it_names_kept(tmp_path: Path, resume_step) -> None:
    """The writer cut the named file's last line (a "torn record") and appended its records to it."""
    users = tmp_path / "authorized_keys"
    users.write_text(USERS_FILE)
    run = tmp_path / "run"
    _linked(run, "metrics.jsonl", users)
    with pytest.raises(OSError, match=rf"{run / 'metrics.jsonl'} is a symbolic link"):
        MetricsWriter(run, resume_step=resume_step)
    assert users.read_text() == USERS_FILE


def test_a_metrics_log_linked_to_nothing_creates_nothing(tmp_path: Path) -> None:
    run, missing = tmp_path / "run", tmp_path / "created-by-the-writer"
    _linked(run, "metrics.jsonl", missing)
    with pytest.raises(OSError, match="is a symbolic link"):
        MetricsWriter(run)
    assert not missing.exists()


def test_a_metrics_log_still_has_its_torn_line_cut_and_records_appended(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"event": "train", "step": 1}\n{"event": "tra')
    with MetricsWriter(tmp_path) as writer:
        writer.write("train", 2, {"loss": 0.5})
    assert [record["step"] for record in read_metrics(path)] == [1, 2]
    assert json.loads(path.read_text().splitlines()[-1])["loss"] == 0.5


def test_a_linked_run_folder_locks_and_records(tmp_path: Path) -> None:
    """Only the last part of the path is checked: a folder kept on another disk is linked to."""
    pytest.importorskip("fcntl")
    elsewhere = tmp_path / "other-disk" / "run"
    elsewhere.mkdir(parents=True)
    run = tmp_path / "run"
    run.symlink_to(elsewhere, target_is_directory=True)
    lock = FolderLock(run, "run folder").acquire()
    try:
        assert (elsewhere / LOCK_NAME).read_text().strip() == str(os.getpid())
        with MetricsWriter(run) as writer:
            writer.write("train", 1, {"loss": 1.0})
    finally:
        lock.release()
    assert [record["step"] for record in read_metrics(elsewhere / "metrics.jsonl")] == [1]


def test_training_and_resuming_through_a_linked_run_folder(tiny_config, tmp_path: Path) -> None:
    elsewhere = tmp_path / "other-disk" / "run"
    elsewhere.mkdir(parents=True)
    (tmp_path / "run").symlink_to(elsewhere, target_is_directory=True)
    first = train(tiny_config("run", "max_steps=2"), verbose=False)
    assert first.step == 2
    resumed = train(load_run_config(first.run_dir, ["max_steps=3"]), resume=first.run_dir, verbose=False)
    assert resumed.step == 3
    assert [r["step"] for r in read_metrics(elsewhere / "metrics.jsonl") if r["event"] == "train"][-1] == 3


def test_training_into_a_run_folder_with_a_linked_lock_fails_and_keeps_the_file(
    tiny_config, tmp_path: Path
) -> None:
    pytest.importorskip("fcntl")
    first = train(tiny_config("run", "max_steps=2"), verbose=False)
    users = tmp_path / "bashrc"
    users.write_text(USERS_FILE)
    (first.run_dir / LOCK_NAME).unlink(missing_ok=True)
    (first.run_dir / LOCK_NAME).symlink_to(users)
    with pytest.raises(OSError, match="is a symbolic link"):
        train(load_run_config(first.run_dir, ["max_steps=3"]), resume=first.run_dir, verbose=False)
    assert users.read_text() == USERS_FILE
