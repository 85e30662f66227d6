"""The tools the agent sees, and the map from each published name to where it goes.

Caller tools are published as `{caller_id}_{tool}`; toolset tools under the
name the server published (`<prefix><sep><tool>`), or with the agent's own
separator in place of the server's when the client has one (an agent that
would rewrite the server's, docs/AGENTS.md). A published name is
resolved through the map built when the list was published, never by
splitting the string, so ids, prefixes and names may contain `_` or `.`
freely. Each change bumps `version` and wakes waiters, who tell the agent.
Every tool carries its tool descriptor.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import attrs
import trio

from protocol.descriptors import build_descriptor

if TYPE_CHECKING:
    from protocol import CallerToolSpec, ToolsetToolSpec
from protocol.schema_check import InvalidSchema, compile_schema, first_problem

log = logging.getLogger("oubliette.client.tools")

CLAUDE_NAME_LIMIT = 64
DEFAULT_INPUT_SCHEMA: dict[str, Any] = {"type": "object"}


@attrs.define(frozen=True)
class PublishedTool:
    """One tool as the agent sees it: its published name, schema and descriptor, and where a call goes.

    Immutable; `validator` is the compiled input schema, excluded from equality. A caller tool's
    `resultSchema` is not checked here: the server enforces it before it answers (the trust
    boundary for the caller's results), so the client does not check it a second time.
    """

    name: str
    description: str
    input_schema: dict[str, Any]
    kind: str  # "caller" | "toolset"
    tool: str  # the name the caller or toolset knows it by
    owner: str  # caller id, or toolset id
    descriptor: dict[str, Any]
    validator: Any = attrs.field(eq=False, repr=False)
    timeout_ms: int | None = None
    """A caller tool's own timeout (the caller's `timeout_ms`), so the relay request waits long enough."""
    approval_timeout_ms: int | None = None
    """A gated caller or toolset tool's approval timeout (the server sends its effective value): waited for first."""
    server_name: str = ""
    """A toolset tool's name as the server published it, which a call names (`name` may use the agent's separator)."""

    @property
    def caller_id(self) -> str:
        """The caller that owns a caller tool (the same as `owner`)."""
        return self.owner

    def validation_error(self, arguments: Any) -> str | None:
        """The first problem with `arguments` against the input schema, or None when they are valid."""
        if not isinstance(arguments, dict):
            return f"arguments for {self.name} must be a JSON object"
        return first_problem(self.validator, arguments, f"invalid arguments for {self.name}")


def caller_descriptor(name: str, caller_id: str, spec: CallerToolSpec, schema: dict[str, Any]) -> dict[str, Any]:
    """The descriptor dict of a caller tool published as `name`."""
    return build_descriptor(
        name,
        description=spec.description or f"{spec.name} (from caller {caller_id})",
        safety=f"runs in the caller's application '{caller_id}', outside the sandbox; the caller decides the result",
        input_schema=schema,
        result_schema=spec.resultSchema,
    ).to_dict()


