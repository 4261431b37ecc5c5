"""``evaluate_checkpoint`` reports the loss under the run's own objective, at the checkpoint's step,
from what the weights (or, for older checkpoints, the training state) record of the run, and says
why not when nothing does."""

from __future__ import annotations

import dataclasses
import shutil
import sys

import pytest
import torch
from torch import nn

from torchvote.training import evaluate, evaluate_checkpoint, load_model_from_checkpoint, train
from torchvote.training.evaluation import load_eval_entry
from torchvote.training.objectives import make_objective
from torchvote.training.schema import LossConfig
from torchvote.training.tasks import get_task_handler

from .test_loop import _StopAfter

MNIST = {"source": "idx"}  # the tiny IDX folder of the conftest, read as the ordinary mnist data set
OLD_FORMAT = ("loss", "total_steps")  # what the weights did not record before they recorded the loss


def _evaluate_checkpoint(location, root, more=(), **kwargs):
    datasets = ["mnist", *more]
    return evaluate_checkpoint(location, datasets, root=str(root), options=MNIST, batch_size=50, **kwargs)


def test_the_loss_is_the_one_training_reported_for_the_same_weights(tiny_config, tiny_mnist_root):
    # `torchvote evaluate` printed accuracy alone; training's table (evaluate() under the trainer's
    # objective) had the loss beside it. A margin loss, as CapsNet trains: the run's loss config
    # decides, not the model's registered loss (the CNN's is the cross-entropy).
    result = train(tiny_config("run", "loss.name=margin"), verbose=False)
    said: list[str] = []
    rows = _evaluate_checkpoint(result.run_dir, tiny_mnist_root, echo=said.append)
    trained = result.results["mnist/test"]  # the trainer's own objective, at the last step
    assert list(rows[0]) == ["data", "accuracy", "loss", "examples"]  # the training table's columns
    assert rows[0]["accuracy"] == trained["accuracy"]
    assert rows[0]["loss"] == pytest.approx(trained["loss"], rel=1e-6)
    assert said == []

    model, spec, _ = load_model_from_checkpoint(result.run_dir)
    handler = get_task_handler(spec.task)
    data = load_eval_entry(handler, "mnist", model.config, root=tiny_mnist_root, options=MNIST)
    registered = make_objective(LossConfig(), spec, result.step, model_config=model.config)
    cross_entropy = evaluate(model, data, handler, objective=registered, batch_size=50)["loss"]
    assert rows[0]["loss"] != pytest.approx(cross_entropy, rel=1e-3)


def _spread_loss(scores, targets, margin):
    """Hinton et al. 2018, sec. 3.1, written out: sum over the wrong classes i of
    max(0, m - (a_t - a_i))^2, averaged over the images."""
    total = 0.0
    for row, target in zip(scores.tolist(), targets.tolist(), strict=True):
        total += sum(max(0.0, margin - (row[target] - a)) ** 2 for i, a in enumerate(row) if i != target)
    return total / len(targets)


def test_the_spread_loss_takes_the_margin_of_the_checkpoints_step(tiny_config, tiny_mnist_root):
    # 240 images in batches of 40 over 2 epochs: 12 steps; stopped after 5, the margin is
    # 0.2 + 0.7 * 5 / 12 (Hinton et al. 2018: raised linearly over the run), not the last step's 0.9
    run = train(tiny_config("spread", "loss.name=spread"), callbacks=[_StopAfter(5)], verbose=False)
    assert run.interrupted and run.checkpoint.name == "step-00000005"
    rows = _evaluate_checkpoint(run.run_dir, tiny_mnist_root)

    model, spec, _ = load_model_from_checkpoint(run.run_dir)
    handler = get_task_handler(spec.task)
    data = load_eval_entry(handler, "mnist", model.config, root=tiny_mnist_root, options=MNIST)
    with torch.no_grad():
        scores = handler.forward(model, data.tensors).scores.float()
    targets = data.tensors["targets"]
    expected = _spread_loss(scores, targets, margin=0.2 + 0.7 * 5 / 12)
    assert rows[0]["loss"] == pytest.approx(expected, rel=1e-5)
    assert rows[0]["loss"] != pytest.approx(_spread_loss(scores, targets, margin=0.9), rel=1e-3)


