"""Building blocks of the protocol's JSON Schemas (draft 2020-12), and the schema of an attrs class.

A wire shape is written once, as an attrs class: :func:`schema_of` derives its JSON Schema from
the fields (their types, which are required, and the bounds a field declares with
:func:`bounded`), so the published schema and the typed model cannot drift apart. Extra
properties are allowed everywhere so newer peers can add fields; optional fields accept ``null``
as well as absence. The parts below are also the bounds the model modules declare.
"""

from __future__ import annotations

import copy
import types
import typing
from typing import Any

import attrs

__all__: list[str] = []  # internal to protocol/: the model modules export their schemas

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"

STRING: dict[str, Any] = {"type": "string"}
NON_EMPTY: dict[str, Any] = {"type": "string", "minLength": 1}
OPT_STRING: dict[str, Any] = {"type": ["string", "null"]}
OBJECT: dict[str, Any] = {"type": "object"}
OPT_OBJECT: dict[str, Any] = {"type": ["object", "null"]}
SEQ: dict[str, Any] = {"type": "integer", "minimum": 0}
TIMESTAMP: dict[str, Any] = {
    "type": "string",
    "pattern": r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?Z$",
}
#: A tool name as MCP allows it (docs/TOOLSETS.md, "Naming").
TOOL_NAME: dict[str, Any] = {"type": "string", "pattern": r"^[A-Za-z0-9_.-]{1,128}$"}

# The metadata key of a field's bounds (`bounded`).
_BOUNDS = "protocol.schema"
_JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}


def obj(required: list[str], properties: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """An object schema with these required members and member schemas."""
    return {"type": "object", "required": required, "properties": properties, **extra}


def document(title: str, body: dict[str, Any]) -> dict[str, Any]:
    """A standalone schema document (``$schema`` and ``title``) around a copy of ``body``."""
    return {"$schema": SCHEMA_DIALECT, "title": title, **copy.deepcopy(body)}


def bounded(schema: dict[str, Any], **field_args: Any) -> Any:
    """An attrs field whose JSON Schema adds `schema`'s bounds (`minLength`, `pattern`, `minimum`,
    `enum`…) to what its type says. A ``type`` in `schema` may only narrow the annotation's (an
    ``int | None`` that is sent as an integer or not at all); an ``enum`` stands for the type (a
    wrong value is "not one of")."""
    return attrs.field(metadata={_BOUNDS: schema}, **field_args)


def schema_of(cls: type[Any]) -> dict[str, Any]:
    """The JSON Schema of an attrs class: a member per field, required when it has no default."""
    hints = typing.get_type_hints(cls)
    fields = attrs.fields(cls)
    return obj(
        [f.name for f in fields if f.default is attrs.NOTHING],
        {f.name: _field_schema(hints[f.name], f.metadata.get(_BOUNDS, {})) for f in fields},
    )


def _field_schema(tp: Any, bounds: dict[str, Any]) -> dict[str, Any]:
    if "enum" in bounds:
        return dict(bounds)
    schema = _type_schema(tp)
    if not _types(bounds.get("type", schema.get("type"))) <= _types(schema.get("type")):
        raise TypeError(f"the bound {bounds} widens the type {tp!r}")
    return {**schema, **bounds}


def _types(schema_type: Any) -> set[Any]:
    return set(schema_type) if isinstance(schema_type, list) else {schema_type}


def _type_schema(tp: Any) -> dict[str, Any]:
    """The schema of a field type: JSON scalars, ``list[X]``, a JSON object, an attrs class and
    unions of them (``X | None``: an attrs class with ``oneOf``, anything else a list of types)."""
    if tp is Any:
        return {}
    if tp in _JSON_TYPES:
        return {"type": _JSON_TYPES[tp]}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list:
        return {"type": "array", "items": _type_schema(args[0])}
    if tp is dict or origin is dict:
        return dict(OBJECT)
    if attrs.has(tp):
        return schema_of(tp)
    if origin in (typing.Union, types.UnionType):
        members = [_type_schema(a) for a in args]
        if any(attrs.has(a) for a in args):  # null first, as a reader expects it
            return {"oneOf": sorted(members, key=lambda m: m.get("type") != "null")}
        merged: dict[str, Any] = {}
        for member in members:
            merged.update(member)
        merged["type"] = [m["type"] for m in members]
        return merged
    raise TypeError(f"no JSON Schema for the field type {tp!r}")
