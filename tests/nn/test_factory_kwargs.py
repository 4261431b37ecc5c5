"""Every module of ``torchvote.nn`` takes torch's factory keywords, as ``nn.Linear(..., device=,
dtype=)`` does, and creates its parameters and buffers there.

One sweep (as timm's ``tests/test_models.py`` sweeps its registry) over every ``nn.Module`` class
that ``torchvote.nn`` exports, found by introspection: a module exported without an entry in
``CASES`` fails :func:`test_every_exported_module_has_a_case`. Each case is built on ``"meta"``
(every tensor there, and the CPU generator untouched: nothing was initialised on the CPU and
moved), in float64 on ``--device`` (every floating tensor float64 and every tensor there, and a
float64 forward pass there works), and with the default keywords spelled out (the same numbers as
without them, so the keywords do not change the initialisation).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import torchvote.nn
from torchvote.nn import (
    AdditiveAttention,
    CapsuleLinear,
    ClassMatrixCapsules,
    ConvMatrixCapsules,
    DynamicRouter,
    EMRouter,
    InvertedDotProductRouter,
    LearnedPositionalEmbedding,
    LuongAttention,
    MatrixCapsules,
    MultiHeadAttention,
    NadarayaWatson,
    PrimaryCapsules,
    PrimaryMatrixCapsules,
    Router,
    RoutingAttention,
    ScoredAttention,
    SelfAttentionRouter,
    SinusoidalPositionalEncoding,
    SlotAttention,
    SlotRouter,
    TransformerConfig,
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
    UniformRouter,
    attention_factory,
    make_router,
)
from torchvote.nn.positional import _sinusoidal_table


def randn(*shape: int, dtype: torch.dtype) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)), dtype=dtype)


def _grid(dtype: torch.dtype) -> MatrixCapsules:
    """Matrix capsules on a 5x5 grid: 2 types of 2x2 poses."""
    activations = torch.rand(2, 5, 5, 2, generator=torch.Generator().manual_seed(0), dtype=dtype)
    return MatrixCapsules(randn(2, 5, 5, 2, 2, 2, dtype=dtype), activations)


@dataclasses.dataclass(frozen=True)
class Case:
    """``build(**factory)`` makes the module; ``inputs(dtype)`` gives ``forward``'s arguments."""

    label: str
    build: Callable[..., nn.Module]
    inputs: Callable[[torch.dtype], tuple[tuple, dict]]


def sequence(dtype):  # (b, T, E)
    return (randn(2, 5, 8, dtype=dtype),), {}


def target_and_memory(dtype):  # (b, T, E), (b, S, E)
    return (randn(2, 5, 8, dtype=dtype), randn(2, 3, 8, dtype=dtype)), {}


def query_and_key(dtype):  # (b, L, 5), (b, S, 6)
    return (randn(2, 4, 5, dtype=dtype), randn(2, 3, 6, dtype=dtype)), {}


def points(dtype):  # queries (b, L), keys (b, S), values (b, S)
    return (randn(2, 4, dtype=dtype), randn(2, 6, dtype=dtype), randn(2, 6, dtype=dtype)), {}


def votes(out_dim: int):  # (b, out_caps, in_caps, out_dim)
    return lambda dtype: ((randn(2, 3, 5, out_dim, dtype=dtype),), {})


def layer_config(**options: Any) -> TransformerConfig:
    return TransformerConfig(8, 2, dim_feedforward=16, dropout=0.0, **options)


