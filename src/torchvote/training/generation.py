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
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from torchvote.data import SEQUENCE_TASKS, CharVocab, decode_sequence, encode_source
from torchvote.models.registry import get_model_spec
from torchvote.models.sampling import check_sampling
from torchvote.models.transformer_backbone import check_max_new_tokens
from torchvote.training.checkpoint import (
    CheckpointError,
    find_checkpoint,
    read_model_metadata,
)
from torchvote.training.data import load_raw_dataset
from torchvote.training.distributed import resolve_device
from torchvote.training.evaluation import (
    autocast,
    autocast_dtype,
    load_model_from_checkpoint,
    run_state_beside,
)
from torchvote.validation import check_flag, check_positive_int, check_seed

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
    on_text: Callable[[int, str, str], None] | None = None,
    bf16: bool = False,
    fp16: bool = False,
    on_generation: Callable[[int, Generation], None] | None = None,
    on_start: Callable[[], None] | None = None,
) -> list[Generation]:
    """Generate from the model of a checkpoint: continue prompts (language model) or decode
    sources (seq2seq).

    Every argument is checked before the model is built (or an old checkpoint's data read).

    Args:
        location: a run folder, its checkpoints folder or a ``.safetensors`` file.
        prompts: a language model's prompts (default: one newline, the start of a line, or the
            vocabulary's first character when it has none), or a seq2seq model's sources, at
            least one: digits for copy, reverse and sort (``"12345"``), ``a+b`` for addition
            (``"12+34"``; the ``=`` that ends the task's sources is added when missing).
        max_new_tokens: tokens to add: a language model's default is
            :data:`DEFAULT_NEW_TOKENS`, a seq2seq model's its longest target (``max_len - 1``,
            also its most).
        temperature: language models: divides the logits (``0``: greedy); default 1.
        top_k, top_p: language models: sample among the ``top_k`` most likely tokens and within
            the smallest set of them whose probability reaches ``top_p``; ``None``: no limit.
        samples: language models: continuations per prompt (one batch); default 1.
        seed: language models: seeds the sampling of each prompt afresh, so a prompt gives the
            same continuations whatever other prompts the call has (the ``samples`` of one prompt
            are drawn together: their number changes each one's draws); ``None``: PyTorch's
            global random state.
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:<index>``.
        use_cache: keep past keys and values while generating (same tokens, far faster).
        on_text: language models: called with ``(index, prompt, character)`` for every
            character as it is drawn, ``index`` the generation's place in the returned list (the
            ``samples`` of one prompt are drawn together, so their characters alternate): to show
            text as it is written. ``None``: the text arrives in the returned list only. A
            seq2seq model decodes each output whole, greedily, and does not call it.
        bf16: generate under bfloat16 autocast: the products in bfloat16 (the cache keeps their
            keys and values), the draws from logits cast to float32 or wider. A token may differ
            from float32's where two are nearly tied.
        fp16: generate under float16 autocast (not with ``bf16``).
        on_generation: called with ``(index, generation)`` for each generation as soon as it is
            complete, ``index`` its place in the returned list, in that order: a language
            model's ``samples`` continuations of a prompt when that prompt's batch is drawn
            (before the next prompt's starts), a seq2seq model's outputs when the batch of
            sources is decoded. To show whole texts as they come (``torchvote generate
            --samples N``); ``None``: the returned list only.
        on_start: called once, when every argument, prompt and source has been checked and the
            model loaded, before the first token is drawn: what is raised before it is the
            caller's request, after it a failure while generating (the command line's exit
            status tells them apart).

    Returns:
        For a language model, ``samples`` generations per prompt, prompt by prompt; for a
        seq2seq model, one per source.

    Raises:
        CheckpointError: the checkpoint cannot be loaded, or a language model's vocabulary is
            neither recorded with its weights nor readable from its run.
        ValueError: a model that does not generate text (an image classifier), an empty prompt,
            a prompt with a character the model does not know, a source not laid out as its
            task's (or longer than the model reads), a seq2seq model given no source or given
            sampling options (it decodes greedily), or a bad ``max_new_tokens``,
            ``temperature``, ``top_k``, ``top_p``, ``samples`` or ``seed``.
        TypeError: ``prompts`` not a sequence of strings (one string included); a
            ``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``samples`` or ``seed``
            that is not a number (a bool included); a ``use_cache`` that is not a bool; an
            ``on_text`` or ``on_generation`` that is not callable.
        DataNotFoundError: an old checkpoint's vocabulary needs its data set, which is not there.
    """
    prompts = _check_prompts(prompts)
    check_flag(use_cache, "use_cache")
    autocast_dtype(bf16, fp16)  # checked before the model is touched
    if on_text is not None and not callable(on_text):  # failed after the model was loaded
        raise TypeError(f"on_text must be a callable (index, prompt, character) or None, got {on_text!r}")
    if on_generation is not None and not callable(on_generation):
        raise TypeError(
            f"on_generation must be a callable (index, generation) or None, got {on_generation!r}"
        )
    if on_start is not None and not callable(on_start):
        raise TypeError(f"on_start must be a callable taking no argument or None, got {on_start!r}")
    if max_new_tokens is not None:
        check_positive_int(max_new_tokens, "max_new_tokens", minimum=0)
    paths = find_checkpoint(location)
    metadata = read_model_metadata(paths.weights)
    task, data = _task_of(metadata, paths.weights), metadata.get("data", "")
    if task == "language-model":
        if samples is not None:
            check_positive_int(samples, "samples")
        if seed is not None:
            seed = check_seed(seed)
        sampling = check_sampling(1.0 if temperature is None else temperature, top_k, top_p, None)
        torch_device = resolve_device(device)
        model, _, metadata = load_model_from_checkpoint(paths.weights, torch_device)
        vocab = _vocabulary(metadata, model.config.vocab_size)
        temperature, top_k, top_p, _ = sampling
        with autocast(torch_device, bf16, fp16):
            return _continue(
                model, vocab, prompts or [_default_prompt(vocab)],
                max_new_tokens=DEFAULT_NEW_TOKENS if max_new_tokens is None else max_new_tokens,
                temperature=temperature, top_k=top_k, top_p=top_p, samples=1 if samples is None else samples,
                seed=seed, use_cache=use_cache, on_text=on_text, on_generation=on_generation,
                on_start=on_start,
            )
    if task == "seq2seq":
        sampling_options = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "samples": samples,
                            "seed": seed}
        given = [name for name, value in sampling_options.items() if value is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)}: {metadata['model']} decodes greedily (one output per source); "
                "sampling options apply to language models"
            )
        sources = _sources(data, prompts)
        torch_device = resolve_device(device)
        model, _, _ = load_model_from_checkpoint(paths.weights, torch_device)
        with autocast(torch_device, bf16, fp16):
            decoded = _decode(model, sources, max_new_tokens, use_cache, model.max_source_length, on_start)
        if on_generation is not None:  # one batch: every output is complete at once
            for index, generation in enumerate(decoded):
                on_generation(index, generation)
        return decoded
    raise ValueError(
        f"{paths.weights} holds a {metadata['model']} ({task}), which does not generate text; "
        "generate takes a language model (transformer-lm) or a seq2seq model "
        "(transformer-seq2seq, rnn-attention-seq2seq)"
    )


