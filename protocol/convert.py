"""One cattrs converter for every protocol class: strict in, compact out.

Input comes from another process, so structuring never coerces (``"5"`` is not an int,
``1`` is not a string, a dict is not a list) and every failure becomes a
``RelayError(INVALID_PARAMS)`` whose message names the class and the field. Unknown keys
are ignored so newer peers can add fields. Unstructuring drops optional fields that are
``None`` so messages stay small and older peers see only what they know.

A value already checked against its class's JSON Schema (derived from the class, so it
accepts nothing the class cannot hold) is built by :func:`build_valid`, which checks nothing
again: a relay message is checked once.

This module knows no protocol class: it sits just above :mod:`protocol.errors`, and every
model module builds on it. A class names itself in error messages with a ``wire_label``
class attribute (``"frame"``, ``"hello params"``); without one, its class name is used.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs
import cattrs
from cattrs.errors import (
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn

from .errors import INVALID_PARAMS, RelayError

__all__ = [
    "converter",
    "make_converter",
    "structure",
    "build_valid",
    "unstructure",
    "wire_label",
    "StrictTypeError",
    "json_type_name",
]

T = TypeVar("T")

_PRIMITIVES: tuple[type, ...] = (str, int, float, bool, type(None))


class StrictTypeError(TypeError):
    """A value of the wrong JSON type; its message is already human-readable."""


def json_type_name(value: Any) -> str:
    """The JSON name of a value's type, for error messages a non-Python peer understands."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__


def _describe_type(tp: Any) -> str:
    names = {str: "a string", int: "an integer", float: "a number", bool: "a boolean"}
    if tp in names:
        return names[tp]
    if tp is type(None):
        return "null"
    if _is_union(tp):
        return " or ".join(_describe_type(a) for a in typing.get_args(tp))
    if tp is dict or typing.get_origin(tp) is dict or attrs.has(tp):
        return "an object"
    if tp is list or typing.get_origin(tp) is list:
        return "an array"
    return getattr(tp, "__name__", repr(tp))


def _wrong_type(value: Any, tp: Any) -> StrictTypeError:
    return StrictTypeError(f"must be {_describe_type(tp)}, got {json_type_name(value)}")


# --- strict primitive hooks --------------------------------------------------------------


def _structure_str(value: Any, tp: Any) -> str:
    if isinstance(value, str):
        return value
    raise _wrong_type(value, str)


