"""A caller that reads only tool results drives a sandboxed agent.

The caller is the SDK's `Client` with NO logging callback: it learns of the agent's caller
tool calls only from the `requires_action` stops of its own `session_message` and
`caller_tool_response` calls with `wait`, as a model would. Every flow runs in both protocol
eras (mode "legacy" and the default "auto", 2026-07-28), on stdio (the server in process,
over memory streams as on stdio; one test starts the real program) and on Streamable HTTP
(2026-07-28 HTTP callers pass back the `owner_key` their `session_message` returned).

The agent is tests/support/loop_agent.py run by the real guest runtime: it calls the caller tools the
message scripts, one step after the other, the calls of one step at the same time.

Where a test must know that a request is stored before the caller's next call (to make "two
pending at once" and "arrives between two calls" deterministic), the *test* long-polls the
server's frame store; the caller itself never reads an event.
"""

from __future__ import annotations

import datetime
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import pytest
import trio

from harness import Deployment
from oubliette_server.store.sqlite import FrameQuery
from loop_caller import (
    IDLE,
    INSTANCE,
    LOOP_AGENT,
    TURN_TIMEOUT,
    LoopCaller,
    ends_with,
    one_answered_call,
    script,
    tool,
)

pytestmark = pytest.mark.in_process


"""A message the agent answers without calling anything."""


class Loop:
    """One test's world: the server (`app`), a guest running the loop agent, and `new_caller()`."""

    def __init__(self, deployment: Deployment, transport: str, mode: str, app: Any, server: Any) -> None:
        self.deployment = deployment
        self.transport = transport
        self.mode = mode
        self.app = app
        self.server = server

    @asynccontextmanager
    async def new_caller(self) -> AsyncIterator[LoopCaller]:
        """Another caller of the same server (HTTP only: a stdio server serves exactly one caller)."""
        assert self.server is not None
        async with self.server.caller(mode=self.mode, events=False) as (client, events):
            yield LoopCaller(client)
        assert events.events == []

    async def stored(self, session_id: str, type_: str, count: int) -> list[Any]:
        """The test's own view (never the caller's): wait until `count` frames of `type_` are stored."""
        frames: list[Any] = []
        query = FrameQuery(channel="mcp", session_id=session_id, types=(type_,))
        with trio.fail_after(TURN_TIMEOUT):
            while len(frames) < count:
                found, _ = await self.app.store.wait_for_frames(INSTANCE, query, timeout=TURN_TIMEOUT)
                frames.extend(found)
                if found:
                    query = FrameQuery(channel="mcp", session_id=session_id, types=(type_,), after_seq=found[-1].seq)
        return frames


@asynccontextmanager
async def loop_world(deployment: Deployment, transport: str, mode: str) -> AsyncIterator[tuple[Loop, LoopCaller]]:
    async with deployment.guest(INSTANCE, LOOP_AGENT):
        if transport == "stdio":
            async with deployment.caller(mode=mode, events=False) as (client, events):
                yield Loop(deployment, transport, mode, deployment.app, None), LoopCaller(client)  # type: ignore[attr-defined]
        else:
            async with deployment.http_server() as server, server.caller(mode=mode, events=False) as (client, events):
                yield Loop(deployment, transport, mode, server.app, server), LoopCaller(client)  # type: ignore[attr-defined]
    assert events.events == [], "the caller read no event"


ERAS = pytest.mark.parametrize("mode", ["legacy", "auto"])
TRANSPORTS = pytest.mark.parametrize("transport", ["stdio", "http"])


# -- the loop -------------------------------------------------------------------------------------


