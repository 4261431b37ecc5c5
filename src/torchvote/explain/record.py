"""Capsule and vision pictures from a *record*: named tensors saved from a trained model.

``torchvote explain --checkpoint RUN`` reads ``RUN`` as a record file (``.safetensors`` or a
``torch.save`` dict of tensors), or a run folder holding ``explain_record.safetensors``. A
training checkpoint holds weights, not intermediates: for a training run's folder (one with
``checkpoints/``), its ``checkpoints/`` folder, or either file of one of its checkpoints (the
``.safetensors`` weights, whose metadata names the checkpoint format, or the ``.state.pt``
training state), :func:`torchvote.explain.from_run.record_from_run` loads that checkpoint's
model, runs it on the first test images and returns the keys below.

Record keys (any subset but none; each picture names what it lacks):

==========================  =======================  ===========================================
key                         shape                    picture
==========================  =======================  ===========================================
``couplings``               ``(t, b, i, j)``         couplings pass by pass (input 0); entropy
``votes``, ``outputs``      ``(b, i, j, d)``,        agreement per pass; input 0's winning
                            ``(t, b, i, d)``         capsule's votes in 2-D, pass by pass
``winners``                 ``(b,)`` int             the capsule each input's model predicts
                                                     (EM activations, a linear scorer); without
                                                     it, the longest output capsule
``inputs``,                 ``(N, H, W)`` each       inputs beside reconstructions
``reconstructions``
``perturbations``           ``(d, s, H, W)``         input 0's winning capsule perturbed (Fig. 4)
``perturbation_span``       ``()``                   the grid's largest change, positive (``s``
                                                     steps in ``[-span, span]``); 0.25 without
                                                     it, the paper's
``multimnist_inputs``,      ``(N, H, W)`` each       MultiMNIST with both reconstructions
``multimnist_first``,
``multimnist_second``
``patch_image``,            ``(H, W)``, ``(P,)``,    ViT attention over patches
``patch_attention``,        ``(2,)`` int
``patch_grid``
==========================  =======================  ===========================================
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from torchvote.explain import capsule_plots as plots
from torchvote.explain.report import HtmlReport
from torchvote.explain.statistics import PAPER_PERTURBATION_SPAN, coupling_entropy, routing_agreement
from torchvote.files import load_failure_reason
from torchvote.validation import as_path

__all__ = ["RECORD_FILE", "check_record", "explain_record", "load_record"]

RECORD_FILE = "explain_record.safetensors"
_KEYS = (  # every key of the table above: a file with none of them is no record
    "couplings", "votes", "outputs", "winners", "inputs", "reconstructions", "perturbations",
    "multimnist_inputs", "multimnist_first", "multimnist_second", "patch_image", "patch_attention",
    "patch_grid",
)

# Each key's axes: a letter shared by two keys must have one size (names in the table above);
# the MultiMNIST and ViT pictures have their own images (M, Y, X / rows, cols).
_AXES: dict[str, tuple[str, ...]] = {
    "couplings": ("t", "b", "i", "j"),
    "votes": ("b", "i", "j", "d"),
    "outputs": ("t", "b", "i", "d"),
    "winners": ("b",),
    "inputs": ("N", "H", "W"),
    "reconstructions": ("N", "H", "W"),
    "perturbations": ("dims", "s", "H", "W"),
    "perturbation_span": (),
    "multimnist_inputs": ("M", "Y", "X"),
    "multimnist_first": ("M", "Y", "X"),
    "multimnist_second": ("M", "Y", "X"),
    "patch_image": ("rows_px", "cols_px"),
    "patch_attention": ("P",),
    "patch_grid": ("two",),
}

_HOW = (
    "save it from your model's forward with record=True (e.g. torchvote.functional.vote(..., record=True) "
    f"gives the couplings per pass) into {RECORD_FILE} with safetensors.torch.save_file"
)


def load_record(path: str | Path, *, device: str | torch.device = "cpu") -> dict[str, Tensor]:
    """Read a record file or a run folder's record, or make one from a training checkpoint.

    Args:
        path: a ``.safetensors`` file, a ``.pt``/``.pth`` file of a dict of tensors, or a folder
            with :data:`RECORD_FILE`; or a training run's folder, its ``checkpoints/`` folder, or
            either file of one of its checkpoints (``step-N.safetensors``, ``step-N.state.pt``),
            from which :func:`~torchvote.explain.from_run.record_from_run` makes the record.
        device: where :func:`~torchvote.explain.from_run.record_from_run` runs a checkpoint's
            model (``torchvote explain --device``): a ``torch.device`` or a name such as
            ``"cpu"``, ``"cuda:1"``; a record file is read onto the CPU whatever it is.

    Returns:
        name -> tensor, on the CPU (where the pictures are drawn from).

    Raises:
        TypeError: ``path`` neither a ``str`` nor an ``os.PathLike`` (``''`` is a ValueError).
        FileNotFoundError: nothing at ``path``, or a folder that is neither a run's nor holds a
            record (the message says how to make one).
        ValueError: a file that is neither a record (a dict of tensors, at least one named as
            in the table above) nor a training checkpoint's (the message says what it holds), or
            not readable as its suffix says; the errors of
            :func:`~torchvote.explain.from_run.record_from_run` for a checkpoint (a
            :class:`~torchvote.training.CheckpointError` is one), an unknown or unavailable
            ``device`` (for a checkpoint).
        ModuleNotFoundError: reading ``.safetensors`` without ``safetensors`` (names the extra).
    """
    from torchvote.explain.from_run import record_from_run

    path = as_path(path, "path")
    if path.is_dir():
        if (path / RECORD_FILE).is_file():
            path = path / RECORD_FILE
        elif _is_checkpoint_folder(path):
            return record_from_run(path, device=device)
        else:
            raise FileNotFoundError(
                f"folder {str(path)!r} has no {RECORD_FILE} and is no training run's (no checkpoint "
                f"in it or in its checkpoints/, no config.yaml a run wrote): name a run folder, or make a "
                f"record: {_HOW}"
            )
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ModuleNotFoundError as error:
            raise ModuleNotFoundError(
                'reading a .safetensors record needs safetensors: pip install "torchvote[pretrained]"',
                name="safetensors",
            ) from error
        if _is_checkpoint_weights(path):
            return record_from_run(path, device=device)
        try:
            tensors = load_file(str(path))
        except Exception as err:  # safetensors raises its own error types for corrupt headers
            raise ValueError(f"checkpoint {str(path)!r} is not a readable safetensors file: {err}") from None
        return _check_keys(tensors, path)
    try:
        record = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # pickle's and zipfile's errors for a file that is not a torch.save
        raise ValueError(
            f"checkpoint {str(path)!r} is not a record torch.load can read safely (a dict of tensors "
            f"saved by torch.save): {load_failure_reason(err, path)}"
        ) from None
    if _is_training_state(record):
        return record_from_run(path, device=device)  # its checkpoint: the weights file beside it
    if not isinstance(record, Mapping) or not all(isinstance(v, Tensor) for v in record.values()):
        raise ValueError(
            f"checkpoint {str(path)!r} is neither a record (a dict of tensors) nor a training "
            f"checkpoint's file: it holds {_what_it_holds(record)}"
        )
    return _check_keys(dict(record), path)


def _check_keys(record: dict[str, Tensor], path: Path) -> dict[str, Tensor]:
    """``record``, if it has a key of the table above.

    Raises:
        ValueError: it has none (another model's weights, say), naming a few of its keys.
    """
    if not any(key in record for key in _KEYS):
        found = ", ".join(repr(key) for key in list(record)[:3]) + (", ..." if len(record) > 3 else "")
        raise ValueError(
            f"checkpoint {str(path)!r} is neither a record nor a training checkpoint's file: its tensors "
            f"({found or 'none'}) have none of a record's names ({', '.join(_KEYS)})"
        )
    try:
        check_record(record)
    except ValueError as error:
        raise ValueError(f"checkpoint {str(path)!r}: {error}") from None
    return record


def check_record(record: Mapping[str, Tensor]) -> None:
    """Check that a record's tensors fit their pictures and one another, before any is drawn.

    Every key of the table above that is present must be a tensor of real numbers, all finite, of
    its rank with no empty axis, and an axis two keys share (``t`` of ``couplings`` and
    ``outputs``; ``b``, ``i``, ``j``, ``d``; the images' ``N``, ``H``, ``W``) must have one size.
    ``patch_grid`` must be two whole numbers whose product is the number of ``patch_attention``
    weights, and divide ``patch_image``'s height and width. (A record that failed while drawing
    left half its pictures in the report's folder.)

    Args:
        record: name -> tensor.

    Raises:
        ValueError: the first tensor that does not fit, named with what was expected.
    """
    seen: dict[str, tuple[int, str]] = {}  # axis -> (size, the key that set it)
    for key, axes in _AXES.items():
        if key not in record:
            continue
        value = record[key]
        layout = "(" + ", ".join(axes) + ")"
        if not isinstance(value, Tensor):
            raise ValueError(f"record {key!r} must be a tensor {layout}, got {type(value).__name__}")
        if value.dim() != len(axes) or 0 in value.shape:
            raise ValueError(f"record {key!r} must be {layout} with no empty axis, got {tuple(value.shape)}")
        if value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"record {key!r} must hold real numbers, got dtype {value.dtype}")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            bad = int((~torch.isfinite(value)).sum())
            raise ValueError(f"record {key!r} must be finite, got {bad} NaN or infinite values")
        for axis, size in zip(axes, value.shape, strict=True):
            first, owner = seen.setdefault(axis, (size, key))
            if size != first:
                raise ValueError(
                    f"record {key!r} {tuple(value.shape)} has {axis}={size} where {owner!r} has "
                    f"{axis}={first}: the tensors must come from the same inputs and passes {layout}"
                )
    if "winners" in record:
        winners, receivers = record["winners"], seen.get("i", (None, ""))[0]
        if winners.is_floating_point() or (receivers is not None and not bool(
                ((winners >= 0) & (winners < receivers)).all())):
            raise ValueError(
                f"record 'winners' must hold output capsule indices in [0, {receivers}), got "
                f"{winners.tolist()[:8]}"
            )
    if "perturbation_span" in record and not float(record["perturbation_span"]) > 0:
        raise ValueError(
            f"record 'perturbation_span' must be positive (the grid's largest change), got "
            f"{float(record['perturbation_span'])!r}"
        )
    if "patch_grid" in record:
        grid = record["patch_grid"]
        values = [] if grid.is_complex() else grid.flatten().tolist()
        whole = len(values) == 2 and all(math.isfinite(v) and v == int(v) and v >= 1 for v in values)
        if not whole:
            raise ValueError(
                f"record 'patch_grid' must be 2 whole numbers (rows, cols), got {grid.tolist()!r}"
            )
        rows, cols = int(values[0]), int(values[1])
        patches = record.get("patch_attention")
        if patches is not None and patches.shape[0] != rows * cols:
            raise ValueError(
                f"record 'patch_attention' has {patches.shape[0]} weights; 'patch_grid' "
                f"{[rows, cols]} has {rows * cols} patches"
            )
        image = record.get("patch_image")
        if image is not None and (image.shape[0] % rows or image.shape[1] % cols):
            raise ValueError(
                f"record 'patch_image' {tuple(image.shape)} must divide into the 'patch_grid' "
                f"{[rows, cols]}: its height a multiple of {rows}, its width of {cols}"
            )


def _is_checkpoint_folder(path: Path) -> bool:
    """Whether the folder ``path`` is a training run's or its checkpoints folder
    (:func:`~torchvote.training.checkpoint.is_run_folder`).

    Raises:
        ModuleNotFoundError: a folder whose only sign of a run is a ``config.yaml``, without the
            train extra that reads it (the message says what to install; it said the folder was
            no run's).
    """
    from torchvote.training.checkpoint import is_run_folder

    try:
        return is_run_folder(path)
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            f"{path / 'config.yaml'} may be a stopped run's: reading it needs the train extra "
            f'({error}): pip install "torchvote[train]"',
            name=error.name,
        ) from error


def _is_checkpoint_weights(path: Path) -> bool:
    """Whether the ``.safetensors`` file ``path`` is a training checkpoint's weights: its
    metadata names :data:`~torchvote.training.checkpoint.CHECKPOINT_FORMAT` (a record's does
    not). An unreadable header is no checkpoint's; reading it as a record then says why."""
    from torchvote.training.checkpoint import CHECKPOINT_FORMAT, CheckpointError, read_model_metadata

    try:
        return read_model_metadata(path).get("format") == CHECKPOINT_FORMAT
    except CheckpointError:
        return False


def _is_training_state(loaded: object) -> bool:
    """Whether what ``torch.load`` read is a training checkpoint's ``.state.pt`` (its ``format``
    is :data:`~torchvote.training.checkpoint.CHECKPOINT_FORMAT`)."""
    from torchvote.training.checkpoint import CHECKPOINT_FORMAT

    return isinstance(loaded, Mapping) and loaded.get("format") == CHECKPOINT_FORMAT


def _what_it_holds(loaded: object) -> str:
    """A few words on what a file that is no record holds: its type, or a dict's first value that
    is not a tensor."""
    if not isinstance(loaded, Mapping):
        return f"a {type(loaded).__name__}"
    key, value = next((k, v) for k, v in loaded.items() if not isinstance(v, Tensor))
    return f"a dict whose {key!r} is {type(value).__name__}, not a tensor"


def explain_record(record: Mapping[str, Tensor], report: HtmlReport) -> list[str]:
    """Add every picture the record has the tensors for; say what each missing one needs.

    Args:
        record: name -> tensor (see the module docstring for the keys).
        report: the page to add to.

    Returns:
        The notices written for pictures that could not be drawn.

    Raises:
        ValueError: a tensor whose shape does not fit its picture or the other tensors (named;
            see :func:`check_record`), before anything is drawn.
    """
    check_record(record)
    missing: list[str] = []

    def has(picture: str, *keys: str, optional: bool = False) -> bool:
        """Whether the record has every key; a notice names the ``picture`` and the absent keys,
        unless the picture is ``optional`` (drawn only for models that give it) and none of its
        keys is there."""
        absent = [key for key in keys if key not in record]
        if absent and not (optional and len(absent) == len(keys)):
            missing.append(f"{picture} skipped: the record needs {', '.join(absent)}")
        return not absent

    report.heading("Trained model: routing, reconstructions, perturbations")
    if has("couplings", "couplings"):
        couplings = record["couplings"].float()
        report.figure(
            plots.coupling_passes(couplings[:, 0], title="couplings of input 0"),
            "couplings",
            caption=(
                "Couplings c_ij of input 0 used in pass t (dynamic routing's pass 1: uniform "
                "1/n_out, before any agreement); each column sums to 1 over the outputs (rows). "
                "White: the uniform coupling; red above it, blue below."
            ),
        )
        entropy = coupling_entropy(couplings)  # (t,)
        agreement = routing_agreement(record["votes"], record["outputs"]) if has(
            "agreement per pass", "votes", "outputs"
        ) else None
        rows = [
            [t + 1, float(entropy[t]), "" if agreement is None else float(agreement[t])]
            for t in range(entropy.shape[0])
        ]
        report.figure(
            plots.routing_statistics(entropy, agreement),
            "routing-statistics",
            caption=f"Mean over {couplings.shape[1]} inputs, per pass.",
            table=(["pass", "coupling entropy (nats)", "agreement u_hat . v"], rows),
        )
        if "votes" in record and "outputs" in record:
            votes, outputs = record["votes"].float(), record["outputs"].float()  # (b, i, j, d), (t, b, i, d)
            # the model's prediction where the record has it, else the longest output capsule
            longest = outputs[-1, 0].norm(dim=-1).argmax()
            winner = int(record["winners"][0] if "winners" in record else longest)
            report.figure(
                plots.vote_passes(
                    votes[0, winner],
                    couplings[:, 0, winner],
                    uniform=1.0 / couplings.shape[2],
                    title=f"input 0's votes for output capsule {winner}",
                ),
                "votes-2d",
                caption=(
                    f"Input 0's votes for capsule {winner} (PCA) on equal scales, coloured and sized by "
                    f"their coupling against the uniform 1/{couplings.shape[2]}; star: the "
                    "coupling-weighted mean of the votes, s_i / sum_j c_ij, whose direction is that "
                    "of the output v_i = squash(s_i) where routing adds no bias (the output itself, a "
                    "squashed sum of every vote, is longer: its length is in the table)."
                ),
                table=(
                    ["pass", "output length"],
                    [[t + 1, float(outputs[t, 0, winner].norm())] for t in range(outputs.shape[0])],
                ),
            )
    if has("reconstructions", "inputs", "reconstructions"):
        inputs, outputs = record["inputs"][:10].float(), record["reconstructions"][:10].float()
        errors = (inputs - outputs).flatten(1).square().mean(1)  # (N,)
        report.figure(
            plots.reconstructions(inputs, outputs, labels=_predictions(record, inputs.shape[0])),
            "reconstructions",
            caption="Inputs (top) and the decoder's reconstructions from the winning capsule.",
            table=(["input", "mean squared error"], [[n, float(e)] for n, e in enumerate(errors)]),
        )
    if has("perturbations", "perturbations"):
        grid = record["perturbations"].float()
        span = float(record.get("perturbation_span", PAPER_PERTURBATION_SPAN))
        report.figure(
            plots.perturbation_grid(grid, span=span, title=_perturbed_capsule(record)),
            "perturbations",
            caption=(
                f"Each row tweaks one capsule dimension in [{-span:g}, {span:g}] "
                "(Sabour et al. 2017, Fig. 4)."
            ),
            table=(
                ["dimension", "mean |change| vs centre"],
                [
                    [k, float((grid[k] - grid[k, grid.shape[1] // 2]).abs().mean())]
                    for k in range(grid.shape[0])
                ],
            ),
        )
    if has("MultiMNIST", "multimnist_inputs", "multimnist_first", "multimnist_second", optional=True):
        report.figure(
            plots.multimnist_reconstructions(
                record["multimnist_inputs"][:8],
                record["multimnist_first"][:8],
                record["multimnist_second"][:8],
            ),
            "multimnist",
            caption="MultiMNIST inputs; first digit's reconstruction red, second's green.",
        )
    if has("patch attention", "patch_image", "patch_attention", "patch_grid", optional=True):
        grid = tuple(int(v) for v in record["patch_grid"].tolist())  # (rows, cols), checked above
        weights = record["patch_attention"].float()
        report.figure(
            plots.patch_attention_overlay(record["patch_image"], weights, grid),
            "patch-attention",
            caption="A ViT's attention from [CLS] to the image patches.",
            table=(["patch", "weight"], [[p, float(w)] for p, w in enumerate(weights)]),
        )
    notices = [f"Picture {need}." for need in dict.fromkeys(missing)]
    if notices:
        notices[-1] += f" To draw them, {_HOW}."  # the how-to once, not once per picture
    for notice in notices:
        report.text(notice, notice=True)
    return notices


def _predictions(record: Mapping[str, Tensor], count: int) -> list[str] | None:
    """``"pred k"`` for the first ``count`` inputs, from ``winners`` (when the record has one
    for each), else ``None``."""
    winners = record.get("winners")
    if winners is None or winners.shape[0] < count:
        return None
    return [f"pred {int(w)}" for w in winners[:count]]


def _perturbed_capsule(record: Mapping[str, Tensor]) -> str:
    """The perturbation grid's title: which input's capsule was perturbed (input 0's winner,
    as :func:`~torchvote.explain.from_run.record_from_run` records it)."""
    if "winners" in record:
        winner = int(record["winners"][0])
        return f"capsule {winner} (the prediction) of input 0, one dimension changed per row"
    return "the winning capsule of input 0, one dimension changed per row"
