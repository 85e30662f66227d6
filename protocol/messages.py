"""Typed params and results of every relay method, and the tether frame model.

These are plain attrs classes so both programs share one definition of each shape;
:mod:`protocol.convert` turns them into and out of JSON-ready dicts, and
:mod:`protocol.schemas` holds the matching JSON Schemas for validating untrusted input.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import attrs

from .descriptors import ToolDescriptor

__all__ = [
    "PROTOCOL_VERSION",
    "HELLO",
    "CALLER_TOOLS_CONFIG",
    "CALLER_TOOL",
    "CANCEL",
    "USER_MESSAGE",
    "ACK",
    "APPEND_FRAME",
    "TOOLSETS_CONFIG",
    "TOOLSET_CALL",
    "METHODS",
    "ROLE_CLIENT",
    "ROLE_GUEST",
    "ROLES",
    "DEFAULT_CHANNEL",
    "FRAME_VERSION",
    "FRAME_TYPES",
    "Hello",
    "HelloResult",
    "CallerToolSpec",
    "CallerToolsConfig",
    "CallerToolCall",
    "CallerToolResult",
    "Cancel",
    "ToolsetToolSpec",
    "ToolsetsConfig",
    "ToolsetCall",
    "ToolsetCallResult",
    "SessionRef",
    "Frame",
    "UserMessageDelivery",
    "Ack",
    "AppendFrame",
    "AppendFrameResult",
    "PARAMS_TYPES",
    "RESULT_TYPES",
    "utc_timestamp",
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
)

ROLE_CLIENT = "client"
ROLE_GUEST = "guest"
ROLES: tuple[str, ...] = (ROLE_CLIENT, ROLE_GUEST)

#: Channel of a session key written without one (``"s-1"`` means ``"mcp:s-1"``).
DEFAULT_CHANNEL = "mcp"
#: Current value of ``Frame.v``.
FRAME_VERSION = 1

#: The frame types named in DESIGN.md; other producers may add more.
FRAME_TYPES: tuple[str, ...] = (
    "user.message",
    "assistant.delta",
    "assistant.done",
    "status.presence",
    "caller_tool_request",
    "caller_tool_result",
    "caller_tool_cancelled",
    "approval_request",
    "approval_resolved",
    "session.error",
)


def _default_input_schema() -> dict[str, Any]:
    return {"type": "object"}


# --- handshake -------------------------------------------------------------------------


@attrs.define(frozen=True, kw_only=True)
class Hello:
    """``hello`` params: who is connecting, for which instance, proven by a token."""

    protocol: str
    role: str  # ROLE_CLIENT or ROLE_GUEST
    instance: str
    token: str
    session: str | None = None


@attrs.define(frozen=True, kw_only=True)
class HelloResult:
    """``hello`` result: the server accepts the connection and echoes its binding."""

    protocol: str
    server_version: str
    instance: str
    session: str | None = None


# --- caller tools ----------------------------------------------------------------------


@attrs.define(frozen=True, kw_only=True)
class CallerToolSpec:
    """One tool a caller offers to the agent."""

    name: str
    description: str = ""
    inputSchema: dict[str, Any] = attrs.field(factory=_default_input_schema)
    requires_approval: bool = False
    timeout_ms: int | None = None
    resultSchema: dict[str, Any] | None = None  # when given, the caller's result must match it


@attrs.define(frozen=True, kw_only=True)
class CallerToolsConfig:
    """``caller_tools_config`` params: the complete tool set of one caller (replaces any earlier)."""

    session_id: str
    caller_id: str
    tools: list[CallerToolSpec]


@attrs.define(frozen=True, kw_only=True)
class CallerToolCall:
    """``caller_tool`` params: the agent calls a caller's tool through the client."""

    tool: str
    arguments: dict[str, Any] = attrs.field(factory=dict)
    caller_id: str | None = None


@attrs.define(frozen=True, kw_only=True)
class CallerToolResult:
    """``caller_tool`` result: wraps whatever JSON value the caller answered with."""

    result: Any


@attrs.define(frozen=True, kw_only=True)
class Cancel:
    """``cancel`` params: abandon the request with this id that the sender has in flight."""

    id: int | str


