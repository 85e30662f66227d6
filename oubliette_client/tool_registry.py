"""The tools the agent sees, and the map from each published name to where it goes.

Caller tools are published as `{caller_id}_{tool}`. A published name is
resolved through the map built when the list was published, never by
splitting the string, so ids and names may contain `_` freely. Each change
bumps `version` and wakes `changed` waiters, who tell the agent.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs
import jsonschema
import trio

from protocol import CallerToolSpec

log = logging.getLogger("oubliette.client.tools")

CLAUDE_NAME_LIMIT = 64
DEFAULT_INPUT_SCHEMA: dict[str, Any] = {"type": "object"}


@attrs.define(frozen=True)
class PublishedTool:
    name: str
    description: str
    input_schema: dict[str, Any]
    kind: str  # "caller"
    caller_id: str
    tool: str
    validator: Any = attrs.field(eq=False, repr=False)

    def validation_error(self, arguments: dict[str, Any]) -> str | None:
        error = jsonschema.exceptions.best_match(self.validator.iter_errors(arguments))
        if error is None:
            return None
        where = "/".join(str(p) for p in error.absolute_path)
        return f"invalid arguments for {self.name}{' at ' + where if where else ''}: {error.message}"


def _validator_for(schema: dict[str, Any]) -> Any:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    cls.check_schema(schema)
    return cls(schema)


class ToolRegistry:
    def __init__(self) -> None:
        self._caller_tools: dict[str, list[CallerToolSpec]] = {}
        self._published: dict[str, PublishedTool] = {}
        self.version = 0
        self._changed = trio.Event()

    @property
    def tools(self) -> list[PublishedTool]:
        return list(self._published.values())

    def resolve(self, name: str) -> PublishedTool | None:
        return self._published.get(name)

    async def wait_changed(self, seen_version: int) -> int:
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

    def replace_caller_tools(self, by_caller: dict[str, list[CallerToolSpec]]) -> None:
        """Replace every caller's tools at once (the configuration sent on each connect)."""
        self._caller_tools = {caller_id: list(tools) for caller_id, tools in by_caller.items() if tools}
        self._republish()

    def _republish(self) -> None:
        published: dict[str, PublishedTool] = {}
        for caller_id in sorted(self._caller_tools):
            for spec in self._caller_tools[caller_id]:
                name = f"{caller_id}_{spec.name}"
                if name in published:
                    log.warning("tool name %s is published twice; keeping the first", name)
                    continue
                schema = spec.inputSchema or DEFAULT_INPUT_SCHEMA
                try:
                    validator = _validator_for(schema)
                except jsonschema.SchemaError as exc:
                    log.warning("caller tool %s has an invalid inputSchema (%s); not published", name, exc.message)
                    continue
                if len(name) > CLAUDE_NAME_LIMIT:
                    log.warning(
                        "tool name %s is %d characters; the Claude API accepts at most %d (with the host's own prefix)",
                        name, len(name), CLAUDE_NAME_LIMIT,
                    )
                published[name] = PublishedTool(
                    name=name, description=spec.description or f"{spec.name} (from caller {caller_id})",
                    input_schema=schema, kind="caller", caller_id=caller_id, tool=spec.name, validator=validator,
                )
        if published.keys() == self._published.keys() and all(
            published[n].input_schema == self._published[n].input_schema
            and published[n].description == self._published[n].description
            for n in published
        ):
            self._published = published
            return
        self._published = published
        self.version += 1
        self._changed.set()
        self._changed = trio.Event()
