"""JSON Schemas (draft 2020-12) of every method's params, of frames and of results.

The schemas are the language-neutral statement of the wire shapes: peers written in other
languages, docs and tests use them, and :func:`validate_params` checks untrusted input
against them before it is structured. Extra properties are allowed everywhere so newer
peers can add fields; optional fields accept ``null`` as well as absence.
"""

from __future__ import annotations

import copy
from functools import lru_cache
from typing import Any

import jsonschema
from jsonschema.exceptions import best_match

from .errors import INVALID_PARAMS, METHOD_NOT_FOUND, RelayError
from .descriptors import ACTIONS, CALL_TOOL, DESCRIBE_TOOL, LIST_TOOLS, ORIGINS
from .messages import (
    ACK,
    APPEND_FRAME,
    CALLER_TOOL,
    CALLER_TOOLS_CONFIG,
    CANCEL,
    HELLO,
    METHODS,
    ROLES,
    TOOLSET_CALL,
    TOOLSETS_CONFIG,
    USER_MESSAGE,
)

__all__ = ["SCHEMA_DIALECT", "SCHEMAS", "validate_params", "validator_for"]

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"

_STRING: dict[str, Any] = {"type": "string"}
_NON_EMPTY: dict[str, Any] = {"type": "string", "minLength": 1}
_OPT_STRING: dict[str, Any] = {"type": ["string", "null"]}
_OBJECT: dict[str, Any] = {"type": "object"}
_OPT_OBJECT: dict[str, Any] = {"type": ["object", "null"]}
_SEQ: dict[str, Any] = {"type": "integer", "minimum": 0}
_TIMESTAMP: dict[str, Any] = {
    "type": "string",
    "pattern": r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?Z$",
}


def _obj(required: list[str], properties: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "object", "required": required, "properties": properties, **extra}


_SESSION_REF = _obj(["channel", "id"], {"channel": _NON_EMPTY, "id": _NON_EMPTY})

_FRAME = _obj(
    ["v", "seq", "ts", "instance", "session", "type", "msg_id"],
    {
        "v": {"type": "integer", "minimum": 1},
        "seq": _SEQ,
        "ts": _TIMESTAMP,
        "instance": _NON_EMPTY,
        "session": _SESSION_REF,
        "type": _NON_EMPTY,
        "msg_id": _NON_EMPTY,
        "reply_to": _OPT_STRING,
        "payload": _OBJECT,
    },
)

_CALLER_TOOL_SPEC = _obj(
    ["name"],
    {
        "name": _NON_EMPTY,
        "description": _STRING,
        "inputSchema": _OBJECT,
        "requires_approval": {"type": "boolean"},
        "timeout_ms": {"type": ["integer", "null"], "minimum": 1},
        "resultSchema": _OPT_OBJECT,
    },
)

# --- seed 001: tool descriptors and the action contract ---

_TOOL_DESCRIPTOR = _obj(
    ["name", "description", "command", "origin", "safety", "input_schema", "result_schema"],
    {
        "name": _NON_EMPTY,
        "description": _STRING,
        "command": _STRING,
        "origin": {"enum": list(ORIGINS)},
        "safety": _STRING,
        "input_schema": _OBJECT,
        "result_schema": _OBJECT,
    },
)

# ``tool`` and ``arguments`` are checked only for the actions that use them, as
# ``protocol.descriptors.parse_action_request`` does; other members are ignored.
_ACTION_REQUEST = _obj(
    ["action"],
    {"action": {"enum": list(ACTIONS)}, "tool": {}, "arguments": {}},
    allOf=[
        {
            "if": {"required": ["action"], "properties": {"action": {"enum": [DESCRIBE_TOOL, CALL_TOOL]}}},
            "then": {"required": ["tool"], "properties": {"tool": _NON_EMPTY}},
        },
        {
            "if": {"required": ["action"], "properties": {"action": {"const": CALL_TOOL}}},
            "then": {"properties": {"arguments": _OPT_OBJECT}},
        },
    ],
)

_ERROR_ENVELOPE = _obj(
    ["type", "error"],
    {
        "type": {"const": "error"},
        "error": _obj(
            ["name", "category", "message"],
            {"name": _STRING, "category": _STRING, "message": _STRING},
        ),
    },
)

# One schema per result shape, so a validator (and a reader) can tell them apart.
_ACTION_RESULTS: dict[str, dict[str, Any]] = {
    LIST_TOOLS: _obj(
        ["type", "tools"],
        {"type": {"const": "result"}, "tools": {"type": "array", "items": _TOOL_DESCRIPTOR}},
    ),
    DESCRIBE_TOOL: _obj(["type", "tool"], {"type": {"const": "result"}, "tool": _TOOL_DESCRIPTOR}),
    CALL_TOOL: _obj(
        ["type", "tool", "result"],
        {"type": {"const": "result"}, "tool": _NON_EMPTY, "result": {}},
    ),
}

_ACTION_RESPONSE: dict[str, Any] = {
    "type": "object",
    "required": ["type"],
    "properties": {"type": {"enum": ["result", "error"]}},
    "anyOf": [_ERROR_ENVELOPE, *_ACTION_RESULTS.values()],
}

# --- toolsets ---

_TOOLSET_TOOL_SPEC = _obj(
    ["name", "toolset", "tool"],
    {
        "name": _NON_EMPTY,
        "toolset": _NON_EMPTY,
        "tool": _NON_EMPTY,
        "description": _STRING,
        "inputSchema": _OBJECT,
        "descriptor": {"oneOf": [{"type": "null"}, _TOOL_DESCRIPTOR]},
    },
)


