"""The evaluation module has a path of its own: ``torchvote.training.evaluate`` is also the
function the package exports, which hid the module of that name (``import ... as m`` gave the
function, and patching ``torchvote.training.evaluate.load_data`` failed)."""

from __future__ import annotations

import inspect

import pytest


def test_the_module_imports_as_a_module_and_patching_it_reaches_its_callers(monkeypatch):
    import torchvote.training as training
    import torchvote.training.evaluation as evaluation

    assert inspect.ismodule(evaluation) and inspect.isfunction(training.evaluate)
    assert training.evaluate is evaluation.evaluate
    monkeypatch.setattr("torchvote.training.evaluation.run_state_beside", lambda *a, **k: "patched")
    from torchvote.training import generation  # a caller that imported the name from the module

    assert evaluation.run_state_beside() == "patched"
    assert generation.__name__ == "torchvote.training.generation"


def test_the_old_path_still_gives_every_name_of_the_module():
    import torchvote.training.evaluation as evaluation
    from torchvote.training.evaluate import autocast, evaluate_checkpoint, parse_eval_entry

    assert (autocast, evaluate_checkpoint, parse_eval_entry) == (
        evaluation.autocast, evaluation.evaluate_checkpoint, evaluation.parse_eval_entry
    )
    with pytest.raises(ImportError):
        from torchvote.training.evaluate import no_such_name  # noqa: F401


def test_importing_the_old_path_leaves_the_package_function_callable():
    """A first import of a submodule binds it on its package: ``from torchvote.training.evaluate
    import ...`` in a fresh process made ``torchvote.training.evaluate`` the module, and a call of
    the function failed with "'module' object is not callable" (diff review)."""
    import subprocess
    import sys

    code = (
        "from torchvote.training.evaluate import evaluate_checkpoint\n"
        "import inspect, torchvote.training as training\n"
        "from torchvote.training import evaluate\n"
        "assert inspect.isfunction(training.evaluate) and evaluate is training.evaluate, training.evaluate\n"
        "import sys; assert 'evaluate_checkpoint' in dir(sys.modules['torchvote.training.evaluate'])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
