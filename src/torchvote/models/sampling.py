"""The next token from a language model's logits: greedy, temperature, top-k and top-p sampling.

:func:`sample_next_token` is one step of
:meth:`~torchvote.models.transformer_lm.TransformerLM.generate`: the logits are divided by the
temperature (``0``: the most likely token, no sampling), cut to the ``top_k`` most likely tokens,
then to the nucleus of top-p sampling (Holtzman et al. 2020, "The Curious Case of Neural Text
Degeneration", ICLR 2020, sec. 3.1): the smallest set of most likely tokens whose probability
reaches ``top_p``, renormalised, which the token is drawn from. As in Hugging Face's
``TopPLogitsWarper``, a token is kept when the tokens more likely than it (sorted by logit,
descending, ties to the lowest id as ``argmax`` breaks them) hold less than ``top_p``, so the most
likely token always stays; ``top_p=1`` keeps every token. A loop of many steps checks its options
once (:func:`check_sampling`) and draws each step with :func:`sample_checked`.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
from torch import Tensor

from torchvote.validation import (
    ArgumentTypeError,
    check_float_tensor,
    check_in_range,
    check_tensor_values,
    is_integer,
)

__all__ = ["check_sampling", "sample_checked", "sample_next_token"]


def sample_next_token(
    logits: Tensor,
    *,
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Draw one token per row of next-token logits.

    The logits are computed in float32 at least (float64 kept). With ``temperature`` 0 the most
    likely token is taken (the lowest id among ties); otherwise the logits, less their row's
    largest, are divided by ``temperature`` in float64, cut by ``top_k`` and then ``top_p``, and
    one token is drawn from their softmax.

    Args:
        logits: ``(b, vocab)`` floating-point next-token logits.
        temperature: a finite number ``>= 0`` (or a one-element tensor of one) that divides the
            logits; ``0`` takes the most likely token (greedy, ``top_k`` and ``top_p`` ignored).
        top_k: a positive integer: keep exactly the ``top_k`` most likely tokens (ties to the
            lowest id; ``vocab`` or more keeps them all); ``None`` for all.
        top_p: a number in ``(0, 1]``: then keep the smallest set of most likely tokens whose
            probability reaches ``top_p`` (nucleus sampling; ``1`` keeps them all); ``None`` for
            all.
        generator: the ``torch.Generator`` of the draw, on any device (the draw happens there);
            ``None`` for PyTorch's global one.

    Returns:
        ``(b, 1)`` int64 token ids, on the device of ``logits``.

    Raises:
        TypeError: ``logits`` not a floating-point tensor; a ``temperature`` or ``top_p`` that is
            not a number (``"1"``, ``None``, a bool; for ``temperature`` a tensor of several
            values); a ``generator`` that is not a ``torch.Generator``.
        ValueError: ``logits`` not of shape ``(b, vocab)`` with ``vocab >= 1``, or a row of them
            holding NaN, only ``-inf`` or, when sampling, ``+inf``; ``temperature`` negative, NaN or infinite;
            ``top_k`` not a positive integer; ``top_p`` outside ``(0, 1]`` or NaN.
    """
    check_float_tensor(logits, "logits")
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must be of shape (batch, vocab) with vocab >= 1, got {tuple(logits.shape)}")
    return sample_checked(logits, *check_sampling(temperature, top_k, top_p, generator))


def check_sampling(
    temperature: Any, top_k: Any, top_p: Any, generator: Any
) -> tuple[float, int | None, float | None, torch.Generator | None]:
    """The sampling options of :func:`sample_next_token`, checked once (a generation loop then
    samples every step with :func:`sample_checked`, which checks nothing).

    Args:
        temperature, top_k, top_p, generator: as :func:`sample_next_token` takes them.

    Returns:
        ``(temperature, top_k, top_p, generator)``: ``temperature`` and ``top_p`` as floats,
        ``top_k`` as an int (or ``None``).

    Raises:
        TypeError, ValueError: as :func:`sample_next_token` raises them for these arguments.
    """
    temperature = _check_temperature(temperature)
    if top_k is not None and (not is_integer(top_k) or top_k < 1):
        error = ValueError if is_integer(top_k) else ArgumentTypeError  # 2.0: a type, 0: a value
        raise error(f"top_k must be a positive integer or None, got {top_k!r}")
    if top_p is not None:  # a bool or a string: ArgumentTypeError, a TypeError and a ValueError
        top_p = check_in_range(top_p, "top_p", 0.0, 1.0, include_low=False)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    return temperature, None if top_k is None else int(top_k), top_p, generator


