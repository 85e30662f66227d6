"""The sandbox side as a library (`oubliette_client.library`, docs/EMBEDDING.md "The sandbox side"),
driving a real `oubliette-server`: an agent's Trio program lists the caller's and a toolset's tools,
calls them with progress and cancellation, sees the tool set change, and gets each failure as
the exception the docs name; no `oubliette-client` process, no MCP between the agent and its tools.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio

from harness import EVENT_TIMEOUT, PYTHON, Deployment, structured, text_of
from oubliette_client import (
    Progress,
    RelayRefused,
    RelaySettings,
    RelayUnavailable,
    SandboxClient,
    ToolCallError,
    open_sandbox_client,
    settings_from_environment,
)

ROOT = Path(__file__).resolve().parents[2]
NOTIFY = {
    "name": "send_notification",
    "description": "Send a notification to the user of myapp",
    "inputSchema": {"type": "object", "properties": {"message": {"type": "string"}}, "required": ["message"]},
}
DOUBLE = {"name": "double", "inputSchema": {"type": "object", "properties": {"n": {"type": "integer"}}}}


def settings(deployment: Deployment, token: str | None = None) -> RelaySettings:
    return RelaySettings(relay=deployment.relay, instance="box1", token=token or deployment.token("box1"))


def echo_toolset_config(deployment: Deployment) -> Path:
    """box1 may use the reference command endpoint (examples/mcp_echo.py) as the toolset `ext`."""
    path = deployment.root / "oubliette.toml"
    path.write_text(
        "[toolsets.echo]\nkind = \"command\"\nprefix = \"ext\"\n"
        f"command = [{json.dumps(PYTHON)}, {json.dumps(str(ROOT / 'examples' / 'mcp_echo.py'))}]\n"
        "[allowlists]\nbox1 = [\"echo\"]\n"
    )
    return path


async def declare_and_see(caller: Any, client: SandboxClient, *tools: dict[str, Any]) -> int:
    """Declare `tools` for session s1 and wait until the client's tool set has changed; its new version."""
    seen = client.tools_version
    result = await caller.call_tool("session_message", {
        "instance": "box1", "session_id": "s1", "message": "hi",
        "context": {"caller_id": "myapp", "caller_tools": list(tools)},
    })
    assert not result.is_error, text_of(result)
    with trio.fail_after(EVENT_TIMEOUT):
        return await client.wait_tools_changed(seen)


async def test_lists_and_calls_the_callers_and_a_toolsets_tools(deployment: Deployment) -> None:
    async with deployment.caller("--config", str(echo_toolset_config(deployment))) as (caller, events), \
            open_sandbox_client(settings(deployment)) as client:
        assert [(t.name, t.kind) for t in client.tools] == [("ext.echo_external", "toolset")]
        await declare_and_see(caller, client, NOTIFY)
        assert [(t.name, t.kind, t.owner, t.tool) for t in client.tools] == [
            ("myapp_send_notification", "caller", "myapp", "send_notification"),
            ("ext.echo_external", "toolset", "echo", "echo_external"),
        ]
        assert client.tools[0].input_schema == NOTIFY["inputSchema"]

        echoed = await client.call("ext.echo_external", {"message": "hi"})
        assert echoed.result == {"echo": "hi"}

        async with trio.open_nursery() as nursery:
            async def answer() -> None:
                request = await events.wait_type("caller_tool_request")
                await caller.call_tool("caller_tool_response", {
                    "session_id": "s1", "request_id": request["request_id"], "result": {"status": "sent"},
                })

            nursery.start_soon(answer)
            with trio.fail_after(EVENT_TIMEOUT):
                outcome = await client.call("myapp_send_notification", {"message": "hello"})
        assert outcome.result == {"status": "sent"}
        [request] = events.of_type("caller_tool_request")
        assert (request["tool"], request["arguments"]) == ("send_notification", {"message": "hello"})


async def test_progress_reaches_the_callback_while_the_call_waits(deployment: Deployment) -> None:
    async with deployment.caller() as (caller, events), open_sandbox_client(settings(deployment)) as client:
        await declare_and_see(caller, client, NOTIFY)
        reports: list[Progress] = []
        reported = trio.Event()

        def on_progress(report: Progress) -> None:
            reports.append(report)
            reported.set()

        async with trio.open_nursery() as nursery:
            async def answer() -> None:
                request = await events.wait_type("caller_tool_request")
                ids = {"session_id": "s1", "request_id": request["request_id"]}
                forwarded = await caller.call_tool("caller_tool_progress", {**ids, "progress": 5, "total": 10, "message": "half"})
                assert structured(forwarded) == {"forwarded": True}
                with trio.fail_after(EVENT_TIMEOUT):
                    await reported.wait()
                await caller.call_tool("caller_tool_response", {**ids, "result": {"status": "sent"}})

            nursery.start_soon(answer)
            with trio.fail_after(EVENT_TIMEOUT):
                outcome = await client.call("myapp_send_notification", {"message": "hi"}, on_progress=on_progress)
        assert outcome.result == {"status": "sent"}
        assert reports == [Progress(5.0, 10.0, "half")]


