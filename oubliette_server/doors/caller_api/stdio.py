"""The caller on this process's stdin/stdout (the server spawned as a stdio MCP server), and the
server's line router: the one place that decides what is answered beside the MCP SDK.

Once a caller has finished a handshake-era `initialize` with the SDK, its plain
`caller_tool_response` (no `wait`) and `caller_tool_progress` calls are answered here
(`oubliette_runtime.fast_tool_calls`, the same `CallerApi.call` the SDK's handler runs, shaped as the SDK
shapes it), and its events are written as `notifications/message` lines directly
(`CallerConnection.write_line`). Every other line — the handshake, lists, 2026-07-28 requests,
calls with `wait`, anything malformed — is the SDK's, the reference; `OUBLIETTE_FAST_PATH=0`
makes every line the SDK's. `tests/server/doors/test_caller_line_router.py` drives the same lines both ways.
"""

from __future__ import annotations

from typing import Any

import trio
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from oubliette_runtime.fast_tool_calls import FastToolCalls, Handler, call_result, fast_path_enabled
from oubliette_runtime.stdio_streams import claimed_stdio

from ...core.callers import CallerConnection, CallerRegistry
from .mcp_server import build_caller_server, initialization_options
from .tools import CallerApi

#: Caller tools whose handshake-era calls skip the SDK's dispatcher (`oubliette_runtime/fast_tool_calls.py`):
#: they need no request context (`caller_tool_response` only without `wait`).
FAST_TOOLS = frozenset({"caller_tool_response", "caller_tool_progress"})

async def serve_stdio_caller(callers: CallerRegistry, tools: CallerApi) -> None:
    """Serve one caller on this process's stdin/stdout until it disconnects (then it is closed)."""
    import mcp.server.stdio

    caller = callers.open("stdio")
    legacy_version: list[str] = []  # the handshake-era version the caller negotiated, once known

    def resolve(ctx: Any, arguments: dict[str, Any] | None) -> CallerConnection:
        """The process's one connection is the caller (docs/SECURITY.md, "Callers and sessions")."""
        if ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS:
            caller.mcp_session = ctx.session
            legacy_version[:] = [ctx.protocol_version]
        return caller

    def fast_route(name: str, arguments: dict[str, Any]) -> Handler | None:
        """Answers (no `wait`) and progress reports of a handshake-era caller take the fast path."""
        if not legacy_version or name not in FAST_TOOLS or arguments.get("wait", False) is not False:
            return None
        version = legacy_version[0]

        async def handle(token: str | int | None, send_progress: Any) -> dict[str, Any]:
            return call_result(await tools.call(None, caller, name, arguments), version)
        return handle

    server = build_caller_server(tools, resolve)
    try:
        with claimed_stdio() as (stdin, stdout):  # cancellable (SIGTERM), no thread per line
            lines: Any = stdin
            async with trio.open_nursery() as nursery:
                if fast_path_enabled():
                    fast = FastToolCalls(fast_route, stdout.write)
                    await nursery.start(fast.run)
                    lines = fast.lines(stdin)
                    caller.write_line = stdout.write
                # The SDK types stdout as an anyio.AsyncFile but only calls write and flush.
                async with mcp.server.stdio.stdio_server(stdin=lines, stdout=stdout) as (  # type: ignore[arg-type]
                    read_stream, write_stream,
                ):
                    await server.run(read_stream, write_stream, initialization_options(server))
                nursery.cancel_scope.cancel()  # answers still in flight: the caller has gone
    finally:
        caller.write_line = None
        callers.close(caller)


