"""Toolsets end to end (integration tests), with the real programs.

oubliette-server is started as the caller's stdio MCP server with a TOML config
(`--config`) that declares a command toolset (`examples/mcp_echo.py`, the action contract's
reference endpoint) and an MCP toolset (`mcp-server-time`, a reference MCP
server from the MCP project), and per-instance allowlists. The agent is the
SDK's MCP client spawning the real `oubliette-client`.

Allowlists have no runtime CLI or MCP surface, so the tests of list changes run
the server in the test's own Trio loop (README.md, "Embedding") and change the
allowlist through `update_allowed_toolsets`, with the real `oubliette-client`
as the agent's stdio MCP server.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
import trio
from mcp.client.subscriptions import ToolsListChanged

from harness import Deployment, ListChanged, PYTHON, structured, text_of

pytestmark = pytest.mark.in_process
from oubliette_server.program.app import OublietteServer
from oubliette_server.features.toolsets import FunctionToolset, ToolSpec
from toolset_configs import agent_token, tool_names, write_config

DESCRIPTOR_META_KEY = "oubliette/descriptor"
EVENT_BOUND = 20.0
ECHO_ENDPOINT = str(Path(__file__).resolve().parents[2] / "examples" / "mcp_echo.py")

ECHO_INPUT_SCHEMA = {
    "type": "object",
    "properties": {"message": {"type": "string"}},
    "required": ["message"],
    "additionalProperties": False,
}
ECHO_RESULT_SCHEMA = {
    "type": "object",
    "properties": {"echo": {"type": "string"}},
    "required": ["echo"],
}
TOOLSET_TOOLS = {"ext.echo_external", "time.get_current_time", "time.convert_time"}

NOTIFY = {
    "name": "send_notification",
    "description": "Send notification",
    "inputSchema": {"type": "object", "properties": {"message": {"type": "string"}}, "required": ["message"]},
}


EXT = {"kind": "command", "prefix": "ext", "command": [PYTHON, ECHO_ENDPOINT], "timeout": 30}
TIME = {"kind": "mcp", "prefix": "time", "command": PYTHON, "args": ["-m", "mcp_server_time", "--local-timezone", "UTC"]}


def standard_config(deployment: Deployment, separator: str | None = None) -> Path:
    return write_config(deployment, {"ext": EXT, "time": TIME}, {"box1": ["ext", "time"]}, separator)


# -- 8. several toolsets, prefixed, with descriptors ------------------------------------------


@pytest.mark.real_programs
async def test_toolsets_are_advertised_with_prefixed_names_and_descriptors(deployment: Deployment) -> None:
    async with deployment.caller("--config", str(standard_config(deployment))):
        async with deployment.agent("box1", "mcp:s1", token=agent_token(deployment, "box1")) as agent:
            listing = await agent.list_tools()
            echoed = await agent.call_tool("ext.echo_external", {"message": "from the sandbox"})
    tools = {tool.name: tool for tool in listing.tools}
    assert tool_names(listing) == TOOLSET_TOOLS

    echo = tools["ext.echo_external"]
    assert echo.description == "Echo a message back from outside the sandbox"
    assert echo.input_schema == ECHO_INPUT_SCHEMA
    descriptor = (echo.meta or {})[DESCRIPTOR_META_KEY]
    assert descriptor["name"] == "ext.echo_external"
    assert descriptor["origin"] == "remote"
    assert descriptor["input_schema"] == ECHO_INPUT_SCHEMA
    assert descriptor["result_schema"] == ECHO_RESULT_SCHEMA
    assert descriptor["safety"] == "read-only; no side effects"
    assert descriptor["command"] == "echo_external --message TEXT"
    assert descriptor["description"] == echo.description

    for name in ("time.get_current_time", "time.convert_time"):
        descriptor = (tools[name].meta or {})[DESCRIPTOR_META_KEY]
        assert descriptor["name"] == name
        assert descriptor["origin"] == "remote"
        assert descriptor["input_schema"] == tools[name].input_schema
        assert descriptor["input_schema"]["type"] == "object"
        assert descriptor["safety"] and descriptor["command"] and descriptor["description"]
    current = (tools["time.get_current_time"].meta or {})[DESCRIPTOR_META_KEY]
    assert tools["time.get_current_time"].input_schema["required"] == ["timezone"]
    assert {"timezone", "datetime", "is_dst"} <= set(current["result_schema"]["properties"]), \
        "the MCP server's outputSchema is the descriptor's result_schema"

    assert not echoed.is_error, text_of(echoed)
    assert structured(echoed) == {"echo": "from the sandbox"}


# -- 9. a real third-party MCP server as a toolset -------------------------------------------


@pytest.mark.real_programs
async def test_mcp_toolset_is_called_with_its_prefixed_name(deployment: Deployment) -> None:
    async with deployment.caller("--config", str(standard_config(deployment))):
        async with deployment.agent("box1", "mcp:s1", token=agent_token(deployment, "box1")) as agent:
            now = await agent.call_tool("time.get_current_time", {"timezone": "UTC"})
            converted = await agent.call_tool("time.convert_time", {
                "source_timezone": "UTC", "time": "12:00", "target_timezone": "Asia/Tokyo"})
            bad_arguments = await agent.call_tool("time.get_current_time", {})
            unprefixed = await agent.call_tool("get_current_time", {"timezone": "UTC"})
    assert not now.is_error, text_of(now)
    assert "UTC" in text_of(now)
    assert structured(now)["timezone"] == "UTC"
    assert not converted.is_error, text_of(converted)
    assert structured(converted)["target"]["timezone"] == "Asia/Tokyo"
    assert structured(converted)["target"]["datetime"].endswith("21:00:00+09:00")
    assert bad_arguments.is_error and "'timezone' is a required property" in text_of(bad_arguments)
    assert unprefixed.is_error and "unknown tool 'get_current_time'" in text_of(unprefixed)


# -- 10. allowlists block toolsets until enabled ----------------------------------------------


async def test_an_instance_outside_the_allowlists_sees_no_toolsets(deployment: Deployment) -> None:
    async with deployment.caller("--config", str(standard_config(deployment))):
        async with deployment.agent("box2", "mcp:s1", token=agent_token(deployment, "box2")) as outsider:
            outsider_listing = await outsider.list_tools()
            blocked = await outsider.call_tool("ext.echo_external", {"message": "let me in"})
            blocked_time = await outsider.call_tool("time.get_current_time", {"timezone": "UTC"})
        async with deployment.agent("box1", "mcp:s1", token=agent_token(deployment, "box1")) as allowed:
            allowed_listing = await allowed.list_tools()
            passed = await allowed.call_tool("ext.echo_external", {"message": "welcome"})
    assert tool_names(outsider_listing) == set()
    assert blocked.is_error and "Toolset not found: 'ext'" in text_of(blocked)
    assert blocked_time.is_error and "Toolset not found: 'time'" in text_of(blocked_time)
    assert tool_names(allowed_listing) == TOOLSET_TOOLS
    assert not passed.is_error and structured(passed) == {"echo": "welcome"}


async def test_a_failing_configured_endpoint_leaves_the_others_working(deployment: Deployment) -> None:
    config = write_config(
        deployment,
        {
            "broken": {"kind": "command", "prefix": "broken", "command": "/nonexistent/endpoint"},
            "exits": {"kind": "command", "prefix": "exits", "command": [PYTHON, "-c", "import sys; sys.exit(1)"]},
            "ext": EXT,
        },
        {"box1": ["broken", "exits", "ext"]},
    )
    async with deployment.caller("--config", str(config)):
        async with deployment.agent("box1", "mcp:s1", token=agent_token(deployment, "box1")) as agent:
            listing = await agent.list_tools()
            result = await agent.call_tool("ext.echo_external", {"message": "fine"})
    assert tool_names(listing) == {"ext.echo_external"}
    assert not result.is_error and structured(result) == {"echo": "fine"}


# -- 11. caller tools and toolsets together ---------------------------------------------------


async def test_agent_sees_caller_tools_and_toolsets_together(deployment: Deployment) -> None:
    async with deployment.caller("--config", str(standard_config(deployment))) as (caller, events):
        declared = await caller.call_tool("session_message", {
            "instance": "box1", "session_id": "s1", "message": "hi",
            "context": {"caller_id": "myapp", "caller_tools": [NOTIFY]},
        })
        assert not declared.is_error, text_of(declared)
        async with deployment.agent("box1", "mcp:s1", token=agent_token(deployment, "box1")) as agent:
            listing = await agent.list_tools()
            outcome: dict[str, Any] = {}
            async with trio.open_nursery() as nursery:
                async def call_caller_tool() -> None:
                    outcome["caller"] = await agent.call_tool("myapp_send_notification", {"message": "ping"})

                nursery.start_soon(call_caller_tool)
                request = await events.wait_type("caller_tool_request", tool="send_notification")
                # While the caller tool call waits for its answer, a toolset call goes through.
                outcome["toolset"] = await agent.call_tool("ext.echo_external", {"message": "meanwhile"})
                reply = await caller.call_tool("caller_tool_response", {
                    "session_id": "s1", "request_id": request["request_id"], "result": {"sent": True}})
                assert not reply.is_error, text_of(reply)
    assert tool_names(listing) == {"myapp_send_notification", *TOOLSET_TOOLS}
    assert not outcome["caller"].is_error and structured(outcome["caller"]) == {"sent": True}
    assert not outcome["toolset"].is_error and structured(outcome["toolset"]) == {"echo": "meanwhile"}
    assert request["arguments"] == {"message": "ping"}
    assert events.of_type("caller_tool_request") == [request], "the toolset call never reached the caller"


class Pings:
    def __init__(self) -> None:
        self.count = 0

    async def __call__(self, arguments: dict[str, Any]) -> dict[str, Any]:
        self.count += 1
        return {"pong": self.count}


@asynccontextmanager
async def embedded(deployment: Deployment) -> AsyncIterator[OublietteServer]:
    """The server in the test's Trio loop, with a code-registered toolset `util` (not allowed to anyone)."""
    async with deployment.embedded() as embedded:
        server = embedded.app
        await server.register_toolset(
            "util", "util", [ToolSpec(name="ping", description="Ping the host",
                                      result_schema={"type": "object", "required": ["pong"]})],
            ref=FunctionToolset({"ping": Pings()}),
        )
        await server.register_command_toolset("ext", "ext", [PYTHON, ECHO_ENDPOINT])
        yield server