def _task_of(metadata: dict[str, str], weights: Any) -> str:
    """The task of a checkpoint's model, from its metadata (no weights read, no model built)."""
    if "model" not in metadata:
        raise CheckpointError(f"{weights} names no model in its metadata; it is not a torchvote checkpoint")
    try:
        return get_model_spec(metadata["model"]).task
    except ValueError as err:
        raise CheckpointError(f"{weights}: {err}") from None


def _check_prompts(prompts: Sequence[str]) -> list[str]:
    if isinstance(prompts, str) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts: expected a sequence of strings, got {type(prompts).__name__}")
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            raise TypeError(f"prompts[{index}]: expected a string, got {type(prompt).__name__} {prompt!r}")
        if not prompt:
            raise ValueError(f"prompts[{index}]: expected at least one character, got ''")
    return list(prompts)


def _encoded(prompt: str, encode: Callable[[str], Tensor]) -> Tensor:
    """``encode(prompt)``, its refusal naming the prompt (``encode`` names its argument ``text``)."""
    try:
        return encode(prompt)
    except ValueError as err:
        raise ValueError(f"prompt {prompt!r}: {str(err).partition(': ')[2]}") from None


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
    config, _ = run_state_beside(
        paths, "their vocabulary", "whose run config names the data set to read it from", "data set"
    )
    data = config.data
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
    on_text: Callable[[int, str, str], None] | None,
    on_generation: Callable[[int, Generation], None] | None,
    on_start: Callable[[], None] | None,
) -> list[Generation]:
    encoded = [_encoded(prompt, vocab.encode) for prompt in prompts]  # (t,) each; all checked first
    if on_start is not None:
        on_start()
    device = next(model.parameters()).device
    results = []
    for prompt, ids in zip(prompts, encoded, strict=True):
        tokens = ids.to(device).expand(samples, -1)  # (samples, t): one prompt, one length
        # seeded afresh for each prompt, on the CPU: the same draws whatever the other prompts
        # and the device (generate draws where its generator is)
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        steps = model.stream(
            tokens, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            generator=generator, use_cache=use_cache,
        )
        drawn = []  # (samples,) each
        for step in steps:
            drawn.append(step)
            if on_text is not None:  # reads each step back from the device: only when shown
                for sample, token in enumerate(step.tolist()):
                    on_text(len(results) + sample, prompt, vocab.decode([token]))
        continuations = torch.stack(drawn, dim=1).cpu() if drawn else tokens[:, :0].cpu()  # (samples, new)
        for row in continuations:  # this prompt's samples are complete: shown before the next prompt's
            results.append(Generation("language-model", prompt, vocab.decode(row)))
            if on_generation is not None:
                on_generation(len(results) - 1, results[-1])
    return results


