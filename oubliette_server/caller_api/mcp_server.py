"""The caller-facing MCP server object, shared by the stdio and Streamable HTTP transports."""

from __future__ import annotations

from typing import Any, Callable

import mcp_types as types
from mcp.server import Server
from mcp.server.lowlevel.server import NotificationOptions
from mcp.server.models import InitializationOptions
from mcp.server.subscriptions import InMemorySubscriptionBus, ListenHandler

from ..callers import CallerConnection
from .tools import CallerTools

ResolveCaller = Callable[[Any, "dict[str, Any] | None"], "CallerConnection | None"]
"""`(ctx, tool arguments or None) -> caller`: who sends this request (docs/SECURITY.md,
"Callers and sessions"); with arguments None (tools/list) it may answer None."""
ReleaseCaller = Callable[[CallerConnection], object]


def build_caller_server(
    tools: CallerTools, resolve_caller: ResolveCaller, release_caller: ReleaseCaller = lambda caller: None,
) -> Server:
    """An MCP server whose tool calls go to `tools`, with callers resolved per request.

    `release_caller(caller)` runs after each tool call (a transport that makes callers per
    request forgets the ones that own nothing).
    """

    async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        resolve_caller(ctx, None)
        return types.ListToolsResult(tools=[tool for tool, _ in tools.tools.values()])

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        arguments = dict(params.arguments or {})
        caller = resolve_caller(ctx, arguments)
        assert caller is not None
        try:
            return await tools.call(ctx, caller, params.name, arguments)
        finally:
            release_caller(caller)

    return CallerMcpServer(
        "oubliette-server", version="0.1.0", on_list_tools=list_tools, on_call_tool=call_tool,
        # Served so 2026-07-28 callers see tools.listChanged too (as handshake-era ones do).
        on_subscriptions_listen=ListenHandler(InMemorySubscriptionBus()),
    )


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


