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
    from .relay_link import RelayLink
    from .settings import RelaySettings
    from .stdio_server import SandboxToolServer

__all__ = ["GuestRuntime", "RelayLink", "RelaySettings", "SandboxToolServer"]

_MODULE_OF = {
    "GuestRuntime": ".guest", "RelayLink": ".relay_link",
    "RelaySettings": ".settings", "SandboxToolServer": ".stdio_server",
}


__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF, __all__, globals())
