"""Two servers on one PostgreSQL database: the caller on A, the sandbox on B (docs/SCALING.md).

The caller (MCP over HTTP) talks only to server A; the guest runtime and the agent's
oubliette-client talk only to server B. Nothing passes between A and B but the log: the
declaration is in A's `session_record` frame, B appends the `caller_tool_request` and waits for its
outcome frame, A lists the request as pending and stores the answer with `append_outcome`,
which lets exactly one outcome win across servers. Everything is a real program (the servers,
the guest runtime, tests/support/loop_agent.py) and a real PostgreSQL (tests/support/postgres.py).
"""

from __future__ import annotations

import datetime
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import pytest
import trio

from harness import Deployment, EventLog
from oubliette_server.store.api import FrameQuery
from oubliette_server.store.postgres import PostgresFrameStore
from tether_http import poll
from loop_caller import INSTANCE, LOOP_AGENT, LoopCaller, ends_with, script, tool
from cluster_servers import one_outcome_each, turn_end, two_servers

TOOL = "myapp_send_notification"


class PushedCaller(LoopCaller):
    """A `LoopCaller` that also hears its events (`events`): what A pushes to it, whichever server
    appended the frame (A's log tail brings B's)."""

    def __init__(self, client: Any, events: EventLog) -> None:
        super().__init__(client)
        self.events = events

    def seqs(self, session_id: str) -> list[int]:
        """The seqs of the session's events received, in order of arrival."""
        return [e["seq"] for e in self.events.events if e.get("session_id") == session_id]


@asynccontextmanager
async def caller_on_a(pg_url: str, mode: str = "legacy", events: bool = False) -> AsyncIterator[PushedCaller]:
    """`two_servers`, and a caller (MCP over HTTP in protocol era `mode`) on A; with `events` it
    hears its events (else it acts on tool results only)."""
    async with two_servers(pg_url) as (server_a, _), server_a.caller(mode=mode, events=events) as (client, log):
        yield PushedCaller(client, log)


async def pushed_once(caller: PushedCaller, session_id: str, frames: list[Any]) -> None:
    """Every frame of `frames` reaches the caller as a pushed event (each awaited, bounded), and no
    event comes twice."""
    try:
        for frame in frames:
            await caller.events.wait_for(lambda e: e.get("session_id") == session_id and e["seq"] == frame.seq, 10)
    except trio.TooSlowError:
        raise AssertionError(
            f"frames not pushed to the caller on A: {[(f.seq, f.type) for f in frames if f.seq not in caller.seqs(session_id)]}"
            f" (received {caller.seqs(session_id)})") from None
    seqs = caller.seqs(session_id)
    assert len(seqs) == len(set(seqs)), f"an event was pushed twice: {seqs}"


def owed_events(mode: str, frames: list[Any], wanted: list[Any]) -> list[Any]:
    """The frames of `wanted` the caller must have had pushed. A handshake-era caller has a stream
    all along: every one. A 2026-07-28 caller has one only while a `wait` runs (docs/SCALING.md):
    what the agent appends after its request stopped a wait and before the caller's answer starts
    the next one (the agent may print a line after asking its next tool) is read with
    `session_events`, not pushed, on one server as across servers; nor is the request itself,
    which the stop's `pending` carries whole (README.md, "Caller tools")."""
    if mode == "legacy":
        return wanted
    requests = [f.seq for f in frames if f.type == "caller_tool_request"]
    answers = [f.seq for f in frames if f.type == "caller_tool_result"]
    between = list(zip(requests, answers))
    return [f for f in wanted if f.seq not in requests and not any(asked < f.seq < answered for asked, answered in between)]


async def session_frames(pg_url: str, session_id: str) -> list[Any]:
    """Every frame of `session_id` in the log, read with a store of the test's own."""
    store = PostgresFrameStore(pg_url)
    async with store.running():
        return await store.query(INSTANCE, FrameQuery(session_id=session_id, limit=200))


