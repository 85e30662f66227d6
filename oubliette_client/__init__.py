"""oubliette-client: the sandbox side of Oubliette (see DESIGN.md)."""

from .guest import GuestRuntime
from .relay_link import RelayLink
from .settings import RelaySettings
from .stdio_server import SandboxToolServer

__all__ = ["GuestRuntime", "RelayLink", "RelaySettings", "SandboxToolServer"]
