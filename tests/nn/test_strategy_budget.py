"""How large the votes ``"auto"`` materialises may be: by the device's memory on CUDA (a fixed
1 GiB sent a 141 GB GPU to the CPU-tuned streamed kernels at CapsNet's batch 2048), and counted
in the dtype autocast computes them in."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import torchvote.nn.capsules as capsules_module
from torchvote.nn import CapsuleLinear
from torchvote.nn.routing_strategy import MATERIALIZE_BUDGET_BYTES, choose_strategy, materialize_budget

CUDA = torch.device("cuda")
GIB = 1 << 30


@pytest.fixture
def gpu_of(monkeypatch):
    """``gpu_of(bytes)``: CUDA reported available, its device ``bytes`` large (no GPU needed)."""

    def install(total_memory: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(
            total_memory=total_memory))

    return install


def test_a_large_gpu_materialises_what_a_fixed_gib_streamed(gpu_of):
    capsnet_batch_2048 = 2048 * 10 * 1152 * 16 * 4  # the votes' bytes, 1.41 GiB
    gpu_of(141 * 10**9)
    assert materialize_budget(CUDA) == 141 * 10**9 // 16
    assert choose_strategy("auto", device=CUDA, vote_bytes=capsnet_batch_2048) == "materialize"
    assert choose_strategy("auto", device=CUDA, vote_bytes=141 * 10**9 // 16 + 1) == "stream"


def test_a_small_gpu_and_other_devices_keep_the_gib_floor(gpu_of):
    assert materialize_budget(torch.device("cpu")) == MATERIALIZE_BUDGET_BYTES == GIB
    assert materialize_budget(torch.device("meta")) == GIB
    gpu_of(8 * GIB)  # a sixteenth is 512 MiB: the floor wins
    assert materialize_budget(CUDA) == GIB


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_votes_are_counted_in_the_dtype_they_are_formed_in(monkeypatch, dtype):
    """The count is checked against the votes the materialised routing forms: in autocast's dtype
    for float32 inputs (bf16 counted double before), and in float64 for float64 inputs, which
    autocast leaves alone."""
    seen, formed = [], []

    def choose(strategy, *, device, vote_bytes):
        seen.append(vote_bytes)
        return "materialize"

    monkeypatch.setattr(capsules_module, "choose_strategy", choose)
    layer = CapsuleLinear(6, 4, 3, 5, iterations=2, dtype=dtype)
    layer.router.register_forward_pre_hook(lambda module, args: formed.append(args[0].nbytes))
    inputs = torch.randn(2, 6, 4, dtype=dtype)
    layer(inputs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(inputs)
    assert seen == formed == [2 * 3 * 6 * 5 * size for size in ([4, 2] if dtype == torch.float32 else [8, 8])]
