"""oubliette-server: the host side of Oubliette (see DESIGN.md)."""

from .app import OublietteServer
from .config import ServerConfig

__all__ = ["OublietteServer", "ServerConfig"]