async def test_cancelling_a_call_tells_the_caller_and_leaves_nothing_pending(deployment: Deployment) -> None:
    async with deployment.caller() as (caller, events), open_sandbox_client(settings(deployment)) as client:
        await declare_and_see(caller, client, NOTIFY)
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                async def cancel_once_requested() -> None:
                    await events.wait_type("caller_tool_request")
                    scope.cancel()

                nursery.start_soon(cancel_once_requested)
                await client.call("myapp_send_notification", {"message": "never"})
        assert scope.cancelled_caught
        request = events.of_type("caller_tool_request")[0]
        cancelled = await events.wait_type("caller_tool_cancelled", request_id=request["request_id"])
        assert cancelled["reason"] == "cancelled by the agent"
        waited = await caller.call_tool("session_message", {"session_id": "s1", "instance": "box1", "message": "?", "wait": 0.2})
        assert structured(waited)["pending"] == []


async def test_the_tool_set_follows_each_declaration(deployment: Deployment) -> None:
    async with deployment.caller() as (caller, _events), open_sandbox_client(settings(deployment)) as client:
        assert client.tools == []
        versions = [client.tools_version]
        for tools, names in (([NOTIFY, DOUBLE], ["myapp_send_notification", "myapp_double"]), ([DOUBLE], ["myapp_double"]), ([], [])):
            versions.append(await declare_and_see(caller, client, *tools))
            assert [t.name for t in client.tools] == names
        assert versions == sorted(set(versions))


async def test_each_failure_is_the_exception_the_docs_name(deployment: Deployment) -> None:
    async with deployment.caller() as (caller, events), open_sandbox_client(settings(deployment)) as client:
        await declare_and_see(caller, client, NOTIFY)
        with pytest.raises(ToolCallError) as unknown:
            await client.call("myapp_nothing", {})
        assert unknown.value.category == "not_found" and "myapp_send_notification" in str(unknown.value)
        with pytest.raises(ToolCallError) as usage:
            await client.call("myapp_send_notification", {"message": 42})
        assert usage.value.category == "usage"
        assert events.of_type("caller_tool_request") == []  # refused before anything was relayed

        async with trio.open_nursery() as nursery:
            async def refuse() -> None:
                request = await events.wait_type("caller_tool_request")
                answered = await caller.call_tool("caller_tool_response", {
                    "session_id": "s1", "request_id": request["request_id"], "error": "quota exceeded",
                })
                assert not answered.is_error, text_of(answered)

            nursery.start_soon(refuse)
            with pytest.raises(ToolCallError) as refused, trio.fail_after(EVENT_TIMEOUT):
                await client.call("myapp_send_notification", {"message": "hi"})
        assert refused.value.category == "tool" and "quota exceeded" in str(refused.value)

    # The block's own exception comes out as itself, not in the nursery's exception group.
    async with deployment.caller():
        with pytest.raises(ToolCallError):
            async with open_sandbox_client(settings(deployment)) as client:
                await client.call("nothing", {})


async def test_a_relay_that_refuses_or_is_absent_is_raised_at_connect(deployment: Deployment) -> None:
    async with deployment.caller():
        with pytest.raises(RelayRefused, match="refused instance 'box1'"):
            async with open_sandbox_client(settings(deployment, token="0" * 64)):
                pytest.fail("connected with a wrong token")
    with pytest.raises(RelayUnavailable, match="cannot connect to unix:"), trio.fail_after(EVENT_TIMEOUT):
        async with open_sandbox_client(settings(deployment), connect_wait=0.5):
            pytest.fail("connected to no server")


def test_settings_come_from_the_environment_as_the_programs_read_them(tmp_path: Path) -> None:
    env = {"OUBLIETTE_RELAY": f"unix:{tmp_path / 'r.sock'}", "OUBLIETTE_INSTANCE": "box1", "OUBLIETTE_TOKEN": "t",
           "OUBLIETTE_SESSION": "mcp:s1", "OUBLIETTE_REQUEST_TIMEOUT": "30"}
    assert settings_from_environment(env) == RelaySettings(
        relay=f"unix:{tmp_path / 'r.sock'}", instance="box1", token="t", session="mcp:s1", request_timeout=30.0,
    )
    assert settings_from_environment(env, instance="box2").instance == "box2"
    with pytest.raises(ValueError, match="missing --instance/OUBLIETTE_INSTANCE and --token/OUBLIETTE_TOKEN"):
        settings_from_environment({})
    with pytest.raises(ValueError, match="OUBLIETTE_REQUEST_TIMEOUT must be a positive number"):
        settings_from_environment({**env, "OUBLIETTE_REQUEST_TIMEOUT": "0"})
    own = settings_from_environment({**env, "OUBLIETTE_TOOL_SEPARATOR": "_"})
    assert own.tool_separator == "_" and own.environment()["OUBLIETTE_TOOL_SEPARATOR"] == "_"
    with pytest.raises(ValueError, match="OUBLIETTE_TOOL_SEPARATOR must be one of '.', '_', '-', '__'; got '/'"):
        settings_from_environment({**env, "OUBLIETTE_TOOL_SEPARATOR": "/"})
