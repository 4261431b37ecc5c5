"""Every registered model takes torch's factory keywords, ``Model(config, *, device=None,
dtype=None)``, passes them to every submodule, and computes on its inputs' device and dtype.

One sweep over the registry (``list_models()``): a model registered without an entry in ``CASES``
fails :func:`test_every_registered_model_has_a_case`. Each case (the ``tiny`` preset and some
overrides that build other submodules) is built on ``"meta"`` (every tensor there, the CPU
generator untouched: nothing was initialised on the CPU and moved), in float64 on ``--device``
(every floating tensor float64 and every tensor there, a float64 forward pass there gives float64
there), with the default keywords spelled out (the same numbers as without them), and run forward
and backward on ``"meta"`` with inputs there: a tensor made inside ``forward`` without its inputs'
device lands on the CPU and fails there, as it fails with a device mismatch on a GPU. Generation
runs on ``--device`` too.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from torchvote.models import create_model, get_model_spec, list_models, register_model
from torchvote.models.capsule_head import CapsuleDecoder
from torchvote.models.efficient_capsnet import DepthwisePrimaryCapsules
from torchvote.training.tasks import get_task_handler

#: label -> config overrides of the ``tiny`` preset, per registered model: the defaults, and the
#: options that build other submodules (routers, scores, pooling, positions, attention).
CASES: dict[str, dict[str, dict[str, Any]]] = {
    "capsnet": {
        "": {},
        "em-router": {"router": "em"},
        "bias-shared": {"router_options": {"bias": True}, "shared_weights": True},
    },
    "cnn-baseline": {"": {}},
    "efficient-capsnet": {"": {}, "grid-slot": {"primary_kernel": 3, "router": "slot"}},
    "em-capsnet": {"": {}, "dynamic-router": {"router": "dynamic"}},
    "rnn-attention-seq2seq": {
        "additive": {},
        "general": {"attention": "general"},
        "concat": {"attention": "concat", "attention_dim": 8},
        "dot": {"attention": "dot", "bidirectional": False},
    },
    "transformer-classifier": {
        "": {},
        "mean-sinusoidal-routing": {
            "pooling": "mean", "positional": "sinusoidal", "attention": "routing", "routing_iterations": 2,
        },
    },
    "transformer-lm": {
        "": {},
        "sinusoidal-routing-untied": {
            "positional": "sinusoidal", "attention": "routing", "routing_iterations": 2, "tie_weights": False,
        },
    },
    "transformer-seq2seq": {
        "": {},
        "sinusoidal-routing": {"positional": "sinusoidal", "attention": "routing", "routing_iterations": 2},
    },
}

ALL_CASES = [
    pytest.param(name, overrides, id=f"{name}-{label}" if label else name)
    for name, cases in CASES.items()
    for label, overrides in cases.items()
]


def _build(name: str, overrides: dict[str, Any], **factory: Any) -> nn.Module:
    return create_model(name, "tiny", **overrides, **factory)


def _tensors(module: nn.Module) -> dict[str, Tensor]:
    """Every parameter and buffer, persistent or not, by name."""
    return dict(list(module.named_parameters()) + list(module.named_buffers()))


def _floating_outputs(value: Any) -> list[Tensor]:
    """The floating-point tensors of a model's output (a dataclass of tensors, lists, dicts)."""
    if isinstance(value, Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _floating_outputs(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _floating_outputs(item)]
    if dataclasses.is_dataclass(value):
        return [t for f in dataclasses.fields(value) for t in _floating_outputs(getattr(value, f.name))]
    return []


def _batch(
    name: str, model: nn.Module, *, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
):
    """The task's example batch for ``model``'s config: images in ``dtype``, all on ``device``."""
    batch = get_task_handler(get_model_spec(name).task).example_batch(
        model.config, 2, torch.Generator().manual_seed(0)
    )
    return {
        key: value.to(device=device, dtype=dtype if value.is_floating_point() else value.dtype)
        for key, value in batch.items()
    }


def _forward(name: str, model: nn.Module, batch: dict[str, Tensor]) -> Any:
    return get_task_handler(get_model_spec(name).task).forward(model, batch)


def test_every_registered_model_has_a_case():
    assert set(CASES) == set(list_models()), "add the new model's configurations to CASES"


@pytest.mark.parametrize("name", list_models())
def test_the_constructor_takes_the_factory_keywords_after_the_config(name):
    parameters = inspect.signature(get_model_spec(name).model_cls).parameters
    assert list(parameters)[:1] == ["config"]
    for keyword in ("device", "dtype"):
        assert parameters[keyword].kind is inspect.Parameter.KEYWORD_ONLY, keyword
        assert parameters[keyword].default is None, keyword


@pytest.mark.parametrize(("name", "overrides"), ALL_CASES)
def test_built_on_meta_every_tensor_is_there_and_nothing_was_drawn_on_the_cpu(name, overrides):
    before = torch.random.get_rng_state()
    model = _build(name, overrides, device="meta")
    tensors = _tensors(model)
    assert {key: t.device.type for key, t in tensors.items()} == dict.fromkeys(tensors, "meta")
    # An initialisation on the CPU moved to meta would have drawn from the CPU generator.
    assert torch.equal(torch.random.get_rng_state(), before)


@pytest.mark.parametrize(("name", "overrides"), ALL_CASES)
def test_built_in_float64_every_floating_tensor_is_float64_and_a_forward_pass_runs(name, overrides, device):
    torch.manual_seed(0)
    model = _build(name, overrides, dtype=torch.float64, device=device)
    tensors = _tensors(model)
    assert {key: t.device for key, t in tensors.items()} == dict.fromkeys(tensors, device)
    floating = {key: t.dtype for key, t in tensors.items() if t.is_floating_point()}
    assert floating == dict.fromkeys(floating, torch.float64)
    model.train()  # a capsule decoder reads the targets
    batch = _batch(name, model, device=device, dtype=torch.float64)
    outputs = _floating_outputs(_forward(name, model, batch))
    assert outputs
    for output in outputs:
        assert output.dtype == torch.float64 and output.device == device
        assert torch.isfinite(output).all()


@pytest.mark.parametrize(("name", "overrides"), ALL_CASES)
def test_the_default_keywords_spelled_out_change_no_number(name, overrides):
    torch.manual_seed(0)
    default = _tensors(_build(name, overrides))
    torch.manual_seed(0)
    explicit = _tensors(_build(name, overrides, device="cpu", dtype=torch.get_default_dtype()))
    assert default.keys() == explicit.keys()
    for key, tensor in default.items():
        assert explicit[key].dtype == tensor.dtype and explicit[key].device == tensor.device, key
        assert torch.equal(explicit[key], tensor), key


@pytest.mark.parametrize(("name", "overrides"), ALL_CASES)
def test_forward_and_backward_on_meta_create_nothing_on_the_cpu(name, overrides):
    model = _build(name, overrides, device="meta")
    model.train()
    outputs = _floating_outputs(_forward(name, model, _batch(name, model, device="meta")))
    assert outputs and {t.device.type for t in outputs} == {"meta"}
    sum(output.sum() for output in outputs if output.requires_grad).backward()
    grads = {key: p.grad for key, p in model.named_parameters() if p.grad is not None}
    assert grads and {g.device.type for g in grads.values()} == {"meta"}


@pytest.mark.parametrize(("name", "overrides"), ALL_CASES)
def test_built_on_meta_then_emptied_and_loaded_computes_as_the_original(name, overrides):
    """The meta recipe: ``to_empty``, ``reset_parameters`` on every module that has it (what no
    checkpoint holds, as the sinusoidal table, is computed), then the checkpoint."""
    torch.manual_seed(0)
    reference = _build(name, overrides).eval()
    model = _build(name, overrides, device="meta").to_empty(device="cpu")
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    model.load_state_dict(reference.state_dict())
    model.eval()
    batch = _batch(name, model)
    with torch.no_grad():
        expected = _floating_outputs(_forward(name, reference, batch))
        actual = _floating_outputs(_forward(name, model, batch))
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("name", list_models())
def test_an_integer_dtype_is_refused_by_name(name):
    spec = get_model_spec(name)
    with pytest.raises(TypeError, match=r"dtype must be a floating-point torch.dtype or None, got torch.int"):
        create_model(name, "tiny", dtype=torch.int64)
    with pytest.raises(TypeError, match=r"dtype must be a floating-point torch.dtype or None, got torch.int"):
        spec.model_cls(spec.config_cls(), dtype=torch.int32)


@pytest.mark.parametrize(
    "build",
    [
        lambda **f: CapsuleDecoder(3, 4, (1, 5, 5), hidden=(6,), **f),
        lambda **f: DepthwisePrimaryCapsules(8, 2, 4, kernel_size=3, **f),
    ],
    ids=["CapsuleDecoder", "DepthwisePrimaryCapsules"],
)
def test_the_models_parts_take_the_keywords_and_refuse_an_integer_dtype(build):
    assert {p.device.type for p in build(device="meta").parameters()} == {"meta"}
    assert {p.dtype for p in build(dtype=torch.float64).parameters()} == {torch.float64}
    with pytest.raises(TypeError, match=r"dtype must be a floating-point torch.dtype or None, got torch.int"):
        build(dtype=torch.int64)


@dataclasses.dataclass
class _ToyConfig:
    width: int = 3


def test_create_model_passes_only_the_keywords_given(scratch_registry):
    """A user's model registered without the keywords still builds when none is asked for."""

    @register_model("toy-without-keywords", config=_ToyConfig)
    class Toy(nn.Module):
        def __init__(self, config: _ToyConfig) -> None:
            super().__init__()
            self.config = config
            self.linear = nn.Linear(config.width, 2)

    assert isinstance(create_model("toy-without-keywords", width=4), Toy)
    with pytest.raises(TypeError, match="device"):
        create_model("toy-without-keywords", device="meta")
    double = create_model("cnn-baseline", "tiny", dtype=torch.float64)
    assert {p.dtype for p in double.parameters()} == {torch.float64}


# --- generation ---------------------------------------------------------------------------------


def _lm(**factory: Any) -> nn.Module:
    torch.manual_seed(0)
    return create_model("transformer-lm", "tiny", **factory)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("use_cache", [True, False])
def test_language_model_generates_on_meta(temperature, use_cache):
    model = _lm(device="meta")
    prompt = torch.zeros(2, 3, dtype=torch.long, device="meta")
    tokens = model.generate(prompt, 4, temperature=temperature, top_k=5, use_cache=use_cache)
    assert tokens.device.type == "meta" and tokens.shape == (2, 7) and tokens.dtype == torch.long


@pytest.mark.parametrize("use_cache", [True, False])
def test_language_model_in_float64_generates_the_float32_models_tokens(use_cache, device):
    model = _lm().to(device)
    double = _lm(dtype=torch.float64).to(device)
    double.load_state_dict({key: t.double() for key, t in model.state_dict().items()})
    prompt = torch.tensor([[1, 2, 3]], device=device)
    expected = model.generate(prompt, 6, temperature=0.0, use_cache=use_cache)
    assert torch.equal(double.generate(prompt, 6, temperature=0.0, use_cache=use_cache), expected)


# The encoder-decoders' greedy loop stops once every sequence has produced <eos>: it reads that
# flag's value each step, which "meta" has not, so their generation is checked in float64 only.
@pytest.mark.parametrize(
    ("name", "overrides"),
    [case for case in ALL_CASES if get_model_spec(case.values[0]).task == "seq2seq"],
)
def test_encoder_decoders_generate_in_float64(name, overrides, device):
    torch.manual_seed(0)
    model = _build(name, overrides, dtype=torch.float64).to(device)
    source = _batch(name, model, device=device)["source"]
    tokens = model.generate(source, max_new_tokens=5)
    assert tokens.dtype == torch.long and tokens.device == device and tokens.shape[0] == source.shape[0]
    assert 1 <= tokens.shape[1] <= 6 and bool((tokens[:, 0] == model.config.bos_id).all())


@pytest.mark.parametrize("name", list_models())
def test_inputs_on_another_device_than_the_model_are_refused_by_name(name):
    """A CPU model given a batch on ``meta`` computed on uninitialised memory without a word
    (the language model, the capsule heads), or failed inside torch naming nothing (on a GPU
    every pair of devices does): the model's first check names its input and both devices."""
    model = create_model(name, "tiny").eval()
    batch = _batch(name, model, device="meta")
    first_input = next(iter(batch))  # images, tokens or source: checked first
    with pytest.raises(ValueError, match=rf"{first_input} is on meta but the module's parameters are on cpu"):
        _forward(name, model, batch)
