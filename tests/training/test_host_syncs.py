"""What a training step makes the host wait for. On a GPU every read of a tensor on the host
(``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``, ``.cpu()``) waits for every kernel queued
so far, and a copy from pageable memory stages the batch while the host waits. The loop reads once
per metrics record and pins the batches bound for a GPU. These tests run on the CPU: they count
the reads the loop asks for and the batches it pins, which is what it would do on a GPU."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

import torchvote
from torchvote.training import StepInfo, read_metrics, train

_READS = ("item", "__float__", "__int__", "__index__", "__bool__", "tolist", "cpu", "numpy")
_PACKAGE = Path(torchvote.__file__).resolve().parent
# where batches are assembled: on the host, from host tensors (no device to wait for); and the
# value checks of validation.check_tensor_values, which read only where reads are free (eager on
# the CPU) and queue an assertion on a device instead (tests/test_validation.py)
_HOST_SIDE = (
    str(_PACKAGE / "data"),
    str(_PACKAGE / "training" / "data.py"),
    str(_PACKAGE / "validation.py"),
)


class _HostReads:
    """Counts the reads of tensors that torchvote's own code (the loop, the task, the objective,
    the model) makes, leaving out the assembly of batches on the host.

    As a callback (put it first), it notes the count at each step: ``between_steps()`` is the
    number of reads from the first callback to the last one, that is, the reads of every step
    but the first and of everything the loop did after each step but the last.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        self.at_step: dict[int, int] = {}
        for name in _READS:
            monkeypatch.setattr(torch.Tensor, name, self._counting(getattr(torch.Tensor, name)))

    def _counting(self, read):
        def counted(tensor, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(str(_PACKAGE)) and not caller.startswith(_HOST_SIDE):
                self.count += 1
            return read(tensor, *args, **kwargs)

        return counted

    def __call__(self, info: StepInfo) -> None:
        self.at_step[info.step] = self.count

    def between_steps(self) -> int:
        return self.at_step[max(self.at_step)] - self.at_step[min(self.at_step)]


# 60 steps an epoch (240 digits in batches of 4): 24 steps have no epoch end, so no evaluation
# and no checkpoint before the last step; only the metrics records
_STEPS = 24
_LONG_EPOCHS = ("batch_size=4", f"max_steps={_STEPS}", "eval_every=0", "checkpoint_every=0")


def _records_before_the_last_step(run_dir: Path) -> int:
    records = read_metrics(run_dir / "metrics.jsonl")
    return sum(1 for record in records if record["event"] == "train" and record["step"] < _STEPS)


@pytest.mark.parametrize("log_every", [4, 12])
def test_a_step_reads_nothing_back_but_once_per_metrics_record(tiny_config, monkeypatch, log_every):
    """A callback that does not look at the loss makes no step wait: the reads scale with the
    metrics records (steps / log_every), not with the steps."""
    reads = _HostReads(monkeypatch)
    config = tiny_config("run", *_LONG_EPOCHS, f"log_every={log_every}")
    result = train(config, callbacks=[reads], verbose=False)
    assert result.step == _STEPS and sorted(reads.at_step) == list(range(1, _STEPS + 1))
    records = _records_before_the_last_step(result.run_dir)
    assert records == (_STEPS - 1) // log_every
    assert reads.between_steps() == records, "one read (the window's sums) per metrics record"


def test_a_callback_that_reads_the_loss_pays_one_read_a_step(tiny_config, monkeypatch):
    """The loss is read when a callback asks for it, once per step however many ask; it is the
    step's loss as a float, the same for every callback of the step."""
    reads = _HostReads(monkeypatch)
    seen: list[tuple[int, StepInfo, float]] = []

    def read_loss(info: StepInfo) -> None:
        seen.append((info.step, info, info.loss))

    config = tiny_config("run", *_LONG_EPOCHS, "log_every=8")
    result = train(config, callbacks=[reads, read_loss, read_loss], verbose=False)
    records = _records_before_the_last_step(result.run_dir)
    assert reads.between_steps() == (_STEPS - 1) + records
    assert len(seen) == 2 * _STEPS
    for (step, info, loss), (step_again, info_again, loss_again) in zip(seen[::2], seen[1::2], strict=True):
        assert step == step_again and info is info_again and loss == loss_again
        assert type(loss) is float and loss == loss  # a float, not NaN
        assert isinstance(info, StepInfo) and info.loss == loss
        assert dataclasses.replace(info, step=0).loss == loss and dataclasses.asdict(info)["loss"] == loss
    losses = [loss for _, _, loss in seen[::2]]
    assert len(set(losses)) > 1, "each step its own loss"


def test_the_loop_pins_the_batches_it_copies_to_a_gpu_only(tiny_config, monkeypatch):
    """The decision is the device's (:func:`~torchvote.training.data.pin_memory_for`): on the
    CPU nothing is pinned; where it says pin (a CUDA device), every tensor of every batch is,
    before the copy; the run is the same."""
    import torchvote.training.loop as loop

    def refuse(tensor):
        raise AssertionError("a batch for the CPU was pinned")

    monkeypatch.setattr(torch.Tensor, "pin_memory", refuse)
    on_cpu = train(tiny_config("cpu", "max_steps=3"), verbose=False)

    pinned: list[tuple[int, ...]] = []

    def pin(tensor):
        pinned.append(tuple(tensor.shape))
        return tensor.clone()  # what pin_memory gives: a copy with the same values

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    decided: list[torch.device] = []
    monkeypatch.setattr(loop, "pin_memory_for", lambda device: decided.append(device) or True)
    as_for_a_gpu = train(tiny_config("gpu", "max_steps=3"), verbose=False)
    assert decided == [torch.device("cpu")], "decided once, from the run's device"
    assert pinned == [(40, 1, 28, 28), (40,)] * 3, "images and targets of each of the 3 steps"
    for name, tensor in on_cpu.model.state_dict().items():
        assert torch.equal(tensor, as_for_a_gpu.model.state_dict()[name]), name
