"""Tool descriptors and the ``list_tools`` / ``describe_tool`` / ``call_tool`` action contract.

This is the machine-checkable tool shape of the action contract (docs/TOOLSETS.md). A *command endpoint* (``MCP_ENDPOINT``, e.g.
``examples/mcp_echo.sh``) reads one JSON request per line on stdin and answers each with one
JSON response line:

- ``{"action": "list_tools"}`` -> ``{"type": "result", "tools": [<descriptor>, ...]}``
- ``{"action": "describe_tool", "tool": NAME}`` -> ``{"type": "result", "tool": <descriptor>}``
- ``{"action": "call_tool", "tool": NAME, "arguments": {...}}`` ->
  ``{"type": "result", "tool": NAME, "result": <tool-defined value>}``

and any failure as the error envelope ``{"type": "error", "error": {name, category, message}}``
(:class:`ActionError`). Requests are checked *before* anything is sent
(:func:`parse_action_request`: the request and its ``arguments`` must be JSON objects), and
responses from a remote endpoint are checked before they are believed
(:func:`parse_action_response`). The JSON Schemas ``tool_descriptor``, ``action_request`` and
``action_response`` (:data:`TOOL_DESCRIPTOR_SCHEMA`, :data:`ACTION_REQUEST_SCHEMA`,
:data:`ACTION_RESPONSE_SCHEMA`, collected in :data:`protocol.schemas.SCHEMAS`) state the same
shapes, next to the model. :func:`build_descriptor` is the one way the programs describe a
tool they publish.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import attrs

from .errors import NOT_FOUND, TOOL_ERROR, RelayError, error_category
from .schema_check import first_error, protocol_validator, require_valid
from .schema_parts import NON_EMPTY, OPT_OBJECT, STRING, bounded, obj, schema_of

__all__ = [
    "DESCRIPTOR_META_KEY",
    "ACTIONS",
    "LIST_TOOLS",
    "DESCRIBE_TOOL",
    "CALL_TOOL",
    "ORIGINS",
    "TOOL_DESCRIPTOR_SCHEMA",
    "ACTION_REQUEST_SCHEMA",
    "ACTION_RESPONSE_SCHEMA",
    "ToolDescriptor",
    "build_descriptor",
    "ActionError",
    "ActionRequest",
    "parse_action_request",
    "parse_action_line",
    "list_tools_response",
    "describe_tool_response",
    "call_tool_response",
    "parse_action_response",
    "parse_action_response_line",
]

#: MCP `tools/list` entries carry their descriptor in `_meta` under this key (server and client).
DESCRIPTOR_META_KEY = "oubliette/descriptor"

LIST_TOOLS = "list_tools"
DESCRIBE_TOOL = "describe_tool"
CALL_TOOL = "call_tool"

#: The values of a request's ``action`` discriminator.
ACTIONS: tuple[str, ...] = (LIST_TOOLS, DESCRIBE_TOOL, CALL_TOOL)

#: The values of ``ToolDescriptor.origin``: a bundled handler, or an external endpoint.
ORIGINS: tuple[str, ...] = ("local", "remote")

_ACTION_LIST = ", ".join(ACTIONS)


def _json_type(value: Any) -> str:
    """`convert.json_type_name`, imported when an error needs it: `protocol.convert` (cattrs) is
    loaded on first use, not with this module (oubliette-client's cold start)."""
    from .convert import json_type_name

    return json_type_name(value)


# --- descriptors -----------------------------------------------------------------------------


@functools.cache
def _descriptor_validator() -> Any:
    """The ``tool_descriptor`` validator, compiled when first needed (not at import: cold start)."""
    return protocol_validator(TOOL_DESCRIPTOR_SCHEMA)


@attrs.define(frozen=True, kw_only=True)
class ToolDescriptor:
    """The description of one tool (its tool descriptor), as ``list_tools`` and ``describe_tool`` return it."""

    wire_label: ClassVar[str] = "tool descriptor"

    name: str = bounded(NON_EMPTY)  # registry identifier
    description: str  # human-readable summary
    command: str  # indicative CLI syntax, e.g. "echo_external --message TEXT"
    origin: str = bounded({"enum": list(ORIGINS)})  # "local" (bundled handler) or "remote" (external endpoint)
    safety: str  # safety or guardrails summary
    input_schema: dict[str, Any]  # JSON Schema of the arguments
    result_schema: dict[str, Any]  # JSON Schema of the result

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of this descriptor (all seven members)."""
        from .convert import unstructure

        return unstructure(self)

    @classmethod
    def from_dict(cls, data: Any) -> ToolDescriptor:
        """Check ``data`` against the ``tool_descriptor`` schema and build a descriptor.

        Raises ``RelayError(INVALID_PARAMS)`` naming the problem.
        """
        require_valid(_descriptor_validator(), data, "tool descriptor")
        from .convert import build_valid

        return build_valid(data, cls)


#: The JSON Schema of a :class:`ToolDescriptor` (derived from the class).
TOOL_DESCRIPTOR_SCHEMA: dict[str, Any] = schema_of(ToolDescriptor)


def _client_command(name: str) -> str:
    """``oubliette-client tools call NAME '<arguments as JSON>'``: how a sandbox calls ``name``."""
    return f"oubliette-client tools call {name} '<arguments as JSON>'"


def build_descriptor(
    name: str,
    *,
    description: str,
    safety: str,
    input_schema: dict[str, Any],
    result_schema: dict[str, Any] | None = None,
    origin: str = "remote",
    command: str | None = None,
) -> ToolDescriptor:
    """The descriptor of a tool the programs publish; the one place one is made.

    ``result_schema`` ``None`` means "any JSON" (``{}``); ``command`` defaults to the
    ``oubliette-client tools call`` line for ``name``. Raises ``ValueError`` for an origin
    not in :data:`ORIGINS` (a bug in the caller).
    """
    if origin not in ORIGINS:
        raise ValueError(f"origin must be one of {ORIGINS}, not {origin!r}")
    return ToolDescriptor(
        name=name,
        description=description,
        command=command if command is not None else _client_command(name),
        origin=origin,
        safety=safety,
        input_schema=input_schema,
        result_schema=result_schema if result_schema is not None else {},
    )


def _descriptor_dict(tool: ToolDescriptor | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(tool, ToolDescriptor):
        return tool.to_dict()
    if isinstance(tool, Mapping):
        return dict(tool)
    raise TypeError(f"a tool descriptor must be a ToolDescriptor or a dict, not {type(tool).__name__}")


# --- errors ---------------------------------------------------------------------------------


class ActionError(Exception):
    """A failure in the action contract, sent as ``{"type": "error", "error": {...}}``.

    ``name`` identifies the component that emits it (``"mcp_echo"``, ``"oubliette-client"``),
    ``category`` classifies it (see :data:`protocol.errors.CATEGORIES`) and ``message`` says what happened.
    """

    name: str
    category: str
    message: str

    def __init__(self, name: str, category: str, message: str) -> None:
        # Passing all three to Exception keeps pickling and copying working.
        super().__init__(name, category, message)
        self.name = name
        self.category = category
        self.message = message

    def envelope(self) -> dict[str, Any]:
        """The error envelope ``{"type": "error", "error": {name, category, message}}``."""
        return {
            "type": "error",
            "error": {"name": self.name, "category": self.category, "message": self.message},
        }

    def to_relay_error(self) -> RelayError:
        """The relay error for this failure: ``not_found`` is ``-32005``, anything else ``-32004``.

        ``data`` keeps the envelope's ``name`` and ``category``.
        """
        code = NOT_FOUND if self.category == "not_found" else TOOL_ERROR
        return RelayError(code, self.message, {"name": self.name, "category": self.category})

    @classmethod
    def from_relay_error(cls, err: RelayError, *, component: str) -> ActionError:
        """The action error for a relay error; its category comes from the one table,
        :data:`protocol.errors.CATEGORY_BY_CODE`."""
        return cls(component, error_category(err.code), err.message)

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.category!r}, {self.message!r})"


# --- requests -------------------------------------------------------------------------------

# ``tool`` and ``arguments`` are checked only for the actions that use them, as
# :func:`parse_action_request` does; other members are ignored.
#: The JSON Schema of an action request.
ACTION_REQUEST_SCHEMA: dict[str, Any] = obj(
    ["action"],
    {"action": {"enum": list(ACTIONS)}, "tool": {}, "arguments": {}},
    allOf=[
        {
            "if": {"required": ["action"], "properties": {"action": {"enum": [DESCRIBE_TOOL, CALL_TOOL]}}},
            "then": {"required": ["tool"], "properties": {"tool": NON_EMPTY}},
        },
        {
            "if": {"required": ["action"], "properties": {"action": {"const": CALL_TOOL}}},
            "then": {"properties": {"arguments": OPT_OBJECT}},
        },
    ],
)


@attrs.define(frozen=True)
class ActionRequest:
    """One checked request: ``tool`` is set for describe_tool and call_tool, ``arguments``
    (a dict, ``{}`` when absent) for call_tool only."""

    action: str
    tool: str | None = None
    arguments: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The request object as sent to an endpoint (members that are ``None`` left out)."""
        out: dict[str, Any] = {"action": self.action}
        if self.tool is not None:
            out["tool"] = self.tool
        if self.arguments is not None:
            out["arguments"] = dict(self.arguments)
        return out


def parse_action_request(obj: Any, *, component: str) -> ActionRequest:
    """Check a decoded request, or raise ``ActionError(component, "usage", …)`` saying why.

    The request must be a JSON object with a known ``action``; ``describe_tool`` and
    ``call_tool`` need ``tool``, a non-empty string; ``call_tool``'s ``arguments`` must be a
    JSON object (absent or ``null`` means ``{}``). Unknown members are ignored.
    """

    def usage(message: str) -> ActionError:
        return ActionError(component, "usage", message)

    if not isinstance(obj, dict):
        raise usage(f"request must be a JSON object, got {_json_type(obj)}")
    if "action" not in obj:
        raise usage(f"request has no 'action' (one of {_ACTION_LIST})")
    action = obj["action"]
    if not isinstance(action, str):
        raise usage(f"'action' must be a string (one of {_ACTION_LIST}), got {_json_type(action)}")
    if action not in ACTIONS:
        raise usage(f"unknown action {action!r} (expected one of {_ACTION_LIST})")
    if action == LIST_TOOLS:
        return ActionRequest(action)

    tool = obj.get("tool")
    if tool is None:
        raise usage(f"{action} needs 'tool', the name of a tool")
    if not isinstance(tool, str) or not tool:
        got = "an empty string" if tool == "" else _json_type(tool)
        raise usage(f"{action} 'tool' must be a non-empty string, got {got}")
    if action == DESCRIBE_TOOL:
        return ActionRequest(action, tool)

    arguments = obj.get("arguments")
    if arguments is None:
        arguments = {}
    elif not isinstance(arguments, dict):
        raise usage(f"call_tool 'arguments' must be a JSON object, got {_json_type(arguments)}")
    return ActionRequest(action, tool, dict(arguments))


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _loads(line: str | bytes) -> Any:
    return json.loads(line, parse_constant=_refuse_constant)


def parse_action_line(line: str | bytes, *, component: str) -> ActionRequest:
    """Decode one request line (JSON) and check it with :func:`parse_action_request`."""
    try:
        obj = _loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ActionError(component, "usage", f"request is not valid JSON: {exc}") from None
    return parse_action_request(obj, component=component)


# --- responses ------------------------------------------------------------------------------

_ERROR_ENVELOPE = obj(
    ["type", "error"],
    {
        "type": {"const": "error"},
        "error": obj(["name", "category", "message"], {"name": STRING, "category": STRING, "message": STRING}),
    },
)

# One schema per result shape, so a validator (and a reader) can tell them apart.
_ACTION_RESULTS: dict[str, dict[str, Any]] = {
    LIST_TOOLS: obj(
        ["type", "tools"],
        {"type": {"const": "result"}, "tools": {"type": "array", "items": TOOL_DESCRIPTOR_SCHEMA}},
    ),
    DESCRIBE_TOOL: obj(["type", "tool"], {"type": {"const": "result"}, "tool": TOOL_DESCRIPTOR_SCHEMA}),
    CALL_TOOL: obj(["type", "tool", "result"], {"type": {"const": "result"}, "tool": NON_EMPTY, "result": {}}),
}

#: The JSON Schema of an action response (a result of any action, or the error envelope).
ACTION_RESPONSE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["type"],
    "properties": {"type": {"enum": ["result", "error"]}},
    "anyOf": [_ERROR_ENVELOPE, *_ACTION_RESULTS.values()],
}


