"""Matrix capsule layers with EM routing: Hinton, Sabour & Frosst 2018, "Matrix capsules with EM
routing", sec. 4 (the architecture) and Procedure 1 (the routing).

A matrix capsule is a pose (a ``P x P`` matrix, 4 x 4 in the paper) and an activation. They travel
together as :class:`MatrixCapsules` (two tensors, never packed into one). Layers:

- :class:`PrimaryMatrixCapsules`: 1x1 convolutions to poses and sigmoid activations;
- :class:`ConvMatrixCapsules`: each output position routes from a ``K x K`` patch of the input
  grid; votes ``V = M_i W_ij`` with one matrix per (kernel position, input type, output type),
  shared across positions; patches gathered with ``F.unfold``, never a Python loop over positions;
- :class:`ClassMatrixCapsules`: one matrix per (input type, class) shared across positions, plus
  coordinate addition.

Routing is :class:`~torchvote.nn.routers.EMRouter` (:func:`torchvote.functional.em.em_routing`,
the same module ``CapsuleLinear(routing="em")`` uses). In a convolutional layer an input capsule
falls in several patches; by default (``normalization="joint"``) its assignments are normalised
jointly over every output capsule of every patch that contains it, as the paper's E-step over
``Omega_{L+1}`` and IBM's public implementation do; ``normalization="per_patch"`` normalises them
over the output capsules of each patch separately (every patch routes on its own).

Index legend: ``b`` batch, ``l`` output positions, ``j`` input capsules of a patch, ``i`` output
capsule types, ``t`` input capsule types, ``h w`` grid rows/columns (not heads, as elsewhere),
``p q r`` pose matrix rows/columns, ``L`` a grid's patch positions (not a query length).

(Over 400 lines: the three layers of the paper's architecture and their shared checks.)
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from typing import Literal, NamedTuple, get_args

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from torchvote.functional.em_kernel import (
    PerSenderVotes,
    SenderGroups,
    conv_sender_groups,
    prepared_conv_sender_groups,
)
from torchvote.functional.voting import routed_in_dtype
from torchvote.nn.capsules import check_feature_maps
from torchvote.nn.initialization import near_identity_
from torchvote.nn.routers import EMRouter, Router, RoutingResult
from torchvote.nn.routers.base import build_router, result_in_dtype
from torchvote.tracing import register_output, under_autograd_transforms
from torchvote.validation import (
    check_choice,
    check_device,
    check_flag,
    check_float_dtype,
    check_input_dtype,
    check_positive_int,
)

__all__ = [
    "ClassMatrixCapsules",
    "ConvNormalization",
    "ConvMatrixCapsules",
    "MatrixCapsules",
    "PrimaryMatrixCapsules",
    "pose_side",
]


ConvNormalization = Literal["joint", "per_patch"]

#: Input grids (with their device) whose prepared sender groups a :class:`ConvMatrixCapsules` keeps,
#: the least recently used dropped first. Four hold a training resolution and an evaluation one on
#: two devices; inputs of ever new sizes (variable resolution in a long-running process) no longer
#: add an entry each (tens of MiB over ten grids), and the entries of a device the layer left
#: age out. A dropped grid is prepared again from its geometry when it returns: no device read.
_KEPT_GRIDS = 4
#: Held while a layer's kept groups are read or changed (the groups themselves are made outside it).
_PREPARED_GROUPS_LOCK = threading.Lock()


class MatrixCapsules(NamedTuple):
    """Poses and activations of a layer of matrix capsules, kept as two tensors.

    Attributes:
        poses: ``(batch, rows, cols, types, P, P)`` on a grid, or ``(batch, caps, P, P)``.
        activations: ``(batch, rows, cols, types)`` or ``(batch, caps)``, in ``[0, 1]``.
    """

    poses: Tensor
    activations: Tensor


register_output(MatrixCapsules)  # its name in a saved exported program (torch.export.save / load)


def pose_side(pose_dim: int, argument: str = "pose_dim") -> int:
    """The side ``P`` of a ``P x P`` pose with ``pose_dim`` entries.

    Raises:
        ValueError: if ``pose_dim`` is not a positive perfect square.
    """
    check_positive_int(pose_dim, argument)
    side = math.isqrt(pose_dim)
    if side * side != pose_dim:
        raise ValueError(f"{argument} must be a perfect square (P x P poses, e.g. 16), got {pose_dim}")
    return side


def _checked_side(pose_dim: int, **sizes: int) -> int:
    """``P`` of the poses, after checking that every size is a positive int.

    Raises:
        ValueError: naming the first bad size, or a ``pose_dim`` that is not a square.
    """
    for argument, value in sizes.items():
        check_positive_int(value, argument)
    return pose_side(pose_dim)


def _check_grid(
    capsules: MatrixCapsules, types: int, side: int, parameter: Tensor, argument: str = "capsules"
) -> None:
    """Refuse a grid of capsules a layer whose parameters are ``parameter``'s dtype and device
    cannot route: shapes, dtypes and devices only.

    Raises:
        TypeError: not a pair of tensors, poses not floating point of ``parameter``'s dtype or
            activations not of the poses' dtype (outside ``torch.autocast``; a bool or integer
            activation would be read as 0 or 1).
        ValueError: poses not ``(batch, rows, cols, types, side, side)`` or activations not
            ``(batch, rows, cols, types)``; poses not on ``parameter``'s device, activations not
            on the poses'.
    """
    if not isinstance(capsules, (tuple, list)) or len(capsules) != 2:
        raise TypeError(
            f"{argument} must be MatrixCapsules(poses, activations), got {type(capsules).__name__}"
        )
    poses, activations = capsules
    check_input_dtype(poses, parameter.dtype, f"{argument}.poses")
    check_input_dtype(activations, poses.dtype, f"{argument}.activations", "the poses")
    check_device(poses, parameter.device, f"{argument}.poses")
    check_device(activations, poses.device, f"{argument}.activations", "the poses")
    if poses.dim() != 6 or poses.shape[-3:] != (types, side, side):
        raise ValueError(
            f"{argument}.poses must have shape (batch, rows, cols, types={types}, {side}, {side}), "
            f"got {tuple(poses.shape)}"
        )
    if activations.shape != poses.shape[:4]:
        raise ValueError(
            f"{argument}.activations must have shape {tuple(poses.shape[:4])} (batch, rows, cols, "
            f"types), got {tuple(activations.shape)}"
        )


def _layer_dtype(capsules: MatrixCapsules, weight: Tensor) -> torch.dtype:
    """The dtype a routing layer's results have without ``torch.autocast``, the promotion of the
    input poses' and the weight's; under autocast the votes (an einsum) are in autocast's dtype,
    and the results are cast back to this one
    (:func:`~torchvote.functional.voting.routed_in_dtype`)."""
    return torch.promote_types(capsules[0].dtype, weight.dtype)


class PrimaryMatrixCapsules(nn.Module):
    """Primary capsules: a ``P x P`` pose and a sigmoid activation per type and position.

    Hinton et al. 2018, sec. 4: "the pose of each primary capsule is a learned linear transform
    of the output of all the lower-layer ReLUs centred at that location"; the activation is the
    sigmoid of a weighted sum of the same. Both are 1x1 convolutions by default.

    Args:
        in_channels: input feature maps (``A``).
        num_types: capsule types (``B``).
        pose_dim: entries of a pose, a perfect square (16: 4x4 poses).
        kernel_size: 1 in the paper.
        stride: 1 in the paper.
        device: where to create the parameters.
        dtype: the parameters' dtype.

    Raises:
        ValueError: non-positive sizes, a ``pose_dim`` that is not a square.
    """

    def __init__(
        self,
        in_channels: int,
        num_types: int,
        *,
        pose_dim: int = 16,
        kernel_size: int = 1,
        stride: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.side = _checked_side(pose_dim, in_channels=in_channels, num_types=num_types,
                                  kernel_size=kernel_size, stride=stride)
        factory = {"device": device, "dtype": check_float_dtype(dtype)}
        self.num_types = num_types
        self.pose = nn.Conv2d(in_channels, num_types * pose_dim, kernel_size, stride=stride, **factory)
        self.activation = nn.Conv2d(in_channels, num_types, kernel_size, stride=stride, **factory)

    def forward(self, features: Tensor) -> MatrixCapsules:
        """``(b, in_channels, h, w)`` -> poses ``(b, h', w', types, P, P)`` and activations
        ``(b, h', w', types)``.

        Raises:
            TypeError: ``features`` not a floating-point tensor of the parameters' dtype (outside
                ``torch.autocast``).
            ValueError: ``features`` not ``(b, in_channels, h, w)``, or smaller than the kernel.
        """
        check_feature_maps(features, self.pose)
        poses = rearrange(self.pose(features), "b (t p q) h w -> b h w t p q", t=self.num_types, p=self.side)
        activations = rearrange(torch.sigmoid(self.activation(features)), "b t h w -> b h w t")
        return MatrixCapsules(poses, activations)


class ConvMatrixCapsules(nn.Module):
    """A convolutional layer of matrix capsules routed by EM (Hinton et al. 2018, sec. 4).

    Every output position routes the ``K * K * in_types`` input capsules of its patch to
    ``out_types`` output capsules. The vote of input capsule ``j`` (kernel position ``(kh, kw)``,
    type ``t``) for output type ``i`` is ``V_ij = M_j W_(kh, kw, t), i``: the transformation
    matrices are shared across positions, as a convolution's kernel. Patches come from one
    ``F.unfold`` of the poses and one of the activations, and the votes from one einsum with the
    weights (not repeated over the batch or the positions). All patches route in one call.

    An input capsule lies in up to ``ceil(K / stride)^2`` patches. With ``normalization="joint"``
    (the default) its assignments are normalised over all its parents, the output capsules of
    every patch holding it (the paper's E-step, Procedure 1, over ``Omega_{L+1}``; IBM's public
    implementation does the same), and start at ``1 / |parents|``; the input capsule ids of each
    patch (:func:`~torchvote.functional.em_kernel.conv_sender_groups`) are built once per input
    grid size and kept. ``"per_patch"`` normalises over the ``out_types`` capsules of each patch
    separately, every patch routing on its own.

    Args:
        in_types: input capsule types (``B`` or ``C``).
        out_types: output capsule types (``C`` or ``D``).
        kernel_size: ``K`` (3 in the paper).
        stride: 2 for ConvCaps1, 1 for ConvCaps2 in the paper.
        pose_dim: entries of a pose, a perfect square (16).
        normalization: ``"joint"`` or ``"per_patch"``, as above.
        **routing_options: the :class:`~torchvote.nn.routers.EMRouter`'s options:
            ``iterations`` (3), ``inverse_temperature`` (the ``lambda_t`` schedule, default
            ``0.01 (1 - 0.95^(t+1))``), ``eps`` (variance floor), ``strategy`` (``"auto"``),
            ``empty_activation`` (0.1), ``data_per_parent`` (``None``; ``EMCapsNet``: 100).
        device: where to create the parameters.
        dtype: the parameters' dtype.

    Raises:
        ValueError: non-positive sizes, a ``pose_dim`` that is not a square, an unknown
            ``normalization``, a bad routing option (one the router does not take, or
            ``out_caps``, which ``out_types`` sets).

    Examples:
        >>> import torch
        >>> from torchvote.nn import ConvMatrixCapsules, MatrixCapsules
        >>> _ = torch.manual_seed(0)
        >>> layer = ConvMatrixCapsules(in_types=4, out_types=6, kernel_size=3, stride=2)
        >>> capsules = MatrixCapsules(torch.randn(2, 7, 7, 4, 4, 4), torch.rand(2, 7, 7, 4))  # 4x4 poses
        >>> out = layer(capsules)
        >>> out.poses.shape, out.activations.shape
        (torch.Size([2, 3, 3, 6, 4, 4]), torch.Size([2, 3, 3, 6]))
        >>> layer.output_size(7, 7)
        (3, 3)
    """

    def __init__(
        self,
        in_types: int,
        out_types: int,
        *,
        kernel_size: int = 3,
        stride: int = 1,
        pose_dim: int = 16,
        normalization: ConvNormalization = "joint",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **routing_options,
    ) -> None:
        super().__init__()
        self.side = _checked_side(pose_dim, in_types=in_types, out_types=out_types,
                                  kernel_size=kernel_size, stride=stride)
        self.normalization = check_choice(normalization, get_args(ConvNormalization), "normalization")
        factory = {"device": device, "dtype": check_float_dtype(dtype)}
        self.in_types, self.out_types = in_types, out_types
        self.kernel_size, self.stride = kernel_size, stride
        # sender_groups prepared for routing, by input grid and device, the most recently used last
        self._prepared_groups: OrderedDict[tuple[int, int, torch.device], SenderGroups] = OrderedDict()
        in_caps = kernel_size * kernel_size * in_types
        # (kernel position and input type, output type, P, P), near the identity so poses pass on.
        self.weight = nn.Parameter(torch.empty(in_caps, out_types, self.side, self.side, **factory))
        self.reset_parameters()
        self.routing = build_router(
            EMRouter, EMRouter.name, fixed={"out_caps": out_types, **factory}, options=routing_options,
            argument="routing_options",
        )

    def output_size(self, rows: int, cols: int) -> tuple[int, int]:
        """The output grid for an input grid of ``rows x cols``.

        Raises:
            ValueError: ``rows`` or ``cols`` not a positive integer, or smaller than the kernel
                (the sizes came out negative).
        """
        rows, cols = check_positive_int(rows, "rows"), check_positive_int(cols, "cols")
        if min(rows, cols) < self.kernel_size:
            raise ValueError(
                f"an input grid of {rows}x{cols} is smaller than the kernel_size={self.kernel_size}: "
                "the layer makes no capsule from it"
            )
        return (rows - self.kernel_size) // self.stride + 1, (cols - self.kernel_size) // self.stride + 1

    def sender_groups(self, rows: int, cols: int, device: torch.device | None = None) -> Tensor | None:
        """The input capsule ids of every patch, for the joint normalisation.

        Args:
            rows: input grid rows.
            cols: input grid columns.
            device: where the ids live (the votes' device).

        Returns:
            ``(L, K*K*in_types)`` int64 ids, or ``None`` with ``normalization="per_patch"``.
        """
        if self.normalization == "per_patch":
            return None
        return conv_sender_groups(rows, cols, self.in_types, self.kernel_size, self.stride, device=device)

    def _routing_groups(self, rows: int, cols: int, device: torch.device) -> SenderGroups | None:
        """:meth:`sender_groups` compacted, from the grid's geometry
        (:func:`~torchvote.functional.em_kernel.prepared_conv_sender_groups`): nothing is read
        back from the device (a GPU never waits; votes on ``"meta"`` route too; under
        ``torch.compile`` it traces into the graph). Kept once per grid and device in eager mode,
        for the :data:`_KEPT_GRIDS` grids most recently used; while compiling it is made in the
        graph (a cache filled there would recompile the next call), and under a ``torch.func``
        transform made afresh (kept, its tensors would be the transform's wrappers, which outlive
        it: later transforms failed, copies and pickles too)."""
        if self.normalization == "per_patch":
            return None
        sizes = (rows, cols, self.in_types, self.kernel_size, self.stride)
        if torch.compiler.is_compiling() or under_autograd_transforms():
            return prepared_conv_sender_groups(*sizes, device=device)
        key = (rows, cols, torch.device(device))
        with _PREPARED_GROUPS_LOCK:  # threads sharing the layer: one's eviction raced another's (KeyError)
            groups = self._prepared_groups.pop(key, None)
        if groups is None:  # made outside the lock: a thread needing another grid does not wait
            groups = prepared_conv_sender_groups(*sizes, device=device)
        with _PREPARED_GROUPS_LOCK:
            self._prepared_groups[key] = groups  # the most recently used, last
            while len(self._prepared_groups) > _KEPT_GRIDS:
                self._prepared_groups.popitem(last=False)
        return groups

    def _vote_factors(self, capsules: MatrixCapsules) -> tuple[PerSenderVotes, Tensor, tuple[int, int]]:
        """:meth:`votes` as unformed :class:`PerSenderVotes` (checks as there)."""
        _check_grid(capsules, self.in_types, self.side, self.weight)
        poses, activations = capsules
        rows, cols = poses.shape[1:3]
        if rows < self.kernel_size or cols < self.kernel_size:
            raise ValueError(f"the capsule grid {rows}x{cols} is smaller than kernel_size={self.kernel_size}")
        k, side = self.kernel_size, self.side
        pose_maps = rearrange(poses, "b h w t p q -> b (t p q) h w")
        pose_patches = F.unfold(pose_maps, k, stride=self.stride)  # (b, t*P*P*k*k, L)
        pose_patches = rearrange(
            pose_patches,
            "b (t p q kh kw) l -> b l (kh kw t) p q",
            t=self.in_types,
            p=side,
            q=side,
            kh=k,
            kw=k,
        )  # (b, L, j, P, P)
        act_maps = rearrange(activations, "b h w t -> b t h w")
        act_patches = F.unfold(act_maps, k, stride=self.stride)  # (b, t*k*k, L)
        act_patches = rearrange(act_patches, "b (t kh kw) l -> b l (kh kw t)", t=self.in_types, kh=k, kw=k)
        batch, positions = pose_patches.shape[:2]
        # V = M W as one matrix product per input capsule j on the flattened pose, with the
        # block-diagonal (I kron W_ji): 4x the multiply-adds of 4x4 products (still small), but
        # each vote's 16 entries come out adjacent. Not formed here: EM's blocked strategy forms
        # them a block of patches at a time; materialized, they are written (b L, j, i P*P) and
        # read through the receivers-first view (b, L, i, j, P*P) of that memory.
        left = rearrange(pose_patches, "b l j p q -> j (b l) (p q)")
        eye = torch.eye(side, dtype=self.weight.dtype, device=self.weight.device)
        right = torch.einsum("ps,jiqr->jsqipr", eye, self.weight).reshape(
            -1, side * side, self.out_types * side * side)  # (j, P*P, i*P*P)
        votes = PerSenderVotes(left, right, (batch, positions), self.out_types)  # (b, L, i, j, P*P)
        return votes, act_patches, self.output_size(rows, cols)

    def votes(self, capsules: MatrixCapsules) -> tuple[Tensor, Tensor, tuple[int, int]]:
        """Gather the patches and cast the votes.

        Returns:
            ``(votes, activations, (rows', cols'))``: votes ``(b, L, out_types, K*K*in_types,
            P*P)`` (receivers first; a strided view of ``(b L, j, i P*P)`` memory) and patch
            activations ``(b, L, K*K*in_types)`` for the ``L = rows' * cols'`` output positions.

        Raises:
            ValueError: a grid of the wrong types or pose size, or smaller than the kernel.
            TypeError: poses not of the parameters' floating dtype, activations not of the poses'
                (outside ``torch.autocast``).
        """
        votes, activations, size = self._vote_factors(capsules)
        return votes.materialize(), activations, size

    def forward(self, capsules: MatrixCapsules) -> MatrixCapsules:
        """Poses ``(b, h, w, in_types, P, P)`` and activations ``(b, h, w, in_types)`` ->
        the same on the ``(h', w')`` output grid with ``out_types`` types.

        Raises:
            ValueError: a grid of the wrong types or pose size, or smaller than the kernel.
            TypeError: poses not of the parameters' floating dtype, activations not of the poses'
                (outside ``torch.autocast``).
        """
        votes, activations, (rows, cols) = self._vote_factors(capsules)  # votes unformed
        grid = capsules[0].shape[1:3]  # a plain (poses, activations) pair too, as the check takes
        groups = self._routing_groups(*grid, votes.device)  # (L, j) ids or None
        # (b, L, i, P*P), (b, L, i)
        routed = self.routing.route(votes, activations, sender_groups=groups)
        poses, out_activations = routed_in_dtype(_layer_dtype(capsules, self.weight), *routed)
        poses = rearrange(poses, "b (h w) i (p q) -> b h w i p q", h=rows, p=self.side)
        out_activations = rearrange(out_activations, "b (h w) i -> b h w i", h=rows)
        return MatrixCapsules(poses, out_activations)

    def reset_parameters(self) -> None:
        """Draw the transformation matrices again near the identity, as the constructor does
        (after ``to_empty()`` of a module built on the ``"meta"`` device; the router's
        parameters are its own to reset)."""
        near_identity_(self.weight)

    def extra_repr(self) -> str:
        return (
            f"in_types={self.in_types}, out_types={self.out_types}, kernel_size={self.kernel_size}, "
            f"stride={self.stride}, pose={self.side}x{self.side}, normalization={self.normalization!r}"
        )


class ClassMatrixCapsules(nn.Module):
    """Class capsules: every capsule of the grid votes for every class, with coordinate addition.

    Hinton et al. 2018, sec. 4: the transformation matrices are shared across positions (one per
    input type and class), and "the scaled coordinate (row, column) of the centre of the receptive
    field of each capsule" is added to the first two entries of the right-hand column of its vote
    matrix. The coordinates here are the grid cell centres scaled to ``[0, 1]``, ``(row + 0.5) /
    rows`` and ``(col + 0.5) / cols``, computed from the input grid at call time: a deliberate
    simplification, not the receptive fields' centres in the image (for the small model's 3x3
    ConvCaps2 on 28x28 those are at 0.29, 0.43 and 0.57 of the image, where the cells' centres
    are at 0.17, 0.5 and 0.83); the code of the paper is unpublished.

    Args:
        in_types: input capsule types (``D``).
        num_classes: output capsules (``E``).
        pose_dim: entries of a pose, a perfect square (16).
        coordinate_addition: add the scaled coordinates to the votes.
        routing: another router for the class votes (any of
            :func:`~torchvote.nn.routers.make_router`); default an
            :class:`~torchvote.nn.routers.EMRouter` with ``routing_options``. A router that takes
            no activations gets each vote scaled by its input capsule's activation (an absent
            part casts a weaker vote).
        **routing_options: the default :class:`~torchvote.nn.routers.EMRouter`'s options:
            ``iterations`` (3), ``inverse_temperature`` (the ``lambda_t`` schedule), ``eps``
            (variance floor), ``strategy`` (``"auto"``), ``empty_activation`` (0.1),
            ``data_per_parent`` (``None``).
        device: where to create the parameters.
        dtype: the parameters' dtype.

    Raises:
        ValueError: non-positive sizes, a ``pose_dim`` that is not a square, a pose smaller
            than 2x2 with coordinate addition, a bad routing option (one the router does not
            take, or ``out_caps``, which ``num_classes`` sets), routing options given with
            ``routing``, or a ``routing`` built for other sizes.
        TypeError: ``routing`` neither a :class:`~torchvote.nn.routers.Router` nor None,
            ``coordinate_addition`` not a bool.
    """

    def __init__(
        self,
        in_types: int,
        num_classes: int,
        *,
        pose_dim: int = 16,
        coordinate_addition: bool = True,
        routing: Router | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **routing_options,
    ) -> None:
        super().__init__()
        self.side = _checked_side(pose_dim, in_types=in_types, num_classes=num_classes)
        check_flag(coordinate_addition, "coordinate_addition")
        if routing is not None and not isinstance(routing, Router):
            raise TypeError(f"routing must be a Router module or None, got {type(routing).__name__}")
        if routing is not None and routing_options:
            raise ValueError(
                f"{sorted(routing_options)} configure the default EM router; with routing=... give "
                "them to that router"
            )
        if coordinate_addition and self.side < 2:
            raise ValueError(f"coordinate_addition needs poses of at least 2x2, got pose_dim={pose_dim}")
        factory = {"device": device, "dtype": check_float_dtype(dtype)}
        self.in_types, self.num_classes = in_types, num_classes
        self.coordinate_addition = coordinate_addition
        self.weight = nn.Parameter(torch.empty(in_types, num_classes, self.side, self.side, **factory))
        self.reset_parameters()
        if routing is not None:
            routing.check_layer_sizes("routing", out_caps=num_classes, out_dim=pose_dim)
        self.routing = routing if routing is not None else build_router(
            EMRouter, EMRouter.name, fixed={"out_caps": num_classes, **factory}, options=routing_options,
            argument="routing_options",
        )

    @property
    def router(self) -> Router:
        """The router of the class votes (kept as ``routing``, the name in checkpoints)."""
        return self.routing

    def coordinates(self, rows: int, cols: int, *, like: Tensor) -> Tensor:
        """``(rows, cols, P*P)``: the offsets coordinate addition adds to each position's votes."""
        side = self.side
        row = (torch.arange(rows, device=like.device, dtype=like.dtype) + 0.5) / rows  # (h,)
        col = (torch.arange(cols, device=like.device, dtype=like.dtype) + 0.5) / cols  # (w,)
        offsets = like.new_zeros(rows, cols, side, side)
        offsets[..., 0, side - 1] = row[:, None]  # first row, right-hand column: the row coordinate
        offsets[..., 1, side - 1] = col[None, :]  # second row, right-hand column: the column
        return offsets.flatten(-2)

    def votes(self, capsules: MatrixCapsules) -> tuple[Tensor, Tensor]:
        """``(votes (b, num_classes, h*w*in_types, P*P), activations (b, h*w*in_types))``.

        Raises:
            TypeError, ValueError: a grid of the wrong types, pose size or dtype.
        """
        _check_grid(capsules, self.in_types, self.side, self.weight)
        poses, activations = capsules
        rows, cols = poses.shape[1:3]
        if rows == 0 or cols == 0:  # the router would name its own votes
            raise ValueError(f"capsules must hold at least one grid position, got a grid of {rows} x {cols}")
        votes = torch.einsum("bhwtpq,tiqr->bihwtpr", poses, self.weight).flatten(-2)  # (b, i, h, w, t, P*P)
        if self.coordinate_addition:
            votes = votes + self.coordinates(rows, cols, like=votes)[:, :, None, :]
        votes = rearrange(votes, "b i h w t d -> b i (h w t) d")
        return votes, rearrange(activations, "b h w t -> b (h w t)")

    def forward(
        self, capsules: MatrixCapsules, *, return_routing: bool = False
    ) -> MatrixCapsules | RoutingResult:
        """Route a grid of capsules to the classes.

        Args:
            capsules: poses ``(b, h, w, in_types, P, P)`` and activations ``(b, h, w, in_types)``.
            return_routing: return the router's :class:`~torchvote.nn.routers.RoutingResult`
                (outputs ``(b, num_classes, P*P)``, couplings ``(b, num_classes, h*w*in_types)``,
                EM's activations) instead of matrix capsules.

        Returns:
            Poses ``(b, num_classes, P, P)`` and activations ``(b, num_classes)``, or the result.

        Raises:
            ValueError: a grid of the wrong types or pose size; matrix capsules asked of a router
                that gives no activations.
            TypeError: poses not of the parameters' floating dtype, activations not of the poses'
                (outside ``torch.autocast``), a ``return_routing`` that is not a bool.
        """
        check_flag(return_routing, "return_routing")
        votes, activations = self.votes(capsules)  # (b, i, j, P*P), (b, j)
        if return_routing:
            if self.routing.uses_activations:
                result = self.routing(votes, activations=activations)
            else:
                result = self.routing(votes * activations[:, None, :, None])  # an absent part votes weaker
            return result_in_dtype(result, _layer_dtype(capsules, self.weight))
        if not isinstance(self.routing, EMRouter):
            raise ValueError(f"{type(self.routing).__name__} gives no activations: use return_routing=True")
        routed = self.routing.route(votes, activations)
        poses, out_activations = routed_in_dtype(_layer_dtype(capsules, self.weight), *routed)
        poses = rearrange(poses, "b i (p q) -> b i p q", p=self.side)
        return MatrixCapsules(poses, out_activations)

    def reset_parameters(self) -> None:
        """Draw the transformation matrices again near the identity, as the constructor does
        (after ``to_empty()`` of a module built on the ``"meta"`` device; the router's
        parameters are its own to reset)."""
        near_identity_(self.weight)

    def extra_repr(self) -> str:
        return (
            f"in_types={self.in_types}, num_classes={self.num_classes}, "
            f"coordinate_addition={self.coordinate_addition}"
        )
