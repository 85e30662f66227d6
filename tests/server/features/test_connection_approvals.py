"""The agent's own actions and waiting well.

In process: `OublietteServer` in the test's nursery with the caller API driven directly (as
tests/server/features/test_approvals.py), and the agent is the MCP SDK's client talking to oubliette-client's
stdio MCP server (`deployment.agent`, bound to the session as the guest runtime binds it).
The permission prompt's answers are checked byte for byte against Claude Code's contract.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Callable

import mcp_types as types
import pytest
import trio
import trio.testing
from contextlib import asynccontextmanager

from harness import EVENT_TIMEOUT, Deployment, structured, text_of
from oubliette_server.features.toolsets.base import FunctionToolset, ToolSpec
from approval_calls import answer, stored
from in_process_calls import INSTANCE, SESSION, InProcess, in_process

pytestmark = pytest.mark.in_process

BASH_INPUT = {"command": "rm -rf build", "description": "Remove the build output"}
PROMPT = {"tool_name": "Bash", "input": BASH_INPUT, "tool_use_id": "toolu_01AbC"}


class AgentToolCall:
    """One `tools/call` of the agent, in flight in the test's nursery (with a progress callback when asked)."""

    def __init__(
        self, nursery: trio.Nursery, agent: Any, name: str, arguments: dict[str, Any], *, progress: bool = False,
    ) -> None:
        self.result: Any = None
        self.progress: list[tuple[float, float | None, str | None]] = []
        self.progress_changed = trio.Event()
        self.finished = trio.Event()
        nursery.start_soon(self._run, agent, name, arguments, progress)

    async def _on_progress(self, progress: float, total: float | None, message: str | None) -> None:
        self.progress.append((progress, total, message))
        self.progress_changed.set()
        self.progress_changed = trio.Event()

    async def _run(self, agent: Any, name: str, arguments: dict[str, Any], progress: bool) -> None:
        self.result = await agent.call_tool(name, arguments, progress_callback=self._on_progress if progress else None)
        self.finished.set()

    async def outcome(self) -> Any:
        with trio.fail_after(EVENT_TIMEOUT):
            await self.finished.wait()
        return self.result

    async def wait_progress(self, predicate: Callable[[list[tuple[float, float | None, str | None]]], bool]) -> None:
        with trio.fail_after(EVENT_TIMEOUT):
            while not predicate(self.progress):
                await self.progress_changed.wait()


def only_text(result: Any) -> str:
    """The one text block Claude Code reads; anything else breaks its contract."""
    assert not result.is_error, text_of(result)
    assert len(result.content) == 1 and result.content[0].type == "text", result.content
    return result.content[0].text


@asynccontextmanager
async def owned_session(deployment: Deployment, *extra: str) -> AsyncIterator[tuple[InProcess, Any, Any, Any]]:
    """A session opened by its owner, and the agent's oubliette-client bound to it: (proc, owner, events, agent)."""
    async with in_process(deployment) as proc:
        owner, events = proc.open_caller()
        await proc.declare(owner, [])
        async with deployment.agent(INSTANCE, f"mcp:{SESSION}", extra_args=extra) as agent:
            yield proc, owner, events, agent


# -- the permission prompt -----------------------------------------------------------


async def test_the_permission_prompt_is_offered_with_its_contract(deployment: Deployment) -> None:
    async with owned_session(deployment) as (_proc, _owner, _events, agent):
        tools = {t.name: t for t in (await agent.list_tools()).tools}
        prompt = tools["permission_prompt"]
        assert prompt.input_schema["required"] == ["tool_name", "input"]
        assert prompt.input_schema["additionalProperties"] is True