def _structure_int(value: Any, tp: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise _wrong_type(value, int)


def _structure_float(value: Any, tp: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise _wrong_type(value, float)


def _structure_bool(value: Any, tp: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise _wrong_type(value, bool)


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _is_primitive_union(tp: Any) -> bool:
    return _is_union(tp) and all(a in _PRIMITIVES for a in typing.get_args(tp))


def _structure_primitive_union(value: Any, tp: Any) -> Any:
    """``int | str``, ``str | None`` and the like: accept exactly one of the member types."""
    members = typing.get_args(tp)
    for member in members:
        if member is type(None):
            if value is None:
                return None
        elif member is bool or member is str:
            if isinstance(value, member):
                return value
        elif member is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        elif member is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
    raise _wrong_type(value, tp)


def _is_optional_compound(tp: Any) -> bool:
    """``dict[str, Any] | None``, ``SomeClass | None``: one non-primitive member and null."""
    if not _is_union(tp) or _is_primitive_union(tp):
        return False
    args = typing.get_args(tp)
    return len(args) == 2 and type(None) in args


def _make_optional_hook(conv: cattrs.Converter) -> Callable[[Any, Any], Any]:
    def structure_optional(value: Any, tp: Any) -> Any:
        if value is None:
            return None
        (member,) = (a for a in typing.get_args(tp) if a is not type(None))
        try:
            return conv.get_structure_hook(member)(value, member)
        except StrictTypeError:
            # Only the top-level type was wrong (nested problems are other exceptions).
            raise _wrong_type(value, tp) from None

    return structure_optional


def _is_plain_dict(tp: Any) -> bool:
    if tp is dict:
        return True
    if typing.get_origin(tp) is dict:
        args = typing.get_args(tp)
        return not args or (args[0] is str and args[1] is Any)
    return False


def _structure_plain_dict(value: Any, tp: Any) -> dict[str, Any]:
    """A JSON object kept as-is (shallow copy, so the frozen instance owns it)."""
    if isinstance(value, dict):
        return dict(value)
    raise _wrong_type(value, dict)


def _is_list(tp: Any) -> bool:
    return tp is list or typing.get_origin(tp) is list


def _make_list_hook(conv: cattrs.Converter) -> Callable[[Any, Any], list[Any]]:
    def structure_list(value: Any, tp: Any) -> list[Any]:
        if not isinstance(value, list):
            raise _wrong_type(value, list)
        args = typing.get_args(tp)
        elem = args[0] if args else Any
        hook = conv.get_structure_hook(elem)
        out: list[Any] = []
        errors: list[Exception] = []
        for index, item in enumerate(value):
            try:
                out.append(hook(item, elem))
            except Exception as exc:  # collected and reported together, like cattrs
                exc.__notes__ = [
                    *getattr(exc, "__notes__", []),
                    IterableValidationNote(f"Structuring {tp} @ index {index}", index, elem),
                ]
                errors.append(exc)
        if errors:
            raise IterableValidationError(f"While structuring {tp!r}", errors, tp)
        return out

    return structure_list


# --- attrs classes ------------------------------------------------------------------------


def _make_attrs_structure(conv: cattrs.Converter) -> Callable[[type[Any]], Any]:
    def factory(cls: type[Any]) -> Callable[[Any, Any], Any]:
        inner = make_dict_structure_fn(cls, conv)

        def structure_attrs(value: Any, tp: Any) -> Any:
            if not isinstance(value, Mapping):
                raise _wrong_type(value, cls)
            return inner(value, tp)

        return structure_attrs

    return factory


def _make_attrs_unstructure(conv: cattrs.Converter) -> Callable[[type[Any]], Any]:
    def factory(cls: type[Any]) -> Callable[[Any], dict[str, Any]]:
        inner = make_dict_unstructure_fn(cls, conv)
        # Only optional fields (default None) are dropped when None; a required field
        # that holds None (e.g. a caller's null result) must stay on the wire.
        optional = tuple(
            f.name for f in attrs.fields(cls) if f.default is None and f.init
        )

        def unstructure_attrs(obj: Any) -> dict[str, Any]:
            out = inner(obj)
            for name in optional:
                if out.get(name, 0) is None:
                    del out[name]
            return out

        return unstructure_attrs

    return factory


def make_converter() -> cattrs.Converter:
    """Build a converter with the protocol's strict rules (exposed for tests and embedding)."""
    conv = cattrs.Converter(forbid_extra_keys=False, detailed_validation=True)
    conv.register_structure_hook(str, _structure_str)
    conv.register_structure_hook(int, _structure_int)
    conv.register_structure_hook(float, _structure_float)
    conv.register_structure_hook(bool, _structure_bool)
    conv.register_structure_hook_func(_is_primitive_union, _structure_primitive_union)
    conv.register_structure_hook_func(_is_plain_dict, _structure_plain_dict)
    conv.register_structure_hook_func(_is_list, _make_list_hook(conv))
    conv.register_structure_hook_func(_is_optional_compound, _make_optional_hook(conv))
    conv.register_structure_hook_factory(attrs.has, _make_attrs_structure(conv))
    conv.register_unstructure_hook_factory(attrs.has, _make_attrs_unstructure(conv))
    return conv


#: The shared converter.
converter: cattrs.Converter = make_converter()


def _passthrough(value: Any, tp: Any) -> Any:
    return value


def _number_union(value: Any, tp: Any) -> Any:
    """An int where the union allows a float but no int (``float | None``) is a float, as `structure` makes it."""
    members = typing.get_args(tp)
    return float(value) if value.__class__ is int and float in members and int not in members else value


def _make_trusting_converter() -> cattrs.Converter:
    """A converter that builds without checking: for values their schema has already accepted."""
    conv = cattrs.Converter(forbid_extra_keys=False, detailed_validation=False)
    for tp in (str, int, bool):
        conv.register_structure_hook(tp, _passthrough)
    conv.register_structure_hook_func(_is_primitive_union, _number_union)
    conv.register_structure_hook_func(_is_plain_dict, lambda value, tp: dict(value))
    return conv


_trusting = _make_trusting_converter()


# --- error messages -------------------------------------------------------------------------

def wire_label(cls: Any) -> str:
    """How error messages name ``cls``: its ``wire_label`` class attribute, else its name."""
    label = getattr(cls, "wire_label", None)
    return label if isinstance(label, str) else getattr(cls, "__name__", str(cls))


def _format_exception(exc: BaseException, tp: Any) -> str:
    if isinstance(exc, KeyError):
        return "is required"
    if isinstance(exc, StrictTypeError):
        return str(exc)
    if isinstance(exc, ForbiddenExtraKeysError):
        return f"has unknown keys {sorted(exc.extra_fields)}"
    if isinstance(exc, (TypeError, ValueError)) and tp is not None:
        return f"must be {_describe_type(tp)}"
    return f"is invalid ({type(exc).__name__}: {exc})"


def _humanise(line: str) -> str:
    """Turn cattrs' ``"<msg> @ $.a[0].b"`` into ``"'a[0].b' <msg>"``."""
    message, sep, path = line.rpartition(" @ ")
    if not sep:
        return line
    path = path.removeprefix("$").removeprefix(".")
    if not path:
        return message
    return f"'{path}' {message}"


def structure(data: Any, cls: type[T], *, what: str | None = None) -> T:
    """Build ``cls`` from untrusted JSON data, or raise ``RelayError(INVALID_PARAMS)``.

    The message reads like ``invalid caller_tool params: 'tool' is required``; ``what``
    overrides the ``caller_tool params`` part.
    """
    label = what or wire_label(cls)
    try:
        return converter.structure(data, cls)
    except (ClassValidationError, IterableValidationError) as exc:
        problems = [_humanise(line) for line in cattrs.transform_error(exc, "$", _format_exception)]
    except (StrictTypeError, KeyError, TypeError, ValueError) as exc:
        problems = [_humanise(f"{_format_exception(exc, cls)} @ $")]
    raise RelayError(
        INVALID_PARAMS,
        f"invalid {label}: " + "; ".join(problems),
        {"errors": problems},
    )


def build_valid(data: Any, cls: type[T]) -> T:
    """Build ``cls`` from data its JSON Schema (:mod:`protocol.schemas`) has accepted, checking
    nothing again (`structure` is for data no schema has checked). Data the schema would refuse
    may raise anything: a bug in the caller."""
    return _trusting.structure(data, cls)


def unstructure(obj: Any) -> Any:
    """JSON-ready data for ``obj`` (attrs instances become dicts without optional Nones)."""
    return converter.unstructure(obj)
