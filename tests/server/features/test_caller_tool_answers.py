"""Answers to caller tool requests that must be refused, and what the agent gets meanwhile.

What one stdio caller can do is tested against the real server. Two callers of
one server (the second must not answer the first's requests) and the state of
the pending-call table are tested in process: `OublietteServer` runs in the
test's nursery, `CallerApi` is driven directly, and the agent's call goes
over the relay socket through `RelayLink`.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from protocol import RelayError
from oubliette_server.core.callers import CallerConnection
from oubliette_server.core.frame_log import FrameLog
from oubliette_server.core.pending_requests import SharedStore
from oubliette_server.core.server_owned import DECLARATION_KEY, OWNER_KEY, SESSION_RECORD
from oubliette_server.core.sessions import SessionRegistry
from oubliette_server.features.caller_tool_relay.pending import CallerCallRegistry
from oubliette_server.features.cluster.log_bus import LogBus
from oubliette_server.store.api import FrameQuery
from oubliette_server.store.postgres import PostgresFrameStore

from harness import EVENT_TIMEOUT, Deployment, structured, text_of

pytestmark = pytest.mark.in_process
from oubliette_server.program.cli import _serve_parser, build_config
from oubliette_server.program.config import ServerConfig
from in_process_calls import (
    INSTANCE,
    NOTIFY,
    SESSION,
    agent_call_in_flight,
    declare,
    in_process,
    result_frames,
    start_agent_call,
)


# -- one stdio caller, real server ------------------------------------------------------


@pytest.mark.real_programs
async def test_second_answer_is_refused_and_the_first_stands(deployment: Deployment) -> None:
    async with deployment.caller() as (caller, events):
        await declare(caller)
        async with agent_call_in_flight(deployment, events) as (request, outcome, finished):
            answer = {"session_id": SESSION, "request_id": request["request_id"]}
            first = await caller.call_tool("caller_tool_response", dict(answer, result={"answer": 1}))
            assert structured(first) == {"resolved": True}
            for second in ({"result": {"answer": 2}}, {"error": "changed my mind"}):
                refused = await caller.call_tool("caller_tool_response", dict(answer, **second))
                assert refused.is_error
                text = text_of(refused)
                assert request["request_id"] in text
                assert "no longer pending" in text and "already resolved" in text, text
        result = outcome["result"]
        assert not result.is_error, text_of(result)
        assert result.structured_content == {"answer": 1}
        stored = await result_frames(caller, request["request_id"])
        assert len(stored) == 1, "nothing is resolved twice"
        assert stored[0]["payload"]["result"] == {"answer": 1}


BAD_ANSWERS = {
    "unknown request_id": (
        {"request_id": "ctr-0000000000000000", "result": "x"},
        ["unknown request_id 'ctr-0000000000000000'"],
    ),
    "wrong session_id": (
        {"session_id": "s2", "result": "x"},
        ["belongs to session 's1', not 's2'"],
    ),
    "both result and error": (
        {"result": {"answer": 0}, "error": "boom"},
        ["'result' or 'error', not both"],
    ),
    "neither result nor error": (
        {},
        ["give either 'result' or 'error'"],
    ),
}


@pytest.mark.parametrize("bad", list(BAD_ANSWERS), ids=list(BAD_ANSWERS))
async def test_bad_answer_is_refused_and_the_call_still_waits(deployment: Deployment, bad: str) -> None:
    """A refused answer says why, resolves nothing; the caller's proper answer then reaches the agent."""
    overrides, expected = BAD_ANSWERS[bad]
    async with deployment.caller() as (caller, events):
        await declare(caller)
        await declare(caller, session_id="s2")  # a real session of the same caller, for the wrong-session case
        async with agent_call_in_flight(deployment, events) as (request, outcome, finished):
            answer = {"session_id": SESSION, "request_id": request["request_id"]}
            refused = await caller.call_tool("caller_tool_response", {**answer, **overrides})
            assert refused.is_error
            for phrase in expected:
                assert phrase in text_of(refused), text_of(refused)
            assert await result_frames(caller, request["request_id"]) == []
            assert not finished.is_set(), "a refused answer must not end the agent's call"
            good = await caller.call_tool("caller_tool_response", dict(answer, result={"answer": 1}))
            assert structured(good) == {"resolved": True}
        assert not outcome["result"].is_error, text_of(outcome["result"])
        assert outcome["result"].structured_content == {"answer": 1}


# -- two callers of one server, in process ------------------------------------------------


