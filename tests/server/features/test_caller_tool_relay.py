"""The caller tool relay, scenario by scenario, with the real programs."""

from __future__ import annotations

import time

import pytest
import trio
import trio.testing

from harness import Deployment, structured, text_of

pytestmark = pytest.mark.in_process

NOTIFY = {
    "name": "send_notification",
    "description": "Send notification",
    "inputSchema": {"type": "object", "properties": {"message": {"type": "string"}}},
}
SLOW = {"name": "slow_tool", "description": "Never answered"}


async def declare(caller, instance: str, session_id: str, tools: list[dict], message: str = "hi") -> dict:
    result = await caller.call_tool("session_message", {
        "instance": instance, "session_id": session_id, "message": message,
        "context": {"caller_id": "myapp", "caller_tools": tools},
    })
    assert not result.is_error, text_of(result)
    return structured(result)


@pytest.mark.real_programs
async def test_agent_calls_caller_tool_successfully(deployment: Deployment) -> None:
    """REQ-CTR-001/003/004: request event on the stream, caller answers, agent gets the result."""
    async with deployment.caller() as (caller, events):
        await declare(caller, "box1", "s1", [NOTIFY])
        async with deployment.agent("box1", "mcp:s1") as agent, trio.open_nursery() as nursery:
            outcome = {}

            async def agent_call() -> None:
                outcome["result"] = await agent.call_tool("myapp_send_notification", {"message": "hi"})

            nursery.start_soon(agent_call)
            request = await events.wait_type("caller_tool_request")
            assert request["tool"] == "send_notification"
            assert request["arguments"] == {"message": "hi"}
            assert request["request_id"]
            assert request["session_id"] == "s1"
            answer = await caller.call_tool("caller_tool_response", {
                "session_id": "s1", "request_id": request["request_id"], "result": {"status": "sent"},
            })
            assert structured(answer) == {"resolved": True}
        result = outcome["result"]
        assert not result.is_error
        assert result.structured_content == {"status": "sent"}


async def test_request_ids_are_unique(deployment: Deployment) -> None:
    async with deployment.caller() as (caller, events):
        await declare(caller, "box1", "s1", [NOTIFY])
        async with deployment.agent("box1", "mcp:s1") as agent, trio.open_nursery() as nursery:
            for n in range(3):
                nursery.start_soon(agent.call_tool, "myapp_send_notification", {"message": str(n)})
            for n in range(3):
                await events.wait_for(lambda e, n=n: e.get("type") == "caller_tool_request" and e["arguments"] == {"message": str(n)})
            requests = events.of_type("caller_tool_request")
            assert len({r["request_id"] for r in requests}) == 3
            for r in requests:
                await caller.call_tool("caller_tool_response", {"session_id": "s1", "request_id": r["request_id"], "result": "ok"})


async def test_caller_tool_times_out(deployment: Deployment) -> None:
    """REQ-CTR-001: no answer within the timeout -> the agent gets a timeout error (short setting here)."""
    async with deployment.caller("--caller-timeout", "0.5") as (caller, events):
        await declare(caller, "box1", "s1", [SLOW])
        async with deployment.agent("box1", "mcp:s1") as agent:
            started = time.monotonic()
            result = await agent.call_tool("myapp_slow_tool", {})
            elapsed = time.monotonic() - started
        assert result.is_error
        assert "timeout" in text_of(result) and "0.5 s" in text_of(result)
        assert 0.4 < elapsed < 5
        cancelled = await events.wait_type("caller_tool_cancelled")
        assert cancelled["reason"] == "timeout"


async def test_per_tool_timeout_overrides_server_setting(deployment: Deployment) -> None:
    async with deployment.caller() as (caller, events):
        await declare(caller, "box1", "s1", [dict(SLOW, timeout_ms=300)])
        async with deployment.agent("box1", "mcp:s1") as agent:
            with trio.fail_after(10):
                result = await agent.call_tool("myapp_slow_tool", {})
        assert result.is_error and "timeout" in text_of(result) and "0.3 s" in text_of(result)


