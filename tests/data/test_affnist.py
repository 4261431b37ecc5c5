"""The real affNIST test set: reading .mat files, finding them, the manifest, the download.

Every file here is a tiny stand-in written by the test with ``scipy.io.savemat`` (scipy comes
with the ``affnist`` extra, part of ``dev``); the download runs against a fake ``urlopen`` that
serves a zip archive built by the test, never the network.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.io import savemat

import torchvote.data.affnist as affnist_module
import torchvote.data.command as command_module
from torchvote.data import (
    AFFNIST_TEST,
    ChecksumError,
    DataNotFoundError,
    download_affnist,
    find_affnist,
    get_dataset,
    load_affnist,
    load_affnist_mat,
)
from torchvote.data.affnist import AffnistRelease, verify_affnist
from torchvote.data.command import main

from .test_download import FakeServer

URL = "https://affnist.example/32x/transformed/test.mat.zip"


def affnist_record(images: np.ndarray, labels: np.ndarray) -> dict[str, np.ndarray]:
    """The layout of affNIST files: one 40x40 image per column, stored row by row."""
    return {"image": images.reshape(len(images), 1600).T.copy(), "label_int": labels}


def tiny_set(num: int = 20, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``num`` random uint8 40x40 images, labels 0, 1, ..., 9, 0, 1, ..."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (num, 40, 40), dtype=np.uint8), (np.arange(num) % 10).astype(np.uint8)


def write_mat(path: Path, images: np.ndarray, labels: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    savemat(path, {"affNISTdata": affnist_record(images, labels)})
    return path


def zip_bytes(members: dict[str, bytes], compression: int = zipfile.ZIP_DEFLATED) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=compression) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buffer.getvalue()


def release_for(archive: bytes, images: int = 20) -> AffnistRelease:
    return AffnistRelease(
        urls=(URL,),
        archive="test.mat.zip",
        member="test.mat",
        sha256=hashlib.sha256(archive).hexdigest(),
        checksum_source="the test",
        images=images,
    )


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> FakeServer:
    fake = FakeServer()
    monkeypatch.setattr("torchvote.data.download.urlopen", fake)
    return fake


@pytest.fixture
def archive(tmp_path: Path) -> tuple[bytes, np.ndarray, np.ndarray]:
    """A zip holding ``test.mat`` with 20 images, as the official archive holds 320,000."""
    images, labels = tiny_set()
    mat = write_mat(tmp_path / "staging" / "test.mat", images, labels)
    return zip_bytes({"test.mat": mat.read_bytes()}), images, labels


@pytest.fixture
def downloaded(
    server: FakeServer, archive: tuple[bytes, np.ndarray, np.ndarray], tmp_path: Path
) -> tuple[Path, bytes]:
    """The fake archive served at ``URL`` and downloaded into ``tmp_path / "affnist"``:
    ``(path of test.mat, archive bytes)``."""
    blob = archive[0]
    server.routes[URL] = blob
    return download_affnist(tmp_path / "affnist", release=release_for(blob)), blob


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".part"))


# ---------------------------------------------------------------- the published release


def test_the_official_release_is_pinned() -> None:
    assert AFFNIST_TEST.urls[0] == "https://www.cs.toronto.edu/~tijmen/affNIST/32x/transformed/test.mat.zip"
    assert all(url.endswith("/32x/transformed/test.mat.zip") for url in AFFNIST_TEST.urls)
    assert AFFNIST_TEST.sha256 == "2cde38ec83ee2ebfd7b901f8be5a09efb17a1bda04771f9b4905751eb945c01a"
    assert (AFFNIST_TEST.archive, AFFNIST_TEST.member, AFFNIST_TEST.images) == (
        "test.mat.zip",
        "test.mat",
        320_000,
    )
    assert "url_checksums/affnist.txt" in AFFNIST_TEST.checksum_source


# ---------------------------------------------------------------- reading .mat files


def test_mat_loader_reads_a_mat_v5_file_and_its_limit(tmp_path: Path) -> None:
    images, labels = tiny_set(4, seed=1)
    path = write_mat(tmp_path / "test.mat", images, labels)
    loaded, loaded_labels = load_affnist_mat(path)
    assert loaded.shape == (4, 1, 40, 40) and loaded.dtype == torch.float32
    np.testing.assert_array_equal((loaded[:, 0] * 255).round().numpy(), images)
    assert loaded_labels.dtype == torch.int64 and loaded_labels.tolist() == labels.tolist()
    first, first_labels = load_affnist_mat(path, limit=3)
    assert torch.equal(first, loaded[:3]) and first_labels.tolist() == labels[:3].tolist()
    with pytest.raises(ValueError, match="limit"):
        load_affnist_mat(path, limit=0)


def test_a_folder_of_other_mat_files_is_not_the_test_set(tmp_path: Path) -> None:
    """Any .mat file made a folder the test set: the affNIST page's training and validation files,
    there without test.mat, were read and reported as "affnist/test"."""
    images, labels = tiny_set(6)
    for name in ("training_and_validation.mat", "validation.mat"):
        write_mat(tmp_path / name, images, labels)
    with pytest.raises(DataNotFoundError, match="real affNIST test set") as missing:
        find_affnist(tmp_path)
    # the stand-in named for either model size (eval_on=[affnist-style] alone failed at 28x28)
    assert "eval_on=[affnist-style:canvas=28] for a model of 28x28 images" in str(missing.value)
    with pytest.raises(FileNotFoundError, match="no test.mat or numbered test batches"):
        load_affnist_mat(tmp_path)
    write_mat(tmp_path / "test.mat", images[:2], labels[:2])  # beside them: only it is read
    assert find_affnist(tmp_path) == tmp_path / "test.mat"
    assert load_affnist_mat(tmp_path)[1].tolist() == labels[:2].tolist()


def test_mat_loader_reads_numbered_batches_in_natural_order(tmp_path: Path) -> None:
    parts = {number: tiny_set(3, seed=number) for number in range(1, 11)}
    for number, (images, labels) in parts.items():
        write_mat(tmp_path / f"{number}.mat", images, labels)
    images, labels = load_affnist_mat(tmp_path)
    expected = np.concatenate([parts[n][0] for n in range(1, 11)])  # 10.mat last, not after 1.mat
    np.testing.assert_array_equal((images[:, 0] * 255).round().numpy(), expected)
    assert labels.tolist() == [int(v) for n in range(1, 11) for v in parts[n][1]]


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (("1.mat", "3.mat"), "found 1.mat, 3.mat"),  # batch 2 missing
        (("1.mat", "01.mat", "2.mat"), "found 01.mat, 1.mat, 2.mat"),  # batch 1 twice
        (("2.mat", "3.mat"), "found 2.mat, 3.mat"),
    ],
)
def test_numbered_batches_with_a_gap_or_a_repeat_are_refused(tmp_path: Path, names, message) -> None:
    """Any ``<digits>.mat`` files were read as the test set: a missing batch, or one there twice
    (``1.mat`` and ``01.mat``), changed the set in silence."""
    for name in names:
        write_mat(tmp_path / name, *tiny_set(3))
    write_mat(tmp_path / "².mat", *tiny_set(3))  # a digit to str.isdigit, not to int(): not a batch
    with pytest.raises(ValueError, match=f"without a gap, a repeat or a leading zero .*; {message}$"):
        load_affnist_mat(tmp_path)
    with pytest.raises(ValueError, match="must be 1.mat"):
        find_affnist(tmp_path)


@pytest.mark.parametrize(
    "folder", ["training_batches", "validation_batches", "training_and_validation_batches"]
)
def test_the_pages_training_and_validation_batches_are_not_the_test_set(tmp_path: Path, folder) -> None:
    """affNIST's other batch archives number their files as the test batches do: they were read
    (and scored) as the test set."""
    for number in (1, 2):
        write_mat(tmp_path / folder / f"{number}.mat", *tiny_set(3))
    with pytest.raises(ValueError, match="not the test set: pass the folder of test_batches.zip"):
        load_affnist(tmp_path / folder)


def test_a_batch_larger_than_a_test_batch_is_refused(tmp_path: Path) -> None:
    """A training batch holds 50,000 or 60,000 images; a test batch 10,000."""
    images = np.zeros((10_001, 40, 40), dtype=np.uint8)
    write_mat(tmp_path / "1.mat", images, (np.arange(10_001) % 10).astype(np.uint8))
    with pytest.raises(ValueError, match="holds 10,001 images; a test batch holds 10,000"):
        load_affnist_mat(tmp_path)


def test_data_one_folder_down_is_named(tmp_path: Path) -> None:
    for number in (1, 2):
        write_mat(tmp_path / "test_batches" / f"{number}.mat", *tiny_set(3))
    write_mat(tmp_path / "single" / "test.mat", *tiny_set(3))
    with pytest.raises(DataNotFoundError) as raised:
        find_affnist(tmp_path)
    assert f"Found {tmp_path / 'single'}, {tmp_path / 'test_batches'}: pass that folder" in str(raised.value)


def test_mat_loader_rejects_other_layouts(tmp_path: Path) -> None:
    images, labels = tiny_set(3)
    savemat(tmp_path / "short.mat", {"affNISTdata": affnist_record(images, labels[:2])})
    with pytest.raises(ValueError, match="3 images but 2 labels"):
        load_affnist_mat(tmp_path / "short.mat")
    savemat(tmp_path / "other.mat", {"data": np.zeros(3)})
    with pytest.raises(ValueError, match="no 'affNISTdata' variable"):
        load_affnist_mat(tmp_path / "other.mat")
    whole = write_mat(tmp_path / "whole.mat", images, labels).read_bytes()
    (tmp_path / "cut.mat").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match="not a readable MATLAB file"):
        load_affnist_mat(tmp_path / "cut.mat")


def test_mat_loader_without_scipy_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "scipy", None)
    monkeypatch.setitem(sys.modules, "scipy.io", None)
    path = tmp_path / "test.mat"
    path.write_bytes(b"MATLAB 5.0")
    with pytest.raises(ImportError, match="pip install scipy"):
        load_affnist_mat(path)


def test_mat_loader_missing_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_affnist_mat(tmp_path / "absent.mat")
    with pytest.raises(FileNotFoundError, match="no test.mat or numbered test batches"):
        load_affnist_mat(tmp_path)


# ---------------------------------------------------------------- finding and loading


def test_missing_data_names_the_download_and_the_generated_stand_in(tmp_path: Path) -> None:
    for call in (
        lambda: load_affnist(),
        lambda: get_dataset("affnist", "test"),
        lambda: load_affnist(tmp_path / "nothing-here"),
    ):
        with pytest.raises(DataNotFoundError) as info:
            call()
        message = str(info.value)
        assert "torchvote data affnist --download" in message and "affnist-style" in message
    assert "--root" in message and str(tmp_path / "nothing-here") in message


def test_found_in_the_cache_in_a_folder_or_as_a_file(_isolated_data_dirs: Path, tmp_path: Path) -> None:
    images, labels = tiny_set()
    cached = write_mat(_isolated_data_dirs / "affnist" / "test.mat", images, labels)
    assert find_affnist() == cached
    loaded, loaded_labels = load_affnist()
    np.testing.assert_array_equal((loaded[:, 0] * 255).round().numpy(), images)
    other = write_mat(tmp_path / "mine" / "1.mat", images[:5], labels[:5])
    assert find_affnist(other) == other
    assert find_affnist(other.parent) == other.parent  # a folder of numbered test batches
    by_root, by_root_labels = get_dataset("affnist", "test", root=str(other.parent), limit=3)
    assert by_root.shape == (3, 1, 40, 40) and by_root_labels.tolist() == [0, 1, 2]
    train, train_labels = get_dataset("affnist", "train", limit=4)  # translated MNIST
    assert train.shape == (4, 1, 40, 40) and len(train_labels) == 4
    with pytest.raises(TypeError):  # the real set has no generator options
        get_dataset("affnist", "test", canvas=28)


def test_numbered_batches_in_the_cache_are_found(_isolated_data_dirs: Path) -> None:
    """The docstring says the default is the cache read as any folder; only its test.mat was."""
    images, labels = tiny_set()
    cache = _isolated_data_dirs / "affnist"
    write_mat(cache / "1.mat", images[:5], labels[:5])
    write_mat(cache / "2.mat", images[5:8], labels[5:8])
    assert find_affnist() == cache
    loaded, loaded_labels = load_affnist()
    np.testing.assert_array_equal((loaded[:, 0] * 255).round().numpy(), images[:8])
    assert loaded_labels.tolist() == labels[:8].tolist()
    (cache / "1.mat").unlink()  # a gap (2.mat alone): not the test set, and in the cache not an error
    with pytest.raises(DataNotFoundError, match=r"(?s)affnist --download.*must be 1.mat .*found 2.mat"):
        find_affnist()


# ---------------------------------------------------------------- download


def test_download_verifies_extracts_and_writes_a_manifest(
    server: FakeServer,
    archive: tuple[bytes, np.ndarray, np.ndarray],
    downloaded: tuple[Path, bytes],
    tmp_path: Path,
) -> None:
    _, images, labels = archive
    path, blob = downloaded
    root = tmp_path / "affnist"
    assert path == root / "test.mat" and server.requested == [URL]
    assert sorted(p.name for p in root.iterdir()) == ["manifest.json", "test.mat", "test.mat.zip"]
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["archive_sha256"] == hashlib.sha256(blob).hexdigest()
    assert manifest["mat_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert manifest["mat_bytes"] == path.stat().st_size and manifest["images"] == 20
    assert manifest["label_counts"] == [2] * 10
    loaded, loaded_labels = load_affnist(root)
    np.testing.assert_array_equal((loaded[:, 0] * 255).round().numpy(), images)
    assert loaded_labels.tolist() == labels.tolist()
    # A verified cache is returned as is: no request.
    assert download_affnist(root, release=release_for(blob)) == path
    assert server.requested == [URL]


def test_a_changed_or_truncated_file_is_reported_and_repaired_offline(
    server: FakeServer, downloaded: tuple[Path, bytes]
) -> None:
    path, blob = downloaded
    root = path.parent
    good = path.read_bytes()
    changed = bytearray(good)
    changed[-1] ^= 0xFF  # same size, one byte differs
    path.write_bytes(bytes(changed))
    with pytest.raises(ValueError, match="changed since it was verified.*--force"):
        load_affnist(root)
    path.write_bytes(good[:-100])
    with pytest.raises(ValueError, match="truncated or replaced"):
        load_affnist(root)
    # The verified archive is still there: downloading again re-extracts without the network.
    server.routes.clear()
    assert download_affnist(root, release=release_for(blob)) == path
    assert path.read_bytes() == good and server.requested == [URL]
    assert len(load_affnist(root)[0]) == 20


def test_wrong_bytes_are_rejected_and_leave_nothing(
    server: FakeServer, archive: tuple[bytes, np.ndarray, np.ndarray], tmp_path: Path
) -> None:
    blob = archive[0]
    server.routes[URL] = blob[:-1] + b"X"
    root = tmp_path / "affnist"
    with pytest.raises(ChecksumError, match="sha256 mismatch"):
        download_affnist(root, release=release_for(blob))
    assert not root.exists()  # not even the folder the download made for it


@pytest.mark.parametrize(
    ("members", "match"),
    [
        ({"training.mat": b"..."}, "no 'test.mat' in the archive"),
        ("wrong-count", "19 images, expected 20"),
        ("bad-crc", "damaged zip archive"),
    ],
)
def test_a_damaged_or_wrong_archive_leaves_no_file_under_a_final_name(
    server: FakeServer, tmp_path: Path, members: object, match: str
) -> None:
    if members == "wrong-count":
        images, labels = tiny_set(19)
        blob = zip_bytes({"test.mat": write_mat(tmp_path / "t.mat", images, labels).read_bytes()})
    elif members == "bad-crc":
        data = write_mat(tmp_path / "t.mat", *tiny_set()).read_bytes()
        stored = zip_bytes({"test.mat": data}, compression=zipfile.ZIP_STORED)
        at = stored.index(data) + len(data) // 2  # a byte inside the stored member
        blob = stored[:at] + bytes([stored[at] ^ 0xFF]) + stored[at + 1 :]
    else:
        blob = zip_bytes(members)  # type: ignore[arg-type]
    server.routes[URL] = blob
    root = tmp_path / "affnist"
    with pytest.raises(ValueError, match=match):
        download_affnist(root, release=release_for(blob))
    assert sorted(p.name for p in root.iterdir()) == ["test.mat.zip"]  # verified bytes only


def test_a_failed_forced_download_keeps_the_verified_files(
    server: FakeServer, downloaded: tuple[Path, bytes]
) -> None:
    path, blob = downloaded
    root = path.parent
    before = {p.name: p.read_bytes() for p in root.iterdir()}
    server.routes[URL] = (blob, len(blob) // 2)  # the connection drops half-way
    with pytest.raises(OSError, match="every mirror failed"):
        download_affnist(root, release=release_for(blob), force=True)
    assert {p.name: p.read_bytes() for p in root.iterdir()} == before
    assert leftovers(root) == [] and len(load_affnist(path)[0]) == 20


def test_verify_reports_what_differs_from_the_release(
    archive: tuple[bytes, np.ndarray, np.ndarray], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    images, labels = tiny_set()
    write_mat(tmp_path / "test.mat", images, labels)
    counts, problems = verify_affnist(tmp_path)
    assert counts == [2] * 10 and problems == ["20 images, expected 320000"]
    monkeypatch.setattr(affnist_module, "AFFNIST_TEST", release_for(archive[0]))
    assert verify_affnist(tmp_path) == ([2] * 10, [])
    write_mat(tmp_path / "test.mat", images, np.full(20, 3, dtype=np.uint8))
    assert "no image of the digits [0, 1, 2, 4, 5, 6, 7, 8, 9]" in verify_affnist(tmp_path)[1]


# ---------------------------------------------------------------- the `torchvote data affnist` command


def test_command_affnist_status_and_download(
    server: FakeServer,
    archive: tuple[bytes, np.ndarray, np.ndarray],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = tmp_path / "affnist"
    assert main(["affnist", "--root", str(root)]) == 1
    out = capsys.readouterr().out
    assert "torchvote data affnist --download --root" in out and "affnist-style" in out
    blob = archive[0]
    server.routes[URL] = blob
    fake_release = functools.partial(download_affnist, release=release_for(blob))
    monkeypatch.setattr(command_module, "download_affnist", fake_release)
    assert main(["affnist", "--download", "--root", str(root)]) == 0
    assert f"test: {root / 'test.mat'} (verified)" in capsys.readouterr().out
    assert main(["affnist", "--root", str(root)]) == 0
    verified = "verified: size and SHA-256 match the download's manifest.json"
    assert f"test: {root / 'test.mat'} ({verified})" in capsys.readouterr().out


def test_command_affnist_status_says_whether_the_file_was_verified(
    downloaded: tuple[Path, bytes], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A hand-placed file and a downloaded one were both reported as found, and so was a
    downloaded file that had changed since (its load then failed)."""
    mine = write_mat(tmp_path / "mine" / "test.mat", *tiny_set())
    assert main(["affnist", "--root", str(mine.parent)]) == 0
    assert f"test: {mine} (not verified: no manifest.json" in capsys.readouterr().out
    mat = downloaded[0]
    data = bytearray(mat.read_bytes())
    data[-1] ^= 0xFF
    mat.write_bytes(bytes(data))
    assert main(["affnist", "--root", str(mat.parent)]) == 1  # changed since verified: a failure
    assert "changed since it was verified" in capsys.readouterr().err


