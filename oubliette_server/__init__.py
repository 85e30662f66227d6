"""oubliette-server: the host side of Oubliette (see README.md and docs/ARCHITECTURE.md).

`OublietteServer`, `ServerConfig` and `ServingAddresses` (what `serve` returns; docs/EMBEDDING.md) are imported on first use (PEP 562), not with the package:
the command line's `--help`, `token` and `http-token` then start without the MCP SDK (about a
second per process).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from protocol import lazy_exports

if TYPE_CHECKING:
    from .program.app import OublietteServer, ServingAddresses
    from .program.config import ServerConfig

__all__ = ["OublietteServer", "ServerConfig", "ServingAddresses"]

_MODULE_OF = {"OublietteServer": ".program.app", "ServerConfig": ".program.config", "ServingAddresses": ".program.app"}


__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF, __all__, globals())
