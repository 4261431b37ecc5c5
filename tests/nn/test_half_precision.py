"""Every exported module of ``torchvote.nn`` in float16, in bfloat16, and in float32 under
``torch.autocast(device.type, dtype=torch.bfloat16)``: forward and backward finite, outputs in the
expected dtype, and close to float32. On ``--device`` (the CPU unless given; the reference runs
there too).

The sweep reuses the construction table of ``test_factory_kwargs.py`` (every exported module,
found by introspection there). The reference of a half run is the same module in float32 with its
parameters and inputs rounded to the half dtype, so only the rounding of the half run's
intermediate results is compared; under autocast the reference is the float32 module on the float32
inputs (autocast rounds each op's inputs itself).

Tolerance: ``4 * eps * max|reference|``, with ``eps = 2**-7`` for bfloat16 (8 significant bits)
and ``2**-10`` for float16. Each output passes through a few half-precision roundings (the votes or
projections, the weighted sum, the nonlinearity or normalisation, an output projection), each at
most ``eps / 2`` of the largest value involved; 4 eps leaves a factor of about 2 over the largest
error measured (1.7 eps: bfloat16 routing attention under autocast). The softmax and log-sum-exp
statistics are float32 (checked tightly in ``tests/functional/test_precision_claims.py``), so the
weights add no more than one rounding.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor

from torchvote.nn import ClassMatrixCapsules, ConvMatrixCapsules, PrimaryMatrixCapsules

from .test_factory_kwargs import ALL_CASES, _outputs, place

BF16, FP16 = torch.bfloat16, torch.float16
MODES = {"bfloat16": BF16, "float16": FP16, "autocast": BF16}


def _leaves(value) -> list[Tensor]:
    """The floating tensors in ``value`` (tensors, tuples, ``MatrixCapsules``, dataclasses)."""
    return [t for t in _outputs(value) if t.is_floating_point()]


def _tolerance(dtype: torch.dtype, reference: Tensor) -> dict[str, float]:
    return {"rtol": 0.0, "atol": 4 * torch.finfo(dtype).eps * reference.abs().max().item() + 1e-6}


def _inputs(case, cls_name: str, device: torch.device):
    args, kwargs = case.inputs(torch.float32)
    if cls_name == "SlotAttention":  # given slots: the sampled ones would differ between the runs
        kwargs = {**kwargs, "slots": torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1))}
    return place((args, kwargs), device=device)


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("case", ALL_CASES)
def test_every_module_in_half_precision_is_finite_in_its_dtype_and_close_to_float32(case, mode, device):
    dtype = MODES[mode]
    torch.manual_seed(0)
    module = case.build().eval().to(device)
    name = type(module).__name__
    args, kwargs = _inputs(case, name, device)
    if mode == "autocast":
        reference_module, reference_args, reference_kwargs = module, args, kwargs
        inputs = [t.requires_grad_() for t in _leaves(args)]
        with torch.autocast(device.type, dtype=dtype):
            outputs = _leaves(module(*args, **kwargs))
        allowed = {dtype, torch.float32}  # autocast decides op by op
    else:
        half = copy.deepcopy(module).to(dtype)
        reference_module = copy.deepcopy(half).float()
        half_args, half_kwargs = place((args, kwargs), dtype=dtype)
        reference_args, reference_kwargs = place((half_args, half_kwargs), dtype=torch.float32)
        inputs = [t.requires_grad_() for t in _leaves(half_args)]
        outputs = _leaves(half(*half_args, **half_kwargs))
        allowed = {dtype}
    expected = _leaves(reference_module(*reference_args, **reference_kwargs))
    assert len(outputs) == len(expected)
    for output, reference in zip(outputs, expected, strict=True):
        assert output.dtype in allowed, (name, output.dtype)
        assert torch.isfinite(output).all(), name
        torch.testing.assert_close(output.float(), reference, **_tolerance(dtype, reference))
    sum(t.float().sum() for t in outputs if t.requires_grad).backward()  # outside autocast
    for tensor in inputs:
        assert tensor.grad is None or torch.isfinite(tensor.grad).all(), name


@pytest.mark.parametrize("strategy", ["blocked", "vectorized"])
@pytest.mark.parametrize("normalization", ["joint", "per_patch"])
def test_a_matrix_capsule_network_trains_under_bfloat16_autocast(strategy, normalization, device):
    """Primary, convolutional and class matrix capsules, as ``EMCapsNet`` stacks them, under the
    training loop's ``bf16`` autocast. Was: the primary capsules' bfloat16 poses met the float32
    vote factors in an ``out=`` product ("Expected out tensor to have dtype float"), and the blocked
    strategy's backward failed ("expected scalar type Float but found BFloat16")."""
    torch.manual_seed(0)
    layers = torch.nn.Sequential(
        PrimaryMatrixCapsules(3, 2, pose_dim=4),
        ConvMatrixCapsules(2, 3, kernel_size=3, pose_dim=4, iterations=2, strategy=strategy,
                           normalization=normalization),
        ClassMatrixCapsules(3, 4, pose_dim=4, iterations=2, strategy=strategy),
    ).to(device)
    images = torch.randn(2, 3, 7, 7).to(device).requires_grad_()
    expected = layers(images)
    with torch.autocast(device.type, dtype=BF16):
        poses, activations = layers(images)
    for output, reference in ((poses, expected.poses), (activations, expected.activations)):
        # routed results come back in the float32 layers' dtype (routed_in_dtype), though the
        # class votes' einsum runs in autocast's
        assert output.dtype == torch.float32 and torch.isfinite(output).all()
        # bfloat16 images and weights: the input rounding counts too (autocast rounds them)
        torch.testing.assert_close(output.float(), reference, **_tolerance(BF16, reference))
    (poses.float().pow(2).sum() + activations.float().sum()).backward()
    assert torch.isfinite(images.grad).all()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layers.parameters()
               if p.requires_grad and p.grad is not None)
