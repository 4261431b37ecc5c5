"""Attention masks, prepared in one place for the fused kernel and the voting loop.

Convention (all of torchvote): a boolean mask is ``True`` where a receiver (query ``i``) may hear
a sender (key ``j``); a float mask is added to the logits (``-inf`` forbids). ``key_mask`` is
``True`` for a real key and ``False`` for padding, the opposite of torch's ``key_padding_mask``.

Index legend: ``b`` batch, ``h`` heads, ``i`` receivers (length ``L``), ``j`` senders (length
``S``).

:func:`prepare_attention_mask` is the one entry point of the modules: attention mask + key mask
(+ an optional receiver mask) + causality -> the ``(mask, is_causal)`` pair that
:func:`torchvote.functional.vote` takes. Only a mask of the logits' full ``(L, S)`` size may turn
into ``is_causal=True`` (a broadcast ``(1, 1)`` mask means "all allowed", not a causal pattern).
:func:`fused_kernel_mask` and :func:`voting_mask` are the last step inside ``vote``: the form the
fused kernel (one of mask or causality, floats in the query's dtype) and the voting loop (one
boolean mask) take; :func:`open_rows_without_senders` makes a query with nothing to attend to
give the fused kernel a finite row, whose output ``vote`` then zeroes.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable

import torch
from torch import Tensor

from torchvote.validation import (
    broadcast_shape,
    caller_stacklevel,
    check_device,
    check_flag,
    check_float_dtype,
    check_tensor_values,
    is_integer,
    values_are_traced,
)

__all__ = [
    "causal_mask",
    "check_attention_mask",
    "check_key_mask",
    "check_mask_dtype",
    "fit_float16_mask",
    "fit_mask_to_dtype",
    "fused_kernel_mask",
    "is_causal_mask",
    "kernel_float_dtype",
    "merge_masks",
    "open_rows_without_senders",
    "prepare_attention_mask",
    "refuse_per_example_3d_mask",
    "restrict_mask",
    "voting_mask",
]


def check_attention_mask(
    mask: Tensor | None, target: tuple[int, ...], argument: str, *, unbatched: bool = False
) -> None:
    """Raise a clear error unless ``mask`` is a usable attention mask for logits of ``target`` shape.

    Args:
        mask: ``None``, a boolean tensor (True = may attend) or a float tensor added to the logits.
        target: the ``(..., L, S)`` shape of the logits the mask applies to.
        argument: the argument's name, for the message.
        unbatched: the inputs had no batch axis and ``target`` is ``(1, h, L, S)``, the batch of 1
            they are attended as: the message then shows the logits as the caller knows them,
            ``(h, L, S)``.

    Raises:
        TypeError: if the mask is neither boolean nor floating point.
        ValueError: if it does not broadcast to ``target`` or a float mask holds NaN or ``+inf``
            (either makes the weights NaN; the values are checked through
            :func:`~torchvote.validation.check_tensor_values`, so not under a ``torch.func``
            transform, where a per-example mask cannot be read).
    """
    if mask is None:
        return
    if not isinstance(mask, Tensor):
        raise TypeError(f"{argument} must be a tensor, got {type(mask).__name__}")
    check_mask_dtype(mask, argument)
    if broadcast_shape(mask.shape, target) != tuple(target):
        shown, axes = (tuple(target[1:]), "(heads, L, S) for unbatched inputs") if unbatched else (
            tuple(target), "(batch..., L, S)")
        raise ValueError(
            f"{argument} of shape {tuple(mask.shape)} does not broadcast to the attention logits' "
            f"shape {shown} {axes}"
        )
    if mask.is_floating_point():
        check_tensor_values(
            ~(torch.isnan(mask) | torch.isposinf(mask)).any(),
            f"{argument} contains NaN or +inf; use -inf to forbid a position",
        )


def check_mask_dtype(mask: Tensor, argument: str = "mask") -> None:
    """Refuse a mask tensor that is neither boolean nor floating point (reads the dtype only).

    Args:
        mask: the mask tensor.
        argument: its name, for the message.

    Raises:
        TypeError: naming ``argument``, what each kind means and the dtype given.
    """
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(
            f"{argument} must be boolean (True = may attend) or floating point (added to the "
            f"logits), got dtype {mask.dtype}"
        )


def is_causal_mask(mask: Tensor) -> bool:
    """True if ``mask`` is a 2-D causal mask (bool lower triangle, or 0 / -inf float), square or
    ``(L, S)`` with ``L != S`` (top-left aligned, as ``is_causal=True`` reads it).

    Such a mask is replaced by ``is_causal=True``, which the fused kernel runs about twice as fast
    on CPU as the same mask given explicitly.

    The values are read (``torch.equal``), which makes an accelerator wait for the host: a 2-D
    square mask costs one synchronisation per call on a GPU (two for a float mask), which the
    attention functions pay once for a mask that a stack's layers are given in turn;
    ``is_causal=True`` costs none. Under ``torch.compile`` or ``torch.export`` such a read is a
    graph break, so the attention functions do not ask while they are traced (the mask is then
    used as given).

    Args:
        mask: a boolean (True = may attend) or float (added to the logits) mask of any shape.

    Returns:
        Whether ``mask`` is ``(L, S)`` and allows exactly ``j <= i``: True below and on the
        diagonal (0 for a float mask) and False above it (``-inf``). False for a mask on the
        ``"meta"`` device, which has no values to read (it is then used as the mask it is).

    Raises:
        TypeError: ``mask`` is not a tensor.
    """
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask must be a tensor, got {type(mask).__name__}")
    if mask.dim() != 2 or mask.is_meta:
        return False
    lower = torch.ones(mask.shape, dtype=torch.bool, device=mask.device).tril()
    if mask.dtype == torch.bool:
        return bool(torch.equal(mask, lower))
    allowed = mask == 0
    forbidden = torch.isneginf(mask)
    return bool(torch.equal(allowed, lower) and torch.equal(forbidden, ~lower))


def _warn_if_blocking_convention(attn_mask: Tensor | None, logits_shape: tuple[int, ...]) -> None:
    """Warn when a boolean ``(L, S)`` ``attn_mask`` is exactly ``torch.nn.MultiheadAttention``'s
    causal mask (True above the diagonal, where that module reads True as *blocked*). Read as
    torchvote reads it (True = may attend), every query would hear only later keys and the last
    one none (zero output): a mask ported without its ``~``. Asked only where reading the values
    is free (eager code on the CPU: not traced, not under a ``torch.func`` transform, where a
    per-example mask has no one value to read; :func:`~torchvote.validation.values_are_traced`),
    so a GPU never waits for it; three entries are read first, so that another mask costs no
    ``(L, S)`` comparison. A model that means that mask (each query hearing only the keys after
    it) can silence the warning with ``warnings.filterwarnings``."""
    if (
        not isinstance(attn_mask, Tensor)
        or attn_mask.dtype != torch.bool
        or attn_mask.dim() != 2
        or len(logits_shape) < 2
        or tuple(attn_mask.shape) != tuple(logits_shape[-2:])
        or min(attn_mask.shape) < 2  # one query or one key: no pattern to read
        or attn_mask.device.type != "cpu"
        or values_are_traced()
    ):
        return
    # the pattern's corners first: (0, 0) blocked, (0, 1) open, the last row blocked
    if bool(attn_mask[0, 0]) or not bool(attn_mask[0, 1]) or bool(attn_mask[-1].any()):
        return
    if torch.equal(attn_mask, ~causal_mask(*attn_mask.shape)):  # True exactly where j > i
        warnings.warn(
            "attn_mask is True exactly above the diagonal: torch.nn.MultiheadAttention's causal mask, "
            "where True means blocked; here True means may attend, so each query hears only later "
            "keys and the last query none. Pass is_causal=True (or ~attn_mask)",
            UserWarning,
            stacklevel=caller_stacklevel(),
        )


#: A float mask's entry at or below this blocks its pair as ``-inf`` does, where a mask's intent is
#: read (:func:`_orders_receivers`): ``exp(-1000)`` is 0 in every floating dtype (float64 included),
#: and BERT-style code writes ``-10000`` (``-9984`` once stored in bfloat16), ``-1e9`` or
#: ``torch.finfo(dtype).min`` for "may not attend".
BLOCKING_LOGIT = -1e3


def _orders_receivers(mask: Tensor) -> bool:
    """Whether a softmax over the receivers under ``mask`` lets later queries change earlier outputs
    where the mask says they must not.

    True where some ``(L, S)`` slice of ``mask`` (any leading axes: per example, per head) blocks
    every later key (``j > i``, top-left aligned as ``is_causal=True``), differs between queries
    (a key-padding pattern, the same for every query, orders nothing), and lets a key reach two
    queries or more (their weights for it then share one softmax, so the later query moves the
    earlier output). A causal mask is such a mask; so are a causal mask merged with padding, a
    per-example causal mask and a causal sliding window. A float mask blocks with ``-inf`` or any
    value at or below :data:`BLOCKING_LOGIT` (``-1000``: the ``-1e4``, ``-1e9`` and ``finfo.min``
    that other code puts there), also where a learned bias was added to it.

    Args:
        mask: boolean (True = may attend) or float (``-inf`` forbids) of shape ``(..., L, S)``.

    Returns:
        The answer; False for a mask of fewer than 2 axes or on the ``"meta"`` device.
    """
    if mask.dim() < 2 or mask.is_meta:
        return False
    mask = mask.detach()
    allowed = mask if mask.dtype == torch.bool else mask > BLOCKING_LOGIT  # (..., i, j)
    slices = allowed.reshape(-1, *allowed.shape[-2:])  # (n, i, j)
    later = torch.ones(slices.shape[-2:], dtype=torch.bool, device=mask.device).triu(1)  # j > i
    blocks_later = ~(slices & later).flatten(1).any(1)  # (n,)
    differs = (slices != slices[:, :1]).flatten(1).any(1)  # (n,): not one row for every query
    shared = (slices.sum(1) >= 2).any(1)  # (n,): a key two queries hear
    return bool((blocks_later & differs & shared).any())


#: For each question :func:`_read_mask_once` asks, the last mask it read: a weak reference, its
#: version, the answer.
_last_reads: dict[object, tuple[weakref.ref[Tensor], int, bool]] = {}


def _read_mask_once(mask: Tensor, question: Callable[[Tensor], bool] | None = None) -> bool:
    """``question(mask)`` (:func:`is_causal_mask` by default), read once for a mask that every
    layer of a model is given in turn: on a GPU each read makes the host wait for the device,
    which a stack of layers would do once per layer. The answer is kept for the last mask each
    question read, while it is the same tensor at the same version (an in-place change reads it
    again); an inference tensor, which has no version, is read every time. A change that bypasses
    autograd's version counter (through ``.data`` or a NumPy view of the tensor) is not seen: give
    the changed mask as a new tensor.

    False, with nothing read, where values cannot be read
    (:func:`~torchvote.validation.values_are_traced`): under ``torch.compile`` or ``torch.export``
    (a graph break) and under a ``torch.func`` transform (inside ``vmap`` a per-example mask has
    one answer per example, and ``bool`` of it raises). The mask is then used as given, with the
    same numbers; the eager call asks."""
    if values_are_traced():
        return False
    question = is_causal_mask if question is None else question
    if mask.is_inference():
        return question(mask)
    last = _last_reads.get(question)
    if last is not None and last[0]() is mask and last[1] == mask._version:
        return last[2]
    answer = question(mask)
    _last_reads[question] = (weakref.ref(mask), mask._version, answer)
    return answer


def causal_mask(receivers: int, senders: int, device: torch.device | None = None) -> Tensor:
    """``(i, j)`` boolean, True where ``j <= i`` (top-left aligned, as the fused kernel)."""
    return torch.ones(receivers, senders, dtype=torch.bool, device=device).tril()


def restrict_mask(mask: Tensor | None, allowed: Tensor) -> Tensor:
    """``mask`` further limited to the ``True`` entries of the boolean ``allowed``.

    Args:
        mask: ``None``, boolean (True = may attend) or float (added to the logits).
        allowed: boolean, broadcastable with ``mask``.

    Returns:
        ``allowed`` (no mask), ``mask & allowed`` (boolean) or ``mask`` with ``-inf`` where
        ``allowed`` is False (float); the broadcast of the two shapes.
    """
    if mask is None:
        return allowed
    if mask.dtype == torch.bool:
        return mask & allowed
    return mask.masked_fill(~allowed, float("-inf"))


def merge_masks(
    attn_mask: Tensor | None, key_mask: Tensor | None, logits_shape: tuple[int, ...]
) -> Tensor | None:
    """One mask (True / finite = may attend) from ``attn_mask`` and ``key_mask``, or None.

    The result is only as large as the broadcast of the two: ``(b, 1, ..., 1, S)`` for a key mask
    alone, ``(b, 1, L, S)`` for a key mask with an ``(L, S)`` mask; nothing is expanded over the
    heads.

    Args:
        attn_mask: boolean or float, broadcastable to ``logits_shape``.
        key_mask: boolean ``(b, S)``.
        logits_shape: ``(b, ..., L, S)``, the shape of the logits the mask applies to.

    Returns:
        A boolean mask, a float mask (``attn_mask`` float: padding set to ``-inf``), or None.

    Raises:
        TypeError, ValueError: as :func:`check_attention_mask`, for torch's ``(b * h, L, S)``
            layout, for a ``key_mask`` that is not boolean ``(b, S)``, and for a ``logits_shape``
            that is not a tuple of at least two sizes (:func:`_check_logits_shape`).
        ValueError: a ``key_mask`` on another device than ``attn_mask``.
    """
    _check_logits_shape(logits_shape)
    batch, source_len = logits_shape[0], logits_shape[-1]
    if (
        isinstance(attn_mask, Tensor)
        and attn_mask.dim() == 3
        and len(logits_shape) == 4
        and batch > 1
        and attn_mask.shape[0] == batch * logits_shape[1]
    ):
        raise ValueError(
            f"attn_mask of shape {tuple(attn_mask.shape)} looks like torch's (batch * heads, L, "
            f"S) layout; pass it as (batch, heads, L, S) = {logits_shape}, e.g. "
            f"mask.view({', '.join(map(str, logits_shape))})"
        )
    check_attention_mask(attn_mask, logits_shape, "attn_mask")
    _warn_if_blocking_convention(attn_mask, logits_shape)
    if key_mask is None:
        return attn_mask
    check_key_mask(key_mask, batch, source_len, "key_mask")
    if attn_mask is not None:  # a CPU mask beside a "meta" one gave uninitialised memory
        check_device(key_mask, attn_mask.device, "key_mask", "attn_mask's entries")
    padding = key_mask.view(batch, *([1] * (len(logits_shape) - 2)), source_len)  # (b, 1.., 1, j)
    return restrict_mask(attn_mask, padding)  # (b, .., i, j)


def _check_logits_shape(logits_shape: tuple[int, ...], minimum: int = 2) -> None:
    """Refuse a ``logits_shape`` that is not a tuple (or list, or ``torch.Size``) of at least
    ``minimum`` sizes, each an integer >= 0 (a symbolic size of a traced shape is taken as it is:
    nothing is compared).

    Raises:
        TypeError: not a tuple or list of integers (``5`` failed with "'int' object is not
            subscriptable").
        ValueError: fewer than ``minimum`` sizes (``()`` failed with an IndexError), or a negative
            one.
    """
    layout = "(b, ..., L, S)" if minimum > 2 else "(..., L, S)"
    if not isinstance(logits_shape, (tuple, list)) or not all(  # `type is int` first: the cheap common case
        type(size) is int or isinstance(size, torch.SymInt) or is_integer(size) for size in logits_shape
    ):
        raise TypeError(f"logits_shape must be a tuple of sizes {layout}, got {logits_shape!r}")
    if len(logits_shape) < minimum or any(
        not isinstance(size, torch.SymInt) and size < 0 for size in logits_shape
    ):
        raise ValueError(
            f"logits_shape must be {layout}: at least {minimum} sizes, none negative, got "
            f"{tuple(logits_shape)}"
        )


def check_key_mask(key_mask: Tensor | None, batch: int | None, source_len: int, argument: str) -> None:
    """Raise a clear error unless ``key_mask`` is ``None`` or a boolean ``(batch, source_len)``
    padding mask (True = a real key), ``(source_len,)`` for unbatched inputs.

    Args:
        key_mask: the mask given.
        batch, source_len: the shape it must have; ``batch`` ``None`` for unbatched inputs (the
            message then shows ``(S,)``, not the batch of 1 the attention adds).
        argument: its name, for the message (a layer's ``memory_key_mask``, not the ``key_mask``
            of the attention inside it).

    Raises:
        TypeError: not a tensor, or not boolean.
        ValueError: another shape.
    """
    if key_mask is None:
        return
    if not isinstance(key_mask, Tensor):
        raise TypeError(f"{argument} must be a tensor, got {type(key_mask).__name__}")
    if key_mask.dtype != torch.bool:
        raise TypeError(
            f"{argument} must be boolean (True = real key, False = padding), got dtype {key_mask.dtype}"
        )
    if batch is None:
        if tuple(key_mask.shape) != (source_len,):
            raise ValueError(
                f"{argument} must have shape (S,) = ({source_len},) for unbatched inputs, got "
                f"{tuple(key_mask.shape)}"
            )
    elif tuple(key_mask.shape) != (batch, source_len):
        raise ValueError(
            f"{argument} must have shape (batch, S) = {(batch, source_len)}, got {tuple(key_mask.shape)}"
        )


def kernel_float_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a float mask takes for queries of ``dtype``: float32 for half types (the fused
    kernel takes that or the queries' dtype; the voting loop keeps the precision), else ``dtype``."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def refuse_per_example_3d_mask(attn_mask: Tensor | None, logits_shape: tuple[int, ...]) -> None:
    """For a module whose logits are ``(batch, heads, L, S)``, called with batched inputs: refuse a
    3-D ``attn_mask`` of more than one slice, whatever the batch. Three conventions read it three
    ways (torch's ``nn.MultiheadAttention``: ``(batch * heads, L, S)``; d2l-style code: one per
    example, ``(batch, L, S)``; broadcasting: one per head, ``(heads, L, S)``), and broadcasting
    alone would apply a per-example mask per head whenever ``batch == heads``. Refusing only then
    (as before) made a per-head mask fail on the one batch whose size equals the heads, a short last
    batch of a training run; refused always, the first call says which 4-D form to give. A mask of
    one slice, ``(1, L, S)``, is one for every example and head. Unbatched inputs (the module's own
    batch of 1) keep torch's ``(heads, L, S)``: not passed here. The functional attention keeps plain
    broadcasting, as ``F.scaled_dot_product_attention`` does: its leading axes need not be
    ``(batch, heads)``.

    Raises:
        ValueError: naming the ``(batch, 1, L, S)`` and ``(1, heads, L, S)`` forms that say which.
    """
    if not isinstance(attn_mask, Tensor) or attn_mask.dim() != 3 or attn_mask.shape[0] == 1:
        return
    batch, heads = logits_shape[0], logits_shape[1]
    if batch > 1 and attn_mask.shape[0] == batch * heads:
        return  # torch's layout: prepare_attention_mask says how to reshape it
    raise ValueError(
        f"attn_mask of shape {tuple(attn_mask.shape)} is 3-D with {attn_mask.shape[0]} slices, which "
        f"batched inputs read ambiguously (per example, per head, or torch's batch * heads; logits "
        f"{logits_shape} are (batch, heads, L, S)): give it 4-D, per example as (batch, 1, L, S), "
        f"e.g. mask.unsqueeze(1), or per head as (1, heads, L, S), e.g. mask.unsqueeze(0)"
    )


def prepare_attention_mask(
    attn_mask: Tensor | None,
    key_mask: Tensor | None,
    logits_shape: tuple[int, ...],
    *,
    is_causal: bool = False,
    receiver_mask: Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[Tensor | None, bool]:
    """The ``(mask, is_causal)`` that :func:`~torchvote.functional.vote` takes, from every mask form.

    Args:
        attn_mask: boolean (True = may attend) or float (added to the logits), ``(L, S)`` or
            broadcastable to ``logits_shape``.
        key_mask: boolean ``(b, S)``, True for a real key, False for padding.
        logits_shape: ``(b, ..., L, S)``, the logits the mask applies to.
        is_causal: receiver ``i`` hears only senders ``j <= i`` (top-left aligned).
        receiver_mask: boolean ``(b, L)``, False for receivers that may take no vote (padded
            queries in routing normalised over the receivers); needs ``logits_shape`` of at
            least 3 sizes ``(b, ..., L, S)``.
        dtype: the queries' dtype (a floating-point ``torch.dtype``, or ``None`` to keep the
            mask's); a float mask is cast to it (float32 for half types).

    Returns:
        ``(mask, is_causal)``: the merged mask (boolean, float, or None) and the causality. A
        mask of exactly the ``(L, S)`` size that is causal becomes ``(None, True)``, the fused
        kernel's fast path; a broadcast mask never does.

    Raises:
        TypeError, ValueError: as :func:`merge_masks`; for a ``receiver_mask`` that is not boolean
            ``(b, L)`` (or beside a ``logits_shape`` of fewer than 3 sizes), and an ``is_causal``
            that is not a bool.
        TypeError: a ``dtype`` that is not a floating-point ``torch.dtype`` or ``None`` (a boolean
            or integer one turned a float mask's ``-inf`` into ``True`` or ``INT64_MIN``).
        ValueError: a ``receiver_mask`` on another device than the other masks.
    """
    check_flag(is_causal, "is_causal")
    check_float_dtype(dtype)
    mask = merge_masks(attn_mask, key_mask, logits_shape)
    if receiver_mask is not None:
        _check_logits_shape(logits_shape, minimum=3)
        batch, target_len = logits_shape[0], logits_shape[-2]
        if not isinstance(receiver_mask, Tensor) or receiver_mask.dtype != torch.bool:
            described = (
                receiver_mask.dtype if isinstance(receiver_mask, Tensor) else type(receiver_mask).__name__
            )
            raise TypeError(f"receiver_mask must be a boolean tensor (True = takes votes), got {described}")
        if tuple(receiver_mask.shape) != (batch, target_len):
            raise ValueError(
                f"receiver_mask must have shape (batch, L) = {(batch, target_len)}, got "
                f"{tuple(receiver_mask.shape)}"
            )
        if mask is not None:
            check_device(receiver_mask, mask.device, "receiver_mask", "the other masks")
        receivers = receiver_mask.view(batch, *([1] * (len(logits_shape) - 3)), target_len, 1)
        mask = restrict_mask(mask, receivers)  # (b, .., i, j)
    # Only a mask of the logits' full (L, S) size can stand for is_causal: a (1, 1) mask
    # broadcasts to "all allowed", not to a causal pattern. The rank first: under torch.export a
    # batch size compared with L would put a guard on it. Not while torch.compile or torch.export
    # traces, nor under a torch.func transform: reading the mask's values there is a graph break
    # (fullgraph=True and export fail), and inside vmap a per-example mask has no one value to
    # read; the traced or transformed call takes the mask as it is, with the same numbers.
    # A float mask that needs a gradient (a learned bias) stays a mask, whatever its values.
    full = mask is not None and mask.dim() == 2 and tuple(mask.shape) == tuple(logits_shape[-2:])
    full = full and not mask.requires_grad
    if full and not values_are_traced() and _read_mask_once(mask):
        mask, is_causal = None, True
    if mask is not None and mask.is_floating_point() and dtype is not None:
        mask = mask.to(kernel_float_dtype(dtype))
    return mask, is_causal


def fused_kernel_mask(
    mask: Tensor | None, is_causal: bool, receivers: int, senders: int, dtype: torch.dtype
) -> tuple[Tensor | None, bool]:
    """``(mask, is_causal)`` as ``F.scaled_dot_product_attention`` takes them.

    The kernel takes a mask or causality, not both, so causality is folded into a given mask; a
    float mask is cast to the queries' ``dtype`` (to float16 or bfloat16 through
    :func:`fit_mask_to_dtype`, whose values neither overflow nor lose the weights); a mask of
    fewer than 2 axes (which broadcasts, but which the kernel refuses) gains leading ones.
    """
    if mask is not None and mask.dim() < 2:
        mask = mask.view(*([1] * (2 - mask.dim())), *mask.shape)  # (1.., j): the kernel needs (.., i, j)
    if mask is not None and is_causal:
        mask = restrict_mask(mask, causal_mask(receivers, senders, mask.device))  # (.., i, j)
        is_causal = False
    if mask is not None and mask.is_floating_point() and mask.dtype != dtype:
        mask = fit_mask_to_dtype(mask, dtype).to(dtype)
    return mask, is_causal


_HALF_DTYPES = (torch.float16, torch.bfloat16)


def fit_mask_to_dtype(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A float mask made safe to meet logits of a narrower half ``dtype``, with the same weights.

    Cast as it is, a float32 mask loses what its rows say: in float16 an entry below -65504
    becomes ``-inf`` (a row of them would allow nothing), and in bfloat16, with 8 bits of
    mantissa, an entry near 200 moves by up to 0.5, each weight by up to ``e^0.5``; the
    ``finfo(float32).min`` that blocks in Hugging Face's masks becomes ``-inf``.
    (``F.scaled_dot_product_attention`` itself keeps a float32 mask in float32.) A row's softmax
    does not change when a constant is added to it, so each row is shifted until its largest
    finite entry is 0: the entries that carry weight are then small, where the half dtype is
    fine, and finite entries still below ``finfo(dtype).min`` (whose weights are exactly 0 in
    ``dtype`` and float32 alike) are clamped to it; ``-inf`` stays ``-inf``. The shift is a
    constant of the row without gradient: a mask that needs one gets the gradient it would get
    unshifted. A mask of ``dtype`` itself, or for logits wider than half, is returned as it is.

    Args:
        mask: a floating-point mask ``(..., i, j)`` (finite or ``-inf``), added to the logits.
        dtype: the logits' dtype.

    Returns:
        The mask, shifted and clamped where ``dtype`` is float16 or bfloat16 and the mask of
        another dtype, in its own dtype, at least float32 (the caller casts it).
    """
    if dtype not in _HALF_DTYPES or mask.dtype == dtype or not mask.is_floating_point():
        return mask
    mask = mask.to(torch.promote_types(mask.dtype, torch.float32))  # the bound exact: -65504 is not bfloat16
    finite = torch.isfinite(mask)
    peak = mask.detach().masked_fill(~finite, float("-inf")).amax(dim=-1, keepdim=True)  # (..., i, 1)
    shifted = mask - peak.nan_to_num(neginf=0.0)  # a row with nothing allowed stays -inf
    return torch.where(finite, shifted.clamp(min=torch.finfo(dtype).min), shifted)


def fit_float16_mask(mask: Tensor) -> Tensor:
    """:func:`fit_mask_to_dtype` for float16 logits (entries below -65504 would be ``-inf``).

    Args:
        mask: a floating-point mask ``(..., i, j)`` (finite or ``-inf``), added to the logits.

    Returns:
        As :func:`fit_mask_to_dtype` with ``dtype=torch.float16``.
    """
    return fit_mask_to_dtype(mask, torch.float16)


def open_rows_without_senders(mask: Tensor) -> tuple[Tensor, Tensor]:
    """``(mask, dead)``: a fused-kernel mask whose rows that allow no sender allow every sender,
    and those rows, ``True`` in ``dead``; the caller zeroes their outputs after the kernel.

    What ``F.scaled_dot_product_attention`` gives a query with nothing to attend to depends on the
    kernel and the torch version: zeros from the CPU kernels of the torch versions torchvote
    supports, NaN from the math kernel before torch 2.5 and, for some versions, from CUDA's
    memory-efficient kernel (pytorch/pytorch#110213); a NaN row would also make the gradients NaN
    even where its output is then zeroed. Opened, the row is a finite uniform average whose output
    is replaced by zero, so its gradient is zero on every kernel. One reduction over the mask, no
    host read.

    Args:
        mask: boolean (True = may attend) or float (``-inf`` forbids), ``(..., i, j)``.

    Returns:
        The opened mask (same dtype, same shape) and ``dead``, boolean ``(..., i, 1)``.
    """
    if mask.shape[-1] == 0:  # no senders at all: every row is dead, and nothing to open
        return mask, torch.ones((*mask.shape[:-1], 1), dtype=torch.bool, device=mask.device)
    # Elementwise maxima over the mask (as bytes for a boolean one): on a CPU about 10x faster
    # than `any` / `|` on booleans and `isneginf().all()` / `masked_fill` on floats.
    if mask.dtype == torch.bool:
        as_bytes = mask.view(torch.uint8)
        dead = as_bytes.amax(dim=-1, keepdim=True) == 0  # (..., i | 1, 1), as the mask broadcasts
        return torch.maximum(as_bytes, dead.view(torch.uint8)).view(torch.bool), dead
    dead = mask.amax(dim=-1, keepdim=True) == float("-inf")  # (..., i | 1, 1); no NaN: checked
    floor = torch.zeros(dead.shape, dtype=mask.dtype, device=mask.device).masked_fill(~dead, float("-inf"))
    return torch.maximum(mask, floor), dead  # a dead row: max(-inf, 0) = 0; the others unchanged


def voting_mask(
    mask: Tensor | None, is_causal: bool, receivers: int, senders: int, device: torch.device
) -> Tensor | None:
    """The boolean mask (True = may vote) of the voting loop from a boolean mask and/or causality.

    A float mask is added to the logits by the loop and contributes nothing here.

    Raises:
        TypeError: a mask that is neither boolean nor floating point.
    """
    bool_mask = None
    if mask is not None:
        check_mask_dtype(mask)
        bool_mask = mask if mask.dtype == torch.bool else None
    if is_causal:
        bool_mask = restrict_mask(bool_mask, causal_mask(receivers, senders, device))
    return bool_mask