def test_python_m_torchvote_data_is_the_same_command(tmp_path: Path, capsys) -> None:
    """``python -m torchvote.data`` had a parser of its own: no ``--verify``, no default."""
    mine = write_mat(tmp_path / "test.mat", *tiny_set())
    assert main(["affnist", "--verify", "--root", str(tmp_path)]) == 1  # 20 images, not 320,000
    captured = capsys.readouterr()
    assert f"test: {mine} (not verified" in captured.out and "test: 20 images (1, 40, 40)" in captured.out
    assert "verify failed: 20 images, expected 320000" in captured.err
    assert main([]) == 0 and "affnist-style" in capsys.readouterr().out  # `list` by default


def test_a_cache_from_another_release_is_replaced(server: FakeServer, tmp_path: Path) -> None:
    root = tmp_path / "affnist"
    old = zip_bytes({"test.mat": write_mat(tmp_path / "old.mat", *tiny_set(seed=1)).read_bytes()})
    new_images, new_labels = tiny_set(seed=2)
    new = zip_bytes({"test.mat": write_mat(tmp_path / "new.mat", new_images, new_labels).read_bytes()})
    server.routes[URL] = old
    download_affnist(root, release=release_for(old))
    server.routes[URL] = new
    download_affnist(root, release=release_for(new))
    assert server.requested == [URL, URL]
    assert (
        json.loads((root / "manifest.json").read_text())["archive_sha256"] == hashlib.sha256(new).hexdigest()
    )
    np.testing.assert_array_equal((load_affnist(root)[0][:, 0] * 255).round().numpy(), new_images)