async def test_legacy_agent_is_told_when_its_allowlist_changes(deployment: Deployment) -> None:
    changes = ListChanged()
    async with embedded(deployment) as server:
        async with deployment.agent("box1", "mcp:s1", token=server.tokens.token_for("box1"),
                                    message_handler=changes) as agent:
            assert tool_names(await agent.list_tools()) == set()
            blocked = await agent.call_tool("util.ping", {})
            assert blocked.is_error and "Toolset not found: 'util'" in text_of(blocked)

            # A caller declares its tools for the session, in process.
            caller = server.open_caller("test")
            declared = await server.caller_api().session_message(None, caller, {
                "instance": "box1", "session_id": "s1", "message": "hi",
                "context": {"caller_id": "myapp", "caller_tools": [NOTIFY]},
            })
            assert declared["session_id"] == "s1"
            seen = await changes.wait_beyond(0)
            assert tool_names(await agent.list_tools()) == {"myapp_send_notification"}

            await server.update_allowed_toolsets("box1", ["util", "ext"])
            seen = await changes.wait_beyond(seen)
            assert tool_names(await agent.list_tools()) == {"myapp_send_notification", "util.ping", "ext.echo_external"}
            pinged = await agent.call_tool("util.ping", {})
            assert not pinged.is_error, text_of(pinged)
            assert structured(pinged) == {"pong": 1}
            echoed = await agent.call_tool("ext.echo_external", {"message": "hello"})
            assert not echoed.is_error and structured(echoed) == {"echo": "hello"}

            await server.update_allowed_toolsets("box1", ["ext"])
            seen = await changes.wait_beyond(seen)
            assert tool_names(await agent.list_tools()) == {"myapp_send_notification", "ext.echo_external"}
            removed = await agent.call_tool("util.ping", {})
            assert removed.is_error and "Toolset not found: 'util'" in text_of(removed)

            await server.update_allowed_toolsets("box1", [])
            seen = await changes.wait_beyond(seen)
            assert tool_names(await agent.list_tools()) == {"myapp_send_notification"}
            server.close_caller(caller)
    assert changes.count == 4, "one notification per change: caller tools, then three allowlist changes"