@TRANSPORTS
@ERAS
async def test_two_caller_tool_calls_answered_with_wait(deployment: Deployment, transport: str, mode: str) -> None:
    """message -> requires_action -> answer with wait -> requires_action -> answer with wait -> end_turn."""
    async with loop_world(deployment, transport, mode) as (world, caller):
        first = ends_with(await caller.message(
            "s1", script([("myapp_lookup", {"n": 1})], [("myapp_store", {"n": 2})]),
            [tool("lookup"), tool("store")], wait=True,
        ), "requires_action")
        assert first["text"] == ""
        [a] = first["pending"]
        assert (a["kind"], a["tool"], a["arguments"], a["caller_id"]) == ("caller_tool", "lookup", {"n": 1}, "myapp")
        assert a["request_id"].startswith("ctr-")

        second = ends_with(await caller.answer("s1", a["request_id"], result={"found": "alpha"}, wait=True),
                           "requires_action")
        assert second["resolved"] is True
        [b] = second["pending"]
        assert (b["tool"], b["arguments"]) == ("store", {"n": 2}), "the answered request is not listed again"

        end = ends_with(await caller.answer("s1", b["request_id"], result="stored", wait=True), "end_turn")
    assert end["resolved"] is True and end["pending"] == [] and end["msg_id"] == first["msg_id"]
    assert 'myapp_lookup -> {"found": "alpha"}' in end["text"]
    assert "myapp_store -> stored" in end["text"]


@TRANSPORTS
@ERAS
async def test_two_requests_pending_at_once(deployment: Deployment, transport: str, mode: str) -> None:
    """Both are listed; answering one with wait returns at once with the other; then the end."""
    async with loop_world(deployment, transport, mode) as (world, caller):
        sent = await caller.message("s2", script([("myapp_lookup", {"n": 1}), ("myapp_lookup", {"n": 2})]),
                                    [tool("lookup")])
        assert "stop_reason" not in sent
        await world.stored("s2", "caller_tool_request", 2)
        both = ends_with(await caller.message("s2", IDLE, wait=True), "requires_action")
        assert sorted(p["arguments"]["n"] for p in both["pending"]) == [1, 2]
        first, other = both["pending"]

        with trio.fail_after(5):  # at once: the other request is already pending
            rest = ends_with(await caller.answer("s2", first["request_id"], result="one", wait=True), "requires_action")
        assert [p["request_id"] for p in rest["pending"]] == [other["request_id"]]

        end = ends_with(await caller.answer("s2", other["request_id"], result="two", wait=True), "end_turn")
    assert end["msg_id"] == sent["msg_id"] and end["pending"] == []
    assert "myapp_lookup -> one" in end["text"] and "myapp_lookup -> two" in end["text"]


@TRANSPORTS
@ERAS
async def test_a_request_arriving_between_two_calls_is_returned_by_the_next(
    deployment: Deployment, transport: str, mode: str,
) -> None:
    async with loop_world(deployment, transport, mode) as (world, caller):
        first = ends_with(await caller.message(
            "s3", script([("myapp_lookup", {"n": 1})], [("myapp_lookup", {"n": 2})]), [tool("lookup")], wait=True,
        ), "requires_action")
        [a] = first["pending"]
        answered = await caller.answer("s3", a["request_id"], result="one")  # no wait: the call returns now
        assert answered == {"resolved": True}
        await world.stored("s3", "caller_tool_request", 2)  # the agent's next call arrives meanwhile

        nxt = ends_with(await caller.message("s3", IDLE, wait=True), "requires_action")
        [b] = nxt["pending"]
        assert b["arguments"] == {"n": 2} and b["request_id"] != a["request_id"]
        end = ends_with(await caller.answer("s3", b["request_id"], result="two", wait=True), "end_turn")
    assert end["msg_id"] == first["msg_id"]
    assert "myapp_lookup -> one" in end["text"] and "myapp_lookup -> two" in end["text"]


@TRANSPORTS
@ERAS
async def test_an_error_answer_reaches_the_agent(deployment: Deployment, transport: str, mode: str) -> None:
    async with loop_world(deployment, transport, mode) as (world, caller):
        first = ends_with(await caller.message("s4", script([("myapp_store", {"n": 1})]), [tool("store")], wait=True),
                          "requires_action")
        [a] = first["pending"]
        end = ends_with(await caller.answer("s4", a["request_id"], error="disk full", wait=True), "end_turn")
    assert end["resolved"] is True
    assert "myapp_store failed:" in end["text"] and "disk full" in end["text"]


