"""Building blocks of the protocol's JSON Schemas (draft 2020-12), shared by the model modules.

Each model module states the schema of its own shapes next to them with these parts;
:mod:`protocol.schemas` collects them by name. Extra properties are allowed everywhere so
newer peers can add fields; optional fields accept ``null`` as well as absence.
"""

from __future__ import annotations

import copy
from typing import Any

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


def obj(required: list[str], properties: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """An object schema with these required members and member schemas."""
    return {"type": "object", "required": required, "properties": properties, **extra}


def document(title: str, body: dict[str, Any]) -> dict[str, Any]:
    """A standalone schema document (``$schema`` and ``title``) around a copy of ``body``."""
    return {"$schema": SCHEMA_DIALECT, "title": title, **copy.deepcopy(body)}
