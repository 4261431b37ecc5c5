"""The one reader of ``key=value`` text and the one type check of config values (on OmegaConf).

Every ``key=value`` the command line takes goes through :func:`parse_override` and
:func:`parse_value`: training overrides (``optim.lr=3e-4``, ``model.router_options={iterations:2}``),
the options of an ``eval_on`` entry (``affnist-style:canvas=28``, :func:`parse_entry`) and the options of
``torchvote evaluate --data-option``. Values are read as OmegaConf reads a dotlist (YAML scalars,
``[lists]``, ``{mappings}``).

Values are checked against the field types of a dataclass by OmegaConf's structured configs
(:func:`typed_fields`): ``int``, ``float``, ``bool``, ``str``, ``Literal`` choices, ``X | None``,
tuples and dicts. Errors are :class:`ConfigError` messages that name the key and the expected type
or the valid keys.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal, Union

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

__all__ = [
    "ConfigError",
    "coerce_value",
    "field_types",
    "parse_entry",
    "parse_override",
    "parse_value",
    "split_entries",
    "type_name",
    "typed_fields",
    "unknown_key",
]

_NONE_WORDS = frozenset({"none", "null", "~"})
_BOOL_WORDS = frozenset({"true", "yes", "on", "1", "false", "no", "off", "0"})


class ConfigError(ValueError):
    """A bad config key or value; the message says what is valid."""


def parse_override(text: str) -> tuple[list[str], str]:
    """``"optim.lr=1e-3"`` -> ``(["optim", "lr"], "1e-3")``.

    Args:
        text: one ``key=value`` of the command line.

    Returns:
        The dotted key's parts and the value's text (stripped), not yet read.

    Raises:
        ConfigError: no ``=``, or an empty key.
    """
    key, sep, value = text.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ConfigError(f"expected key=value (e.g. optim.lr=3e-4), got {text!r}")
    return parts, value.strip()


def parse_value(text: str, key: str | None = None) -> Any:
    """A command-line value as OmegaConf reads a dotlist entry: ``3`` -> 3, ``1e-3`` -> 0.001,
    ``[0, 1]`` -> a list, ``{iterations: 2}`` (or ``{iterations:2}``) -> a dict, ``null`` -> None,
    anything else -> the text.

    Args:
        text: the value's text.
        key: the dotted key it is the value of, named in the message when it cannot be read.

    Returns:
        The value: a scalar, list, dict, ``None`` or the text itself.

    Raises:
        ConfigError: text YAML cannot read (an unclosed ``{`` or ``[``), naming ``key``.
    """
    given = text
    text = text.strip()
    if text.startswith("{") and text.endswith("}"):  # YAML wants a space after a mapping's colon
        text = re.sub(r":(?=\S)", ": ", text)
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist([f"value={text}"]))["value"]
    except (yaml.YAMLError, OmegaConfBaseException) as err:  # was a yaml traceback
        problem = getattr(err, "problem", None) or str(err).strip().splitlines()[0]
        where = f"{key}: " if key else ""
        raise ConfigError(f"{where}cannot read {given!r} as a value ({problem})") from None


def parse_entry(entry: str, what: str) -> tuple[str, dict[str, Any]]:
    """``"name:key=value,key=value"`` -> ``("name", {key: value, ...})`` (an ``eval_on`` entry).

    Args:
        entry: the text.
        what: the setting it comes from, for the error message (``eval_on``).

    Returns:
        The name and its options, each value read by :func:`parse_value`.

    Raises:
        ConfigError: an option that is not ``key=value``, a key given twice, or options joined
            with colons (``mnist:split=train:limit=5``, whose split read as ``train:limit=5``, or
            ``mnist:split:limit=5``, an option named ``split:limit``).
    """
    name, _, rest = entry.partition(":")
    items = [item for item in (part.strip() for part in _split_commas(rest)) if item]
    for item in items:
        key, _, value = item.partition("=")
        # a value holding ":key=" (split=train:limit=5), or a key holding a colon (split:limit=5)
        if ("=" in item and ":" in key) or re.search(r":\s*[A-Za-z_][\w.]*\s*=", value):
            raise ConfigError(
                f"{what} entry {entry!r}: separate its options with commas, not colons "
                f"({name.strip()}:key=value,key=value)"
            )
    return name.strip(), parse_options(items, f"{what} entry {entry!r}")


def _split_commas(text: str) -> list[str]:
    """``text`` split at its commas outside brackets, braces and quotes, so that a value may be a
    list or a mapping (``ranges={rotation_deg: [0, 0], shear: [0, 0]}``)."""
    pieces, start, depth, quote = [], 0, 0, ""
    for index, char in enumerate(text):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{(":
            depth += 1
        elif char in "]})":
            depth = max(depth - 1, 0)
        elif char == "," and depth == 0:
            pieces.append(text[start:index])
            start = index + 1
    return [*pieces, text[start:]]


def split_entries(values: Iterable[str]) -> list[str]:
    """Comma-separated ``eval_on``-style entries -> one text per entry.

    A ``key=value`` piece (no ``:`` before its ``=``) continues the options of the entry before
    it, so ``["mnist,affnist-style:canvas=28,seed=1", "copy"]`` gives ``["mnist",
    "affnist-style:canvas=28,seed=1", "copy"]``; commas inside a list or a mapping do not split
    (``affnist-style:ranges={shear: [0, 0]}``).

    Args:
        values: the texts as given (each may hold several entries).

    Returns:
        The entries, stripped, empty ones dropped.
    """
    entries: list[str] = []
    for value in values:
        for piece in (part.strip() for part in _split_commas(value)):
            if not piece:
                continue
            if entries and "=" in piece and ":" not in piece.partition("=")[0] and ":" in entries[-1]:
                entries[-1] += f",{piece}"
            else:
                entries.append(piece)
    return entries


def parse_options(items: Iterable[str], what: str) -> dict[str, Any]:
    """``["key=value", ...]`` -> ``{key: value}`` (values read by :func:`parse_value`).

    Args:
        items: the ``key=value`` texts.
        what: where they come from, for the message (``--data-option``).

    Returns:
        The options.

    Raises:
        ConfigError: an item that is not ``key=value``, or a key given twice (refused, not
            settled by order, as the training overrides are); the message starts with ``what``.
    """
    options: dict[str, Any] = {}
    for item in items:
        try:
            parts, raw = parse_override(item)
        except ConfigError:
            raise ConfigError(f"{what}: options must be key=value, got {item!r}") from None
        key = ".".join(parts)
        if key in options:
            raise ConfigError(f"{what}: {key} is given twice; give each option once")
        options[key] = parse_value(raw, f"{what}: {key}")
    return options


def type_name(annotation: Any) -> str:
    """A type annotation as the error messages write it (``int | none``, ``comma-separated ints``)."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return " | ".join(repr(choice) for choice in typing.get_args(annotation))
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(arm) for arm in typing.get_args(annotation))
    if origin is tuple:
        args = typing.get_args(annotation)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"comma-separated {type_name(args[0])}s"
        return f"tuple of ({', '.join(type_name(a) for a in args)})"
    if annotation is type(None):
        return "none"
    return getattr(annotation, "__name__", str(annotation))


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """The resolved annotations of a dataclass's init fields."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def unknown_key(key: str, valid: Iterable[str], what: str = "", *, deeper: Iterable[str] = ()) -> ConfigError:
    """The error for a key that does not exist, with the key probably meant.

    Args:
        key: the dotted key given.
        valid: the dotted keys that exist there.
        what: more words after the key (`` for model 'capsnet'``).
        deeper: keys one section down (``optim.lr`` beside the top level's ``lr``): one whose
            last part is ``key`` is the key meant.

    Returns:
        The :class:`ConfigError` to raise; its message names the key meant, where one is close
        (``lr``: ``optim.lr``; ``optim.lrr``: ``optim.lr``), and lists ``valid``.
    """
    valid = list(valid)
    meant = [candidate for candidate in deeper if candidate.rsplit(".", 1)[-1] == key]
    meant = meant or difflib.get_close_matches(key, valid, n=1, cutoff=0.8)
    hint = f" (did you mean {' or '.join(repr(m) for m in meant)}?)" if meant else ""
    return ConfigError(f"unknown key {key!r}{what}{hint}; valid keys: {', '.join(valid)}")


def _arms(annotation: Any) -> tuple[Any, ...]:
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _prepare(value: Any, annotation: Any, key: str) -> Any:
    """Command-line conventions OmegaConf does not know, before it checks the type: ``none`` for
    an optional field, ``8,16`` or ``(8, 16)`` for a tuple, a ``{mapping}`` or number in free-form
    fields; and stricter than OmegaConf: a ``str`` field takes only text, a ``bool`` field only
    the words true/false/yes/no/on/off/1/0."""
    arms = _arms(annotation)
    if not isinstance(value, str):
        if str in arms and value is not None and len(arms) == 1:
            raise ConfigError(f"{key}: expected {type_name(annotation)}, got {value!r}")
        return value
    if type(None) in arms and value.lower() in _NONE_WORDS:
        return None
    if any(typing.get_origin(arm) is tuple for arm in arms):
        text = value.strip()
        if len(text) >= 2 and text[0] + text[-1] in ("()", "[]"):
            text = text[1:-1]
        elif text[:1] in ("(", "[") or text[-1:] in (")", "]"):  # `[mnist` read as a data set name
            raise ConfigError(f"{key}: expected {type_name(annotation)}, got {value!r} (unbalanced brackets)")
        return split_entries([text])  # an eval_on entry keeps its key=value options together
    if annotation is Any or any(arm is dict or typing.get_origin(arm) is dict for arm in arms):
        return parse_value(value, key)
    if bool in arms and value.lower() not in _BOOL_WORDS:
        raise ConfigError(f"{key}: expected {type_name(annotation)}, got {value!r}")
    return value


def _type_error(annotation: Any, value: Any, key: str) -> ConfigError:
    """The message for a value OmegaConf rejected: the choices, the bad element, or the type."""
    if typing.get_origin(annotation) is Literal:
        choices = ", ".join(str(choice) for choice in typing.get_args(annotation))
        return ConfigError(f"{key}: {value!r} is not one of: {choices}")
    for arm in _arms(annotation):
        args = typing.get_args(arm)
        if typing.get_origin(arm) is tuple and isinstance(value, (list, tuple)):
            homogeneous = len(args) == 2 and args[1] is Ellipsis
            if homogeneous or len(args) == len(value):
                for index, item in enumerate(value):
                    coerce_value(item, args[0] if homogeneous else args[index], f"{key}[{index}]")
    return ConfigError(f"{key}: expected {type_name(annotation)}, got {value!r}")


def typed_fields(cls: type, values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Check ``values`` (field name -> value) against the fields of the dataclass ``cls`` with
    OmegaConf's structured config; return them converted (tuples as tuples, nested dataclass
    sections as plain dicts).

    Args:
        cls: the dataclass (its field types are the schema).
        values: the fields to set; nested dataclass fields take mappings.
        prefix: the dotted key of ``cls`` in the whole config, for the messages.

    Returns:
        The converted values, only the keys of ``values``.

    Raises:
        ConfigError: an unknown key (the message lists the valid ones) or a value of the wrong
            type (the message names the key and the type).
    """
    dotted = f"{prefix}." if prefix else ""
    types_ = field_types(cls)
    prepared: dict[str, Any] = {}
    for name, value in values.items():
        if name not in types_:
            raise unknown_key(f"{dotted}{name}", [f"{dotted}{n}" for n in types_])
        annotation = types_[name]
        if dataclasses.is_dataclass(annotation):
            if not isinstance(value, Mapping):
                sub = ", ".join(f"{dotted}{name}.{n}" for n in field_types(annotation))
                raise ConfigError(f"{dotted}{name} is a section; set one of its keys: {sub}")
            prepared[name] = typed_fields(annotation, value, f"{dotted}{name}")
        else:
            prepared[name] = _prepare(value, annotation, f"{dotted}{name}")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(cls), prepared)
    except (ConfigAttributeError, ConfigKeyError) as err:  # pragma: no cover - caught above
        raise unknown_key(f"{dotted}{err.full_key}", [f"{dotted}{n}" for n in types_]) from None
    except (OmegaConfBaseException, TypeError) as err:  # TypeError: a list merged into a dict
        key = getattr(err, "key", None)
        name = str(key) if key is not None and str(key) in types_ else None
        if name is None:  # an element of a sequence, or no key named: the field that fails alone
            name = next((n for n in prepared if not _merges(cls, n, prepared[n])), None)
        if name is None:
            raise ConfigError(f"{dotted.rstrip('.') or 'config'}: {err}") from None
        raise _type_error(types_[name], prepared[name], f"{dotted}{name}") from None
    converted = OmegaConf.to_container(merged)
    return {name: converted[name] for name in values}


def _merges(cls: type, name: str, value: Any) -> bool:
    """Whether field ``name`` of the dataclass ``cls`` takes ``value`` (OmegaConf's check)."""
    try:
        OmegaConf.merge(OmegaConf.structured(cls), {name: value})
    except (OmegaConfBaseException, TypeError):
        return False
    return True


def coerce_value(value: Any, annotation: Any, key: str) -> Any:
    """Check one value (a command-line string or a YAML value) against ``annotation``; convert it.

    Args:
        value: the raw value.
        annotation: a resolved type: ``int``, ``float``, ``bool``, ``str``, ``Literal[...]``,
            ``X | None``, ``tuple[X, ...]``, ``dict[str, Any]`` or ``Any``.
        key: the dotted key, for the error message.

    Returns:
        The converted value.

    Raises:
        ConfigError: the value does not fit; the message names the key and the expected type.
    """
    if annotation is Any:
        return parse_value(value, key) if isinstance(value, str) else value
    holder = _holder(annotation)
    try:
        return typed_fields(holder, {"value": value})["value"]
    except ConfigError as err:
        message = str(err)
        raise ConfigError(key + message[len("value") :] if message.startswith("value") else message) from None


@functools.cache
def _holder(annotation: Any) -> type:
    """A one-field dataclass whose field has the type ``annotation`` (for :func:`coerce_value`)."""
    return dataclasses.make_dataclass("Value", [("value", annotation)])
