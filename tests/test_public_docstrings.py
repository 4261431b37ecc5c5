"""Every public callable documents its arguments, Google style.

The public API is what the packages below list in ``__all__``. For each function or class there,
the docstring must exist and its ``Args:`` section must name every parameter: a function's own
signature, a class's constructor (``inspect.signature(cls)``: its ``__init__``, inherited or
generated for a dataclass, or a named tuple's ``__new__``). ``self`` and the ``*args`` /
``**kwargs`` catch-alls are left out; keyword-only parameters count. A class may document its
arguments in its own docstring or its ``__init__``'s; one whose constructor is generated from its
fields (a dataclass or a named tuple) may list them under ``Attributes:`` instead.

The section is parsed, not searched: its entries are the lines one indent level under the header,
each ``name:``, ``name (type):`` or ``name, other:``; deeper lines continue an entry, and the first
line back at the header's level (the next section) ends it. A parameter mentioned only in prose
does not count, an entry line of another form fails, and so does an ``Args:`` entry naming
something the callable does not take (a renamed or removed parameter).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re

import pytest

PACKAGES = (
    "torchvote.nn",
    "torchvote.functional",
    "torchvote.models",
    "torchvote.data",
    "torchvote.training",
    "torchvote.explain",
    "torchvote.pretrained",
    "torchvote.losses",
    "torchvote.experiments",
    "torchvote.validation",
)

# Callables exempt from the check, each with the reason. Empty: everything public can be documented.
ALLOWED_UNDOCUMENTED: dict[str, str] = {}

# Over 200 functions and classes are exported today; far fewer means the collection broke.
MIN_CALLABLES = 180

_HEADER = re.compile(r"^(?P<indent>\s*)(?P<name>[A-Z][A-Za-z]*(?: [A-Za-z]+)?):\s*$")
_NAMES = r"\*{0,2}\w+(?:, \*{0,2}\w+)*"
_ENTRY = re.compile(rf"^(?P<names>{_NAMES})(?: \([^()]*(?:\([^()]*\)[^()]*)*\))?:(?:\s|$)")


def section_entries(doc: str, section: str) -> tuple[set[str], list[str]]:
    """Parse one Google-style section of ``doc``.

    Args:
        doc: the raw docstring.
        section: the header without its colon (``"Args"``, ``"Attributes"``).

    Returns:
        The names its entries document and its malformed entry lines (at the entries' indent, but
        not ``name:``, ``name (type):`` or ``name, other:``). Both empty without the section.
    """
    lines = inspect.cleandoc(doc).splitlines()
    names: set[str] = set()
    malformed: list[str] = []
    for start, line in enumerate(lines):
        header = _HEADER.match(line)
        if not header or header["name"] != section:
            continue
        base = len(header["indent"])
        entry_indent = None
        for entry in lines[start + 1 :]:
            if not entry.strip():
                continue
            indent = len(entry) - len(entry.lstrip())
            if indent <= base:
                break  # the next section, or prose after the section
            if entry_indent is None:
                entry_indent = indent
            if indent > entry_indent:
                continue  # a continuation line
            if indent < entry_indent:
                malformed.append(entry.strip())
                continue
            match = _ENTRY.match(entry.strip())
            if match:
                names.update(match["names"].split(", "))
            else:
                malformed.append(entry.strip())
    return names, malformed


def _own_doc(obj) -> str | None:
    """The docstring written for ``obj`` itself: not a base class's, not a dataclass's stand-in."""
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
    if not doc or not doc.strip():
        return None
    if dataclasses.is_dataclass(obj):
        stand_in = obj.__name__ + str(inspect.signature(obj)).replace(" -> None", "")
        if doc == stand_in:
            return None  # what @dataclass writes when the class has no docstring
    return doc


def _fields_make_constructor(cls) -> bool:
    """Whether ``cls``'s constructor is generated from its fields (dataclass or named tuple)."""
    if issubclass(cls, tuple) and hasattr(cls, "_fields"):
        return True
    init = cls.__dict__.get("__init__")
    # @dataclass compiles its __init__ from a string: no source file, unlike one written by hand.
    return (
        dataclasses.is_dataclass(cls)
        and inspect.isfunction(init)
        and (init.__code__.co_filename != inspect.getsourcefile(cls))
    )


