"""JSON Schemas of the caller-facing MCP tools (what a caller sends to the server).

Shapes the protocol already states are taken from it, not restated: a declared caller tool is
the protocol's caller tool spec, a caller id and a session id are the protocol's, and the frames a
read returns are the protocol's frame.
"""

from __future__ import annotations

from typing import Any

from protocol import (
    CALLER_ID_SCHEMA,
    CALLER_TOOL_SPEC_SCHEMA,
    FRAME_SCHEMA,
    SESSION_ID_SCHEMA,
)

from ...store.sqlite import MAX_SEQ

OWNER_KEY_PATTERN = r"^[A-Za-z0-9_-]{22,128}$"
OWNER_KEY = {
    "type": "string", "pattern": OWNER_KEY_PATTERN,
    "description": "2026-07-28 (stateless HTTP) callers only: the owner_key session_message returned, or one you "
    "chose (22-128 of A-Z a-z 0-9 _ -, at least 128 random bits); it names you as the session's owner. "
    "Ignored on stdio and handshake-era HTTP, where your connection names you.",
}

# Descriptions a model reads: each says what every stop means and what to call next, so a model
# follows the loop (message -> requires_action -> caller_tool_response with wait -> ... -> end_turn)
# from tool results alone, with no event read and no extra prompting.
_STOPS = (
    "stop_reason says what to do next: "
    "'end_turn': the turn is over and text is the agent's answer. "
    "'requires_action': the agent called your caller tools and waits for you; each pending entry with kind "
    "'caller_tool' has request_id, tool, arguments and expires_at: run the tool yourself and answer each one with "
    "caller_tool_response (session_id, request_id, result or error, wait: true) before expires_at. "
    "'requires_approval': the agent wants to run a tool that needs your decision; each pending entry with kind "
    "'approval' has request_id, tool, arguments: answer with approval_response (session_id, request_id, approve, "
    "reason, wait: true). "
    "'error': the turn failed and text says why. "
    "'no_guest' (session_message only): no guest is connected to the instance and it has no start command; the "
    "message is stored and runs when a guest connects; text says what to do (start a guest, check the instance "
    "name). "
    "'timeout': the wait ran out while the turn goes on; answer what is pending, or read the turn's end with "
    "session_events (types ['assistant.done', 'session.error'], wait_ms)."
)
SESSION_MESSAGE_DESCRIPTION = (
    "Send a message to the agent in a sandboxed instance. Optionally declare your own tools in "
    "context.caller_tools (caller_id, caller_tools: [{name, description, inputSchema, timeout_ms}]): the agent sees "
    "them as {caller_id}_{name}, and each call it makes comes back to you to run. With wait (true, or seconds) the "
    "result comes when the turn ends or needs you; " + _STOPS + " Keep the result's session_id (and owner_key, if "
    "it has one) for the calls that follow."
)
CALLER_TOOL_RESPONSE_DESCRIPTION = (
    "Answer a caller tool request (a pending entry with kind 'caller_tool' of a requires_action stop) with result "
    "(any JSON: the agent gets it as the tool's result) or error (text: the agent gets a tool error). Pass wait: true "
    "to go on waiting on the same turn; the result then also has the turn's next stop, as session_message's: if "
    "other requests are still pending it returns at once listing them. " + _STOPS + " An answer after expires_at "
    "is too late: the agent already got a timeout error; with wait you get resolved: false, not_pending, and the "
    "turn's next stop."
)
APPROVAL_RESPONSE_DESCRIPTION = (
    "Decide an approval request (a pending entry with kind 'approval' of a requires_approval stop): approve "
    "(optionally with updated_arguments) or deny with a reason the agent sees. Or answer every pending approval "
    "of the session at once with approvals: [{type: 'approval', tool_call_id, approve, reason?} | {type: 'tool', "
    "tool_call_id, tool_return, status}] (a tool return is a client-side tool's result). A toolset's form "
    "(origin 'toolset') is answered with approve and content. Pass wait: true to go on "
    "waiting on the same turn; the result then also has the turn's next stop, as session_message's: " + _STOPS
)

SESSION_ID: dict[str, Any] = {**SESSION_ID_SCHEMA, "description": "Session id."}
INSTANCE = {"type": "string", "description": "Instance id; defaults to the only connected instance."}
CALLER_TOOL_SPEC: dict[str, Any] = CALLER_TOOL_SPEC_SCHEMA

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
                "caller_id": CALLER_ID_SCHEMA,
                "caller_tools": {"type": "array", "items": CALLER_TOOL_SPEC},
                "echo_own_answers": {
                    "type": "boolean",
                    "description": "Also send me the caller_tool_result event of my own caller_tool_response "
                                   "(default false: the answer is in the log, other followers get the event).",
                },
            },
            "required": ["caller_id"],
        },
        "wait": {
            "description": "true: wait until the turn ends; a number: wait at most that many seconds.",
            "oneOf": [{"type": "boolean"}, {"type": "number", "minimum": 0}],
        },
        "owner_key": OWNER_KEY,
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
        "wait": {
            "description": "true: after answering, wait on the turn until its next stop; a number: at most that many seconds.",
            "oneOf": [{"type": "boolean"}, {"type": "number", "minimum": 0}],
        },
        "owner_key": OWNER_KEY,
    },
    "required": ["session_id", "request_id"],
    "additionalProperties": False,
}

