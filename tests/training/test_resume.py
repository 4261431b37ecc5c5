"""``--resume`` never loses a run: a truncated or corrupt newest checkpoint is skipped (and kept),
the run continues from the newest intact one, exactly as a run resumed from that one would."""

from __future__ import annotations

import os
import re
import shutil
import time

import pytest
import torch

from torchvote.training import CheckpointError, load_run_config, save_checkpoint, train
from torchvote.training.results import find_resumable_checkpoint

from .test_loop import _assert_same_weights, _StopAfter, _weights


def _damage(path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    else:  # garbage over the start: the safetensors header / the zip's first record
        path.write_bytes(b"\xde\xad\xbe\xef" * 16 + data[64:])


@pytest.fixture
def stopped_run(tiny_config):
    """A run killed at step 9 with checkpoints every 4 steps: it keeps step-8 and step-9."""
    run = train(tiny_config("killed", "checkpoint_every=4"), callbacks=[_StopAfter(9)], verbose=False)
    names = sorted(p.name for p in (run.run_dir / "checkpoints").glob("*.safetensors"))
    assert names == ["step-00000008.safetensors", "step-00000009.safetensors"]
    return run.run_dir


@pytest.mark.parametrize("how", ["truncated", "garbage"])
@pytest.mark.parametrize("broken", ["safetensors", "state.pt"])
def test_resume_falls_back_to_the_newest_intact_checkpoint(stopped_run, tmp_path, broken, how, capsys):
    # The reference: the same run resumed from step 8 with step 9 never written.
    reference_dir = tmp_path / "reference"
    shutil.copytree(stopped_run, reference_dir)
    for path in (reference_dir / "checkpoints").glob("step-00000009.*"):
        path.unlink()
    (reference_dir / "checkpoints" / "latest").write_text("step-00000008\n")
    reference = train(load_run_config(reference_dir), resume=reference_dir, verbose=False)

    bad = stopped_run / "checkpoints" / f"step-00000009.{broken}"
    _damage(bad, how)
    bad_bytes = bad.read_bytes()
    capsys.readouterr()
    resumed = train(load_run_config(stopped_run), resume=stopped_run, verbose=False)
    lines = [line for line in capsys.readouterr().err.splitlines() if "unreadable" in line]
    assert len(lines) == 1 and str(bad) in lines[0] and "resuming from step-00000008" in lines[0]
    assert not resumed.interrupted and resumed.step == reference.step == 12
    _assert_same_weights(_weights(reference.model), _weights(resumed.model))
    assert resumed.results == reference.results
    assert bad.read_bytes() == bad_bytes, "the bad file is kept as it was"


def test_no_intact_checkpoint_is_an_error_naming_every_file(stopped_run):
    for name in ("step-00000009.safetensors", "step-00000008.state.pt"):
        _damage(stopped_run / "checkpoints" / name, "truncated")
    with pytest.raises(CheckpointError) as error:
        load_run_config(stopped_run)
    message = str(error.value)
    assert message.startswith(f"no intact checkpoint in {stopped_run / 'checkpoints'}: ")
    assert "step-00000009.safetensors is corrupt" in message
    assert "step-00000008.state.pt is corrupt" in message
    assert (stopped_run / "checkpoints" / "step-00000009.safetensors").is_file()


def test_the_fallback_takes_the_newest_intact_of_several_older_checkpoints(tiny_config):
    """Every fallback case had one older checkpoint: a search oldest-first (a resume silently
    losing all but the first checkpoint's progress) passed them all."""
    run = train(tiny_config("killed", "checkpoint_every=2", "keep_checkpoints=5"), callbacks=[_StopAfter(9)],
                verbose=False)
    steps = sorted(int(p.name[5:13]) for p in (run.run_dir / "checkpoints").glob("*.safetensors"))
    assert steps == [2, 4, 6, 8, 9]
    _damage(run.run_dir / "checkpoints" / "step-00000009.safetensors", "truncated")
    _damage(run.run_dir / "checkpoints" / "step-00000008.state.pt", "garbage")
    paths, state, skipped = find_resumable_checkpoint(run.run_dir)
    assert paths.name == "step-00000006" and state["step"] == 6 and len(skipped) == 2


def test_a_missing_newest_checkpoint_or_pointer_falls_back_too(stopped_run):
    (stopped_run / "checkpoints" / "step-00000009.safetensors").unlink()
    paths, state, skipped = find_resumable_checkpoint(stopped_run)
    assert paths.name == "step-00000008" and state["step"] == 8 and len(skipped) == 1
    (stopped_run / "checkpoints" / "latest").write_text("")
    assert find_resumable_checkpoint(stopped_run)[0].name == "step-00000008"


def test_saving_over_an_existing_checkpoint_keeps_the_old_files(tmp_path):
    model = torch.nn.Linear(2, 2)
    first = save_checkpoint(tmp_path, step=3, model=model, model_metadata={}, state={"step": 3})
    (first.weights).write_bytes(b"unreadable")
    second = save_checkpoint(tmp_path, step=3, model=model, model_metadata={}, state={"step": 3})
    assert second == first and second.weights.stat().st_size > 10
    assert (tmp_path / "step-00000003.safetensors.old").read_bytes() == b"unreadable"
    assert (tmp_path / "step-00000003.state.pt.old").is_file()


def test_multimnist_resumes_on_the_pairs_the_killed_run_would_have_drawn(tiny_mnist_root, tmp_path):
    """Each epoch's pairs are drawn afresh from (seed, epoch): a run killed in its second epoch
    and resumed reaches the weights of the unbroken run."""
    from torchvote.training.config import load_config

    def config(name: str):
        return load_config(
            "capsnet-multimnist",
            [
                "model.preset=tiny",
                f"data.root={tiny_mnist_root}",
                "data.options.source=idx",
                "data.options.num_pairs=32",
                "data.eval_limit=20",
                "batch_size=8",
                "eval_batch_size=20",
                "epochs=3",
                "progress=false",
                "tensorboard=false",
                f"run_dir={tmp_path / name}",
            ],
        )

    unbroken = train(config("unbroken"), verbose=False)
    assert unbroken.step == 12
    killed = train(config("killed"), callbacks=[_StopAfter(6)], verbose=False)
    assert killed.interrupted and killed.step == 6
    resumed = train(load_run_config(killed.run_dir), resume=killed.run_dir, verbose=False)
    assert resumed.step == 12
    _assert_same_weights(_weights(unbroken.model), _weights(resumed.model))
    assert resumed.results == unbroken.results


def test_wall_time_counts_every_segment_of_a_resumed_run(tiny_config):
    """A killed and resumed run reports the time of both segments, not only the last one's
    (it reported the last segment's alone, which made resumed runs look fast)."""
    pause = 0.05

    def slow(info):  # the first segment: at least 9 x 50 ms
        time.sleep(pause)

    config = tiny_config("killed")
    killed = train(config, callbacks=[slow, _StopAfter(9)], verbose=False)
    assert killed.interrupted and killed.wall_s >= 9 * pause
    _, state, _ = find_resumable_checkpoint(killed.run_dir)
    assert 9 * pause <= state["wall_s"] <= killed.wall_s
    started = time.perf_counter()
    resumed = train(config, resume=killed.run_dir, verbose=False)
    segment = time.perf_counter() - started
    assert not resumed.interrupted
    # more than this segment took (only the earlier one can add it), at most both together
    assert segment < resumed.wall_s <= state["wall_s"] + segment


def _checkpoints(directory) -> list[str]:
    return sorted(p.name[: -len(".safetensors")] for p in directory.glob("step-*.safetensors"))


def test_keep_counts_only_the_lineage_a_resumed_run_continues(tmp_path):
    """``keep`` counts the checkpoints at or below the step just written that look whole: a
    higher-numbered one (the killed run's, skipped as unreadable) is never deleted, and a torn one
    is not counted. Both used to count among the newest ``keep``, so after resuming from an older
    checkpoint only one good checkpoint was left."""
    model = torch.nn.Linear(2, 2)

    def save(step: int) -> None:
        save_checkpoint(tmp_path, step=step, model=model, model_metadata={}, state={"step": step}, keep=2)

    for step in (10, 20, 30):
        save(step)
    assert _checkpoints(tmp_path) == ["step-00000020", "step-00000030"]
    for path in tmp_path.glob("step-00000030.*"):
        _damage(path, "truncated")
    torn = {path.name: path.read_bytes() for path in tmp_path.glob("step-00000030.*")}
    paths, _, skipped = find_resumable_checkpoint(tmp_path)
    assert paths.name == "step-00000020" and len(skipped) == 1

    save(25)  # the resumed run checkpoints at another step (an interrupt, a new checkpoint_every)
    assert _checkpoints(tmp_path) == ["step-00000020", "step-00000025", "step-00000030"]
    assert find_resumable_checkpoint(tmp_path)[0].name == "step-00000025"
    save(30)  # the torn files move aside to .old, kept
    assert _checkpoints(tmp_path) == ["step-00000025", "step-00000030"]
    assert {name: (tmp_path / f"{name}.old").read_bytes() for name in torn} == torn
    save(40)
    assert _checkpoints(tmp_path) == ["step-00000030", "step-00000040"]
    assert {name: (tmp_path / f"{name}.old").read_bytes() for name in torn} == torn
    for name in _checkpoints(tmp_path):
        assert find_resumable_checkpoint(tmp_path / f"{name}.safetensors")[1]["step"] == int(name[5:])
    save(50)  # step 30 goes, with the copies moved aside at its step (they stayed for good)
    assert _checkpoints(tmp_path) == ["step-00000040", "step-00000050"]
    assert sorted(path.name for path in tmp_path.iterdir() if ".old" in path.name) == []


@pytest.mark.parametrize(
    ("broken", "how"),
    # state.pt garbage: its zip directory reads, its first record's header does not (mutation review)
    [("safetensors", "garbage"), ("state.pt", "truncated"), ("state.pt", "garbage")],
)
def test_a_resumed_run_keeps_two_good_checkpoints_past_a_torn_one(stopped_run, broken, how):
    """The killed run's interrupt checkpoint (step 9) is torn: the resumed run passes it, and its
    ``keep_checkpoints=2`` still leaves two checkpoints to resume from (step 8 was deleted)."""
    bad = stopped_run / "checkpoints" / f"step-00000009.{broken}"
    _damage(bad, how)
    bad_bytes = bad.read_bytes()
    resumed = train(load_run_config(stopped_run), resume=stopped_run, verbose=False)
    assert resumed.step == 12
    assert _checkpoints(stopped_run / "checkpoints") == ["step-00000008", "step-00000009", "step-00000012"]
    assert bad.read_bytes() == bad_bytes
    (stopped_run / "checkpoints" / "step-00000012.state.pt").unlink()  # the newest breaks too
    assert find_resumable_checkpoint(stopped_run)[0].name == "step-00000008"


def test_with_nothing_to_resume_the_error_says_how_to_start_over(stopped_run, tmp_path):
    """The error named what it looked for and stopped there: a run killed before its first
    checkpoint, or with every checkpoint damaged, had no way on but deleting files by hand."""
    for name in ("step-00000009.safetensors", "step-00000008.state.pt"):
        _damage(stopped_run / "checkpoints" / name, "garbage")
    with pytest.raises(CheckpointError) as error:
        find_resumable_checkpoint(stopped_run)
    message = str(error.value)
    assert "weights_only" not in message  # torch's advice to run a damaged file's code
    start = f"torchvote train {stopped_run / 'config.yaml'} run_dir={stopped_run}"
    assert f"move its checkpoints aside and start it again: mv {stopped_run / 'checkpoints'} " in message
    assert message.endswith(start)
    # the two commands work: moved out of the folder, the run starts over there
    aside = message.split(": mv ", 1)[1].split("; ", 1)[0].split(" ")[1]
    shutil.move(stopped_run / "checkpoints", aside)
    from torchvote.training.config import load_config

    config = load_config(str(stopped_run / "config.yaml"), [f"run_dir={stopped_run}"])
    restarted = train(config, verbose=False)
    assert not restarted.interrupted and (stopped_run / "checkpoints" / "latest").is_file()
    early = tmp_path / "early"
    early.mkdir()
    shutil.copy(stopped_run / "config.yaml", early / "config.yaml")
    with pytest.raises(CheckpointError, match="stopped before its first checkpoint: start it again with: "):
        find_resumable_checkpoint(early)


def test_a_failed_checkpoint_write_leaves_nothing_of_itself(tiny_config, monkeypatch):
    """A full disk: the weights were written, the state was not, and each retry of the same step
    renamed the orphaned weights aside (``.old``, ``.old-2`` ...), filling the disk further."""
    import torchvote.training.checkpoint as checkpoint_module

    run = train(tiny_config("run", "epochs=1", "keep_checkpoints=5"), verbose=False)
    directory = run.run_dir / "checkpoints"
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    written = checkpoint_module.atomic_write_bytes

    def disk_full(path, data):
        if str(path).endswith(".state.pt"):
            raise OSError(28, "No space left on device")
        written(path, data)

    monkeypatch.setattr(checkpoint_module, "atomic_write_bytes", disk_full)
    for step in (run.step, run.step + 1):  # over the existing checkpoint, and a new one
        with pytest.raises(OSError, match="No space left"):
            checkpoint_module.save_checkpoint(
                directory, step=step, model=run.model, model_metadata={"step": str(step)}, state={}, keep=5
            )
        assert {p.name: p.read_bytes() for p in directory.iterdir()} == before  # as it was, nothing aside


def test_a_second_process_cannot_write_a_run_folder_in_use(tiny_config, tmp_path):
    """Two processes in one run folder (one command started twice) interleaved the metrics and
    renamed each other's checkpoints aside. The lock is the operating system's: a process that
    holds it, here this test through another open file, keeps a run out."""
    from torchvote.files import FolderInUseError, FolderLock

    config = tiny_config("busy", "epochs=1")
    in_use = re.escape(f"run folder {tmp_path / 'busy'} is in use by another process (pid {os.getpid()})")
    with FolderLock(tmp_path / "busy"), pytest.raises(FolderInUseError, match=in_use):
        train(config, verbose=False)
    assert not (tmp_path / "busy" / "metrics.jsonl").exists()
    run = train(config, verbose=False)  # free again: the lock went with its holder
    FolderLock(run.run_dir).acquire().release()  # and the run let its own go


def test_the_metrics_reach_the_disk_before_each_checkpoint(tiny_config, monkeypatch, tmp_path):
    """Checkpoints are fsynced, metrics.jsonl was only flushed: after a power loss a checkpoint
    could outlive the records of its own steps, a gap a resume never fills."""
    import torchvote.training.loop as loop_module
    import torchvote.training.metrics as metrics_module

    events: list[str] = []
    real_fsync, real_save = metrics_module.os.fsync, loop_module.save_checkpoint

    metrics = tmp_path / "run" / "metrics.jsonl"

    def fsync(descriptor):  # os.fsync everywhere (the checkpoints' too): the metrics file's only
        if metrics.exists() and os.path.samestat(os.fstat(descriptor), os.stat(metrics)):
            events.append("metrics fsync")
        real_fsync(descriptor)

    def save(*args, **kwargs):
        events.append("checkpoint")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(metrics_module.os, "fsync", fsync)
    monkeypatch.setattr(loop_module, "save_checkpoint", save)
    train(tiny_config("run", "epochs=2", "checkpoint_every=4"), verbose=False)
    checkpoints = [i for i, event in enumerate(events) if event == "checkpoint"]
    assert len(checkpoints) >= 3 and all(events[i - 1] == "metrics fsync" for i in checkpoints)


def test_the_lock_is_taken_before_the_folder_is_read(stopped_run, monkeypatch):
    """The lock came after the checkpoint to resume from was chosen and the data loaded: a
    process still writing the folder then ended, and the resume went on from what it had read
    (a checkpoint since replaced), dropping the other's records and renaming its checkpoints."""
    import torchvote.training.loop as loop_module
    from torchvote.files import FolderInUseError, FolderLock

    read: list[object] = []
    monkeypatch.setattr(loop_module, "find_resumable_checkpoint", lambda *a: read.append(a))
    config = load_run_config(stopped_run)
    with FolderLock(stopped_run), pytest.raises(FolderInUseError):
        train(config, resume=stopped_run, verbose=False)
    assert read == []


def test_a_file_system_that_cannot_lock_runs_unlocked_with_a_warning(tiny_config, monkeypatch):
    """flock's "not supported" (some network and FUSE mounts) failed every run, and left the lock
    file open: a retry in the same process was refused as "in use" by its own pid."""
    import errno
    import fcntl

    def unsupported(descriptor, operation):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", unsupported)
    config = tiny_config("nolock", "epochs=1")
    with pytest.warns(UserWarning, match="this file system cannot lock"):
        run = train(config, verbose=False)
    assert not run.interrupted
    with pytest.warns(UserWarning, match="cannot lock"):
        train(load_run_config(run.run_dir, ["epochs=2"]), resume=run.run_dir, verbose=False)


def test_discarding_the_lock_leaves_a_lock_file_it_did_not_make(tmp_path):
    """release(discard=True) is for a folder that was not this process's to write: a lock file
    that was there before acquire (another process's, an earlier run's) stays (mutation review)."""
    from torchvote.files import LOCK_NAME, FolderLock

    there = tmp_path / "there"
    there.mkdir()
    (there / LOCK_NAME).write_text("12345\n")
    FolderLock(there).acquire().release(discard=True)
    assert (there / LOCK_NAME).is_file()
    made = FolderLock(tmp_path / "made").acquire()
    assert (tmp_path / "made" / LOCK_NAME).is_file()
    made.release(discard=True)  # the one it made goes
    assert list((tmp_path / "made").iterdir()) == []


def test_a_flock_error_other_than_unsupported_is_raised(tmp_path, monkeypatch):
    """Only "this file system cannot lock" (ENOSYS and kin) runs unlocked: an I/O error is not
    swallowed into an unlocked run (mutation review)."""
    import errno
    import fcntl
    import warnings

    from torchvote.files import FolderLock

    def failing(descriptor, operation):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(fcntl, "flock", failing)
    lock = FolderLock(tmp_path / "run")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "cannot lock" warning either
        with pytest.raises(OSError, match="Input/output error") as raised:
            lock.acquire()
    assert raised.value.errno == errno.EIO and lock._descriptor is None


def test_a_read_only_run_folder_is_named_and_said_readable(stopped_run, monkeypatch):
    """Resuming a run on a read-only mount said "[Errno 30] Read-only file system: '<run>/.lock'"."""
    import errno

    import torchvote.files as files_module

    real_open = files_module.os.open

    def read_only(path, *args, **kwargs):
        if str(path).endswith(".lock"):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(files_module.os, "open", read_only)
    written = re.escape(f"run folder {stopped_run} cannot be written (Read-only file system): this command")
    with pytest.raises(PermissionError, match=written + ".*reading it .*torchvote evaluate.* needs no write"):
        train(load_run_config(stopped_run), resume=stopped_run, verbose=False)


def test_a_full_disk_when_a_resume_opens_its_folder_says_the_checkpoint_is_intact(stopped_run, monkeypatch,
                                                                                   capsys):
    """A resume on a full disk ended in a bare "[Errno 28] No space left on device"; in a step the
    same error named the intact checkpoint and the command that goes on."""
    import errno

    import torchvote.training.loop as loop_module

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(loop_module, "atomic_write_bytes", full)
    with pytest.raises(OSError, match="No space left"):
        train(load_run_config(stopped_run), resume=stopped_run, verbose=False)
    said = capsys.readouterr().err
    assert f"OSError opening the run folder {stopped_run}: the last checkpoint is " in said
    assert ", intact; " in said and "--resume" in said


def test_a_resume_says_when_the_metrics_file_is_gone(stopped_run, capsys):
    """A deleted metrics.jsonl was started anew at the resumed step without a word; the plots then
    began there."""
    (stopped_run / "metrics.jsonl").unlink()
    train(load_run_config(stopped_run), resume=stopped_run, verbose=False)
    said = capsys.readouterr().err  # resumed from step 9, the newest checkpoint
    assert f"metrics.jsonl: not in {stopped_run}; the records of steps 1 to 9 are gone, a new file starts " \
           "at step 10" in said


def test_a_whole_checkpoint_past_the_pointer_is_said_and_its_copies_go_with_keep(stopped_run, capsys):
    """A kill between a checkpoint's files and its ``latest`` pointer leaves a whole checkpoint
    newer than the pointer: the resume passed it over without a word, and writing its step again
    moved its files to ``.old`` copies that stayed for good."""
    folder = stopped_run / "checkpoints"
    (folder / "latest").write_text("step-00000008\n")  # as if killed before the pointer moved to 9
    (folder / "step-00000009.safetensors.older").write_text("mine")  # a user's file: never a copy
    capsys.readouterr()
    resumed = train(load_run_config(stopped_run, ["keep_checkpoints=1"]), resume=stopped_run, verbose=False)
    said = [line for line in capsys.readouterr().err.splitlines() if "look whole" in line]
    assert len(said) == 1 and f"resuming from step-00000008, as {folder / 'latest'} says" in said[0]
    assert "step-00000009 look whole but are not resumed from" in said[0]
    assert f"write step-00000009 into {folder / 'latest'}" in said[0]
    assert "renamed to .old, and deleted with that step's checkpoint by keep_checkpoints" in said[0]
    assert resumed.step > 9  # the pointer decided: step 9 was written again, its old files aside, then pruned
    assert sorted(p.name for p in folder.iterdir() if ".old" in p.name) == ["step-00000009.safetensors.older"]
    assert _checkpoints(folder) == [f"step-{resumed.step:08d}"]
