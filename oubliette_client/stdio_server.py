"""oubliette-client's stdio MCP server: the caller's tools as the agent's native tools.

It connects to the relay before answering `initialize` (bounded by
`connect_wait`), so the first `tools/list` already has the tools. If the relay
is down it still serves MCP: the tools it last knew stay listed and calls say
why they cannot run, while the link reconnects in the background. Every
change of the list is announced in both protocol eras: handshake-era agents
get `notifications/tools/list_changed`, 2026-07-28 agents a
`subscriptions/listen` event.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import mcp_types as types
import trio
from mcp.server import Server
from mcp.server.lowlevel.server import NotificationOptions
from mcp.server.subscriptions import InMemorySubscriptionBus, ListenHandler, ToolsListChanged
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from protocol import CallerToolSpec, RelayError, errors, messages, structure

from .relay_link import RelayLink
from .settings import RelaySettings
from .tool_registry import PublishedTool, ToolRegistry

log = logging.getLogger("oubliette.client")

DEFAULT_CONNECT_WAIT = 3.0


def tool_error(text: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(text=text)], is_error=True)


def relay_error_text(tool: PublishedTool, err: RelayError) -> str:
    if err.code == errors.TIMEOUT:
        return f"{tool.name}: timeout: {err.message}"
    if err.code == errors.PEER_DISCONNECTED:
        return f"{tool.name}: connection error: {err.message}"
    if err.code == errors.TOOL_ERROR:
        return f"{tool.name} failed: {err.message}"
    return f"{tool.name}: {err.message}"


def result_content(result: Any) -> types.CallToolResult:
    """The caller's result as MCP content; structured content when it is an object."""
    text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)
    return types.CallToolResult(
        content=[types.TextContent(text=text)],
        structured_content=result if isinstance(result, dict) else None,
    )


class SandboxToolServer:
    """The MCP server the agent talks to, fed by a `RelayLink`."""

    def __init__(self, settings: RelaySettings, *, connect_wait: float = DEFAULT_CONNECT_WAIT) -> None:
        self.settings = settings
        self.connect_wait = connect_wait
        self.registry = ToolRegistry()
        self._staged: dict[str, list[CallerToolSpec]] | None = None
        self.link = RelayLink(settings, "client", self._on_relay_notification, self._commit_handshake_config)
        self.bus = InMemorySubscriptionBus()
        self._legacy_session: Any = None
        self._unannounced = False
        self.server = Server(
            "oubliette-client", version="0.1.0",
            on_list_tools=self._list_tools, on_call_tool=self._call_tool,
            on_subscriptions_listen=ListenHandler(self.bus),
        )
        # A handshake-era agent may wait for list_changed before it lists anything.
        self.server.add_notification_handler("notifications/initialized", types.NotificationParams, self._initialized)

    # -- relay side ----------------------------------------------------------------------

    async def _on_relay_notification(self, method: str, params: dict[str, Any]) -> None:
        if method == messages.CALLER_TOOLS_CONFIG:
            try:
                config = structure(params, messages.CallerToolsConfig)
            except RelayError as err:
                log.warning("ignoring a bad caller_tools_config: %s", err.message)
                return
            if not self.link.connected:
                # Part of the handshake: the server's full configuration for this connection.
                staged = self._staged if self._staged is not None else {}
                staged[config.caller_id] = config.tools
                self._staged = staged
            else:
                self.registry.set_caller_tools(config.caller_id, config.tools)
        else:
            log.debug("ignoring relay notification %s", method)

    def _commit_handshake_config(self) -> None:
        staged, self._staged = self._staged or {}, None
        self.registry.replace_caller_tools(staged)

    async def _announce_changes(self) -> None:
        seen = self.registry.version
        while True:
            seen = await self.registry.wait_changed(seen)
            log.info("tool list changed: %s", ", ".join(t.name for t in self.registry.tools) or "(none)")
            if self._legacy_session is not None:
                await self._legacy_session.send_tool_list_changed()
            else:
                self._unannounced = True
            await self.bus.publish(ToolsListChanged())

    # -- MCP side ------------------------------------------------------------------------

    def _remember(self, ctx: Any) -> None:
        if ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS:
            self._legacy_session = ctx.session

    async def _initialized(self, ctx: Any, params: Any) -> None:
        self._remember(ctx)
        if self._unannounced and self._legacy_session is not None:
            # The list changed while `initialized` was still on its way.
            self._unannounced = False
            await self._legacy_session.send_tool_list_changed()

    async def _list_tools(self, ctx: Any, params: Any) -> types.ListToolsResult:
        self._remember(ctx)
        return types.ListToolsResult(tools=[
            types.Tool(name=t.name, description=t.description, input_schema=t.input_schema)
            for t in self.registry.tools
        ])

    async def _call_tool(self, ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        self._remember(ctx)
        tool = self.registry.resolve(params.name)
        if tool is None:
            known = ", ".join(t.name for t in self.registry.tools) or "none"
            why = "" if self.link.connected else f"; {self.link.unavailable_error().message}"
            return tool_error(f"unknown tool '{params.name}' (available: {known}){why}")
        arguments = dict(params.arguments or {})
        problem = tool.validation_error(arguments)
        if problem:
            return tool_error(problem)
        try:
            reply = await self.link.request(
                messages.CALLER_TOOL, {"tool": tool.tool, "arguments": arguments, "caller_id": tool.caller_id},
            )
        except RelayError as err:
            return tool_error(relay_error_text(tool, err))
        return result_content(reply.get("result") if isinstance(reply, dict) else reply)

    async def run_stdio(self) -> None:
        """Serve the agent on stdin/stdout until it closes them."""
        import mcp.server.stdio

        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.link.run)
            nursery.start_soon(self._announce_changes)
            with trio.move_on_after(self.connect_wait):
                await self.link.attempted.wait()
            if not self.link.connected:
                log.warning("relay not available yet (%s); serving MCP anyway", self.link.last_error)
            async with mcp.server.stdio.stdio_server() as (read_stream, write_stream):
                await self.server.run(
                    read_stream, write_stream,
                    self.server.create_initialization_options(NotificationOptions(tools_changed=True)),
                )
            nursery.cancel_scope.cancel()
