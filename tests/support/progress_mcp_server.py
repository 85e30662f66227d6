"""A tiny stdio MCP server whose tool `count` reports progress before it answers (for
tests/server/features/test_connection_approvals.py), and whose tools `trace_id` and `trace_parent` say which trace (and
span) its call arrived in (tests/runtime/test_trace_spans.py)."""

from __future__ import annotations

from mcp.server.mcpserver import Context, MCPServer

server = MCPServer("progress-demo")


@server.tool()
async def count(steps: int, ctx: Context) -> str:
    """Report progress `steps` times (1..steps of steps), then answer."""
    for step in range(1, steps + 1):
        await ctx.report_progress(step, steps, f"step {step}")
    return f"counted {steps}"


@server.tool()
async def trace_id() -> str:
    """The trace id of the `_meta.traceparent` this call arrived with, or "none" (the SDK's span of
    the call carries it, recording or not)."""
    from opentelemetry import trace

    context = trace.get_current_span().get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else "none"


@server.tool()
async def trace_parent() -> str:
    """`TRACE_ID-SPAN_ID` of the `_meta.traceparent` this call arrived with, or "none": with no
    SDK set up here the SDK's span of the call is a no-op carrying its parent's ids."""
    from opentelemetry import trace

    context = trace.get_current_span().get_span_context()
    return f"{context.trace_id:032x}-{context.span_id:016x}" if context.is_valid else "none"


if __name__ == "__main__":
    server.run("stdio")