def _schema(title: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"$schema": SCHEMA_DIALECT, "title": title, **copy.deepcopy(body)}


#: Schema name -> JSON Schema. Method names hold that method's params; ``frame``,
#: ``session_ref``, ``caller_tool_spec``, ``toolset_tool_spec`` and ``*_result`` hold the
#: other relay shapes; ``tool_descriptor``, ``action_request`` and ``action_response`` are
#: seed 001's action contract (:mod:`protocol.descriptors`).
SCHEMAS: dict[str, dict[str, Any]] = {
    HELLO: _schema(
        "hello params",
        _obj(
            ["protocol", "role", "instance", "token"],
            {
                "protocol": _NON_EMPTY,
                "role": {"enum": list(ROLES)},
                "instance": _NON_EMPTY,
                "token": _STRING,
                "session": _OPT_STRING,
            },
        ),
    ),
    "hello_result": _schema(
        "hello result",
        _obj(
            ["protocol", "server_version", "instance"],
            {
                "protocol": _NON_EMPTY,
                "server_version": _STRING,
                "instance": _NON_EMPTY,
                "session": _OPT_STRING,
            },
        ),
    ),
    CALLER_TOOLS_CONFIG: _schema(
        "caller_tools_config params",
        _obj(
            ["session_id", "caller_id", "tools"],
            {
                "session_id": _NON_EMPTY,
                "caller_id": _NON_EMPTY,
                "tools": {"type": "array", "items": _CALLER_TOOL_SPEC},
            },
        ),
    ),
    "caller_tool_spec": _schema("caller tool spec", _CALLER_TOOL_SPEC),
    CALLER_TOOL: _schema(
        "caller_tool params",
        _obj(
            ["tool"],
            {"tool": _NON_EMPTY, "arguments": _OBJECT, "caller_id": _OPT_STRING},
        ),
    ),
    "caller_tool_result": _schema("caller_tool result", _obj(["result"], {"result": {}})),
    CANCEL: _schema(
        "cancel params", _obj(["id"], {"id": {"type": ["integer", "string"]}})
    ),
    USER_MESSAGE: _schema("user_message params", _obj(["frame"], {"frame": _FRAME})),
    ACK: _schema("ack params", _obj(["seq"], {"seq": _SEQ})),
    APPEND_FRAME: _schema(
        "append_frame params",
        _obj(
            ["session", "type"],
            {
                "session": _SESSION_REF,
                "type": _NON_EMPTY,
                "payload": _OBJECT,
                "reply_to": _OPT_STRING,
            },
        ),
    ),
    "append_frame_result": _schema(
        "append_frame result",
        _obj(["seq", "msg_id"], {"seq": _SEQ, "msg_id": _NON_EMPTY}),
    ),
    "frame": _schema("frame", _FRAME),
    "session_ref": _schema("session", _SESSION_REF),
    TOOLSETS_CONFIG: _schema(
        "toolsets_config params",
        _obj(
            ["tools"],
            {
                "tools": {"type": "array", "items": _TOOLSET_TOOL_SPEC},
                "separator": _NON_EMPTY,
            },
        ),
    ),
    "toolset_tool_spec": _schema("toolset tool spec", _TOOLSET_TOOL_SPEC),
    TOOLSET_CALL: _schema(
        "toolset_call params",
        _obj(["name"], {"name": _NON_EMPTY, "arguments": _OBJECT}),
    ),
    "toolset_call_result": _schema(
        "toolset_call result",
        _obj(
            [],
            {
                "result": {},
                "content": {"type": ["array", "null"], "items": _OBJECT},
            },
        ),
    ),
    "tool_descriptor": _schema("tool descriptor", _TOOL_DESCRIPTOR),
    "action_request": _schema("action request", _ACTION_REQUEST),
    "action_response": _schema("action response", _ACTION_RESPONSE),
}


def _is_strict_integer(checker: Any, instance: Any) -> bool:
    # JSON Schema counts 1.0 as an integer; the converter does not, so neither do we.
    return isinstance(instance, int) and not isinstance(instance, bool)


_Validator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", _is_strict_integer
    ),
)


@lru_cache(maxsize=None)
def validator_for(name: str) -> jsonschema.protocols.Validator:
    """The compiled (cached) validator of a schema in :data:`SCHEMAS`; ``KeyError`` if unknown."""
    schema = SCHEMAS[name]
    _Validator.check_schema(schema)
    return _Validator(schema)


def _shorten(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def validate_params(method: str, params: dict[str, Any]) -> None:
    """Check ``params`` against the schema named ``method``.

    Raises ``RelayError(INVALID_PARAMS)`` naming the JSON path and the problem, or
    ``RelayError(METHOD_NOT_FOUND)`` for a name without a schema.
    """
    try:
        validator = validator_for(method)
    except KeyError:
        raise RelayError(METHOD_NOT_FOUND, f"unknown method {method!r}") from None
    error = best_match(validator.iter_errors(params))
    if error is None:
        return
    label = f"{method} params" if method in METHODS else method.replace("_", " ")
    path = error.json_path
    message = _shorten(error.message)
    raise RelayError(
        INVALID_PARAMS,
        f"invalid {label} at {path}: {message}",
        {"path": path},
    )