async def test_answer_from_another_caller_is_refused(deployment: Deployment) -> None:
    async with in_process(deployment) as proc:
        owner, owner_events = proc.open_caller()
        other, other_events = proc.open_caller()
        await proc.declare(owner, [NOTIFY])
        # The session belongs to its owner: the other caller can neither join nor follow it.
        joined = await proc.call(other, "session_message", {"instance": INSTANCE, "session_id": SESSION, "message": "me too"})
        assert joined.is_error and f"session '{SESSION}' belongs to another caller" in text_of(joined)
        link = await proc.connect_agent(deployment)
        outcome, finished, _ = start_agent_call(proc.nursery, link)

        request = await owner_events.wait_type("caller_tool_request")
        assert [e for e in other_events.events if e.get("type") == "caller_tool_request"] == []
        answer = {"session_id": SESSION, "request_id": request["request_id"]}

        refused = await proc.call(other, "caller_tool_response", dict(answer, result={"from": "other"}))
        assert refused.is_error
        assert f"session '{SESSION}' belongs to another caller" in text_of(refused), text_of(refused)
        assert request["request_id"] in proc.server.calls.pending
        assert not finished.is_set()

        accepted = await proc.call(owner, "caller_tool_response", dict(answer, result={"from": "owner"}))
        assert structured(accepted) == {"resolved": True}
        with trio.fail_after(EVENT_TIMEOUT):
            await finished.wait()
        assert outcome["result"] == {"result": {"from": "owner"}}
        assert proc.server.calls.pending == {}

        again = await proc.call(owner, "caller_tool_response", dict(answer, result={"from": "owner"}))
        assert again.is_error and "no longer pending" in text_of(again)
        assert [e for e in other_events.events if e.get("session_id") == SESSION] == []


async def test_after_the_agent_cancels_nothing_is_pending(deployment: Deployment) -> None:
    async with in_process(deployment) as proc:
        owner, events = proc.open_caller()
        await proc.declare(owner, [NOTIFY])
        link = await proc.connect_agent(deployment)
        outcome, finished, scope = start_agent_call(proc.nursery, link)
        request = await events.wait_type("caller_tool_request")
        assert list(proc.server.calls.pending) == [request["request_id"]]

        scope.cancel()  # the agent gives up; RelayLink sends `cancel`
        cancelled = await events.wait_type("caller_tool_cancelled", request_id=request["request_id"])
        assert cancelled["reason"] == "cancelled by the agent"
        with trio.fail_after(EVENT_TIMEOUT):
            await finished.wait()
        assert outcome["cancelled"]
        assert proc.server.calls.pending == {}

        late = await proc.call(owner, "caller_tool_response", {
            "session_id": SESSION, "request_id": request["request_id"], "result": "late",
        })
        assert late.is_error
        assert "no longer pending" in text_of(late) and "cancelled" in text_of(late), text_of(late)


async def test_after_a_timeout_nothing_is_pending(deployment: Deployment) -> None:
    async with in_process(deployment, caller_timeout=0.3) as proc:
        owner, events = proc.open_caller()
        await proc.declare(owner, [NOTIFY])
        link = await proc.connect_agent(deployment)
        outcome, finished, _ = start_agent_call(proc.nursery, link)
        request = await events.wait_type("caller_tool_request")
        with trio.fail_after(EVENT_TIMEOUT):
            await finished.wait()
        assert outcome["error"].code == -32001
        assert "0.3 s" in outcome["error"].message
        assert proc.server.calls.pending == {}
        cancelled = await events.wait_type("caller_tool_cancelled", request_id=request["request_id"])
        assert cancelled["reason"] == "timeout"

        late = await proc.call(owner, "caller_tool_response", {
            "session_id": SESSION, "request_id": request["request_id"], "result": "late",
        })
        assert late.is_error
        assert "no longer pending" in text_of(late) and "timed out" in text_of(late), text_of(late)


# -- the default timeout ----------------------------------------------------------------


def test_default_caller_timeout_is_60_seconds() -> None:
    """The library default and what the command line builds when no flag (and no config file) says otherwise."""
    assert ServerConfig().caller_timeout == 60
    parser = _serve_parser()
    assert build_config(parser.parse_args([])).caller_timeout == 60
    assert build_config(parser.parse_args(["--caller-timeout", "5"])).caller_timeout == 5
    assert "default 60" in " ".join(parser.format_help().split())


async def test_default_timeout_ends_a_call_after_60_seconds(deployment: Deployment, mock_clock: trio.testing.MockClock) -> None:
    """With no timeout configured anywhere, a call waits 60 s (on a mock clock), then times out."""
    mock_clock.rate = 1.0  # real time still passes, so the bounds below keep working
    async with in_process(deployment) as proc:
        assert proc.server.calls.default_timeout == 60
        owner, events = proc.open_caller()
        await proc.declare(owner, [NOTIFY])
        link = await proc.connect_agent(deployment)
        outcome, finished, _ = start_agent_call(proc.nursery, link)
        request = await events.wait_type("caller_tool_request")

        mock_clock.jump(58)
        await trio.testing.wait_all_tasks_blocked()
        assert not finished.is_set(), "the call must still wait after 58 s"
        assert request["request_id"] in proc.server.calls.pending

        mock_clock.jump(3)
        with trio.fail_after(EVENT_TIMEOUT):
            await finished.wait()
        assert outcome["error"].code == -32001
        assert "60 s" in outcome["error"].message
        assert proc.server.calls.pending == {}


