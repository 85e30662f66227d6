"""oubliette-client: the sandbox side of Oubliette (see README.md and docs/ARCHITECTURE.md).

The public classes are imported on first use (PEP 562), not with the package: each
`oubliette-client` mode and the demo agent then load only what they run (the MCP server
side and JSON Schema validation cost about a second per process otherwise).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from protocol import lazy_exports

if TYPE_CHECKING:
    from .guest import GuestRuntime
    from .library import Progress, SandboxClient, ToolCallError, open_sandbox_client
    from .relay_link import RelayLink, RelayRefused, RelayUnavailable
    from .settings import RelaySettings, settings_from_environment
    from .stdio_server import SandboxToolServer

__all__ = [
    "GuestRuntime", "Progress", "RelayLink", "RelayRefused", "RelaySettings", "RelayUnavailable", "SandboxClient",
    "SandboxToolServer", "ToolCallError", "open_sandbox_client", "settings_from_environment",
]

_MODULE_OF = {
    "GuestRuntime": ".guest", "RelayLink": ".relay_link", "RelayRefused": ".relay_link", "RelayUnavailable": ".relay_link",
    "RelaySettings": ".settings", "settings_from_environment": ".settings", "SandboxToolServer": ".stdio_server",
    "Progress": ".library", "SandboxClient": ".library", "ToolCallError": ".library", "open_sandbox_client": ".library",
}


__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF, __all__, globals())