CALLER_TOOL_PROGRESS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "session_id": SESSION_ID,
        "request_id": {"type": "string", "minLength": 1, "description": "The caller_tool_request's request_id."},
        "progress": {"type": "number", "description": "How far the tool has come (should increase)."},
        "total": {"type": ["number", "null"], "description": "The value `progress` reaches when done, if known."},
        "message": {"type": ["string", "null"], "maxLength": 1000, "description": "A short status line for the agent."},
        "owner_key": OWNER_KEY,
    },
    "required": ["session_id", "request_id", "progress"],
    "additionalProperties": False,
}

_WAIT: dict[str, Any] = {
    "description": "true: wait until the turn ends; a number: wait at most that many seconds.",
    "oneOf": [{"type": "boolean"}, {"type": "number", "minimum": 0}],
}
_REASON: dict[str, Any] = {"type": ["string", "null"], "description": "Why; the agent sees it on a denial."}
_APPROVAL_ITEM: dict[str, Any] = {
    "type": "object",
    "properties": {
        "type": {"const": "approval"},
        "tool_call_id": {"type": "string", "minLength": 1, "description": "The approval's request_id."},
        "approve": {"type": "boolean"},
        "reason": _REASON,
    },
    "required": ["type", "tool_call_id", "approve"],
    "additionalProperties": False,
}
_TOOL_RETURN_ITEM: dict[str, Any] = {
    "type": "object",
    "properties": {
        "type": {"const": "tool"},
        "tool_call_id": {"type": "string", "minLength": 1, "description": "The approval's request_id."},
        "tool_return": {"description": "The client-side tool's result (any JSON; the error text when status is error)."},
        "status": {"enum": ["success", "error"]},
    },
    "required": ["type", "tool_call_id", "tool_return", "status"],
    "additionalProperties": False,
}
APPROVAL_RESPONSE: dict[str, Any] = {
    "type": "object",
    "properties": {
        "session_id": SESSION_ID,
        "instance": INSTANCE,
        "request_id": {"type": "string", "minLength": 1, "description": "The approval_request's request_id."},
        "approve": {"type": "boolean"},
        "reason": _REASON,
        "updated_arguments": {"type": "object", "description": "On approve: the arguments to run the tool with instead."},
        "content": {
            "type": "object",
            "description": "A toolset's elicitation (origin 'toolset', with an 'elicitation' form): on approve, the "
            "form's answer, checked against its requestedSchema; approve false declines the form.",
        },
        "approvals": {
            "type": "array", "minItems": 1,
            "description": "Letta's batch form: one answer for each pending approval of the session.",
            "items": {"oneOf": [_APPROVAL_ITEM, _TOOL_RETURN_ITEM]},
        },
        "wait": _WAIT,
        "owner_key": OWNER_KEY,
    },
    "required": ["session_id"],
    "additionalProperties": False,
}

SESSION_EVENTS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "session_id": SESSION_ID,
        "instance": INSTANCE,
        "channel": {"type": "string", "description": "Session channel; default 'mcp'."},
        "after_seq": {"type": "integer", "minimum": 0, "maximum": MAX_SEQ},
        "wait_ms": {"type": "integer", "minimum": 0, "maximum": 30000},
        "limit": {"type": "integer", "minimum": 1, "maximum": 200},
        "types": {"type": "array", "items": {"type": "string"}},
        "owner_key": OWNER_KEY,
    },
    "required": ["session_id"],
    "additionalProperties": False,
}

# The host agent's tether tools, exactly as docs/TETHER.md gives them.
TETHER_SEND_DESCRIPTION = (
    "Send a message to an agent running inside a VM instance. The message is delivered via the tether "
    "protocol. The instance wakes automatically if paused or stopped. Use tether_read to receive the "
    "agent's response."
)
TETHER_SEND: dict[str, Any] = {
    "type": "object",
    "properties": {
        "instance": {"type": "string", "description": "Instance handle or ID"},
        "text": {"type": "string", "description": "Message text to send to the agent"},
        "session_id": {
            "type": "string",
            "description": "Session identifier for conversation threading. Use a stable ID per conversation "
            "(e.g. 'debug-session-1'). Defaults to 'default'.",
        },
    },
    "required": ["instance", "text"],
}

