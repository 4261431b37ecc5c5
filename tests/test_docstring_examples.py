"""The ``Examples:`` sections of the public docstrings run and print what they show.

The docstrings of the core API (the voting operator, attention and routing functions, the layers a
new user builds first, the losses and the model registry) end with an ``Examples:`` section of
doctest lines (``>>>``), as PyTorch's own docstrings do. Each docstring with examples in the
modules below is one test case: its examples run with the standard library's :mod:`doctest`
(``NORMALIZE_WHITESPACE | ELLIPSIS``) in a copy of its module's namespace, and the case fails on
the first example whose output differs from the one written or that raises.

The examples are written to be deterministic across platforms: they seed torch before drawing
random tensors and print shapes, booleans (``torch.allclose``, a property such as couplings that
sum to 1) or values that are exact, never raw floats a BLAS could round otherwise.

:data:`MIN_DOCSTRINGS` guards the collection: if the modules were renamed or the examples lost
(a docstring rewritten without them, a finder that found none), the count test fails rather than
every case silently disappearing.
"""

from __future__ import annotations

import doctest
import importlib

import pytest

# The modules whose docstrings carry examples (each module's own objects only: a re-export is
# collected where it is defined).
MODULES = (
    "torchvote.functional.voting",
    "torchvote.functional.attention",
    "torchvote.functional.nonlinearities",
    "torchvote.functional.routing",
    "torchvote.functional.em",
    "torchvote.nn.attention",
    "torchvote.nn.routing_attention",
    "torchvote.nn.capsules",
    "torchvote.nn.em_capsules",
    "torchvote.nn.routers.base",
    "torchvote.nn.routers.dynamic",
    "torchvote.nn.routers.em",
    "torchvote.nn.routers.slot_attention",
    "torchvote.nn.scoring_attention",
    "torchvote.nn.transformer_stack",
    "torchvote.losses",
    "torchvote.models.registry",
)

# The docstrings with examples today; fewer means some were lost or the collection broke.
MIN_DOCSTRINGS = 25

OPTIONS = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS


def _collect() -> dict[str, doctest.DocTest]:
    """Every docstring with at least one example in :data:`MODULES`, by qualified name."""
    finder = doctest.DocTestFinder(exclude_empty=True)
    found: dict[str, doctest.DocTest] = {}
    for name in MODULES:
        module = importlib.import_module(name)
        for test in finder.find(module):
            if test.examples:
                found[test.name] = test
    return found


DOCTESTS = _collect()


def test_the_collection_found_the_examples():
    assert len(DOCTESTS) >= MIN_DOCSTRINGS, (
        f"only {len(DOCTESTS)} docstrings with examples found in {len(MODULES)} modules: "
        f"{sorted(DOCTESTS)}"
    )


@pytest.mark.parametrize("name", sorted(DOCTESTS))
def test_docstring_examples_run_as_written(name):
    test = DOCTESTS[name]
    test.globs = dict(test.globs)  # a fresh namespace per run: nothing leaks between cases
    runner = doctest.DocTestRunner(optionflags=OPTIONS, verbose=False)
    report: list[str] = []
    results = runner.run(test, out=report.append, clear_globs=True)
    assert results.attempted > 0, f"{name}: no example ran"
    failures = "".join(report)
    assert results.failed == 0, f"{name}: {results.failed} of {results.attempted} failed\n{failures}"