async def test_allow_answers_with_the_full_input(deployment: Deployment) -> None:
    async with owned_session(deployment) as (proc, owner, events, agent):
        call = AgentToolCall(proc.nursery, agent, "permission_prompt", {**PROMPT, "extra_key": "accepted"})
        request = await events.wait_type("approval_request")
        assert (request["origin"], request["tool_name"], request["arguments"]) == ("agent", "Bash", BASH_INPUT)
        assert request["tool_use_id"] == "toolu_01AbC"
        await trio.testing.wait_all_tasks_blocked()
        assert not call.finished.is_set(), "the agent waits for the decision"
        assert structured(await answer(proc, owner, request_id=request["request_id"], approve=True)) == {"resolved": True}
        text = only_text(await call.outcome())
        assert text == '{"behavior":"allow","updatedInput":{"command":"rm -rf build","description":"Remove the build output"}}'
        resolved = await events.wait_type("approval_resolved", request_id=request["request_id"])
        assert (resolved["approve"], resolved["who"]) == (True, owner.id)


async def test_allow_with_a_rewrite_answers_with_the_updated_input(deployment: Deployment) -> None:
    async with owned_session(deployment) as (proc, owner, events, agent):
        call = AgentToolCall(proc.nursery, agent, "permission_prompt", PROMPT)
        request = await events.wait_type("approval_request")
        await answer(proc, owner, request_id=request["request_id"], approve=True,
                     updated_arguments={"command": "rm -rf build/tmp"})
        text = only_text(await call.outcome())
        assert text == '{"behavior":"allow","updatedInput":{"command":"rm -rf build/tmp"}}'
        assert json.loads(text) == {"behavior": "allow", "updatedInput": {"command": "rm -rf build/tmp"}}


async def test_deny_answers_with_the_reason(deployment: Deployment) -> None:
    async with owned_session(deployment) as (proc, owner, events, agent):
        call = AgentToolCall(proc.nursery, agent, "permission_prompt", PROMPT)
        request = await events.wait_type("approval_request")
        await answer(proc, owner, request_id=request["request_id"], approve=False, reason="keep the build output")
        text = only_text(await call.outcome())
        assert text == '{"behavior":"deny","message":"\'Bash\' was denied: keep the build output"}'
        assert set(json.loads(text)) == {"behavior", "message"}


async def test_no_owning_caller_connected_denies_at_once(deployment: Deployment) -> None:
    async with owned_session(deployment) as (proc, owner, _events, agent):
        proc.server.close_caller(owner)
        text = only_text(await agent.call_tool("permission_prompt", PROMPT))
        decision = json.loads(text)
        assert decision["behavior"] == "deny" and set(decision) == {"behavior", "message"}
        assert "is not connected; nobody can approve it" in decision["message"], decision
        resolved = await stored(proc, "approval_resolved")
        assert [(r["approve"], r["who"]) for r in resolved] == [(False, "disconnect")]


async def test_a_session_nobody_opened_denies(deployment: Deployment) -> None:
    async with in_process(deployment) as _proc, deployment.agent(INSTANCE, "mcp:s-nobody") as agent:
        decision = json.loads(only_text(await agent.call_tool("permission_prompt", PROMPT)))
        assert decision == {
            "behavior": "deny",
            "message": "'Bash' was denied: session 'mcp:s-nobody' has not been opened by any caller; nobody can approve 'Bash'",
        }


async def test_malformed_prompts_are_denied_never_allowed(deployment: Deployment) -> None:
    async with owned_session(deployment) as (proc, _owner, _events, agent):
        for bad in ({"tool_name": "Bash"}, {"tool_name": "Bash", "input": "ls"}):
            result = await agent.call_tool("permission_prompt", bad)
            # The SDK may refuse the schema itself (an MCP error) or the tool denies: never an allow.
            assert result.is_error or json.loads(result.content[0].text)["behavior"] == "deny", result
        assert await stored(proc, "approval_request") == []


# -- gated toolset tools ------------------------------------------------------

RM_SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}


