"""Typed params and results of every relay method.

These are plain attrs classes so both programs share one definition of each shape: a field's
type, whether it is required and its bounds (`bounded`) are written here once.
:mod:`protocol.convert` turns them into and out of JSON-ready dicts, and
:mod:`protocol.schemas` derives from them the JSON Schemas that check untrusted input.
The tether frame is :mod:`protocol.frames`; tool descriptors are :mod:`protocol.descriptors`.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import attrs

from .descriptors import ToolDescriptor
from .frames import Frame, SessionRef
from .schema_parts import NON_EMPTY, SEQ, TOOL_NAME, bounded

__all__ = [
    "PROTOCOL_VERSION",
    "APPEND_ID_FEATURE",
    "APPEND_ID_RULE",
    "server_features",
    "is_append_id",
    "CALLER_ID_SCHEMA",
    "HELLO",
    "CALLER_TOOLS_CONFIG",
    "CALLER_TOOL",
    "CANCEL",
    "USER_MESSAGE",
    "ACK",
    "APPEND_FRAME",
    "TOOLSETS_CONFIG",
    "TOOLSET_CALL",
    "TOOL_SEPARATORS",
    "APPROVAL",
    "PROGRESS",
    "METHODS",
    "ROLE_CLIENT",
    "ROLE_GUEST",
    "ROLES",
    "Hello",
    "HelloResult",
    "CallerToolSpec",
    "CallerToolsConfig",
    "CallerToolCall",
    "CallerToolResult",
    "Cancel",
    "ToolsetToolSpec",
    "UnavailableToolset",
    "ToolsetsConfig",
    "ToolsetCall",
    "ToolsetCallResult",
    "AgentApproval",
    "AgentApprovalResult",
    "Progress",
    "UserMessageDelivery",
    "Ack",
    "AppendFrame",
    "AppendFrameResult",
    "PARAMS_TYPES",
    "RESULT_TYPES",
]

#: The value of ``hello.protocol`` this package speaks.
PROTOCOL_VERSION = "oubliette-relay/1"

# Method names.
HELLO = "hello"  # request, client/guest -> server, first message on a connection
CALLER_TOOLS_CONFIG = "caller_tools_config"  # notification, server -> client
CALLER_TOOL = "caller_tool"  # request, client -> server
CANCEL = "cancel"  # notification, either way
USER_MESSAGE = "user_message"  # notification, server -> guest
ACK = "ack"  # notification, guest -> server
APPEND_FRAME = "append_frame"  # request, guest -> server
TOOLSETS_CONFIG = "toolsets_config"  # notification, server -> client
TOOLSET_CALL = "toolset_call"  # request, client -> server
APPROVAL = "approval"  # request, client -> server: the agent asks the session's caller to allow an action
PROGRESS = "progress"  # notification, server -> client: progress of a request the client has in flight

#: Every method of the protocol.
METHODS: tuple[str, ...] = (
    HELLO,
    CALLER_TOOLS_CONFIG,
    CALLER_TOOL,
    CANCEL,
    USER_MESSAGE,
    ACK,
    APPEND_FRAME,
    TOOLSETS_CONFIG,
    TOOLSET_CALL,
    APPROVAL,
    PROGRESS,
)

#: The `hello` result's `features` entry of a server that stores a guest's `append_frame` once
#: per `append_id` (docs/PROTOCOL.md, "Exactly-once appends"); a guest sends `append_id` only then.
APPEND_ID_FEATURE = "append_id"
#: What an `append_id` may be, as a regular expression to match in full (`re.fullmatch`): short,
#: and of characters every store keeps as they are (the sandbox chooses it).
APPEND_ID_RULE = r"[A-Za-z0-9_-]{1,64}"
_APPEND_ID_RE = re.compile(APPEND_ID_RULE)


def is_append_id(value: Any) -> bool:
    """Whether `value` is an `append_id` (`APPEND_ID_RULE` in full: Python's `$` would also
    match before a final newline, which the JSON Schema's `^…$` lets through here)."""
    return isinstance(value, str) and _APPEND_ID_RE.fullmatch(value) is not None

#: A caller id: its tools are published as ``{caller_id}_{tool}``, so it keeps to the
#: characters every host accepts in a tool name.
CALLER_ID_SCHEMA: dict[str, Any] = {"type": "string", "pattern": r"^[A-Za-z0-9_-]{1,32}$"}

# Bounds of fields that recur.
_POSITIVE = {"minimum": 1}  # a duration in milliseconds
_POSITIVE_OR_ABSENT = {"type": "integer", "minimum": 1}  # the same, never sent as null
_PROGRESS_REF = {"minLength": 1, "maxLength": 128}  # names one request in flight in `progress`

ROLE_CLIENT = "client"
ROLE_GUEST = "guest"
ROLES: tuple[str, ...] = (ROLE_CLIENT, ROLE_GUEST)

def _default_input_schema() -> dict[str, Any]:
    return {"type": "object"}


# --- handshake -------------------------------------------------------------------------


@attrs.define(frozen=True, kw_only=True)
class Hello:
    """``hello`` params: who is connecting, for which instance, proven by a token."""

    wire_label: ClassVar[str] = "hello params"

    protocol: str = bounded(NON_EMPTY)
    role: str = bounded({"enum": list(ROLES)})
    instance: str = bounded(NON_EMPTY)
    token: str
    session: str | None = None


@attrs.define(frozen=True, kw_only=True)
class HelloResult:
    """``hello`` result: the server accepts the connection and echoes its binding."""

    wire_label: ClassVar[str] = "hello result"

    protocol: str = bounded(NON_EMPTY)
    server_version: str
    instance: str = bounded(NON_EMPTY)
    session: str | None = None
    features: list[str] = bounded({"maxItems": 64, "items": {"type": "string", "maxLength": 64}}, factory=list)  # what this server does beyond the protocol's base


def server_features(result: Any) -> frozenset[str]:
    """The `features` a `hello` result lists (none from an older server, or from a malformed
    result: a requester never validates a result, so this reads it defensively)."""
    features = result.get("features") if isinstance(result, dict) else None
    if not isinstance(features, list):
        return frozenset()
    return frozenset(f for f in features if isinstance(f, str))


# --- caller tools ----------------------------------------------------------------------


@attrs.define(frozen=True, kw_only=True)
class CallerToolSpec:
    """One tool a caller offers to the agent."""

    wire_label: ClassVar[str] = "caller tool spec"

    name: str = bounded(TOOL_NAME)
    description: str = ""
    inputSchema: dict[str, Any] = attrs.field(factory=_default_input_schema)
    requires_approval: bool = False
    timeout_ms: int | None = bounded(_POSITIVE_OR_ABSENT, default=None)
    resultSchema: dict[str, Any] | None = None  # when given, the caller's result must match it
    approval_timeout_ms: int | None = bounded(_POSITIVE_OR_ABSENT, default=None)  # with requires_approval: how long a decision may take


@attrs.define(frozen=True, kw_only=True)
class CallerToolsConfig:
    """``caller_tools_config`` params: the complete tool set of one caller (replaces any earlier)."""

    wire_label: ClassVar[str] = "caller_tools_config params"

    session_id: str = bounded(NON_EMPTY)
    caller_id: str = bounded(CALLER_ID_SCHEMA)
    tools: list[CallerToolSpec]


@attrs.define(frozen=True, kw_only=True)
class CallerToolCall:
    """``caller_tool`` params: the agent calls a caller's tool through the client."""

    wire_label: ClassVar[str] = "caller_tool params"

    tool: str = bounded(NON_EMPTY)
    arguments: dict[str, Any] = attrs.field(factory=dict)
    caller_id: str | None = None
    progress_ref: str | None = bounded(_PROGRESS_REF, default=None)  # names this call in the server's `progress` notifications
    _meta: dict[str, Any] | None = None  # W3C trace context (`traceparent`, `tracestate`) of the client's span


@attrs.define(frozen=True, kw_only=True)
class CallerToolResult:
    """``caller_tool`` result: wraps whatever JSON value the caller answered with."""

    wire_label: ClassVar[str] = "caller_tool result"

    result: Any


@attrs.define(frozen=True, kw_only=True)
class Cancel:
    """``cancel`` params: abandon the request with this id that the sender has in flight."""

    wire_label: ClassVar[str] = "cancel params"

    id: int | str


# --- toolsets -------------------------------------------------------------------------


@attrs.define(frozen=True, kw_only=True)
class ToolsetToolSpec:
    """One host toolset tool as the client publishes it to the agent."""

    wire_label: ClassVar[str] = "toolset tool spec"

    name: str = bounded(NON_EMPTY)  # the published name, e.g. "ext.echo_external"
    toolset: str = bounded(NON_EMPTY)  # the toolset id
    tool: str = bounded(NON_EMPTY)  # the tool's own name inside the toolset
    description: str = ""
    inputSchema: dict[str, Any] = attrs.field(factory=_default_input_schema)
    descriptor: ToolDescriptor | None = None  # its tool descriptor, when the toolset has one
    approval_timeout_ms: int | None = bounded(_POSITIVE, default=None)  # set for a gated tool: how long its approval may take


#: What may stand between a toolset's prefix and its tools' names: the server's `tool_separator`,
#: and an agent's own (`OUBLIETTE_TOOL_SEPARATOR`, for an agent that would rewrite the server's).
TOOL_SEPARATORS = (".", "_", "-", "__")


@attrs.define(frozen=True, kw_only=True)
class UnavailableToolset:
    """A toolset the agent is allowed but that could not start: it has no tools meanwhile, and a
    call of its prefix is answered with `message()`, not as an unknown toolset."""

    wire_label: ClassVar[str] = "unavailable toolset"

    toolset: str = bounded(NON_EMPTY)  # the toolset id
    prefix: str = bounded(NON_EMPTY)
    reason: str  # why it could not start (the server's last attempt)

    def message(self) -> str:
        """The error an agent gets for a call of this toolset's prefix (the client's and the server's)."""
        return (
            f"Toolset unavailable: '{self.prefix}' (toolset '{self.toolset}' is allowed but could not start: "
            f"{self.reason}; the server keeps trying to start it, and its tools appear once it runs)"
        )


@attrs.define(frozen=True, kw_only=True)
class ToolsetsConfig:
    """``toolsets_config`` params: every toolset tool the client may publish (replaces any earlier),
    and the allowed toolsets that could not start."""

    wire_label: ClassVar[str] = "toolsets_config params"

    tools: list[ToolsetToolSpec]
    separator: str = bounded(NON_EMPTY, default=".")
    unavailable: list[UnavailableToolset] | None = bounded({"type": "array"}, default=None)  # omitted when every allowed toolset runs


@attrs.define(frozen=True, kw_only=True)
class ToolsetCall:
    """``toolset_call`` params: the agent calls a toolset tool by its published name."""

    wire_label: ClassVar[str] = "toolset_call params"

    name: str = bounded(NON_EMPTY)
    arguments: dict[str, Any] = attrs.field(factory=dict)
    progress_ref: str | None = bounded(_PROGRESS_REF, default=None)  # names this call in the server's `progress` notifications
    _meta: dict[str, Any] | None = None  # W3C trace context (`traceparent`, `tracestate`) of the client's span


@attrs.define(frozen=True, kw_only=True)
class ToolsetCallResult:
    """``toolset_call`` result: the tool's JSON result and, from an MCP toolset, its content blocks."""

    wire_label: ClassVar[str] = "toolset_call result"

    result: Any = None
    content: list[dict[str, Any]] | None = None


# --- the agent's own actions and progress -------------------------------------------


@attrs.define(frozen=True, kw_only=True)
class AgentApproval:
    """``approval`` params: the agent asks whether it may take one of its own actions (a permission prompt)."""

    wire_label: ClassVar[str] = "approval params"

    tool_name: str = bounded(NON_EMPTY)  # the agent's own tool, e.g. "Bash"
    arguments: dict[str, Any] = attrs.field(factory=dict)
    tool_use_id: str | None = None
    progress_ref: str | None = bounded(_PROGRESS_REF, default=None)
    _meta: dict[str, Any] | None = None  # W3C trace context (`traceparent`, `tracestate`) of the client's span


@attrs.define(frozen=True, kw_only=True)
class AgentApprovalResult:
    """``approval`` result: the decision; a denial is a result too (with its reason), not an error."""

    wire_label: ClassVar[str] = "approval result"

    approve: bool
    reason: str | None = None
    updated_arguments: dict[str, Any] | None = None


@attrs.define(frozen=True, kw_only=True)
class Progress:
    """``progress`` params: how far a request the client has in flight has come (a caller's or a toolset's report)."""

    wire_label: ClassVar[str] = "progress params"

    ref: str = bounded(_PROGRESS_REF)  # the request's `progress_ref`
    progress: float
    total: float | None = None
    message: str | None = None


# --- frames ----------------------------------------------------------------------------


@attrs.define(frozen=True, kw_only=True)
class UserMessageDelivery:
    """``user_message`` params: a frame for the guest, pushed after its acknowledged cursor."""

    wire_label: ClassVar[str] = "user_message params"

    frame: Frame


@attrs.define(frozen=True, kw_only=True)
class Ack:
    """``ack`` params: the guest has handled every frame delivered up to ``seq``."""

    wire_label: ClassVar[str] = "ack params"

    seq: int = bounded(SEQ)


@attrs.define(frozen=True, kw_only=True)
class AppendFrame:
    """``append_frame`` params: the guest adds a frame; the server assigns seq, ts and msg_id."""

    wire_label: ClassVar[str] = "append_frame params"

    session: SessionRef
    type: str = bounded(NON_EMPTY)
    payload: dict[str, Any] = attrs.field(factory=dict)
    reply_to: str | None = None
    append_id: str | None = bounded({"pattern": f"^{APPEND_ID_RULE}$"}, default=None)  # chosen once per frame, the same on every resend: stored once


@attrs.define(frozen=True, kw_only=True)
class AppendFrameResult:
    """``append_frame`` result: where the frame landed in the log."""

    wire_label: ClassVar[str] = "append_frame result"

    seq: int = bounded(SEQ)
    msg_id: str = bounded(NON_EMPTY)


#: The params class of each method.
PARAMS_TYPES: dict[str, type[Any]] = {
    HELLO: Hello,
    CALLER_TOOLS_CONFIG: CallerToolsConfig,
    CALLER_TOOL: CallerToolCall,
    CANCEL: Cancel,
    USER_MESSAGE: UserMessageDelivery,
    ACK: Ack,
    APPEND_FRAME: AppendFrame,
    TOOLSETS_CONFIG: ToolsetsConfig,
    TOOLSET_CALL: ToolsetCall,
    APPROVAL: AgentApproval,
    PROGRESS: Progress,
}

#: The result class of each request method (notifications have none).
RESULT_TYPES: dict[str, type[Any]] = {
    HELLO: HelloResult,
    CALLER_TOOL: CallerToolResult,
    APPEND_FRAME: AppendFrameResult,
    TOOLSET_CALL: ToolsetCallResult,
    APPROVAL: AgentApprovalResult,
}