def _copy_weights(weights, destination, drop=(), **replace):
    """Copy a weights file, dropping or replacing metadata entries (a checkpoint written before
    the weights recorded their run's loss has no ``loss`` / ``total_steps``)."""
    from safetensors import safe_open
    from safetensors.torch import load, save

    with safe_open(str(weights), framework="pt") as handle:
        metadata = {k: v for k, v in handle.metadata().items() if k not in drop} | replace
    destination.parent.mkdir(exist_ok=True)
    destination.write_bytes(save(load(weights.read_bytes()), metadata=metadata))
    return destination


def test_a_weights_file_copied_alone_reports_the_runs_loss(tiny_config, tiny_mnist_root, tmp_path):
    # the weights record the loss config and the run's length: a copied .safetensors had no loss
    # column; a spread-loss run stopped after 5 of 12 steps keeps its step's margin, not 0.9
    run = train(tiny_config("spread", "loss.name=spread"), callbacks=[_StopAfter(5)], verbose=False)
    bare = tmp_path / "copied" / "model.safetensors"
    bare.parent.mkdir()
    shutil.copy(run.checkpoint.weights, bare)
    said: list[str] = []
    rows = _evaluate_checkpoint(bare, tiny_mnist_root, echo=said.append)
    assert said == []
    assert rows == _evaluate_checkpoint(run.run_dir, tiny_mnist_root)

    model, spec, _ = load_model_from_checkpoint(bare)
    handler = get_task_handler(spec.task)
    data = load_eval_entry(handler, "mnist", model.config, root=tiny_mnist_root, options=MNIST)
    with torch.no_grad():
        scores = handler.forward(model, data.tensors).scores.float()
    expected = _spread_loss(scores, data.tensors["targets"], margin=0.2 + 0.7 * 5 / 12)
    assert rows[0]["loss"] == pytest.approx(expected, rel=1e-5)


def test_an_older_checkpoint_reads_the_loss_from_its_training_state(tiny_config, tiny_mnist_root, tmp_path):
    # written before the weights recorded the loss: the training state beside them still gives it
    run = train(tiny_config("spread", "loss.name=spread"), callbacks=[_StopAfter(5)], verbose=False)
    old = _copy_weights(run.checkpoint.weights, tmp_path / "old" / "model.safetensors", drop=OLD_FORMAT)
    shutil.copy(run.checkpoint.state, old.with_name("model.state.pt"))
    said: list[str] = []
    assert _evaluate_checkpoint(old, tiny_mnist_root, echo=said.append) == _evaluate_checkpoint(
        run.run_dir, tiny_mnist_root
    )
    assert said == []


def test_where_nothing_records_the_loss_there_is_none_and_it_says_why(tiny_config, tiny_mnist_root, tmp_path):
    run = train(tiny_config("run", "max_steps=3"), verbose=False)
    accuracy = _evaluate_checkpoint(run.run_dir, tiny_mnist_root)[0]["accuracy"]
    old = _copy_weights(run.checkpoint.weights, tmp_path / "old" / "model.safetensors", drop=OLD_FORMAT)
    said: list[str] = []
    rows = _evaluate_checkpoint(old, tiny_mnist_root, echo=said.append)  # no training state beside it
    assert list(rows[0]) == ["data", "accuracy", "examples"]
    assert rows[0]["accuracy"] == accuracy
    assert len(said) == 1 and said[0].startswith("loss: not reported: ")
    assert str(old.with_name("model.state.pt")) in said[0]

    # an unreadable training state beside the weights: the same, naming the file (no crash)
    old.with_name("model.state.pt").write_bytes(b"not a torch file")
    said.clear()
    rows = _evaluate_checkpoint(old, tiny_mnist_root, echo=said.append)
    assert "loss" not in rows[0] and "model.state.pt is corrupt" in said[0]

    # a loss record that is not a loss config: the same, naming the weights file
    for bad in ('{"name": "hinge"}', '[1, 2]', "{not json", '{"label_smoothing": "high"}'):
        broken = _copy_weights(run.checkpoint.weights, tmp_path / "broken" / "model.safetensors", loss=bad)
        said.clear()
        rows = _evaluate_checkpoint(broken, tiny_mnist_root, echo=said.append)
        assert "loss" not in rows[0] and rows[0]["accuracy"] == accuracy
        assert said[0].startswith(f"loss: not reported: {broken} records its run's loss unreadably"), said


