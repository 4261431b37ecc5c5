"""``torch.func`` transforms and forward-mode AD on the layers whose CPU default runs a custom kernel.

``CapsuleLinear``'s streamed votes and dynamic routing kernel, EM's blocked strategy and the
convolutional layer's unformed votes, and float16 attention weights are autograd Functions that
write into buffers they allocate: no transform can run them, so under one (and under forward-mode
AD) the library computes the same numbers with plain differentiable operations
(``torchvote.tracing.plain_ops_required``). Each transform is checked, in float64, against the eager
layer (which runs the kernels) differentiated by ``torch.autograd``: per-sample gradients against
a loop of ``torch.autograd.grad`` over the examples, Jacobians against
``torch.autograd.functional.jacobian``, ``jvp`` against that Jacobian times the tangent, ``vmap``
against the batched call.

Attention without weights runs ``F.scaled_dot_product_attention``, whose fused CPU kernel has no
forward-mode AD: under a transform ``vote`` asks for its math kernel. Slot attention's GRU update
runs as plain operations under a transform: ``vmap(grad(...))`` of ``nn.GRUCell``'s parameters
failed in PyTorch's batching fallback for ``gru_cell``, and CUDA's fused GRU cell has no
forward-mode derivative.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.func import functional_call, grad, jacrev, jvp, vmap

from conftest import routing_passes
from torchvote.functional import list_routers, softmax_attention
from torchvote.functional.routing import dynamic_routing
from torchvote.functional.routing_votes import LinearVotes
from torchvote.nn.attention import MultiHeadAttention
from torchvote.nn.capsules import CapsuleLinear
from torchvote.nn.em_capsules import ClassMatrixCapsules, ConvMatrixCapsules, MatrixCapsules

DOUBLE = torch.float64
ROUTERS = sorted(list_routers())
BATCH = 3


def _probe(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Fixed weights for a scalar loss through every output entry."""
    return torch.linspace(-1.0, 1.5, int(torch.Size(shape).numel()), dtype=DOUBLE, device=device).view(shape)


def _per_sample_check(module, example, inputs, device):
    """``vmap(grad)`` of the parameters, per example, against a loop of ``torch.autograd.grad``
    on the eager module. ``example(module_or_call, params, *one)`` -> the outputs of one example.
    Frozen parameters (``requires_grad=False``) are left out."""
    trained = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    params = {name: p.detach() for name, p in trained}
    probe = _probe(tuple(example(module, params, *[x[0] for x in inputs]).shape), device)

    def loss(p, *one):
        return (example(module, p, *one) * probe).sum()

    batched = vmap(grad(loss), in_dims=(None, *[0] * len(inputs)))(params, *inputs)
    for k in range(BATCH):
        expected = torch.autograd.grad(
            (example(module, dict(trained), *[x[k] for x in inputs]) * probe).sum(),
            [p for _, p in trained],
        )
        for (name, got), want in zip(batched.items(), expected, strict=True):
            torch.testing.assert_close(got[k], want, msg=lambda m, name=name: f"{name}: {m}")


def _input_transforms_check(function, x, device):
    """``jacrev``, ``jvp`` (``torch.func`` and ``torch.autograd.forward_ad``) and ``vmap`` of
    ``function`` (one example -> outputs) against the eager Jacobian and batched calls."""
    expected = torch.autograd.functional.jacobian(function, x[0])  # the eager kernels, reversed
    torch.testing.assert_close(jacrev(function)(x[0]), expected)
    tangent = torch.randn(x[0].shape, dtype=DOUBLE, generator=torch.Generator().manual_seed(1)).to(device)
    directional = (expected.reshape(-1, x[0].numel()) @ tangent.flatten()).view_as(function(x[0]))  # J t
    value, derivative = jvp(function, (x[0],), (tangent,))
    torch.testing.assert_close(value, function(x[0]))
    torch.testing.assert_close(derivative, directional)
    with fwAD.dual_level():
        dual = function(fwAD.make_dual(x[0], tangent))
        torch.testing.assert_close(fwAD.unpack_dual(dual).tangent, directional)
    torch.testing.assert_close(vmap(function)(x), torch.stack([function(one) for one in x]))