@asynccontextmanager
async def gated_toolset(
    deployment: Deployment, requires_approval: Any, approval_timeout: Any = None,
) -> AsyncIterator[tuple[InProcess, Any, Any, Any, list]]:
    """Toolset `files` (prefix `fs`: `rm`, `ls`) allowed for the instance, gated as asked: (proc, owner, events, agent, ran)."""
    ran: list[tuple[str, dict[str, Any]]] = []

    async def rm(arguments: dict[str, Any]) -> dict[str, Any]:
        ran.append(("rm", arguments))
        return {"removed": arguments["path"]}

    async def ls(arguments: dict[str, Any]) -> dict[str, Any]:
        ran.append(("ls", arguments))
        return {"files": ["a"]}

    async with in_process(deployment) as proc:
        await proc.server.register_toolset(
            "files", "fs", [ToolSpec(name="rm", input_schema=RM_SCHEMA), ToolSpec(name="ls")],
            ref=FunctionToolset({"rm": rm, "ls": ls}), requires_approval=requires_approval,
            approval_timeout=approval_timeout,
        )
        await proc.server.update_allowed_toolsets(INSTANCE, ["files"])
        owner, events = proc.open_caller()
        await proc.declare(owner, [])
        async with deployment.agent(INSTANCE, f"mcp:{SESSION}") as agent:
            yield proc, owner, events, agent, ran


async def test_a_gated_toolset_tool_runs_once_approved(deployment: Deployment) -> None:
    async with gated_toolset(deployment, {"rm"}) as (proc, owner, events, agent, ran):
        call = AgentToolCall(proc.nursery, agent, "fs.rm", {"path": "/tmp/a"})
        request = await events.wait_type("approval_request")
        assert (request["origin"], request["tool_name"], request["arguments"]) == ("toolset", "fs.rm", {"path": "/tmp/a"})
        await trio.testing.wait_all_tasks_blocked()
        assert ran == [] and not call.finished.is_set(), "nothing runs before the decision"
        await answer(proc, owner, request_id=request["request_id"], approve=True, updated_arguments={"path": "/tmp/b"})
        result = await call.outcome()
        assert not result.is_error, text_of(result)
        assert result.structured_content == {"removed": "/tmp/b"}
        assert ran == [("rm", {"path": "/tmp/b"})]
        # The tool not named in requires_approval runs without asking.
        listing = await agent.call_tool("fs.ls", {})
        assert listing.structured_content == {"files": ["a"]}
        assert len(await stored(proc, "approval_request")) == 1


async def test_a_gated_toolset_tool_denied_never_runs(deployment: Deployment) -> None:
    async with gated_toolset(deployment, True) as (proc, owner, events, agent, ran):
        call = AgentToolCall(proc.nursery, agent, "fs.ls", {})
        request = await events.wait_type("approval_request")
        assert request["tool_name"] == "fs.ls"
        await answer(proc, owner, request_id=request["request_id"], approve=False, reason="not now")
        result = await call.outcome()
        assert result.is_error and "'fs.ls' was denied: not now" in text_of(result), text_of(result)
        assert ran == []


async def test_a_gated_toolset_tool_without_an_owner_is_denied(deployment: Deployment) -> None:
    async with gated_toolset(deployment, ["rm"]) as (proc, owner, _events, agent, ran):
        proc.server.close_caller(owner)
        result = await agent.call_tool("fs.rm", {"path": "/tmp/a"})
        assert result.is_error and "is not connected; nobody can approve it" in text_of(result), text_of(result)
        assert ran == []


async def test_gated_toolset_tools_tell_the_client_their_approval_timeout(deployment: Deployment) -> None:
    async with gated_toolset(deployment, {"rm"}) as (proc, _owner, _events, _agent, _ran):
        router = next(iter(proc.server.toolsets.sessions._routers.values()))
        published = {tool["name"]: tool for tool in router.published()}
        assert published["fs.rm"]["approval_timeout_ms"] == round(proc.server.approvals.default_timeout * 1000)
        assert "approval_timeout_ms" not in published["fs.ls"]


