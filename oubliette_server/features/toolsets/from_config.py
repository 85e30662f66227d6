"""Toolsets and allowlists declared in the config file ([toolsets.ID] and [allowlists])."""

from __future__ import annotations

import logging
from typing import Any, Protocol

import attrs

from ...core.toml_types import wrong_type
from .command_toolset import command_list

log = logging.getLogger("oubliette.server.toolsets")

KINDS = ("command", "mcp")


@attrs.define(frozen=True)
class ToolsetEntry:
    """One `[toolsets.ID]` table of the config file, checked: kind, prefix, command and its options."""

    id: str
    kind: str
    prefix: str
    command: str | list[str]
    args: list[str] = attrs.field(factory=list)
    env: dict[str, str] | None = None
    cwd: str | None = None
    roots: list[str] = attrs.field(factory=list)
    timeout: float | None = None
    requires_approval: bool | list[str] = False
    """true gates every tool of the toolset; a list gates those tools (their own names)."""
    approval_timeout: float | dict[str, float] | None = None
    """Seconds a gated call waits for its decision: one number, or a table of tool names to seconds."""


def parse_toolsets(tables: Any, where: str) -> list[ToolsetEntry]:
    """Check the [toolsets.*] tables and turn them into entries, with errors naming the key."""
    if not isinstance(tables, dict):
        raise ValueError(f"{where}: [toolsets] must be a table of tables")
    entries = []
    allowed_keys = {"kind", "prefix", "command", "args", "env", "cwd", "roots", "timeout", "requires_approval", "approval_timeout"}
    for toolset_id, table in tables.items():
        here = f"{where}: [toolsets.{toolset_id}]"
        if not isinstance(table, dict):
            raise ValueError(f"{here} must be a table")
        unknown = set(table) - allowed_keys
        if unknown:
            raise ValueError(f"{here}: unknown key(s) {', '.join(sorted(unknown))}")
        kind = table.get("kind")
        if kind not in KINDS:
            raise ValueError(f"{here}: kind must be one of {', '.join(KINDS)}")
        prefix = table.get("prefix")
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"{here}: prefix is required (a string)")
        command = table.get("command")
        if kind == "mcp" and not isinstance(command, str):
            raise ValueError(f"{here}: command must be the server's executable (a string); put its arguments in args")
        if not (isinstance(command, str) and command) and not (isinstance(command, list) and command):
            raise ValueError(f"{here}: command is required (a string or a list)")
        if kind == "command" and "roots" in table:
            raise ValueError(f"{here}: roots apply to MCP toolsets only")
        for key, expected in (("args", list), ("env", dict), ("cwd", str), ("roots", list), ("timeout", (int, float))):
            problem = wrong_type(key, table[key], expected) if key in table else None
            if problem:
                raise ValueError(f"{here}: {problem}")
        gate = table.get("requires_approval", False)
        if not isinstance(gate, bool) and not (isinstance(gate, list) and all(isinstance(t, str) and t for t in gate)):
            raise ValueError(f"{here}: requires_approval must be true, false or a list of tool names")
        approval_timeout = table.get("approval_timeout")
        if approval_timeout is not None and not _seconds(approval_timeout) and not (
            isinstance(approval_timeout, dict) and approval_timeout and all(map(_seconds, approval_timeout.values()))
        ):
            raise ValueError(
                f"{here}: approval_timeout must be a positive number of seconds, or a table of tool names to seconds"
            )
        entries.append(ToolsetEntry(
            id=toolset_id, kind=kind, prefix=prefix, command=command,
            args=[str(a) for a in table.get("args", [])],
            env={str(k): str(v) for k, v in table["env"].items()} if "env" in table else None,
            cwd=table.get("cwd"), roots=[str(r) for r in table.get("roots", [])],
            timeout=float(table["timeout"]) if "timeout" in table else None,
            requires_approval=gate,
            approval_timeout=dict(approval_timeout) if isinstance(approval_timeout, dict) else approval_timeout,
        ))
    return entries


def _seconds(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")


class ToolsetRegistrar(Protocol):
    """What registering configured toolsets needs (the server, or its toolset service)."""

    async def register_mcp_toolset(
        self, toolset_id: str, prefix: str, command: str, args: list[str] | None = ...,
        env: dict[str, str] | None = ..., cwd: str | None = ..., roots: list[str] | None = ...,
        *, call_timeout: float | None = ..., requires_approval: bool | list[str] = ...,
        approval_timeout: float | dict[str, float] | None = ..., keep_trying: bool = ...,
    ) -> Any:
        """Start and register a shared stdio MCP toolset (see `ToolsetService.register_mcp_toolset`)."""

    async def register_command_toolset(
        self, toolset_id: str, prefix: str, command: str | list[str], *,
        timeout: float | None = ..., env: dict[str, str] | None = ..., cwd: str | None = ...,
        requires_approval: bool | list[str] = ...,
        approval_timeout: float | dict[str, float] | None = ...,
    ) -> Any:
        """Register an action-contract command toolset (see `ToolsetService.register_command_toolset`)."""

    async def update_allowed_toolsets(self, instance: str, toolset_ids: list[str]) -> None:
        """Set the toolsets an instance's agents see (see `ToolsetService.update_allowed_toolsets`)."""


def parse_allowlists(table: Any, where: str) -> dict[str, list[str]]:
    """Check the `[allowlists]` table: instance id -> list of toolset ids.

    Raises: `ValueError` naming `where` and the offending key.
    """
    if not isinstance(table, dict):
        raise ValueError(f"{where}: [allowlists] must map instance ids to lists of toolset ids")
    result = {}
    for instance, ids in table.items():
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise ValueError(f"{where}: [allowlists] {instance} must be a list of toolset ids")
        result[instance] = list(ids)
    return result


async def register_from_config(
    server: ToolsetRegistrar, toolsets: list[ToolsetEntry], allowlists: dict[str, list[str]]
) -> None:
    """Register every configured toolset. An MCP toolset that cannot start stays registered as
    unavailable (the agents it is allowed to are told why) and is started again with backoff;
    a toolset whose registration is refused (a bad prefix, an id in use) is logged and left out."""
    registered = set()
    for entry in toolsets:
        try:
            if entry.kind == "mcp":
                assert isinstance(entry.command, str)
                await server.register_mcp_toolset(
                    entry.id, entry.prefix, entry.command, entry.args, entry.env, entry.cwd, entry.roots,
                    call_timeout=entry.timeout, requires_approval=entry.requires_approval,
                    approval_timeout=entry.approval_timeout, keep_trying=True,
                )
            else:
                command = [*command_list(entry.command), *entry.args]
                await server.register_command_toolset(
                    entry.id, entry.prefix, command, timeout=entry.timeout, env=entry.env, cwd=entry.cwd,
                    requires_approval=entry.requires_approval, approval_timeout=entry.approval_timeout,
                )
            registered.add(entry.id)
        except Exception as exc:
            log.error("toolset %s from the config file could not be registered: %s", entry.id, exc)
    for instance, ids in allowlists.items():
        kept = [i for i in ids if i in registered]
        missing = [i for i in ids if i not in registered]
        if missing:
            log.warning("allowlist of %s names toolsets that are not registered: %s", instance, ", ".join(missing))
        await server.update_allowed_toolsets(instance, kept)
