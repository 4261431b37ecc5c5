"""How torchvote's code meets PyTorch's tracers: ``torch.export``, ``torch.func`` transforms and
forward-mode AD (``torch.compile`` needs nothing here: it traces every module in one graph, see
``tests/test_graph_breaks.py``).

- :func:`plain_ops_required`: whether the blocked CPU kernels (autograd Functions writing into
  buffers they allocate) must step aside for plain differentiable operations, which give the same
  numbers; :func:`under_autograd_transforms`, the same question without ``torch.export``.
- :func:`under_vmap`: whether a backward runs batched (``is_grads_batched``, a vectorised
  Jacobian), which the kernels' backward cannot.
- :func:`is_exporting`: whether ``torch.export`` (not ``torch.compile``) is tracing, where this
  torch can tell (2.6 and later).
- :func:`register_output`: a dataclass (or named tuple) that a module takes or returns, made a
  pytree node so that ``torch.export`` can return it and ``torch.export.save`` / ``load`` write
  and find it.
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor

__all__ = ["is_exporting", "plain_ops_required", "register_output", "under_autograd_transforms", "under_vmap"]


def is_exporting() -> bool:
    """Whether ``torch.export`` is tracing the caller, and not ``torch.compile``.

    Reads the flag that strict and non-strict export set (``torch.compiler._is_exporting_flag``,
    torch 2.6 and later) rather than calling ``torch.compiler.is_exporting()``: before PyTorch
    2.13, ``torch.compile`` traced that call as ``True`` (pytorch/pytorch#176347), which took
    every compiled model down its export path (plain operations in place of the CPU kernels, the
    GRU seq2seq refused). Always False on torch 2.5, which has neither (an export there traces
    the code as it is, and fails where it would).
    """
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    if flag is not None:
        return bool(flag)
    check = getattr(torch.compiler, "is_exporting", None)
    return bool(check()) if check is not None else False


def plain_ops_required(*tensors: Tensor | None) -> bool:
    """Whether torchvote's blocked kernels must give way to plain differentiable operations.

    The kernels (:mod:`~torchvote.functional.routing_votes`,
    :mod:`~torchvote.functional.dynamic_kernel`, :mod:`~torchvote.functional.em_kernel`) are
    autograd Functions that write into buffers they allocate; the attention weights of
    :mod:`~torchvote.functional.attention`, formed without a gradient, are a softmax written over
    the logits (``out=``). Under a ``torch.func`` transform (``vmap``, ``grad``,
    ``jacrev``, ``jvp``, per-sample gradients) they cannot run: a transform rejects a Function
    without ``setup_context``, ``vmap`` cannot batch an ``out=`` product or an in-place write of a
    batched value into an unbatched buffer. Forward-mode AD needs a ``jvp`` they do not have.
    ``torch.export`` traces a Function's forward as plain operations, whose ``out=`` products
    fail when the exported program runs with gradients on, and whose tiles, sized by the batch,
    would fix the program's batch size. Their callers then compute the same numbers with plain
    tensor operations (the memory of materialised votes).

    Args:
        *tensors: the kernel's tensor arguments (``None`` is skipped), checked for a forward-mode
            tangent.

    Returns:
        True under a transform or ``torch.export``, or with a tangent on one of ``tensors``.
    """
    return is_exporting() or under_autograd_transforms(*tensors)


def under_autograd_transforms(*tensors: Tensor | None) -> bool:
    """Whether a ``torch.func`` transform is running or one of ``tensors`` carries a forward-mode
    tangent (``torch.autograd.forward_ad``): :func:`plain_ops_required` but for ``torch.export``.

    ``F.scaled_dot_product_attention``'s fused CPU kernels have no forward-mode AD, so attention
    asks for the math kernel here; an exported program keeps the fused kernel it was traced with.

    Args:
        *tensors: tensors to check for a forward-mode tangent (``None`` is skipped).

    Returns:
        True under a transform or with a tangent on one of ``tensors``.
    """
    if torch._C._are_functorch_transforms_active():
        return True
    if fwAD._current_level < 0:  # no dual level entered: no tensor has a tangent (and no call costs)
        return False
    return any(t is not None and fwAD.unpack_dual(t).tangent is not None for t in tensors)


def under_vmap(*tensors: Tensor | None) -> bool:
    """Whether the caller runs under ``vmap``: a ``torch.func`` transform, or one of ``tensors``
    a batched tensor of the older vmap that ``torch.autograd.grad(..., is_grads_batched=True)``
    and ``jacobian`` / ``hessian`` with ``vectorize=True`` run a backward under
    (``torch/_vmap_internals.py``): what a custom backward that cannot be batched checks
    (:func:`~torchvote.functional.voting.refuse_double_backward`).

    Args:
        *tensors: the backward's output gradients (``None`` is skipped).

    Returns:
        True under a transform or with a batched tensor among ``tensors``.
    """
    if torch._C._are_functorch_transforms_active():
        return True
    is_legacy_batched = getattr(torch._C._functorch, "is_legacy_batchedtensor", None)
    return is_legacy_batched is not None and any(t is not None and is_legacy_batched(t) for t in tensors)


def register_output(cls: type) -> type:
    """Make the dataclass ``cls``, returned by a module, a pytree node (its fields the children, a
    ``None`` field kept as ``None``), so that ``torch.export.export`` can return it; its serialized
    name (module and qualified name) lets ``torch.export.save`` write the output's spec and
    ``torch.export.load`` find the class again. A ``NamedTuple`` (a pytree node already) gets
    the serialized name, and a place among the globals ``torch.load(weights_only=True)`` may
    build (a program keeps its example inputs): without them an exported program that takes or
    returns one could not be saved, then not loaded.

    Args:
        cls: a ``@dataclass`` or a ``NamedTuple`` whose fields are tensors, ``None``, or
            containers of them.

    Returns:
        ``cls`` (so it can decorate the class).
    """
    name = f"{cls.__module__}.{cls.__qualname__}"
    if issubclass(cls, tuple) and hasattr(cls, "_fields"):
        torch.utils._pytree._register_namedtuple(cls, serialized_type_name=name)  # torch's own advice
        # a program saves its example inputs, which torch.export.load reads with weights_only
        torch.serialization.add_safe_globals([cls])
    else:
        torch.export.register_dataclass(cls, serialized_type_name=name)
    return cls
