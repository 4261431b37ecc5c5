"""Text from a trained run: a language model's continuations, a seq2seq model's outputs.

:func:`generate_from_checkpoint` (``torchvote generate``) rebuilds the model of a checkpoint as
``torchvote evaluate`` does, then

* a language model (``transformer-lm``) continues each prompt one token at a time
  (:meth:`~torchvote.models.transformer_lm.TransformerLM.generate`: the key/value cache,
  temperature, top-k and top-p sampling), ``samples`` continuations per prompt;
* a sequence-to-sequence model (``transformer-seq2seq``, ``rnn-attention-seq2seq``) trained on
  one of the sequence tasks (:mod:`torchvote.data.sequences`) decodes each source greedily.

A language model's characters are those of its training data: a run records them with its
weights (metadata ``vocab``), so the ``.safetensors`` file alone reads and writes text; for a
checkpoint written before runs recorded them, the run's data set is read again with the options
its training state records.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from torchvote.data import SEQUENCE_TASKS, CharVocab, decode_sequence, encode_source
from torchvote.training.checkpoint import CheckpointError, find_checkpoint, load_training_state
from torchvote.training.config import config_from_dict
from torchvote.training.data import load_raw_dataset
from torchvote.training.distributed import resolve_device
from torchvote.training.evaluate import load_model_from_checkpoint
from torchvote.validation import check_positive_int

__all__ = ["DEFAULT_NEW_TOKENS", "Generation", "generate_from_checkpoint"]

#: Characters a language model appends when ``max_new_tokens`` is not given.
DEFAULT_NEW_TOKENS = 200


@dataclass(frozen=True)
class Generation:
    """One prompt and what the model made of it.

    Attributes:
        task: the model's task: ``language-model`` or ``seq2seq``.
        prompt: the prompt as given (a seq2seq model's source; an addition's ``=`` added).
        text: a language model's continuation (without the prompt), or a seq2seq model's output
            (without ``<bos>``, ``<eos>`` and padding).
    """

    task: str
    prompt: str
    text: str


def generate_from_checkpoint(
    location: str | os.PathLike[str],
    prompts: Sequence[str] = (),
    *,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    samples: int | None = None,
    seed: int | None = None,
    device: str = "auto",
    use_cache: bool = True,
) -> list[Generation]:
    """Generate from the model of a checkpoint: continue prompts (language model) or decode
    sources (seq2seq).

    Args:
        location: a run folder, its checkpoints folder or a ``.safetensors`` file.
        prompts: a language model's prompts (default: one newline, the start of a line, or the
            vocabulary's first character when it has no newline), or a seq2seq model's sources
            (``"12345"``; an addition's ``"12+34"``, its ``=`` added when missing), at least one.
        max_new_tokens: tokens to add: a language model's default is
            :data:`DEFAULT_NEW_TOKENS`, a seq2seq model's its longest target.
        temperature: language models: divides the logits (``0``: greedy); default 1.
        top_k, top_p: language models: sample among the ``top_k`` most likely tokens and within
            the smallest set of them whose probability reaches ``top_p``; ``None``: no limit.
        samples: language models: continuations per prompt (one batch); default 1.
        seed: language models: seeds the sampling, so a call repeats; ``None``: PyTorch's global
            random state.
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:<index>``.
        use_cache: keep past keys and values while generating (same tokens, far faster).

    Returns:
        For a language model, ``samples`` generations per prompt, prompt by prompt; for a
        seq2seq model, one per source.

    Raises:
        CheckpointError: the checkpoint cannot be loaded, or a language model's vocabulary is
            neither recorded with its weights nor readable from its run.
        ValueError: a model that does not generate text (an image classifier), a prompt with a
            character the model does not know or a source longer than the model reads, a
            seq2seq model given no source or given sampling options (it decodes greedily), or a
            bad ``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``samples`` or ``seed``.
        DataNotFoundError: an old checkpoint's vocabulary needs its data set, which is not there.
    """
    prompts = _check_prompts(prompts)
    model, spec, metadata = load_model_from_checkpoint(location, resolve_device(device))
    if spec.task == "language-model":
        vocab = _vocabulary(metadata, model.config.vocab_size)
        return _continue(
            model, vocab, prompts or [_default_prompt(vocab)],
            max_new_tokens=DEFAULT_NEW_TOKENS if max_new_tokens is None else max_new_tokens,
            temperature=1.0 if temperature is None else temperature,
            top_k=top_k, top_p=top_p, samples=1 if samples is None else samples, seed=seed,
            use_cache=use_cache,
        )
    if spec.task == "seq2seq":
        sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "samples": samples,
                    "seed": seed}
        given = [name for name, value in sampling.items() if value is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)}: {spec.name} decodes greedily (one output per source); "
                "sampling options apply to language models"
            )
        # the Transformer's positions end at max_len; the GRUs read sources of any length
        source_limit = model.config.max_len if spec.name == "transformer-seq2seq" else None
        return _decode(model, metadata.get("data", ""), prompts, max_new_tokens, use_cache, source_limit)
    raise ValueError(
        f"{metadata['path']} holds a {spec.name} ({spec.task}), which does not generate text; "
        "generate takes a language model (transformer-lm) or a seq2seq model "
        "(transformer-seq2seq, rnn-attention-seq2seq)"
    )


def _check_prompts(prompts: Sequence[str]) -> list[str]:
    if isinstance(prompts, str) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts: expected a sequence of strings, got {type(prompts).__name__}")
    for prompt in prompts:
        if not isinstance(prompt, str):
            raise TypeError(f"prompts: expected strings, got {type(prompt).__name__} {prompt!r}")
        if not prompt:
            raise ValueError("prompt: expected at least one character, got ''")
    return list(prompts)


# --- language models --------------------------------------------------------------------------


def _vocabulary(metadata: dict[str, str], vocab_size: int) -> CharVocab:
    """The characters of a language model's ids: recorded with its weights, or (a checkpoint
    written before they were) those of its run's training data, read again."""
    source = metadata["path"]
    if "vocab" in metadata:
        try:
            vocab = CharVocab.from_dict(json.loads(metadata["vocab"]))
        except (TypeError, ValueError) as err:  # JSONDecodeError too
            raise CheckpointError(f"{source} records its vocabulary unreadably ({err})") from None
    else:
        vocab = _vocabulary_of_the_run(source)
    if len(vocab) != vocab_size:
        raise CheckpointError(
            f"{source}: the model has {vocab_size} token ids, its vocabulary {len(vocab)} characters"
        )
    return vocab


