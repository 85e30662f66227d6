"""The Oubliette relay wire protocol, shared by oubliette-server and oubliette-client.

Newline-delimited JSON-RPC 2.0 over a Unix or TCP socket (see ``docs/PROTOCOL.md``).
This package is the single definition of the wire: framing, envelope, typed messages,
JSON Schemas and error codes, the tether frame (``protocol.frames``), the sans-IO connection
(``protocol.core``) and the one Trio peer over it (``protocol.peer``), plus seed 001's tool
descriptors and action contract (``protocol.descriptors``). It imports nothing from either
program, and its modules form layers (bottom first; each imports only those below it):
``errors`` and ``schema_parts``; ``convert`` and ``schema_check``; ``jsonrpc``, ``framing``
and ``descriptors``; ``frames``; ``messages``; ``schemas``. ``pyproject.toml``
(``[tool.importlinter]``) states them as contracts.
"""

from __future__ import annotations

from . import addresses, convert, core, descriptors, errors, frames, framing, jsonrpc, messages, peer, schemas
from .addresses import *  # noqa: F403 - each module's __all__ is its public API
from .convert import *  # noqa: F403
from .core import *  # noqa: F403
from .descriptors import *  # noqa: F403
from .errors import *  # noqa: F403
from .frames import *  # noqa: F403
from .framing import *  # noqa: F403
from .jsonrpc import *  # noqa: F403
from .messages import *  # noqa: F403
from .peer import *  # noqa: F403
from .schemas import *  # noqa: F403

__all__ = [
    name
    for module in (addresses, errors, framing, jsonrpc, frames, messages, descriptors, convert, schemas, core, peer)
    for name in module.__all__
]
