"""Forward and backward on the ``"meta"`` device: nothing in a forward pass is made on the CPU.

Users train on GPUs; this machine has none. On ``"meta"`` every tensor has a shape, a dtype and a
device but no values, and an op that meets a CPU tensor fails ("Tensor on device cpu is not on
the expected device meta"): the crash a hard-coded device gives on a GPU. So every exported module
of ``torchvote.nn`` (the construction table of ``test_factory_kwargs.py``, found by introspection
there), every router under every routing strategy, and every functional entry point runs forward
and backward here, with module and inputs on ``"meta"``, and gives the shapes and dtypes of the same
run on the CPU.

Ops that cannot run on ``"meta"`` because they read values are kept out of the forward passes:
``torch.equal`` (recognising a causal mask: a meta mask is used as the mask it is), ``torch.unique``
and reading a flag (the ids of EM's ``sender_groups``: built and compacted on the CPU, then moved).
Ids given on ``"meta"`` themselves have nothing to compact and are refused by name.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor, nn

import torchvote.functional as TF
from torchvote.functional.em import em_routing
from torchvote.functional.em_kernel import prepare_sender_groups
from torchvote.functional.routing_votes import LinearVotes, SharedLinearVotes
from torchvote.nn import (
    CapsuleLinear,
    ConvMatrixCapsules,
    InvertedDotProductRouter,
    MultiHeadAttention,
    RoutingAttention,
)
from torchvote.nn.em_capsules import MatrixCapsules
from torchvote.nn.routing_strategy import STRATEGIES

from .test_factory_kwargs import ALL_CASES, _outputs

META = torch.device("meta")
ROUTERS = ["dynamic", "uniform", "em", "inverted_dot_product", "self_attention", "slot"]


def _to(value, device: torch.device):
    """Tensors (in tuples and ``MatrixCapsules``) moved to ``device``, floating ones as leaves that
    require a gradient."""
    if isinstance(value, Tensor):
        return value.detach().to(device).requires_grad_(value.is_floating_point())
    if isinstance(value, MatrixCapsules):
        return MatrixCapsules(*(_to(t, device) for t in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_to(t, device) for t in value)
    return value


def _forward_backward(run, *inputs: Tensor) -> list[Tensor]:
    """``run(*inputs)``'s floating outputs after a backward pass of their sum: every output and
    every floating input's gradient on the inputs' device."""
    outputs = [t for t in _outputs(run(*inputs)) if t.is_floating_point()]
    assert outputs
    sum(t.float().sum() for t in outputs if t.requires_grad).backward()
    return outputs


def _same_layout(meta: list[Tensor], cpu: list[Tensor]) -> None:
    assert [(t.shape, t.dtype) for t in meta] == [(t.shape, t.dtype) for t in cpu]
    assert all(t.device == META for t in meta)


@pytest.mark.parametrize("case", ALL_CASES)
def test_every_exported_module_runs_forward_and_backward_on_meta(case):
    torch.manual_seed(0)
    module = case.build(device="meta")
    args, kwargs = case.inputs(torch.float32)
    meta_args, meta_kwargs = _to(args, META), {key: _to(value, META) for key, value in kwargs.items()}
    outputs = _forward_backward(lambda *a: module(*a, **meta_kwargs), *meta_args)
    for name, parameter in module.named_parameters():
        assert parameter.grad is None or parameter.grad.device == META, name
    cpu_module = case.build()
    cpu_outputs = _forward_backward(lambda *a: cpu_module(*a, **kwargs), *_to(args, torch.device("cpu")))
    _same_layout(outputs, cpu_outputs)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("routing", ROUTERS)
def test_every_router_and_strategy_runs_on_meta(routing, strategy, shared):
    # was: "stream" failed entering torch.autocast on meta (the LinearVotes and dynamic-routing
    # kernels), the inverted dot-product router asked torch.is_autocast_enabled("meta"), and
    # "compiled" tried torch.compile for meta and left the layer eager for good after it failed
    layer = CapsuleLinear(5, 4, 3, 6, routing=routing, strategy=strategy, shared_weights=shared, device=META)
    inputs = torch.randn(2, 5, 4, device=META, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no compile attempt, no fallback warning
        result = layer(inputs, return_routing=True)
    result.outputs.sum().backward()
    assert result.outputs.shape == (2, 3, 6) and result.couplings.shape == (2, 3, 5)
    assert inputs.grad.device == META and layer.weight.grad.device == META
    assert layer._compiled is None  # a compiled route is still tried on the device it moves to


def _votes(*shape: int) -> Tensor:
    return torch.randn(*shape, device=META, requires_grad=True)


FUNCTIONS = {
    "vote routing": lambda: TF.vote(TF.PairwiseVotes(_votes(2, 3, 5, 4)), None, normalize_over="receivers",
                                    iterations=3, nonlinearity="squash", record=True),
    "vote attention loop": lambda: TF.vote(
        TF.SharedVotes(_votes(2, 5, 4)), TF.DotProductScores(_votes(2, 3, 4), _votes(2, 5, 4)),
        normalize_over="senders", iterations=2, is_causal=True, record=True),
    "masked_softmax": lambda: TF.masked_softmax(_votes(2, 3, 4), -1,
                                                torch.ones(3, 4, dtype=torch.bool, device=META)),
    "sdpa fused": lambda: TF.scaled_dot_product_attention(_votes(2, 3, 4), _votes(2, 5, 4), _votes(2, 5, 4),
                                                          attn_mask=torch.zeros(3, 5, device=META)),
    # was NotImplementedError from torch.equal (aten::equal has no meta kernel)
    "sdpa causal 2-D mask": lambda: TF.scaled_dot_product_attention(
        _votes(2, 3, 4), _votes(2, 3, 4), _votes(2, 3, 4),
        attn_mask=torch.ones(3, 3, dtype=torch.bool, device=META).tril()),
    "sdpa weights": lambda: TF.scaled_dot_product_attention(_votes(2, 3, 4), _votes(2, 5, 4), _votes(2, 5, 4),
                                                            is_causal=True, need_weights=True),
    "softmax_attention float16": lambda: TF.softmax_attention(
        _votes(2, 3, 4).half(), _votes(2, 5, 4).half(), _votes(2, 5, 4).half(), is_causal=True),
    "attend": lambda: TF.attend(_votes(2, 3, 5), _votes(2, 5, 4)),
    "self_attention": lambda: TF.self_attention(_votes(2, 3, 4), need_weights=True),
    "dynamic_routing": lambda: TF.dynamic_routing(_votes(2, 3, 5, 4)),
    "dynamic_routing distance": lambda: TF.dynamic_routing(_votes(2, 3, 5, 4), agreement="distance"),
    "uniform_routing": lambda: TF.uniform_routing(_votes(2, 3, 5, 4)),
    "inverted_dot_product_routing": lambda: TF.inverted_dot_product_routing(_votes(2, 3, 5, 4)),
    "self_attention_routing": lambda: TF.self_attention_routing(_votes(2, 3, 5, 4), log_prior=_votes(3, 5)),
    "slot_routing": lambda: TF.slot_routing(_votes(2, 3, 5, 4), _votes(3, 4), query=lambda s: s * 2,
                                            update=lambda u, p: u + p),
    "slot_attention": lambda: TF.slot_attention(_votes(2, 5, 4), _votes(2, 5, 4), _votes(2, 3, 4),
                                                query=lambda s: s * 2, update=lambda u, p: u + p,
                                                mask=torch.ones(2, 5, dtype=torch.bool, device=META)),
    "squash": lambda: TF.squash(_votes(2, 3)),
    "efficient_squash": lambda: TF.efficient_squash(_votes(2, 3)),
    "additive_score": lambda: TF.additive_score(_votes(2, 3, 4), _votes(2, 5, 6), _votes(7, 4), _votes(7, 6),
                                                _votes(7)),
    "em_routing": lambda: em_routing(_votes(2, 3, 5, 4), torch.rand(2, 5, device=META), 0.0, _votes(3),
                                     return_assignments=True),
    # ids on the CPU (what a convolutional layer builds), votes on meta: compacted there, moved
    "em_routing sender_groups": lambda: em_routing(
        _votes(2, 2, 3, 5, 4), torch.rand(2, 2, 5, device=META), 0.0, 0.5,
        sender_groups=torch.tensor([[0, 1, 2, 3, 4], [3, 4, 5, 6, 7]])),
}
for _agreement in ("dot", "distance"):  # the one-kernel dynamic routing, and the voting loop
    FUNCTIONS[f"dynamic_routing LinearVotes {_agreement}"] = (
        lambda agreement=_agreement: TF.dynamic_routing(LinearVotes(_votes(3, 5, 4, 2), _votes(2, 5, 2)),
                                                        agreement=agreement))
for _name in ("uniform_routing", "inverted_dot_product_routing", "self_attention_routing"):
    FUNCTIONS[f"{_name} LinearVotes"] = (
        lambda name=_name: getattr(TF, name)(LinearVotes(_votes(3, 5, 4, 2), _votes(2, 5, 2))))
    FUNCTIONS[f"{_name} SharedLinearVotes"] = (
        lambda name=_name: getattr(TF, name)(SharedLinearVotes(_votes(3, 4, 2), _votes(2, 5, 2))))
FUNCTIONS["dynamic_routing LinearVotes one pass"] = (
    lambda: TF.dynamic_routing(LinearVotes(_votes(3, 5, 4, 2), _votes(2, 5, 2)), iterations=1))


@pytest.mark.parametrize("strategy", ["blocked", "vectorized"])
def test_em_routing_runs_on_meta_with_every_eager_strategy(strategy):
    votes = _votes(2, 2, 3, 5, 4)
    ids = torch.tensor([[0, 1, 2, 3, 4], [3, 4, 5, 6, 7]])  # on the CPU: meta has no ids to compact
    poses, activations = em_routing(votes, torch.rand(2, 2, 5, device=META), _votes(3), 0.5,
                                    strategy=strategy, sender_groups=ids)
    (poses.sum() + activations.sum()).backward()
    assert poses.shape == (2, 2, 3, 4) and activations.shape == (2, 2, 3) and votes.grad.device == META


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_every_functional_entry_point_runs_forward_and_backward_on_meta(name):
    outputs = _forward_backward(lambda: FUNCTIONS[name]())
    assert all(t.device == META for t in outputs)


def test_sender_groups_on_meta_are_refused_by_name():
    # torch.unique and the check of the ids read values, which meta tensors do not have
    ids = torch.tensor([[0, 1, 2], [1, 2, 3]], device=META)
    with pytest.raises(ValueError, match="sender_groups on the meta device"):
        prepare_sender_groups(ids)


def test_sender_groups_prepared_on_the_cpu_move_to_the_votes_device():
    ids = torch.tensor([[5, 9, 7], [9, 7, 11]])
    cpu = prepare_sender_groups(ids)
    meta = prepare_sender_groups(ids, device=META)
    assert meta.ids.device == META and meta.patches.device == META and meta.count == cpu.count == 4
    assert cpu.ids.tolist() == [[0, 2, 1], [2, 1, 3]] and cpu.patches.tolist() == [[1, 2, 2], [2, 2, 1]]


def test_a_convolutional_em_layer_prepares_its_groups_without_reading_values(monkeypatch):
    # was: the ids were made on the votes' device and compacted there (two reads a GPU waits for,
    # and "Tensor.item() cannot be called on meta tensors" on meta); they now follow from the
    # grid's geometry, equal to the ids compacted (tests/test_graph_breaks.py compares them)
    def never(*args, **kwargs):
        raise AssertionError("prepare_sender_groups reads the ids' values")

    monkeypatch.setattr("torchvote.functional.em_kernel.prepare_sender_groups", never)
    layer = ConvMatrixCapsules(2, 3, kernel_size=3, pose_dim=4, iterations=2, device=META)
    grid = MatrixCapsules(torch.randn(2, 5, 5, 2, 2, 2, device=META), torch.rand(2, 5, 5, 2, device=META))
    out = layer(grid)
    layer(grid)  # prepared once per grid and device
    assert list(layer._prepared_groups) == [(5, 5, META)]
    assert out.poses.shape == (2, 3, 3, 3, 2, 2) and out.poses.device == META


@pytest.mark.parametrize("module", [MultiHeadAttention(8, 2, device=META),
                                    RoutingAttention(8, 2, iterations=2, device=META)],
                         ids=["softmax", "routing"])
def test_attention_with_a_causal_2d_mask_runs_on_meta(module: nn.Module):
    # is_causal_mask reads the mask with torch.equal, which has no meta kernel: a meta mask is
    # not recognised as causal and is applied as the mask it is (same shapes)
    x = torch.randn(2, 5, 8, device=META, requires_grad=True)
    output, weights = module(x, attn_mask=torch.ones(5, 5, dtype=torch.bool, device=META).tril(),
                             need_weights=True)
    output.sum().backward()
    assert output.shape == (2, 5, 8) and weights.shape == (2, 5, 5) and x.grad.device == META
    assert not TF.is_causal_mask(torch.ones(5, 5, dtype=torch.bool, device=META).tril())
    assert TF.is_causal_mask(torch.ones(5, 5, dtype=torch.bool).tril())


def test_a_router_given_votes_of_another_dtype_on_meta_still_names_them():
    # the router asks whether autocast is on only on a mismatch, and only where autocast exists:
    # torch.is_autocast_enabled("meta") raises a RuntimeError that names nothing
    router = InvertedDotProductRouter(out_dim=6, device=META)
    with pytest.raises(TypeError, match="votes have dtype torch.float64 but the router's parameters"):
        router(torch.randn(2, 3, 5, 6, device=META, dtype=torch.float64))
