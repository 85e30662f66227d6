"""The caller on this process's stdin/stdout (the server spawned as a stdio MCP server)."""

from __future__ import annotations

from typing import Any

from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from protocol.stdio_streams import claimed_stdio

from ..callers import CallerConnection, CallerRegistry
from .mcp_server import build_caller_server, initialization_options
from .tools import CallerTools


async def serve_stdio_caller(callers: CallerRegistry, tools: CallerTools) -> None:
    """Serve one caller on this process's stdin/stdout until it disconnects (then it is closed)."""
    import mcp.server.stdio

    caller = callers.open("stdio")

    def resolve(ctx: Any, arguments: dict[str, Any] | None) -> CallerConnection:
        """The process's one connection is the caller (docs/SECURITY.md, "Callers and sessions")."""
        if ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS:
            caller.mcp_session = ctx.session
        return caller

    server = build_caller_server(tools, resolve)
    try:
        with claimed_stdio() as (stdin, stdout):  # cancellable (SIGTERM), no thread per line
            async with mcp.server.stdio.stdio_server(stdin=stdin, stdout=stdout) as (read_stream, write_stream):  # type: ignore[arg-type]
                await server.run(read_stream, write_stream, initialization_options(server))
    finally:
        callers.close(caller)