def sample_checked(
    logits: Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> Tensor:
    """:func:`sample_next_token` on options already checked by :func:`check_sampling`, which a
    generation loop calls once before its steps. Each step checks only the logits' values (a
    model that diverged gives NaN), without reading anything back from an accelerator
    (:func:`~torchvote.validation.check_tensor_values`).

    Args:
        logits, temperature, top_k, top_p, generator: as :func:`sample_next_token` takes them,
            the options as :func:`check_sampling` returns them.

    Returns:
        ``(b, 1)``: the drawn ids, on ``logits``' device.

    Raises:
        ValueError: (on the CPU; a device-side assertion on an accelerator) a row of ``logits``
            holding NaN, or only ``-inf``, or, when sampling, ``+inf``: no token can be drawn
            from it (greedy decoding took the NaN's index, or token 0, in silence; sampling
            failed inside ``torch.multinomial``). Greedy decoding takes a ``+inf`` (a float16
            overflow of the winning logit, say) as the most likely token.
    """
    largest = logits.amax(dim=-1)  # (b,): NaN if the row holds one
    # one kernel, not six, at every token: NaN > -inf is False; a softmax of +inf is NaN
    drawable = torch.isfinite(largest) if temperature != 0.0 else largest > float("-inf")  # (b,)
    check_tensor_values(
        drawable.all(),
        "logits must hold no NaN and a value above -inf in every row"
        + ("" if temperature == 0.0 else ", and no +inf when sampling")
        + " (no token can be drawn from such a row)",
        detail=lambda: f"; rows {torch.nonzero(~drawable).flatten()[:8].tolist()}",
    )
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # (b, vocab); float64 kept
    if temperature == 0.0:
        return logits.argmax(dim=-1, keepdim=True)  # (b, 1)
    filtered = _filtered_logits(logits, temperature, top_k, top_p, largest=largest)  # (b, vocab)
    probabilities = torch.softmax(filtered, dim=-1)  # (b, vocab)
    if generator is not None:  # drawn where the generator is (a CPU one, say)
        probabilities = probabilities.to(generator.device)
    next_token = torch.multinomial(probabilities, 1, generator=generator)  # (b, 1)
    return next_token.to(logits.device)  # (b, 1)


def _filtered_logits(
    logits: Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    *,
    largest: Tensor | None = None,
) -> Tensor:
    """The float64 logits a token is drawn from (their softmax): shifted by the row's largest,
    divided by ``temperature`` (``> 0``), the tokens ``top_k`` and ``top_p`` drop at ``-inf``.

    Args:
        logits: ``(b, vocab)`` floating-point logits.
        temperature, top_k, top_p: checked options (:func:`check_sampling`), ``temperature > 0``.
        largest: ``(b,)`` each row's largest logit, where the caller has it (the check before a
            draw takes it); computed here otherwise.

    Returns:
        ``(b, vocab)`` float64 logits.
    """
    # from the peak: a tiny temperature gives -inf, never inf - inf = NaN; in float64, where a
    # temperature below float32's smallest number is still > 0
    largest = logits.amax(dim=-1) if largest is None else largest  # (b,)
    logits = (logits.double() - largest.double().unsqueeze(-1)) / temperature  # (b, vocab)
    cut_k = top_k is not None and top_k < logits.shape[-1]
    cut_p = top_p is not None and top_p < 1.0  # 1 keeps every token: no sum rounded to 1 drops one
    if not (cut_k or cut_p):
        return logits
    # most likely first by logit, ties to the lowest id as argmax breaks them (two logits whose
    # probabilities round to one value keep their order); one sort serves both cuts
    order = logits.sort(dim=-1, descending=True, stable=True).indices  # (b, vocab)
    if cut_k:
        # exactly top_k tokens: a threshold on the k-th value kept every token tied with it
        # (bfloat16 ties)
        dropped = torch.full_like(logits, float("-inf")).scatter(-1, order[:, :top_k], 0.0)  # (b, vocab)
        logits = logits + dropped  # (b, vocab)
    if cut_p:  # top_k's tokens stay first in the order, the ones it dropped (probability 0) last
        ordered = torch.softmax(logits, dim=-1).gather(-1, order)  # (b, vocab): probabilities, sorted
        mass = torch.cumsum(ordered, dim=-1)  # (b, vocab): entry i, the mass of sorted tokens 0..i
        before = torch.cat([torch.zeros_like(mass[:, :1]), mass[:, :-1]], dim=-1)  # (b, vocab): 0..i-1
        # a token goes when the more likely ones hold top_p already, so the first always stays
        dropped = before >= top_p  # (b, vocab), in sorted order
        dropped = torch.zeros_like(dropped).scatter(-1, order, dropped)  # (b, vocab), in id order
        logits = logits.masked_fill(dropped, float("-inf"))  # (b, vocab)
    return logits


def _check_temperature(temperature: Any) -> float:
    """``temperature`` as a float: a finite real number ``>= 0`` (bools are not), or a
    one-element real tensor of one (read once, here, not at every step).

    Raises:
        TypeError: not a real number (``"1"``, ``None``, a bool, a tensor of several values).
        ValueError: negative, NaN or infinite.
    """
    if (
        isinstance(temperature, Tensor)
        and temperature.numel() == 1
        and temperature.dtype != torch.bool
        and not temperature.is_complex()
    ):
        temperature = temperature.item()
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        described = (
            f"a tensor of shape {tuple(temperature.shape)} and dtype {temperature.dtype}"
            if isinstance(temperature, Tensor)
            else type(temperature).__name__
        )
        raise TypeError(f"temperature must be a number >= 0 (0: greedy), got {described}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    return float(temperature)
