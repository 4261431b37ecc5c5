"""The training loop and ``evaluate`` give ``rnn-attention-seq2seq`` its sources' lengths on the
CPU (``source_lengths=``, counted on the batch's host copy before it moves to the device), so that
a training step reads nothing back from the device; the loss and gradients are those of the model
called without them, and models whose ``forward`` takes no ``source_lengths`` (the Transformer
encoder-decoder, the language models, the classifiers) get none."""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import torchvote.training.loop as loop_module
from conftest import recording_reads
from torchvote.models import create_model
from torchvote.training import get_task_handler, train
from torchvote.training.config import config_from_dict
from torchvote.training.data import TaskData
from torchvote.training.evaluation import evaluate

PAD = 0


def _batch(lengths: list[int], width: int, target_width: int = 5) -> dict[str, Tensor]:
    """A seq2seq batch: sources with ``lengths[i]`` tokens then ``PAD``; targets ``<bos> ...``."""
    generator = torch.Generator().manual_seed(1)
    source = torch.randint(3, 15, (len(lengths), width), generator=generator)
    for row, length in enumerate(lengths):
        source[row, length:] = PAD
    target = torch.randint(3, 15, (len(lengths), target_width), generator=generator)
    target[:, 0] = 1
    target[0, -2:] = PAD  # a padded target: its padding counts in no loss
    return {"source": source, "target": target}


def _rnn(dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    return create_model("rnn-attention-seq2seq", "tiny", dtype=dtype)


def _recording_calls(model) -> list[dict]:
    """The keyword arguments of every call of ``model`` (a forward pre-hook)."""
    calls: list[dict] = []
    model.register_forward_pre_hook(lambda _m, _args, kwargs: calls.append(dict(kwargs)), with_kwargs=True)
    return calls


def test_the_handler_counts_the_sources_on_the_host_for_a_model_that_takes_them():
    batch = _batch([5, 2, 7, 1], 8)
    handler = get_task_handler("seq2seq")
    arguments = handler.host_arguments(_rnn(), batch)
    assert list(arguments) == ["source_lengths"]
    lengths = arguments["source_lengths"]
    assert lengths.device.type == "cpu" and lengths.tolist() == [5, 2, 7, 1]
    # the Transformer encoder-decoder's forward takes no source_lengths: it gets none
    transformer = create_model("transformer-seq2seq", "tiny")
    assert handler.host_arguments(transformer, batch) == {}
    # a source already on another device: nothing computed there (the model counts it)
    assert handler.host_arguments(_rnn(), {key: value.to("meta") for key, value in batch.items()}) == {}


def test_the_handler_counts_against_the_models_own_pad_id():
    """Padding is the model's ``pad_id`` (here 2), not 0: the counts stop at it, and the model,
    which checks them against its own mask, takes them."""
    torch.manual_seed(0)
    model = create_model("rnn-attention-seq2seq", "tiny", pad_id=2, bos_id=1, eos_id=0)
    source = torch.tensor([[5, 6, 7, 2, 2], [0, 4, 2, 2, 2]])  # 0 is a token for this model
    batch = {"source": source, "target": torch.tensor([[1, 5, 6], [1, 4, 2]])}
    lengths = get_task_handler("seq2seq").host_arguments(model, batch)["source_lengths"]
    assert lengths.tolist() == [3, 2]
    given = model(source, batch["target"][:, :-1], source_lengths=lengths).logits
    torch.testing.assert_close(given, model(source, batch["target"][:, :-1]).logits, rtol=0.0, atol=0.0)


def test_through_wrappers_and_a_ddp_that_moves_its_tensor_arguments():
    """Under ``torch.compile`` the lengths stay a CPU tensor; a DDP wrapper given ``device_ids``
    (on GPUs) moves every tensor argument to its GPU, where the model would refuse them (and
    read them back): it gets a NumPy array, which DDP leaves alone (a list of ints would make
    ``torch.compile`` guard on its values and compile again for every batch); a DataParallel over
    several GPUs, which would copy the whole batch's lengths to every replica, gets nothing."""
    batch = _batch([5, 2, 7, 1], 8)
    handler = get_task_handler("seq2seq")
    model = _rnn()
    compiled = torch.compile(model)  # lazy: nothing compiled until called
    lengths = handler.host_arguments(compiled, batch)["source_lengths"]
    assert isinstance(lengths, Tensor) and lengths.tolist() == [5, 2, 7, 1]
    ddp = nn.parallel.DistributedDataParallel.__new__(nn.parallel.DistributedDataParallel)
    nn.Module.__init__(ddp)  # the attributes host_arguments reads, without a process group
    ddp.module, ddp.device_ids = model, [0]
    for wrapped in (ddp, torch.compile(ddp)):
        lengths = handler.host_arguments(wrapped, batch)["source_lengths"]
        assert isinstance(lengths, np.ndarray) and lengths.tolist() == [5, 2, 7, 1]
    # ... which the model takes as it takes the tensor, with the same outputs
    source, target = batch["source"], batch["target"][:, :-1]
    given, counted = model(source, target, source_lengths=lengths), model(source, target)
    torch.testing.assert_close(given.logits, counted.logits, rtol=0.0, atol=0.0)
    ddp.device_ids = None  # DDP on CPUs moves nothing
    assert isinstance(handler.host_arguments(ddp, batch)["source_lengths"], Tensor)
    parallel = nn.DataParallel.__new__(nn.DataParallel)
    nn.Module.__init__(parallel)
    parallel.module, parallel.device_ids = model, [0, 1]
    assert handler.host_arguments(parallel, batch) == {}
    parallel.device_ids = [0]  # one device: nothing is split
    assert isinstance(handler.host_arguments(parallel, batch)["source_lengths"], Tensor)


def test_the_other_tasks_pass_nothing_more():
    lm = create_model("transformer-lm", "tiny")
    tokens = torch.randint(0, lm.config.vocab_size, (2, lm.config.context_length + 1))
    assert get_task_handler("language-model").host_arguments(lm, {"tokens": tokens}) == {}
    classifier = create_model("cnn-baseline", "tiny")
    images = {"images": torch.zeros(2, 1, 28, 28), "labels": torch.zeros(2, dtype=torch.long)}
    assert get_task_handler("image-classification").host_arguments(classifier, images) == {}


def test_the_loss_and_gradients_are_the_models_without_the_lengths():
    """float64: the handler's forward with its host arguments, through the training objective,
    against the model called without ``source_lengths`` and a cross-entropy written here."""
    model = _rnn(torch.float64).train()
    batch = _batch([5, 2, 7, 1, 0], 8)
    handler = get_task_handler("seq2seq")
    # the reference: the model as it was called, counting the lengths itself
    torch.manual_seed(5)
    logits = model(batch["source"], batch["target"][:, :-1]).logits  # (b, t, vocab)
    targets = batch["target"][:, 1:]  # (b, t)
    real = targets != PAD
    picked = logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0]  # (b, t)
    reference = -(picked * real).sum() / real.sum()
    reference_grads = torch.autograd.grad(reference, list(model.parameters()))
    # the loop's path
    torch.manual_seed(5)
    output = handler.forward(model, batch, **handler.host_arguments(model, batch))
    logits, targets = handler.logits_and_targets(output, batch)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=handler.ignore_index(PAD))
    grads = torch.autograd.grad(loss, list(model.parameters()))
    torch.testing.assert_close(loss, reference, rtol=0, atol=1e-15)
    for mine, theirs in zip(grads, reference_grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-15)


