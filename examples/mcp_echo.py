#!/usr/bin/env python3
"""The reference endpoint of the action contract (docs/TOOLSETS.md): one tool, ``echo_external``.

A command endpoint (``MCP_ENDPOINT``) reads one JSON request per line on stdin, until EOF,
and writes one JSON response line to stdout for each, so it works both for a single
request and as a long-lived pipe:

    echo '{"action":"list_tools"}' | ./examples/mcp_echo.sh
    echo '{"action":"describe_tool","tool":"echo_external"}' | ./examples/mcp_echo.sh
    echo '{"action":"call_tool","tool":"echo_external","arguments":{"message":"hi"}}' | ./examples/mcp_echo.sh

Every failure is answered with the error envelope
``{"type":"error","error":{"name":"mcp_echo","category":"usage","message":…}}``; blank lines
are skipped. Standard library only, and deliberately independent of Oubliette's
``protocol`` package: it stands for a third party's endpoint.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

NAME = "mcp_echo"
ACTIONS = ("list_tools", "describe_tool", "call_tool")

ECHO_EXTERNAL: dict[str, Any] = {
    "name": "echo_external",
    "description": "Echo a message back from outside the sandbox",
    "command": "echo_external --message TEXT",
    "origin": "remote",
    "safety": "read-only; no side effects",
    "input_schema": {
        "type": "object",
        "properties": {"message": {"type": "string"}},
        "required": ["message"],
        "additionalProperties": False,
    },
    "result_schema": {
        "type": "object",
        "properties": {"echo": {"type": "string"}},
        "required": ["echo"],
    },
}

TOOLS: dict[str, dict[str, Any]] = {ECHO_EXTERNAL["name"]: ECHO_EXTERNAL}


class UsageError(Exception):
    """A bad request; answered with the error envelope."""


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def echo_external(arguments: dict[str, Any]) -> dict[str, Any]:
    """The tool itself: ``{message}`` -> ``{echo}``."""
    extra = sorted(set(arguments) - {"message"})
    if extra:
        raise UsageError(f"echo_external: unexpected argument(s) {', '.join(map(repr, extra))}")
    if "message" not in arguments:
        raise UsageError("echo_external needs 'message', a string")
    message = arguments["message"]
    if not isinstance(message, str):
        raise UsageError(f"echo_external 'message' must be a string, got {_json_type(message)}")
    return {"echo": message}


def _tool(request: dict[str, Any], action: str) -> dict[str, Any]:
    tool = request.get("tool")
    if not isinstance(tool, str) or not tool:
        raise UsageError(f"{action} needs 'tool', a non-empty string")
    if tool not in TOOLS:
        raise UsageError(f"unknown tool {tool!r} (this endpoint has: {', '.join(TOOLS)})")
    return TOOLS[tool]


def handle(line: bytes) -> dict[str, Any]:
    """Answer one request line."""
    try:
        request = json.loads(line, parse_constant=_refuse_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise UsageError(f"request is not valid JSON: {exc}") from None
    if not isinstance(request, dict):
        raise UsageError(f"request must be a JSON object, got {_json_type(request)}")
    action = request.get("action")
    if action is None:
        raise UsageError(f"request has no 'action' (one of {', '.join(ACTIONS)})")
    if action == "list_tools":
        return {"type": "result", "tools": list(TOOLS.values())}
    if action == "describe_tool":
        return {"type": "result", "tool": _tool(request, action)}
    if action == "call_tool":
        tool = _tool(request, action)
        arguments = request.get("arguments")
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            raise UsageError(f"call_tool 'arguments' must be a JSON object, got {_json_type(arguments)}")
        return {"type": "result", "tool": tool["name"], "result": echo_external(arguments)}
    raise UsageError(f"unknown action {action!r} (expected one of {', '.join(ACTIONS)})")


def respond(line: bytes) -> dict[str, Any]:
    """The response object for one request line, error envelope included."""
    try:
        return handle(line)
    except UsageError as exc:
        return {"type": "error", "error": {"name": NAME, "category": "usage", "message": str(exc)}}


def main(argv: list[str]) -> int:
    if argv:
        if argv[0] in ("-h", "--help"):
            print(__doc__.strip())
            return 0
        print(f"usage: {NAME} (reads JSON requests on stdin; takes no arguments)", file=sys.stderr)
        return 2
    out = sys.stdout.buffer  # UTF-8 whatever the locale
    try:
        for line in sys.stdin.buffer:
            if not line.strip():
                continue
            answer = json.dumps(respond(line), separators=(",", ":"), ensure_ascii=False)
            out.write(answer.encode("utf-8") + b"\n")
            out.flush()  # one answer per request, at once: the pipe may be long-lived
    except BrokenPipeError:
        # The reader went away: stop quietly (and keep Python's exit-time flush from failing).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