# ---------------------------------------------------------------- damaged or odd files


@pytest.mark.parametrize("damage", ["empty", "header-cut", "compressed-flipped", "a-zip-archive"])
def test_an_unreadable_mat_file_names_the_file_and_the_fix(tmp_path: Path, damage: str) -> None:
    images, labels = tiny_set()
    path = tmp_path / "test.mat"
    if damage == "compressed-flipped":  # a damaged zlib stream inside a compressed variable
        savemat(path, {"affNISTdata": affnist_record(images, labels)}, do_compression=True)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        whole = write_mat(path, images, labels).read_bytes()
        path.write_bytes(
            {"empty": b"", "header-cut": whole[:100], "a-zip-archive": zip_bytes({"test.mat": whole})}[damage]
        )
    with pytest.raises(ValueError, match="not a readable MATLAB file") as info:
        load_affnist(path)
    message = str(info.value)
    assert str(path) in message
    if damage == "a-zip-archive":
        assert "zip archive: extract" in message
    else:
        assert f"torchvote data affnist --download --force --root {tmp_path}" in message


@pytest.mark.parametrize(
    ("field", "values", "match"),
    [
        ("label_int", np.arange(20) % 10 + 10, "'label_int'.*0-9"),
        ("label_int", np.arange(20) % 10 + 0.5, "'label_int'.*0-9"),
        ("image", np.full((1600, 20), 300.0), "'image'.*0-255"),
        ("image", np.full((1600, 20), 0.5), "'image'.*0-255"),  # already scaled: not 8-bit levels
        # the message listed the first ten distinct values, 0. 1. ... 9., never the NaN
        ("image", np.where(np.arange(1600) == 7, np.nan, np.arange(1600) % 20)[:, None] * np.ones(20),
         "'image'.*0-255, got NaN"),
    ],
)
def test_values_outside_the_affnist_ranges_are_refused(
    tmp_path: Path, field: str, values: np.ndarray, match: str
) -> None:
    images, labels = tiny_set()
    record = affnist_record(images, labels)
    record[field] = values
    savemat(tmp_path / "odd.mat", {"affNISTdata": record})
    with pytest.raises(ValueError, match=match):
        load_affnist_mat(tmp_path / "odd.mat")