@TRANSPORTS
@ERAS
async def test_the_tools_timeout_passes_while_the_caller_decides(deployment: Deployment, transport: str, mode: str) -> None:
    """The clock runs while the caller decides; `expires_at` says until when. The agent gets a
    timeout error at once when it expires; a late answer records nothing, and with wait the
    caller is told so and still gets the turn's next stop."""
    async with loop_world(deployment, transport, mode) as (world, caller):
        before = datetime.datetime.now(datetime.timezone.utc)
        first = ends_with(await caller.message(
            "s5", script([("myapp_slow", {"n": 1})]), [tool("slow", timeout_ms=1500)], wait=True,
        ), "requires_action")
        after = datetime.datetime.now(datetime.timezone.utc)
        [a] = first["pending"]
        expires = datetime.datetime.fromisoformat(a["expires_at"].replace("Z", "+00:00"))
        assert a["expires_at"].endswith("Z")
        # 1.5 s from the agent's call, which came between our two readings of the clock.
        slack = datetime.timedelta(milliseconds=5)
        assert before + datetime.timedelta(seconds=1.5) - slack <= expires <= after + datetime.timedelta(seconds=1.5) + slack

        [cancelled] = await world.stored("s5", "caller_tool_cancelled", 1)  # the caller is still "deciding"
        assert cancelled.payload["reason"] == "timeout"
        late = await caller.answer("s5", a["request_id"], result="too late")
        assert "no longer pending" in late["error"] and "timed out" in late["error"]
        end = ends_with(await caller.answer("s5", a["request_id"], result="too late", wait=True), "end_turn")
    assert end["resolved"] is False and "timed out" in end["not_pending"]
    assert "myapp_slow failed:" in end["text"] and "timed out after 1.5 s" in end["text"]
    assert end["pending"] == []


@ERAS
async def test_another_caller_sees_and_answers_nothing(deployment: Deployment, mode: str) -> None:
    """Over HTTP (a stdio server has exactly one caller): the other caller's own waits list none
    of the owner's requests, and everything it tries on the owner's session is refused."""
    async with loop_world(deployment, "http", mode) as (world, owner), world.new_caller() as other:
        first = ends_with(await owner.message("s6", script([("myapp_lookup", {"n": 1})]), [tool("lookup")], wait=True),
                          "requires_action")
        [a] = first["pending"]

        own = ends_with(await other.message("s-other", IDLE, wait=True), "end_turn")
        assert own["pending"] == []
        refusals = [
            await other.answer("s6", a["request_id"], result="hijacked"),
            await other.answer("s6", a["request_id"], result="hijacked", wait=True),
            await other.message("s6", IDLE, wait=True),
            await other.call("session_events", session_id="s6"),
            await other.call("approval_response", session_id="s6", request_id=a["request_id"], approve=True),
        ]
        for refused in refusals:
            assert "error" in refused, refused
        for refused in refusals[:4]:
            assert "belongs to another caller" in refused["error"], refused

        end = ends_with(await owner.answer("s6", a["request_id"], result="mine", wait=True), "end_turn")
    assert "myapp_lookup -> mine" in end["text"]


# -- the real program on stdio ------------------------------------------------------------------


@pytest.mark.real_programs
async def test_the_loop_with_the_real_server_on_stdio(deployment: Deployment) -> None:
    """The issue's case: a tool-results-only caller, a caller tool, wait: requires_action with the
    arguments as soon as the agent calls, the answer with wait, end_turn with the result."""
    async with deployment.guest(INSTANCE, LOOP_AGENT), deployment.caller(events=False) as (client, events):
        end = await one_answered_call(LoopCaller(client))
    assert events.events == []
    assert 'myapp_send_notification -> {"status": "sent"}' in end["text"]