async def test_modern_agent_gets_a_listen_event_when_its_allowlist_changes(deployment: Deployment) -> None:
    async with embedded(deployment) as server:
        async with deployment.agent("box1", "mcp:s1", mode="auto", token=server.tokens.token_for("box1")) as agent:
            assert agent.protocol_version == "2026-07-28"
            assert tool_names(await agent.list_tools()) == set()
            async with agent.listen(tools_list_changed=True) as subscription:
                await server.update_allowed_toolsets("box1", ["util"])
                with trio.fail_after(EVENT_BOUND):
                    event = await subscription.__anext__()
                assert isinstance(event, ToolsListChanged)
                listing = await agent.list_tools(cache_mode="refresh")
                assert tool_names(listing) == {"util.ping"}
                assert (listing.tools[0].meta or {})[DESCRIPTOR_META_KEY]["result_schema"] == {
                    "type": "object", "required": ["pong"]}
                pinged = await agent.call_tool("util.ping", {})
                assert not pinged.is_error and structured(pinged) == {"pong": 1}

                await server.update_allowed_toolsets("box1", ["ext"])
                with trio.fail_after(EVENT_BOUND):
                    event = await subscription.__anext__()
                assert isinstance(event, ToolsListChanged)
                assert tool_names(await agent.list_tools(cache_mode="refresh")) == {"ext.echo_external"}


# -- 12. the "_" separator --------------------------------------------------------------------


async def test_underscore_separator_publishes_prefix_underscore_tool(deployment: Deployment) -> None:
    config = standard_config(deployment, separator="_")
    async with deployment.caller("--config", str(config)):
        async with deployment.agent("box1", "mcp:s1", token=agent_token(deployment, "box1")) as agent:
            listing = await agent.list_tools()
            echoed = await agent.call_tool("ext_echo_external", {"message": "no dots"})
            now = await agent.call_tool("time_get_current_time", {"timezone": "UTC"})
            dotted = await agent.call_tool("ext.echo_external", {"message": "dots"})
    tools = {tool.name: tool for tool in listing.tools}
    assert tool_names(listing) == {"ext_echo_external", "time_get_current_time", "time_convert_time"}
    assert (tools["ext_echo_external"].meta or {})[DESCRIPTOR_META_KEY]["name"] == "ext_echo_external"
    assert not echoed.is_error and structured(echoed) == {"echo": "no dots"}
    assert not now.is_error and structured(now)["timezone"] == "UTC"
    assert dotted.is_error
