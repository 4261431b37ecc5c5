"""``torchvote explain --checkpoint RUN --device D``: a training checkpoint's model makes its record
on ``D`` (it was made on the CPU whatever ``--device`` said), and the record comes back on the CPU,
where the pictures are drawn."""

from __future__ import annotations

import argparse

import pytest
import torch

import torchvote.explain.from_run as from_run
import torchvote.explain.sentences as sentences
from conftest import tiny_config_values
from torchvote.explain.command import _load_checkpoint, add_explain_arguments, run_explain
from torchvote.explain.record import load_record
from torchvote.training import train
from torchvote.training.checkpoint import find_checkpoint
from torchvote.training.config import config_from_dict


@pytest.fixture(scope="module")
def capsnet_run(tiny_mnist_root, tmp_path_factory):
    """A two-step tiny capsnet run's folder."""
    run_dir = tmp_path_factory.mktemp("capsnet_run") / "caps"
    values = tiny_config_values(tiny_mnist_root, run_dir, max_steps=2, epochs=1)
    values["model"] = {"name": "capsnet", "preset": "tiny"}
    return train(config_from_dict(values), verbose=False).run_dir


def _recording(monkeypatch, call_through: bool = False) -> list:
    """Replace ``record_from_run`` by one that notes the ``device`` it is given (``None``: none)
    and returns a one-key record, or (``call_through``) the real record."""
    devices: list = []
    real = from_run.record_from_run

    def recorded(run, **kwargs):
        devices.append(kwargs.get("device"))
        if call_through:
            return real(run, **kwargs)
        return {"winners": torch.zeros(2, dtype=torch.long)}

    monkeypatch.setattr(from_run, "record_from_run", recorded)
    return devices


def test_load_record_passes_the_device_for_every_kind_of_checkpoint_location(capsnet_run, monkeypatch):
    devices = _recording(monkeypatch)
    paths = find_checkpoint(capsnet_run)
    meta = torch.device("meta")
    for location in (capsnet_run, capsnet_run / "checkpoints", paths.weights, paths.state):
        load_record(location, device=meta)
    assert devices == [meta] * 4
    load_record(capsnet_run)  # the default: the CPU
    assert devices[-1] == "cpu"


def test_the_command_passes_its_device_to_the_record(capsnet_run, monkeypatch):
    devices = _recording(monkeypatch)
    _load_checkpoint(capsnet_run, torch.device("meta"))
    assert devices == [torch.device("meta")]


def test_explain_device_cpu_end_to_end(capsnet_run, tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib", reason='the report needs matplotlib: pip install "torchvote[plots]"')
    monkeypatch.setattr(sentences, "explain_sentences", lambda *args, **kwargs: None)  # the model's part only
    devices = _recording(monkeypatch, call_through=True)
    out = tmp_path / "out"
    parser = add_explain_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["x", "--out", str(out), "--checkpoint", str(capsnet_run), "--device", "cpu"])
    code = run_explain(args)
    err = capsys.readouterr().err
    assert code == 0 and "Picture skipped" not in err, err
    assert devices == [torch.device("cpu")]
    assert {"couplings.png", "reconstructions.png"} <= {path.name for path in out.iterdir()}


def test_the_record_comes_back_on_the_cpu_from_any_device_name(capsnet_run):
    """``auto`` (CUDA where torch sees it): the model and images go there, the record comes back
    on the CPU, as made on the CPU (it failed: the images were sent to the device named "auto")."""
    on_cpu = from_run.record_from_run(capsnet_run, examples=2, device="cpu")
    auto = from_run.record_from_run(capsnet_run, examples=2, device="auto")
    assert auto.keys() == on_cpu.keys()
    for key, tensor in auto.items():
        assert tensor.device.type == "cpu", key
        torch.testing.assert_close(tensor, on_cpu[key], rtol=1e-4, atol=1e-5, msg=key)
