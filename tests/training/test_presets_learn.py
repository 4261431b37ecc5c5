"""Every shipped image preset's recipe learns on a 28x28 and on a 40x40 canvas.

``cnn-paper data.canvas=40`` once never learned (loss 2.301 for 20 epochs): a recipe can work at
28x28 and fail on the larger canvas of the affNIST experiment (Sabour et al. 2017, sec. 5.2). Each
image preset is trained here as shipped (optimiser, learning rate, schedule, loss, data set) except
for the model size (``model.preset=tiny``), the data (the tiny MNIST folder of conftest, 240 real
digits; ``small-digits`` presets keep their own) and the length of the run, and its training loss
must fall. MultiMNIST's pairs are 36x36, so its smaller canvas is its own 36 (28 is refused).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from torchvote.models.registry import get_model_spec
from torchvote.training import train
from torchvote.training.config import ConfigError, TrainConfig, apply_overrides, list_presets, load_config

STEPS = 60
BATCH = 20
#: Mean training loss over the last steps, as a fraction of the mean over the first, at most.
WINDOW = 10
MAX_RATIO = 0.95
#: The native image side of each data set the image presets train on.
NATIVE_SIDE = {"mnist": 28, "small-digits": 28, "multimnist": 36}


def _image_presets() -> list[str]:
    return [
        name
        for name in sorted(list_presets())
        if get_model_spec(load_config(name).model.name).task == "image-classification"
    ]


def _short_run(name: str, canvas: int, root: Path, run_dir: Path) -> TrainConfig:
    """``name`` with a tiny model, ``STEPS`` steps on the tiny data, at ``canvas``."""
    config = load_config(name)
    overrides = [
        "model.preset=tiny",
        f"data.canvas={canvas}",
        f"batch_size={BATCH}",
        f"max_steps={STEPS}",
        "epochs=1000",  # max_steps ends the run
        "eval_on=[]",
        "eval_every=0",
        "data.eval_limit=20",
        "progress=false",
        "tensorboard=false",
        f"run_dir={run_dir}",
    ]
    if config.data.name == "small-digits":
        overrides.append("data.limit=240")
    else:
        overrides += [f"data.root={root}", "data.options.source=idx"]
    # A schedule written for thousands of steps keeps its shape over STEPS: the warm-up is cut
    # to a quarter of the run.
    if config.optim.warmup_steps > STEPS // 4:
        overrides.append(f"optim.warmup_steps={STEPS // 4}")
    # The spread loss's margin is raised over the run on purpose, which raises the loss; the
    # comparison holds the margin at its final value (the other losses ignore it).
    overrides.append(f"loss.spread_margin_start={config.loss.spread_margin_end}")
    return apply_overrides(config, overrides)


@pytest.mark.parametrize("canvas", [28, 40])
@pytest.mark.parametrize("name", _image_presets())
def test_every_image_preset_learns_at_canvas_28_and_40(name, canvas, tiny_mnist_root, tmp_path):
    config = load_config(name)
    canvas = max(canvas, NATIVE_SIDE[config.data.name])
    losses: list[float] = []
    result = train(
        _short_run(name, canvas, tiny_mnist_root, tmp_path / "run"),
        verbose=False,
        callbacks=[lambda info: losses.append(info.loss)],
    )
    assert result.step == STEPS and len(losses) == STEPS
    first = sum(losses[:WINDOW]) / WINDOW
    last = sum(losses[-WINDOW:]) / WINDOW
    assert last < MAX_RATIO * first, (
        f"{name} at {canvas}x{canvas}: training loss {first:.4f} over the first {WINDOW} steps, "
        f"{last:.4f} over the last {WINDOW} (all: {[round(v, 3) for v in losses]})"
    )


def test_a_canvas_smaller_than_the_images_is_refused(tiny_mnist_root, tmp_path):
    with pytest.raises(ConfigError, match=r"data\.canvas=28 is smaller than the 36-pixel images"):
        train(_short_run("capsnet-multimnist", 28, tiny_mnist_root, tmp_path / "run"), verbose=False)


@pytest.mark.parametrize(("canvas", "shift"), [(28, 28), (40, 28), (40, 100)])
def test_a_shift_that_moves_images_out_of_the_frame_is_refused(tiny_mnist_root, tmp_path, canvas, shift):
    """On a 40-pixel canvas the 28-pixel digit is placed anywhere, then shifted: a shift of 28
    moves it off the canvas (only 40 was refused)."""
    config = apply_overrides(
        _short_run("capsnet-mnist", canvas, tiny_mnist_root, tmp_path / "run"), [f"data.shift={shift}"]
    )
    message = rf"data\.shift={shift} can move the 28-pixel training images out of their frame: "
    with pytest.raises(ConfigError, match=message + "expected at most 27"):
        train(config, verbose=False)


def test_the_image_presets_are_all_found():
    presets = _image_presets()
    assert {"capsnet-mnist", "cnn-paper", "mnist-cnn", "em-capsnet-mnist", "vit-mnist"} <= set(presets)
    assert "lm-shakespeare" not in presets and "seq2seq-reverse" not in presets
