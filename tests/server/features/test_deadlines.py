"""Every call out of the server has a deadline, and the waiting side sees a clear outcome when it passes.

- a start command (wake on message) that does not connect its guest in time is stopped and logged,
  and the next message may start the instance again;
- a call to an MCP toolset that does not answer within its call timeout gives the agent a tool error.

(The relay peer's request and write deadlines are tested in tests/protocol/test_peer.py.)
"""

from __future__ import annotations

import logging
import os
import sys
import textwrap
from pathlib import Path

import pytest
import trio

from oubliette_server.features.guests import InstanceStarter
from oubliette_server.features.toolsets import McpToolset

from harness import fresh_dir

HANGING_MCP_SERVER = textwrap.dedent('''
    """A stdio MCP server whose `hang` tool never answers and whose `quick` tool does."""
    from typing import Any

    import mcp_types as types
    import trio
    from mcp.server import Server

    async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[
            types.Tool(name="hang", description="never answers", input_schema={"type": "object"}),
            types.Tool(name="quick", description="answers", input_schema={"type": "object"}),
        ])

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        if params.name == "hang":
            await trio.sleep_forever()
        return types.CallToolResult(content=[types.TextContent(text="done")])

    async def main() -> None:
        import mcp.server.stdio
        server = Server("hanging", version="0.1.0", on_list_tools=list_tools, on_call_tool=call_tool)
        async with mcp.server.stdio.stdio_server() as (read_stream, write_stream):
            await server.run(read_stream, write_stream, server.create_initialization_options())

    trio.run(main)
''')


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_a_start_command_that_connects_no_guest_is_stopped_at_its_deadline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pid_file = fresh_dir() / "pid"
    command = ["sh", "-c", f"echo $$ > {pid_file}; exec sleep 1000"]
    failures: list[tuple[str, str]] = []
    failed = trio.Event()

    def on_start_failed(instance: str, reason: str) -> None:
        failures.append((instance, reason))
        failed.set()

    starter = InstanceStarter(
        lambda instance: command, lambda instance: "token", "unix:/nonexistent.sock",
        lambda instance: False, start_grace=1.0, on_start_failed=on_start_failed,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(starter.serve)
        with caplog.at_level(logging.ERROR, logger="oubliette.server.wake"):
            assert starter.wake("box1") is True
            assert starter.wake("box1") is False, "a second message does not start it again while it starts"
            with trio.fail_after(10):
                await failed.wait()
        assert failures == [("box1", "the guest of box1 did not connect within 1 s of its start command")]
        assert any("did not connect within 1 s" in r.getMessage() for r in caplog.records), caplog.text
        assert not _alive(int(pid_file.read_text())), "the command was terminated (and reaped) at the deadline"
        assert starter.wake("box1") is True, "after the deadline the next message starts it again"
        assert starter.starts["box1"] == 2
        nursery.cancel_scope.cancel()


async def test_a_start_command_whose_guest_connects_keeps_running_past_the_deadline() -> None:
    """No sleeping to show no failure came: a second instance started just after, whose guest never
    connects, is stopped at the same deadline; once its failure is reported, the first one's deadline
    has passed too and its command still runs."""
    pid_file = fresh_dir() / "pid"
    commands = {"box1": ["sh", "-c", f"echo $$ > {pid_file}; exec sleep 1000"], "box2": ["sleep", "1000"]}
    failures: list[str] = []
    control_failed = trio.Event()

    def on_start_failed(instance: str, reason: str) -> None:
        failures.append(instance)
        if instance == "box2":
            control_failed.set()

    starter = InstanceStarter(
        commands.__getitem__, lambda instance: "token", "unix:/nonexistent.sock",
        lambda instance: False, start_grace=0.5, on_start_failed=on_start_failed,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(starter.serve)
        starter.wake("box1")
        starter.guest_connected("box1")  # its guest runtime said hello
        starter.wake("box2")  # the control: no hello
        with trio.fail_after(10):
            await control_failed.wait()
        assert failures == ["box2"], "a start command whose guest is up is the guest: it keeps running"
        assert _alive(int(pid_file.read_text())), "and it was not stopped"
        nursery.cancel_scope.cancel()


async def test_an_mcp_toolset_call_past_its_timeout_is_a_tool_error_and_the_toolset_keeps_serving() -> None:
    script = Path(fresh_dir()) / "hanging_server.py"
    script.write_text(HANGING_MCP_SERVER)
    async with trio.open_nursery() as nursery:
        toolset = McpToolset("slow", sys.executable, [str(script)], nursery=nursery, call_timeout=0.5)
        tools = await toolset.start()
        assert sorted(t.name for t in tools) == ["hang", "quick"]
        with trio.fail_after(10):
            outcome = await toolset.call("hang", {})
        assert outcome.is_error
        assert outcome.error == "MCP toolset 'slow' did not answer 'hang' within 0.5 s (its call timeout)"
        with trio.fail_after(10):
            quick = await toolset.call("quick", {})
        assert not quick.is_error, quick.error
        await toolset.aclose()
