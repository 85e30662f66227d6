"""Host-side toolsets: registry, per-session router, MCP and command-endpoint toolsets (docs/TOOLSETS.md)."""

from .base import FunctionToolset, ToolResult, Toolset, ToolsetFactory, ToolSpec
from .command_toolset import CommandToolset
from .mcp_toolset import McpToolset
from .registry import ToolsetDefinition, ToolsetRegistry
from .router import ToolRouter
from .service import ToolsetService

__all__ = [
    "CommandToolset",
    "FunctionToolset",
    "McpToolset",
    "ToolResult",
    "ToolRouter",
    "ToolSpec",
    "Toolset",
    "ToolsetDefinition",
    "ToolsetFactory",
    "ToolsetRegistry",
    "ToolsetService",
]
