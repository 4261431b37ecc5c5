from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from torchvote.data import read_idx, write_idx

DTYPES = [np.uint8, np.int8, np.int16, np.int32, np.float32, np.float64]


@settings(max_examples=40, deadline=None)
@given(
    array=st.sampled_from(DTYPES).flatmap(
        lambda dt: arrays(dt, st.lists(st.integers(0, 4), min_size=1, max_size=3).map(tuple))
    ),
    compress=st.booleans(),
)
def test_roundtrip_preserves_values_shape_and_dtype(
    tmp_path_factory: pytest.TempPathFactory, array: np.ndarray, compress: bool
) -> None:
    path = tmp_path_factory.mktemp("idx") / "values.idx"
    write_idx(path, array, compress=compress)
    back = read_idx(path)
    assert back.shape == array.shape
    assert back.numpy().dtype == array.dtype
    np.testing.assert_array_equal(back.numpy(), array)  # NaNs compare equal here


def test_bytes_follow_the_published_format(tmp_path: Path) -> None:
    # Labels file layout from the MNIST page: magic 0x00000801, count, then one byte per label.
    path = write_idx(tmp_path / "labels", np.array([7, 2, 1], dtype=np.uint8))
    assert path.read_bytes() == bytes.fromhex("00000801 00000003 070201")
    # Multi-byte values are big-endian, each dimension a big-endian uint32.
    path = write_idx(tmp_path / "ints", np.array([[1, -2]], dtype=np.int32))
    assert path.read_bytes() == bytes.fromhex("00000C02 00000001 00000002 00000001 FFFFFFFE")


def test_gzip_is_detected_from_content_not_name(tmp_path: Path) -> None:
    values = torch.arange(6, dtype=torch.uint8).view(2, 3)
    path = write_idx(tmp_path / "no-suffix", values, compress=True)
    assert path.read_bytes()[:2] == b"\x1f\x8b"
    assert torch.equal(read_idx(path), values)
    assert write_idx(tmp_path / "x.gz", values).read_bytes()[:2] == b"\x1f\x8b"


def test_write_accepts_tensors_and_reads_native_dtype(tmp_path: Path) -> None:
    values = torch.randn(3, 4, dtype=torch.float64)
    back = read_idx(write_idx(tmp_path / "f.idx", values))
    assert back.dtype == torch.float64
    assert torch.equal(back, values)


@pytest.fixture
def good_file(tmp_path: Path) -> Path:
    return write_idx(tmp_path / "images.idx", np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4))


def test_truncated_payload_names_the_file(good_file: Path) -> None:
    good_file.write_bytes(good_file.read_bytes()[:-1])
    with pytest.raises(ValueError, match="truncated") as info:
        read_idx(good_file)
    assert str(good_file) in str(info.value)


@pytest.mark.parametrize("shape", [(2**32 - 1,) * 3, (2**16,) * 4])
def test_a_header_whose_size_passes_64_bits_names_the_file_and_the_true_size(tmp_path: Path, shape) -> None:
    """np.prod in int64 wrapped: the message gave a wrong byte count, or (2^16)^4 became 0 bytes and
    numpy's reshape error named no file."""
    import struct

    path = tmp_path / "huge.idx"
    path.write_bytes(struct.pack(">HBB", 0, 0x08, len(shape)) + struct.pack(f">{len(shape)}I", *shape))
    size = 1
    for n in shape:
        size *= n
    with pytest.raises(ValueError, match=rf"{path.name}: truncated IDX data: .* needs {size} bytes"):
        read_idx(path)


def test_truncated_header(good_file: Path) -> None:
    good_file.write_bytes(good_file.read_bytes()[:9])  # 3 dims need 16 header bytes
    with pytest.raises(ValueError, match="truncated IDX header"):
        read_idx(good_file)
    good_file.write_bytes(b"\x00\x00")
    with pytest.raises(ValueError, match="truncated"):
        read_idx(good_file)


def test_truncated_gzip_names_the_file(tmp_path: Path) -> None:
    path = write_idx(
        tmp_path / "images.gz", np.random.default_rng(0).integers(0, 255, (50, 28, 28), dtype=np.uint8)
    )
    blob = path.read_bytes()
    path.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(ValueError, match="gzip") as info:
        read_idx(path)
    assert str(path) in str(info.value)


def test_trailing_bytes_are_rejected(good_file: Path) -> None:
    good_file.write_bytes(good_file.read_bytes() + b"\x00")
    with pytest.raises(ValueError, match="trailing"):
        read_idx(good_file)


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (bytes.fromhex("01000801"), "magic"),
        (bytes.fromhex("00000A01"), "type code 0x0A"),
        (bytes.fromhex("00000800"), "0 dimensions"),
    ],
)
def test_bad_headers(tmp_path: Path, header: bytes, message: str) -> None:
    path = tmp_path / "bad.idx"
    path.write_bytes(gzip.compress(header + bytes.fromhex("00000001 05")))
    with pytest.raises(ValueError, match=message):
        read_idx(path)


def test_write_rejects_unsupported_values(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="int64"):
        write_idx(tmp_path / "a", np.zeros(3, dtype=np.int64))
    with pytest.raises(ValueError, match="dimensions"):
        write_idx(tmp_path / "b", np.array(3, dtype=np.uint8))
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_missing_file_raises_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_idx(tmp_path / "absent")


def test_a_path_that_is_not_a_path_is_named() -> None:
    with pytest.raises(TypeError, match="path"):
        read_idx(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="path"):
        write_idx(None, np.zeros(2, dtype=np.uint8))  # type: ignore[arg-type]


def test_a_file_where_a_folder_must_be_is_named(tmp_path: Path) -> None:
    """write_idx('afile/x.idx') was mkdir's "File exists: 'afile'" (every atomic write: make_folder)."""
    (tmp_path / "afile").write_text("x")
    with pytest.raises(NotADirectoryError, match=f"cannot make the folder {tmp_path / 'afile' / 'sub'}: "
                       f"{tmp_path / 'afile'} is a file"):
        write_idx(tmp_path / "afile" / "sub" / "x.idx", torch.zeros(3, dtype=torch.uint8))
    assert (tmp_path / "afile").read_text() == "x"


def test_a_data_root_variable_naming_a_file_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TORCHVOTE_DATA=<a file> was "[Errno 20] Not a directory: '<file>/mnist'" at a download."""
    from torchvote.data.paths import data_root, dataset_dir

    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("TORCHVOTE_DATA", str(tmp_path / "afile"))
    with pytest.raises(ValueError, match=f"TORCHVOTE_DATA={tmp_path / 'afile'} names a file"):
        dataset_dir("mnist")
    # ... or a folder under a file: the file is named
    monkeypatch.setenv("TORCHVOTE_DATA", str(tmp_path / "afile" / "data"))
    with pytest.raises(ValueError, match=f"TORCHVOTE_DATA={tmp_path / 'afile' / 'data'}: "
                       f"{tmp_path / 'afile'} is a file; it must name the folder"):
        dataset_dir("mnist")
    # ... or a link to nothing (mkdir failed on it with "File exists")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    monkeypatch.setenv("TORCHVOTE_DATA", str(tmp_path / "dangling"))
    with pytest.raises(ValueError, match=f"TORCHVOTE_DATA={tmp_path / 'dangling'} names a file"):
        dataset_dir("mnist")
    monkeypatch.setenv("TORCHVOTE_DATA", str(tmp_path / "data"))
    assert data_root() == tmp_path / "data"
