"""The caller-facing MCP: the tools a caller (an app, or Claude Code on the host) uses.

- `tools`: the tool table and handlers (thin adapters over the feature services);
- `schemas`: their JSON Schemas and result schemas;
- `mcp_server`: the SDK server object both transports share;
- `stdio`: the caller on stdin/stdout. Streamable HTTP is in `oubliette_server.doors.http_api`.
"""

from .mcp_server import build_caller_server
from .stdio import serve_stdio_caller
from .tools import CallerApi

__all__ = ["CallerApi", "build_caller_server", "serve_stdio_caller"]
