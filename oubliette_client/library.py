"""The sandbox side in-process, for an agent written in Python (docs/EMBEDDING.md, "The sandbox side").

What `oubliette-client` gives an MCP agent over stdio — the caller's tools and the allowed
toolsets' tools, each call validated and relayed, progress, cancellation, the tool set kept
current — given to a Trio program as objects: no `oubliette-client` process, no MCP. It is
`SandboxTools` (the stdio server's and the action endpoint's core) behind a small surface that
raises instead of returning error outcomes.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

import attrs
import trio

from .progress import new_progress_ref
from .relay_link import RelayRefused, RelayUnavailable
from .sandbox_tools import CallOutcome, SandboxTools
from .settings import RelaySettings, settings_from_environment

if TYPE_CHECKING:
    from protocol import UnavailableToolset

    from .tool_registry import PublishedTool

#: Seconds `open_sandbox_client` waits for the relay's verdict on its hello by default.
DEFAULT_CONNECT_WAIT = 5.0


class ToolCallError(Exception):
    """A tool call that did not produce a result: the text the agent would see, and its kind.

    `category` is one of `protocol.errors.CATEGORIES`: `not_found` (no such tool, or its toolset
    is unavailable), `usage` (arguments the tool's `inputSchema` refuses; nothing was relayed),
    `timeout`, `connection` (the relay is down or went down), `denied` (a gated call was not
    approved), `tool` (the caller or the toolset answered with an error), ...
    """

    def __init__(self, message: str, category: str) -> None:
        super().__init__(message)
        self.category = category


@attrs.frozen
class Progress:
    """One progress report on a call in flight, as its caller (`caller_tool_progress`) or toolset sent it."""

    progress: float
    total: float | None = None
    message: str | None = None


@attrs.define
class _ReportTo:
    """A call's progress sink that hands each report to the embedder's callback."""

    callback: Callable[[Progress], None]
    ref: str = attrs.field(factory=new_progress_ref)

    def report(self, progress: float, total: float | None = None, message: str | None = None) -> None:
        self.callback(Progress(progress, total, message))


class SandboxClient:
    """This sandbox's tools, kept current over the relay, and `call` to use one.

    Made by `open_sandbox_client`, which owns its relay connection; use it only inside that block.
    """

    def __init__(self, tools: SandboxTools) -> None:
        self._tools = tools

    @property
    def settings(self) -> RelaySettings:
        """Where and as whom it is connected (relay, instance, token, session)."""
        return self._tools.settings

    @property
    def connected(self) -> bool:
        """Whether the relay connection is up now (it reconnects by itself after a drop)."""
        return self._tools.link.connected

    @property
    def tools(self) -> list[PublishedTool]:
        """The tools this sandbox may call now: the caller's (`kind` "caller", named
        `{caller_id}_{tool}`), then the allowed toolsets' (`kind` "toolset", `<prefix><sep><tool>`)."""
        return self._tools.registry.tools

    @property
    def tools_version(self) -> int:
        """Bumped on every change of `tools`: pass it to `wait_tools_changed`."""
        return self._tools.registry.version

    @property
    def unavailable_toolsets(self) -> list[UnavailableToolset]:
        """The allowed toolsets the server could not start, each with its reason (it retries them)."""
        return self._tools.unavailable_toolsets

    async def wait_tools_changed(self, seen_version: int) -> int:
        """Wait until `tools_version` differs from `seen_version`; return the new version.

        A change between reading the version and this call is not missed. Cancellation: safe.
        """
        return await self._tools.registry.wait_changed(seen_version)

    async def call(
        self, name: str, arguments: dict[str, Any], *, on_progress: Callable[[Progress], None] | None = None,
    ) -> CallOutcome:
        """Validate `arguments` against the tool's `inputSchema`, relay the call and return its result
        (`result`, and `content`: the MCP content blocks when the tool gave them).

        `on_progress` gets each progress report on the call while it is in flight; it is called
        in the relay connection's task, so it must not block (hand the report to a memory
        channel to await on it).
        Raises: `ToolCallError` (see its `category`). Cancellation: the server is told at once
        (the caller sees `caller_tool_cancelled`; a toolset's call is cancelled) and nothing of
        the call is left pending.
        """
        progress = None if on_progress is None else _ReportTo(on_progress)
        outcome = await self._tools.call(name, arguments, progress)
        if outcome.error is not None:
            raise ToolCallError(outcome.error, outcome.category)
        return outcome


@asynccontextmanager
async def open_sandbox_client(
    settings: RelaySettings | None = None, *, connect_wait: float = DEFAULT_CONNECT_WAIT,
) -> AsyncIterator[SandboxClient]:
    """Connect to the relay as this sandbox's `client` and yield its `SandboxClient`.

    `settings`: None reads them as `oubliette-client` does (`settings_from_environment`:
    `OUBLIETTE_RELAY`, `OUBLIETTE_INSTANCE`, `OUBLIETTE_TOKEN`, `OUBLIETTE_SESSION`). It returns
    once the relay has accepted the hello, with the tools the server sent in it.
    Owns: the relay connection, in a nursery of its own, reconnected with backoff after a drop
    (calls meanwhile raise `ToolCallError` with category `connection`); closed when the block ends.
    Raises: `ValueError` for missing or malformed settings; `RelayUnavailable` when the relay
    cannot be reached within `connect_wait` seconds, `RelayRefused` (a subclass) when it refuses
    the token or instance. Cancellation: the connection is closed.
    """
    tools = SandboxTools(settings if settings is not None else settings_from_environment())
    link = tools.link
    link.report_failures = False  # a failure to connect is raised, not logged
    failure: RelayUnavailable | None = None
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(link.run)
            with trio.move_on_after(connect_wait):
                await link.wait_settled()
            if link.connected:
                link.report_failures = True  # from here a drop is logged, as the programs log it
                try:
                    yield SandboxClient(tools)
                finally:
                    nursery.cancel_scope.cancel()
            else:
                failure = (RelayUnavailable if link.refused is None else RelayRefused)(link.failure_line())
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The link's task ends only when cancelled: what the nursery wrapped is the block's own exception.
        if len(group.exceptions) != 1:
            raise
        raise group.exceptions[0] from None
    if failure is not None:
        raise failure
