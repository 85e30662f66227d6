"""A tiny stdio MCP server whose one tool reports progress before it answers (for test_agent_approvals.py)."""

from __future__ import annotations

from mcp.server.mcpserver import Context, MCPServer

server = MCPServer("progress-demo")


@server.tool()
async def count(steps: int, ctx: Context) -> str:
    """Report progress `steps` times (1..steps of steps), then answer."""
    for step in range(1, steps + 1):
        await ctx.report_progress(step, steps, f"step {step}")
    return f"counted {steps}"


if __name__ == "__main__":
    server.run("stdio")