@pytest.mark.real_programs
async def test_caller_disconnect_gives_connection_error_at_once(deployment: Deployment) -> None:
    """REQ-CTR-001: the caller disconnects before responding -> connection error, not the timeout."""
    disconnect = trio.Event()
    caller_gone = trio.Event()

    async def run_caller(task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with deployment.caller() as (caller, events):
            await declare(caller, "box1", "s1", [NOTIFY])
            task_status.started(events)
            await disconnect.wait()
        caller_gone.set()

    async with trio.open_nursery() as outer:
        events = await outer.start(run_caller)
        async with deployment.agent("box1", "mcp:s1") as agent, trio.open_nursery() as nursery:
            outcome: dict = {}
            finished = trio.Event()

            async def agent_call() -> None:
                outcome["result"] = await agent.call_tool("myapp_send_notification", {})
                outcome["at"] = time.monotonic()
                finished.set()

            nursery.start_soon(agent_call)
            await events.wait_type("caller_tool_request")
            disconnected_at = time.monotonic()
            disconnect.set()  # the caller's client closes the server's stdin
            with trio.fail_after(10):
                await finished.wait()
                await caller_gone.wait()
    result = outcome["result"]
    assert result.is_error
    assert "connection error" in text_of(result) and "disconnected" in text_of(result)
    assert outcome["at"] - disconnected_at < 1.0, "the agent must not wait for the 60 s timeout"


async def test_result_not_matching_result_schema_is_a_tool_error(deployment: Deployment) -> None:
    """A declared resultSchema is enforced: a result that does not match never reaches the agent as success."""
    weather = {
        "name": "get_weather",
        "resultSchema": {"type": "object", "properties": {"temp_c": {"type": "number"}}, "required": ["temp_c"]},
    }
    async with deployment.caller() as (caller, events):
        await declare(caller, "box1", "s1", [weather])
        async with deployment.agent("box1", "mcp:s1") as agent, trio.open_nursery() as nursery:
            outcomes: list = []

            async def agent_call() -> None:
                outcomes.append(await agent.call_tool("myapp_get_weather", {}))

            nursery.start_soon(agent_call)
            first = await events.wait_type("caller_tool_request")
            await caller.call_tool("caller_tool_response", {
                "session_id": "s1", "request_id": first["request_id"], "result": {"temp": "warm"},
            })
        async with deployment.agent("box1", "mcp:s1") as agent, trio.open_nursery() as nursery:
            nursery.start_soon(agent_call)
            second = await events.wait_for(
                lambda e: e.get("type") == "caller_tool_request" and e["request_id"] != first["request_id"])
            await caller.call_tool("caller_tool_response", {
                "session_id": "s1", "request_id": second["request_id"], "result": {"temp_c": 21.5},
            })
    bad, good = outcomes
    assert bad.is_error and "resultSchema" in text_of(bad) and "temp_c" in text_of(bad)
    assert not good.is_error and good.structured_content == {"temp_c": 21.5}


async def test_the_agent_is_answered_only_once_the_result_frame_is_stored() -> None:
    """What the agent got is in the log: a caller's answer wakes the agent's call only after the
    `caller_tool_result` frame is committed, so a server that dies in between leaves no result
    the log does not know (it would record the request as cancelled on restart)."""
    from types import SimpleNamespace

    from oubliette_server.features.caller_tool_relay.pending import CallerCallRegistry
    from oubliette_server.core.callers import CallerConnection
    from oubliette_server.core.sessions import Session
    from protocol.messages import CallerToolSpec

    stored: list[str] = []
    result_commit = trio.Event()
    seq = iter(range(1, 100))

    async def append_frame(session: Session, type_: str, payload: dict, **_: object) -> SimpleNamespace:
        if type_ == "caller_tool_result":
            await result_commit.wait()  # the commit, held back by the test
        stored.append(type_)
        return SimpleNamespace(seq=next(seq))

    registry = CallerCallRegistry(append_frame, default_timeout=10)
    caller = CallerConnection("stdio")
    session = Session(instance="box1", channel="mcp", id="s1", caller_id="myapp", owner=caller)
    answered: list[object] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:

            async def agent_call() -> None:
                answered.append(await registry.relay(session, CallerToolSpec(name="notify"), {}))

            nursery.start_soon(agent_call)
            [call] = await registry.wait_pending(session)
            nursery.start_soon(registry.respond, caller, "s1", call.request_id, {"ok": True})
            await trio.testing.wait_all_tasks_blocked()
            assert answered == [], "the agent was answered before its result frame was stored"
            result_commit.set()
    assert answered == [{"ok": True}]
    assert stored == ["caller_tool_request", "caller_tool_result"]
