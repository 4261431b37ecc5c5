"""Read and write the IDX format used by the original MNIST files.

Format (LeCun et al., http://yann.lecun.com/exdb/mnist/, "FILE FORMATS FOR THE MNIST DATABASE"):
a 4-byte magic number ``0x00 0x00 <type code> <number of dimensions>``, then one big-endian
uint32 per dimension, then the values in C order, big-endian. Files may be gzip-compressed;
compression is detected from the gzip magic bytes, not from the file name.
"""

from __future__ import annotations

import gzip
import math
import os
import stat
import struct
import zlib
from os import PathLike
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from torch import Tensor

from torchvote.data.errors import CorruptDataError
from torchvote.data.paths import as_path
from torchvote.files import atomic_write_bytes

__all__ = ["IDX_DTYPES", "MAX_GZIP_IDX_BYTES", "read_idx", "write_idx"]

#: IDX type code -> big-endian numpy dtype.
IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_CODE_FOR_KIND = {(dt.kind, dt.itemsize): code for code, dt in IDX_DTYPES.items()}
_GZIP_MAGIC = b"\x1f\x8b"


#: The most bytes a gzip-compressed IDX file may unpack to, checked against the size its header
#: states before anything past the header is decompressed: a few kilobytes of gzip unpack to
#: gigabytes (a crafted 1.5 MB file to 3.3 GB). The largest IDX files in use, EMNIST ByClass's
#: training images, hold 547 MB; MNIST's 47 MB. An uncompressed file is checked against its size
#: on disk instead, which bounds what it can make this process read (a pipe, which has no size,
#: against this bound).
MAX_GZIP_IDX_BYTES = 1 << 30


def read_idx(path: str | PathLike[str]) -> Tensor:
    """Read one IDX file (plain or gzip-compressed).

    Only the data its header announces is read: a gzip stream is decompressed up to that size
    (and one byte more, to tell that more follows), never to its end.

    Args:
        path: The file to read.

    Returns:
        A tensor of the stored shape, in the native-endian torch dtype that matches the stored
        type: uint8, int8, int16, int32, float32 or float64.

    Raises:
        TypeError: If ``path`` is not a ``str`` or ``os.PathLike``.
        FileNotFoundError: If ``path`` does not exist (``IsADirectoryError``: a folder).
        CorruptDataError: (a ``ValueError``) If the gzip stream is corrupt or truncated, the
            magic number, type code or dimension count is invalid, the payload is shorter
            (truncated) or longer than the header announces, or a compressed file's header
            announces more than :data:`MAX_GZIP_IDX_BYTES`. The message names the file.
    """
    path = as_path(path, "path")
    with path.open("rb") as file:
        # peeked, not read and sought back: a pipe (a FIFO, <(zcat ...)) cannot seek
        compressed = file.peek(len(_GZIP_MAGIC))[: len(_GZIP_MAGIC)] == _GZIP_MAGIC
        if not compressed:
            status = os.fstat(file.fileno())
            on_disk = status.st_size if stat.S_ISREG(status.st_mode) else None  # a pipe has no size
            return _read_stream(path, file, on_disk=on_disk)
        try:
            with gzip.GzipFile(fileobj=file, mode="rb") as stream:
                return _read_stream(path, stream, on_disk=None)
        except (EOFError, OSError, zlib.error) as err:  # truncated or corrupt gzip stream
            raise CorruptDataError(f"{path}: corrupt or truncated gzip data ({err})") from err


