"""Checkpoints: atomic writes, strict loads whose errors name the tensor, weights_only state."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from torchvote.models import create_model
from torchvote.training import checkpoint as checkpoint_module
from torchvote.training.checkpoint import (
    CheckpointError,
    atomic_write_bytes,
    capture_rng_state,
    find_checkpoint,
    load_model_weights,
    load_training_state,
    read_model_metadata,
    restore_rng_state,
    save_checkpoint,
)


def _save(directory, step, model, **kw):
    state = {"step": step, "tensor": torch.arange(3), "nested": {"a": [1, 2.5, None]}}
    return save_checkpoint(
        directory, step=step, model=model, model_metadata={"model": "cnn-baseline"}, state=state, **kw
    )


def _tiny_model(seed=0, **overrides):
    torch.manual_seed(seed)
    return create_model("cnn-baseline", "tiny", **overrides)


def _weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_round_trip_of_weights_state_and_metadata(tmp_path):
    model = _tiny_model(0)
    paths = _save(tmp_path, 7, model)
    assert paths.name == "step-00000007"
    assert (tmp_path / "latest").read_text().strip() == paths.name
    assert read_model_metadata(paths.weights)["model"] == "cnn-baseline"
    state = load_training_state(paths.state)
    assert state["step"] == 7 and torch.equal(state["tensor"], torch.arange(3))
    assert state["nested"] == {"a": [1, 2.5, None]}
    other = _tiny_model(1)
    load_model_weights(other, paths.weights)
    for name, tensor in model.state_dict().items():
        assert torch.equal(other.state_dict()[name], tensor)


def test_find_checkpoint_accepts_every_way_of_naming_one(tmp_path):
    run = tmp_path / "run"
    _save(run / "checkpoints", 1, _tiny_model())
    latest = _save(run / "checkpoints", 2, _tiny_model())
    for location in (
        run,
        run / "checkpoints",
        latest.weights,
        latest.state,
        str(latest.weights)[: -len(".safetensors")],
    ):
        assert find_checkpoint(location) == latest
    first = find_checkpoint(run / "checkpoints" / "step-00000001.safetensors")
    assert first.name == "step-00000001"
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        find_checkpoint(tmp_path)
    (run / "checkpoints" / "latest").write_text("step-00000099\n")
    with pytest.raises(CheckpointError, match="points at step-00000099"):
        find_checkpoint(run)
    # the pointer names a checkpoint, never a path: one reading "../../elsewhere/model" opened a
    # file outside the run folder (a shared run folder crafted so)
    outside = _save(tmp_path / "elsewhere", 5, _tiny_model())
    (run / "checkpoints" / "latest").write_text(f"../../elsewhere/{outside.name}\n")
    with pytest.raises(CheckpointError, match=r"which is no checkpoint name \(step-<digits>\)"):
        find_checkpoint(run)
    # a file of another kind named as a checkpoint was read as a stem: "op.py.safetensors does
    # not exist", which sent the user looking for a file they never had
    script = tmp_path / "op.py"
    script.write_text("x = 1\n")
    with pytest.raises(CheckpointError) as error:
        find_checkpoint(script)
    assert str(error.value) == (
        f"{script} is not a checkpoint: expected a run folder, its checkpoints folder, or a "
        ".safetensors or .state.pt file of one"
    )


def test_a_folder_without_its_latest_pointer_gives_its_newest_whole_checkpoint(tmp_path):
    """A run killed between a checkpoint's files and its pointer: evaluate and explain said "no
    checkpoint" where a resume found one."""
    run = tmp_path / "run"
    for step in (2, 10, 9):
        _save(run / "checkpoints", step, _tiny_model(0))
    (run / "checkpoints" / "latest").unlink()
    assert find_checkpoint(run).name == "step-00000010"  # by step, not by the order written
    assert find_checkpoint(run / "checkpoints").name == "step-00000010"
    torn = run / "checkpoints" / "step-00000010.safetensors"
    torn.write_bytes(torn.read_bytes()[:100])
    assert find_checkpoint(run).name == "step-00000009"
    for step in (2, 9):
        (run / "checkpoints" / f"step-{step:08d}.state.pt").unlink()
    # a whole checkpoint beside the checkpoints folder is not the run's (a resume does not read it)
    _save(run, 5, _tiny_model(0))
    (run / "latest").unlink()
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        find_checkpoint(run)