@pytest.mark.parametrize("where", ["toolset", "tool"])
async def test_a_gated_toolset_tools_own_approval_timeout_denies(deployment: Deployment, where: str) -> None:
    """`approval_timeout` per toolset (seconds) or per tool (a mapping); the rest keep the server's; fail closed."""
    timeout = 0.3 if where == "toolset" else {"rm": 0.3}
    async with gated_toolset(deployment, True, approval_timeout=timeout) as (proc, owner, events, agent, ran):
        router = next(iter(proc.server.toolsets.sessions._routers.values()))
        published = {tool["name"]: tool["approval_timeout_ms"] for tool in router.published()}
        assert published == {"fs.rm": 300, "fs.ls": 300 if where == "toolset" else 600_000}
        call = AgentToolCall(proc.nursery, agent, "fs.rm", {"path": "/tmp/a"})
        request = await events.wait_type("approval_request")
        result = await call.outcome()
        assert result.is_error, text_of(result)
        assert "'fs.rm' was denied: no decision within 0.3 s (approval timeout)" in text_of(result), text_of(result)
        resolved = await events.wait_type("approval_resolved", request_id=request["request_id"])
        assert (resolved["approve"], resolved["who"]) == (False, "timeout")
        late = await answer(proc, owner, request_id=request["request_id"], approve=True)
        assert late.is_error and "already resolved: denied (timeout)" in text_of(late)
        assert ran == [], "nothing runs without a decision"


@pytest.mark.parametrize("bad", [0, -1, True, "10", float("inf"), {"rm": 0}])
async def test_a_bad_toolset_approval_timeout_is_refused(deployment: Deployment, bad: Any) -> None:
    async with in_process(deployment) as proc:
        with pytest.raises(ValueError, match="approval_timeout.* must be a positive number of seconds"):
            await proc.server.register_toolset(
                "files", "fs", [ToolSpec(name="rm")], ref=FunctionToolset({}), requires_approval=True,
                approval_timeout=bad,
            )
        assert "files" not in proc.server.toolsets.registry.definitions


def test_requires_approval_in_the_config_file() -> None:
    from oubliette_server.features.toolsets.from_config import parse_toolsets

    entries = parse_toolsets({
        "a": {"kind": "command", "prefix": "a", "command": "x", "requires_approval": True},
        "b": {"kind": "command", "prefix": "b", "command": "x", "requires_approval": ["rm"]},
        "c": {"kind": "command", "prefix": "c", "command": "x"},
    }, "test.toml")
    assert [e.requires_approval for e in entries] == [True, ["rm"], False]
    with pytest.raises(ValueError, match="requires_approval must be true, false or a list of tool names"):
        parse_toolsets({"d": {"kind": "command", "prefix": "d", "command": "x", "requires_approval": "yes"}}, "t")


def test_approval_timeout_in_the_config_file() -> None:
    from oubliette_server.features.toolsets.from_config import parse_toolsets

    entries = parse_toolsets({
        "a": {"kind": "command", "prefix": "a", "command": "x", "requires_approval": True, "approval_timeout": 120},
        "b": {"kind": "command", "prefix": "b", "command": "x", "requires_approval": ["rm"],
              "approval_timeout": {"rm": 30.5}},
        "c": {"kind": "command", "prefix": "c", "command": "x"},
    }, "test.toml")
    assert [e.approval_timeout for e in entries] == [120, {"rm": 30.5}, None]
    for bad in (0, "ten", {"rm": -1}, {}, False):
        with pytest.raises(ValueError, match="approval_timeout must be a positive number of seconds, or a table"):
            parse_toolsets({"d": {"kind": "command", "prefix": "d", "command": "x", "approval_timeout": bad}}, "t")


# -- waiting well ----------------------------------------------------------------------------

NOTIFY = {"name": "send_notification", "inputSchema": {"type": "object", "properties": {"message": {"type": "string"}}}}