TETHER_READ_DESCRIPTION = (
    "Read response frames from an agent inside a VM instance. Returns new frames since the given cursor. "
    "Supports long-polling: set wait_ms to block until frames arrive or timeout. Call in a loop for "
    "streaming-like behavior."
)
TETHER_READ: dict[str, Any] = {
    "type": "object",
    "properties": {
        "instance": {"type": "string", "description": "Instance handle or ID"},
        "session_id": {
            "type": "string",
            "description": "Session ID (must match the one used in tether_send). Defaults to 'default'.",
        },
        "after_seq": {
            "type": "integer",
            "description": "Return frames with seq > this value. Use next_seq from previous tether_read "
            "response. Start with 0.",
        },
        "limit": {"type": "integer", "description": "Max frames to return. Default: 50, max: 200."},
        "wait_ms": {
            "type": "integer",
            "description": "Long-poll timeout in milliseconds. If no frames available, block up to this "
            "duration. 0 = return immediately. Default: 0, max: 30000.",
        },
        "types": {
            "type": "array",
            "items": {"type": "string"},
            "description": "Filter by frame types. Example: ['assistant.delta', 'assistant.done']. "
            "Default: all types.",
        },
        "reply_to_msg_id": {
            "type": "string",
            "description": "Filter frames that are replies to a specific msg_id. Useful for isolating one "
            "task's response in a multi-task session.",
        },
    },
    "required": ["instance"],
}

#: Why a `wait` returned: the turn ended, it needs the caller (a caller tool request, an approval),
#: it failed, the wait ran out while it goes on, or (`session_message`) nothing can run it yet.
STOP_REASONS = ["end_turn", "requires_action", "requires_approval", "error", "timeout", "no_guest"]

# Result schemas: the tool descriptors of the server's own tools carry them.
_FRAMES_RESULT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "frames": {"type": "array", "items": FRAME_SCHEMA},
        "next_seq": {"type": "integer", "minimum": 0},
        "timed_out": {"type": "boolean"},
    },
    "required": ["frames", "next_seq", "timed_out"],
}
RESULT_SCHEMAS: dict[str, dict[str, Any]] = {
    "session_message": {
        "type": "object",
        "properties": {
            "session_id": {"type": "string"}, "instance": {"type": "string"}, "msg_id": {"type": "string"},
            "ingress_seq": {"type": "integer"},
            "owner_key": {"type": "string"},
            "notice": {"type": "string"},
            "stop_reason": {"enum": STOP_REASONS},
            "text": {"type": "string"},
            "pending": {"type": "array", "items": {"type": "object"}},
            "approval_requests": {"type": "array", "items": {"type": "object"}},
        },
        "required": ["session_id", "instance", "msg_id", "ingress_seq"],
    },
    "caller_tool_response": {
        "type": "object",
        "properties": {
            "resolved": {"type": "boolean"}, "not_pending": {"type": "string"}, "msg_id": {"type": "string"},
            "stop_reason": {"enum": STOP_REASONS},
            "text": {"type": "string"},
            "pending": {"type": "array", "items": {"type": "object"}},
            "approval_requests": {"type": "array", "items": {"type": "object"}},
        },
        "required": ["resolved"],
    },
    "caller_tool_progress": {
        "type": "object", "properties": {"forwarded": {"type": "boolean"}}, "required": ["forwarded"],
    },
    "approval_response": {
        "type": "object",
        "properties": {
            "resolved": {"const": True}, "already_resolved": {"type": "boolean"}, "msg_id": {"type": "string"},
            "stop_reason": {"enum": STOP_REASONS},
            "text": {"type": "string"},
            "pending": {"type": "array", "items": {"type": "object"}},
            "approval_requests": {"type": "array", "items": {"type": "object"}},
        },
        "required": ["resolved"],
    },
    "session_events": _FRAMES_RESULT,
    "tether_send": {
        "type": "object",
        "properties": {"msg_id": {"type": "string"}, "session_id": {"type": "string"}, "ingress_seq": {"type": "integer"}},
        "required": ["msg_id", "session_id", "ingress_seq"],
    },
    "tether_read": _FRAMES_RESULT,
}
SAFETY: dict[str, str] = {
    "session_message": "appends a user.message to the instance's log and may wake the instance",
    "caller_tool_response": "resolves one pending caller tool request of your own session",
    "caller_tool_progress": "tells the agent how far one pending caller tool request of your own session has come",
    "approval_response": "decides pending approval requests of your own session: an approval lets the agent's call run",
    "session_events": "read-only",
    "tether_send": "appends a user.message on channel host and may wake the instance",
    "tether_read": "read-only",
}