def _vocabulary_of_the_run(weights: str) -> CharVocab:
    paths = find_checkpoint(weights)
    if not paths.state.is_file():
        raise CheckpointError(
            f"{weights} was written before checkpoints recorded their vocabulary, and {paths.state}, "
            "whose run config names the data set to read it from, does not exist"
        )
    try:
        data = config_from_dict(load_training_state(paths.state)["config"]).data
    except (KeyError, TypeError, ValueError) as err:  # ConfigError too: a config of another version
        raise CheckpointError(f"{paths.state} does not record its run's data set ({err})") from None
    _, raw = load_raw_dataset(data.name, "train", options=data.options, root=data.root)
    vocab = raw[1] if isinstance(raw, tuple) and len(raw) == 2 else None
    if not isinstance(vocab, CharVocab):
        raise CheckpointError(f"{weights}: its run's data set {data.name!r} has no character vocabulary")
    return vocab


def _default_prompt(vocab: CharVocab) -> str:
    return "\n" if "\n" in vocab.chars else vocab.chars[0]


def _continue(
    model: Any,
    vocab: CharVocab,
    prompts: list[str],
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    samples: int,
    seed: int | None,
    use_cache: bool,
) -> list[Generation]:
    check_positive_int(samples, "samples")
    if seed is not None and check_positive_int(seed, "seed", minimum=0) >= 2**64:
        raise ValueError(f"seed: expected an integer in [0, 2**64), got {seed}")
    # a CPU generator: the same draws on every device (generate draws where its generator is)
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    encoded = []
    for prompt in prompts:  # every prompt checked before the first is generated
        try:
            encoded.append(vocab.encode(prompt))  # (t,)
        except ValueError as err:
            raise ValueError(f"prompt {prompt!r}: {str(err).removeprefix('text: ')}") from None
    device = next(model.parameters()).device
    results = []
    for prompt, ids in zip(prompts, encoded, strict=True):
        tokens = ids.to(device).expand(samples, -1)  # (samples, t): one prompt, one length
        output = model.generate(
            tokens, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            generator=generator, use_cache=use_cache,
        )  # (samples, t + max_new_tokens)
        continuations = output[:, len(ids) :].cpu()  # (samples, max_new_tokens)
        results += [Generation("language-model", prompt, vocab.decode(row)) for row in continuations]
    return results


# --- sequence-to-sequence models ------------------------------------------------------------


def _decode(
    model: Any,
    data: str,
    prompts: list[str],
    max_new_tokens: int | None,
    use_cache: bool,
    source_limit: int | None,
) -> list[Generation]:
    if data not in SEQUENCE_TASKS:
        raise ValueError(
            f"the model was trained on {data!r}; generate reads the symbols of the sequence tasks "
            f"({', '.join(SEQUENCE_TASKS)}) only"
        )
    if not prompts:
        raise ValueError(f"prompt: a seq2seq model needs a source to decode, e.g. '12345' ({data} task)")
    if data == "addition":  # its sources end with '=' (the task's layout)
        prompts = [prompt if prompt.endswith("=") else f"{prompt}=" for prompt in prompts]
    sources = []
    for prompt in prompts:
        try:
            source = encode_source(prompt)  # (s,): the symbols and <eos>
        except ValueError as err:
            raise ValueError(f"prompt {prompt!r}: {str(err).removeprefix('text: ')}") from None
        if source_limit is not None and len(source) > source_limit:
            raise ValueError(
                f"prompt {prompt!r}: {len(prompt)} symbols and <eos>; the model reads at most "
                f"{source_limit} tokens ({source_limit - 1} symbols)"
            )
        sources.append(source)
    batch = _pad(sources, model.config.pad_id).to(next(model.parameters()).device)  # (n, s)
    output = model.generate(batch, max_new_tokens=max_new_tokens, use_cache=use_cache)  # (n, 1 + m)
    outputs = [decode_sequence(row) for row in output.cpu()]
    return [Generation("seq2seq", prompt, text) for prompt, text in zip(prompts, outputs, strict=True)]


def _pad(sequences: list[Tensor], pad_id: int) -> Tensor:
    """``(n, longest)``: each sequence, then ``pad_id``."""
    batch = torch.full((len(sequences), max(len(s) for s in sequences)), pad_id, dtype=torch.long)
    for row, sequence in zip(batch, sequences, strict=True):
        row[: len(sequence)] = sequence
    return batch
