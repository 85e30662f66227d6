"""A stdio MCP server whose one tool, `book`, asks its client for input during the call
(`elicitation/create`) and answers with what it got: the toolset of tests/server/features/test_approval_elicitation.py."""

from __future__ import annotations

import json
from typing import Any

import mcp_types as types
import trio
from mcp.server import Server
from mcp.server.stdio import stdio_server

SCHEMA = {
    "type": "object",
    "properties": {"seats": {"type": "integer", "title": "Seats"}},
    "required": ["seats"],
}


async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
    return types.ListToolsResult(tools=[types.Tool(
        name="book", description="Book a table (asks how many seats)",
        input_schema={"type": "object", "properties": {"place": {"type": "string"}}},
    )])


async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
    place = (params.arguments or {}).get("place", "?")
    answer = await ctx.session.elicit_form(f"How many seats at {place}?", SCHEMA, related_request_id=ctx.request_id)
    text = json.dumps({"action": answer.action, "content": answer.content})
    return types.CallToolResult(content=[types.TextContent(text=f"booking: {text}")])


async def main() -> None:
    server = Server("elicit-toolset", on_list_tools=list_tools, on_call_tool=call_tool)
    async with stdio_server() as (read_stream, write_stream):
        await server.run(read_stream, write_stream, server.create_initialization_options())


if __name__ == "__main__":
    trio.run(main)