def _parameters(obj) -> list[str]:
    """The parameters a caller passes: no ``self``, no ``*args`` / ``**kwargs``, and no private
    ``_name`` (a dataclass's internal field left in its constructor: not an argument to pass)."""
    try:
        signature = inspect.signature(obj)
    except ValueError:  # a class whose constructor has no signature (builtin base): nothing to name
        return []
    catch_all = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [
        p.name
        for p in signature.parameters.values()
        if p.kind not in catch_all and p.name != "self" and not p.name.startswith("_")
    ]


def _documented(obj) -> tuple[set[str], set[str], list[str]]:
    """What ``obj``'s docstrings document: the ``Args:`` names, the ``Attributes:`` names that may
    stand in for them (a constructor generated from fields), and the malformed entry lines."""
    docs = [_own_doc(obj)]
    if inspect.isclass(obj):
        init = getattr(obj, "__init__", None)
        if inspect.isfunction(init) and init.__module__.startswith("torchvote"):
            docs.append(init.__doc__)
    args: set[str] = set()
    attributes: set[str] = set()
    malformed: list[str] = []
    for doc in filter(None, docs):
        found, bad = section_entries(doc, "Args")
        args |= {name.lstrip("*") for name in found}
        malformed += bad
        if inspect.isclass(obj) and _fields_make_constructor(obj):
            found, bad = section_entries(doc, "Attributes")
            attributes |= found
            malformed += bad
    return args, attributes, malformed


def _public_callables() -> dict[str, object]:
    """Every function and class in the packages' ``__all__``, first exporter's name, once each."""
    found: dict[str, object] = {}
    seen: set[int] = set()
    for package in PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            obj = getattr(module, name)
            if not (inspect.isfunction(obj) or inspect.isclass(obj)) or id(obj) in seen:
                continue
            seen.add(id(obj))
            found[f"{package}.{name}"] = obj
    return found


PUBLIC = _public_callables()


def test_the_collection_found_the_public_api():
    assert len(PUBLIC) >= MIN_CALLABLES, f"only {len(PUBLIC)} public callables found"
    assert sum(len(_parameters(obj)) for obj in PUBLIC.values()) >= 3 * MIN_CALLABLES
    assert set(ALLOWED_UNDOCUMENTED) <= set(PUBLIC), "the allow-list names what is not public"


@pytest.mark.parametrize("qualname", sorted(PUBLIC))
def test_public_callable_documents_every_argument(qualname):
    if qualname in ALLOWED_UNDOCUMENTED:
        pytest.skip(ALLOWED_UNDOCUMENTED[qualname])
    obj = PUBLIC[qualname]
    assert _own_doc(obj), f"{qualname} has no docstring"
    args, attributes, malformed = _documented(obj)
    assert not malformed, f"{qualname}: entries not of the form 'name: ...' / 'name (type): ...': {malformed}"
    missing = [name for name in _parameters(obj) if name not in args | attributes]
    assert not missing, f"{qualname}: parameters missing from its Args section: {missing}"
    try:
        every_parameter = set(inspect.signature(obj).parameters)  # the catch-alls included
    except ValueError:
        every_parameter = set()
    stale = sorted(args - every_parameter)
    assert not stale, f"{qualname}: its Args section names what it does not take: {stale}"


def test_the_parser_reads_sections_not_prose():
    doc = """Summary naming ``alpha`` in prose.

    Args:
        alpha: first, continued
            on a deeper line that mentions gamma: not an entry.
        beta (int, optional): second.
        delta, epsilon: a group.
        **options: a catch-all, named without its stars.

    Returns:
        zeta: not an argument.
    """
    assert section_entries(doc, "Args") == ({"alpha", "beta", "delta", "epsilon", "**options"}, [])
    assert section_entries(doc, "Attributes") == (set(), [])
    quoted = """Summary.

    Args:
        ``alpha``: quoted.
    """
    assert section_entries(quoted, "Args") == (set(), ["``alpha``: quoted."])


def test_a_dataclass_without_a_docstring_has_none():
    @dataclasses.dataclass
    class Bare:
        size: int

    @dataclasses.dataclass
    class Documented:
        """A size.

        Attributes:
            size: how big.
        """

        size: int

    assert _own_doc(Bare) is None
    assert _fields_make_constructor(Bare) and _fields_make_constructor(Documented)
    assert _documented(Documented) == (set(), {"size"}, [])
