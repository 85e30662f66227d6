"""What a toolset is: a named group of host-side tools the agent reaches behind a prefix.

A toolset answers `call(tool, arguments)` with a `ToolResult`; its own failures
are results with `is_error` (they reach the agent as tool errors with the
toolset's text), never exceptions across the router.
"""

from __future__ import annotations

import abc
from typing import Any, Awaitable, Callable, Union

import attrs

DEFAULT_SAFETY = "runs on the host, outside the sandbox"


def _object_schema() -> dict[str, Any]:
    return {"type": "object"}


@attrs.define(frozen=True, kw_only=True)
class ToolSpec:
    """One tool of a toolset, as its owner describes it (unprefixed)."""

    name: str
    description: str = ""
    input_schema: dict[str, Any] = attrs.field(factory=_object_schema)
    result_schema: dict[str, Any] | None = None
    safety: str = DEFAULT_SAFETY
    command: str | None = None
    """Indicative CLI syntax (seed 001); derived from the published name when None."""


@attrs.define(frozen=True)
class ToolResult:
    result: Any = None
    content: list[dict[str, Any]] | None = None
    is_error: bool = False
    error: str | None = None

    @classmethod
    def ok(cls, result: Any = None, content: list[dict[str, Any]] | None = None) -> "ToolResult":
        return cls(result=result, content=content)

    @classmethod
    def failure(cls, text: str) -> "ToolResult":
        return cls(is_error=True, error=text)


class Toolset(abc.ABC):
    """A running toolset. Shared ones (`ref=`) live on; per-session ones (`factory=`) are closed by their session."""

    @abc.abstractmethod
    async def call(self, tool: str, arguments: dict[str, Any]) -> ToolResult: ...

    async def aclose(self) -> None:
        """Release what the toolset holds (processes, connections)."""


ToolsetFactory = Callable[[], Union[Toolset, Awaitable[Toolset]]]


class FunctionToolset(Toolset):
    """A toolset of plain async functions `(arguments) -> result`: the simplest code-driven toolset."""

    def __init__(self, handlers: dict[str, Callable[[dict[str, Any]], Awaitable[Any]]]) -> None:
        self.handlers = handlers
        self.closed = False

    async def call(self, tool: str, arguments: dict[str, Any]) -> ToolResult:
        handler = self.handlers.get(tool)
        if handler is None:
            return ToolResult.failure(f"no tool named {tool!r}")
        try:
            return ToolResult.ok(await handler(arguments))
        except Exception as exc:  # the toolset's own error becomes the agent's tool error
            return ToolResult.failure(str(exc) or type(exc).__name__)

    async def aclose(self) -> None:
        self.closed = True