class ToolRegistry:
    """The tools the agent sees, by published name; each change bumps `version` and wakes `wait_changed`.

    Owns: only in-memory state. A tool whose schema does not compile, or whose name is
    already taken, is logged and left out rather than raised.
    """

    def __init__(self, separator: str | None = None) -> None:
        self.agent_separator = separator
        """The separator the agent sees in toolset tool names instead of the server's, if any."""
        self.server_separator = "."
        """The server's separator (its `toolsets_config`)."""
        self._caller_tools: dict[str, list[CallerToolSpec]] = {}
        self._toolset_tools: list[ToolsetToolSpec] = []
        self._published: dict[str, PublishedTool] = {}
        self.version = 0
        self._changed = trio.Event()

    @property
    def tools(self) -> list[PublishedTool]:
        """Every published tool, in publication order (caller tools by caller id, then toolset tools)."""
        return list(self._published.values())

    @property
    def separator(self) -> str:
        """The separator of the toolset tool names the agent sees."""
        return self.agent_separator or self.server_separator

    def resolve(self, name: str) -> PublishedTool | None:
        """The tool published as `name`, or None; names are looked up, never split."""
        return self._published.get(name)

    async def wait_changed(self, seen_version: int) -> int:
        """Wait until `version` differs from `seen_version` and return the new version.

        Cancellation: safe at any point; nothing is consumed.
        """
        while self.version == seen_version:
            await self._changed.wait()
        return self.version

    def set_caller_tools(self, caller_id: str, tools: list[CallerToolSpec]) -> None:
        """Replace one caller's tools (an empty list removes them)."""
        if tools:
            self._caller_tools[caller_id] = list(tools)
        else:
            self._caller_tools.pop(caller_id, None)
        self._republish()

    def set_toolset_tools(self, tools: list[ToolsetToolSpec]) -> None:
        """Replace every toolset tool (the server sends the whole list)."""
        self._toolset_tools = list(tools)
        self._republish()

    def replace_all(self, by_caller: dict[str, list[CallerToolSpec]], toolset_tools: list[ToolsetToolSpec]) -> None:
        """Replace everything at once (the configuration sent on each connect)."""
        self._caller_tools = {caller_id: list(tools) for caller_id, tools in by_caller.items() if tools}
        self._toolset_tools = list(toolset_tools)
        self._republish()

    def _publish_one(self, published: dict[str, PublishedTool], tool: PublishedTool | None) -> None:
        if tool is None:
            return
        if tool.name in published:
            log.warning("tool name %s is published twice; keeping the first", tool.name)
            return
        if len(tool.name) > CLAUDE_NAME_LIMIT:
            log.warning(
                "tool name %s is %d characters; the Claude API accepts at most %d (with the host's own prefix)",
                tool.name, len(tool.name), CLAUDE_NAME_LIMIT,
            )
        published[tool.name] = tool

    @staticmethod
    def _validator(name: str, schema: dict[str, Any]) -> Any:
        """The compiled input schema, or None (the tool is not published) when it is broken."""
        try:
            return compile_schema(schema)
        except InvalidSchema as exc:
            log.warning("tool %s is not published: %s", name, exc)
            return None

    def _caller_tool(self, caller_id: str, spec: CallerToolSpec) -> PublishedTool | None:
        name = f"{caller_id}_{spec.name}"
        schema = spec.inputSchema or DEFAULT_INPUT_SCHEMA
        validator = self._validator(name, schema)
        if validator is None:
            return None
        descriptor = caller_descriptor(name, caller_id, spec, schema)
        return PublishedTool(
            name=name, description=descriptor["description"], input_schema=schema, kind="caller",
            tool=spec.name, owner=caller_id, descriptor=descriptor,
            validator=validator, timeout_ms=spec.timeout_ms,
            approval_timeout_ms=spec.approval_timeout_ms if spec.requires_approval else None,
        )

    def _agent_name(self, spec: ToolsetToolSpec) -> str:
        """`<prefix><sep><tool>` with the agent's separator in place of the server's."""
        server_suffix = self.server_separator + spec.tool
        if not spec.name.endswith(server_suffix):
            return spec.name
        return spec.name[: len(spec.name) - len(server_suffix)] + self.separator + spec.tool

    def _toolset_tool(self, spec: ToolsetToolSpec) -> PublishedTool | None:
        name = self._agent_name(spec)
        schema = spec.inputSchema or DEFAULT_INPUT_SCHEMA
        validator = self._validator(name, schema)
        if validator is None:
            return None
        descriptor = (spec.descriptor or build_descriptor(
            name, description=spec.description, safety="runs on the host, outside the sandbox", input_schema=schema,
        )).to_dict()
        return PublishedTool(
            name=name, description=spec.description or descriptor["description"], input_schema=schema,
            kind="toolset", tool=spec.tool, owner=spec.toolset, descriptor={**descriptor, "name": name},
            validator=validator, approval_timeout_ms=spec.approval_timeout_ms, server_name=spec.name,
        )

    def _republish(self) -> None:
        published: dict[str, PublishedTool] = {}
        for caller_id in sorted(self._caller_tools):
            for spec in self._caller_tools[caller_id]:
                self._publish_one(published, self._caller_tool(caller_id, spec))
        for toolset_spec in self._toolset_tools:
            self._publish_one(published, self._toolset_tool(toolset_spec))
        if [(t.name, t.descriptor) for t in published.values()] == [
            (t.name, t.descriptor) for t in self._published.values()
        ]:
            self._published = published
            return
        self._published = published
        self.version += 1
        self._changed.set()
        self._changed = trio.Event()