def test_a_failure_mid_write_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    first_model = _tiny_model(0)
    first = _save(tmp_path, 1, first_model)
    before = {p: p.read_bytes() for p in (first.weights, first.state, tmp_path / "latest")}

    calls = {"n": 0}
    real_fsync = os.fsync

    def failing_fsync(fd):
        calls["n"] += 1
        if calls["n"] == 3:  # weights file, its directory, then the state file: the disk fills up
            raise OSError(28, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(checkpoint_module.os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="No space left"):
        _save(tmp_path, 2, _tiny_model(1))
    monkeypatch.undo()

    # The pointer and the first checkpoint are untouched; no temporary file is left behind.
    assert {p: p.read_bytes() for p in before} == before
    assert find_checkpoint(tmp_path) == first
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))
    assert not (tmp_path / "step-00000002.state.pt").exists()
    restored = _tiny_model(5)
    load_model_weights(restored, find_checkpoint(tmp_path).weights)
    assert all(torch.equal(restored.state_dict()[k], v) for k, v in first_model.state_dict().items())


def test_atomic_write_replaces_whole_files_only(tmp_path, monkeypatch):
    target = tmp_path / "file.bin"
    atomic_write_bytes(target, b"old contents")

    def failing_replace(src, dst):
        raise OSError("power cut before the rename")

    monkeypatch.setattr(checkpoint_module.os, "replace", failing_replace)
    with pytest.raises(OSError, match="power cut"):
        atomic_write_bytes(target, b"new contents that never land")
    monkeypatch.undo()
    assert target.read_bytes() == b"old contents"
    assert [p.name for p in tmp_path.iterdir()] == ["file.bin"]


def test_keep_prunes_old_checkpoints_after_the_pointer_moved(tmp_path):
    model = _tiny_model()
    for step in range(1, 5):
        _save(tmp_path, step, model, keep=2)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == [
        "step-00000003.safetensors",
        "step-00000004.safetensors",
    ]
    assert sorted(p.name for p in tmp_path.glob("*.state.pt")) == [
        "step-00000003.state.pt",
        "step-00000004.state.pt",
    ]


def test_a_write_killed_midway_leaves_a_temporary_file_the_next_save_removes(tmp_path):
    """A SIGKILL inside atomic_write skips its clean-up: a hidden .tmp the size of a checkpoint
    stayed in checkpoints/ for good. Writes of running processes (this one's, another's) stay."""
    killed = (
        "import os, signal\n"
        "from torchvote.files import atomic_write\n"
        "def write(handle):\n"
        "    handle.write(b'x' * 4096); handle.flush(); os.kill(os.getpid(), signal.SIGKILL)\n"
        f"atomic_write({str(tmp_path / 'step-00000003.state.pt')!r}, write)\n"
    )
    process = subprocess.run([sys.executable, "-c", killed], check=False)
    assert process.returncode == -signal.SIGKILL
    (abandoned,) = tmp_path.glob(".step-00000003.state.pt.*.tmp")
    assert abandoned.stat().st_size == 4096
    pids = (os.getpid(), os.getppid())  # this process, and its parent (alive while it runs)
    running = [tmp_path / f".step-00000004.safetensors.{pid}.0123abcd.tmp" for pid in pids]
    for path in running:
        path.write_bytes(b"in progress")
    _save(tmp_path, 4, _tiny_model())
    assert not abandoned.exists()
    assert all(path.exists() for path in running)