def strictly_increasing(values: list[float]) -> bool:
    return all(a < b for a, b in zip(values, values[1:]))


async def test_heartbeats_reach_the_agent_while_it_waits_and_stop_with_the_response(deployment: Deployment) -> None:
    async with owned_session(deployment, "--progress-interval", "0.05") as (proc, owner, events, agent):
        call = AgentToolCall(proc.nursery, agent, "permission_prompt", PROMPT, progress=True)
        request = await events.wait_type("approval_request")
        await call.wait_progress(lambda seen: len(seen) >= 3)
        assert not call.finished.is_set()
        await answer(proc, owner, request_id=request["request_id"], approve=True)
        assert json.loads(only_text(await call.outcome()))["behavior"] == "allow"
        values = [value for value, _total, _message in call.progress]
        assert strictly_increasing(values), values
        assert all(message == "waiting for the caller's decision" for _v, _t, message in call.progress)
        sent = len(call.progress)
        # No sleeping to show none came after the response: a second call's heartbeats, sent on the same
        # ordered stream, mark three intervals of the agent's own clock.
        marker = AgentToolCall(proc.nursery, agent, "permission_prompt", PROMPT, progress=True)
        second = await events.wait_for(lambda e: e.get("type") == "approval_request" and e is not request)
        await marker.wait_progress(lambda seen: len(seen) >= 3)
        # (The agent's SDK runs each progress callback in a task of its own, spawned before the result
        # wakes the call, so a report sent before the response is in `sent` even when it runs just after.)
        assert len(call.progress) == sent
        await answer(proc, owner, request_id=second["request_id"], approve=False)
        await marker.outcome()


async def test_no_progress_without_a_progress_token(deployment: Deployment) -> None:
    seen: list[Any] = []

    async def on_message(message: Any) -> None:
        if isinstance(message, types.ProgressNotification):
            seen.append(message)

    async with in_process(deployment) as proc:
        owner, events = proc.open_caller()
        await proc.declare(owner, [])
        async with deployment.agent(INSTANCE, f"mcp:{SESSION}", extra_args=("--progress-interval", "0.05"),
                                    message_handler=on_message) as agent:
            call = AgentToolCall(proc.nursery, agent, "permission_prompt", PROMPT)
            request = await events.wait_type("approval_request")
            # No sleeping to show none came: a call that asks for progress, waiting alongside, marks
            # three heartbeat intervals of the agent's own clock on the same ordered stream.
            marker = AgentToolCall(proc.nursery, agent, "permission_prompt", PROMPT, progress=True)
            second = await events.wait_for(lambda e: e.get("type") == "approval_request" and e is not request)
            await marker.wait_progress(lambda progress: len(progress) >= 3)
            assert len(seen) == len(marker.progress), "every progress notification was the marker's"
            for asked in (request, second):
                await answer(proc, owner, request_id=asked["request_id"], approve=False)
            await call.outcome()
            await marker.outcome()


async def test_caller_progress_is_forwarded_to_the_agent(deployment: Deployment) -> None:
    async with in_process(deployment) as proc:
        owner, events = proc.open_caller()
        await proc.declare(owner, [NOTIFY])
        async with deployment.agent(INSTANCE, f"mcp:{SESSION}", extra_args=("--progress-interval", "600")) as agent:
            call = AgentToolCall(proc.nursery, agent, "myapp_send_notification", {"message": "hi"}, progress=True)
            request = await events.wait_type("caller_tool_request")
            report = {"session_id": SESSION, "request_id": request["request_id"]}
            forwarded = await proc.call(owner, "caller_tool_progress", {**report, "progress": 5, "total": 10, "message": "half"})
            assert structured(forwarded) == {"forwarded": True}
            await call.wait_progress(lambda seen: len(seen) >= 1)
            assert call.progress == [(5.0, 10.0, "half")]
            # A report that does not advance is still sent, strictly above the last value, without a total.
            await proc.call(owner, "caller_tool_progress", {**report, "progress": 2, "message": "retrying"})
            await call.wait_progress(lambda seen: len(seen) >= 2)
            assert call.progress[1] == (6.0, None, "retrying")

            other, _ = proc.open_caller()
            refused = await proc.call(other, "caller_tool_progress", {**report, "progress": 7})
            assert refused.is_error and "belongs to another caller" in text_of(refused), text_of(refused)

            await proc.call(owner, "caller_tool_response", {**report, "result": {"sent": True}})
            result = await call.outcome()
            assert result.structured_content == {"sent": True}
            late = await proc.call(owner, "caller_tool_progress", {**report, "progress": 9})
            assert late.is_error and "no longer pending" in text_of(late), text_of(late)
            assert len(call.progress) == 2


