"""Approvals decided by a person in the caller's MCP client.

End to end with the real programs: oubliette-server as the stdio MCP server of an SDK `Client`
whose `elicitation_callback` stands for the person, the guest runtime running the scripted demo
agent that calls a gated caller tool. Both protocol eras: `mode="legacy"` (`elicitation/create`
on the waiting `session_message`) and the SDK's default (2026-07-28: an `input_required`
result, answered by the client's retry). The caller reads only tool results; frames are read
back with `session_events`.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable

import mcp_types as types
import pytest
import trio
from mcp import Client

from harness import DEMO_AGENT, EVENT_TIMEOUT, Deployment, structured, text_of
from elicitation_forms import forms_config

DELETE = {
    "name": "delete_file",
    "description": "Delete a file on the host",
    "inputSchema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    "requires_approval": True,
}
MESSAGE = 'Please call myapp_delete_file {"path": "/tmp/x"}'
MODES = ["legacy", "auto"]
TURN = 60

Answer = Callable[[Any, Any], Awaitable[types.ElicitResult]]


class Person:
    """The person at the caller's MCP client: answers each form with `reply`, keeping what was asked."""

    def __init__(self, reply: Answer | types.ElicitResult) -> None:
        self.asked: list[Any] = []
        self.was_asked = trio.Event()
        self._reply = reply

    async def __call__(self, context: Any, params: Any) -> types.ElicitResult:
        self.asked.append(params)
        self.was_asked.set()
        if isinstance(self._reply, types.ElicitResult):
            return self._reply
        return await self._reply(context, params)


@asynccontextmanager
async def person_caller(
    deployment: Deployment, person: Person | None, *extra: str, mode: str = "legacy"
) -> AsyncIterator[Client]:
    """oubliette-server as the stdio MCP server of a caller whose client offers elicitation (if `person`)."""
    async with Client(deployment.server_parameters(*extra), mode=mode, elicitation_callback=person) as client:
        yield client


async def frames(caller: Client, session_id: str, type_: str, wait_ms: int = 0) -> list[dict[str, Any]]:
    result = await caller.call_tool("session_events", {"session_id": session_id, "types": [type_], "wait_ms": wait_ms})
    assert not result.is_error, text_of(result)
    return [{"seq": f["seq"], **f["payload"]} for f in structured(result)["frames"]]


async def gated_turn(caller: Client, session_id: str) -> dict[str, Any]:
    with trio.fail_after(TURN):
        result = await caller.call_tool("session_message", {
            "instance": "box1", "session_id": session_id, "message": MESSAGE,
            "context": {"caller_id": "myapp", "caller_tools": [DELETE]}, "wait": TURN,
        })
    assert not result.is_error, text_of(result)
    return structured(result)


def form_of(person: Person) -> tuple[str, dict[str, Any]]:
    [params] = person.asked
    return params.message, params.requested_schema


@pytest.mark.parametrize("mode", MODES)
async def test_accept_and_approve_runs_the_tool(deployment: Deployment, mode: str) -> None:
    person = Person(types.ElicitResult(action="accept", content={"approve": True}))
    async with person_caller(deployment, person, mode=mode) as caller, deployment.guest("box1", DEMO_AGENT):
        stopped = await gated_turn(caller, "s-el-ok")
        # Approved by the person, the call reaches the caller: the turn stops for it.
        assert stopped["stop_reason"] == "requires_action", stopped
        [request] = stopped["pending"]
        assert (request["kind"], request["tool"]) == ("caller_tool", "delete_file"), request
        [relayed] = await frames(caller, "s-el-ok", "caller_tool_request")
        assert relayed["request_id"] == request["request_id"]
        with trio.fail_after(TURN):
            done = await caller.call_tool("caller_tool_response", {
                "session_id": "s-el-ok", "request_id": request["request_id"], "result": {"deleted": "/tmp/x"},
                "wait": TURN,
            })
        assert not done.is_error, text_of(done)
        ended = structured(done)
        assert ended["stop_reason"] == "end_turn", ended
        assert "deleted" in ended["text"] and "/tmp/x" in ended["text"], ended["text"]
        message, schema = form_of(person)
        assert "myapp_delete_file" in message and '"path": "/tmp/x"' in message
        assert schema["properties"]["approve"]["type"] == "boolean" and schema["required"] == ["approve"]
        assert "reason" in schema["properties"]
        [resolved] = await frames(caller, "s-el-ok", "approval_resolved")
        assert (resolved["approve"], resolved["who"], resolved["action"]) == (True, "elicitation", "accept")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("answer", "reason"), [
    (types.ElicitResult(action="accept", content={"approve": False, "reason": "keep the build output"}), "keep the build output"),
    (types.ElicitResult(action="decline"), "declined by the user"),
    (types.ElicitResult(action="cancel"), "declined by the user"),
], ids=["accept-deny", "decline", "cancel"])
async def test_a_person_who_does_not_approve_denies_with_the_reason(
    deployment: Deployment, mode: str, answer: types.ElicitResult, reason: str
) -> None:
    person = Person(answer)
    async with person_caller(deployment, person, mode=mode) as caller, deployment.guest("box1", DEMO_AGENT):
        ended = await gated_turn(caller, "s-el-no")
        assert ended["stop_reason"] == "end_turn", ended
        assert "The tool failed" in ended["text"] and reason in ended["text"], ended["text"]
        assert len(person.asked) == 1
        [resolved] = await frames(caller, "s-el-no", "approval_resolved")
        assert (resolved["approve"], resolved["who"], resolved["reason"]) == (False, "elicitation", reason)
        assert resolved["action"] == answer.action
        assert await frames(caller, "s-el-no", "caller_tool_request") == [], "nothing ran"


