"""Positional encodings: attention is blind to order, so positions are added to the tokens.

Weighted voting sums the votes of the senders whatever their order (permuting the keys permutes
nothing in the output), so a sequence model has to write each token's position into its features.
Both modules take ``(..., T, E)`` and add the encodings of positions ``offset .. offset + T - 1``;
``offset`` lets an incremental decoder feed one new token at a time.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from torchvote.validation import (
    check_device,
    check_float_dtype,
    check_inputs_beside,
    check_positive_int,
    check_probability,
    is_integer,
)

__all__ = ["SinusoidalPositionalEncoding", "LearnedPositionalEmbedding"]


def _check_positions(inputs: Tensor, embed_dim: int, max_len: int, offset: int) -> None:
    if not isinstance(inputs, Tensor):
        raise TypeError(f"inputs must be a tensor, got {type(inputs).__name__}")
    if inputs.dim() < 2 or inputs.shape[-1] != embed_dim:
        raise ValueError(f"inputs must have shape (..., T, {embed_dim}), got {tuple(inputs.shape)}")
    if not inputs.is_floating_point():  # integer features would truncate the encodings away
        raise TypeError(f"inputs must be floating point, got dtype {inputs.dtype}")
    if not is_integer(offset) or offset < 0:
        raise ValueError(f"offset must be a non-negative integer, got {offset!r}")
    length = inputs.shape[-2]
    if offset + length > max_len:
        raise ValueError(
            f"positions {offset}..{offset + length - 1} (offset={offset}, T={length}) exceed "
            f"max_len={max_len}; build the module with a larger max_len"
        )


def _sinusoidal_table(max_len: int, embed_dim: int) -> Tensor:
    """The ``(max_len, embed_dim)`` table of Vaswani et al. 2017, sec. 3.5, in float64.

    ``PE[pos, 2k] = sin(pos / 10000^(2k / E))`` and ``PE[pos, 2k + 1] = cos(pos / 10000^(2k / E))``.
    For odd ``E`` the last column is a sine (there is one more even index than odd).

    The angles are formed in float64: in float32 ``pos * frequency`` loses about ``pos * 6e-8``
    radians, which at ``pos = 5000`` is an error of ``3e-4`` in the encoding.
    """
    cpu = torch.device("cpu")  # never the default device (a "meta" or "cuda" one)
    positions = torch.arange(max_len, dtype=torch.float64, device=cpu).unsqueeze(1)  # (T, 1)
    even = torch.arange(0, embed_dim, 2, dtype=torch.float64, device=cpu)  # (ceil(E / 2),)
    frequencies = torch.exp(-math.log(10000.0) * even / embed_dim)
    angles = positions * frequencies  # (T, ceil(E / 2))
    table = torch.empty(max_len, embed_dim, dtype=torch.float64, device=cpu)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles[:, : embed_dim // 2])
    return table


def _refill_after_load(module: SinusoidalPositionalEncoding, _incompatible_keys: object) -> None:
    """``load_state_dict``'s post-hook: the table, which no state dict holds, computed again."""
    module.reset_parameters()


