"""Batches of 0 and 1 example: the image models run them eagerly, and a program exported with a
dynamic batch (traced at 2, as docs/architecture.md says to) runs them with the eager outputs.
Tracing at 0 or 1 is what fails: ``torch.export`` specialises those sizes."""

from __future__ import annotations

import pytest
import torch
from test_export import _inputs, _tiny, assert_same_outputs
from torch._dynamo.exc import UserError

from conftest import needs_one_graph_torch
from torchvote.models import get_model_spec, list_models

IMAGE_MODELS = [name for name in list_models() if get_model_spec(name).task == "image-classification"]


def _export(name: str, batch: int) -> torch.nn.Module:
    model = _tiny(name)
    (images,) = _inputs(name, model, batch)
    program = torch.export.export(model, (images,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    return program.module()


@pytest.mark.parametrize("name", IMAGE_MODELS)
def test_an_image_model_classifies_an_empty_batch_eagerly(name):
    model = _tiny(name)
    (images,) = _inputs(name, model, 2)
    with torch.no_grad():
        scores = model(images[:0]).scores  # (0, classes)
    assert scores.shape == (0, model(images).scores.shape[1])


@needs_one_graph_torch
@pytest.mark.parametrize("name", ["cnn-baseline", "capsnet"])  # a plain network and a routing one
def test_a_program_traced_at_batch_2_runs_batches_of_0_and_1_as_the_eager_model(name):
    program, model = _export(name, 2), _tiny(name)
    (images,) = _inputs(name, model, 3)
    for batch in (0, 1):
        with torch.no_grad():
            expected = model(images[:batch])
        assert_same_outputs(program(images[:batch]), expected)


@needs_one_graph_torch
@pytest.mark.parametrize("batch", [0, 1])
def test_tracing_a_dynamic_batch_at_0_or_1_is_refused_by_torch(batch):
    """The limit docs/architecture.md names beside its export example: torch's, not the model's."""
    with pytest.raises(UserError, match=f"specialized it to be a constant \\({batch}\\)"):
        _export("cnn-baseline", batch)