#: One or more constructions per exported module; each creates at least one parameter or buffer
#: (a module whose options leave it none, e.g. the dot score, would check nothing).
CASES: dict[type[nn.Module], list[Case]] = {
    # --- attention -----------------------------------------------------------------------------
    MultiHeadAttention: [Case("", lambda **f: MultiHeadAttention(8, 2, **f), target_and_memory)],
    RoutingAttention: [Case("", lambda **f: RoutingAttention(8, 2, iterations=2, **f), sequence)],
    AdditiveAttention: [Case("", lambda **f: AdditiveAttention(5, 6, 7, **f), query_and_key)],
    LuongAttention: [
        Case("general", lambda **f: LuongAttention(5, 6, score="general", **f), query_and_key),
        Case("concat", lambda **f: LuongAttention(5, 6, score="concat", hidden_dim=4, **f), query_and_key),
    ],
    NadarayaWatson: [
        Case("learnable", lambda **f: NadarayaWatson(bandwidth=0.5, learnable=True, **f), points),
    ],
    LearnedPositionalEmbedding: [Case("", lambda **f: LearnedPositionalEmbedding(11, 8, **f), sequence)],
    SinusoidalPositionalEncoding: [
        Case("", lambda **f: SinusoidalPositionalEncoding(8, max_len=11, **f), sequence),
    ],
    # --- transformer ---------------------------------------------------------------------------
    TransformerEncoderLayer: [
        Case("", lambda **f: TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, **f), sequence),
        Case("routing", lambda **f: TransformerEncoderLayer.from_config(
            layer_config(attention=attention_factory("routing", iterations=2)), **f), sequence),
    ],
    TransformerDecoderLayer: [
        Case("", lambda **f: TransformerDecoderLayer(8, 2, dim_feedforward=16, dropout=0.0, **f),
             target_and_memory),
    ],
    TransformerEncoder: [
        Case("pre-norm", lambda **f: TransformerEncoder(layer_config(norm_first=True), 2, **f), sequence),
    ],
    TransformerDecoder: [
        Case("routing", lambda **f: TransformerDecoder(layer_config(
            norm_first=True, decoder_attention=attention_factory("routing", iterations=2)), 2, **f),
            target_and_memory),
    ],
    # --- routers -------------------------------------------------------------------------------
    DynamicRouter: [Case("bias", lambda **f: DynamicRouter(bias=True, out_caps=3, out_dim=6, **f), votes(6))],
    UniformRouter: [Case("bias", lambda **f: UniformRouter(bias=True, out_caps=3, out_dim=6, **f), votes(6))],
    EMRouter: [Case("", lambda **f: EMRouter(out_caps=3, iterations=2, **f), votes(4))],
    InvertedDotProductRouter: [Case("", lambda **f: InvertedDotProductRouter(out_dim=6, **f), votes(6))],
    SelfAttentionRouter: [Case("", lambda **f: SelfAttentionRouter(in_caps=5, out_caps=3, **f), votes(6))],
    SlotRouter: [Case("", lambda **f: SlotRouter(out_caps=3, out_dim=6, hidden_dim=8, **f), votes(6))],
    SlotAttention: [
        Case("", lambda **f: SlotAttention(3, 6, slot_dim=4, hidden_dim=8, **f),
             lambda dtype: ((randn(2, 7, 6, dtype=dtype),), {})),
    ],
    # --- capsules ------------------------------------------------------------------------------
    PrimaryCapsules: [
        Case("", lambda **f: PrimaryCapsules(3, 4, 2, kernel_size=3, stride=1, **f),
             lambda dtype: ((randn(2, 3, 6, 6, dtype=dtype),), {})),
    ],
    CapsuleLinear: [
        Case("dynamic", lambda **f: CapsuleLinear(5, 4, 3, 6, **f),
             lambda dtype: ((randn(2, 5, 4, dtype=dtype),), {})),
        Case("slot", lambda **f: CapsuleLinear(5, 4, 3, 6, routing="slot", **f),
             lambda dtype: ((randn(2, 5, 4, dtype=dtype),), {})),
    ],
    PrimaryMatrixCapsules: [
        Case("", lambda **f: PrimaryMatrixCapsules(3, 2, pose_dim=4, **f),
             lambda dtype: ((randn(2, 3, 5, 5, dtype=dtype),), {})),
    ],
    ConvMatrixCapsules: [
        Case("", lambda **f: ConvMatrixCapsules(2, 3, kernel_size=3, pose_dim=4, iterations=2, **f),
             lambda dtype: ((_grid(dtype),), {})),
    ],
    ClassMatrixCapsules: [
        Case("", lambda **f: ClassMatrixCapsules(2, 4, pose_dim=4, iterations=2, **f),
             lambda dtype: ((_grid(dtype),), {})),
    ],
}

