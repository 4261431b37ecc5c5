"""CapsuleLinear's routing strategies: the same numbers from every kernel, and what "auto" picks.

The kernels run on ``--device`` (the CPU unless given): "auto" streams on a CPU and materialises
on a GPU, so it is the device that decides which kernel ``auto`` compares with ``stream``.
"""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch

from torchvote.nn import routing_strategy
from torchvote.nn.capsules import CapsuleLinear
from torchvote.nn.routing_strategy import MATERIALIZE_BUDGET_BYTES, choose_strategy

DOUBLE = torch.float64
CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # devices as values: no CUDA needed


def _run(layer: CapsuleLinear, inputs: torch.Tensor):
    """Outputs, couplings, and the gradients of a loss of both w.r.t. the inputs and the weight."""
    inputs = inputs.clone().requires_grad_(True)
    result = layer(inputs, return_routing=True)
    ramp = torch.linspace(0, 1, result.couplings.shape[-1], dtype=DOUBLE, device=inputs.device)  # (j,)
    loss = result.outputs.pow(2).sum() + (result.couplings * ramp).sum()
    grad_x, grad_w = torch.autograd.grad(loss, [inputs, layer.weight])
    return result.outputs, result.couplings, grad_x, grad_w


def _pair(
    strategy: str, routing: str, shared: bool, device: torch.device = CPU
) -> tuple[CapsuleLinear, CapsuleLinear]:
    """The stream strategy's layer and one of ``strategy`` with its weights, both on ``device``."""
    torch.manual_seed(0)
    reference = CapsuleLinear(7, 3, 4, 5, routing=routing, shared_weights=shared, strategy="stream",
                              init_std=0.5, dtype=DOUBLE)
    layer = CapsuleLinear(7, 3, 4, 5, routing=routing, shared_weights=shared, strategy=strategy, dtype=DOUBLE)
    layer.load_state_dict(reference.state_dict())
    return reference.to(device), layer.to(device)


def _run_on_broadcast_votes(layer: CapsuleLinear, inputs: torch.Tensor):
    """:func:`_run`'s results with the votes formed by a broadcast product and routed by the
    layer's router on that tensor (checked against the papers' loops elsewhere): no strategy of
    the layer's takes part."""
    inputs = inputs.clone().requires_grad_(True)
    weight = layer.weight.unsqueeze(1) if layer.shared_weights else layer.weight  # (i, j | 1, d, e)
    votes = (weight * inputs[..., None, :, None, :]).sum(-1)  # (..., i, j, d)
    result = layer.router(votes)
    ramp = torch.linspace(0, 1, result.couplings.shape[-1], dtype=DOUBLE, device=inputs.device)  # (j,)
    loss = result.outputs.pow(2).sum() + (result.couplings * ramp).sum()
    grad_x, grad_w = torch.autograd.grad(loss, [inputs, layer.weight])
    return result.outputs, result.couplings, grad_x, grad_w


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("routing", ["dynamic", "inverted_dot_product", "self_attention", "uniform"])
@pytest.mark.parametrize("strategy", ["stream", "materialize", "auto"])
def test_every_strategy_gives_the_numbers_of_votes_formed_outright(strategy, routing, shared, device):
    """Each strategy (``auto``: stream on a CPU, materialize on CUDA) against the router on votes
    formed by a broadcast product (the "auto" case compared the stream with itself on a CPU)."""
    _, layer = _pair(strategy, routing, shared, device)
    inputs = torch.randn(2, 3, 7, 3, dtype=DOUBLE).to(device)  # two batch axes
    ours, theirs = _run(layer, inputs), _run_on_broadcast_votes(layer, inputs)
    for mine, reference_value in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, reference_value, rtol=1e-10, atol=1e-12)
    # and one layout: the stream's outputs were a view that refused .view(b, -1)
    assert all(result.is_contiguous() for result in (*ours[:2], *theirs[:2]))


@pytest.mark.slow  # about 30 s of compiling per case on a 2-core CPU
@pytest.mark.parametrize(("routing", "shared"), [("dynamic", False), ("dynamic", True),
                                                 ("inverted_dot_product", False)])
