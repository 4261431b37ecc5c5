from __future__ import annotations

import gzip
import hashlib
import io
import os
from pathlib import Path
from urllib.error import URLError

import numpy as np
import pytest

import torchvote.data.download as download_module
from torchvote.data import ChecksumError, DownloadError, download_file, download_mnist, load_mnist, write_idx
from torchvote.data.mnist import MNIST_IDX_NAMES


class FakeResponse(io.BytesIO):
    """What ``urlopen`` returns: a readable context manager; may fail part-way."""

    def __init__(self, data: bytes, fail_after: int | None = None) -> None:
        super().__init__(data)
        self.fail_after = fail_after

    def read(self, size: int | None = -1) -> bytes:
        if self.fail_after is not None and self.tell() >= self.fail_after:
            raise ConnectionResetError("connection dropped")
        if self.fail_after is not None and size is not None and size > 0:
            size = min(size, self.fail_after - self.tell())
        return super().read(size)


class FakeServer:
    """Replaces ``urlopen``: serves registered bytes per URL and records the requests."""

    def __init__(self) -> None:
        self.routes: dict[str, object] = {}
        self.requested: list[str] = []

    def __call__(self, request: object, timeout: float | None = None) -> FakeResponse:
        url = getattr(request, "full_url", request)
        self.requested.append(str(url))
        route = self.routes.get(str(url))
        if route is None:
            raise URLError(f"no route to {url}")
        if isinstance(route, Exception):
            raise route
        if isinstance(route, tuple):
            return FakeResponse(*route)
        return FakeResponse(route)  # type: ignore[arg-type]


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> FakeServer:
    fake = FakeServer()
    monkeypatch.setattr(download_module, "urlopen", fake)
    return fake


PAYLOAD = b"torchvote" * 300_000  # a few chunks of 1 MiB
PAYLOAD_MD5 = hashlib.md5(PAYLOAD).hexdigest()


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name != "file.bin")


def test_good_download_is_verified_and_renamed(server: FakeServer, tmp_path: Path) -> None:
    server.routes["https://a/file.bin"] = PAYLOAD
    path = download_file("https://a/file.bin", tmp_path / "file.bin", checksum=PAYLOAD_MD5)
    assert path.read_bytes() == PAYLOAD
    assert _leftovers(tmp_path) == []


def test_wrong_checksum_raises_and_leaves_nothing(server: FakeServer, tmp_path: Path) -> None:
    server.routes["https://a/file.bin"] = PAYLOAD[:-1] + b"X"
    with pytest.raises(ChecksumError) as info:
        download_file("https://a/file.bin", tmp_path / "file.bin", checksum=PAYLOAD_MD5)
    message = str(info.value)
    assert "https://a/file.bin" in message and PAYLOAD_MD5 in message and "md5" in message
    assert list(tmp_path.iterdir()) == []


def test_falls_through_mirrors_in_order(server: FakeServer, tmp_path: Path) -> None:
    server.routes["https://bad/file.bin"] = b"corrupt"
    server.routes["https://good/file.bin"] = PAYLOAD
    mirrors = ["https://down/file.bin", "https://bad/file.bin", "https://good/file.bin"]
    download_file(mirrors, tmp_path / "file.bin", checksum=PAYLOAD_MD5)
    assert server.requested == mirrors
    assert (tmp_path / "file.bin").read_bytes() == PAYLOAD
    assert _leftovers(tmp_path) == []


def test_every_mirror_unreachable(server: FakeServer, tmp_path: Path) -> None:
    with pytest.raises(OSError, match="every mirror failed") as info:
        download_file(["https://x/f", "https://y/f"], tmp_path / "f", checksum=PAYLOAD_MD5)
    assert str(info.value) == (
        "could not download f: every mirror failed (x: no route to https://x/f; y: no route to https://y/f)"
    )
    assert [url for url, _ in info.value.failures] == ["https://x/f", "https://y/f"]
    assert list(tmp_path.iterdir()) == []


def test_mirrors_failing_alike_give_their_reason_once(server: FakeServer, tmp_path: Path) -> None:
    """Offline, MNIST's three mirrors made one 400-character line, the same reason three times."""
    import socket
    from urllib.error import HTTPError

    offline = URLError(socket.gaierror(-3, "Temporary failure in name resolution"))
    mirrors = ["https://a.org/m/f", "https://b.com/f", "http://c.net/x/f"]
    for url in mirrors:
        server.routes[url] = offline
    with pytest.raises(DownloadError) as info:
        download_file(mirrors, tmp_path / "f", checksum=PAYLOAD_MD5)
    assert str(info.value) == (
        "could not download f: every mirror failed (a.org, b.com, c.net: Temporary failure in name "
        "resolution)"
    )
    # each reason once, with its mirrors, in the order they were tried; two mirrors of one host by URL
    server.routes["https://a.org/m/f"] = HTTPError("https://a.org/m/f", 404, "Not Found", None, None)
    server.routes["https://a.org/n/f"] = URLError(TimeoutError("timed out"))
    server.routes["http://c.net/x/f"] = HTTPError("http://c.net/x/f", 404, "Not Found", None, None)
    with pytest.raises(DownloadError) as info:
        download_file(["https://a.org/m/f", "https://a.org/n/f", "http://c.net/x/f"], tmp_path / "f",
                      checksum=PAYLOAD_MD5)
    assert str(info.value) == (
        "could not download f: every mirror failed (https://a.org/m/f, http://c.net/x/f: HTTP 404 Not "
        "Found; https://a.org/n/f: timed out)"
    )


