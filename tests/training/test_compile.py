"""``compile=true``: the training step runs through ``torch.compile``; checkpoints stay eager."""

from __future__ import annotations

import pytest
import torch

from torchvote.training import load_model_from_checkpoint, train
from torchvote.training.checkpoint import load_model_weights, read_weights, save_checkpoint
from torchvote.training.setup import compile_model


def test_compile_model_is_a_no_op_when_off():
    model = torch.nn.Linear(2, 3)
    assert compile_model(model, False) is model


@pytest.mark.slow  # compiling the tiny CNN's step takes about 30 s on a 2-core CPU
def test_compiled_run_trains_and_its_checkpoint_loads_uncompiled(tiny_config, monkeypatch, compiler):
    calls = []
    real_compile = torch.compile

    def counting_compile(model, *args, **kwargs):
        calls.append(model)
        return real_compile(model, *args, **kwargs)

    monkeypatch.setattr(torch, "compile", counting_compile)
    result = train(tiny_config("run", "compile=true", "max_steps=2", "epochs=1"), verbose=False)
    assert result.step == 2 and not result.interrupted
    assert len(calls) == 1 and calls[0] is result.model  # the step's module, compiled once
    names = read_weights(result.checkpoint.weights).keys()
    assert names and not any("_orig_mod" in name for name in names)
    model, _, _ = load_model_from_checkpoint(result.run_dir)  # an uncompiled model
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, result.model.state_dict()[name], rtol=0, atol=0)


def test_weights_of_a_compiled_wrapper_save_and_load_with_eager_names(tmp_path, compiler):
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    wrapped = torch.compile(eager)  # never called: nothing is compiled
    assert all(name.startswith("_orig_mod.") for name in wrapped.state_dict())
    paths = save_checkpoint(tmp_path, step=1, model=wrapped, model_metadata={}, state={})
    assert set(read_weights(paths.weights)) == set(eager.state_dict())
    fresh = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    load_model_weights(fresh, paths.weights)
    load_model_weights(torch.compile(fresh), paths.weights)  # into a wrapper, too
    for name, tensor in fresh.state_dict().items():
        torch.testing.assert_close(tensor, eager.state_dict()[name], rtol=0, atol=0)