def test_compiled_strategy_gives_the_stream_numbers(routing, shared, device, compiler):
    """Compiled against streamed, for dynamic routing and one other router (compiling each of the
    six costs half a minute here)."""
    reference, layer = _pair("compiled", routing, shared, device)
    inputs = torch.randn(2, 7, 3, dtype=DOUBLE).to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback: the compiled function ran
        first = _run(layer, inputs)
    assert callable(layer._compiled)
    for ours, theirs in zip(first, _run(reference, inputs), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
    for ours, theirs in zip(_run(layer, inputs), first, strict=True):  # the cached function
        torch.testing.assert_close(ours, theirs)


def test_compiled_strategy_falls_back_with_a_warning(monkeypatch):
    def broken(fn):
        def run(*args):
            raise RuntimeError("no compiler here")
        return run

    monkeypatch.setattr(routing_strategy.torch, "compile", broken)
    reference, layer = _pair("compiled", "dynamic", False)
    inputs = torch.randn(2, 7, 3, dtype=DOUBLE)
    with pytest.warns(RuntimeWarning, match="no compiler here"):
        ours = _run(layer, inputs)
    assert layer._compiled is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once
        again = _run(layer, inputs)
    for a, b, c in zip(ours, again, _run(reference, inputs), strict=True):
        torch.testing.assert_close(a, c)
        torch.testing.assert_close(b, c)


def test_a_layer_with_a_compiled_route_still_pickles():
    layer = CapsuleLinear(7, 3, 4, 5, strategy="compiled")
    layer._compiled = lambda *args: None  # stands for a compiled function
    copy = pickle.loads(pickle.dumps(layer))
    assert copy._compiled is None and copy.strategy == "compiled"


def test_auto_picks_by_device_and_size():
    small, large = 1 << 20, MATERIALIZE_BUDGET_BYTES + 1
    assert choose_strategy("auto", device=CPU, vote_bytes=small) == "stream"
    assert choose_strategy("auto", device=CUDA, vote_bytes=small) == "materialize"
    assert choose_strategy("auto", device=CUDA, vote_bytes=large) == "stream"
    for forced in ("materialize", "stream", "compiled"):
        assert choose_strategy(forced, device=CPU, vote_bytes=large) == forced


def test_auto_streams_the_votes_on_a_cpu_and_materialises_them_on_a_gpu(monkeypatch, device):
    layer = CapsuleLinear(7, 3, 4, 5).to(device)
    assert layer.strategy == "auto"
    if device.type == "cpu":
        monkeypatch.setattr(layer, "_route_materialized", lambda *args: pytest.fail("materialised on a CPU"))
    else:  # small votes: materialised
        monkeypatch.setattr(layer, "votes", lambda inputs: pytest.fail(f"streamed on {device}"))
    assert layer(torch.randn(2, 7, 3).to(device)).shape == (2, 4, 5)


def test_materialize_strategy_never_streams(monkeypatch, device):
    layer = CapsuleLinear(7, 3, 4, 5, strategy="materialize").to(device)
    monkeypatch.setattr(layer, "votes", lambda inputs: pytest.fail("streamed"))
    assert layer(torch.randn(2, 7, 3).to(device)).shape == (2, 4, 5)


@pytest.mark.parametrize("routing", ["dynamic", "uniform", "inverted_dot_product", "self_attention"])
def test_double_backward_needs_materialised_votes_and_the_streamed_ones_say_so(routing):
    """Streamed votes let grad(create_graph=True) return a detached first derivative; the second
    then failed with autograd's "appears to not have been used in the graph" (or "differentiate
    twice a function marked once_differentiable"). Materialised votes give the second derivative,
    equal to a finite difference of the first (float64)."""
    torch.manual_seed(0)
    layer = CapsuleLinear(5, 4, 3, 4, routing=routing, strategy="stream", init_std=0.5, dtype=torch.float64)
    x = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="differentiated once only.*strategy='materialize'"):
        torch.autograd.grad(layer(x).square().sum(), x, create_graph=True)
    layer.strategy = "materialize"

    def penalty() -> torch.Tensor:  # the squared input gradient of the layer's output energy
        (grad,) = torch.autograd.grad(layer(x).square().sum(), x, create_graph=True)
        return grad.square().sum()

    (second,) = torch.autograd.grad(penalty(), layer.weight)
    direction = torch.randn_like(layer.weight)
    with torch.no_grad():
        layer.weight += 1e-6 * direction
    above = penalty().item()
    with torch.no_grad():
        layer.weight -= 2e-6 * direction
    below = penalty().item()
    assert (second * direction).sum().item() == pytest.approx((above - below) / 2e-6, rel=1e-4)


