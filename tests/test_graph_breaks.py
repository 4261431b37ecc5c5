"""``torch.compile`` traces every model and module in one graph: no graph break.

A graph break splits a compiled function into several graphs with Python run between them: on a
GPU the fusion stops at every break and each piece is its own sequence of launches, a cost that
nothing reports. ``torch._dynamo.explain`` traces with dynamo alone (no Inductor, so it is cheap on
a CPU) and lists every break with its reason; it resets dynamo before and after each call, so no
case reuses another's compiled code.

Swept: every registered model's ``tiny`` preset in the training step as
:func:`~torchvote.training.setup.compile_model` compiles it (training mode, with targets, also
under bfloat16 autocast) and in evaluation; every module ``torchvote.nn`` exports (the construction
table of ``tests/nn/test_factory_kwargs.py``); :class:`~torchvote.nn.CapsuleLinear` with every
router and every routing strategy but ``"compiled"``; :class:`~torchvote.nn.MultiHeadAttention`'s
masks, causality, weights and cache. On this CPU ``strategy="auto"`` streams the votes and EM
routing is vectorized while compiling; on a GPU ``"auto"`` materialises them: both are swept.

Breaks that must stay are asserted as exactly what they are (count and reason) and documented
where they happen: the GRU encoder-decoder's packing and recurrent layers, and EM routing's
explicit ``strategy="blocked"`` eager kernel. Where a fix changed what runs under compilation,
the compiled result (dynamo + AOTAutograd, ``backend="aot_eager"``, ``fullgraph=True``) is
compared with the eager one, outputs and gradients, in float64.

Two fixtures give PyTorch's older tracing behaviour (CI runs 2.13; the project allows 2.5 and
later), both seen on torch 2.11 with an H200: ``torch.amp.is_autocast_available`` untraceable, and
``torch.compiler.is_exporting()`` traced as ``True`` while compiling.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import Tensor, nn

import torchvote
from conftest import needs_one_graph_torch, routing_passes
from nn.test_factory_kwargs import ALL_CASES, _grid, _outputs, randn
from torchvote.functional import list_routers
from torchvote.functional.em_kernel import (
    conv_sender_groups,
    prepare_sender_groups,
    prepared_conv_sender_groups,
)
from torchvote.models import create_model, get_model_spec, list_models
from torchvote.nn import (
    CapsuleLinear,
    ClassMatrixCapsules,
    ConvMatrixCapsules,
    EMRouter,
    MultiHeadAttention,
)
from torchvote.nn.kv_cache import KVCache
from torchvote.nn.routing_strategy import STRATEGIES
from torchvote.training import setup
from torchvote.training.tasks import get_task_handler

DOUBLE = torch.float64
PACKAGE = str(Path(torchvote.__file__).parent)


def explain(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``torch._dynamo.explain(fn)(*args, **kwargs)`` (which resets dynamo before and after)."""
    return torch._dynamo.explain(fn)(*args, **kwargs)


def breaks(explanation: Any) -> list[tuple[str, str]]:
    """Each break as ``(first line of its reason, innermost torchvote frame 'function:line')``."""
    found = []
    for reason in explanation.break_reasons:
        ours = [f for f in reason.user_stack if f.filename.startswith(PACKAGE)] or reason.user_stack
        found.append((reason.reason.splitlines()[0], f"{ours[-1].name}:{ours[-1].line}"))
    return found


def assert_one_graph(explanation: Any) -> None:
    assert breaks(explanation) == [], "graph breaks"
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0


# --- models ----------------------------------------------------------------------------------------

#: Where dynamo breaks at an ``nn.GRU`` (not traced: ``allow_rnn`` is off). Before torch 2.15 at
#: reading the module (``self.decoder``), which it cannot resume after ("step_unsupported"): the
#: rest of the frame runs eagerly. From 2.15 at the call (pytorch/pytorch#186614, "Unsupported
#: function call (delayed)"), which it resumes after: what follows a GRU in ``encode`` and in the
#: decoder step is compiled too, one graph more for the same breaks.
GRU_BREAKS_AT_CALL = torch.torch_version.Version(torch.__version__).release[:2] >= (2, 15)
GRU_BREAK = "Unsupported function call (delayed)" if GRU_BREAKS_AT_CALL else "step_unsupported"