async def caller_tool_frames(pg_url: str, session_id: str) -> list[Any]:
    return [f for f in await session_frames(pg_url, session_id) if f.type.startswith("caller_tool_")]


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_a_call_relayed_from_b_is_answered_on_a(pg_url: str, mode: str) -> None:
    """A result and an error answered on A reach the agent on B; the caller that reads no events
    learns of each request from its own `wait` on A (with the arguments and B's deadline), in
    both protocol eras (handshake, and 2026-07-28: the SDK's default)."""
    async with caller_on_a(pg_url, mode, events=True) as caller:
        first = ends_with(await caller.message(
            "s1", script([(TOOL, {"n": 1})], [(TOOL, {"n": 2})]), [tool("send_notification")], wait=60,
        ), "requires_action")
        [call] = first["pending"]
        assert call["arguments"] == {"n": 1} and call["tool"] == "send_notification" and call["expires_at"]
        second = ends_with(await caller.answer("s1", call["request_id"], result={"status": "sent"}, wait=60),
                           "requires_action")
        assert second["resolved"] is True
        [call2] = second["pending"]
        assert call2["arguments"] == {"n": 2}
        end = ends_with(await caller.answer("s1", call2["request_id"], error="no route to host", wait=60), "end_turn")
        again = await caller.answer("s1", call2["request_id"], result={"status": "late"})
        # The frames B appended were pushed to the caller on A during its waits (both eras push there):
        # each request, and the turn's deltas and end, each once.
        frames = await session_frames(pg_url, "s1")
        b_frames = [f for f in frames if f.type in ("caller_tool_request", "assistant.delta", "assistant.done")]
        assert [f.type for f in b_frames].count("caller_tool_request") == 2
        await pushed_once(caller, "s1", owed_events(mode, frames, b_frames))
    assert f'{TOOL} -> {{"status": "sent"}}' in end["text"], end
    assert f"{TOOL} failed: no route to host" in end["text"], end
    assert "no longer pending: it was already resolved with an error" in again["error"], again
    outcomes = one_outcome_each(await caller_tool_frames(pg_url, "s1"))
    assert [o.type for o in outcomes.values()] == ["caller_tool_result"] * 2


async def test_an_unanswered_call_times_out_on_b_and_a_late_answer_on_a_is_refused(pg_url: str) -> None:
    async with caller_on_a(pg_url) as caller:
        first = ends_with(await caller.message(
            "s2", script([(TOOL, {"n": 1})]), [tool("send_notification", timeout_ms=1500)], wait=60,
        ), "requires_action")
        [call] = first["pending"]
        with trio.fail_after(60):
            events = await caller.call("session_events", session_id="s2", types=["assistant.done"], wait_ms=30_000)
        [done] = events["frames"]
        late = await caller.answer("s2", call["request_id"], result={"status": "too late"})
    assert f"{TOOL} failed:" in done["payload"]["text"] and "timed out after 1.5 s" in done["payload"]["text"], done
    assert "no longer pending: it was already timed out" in late["error"], late
    [outcome] = one_outcome_each(await caller_tool_frames(pg_url, "s2")).values()
    assert outcome.type == "caller_tool_cancelled" and outcome.payload["reason"] == "timeout"


async def test_an_answer_on_a_racing_the_timeout_on_b_resolves_each_call_once(pg_url: str) -> None:
    """The caller answers on A right at B's deadline, so A's answer and B's timeout race in the
    database. Whichever wins, each request has one outcome frame, and the agent and the caller
    agree on it: a winning answer is what the agent printed; a losing one was refused."""
    offsets = [-0.03, -0.01, 0.0, 0.01, 0.03]
    steps = [[(TOOL, {"n": i})] for i in range(len(offsets))]
    async with caller_on_a(pg_url) as caller:
        stop = ends_with(await caller.message(
            "s3", script(*steps), [tool("send_notification", timeout_ms=1000)], wait=60,
        ), "requires_action")
        answered: dict[int, bool] = {}
        for i, offset in enumerate(offsets):
            [call] = stop["pending"]
            assert call["arguments"] == {"n": i}
            expires = datetime.datetime.fromisoformat(call["expires_at"].replace("Z", "+00:00")).timestamp()
            await trio.sleep(max(0.0, expires + offset - time.time()))  # aim the answer at B's deadline: the race
            stop = await caller.answer("s3", call["request_id"], result={"won": i}, wait=60)
            assert stop["resolved"] is True or "already timed out" in stop["not_pending"], stop
            answered[i] = stop["resolved"]
            if i < len(offsets) - 1:
                ends_with(stop, "requires_action")
        end = ends_with(stop, "end_turn")
    outcomes = one_outcome_each(await caller_tool_frames(pg_url, "s3"))
    lines = [line for line in end["text"].splitlines() if line.startswith(TOOL)]
    assert len(lines) == len(offsets) == len(outcomes)
    for i, (line, outcome) in enumerate(zip(lines, outcomes.values())):
        if answered[i]:
            assert outcome.type == "caller_tool_result" and line == f'{TOOL} -> {{"won": {i}}}', (line, outcome)
        else:
            assert outcome.type == "caller_tool_cancelled" and "timed out" in line, (line, outcome)


