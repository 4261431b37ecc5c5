"""Checkpoints: model weights in safetensors, training state in a ``weights_only`` torch file.

A checkpoint named ``step-00001200`` in ``<run>/checkpoints/`` is two files:

* ``step-00001200.safetensors``: the model's tensors, plus metadata naming the registered model
  and its config (JSON), the step, and the run's loss config (JSON) and length, so ``torchvote
  evaluate`` can rebuild the model and the run's objective at that step from this file alone.
  Tensors shared between parameters (tied weights) are stored once, their other names listed in
  the metadata.
* ``step-00001200.state.pt``: optimiser and scheduler state, step, epoch, the data-order state,
  the RNG states of torch, numpy and python, the metric sums of the steps since the last metrics
  record, and the run config, all plain containers and tensors so that
  ``torch.load(..., weights_only=True)`` reads it without running any code.

Both are written atomically (temporary file in the same directory, fsync, ``os.replace``); the
``latest`` pointer file is replaced last, so a crash mid-write leaves the previous checkpoint and
pointer intact. Loading checks every tensor name, shape and dtype first, and raises
:class:`CheckpointError` naming the ones that do not fit: never a silent partial load. Tensor
bytes changed on disk after the write are found too: the weights record the SHA-256 of their
tensor bytes (``tensors_sha256``; not of the metadata header, whose JSON fails to parse when
damaged more often than not; files written before 2026-11-29 have none and are read unchecked),
and the training state's zip records carry the CRC-32 ``torch.save`` writes, both checked on every
read (a flipped byte inside a tensor loaded as a wrong number: NaN losses, or none at all).

Pruning (``keep``) orders checkpoints by their step number, only ever deletes ones at or below
the step just written (a higher-numbered checkpoint is a previous attempt's, which a resumed run
skipped) and counts only checkpoints that look whole (:func:`save_checkpoint` has the rule).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import random
import re
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from torchvote.files import (
    atomic_write,
    atomic_write_bytes,
    load_failure_reason,
    remove_abandoned_temporaries,
)
from torchvote.validation import as_path, check_positive_int

__all__ = [
    "CHECKPOINT_FORMAT",
    "CheckpointError",
    "CheckpointPaths",
    "atomic_write_bytes",
    "capture_rng_state",
    "checkpoint_folder",
    "checkpoint_name",
    "checkpoint_step",
    "find_checkpoint",
    "holds_checkpoints",
    "is_run_folder",
    "read_weights",
    "load_model_weights",
    "load_training_state",
    "read_model_metadata",
    "restore_rng_state",
    "save_checkpoint",
    "step_checkpoints",
    "whole_checkpoints_past_latest",
]

CHECKPOINT_FORMAT = "torchvote-checkpoint-1"
LATEST = "latest"


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt or does not fit the model; the message says which
    file or tensor."""


@dataclass(frozen=True)
class CheckpointPaths:
    """The two files of one checkpoint.

    Attributes:
        weights: the ``<name>.safetensors`` file: the model's tensors and metadata.
        state: the ``<name>.state.pt`` file: the training state (optimiser, RNG, config ...).
    """

    weights: Path
    state: Path

    @property
    def name(self) -> str:
        return self.weights.name[: -len(".safetensors")]

    @classmethod
    def of(cls, directory: Path, name: str) -> CheckpointPaths:
        return cls(directory / f"{name}.safetensors", directory / f"{name}.state.pt")


# --- RNG state ---------------------------------------------------------------------------------