async def test_a_caller_tool_with_an_invalid_schema_is_refused_when_declared(deployment: Deployment) -> None:
    """`{"type": 5}` is not a JSON Schema; it used to be stored and quietly not published."""
    async with in_process(deployment) as proc:
        caller, _ = proc.open_caller()
        for field in ("inputSchema", "resultSchema"):
            broken = dict(NOTIFY, **{field: {"type": 5}})
            result = await proc.call(caller, "session_message", {
                "instance": INSTANCE, "session_id": SESSION, "message": "hi",
                "context": {"caller_id": "myapp", "caller_tools": [broken]},
            })
            assert result.is_error
            assert f"caller tool 'send_notification': {field} is not a valid JSON Schema" in text_of(result), text_of(result)
        assert await proc.server.store.last_seq(INSTANCE) == 0, "nothing was stored for the refused declarations"


# -- an answer on a server that did not store the request (PostgreSQL) --------------------


async def test_an_answer_to_a_request_whose_notice_was_heard_takes_it_from_memory(pg_url: str) -> None:
    """The server that takes an answer to another server's request finds the request in what it heard
    (the request's NOTIFY carries the whole frame): it does not read the session's requests, and the
    answer is still stored once, through the store's claim (`append_outcome`), a second refused."""
    class Heard:
        """The last seq of the notices `here` heard; each sets `event` (a fresh one taken by the waiter)."""

        event = trio.Event()
        last = 0

        def appended(self, instance: str, first: int | None, last: int | None, fields: Any = None) -> None:
            self.last = max(self.last, last or 0)
            self.event.set()

        def missed(self) -> None:
            pass

    heard = Heard()
    agent_side, here = PostgresFrameStore(pg_url), PostgresFrameStore(pg_url)
    async with agent_side.running(), here.running():
        here.hear_appends(heard)
        sessions = SessionRegistry()
        frame_log = FrameLog(here, sessions)
        crossing = SharedStore(LogBus(here, frame_log.append_outcome), "server-c")
        sessions.learn_from(crossing.record_of, crossing.recorded_sessions)
        calls = CallerCallRegistry(frame_log.append, 60, crossing=crossing, find_sessions=sessions.find_by_id)
        owner = CallerConnection("http")
        owner.identity = "key:owner"

        async def put(type: str, payload: dict[str, Any]) -> None:
            frame = await agent_side.append("box1", channel="mcp", session_id="s1", type=type, payload=payload)
            while heard.last < frame.seq:
                heard.event = trio.Event()
                await heard.event.wait()

        def request(request_id: str) -> dict[str, Any]:
            return {"request_id": request_id, "tool": "notify", "arguments": {}, "caller_id": "myapp",
                    "expires_at": "2999-01-01T00:00:00.000Z", "server": "server-b"}

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(here.wait_for_frames, "box1", FrameQuery(session_id="nobody"), 60)  # box1 waited on here
                while here.waiter_count("box1") != 1:
                    await trio.testing.wait_all_tasks_blocked()
                await put(SESSION_RECORD, {OWNER_KEY: "key:owner", DECLARATION_KEY: {
                    "caller_id": "myapp", "tools": [{"name": "notify", "requires_approval": False}]}})
                await put("caller_tool_request", request("ctr-1"))
                assert len(await sessions.owns(owner, "s1", "mcp")) == 1
                await calls.respond(owner, "s1", "ctr-1", result={"ok": 1})  # the first look reads the log
                await put("caller_tool_request", request("ctr-2"))
                queries: list[Any] = []
                real_query = here.query

                async def counted(*args: Any) -> Any:
                    queries.append(args)
                    return await real_query(*args)

                here.query = counted  # type: ignore[method-assign, assignment]
                answered = await calls.respond(owner, "s1", "ctr-2", result={"ok": 2})
                assert answered.remote and answered.done.is_set() and queries == [], "ctr-2 was heard: no read"
                with pytest.raises(RelayError, match="no longer pending"):
                    await calls.respond(owner, "s1", "ctr-2", result={"ok": 3})
                nursery.cancel_scope.cancel()
        results = await agent_side.query("box1", FrameQuery(session_id="s1", types=["caller_tool_result"]))
    assert [(f.payload["request_id"], f.payload["result"]) for f in results] == [("ctr-1", {"ok": 1}), ("ctr-2", {"ok": 2})]