@pytest.mark.parametrize("mode", MODES)
async def test_a_caller_without_elicitation_gets_the_requires_approval_stop(deployment: Deployment, mode: str) -> None:
    async with person_caller(deployment, None, mode=mode) as caller, deployment.guest("box1", DEMO_AGENT):
        stopped = await gated_turn(caller, "s-el-tool")
        assert stopped["stop_reason"] == "requires_approval", stopped
        [request] = stopped["approval_requests"]
        denied = await caller.call_tool("approval_response", {
            "session_id": "s-el-tool", "request_id": request["request_id"], "approve": False, "reason": "no", "wait": TURN,
        })
        assert structured(denied)["stop_reason"] == "end_turn", structured(denied)


async def test_delivery_tool_never_elicits(deployment: Deployment) -> None:
    person = Person(types.ElicitResult(action="accept", content={"approve": True}))
    async with person_caller(deployment, person, "--approval-delivery", "tool") as caller, deployment.guest("box1", DEMO_AGENT):
        stopped = await gated_turn(caller, "s-el-deliv")
        assert stopped["stop_reason"] == "requires_approval", stopped
        assert person.asked == []
        [request] = stopped["approval_requests"]
        await caller.call_tool("approval_response", {"session_id": "s-el-deliv", "request_id": request["request_id"], "approve": False})


async def test_delivery_elicitation_denies_when_the_client_cannot_ask(deployment: Deployment) -> None:
    async with person_caller(deployment, None, "--approval-delivery", "elicitation") as caller, deployment.guest("box1", DEMO_AGENT):
        ended = await gated_turn(caller, "s-el-strict")
        assert ended["stop_reason"] == "end_turn", ended
        assert "offers no elicitation" in ended["text"], ended["text"]