# --- sequence-to-sequence models ------------------------------------------------------------


#: What each sequence task's sources are (:mod:`torchvote.data.sequences`), before the ``<eos>``.
_SOURCE_LAYOUTS = {
    "copy": (re.compile(r"[0-9]+"), "digits, e.g. 12345"),
    "reverse": (re.compile(r"[0-9]+"), "digits, e.g. 12345"),
    "sort": (re.compile(r"[0-9]+"), "digits, e.g. 12345"),
    "addition": (re.compile(r"[0-9]+\+[0-9]+="), "two numbers and a plus sign, e.g. 12+34 (the = is added)"),
}


def _sources(data: str, prompts: list[str]) -> list[str]:
    """The prompts as sources of the task ``data`` (an addition's ``=`` added), each laid out as
    the task's sources are.

    Raises:
        ValueError: a model trained on another data set, no prompt, or a prompt of another layout.
    """
    if data not in _SOURCE_LAYOUTS:
        raise ValueError(
            f"the model was trained on {data!r}; generate reads the sources of the sequence tasks "
            f"({', '.join(SEQUENCE_TASKS)}) only"
        )
    pattern, described = _SOURCE_LAYOUTS[data]
    if not prompts:
        raise ValueError(f"prompts: a seq2seq model needs a source to decode: {described} ({data} task)")
    if data == "addition":  # its sources end with '=' (the task's layout)
        prompts = [prompt if prompt.endswith("=") else f"{prompt}=" for prompt in prompts]
    for prompt in prompts:
        if not pattern.fullmatch(prompt):
            raise ValueError(f"prompt {prompt!r}: the {data} task's sources are {described}")
    return prompts


def _decode(
    model: Any,
    sources: list[str],
    max_new_tokens: int | None,
    use_cache: bool,
    source_limit: int | None,
    on_start: Callable[[], None] | None,
) -> list[Generation]:
    encoded = [_encoded(source, encode_source) for source in sources]  # (s,) each: symbols, <eos>
    for source, ids in zip(sources, encoded, strict=True):
        if source_limit is not None and len(ids) > source_limit:
            raise ValueError(
                f"prompt {source!r}: {len(source)} symbols and <eos>; the model reads at most "
                f"{source_limit} tokens ({source_limit - 1} symbols)"
            )
    check_max_new_tokens(max_new_tokens, model.config.max_len)  # as generate checks it, before on_start
    if on_start is not None:
        on_start()
    batch = _pad(encoded, model.config.pad_id).to(next(model.parameters()).device)  # (n, s)
    output = model.generate(batch, max_new_tokens=max_new_tokens, use_cache=use_cache)  # (n, 1 + m)
    outputs = [decode_sequence(row) for row in output.cpu()]
    return [Generation("seq2seq", source, text) for source, text in zip(sources, outputs, strict=True)]


def _pad(sequences: list[Tensor], pad_id: int) -> Tensor:
    """``(n, longest)``: each sequence, then ``pad_id``."""
    batch = torch.full((len(sequences), max(len(s) for s in sequences)), pad_id, dtype=torch.long)
    for row, sequence in zip(batch, sequences, strict=True):
        row[: len(sequence)] = sequence
    return batch
