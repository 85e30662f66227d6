"""oubliette-client: the sandbox side of Oubliette (see README.md and docs/ARCHITECTURE.md).

The public classes are imported on first use (PEP 562), not with the package: each
`oubliette-client` mode and the demo agent then load only what they run (the MCP server
side and JSON Schema validation cost about a second per process otherwise).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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


def __getattr__(name: str) -> Any:
    """`oubliette_client.GuestRuntime` and the other public names, imported when first asked for."""
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