#: Exported classes no one builds: they leave their parameters to their subclasses.
BASES: dict[type[nn.Module], str] = {
    Router: "base class of the routers (forward raises NotImplementedError)",
    ScoredAttention: "abstract base of the scored attentions",
}

EXPORTED = sorted(
    (
        obj
        for name in torchvote.nn.__all__
        if inspect.isclass(obj := getattr(torchvote.nn, name)) and issubclass(obj, nn.Module)
    ),
    key=lambda cls: cls.__name__,
)
ALL_CASES = [
    pytest.param(case, id=f"{cls.__name__}-{case.label}" if case.label else cls.__name__)
    for cls, cases in CASES.items()
    for case in cases
]


def _tensors(module: nn.Module) -> dict[str, Tensor]:
    """Every parameter and buffer, persistent or not, by name."""
    return dict(list(module.named_parameters()) + list(module.named_buffers()))


def place(value: Any, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Any:
    """``value``'s tensors (in tuples, lists, dicts and ``MatrixCapsules``) on ``device``, the
    floating ones in ``dtype`` too (``None`` keeps what a tensor has)."""
    if isinstance(value, Tensor):
        return value.to(device=device, dtype=dtype if value.is_floating_point() else None)
    if isinstance(value, dict):
        return {key: place(item, device=device, dtype=dtype) for key, item in value.items()}
    if isinstance(value, MatrixCapsules):
        return MatrixCapsules(*(place(t, device=device, dtype=dtype) for t in value))
    if isinstance(value, (tuple, list)):
        return type(value)(place(t, device=device, dtype=dtype) for t in value)
    return value


def _outputs(value: Any) -> list[Tensor]:
    """The tensors in a forward pass's result (tensors, tuples, dataclasses, dicts)."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _outputs(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _outputs(item)]
    if dataclasses.is_dataclass(value):
        return [t for field in dataclasses.fields(value) for t in _outputs(getattr(value, field.name))]
    return []


def test_every_exported_module_has_a_case():
    missing = [cls.__name__ for cls in EXPORTED if cls not in CASES and cls not in BASES]
    assert not missing, f"add a construction to CASES for {missing}"
    assert set(CASES) | set(BASES) <= set(EXPORTED)
    assert inspect.isabstract(ScoredAttention)
    for cls, cases in CASES.items():
        assert cases and all(isinstance(case.build(), cls) for case in cases), cls.__name__


@pytest.mark.parametrize("case", ALL_CASES)
def test_built_on_meta_every_tensor_is_there_and_nothing_was_drawn_on_the_cpu(case):
    before = torch.random.get_rng_state()
    module = case.build(device="meta")
    tensors = _tensors(module)
    assert tensors, "the case builds nothing to place"
    assert {name: t.device.type for name, t in tensors.items()} == dict.fromkeys(tensors, "meta")
    # An initialisation on the CPU moved to meta would have drawn from the CPU generator.
    assert torch.equal(torch.random.get_rng_state(), before)
    repr(module)  # a module on meta prints (no value is read)


@pytest.mark.parametrize("case", ALL_CASES)
def test_built_in_float64_every_floating_tensor_is_float64_and_a_forward_pass_runs(case, device):
    torch.manual_seed(0)
    module = case.build(dtype=torch.float64, device=device)
    tensors = _tensors(module)
    assert {name: t.device for name, t in tensors.items()} == dict.fromkeys(tensors, device)
    floating = {name: t.dtype for name, t in tensors.items() if t.is_floating_point()}
    assert floating, "the case builds no floating tensor"
    assert floating == dict.fromkeys(floating, torch.float64)
    args, kwargs = place(case.inputs(torch.float64), device=device)
    outputs = [t for t in _outputs(module(*args, **kwargs)) if t.is_floating_point()]
    assert outputs
    for output in outputs:
        assert output.dtype == torch.float64 and output.device == device
        assert torch.isfinite(output).all()


@pytest.mark.parametrize("case", ALL_CASES)
def test_the_default_keywords_spelled_out_change_no_number(case):
    torch.manual_seed(0)
    default = _tensors(case.build())
    torch.manual_seed(0)
    explicit = _tensors(case.build(device="cpu", dtype=torch.get_default_dtype()))
    assert default.keys() == explicit.keys()
    for name, tensor in default.items():
        assert explicit[name].dtype == tensor.dtype and explicit[name].device == tensor.device, name
        assert torch.equal(explicit[name], tensor), name


@pytest.mark.parametrize("case", ALL_CASES)
def test_an_integer_dtype_is_refused_by_name(case):
    # was torch's "Only Tensors of floating point ... can require gradients" (a RuntimeError from
    # nn.Parameter) or a NotImplementedError from randn, naming no argument
    with pytest.raises(TypeError, match=r"dtype must be a floating-point torch.dtype or None, got torch.int"):
        case.build(dtype=torch.int64)


def test_sinusoidal_integer_dtype_is_refused_by_name():
    with pytest.raises(TypeError, match="dtype must be a floating-point torch.dtype"):
        SinusoidalPositionalEncoding(8, dtype=torch.int64)


def test_sinusoidal_table_in_float64_keeps_float64_precision():
    """The float64 table is the float64 computation itself, not a float32 table widened."""
    module = SinusoidalPositionalEncoding(7, max_len=3000, dtype=torch.float64)
    assert torch.equal(module.table, _sinusoidal_table(3000, 7))
    positions = torch.arange(3000, dtype=torch.float64).unsqueeze(1)  # (T, 1)
    pairs = torch.arange(7, dtype=torch.float64) // 2  # (E,)
    angles = positions / 10000 ** (2 * pairs / 7)  # (T, E), Vaswani et al. 2017, sec. 3.5
    expected = torch.where(torch.arange(7) % 2 == 0, torch.sin(angles), torch.cos(angles))
    torch.testing.assert_close(module.table, expected, rtol=0, atol=1e-10)  # float32 errs by ~1e-7


def test_sinusoidal_table_built_on_meta_is_refilled_after_to_empty():
    module = SinusoidalPositionalEncoding(6, max_len=20, device="meta").to_empty(device="cpu")
    module.reset_parameters()
    expected = SinusoidalPositionalEncoding(6, max_len=20).table
    torch.testing.assert_close(module.table, expected, rtol=0, atol=0)


def test_a_layer_passes_the_keywords_to_its_attention_factory_only_when_given():
    calls = []

    def factory(embed_dim, num_heads, *, dropout, **factory_keywords):
        calls.append(factory_keywords)
        return MultiHeadAttention(embed_dim, num_heads, dropout=dropout, **factory_keywords)

    TransformerDecoderLayer(8, 2, attention=factory)
    TransformerEncoderLayer(8, 2, attention=factory, dtype=torch.float64)
    TransformerEncoderLayer(8, 2, attention=factory, device="meta", dtype=torch.float64)
    assert calls == [{}, {}, {"dtype": torch.float64}, {"device": "meta", "dtype": torch.float64}]


def test_a_stack_from_a_callable_places_its_final_norm():
    layer = functools.partial(TransformerEncoderLayer, 8, 2, norm_first=True, dtype=torch.float64)
    stack = TransformerEncoder(layer, 2, dtype=torch.float64)
    assert {t.dtype for t in _tensors(stack).values()} == {torch.float64}
    assert stack.norm.weight.dtype == torch.float64


@pytest.mark.parametrize("name", ["dynamic", "uniform"])
def test_biased_routers_take_the_keywords_through_their_bias_options(name):
    router = make_router(
        name, in_caps=5, out_caps=3, out_dim=6, bias=True, device="meta", dtype=torch.float64
    )
    assert router.bias.device.type == "meta" and router.bias.dtype == torch.float64
