"""One :class:`LinearVotes` routed more than once gives what fresh votes give, outputs and
gradients, whatever happened between the calls: a call under ``no_grad`` or ``inference_mode``, an
in-place change of the weight or the inputs (an optimizer step), ``.data`` assigned, the inputs
switched to ``requires_grad``. The votes keep the layouts their kernels read (and the squared norms
of the distance agreement) from one read to the next; ``explain.from_run`` routes one votes object
for every prefix of the passes. The reference is always fresh votes of the same layer and inputs,
in float64; the last tests check that one call still forms the layouts once."""

from __future__ import annotations

import contextlib

import pytest
import torch

import torchvote.functional.routing_votes as routing_votes_module
import torchvote.nn as tvn
from torchvote.functional import LinearVotes, dynamic_routing

DOUBLE = torch.float64

# every router a CapsuleLinear streams LinearVotes to, with the options that change what they read
ROUTERS = [
    ("dynamic", {}),
    ("dynamic", {"agreement": "distance"}),  # reads squared_norm() every pass
    ("uniform", {}),
    ("inverted_dot_product", {}),
    ("self_attention", {}),
    ("slot", {}),
    ("em", {}),  # materialises the votes: nothing kept, checked all the same
]
ROUTER_IDS = [f"{name}-{options['agreement']}" if options else name for name, options in ROUTERS]


def _layer(routing: str, options: dict, seed: int = 0) -> tvn.CapsuleLinear:
    torch.manual_seed(seed)
    layer = tvn.CapsuleLinear(6, 4, 3, 5, routing=routing, strategy="stream", router_options=options or None)
    return layer.to(DOUBLE)


def _inputs(seed: int = 1, requires_grad: bool = True) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(2, 6, 4, dtype=DOUBLE, requires_grad=requires_grad)  # (b, j, e)


def _route(layer: tvn.CapsuleLinear, votes) -> torch.Tensor:
    """``(b, i, d + j)``: the outputs and the couplings of one call, so a loss reaches both."""
    activations = None
    if layer.router.uses_activations:  # EM routing
        activations = torch.ones(*votes.batch_shape, votes.senders, dtype=DOUBLE)
    result = layer.router(votes, activations=activations)
    return torch.cat([result.outputs, result.couplings], dim=-1)


def _loss(routed: torch.Tensor) -> torch.Tensor:
    probe = torch.linspace(-1, 1, routed.numel(), dtype=routed.dtype).view_as(routed)
    return (routed * probe).sum()


def _grads(layer: tvn.CapsuleLinear, inputs: torch.Tensor, routed: torch.Tensor) -> list[torch.Tensor | None]:
    """The gradients of the weight and the inputs of ``_loss(routed)`` (None where none reaches)."""
    sources = [layer.weight, inputs]
    return list(torch.autograd.grad(_loss(routed), sources, allow_unused=True))


def _check_against_fresh(layer: tvn.CapsuleLinear, inputs: torch.Tensor, routed: torch.Tensor) -> None:
    """``routed`` (from reused votes) against a fresh votes object: values, then gradients."""
    fresh = _route(layer, layer.votes(inputs))
    torch.testing.assert_close(routed, fresh, rtol=1e-12, atol=1e-12)
    assert routed.requires_grad == fresh.requires_grad
    if fresh.requires_grad:
        got, expected = _grads(layer, inputs, routed), _grads(layer, inputs, fresh)
        for name, g, e in zip(["weight", "inputs"], got, expected, strict=True):
            assert (g is None) == (e is None), f"{name}: gradient {g} where fresh votes give {e}"
            if e is not None:
                torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12, msg=f"{name} gradient")


@pytest.mark.parametrize(("routing", "options"), ROUTERS, ids=ROUTER_IDS)
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_a_call_without_grad_then_one_with(routing, options, mode):
    layer, inputs = _layer(routing, options), _inputs()
    votes = layer.votes(inputs)
    with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
        _route(layer, votes)
    routed = _route(layer, votes)
    assert routed.requires_grad
    _check_against_fresh(layer, inputs, routed)


@pytest.mark.parametrize(("routing", "options"), ROUTERS, ids=ROUTER_IDS)
def test_a_call_with_grad_then_one_without_keeps_no_graph(routing, options):
    layer, inputs = _layer(routing, options), _inputs()
    votes = layer.votes(inputs)
    _loss(_route(layer, votes)).backward()
    with torch.no_grad():
        routed = _route(layer, votes)
        torch.testing.assert_close(routed, _route(layer, layer.votes(inputs)), rtol=1e-12, atol=1e-12)
        assert not routed.requires_grad
        for read in (votes.gemm_inputs, votes.gemm_weight, votes.squared_norm()):
            assert read.grad_fn is None and not read.requires_grad  # as fresh votes read them here
    # and nothing the votes keep holds the first call's graph alive
    kept = [value for value in vars(votes).values() if isinstance(value, torch.Tensor)]
    kept += [entry[-1] for entry in getattr(votes, "_kept_tensors", {}).values()]
    assert all(t.grad_fn is None for t in kept)


