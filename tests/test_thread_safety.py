"""One model or layer used from several threads at once (a threaded server): what torchvote keeps
in Python between calls (the model registry, a layer's kept groups, the default dtype while a
model is built, a module's modes while it generates) must not be seen half-changed."""

from __future__ import annotations

import dataclasses
import sys
import threading

import pytest
import torch
from torch import nn

from torchvote.models import registry
from torchvote.nn import ConvMatrixCapsules
from torchvote.nn.em_capsules import _KEPT_GRIDS
from torchvote.nn.modes import evaluating
from torchvote.training.evaluation import build_float32_model


@dataclasses.dataclass
class _LateConfig:
    width: int = 2


def test_a_first_query_waits_for_the_models_another_thread_is_loading(scratch_registry, monkeypatch):
    """The registry marked itself loaded before importing the model modules: a second thread's
    first query read it half-filled ("unknown model 'capsnet'; models: ") on 6 of 6 tries."""
    started, release = threading.Event(), threading.Event()
    real_import = registry.importlib.import_module

    def slow_import(name):
        if name == "torchvote.models":
            return real_import(name)
        if not started.is_set():  # the first model module: register one model, slowly
            started.set()
            release.wait(10)
            registry.register_model("late-model", config=_LateConfig)(type("LateModel", (nn.Module,), {}))
        return real_import(name)

    monkeypatch.setattr(registry.importlib, "import_module", slow_import)
    monkeypatch.setattr(registry, "_LOADED", False)
    answers: dict[str, object] = {}

    def ask(who):
        try:
            answers[who] = registry.get_model_spec("late-model").name
        except ValueError as error:
            answers[who] = error

    first = threading.Thread(target=ask, args=("first",))
    first.start()
    assert started.wait(10)
    second = threading.Thread(target=ask, args=("second",))
    second.start()
    second.join(0.3)  # it waits for the first thread's imports (it used to answer at once)
    release.set()
    first.join(10)
    second.join(10)
    assert answers == {"first": "late-model", "second": "late-model"}


def test_a_float32_build_under_a_float32_default_sets_no_default(monkeypatch):
    """Setting the default dtype is process-wide: under torch's own default a build no longer sets
    it (builds in several threads gave back each other's default: float64 models)."""
    spec = registry.get_model_spec("cnn-baseline")
    config = registry.build_config("cnn-baseline", "tiny")
    calls = []
    monkeypatch.setattr(torch, "set_default_dtype", calls.append)
    model = build_float32_model(spec, config)
    assert calls == []
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_a_float32_build_under_another_default_gives_it_back():
    spec = registry.get_model_spec("cnn-baseline")
    config = registry.build_config("cnn-baseline", "tiny")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = build_float32_model(spec, config)
        assert torch.get_default_dtype() == torch.float64
    finally:
        torch.set_default_dtype(previous)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


class _ModeWrites(nn.Module):
    """Counts every write of a module's ``training`` flag (``eval()`` and restores alike)."""

    writes = 0

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 2)

    def __setattr__(self, name, value):
        if name == "training":
            type(self).writes += 1
        super().__setattr__(name, value)


def test_evaluating_a_module_in_eval_mode_throughout_writes_no_mode():
    """Threads generating from one model in eval mode (a server) each saved, set and restored
    every submodule's mode: with the model in training mode that interleaved into wrong tokens,
    and even in eval mode each thread wrote shared state. A module already in eval mode is not
    touched now; one in training mode is switched and given back as before."""
    module = _ModeWrites().eval()
    _ModeWrites.writes = 0
    with evaluating(module):
        assert not module.training
    assert _ModeWrites.writes == 0
    module.train()
    module.linear.eval()  # a part the caller keeps in eval mode
    with evaluating(module):
        assert not module.training and not module.linear.training
    assert module.training and not module.linear.training


@pytest.mark.slow  # 8 threads, 16,000 lookups of the kept groups with a one-microsecond switch interval
def test_conv_matrix_capsules_shared_by_threads_keep_their_grids_without_error():
    """The kept groups (an LRU of a few grids) were popped and evicted by several threads at once:
    KeyError from popitem in 4 of 4 tries with 8 threads over 9 grid sizes. Compared with the
    groups a fresh layer makes for the same grid."""
    layer = ConvMatrixCapsules(2, 2, kernel_size=3, stride=1)
    grids = [(size, size) for size in range(3, 3 + 2 * _KEPT_GRIDS + 1)]
    reference = {grid: ConvMatrixCapsules(2, 2, kernel_size=3, stride=1)._routing_groups(*grid, "cpu")
                 for grid in grids}
    failures: list[BaseException] = []

    def look_up(offset):
        try:
            for step in range(2000):
                grid = grids[(offset + step) % len(grids)]
                groups, expected = layer._routing_groups(*grid, "cpu"), reference[grid]
                same = (groups.count == expected.count and torch.equal(groups.ids, expected.ids)
                        and torch.equal(groups.patches, expected.patches))
                if not same:
                    raise AssertionError(f"grid {grid}: other groups than a fresh layer's")
        except BaseException as error:  # noqa: BLE001 (reported by the main thread)
            failures.append(error)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=look_up, args=(offset,)) for offset in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    finally:
        sys.setswitchinterval(interval)
    assert failures == []
    assert len(layer._prepared_groups) <= _KEPT_GRIDS
