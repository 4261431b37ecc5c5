"""A record made from a training run: the passes are the trained routing's, the rest the model's."""

from __future__ import annotations

import argparse

import pytest
import torch

import torchvote.explain.sentences as sentences
from torchvote.explain.command import add_explain_arguments, run_explain
from torchvote.explain.from_run import record_from_run
from torchvote.explain.record import load_record
from torchvote.functional.routing import dynamic_routing
from torchvote.training import train
from torchvote.training.checkpoint import CHECKPOINT_FORMAT, find_checkpoint
from torchvote.training.config import config_from_dict
from torchvote.training.evaluation import load_data, load_model_from_checkpoint
from torchvote.training.tasks import get_task_handler


def test_record_from_a_capsnet_run(tiny_values, tiny_mnist_root, tmp_path):
    values = tiny_values(tmp_path / "caps", max_steps=2, epochs=1)
    values["model"] = {"name": "capsnet", "preset": "tiny"}
    run = train(config_from_dict(values)).run_dir
    record = record_from_run(run, examples=3)
    assert load_record(run).keys() == record.keys()  # a run folder is read through the same path
    # its checkpoints folder without the latest pointer, which find_checkpoint resolves, is one too
    (run / "checkpoints" / "latest").unlink()
    assert load_record(run / "checkpoints").keys() == record.keys()

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
    assert float(record["perturbation_span"]) == 0.25  # the paper's, which the caption then states
    # The centre of every row is the unperturbed reconstruction of image 0.
    for k in range(dims):
        torch.testing.assert_close(record["perturbations"][k, steps // 2], record["reconstructions"][0],
                                   rtol=1e-5, atol=1e-6)


def test_a_multimnist_run_records_both_digits_reconstructions(tiny_values, tiny_mnist_root, tmp_path):
    """Only the longest capsule was reconstructed from a MultiMNIST run: the two-colour picture of
    both digits (Sabour et al. 2017, Fig. 5) was never drawn from a run."""
    values = tiny_values(tmp_path / "pairs", max_steps=2, epochs=1)
    values["model"] = {"name": "capsnet", "preset": "tiny"}
    values["data"] = {"name": "multimnist", "root": str(tiny_mnist_root),
                      "options": {"source": "idx", "num_pairs": 40}, "shift": 0}
    values["loss"] = {"name": "margin"}
    run = train(config_from_dict(values)).run_dir
    record = record_from_run(run, examples=4)
    model, spec, _ = load_model_from_checkpoint(run)
    handler = get_task_handler(spec.task)
    data = handler.finalize(load_data(handler, "multimnist", None, options={"source": "idx", "num_pairs": 40},
                                      root=str(tiny_mnist_root), limit=4), model.config)
    images = data.tensors["images"]
    torch.testing.assert_close(record["multimnist_inputs"], images[:, 0])
    with torch.no_grad():
        output = model(images)
        pair = output.scores.topk(2, dim=-1).indices  # (b, 2): the two longest capsules
        for k, key in enumerate(("multimnist_first", "multimnist_second")):
            expected = model.head.decoder(output.poses, pair[:, k : k + 1])[:, 0, 0]  # that capsule alone
            torch.testing.assert_close(record[key], expected, rtol=1e-5, atol=1e-6)
    assert not torch.equal(record["multimnist_first"], record["multimnist_second"])


def _explain(capsys, checkpoint, out):
    """``torchvote explain --checkpoint CHECKPOINT --out OUT`` -> (exit code, stderr)."""
    parser = add_explain_arguments(argparse.ArgumentParser())
    code = run_explain(parser.parse_args(["x", "--out", str(out), "--checkpoint", str(checkpoint)]))
    return code, capsys.readouterr().err


def test_a_checkpoint_file_is_read_as_that_checkpoint_of_its_run(tiny_values, tmp_path, capsys, monkeypatch):
    # A checkpoint's weights file was read as a record of no known key: exit 0, and not one of
    # the model's pictures on the page; its state file was "a dict of tensors, got dict".
    pytest.importorskip("matplotlib", reason='the report needs matplotlib: pip install "torchvote[plots]"')
    values = tiny_values(tmp_path / "caps", max_steps=2, epochs=1)
    values["model"] = {"name": "capsnet", "preset": "tiny"}
    run = train(config_from_dict(values)).run_dir
    record = load_record(run)
    paths = find_checkpoint(run)
    for location in (paths.weights, paths.state, run / "checkpoints"):
        from_location = load_record(location)
        assert from_location.keys() == record.keys(), location
        for key, tensor in record.items():
            torch.testing.assert_close(from_location[key], tensor, msg=f"{location}: {key}")

    monkeypatch.setattr(sentences, "explain_sentences", lambda *args, **kwargs: None)  # the model's part only
    drawn = {}
    for location in (run, paths.weights):
        out = tmp_path / f"out-{location.name}"
        code, err = _explain(capsys, location, out)
        assert code == 0 and "Picture skipped" not in err, err
        drawn[location] = sorted(path.name for path in out.iterdir())
    assert drawn[paths.weights] == drawn[run]
    assert {"couplings.png", "votes-2d.png", "reconstructions.png", "perturbations.png"} <= set(drawn[run])
    # the page says which model and checkpoint it shows (it named none: UX review)
    page = (tmp_path / f"out-{run.name}" / "index.html").read_text()
    from torchvote.provenance import describe_code

    said = (f"Capsule pictures from --checkpoint {run}: capsnet at step 2 ({paths.weights}), "
            f"trained by {describe_code()}.")
    assert said in page
    # weights without their training state (the run's config): refused, saying why (it said "a
    # weights-only checkpoint cannot be resumed", when nothing was being resumed)
    paths.state.unlink()
    code, err = _explain(capsys, paths.weights, tmp_path / "out-lone")
    assert code != 0 and "does not exist" in err and "rebuilt into their model" in err, err


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ([1, 2], "it holds a list"),
        ({"step": 3, "weight": torch.ones(2)}, "it holds a dict whose 'step' is int, not a tensor"),
        ({"conv.weight": torch.ones(2)}, "its tensors ('conv.weight') have none of a record's names"),
        ({"format": CHECKPOINT_FORMAT, "step": 3}, "no checkpoint at"),  # a state file without its weights
    ],
    ids=["list", "dict-of-int", "state-dict", "lone-state"],
)
def test_a_file_that_is_no_record_nor_checkpoint_is_refused(tmp_path, capsys, content, says):
    # "must hold a dict of tensors, got dict" for a checkpoint's state; a model's state dict was
    # taken for a record and drew nothing.
    path = tmp_path / "step-00000003.state.pt"
    torch.save(content, path)
    code, err = _explain(capsys, path, tmp_path / "out")
    assert code == 1 and err.startswith("torchvote explain: error: --checkpoint: ") and says in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    if "no checkpoint" not in says:
        assert "neither a record" in err and "nor a training checkpoint's file" in err


