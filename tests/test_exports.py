"""Every name a package exports is there: the re-export lists are built from the modules' own."""

from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize("package", ["torchvote.explain", "torchvote.functional", "torchvote.models"])
def test_every_exported_name_exists(package):
    module = importlib.import_module(package)
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert not missing, f"{package}.__all__ names what it does not define: {missing}"
    assert len(set(module.__all__)) == len(module.__all__)
