"""JSON Schemas of the caller-facing MCP tools (what a caller sends to the server)."""

from __future__ import annotations

from typing import Any

SESSION_ID = {"type": "string", "pattern": r"^[A-Za-z0-9_.:@-]{1,128}$", "description": "Session id."}
INSTANCE = {"type": "string", "description": "Instance id; defaults to the only connected instance."}
TOOL_NAME = {"type": "string", "pattern": r"^[A-Za-z0-9_.-]{1,128}$"}

CALLER_TOOL_SPEC: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": TOOL_NAME,
        "description": {"type": "string"},
        "inputSchema": {"type": "object"},
        "requires_approval": {"type": "boolean"},
        "timeout_ms": {"type": "integer", "minimum": 1},
    },
    "required": ["name"],
}

SESSION_MESSAGE: dict[str, Any] = {
    "type": "object",
    "properties": {
        "message": {"type": "string", "minLength": 1, "description": "Text for the agent."},
        "session_id": SESSION_ID,
        "instance": INSTANCE,
        "context": {
            "type": "object",
            "description": "Declare the caller's tools for this session; the agent sees them as {caller_id}_{tool}.",
            "properties": {
                "caller_id": {"type": "string", "pattern": r"^[A-Za-z0-9_-]{1,32}$"},
                "caller_tools": {"type": "array", "items": CALLER_TOOL_SPEC},
            },
            "required": ["caller_id"],
        },
        "wait": {
            "description": "true: wait until the turn ends; a number: wait at most that many seconds.",
            "oneOf": [{"type": "boolean"}, {"type": "number", "minimum": 0}],
        },
    },
    "required": ["message"],
    "additionalProperties": False,
}

CALLER_TOOL_RESPONSE: dict[str, Any] = {
    "type": "object",
    "properties": {
        "session_id": SESSION_ID,
        "request_id": {"type": "string", "minLength": 1},
        "result": {"description": "The tool's result (any JSON)."},
        "error": {"type": ["string", "null"], "description": "The tool's error text."},
    },
    "required": ["session_id", "request_id"],
    "additionalProperties": False,
}

SESSION_EVENTS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "session_id": SESSION_ID,
        "instance": INSTANCE,
        "channel": {"type": "string", "description": "Session channel; default 'mcp'."},
        "after_seq": {"type": "integer", "minimum": 0},
        "wait_ms": {"type": "integer", "minimum": 0, "maximum": 30000},
        "limit": {"type": "integer", "minimum": 1, "maximum": 200},
        "types": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["session_id"],
    "additionalProperties": False,
}