def test_a_file_torch_cannot_read_safely_is_refused_without_torchs_advice_to_run_it(tmp_path, capsys):
    # a script named as the checkpoint: the message passed on torch's advice to load it with
    # weights_only=False, that is, to run whatever code the file holds
    script = tmp_path / "some.py"
    script.write_text("import os\n")
    code, err = _explain(capsys, script, tmp_path / "out")
    assert code == 1 and "weights_only" not in err, err
    assert err.strip() == (
        f"torchvote explain: error: --checkpoint: checkpoint '{script}' is not a record torch.load can "
        "read safely (a dict of tensors saved by torch.save): not a file torch.save writes (it starts "
        "with b'im', neither a zip archive nor a pickle)"
    )


def test_a_checkpoint_of_a_model_without_capsules_is_refused(tiny_values, tmp_path, capsys):
    run = train(config_from_dict(tiny_values(tmp_path / "cnn", max_steps=1, epochs=1))).run_dir
    code, err = _explain(capsys, find_checkpoint(run).weights, tmp_path / "out")
    assert code == 1 and "--checkpoint: " in err and "has no vector capsule layer to draw" in err, err


@pytest.mark.parametrize(
    "options",
    [
        {"router": "em"},
        # one value per pass: each earlier pass's copy was refused ("one value per iteration (1)")
        {"router": "em", "iterations": 3, "router_options": {"inverse_temperature": [0.001, 0.002, 0.004]}},
        {"scores": "linear"},
    ],
    ids=["em", "em-schedule-list", "linear-scores"],
)
def test_a_record_routes_and_reconstructs_as_the_model_does(tiny_values, tiny_mnist_root, tmp_path, options):
    """EM routing weighs the votes by the input capsules' lengths, and an EM or linear-scored model
    predicts by activations or scores, not by lengths: the record called the router without the
    activations (couplings off by up to 0.4) and reconstructed the longest capsule (a class the
    model did not predict in 14 images of 16)."""
    values = tiny_values(tmp_path / "caps", max_steps=2, epochs=1)
    values["model"] = {"name": "capsnet", "preset": "tiny", **options}
    run = train(config_from_dict(values)).run_dir
    record = record_from_run(run, examples=8)

    model, spec, _ = load_model_from_checkpoint(run)
    handler = get_task_handler(spec.task)
    data = handler.finalize(load_data(handler, "mnist", None, options={"source": "idx"},
                                      root=str(tiny_mnist_root), limit=8), model.config)
    with torch.no_grad():
        output = model(data.tensors["images"])  # reconstructs the predicted class
    torch.testing.assert_close(record["couplings"][-1], output.couplings)
    torch.testing.assert_close(record["outputs"][-1], output.poses)
    torch.testing.assert_close(record["reconstructions"], output.reconstructions[:, 0])
    assert torch.equal(record["winners"], output.scores.argmax(-1))  # what the votes picture shows


def test_a_record_reads_another_evaluation_set_without_the_training_sets_options(tiny_values, tmp_path):
    """Training loads data.eval_name without data.options (they are the training set's); the record
    passed them on, and a run of affnist-style evaluated on mnist was refused ('takes no option
    canvas')."""
    values = tiny_values(tmp_path / "caps", max_steps=1, epochs=1)
    values["model"] = {"name": "capsnet", "preset": "tiny"}
    options = {"source": "idx", "canvas": 28}
    values["data"] |= {"name": "affnist-style", "options": options, "eval_name": "mnist"}
    run = train(config_from_dict(values)).run_dir
    record = record_from_run(run, examples=2)
    assert record["inputs"].shape == (2, 28, 28)
