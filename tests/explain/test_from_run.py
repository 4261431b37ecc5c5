"""A record made from a training run: the passes are the trained routing's, the rest the model's."""

from __future__ import annotations

import torch

from torchvote.explain.from_run import record_from_run
from torchvote.explain.record import load_record
from torchvote.functional.routing import dynamic_routing
from torchvote.training import train
from torchvote.training.config import config_from_dict
from torchvote.training.evaluate import load_data, load_model_from_checkpoint
from torchvote.training.tasks import get_task_handler


def test_record_from_a_capsnet_run(tiny_values, tiny_mnist_root, tmp_path):
    values = tiny_values(tmp_path / "caps", max_steps=2, epochs=1)
    values["model"] = {"name": "capsnet", "preset": "tiny"}
    run = train(config_from_dict(values)).run_dir
    record = record_from_run(run, examples=3)
    assert load_record(run).keys() == record.keys()  # a run folder is read through the same path

    model, spec, _ = load_model_from_checkpoint(run)
    handler = get_task_handler(spec.task)
    data = handler.finalize(load_data(handler, "mnist", None, options={"source": "idx"},
                                      root=str(tiny_mnist_root), limit=3), model.config)
    with torch.no_grad():
        output = model(data.tensors["images"])
    iterations = model.head.router.iterations
    passes, batch, out_caps, in_caps = record["couplings"].shape
    assert (passes, batch, out_caps) == (iterations, 3, model.config.num_classes)
    # The last recorded pass is the model's own forward.
    torch.testing.assert_close(record["couplings"][-1], output.couplings)
    torch.testing.assert_close(record["outputs"][-1], output.poses)
    torch.testing.assert_close(record["reconstructions"], output.reconstructions[:, 0])
    # Every pass equals dynamic routing (Sabour et al. 2017, Procedure 1) of the recorded votes
    # stopped after that many iterations, with the router's bias: a reference that shares nothing
    # with the record's code path but the votes.
    bias = model.head.router.bias
    for t in range(passes):
        outputs, couplings = dynamic_routing(record["votes"], iterations=t + 1, bias=bias)
        torch.testing.assert_close(record["couplings"][t], couplings, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(record["outputs"][t], outputs, rtol=1e-5, atol=1e-6)
    dims, steps, height, width = record["perturbations"].shape
    assert (dims, steps) == (model.config.class_dim, 11)
    # The centre of every row is the unperturbed reconstruction of image 0.
    for k in range(dims):
        torch.testing.assert_close(record["perturbations"][k, steps // 2], record["reconstructions"][0],
                                   rtol=1e-5, atol=1e-6)
