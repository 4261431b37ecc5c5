"""``deterministic=true``: two runs of a preset with one seed give identical weights.

The config turns on ``torch.use_deterministic_algorithms(True)`` for the run
(``training/setup.py``). On CUDA an operation with no deterministic implementation then raises
(``torch.use_deterministic_algorithms``' list: ``index_add_`` and ``scatter_add_`` are made
deterministic, ``histc``, ``bincount`` with weights, floating ``cumsum``, ``grid_sample`` and
``interpolate`` backward, ... raise). One shipped preset per model and data set (whose data
needs no download) trains a few steps, evaluates, and trains again: a preset that reaches such an
operation fails here with its error, one that is not reproducible shows different weights.
``pytest --device cuda -m device`` runs it on the GPU, where both can happen; on the CPU it holds
the CPU kernels (streamed capsule votes, blocked EM routing) to the same standard.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torchvote.training import train
from torchvote.training.config import TrainConfig, apply_overrides, list_presets, load_config

#: Presets whose data needs a download (the Shakespeare corpus), left out.
NEEDS_DOWNLOAD = {"lm-shakespeare"}
#: Presets on data the tiny MNIST folder replaces, and the data sets that need nothing.
LOCAL_DATA = {"mnist", "small-digits", "addition", "reverse"}


def _presets() -> list[str]:
    """One preset per (model, data set) pair, the first by name: the recipes of one pair differ
    in sizes, losses and schedules, not in the operations they reach."""
    chosen: dict[tuple[str, str], str] = {}
    for name in sorted(list_presets()):
        config = load_config(name)
        if name not in NEEDS_DOWNLOAD:
            chosen.setdefault((config.model.name, config.data.name), name)
    return sorted(chosen.values())


def _run(name: str, root: Path, run_dir: Path, device: torch.device) -> TrainConfig:
    """``name`` with its tiny model, three steps of 8 and an evaluation of 16, deterministic."""
    config = load_config(name)
    assert config.data.name in LOCAL_DATA | {"multimnist"}, f"{name}: {config.data.name} needs a download?"
    overrides = [
        "model.preset=tiny",
        "deterministic=true",
        "seed=5",
        "max_steps=3",
        "epochs=1000",  # max_steps ends the run
        "batch_size=8",
        "data.eval_limit=16",
        "progress=false",
        "tensorboard=false",
        f"run_dir={run_dir}",
        f"device={device}",
    ]
    if config.data.name in ("mnist", "multimnist"):  # MultiMNIST pairs the tiny folder's digits
        overrides += [f"data.root={root}", "data.options.source=idx"]
    if config.data.name == "small-digits":
        overrides.append("data.limit=80")
    return apply_overrides(config, overrides)


@pytest.mark.parametrize("name", _presets())
def test_deterministic_runs_of_a_preset_give_identical_weights(name, tiny_mnist_root, tmp_path, device):
    weights = []
    for attempt in ("first", "second"):
        result = train(_run(name, tiny_mnist_root, tmp_path / attempt, device), verbose=False)
        assert result.step == 3
        weights.append({key: value.detach().cpu() for key, value in result.model.state_dict().items()})
    assert weights[0].keys() == weights[1].keys()
    for key in weights[0]:
        assert torch.equal(weights[0][key], weights[1][key]), f"{name}: {key} differs between the runs"
    assert not torch.are_deterministic_algorithms_enabled()  # on for the runs only