def _capsule_layer(routing: str, strategy: str, device: torch.device) -> CapsuleLinear:
    torch.manual_seed(0)
    passes = routing_passes(routing, 3)  # unset for a one-pass router
    return CapsuleLinear(5, 3, 3, 4, routing=routing, iterations=passes, strategy=strategy,
                         init_std=0.5, dtype=DOUBLE).to(device)


def _capsule_example(layer, params, inputs):
    """One example ``(in_caps, in_dim)`` -> its outputs and couplings, flattened."""
    result = functional_call(layer, params, (inputs[None],), {"return_routing": True})
    return torch.cat([result.outputs.flatten(), result.couplings.flatten()])


@pytest.mark.parametrize("routing", ROUTERS)
@pytest.mark.parametrize("strategy", ["auto", "stream", "materialize"])
def test_capsule_linear_per_sample_gradients_equal_the_loop(routing, strategy, device):
    layer = _capsule_layer(routing, strategy, device)
    inputs = torch.randn(BATCH, 5, 3, dtype=DOUBLE, device=device)
    _per_sample_check(layer, _capsule_example, [inputs], device)


@pytest.mark.parametrize("routing", ROUTERS)
@pytest.mark.parametrize("strategy", ["auto", "stream"])
def test_capsule_linear_input_transforms_equal_autograd(routing, strategy, device):
    layer = _capsule_layer(routing, strategy, device)
    params = dict(layer.named_parameters())
    inputs = torch.randn(BATCH, 5, 3, dtype=DOUBLE, device=device)
    _input_transforms_check(lambda x: _capsule_example(layer, params, x), inputs, device)


def _slot_attention_example(module, params, inputs, slots):
    """One example ``(inputs, input_dim)`` with its initial slots -> the slots and attention."""
    options = {"slots": slots[None], "return_attention": True}
    new, attention = functional_call(module, params, (inputs[None],), options)
    return torch.cat([new.flatten(), attention.flatten()])


def test_slot_attention_under_transforms_equals_autograd(device):
    """Per-sample gradients, jacrev, jvp and vmap of ``nn.SlotAttention`` (its GRU update in plain
    operations under a transform) against the eager module (``nn.GRUCell``) differentiated by
    ``torch.autograd``; no batching fallback on the way (PyTorch warns of one for ``gru_cell``)."""
    from torchvote.nn import SlotAttention

    torch.manual_seed(0)
    module = SlotAttention(3, 4, slot_dim=5, iterations=3, hidden_dim=6, dtype=DOUBLE).to(device)
    module.slots_mu.requires_grad_(False)  # the slots are given: the sampling's parameters are unused
    module.slots_log_sigma.requires_grad_(False)
    inputs = torch.randn(BATCH, 7, 4, dtype=DOUBLE, device=device)
    slots = torch.randn(BATCH, 3, 5, dtype=DOUBLE, device=device)
    params = dict(module.named_parameters())
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*performance drop.*")
        _per_sample_check(module, _slot_attention_example, [inputs, slots], device)
        one = slots[0]
        _input_transforms_check(lambda x: _slot_attention_example(module, params, x, one), inputs, device)


