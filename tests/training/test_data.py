"""Data drawn afresh each epoch (MultiMNIST's training pairs): a function of ``(seed, epoch)``,
built, limited and fitted to the model like the first draw."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import pytest
import torch

from torchvote.data import MultiMNISTSource, load_small_digits, make_multimnist
from torchvote.training import get_task_handler
from torchvote.training.data import BatchPlan, DrawnData, build_task_data, iterate_batches
from torchvote.training.evaluate import load_data, load_eval_entry


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
    evaluate_module = importlib.import_module("torchvote.training.evaluate")  # not the function
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
    evaluate_module = importlib.import_module("torchvote.training.evaluate")
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
