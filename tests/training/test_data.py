"""Data drawn afresh each epoch (MultiMNIST's training pairs): a function of ``(seed, epoch)``,
built, limited and fitted to the model like the first draw."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from torchvote.data import MultiMNISTSource, load_small_digits, make_multimnist
from torchvote.training import get_task_handler
from torchvote.training.data import (
    BatchPlan,
    DrawnData,
    TaskData,
    build_task_data,
    iterate_batches,
    pin_memory_for,
)
from torchvote.training.evaluation import load_data, load_eval_entry


@dataclass
class Fits40:
    image_size: int = 40
    in_channels: int = 1
    num_classes: int = 10


@pytest.fixture(scope="module")
def source() -> MultiMNISTSource:
    images, labels = load_small_digits("test", size=60)
    return MultiMNISTSource(images, labels, num_pairs=24, seed=5)


def _fitted(source: MultiMNISTSource):
    handler = get_task_handler("image-classification")
    data = build_task_data(handler, "multimnist", "train", source)
    return data.map(lambda each: handler.finalize(each, Fits40()))


def test_the_first_draw_is_the_sources_own_and_each_epoch_draws_anew(source):
    assert isinstance(source, DrawnData)
    data = _fitted(source)
    own = make_multimnist(source.images, source.labels, num_pairs=24, seed=5)
    assert data.tensors["images"].shape == (24, 1, 40, 40)  # fitted to the model: centred on 40x40
    torch.testing.assert_close(data.tensors["images"][:, :, 2:38, 2:38], own.images)
    epoch0, epoch1 = data.for_epoch(7, 0), data.for_epoch(7, 1)
    assert epoch0.redraw is None and len(epoch0) == len(data) == 24
    assert epoch0.tensors["digits"].shape == (24, 2, 1, 40, 40)  # each draw is fitted too
    assert not torch.equal(epoch0.tensors["images"], epoch1.tensors["images"])
    assert not torch.equal(epoch0.tensors["targets"], epoch1.tensors["targets"])
    again = _fitted(source).for_epoch(7, 1)  # a function of (seed, epoch): a resumed run's pairs
    assert all(torch.equal(again.tensors[key], epoch1.tensors[key]) for key in epoch1.tensors)
    assert not torch.equal(data.for_epoch(8, 1).tensors["images"], epoch1.tensors["images"])


def test_batches_of_an_epoch_come_from_that_epochs_draw(source):
    data = _fitted(source)
    plan = BatchPlan(len(data), 8, seed=7)
    for epoch in (0, 1):
        drawn = data.for_epoch(7, epoch)
        order = plan.epoch_order(epoch)
        batches = list(iterate_batches(data, plan, epoch))
        assert len(batches) == 3
        for position, batch in enumerate(batches):
            expected = drawn.select(plan.global_indices(order, position))
            assert all(torch.equal(batch[key], expected[key]) for key in expected)
        resumed = next(iterate_batches(data, plan, epoch, start=2))  # mid-epoch: same pairs
        assert torch.equal(resumed["images"], batches[2]["images"])


def test_fixed_data_is_the_same_every_epoch():
    images, labels = load_small_digits("test", size=20)
    data = build_task_data(get_task_handler("image-classification"), "small-digits", "test", (images, labels))
    assert data.redraw is None and data.for_epoch(0, 3) is data


def test_load_data_limits_every_draw(monkeypatch, source):
    evaluate_module = importlib.import_module("torchvote.training.evaluation")  # not the function
    monkeypatch.setattr(evaluate_module, "load_raw_dataset", lambda name, split, **kw: (split, source))
    handler = get_task_handler("image-classification")
    limited = load_data(handler, "multimnist", "train", limit=10)
    whole = build_task_data(handler, "multimnist", "train", source)
    assert len(limited) == len(limited.for_epoch(0, 1)) == 10
    assert torch.equal(
        limited.for_epoch(0, 1).tensors["images"], whole.for_epoch(0, 1).tensors["images"][:10]
    )


@pytest.mark.parametrize("limit", [0, -5, 2.5, True])
def test_load_data_and_load_eval_entry_refuse_a_limit_below_one(monkeypatch, source, limit):
    evaluate_module = importlib.import_module("torchvote.training.evaluation")
    loaded = []
    monkeypatch.setattr(
        evaluate_module, "load_raw_dataset", lambda name, split, **kw: loaded.append(name) or (split, source)
    )
    handler = get_task_handler("image-classification")
    message = f"limit must be a positive integer, got {limit!r}"
    with pytest.raises(ValueError, match=message):  # -5 would drop the last 5, 0 leave none
        load_data(handler, "multimnist", "train", limit=limit)
    with pytest.raises(ValueError, match=message):
        load_eval_entry(handler, "multimnist", Fits40(), limit=limit)
    assert loaded == []  # refused before anything is loaded


@pytest.mark.parametrize(
    ("device", "pinned"),
    [(torch.device("cuda"), True), (torch.device("cuda", 1), True), (torch.device("cpu"), False)],
)
def test_pin_memory_for_decides_from_the_device_alone(monkeypatch, device, pinned):
    """CUDA batches are pinned, CPU ones never; deciding touches no device (this machine may
    have none)."""

    def no_cuda(*args, **kwargs):
        raise AssertionError("pin_memory_for asked CUDA")

    for name in ("is_available", "init", "_lazy_init", "current_device", "device_count"):
        monkeypatch.setattr(torch.cuda, name, no_cuda)
    assert pin_memory_for(device) is pinned


def _numbered(count: int = 12) -> TaskData:
    tensors = {"x": torch.arange(count * 2.0).view(count, 2), "y": torch.arange(count)}  # (n, 2), (n,)
    return TaskData("numbers", "train", tensors)


def test_iterate_batches_pins_each_tensor_of_each_batch_when_asked(monkeypatch):
    """In this process each batch is pinned as it is made (here a copy stands in for the page-
    locked one, which needs CUDA); the values are those of the unpinned batches."""
    data, plan = _numbered(), BatchPlan(12, 4, seed=1)
    plain = list(iterate_batches(data, plan, 0, start=1))
    pinned: list[Tensor] = []

    def pin(tensor):
        pinned.append(tensor.clone())
        return pinned[-1]

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    batches = list(iterate_batches(data, plan, 0, start=1, pin_memory=True))
    assert len(batches) == len(plain) == 2 and len(pinned) == 2 * 2  # x and y of 2 batches
    for batch, expected in zip(batches, plain, strict=True):
        assert all(any(batch[key] is tensor for tensor in pinned) for key in batch)
        assert all(torch.equal(batch[key], expected[key]) for key in expected)
    assert list(iterate_batches(data, plan, 0, start=1)) and len(pinned) == 4, "pinned only when asked"


@pytest.mark.parametrize("pin_memory", [True, False])
def test_iterate_batches_with_workers_asks_the_loader_to_pin(monkeypatch, pin_memory):
    """With worker processes the ``DataLoader`` pins (in a thread of this process)."""
    made: list[dict] = []

    class Loader:  # the batches in order, as the real loader gives them; no worker started
        def __init__(self, dataset, **kwargs):
            made.append(kwargs)
            self.dataset, self.positions = dataset, kwargs["sampler"]

        def __iter__(self):
            return (self.dataset[position] for position in self.positions)

    monkeypatch.setattr(torch.utils.data, "DataLoader", Loader)
    data, plan = _numbered(), BatchPlan(12, 4, seed=1)
    batches = list(iterate_batches(data, plan, 0, num_workers=2, pin_memory=pin_memory))
    assert len(batches) == 3 and [kwargs["pin_memory"] for kwargs in made] == [pin_memory]
    assert made[0]["num_workers"] == 2 and "pin_memory_device" not in made[0]  # deprecated in torch


def test_task_data_refuses_tensors_of_different_lengths():
    # its length was the first tensor's: 5 images beside 3 labels were taken
    with pytest.raises(ValueError, match=r"first axis, got lengths \{'images': 5, 'labels': 3\}"):
        TaskData("x", "test", {"images": torch.zeros(5, 1, 2, 2), "labels": torch.zeros(3, dtype=torch.long)})
    with pytest.raises(ValueError, match="one or more tensors"):
        TaskData("x", "test", {})


def test_small_api_arguments_are_refused_by_name():
    """Review findings: BatchPlan.epoch_order(-1) failed inside NumPy, load_data(options="size=8")
    with a dict-update error, with_routing of a 0-d tensor or a dict of layers."""
    from torchvote.training.evaluation import load_data

    plan = BatchPlan(num_examples=10, global_batch=2, seed=0)
    with pytest.raises(ValueError, match="epoch must be an integer >= 0, got -1"):
        plan.epoch_order(-1)
    with pytest.raises(TypeError, match="options must be a mapping of keyword arguments, got 'size=8'"):
        load_data(get_task_handler("image-classification"), "small-digits", "test", options="size=8")