def test_a_data_set_whose_labels_the_loss_does_not_take_is_evaluated_without_a_loss(
    tiny_config, tiny_mnist_root
):
    # a cross-entropy run on MultiMNIST's label pairs: the objective raised, and the evaluation
    # that reported the accuracy before the loss was added stopped with the loss's error
    run = train(tiny_config("run", "max_steps=2", "data.canvas=36"), verbose=False)
    pairs = "multimnist:num_pairs=20"
    said: list[str] = []
    rows = _evaluate_checkpoint(run.run_dir, tiny_mnist_root, echo=said.append, more=[pairs])
    assert [row["data"] for row in rows] == ["mnist/test", "multimnist/test"]
    assert "loss" in rows[0] and "loss" not in rows[1]
    assert len(said) == 1
    assert said[0].startswith("loss: not reported on multimnist/test: the run's loss does not apply to it")

    model, spec, _ = load_model_from_checkpoint(run.run_dir)
    handler = get_task_handler(spec.task)
    data = load_eval_entry(handler, pairs, model.config, root=tiny_mnist_root, options=MNIST)
    assert rows[1]["accuracy"] == evaluate(model, data, handler, batch_size=50)["accuracy"]


def test_evaluate_gives_back_every_submodule_its_own_mode(tiny_config, tiny_mnist_root):
    # evaluate() put the model back with model.train(was_training): a part kept in evaluation mode
    # inside a training model (a frozen batch norm, say) came back training after each evaluation.
    result = train(tiny_config("run"), verbose=False)
    model, spec, _ = load_model_from_checkpoint(result.run_dir)
    handler = get_task_handler(spec.task)
    data = load_eval_entry(handler, "mnist", model.config, root=tiny_mnist_root, options=MNIST)
    model.train()
    kept = next(part for part in model.modules() if part is not model)
    kept.eval()
    before = {name: part.training for name, part in model.named_modules()}
    evaluate(model, data, handler, batch_size=50)
    assert {name: part.training for name, part in model.named_modules()} == before
    assert model.training and not kept.training


def test_bad_arguments_are_refused_before_anything_is_evaluated(tiny_config, tiny_mnist_root):
    result = train(tiny_config("run"), verbose=False)
    # device="auto" failed inside torch ("Expected one of cpu, cuda, ... at start of device string")
    model, spec, _ = load_model_from_checkpoint(result.run_dir, device="auto")
    assert next(model.parameters()).device == torch.device("cpu")  # no GPU here
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda"):
        load_model_from_checkpoint(result.run_dir, device="gpu")
    with pytest.MonkeyPatch.context() as patch:  # a torch.device was taken unchecked: torch's
        patch.setattr(torch.cuda, "is_available", lambda: False)  # "Torch not compiled with CUDA"
        with pytest.raises(ValueError, match="device 'cuda:0' requested but CUDA is not available"):
            load_model_from_checkpoint(result.run_dir, device=torch.device("cuda:0"))
    handler = get_task_handler(spec.task)
    data = load_eval_entry(handler, "mnist", model.config, root=tiny_mnist_root, options=MNIST)
    expected = evaluate(model, data, handler, batch_size=50)
    assert evaluate(model, data, handler, batch_size=50, device="auto") == expected
    # batch_size=-1 evaluated nothing and reported {'accuracy': 0.0, 'examples': 0.0}
    for batch_size, error in ((-1, ValueError), (0, ValueError), (2.5, TypeError)):
        with pytest.raises(error, match="batch_size must be a positive integer"):
            evaluate(model, data, handler, batch_size=batch_size)
    with pytest.raises(TypeError, match="step must be an integer >= 0, got 'x'"):
        evaluate(model, data, handler, step="x")  # was a comparison inside the spread loss
    with pytest.raises(ValueError, match=r"not the \['source', 'target'\] a seq2seq batch needs"):
        evaluate(model, data, get_task_handler("seq2seq"))  # was KeyError: 'source'
    with pytest.raises(ValueError, match="data holds no examples to evaluate on"):
        evaluate(model, dataclasses.replace(data, tensors=data.select(torch.arange(0))), handler)
    # one string: "name: unknown data set 's'"
    with pytest.raises(TypeError, match="datasets must be a list of strings, got the single string 'mnist'"):
        evaluate_checkpoint(result.run_dir, "mnist", root=str(tiny_mnist_root), options=MNIST)