def test_a_bad_limit_is_named_before_looking_for_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="limit"):
        load_affnist(tmp_path / "nothing-here", limit=-1)
    with pytest.raises(TypeError, match="root"):
        load_affnist(5)  # type: ignore[arg-type]


def test_a_missing_mat_file_is_looked_for_as_a_file(tmp_path: Path) -> None:
    with pytest.raises(DataNotFoundError) as info:
        load_affnist(tmp_path / "mine.mat")
    assert info.value.looked_for == (str(tmp_path / "mine.mat"),)
    assert info.value.command == f"torchvote data affnist --download --root {tmp_path}"


def test_the_manifest_speaks_only_for_the_downloaded_file(downloaded: tuple[Path, bytes]) -> None:
    path, _ = downloaded
    images, labels = tiny_set(5, seed=7)
    mine = write_mat(path.parent / "mine.mat", images, labels)  # a user's own file beside it
    loaded, loaded_labels = load_affnist(mine)
    np.testing.assert_array_equal((loaded[:, 0] * 255).round().numpy(), images)
    assert loaded_labels.tolist() == labels.tolist()
    assert len(load_affnist(path)[0]) == 20  # the verified file is still checked and read


def test_the_extracted_file_reaches_the_disk_before_its_rename(
    server: FakeServer,
    archive: tuple[bytes, np.ndarray, np.ndarray],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    synced: set[str] = set()  # files flushed with fsync, by path
    renamed: dict[str, bool] = {}  # final name -> were its bytes flushed before the rename
    real_fsync, real_replace = affnist_module.os.fsync, affnist_module.os.replace

    def fsync(descriptor: int) -> None:
        synced.add(os.readlink(f"/proc/self/fd/{descriptor}"))
        real_fsync(descriptor)

    def replace(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
        renamed[Path(target).name] = os.path.realpath(source) in synced
        real_replace(source, target)

    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc to tell which file a descriptor belongs to")
    monkeypatch.setattr(affnist_module.os, "fsync", fsync)
    monkeypatch.setattr(affnist_module.os, "replace", replace)
    blob = archive[0]
    server.routes[URL] = blob
    download_affnist(tmp_path / "affnist", release=release_for(blob))
    # a crash right after a rename never leaves a final name on bytes still in the page cache
    assert renamed == {"test.mat.zip": True, "manifest.json": True, "test.mat": True}
