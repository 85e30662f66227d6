"""oubliette-client's stdio MCP server: the caller's tools as the agent's native tools.

It answers `initialize` at once (`oubliette-client` itself starts through
`line_router.serve_stdio`, which first waits up to 1 s for the relay's verdict on its hello,
so a refused token fails the handshake, and answers a handshake-era agent's fixed shapes itself)
and connects to the relay meanwhile; the first
`tools/list` and the first call wait for that first attempt (bounded by
`connect_wait` from the start), so they already have the tools, and the relay's
connect, hello and tool list never delay the handshake. If the relay
is down it still serves MCP: the tools it last knew stay listed and calls say
why they cannot run, while the link reconnects in the background. Every
change of the list is announced in both protocol eras: handshake-era agents
get `notifications/tools/list_changed`, 2026-07-28 agents a
`subscriptions/listen` event.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterable, Awaitable, Callable
from typing import Any

import mcp_types as types
import trio
from mcp.server import Server
from mcp.server.lowlevel.server import NotificationOptions
from mcp.server.subscriptions import InMemorySubscriptionBus, ListenHandler, ToolsListChanged
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from protocol import VERSION
from oubliette_runtime.fast_tool_calls import tool_error
from oubliette_runtime.stdio_streams import claimed_stdio
from oubliette_runtime.telemetry import guard_sdk_extraction

from .permission_prompt import PERMISSION_PROMPT
from .progress import DEFAULT_PROGRESS_INTERVAL, AgentProgress
from .sandbox_tools import CallOutcome, SandboxTools
from .settings import RelaySettings

log = logging.getLogger("oubliette.client")

DEFAULT_CONNECT_WAIT = 3.0


def result_content(outcome: CallOutcome) -> types.CallToolResult:
    """A result as MCP content: the tool's own content blocks, or the result as text; structured when an object."""
    result = outcome.result
    if outcome.content:
        content = [types.CallToolResult.model_validate({"content": [block]}).content[0] for block in outcome.content]
    else:
        text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)
        content = [types.TextContent(text=text)]
    return types.CallToolResult(content=content, structured_content=result if isinstance(result, dict) else None)


def _progress_token(ctx: Any) -> str | int | None:
    """The agent's `_meta.progressToken` for this request, or None when it asked for no progress."""
    meta = getattr(ctx, "meta", None) or {}
    token = meta.get("progress_token", meta.get("progressToken"))
    return None if isinstance(token, bool) else token