def test_a_failed_download_leaves_no_folder_it_made(
    server: FakeServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`torchvote data mnist --download --root DIR`, offline, left DIR behind, empty."""
    with pytest.raises(DownloadError):
        download_file("https://x/f", tmp_path / "new" / "nested" / "f", checksum=PAYLOAD_MD5)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "there").mkdir()  # a folder that was there stays, empty or not
    with pytest.raises(DownloadError):
        download_file("https://x/f", tmp_path / "there" / "f", checksum=PAYLOAD_MD5)
    assert (tmp_path / "there").is_dir()
    # a folder made by the download, that another file went into meanwhile, stays (with it)
    def drop_a_file_then_fail(request: object, timeout: float | None = None) -> FakeResponse:
        (tmp_path / "made" / "other.txt").write_text("kept")
        raise URLError("no route")

    monkeypatch.setattr(download_module, "urlopen", drop_a_file_then_fail)
    with pytest.raises(DownloadError):
        download_file("https://x/f", tmp_path / "made" / "f", checksum=PAYLOAD_MD5)
    assert (tmp_path / "made" / "other.txt").read_text() == "kept"

    # interrupted (Ctrl-C while connecting): the folder goes too
    def interrupted(request: object, timeout: float | None = None) -> FakeResponse:
        raise KeyboardInterrupt

    monkeypatch.setattr(download_module, "urlopen", interrupted)
    with pytest.raises(KeyboardInterrupt):
        download_file("https://x/f", tmp_path / "stopped" / "f", checksum=PAYLOAD_MD5)
    assert not (tmp_path / "stopped").exists()


def test_every_mirror_failing_is_a_download_error_and_a_url_that_is_none_falls_through(
    server: FakeServer, tmp_path: Path
) -> None:
    server.routes["https://good/f"] = PAYLOAD
    download_file(["not a url", "https://good/f"], tmp_path / "f", checksum=PAYLOAD_MD5)  # was: ValueError
    assert (tmp_path / "f").read_bytes() == PAYLOAD
    with pytest.raises(DownloadError, match="every mirror failed"):
        download_file(["https://x/g"], tmp_path / "g", checksum=PAYLOAD_MD5)


def test_a_local_write_error_stops_at_once_and_is_not_called_offline(
    server: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder where the file goes (a read-only folder or a full disk alike) made every mirror
    serve the file again, then the command blamed the network."""
    from torchvote.data.command import main

    name, digest = "train-images-idx3-ubyte.gz", hashlib.md5(b"bytes").hexdigest()
    mirrors = download_module.MNIST_MIRRORS
    for mirror in mirrors:
        server.routes[mirror + name] = b"bytes"
    (tmp_path / name).mkdir()  # the rename into place fails: "Is a directory"
    with pytest.raises(OSError) as info:
        download_file([m + name for m in mirrors], tmp_path / name, checksum=digest)
    assert not isinstance(info.value, DownloadError) and server.requested == [mirrors[0] + name]
    server.requested.clear()
    monkeypatch.setitem(download_module.MNIST_FILES, name, digest)
    assert main(["mnist", "--download", "--root", str(tmp_path)]) == 1
    error = capsys.readouterr().err
    assert "without the internet" not in error and server.requested == [mirrors[0] + name], error


def test_a_download_clears_what_a_killed_download_left(server: FakeServer, tmp_path: Path) -> None:
    """A SIGKILL mid-download left a hidden .part file (affNIST: up to 512 MB) that nothing removed."""
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    left = tmp_path / f".file.bin.{dead.stdout.strip()}.abc123.part"
    left.write_bytes(b"half a download")
    running = tmp_path / f".other.bin.{os.getpid()}.def456.part"  # this process: in progress
    running.write_bytes(b"being written")
    server.routes["https://a/file.bin"] = PAYLOAD
    download_file("https://a/file.bin", tmp_path / "file.bin", checksum=PAYLOAD_MD5)
    assert not left.exists() and running.exists()


def test_a_file_already_there_is_returned_whatever_temporaries_lie_beside_it(
    server: FakeServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The clean-up ran before the presence check, and an undeletable temporary (another user's,
    in a read-only shared folder) failed every call, the file already being there."""
    import torchvote.files as files

    (tmp_path / "file.bin").write_bytes(PAYLOAD)
    (tmp_path / ".file.bin.999999999.abc123.part").write_bytes(b"another user's")
    monkeypatch.setattr(files, "_process_runs", lambda pid: False)

    def refuse(self, missing_ok=False):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "unlink", refuse)
    assert download_file("https://a/file.bin", tmp_path / "file.bin", checksum=PAYLOAD_MD5).is_file()
    assert server.requested == []
    assert files.remove_abandoned_temporaries(tmp_path) == []  # left for its owner, no error


def test_the_clean_up_leaves_this_process_s_and_a_running_process_s_temporaries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A temporary named with this process's id is a write in progress, even where the process
    check says otherwise (a pid namespace); one of a process that runs is left too (mutation review)."""
    import torchvote.files as files

    own = tmp_path / f".file.bin.{os.getpid()}.abc123.tmp"
    parent = tmp_path / f".other.bin.{os.getppid()}.def456.part"  # the parent process runs
    for temporary in (own, parent):
        temporary.write_bytes(b"being written")
    assert files.remove_abandoned_temporaries(tmp_path) == []
    assert own.exists() and parent.exists()
    monkeypatch.setattr(files, "_process_runs", lambda pid: False)
    assert files.remove_abandoned_temporaries(tmp_path) == [parent]
    assert own.exists() and not parent.exists()


def test_interrupted_download_keeps_the_old_file(server: FakeServer, tmp_path: Path) -> None:
    dest = tmp_path / "file.bin"
    dest.write_bytes(b"previous version")
    server.routes["https://a/file.bin"] = (PAYLOAD, 1_500_000)
    with pytest.raises(OSError, match="connection dropped"):
        download_file("https://a/file.bin", dest, checksum=PAYLOAD_MD5)
    assert dest.read_bytes() == b"previous version"
    assert _leftovers(tmp_path) == []


def test_existing_good_file_is_not_downloaded_again(server: FakeServer, tmp_path: Path) -> None:
    dest = tmp_path / "file.bin"
    dest.write_bytes(PAYLOAD)
    download_file("https://a/file.bin", dest, checksum=PAYLOAD_MD5)
    assert server.requested == []
    dest.write_bytes(b"stale")
    server.routes["https://a/file.bin"] = PAYLOAD
    download_file("https://a/file.bin", dest, checksum=PAYLOAD_MD5)
    assert dest.read_bytes() == PAYLOAD


def test_sha256_checksums(server: FakeServer, tmp_path: Path) -> None:
    server.routes["https://a/file.bin"] = PAYLOAD
    digest = hashlib.sha256(PAYLOAD).hexdigest()
    download_file("https://a/file.bin", tmp_path / "file.bin", checksum=digest.upper(), algorithm="sha256")
    assert (tmp_path / "file.bin").read_bytes() == PAYLOAD


def test_no_urls_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="urls"):
        download_file([], tmp_path / "f", checksum=PAYLOAD_MD5)


def test_file_table_matches_the_loader_names() -> None:
    expected = {f"{base}.gz" for pair in MNIST_IDX_NAMES.values() for base in pair}
    assert set(download_module.MNIST_FILES) == expected
    assert all(len(md5) == 32 and int(md5, 16) >= 0 for md5 in download_module.MNIST_FILES.values())


def test_download_mnist_then_load(
    server: FakeServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """End to end with fake mirrors: files land under the standard names and load back."""
    rng = np.random.default_rng(0)
    staging = tmp_path / "staging"
    arrays = {
        "train": (rng.integers(0, 256, (4, 28, 28), dtype=np.uint8), np.arange(4, dtype=np.uint8)),
        "test": (rng.integers(0, 256, (2, 28, 28), dtype=np.uint8), np.arange(2, dtype=np.uint8)),
    }
    table = {}
    for split, (images, labels) in arrays.items():
        for name, values in zip(MNIST_IDX_NAMES[split], (images, labels), strict=True):
            blob = write_idx(staging / f"{name}.gz", values).read_bytes()
            assert gzip.decompress(blob)  # a valid gzip file
            table[f"{name}.gz"] = hashlib.md5(blob).hexdigest()
            server.routes[f"https://mirror-b/{name}.gz"] = blob
    monkeypatch.setattr(download_module, "MNIST_FILES", table)
    root = tmp_path / "mnist"
    paths = download_mnist(root, mirrors=("https://mirror-a/", "https://mirror-b/"))
    assert sorted(p.name for p in paths.values()) == sorted(table)
    assert sorted(p.name for p in root.iterdir()) == sorted(table)
    images, labels = load_mnist("train", source="idx", root=root)
    np.testing.assert_array_equal((images[:, 0] * 255).round().numpy(), arrays["train"][0])
    assert labels.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"checksum": PAYLOAD_MD5[:-1]}, ValueError, "checksum.*32 hex digits"),
        ({"checksum": "z" * 32}, ValueError, "checksum"),
        ({"checksum": PAYLOAD_MD5, "algorithm": "sha256"}, ValueError, "64 hex digits"),
        ({"checksum": None}, TypeError, "checksum"),
        ({"checksum": PAYLOAD_MD5, "algorithm": "nosuch"}, ValueError, "algorithm"),
    ],
)
def test_a_digest_no_file_can_match_is_refused_before_downloading(
    server: FakeServer, tmp_path: Path, kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    server.routes["https://a/file.bin"] = PAYLOAD
    with pytest.raises(error, match=match):
        download_file("https://a/file.bin", tmp_path / "file.bin", **kwargs)  # type: ignore[arg-type]
    assert server.requested == [] and list(tmp_path.iterdir()) == []


def test_urls_and_dest_of_the_wrong_type_are_named(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="urls"):
        download_file(5, tmp_path / "f", checksum=PAYLOAD_MD5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dest"):
        download_file("https://a/f", 5, checksum=PAYLOAD_MD5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("timeout", "error"),
    [("10", TypeError), (0, ValueError), (-1, ValueError), (float("inf"), ValueError)],
)
def test_a_timeout_that_is_no_positive_number_is_named_before_any_mirror(
    server: FakeServer, tmp_path: Path, timeout: object, error: type
) -> None:
    """"10" failed inside socket.settimeout; -1 and 0 (a non-blocking socket) came back as every
    mirror failing ("Timeout value out of range", "Operation now in progress")."""
    from torchvote.data.affnist import download_affnist
    from torchvote.data.text import fetch_shakespeare

    server.routes["https://a/f"] = PAYLOAD
    calls = (
        lambda: download_file("https://a/f", tmp_path / "f", checksum=PAYLOAD_MD5, timeout=timeout),
        lambda: download_mnist(tmp_path / "mnist", mirrors=["https://a/"], timeout=timeout),
        lambda: fetch_shakespeare(tmp_path / "text", timeout=timeout),
        lambda: download_affnist(tmp_path / "affnist", timeout=timeout),
    )
    for call in calls:
        with pytest.raises(error, match="timeout must be a positive finite number"):
            call()
    assert server.requested == [] and not (tmp_path / "f").exists()


def test_one_mirror_string_is_refused_not_read_as_its_characters(server: FakeServer, tmp_path: Path) -> None:
    """download_mnist(mirrors="https://...") tried 'htrain-images-idx3-ubyte.gz', 'ttrain-...'."""
    with pytest.raises(TypeError, match=r"mirrors must be a list of strings, got the single string"):
        download_mnist(tmp_path, mirrors="https://a/")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mirrors must name at least one base URL"):
        download_mnist(tmp_path, mirrors=[])
    assert server.requested == []


def test_the_bytes_reach_the_disk_before_the_rename(
    server: FakeServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc to tell which file a descriptor belongs to")
    synced: set[str] = set()
    renamed: list[bool] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(descriptor: int) -> None:
        synced.add(os.readlink(f"/proc/self/fd/{descriptor}"))
        real_fsync(descriptor)

    def replace(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
        renamed.append(os.path.realpath(source) in synced)
        real_replace(source, target)

    monkeypatch.setattr(os, "fsync", fsync)  # whichever module writes the file
    monkeypatch.setattr(os, "replace", replace)
    server.routes["https://a/file.bin"] = PAYLOAD
    download_file("https://a/file.bin", tmp_path / "file.bin", checksum=PAYLOAD_MD5)
    assert renamed == [True]  # a crash after the rename cannot leave the name on unwritten bytes


@pytest.mark.skipif(os.name == "nt", reason="POSIX permission bits")
def test_downloaded_and_written_data_files_get_the_usual_permissions(
    server: FakeServer, tmp_path: Path
) -> None:
    """Data files were created through tempfile.mkstemp, mode 0o600 whatever the umask: a shared
    TORCHVOTE_DATA folder's downloads were unreadable to its other users."""
    from torchvote.data import write_idx

    server.routes["https://a/file.bin"] = PAYLOAD
    previous = os.umask(0o022)
    try:
        downloaded = download_file("https://a/file.bin", tmp_path / "file.bin", checksum=PAYLOAD_MD5)
        written = write_idx(tmp_path / "images.idx", np.zeros((2, 3, 3), np.uint8))
    finally:
        os.umask(previous)
    assert downloaded.stat().st_mode & 0o777 == 0o644
    assert written.stat().st_mode & 0o777 == 0o644
