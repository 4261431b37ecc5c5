"""The model registry: lookups, errors that list what exists, and a sweep over every model.

The sweep is parametrised by ``list_models()``, so a model file added later is covered without
editing this file: each model, at its smallest preset, must give outputs of the right shapes,
without NaN, and a backward pass that reaches every parameter.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from torch import nn

from torchvote.models import (
    ClassifierOutput,
    SequenceOutput,
    build_config,
    create_model,
    get_model_spec,
    list_models,
    register_model,
    registered_name,
)
from torchvote.models import registry as registry_module
from torchvote.training.tasks import get_task_handler


def _smallest_preset(name: str) -> str | None:
    """The preset with the fewest parameters (the sweep must stay fast)."""
    spec = get_model_spec(name)
    if not spec.presets:
        return None
    sizes = {}
    for preset in spec.presets:
        model = create_model(name, preset, device="meta")  # no memory for the paper-size presets
        sizes[preset] = sum(p.numel() for p in model.parameters())
    return min(sizes, key=sizes.get)


@pytest.mark.parametrize("name", list_models())
def test_every_registered_model_runs_forward_and_backward(name):
    spec = get_model_spec(name)
    torch.manual_seed(0)
    model = create_model(name, _smallest_preset(name))
    assert model.config.__class__ is spec.config_cls
    handler = get_task_handler(spec.task)
    batch = handler.example_batch(model.config, 3, torch.Generator().manual_seed(0))
    model.train()
    output = handler.forward(model, batch)

    if spec.task == "image-classification":
        assert isinstance(output, ClassifierOutput)
        assert output.scores.shape == (3, model.config.num_classes)
        main = output.scores
        if output.reconstructions is not None:
            assert output.reconstructions[0].numel() == batch["images"][0].numel()
    else:
        assert isinstance(output, SequenceOutput)
        vocab = model.config.vocab_size if spec.task == "language-model" else model.config.tgt_vocab_size
        targets = batch["tokens"][:, 1:] if spec.task == "language-model" else batch["target"][:, 1:]
        assert output.logits.shape == (*targets.shape, vocab)
        main = output.logits
    assert torch.isfinite(main).all(), f"{name} gives non-finite outputs"

    from torchvote.training.config import LossConfig
    from torchvote.training.tasks import make_objective

    loss, _ = make_objective(LossConfig(), spec, total_steps=10)(output, batch, 0)
    assert torch.isfinite(loss)
    loss.backward()
    unreached = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not unreached, f"{name}: no gradient reaches {unreached}"
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)

    model.eval()
    with torch.no_grad():
        again = handler.forward(model, batch)
    assert torch.isfinite(again.scores if spec.task == "image-classification" else again.logits).all()


@pytest.mark.parametrize("name", list_models())
def test_every_model_has_a_dataclass_config_and_valid_presets(name):
    spec = get_model_spec(name)
    assert dataclasses.is_dataclass(spec.config_cls)
    assert spec.task in registry_module.TASKS
    for preset in spec.presets:
        assert dataclasses.is_dataclass(build_config(name, preset))


def test_unknown_model_lists_the_registered_ones():
    with pytest.raises(ValueError, match="unknown model 'nope'; models: .*cnn-baseline"):
        create_model("nope")


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ValueError, match="unknown preset 'huge' for model 'cnn-baseline'; presets: .*small"):
        create_model("cnn-baseline", "huge")


def test_a_name_or_preset_that_is_not_a_string_is_named_not_unhashable():
    # A list failed the dict lookup with "TypeError: unhashable type: 'list'", naming nothing.
    with pytest.raises(ValueError, match=r"unknown model \['cnn-baseline'\]; models: .*cnn-baseline"):
        create_model(["cnn-baseline"])
    with pytest.raises(ValueError, match=r"unknown preset \['small'\] for model 'cnn-baseline'; presets: "):
        create_model("cnn-baseline", ["small"])


def test_unknown_override_lists_the_fields():
    with pytest.raises(ValueError, match="unknown config field.*widht.*fields: .*image_size"):
        create_model("cnn-baseline", widht=3)


def test_overrides_win_over_the_preset():
    model = create_model("cnn-baseline", "small", dropout=0.1, num_classes=7)
    assert model.config.dropout == 0.1 and model.config.num_classes == 7
    assert model.config.channels == get_model_spec("cnn-baseline").presets["small"]["channels"]


def test_registered_name_sees_through_a_torch_compile_wrapper():
    model = create_model("cnn-baseline", "small")
    compiled = torch.compile(model)  # wrapping compiles nothing until the first call
    assert registered_name(model) == "cnn-baseline"
    assert registered_name(compiled) == "cnn-baseline"

    class Unregistered(nn.Linear):
        pass

    with pytest.raises(ValueError, match="Unregistered is not a registered model"):
        registered_name(torch.compile(Unregistered(2, 2)))


@dataclasses.dataclass
class _ToyConfig:
    image_size: int = 4
    in_channels: int = 1
    num_classes: int = 3


def test_register_model_adds_a_model(scratch_registry):
    @register_model("toy-net", config=_ToyConfig, presets={"wide": {"num_classes": 5}})
    class ToyNet(nn.Module):
        """A linear classifier."""

        def __init__(self, config):
            super().__init__()
            self.config = config
            self.linear = nn.Linear(config.image_size**2, config.num_classes)

        def forward(self, images, targets=None):
            return ClassifierOutput(scores=self.linear(images.flatten(1)))

    assert "toy-net" in list_models()
    assert "toy-net" in list_models(task="image-classification")
    assert "toy-net" not in list_models(task="seq2seq")
    spec = get_model_spec("toy-net")
    assert spec.loss == "cross-entropy" and spec.description == "A linear classifier."
    assert create_model("toy-net", "wide").linear.out_features == 5


def test_register_model_rejects_bad_registrations(scratch_registry):
    with pytest.raises(ValueError, match="unknown task"):
        register_model("x", config=_ToyConfig, task="detection")
    with pytest.raises(ValueError, match="unknown loss"):
        register_model("x", config=_ToyConfig, loss="hinge")
    with pytest.raises(ValueError, match="must be a @dataclass"):
        register_model("x", config=dict)
    with pytest.raises(ValueError, match="unknown fields \\['depth'\\]"):
        register_model("x", config=_ToyConfig, presets={"deep": {"depth": 3}})

    class Other(nn.Module):
        pass

    with pytest.raises(ValueError, match="already registered"):
        register_model("cnn-baseline", config=_ToyConfig)(Other)


def test_a_model_class_defined_again_replaces_the_registered_one_and_another_is_refused(scratch_registry):
    """A model class defined again (a notebook cell run again: same module, same qualified name)
    replaces the registered one, as a router class does; a class of torchvote's qualified name
    from another module is another class and is refused (the rule compared qualified names only,
    so a user's ``CapsNet`` took ``"capsnet"`` over silently)."""

    def run_the_cell(classes):
        @register_model("toy-again", config=_ToyConfig)
        class ToyAgain(nn.Module):
            def __init__(self, config, *, device=None, dtype=None):
                super().__init__()
                self.linear = nn.Linear(config.image_size**2, classes, device=device, dtype=dtype)

        return ToyAgain

    first, second = run_the_cell(3), run_the_cell(4)
    assert first is not second and get_model_spec("toy-again").model_cls is second
    assert create_model("toy-again").linear.out_features == 4
    capsnet = get_model_spec("capsnet").model_cls
    impostor = type(capsnet.__qualname__, (nn.Module,), {"__module__": __name__})
    assert impostor.__qualname__ == capsnet.__qualname__
    with pytest.raises(ValueError, match="model 'capsnet' is already registered by"):
        register_model("capsnet", config=_ToyConfig)(impostor)
    assert get_model_spec("capsnet").model_cls is capsnet


def test_an_unknown_task_is_named_not_an_empty_list():
    assert "cnn-baseline" in list_models("image-classification")
    with pytest.raises(ValueError, match="task must be one of 'image-classification'.*got 'classification'"):
        list_models("classification")


@pytest.mark.parametrize(
    ("name", "field"),
    [
        ("capsnet", "decoder"),
        ("efficient-capsnet", "decoder"),
        ("em-capsnet", "coordinate_addition"),
        ("rnn-attention-seq2seq", "bidirectional"),
        ("transformer-lm", "tie_weights"),
        ("transformer-seq2seq", "share_embeddings"),
    ],
)
def test_a_switch_given_as_text_is_refused(name, field):
    # decoder="no" is a truthy string: the option was switched on without a word
    spec = get_model_spec(name)
    with pytest.raises(TypeError, match=f"{field} must be True or False, got 'no'"):
        spec.config_cls(**{field: "no"})


def _variants() -> list[tuple[str, dict[str, object]]]:
    """Every model, and each with every router or attention it takes (smallest preset each)."""
    from torchvote.functional import list_routers

    variants: list[tuple[str, dict[str, object]]] = [(name, {}) for name in list_models()]
    for name in list_models():
        fields = {f.name for f in dataclasses.fields(get_model_spec(name).config_cls)}
        if "router" in fields and name != "em-capsnet":  # em-capsnet routes matrix capsules only
            variants += [(name, {"router": router}) for router in list_routers()]
        if "routing_normalize_over" in fields:  # a causal model cannot normalise over the receivers
            causal = get_model_spec(name).task == "language-model"
            variants += [
                (name, {"attention": "routing", "routing_normalize_over": over})
                for over in (("senders",) if causal else ("senders", "receivers"))
            ]
        elif "attention" in fields:  # the RNN: 'dot' compares equal widths, so one direction
            variants += [(name, {"attention": kind}) for kind in ("additive", "general", "concat")]
            variants.append((name, {"attention": "dot", "bidirectional": False}))
    return variants


@pytest.mark.parametrize(
    ("name", "overrides"),
    _variants(),
    ids=lambda value: value if isinstance(value, str) else "-".join(map(str, value.values())) or "default",
)
def test_every_model_makes_its_tensors_where_its_inputs_are(name, overrides):
    """GPU paths correct by construction, checked on a CPU: with PyTorch's default device set to
    ``meta``, a tensor a model makes without ``device=`` (fine on a CPU, an error or a copy per
    call on a GPU) is a meta tensor, and mixing it with the model's CPU tensors fails. Training
    and evaluation forwards, the backward pass and generation (with and without the cache) run."""
    spec = get_model_spec(name)
    torch.manual_seed(0)
    model = create_model(name, _smallest_preset(name), **overrides)
    handler = get_task_handler(spec.task)
    batch = handler.example_batch(model.config, 3, torch.Generator().manual_seed(0))
    prompt = next(batch[key] for key in ("tokens", "source", "images") if key in batch)[:2]
    with torch.device("meta"):
        output = handler.forward(model.train(), batch)
        main = output.scores if spec.task == "image-classification" else output.logits
        main.float().square().mean().backward()
        again = handler.forward(model.eval(), batch)
        if spec.task == "language-model":
            generated = [model.generate(prompt[:, :3], 4, use_cache=cache) for cache in (True, False)]
        elif spec.task == "seq2seq":
            generated = [model.generate(prompt, max_new_tokens=4)]
            if "use_cache" in inspect.signature(model.generate).parameters:
                generated.append(model.generate(prompt, max_new_tokens=4, use_cache=False))
        else:
            generated = []
    for tensor in (main, again.scores if spec.task == "image-classification" else again.logits, *generated):
        assert tensor.device.type == "cpu"
    assert all(p.grad is None or p.grad.device.type == "cpu" for p in model.parameters())


_HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


@pytest.fixture
def host_reads(monkeypatch):
    """A Counter of the reads of tensor values that torchvote's own code makes (the frame that
    reads is in the torchvote package), by ``file:line method``."""
    import collections
    import sys
    from pathlib import Path

    import torchvote

    package = str(Path(torchvote.__file__).parent)
    counts: collections.Counter = collections.Counter()

    def counted(method: str):
        original = getattr(torch.Tensor, method)

        def counting(self, *args, **kwargs):
            frame = sys._getframe(1)
            if frame.f_code.co_filename.startswith(package):
                where = frame.f_code.co_filename[len(package) + 1 :]
                counts[f"{where}:{frame.f_lineno} {method}"] += 1
            return original(self, *args, **kwargs)

        return counting

    for method in _HOST_READS:
        monkeypatch.setattr(torch.Tensor, method, counted(method))
    return counts


@pytest.mark.parametrize(
    ("name", "overrides"),
    _variants(),
    ids=lambda value: value if isinstance(value, str) else "-".join(map(str, value.values())) or "default",
)
def test_a_warm_training_step_reads_no_tensor_value_back(name, overrides, host_reads, monkeypatch):
    """On a GPU, reading a tensor's value (``.item()``, ``bool``, ``int``) makes the host wait for
    every kernel queued before it: once per step, the device idles while the next step is queued.
    With value checks taking their accelerator path (``check_tensor_values`` asserts on the
    device instead of reading), a second training step of every model (forward, objective,
    backward, metric sums) reads nothing. The first step may (an EM layer prepares its grid's
    ids once)."""
    from torchvote import validation
    from torchvote.training.config import LossConfig
    from torchvote.training.tasks import make_objective

    monkeypatch.setattr(validation, "_reads_are_free", lambda tensor: False)
    spec = get_model_spec(name)
    torch.manual_seed(0)
    model = create_model(name, _smallest_preset(name), **overrides).train()
    handler = get_task_handler(spec.task)
    batch = handler.example_batch(model.config, 3, torch.Generator().manual_seed(0))
    objective = make_objective(LossConfig(), spec, total_steps=10)
    for step in range(2):
        host_reads.clear()
        output = handler.forward(model, batch)
        loss, _ = objective(output, batch, step)
        loss.backward()
        handler.metric_sums(output, batch)
    assert dict(host_reads) == {}


@pytest.mark.parametrize("name", list_models())
def test_a_saved_state_dict_loads_into_a_fresh_model_with_identical_outputs(name):
    """After a training step (weights, batch-norm statistics), ``torch.save`` of the state dict
    and ``load_state_dict`` into a model built from another seed: every key matches, the outputs
    in evaluation mode are equal (two calls of one model too), and so is generation, which runs in
    evaluation mode whatever the model's mode."""
    import io

    spec = get_model_spec(name)
    preset = _smallest_preset(name)
    dropout = {"dropout": 0.3} if "dropout" in spec.config_fields() else {}  # so eval mode matters
    torch.manual_seed(0)
    model = create_model(name, preset, **dropout)
    handler = get_task_handler(spec.task)
    batch = handler.example_batch(model.config, 3, torch.Generator().manual_seed(0))
    optimiser = torch.optim.SGD(model.parameters(), lr=0.1)
    output = handler.forward(model.train(), batch)
    main = output.scores if spec.task == "image-classification" else output.logits
    main.float().square().mean().backward()
    optimiser.step()
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    torch.manual_seed(1)
    fresh = create_model(name, preset, **dropout)
    result = fresh.load_state_dict(torch.load(buffer, weights_only=True))
    assert not result.missing_keys and not result.unexpected_keys

    def main(module):
        with torch.no_grad():
            out = handler.forward(module.eval(), batch)
        return out.scores if spec.task == "image-classification" else out.logits

    first = main(model)
    assert torch.equal(first, main(model))  # evaluation mode is deterministic
    assert torch.equal(first, main(fresh))
    if spec.task == "language-model":
        prompt = batch["tokens"][:, :3]
        generated = [m.generate(prompt, 5, temperature=0.0) for m in (model.train(), fresh)]
    elif spec.task == "seq2seq":
        generated = [m.generate(batch["source"], max_new_tokens=5) for m in (model.train(), fresh)]
    else:
        return
    assert model.training  # generation restored the mode
    assert torch.equal(*generated)