@pytest.mark.parametrize(("routing", "options"), ROUTERS, ids=ROUTER_IDS)
@pytest.mark.parametrize("changed", ["weight", "inputs"])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no-grad"])
def test_an_in_place_change_between_calls(routing, options, changed, grad):
    layer, inputs = _layer(routing, options), _inputs()
    votes = layer.votes(inputs)
    with contextlib.nullcontext() if grad else torch.no_grad():
        _route(layer, votes)
        with torch.no_grad():
            (layer.weight if changed == "weight" else inputs).mul_(1.7).add_(0.1)
        routed = _route(layer, votes)
        _check_against_fresh(layer, inputs, routed)


@pytest.mark.parametrize(("routing", "options"), ROUTERS, ids=ROUTER_IDS)
def test_inference_tensors_changed_in_place_between_calls(routing, options):
    """Inference tensors have no version counter: an in-place change made in inference mode is seen
    all the same."""
    layer = _layer(routing, options)
    with torch.inference_mode():
        inputs = _inputs(requires_grad=False)  # made in inference mode: an inference tensor
        votes = layer.votes(inputs)
        _route(layer, votes)
        inputs.mul_(1.7).add_(0.1)
        fresh = _route(layer, layer.votes(inputs))
        torch.testing.assert_close(_route(layer, votes), fresh, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("routing", "options"), ROUTERS, ids=ROUTER_IDS)
def test_an_optimizer_step_between_calls(routing, options):
    layer, inputs = _layer(routing, options), _inputs()
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.5)
    votes = layer.votes(inputs)
    _loss(_route(layer, votes)).backward()
    optimizer.step()
    optimizer.zero_grad()
    _check_against_fresh(layer, inputs, _route(layer, votes))


@pytest.mark.parametrize(("routing", "options"), ROUTERS[:3], ids=ROUTER_IDS[:3])
def test_weight_data_assigned_between_calls(routing, options):
    """``.data =`` (what ``Module.to`` does to parameters) leaves the version counter as it was."""
    layer, inputs = _layer(routing, options), _inputs()
    votes = layer.votes(inputs)
    _route(layer, votes)
    layer.weight.data = layer.weight.data * 1.5 - 0.2
    _check_against_fresh(layer, inputs, _route(layer, votes))


@pytest.mark.parametrize(("routing", "options"), ROUTERS[:5], ids=ROUTER_IDS[:5])
def test_weight_data_assigned_again_and_again_between_calls(routing, options):
    """Weight decay written as ``w.data = w.data * 0.9``: once the old data is freed the allocator
    soon hands its address to new data (2-3 assignments here), and the key's data pointer and
    unchanged version then read the old layouts as current (inverted dot-product: outputs off by
    5e-2, the weight's gradient by 2e1). Assigned until the first call's address comes back (it
    may not: the kept layouts hold their source's storage), then checked against fresh votes."""
    layer, inputs = _layer(routing, options), _inputs()
    votes = layer.votes(inputs)
    _route(layer, votes)
    address = layer.weight.data_ptr()
    for _ in range(50):
        layer.weight.data = layer.weight.data * 0.9
        if layer.weight.data_ptr() == address:
            break
    _check_against_fresh(layer, inputs, _route(layer, votes))


def test_two_calls_with_their_own_backward_share_the_kept_graph_as_documented():
    """A distance agreement's kept squared norms carry their einsums' graph into the next call
    (LinearVotes' docstring): with retain_graph=True on the first backward, the second call's
    gradients are fresh votes' gradients."""
    layer, inputs = _layer("dynamic", {"agreement": "distance"}), _inputs()
    votes = layer.votes(inputs)
    _loss(_route(layer, votes)).backward(retain_graph=True)
    _check_against_fresh(layer, inputs, _route(layer, votes))


@pytest.mark.parametrize(("routing", "options"), ROUTERS, ids=ROUTER_IDS)
def test_inputs_switched_to_requires_grad_between_calls(routing, options):
    layer, inputs = _layer(routing, options), _inputs(requires_grad=False)
    votes = layer.votes(inputs)
    _route(layer, votes)
    inputs.requires_grad_(True)
    routed = _route(layer, votes)
    _check_against_fresh(layer, inputs, routed)