def test_shape_mismatch_names_the_tensor_and_loads_nothing(tmp_path):
    paths = _save(tmp_path, 1, _tiny_model(0))
    wider = _tiny_model(1, num_classes=7)
    before = _weights(wider)
    with pytest.raises(CheckpointError) as error:
        load_model_weights(wider, paths.weights)
    message = str(error.value)
    assert (
        "tensor 'classifier.weight' has shape (10, 32) in the checkpoint, the model expects (7, 32)"
        in message
    )
    assert "'classifier.bias' has shape (10,)" in message
    assert all(torch.equal(wider.state_dict()[k], v) for k, v in before.items()), "a partial load happened"


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    paths = _save(tmp_path, 1, _tiny_model(0))
    deeper = _tiny_model(0, channels=(8, 16, 16), pool_after=(0, 1))
    with pytest.raises(CheckpointError, match=r"missing tensors: features\.6\.weight, features\.6\.bias"):
        load_model_weights(deeper, paths.weights)
    shallower = _tiny_model(0, channels=(8,), pool_after=(0,))
    with pytest.raises(CheckpointError, match=r"unexpected tensors: features\.3\.bias, features\.3\.weight"):
        load_model_weights(shallower, paths.weights)


def test_dtype_mismatch_is_named(tmp_path):
    """One tensor of another dtype is named; a whole model in another dtype is one line that says
    how to load it (it was one line per tensor, over 1,000 characters for capsnet tiny)."""
    model = _tiny_model(0)
    name = next(iter(model.state_dict()))
    with torch.no_grad():
        model.get_parameter(name).data = model.get_parameter(name).data.double()
    paths = _save(tmp_path / "one", 1, model)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' has dtype torch.float64 in the checkpoint, "
                       "the model expects torch.float32$"):
        load_model_weights(_tiny_model(0), paths.weights)
    paths = _save(tmp_path / "all", 1, _tiny_model(0).double())
    count = len(_tiny_model(0).state_dict())
    with pytest.raises(CheckpointError, match=rf": {count} tensors \('.*', '.*', \.\.\.\) have dtype "
                       r"torch.float64 in the checkpoint, the model expects torch.float32: load into a model "
                       r"in torch.float64, then convert it \(model.to\(torch.float32\)\)$"):
        load_model_weights(_tiny_model(0), paths.weights)


@pytest.mark.parametrize("cut", [0.5, 0.99])
def test_a_truncated_weights_file_is_reported_as_corrupt(tmp_path, cut):
    paths = _save(tmp_path, 1, _tiny_model(0))
    data = paths.weights.read_bytes()
    paths.weights.write_bytes(data[: int(len(data) * cut)])
    with pytest.raises(CheckpointError, match="corrupt or not a safetensors file"):
        load_model_weights(_tiny_model(0), paths.weights)


def _flip_inside_a_tensor(path):
    """Overwrite 8 bytes in the middle of a weights file's tensor data, its header untouched."""
    import json

    data = bytearray(path.read_bytes())
    header = int.from_bytes(data[:8], "little")
    offsets = json.loads(data[8 : 8 + header])
    begin, end = max((v["data_offsets"] for k, v in offsets.items() if k != "__metadata__"),
                     key=lambda o: o[1] - o[0])  # the largest tensor
    middle = 8 + header + (begin + end) // 2
    data[middle : middle + 8] = b"\x7f" * 8
    path.write_bytes(bytes(data))


def test_tensor_bytes_changed_on_disk_are_found(tmp_path):
    """A checkpoint damaged inside its tensor data, header intact, loaded a NaN weight in silence
    (evaluate printed 10% and a NaN loss; a resume blamed the learning rate)."""
    import hashlib

    from torchvote.training.results import find_resumable_checkpoint

    older = _save(tmp_path, 0, _tiny_model(0))
    paths = _save(tmp_path, 1, _tiny_model(0))
    blob = paths.weights.read_bytes()
    data_section = blob[8 + int.from_bytes(blob[:8], "little") :]
    assert read_model_metadata(paths.weights)["tensors_sha256"] == hashlib.sha256(data_section).hexdigest()
    _flip_inside_a_tensor(paths.weights)
    read_model_metadata(paths.weights)  # the header still reads
    with pytest.raises(CheckpointError, match="is corrupt: its tensor bytes changed since it was written"):
        load_model_weights(_tiny_model(0), paths.weights)
    # a resume skips it for the older one, saying why
    found, _, skipped = find_resumable_checkpoint(tmp_path)
    assert found == older and "tensor bytes changed" in skipped[0]