class SinusoidalPositionalEncoding(nn.Module):
    """Fixed sine / cosine positions (Vaswani et al. 2017, "Attention Is All You Need", sec. 3.5).

    The table is a non-persistent buffer (it is not saved in ``state_dict``: it is a function of
    the sizes alone), computed in float64 and stored in ``dtype`` (default: the default dtype);
    it follows the module's ``.to()`` and is cast to the inputs' dtype when added. ``.to()``
    converts the stored values: a float32 table widened by ``.double()`` keeps float32's
    rounding (about 3e-8), and one taken through ``.half().float()`` float16's (about 2e-4);
    build with ``dtype=torch.float64``, or call :meth:`reset_parameters` after the conversion,
    for a table exact in its dtype. Built on the ``"meta"`` device it holds no values: after
    ``to_empty()``, :meth:`reset_parameters` fills it, and so does ``load_state_dict`` (which has
    no table to load); ``load_state_dict(assign=True)`` alone leaves it on ``"meta"`` (it assigns
    only what the state dict holds), and the forward pass says so.

    Args:
        embed_dim: feature size ``E`` (odd sizes are fine: the last column is a sine).
        max_len: number of positions in the table.
        dropout: dropout on the sum, as in the paper (sec. 5.4), in training mode only.
        device: where to create the table.
        dtype: the table's dtype, floating point.

    Raises:
        ValueError: a non-positive size or ``dropout`` outside ``[0, 1)``.
        TypeError: a ``dtype`` that is not a floating-point ``torch.dtype`` (an integer table
            would truncate the encodings to -1, 0 and 1).
    """

    table: Tensor

    def __init__(
        self,
        embed_dim: int,
        *,
        max_len: int = 5000,
        dropout: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_positive_int(embed_dim, "embed_dim")
        check_positive_int(max_len, "max_len")
        check_probability(dropout, "dropout")
        check_float_dtype(dtype)
        self.embed_dim, self.max_len = embed_dim, max_len
        self.dropout = nn.Dropout(dropout)
        table = torch.empty(max_len, embed_dim, device=device, dtype=dtype)  # (T, E), filled below
        self.register_buffer("table", table, persistent=False)
        self.reset_parameters()
        # a model built on "meta", moved by to_empty() and loaded had this memory's garbage here
        self.register_load_state_dict_post_hook(_refill_after_load)  # a function: the module pickles

    def reset_parameters(self) -> None:
        """(Re)compute the table in place: in float64 on the CPU (the same numbers on every
        device), then cast into the buffer's dtype and device. A table on ``"meta"`` has no values
        to fill; call this after ``module.to_empty(device=...)`` (``load_state_dict`` calls it: the
        state dict holds no table)."""
        if self.table.is_meta:
            return
        with torch.no_grad():
            self.table.copy_(_sinusoidal_table(self.max_len, self.embed_dim))  # (T, E)

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, max_len={self.max_len}"

    def forward(self, inputs: Tensor, *, offset: int = 0) -> Tensor:
        """Add the encodings of positions ``offset .. offset + T - 1``.

        Args:
            inputs: ``(..., T, E)``, e.g. ``(b, T, E)``.
            offset: position of the first token (for incremental decoding).

        Returns:
            ``(..., T, E)``, in the dtype of ``inputs``.

        Raises:
            ValueError: wrong feature size, an offset that is not a non-negative int,
                ``offset + T > max_len``, ``inputs`` on another device than the table, or a
                table still on ``"meta"`` (never filled).
            TypeError: ``inputs`` not a floating-point tensor.
        """
        _check_positions(inputs, self.embed_dim, self.max_len, offset)
        if self.table.is_meta and not inputs.is_meta:  # not "move the inputs to meta"
            raise ValueError(
                "the sinusoidal table was never filled: the module was built on the 'meta' device "
                "and not moved with to_empty(device=...) (load_state_dict(assign=True) leaves a "
                "buffer no state dict holds on 'meta'); call to_empty(device=...), then load the "
                "weights, or reset_parameters() after moving the table"
            )
        check_device(inputs, self.table.device, "inputs", "the encodings")
        positions = self.table[offset : offset + inputs.shape[-2]]  # (T, E)
        return self.dropout(inputs + positions.to(inputs.dtype))


class LearnedPositionalEmbedding(nn.Module):
    """One learned vector per position (as in BERT and GPT-2), added to the tokens.

    Args:
        max_len: number of positions.
        embed_dim: feature size ``E``.
        device: where to create the parameters.
        dtype: the parameters' dtype.

    Raises:
        ValueError: a non-positive size.
    """

    def __init__(
        self,
        max_len: int,
        embed_dim: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_positive_int(max_len, "max_len")
        check_positive_int(embed_dim, "embed_dim")
        check_float_dtype(dtype)
        self.embed_dim, self.max_len = embed_dim, max_len
        self.weight = nn.Parameter(torch.empty(max_len, embed_dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw the embeddings again from ``N(0, 0.02^2)`` (GPT-2's initialisation), as the
        constructor does (after ``to_empty()`` of a module built on the ``"meta"`` device)."""
        nn.init.normal_(self.weight, std=0.02)

    def extra_repr(self) -> str:
        return f"max_len={self.max_len}, embed_dim={self.embed_dim}"

    def forward(self, inputs: Tensor, *, offset: int = 0) -> Tensor:
        """Add the embeddings of positions ``offset .. offset + T - 1``.

        Args:
            inputs: ``(..., T, E)``.
            offset: position of the first token (for incremental decoding).

        Returns:
            ``(..., T, E)``.

        Raises:
            ValueError: wrong feature size, an offset that is not a non-negative int,
                ``offset + T > max_len``, or ``inputs`` on another device than the embeddings.
            TypeError: ``inputs`` not a floating-point tensor of the embeddings' dtype (outside
                ``torch.autocast``; float16 inputs came back float32).
        """
        _check_positions(inputs, self.embed_dim, self.max_len, offset)
        check_inputs_beside(self.weight, (("inputs", inputs),))
        return inputs + self.weight[offset : offset + inputs.shape[-2]]  # (..., T, E)
