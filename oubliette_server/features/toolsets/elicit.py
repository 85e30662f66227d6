"""How a toolset's own elicitation reaches the person: the asker of the call in flight.

An MCP toolset may send `elicitation/create` while one of its tools runs. The toolset service
sets `current_asker` for each `toolset_call` (a callable bound to the calling session); a
toolset reads it in the task of its `call` and routes the form to it (`McpToolset`).
"""

from __future__ import annotations

import contextvars
from typing import Any, Awaitable, Callable

Asker = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]
"""`(message, requestedSchema) -> {"action": "accept"|"decline"|"cancel", "content"?: {...}}`."""

current_asker: contextvars.ContextVar[Asker | None] = contextvars.ContextVar("oubliette_toolset_asker", default=None)