def list_tools_response(tools: Sequence[ToolDescriptor | Mapping[str, Any]]) -> dict[str, Any]:
    """``{"type": "result", "tools": [<descriptor>, ...]}`` (descriptors or their dicts)."""
    return {"type": "result", "tools": [_descriptor_dict(t) for t in tools]}


def describe_tool_response(tool: ToolDescriptor | Mapping[str, Any]) -> dict[str, Any]:
    """``{"type": "result", "tool": <descriptor>}``."""
    return {"type": "result", "tool": _descriptor_dict(tool)}


def call_tool_response(tool: str, result: Any) -> dict[str, Any]:
    """``{"type": "result", "tool": NAME, "result": <tool-defined value>}``."""
    return {"type": "result", "tool": tool, "result": result}


def _check_descriptor(value: Any, where: str, pipeline: Any) -> None:
    error = first_error(_descriptor_validator(), value)
    if error is not None:
        path = error.json_path.removeprefix("$")
        message = error.message if len(error.message) <= 200 else error.message[:199] + "…"
        raise pipeline(f"response {where}{path} is not a valid tool descriptor: {message}")


def parse_action_response(
    obj: Any,
    *,
    component: str,
    action: str | None = None,
    tool: str | None = None,
) -> dict[str, Any]:
    """Check a response from a remote endpoint and return it.

    A malformed response raises ``ActionError(component, "pipeline", …)``; a well-formed
    error envelope raises ``ActionError`` with *its* name, category and message. With
    ``action`` the result must have that action's shape; with ``tool`` a describe_tool or
    call_tool result must be about that tool.
    """

    def pipeline(message: str) -> ActionError:
        return ActionError(component, "pipeline", message)

    if action is not None and action not in ACTIONS:
        raise ValueError(f"unknown action {action!r}")
    if not isinstance(obj, dict):
        raise pipeline(f"response is not a JSON object (got {_json_type(obj)})")
    kind = obj.get("type")
    if kind == "error":
        err = obj.get("error")
        if not isinstance(err, dict):
            raise pipeline("error response has no 'error' object")
        for key in ("name", "category", "message"):
            if not isinstance(err.get(key), str):
                raise pipeline(f"error response's 'error.{key}' must be a string")
        raise ActionError(err["name"], err["category"], err["message"])
    if kind != "result":
        shown = "missing" if "type" not in obj else repr(obj["type"])
        raise pipeline(f"response 'type' must be \"result\" or \"error\", got {shown}")

    if action is None:
        if "tools" in obj:
            action = LIST_TOOLS
        elif isinstance(obj.get("tool"), dict):
            action = DESCRIBE_TOOL
        elif "result" in obj:
            action = CALL_TOOL
        else:
            raise pipeline("result response has none of 'tools', 'tool' (a descriptor) or 'result'")

    if action == LIST_TOOLS:
        tools = obj.get("tools")
        if not isinstance(tools, list):
            raise pipeline(f"list_tools response 'tools' must be an array, got {_json_type(tools)}")
        for index, item in enumerate(tools):
            _check_descriptor(item, f"'tools[{index}]'", pipeline)
    elif action == DESCRIBE_TOOL:
        if "tool" not in obj:
            raise pipeline("describe_tool response has no 'tool'")
        _check_descriptor(obj["tool"], "'tool'", pipeline)
        if tool is not None and obj["tool"]["name"] != tool:
            raise pipeline(f"describe_tool response is about {obj['tool']['name']!r}, not {tool!r}")
    else:
        name = obj.get("tool")
        if not isinstance(name, str) or not name:
            raise pipeline("call_tool response 'tool' must be a non-empty string")
        if "result" not in obj:
            raise pipeline("call_tool response has no 'result'")
        if tool is not None and name != tool:
            raise pipeline(f"call_tool response is about {name!r}, not {tool!r}")
    return obj


def parse_action_response_line(
    line: str | bytes,
    *,
    component: str,
    action: str | None = None,
    tool: str | None = None,
) -> dict[str, Any]:
    """Decode one response line (JSON) and check it with :func:`parse_action_response`.

    A line that is not JSON is a ``pipeline`` error.
    """
    try:
        obj = _loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ActionError(component, "pipeline", f"response is not valid JSON: {exc}") from None
    return parse_action_response(obj, component=component, action=action, tool=tool)