@pytest.mark.parametrize("detach_votes", [False, True])
def test_dynamic_kernel_with_bias_and_detached_votes_under_transforms(detach_votes, device):
    """The kernel's passes in einsums: the bias in every pass, detached votes in all but the last,
    the couplings of every pass; per-sample gradients of weight and bias, and jvp in the inputs."""
    torch.manual_seed(1)
    weight = torch.randn(3, 5, 4, 2, dtype=DOUBLE, device=device) * 0.7
    bias = torch.randn(3, 4, dtype=DOUBLE, device=device)
    inputs = torch.randn(BATCH, 5, 2, dtype=DOUBLE, device=device)

    def route(w, b, x):  # one example (5, 2) -> outputs and the couplings of every pass
        outputs, couplings = dynamic_routing(LinearVotes(w, x[None]), iterations=3, bias=b,
                                             detach_votes=detach_votes, all_passes=True)
        return torch.cat([outputs.flatten(), couplings.flatten()])

    probe = _probe(tuple(route(weight, bias, inputs[0]).shape), device)
    batched = vmap(grad(lambda w, b, x: (route(w, b, x) * probe).sum(), argnums=(0, 1)),
                   in_dims=(None, None, 0))(weight, bias, inputs)
    for k in range(BATCH):
        leaves = [weight.clone().requires_grad_(True), bias.clone().requires_grad_(True)]
        expected = torch.autograd.grad((route(*leaves, inputs[k]) * probe).sum(), leaves)
        torch.testing.assert_close(batched[0][k], expected[0])
        torch.testing.assert_close(batched[1][k], expected[1])
    _input_transforms_check(lambda x: route(weight, bias, x), inputs, device)