class SandboxToolServer:
    """The MCP server the agent talks to, fed by a `RelayLink`.

    Besides the relayed tools it always offers `permission_prompt` (Claude Code's
    `--permission-prompt-tool`, see `permission_prompt.py`). While a call waits and the agent
    gave a `progressToken`, it sends progress on it (`progress.py`): a heartbeat every
    `progress_interval` seconds, and the caller's or toolset's own reports.

    `line_router.LineRouter` answers a handshake-era agent's calls with the same `answer_call`.

    Owns: the `SandboxTools` (its registry and `client`-role link) and, inside `run_stdio`,
    the link's task and the task announcing list changes; one progress task per waiting call.
    Needs: `RelaySettings`.
    Raises: nothing for a tool call: failures reach the agent as MCP tool errors.
    """

    def __init__(
        self, settings: RelaySettings, *, connect_wait: float = DEFAULT_CONNECT_WAIT,
        progress_interval: float = DEFAULT_PROGRESS_INTERVAL, tools: SandboxTools | None = None,
    ) -> None:
        self.settings = settings
        self.connect_wait = connect_wait
        self.progress_interval = progress_interval
        self.tools = SandboxTools(settings) if tools is None else tools
        self.registry = self.tools.registry
        self.link = self.tools.link
        self.bus = InMemorySubscriptionBus()
        #: Sends `notifications/tools/list_changed` to a handshake-era agent once it is initialized
        #: (its SDK session's, or the line router's when the handshake was the router's).
        self._tell_list_changed: Callable[[], Awaitable[None]] | None = None
        #: Trio time when lists and calls stop waiting for the relay's first attempt (set by whoever
        #: starts serving: `run_stdio`, or `line_router.serve_stdio`).
        self.relay_deadline = float("inf")
        self._unannounced = False
        guard_sdk_extraction()  # an agent's malformed `_meta.baggage` must not fail its call
        self.server = Server(
            "oubliette-client", version=VERSION,
            on_list_tools=self._list_tools, on_call_tool=self._call_tool,
            on_subscriptions_listen=ListenHandler(self.bus),
        )
        # A handshake-era agent may wait for list_changed before it lists anything.
        self.server.add_notification_handler("notifications/initialized", types.NotificationParams, self._initialized)

    # -- telling the agent ---------------------------------------------------------------

    async def _announce_changes(self, seen: int | None = None) -> None:
        """Tell the agent of every change of the list after version `seen` (default: the current one)."""
        if seen is None:
            seen = self.registry.version
        while True:
            seen = await self.registry.wait_changed(seen)
            log.info("tool list changed: %s", ", ".join(t.name for t in self.registry.tools) or "(none)")
            if self._tell_list_changed is not None:
                await self._tell_list_changed()
            else:
                self._unannounced = True
            await self.bus.publish(ToolsListChanged())

    # -- MCP side ------------------------------------------------------------------------

    def _remember(self, ctx: Any) -> None:
        if ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS:
            self._tell_list_changed = ctx.session.send_tool_list_changed

    async def _initialized(self, ctx: Any, params: Any) -> None:
        self._remember(ctx)
        await self.initialized()

    async def initialized(self, tell_list_changed: Callable[[], Awaitable[None]] | None = None) -> None:
        """A handshake-era agent is initialized: list changes are announced to it from now on
        (through `tell_list_changed` when given: the line router's handshake), and one that came
        while `initialized` was still on its way is announced now."""
        if tell_list_changed is not None:
            self._tell_list_changed = tell_list_changed
        if self._unannounced and self._tell_list_changed is not None:
            self._unannounced = False
            await self._tell_list_changed()

    async def _list_tools(self, ctx: Any, params: Any) -> types.ListToolsResult:
        self._remember(ctx)
        await self.tools.wait_first_attempt(self.relay_deadline)
        return types.ListToolsResult.model_validate({"tools": self.tools.listed_tools()})

    async def _call_tool(self, ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        self._remember(ctx)
        return await self.answer_call(
            params.name, dict(params.arguments or {}), _progress_token(ctx), ctx.session.report_progress,
        )

    async def answer_call(
        self, name: str, arguments: dict[str, Any], progress_token: str | int | None, send_progress: Any,
    ) -> types.CallToolResult:
        """The result of the agent's call of `name`, for the SDK's path and the line router alike.

        With a `progress_token`, progress goes out through `send_progress(progress, total,
        message)` while the call waits. Raises: nothing; failures are tool errors.
        """
        await self.tools.wait_first_attempt(self.relay_deadline)  # a call made before the relay answered finds its tool
        if name == PERMISSION_PROMPT:
            answer = await self._with_progress(progress_token, send_progress, "waiting for the caller's decision",
                                               lambda progress: self.tools.ask_permission(arguments, progress))
            return types.CallToolResult(content=[types.TextContent(text=answer)])
        outcome = await self._with_progress(progress_token, send_progress, f"waiting for {name}",
                                            lambda progress: self.tools.call(name, arguments, progress))
        if outcome.is_error:
            return tool_error(outcome.error or "failed")
        return result_content(outcome)

    async def _with_progress(self, progress_token: str | int | None, send_progress: Any, waiting_for: str, run: Any) -> Any:
        """`run(progress)`, with progress on the agent's token while it waits (none after it returns)."""
        if progress_token is None:
            return await run(None)
        progress = AgentProgress(send_progress, self.progress_interval, waiting_for)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(progress.run)
            try:
                outcome = await run(progress)
            finally:
                nursery.cancel_scope.cancel()  # no progress after the response
        await progress.drain()  # reports that arrived just before the answer still come before it
        return outcome

    async def run_stdio(self) -> None:
        """Serve the agent on stdin/stdout until it closes them, with the MCP SDK already loaded
        (for embedders; `oubliette-client` starts through `line_router.serve_stdio`).

        Serves at once; lists and calls wait up to `connect_wait` (from now) for the first relay
        attempt, then go on even if the relay is down (calls say why). Cancellation: the link
        closes and MCP serving stops.
        """
        async with trio.open_nursery() as nursery:
            self.relay_deadline = trio.current_time() + self.connect_wait
            await nursery.start(self.link.run)
            nursery.start_soon(self.tools.warn_if_relay_down, self.relay_deadline)
            with claimed_stdio() as (stdin, stdout):  # cancellable, no thread per line
                await self.serve(stdin, stdout)
            nursery.cancel_scope.cancel()

    async def serve(self, lines: AsyncIterable[str], stdout: Any, *, listed_version: int | None = None) -> None:
        """Serve MCP on the agent's `lines` and `stdout` (`async write(text)`, safe from several
        tasks; `stdio_streams.StdoutText`) until the lines end; then calls still in flight are
        cancelled (the agent has gone). The link must be running (its owner runs `link.run`).

        `listed_version`: the registry version the agent has already been shown (by the line
        router); changes after it are announced.
        """
        import mcp.server.stdio

        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._announce_changes, listed_version)
            # The SDK types stdin as an anyio.AsyncFile but only iterates its lines.
            async with mcp.server.stdio.stdio_server(stdin=lines, stdout=stdout) as (  # type: ignore[arg-type]
                read_stream, write_stream,
            ):
                await self.server.run(
                    read_stream, write_stream,
                    self.server.create_initialization_options(NotificationOptions(tools_changed=True)),
                )
            nursery.cancel_scope.cancel()