def _read_stream(path: Path, stream: BinaryIO, on_disk: int | None) -> Tensor:
    """:func:`read_idx` of an open stream: the header, then exactly the data it announces.

    Args:
        path: the file, for the messages.
        stream: the file's bytes, from the start (decompressed where it is gzip).
        on_disk: the size of an uncompressed regular file; ``None`` for a gzip stream or a pipe,
            whose header is checked against :data:`MAX_GZIP_IDX_BYTES` instead.
    """
    start = stream.read(4)
    if len(start) < 4:
        raise CorruptDataError(f"{path}: truncated IDX file ({len(start)} bytes, header needs 4)")
    zero, code, ndim = struct.unpack(">HBB", start)
    if zero != 0:
        raise CorruptDataError(f"{path}: bad IDX magic number 0x{start.hex()} (must start with 0x0000)")
    if code not in IDX_DTYPES:
        known = ", ".join(f"0x{c:02X}" for c in IDX_DTYPES)
        raise CorruptDataError(f"{path}: unknown IDX type code 0x{code:02X} (expected one of {known})")
    if ndim == 0:
        raise CorruptDataError(f"{path}: IDX header declares 0 dimensions")
    header_len = 4 + 4 * ndim
    dims = stream.read(4 * ndim)
    if len(dims) < 4 * ndim:
        raise CorruptDataError(
            f"{path}: truncated IDX header ({4 + len(dims)} bytes, {ndim} dims need {header_len})"
        )
    shape = struct.unpack(f">{ndim}I", dims)
    dtype = IDX_DTYPES[code]
    expected = math.prod(shape) * dtype.itemsize  # Python ints: np.prod's int64 wrapped around
    if on_disk is not None and on_disk - header_len < expected:  # before a read sized by the header
        raise CorruptDataError(
            f"{path}: truncated IDX data: shape {shape} of {dtype.name} needs {expected} bytes, "
            f"file has {on_disk - header_len}"
        )
    if on_disk is None and expected > MAX_GZIP_IDX_BYTES:
        raise CorruptDataError(
            f"{path}: IDX header announces shape {shape} of {dtype.name}, {expected} bytes, more "
            f"than the {MAX_GZIP_IDX_BYTES} a gzip-compressed (or piped) IDX file may hold; not read "
            "(a damaged or crafted file)"
        )
    payload = stream.read(expected + 1)  # one byte more tells that more data follows
    if len(payload) < expected:
        raise CorruptDataError(
            f"{path}: truncated IDX data: shape {shape} of {dtype.name} needs {expected} bytes, "
            f"file has {len(payload)}"
        )
    if len(payload) > expected:
        extra = "" if on_disk is None else f"{on_disk - header_len - expected} "  # unknown for gzip
        raise CorruptDataError(f"{path}: {extra}unexpected trailing bytes after IDX data of shape {shape}")
    array = np.frombuffer(payload, dtype=dtype).reshape(shape)
    return torch.from_numpy(array.astype(dtype.newbyteorder("="), copy=True))


def write_idx(
    path: str | PathLike[str], values: Tensor | np.ndarray, *, compress: bool | None = None
) -> Path:
    """Write an array as one IDX file, atomically (temporary file, then rename).

    Args:
        path: Destination file.
        values: Tensor or array with 1 to 255 dimensions of dtype uint8, int8, int16, int32,
            float32 or float64. Every dimension must be below 2**32.
        compress: Gzip the file. ``None`` (default) compresses when ``path`` ends in ``.gz``.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        TypeError: If ``values`` has a dtype IDX cannot store, or ``path`` is not a ``str`` or
            ``os.PathLike``.
        ValueError: If ``values`` has 0 or more than 255 dimensions, or a dimension >= 2**32.
    """
    path = as_path(path, "path")
    array = values.detach().cpu().numpy() if isinstance(values, Tensor) else np.asarray(values)
    code = _CODE_FOR_KIND.get((array.dtype.kind, array.dtype.itemsize))
    if code is None:
        raise TypeError(
            f"values: IDX cannot store dtype {array.dtype}; "
            "expected uint8, int8, int16, int32, float32 or float64"
        )
    if not 1 <= array.ndim <= 255:
        raise ValueError(f"values: IDX needs 1 to 255 dimensions, got {array.ndim}")
    if any(d >= 2**32 for d in array.shape):
        raise ValueError(f"values: every IDX dimension must be < 2**32, got {array.shape}")
    header = struct.pack(f">HBB{array.ndim}I", 0, code, array.ndim, *array.shape)
    blob = header + np.ascontiguousarray(array, dtype=IDX_DTYPES[code]).tobytes()
    if compress is None:
        compress = path.suffix == ".gz"
    if compress:
        blob = gzip.compress(blob, mtime=0)
    atomic_write_bytes(path, blob)  # its folder made too
    return path