async def test_caller_progress_on_a_call_that_asked_for_none_is_not_forwarded(deployment: Deployment) -> None:
    async with in_process(deployment) as proc:
        owner, events = proc.open_caller()
        await proc.declare(owner, [NOTIFY])
        async with deployment.agent(INSTANCE, f"mcp:{SESSION}") as agent:
            call = AgentToolCall(proc.nursery, agent, "myapp_send_notification", {"message": "hi"})
            request = await events.wait_type("caller_tool_request")
            report = {"session_id": SESSION, "request_id": request["request_id"]}
            assert structured(await proc.call(owner, "caller_tool_progress", {**report, "progress": 1})) == {"forwarded": False}
            await proc.call(owner, "caller_tool_response", {**report, "result": "ok"})
            await call.outcome()


async def test_an_mcp_toolsets_progress_is_forwarded_to_the_agent(deployment: Deployment) -> None:
    import sys
    from pathlib import Path

    script = str(Path(__file__).resolve().parents[3] / "tests" / "support" / "progress_mcp_server.py")
    async with in_process(deployment) as proc:
        await proc.server.register_mcp_toolset("progress", "pg", sys.executable, [script])
        await proc.server.update_allowed_toolsets(INSTANCE, ["progress"])
        owner, _events = proc.open_caller()
        await proc.declare(owner, [])
        async with deployment.agent(INSTANCE, f"mcp:{SESSION}", extra_args=("--progress-interval", "600")) as agent:
            call = AgentToolCall(proc.nursery, agent, "pg.count", {"steps": 8}, progress=True)
            result = await call.outcome()
            assert not result.is_error, text_of(result)
            assert "counted 8" in text_of(result)
            # Every report forwarded, in order, before the response (a report behind it would find the
            # agent's request gone and be dropped). The server reads the toolset's reports off its stream,
            # not through the SDK's progress callback, which runs in a task of its own and let the last
            # reports trail the result. The agent's SDK also runs its callback in a task of its own, so
            # its last few may land just after the result: wait for them.
            await call.wait_progress(lambda seen: len(seen) >= 8)
            assert call.progress == [(float(step), 8.0, f"step {step}") for step in range(1, 9)]


async def test_a_configured_toolsets_approval_timeout_reaches_its_definition(deployment: Deployment) -> None:
    import sys
    from pathlib import Path

    from oubliette_server.features.toolsets.from_config import parse_toolsets, register_from_config

    echo = str(Path(__file__).resolve().parents[3] / "examples" / "mcp_echo.py")
    entries = parse_toolsets({"echo": {
        "kind": "command", "prefix": "ex", "command": [sys.executable, echo],
        "requires_approval": True, "approval_timeout": {"echo_external": 5},
    }}, "test.toml")
    async with in_process(deployment) as proc:
        await register_from_config(proc.server, entries, {})
        definition = proc.server.toolsets.registry.definitions["echo"]
        assert definition.approval_timeout_ms_for("echo_external") == 5000
        assert definition.approval_timeout_ms == 600_000, "the tools not named keep the server's"
