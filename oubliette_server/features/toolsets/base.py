"""What a toolset is: a named group of host-side tools the agent reaches behind a prefix.

A toolset answers `call(tool, arguments)` with a `ToolResult`; its own failures
are results with `is_error` (they reach the agent as tool errors with the
toolset's text), never exceptions across the router.
"""

from __future__ import annotations

import abc
import contextvars
from typing import Any, Awaitable, Callable, Union

import attrs

DEFAULT_SAFETY = "runs on the host, outside the sandbox"

#: Where a toolset may report progress on the call it is running (progress, total, message), or
#: None when the agent asked for none. Set by the toolset service around each call, so the
#: `Toolset.call` signature stays the same for every toolset; `McpToolset` forwards its server's
#: `notifications/progress` here. Never waits.
call_progress: contextvars.ContextVar[Callable[[float, "float | None", "str | None"], None] | None] = (
    contextvars.ContextVar("oubliette_toolset_call_progress", default=None)
)


def _object_schema() -> dict[str, Any]:
    return {"type": "object"}


@attrs.define(frozen=True, kw_only=True)
class ToolSpec:
    """One tool of a toolset, as its owner describes it (unprefixed).

    Immutable. The router checks arguments against `input_schema` before the toolset runs,
    and a result against `result_schema` (when set) after.
    """

    name: str
    description: str = ""
    input_schema: dict[str, Any] = attrs.field(factory=_object_schema)
    result_schema: dict[str, Any] | None = None
    safety: str = DEFAULT_SAFETY
    command: str | None = None
    """Indicative CLI syntax (a tool descriptor field); derived from the published name when None."""


@attrs.define(frozen=True)
class ToolResult:
    """What a toolset call produced: a result (with MCP content blocks when the tool gave them), or an error text.

    Immutable; build it with `ok` or `failure`. A failure reaches the agent as a tool error
    with `error` as its text.
    """

    result: Any = None
    content: list[dict[str, Any]] | None = None
    is_error: bool = False
    error: str | None = None

    @classmethod
    def ok(cls, result: Any = None, content: list[dict[str, Any]] | None = None) -> "ToolResult":
        """A successful result, with the tool's own MCP content blocks if it has them."""
        return cls(result=result, content=content)

    @classmethod
    def failure(cls, text: str) -> "ToolResult":
        """A failed call whose `text` the agent sees as the tool error."""
        return cls(is_error=True, error=text)


class Toolset(abc.ABC):
    """A running toolset. Shared ones (`ref=`) live on; per-session ones (`factory=`) are closed by their session.

    Owns: whatever it starts (processes, connections), released by `aclose`. A per-session
    toolset is closed by its session's router; a shared one when it is unregistered.
    """

    @abc.abstractmethod
    async def call(self, tool: str, arguments: dict[str, Any]) -> ToolResult:
        """Run `tool` (its unprefixed name) with `arguments`, already checked against its input schema.

        Raises: nothing by contract: a failure is `ToolResult.failure`. An exception is a bug; the
        relay answers it as an internal error and the connection stays up.
        Cancellation: the agent cancelled the call or the connection went; leave no work behind.
        """

    async def aclose(self) -> None:
        """Release what the toolset holds (processes, connections)."""


ToolsetFactory = Callable[[], Union[Toolset, Awaitable[Toolset]]]


class FunctionToolset(Toolset):
    """A toolset of plain async functions `(arguments) -> result`: the simplest code-driven toolset."""

    def __init__(self, handlers: dict[str, Callable[[dict[str, Any]], Awaitable[Any]]]) -> None:
        self.handlers = handlers
        self.closed = False

    async def call(self, tool: str, arguments: dict[str, Any]) -> ToolResult:
        """Await the handler named `tool`; an unknown tool or an exception it raises becomes `ToolResult.failure`."""
        handler = self.handlers.get(tool)
        if handler is None:
            return ToolResult.failure(f"no tool named {tool!r}")
        try:
            return ToolResult.ok(await handler(arguments))
        except Exception as exc:  # the toolset's own error becomes the agent's tool error
            return ToolResult.failure(str(exc) or type(exc).__name__)

    async def aclose(self) -> None:
        """Mark the toolset closed (`closed`); it holds nothing else."""
        self.closed = True