def test_a_root_that_no_data_set_reads_is_refused_before_the_checkpoint(tmp_path):
    """evaluate RUN --on reverse --root /anything ran on in silence (training refuses data.root
    for a generated set); a root some entry reads is taken."""
    from torchvote.training import CheckpointError

    with pytest.raises(ValueError, match=r"root \(--root\): none of the data sets reverse, copy reads files"):
        evaluate_checkpoint(tmp_path / "no-run", ["reverse", "copy:max_len=4"], root=str(tmp_path))
    with pytest.raises(CheckpointError):  # mnist reads its files there: on to the checkpoint
        evaluate_checkpoint(tmp_path / "no-run", ["reverse", "mnist"], root=str(tmp_path))


def test_an_entrys_own_options_win_over_the_shared_ones(monkeypatch):
    """load_eval_entry let the shared ``options`` override an entry's own (mutation review)."""
    evaluate_module = sys.modules[load_eval_entry.__module__]  # the package's `evaluate` is a function
    seen = {}

    class Loaded(Exception):
        pass

    def load_data(handler, name, split, *, options=None, root=None, limit=None):
        seen.update(name=name, split=split, options=options)
        raise Loaded

    monkeypatch.setattr(evaluate_module, "load_data", load_data)
    with pytest.raises(Loaded):
        load_eval_entry(None, "reverse:seed=7,split=train", None, options={"seed": 3, "length": 5})
    assert seen == {"name": "reverse", "split": "train", "options": {"seed": 7, "length": 5}}


def test_a_model_config_its_model_refuses_is_a_checkpoint_error_naming_the_file(tiny_config, tmp_path):
    """Router options the router does not take pass the config's own checks and are refused when
    the model is built: that was a bare ValueError naming no file, where the docstring promises a
    CheckpointError."""
    import json

    from safetensors import safe_open

    from torchvote.training.checkpoint import CheckpointError

    run = train(tiny_config("caps", model={"name": "capsnet", "preset": "tiny"}, max_steps=1), verbose=False)
    with safe_open(str(run.checkpoint.weights), framework="pt") as handle:
        config = json.loads(handle.metadata()["model_config"])
    config["router_options"] = {"temperature": 2.0}  # dynamic routing takes no temperature
    edited = _copy_weights(run.checkpoint.weights, tmp_path / "edited" / "model.safetensors",
                           model_config=json.dumps(config))
    said = f"{edited} records a model config that capsnet refuses: .*temperature"
    with pytest.raises(CheckpointError, match=said):
        load_model_from_checkpoint(edited)