def _seq2seq_values(run_dir, model: str, **extra) -> dict:
    return {
        "model": {"name": model, "preset": "tiny", "dropout": 0.0},
        "data": {"name": "reverse", "options": {"num_samples": 48, "max_len": 8}},
        "optim": {"name": "sgd", "lr": 0.1, "schedule": "constant", "warmup_steps": 0},
        "batch_size": 16,
        "max_steps": 2,
        "seed": 3,
        "progress": False,
        "tensorboard": False,
        "run_dir": str(run_dir),
        **extra,
    }


def test_a_training_step_reads_nothing_back_in_the_models_forward(tmp_path, monkeypatch):
    """Through the real loop: every step's forward gets CPU lengths, and reads no value of a
    tensor (on a GPU each would wait for the device); without them it read the counted lengths."""
    seen: dict[str, list] = {"reads": [], "calls": []}
    real = loop_module._Run._train_step

    def recording(run, batch):
        if not seen["calls"]:  # once: the hooks stay on the model
            seen["calls"] = _recording_calls(run.model)
            reads_in_forward: list[str] = []
            stack = contextlib.ExitStack()

            def start(_module, _args, _kwargs):
                stack.enter_context(recording_reads(monkeypatch, reads_in_forward))

            run.model.register_forward_pre_hook(start, with_kwargs=True)
            run.model.register_forward_hook(lambda *_: stack.close())
            seen["reads"] = reads_in_forward
        expected = (batch["source"] != PAD).sum(dim=1)  # (b,) counted here, on the host copy
        result = real(run, batch)
        kwargs = seen["calls"][-1]
        assert "source_lengths" in kwargs and kwargs["source_lengths"].device.type == "cpu"
        assert torch.equal(kwargs["source_lengths"], expected)
        return result

    monkeypatch.setattr(loop_module._Run, "_train_step", recording)
    values = _seq2seq_values(tmp_path / "run", "rnn-attention-seq2seq")
    result = train(config_from_dict(values), verbose=False)
    assert result.step == 2
    assert seen["reads"] == []  # without the lengths: ["cpu"] per forward, the counted lengths


def test_evaluate_gives_the_lengths_and_other_models_train_as_before(tmp_path):
    model = _rnn()
    calls = _recording_calls(model)
    batch = _batch([5, 2, 7, 1], 8)
    data = TaskData("reverse", "test", batch, {})
    metrics = evaluate(model, data, get_task_handler("seq2seq"), batch_size=3)
    assert metrics["count"] == float((batch["target"][:, 1:] != PAD).sum())
    assert [call["source_lengths"].tolist() for call in calls] == [[5, 2, 7], [1]]
    # the Transformer encoder-decoder takes no source_lengths: trains and evaluates as before
    result = train(config_from_dict(_seq2seq_values(tmp_path / "t", "transformer-seq2seq")), verbose=False)
    assert result.step == 2
