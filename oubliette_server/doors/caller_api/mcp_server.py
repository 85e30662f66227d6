"""The caller-facing MCP server object, shared by the stdio and Streamable HTTP transports."""

from __future__ import annotations

from typing import Any, Callable

import mcp_types as types
from mcp.server import Server
from mcp.server.lowlevel.server import NotificationOptions
from mcp.server.models import InitializationOptions
from mcp.server.request_state import RequestStateBoundary, RequestStateSecurity
from mcp.server.subscriptions import InMemorySubscriptionBus, ListenHandler

from oubliette_runtime.fast_tool_calls import tool_error
from oubliette_runtime.telemetry import guard_sdk_extraction
from protocol import VERSION, RelayError

from ...core.callers import CallerConnection
from .tools import CallerApi

REQUEST_STATE_TTL = 24 * 3600.0
"""Seconds a 2026-07-28 caller has to retry an `input_required` wait (longer than any wait plus approval)."""
SERVER_NAME = "oubliette-server"

ResolveCaller = Callable[[Any, "dict[str, Any] | None"], "CallerConnection | None"]
"""`(ctx, tool arguments or None) -> caller`: who sends this request (docs/SECURITY.md,
"Callers and sessions"); with arguments None (tools/list) it may answer None."""
ReleaseCaller = Callable[[CallerConnection], object]


def build_caller_server(
    tools: CallerApi, resolve_caller: ResolveCaller, release_caller: ReleaseCaller = lambda caller: None,
) -> Server:
    """An MCP server whose tool calls go to `tools`, with callers resolved per request.

    `release_caller(caller)` runs after each tool call (a transport that makes callers per
    request forgets the ones that own nothing).
    """
    guard_sdk_extraction()  # a caller's malformed `_meta.baggage` must not fail its request

    async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        resolve_caller(ctx, None)
        return types.ListToolsResult(tools=[tool for tool, _ in tools.tools.values()])

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult | types.InputRequiredResult:
        resume = (params.request_state, params.input_responses) if params.request_state else None
        return await call_as_caller(tools, resolve_caller, release_caller, ctx, params.name, dict(params.arguments or {}), resume)

    async def set_log_level(ctx: Any, params: types.SetLevelRequestParams) -> types.EmptyResult:
        caller = resolve_caller(ctx, None)
        if caller is not None:  # a 2026-07-28 request has no caller of its own to keep a level for
            caller.set_log_level(params.level)
        return types.EmptyResult()

    def input_schema(name: str) -> dict[str, Any] | None:
        """A tool's `inputSchema`, for the SDK's `Mcp-Param-*` header check of a 2026-07-28 call:
        without it the SDK runs a whole `tools/list` (every schema dumped) for each call."""
        entry = tools.tools.get(name)
        return None if entry is None else entry[0].input_schema

    server = CallerMcpServer(
        SERVER_NAME, version=VERSION, on_list_tools=list_tools, on_call_tool=call_tool,
        get_tool_input_schema=input_schema,
        # Served so 2026-07-28 callers see tools.listChanged too (as handshake-era ones do).
        on_subscriptions_listen=ListenHandler(InMemorySubscriptionBus()),
    )
    # Events are `notifications/message` (handshake era): the logging capability is declared and
    # a caller's level honoured. Registered directly: the constructor's `on_set_logging_level`
    # warns that logging is deprecated in 2026-07-28, where `_meta` log levels replace it.
    server.add_request_handler("logging/setLevel", types.SetLevelRequestParams, set_log_level)
    # 2026-07-28 `input_required` waits (approvals put to a person): the SDK seals the state we
    # hand out and checks it on the retry (bound to the tool, its arguments and this server).
    security = RequestStateSecurity.ephemeral(ttl=REQUEST_STATE_TTL)
    server.middleware.append(RequestStateBoundary(security, default_audience=SERVER_NAME))
    return server


async def call_as_caller(
    tools: CallerApi, resolve_caller: ResolveCaller, release_caller: ReleaseCaller, ctx: Any, name: str,
    arguments: dict[str, Any], resume: tuple[str, dict[str, Any] | None] | None = None,
) -> types.CallToolResult | types.InputRequiredResult:
    """One caller tool call as the transport's caller: the one home of what the SDK's `tools/call`
    handler and the HTTP fast path (`http_fast.py`) both run."""
    try:
        caller = resolve_caller(ctx, arguments)
    except RelayError as err:  # a caller the transport refuses (another principal's MCP session)
        return tool_error(err.message)
    assert caller is not None
    try:
        return await tools.call(ctx, caller, name, arguments, resume)
    finally:
        release_caller(caller)


class CallerMcpServer(Server):
    """Advertises `tools.listChanged` on every transport (the HTTP app asks with no options)."""

    def create_initialization_options(
        self, notification_options: NotificationOptions | None = None, *args: Any, **kwargs: Any
    ) -> InitializationOptions:
        """The SDK's options, with `tools.listChanged` advertised when the caller gives no notification options."""
        return super().create_initialization_options(
            notification_options or NotificationOptions(tools_changed=True), *args, **kwargs
        )


def initialization_options(server: Server) -> InitializationOptions:
    """The server's initialization options (with `tools.listChanged`), as stdio serving needs them."""
    return server.create_initialization_options()


