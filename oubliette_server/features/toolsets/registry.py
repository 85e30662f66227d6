"""The toolset registry: definitions (id, prefix, tools, factory or shared ref) and per-instance allowlists.

The allowlist of an instance is empty by default: an agent sees no toolset
until it is allowed (docs/TOOLSETS.md).
"""

from __future__ import annotations

import logging
import re

import attrs

from .base import Toolset, ToolsetFactory, ToolSpec

log = logging.getLogger("oubliette.server.toolsets")

PREFIX_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
TOOL_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


@attrs.define(eq=False)
class ToolsetDefinition:
    """A registered toolset: id, prefix, tools, and exactly one of `factory` (one per session) or `ref` (shared)."""

    id: str
    prefix: str
    tools: list[ToolSpec]
    factory: ToolsetFactory | None = None
    ref: Toolset | None = None
    kind: str = "code"
    requires_approval: bool | frozenset[str] = False
    """True: every tool is gated; a set: those tools are (by their own names). See `gates`."""
    approval_timeout_ms: int | None = None
    """How long a gated call waits for its decision (the clients add it to their deadline)."""
    approval_timeouts_ms: dict[str, int] = attrs.field(factory=dict)
    """Per tool (its own name), overriding `approval_timeout_ms`."""
    unavailable: str | None = None
    """Why the toolset could not start (it has no tools while this is set; the service keeps
    trying to start it); None for a toolset that runs."""

    @property
    def per_session(self) -> bool:
        """True when each agent session gets its own toolset from `factory`."""
        return self.factory is not None

    def gates(self, tool: str) -> bool:
        """Whether a call of `tool` (its own name) waits for the owning caller's approval first."""
        if isinstance(self.requires_approval, frozenset):
            return tool in self.requires_approval
        return bool(self.requires_approval)

    def approval_timeout_ms_for(self, tool: str) -> int | None:
        """How long a call of `tool` (its own name) waits for its decision; None for a tool that is not gated."""
        if not self.gates(tool):
            return None
        return self.approval_timeouts_ms.get(tool, self.approval_timeout_ms)


class ToolsetRegistry:
    """The registered toolset definitions and, per instance, which of them its agents may see.

    Owns: only in-memory state; it starts and stops nothing (routers and the service do).
    Raises: `ValueError` for a bad or conflicting registration or an unknown allowed id,
    `KeyError` from `unregister` for an unknown id.
    """

    def __init__(self) -> None:
        self._definitions: dict[str, ToolsetDefinition] = {}
        self._allowed: dict[str, list[str]] = {}

    @property
    def definitions(self) -> dict[str, ToolsetDefinition]:
        """A copy of the registered definitions, by id."""
        return dict(self._definitions)

    def register(self, definition: ToolsetDefinition) -> None:
        """Add a definition; `ValueError` unless it has exactly one of factory/ref, valid names and a free id and prefix."""
        if (definition.factory is None) == (definition.ref is None):
            raise ValueError(f"toolset {definition.id!r}: give exactly one of factory= or ref=")
        if not PREFIX_PATTERN.match(definition.prefix):
            raise ValueError(f"toolset {definition.id!r}: prefix {definition.prefix!r} must be 1-64 of A-Z a-z 0-9 _ . -")
        if definition.id in self._definitions:
            raise ValueError(f"a toolset with id {definition.id!r} is already registered")
        for other in self._definitions.values():
            if other.prefix == definition.prefix:
                raise ValueError(f"prefix {definition.prefix!r} is already used by toolset {other.id!r}")
        for tool in definition.tools:
            if not TOOL_NAME_PATTERN.match(tool.name):
                raise ValueError(f"toolset {definition.id!r}: tool name {tool.name!r} must be 1-128 of A-Z a-z 0-9 _ . -")
        if isinstance(definition.requires_approval, frozenset):
            missing = sorted(definition.requires_approval - {tool.name for tool in definition.tools})
            if missing:  # an MCP server may add them later; the gate holds whenever they appear
                log.warning("toolset %s: requires_approval names tools it does not have (yet): %s",
                            definition.id, ", ".join(missing))
        self._definitions[definition.id] = definition
        log.info("toolset %s registered (prefix %r, %d tools)", definition.id, definition.prefix, len(definition.tools))

    def unregister(self, toolset_id: str) -> ToolsetDefinition:
        """Remove and return the definition `toolset_id`; `KeyError` if there is none. Allowlists keep the id (ignored while unregistered)."""
        definition = self._definitions.pop(toolset_id, None)
        if definition is None:
            raise KeyError(f"no toolset with id {toolset_id!r}")
        return definition

    def set_allowed(self, instance: str, toolset_ids: list[str]) -> None:
        """Replace the instance's allowlist; `ValueError` naming any id that is not registered."""
        unknown = [t for t in toolset_ids if t not in self._definitions]
        if unknown:
            raise ValueError(f"unknown toolset id(s): {', '.join(unknown)}")
        self._allowed[instance] = list(dict.fromkeys(toolset_ids))

    def allowed_ids(self, instance: str) -> list[str]:
        """The instance's allowlist as set (empty by default)."""
        return list(self._allowed.get(instance, []))

    def allowed_definitions(self, instance: str) -> list[ToolsetDefinition]:
        """The registered definitions the instance may see, in allowlist order."""
        return [self._definitions[i] for i in self._allowed.get(instance, []) if i in self._definitions]