def test_a_weights_file_without_a_digest_still_loads(tmp_path):
    """Checkpoints written before the digest are read as they were, unchecked."""
    from safetensors.torch import save_file

    model = _tiny_model(0)
    path = tmp_path / "old.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path), metadata={"format": "x"})
    other = _tiny_model(1)
    load_model_weights(other, path)
    assert all(torch.equal(other.state_dict()[k], v) for k, v in model.state_dict().items())


def test_state_bytes_changed_on_disk_are_found(tmp_path):
    """torch.load does not check its records' CRC-32: a changed byte in the optimiser state was a
    wrong number (3.4e38 where a 0.5 was)."""
    import zipfile

    model = _tiny_model(0)
    state = {"step": 1, "moments": torch.randn(4096)}
    paths = save_checkpoint(tmp_path, step=1, model=model, model_metadata={}, state=state)
    with zipfile.ZipFile(paths.state) as archive:
        record = max(archive.infolist(), key=lambda info: info.file_size)
    data = bytearray(paths.state.read_bytes())
    local = record.header_offset  # the local header: 30 bytes, the name, its own extra field
    start = local + 30 + int.from_bytes(data[local + 26 : local + 28], "little") + int.from_bytes(
        data[local + 28 : local + 30], "little"
    )
    data[start + 1000 : start + 1008] = b"\x7f" * 8
    paths.state.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"is corrupt: its record {record.filename} fails its CRC-32"):
        load_training_state(paths.state)


def test_a_state_file_that_cannot_be_read_for_its_check_says_so(tmp_path, monkeypatch):
    """An error reading the file for the CRC pass read "its record unreadable (...) fails its CRC-32"."""
    import zipfile

    paths = _save(tmp_path, 1, _tiny_model(0))

    def unreadable(self):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(zipfile.ZipFile, "testzip", unreadable)
    said = r"could not be read to check it \(\[Errno 5\] Input/output error\)"
    with pytest.raises(CheckpointError, match=said):
        load_training_state(paths.state)


def test_garbage_state_file_is_an_error_not_code(tmp_path):
    paths = _save(tmp_path, 1, _tiny_model(0))
    paths.state.write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match="corrupt or not a training state"):
        load_training_state(paths.state)


def test_a_torch_file_without_the_format_marker_is_not_a_training_state(tmp_path):
    """A dict torch.save'd by something else (no "format" key) was read as a training state
    (mutation review)."""
    path = tmp_path / "other.state.pt"
    torch.save({"step": 1, "model": {"weight": torch.zeros(2)}}, path)
    with pytest.raises(CheckpointError, match="is not a .* training state"):
        load_training_state(path)


class _Payload:
    """An object torch.save pickles by class: weights_only loading must refuse it."""

    def __reduce__(self):
        return (print, ("this code must never run",))


def test_state_files_are_loaded_with_weights_only(tmp_path, capsys):
    path = tmp_path / "evil.state.pt"
    torch.save({"format": checkpoint_module.CHECKPOINT_FORMAT, "payload": _Payload()}, path)
    with pytest.raises(CheckpointError, match="corrupt or not a training state"):
        load_training_state(path)
    assert "this code must never run" not in capsys.readouterr().out


def test_tied_weights_are_stored_once_and_restored(tmp_path):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(5, 3)
            self.out = nn.Linear(3, 5, bias=False)
            self.out.weight = self.embed.weight

    model = Tied()
    paths = save_checkpoint(tmp_path, step=1, model=model, model_metadata={}, state={})
    from safetensors import safe_open

    with safe_open(str(paths.weights), framework="pt") as handle:
        assert sorted(handle.keys()) == ["embed.weight"]
    other = Tied()
    load_model_weights(other, paths.weights)
    assert torch.equal(other.out.weight, model.embed.weight)
    assert other.out.weight.data_ptr() == other.embed.weight.data_ptr()


