"""ToolRouter: one per agent session; routes `<prefix><sep><tool>` to the toolset bound to that prefix.

A published name is resolved through the map built when the list was
published, never by splitting strings alone, so prefixes and tool names may
contain the separator. The router spawns the per-session (factory) toolsets
it needs and stops exactly those when the session ends; shared (ref)
toolsets are never stopped by a session.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import attrs
import trio

from protocol import RelayError, build_descriptor, errors
from protocol.messages import UnavailableToolset
from protocol.schema_check import schema_problem

from .base import ToolResult, Toolset, ToolSpec
from .registry import ToolsetDefinition

log = logging.getLogger("oubliette.server.toolsets")

CLAUDE_NAME_LIMIT = 64


@attrs.define(eq=False)
class Binding:
    """A toolset bound into a router: its definition, the running toolset, and whether this router spawned it (and so stops it)."""

    definition: ToolsetDefinition
    toolset: Toolset
    spawned: bool


@attrs.define(frozen=True)
class PublishedToolsetTool:
    """One tool as a router publishes it: the prefixed name, the binding that answers it, and its spec."""

    name: str
    binding: Binding
    spec: ToolSpec

    def wire(self) -> dict[str, Any]:
        """The `toolsets_config` entry the client lists (with its tool descriptor)."""
        spec = self.spec
        definition = self.binding.definition
        timeout_ms = definition.approval_timeout_ms_for(spec.name)
        gated = {"approval_timeout_ms": timeout_ms} if definition.gates(spec.name) else {}
        return {
            **gated,
            "name": self.name,
            "toolset": self.binding.definition.id,
            "tool": spec.name,
            "description": spec.description,
            "inputSchema": spec.input_schema,
            "descriptor": build_descriptor(
                self.name, description=spec.description, command=spec.command or None, safety=spec.safety,
                input_schema=spec.input_schema, result_schema=spec.result_schema,
            ).to_dict(),
        }


class ToolRouter:
    """One agent session's toolsets: binds the allowed ones, publishes their tools, routes calls.

    Owns: the per-session toolsets it spawned from factories (stopped by `stop` or when a
    rebind drops them); never the shared ones. `references` counts the client connections
    sharing it.
    Raises: `call` raises `RelayError` (`NOT_FOUND` for an unknown name, `INVALID_PARAMS` for
    arguments that do not match the schema); a toolset that fails to start is logged, left out
    of `bind` and listed in `unavailable()` with the reason, as is a shared toolset the service
    could not start yet: a call of its prefix says so, not "not found".
    """

    def __init__(self, separator: str, label: str) -> None:
        self.separator = separator
        self.label = label
        self._bindings: dict[str, Binding] = {}
        self._published: dict[str, PublishedToolsetTool] = {}
        self._unavailable: dict[str, UnavailableToolset] = {}
        self._failed: dict[str, UnavailableToolset] = {}
        """Per-session toolsets whose factory failed at the last bind, by toolset id."""
        self._binding_lock = trio.Lock()
        self.references = 0

    @property
    def bindings(self) -> dict[str, Binding]:
        """A copy of the bound toolsets, by toolset id."""
        return dict(self._bindings)

    async def bind(self, definitions: list[ToolsetDefinition]) -> bool:
        """Make the bound toolsets exactly `definitions`; True if the published list changed."""
        async with self._binding_lock:
            return await self._bind(definitions)

    async def _bind(self, definitions: list[ToolsetDefinition]) -> bool:
        wanted = {d.id: d for d in definitions}
        for toolset_id, binding in list(self._bindings.items()):
            if wanted.get(toolset_id) is not binding.definition:
                del self._bindings[toolset_id]
                await self._release(binding)
        self._failed = {}
        for toolset_id, definition in wanted.items():
            if toolset_id not in self._bindings:
                try:
                    self._bindings[toolset_id] = await self._acquire(definition)
                except Exception as exc:
                    log.exception("%s: could not start toolset %s; it is left out", self.label, toolset_id)
                    self._failed[toolset_id] = UnavailableToolset(
                        toolset=toolset_id, prefix=definition.prefix, reason=f"{type(exc).__name__}: {exc}",
                    )
        return self._republish()

    async def _acquire(self, definition: ToolsetDefinition) -> Binding:
        if definition.factory is None:
            assert definition.ref is not None
            return Binding(definition, definition.ref, spawned=False)
        made = definition.factory()
        toolset = await made if inspect.isawaitable(made) else made
        log.info("%s: spawned toolset %s", self.label, definition.id)
        return Binding(definition, toolset, spawned=True)

    async def _release(self, binding: Binding) -> None:
        if binding.spawned:
            try:
                await binding.toolset.aclose()
            except Exception:
                log.exception("%s: toolset %s failed to stop", self.label, binding.definition.id)
            log.info("%s: stopped toolset %s", self.label, binding.definition.id)

    def _republish(self) -> bool:
        published: dict[str, PublishedToolsetTool] = {}
        for binding in self._bindings.values():
            for spec in binding.definition.tools:
                name = f"{binding.definition.prefix}{self.separator}{spec.name}"
                if name in published:
                    log.warning("%s: tool name %s is published twice; keeping the first", self.label, name)
                    continue
                if len(name) > CLAUDE_NAME_LIMIT:
                    log.warning(
                        "tool name %s is %d characters; the Claude API accepts at most %d (with the host's own prefix)",
                        name, len(name), CLAUDE_NAME_LIMIT,
                    )
                published[name] = PublishedToolsetTool(name, binding, spec)
        unavailable = dict(self._failed)
        for binding in self._bindings.values():
            definition = binding.definition
            if definition.unavailable is not None:
                unavailable[definition.id] = UnavailableToolset(
                    toolset=definition.id, prefix=definition.prefix, reason=definition.unavailable,
                )
        changed = (
            [p.wire() for p in published.values()] != [p.wire() for p in self._published.values()]
            or unavailable != self._unavailable
        )
        self._published = published
        self._unavailable = unavailable
        return changed

    def published(self) -> list[dict[str, Any]]:
        """The published tools as `toolsets_config` entries (with their tool descriptors)."""
        return [p.wire() for p in self._published.values()]

    def unavailable(self) -> list[dict[str, Any]]:
        """The allowed toolsets that could not start, as `toolsets_config`'s `unavailable` entries."""
        return [attrs.asdict(u) for u in self._unavailable.values()]

    def _not_found(self, name: str) -> RelayError:
        for unavailable in self._unavailable.values():
            if name.startswith(unavailable.prefix + self.separator):
                return RelayError(errors.NOT_FOUND, unavailable.message())
        for binding in self._bindings.values():
            if name.startswith(binding.definition.prefix + self.separator):
                return RelayError(
                    errors.NOT_FOUND, f"toolset '{binding.definition.id}' has no tool named '{name}'",
                )
        prefix = name.split(self.separator, 1)[0]
        return RelayError(errors.NOT_FOUND, f"Toolset not found: '{prefix}'")

    def toolset_of(self, name: str) -> str | None:
        """The id of the toolset that publishes `name` here, or None."""
        entry = self._published.get(name)
        return entry.binding.definition.id if entry is not None else None

    def checked(self, name: str, arguments: dict[str, Any]) -> PublishedToolsetTool:
        """The published tool `name`, once `arguments` match its schema (`RelayError` otherwise)."""
        entry = self._published.get(name)
        if entry is None:
            raise self._not_found(name)
        problem = schema_problem(entry.spec.input_schema, arguments, f"invalid arguments for {name}")
        if problem:
            raise RelayError(errors.INVALID_PARAMS, problem)
        return entry

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        """Route a published name to its toolset with the prefix stripped."""
        entry = self.checked(name, arguments)
        result = await entry.binding.toolset.call(entry.spec.name, arguments)
        if result.is_error:
            return result
        if entry.spec.result_schema is not None:
            problem = schema_problem(entry.spec.result_schema, result.result, f"the result of {name} does not match its result_schema")
            if problem:
                return ToolResult.failure(problem)
        return result

    async def stop(self) -> None:
        """The session ended: stop the toolsets it spawned (not the shared ones)."""
        async with self._binding_lock:
            bindings, self._bindings = list(self._bindings.values()), {}
            self._published = {}
            for binding in bindings:
                await self._release(binding)
