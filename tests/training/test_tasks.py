"""The loop is generic over tasks: a toy language model and a toy seq2seq model train through it.

The toy models are registered only for the duration of each test, the way a model file registers
itself; they stand in for the Transformer models that other files add.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from torchvote.models import SequenceOutput, register_model
from torchvote.models import registry as registry_module
from torchvote.training import (
    evaluate_checkpoint,
    get_task_handler,
    load_run_config,
    read_metrics,
    train,
)
from torchvote.training.config import config_from_dict
from torchvote.training.data import TaskData


@pytest.fixture
def toy_models(scratch_registry):

    @dataclass
    class ToyLMConfig:
        vocab_size: int = 16
        context_length: int = 8
        width: int = 16

    @register_model("toy-lm", config=ToyLMConfig, presets={"tiny": {"width": 8}}, task="language-model")
    class ToyLM(nn.Module):
        """Embedding, one hidden layer, logits: each position sees only its own token."""

        def __init__(self, config):
            super().__init__()
            self.config = config
            self.embed = nn.Embedding(config.vocab_size, config.width)
            self.head = nn.Linear(config.width, config.vocab_size)

        def forward(self, tokens):
            return SequenceOutput(logits=self.head(torch.tanh(self.embed(tokens))))

    @dataclass
    class ToySeq2SeqConfig:
        src_vocab_size: int = 15
        tgt_vocab_size: int = 15
        max_len: int = 10
        pad_id: int = 0
        width: int = 16

    @register_model("toy-seq2seq", config=ToySeq2SeqConfig, task="seq2seq")
    class ToySeq2Seq(nn.Module):
        """Decoder position t reads source position t and the previous target token."""

        def __init__(self, config):
            super().__init__()
            self.config = config
            self.source = nn.Embedding(config.src_vocab_size, config.width, padding_idx=config.pad_id)
            self.target = nn.Embedding(config.tgt_vocab_size, config.width)
            self.position = nn.Embedding(config.max_len, config.width)
            self.head = nn.Linear(config.width, config.tgt_vocab_size)

        def forward(self, source, target_input):
            length = target_input.shape[1]
            aligned = nn.functional.pad(source, (0, max(0, length - source.shape[1])))[:, :length]
            positions = self.position(torch.arange(length, device=source.device))
            hidden = self.source(aligned) + self.target(target_input) + positions  # (b, t, d)
            return SequenceOutput(logits=self.head(torch.relu(hidden)))


@pytest.fixture
def fake_text(monkeypatch):
    """A ``shakespeare`` data set that needs no archive: a repetitive text, split 90/10."""
    import torchvote.data as data_package
    from torchvote.data import CharVocab

    real_get_dataset = data_package.get_dataset
    text = "to be or not to be, that is the question. " * 40

    def get_dataset(name, split="train", **kwargs):
        if name != "shakespeare":
            return real_get_dataset(name, split, **kwargs)
        if split not in ("train", "val"):
            raise ValueError(f"split: expected one of ('train', 'val'), got {split!r}")
        vocab = CharVocab.from_text(text)
        tokens = vocab.encode(text)
        cut = int(len(tokens) * 0.9)
        return (tokens[:cut] if split == "train" else tokens[cut:]), vocab

    monkeypatch.setattr(data_package, "get_dataset", get_dataset)


def _config(tmp_path, name, model, data, **extra):
    values = {
        "model": model if isinstance(model, dict) else {"name": model},
        "data": data if isinstance(data, dict) else {"name": data},
        "optim": {"lr": 0.03},
        "batch_size": 16,
        "epochs": 2,
        "log_every": 4,
        "progress": False,
        "tensorboard": False,
        "run_dir": str(tmp_path / name),
    }
    values.update(extra)
    return config_from_dict(values)


def test_language_model_trains_on_token_windows(toy_models, fake_text, tmp_path):
    config = _config(tmp_path, "lm", {"name": "toy-lm", "preset": "tiny"}, "shakespeare", epochs=5)
    result = train(config, verbose=False)
    assert result.model.config.vocab_size == len(set("to be or not to be, that is the question. "))
    assert "shakespeare/val" in result.results  # no test split: the validation split is used
    accuracy = result.results["shakespeare/val"]["accuracy"]
    assert accuracy > 0.3, "next-character bigrams of a repeated sentence are easy"
    train_records = [r for r in read_metrics(result.metrics_path) if r["event"] == "train"]
    assert "tok_per_second" in train_records[0]


def test_a_batch_larger_than_the_language_models_windows_says_what_limit_counts(
    toy_models, fake_text, tmp_path
):
    # data.limit=100 keeps 100 characters, 12 windows of 8 + 1: "larger than the 12 training
    # examples" left the user wondering where 100 examples went
    data = {"name": "shakespeare", "limit": 100}
    config = _config(tmp_path, "lm", {"name": "toy-lm", "preset": "tiny"}, data)
    with pytest.raises(ValueError) as error:
        train(config, verbose=False)
    assert str(error.value) == (
        "batch_size=16 is larger than the 12 training windows of 9 characters (data.limit counts "
        "characters, not windows)"
    )
    config = _config(tmp_path, "lm", {"name": "toy-lm", "preset": "tiny"}, {**data, "limit": 5})
    too_short = r"^shakespeare \(train\) has 5 characters, fewer than one window of 9 "
    with pytest.raises(ValueError, match=too_short):
        train(config, verbose=False)


def test_seq2seq_trains_on_the_copy_task_and_resumes_exactly(toy_models, tmp_path):
    options = {"num_samples": 320, "max_len": 6}
    data = {"name": "copy", "options": options}
    config = _config(tmp_path, "s2s", "toy-seq2seq", data)
    unbroken = train(config, verbose=False)
    metrics = unbroken.results["copy/test"]
    assert metrics["accuracy"] > 0.5 and 0.0 <= metrics["sequence_accuracy"] <= 1.0
    assert unbroken.model.config.max_len == 8  # (src, tgt) widths 7 and 8 for max_len 6

    def stop(info):
        if info.step == 7:
            raise KeyboardInterrupt

    killed = train(_config(tmp_path, "killed", "toy-seq2seq", data), callbacks=[stop], verbose=False)
    assert killed.interrupted
    resumed = train(load_run_config(killed.run_dir), resume=killed.run_dir, verbose=False)
    for name, tensor in unbroken.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name

    rows = evaluate_checkpoint(unbroken.run_dir, ["copy"], options={"max_len": 6, "num_samples": 50})
    assert rows[0]["data"] == "copy/test" and rows[0]["examples"] == 50
    # A data folder is for file-based sets (in a mixed list it is not passed to a generated one);
    # given for generated sets only, it is refused, as training refuses data.root for them.
    with pytest.raises(ValueError, match="none of the data sets copy reads files"):
        evaluate_checkpoint(unbroken.run_dir, ["copy"], root=str(tmp_path), options={"max_len": 6})
    assert set(rows[0]) == {"data", "accuracy", "loss", "sequence_accuracy", "examples"}
    with pytest.raises(ValueError, match="the model takes at most max_len=8"):
        evaluate_checkpoint(unbroken.run_dir, ["copy"])


def test_example_batches_fit_the_conventions(toy_models):
    from torchvote.models import create_model

    for name, key in (("toy-lm", "tokens"), ("toy-seq2seq", "target")):
        model = create_model(name)
        handler = get_task_handler(registry_module.get_model_spec(name).task)
        batch = handler.example_batch(model.config, 2, torch.Generator().manual_seed(0))
        output = handler.forward(model, batch)
        assert output.logits.shape[:2] == batch[key][:, 1:].shape


def test_each_handler_declares_the_model_fields_its_data_fill():
    """config_diff compares these fields as given (built without the data, an override of one and
    none would look alike); a handler filling a field it does not declare would slip through."""
    from torchvote.data import CharVocab

    raws = {
        "image-classification": (torch.rand(3, 1, 8, 8), torch.tensor([0, 1, 2])),
        "language-model": (torch.tensor([0, 1, 2, 1]), CharVocab("abc")),
        "seq2seq": (torch.tensor([[1, 4, 2]]), torch.tensor([[1, 5, 2]])),
    }
    for task, raw in raws.items():
        handler = get_task_handler(task)
        assert set(handler.build("data", "train", raw).fields) == set(handler.data_fields), task


def test_language_model_handler_cuts_overlapping_windows():
    handler = get_task_handler("language-model")

    @dataclass
    class Config:
        context_length: int = 3
        vocab_size: int = 10

    data = TaskData("text", "train", {"stream": torch.arange(10)})
    windows = handler.finalize(data, Config()).tensors["tokens"]
    assert windows.tolist() == [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]
    with pytest.raises(ValueError, match="token ids up to 9, the model's vocabulary has 5"):
        handler.finalize(data, Config(vocab_size=5))


def test_unknown_task_is_an_error():
    with pytest.raises(ValueError, match="no training support for task 'detection'"):
        get_task_handler("detection")


@pytest.mark.parametrize(
    ("task", "batch", "expected_targets"),
    [
        ("image-classification", {"targets": torch.tensor([1, 0, 2])}, torch.tensor([1, 0, 2])),
        (
            "language-model",
            {"tokens": torch.tensor([[1, 2, 0], [2, 0, 1], [0, 1, 2]])},
            torch.tensor([[2, 0], [0, 1], [1, 2]]),
        ),
        (
            "seq2seq",
            {"source": torch.zeros(3, 2), "target": torch.tensor([[1, 2, 0], [1, 0, 0], [1, 2, 2]])},
            torch.tensor([[2, 0], [0, 0], [2, 2]]),
        ),
    ],
)
def test_the_handler_says_what_cross_entropy_compares(task, batch, expected_targets):
    from torchvote import losses
    from torchvote.models.registry import ClassifierOutput
    from torchvote.training.config import LossConfig
    from torchvote.training.objectives import make_objective

    handler = get_task_handler(task)
    shape = (*expected_targets.shape, 3)
    logits = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    classifies = task == "image-classification"
    output = ClassifierOutput(scores=logits) if classifies else SequenceOutput(logits=logits)
    assert handler.logits_and_targets(output, batch)[1].equal(expected_targets)
    spec = type("Spec", (), {"task": task, "loss": "cross-entropy"})()
    loss, _ = make_objective(LossConfig(), spec, total_steps=1, pad_id=0)(output, batch, 0)
    ignore = 0 if task == "seq2seq" else -100  # only seq2seq skips its padding
    assert handler.ignore_index(0) == ignore
    assert torch.equal(loss, losses.cross_entropy(logits, expected_targets, ignore_index=ignore))


def test_cross_entropy_on_several_labels_per_image_says_what_to_use():
    from torchvote.models.registry import ClassifierOutput

    output = ClassifierOutput(scores=torch.zeros(2, 10))
    with pytest.raises(ValueError, match="use loss.name=margin for MultiMNIST"):
        get_task_handler("image-classification").logits_and_targets(output, {"targets": torch.zeros(2, 2)})


def test_two_digit_accuracy_counts_an_image_when_its_two_longest_capsules_are_its_digits():
    from torchvote.models.registry import ClassifierOutput

    handler = get_task_handler("image-classification")
    lengths = torch.full((5, 10), 0.1)
    targets = torch.tensor([[3, 7], [0, 1], [4, 2], [5, 6], [8, 9]])
    lengths[0, [7, 3]] = torch.tensor([0.9, 0.8])  # right, in either order
    lengths[1, [0, 2]] = torch.tensor([0.9, 0.8])  # one digit right, the other missed: wrong
    lengths[1, 1] = 0.7
    lengths[2, [4, 9, 2]] = torch.tensor([0.9, 0.6, 0.5])  # second digit only third: wrong
    lengths[3, [6, 5]] = torch.tensor([0.3, 0.2])  # right, however short the capsules
    lengths[4, [8, 9]] = torch.tensor([0.9, 0.05])  # the other digit's capsule the shortest: wrong
    sums = handler.metric_sums(ClassifierOutput(scores=lengths), {"targets": targets})
    assert sums["correct"].item() == 2 and sums["count"].item() == 5
    assert handler.summarize({k: v.item() for k, v in sums.items()})["accuracy"] == pytest.approx(0.4)


def test_language_model_accuracy_counts_every_next_token_by_hand():
    """Only a bound (accuracy > 0.3) checked the LM's metrics: a count of sequences instead of
    tokens (an accuracy far above 1) passed."""
    handler = get_task_handler("language-model")
    tokens = torch.tensor([[1, 2, 3, 0], [3, 3, 1, 2]])  # (b, t + 1): targets tokens[:, 1:]
    logits = torch.zeros(2, 3, 4)  # (b, t, vocab)
    logits[0, torch.arange(3), torch.tensor([2, 0, 0])] = 1.0  # right, wrong, right
    logits[1, torch.arange(3), torch.tensor([3, 2, 2])] = 1.0  # right, wrong, right
    sums = handler.metric_sums(SequenceOutput(logits=logits), {"tokens": tokens})
    assert (sums["correct"].item(), sums["count"].item(), sums["examples"].item()) == (4, 6, 2)
    assert handler.summarize({k: v.item() for k, v in sums.items()})["accuracy"] == pytest.approx(4 / 6)


def test_language_model_bits_per_char_is_the_mean_negative_log2_likelihood_by_hand():
    """train and evaluate printed the loss in nats only; character LMs are compared in bits per
    character (docs/results.md's row g), which users had to work out."""
    handler = get_task_handler("language-model")
    tokens = torch.tensor([[1, 2, 3], [3, 0, 1]])  # (b, t + 1): targets 2, 3 and 0, 1
    logits = torch.zeros(2, 2, 4)  # uniform over 4 characters: 2 bits each ...
    logits[1, 1] = torch.tensor([0.0, 3.0, 0.0, 0.0]).log1p()  # ... but p(1) = 4/7 at this one
    sums = handler.metric_sums(SequenceOutput(logits=logits), {"tokens": tokens})
    metrics = handler.summarize({k: v.item() for k, v in sums.items()})
    assert metrics["bits_per_char"] == pytest.approx((3 * 2.0 - math.log2(4 / 7)) / 4)
    # bf16 logits (autocast) are scored in fp32: the first row's two uniform characters, in nats
    half = handler.metric_sums(SequenceOutput(logits=logits[:1].bfloat16()), {"tokens": tokens[:1]})
    assert half["nll_sum"].dtype == torch.float32
    assert half["nll_sum"].item() == pytest.approx(2 * math.log(4))


def test_seq2seq_exact_match_chooses_as_greedy_decoding_does():
    """Greedy decoding never picks <pad> or <bos>; the teacher-forced metrics took the plain
    argmax, so a position whose top score was <pad> counted wrong where greedy decoding, taking
    the next best, got it right: the exact match was only a lower bound of greedy decoding's."""
    handler = get_task_handler("seq2seq")
    pad, bos, eos = 0, 1, 2
    target = torch.tensor([[bos, 5, 6, eos, pad], [bos, 7, eos, pad, pad]])  # (b, 1 + t)
    logits = torch.zeros(2, 4, 9)  # (b, t, vocab) predicting target[:, 1:]
    for row, tokens in enumerate(target[:, 1:].tolist()):
        for position, token in enumerate(tokens):
            logits[row, position, token] = 1.0
    logits[0, 0, pad] = 3.0  # above the target 5: greedy skips it and picks 5
    logits[1, 1, bos] = 3.0  # above <eos>: greedy skips it too
    logits[1, 2, 8] = 5.0  # a padding position: not counted
    sums = handler.metric_sums(SequenceOutput(logits=logits), {"source": target, "target": target})
    assert sums["correct"].item() == 5 and sums["count"].item() == 5
    assert sums["sequence_correct"].item() == 2
    metrics = handler.summarize({k: v.item() for k, v in sums.items()})
    assert metrics["accuracy"] == 1.0 and metrics["sequence_accuracy"] == 1.0
    logits[0, 1, 4] = 2.0  # a real mistake still counts
    sums = handler.metric_sums(SequenceOutput(logits=logits), {"source": target, "target": target})
    assert sums["correct"].item() == 4 and sums["sequence_correct"].item() == 1
    metrics = handler.summarize({k: v.item() for k, v in sums.items()})
    assert (metrics["accuracy"], metrics["sequence_accuracy"]) == pytest.approx((4 / 5, 1 / 2))


def test_each_digits_reconstruction_is_compared_with_that_digit_alone():
    """MultiMNIST: the margin loss over both labels plus 0.0005 x the summed squared error of each
    digit's reconstruction against that digit on its own canvas, written out as loops."""
    from torchvote import losses
    from torchvote.models.registry import ClassifierOutput
    from torchvote.training.config import LossConfig
    from torchvote.training.objectives import make_objective

    generator = torch.Generator().manual_seed(0)
    scores = torch.rand(3, 10, generator=generator, dtype=torch.float64)
    targets = torch.tensor([[1, 7], [0, 2], [9, 4]])
    digits = torch.rand(3, 2, 1, 6, 6, generator=generator, dtype=torch.float64)
    reconstructions = torch.rand(3, 2, 1, 6, 6, generator=generator, dtype=torch.float64)
    images = digits.sum(dim=1).clamp(max=1.0)
    spec = type("Spec", (), {"task": "image-classification", "loss": "margin"})()
    objective = make_objective(LossConfig(), spec, total_steps=1)
    batch = {"images": images, "targets": targets, "digits": digits}
    output = ClassifierOutput(scores=scores, reconstructions=reconstructions)
    loss, parts = objective(output, batch, 0)

    squared = 0.0
    for b in range(3):
        for k in range(2):  # the k-th reconstruction against the k-th digit alone
            squared += float(((reconstructions[b, k] - digits[b, k]) ** 2).sum())
    present = torch.zeros(3, 10, dtype=torch.float64)
    present[torch.arange(3)[:, None], targets] = 1.0
    margin = losses.margin_loss(scores.float(), present)
    assert parts["reconstruction"].item() == pytest.approx(0.0005 * squared / 3, rel=1e-6)
    assert loss.item() == pytest.approx(margin.item() + 0.0005 * squared / 3, rel=1e-6)
    swapped = {**batch, "digits": digits.flip(1)}  # against the other digit: another number
    assert objective(output, swapped, 0)[1]["reconstruction"] != parts["reconstruction"]
    # At evaluation the decoder reconstructs the longest capsule only: nothing to compare it with.
    single = ClassifierOutput(scores=scores, reconstructions=reconstructions[:, 0])
    loss, parts = objective(single, batch, 0)
    assert "reconstruction" not in parts and loss.item() == pytest.approx(margin.item(), rel=1e-6)