def test_rng_states_round_trip():
    torch.manual_seed(1)
    np.random.seed(1)  # noqa: NPY002 (the global state is what is saved)
    random.seed(1)
    state = capture_rng_state()
    first = (torch.rand(3), np.random.rand(3), random.random())  # noqa: NPY002
    torch.manual_seed(99)
    np.random.seed(99)  # noqa: NPY002
    random.seed(99)
    restore_rng_state(state)
    second = (torch.rand(3), np.random.rand(3), random.random())  # noqa: NPY002
    assert torch.equal(first[0], second[0])
    assert np.array_equal(first[1], second[1])
    assert first[2] == second[2]


def test_the_python_rng_restores_its_pending_gaussian():
    """random.gauss makes two values at a time and keeps the second (gauss_next): a restored state
    that dropped it drew another value than the run it resumes (mutation review)."""
    random.seed(5)
    random.gauss(0.0, 1.0)  # leaves its spare value pending
    assert random.getstate()[2] is not None
    state = capture_rng_state()
    expected = random.gauss(0.0, 1.0)
    random.seed(99)
    restore_rng_state(state)
    assert random.gauss(0.0, 1.0) == expected


@pytest.mark.parametrize("keep", [0, -1, 2.5, "2", True])
def test_a_keep_below_one_or_not_an_integer_is_refused_before_anything_is_written(tmp_path, keep):
    model = nn.Linear(2, 2)
    for step in (1, 2, 3):
        _save(tmp_path, step, model)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ValueError, match=f"keep must be a positive integer, got {keep!r}"):
        _save(tmp_path, 4, model, keep=keep)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, nothing deleted
    assert (tmp_path / "latest").read_text().strip() == "step-00000003"


@pytest.mark.parametrize("step", [-1, 2.5, "3", True])
def test_a_negative_or_non_integer_step_is_refused_before_anything_is_written(tmp_path, step):
    """A step of -1 was written as ``step--0000001`` (and ``True`` as ``step-00000001``)."""
    model = nn.Linear(2, 2)
    _save(tmp_path, 3, model)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(ValueError, match=f"step must be an integer >= 0, got {step!r}"):
        save_checkpoint(tmp_path, step=step, model=model, model_metadata={}, state={}, keep=1)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # nothing written or deleted


def test_step_zero_is_a_checkpoint(tmp_path):
    assert _save(tmp_path, 0, nn.Linear(2, 2), keep=1).name == "step-00000000"


def test_keep_orders_checkpoints_by_step_past_the_zero_padding(tmp_path):
    """Past 99,999,999 steps a name has more digits than the padding: ordered as text,
    ``step-100000000`` sorts before ``step-99999999`` and the newest checkpoints were deleted."""
    model = nn.Linear(2, 2)
    for step in (99_999_998, 99_999_999, 100_000_000, 100_000_001):
        _save(tmp_path, step, model, keep=2)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == [
        "step-100000000.safetensors",
        "step-100000001.safetensors",
    ]
    assert sorted(p.name for p in tmp_path.glob("*.state.pt")) == [
        "step-100000000.state.pt",
        "step-100000001.state.pt",
    ]
    assert find_checkpoint(tmp_path).name == "step-100000001"


def test_keep_does_not_count_a_whole_higher_numbered_checkpoint(tmp_path):
    """A run resumed from step 20 past a whole step 30 (an earlier attempt's) and saving step 25
    with keep=1 counted step 30 and deleted the checkpoint it had just written (mutation review)."""
    model = nn.Linear(2, 2)
    for step in (10, 20, 30):
        _save(tmp_path, step, model)
    _save(tmp_path, 25, model, keep=1)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == [
        "step-00000025.safetensors",
        "step-00000030.safetensors",
    ]


