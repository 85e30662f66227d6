"""oubliette-server: the host side of Oubliette (see README.md and docs/ARCHITECTURE.md).

`OublietteServer` and `ServerConfig` are imported on first use (PEP 562), not with the package:
the command line's `--help`, `token` and `http-token` then start without the MCP SDK (about a
second per process).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import OublietteServer
    from .config import ServerConfig

__all__ = ["OublietteServer", "ServerConfig"]

_MODULE_OF = {"OublietteServer": ".app", "ServerConfig": ".config"}


def __getattr__(name: str) -> Any:
    """`oubliette_server.OublietteServer` and `ServerConfig`, imported when first asked for."""
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
