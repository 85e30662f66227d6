"""SandboxTools: every tool this sandbox may use, kept current over the relay, and how to call one.

Both faces of the client use it: the stdio MCP server (for MCP agents) and
the action-contract endpoint (for everything else). It listens to
`caller_tools_config` and `toolsets_config`; what arrives during a handshake
is the server's whole configuration and replaces the registry when the
handshake completes.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import attrs
import trio

from oubliette_runtime.trace_spans import current_meta
from protocol import RelayError, errors
from protocol.descriptors import DESCRIPTOR_META_KEY

if TYPE_CHECKING:
    from protocol import CallerToolSpec, ToolsetToolSpec, UnavailableToolset

from .permission_prompt import APPROVAL_MARGIN, APPROVAL_WAIT, PERMISSION_PROMPT, permission_prompt
from .permission_prompt import DESCRIPTION as PERMISSION_DESCRIPTION
from .permission_prompt import INPUT_SCHEMA as PERMISSION_SCHEMA
from .progress import AgentProgress, ProgressSink
from .relay_link import RelayLink
from .settings import RelaySettings
from .tool_registry import PublishedTool, ToolRegistry

log = logging.getLogger("oubliette.client")


@attrs.define(frozen=True)
class CallOutcome:
    """What a call produced: a result (with MCP content blocks when the tool gave them) or an error text."""

    result: Any = None
    content: list[dict[str, Any]] | None = None
    error: str | None = None
    category: str = "tool"  # for errors: one of protocol.errors.CATEGORIES

    @property
    def is_error(self) -> bool:
        """True when the call failed (`error` holds the text, `category` the kind)."""
        return self.error is not None


#: Seconds a relayed caller tool call waits beyond the tool's own `timeout_ms` for the server's answer.
CALLER_TOOL_MARGIN = 10.0


def relay_error_text(tool: PublishedTool, err: RelayError) -> str:
    """The agent-facing text of a relay failure of `tool`, naming timeouts and lost connections as such."""
    if err.code == errors.TIMEOUT:
        return f"{tool.name}: timeout: {err.message}"
    if err.code == errors.PEER_DISCONNECTED:
        return f"{tool.name}: connection error: {err.message}"
    if err.code == errors.TOOL_ERROR:
        return f"{tool.name} failed: {err.message}"
    return f"{tool.name}: {err.message}"


class SandboxTools:
    """Every tool this sandbox may use, kept current over the relay, and `call` to use one.

    Owns: the `ToolRegistry` and a `client`-role `RelayLink` (not started: whoever embeds it
    runs `link.run` in a nursery, as `SandboxToolServer` and `ActionEndpoint` do).
    Needs: `RelaySettings`.
    Raises: nothing from `call`: unknown tools, bad arguments and relay errors are outcomes.
    """

    def __init__(self, settings: RelaySettings) -> None:
        self.settings = settings
        self.registry = ToolRegistry(settings.tool_separator)
        self._staged_callers: dict[str, list[CallerToolSpec]] = {}
        self._staged_toolsets: list[ToolsetToolSpec] | None = None
        self.unavailable_toolsets: list[UnavailableToolset] = []
        """The allowed toolsets the server could not start (from the last `toolsets_config`)."""
        self._progress: dict[str, ProgressSink] = {}
        self.link = RelayLink(
            settings, "client", self._on_relay_notification, self._commit_handshake_config,
            request_timeout=settings.request_timeout,
        )

    async def _on_relay_notification(self, method: str, params: Any) -> None:
        """Params come validated and structured by the relay peer."""
        from protocol import messages  # loaded with the link's first connection (cold start)

        if isinstance(params, messages.CallerToolsConfig):
            if self.link.connected:
                self.registry.set_caller_tools(params.caller_id, params.tools)
            else:  # part of the handshake: the server's configuration for this connection
                self._staged_callers[params.caller_id] = params.tools
        elif isinstance(params, messages.ToolsetsConfig):
            self.registry.server_separator = params.separator
            self.unavailable_toolsets = list(params.unavailable or [])
            if self.link.connected:
                self.registry.set_toolset_tools(params.tools)
            else:
                self._staged_toolsets = params.tools
        elif isinstance(params, messages.Progress):
            waiting = self._progress.get(params.ref)
            if waiting is not None:  # a report for a call that has ended is dropped
                waiting.report(params.progress, params.total, params.message)
        else:
            log.debug("ignoring relay notification %s", method)

    def _commit_handshake_config(self) -> None:
        callers, self._staged_callers = self._staged_callers, {}
        toolsets, self._staged_toolsets = self._staged_toolsets or [], None
        self.registry.replace_all(callers, toolsets)

    async def wait_first_attempt(self, deadline: float) -> None:
        """Wait for the link's first connection attempt, until Trio time `deadline` at most: a
        list or call made as the program starts then already sees the relay's tools."""
        if self.link.attempted.is_set():
            return
        with trio.move_on_at(deadline):
            await self.link.attempted.wait()

    async def warn_if_relay_down(self, deadline: float) -> None:
        """Log once, after the first attempt (or at `deadline`), when the relay is not reachable."""
        await self.wait_first_attempt(deadline)
        if not self.link.connected:
            log.warning("relay not available yet (%s)", self.link.last_error)

    def listed_tools(self) -> list[dict[str, Any]]:
        """The agent's `tools/list` entries as JSON (MCP `Tool`): every relayed tool with its
        descriptor in `_meta`, then the built-in `permission_prompt` (which hides a relayed
        tool of that name). One definition for the SDK's path and the early handshake."""
        tools = self.registry.tools
        relayed = [t for t in tools if t.name != PERMISSION_PROMPT]
        if len(relayed) < len(tools):
            log.warning("a relayed tool is named %s; the built-in permission prompt hides it", PERMISSION_PROMPT)
        return [
            *(
                {"name": t.name, "description": t.description, "inputSchema": t.input_schema,
                 "_meta": {DESCRIPTOR_META_KEY: t.descriptor}}
                for t in relayed
            ),
            {"name": PERMISSION_PROMPT, "description": PERMISSION_DESCRIPTION, "inputSchema": PERMISSION_SCHEMA},
        ]

    def _toolset_prefixes(self) -> set[str]:
        sep = self.registry.separator
        return {t.name[: len(t.name) - len(t.tool) - len(sep)] for t in self.registry.tools if t.kind == "toolset"}

    def unknown_tool_text(self, name: str) -> str:
        """The text for a tool name that resolves to nothing: which toolset prefix is unknown, or which tools exist, and why the link is down if it is."""
        why = "" if self.link.connected else f"; {self.link.unavailable_error().message}"
        sep = self.registry.separator
        callers = {t.owner for t in self.registry.tools if t.kind == "caller"}
        prefix = name.split(sep, 1)[0]
        for unavailable in self.unavailable_toolsets:
            if name.startswith(unavailable.prefix + sep):
                return unavailable.message() + why
        if sep in name and prefix not in callers and not any(name.startswith(p + sep) for p in self._toolset_prefixes()):
            return f"Toolset not found: '{prefix}' (no allowed toolset has that prefix){why}"
        known = ", ".join(t.name for t in self.registry.tools) or "none"
        return f"unknown tool '{name}' (available: {known}){why}"

    def _caller_tool_deadline(self, tool: PublishedTool) -> float:
        """The link's request deadline, or longer for a tool whose own timeout is longer:
        the server answers at the tool's timeout, so the client waits for that answer. A gated
        tool first waits for its approval (the server's effective approval timeout)."""
        approval = (tool.approval_timeout_ms or 0) / 1000
        if tool.timeout_ms is None:
            return self.link.request_timeout + approval
        return max(self.link.request_timeout, tool.timeout_ms / 1000 + CALLER_TOOL_MARGIN) + approval

    def _toolset_deadline(self, tool: PublishedTool) -> float:
        """The link's request deadline, plus a gated tool's approval timeout (waited for first)."""
        return self.link.request_timeout + (tool.approval_timeout_ms or 0) / 1000

    async def ask_permission(self, arguments: Any, progress: AgentProgress | None = None) -> str:
        """The `permission_prompt` tool: the answer text in Claude Code's JSON (a denial on any failure)."""
        ref = self._track(progress)
        try:
            return await permission_prompt(
                self._traced_request, arguments, progress_ref=ref,
                timeout=max(self.link.request_timeout, APPROVAL_WAIT) + APPROVAL_MARGIN,
            )
        finally:
            self._untrack(ref)

    async def _traced_request(self, method: str, params: dict[str, Any], **kwargs: Any) -> Any:
        """`link.request` carrying the current trace context (the client's `tools/call` span) in `_meta`."""
        meta = current_meta()
        return await self.link.request(method, params if meta is None else {**params, "_meta": meta}, **kwargs)

    def _track(self, progress: ProgressSink | None) -> str | None:
        if progress is None:
            return None
        self._progress[progress.ref] = progress
        return progress.ref

    def _untrack(self, ref: str | None) -> None:
        if ref is not None:
            self._progress.pop(ref, None)

    async def call(self, name: str, arguments: Any, progress: ProgressSink | None = None) -> CallOutcome:
        """Validate and relay one call; every failure comes back as an outcome with a clear text.

        With `progress`, the server's progress reports on the call (the caller's, a toolset's)
        are handed to it while the call is in flight.
        """
        tool = self.registry.resolve(name)
        if tool is None:
            return CallOutcome(error=self.unknown_tool_text(name), category="not_found")
        problem = tool.validation_error(arguments)
        if problem:
            return CallOutcome(error=problem, category="usage")
        from protocol import messages  # loaded with the link's first connection (cold start)

        ref = self._track(progress)
        extra: dict[str, Any] = {"progress_ref": ref} if ref is not None else {}
        meta = current_meta()  # the client's `tools/call` span: the server's span of the call joins it
        if meta is not None:
            extra["_meta"] = meta
        try:
            if tool.kind == "caller":
                reply = await self.link.request(
                    messages.CALLER_TOOL,
                    {"tool": tool.tool, "arguments": arguments, "caller_id": tool.owner, **extra},
                    timeout=self._caller_tool_deadline(tool),
                )
            else:
                reply = await self.link.request(
                    messages.TOOLSET_CALL, {"name": tool.server_name, "arguments": arguments, **extra},
                    timeout=self._toolset_deadline(tool),
                )
        except RelayError as err:
            return CallOutcome(error=relay_error_text(tool, err), category=err.category)
        finally:
            self._untrack(ref)
        reply = reply if isinstance(reply, dict) else {"result": reply}
        # A caller tool's resultSchema was enforced by the server before it answered.
        return CallOutcome(result=reply.get("result"), content=reply.get("content"))