def test_a_damaged_latest_checkpoint_names_the_intact_one_beside_it(tiny_config):
    """A truncated latest checkpoint stopped evaluate and explain with the file's name alone, while
    a resume went on from the older one without a word to them."""
    from torchvote.training.checkpoint import CheckpointError

    result = train(tiny_config("run", "epochs=2", "checkpoint_every=2"), verbose=False)
    checkpoints = sorted((result.run_dir / "checkpoints").glob("*.safetensors"))
    latest, older = checkpoints[-1], checkpoints[-2]
    latest.write_bytes(latest.read_bytes()[:1000])
    hint = f"The newest intact checkpoint there is {older}: pass that file"
    with pytest.raises(CheckpointError, match=hint):
        load_model_from_checkpoint(result.run_dir)
    with pytest.raises(CheckpointError) as named:  # a file named directly: itself, nothing else
        load_model_from_checkpoint(latest)
    assert "intact checkpoint" not in str(named.value)
    load_model_from_checkpoint(older)


def test_a_config_larger_than_its_weights_is_refused_before_the_model_is_allocated(tmp_path):
    """A checkpoint's metadata sets its model's size: one holding a single float and a
    transformer-lm of 40 TB (d_model 10^7, vocab 10^6) stopped in the allocator (or, on a machine
    with the memory, took it) before its tensors were compared; the comparison now runs on the
    model built on the meta device, against the file's header."""
    import json

    from safetensors.torch import save_file

    from torchvote.training.checkpoint import CheckpointError

    config = {"vocab_size": 10**6, "d_model": 10**7, "num_heads": 1, "dim_feedforward": 1,
              "num_layers": 1, "context_length": 8}
    weights = tmp_path / "crafted.safetensors"
    save_file({"w": torch.zeros(1)}, str(weights),
              metadata={"model": "transformer-lm", "model_config": json.dumps(config)})
    said = (f"{weights} does not fit TransformerLM: missing tensors: token_embedding.weight, "
            ".*unexpected tensors: w")
    with pytest.raises(CheckpointError, match=said):
        load_model_from_checkpoint(weights)


@pytest.mark.parametrize(
    "value_of",
    [lambda t: t.sum().item(), lambda t: float(t.numpy().sum())],  # RuntimeError / TypeError on meta
    ids=["item", "numpy"],
)
def test_a_model_that_cannot_be_built_on_the_meta_device_still_loads(scratch_registry, tmp_path, value_of):
    """The check before allocation builds the model on the meta device; a registered class that
    reads a tensor's value as it builds cannot be, and is loaded (and checked) as before (a
    TypeError there, ``.numpy()`` of a meta tensor, was taken for a config the model refuses)."""
    import json

    from safetensors.torch import save_file

    from torchvote.models.registry import register_model

    @dataclasses.dataclass
    class ScaledConfig:
        width: int = 3

    @register_model("scaled-by-a-value", config=ScaledConfig)
    class Scaled(nn.Module):
        def __init__(self, config):
            super().__init__()
            scale = value_of(torch.full((1,), 2.0))  # a value: no meta tensor has one
            self.linear = nn.Linear(config.width, int(scale))

        def forward(self, images, targets=None):
            return self.linear(images)

    saved = Scaled(ScaledConfig())
    weights = tmp_path / "scaled.safetensors"
    save_file({k: v.contiguous() for k, v in saved.state_dict().items()}, str(weights),
              metadata={"model": "scaled-by-a-value", "model_config": json.dumps({"width": 3})})
    model, _, _ = load_model_from_checkpoint(weights)
    torch.testing.assert_close(model.linear.weight, saved.linear.weight, rtol=0, atol=0)


def test_the_weights_name_the_code_that_trained_them(tiny_config):
    """Only ``torchvote reproduce`` recorded the code of a run: a plain training's checkpoint did
    not say which commit made it, so its numbers could not be traced once the code moved on."""
    from torchvote.provenance import describe_code
    from torchvote.training.checkpoint import read_model_metadata
    from torchvote.training.evaluation import checkpoint_summary

    run = train(tiny_config("run", "max_steps=2", "eval_every=0"), verbose=False)
    assert read_model_metadata(run.checkpoint.weights)["code"] == describe_code()
    assert checkpoint_summary(run.run_dir) == (
        f"cnn-baseline at step 2 ({run.checkpoint.weights}), trained by {describe_code()}"
    )