@pytest.mark.parametrize("name", ["step-\u0660\u0660\u0661\u0662", "step-\u00b2", "step-1\u00b2"])
def test_a_step_of_digits_other_than_ascii_is_no_checkpoint_step(name):
    """str.isdigit takes Arabic-Indic digits (int() reads them as 12) and '²' (int() refuses it):
    no checkpoint name of this project holds them (mutation review)."""
    assert checkpoint_module.checkpoint_step(name) == -1
    assert checkpoint_module.checkpoint_step("step-00000012") == 12


def test_keep_leaves_files_that_are_not_named_by_a_step_alone(tmp_path):
    """A copy the user made (``step-00000002-best``) is not a checkpoint ``keep`` counts or deletes
    (ordered as text, it sorted among the old checkpoints and was deleted)."""
    model = nn.Linear(2, 2)
    for step in (1, 2):
        _save(tmp_path, step, model, keep=1)
    best = tmp_path / "step-00000002-best.safetensors"
    best.write_bytes((tmp_path / "step-00000002.safetensors").read_bytes())
    _save(tmp_path, 3, model, keep=1)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == [
        "step-00000002-best.safetensors",
        "step-00000003.safetensors",
    ]


def test_a_checkpoint_of_more_gpus_restores_the_rng_of_the_gpus_there_are(monkeypatch):
    """A run checkpointed where rank 0 saw four GPUs resumes where there is one: the state of
    GPU 0 is restored and the others are left out. It set every saved GPU's state, and the
    second one failed (there is no GPU 1: "invalid device ordinal")."""
    restored: list[int] = []

    def set_rng_state(new_state, device=0):
        if device >= 1:
            raise RuntimeError("CUDA error: invalid device ordinal")
        restored.append(device)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)
    monkeypatch.setattr(torch.cuda.random, "set_rng_state", set_rng_state)  # set_rng_state_all's
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [torch.zeros(16, dtype=torch.uint8)] * 4)
    state = capture_rng_state()
    assert len(state["cuda"]) == 4
    restore_rng_state(state)
    assert restored == [0]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        # written, and `latest` moved to it, then refused on resume as "corrupt or not a training state"
        ({"state": {"a": np.zeros(3)}}, ValueError,
         r"state could not be read back from a checkpoint \(.*Unsupported global.*numpy"),
        ({"state": {"f": lambda: 1}}, ValueError, "state could not be read back from a checkpoint"),
        # replaced the format marker: the checkpoint was "not a torchvote-checkpoint-1 training state"
        ({"state": {"format": "x"}}, ValueError, "state must not set 'format'"),
        ({"state": None}, TypeError, "state must be a mapping"),
        # saved 'module.'-prefixed names that do not load into the model
        ({"model": nn.DataParallel(nn.Linear(2, 2))}, ValueError, "not its DataParallel wrapper"),
        ({"model": None}, TypeError, "model must be an nn.Module"),
        # safetensors' "argument 'metadata': 'int' object is not an instance of 'str'"
        ({"model_metadata": {"model": 1}}, TypeError, "must map strings to strings, got .model.: 1"),
        ({"model_metadata": {"format": "mine"}}, ValueError, r"model_metadata must not set \['format'\]"),
    ],
)
def test_what_could_not_be_read_back_is_refused_before_anything_is_written(tmp_path, kwargs, error, match):
    model = nn.Linear(2, 2)
    _save(tmp_path, 3, model)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    arguments = {"step": 4, "model": model, "model_metadata": {"model": "x"}, "state": {"step": 4}} | kwargs
    with pytest.raises(error, match=match):
        save_checkpoint(tmp_path, **arguments)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # nothing written or deleted


def _run_config(folder):
    """A run's config.yaml, as a run writes it first (every key of the training config)."""
    import dataclasses

    import yaml

    from torchvote.training.schema import TrainConfig

    folder.mkdir(parents=True, exist_ok=True)
    keys = sorted(field.name for field in dataclasses.fields(TrainConfig))
    (folder / "config.yaml").write_text(yaml.safe_dump(dict.fromkeys(keys, 1)))


