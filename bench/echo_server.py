"""The baseline of bench_relay.py: a minimal stdio MCP server with one `echo` tool.

It uses the same SDK, the same low-level `mcp.server.Server` and the same stdio
transport as oubliette-client, under Trio, and answers with the same result
shape the relay produces for the benchmark's caller tool (the arguments'
`text` as JSON text plus structured content). Nothing else happens per call,
so the difference to a relayed call is the relay itself.

    python bench/echo_server.py     (spawned by bench_relay.py; speaks MCP on stdin/stdout)
"""

from __future__ import annotations

import json
from typing import Any

import mcp_types as types
import trio
from mcp.server import Server
from mcp.server.lowlevel.server import NotificationOptions

INPUT_SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}}


async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
    return types.ListToolsResult(tools=[
        types.Tool(name="echo", description="Echo the text back", input_schema=INPUT_SCHEMA),
    ])


async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
    result = {"echo": (params.arguments or {}).get("text")}
    return types.CallToolResult(
        content=[types.TextContent(text=json.dumps(result))], structured_content=result,
    )


async def main() -> None:
    import mcp.server.stdio

    server = Server("bench-echo", version="0.1.0", on_list_tools=list_tools, on_call_tool=call_tool)
    async with mcp.server.stdio.stdio_server() as (read_stream, write_stream):
        await server.run(read_stream, write_stream, server.create_initialization_options(NotificationOptions()))


if __name__ == "__main__":
    trio.run(main)
