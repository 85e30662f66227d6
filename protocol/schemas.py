"""JSON Schemas (draft 2020-12) of every method's params and result, collected by name.

The schemas are the language-neutral statement of the wire shapes: peers written in other
languages, docs and tests use them, and :func:`validate_params` checks untrusted input
against them before it is structured (:func:`parse_params` does both). The frame's and the
descriptors' schemas live next to their models (:mod:`protocol.frames`,
:mod:`protocol.descriptors`); the relay methods' are stated here, next to nothing else.
Extra properties are allowed everywhere so newer peers can add fields; optional fields
accept ``null`` as well as absence.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from .convert import structure
from .descriptors import ACTION_REQUEST_SCHEMA, ACTION_RESPONSE_SCHEMA, TOOL_DESCRIPTOR_SCHEMA
from .errors import METHOD_NOT_FOUND, RelayError
from .frames import FRAME_SCHEMA, SESSION_REF_SCHEMA
from .messages import (
    ACK,
    APPEND_ID_RULE,
    APPEND_FRAME,
    APPROVAL,
    CALLER_TOOL,
    CALLER_TOOLS_CONFIG,
    CANCEL,
    HELLO,
    METHODS,
    PARAMS_TYPES,
    PROGRESS,
    ROLES,
    TOOLSET_CALL,
    TOOLSETS_CONFIG,
    USER_MESSAGE,
)
from .schema_check import protocol_validator, require_valid
from .schema_parts import (
    NON_EMPTY,
    OBJECT,
    OPT_OBJECT,
    OPT_STRING,
    SCHEMA_DIALECT,
    SEQ,
    STRING,
    TOOL_NAME,
    document,
    obj,
)

__all__ = [
    "SCHEMA_DIALECT",
    "SCHEMAS",
    "CALLER_ID_SCHEMA",
    "CALLER_TOOL_SPEC_SCHEMA",
    "validate_params",
    "validator_for",
    "parse_params",
]

#: A caller id: its tools are published as ``{caller_id}_{tool}``, so it keeps to the
#: characters every host accepts in a tool name.
CALLER_ID_SCHEMA: dict[str, Any] = {"type": "string", "pattern": r"^[A-Za-z0-9_-]{1,32}$"}

#: The JSON Schema of a :class:`protocol.messages.CallerToolSpec`, also what a caller
#: declares in ``session_message`` (the server's caller-facing schema is this one).
CALLER_TOOL_SPEC_SCHEMA: dict[str, Any] = obj(
    ["name"],
    {
        "name": TOOL_NAME,
        "description": STRING,
        "inputSchema": OBJECT,
        "requires_approval": {"type": "boolean"},
        "timeout_ms": {"type": "integer", "minimum": 1},
        "resultSchema": OPT_OBJECT,
        "approval_timeout_ms": {"type": "integer", "minimum": 1},
    },
)

_TOOLSET_TOOL_SPEC = obj(
    ["name", "toolset", "tool"],
    {
        "name": NON_EMPTY,
        "toolset": NON_EMPTY,
        "tool": NON_EMPTY,
        "description": STRING,
        "inputSchema": OBJECT,
        "descriptor": {"oneOf": [{"type": "null"}, TOOL_DESCRIPTOR_SCHEMA]},
        "approval_timeout_ms": {"type": ["integer", "null"], "minimum": 1},
    },
)

#: An allowed toolset that could not start (`toolsets_config`'s `unavailable`).
_UNAVAILABLE_TOOLSET = obj(["toolset", "prefix", "reason"], {"toolset": NON_EMPTY, "prefix": NON_EMPTY, "reason": STRING})

#: A progress reference: names one request in flight for the server's `progress` notifications.
_PROGRESS_REF = {"type": ["string", "null"], "minLength": 1, "maxLength": 128}
_NUMBER = {"type": "number"}


#: Schema name -> JSON Schema. Method names hold that method's params; ``frame``,
#: ``session_ref``, ``caller_tool_spec``, ``toolset_tool_spec``, ``unavailable_toolset`` and ``*_result`` hold the
#: other relay shapes; ``tool_descriptor``, ``action_request`` and ``action_response`` are
#: the action contract (:mod:`protocol.descriptors`).
SCHEMAS: dict[str, dict[str, Any]] = {
    HELLO: document(
        "hello params",
        obj(
            ["protocol", "role", "instance", "token"],
            {
                "protocol": NON_EMPTY,
                "role": {"enum": list(ROLES)},
                "instance": NON_EMPTY,
                "token": STRING,
                "session": OPT_STRING,
            },
        ),
    ),
    "hello_result": document(
        "hello result",
        obj(
            ["protocol", "server_version", "instance"],
            {
                "protocol": NON_EMPTY,
                "server_version": STRING,
                "instance": NON_EMPTY,
                "session": OPT_STRING,
                "features": {"type": "array", "maxItems": 64, "items": {"type": "string", "maxLength": 64}},
            },
        ),
    ),
    CALLER_TOOLS_CONFIG: document(
        "caller_tools_config params",
        obj(
            ["session_id", "caller_id", "tools"],
            {
                "session_id": NON_EMPTY,
                "caller_id": CALLER_ID_SCHEMA,
                "tools": {"type": "array", "items": CALLER_TOOL_SPEC_SCHEMA},
            },
        ),
    ),
    "caller_tool_spec": document("caller tool spec", CALLER_TOOL_SPEC_SCHEMA),
    CALLER_TOOL: document(
        "caller_tool params",
        obj(
            ["tool"],
            {"tool": NON_EMPTY, "arguments": OBJECT, "caller_id": OPT_STRING, "progress_ref": _PROGRESS_REF,
             "_meta": OPT_OBJECT},
        ),
    ),
    "caller_tool_result": document("caller_tool result", obj(["result"], {"result": {}})),
    CANCEL: document(
        "cancel params", obj(["id"], {"id": {"type": ["integer", "string"]}})
    ),
    USER_MESSAGE: document("user_message params", obj(["frame"], {"frame": FRAME_SCHEMA})),
    ACK: document("ack params", obj(["seq"], {"seq": SEQ})),
    APPEND_FRAME: document(
        "append_frame params",
        obj(
            ["session", "type"],
            {
                "session": SESSION_REF_SCHEMA,
                "type": NON_EMPTY,
                "payload": OBJECT,
                "reply_to": OPT_STRING,
                "append_id": {"type": ["string", "null"], "pattern": f"^{APPEND_ID_RULE}$"},
            },
        ),
    ),
    "append_frame_result": document(
        "append_frame result",
        obj(["seq", "msg_id"], {"seq": SEQ, "msg_id": NON_EMPTY}),
    ),
    "frame": document("frame", FRAME_SCHEMA),
    "session_ref": document("session", SESSION_REF_SCHEMA),
    TOOLSETS_CONFIG: document(
        "toolsets_config params",
        obj(
            ["tools"],
            {
                "tools": {"type": "array", "items": _TOOLSET_TOOL_SPEC},
                "separator": NON_EMPTY,
                "unavailable": {"type": "array", "items": _UNAVAILABLE_TOOLSET},
            },
        ),
    ),
    "toolset_tool_spec": document("toolset tool spec", _TOOLSET_TOOL_SPEC),
    "unavailable_toolset": document("unavailable toolset", _UNAVAILABLE_TOOLSET),
    TOOLSET_CALL: document(
        "toolset_call params",
        obj(["name"], {"name": NON_EMPTY, "arguments": OBJECT, "progress_ref": _PROGRESS_REF, "_meta": OPT_OBJECT}),
    ),
    "toolset_call_result": document(
        "toolset_call result",
        obj(
            [],
            {
                "result": {},
                "content": {"type": ["array", "null"], "items": OBJECT},
            },
        ),
    ),
    APPROVAL: document(
        "approval params",
        obj(
            ["tool_name"],
            {"tool_name": NON_EMPTY, "arguments": OBJECT, "tool_use_id": OPT_STRING, "progress_ref": _PROGRESS_REF,
             "_meta": OPT_OBJECT},
        ),
    ),
    "approval_result": document(
        "approval result",
        obj(["approve"], {"approve": {"type": "boolean"}, "reason": OPT_STRING, "updated_arguments": OPT_OBJECT}),
    ),
    PROGRESS: document(
        "progress params",
        obj(
            ["ref", "progress"],
            {"ref": {"type": "string", "minLength": 1, "maxLength": 128}, "progress": _NUMBER,
             "total": {"type": ["number", "null"]}, "message": OPT_STRING},
        ),
    ),
    "tool_descriptor": document("tool descriptor", TOOL_DESCRIPTOR_SCHEMA),
    "action_request": document("action request", ACTION_REQUEST_SCHEMA),
    "action_response": document("action response", ACTION_RESPONSE_SCHEMA),
}


@lru_cache(maxsize=None)
def validator_for(name: str) -> Any:
    """The compiled (cached) validator of a schema in :data:`SCHEMAS`; ``KeyError`` if unknown."""
    return protocol_validator(SCHEMAS[name])


def validate_params(method: str, params: dict[str, Any]) -> None:
    """Check ``params`` against the schema named ``method``.

    Raises ``RelayError(INVALID_PARAMS)`` naming the JSON path and the problem, or
    ``RelayError(METHOD_NOT_FOUND)`` for a name without a schema.
    """
    try:
        validator = validator_for(method)
    except KeyError:
        raise RelayError(METHOD_NOT_FOUND, f"unknown method {method!r}") from None
    label = f"{method} params" if method in METHODS else method.replace("_", " ")
    require_valid(validator, params, label)


def parse_params(method: str, params: dict[str, Any]) -> Any:
    """Validate ``params`` against the method's schema, then structure its params class.

    The one call a dispatcher needs per incoming request or notification; raises
    ``RelayError`` (``METHOD_NOT_FOUND`` or ``INVALID_PARAMS``).
    """
    cls = PARAMS_TYPES.get(method)
    if cls is None:
        raise RelayError(METHOD_NOT_FOUND, f"unknown method {method!r}")
    validate_params(method, params)
    return structure(params, cls)
