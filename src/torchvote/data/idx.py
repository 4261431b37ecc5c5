"""Read and write the IDX format used by the original MNIST files.

Format (LeCun et al., http://yann.lecun.com/exdb/mnist/, "FILE FORMATS FOR THE MNIST DATABASE"):
a 4-byte magic number ``0x00 0x00 <type code> <number of dimensions>``, then one big-endian
uint32 per dimension, then the values in C order, big-endian. Files may be gzip-compressed;
compression is detected from the gzip magic bytes, not from the file name.
"""

from __future__ import annotations

import gzip
import math
import struct
import zlib
from os import PathLike
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from torchvote.data.errors import CorruptDataError
from torchvote.data.paths import as_path
from torchvote.files import atomic_write_bytes

__all__ = ["IDX_DTYPES", "read_idx", "write_idx"]

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


def _read_bytes(path: Path) -> bytes:
    with path.open("rb") as f:
        raw = f.read()
    if not raw.startswith(_GZIP_MAGIC):
        return raw
    try:
        return gzip.decompress(raw)
    except (EOFError, OSError, zlib.error) as err:  # truncated or corrupt gzip stream
        raise CorruptDataError(f"{path}: corrupt or truncated gzip data ({err})") from err


def read_idx(path: str | PathLike[str]) -> Tensor:
    """Read one IDX file (plain or gzip-compressed).

    Args:
        path: The file to read.

    Returns:
        A tensor of the stored shape, in the native-endian torch dtype that matches the stored
        type: uint8, int8, int16, int32, float32 or float64.

    Raises:
        TypeError: If ``path`` is not a ``str`` or ``os.PathLike``.
        FileNotFoundError: If ``path`` does not exist (``IsADirectoryError``: a folder).
        CorruptDataError: (a ``ValueError``) If the gzip stream is corrupt or truncated, the
            magic number, type code or dimension count is invalid, or the payload is shorter
            (truncated) or longer than the header announces. The message names the file.
    """
    path = as_path(path, "path")
    data = _read_bytes(path)
    if len(data) < 4:
        raise CorruptDataError(f"{path}: truncated IDX file ({len(data)} bytes, header needs 4)")
    zero, code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0:
        raise CorruptDataError(f"{path}: bad IDX magic number 0x{data[:4].hex()} (must start with 0x0000)")
    if code not in IDX_DTYPES:
        known = ", ".join(f"0x{c:02X}" for c in IDX_DTYPES)
        raise CorruptDataError(f"{path}: unknown IDX type code 0x{code:02X} (expected one of {known})")
    if ndim == 0:
        raise CorruptDataError(f"{path}: IDX header declares 0 dimensions")
    header_len = 4 + 4 * ndim
    if len(data) < header_len:
        raise CorruptDataError(
            f"{path}: truncated IDX header ({len(data)} bytes, {ndim} dims need {header_len})"
        )
    shape = struct.unpack(f">{ndim}I", data[4:header_len])
    dtype = IDX_DTYPES[code]
    expected = math.prod(shape) * dtype.itemsize  # Python ints: np.prod's int64 wrapped around
    payload = len(data) - header_len
    if payload < expected:
        raise CorruptDataError(
            f"{path}: truncated IDX data: shape {shape} of {dtype.name} needs {expected} bytes, "
            f"file has {payload}"
        )
    if payload > expected:
        raise CorruptDataError(
            f"{path}: {payload - expected} unexpected trailing bytes after IDX data of shape {shape}"
        )
    array = np.frombuffer(data, dtype=dtype, offset=header_len).reshape(shape)
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