@pytest.mark.parametrize(("routing", "options"), ROUTERS, ids=ROUTER_IDS)
def test_weight_switched_to_requires_grad_between_calls(routing, options):
    """A frozen weight unfrozen between calls (fine-tuning a layer): the kept layouts of the frozen
    weight had no graph to it (mutation review: a key without the weight's flag went unnoticed)."""
    layer, inputs = _layer(routing, options), _inputs()
    layer.weight.requires_grad_(False)
    votes = layer.votes(inputs)
    _route(layer, votes)
    layer.weight.requires_grad_(True)
    routed = _route(layer, votes)
    _check_against_fresh(layer, inputs, routed)


def test_layouts_kept_under_inference_mode_are_not_read_outside_it():
    """Layouts formed under ``inference_mode`` are inference tensors, which an in-place update or a
    graph outside it refuses: a later read outside gets layouts of its own."""
    weight = torch.randn(3, 6, 5, 4, dtype=DOUBLE)
    votes = LinearVotes(weight, _inputs(requires_grad=False))
    with torch.inference_mode():
        assert votes.squared_norm().is_inference() and votes.gemm_inputs.is_inference()
    with torch.no_grad():
        assert not votes.squared_norm().is_inference() and not votes.gemm_inputs.is_inference()
        assert not votes.gemm_weight.is_inference()


def test_the_weight_layout_is_contiguous_with_one_sender():
    """Its docstring says contiguous; with one sender the reshaped weight was a strided view."""
    votes = LinearVotes(torch.randn(3, 1, 5, 4, dtype=DOUBLE), torch.randn(2, 1, 4, dtype=DOUBLE))
    assert votes.gemm_weight.is_contiguous()


def test_the_reviewers_repros():
    """The two reports, as written: a no_grad call left the next call without gradient, and
    inputs scaled in place between calls gave the old inputs' outputs."""
    torch.manual_seed(0)
    for routing in ["dynamic", "uniform"]:
        layer = tvn.CapsuleLinear(6, 4, 3, 5, routing=routing)
        x = torch.randn(2, 6, 4, requires_grad=True)
        votes = layer.votes(x)
        with torch.no_grad():
            layer.router(votes)
        out = layer.router(votes).outputs
        assert out.requires_grad, routing
        out.sum().backward()
        assert x.grad is not None and x.grad.abs().sum() > 0, routing
    weight, x = torch.randn(3, 6, 5, 4), torch.randn(2, 6, 4)
    votes = LinearVotes(weight, x)
    dynamic_routing(votes)
    x.mul_(3)
    torch.testing.assert_close(dynamic_routing(votes)[0], dynamic_routing(LinearVotes(weight, x))[0])


def test_reads_with_nothing_changed_are_the_same_tensors():
    weight = torch.randn(3, 6, 5, 4, dtype=DOUBLE, requires_grad=True)
    votes = LinearVotes(weight, _inputs())
    for mode in (contextlib.nullcontext, torch.no_grad):
        with mode():
            assert votes.gemm_inputs is votes.gemm_inputs
            assert votes.gemm_weight is votes.gemm_weight
            assert votes.squared_norm() is votes.squared_norm()


@pytest.mark.parametrize(("routing", "options"), [("inverted_dot_product", {}), ("self_attention", {}),
                                                ("dynamic", {"agreement": "distance"})],
                         ids=["inverted_dot_product", "self_attention", "dynamic-distance"])
@pytest.mark.parametrize("mode", ["grad", "no_grad"])
def test_one_call_forms_the_layouts_once(routing, options, mode, monkeypatch):
    """Every product of one multi-pass call reads the same layout tensors: none is formed again
    per pass (the cost the kept layouts save)."""
    seen: dict[str, set[int]] = {"inputs": set(), "weight": set()}

    def recording(function, inputs_at: int, weight_at: int):
        apply = function.apply

        def run(*args):
            seen["inputs"].add(id(args[inputs_at]))
            seen["weight"].add(id(args[weight_at]))
            return apply(*args)

        return run

    weighted_sum, dot = routing_votes_module._LinearWeightedSum, routing_votes_module._LinearDot
    monkeypatch.setattr(weighted_sum, "apply", recording(weighted_sum, 1, 2))  # (couplings, inputs, weight)
    monkeypatch.setattr(dot, "apply", recording(dot, 0, 1))  # (inputs, weight, outputs)
    layer, inputs = _layer(routing, options), _inputs()
    votes = layer.votes(inputs)
    norms: list[int] = []
    squared_norm = votes.squared_norm

    def recorded_squared_norm():
        norms.append(id(result := squared_norm()))
        return result

    votes.squared_norm = recorded_squared_norm  # the distance agreement reads it every pass
    with contextlib.nullcontext() if mode == "grad" else torch.no_grad():
        _route(layer, votes)
    assert len(seen["inputs"]) == 1 and len(seen["weight"]) == 1
    assert len(set(norms)) == (1 if options else 0)
    assert len(norms) == (layer.router.iterations - 1 if options else 0)  # one read per agreement
