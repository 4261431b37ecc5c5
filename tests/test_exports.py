"""Every name a package exports is there: the re-export lists are built from the modules' own."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest


@pytest.mark.parametrize(
    "package",
    [
        "torchvote.data",
        "torchvote.experiments",
        "torchvote.explain",
        "torchvote.functional",
        "torchvote.models",
        "torchvote.nn",
        "torchvote.pretrained",
        "torchvote.training",
    ],
)
def test_every_exported_name_exists(package):
    module = importlib.import_module(package)
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert not missing, f"{package}.__all__ names what it does not define: {missing}"
    assert len(set(module.__all__)) == len(module.__all__)


def _subpackages() -> list[str]:
    """The package directories under ``src/torchvote`` (each with an ``__init__.py``)."""
    import torchvote

    root = Path(torchvote.__file__).parent
    return sorted(path.parent.name for path in root.glob("*/__init__.py"))


def test_every_subpackage_is_reachable_from_a_plain_import_without_loading_torch():
    code = (
        "import sys, torchvote\n"
        "assert 'torch' not in sys.modules, 'import torchvote loaded torch'\n"
        f"for name in {_subpackages() + ['losses', 'validation']!r}:\n"
        "    assert getattr(torchvote, name).__name__ == 'torchvote.' + name, name\n"
        "print(torchvote.nn.CapsuleLinear.__name__, torchvote.functional.vote.__name__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["CapsuleLinear", "vote"]


def test_the_library_imports_without_torch_compile_machinery():
    """``@torch.compiler.disable`` on EM's blocked kernel imported dynamo and inductor with
    ``torchvote.nn``: 2-3 s of every import on a CPU. Only a compile (or the kernel run under one)
    needs them."""
    code = (
        "import sys, torchvote.functional, torchvote.nn, torchvote.models\n"
        "print(sorted({name.split('.')[1] for name in sys.modules if name.startswith(('torch._dynamo', "
        "'torch._inductor'))}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]"]


def test_the_top_level_lists_every_subpackage_and_refuses_other_names():
    import torchvote

    assert set(_subpackages()) <= set(torchvote.__all__)
    assert len(_subpackages()) >= 8  # the glob found the tree
    assert set(dir(torchvote)) == set(torchvote.__all__)
    with pytest.raises(AttributeError, match="has no attribute 'bogus'"):
        torchvote.bogus  # noqa: B018


def test_version_is_the_installed_distributions_and_the_command_prints_it(capsys):
    import torchvote
    from torchvote.cli import main

    assert torchvote.__version__ == metadata.version("torchvote")
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"torchvote {torchvote.__version__}"


def test_the_package_is_marked_typed_and_ships_the_marker():
    """PEP 561: type checkers read torchvote's annotations only where ``py.typed`` is installed."""
    import torchvote

    assert (Path(torchvote.__file__).parent / "py.typed").is_file()
    project = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    package_data = re.search(r"^\[tool\.setuptools\.package-data\]\ntorchvote = (\[.*\])$", project, re.M)
    assert package_data is not None and '"py.typed"' in package_data.group(1)
