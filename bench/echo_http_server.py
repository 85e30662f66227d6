"""The HTTP baseline of bench_http.py: the MCP SDK's own `MCPServer` with one `echo` tool over
Streamable HTTP, under hypercorn's Trio worker (as oubliette-server serves `/mcp`).

It answers with the shape the relay gives the benchmark's caller tool (structured content
`{"echo": text}`), so the difference to a relayed call over HTTP is the relay. It prints
`listening on http://127.0.0.1:PORT/mcp` on stderr once bound.

    python bench/echo_http_server.py [--port 0]
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from mcp.server.mcpserver import MCPServer


def app() -> Any:
    """The SDK's Streamable HTTP app with the `echo` tool (SSE responses, sessions as the SDK keeps them)."""
    server = MCPServer("bench-echo-http")

    @server.tool(description="Echo the text back")
    def echo(text: str) -> dict[str, Any]:
        return {"echo": text}

    return server.streamable_http_app()


async def main(port: int) -> None:
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    config.errorlog = None
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve, app(), config))
        print(f"listening on {binds[0]}/mcp", file=sys.stderr, flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0)
    trio.run(main, parser.parse_args().port)