def test_an_empty_checkpoints_folder_makes_no_run(tmp_path):
    """A user's project folder with an empty (or unrelated) ``checkpoints/`` was a run folder: the
    command line then said "no checkpoint" (a failure, 1) instead of "not a run folder" (2).
    ``checkpoints/`` counts where it holds the ``latest`` pointer or a step's checkpoint; a run
    stopped before its first checkpoint still counts by its config.yaml."""
    from torchvote.training.checkpoint import is_run_folder

    empty = tmp_path / "project"
    (empty / "checkpoints").mkdir(parents=True)
    mine = tmp_path / "mine"
    (mine / "checkpoints").mkdir(parents=True)
    (mine / "checkpoints" / "model.pt").write_bytes(b"mine")  # no step's name, no pointer
    (mine / "checkpoints" / "step-final.safetensors").write_bytes(b"mine")  # no step number
    pointer = tmp_path / "pointer-only"
    (pointer / "checkpoints").mkdir(parents=True)
    (pointer / "checkpoints" / "latest").write_text("step-00000001\n")  # broken, still a run's
    unpointed = tmp_path / "unpointed"
    (unpointed / "checkpoints").mkdir(parents=True)
    (unpointed / "checkpoints" / "step-00000003.safetensors").write_bytes(b"torn")  # still a run's
    saved = tmp_path / "saved"
    _save(saved / "checkpoints", 1, _tiny_model(0))
    stopped = tmp_path / "stopped"  # a run stopped before its first checkpoint, an empty folder beside
    _run_config(stopped)
    (stopped / "checkpoints").mkdir()
    folders = {
        empty: False,
        mine: False,
        mine / "checkpoints": False,
        pointer: True,
        pointer / "checkpoints": True,
        unpointed: True,
        unpointed / "checkpoints": True,
        saved: True,
        saved / "checkpoints": True,
        stopped: True,
    }
    for folder, expected in folders.items():
        assert is_run_folder(folder) is expected, folder
    from torchvote.training.checkpoint import holds_checkpoints  # the rule of checkpoints/ it reads by

    assert not holds_checkpoints(empty / "checkpoints") and not holds_checkpoints(tmp_path / "nowhere")
    assert holds_checkpoints(saved / "checkpoints") and not holds_checkpoints(saved)


def test_a_run_makes_its_checkpoints_folder_at_its_first_save(tmp_path, monkeypatch):
    """What is_run_folder relies on: a run stopped before its first checkpoint has its config.yaml
    and no ``checkpoints/``, and reads as a run by that config.yaml alone."""
    import importlib

    from torchvote.training.checkpoint import is_run_folder
    from torchvote.training.config import load_config

    loop = importlib.import_module("torchvote.training.loop")

    def stops(*args, **kwargs):
        raise RuntimeError("stopped in the first step")  # before any checkpoint

    monkeypatch.setattr(loop._Run, "_train_step", stops)
    run = tmp_path / "run"
    config = load_config("smoke", [f"run_dir={run}", "max_steps=2", "progress=false", "tensorboard=false"])
    with pytest.raises(RuntimeError, match="stopped in the first step"):
        loop.train(config)
    assert (run / "config.yaml").is_file() and not (run / "checkpoints").exists()
    assert is_run_folder(run)


def test_checkpoints_beside_a_stray_empty_checkpoints_folder_are_found(tmp_path):
    """A checkpoints folder given itself, its ``latest`` pointer lost, with an empty
    ``checkpoints/`` beside the step files: is_run_folder counted it (its own checkpoints), but the
    reader looked in the empty subfolder only ("no checkpoint in ...")."""
    from torchvote.training.checkpoint import is_run_folder

    folder = tmp_path / "checkpoints-copy"
    paths = _save(folder, 1, _tiny_model(0))
    (folder / "latest").unlink()
    (folder / "checkpoints").mkdir()
    assert is_run_folder(folder)
    assert find_checkpoint(folder).weights == paths.weights