#: The breaks that stay, by model, as :func:`breaks` lists them (documented in the model).
KNOWN_BREAKS: dict[str, list[tuple[str, str]]] = {
    # RNNAttentionSeq2Seq.forward: the packing (one break, reported in both frames that hold it)
    # and the decoder's nn.GRU (dynamo's allow_rnn is off), inside the loop over the target
    "rnn-attention-seq2seq": [
        ("Attempted to call function marked as skipped", "encode:pack_padded_sequence"),
        ("Attempted to call function marked as skipped", "encode:pack_padded_sequence"),
        (GRU_BREAK, "_bahdanau_step:self.decoder"),
    ],
}

#: Graphs beyond one per break (``explain``'s ``graph_break_count`` is its graphs less one), by model.
EXTRA_GRAPHS: dict[str, int] = {"rnn-attention-seq2seq": int(GRU_BREAKS_AT_CALL)}


def _short(found: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """:func:`breaks` with each source line cut to its first call (``self.decoder(...)`` ->
    ``self.decoder``), so a comment or an argument added to the line does not matter."""
    short = []
    for reason, where in found:
        function, line = where.split(":", 1)
        call = line.split("(", 1)[0].split("=")[-1].strip()  # "a, b = self.f(x)" -> "self.f"
        short.append((reason, f"{function}:{call}"))
    return short


def assert_model_graphs(name: str, explanation: Any) -> None:
    if name in KNOWN_BREAKS:
        assert _short(breaks(explanation)) == KNOWN_BREAKS[name]
        assert explanation.graph_break_count == len(KNOWN_BREAKS[name]) + EXTRA_GRAPHS.get(name, 0)
    else:
        assert_one_graph(explanation)


class _Explaining(nn.Module):
    """What ``compile_model`` returns with ``torch.compile`` replaced by this: every call is
    traced by ``torch._dynamo.explain`` first, then run."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.explanations: list[Any] = []

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.explanations.append(explain(self.module, *args, **kwargs))
        return self.module(*args, **kwargs)


def _tiny(name: str) -> tuple[nn.Module, Any, dict[str, Tensor]]:
    spec = get_model_spec(name)
    assert "tiny" in spec.presets, f"{name} has no tiny preset"
    torch.manual_seed(0)
    model = create_model(name, "tiny")
    handler = get_task_handler(spec.task)
    return model, handler, handler.example_batch(model.config, 3, torch.Generator().manual_seed(0))


def _training_step(name: str, monkeypatch: pytest.MonkeyPatch, strategy: str | None = None) -> list[Any]:
    """The explanations of the training step's forward, compiled as the loop compiles it."""
    model, handler, batch = _tiny(name)
    if strategy is not None:
        for module in model.modules():
            if isinstance(module, CapsuleLinear):
                module.strategy = strategy
    monkeypatch.setattr(torch, "compile", _Explaining)
    step = setup.compile_model(model, True)
    assert isinstance(step, _Explaining) and step.module is model  # the whole model, compiled once
    step.train()
    handler.forward(step, batch)
    return step.explanations


@needs_one_graph_torch
@pytest.mark.parametrize("name", list_models())
def test_training_step_is_one_graph(name, monkeypatch):
    (explanation,) = _training_step(name, monkeypatch)
    assert_model_graphs(name, explanation)


def _has_capsule_linear(name: str) -> bool:
    return any(isinstance(m, CapsuleLinear) for m in create_model(name, "tiny", device="meta").modules())


@pytest.mark.slow  # about 5 s
@pytest.mark.parametrize("name", [name for name in list_models() if _has_capsule_linear(name)])
def test_training_step_with_materialised_votes_is_one_graph(name, monkeypatch):
    """What ``strategy="auto"`` runs on a GPU (here it streams the votes)."""
    (explanation,) = _training_step(name, monkeypatch, strategy="materialize")
    assert_one_graph(explanation)


@pytest.fixture
def autocast_availability_untraceable(monkeypatch):
    """``torch.amp.is_autocast_available`` as ``torch.compile`` sees it before PyTorch 2.13: a call
    it cannot trace (on torch 2.11 with CUDA, a graph break in every product run with autocast off:
    the vote dot products, the float32 statistics). torchvote reads it once, at import."""
    real = torch.amp.is_autocast_available

    def untraceable(device_type: str) -> bool:
        torch._dynamo.graph_break()
        return real(device_type)

    monkeypatch.setattr(torch.amp, "is_autocast_available", untraceable)


@pytest.fixture
def is_exporting_true_while_compiling(monkeypatch):
    """``torch.compiler.is_exporting()`` as ``torch.compile`` traced it before PyTorch 2.13: ``True``
    (pytorch/pytorch#176347; seen on torch 2.11, where compiling the GRU seq2seq raised "cannot be
    exported" and EM's blocked strategy refused). torchvote reads the export flag instead."""

    def is_exporting_as_traced_before() -> bool:  # True wherever dynamo traces, as export does
        return torch.compiler.is_compiling()

    monkeypatch.setattr(torch.compiler, "is_exporting", is_exporting_as_traced_before)


def test_compiling_is_not_exporting(monkeypatch, is_exporting_true_while_compiling):
    """The GRU seq2seq, which refuses ``torch.export``, compiles with its documented breaks."""
    (explanation,) = _training_step("rnn-attention-seq2seq", monkeypatch)
    assert_model_graphs("rnn-attention-seq2seq", explanation)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("routing", ["dynamic", "self_attention", "em"])
def test_capsule_layer_under_autocast_is_one_graph_where_autocast_checks_do_not_trace(
    routing, dtype, autocast_availability_untraceable
):
    torch.manual_seed(0)
    passes = routing_passes(routing, 2)  # unset for a one-pass router
    layer = CapsuleLinear(7, 3, 4, 5, routing=routing, strategy="materialize", iterations=passes)
    with torch.autocast("cpu", dtype=dtype):
        assert_one_graph(explain(layer, torch.randn(2, 7, 3)))


@pytest.mark.slow  # about 30 s in all on a 2-core CPU
@pytest.mark.parametrize("name", list_models())
def test_training_step_under_bfloat16_autocast_is_one_graph(
    name, monkeypatch, autocast_availability_untraceable
):
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as the loop's bf16=true
        (explanation,) = _training_step(name, monkeypatch)
    assert_model_graphs(name, explanation)


@pytest.mark.slow  # about 30 s in all on a 2-core CPU
@pytest.mark.parametrize("name", list_models())
def test_evaluation_forward_is_one_graph(name):
    model, handler, batch = _tiny(name)
    model.eval()
    step = _Explaining(model).eval()
    with torch.no_grad():
        handler.forward(step, batch)
    assert_model_graphs(name, step.explanations[0])


@pytest.mark.slow  # about 6 s
def test_the_rnn_decoder_loop_stays_eager_whatever_the_target_length():
    """The documented breaks do not grow with the sequence: the loop is not unrolled."""
    model, handler, batch = _tiny("rnn-attention-seq2seq")
    counts = []
    for length in (2, 5):
        explanation = explain(model, batch["source"], batch["target"][:, :length])
        assert _short(breaks(explanation)) == KNOWN_BREAKS["rnn-attention-seq2seq"]
        counts.append(explanation.graph_count)
    assert counts[0] == counts[1]


# --- modules ---------------------------------------------------------------------------------------


@needs_one_graph_torch
@pytest.mark.slow  # about 35 s in all on a 2-core CPU
@pytest.mark.parametrize("case", ALL_CASES)
def test_every_module_is_one_graph(case):
    torch.manual_seed(0)
    module = case.build()
    args, kwargs = case.inputs(torch.float32)
    assert_one_graph(explain(module, *args, **kwargs))


ROUTER_CASES = [
    # "auto" runs what "stream" runs here (and what "materialize" runs on a GPU), and "materialize"
    # was one graph before the fixes: those two are the slow part of the sweep
    pytest.param(
        routing,
        strategy,
        id=f"{routing}-{strategy}",
        marks=[] if strategy == "stream" else [pytest.mark.slow],
    )
    for routing, strategy in itertools.product(list_routers(), STRATEGIES)
    if strategy != "compiled"  # torch.compile of its own
]


@pytest.mark.parametrize(("routing", "strategy"), ROUTER_CASES)
def test_capsule_layer_with_every_router_and_strategy_is_one_graph(routing, strategy):
    # was: "Unsupported context manager" (functools.cached_property's lock in LinearVotes, every
    # streamed router), torch.autograd.grad in dynamic routing's backward, and EM's blocked
    # kernel ("non-contiguous out=", a dozen breaks)
    torch.manual_seed(0)
    passes = routing_passes(routing, 2)  # unset for a one-pass router
    layer = CapsuleLinear(7, 3, 4, 5, routing=routing, strategy=strategy, iterations=passes)
    assert_one_graph(explain(layer, torch.randn(2, 7, 3)))


def test_streamed_shared_votes_are_one_graph():
    layer = CapsuleLinear(7, 3, 4, 5, shared_weights=True, strategy="stream", iterations=2)
    assert_one_graph(explain(layer, torch.randn(2, 7, 3)))


@pytest.mark.parametrize("strategy", ["auto", pytest.param("vectorized", marks=pytest.mark.slow)])
def test_matrix_capsule_layers_are_one_graph(strategy):
    # was: ConvMatrixCapsules' first call compacted its sender groups by reading them
    # (.any(), torch.unique, torch.bincount: five breaks), and "auto" ran the blocked kernel
    for module in (
        ConvMatrixCapsules(2, 3, kernel_size=3, pose_dim=4, iterations=2, strategy=strategy),
        ClassMatrixCapsules(2, 4, pose_dim=4, iterations=2, strategy=strategy),
    ):
        assert_one_graph(explain(module, _grid(torch.float32)))


def test_em_blocked_strategy_is_one_documented_break(is_exporting_true_while_compiling):
    """``strategy="blocked"`` is an eager kernel: one opaque call between two graphs (dynamo
    reports the break once in each frame that holds it: EMRouter.forward, route, em_routing,
    em_kernel.route). Importing the package does not import dynamo for it (2-3 s on a CPU)."""
    router = EMRouter(out_caps=3, iterations=2, strategy="blocked")
    found = _short(breaks(explain(router, randn(2, 3, 5, 4, dtype=torch.float32))))
    # torch._disable_dynamo (the lazy torch.compiler.disable) is skipped as a torch function
    not_followed = {"Skip calling `torch.compiler.disable()`d function",
                    "Attempted to call function marked as skipped"}
    assert len(found) == 4
    assert all(reason in not_followed and where == "route:_blocked_em" for reason, where in found), found


# --- MultiHeadAttention ---------------------------------------------------------------------------


def _attention_cases() -> list[Any]:
    query, memory = randn(2, 5, 8, dtype=torch.float32), randn(2, 3, 8, dtype=torch.float32)
    key_mask = torch.tensor([[True, True, False], [True, True, True]])
    allowed = torch.ones(5, 3, dtype=torch.bool).tril()  # (L, S), every query hears key 0
    cases = {
        "self": ((query,), {}),
        "cross": ((query, memory), {}),
        "key-mask": ((query, memory), {"key_mask": key_mask}),
        "bool-mask": ((query, memory), {"attn_mask": allowed}),
        "float-mask": ((query, memory), {"attn_mask": torch.zeros(5, 3).masked_fill(~allowed, -torch.inf)}),
        # a square (L, L) causal mask, given explicitly (nn.Transformer.generate_square_subsequent_mask):
        # eagerly it runs as is_causal, which reading its values decides (a break when traced)
        "square-bool-mask": ((query,), {"attn_mask": torch.ones(5, 5, dtype=torch.bool).tril()}),
        "square-float-mask": ((query,), {"attn_mask": nn.Transformer.generate_square_subsequent_mask(5)}),
        "causal": ((query,), {"is_causal": True}),
        "causal-key-mask": ((query,), {"is_causal": True, "key_mask": torch.ones(2, 5, dtype=torch.bool)}),
    }
    return [
        pytest.param(args, {**kwargs, "need_weights": need}, id=f"{label}-{'weights' if need else 'fast'}")
        for label, (args, kwargs) in cases.items()
        for need in (False, True)
    ]


@pytest.mark.slow  # about 20 s in all; one graph before the fixes too
@pytest.mark.parametrize(("args", "kwargs"), _attention_cases())
def test_multi_head_attention_is_one_graph(args, kwargs):
    torch.manual_seed(0)
    assert_one_graph(explain(MultiHeadAttention(8, 2), *args, **kwargs))


def test_multi_head_attention_with_a_cache_is_one_graph():
    torch.manual_seed(0)
    attention = MultiHeadAttention(8, 2)
    tokens = randn(2, 5, 8, dtype=torch.float32)
    cache = KVCache()
    attention(tokens[:, :4], is_causal=True, cache=cache)  # the prompt
    assert_one_graph(explain(attention, tokens[:, 4:], is_causal=True, cache=cache))  # one new token


# --- what the fixes changed: compiled against eager ------------------------------------------------


def _outputs_and_gradients(module: nn.Module, run: Any, *args: Any) -> list[Tensor]:
    """The module's floating outputs, and the gradients of their squares' sum with respect to
    the parameters and the inputs that require them."""
    outputs = [t for t in _outputs(run(*args)) if t.is_floating_point()]
    wanted = list(module.parameters()) + [a for a in _outputs(args) if a.requires_grad]
    loss = sum(
        (t * torch.linspace(0.5, 1.5, t.numel(), dtype=t.dtype).view(t.shape)).square().sum() for t in outputs
    )
    return [t.detach() for t in outputs] + list(torch.autograd.grad(loss, wanted))


def assert_compiled_matches_eager(module: nn.Module, *args: Any) -> None:
    torch._dynamo.reset()
    try:
        compiled = torch.compile(module, backend="aot_eager", fullgraph=True)  # no break, or it raises
        theirs = _outputs_and_gradients(module, module, *args)
        ours = _outputs_and_gradients(module, compiled, *args)
    finally:
        torch._dynamo.reset()
    assert len(ours) == len(theirs)
    for mine, eager in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, eager, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("routing", ["dynamic", pytest.param("self_attention", marks=pytest.mark.slow), "em"])
def test_compiled_streamed_routing_gives_the_eager_numbers(routing):
    """Dynamic routing's kernel (its squash gradient through torch.func.vjp while compiling), the
    streamed votes of the other routers, and EM's "auto" (vectorized while compiling, blocked
    eagerly)."""
    torch.manual_seed(0)
    passes = routing_passes(routing, 3)  # unset for a one-pass router
    layer = CapsuleLinear(
        7, 3, 4, 5, routing=routing, strategy="stream", iterations=passes, init_std=0.5, dtype=DOUBLE
    )
    assert_compiled_matches_eager(layer, torch.randn(2, 7, 3, dtype=DOUBLE, requires_grad=True))


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_compiled_attention_with_a_square_causal_mask_gives_the_eager_numbers(kind):
    """Eagerly the mask runs as ``is_causal`` (its values read); compiled, as the mask it is."""
    torch.manual_seed(0)
    attention = MultiHeadAttention(8, 2, dtype=DOUBLE)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    mask = causal if kind == "bool" else torch.zeros(5, 5, dtype=DOUBLE).masked_fill(~causal, -torch.inf)
    tokens = torch.randn(2, 5, 8, dtype=DOUBLE, requires_grad=True)
    assert_compiled_matches_eager(_WithMask(attention, mask), tokens)


class _WithMask(nn.Module):
    """Self-attention with a fixed ``attn_mask`` (a keyword argument): ``(b, T, E) -> (b, T, E)``."""

    def __init__(self, attention: nn.Module, mask: Tensor) -> None:
        super().__init__()
        self.attention, self.mask = attention, mask

    def forward(self, tokens: Tensor) -> Tensor:
        return self.attention(tokens, attn_mask=self.mask)[0]


@pytest.mark.slow  # about 5 s
def test_compiled_conv_matrix_capsules_give_the_eager_numbers():
    """The sender groups made in the graph, the votes formed by a plain product while compiling."""
    torch.manual_seed(0)
    layer = ConvMatrixCapsules(2, 3, kernel_size=3, stride=1, pose_dim=4, iterations=2, dtype=DOUBLE)
    capsules = _grid(DOUBLE)
    capsules.poses.requires_grad_(True)
    assert_compiled_matches_eager(layer, capsules)


@pytest.mark.parametrize(
    ("rows", "cols", "in_types", "kernel_size", "stride"),
    [(5, 5, 2, 3, 1), (7, 6, 1, 3, 2), (9, 9, 3, 2, 3), (4, 8, 2, 1, 1), (6, 5, 2, 2, 4), (3, 3, 1, 3, 1)],
)
def test_conv_groups_from_the_geometry_are_the_compacted_ids(rows, cols, in_types, kernel_size, stride):
    """The sizes-only preparation against checking and compacting the ids themselves (strides
    above the kernel leave cells no patch holds: the compact ids skip them)."""
    sizes = (rows, cols, in_types, kernel_size, stride)
    expected = prepare_sender_groups(conv_sender_groups(*sizes))
    got = prepared_conv_sender_groups(*sizes)
    assert got.count == expected.count
    assert torch.equal(got.ids, expected.ids)
    assert torch.equal(got.patches, expected.patches)
    assert got.patches.dtype == torch.float64 and got.ids.dtype == torch.int64
