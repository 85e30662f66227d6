"""The action-contract face of the client (docs/TOOLSETS.md): for agents that do not speak MCP.

`oubliette-client endpoint` reads one request per line on stdin —
`list_tools`, `describe_tool`, `call_tool` — and writes one response line per
request, over the same relay and with the same tools as the stdio MCP server:
a shell script, or anything that takes an `MCP_ENDPOINT` command, can use
every tool its sandbox may use. A request or `arguments` that is not a JSON
object is refused before anything is sent. `oubliette-client tools …` is the
same for people, one action per run.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import trio

from protocol import read_lines
from protocol.descriptors import (
    ActionError,
    ActionRequest,
    call_tool_response,
    describe_tool_response,
    list_tools_response,
    parse_action_line,
)

from .sandbox_tools import SandboxTools
from .relay_link import RelayUnavailable
from .settings import RelaySettings

COMPONENT = "oubliette-client"
DEFAULT_CONNECT_WAIT = 5.0


class ActionEndpoint:
    """The action contract (`list_tools`, `describe_tool`, `call_tool`) over this sandbox's relay.

    Owns: a `SandboxTools` (its registry and `RelayLink`); the link runs only inside `run`.
    Needs: `RelaySettings`; call `run(fn)` so the link is up while `fn` uses the endpoint.
    Raises: nothing from `handle`/`handle_line`: every failure is an error envelope.
    """

    def __init__(
        self, settings: RelaySettings, *, connect_wait: float = DEFAULT_CONNECT_WAIT, require_connection: bool = False,
    ) -> None:
        self.tools = SandboxTools(settings)
        self.connect_wait = connect_wait
        self.require_connection = require_connection
        """Fail `run` with `RelayUnavailable` instead of answering errors when the relay is not up in time."""
        self.tools.link.report_failures = not require_connection  # the failure is reported once, by the caller

    async def handle(self, request: ActionRequest) -> dict[str, Any]:
        """Answer one parsed request; failures come back as the error envelope."""
        try:
            return await self._handle(request)
        except ActionError as err:
            return err.envelope()

    async def _handle(self, request: ActionRequest) -> dict[str, Any]:
        registry = self.tools.registry
        if request.action == "list_tools":
            return list_tools_response([tool.descriptor for tool in registry.tools])
        assert request.tool is not None
        tool = registry.resolve(request.tool)
        if tool is None:
            raise ActionError(COMPONENT, "not_found", self.tools.unknown_tool_text(request.tool))
        if request.action == "describe_tool":
            return describe_tool_response(tool.descriptor)
        outcome = await self.tools.call(request.tool, request.arguments or {})
        if outcome.is_error:
            raise ActionError(COMPONENT, outcome.category, outcome.error or "failed")
        result = outcome.result if outcome.result is not None or not outcome.content else {"content": outcome.content}
        return call_tool_response(request.tool, result)

    async def handle_line(self, line: str | bytes) -> dict[str, Any]:
        """Parse one request line and answer it; a line that is not a valid request gets the error envelope."""
        try:
            request = parse_action_line(line, component=COMPONENT)
        except ActionError as err:
            return err.envelope()
        return await self.handle(request)

    async def run(self, fn: Any) -> Any:
        """Run `fn(self)` with the relay link up (or given up on after `connect_wait`).

        Raises: `RelayUnavailable` (one line saying why) with `require_connection` when the
        relay is unreachable for `connect_wait` seconds or refuses this instance.
        """
        link = self.tools.link
        failure: str | None = None
        async with trio.open_nursery() as nursery:
            await nursery.start(link.run)
            with trio.move_on_after(self.connect_wait):
                await (link.wait_settled() if self.require_connection else link.wait_connected())
            if self.require_connection and not link.connected:
                failure = link.failure_line(waited=self.connect_wait)
                nursery.cancel_scope.cancel()
            else:
                try:
                    return await fn(self)
                finally:
                    nursery.cancel_scope.cancel()
        raise RelayUnavailable(failure)


async def serve_stdin(endpoint: ActionEndpoint) -> None:
    """One response line per request line, until stdin ends."""
    stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    out = trio.lowlevel.FdStream(os.dup(sys.stdout.fileno()))
    try:
        async for line in read_lines(stdin):
            if not line.strip():
                continue
            response = await endpoint.handle_line(line)
            await out.send_all(json.dumps(response, ensure_ascii=False).encode() + b"\n")
    finally:
        await out.aclose()
        await stdin.aclose()


def run_endpoint(settings: RelaySettings, connect_wait: float) -> int:
    """The `endpoint` command: answer stdin's request lines on stdout until stdin ends; returns 0.

    Needs: no running trio loop (it calls `trio.run`). Raises: `RelayUnavailable` when the relay
    cannot be reached within `connect_wait` or refuses this instance (the CLI: one line, exit 1).
    """
    endpoint = ActionEndpoint(settings, connect_wait=connect_wait, require_connection=True)
    trio.run(endpoint.run, serve_stdin)
    return 0


def run_tools_command(settings: RelaySettings, connect_wait: float, words: list[str]) -> int:
    """`tools list`, `tools describe NAME`, `tools call NAME JSON`: print the response, exit 1 on an error.

    Raises: `RelayUnavailable` as `run_endpoint` does.
    """
    usage = "usage: oubliette-client tools list | describe NAME | call NAME JSON"
    if not words or words[0] not in ("list", "describe", "call"):
        print(usage, file=sys.stderr)
        return 2
    action = {"list": "list_tools", "describe": "describe_tool", "call": "call_tool"}[words[0]]
    request: dict[str, Any] = {"action": action}
    if action != "list_tools":
        if len(words) < 2:
            print(usage, file=sys.stderr)
            return 2
        request["tool"] = words[1]
    if action == "call_tool":
        if len(words) != 3:
            print(usage, file=sys.stderr)
            return 2
        try:
            request["arguments"] = json.loads(words[2])
        except json.JSONDecodeError as exc:
            # the person's own typo: a usage error, said on stderr (stdout is for the answer)
            print(f"oubliette-client tools: error: arguments are not valid JSON: {exc} (see --help)", file=sys.stderr)
            return 2
    endpoint = ActionEndpoint(settings, connect_wait=connect_wait, require_connection=True)

    async def once(ep: ActionEndpoint) -> dict[str, Any]:
        return await ep.handle_line(json.dumps(request))

    response = trio.run(endpoint.run, once)
    # one line, as the endpoint answers and as the README shows it (`| python3 -m json.tool` to indent)
    print(json.dumps(response, ensure_ascii=False))
    return 0 if response.get("type") == "result" else 1