@pytest.mark.parametrize("routing", ["dynamic", "inverted_dot_product"])
@pytest.mark.parametrize("batched", ["is_grads_batched", "jacobian"])
def test_batched_gradients_need_materialised_votes_and_the_streamed_ones_say_so(routing, batched):
    """Batched gradients run the backward alone under vmap (the forward ran on the kernels): the
    streamed products failed inside with "Batching rule not implemented for aten::alias".
    Materialised votes give every row of the Jacobian, each equal to its own backward."""
    torch.manual_seed(0)
    layer = CapsuleLinear(5, 4, 3, 4, routing=routing, strategy="stream", init_std=0.5, dtype=torch.float64)
    x = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)

    def jacobian() -> torch.Tensor:  # (2 * 4, 2, 5, 4): d(outputs' sums) / d(inputs)
        if batched == "jacobian":
            return torch.autograd.functional.jacobian(lambda x: layer(x).sum(-1).flatten(), x, vectorize=True)
        out = layer(x).sum(-1).flatten()
        return torch.autograd.grad(out, x, torch.eye(out.numel(), dtype=x.dtype), is_grads_batched=True)[0]

    with pytest.raises(RuntimeError, match="one gradient at a time.*'materialize'.*is_grads_batched"):
        jacobian()
    layer.strategy = "materialize"
    out = layer(x).sum(-1).flatten()
    rows = torch.stack([torch.autograd.grad(value, x, retain_graph=True)[0] for value in out])
    torch.testing.assert_close(jacobian(), rows, rtol=1e-12, atol=1e-12)


def test_an_unknown_strategy_is_rejected_by_name():
    with pytest.raises(ValueError, match="strategy"):
        CapsuleLinear(7, 3, 4, 5, strategy="fast")


@pytest.mark.parametrize("strategy", ["materialize", "stream"])
def test_every_strategy_runs_under_bfloat16_autocast(strategy, device):
    torch.manual_seed(0)
    layer = CapsuleLinear(7, 3, 4, 5, strategy=strategy, init_std=0.5).to(device)
    inputs = torch.randn(2, 7, 3).to(device).requires_grad_()
    exact = layer(inputs)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        mixed = layer(inputs)
    mixed.float().pow(2).sum().backward()
    assert inputs.grad is not None and layer.weight.grad is not None
    if strategy == "stream":  # the streamed kernels compute in the weight's float32
        torch.testing.assert_close(mixed, exact)
    else:  # votes in bfloat16
        torch.testing.assert_close(mixed.float(), exact, rtol=3e-2, atol=3e-2)


def test_a_compiled_layer_takes_new_batch_sizes_without_compiling_each(compiler):
    """Under torch.compile "auto" streamed on a CPU, whose kernels tile the batch in Python: each
    batch size compiled a graph of its own (dynamic shapes never engaged; after eight, eager). It
    now materialises the votes while tracing: one static graph, then one dynamic one."""
    import torch._dynamo

    from torchvote.nn.routing_strategy import choose_strategy

    assert choose_strategy("auto", device=CPU, vote_bytes=1024) == "stream"  # eager: unchanged
    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch.manual_seed(0)
    layer = CapsuleLinear(8, 4, 3, 5)
    compiled = torch.compile(layer, backend="eager")  # tracing only: no code generated
    for batch in (2, 3, 4, 5, 7):
        inputs = torch.randn(batch, 8, 4)
        torch.testing.assert_close(compiled(inputs), layer(inputs))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before <= 2
