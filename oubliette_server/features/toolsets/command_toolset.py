"""A toolset backed by a command that speaks the action contract on stdin/stdout.

Each action runs the command once: one JSON request line in, one JSON response
line out (`{"type": "result", …}` or the error envelope). Discovery
(`list_tools`) happens at registration; when it fails, the failure is logged
and the toolset is registered with no tools, so the rest of the catalog keeps
working.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
from typing import Any

import trio

from protocol.descriptors import ActionError, parse_action_response

from .base import ToolResult, Toolset, ToolSpec

log = logging.getLogger("oubliette.server.toolsets.command")

DEFAULT_TIMEOUT = 30.0


def command_list(command: str | list[str]) -> list[str]:
    """The argv of `command`: a string is split the way a shell would (`shlex`), a list is kept."""
    return shlex.split(command) if isinstance(command, str) else [str(part) for part in command]


class CommandToolset(Toolset):
    """A toolset backed by a host command speaking the action contract: one process per action.

    Owns: each action's process, for the action only (killed at `timeout`, 30 s by default).
    Needs: nothing running; `discover()` once to learn the tools.
    Raises: `ValueError` from the constructor when the command is empty; `discover` and `call`
    raise nothing: failures are logged (no tools) or returned as `ToolResult.failure`.
    """

    def __init__(
        self,
        toolset_id: str,
        command: str | list[str],
        *,
        timeout: float = DEFAULT_TIMEOUT,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> None:
        self.id = toolset_id
        self.command = command_list(command)
        self.env = {**os.environ, **env} if env else None
        self.cwd = cwd
        if not self.command:
            raise ValueError(f"command toolset {toolset_id!r} needs a command")
        self.timeout = timeout

    async def _request(self, request: dict[str, Any]) -> dict[str, Any]:
        """Run the endpoint for one action; raise ActionError for any failure, with its own text."""
        line = json.dumps(request) + "\n"
        try:
            with trio.fail_after(self.timeout):
                done = await trio.run_process(
                    self.command, stdin=line.encode(), capture_stdout=True, capture_stderr=True, check=False,
                    env=self.env, cwd=self.cwd,
                )
        except trio.TooSlowError:
            raise ActionError(self.id, "pipeline", f"endpoint did not answer within {self.timeout:g} s") from None
        except OSError as exc:
            raise ActionError(self.id, "fatal", f"cannot run endpoint {self.command[0]}: {exc.strerror or exc}") from None
        output = done.stdout.decode(errors="replace").strip().splitlines()
        if not output:
            stderr = done.stderr.decode(errors="replace").strip()[-500:]
            raise ActionError(
                self.id, "pipeline", f"endpoint exited with status {done.returncode} and no response"
                + (f": {stderr}" if stderr else ""),
            )
        try:
            response = json.loads(output[0])
        except json.JSONDecodeError as exc:
            raise ActionError(self.id, "pipeline", f"endpoint answered with invalid JSON: {exc}") from None
        return parse_action_response(response, component=self.id)

    async def discover(self) -> list[ToolSpec]:
        """`list_tools`, tolerating failure (logged; no tools)."""
        try:
            response = await self._request({"action": "list_tools"})
        except ActionError as err:
            log.warning("discovery of command toolset %s failed (%s: %s); it has no tools for now", self.id, err.category, err.message)
            return []
        specs = []
        for descriptor in response.get("tools", []):
            try:
                specs.append(ToolSpec(
                    name=descriptor["name"], description=descriptor.get("description", ""),
                    input_schema=descriptor.get("input_schema") or {"type": "object"},
                    result_schema=descriptor.get("result_schema"),
                    safety=descriptor.get("safety") or f"runs the host command {self.command[0]}",
                    command=descriptor.get("command"),
                ))
            except (KeyError, TypeError):
                log.warning("command toolset %s listed a malformed descriptor %r; skipped", self.id, descriptor)
        return specs

    async def call(self, tool: str, arguments: dict[str, Any]) -> ToolResult:
        """Run the command once with a `call_tool` request; a timeout, a crash or an error envelope is a failure.

        Cancellation: the process is killed (by `trio.run_process`).
        """
        if not isinstance(arguments, dict):
            return ToolResult.failure("arguments must be a JSON object")
        try:
            response = await self._request({"action": "call_tool", "tool": tool, "arguments": arguments})
        except ActionError as err:
            return ToolResult.failure(f"{err.name} ({err.category}): {err.message}")
        return ToolResult.ok(response.get("result"))