def _grid(batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Poses ``(batch, 3, 3, 2, 2, 2)`` and activations ``(batch, 3, 3, 2)``."""
    generator = torch.Generator().manual_seed(2)
    poses = torch.randn(batch, 3, 3, 2, 2, 2, dtype=DOUBLE, generator=generator)
    activations = torch.rand(batch, 3, 3, 2, dtype=DOUBLE, generator=generator)
    return poses.to(device), activations.to(device)


def _matrix_example(layer, params, poses, activations):
    out = functional_call(layer, params, (MatrixCapsules(poses[None], activations[None]),))
    return torch.cat([out.poses.flatten(), out.activations.flatten()])


def _matrix_layer(kind: str, strategy: str, device: torch.device):
    torch.manual_seed(3)
    if kind == "conv":  # joint normalisation over every patch holding an input capsule
        return ConvMatrixCapsules(2, 2, kernel_size=2, stride=1, pose_dim=4, strategy=strategy,
                                  dtype=DOUBLE).to(device)
    return ClassMatrixCapsules(2, 3, pose_dim=4, strategy=strategy, dtype=DOUBLE).to(device)


@pytest.mark.parametrize("kind", ["conv", "class"])
@pytest.mark.parametrize("strategy", ["auto", "vectorized"])
def test_em_layers_under_transforms_equal_autograd(kind, strategy, device):
    layer = _matrix_layer(kind, strategy, device)
    poses, activations = _grid(BATCH, device)
    _per_sample_check(layer, _matrix_example, [poses, activations], device)
    params = dict(layer.named_parameters())
    _input_transforms_check(lambda p: _matrix_example(layer, params, p, activations[0]), poses, device)


def test_a_conv_em_layer_first_called_under_a_transform_works_and_copies_afterwards(device):
    """The layer kept the sender groups it prepared under its first call, as the transform's
    wrapped tensors: after a nested transform every later transform failed (functorch's level
    assertion) and the layer could no longer be copied, pickled or saved."""
    import copy
    import pickle

    from torch.func import hessian

    layer = _matrix_layer("conv", "auto", device)
    poses, activations = _grid(1, device)

    def loss(p):
        out = layer(MatrixCapsules(p, activations))
        return out.poses.square().sum() + out.activations.square().sum()

    second = hessian(loss)(poses)  # the layer's first call
    leaf = poses.clone().requires_grad_(True)
    expected = torch.autograd.grad(loss(leaf), leaf)[0]
    torch.testing.assert_close(grad(loss)(poses), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(hessian(loss)(poses), second, rtol=1e-12, atol=1e-12)
    twin = copy.deepcopy(layer)
    pickle.dumps(layer)
    torch.testing.assert_close(twin(MatrixCapsules(poses, activations)).poses,
                               layer(MatrixCapsules(poses, activations)).poses)


@pytest.mark.parametrize("strategy", ["auto", "materialize"])
def test_dynamic_routing_reverse_over_forward_equals_forward_over_reverse(strategy, device):
    """The plain-ops path of streamed dynamic routing (a CPU's default under transforms) added
    each pass's agreement into the logits in place: jacrev(jvp(...)) (a Hessian-vector product,
    the gradient of a JVP-based loss) failed with "modified by an inplace operation"."""
    torch.manual_seed(4)
    layer = CapsuleLinear(5, 3, 3, 4, routing="dynamic", iterations=3, dtype=DOUBLE, strategy=strategy)
    layer = layer.to(device)
    x = torch.randn(2, 5, 3, dtype=DOUBLE, device=device)
    tangent = torch.randn_like(x)

    def loss(y):
        return layer(y).square().sum()

    reverse_over_forward = jacrev(lambda y: jvp(loss, (y,), (tangent,))[1])(x)
    forward_over_reverse = jvp(grad(loss), (x,), (tangent,))[1]  # the same Hessian-vector product
    torch.testing.assert_close(reverse_over_forward, forward_over_reverse, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("transform", ["vmap", "grad", "jvp"])
@pytest.mark.parametrize("kind", ["conv", "class"])
def test_em_blocked_strategy_under_a_transform_names_the_way_out(kind, transform, device):
    layer = _matrix_layer(kind, "blocked", device)
    params = {name: p.detach() for name, p in layer.named_parameters()}
    poses, activations = _grid(BATCH, device)

    def one(p):
        return _matrix_example(layer, params, p, activations[0])

    run = {
        "vmap": lambda: vmap(lambda p, a: _matrix_example(layer, params, p, a))(poses, activations),
        "grad": lambda: grad(lambda p: one(p).sum())(poses[0]),
        "jvp": lambda: jvp(one, (poses[0],), (poses[0],)),
    }[transform]
    with pytest.raises(RuntimeError, match="strategy='vectorized'"):
        run()


def _attention(device: torch.device, dtype: torch.dtype = DOUBLE) -> MultiHeadAttention:
    torch.manual_seed(4)
    return MultiHeadAttention(8, 2, batch_first=True, dtype=dtype).to(device)


def _attention_example(module, params, x, need_weights=True):
    inputs, options = (x[None], x[None], x[None]), {"need_weights": need_weights}
    output, weights = functional_call(module, params, inputs, options)
    return output.flatten() if weights is None else torch.cat([output.flatten(), weights.flatten()])


@pytest.mark.parametrize("need_weights", [False, True])
def test_attention_per_sample_gradients_and_vmap(need_weights, device):
    module = _attention(device)
    x = torch.randn(BATCH, 4, 8, dtype=DOUBLE, device=device)
    _per_sample_check(module, lambda m, p, one: _attention_example(m, p, one, need_weights), [x], device)
    params = dict(module.named_parameters())  # without weights: the fused kernel, math under jvp
    _input_transforms_check(lambda one: _attention_example(module, params, one, need_weights), x, device)


def test_float16_attention_under_vmap_and_grad_matches_the_eager_kernel(device):
    """float16 attention weights (float16 logits, clamped in place to float16's range): the
    weights and outputs under ``vmap`` against the eager float16 call, and the per-sample
    gradients of the queries under ``vmap(grad)`` against the eager float16 backward of each
    sample, within one float16 spacing of the largest entry (the batched kernels may sum in
    another order)."""
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(BATCH, 2, 6, 4, generator=generator, dtype=DOUBLE).to(device).half() * 3
               for _ in range(3))
    batched = vmap(softmax_attention)(q, k, v)
    for got, want in zip(batched, softmax_attention(q, k, v), strict=True):
        torch.testing.assert_close(got, want)
    probe = _probe((2, 6, 6), device)

    def loss(a, b, c):  # summed in float64: only the attention rounds
        output, weights = softmax_attention(a, b, c)
        return output.double().sum() + (weights.double() * probe).sum()

    grads = vmap(grad(loss))(q, k, v)
    for n in range(BATCH):
        query = q[n].clone().requires_grad_(True)
        (eager,) = torch.autograd.grad(loss(query, k[n], v[n]), query)
        spacing = 2.0**-10 * eager.abs().max().item()  # float16's relative spacing, at the largest entry
        torch.testing.assert_close(grads[n], eager, rtol=0, atol=spacing)