# --- toolsets -------------------------------------------------------------------------


@attrs.define(frozen=True, kw_only=True)
class ToolsetToolSpec:
    """One host toolset tool as the client publishes it to the agent."""

    name: str  # the published name, e.g. "ext.echo_external"
    toolset: str  # the toolset id
    tool: str  # the tool's own name inside the toolset
    description: str = ""
    inputSchema: dict[str, Any] = attrs.field(factory=_default_input_schema)
    descriptor: ToolDescriptor | None = None  # seed 001 descriptor, when the toolset has one


@attrs.define(frozen=True, kw_only=True)
class ToolsetsConfig:
    """``toolsets_config`` params: every toolset tool the client may publish (replaces any earlier)."""

    tools: list[ToolsetToolSpec]
    separator: str = "."


@attrs.define(frozen=True, kw_only=True)
class ToolsetCall:
    """``toolset_call`` params: the agent calls a toolset tool by its published name."""

    name: str
    arguments: dict[str, Any] = attrs.field(factory=dict)


@attrs.define(frozen=True, kw_only=True)
class ToolsetCallResult:
    """``toolset_call`` result: the tool's JSON result and, from an MCP toolset, its content blocks."""

    result: Any = None
    content: list[dict[str, Any]] | None = None


# --- frames ----------------------------------------------------------------------------


@attrs.define(frozen=True, kw_only=True)
class SessionRef:
    """A session, named by channel and id; keyed ``channel:id`` in maps and logs."""

    channel: str
    id: str

    @property
    def key(self) -> str:
        """The ``channel:id`` key."""
        return f"{self.channel}:{self.id}"

    @classmethod
    def parse_key(cls, key: str) -> SessionRef:
        """Split ``channel:id`` on its first colon; a key without one is in channel ``mcp``."""
        channel, sep, sid = key.partition(":")
        if not sep:
            channel, sid = DEFAULT_CHANNEL, key
        if not channel or not sid:
            raise ValueError(f"invalid session key {key!r}: want 'channel:id'")
        return cls(channel=channel, id=sid)

    def __str__(self) -> str:
        return self.key


@attrs.define(frozen=True, kw_only=True)
class Frame:
    """One record of the tether log; ``seq`` is per instance and strictly increasing."""

    v: int
    seq: int
    ts: str
    instance: str
    session: SessionRef
    type: str
    msg_id: str
    reply_to: str | None = None
    payload: dict[str, Any] = attrs.field(factory=dict)


@attrs.define(frozen=True, kw_only=True)
class UserMessageDelivery:
    """``user_message`` params: a frame for the guest, pushed after its acknowledged cursor."""

    frame: Frame


@attrs.define(frozen=True, kw_only=True)
class Ack:
    """``ack`` params: the guest has handled every frame delivered up to ``seq``."""

    seq: int


@attrs.define(frozen=True, kw_only=True)
class AppendFrame:
    """``append_frame`` params: the guest adds a frame; the server assigns seq, ts and msg_id."""

    session: SessionRef
    type: str
    payload: dict[str, Any] = attrs.field(factory=dict)
    reply_to: str | None = None


@attrs.define(frozen=True, kw_only=True)
class AppendFrameResult:
    """``append_frame`` result: where the frame landed in the log."""

    seq: int
    msg_id: str


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
}

#: The result class of each request method (notifications have none).
RESULT_TYPES: dict[str, type[Any]] = {
    HELLO: HelloResult,
    CALLER_TOOL: CallerToolResult,
    APPEND_FRAME: AppendFrameResult,
    TOOLSET_CALL: ToolsetCallResult,
}


def utc_timestamp(when: datetime | None = None) -> str:
    """ISO-8601 UTC with milliseconds and ``Z`` (``2026-11-22T10:00:00.123Z``), as frames use.

    ``when`` defaults to now; a naive datetime is taken to be UTC.
    """
    if when is None:
        when = datetime.now(timezone.utc)
    elif when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    else:
        when = when.astimezone(timezone.utc)
    return when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{when.microsecond // 1000:03d}Z"