async def test_the_caller_leaving_a_fails_the_agents_call_on_b_at_once(pg_url: str) -> None:
    """The caller's connection to A ends while B's agent waits on its request (timeout 60 s): A
    stores `caller_tool_cancelled` (caller disconnected) and the agent fails now, not at the timeout."""
    async with two_servers(pg_url) as (server_a, server_b):
        async with server_a.caller(events=False) as (client, _):
            caller = LoopCaller(client)
            ends_with(await caller.message(
                "s4", script([(TOOL, {"n": 1})]), [tool("send_notification", timeout_ms=60_000)], wait=60,
            ), "requires_action")
        frame = await turn_end(server_b, "s4")
    assert "connection error: caller 'myapp' disconnected before responding" in frame["payload"]["text"], frame
    [outcome] = one_outcome_each(await caller_tool_frames(pg_url, "s4")).values()
    assert outcome.type == "caller_tool_cancelled" and outcome.payload["reason"] == "caller disconnected"


async def test_the_agents_cancel_on_b_ends_the_request_the_caller_sees_on_a(pg_url: str) -> None:
    """An agent on B (its own oubliette-client, bound to the session) cancels its call: B stores
    `caller_tool_cancelled` ("cancelled by the agent"); the caller on A stops seeing it pending, a
    late answer on A is refused as cancelled, and the request has exactly one outcome."""
    from loop_caller import IDLE

    a, b = Deployment(store=pg_url), Deployment(store=pg_url)
    try:
        async with a.http_server("--config", str(a.config_file(INSTANCE))) as server_a, \
                b.http_server("--config", str(b.config_file(INSTANCE))) as server_b, \
                b.guest(INSTANCE, LOOP_AGENT), server_a.caller(events=False) as (client, _):
            await server_b.wait_connected(INSTANCE)
            caller = LoopCaller(client)
            ends_with(await caller.message("s6", IDLE, [tool("send_notification", timeout_ms=60_000)], wait=60), "end_turn")
            async with b.agent(INSTANCE, "mcp:s6") as agent, trio.open_nursery() as nursery:
                scope = trio.CancelScope()
                outcome: dict[str, Any] = {}

                async def agent_call() -> None:
                    with scope:
                        outcome["result"] = await agent.call_tool(TOOL, {"n": 7})

                nursery.start_soon(agent_call)
                with trio.fail_after(30):  # A learns of B's request from the log (a long poll on A)
                    asked = await caller.call("session_events", session_id="s6", types=["caller_tool_request"], wait_ms=20_000)
                [frame] = asked["frames"]
                request = frame["payload"]
                assert request["arguments"] == {"n": 7}
                scope.cancel()  # the SDK client sends notifications/cancelled to oubliette-client on B
            assert "result" not in outcome
            with trio.fail_after(30):
                ended = await caller.call("session_events", session_id="s6", types=["caller_tool_cancelled"], wait_ms=20_000)
            [cancelled] = [f["payload"] for f in ended["frames"]]
            assert cancelled["request_id"] == request["request_id"] and cancelled["reason"] == "cancelled by the agent"
            late = await caller.answer("s6", request["request_id"], result={"status": "late"})
            assert "no longer pending" in late["error"] and "cancelled" in late["error"], late
    finally:
        a.cleanup()
        b.cleanup()
    [outcome_frame] = one_outcome_each(await caller_tool_frames(pg_url, "s6")).values()
    assert outcome_frame.type == "caller_tool_cancelled"