@pytest.mark.parametrize("mode", MODES)
async def test_the_tool_answer_first_wins_over_the_person(deployment: Deployment, mode: str) -> None:
    """The caller denies with approval_response while the form is open; the person's later approval loses."""
    asked = trio.Event()
    release = trio.Event()

    async def slow(context: Any, params: Any) -> types.ElicitResult:
        asked.set()
        with trio.move_on_after(EVENT_TIMEOUT):
            await release.wait()
        return types.ElicitResult(action="accept", content={"approve": True})

    person = Person(slow)
    async with person_caller(deployment, person, mode=mode) as caller, deployment.guest("box1", DEMO_AGENT):
        turns: list[dict[str, Any]] = []

        async def turn() -> None:
            turns.append(await gated_turn(caller, "s-el-race"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(turn)
            with trio.fail_after(EVENT_TIMEOUT):
                await asked.wait()
            [request] = await frames(caller, "s-el-race", "approval_request")
            denied = await caller.call_tool("approval_response", {
                "session_id": "s-el-race", "request_id": request["request_id"], "approve": False, "reason": "the model said no",
            })
            assert structured(denied) == {"resolved": True}, text_of(denied)
            release.set()
        [ended] = turns
        assert "the model said no" in ended["text"], ended
        resolved = await frames(caller, "s-el-race", "approval_resolved")
        assert [(r["approve"], r["who"]) for r in resolved] == [(False, resolved[0]["who"])]
        assert resolved[0]["who"] != "elicitation"
        assert await frames(caller, "s-el-race", "caller_tool_request") == []


async def test_the_person_first_wins_over_the_tool_answer(deployment: Deployment) -> None:
    """The person denies in the form; the caller's approval_response afterwards is refused as already resolved."""
    person = Person(types.ElicitResult(action="decline"))
    async with person_caller(deployment, person) as caller, deployment.guest("box1", DEMO_AGENT):
        ended = await gated_turn(caller, "s-el-race2")
        assert "declined by the user" in ended["text"], ended
        [request] = await frames(caller, "s-el-race2", "approval_request")
        for approve in (True, False):  # neither the contradicting nor the same verdict is taken
            late = await caller.call_tool("approval_response", {
                "session_id": "s-el-race2", "request_id": request["request_id"], "approve": approve,
            })
            assert late.is_error and "already resolved" in text_of(late), text_of(late)
        assert len(await frames(caller, "s-el-race2", "approval_resolved")) == 1


# -- a toolset's own elicitation ----------------------------------------


BOOK = 'Please call forms.book {"place": "Chez Oubliette"}'


async def book_turn(caller: Client, session_id: str) -> dict[str, Any]:
    with trio.fail_after(TURN):
        result = await caller.call_tool("session_message", {
            "instance": "box1", "session_id": session_id, "message": BOOK, "wait": TURN,
        })
    assert not result.is_error, text_of(result)
    return structured(result)


@pytest.mark.parametrize("mode", MODES)
async def test_a_toolsets_elicitation_is_answered_by_the_person(deployment: Deployment, mode: str) -> None:
    person = Person(types.ElicitResult(action="accept", content={"seats": 4}))
    config = forms_config(deployment)
    async with person_caller(deployment, person, "--config", str(config), mode=mode) as caller, \
            deployment.guest("box1", DEMO_AGENT):
        ended = await book_turn(caller, "s-el-forms")
        assert ended["stop_reason"] == "end_turn", ended
        assert '"action": "accept"' in ended["text"] and '"seats": 4' in ended["text"], ended["text"]
        message, schema = form_of(person)
        assert "How many seats at Chez Oubliette?" in message and schema["properties"]["seats"]["type"] == "integer"
        [request] = await frames(caller, "s-el-forms", "approval_request")
        assert request["origin"] == "toolset" and request["tool_name"] == "forms.book"
        assert request["elicitation"]["requestedSchema"] == schema
        [resolved] = await frames(caller, "s-el-forms", "approval_resolved")
        assert (resolved["approve"], resolved["content"], resolved["who"]) == (True, {"seats": 4}, "elicitation")


async def test_a_toolsets_elicitation_answered_with_approval_response(deployment: Deployment) -> None:
    config = forms_config(deployment)
    async with person_caller(deployment, None, "--config", str(config)) as caller, deployment.guest("box1", DEMO_AGENT):
        stopped = await book_turn(caller, "s-el-forms2")
        assert stopped["stop_reason"] == "requires_approval", stopped
        [request] = stopped["approval_requests"]
        assert request["origin"] == "toolset" and "elicitation" in request
        wrong = await caller.call_tool("approval_response", {
            "session_id": "s-el-forms2", "request_id": request["request_id"], "approve": True, "content": {"seats": "many"},
        })
        assert wrong.is_error and "still pending" in text_of(wrong), text_of(wrong)
        answered = await caller.call_tool("approval_response", {
            "session_id": "s-el-forms2", "request_id": request["request_id"], "approve": True, "content": {"seats": 2},
            "wait": TURN,
        })
        ended = structured(answered)
        assert ended["stop_reason"] == "end_turn", ended
        assert '"action": "accept"' in ended["text"] and '"seats": 2' in ended["text"], ended["text"]


async def test_a_toolsets_elicitation_declined_goes_back_as_decline(deployment: Deployment) -> None:
    person = Person(types.ElicitResult(action="decline"))
    config = forms_config(deployment)
    async with person_caller(deployment, person, "--config", str(config)) as caller, deployment.guest("box1", DEMO_AGENT):
        ended = await book_turn(caller, "s-el-forms3")
        assert '"action": "decline"' in ended["text"], ended["text"]