def capture_rng_state() -> dict[str, Any]:
    """The RNG states of torch (CPU and CUDA), numpy and python, as ``weights_only``-safe values."""
    bit_generator, keys, position, has_gauss, cached_gaussian = np.random.get_state()  # noqa: NPY002 (the global state)
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "bit_generator": str(bit_generator),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`. CUDA states are restored for the GPUs this process
    sees (a run saved on eight GPUs resumes on one; without CUDA, none)."""
    torch.set_rng_state(state["torch"])
    numpy_state = state["numpy"]
    np.random.set_state(  # noqa: NPY002 (the global state)
        (
            numpy_state["bit_generator"],
            numpy_state["keys"].numpy().astype(np.uint32),
            numpy_state["position"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    )
    python_state = state["python"]
    random.setstate((python_state["version"], tuple(python_state["internal"]), python_state["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        for index, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, index)


# --- model weights -----------------------------------------------------------------------------


def _storage_key(tensor: Tensor) -> tuple[Any, ...]:
    return (
        tensor.device,
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
    )


def _weights_bytes(model: nn.Module, metadata: Mapping[str, str]) -> tuple[bytes, memoryview]:
    """The weights file, as its header and its tensor bytes (written one after the other: joined,
    they would be copied once more)."""
    from safetensors.torch import save

    tensors: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    model = getattr(model, "_orig_mod", model)  # a torch.compile wrapper: store the eager names
    for name, tensor in model.state_dict().items():
        key = _storage_key(tensor)
        if key in seen:  # tied weights: store once, remember the other name
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = tensor.detach().to("cpu").contiguous()
    meta = {**metadata, "format": CHECKPOINT_FORMAT, "aliases": json.dumps(aliases)}
    blob = save(tensors, metadata=meta)
    return _with_metadata(blob, {DIGEST_KEY: hashlib.sha256(_tensor_bytes(blob)).hexdigest()})


def _with_metadata(blob: bytes, extra: Mapping[str, str]) -> tuple[bytes, memoryview]:
    """A safetensors file with ``extra`` added to its metadata, as ``(header, tensor bytes)``: the
    length and JSON header written again (padded with spaces to a multiple of 8 bytes, as
    safetensors pads it), the tensor bytes as they were (their offsets count from the end of the
    header). Serialising the tensors a second time to add the digest of the first cost as much
    again as the save."""
    size = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + size])
    header["__metadata__"] = {**(header.get("__metadata__") or {}), **extra}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, _tensor_bytes(blob)


#: The weights' metadata entry that holds the SHA-256 (hex) of the file's tensor bytes.
DIGEST_KEY = "tensors_sha256"


def _tensor_bytes(blob: bytes) -> memoryview:
    """The data section of a safetensors file: what follows its 8-byte length and JSON header."""
    return memoryview(blob)[8 + int.from_bytes(blob[:8], "little") :]


def _recorded_digest(blob: bytes) -> str | None:
    """The ``tensors_sha256`` a (parsed, hence well-formed) safetensors file records, if any."""
    header = json.loads(bytes(blob[8 : 8 + int.from_bytes(blob[:8], "little")]))
    return (header.get("__metadata__") or {}).get(DIGEST_KEY)


def read_model_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
    """The metadata of a weights file (``model``, ``model_config`` JSON, ``format``, ...).

    Raises:
        TypeError: ``path`` neither a ``str`` nor an ``os.PathLike`` (``''`` is a ValueError).
        CheckpointError: the file is missing or not a safetensors file.
    """
    from safetensors import safe_open

    path = as_path(path, "path")
    if not path.is_file():
        raise CheckpointError(f"checkpoint weights {path} do not exist")
    try:
        with safe_open(str(path), framework="pt") as handle:
            return dict(handle.metadata() or {})
    except Exception as err:  # safetensors raises its own error types for corrupt headers
        raise CheckpointError(f"{path} is not a readable safetensors file ({err})") from None


def read_weights(path: Path) -> dict[str, Tensor]:
    """Every tensor of a weights file (which reads the whole file), checked against the SHA-256
    its metadata records (where it records one).

    Raises:
        CheckpointError: missing, truncated, not a safetensors file, or tensor bytes that differ
            from the recorded digest.
    """
    from safetensors.torch import load

    try:
        blob = path.read_bytes()
        tensors = load(blob)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint weights {path} do not exist") from None
    except Exception as err:
        raise CheckpointError(f"{path} is corrupt or not a safetensors file ({err})") from None
    recorded = _recorded_digest(blob)
    if recorded is not None and hashlib.sha256(_tensor_bytes(blob)).hexdigest() != recorded:
        raise CheckpointError(
            f"{path} is corrupt: its tensor bytes changed since it was written (their SHA-256 differs "
            "from the one recorded in the file)"
        )
    return tensors


def _eager_name(name: str) -> str:
    """A tensor's name without the ``_orig_mod.`` a ``torch.compile`` wrapper's state_dict adds."""
    return name.replace("_orig_mod.", "")


def load_model_weights(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Load a weights file into ``model``, strictly.

    Args:
        model: the model to fill (a ``torch.compile`` wrapper loads into its module).
        path: a ``.safetensors`` weights file.

    Raises:
        TypeError: ``model`` is no ``nn.Module``, or ``path`` neither a ``str`` nor an
            ``os.PathLike`` (``''`` is a ValueError).
        CheckpointError: the file is corrupt, or a tensor is missing, unexpected, or of another
            shape or dtype; the message names every such tensor and nothing is loaded.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    path = as_path(path, "path")
    model = getattr(model, "_orig_mod", model)  # a torch.compile wrapper: load into its module
    loaded = _with_aliases(
        {_eager_name(name): tensor for name, tensor in read_weights(path).items()}, read_model_metadata(path)
    )
    _refuse_misfits(model, path, {name: (tensor.shape, tensor.dtype) for name, tensor in loaded.items()})
    model.load_state_dict(loaded, strict=True)


def check_weights_fit(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Check that a weights file's tensors have ``model``'s names and shapes, from the file's
    header alone (no tensor is read): run on a model built on the ``meta`` device, it refuses a
    checkpoint whose recorded config asks for a model larger than its weights before that model's
    memory is allocated. Dtypes are left to :func:`load_model_weights`.

    Args:
        model: the model the file should fit (on any device, ``meta`` included).
        path: a ``.safetensors`` weights file.

    Raises:
        CheckpointError: the file is missing or not a safetensors file, or a tensor is missing,
            unexpected or of another shape; the message names every such tensor.
    """
    from safetensors import safe_open

    path = as_path(path, "path")
    metadata = read_model_metadata(path)  # missing or unreadable: its CheckpointError
    with safe_open(str(path), framework="pt") as handle:
        names = handle.keys()  # noqa: SIM118 (a safe_open handle cannot be iterated)
        shapes = {_eager_name(name): torch.Size(handle.get_slice(name).get_shape()) for name in names}
    shapes = _with_aliases(shapes, metadata)
    _refuse_misfits(model, path, {name: (shape, None) for name, shape in shapes.items()})


def _with_aliases(found: dict[str, Any], metadata: dict[str, str]) -> dict[str, Any]:
    """``found`` (a file's entries by name) with the names :func:`save_model_weights` stored once
    for tensors that share memory (its ``aliases`` metadata) filled in."""
    for alias, target in json.loads(metadata.get("aliases", "{}")).items():
        if target in found:
            found[alias] = found[target]
    return found


def _refuse_misfits(
    model: nn.Module, path: Path, found: dict[str, tuple[torch.Size, torch.dtype | None]]
) -> None:
    """Raise a :class:`CheckpointError` naming every tensor of ``found`` (a file's shapes and
    dtypes by name; a dtype of ``None`` is not compared) that ``model``'s state_dict lacks, or
    holds in another shape or dtype, and every tensor of the model the file lacks."""
    expected = model.state_dict()
    problems: list[str] = []
    missing = [name for name in expected if name not in found]
    unexpected = sorted(name for name in found if name not in expected)
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected)}")
    dtypes: dict[tuple[torch.dtype, torch.dtype], list[str]] = {}  # (checkpoint's, model's) -> names
    for name, tensor in expected.items():
        if name not in found:
            continue
        shape, dtype = found[name]
        if shape != tensor.shape:
            problems.append(
                f"tensor {name!r} has shape {tuple(shape)} in the checkpoint, "
                f"the model expects {tuple(tensor.shape)}"
            )
        elif dtype is not None and dtype != tensor.dtype:
            dtypes.setdefault((dtype, tensor.dtype), []).append(name)
    for (saved, wanted), names in dtypes.items():
        if len(names) == 1:
            problems.append(
                f"tensor {names[0]!r} has dtype {saved} in the checkpoint, the model expects {wanted}"
            )
        else:  # one line for a model built in another dtype, not one per tensor
            problems.append(
                f"{len(names)} tensors ({names[0]!r}, {names[1]!r}, ...) have dtype {saved} in the "
                f"checkpoint, the model expects {wanted}: load into a model in {saved}, then convert it "
                f"(model.to({wanted}))"
            )
    if problems:
        raise CheckpointError(f"{path} does not fit {type(model).__name__}: " + "; ".join(problems))


# --- whole checkpoints ---------------------------------------------------------------------------


def checkpoint_name(step: int) -> str:
    """The stem of step ``step``'s checkpoint files, ``step-<step, 8 digits or more>``.

    Args:
        step: the optimiser step, >= 0.

    Returns:
        The name; :func:`checkpoint_step` reads the step back.
    """
    return f"step-{step:08d}"


def checkpoint_step(name: str) -> int:
    """The step of a checkpoint name, the inverse of :func:`checkpoint_name`.

    Args:
        name: a checkpoint's stem, ``step-<digits>`` (any number of digits).

    Returns:
        The step, or -1 for a name of any other form (never a checkpoint's).
    """
    digits = name[len("step-") :]
    return int(digits) if name.startswith("step-") and digits.isascii() and digits.isdigit() else -1


def save_checkpoint(
    directory: str | os.PathLike[str],
    *,
    step: int,
    model: nn.Module,
    model_metadata: Mapping[str, str],
    state: Mapping[str, Any],
    keep: int | None = None,
) -> CheckpointPaths:
    """Write one checkpoint and then point ``latest`` at it.

    Args:
        directory: the run's checkpoint folder.
        step: the optimiser step the checkpoint holds (its name), an integer >= 0.
        model: the model (not a DDP wrapper).
        model_metadata: strings stored with the weights (``model``, ``model_config`` ...).
        state: the training state (``weights_only``-safe containers and tensors).
        keep: after the pointer moved, delete the older checkpoints of this run's lineage,
            keeping the newest ``keep`` whole ones (at least 1; the one just written is one of
            them, and is never deleted); ``None``: keep every checkpoint. The rule is below.

    Pruning looks only at the checkpoints whose step is at most ``step``, ordered by step number.
    One with a higher step is a previous attempt's (left when a run resumed from an older
    checkpoint, because it was unreadable or newer than the one resumed from) and is never
    deleted. Of the rest, newest first, one whose files do not look whole (a truncated file,
    garbage over a header, a missing state file) is kept but not counted, so that ``keep``
    checkpoints remain to resume from; every checkpoint older than the ``keep``-th whole one is
    deleted, with the copies of its files moved aside at its step (``.old``, ``.old-2`` ...,
    below). Other files not named ``step-<digits>`` are never touched.

    A file already at the checkpoint's name (a run resumed from an older checkpoint because this
    one was unreadable) is never overwritten: it is renamed to ``<name>.old`` (``.old-2`` ...)
    first, so nothing a run wrote is ever deleted except by ``keep`` (which deletes those copies
    when it deletes their step's checkpoint). The other deletions: the
    hidden temporary files of a write whose process was killed mid-write (never read, the size of
    a checkpoint; :func:`~torchvote.files.remove_abandoned_temporaries`), and a write that fails
    (a full disk) removes what it wrote of its own checkpoint and puts back what it moved aside.

    Returns:
        the paths written.

    Raises:
        TypeError: ``directory`` neither a ``str`` nor an ``os.PathLike`` (``''`` is a ValueError).
        ValueError: ``step`` is not an integer >= 0, or ``keep`` is neither ``None`` nor a
            positive integer; ``model`` a ``DataParallel`` / DDP wrapper (its names would not
            load into the model); metadata that sets ``format``, ``aliases`` or
            ``tensors_sha256``; a ``state`` that
            sets ``format`` or that
            :func:`load_training_state` could not read back (an object that is no tensor,
            number, string or container of them, such as a NumPy array or a dataclass).
        TypeError: ``model`` no ``nn.Module``; ``model_metadata`` or ``state`` no mapping, or
            metadata that is not strings. All checked before anything is written or deleted.
    """
    check_positive_int(step, "step", minimum=0)  # -1 would be named step--0000001
    if keep is not None:
        check_positive_int(keep, "keep")
    _check_model_and_metadata(model, model_metadata)
    state_bytes = _state_bytes(state)
    directory = as_path(directory, "directory")
    paths = CheckpointPaths.of(directory, checkpoint_name(step))
    present = [path for path in (paths.weights, paths.state) if path.exists()]
    moved = [(path, _move_aside(path)) for path in present]
    try:
        header, tensors = _weights_bytes(model, model_metadata)
        atomic_write(paths.weights, lambda handle: (handle.write(header), handle.write(tensors)))
        atomic_write_bytes(paths.state, state_bytes)
    except BaseException:
        # a full disk, an interrupt: a checkpoint without its state file was left under the final
        # name, renamed aside by the next attempt at this step, and again by each retry (each
        # the weights' size, on a disk that is full); the files moved aside come back
        for path in (paths.weights, paths.state):
            path.unlink(missing_ok=True)
        for original, aside in moved:
            os.replace(aside, original)
        raise
    atomic_write_bytes(directory / LATEST, (paths.name + "\n").encode())
    if keep is not None:
        _prune(directory, keep, current=paths.name)
    remove_abandoned_temporaries(directory)
    return paths


def _check_model_and_metadata(model: Any, model_metadata: Any) -> None:
    """What :func:`save_checkpoint` stores as weights: a plain module and string metadata."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        raise ValueError(
            f"model must be the model itself, not its {type(model).__name__} wrapper (its names "
            "start with 'module.' and would not load into the model): pass model.module"
        )
    if not isinstance(model_metadata, Mapping):
        raise TypeError(f"model_metadata must be a mapping of strings, got {type(model_metadata).__name__}")
    wrong = [
        key for key, value in model_metadata.items() if not (isinstance(key, str) and isinstance(value, str))
    ]
    if wrong:
        raise TypeError(
            f"model_metadata must map strings to strings, got {wrong[0]!r}: "
            f"{model_metadata[wrong[0]]!r} (JSON-encode structured values)"
        )
    reserved = sorted({"format", "aliases", DIGEST_KEY} & set(model_metadata))
    if reserved:  # they were replaced by the file's own without a word
        raise ValueError(f"model_metadata must not set {reserved}: the weights file's own entries go there")


def _state_bytes(state: Any) -> bytes:
    """``state`` with the format marker, serialised, and read back as :func:`load_training_state`
    reads it (``weights_only``), so that no checkpoint is written that cannot be resumed from."""
    import io

    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a mapping, got {type(state).__name__}")
    if "format" in state:
        raise ValueError("state must not set 'format': the checkpoint's format marker goes there")
    buffer = io.BytesIO()
    try:
        torch.save({"format": CHECKPOINT_FORMAT, **state}, buffer)  # a lambda fails here
        torch.load(io.BytesIO(buffer.getvalue()), map_location="cpu", weights_only=True)
    except Exception as error:  # what load_training_state would call a corrupt file, later
        raise ValueError(
            f"state could not be read back from a checkpoint ({load_failure_reason(error)}); keep "
            "it to tensors, numbers, strings and lists, tuples or dicts of them"
        ) from None
    return buffer.getvalue()


def _move_aside(path: Path) -> Path:
    """Rename ``path`` to the first free ``<path>.old``, ``<path>.old-2`` ...; return the new path."""
    target, number = path.with_name(path.name + ".old"), 1
    while target.exists():
        number += 1
        target = path.with_name(f"{path.name}.old-{number}")
    os.replace(path, target)
    return target


def _prune(directory: Path, keep: int, current: str) -> None:
    """Delete the checkpoints of ``current``'s lineage beyond the newest ``keep`` whole ones; the
    rule is in :func:`save_checkpoint`.

    Ordered by the step number, not the name: past ``step-99999999`` a name has more digits than
    the zero padding, and ordered as text the newest checkpoints would sort first and be deleted.
    """
    newest = checkpoint_step(current)
    lineage = [n for n in step_checkpoints(directory) if checkpoint_step(n) <= newest]
    lineage.sort(key=lambda n: (checkpoint_step(n), n == current), reverse=True)  # newest, current, first
    whole = 0
    for name in lineage:
        paths = CheckpointPaths.of(directory, name)
        if whole < keep:
            if name == current or _looks_whole(paths):  # a torn one is kept, but not counted
                whole += 1
            continue
        for path in (paths.weights, paths.state):  # with the copies moved aside at its step
            for copy in _moved_aside_copies(path):
                copy.unlink(missing_ok=True)
            path.unlink(missing_ok=True)


def _moved_aside_copies(path: Path) -> list[Path]:
    """The copies :func:`_move_aside` made of ``path``: ``<name>.old``, ``<name>.old-2`` ... (a
    user's ``<name>.older`` or ``<name>.old-copy`` is none of them)."""
    pattern = re.compile(re.escape(path.name) + r"\.old(-[0-9]+)?")
    candidates = path.parent.glob(f"{glob.escape(path.name)}.old*")
    return [copy for copy in candidates if pattern.fullmatch(copy.name)]


def _looks_whole(paths: CheckpointPaths) -> bool:
    """Whether both files of a checkpoint look whole, judged from their headers alone (cheap: no
    tensor is read): the safetensors header parses and fits the file's length, the state file's
    zip directory and the header of each of its records read. A truncated file, garbage over a
    header or a missing file fails it."""
    import zipfile

    try:
        read_model_metadata(paths.weights)
        with zipfile.ZipFile(paths.state) as archive:
            for record in archive.infolist():
                archive.open(record).close()  # checks the record's local header, reads no data
    except Exception:  # CheckpointError, OSError, zipfile.BadZipFile ...: not whole
        return False
    return True


def checkpoint_folder(location: Path) -> Path:
    """The folder of a run's checkpoints: ``<location>/checkpoints`` where it exists (a run
    folder), else ``location`` (a checkpoints folder given itself); ``location`` too where only it
    holds checkpoints (:func:`holds_checkpoints`: a stray empty ``checkpoints/`` beside them), as
    :func:`is_run_folder` reads it."""
    subfolder = location / "checkpoints"
    if subfolder.is_dir() and (holds_checkpoints(subfolder) or not holds_checkpoints(location)):
        return subfolder
    return location


#: What a folder that :func:`is_run_folder` refuses is, for the messages that refuse it.
NOT_A_RUN_FOLDER = (
    "not a run folder (no checkpoint or latest pointer in it or in its checkpoints/, no config.yaml of a run)"
)


def holds_checkpoints(folder: Path) -> bool:
    """Whether ``folder`` is a checkpoints folder: it holds the ``latest`` pointer, or ``step-*``
    checkpoints without one (a run killed between its first checkpoint's files and its pointer).
    An empty folder, or one of other files only, is none: a run makes ``checkpoints/`` at its first
    save (:func:`save_checkpoint` writes into it), never before.

    Args:
        folder: any path (one that does not exist, or a file, holds none).

    Returns:
        The answer.
    """
    return (folder / LATEST).is_file() or bool(step_checkpoints(folder))


def is_run_folder(path: Path) -> bool:
    """Whether the folder ``path`` is a training run's or a run's checkpoints folder: the folders
    :func:`find_checkpoint` resolves.

    A run's folder has checkpoints in ``checkpoints/`` (:func:`holds_checkpoints`), or the
    ``config.yaml`` a run writes first, whole: a run stopped before its first checkpoint has that
    file and no ``checkpoints/`` (made at the first save); a user's own ``config.yaml`` makes no
    run, nor does a ``checkpoints/`` folder that holds no checkpoint and no ``latest`` pointer (an
    empty one in a user's project folder). A checkpoints folder holds checkpoints itself. A broken
    one is still one (reading it says what is wrong: "no checkpoint in ..."). The command line
    refuses a folder that is none of these as a usage error; ``torchvote explain`` reads the rest
    as a record's folder.

    Args:
        path: an existing folder.

    Returns:
        The answer.

    Raises:
        ModuleNotFoundError: a folder whose only sign is a ``config.yaml``, without the train
            extra that reads it (PyYAML, with omegaconf).
    """
    if holds_checkpoints(path / "checkpoints") or holds_checkpoints(path):
        return True
    config = path / "config.yaml"
    if not config.is_file():
        return False
    from torchvote.training.setup import is_run_config  # here: setup imports this module

    return is_run_config(config)


def step_checkpoints(directory: Path) -> list[str]:
    """The names of the checkpoints in ``directory`` (``step-<digits>`` with a weights file), the
    highest step first; files of any other name are no checkpoints."""
    names = (p.name[: -len(".safetensors")] for p in directory.glob("step-*.safetensors"))
    return sorted((n for n in names if checkpoint_step(n) >= 0), key=checkpoint_step, reverse=True)


def whole_checkpoints_past_latest(directory: Path) -> list[str]:
    """The checkpoints in ``directory`` newer than its ``latest`` pointer whose files look whole,
    the highest step first: a kill between a checkpoint's files and its pointer leaves one, which a
    resume passes over (the pointer decides, so that pointing it back rolls a run back).

    Args:
        directory: a checkpoints folder.

    Returns:
        Their names; empty without a pointer (the newest whole checkpoint is then the one used).
    """
    pointer = directory / LATEST
    latest = checkpoint_step(pointer.read_text(errors="replace").strip()) if pointer.is_file() else -1
    if latest < 0:
        return []
    newer = [name for name in step_checkpoints(directory) if checkpoint_step(name) > latest]
    return [name for name in newer if _looks_whole(CheckpointPaths.of(directory, name))]


def find_checkpoint(location: str | os.PathLike[str]) -> CheckpointPaths:
    """Resolve a run folder, a checkpoint folder, a ``.safetensors`` / ``.state.pt`` file or a
    checkpoint stem to the two files of one checkpoint (the ``latest`` one for a folder).

    Args:
        location: a run folder (its ``checkpoints/latest`` pointer is read), a checkpoint folder
            (its ``latest``), either file of a checkpoint, or the path without the suffix. A
            folder without a ``latest`` pointer (a run killed between its first checkpoint's files
            and its pointer, or the pointer deleted) gives the newest checkpoint by step whose
            files look whole, in the folder a resume reads (:func:`checkpoint_folder`).

    Returns:
        The checkpoint's paths; its weights file exists (its state file may not: a weights-only
        checkpoint).

    Raises:
        TypeError: ``location`` neither a ``str`` nor an ``os.PathLike`` (``''`` is a ValueError).
        CheckpointError: nothing there; the message says what was looked for.
    """
    location = as_path(location, "location")
    if location.is_dir():
        for directory in (location / "checkpoints", location):
            pointer = directory / LATEST
            if pointer.is_file():
                name = pointer.read_text(errors="replace").strip()
                if checkpoint_step(name) < 0:  # a pointer only ever holds a checkpoint's name, never a path
                    raise CheckpointError(
                        f"{pointer} holds {name[:80]!r}, which is no checkpoint name (step-<digits>): "
                        f"write the name of a checkpoint in {directory} into it, or delete it"
                    )
                paths = CheckpointPaths.of(directory, name)
                if not paths.weights.is_file():
                    raise CheckpointError(f"{pointer} points at {name}, but {paths.weights} does not exist")
                return paths
        directory = checkpoint_folder(location)  # no pointer: the newest whole one, as a resume reads
        for paths in (CheckpointPaths.of(directory, name) for name in step_checkpoints(directory)):
            if _looks_whole(paths):
                return paths
        raise CheckpointError(
            f"no checkpoint in {location}: looked for {location / 'checkpoints' / LATEST} "
            f"and {location / LATEST}"
        )
    text = str(location)
    for suffix in (".safetensors", ".state.pt"):
        if text.endswith(suffix):
            text = text[: -len(suffix)]
    if location.is_file() and text == str(location):  # op.py: not "op.py.safetensors does not exist"
        raise CheckpointError(
            f"{location} is not a checkpoint: expected a run folder, its checkpoints folder, or a "
            ".safetensors or .state.pt file of one"
        )
    paths = CheckpointPaths(Path(text + ".safetensors"), Path(text + ".state.pt"))
    if not paths.weights.is_file():
        raise CheckpointError(f"no checkpoint at {location}: {paths.weights} does not exist")
    return paths


def load_training_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a ``.state.pt`` file with ``torch.load(weights_only=True)`` (no code runs).

    Args:
        path: the ``.state.pt`` file.

    Returns:
        The training state as saved (tensors on the CPU), with its ``"format"`` key.

    Raises:
        TypeError: ``path`` neither a ``str`` nor an ``os.PathLike`` (``''`` is a ValueError).
        CheckpointError: missing, corrupt, or not a torchvote training state.
    """
    path = as_path(path, "path")
    if not path.is_file():
        raise CheckpointError(
            f"training state {path} does not exist (it holds the run's config, without which the "
            "weights beside it can be neither rebuilt into their model nor resumed)"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        reason = load_failure_reason(err, path)
        raise CheckpointError(f"{path} is corrupt or not a training state ({reason})") from None
    try:  # torch.load does not check the records' CRC-32: a changed byte read as a wrong number
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
    except zipfile.BadZipFile:  # a legacy, non-zip torch file: no CRC to check
        damaged = None
    except OSError as err:
        raise CheckpointError(f"{path} could not be read to check it ({err})") from None
    if damaged is not None:
        raise CheckpointError(f"{path} is corrupt: its record {damaged} fails its CRC-32 check")
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} is not a {CHECKPOINT_FORMAT} training state")
    return state