async def test_a_turn_on_b_is_read_on_a_by_sse_and_by_long_poll(pg_url: str) -> None:
    """The caller's message goes in on A, the guest on B answers it: A's SSE stream and a long
    poll on A both get the turn's `assistant.done`, which B stored (woken by LISTEN on A)."""
    from loop_caller import IDLE
    from tether_http import sse

    async with two_servers(pg_url) as (server_a, _), server_a.rest() as rest, server_a.rest() as poller, \
            server_a.caller(events=False) as (client, _):
        caller = LoopCaller(client)
        filters = {"channel": "mcp", "session_id": "s7", "types": "assistant.done"}
        async with sse(rest, INSTANCE, params=filters) as stream, trio.open_nursery() as nursery:
            polled: dict[str, Any] = {}

            async def long_poll() -> None:
                polled.update(await poll(poller, INSTANCE, {**filters, "wait_ms": 25_000}))

            nursery.start_soon(long_poll)
            sent = await caller.message("s7", IDLE, [tool("send_notification")])
            assert "error" not in sent, sent
            with trio.fail_after(30):
                event = await stream.next(timeout=30)
        assert event["event"] == "frame" and event["data"]["type"] == "assistant.done"
        assert event["data"]["session"] == {"channel": "mcp", "id": "s7"}
        assert polled["frames"] == [event["data"]] and not polled["timed_out"]


@pytest.mark.parametrize("door", ["http_tether", "mcp_session_message"])
async def test_the_first_message_ever_can_go_to_a_server_that_does_not_hold_the_guest(pg_url: str, door: str) -> None:
    """A fresh database, `box1` configured nowhere, its guest connected to A, not one frame yet:
    the first message to box1 is sent to B (HTTP tether ingress, or MCP `session_message`), and
    B takes it (it knows box1 by its guest lease) and A's guest runs the turn. B used to answer
    the HTTP ingress `404 unknown instance 'box1'`."""
    a, b = Deployment(store=pg_url), Deployment(store=pg_url)
    try:
        async with a.http_server() as server_a, b.http_server() as server_b, a.guest(INSTANCE, LOOP_AGENT):
            await server_a.wait_connected(INSTANCE)
            if door == "http_tether":
                async with server_b.rest() as rest_b:
                    response = await rest_b.post(f"/v1/instances/{INSTANCE}/tether", json={
                        "type": "user.message", "session": {"channel": "host", "id": "first"},
                        "payload": {"text": script()},
                    })
                    assert response.status_code == 201, response.text
                    assert response.json()["ingress_seq"] == 1, "the first frame of box1 ever"
                    with trio.fail_after(60):
                        done = await poll(rest_b, INSTANCE, {
                            "channel": "host", "session_id": "first", "types": "assistant.done",
                            "reply_to_msg_id": response.json()["msg_id"], "wait_ms": 30_000,
                        })
                    assert [f["type"] for f in done["frames"]] == ["assistant.done"], done
            else:
                async with server_b.caller(events=False) as (client, _):
                    with trio.fail_after(60):
                        sent = await client.call_tool("session_message", {
                            "instance": INSTANCE, "session_id": "first", "message": script(), "wait": 45,
                        })
                    assert not sent.is_error, sent
                    # The first frames of box1 ever: the session's record (owner; only the server
                    # writes it, docs/SECURITY.md), then the message.
                    assert sent.structured_content["ingress_seq"] == 2, "the first frames of box1 ever"
                    ends_with(sent.structured_content, "end_turn")
            # And an instance no server has heard of is still refused, with the shared-store wording.
            async with server_b.rest() as rest_b:
                unknown = await rest_b.post("/v1/instances/nobody/tether", json={
                    "type": "user.message", "session": {"channel": "host", "id": "x"}, "payload": {"text": "hi"},
                })
                assert unknown.status_code == 404, unknown.text
                assert "has not connected to any server" in unknown.json()["error"]["message"]
    finally:
        a.cleanup()
        b.cleanup()
