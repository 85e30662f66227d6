"""Turn waits (oubliette_server/features/turns.py) alone: the in-memory store, no subprocess.

A `wait` stops at the first of: the turn's end, a caller tool request the caller must answer,
an approval it must decide, or its time running out; the stop lists what is pending then.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import trio
import trio.testing

from oubliette_server.features.approvals import ApprovalElicitation, ApprovalService
from oubliette_server.features.caller_tool_relay import CallerCallRegistry
from oubliette_server.core.callers import CallerConnection
from oubliette_server.core.frame_log import FrameLog
from oubliette_server.core.sessions import SessionRegistry
from oubliette_server.store.sqlite import FrameStore
from oubliette_server.features.turns import STREAM_GONE_STATE, TurnWaits, WaitEvents
from protocol import RelayError
from protocol.messages import CallerToolSpec

CTX = SimpleNamespace(protocol_version=None)  # a stdio caller's request: no request-scoped events


def world() -> SimpleNamespace:
    """Turn waits over the in-memory store, with session `s1` of box1 owned by a caller."""
    store = FrameStore.in_memory()
    sessions = SessionRegistry()
    frame_log = FrameLog(store, sessions)
    calls = CallerCallRegistry(frame_log.append, default_timeout=10)
    approvals = ApprovalService(frame_log.append)
    turns = TurnWaits(
        store=store, sessions=sessions, calls=calls, approvals=approvals, elicitation=ApprovalElicitation(approvals),
    )
    caller = CallerConnection("stdio")
    session = sessions.get_or_create("box1", "mcp", "s1")
    sessions.set_owner(session, caller)
    return SimpleNamespace(frame_log=frame_log, calls=calls, approvals=approvals, turns=turns, caller=caller, session=session)


async def stopped_by_a_request(w: SimpleNamespace, ctx: Any, instrument: trio.abc.Instrument | None = None) -> dict[str, Any]:
    """The stop of a wait of `w`'s caller that the agent's call of the caller tool `notify` stops
    (the call is ended after it, so the nursery can close); `instrument` watches the wait alone."""
    stops: list[dict[str, Any]] = []
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:

            async def agent() -> None:
                with contextlib.suppress(RelayError):  # the caller leaves below
                    await w.calls.relay(w.session, CallerToolSpec(name="notify"), {"n": 1})

            nursery.start_soon(agent)
            if instrument is not None:
                trio.lowlevel.add_instrument(instrument)
            try:
                stops.append(await w.turns.wait(ctx, w.caller, w.session, None, 0, 5))
            finally:
                if instrument is not None:
                    trio.lowlevel.remove_instrument(instrument)
            w.calls.fail_caller(w.caller)  # ends the relayed call
    return stops[0]


async def test_a_wait_stops_when_a_caller_tool_request_is_pending() -> None:
    w = world()
    stop = await stopped_by_a_request(w, CTX)
    assert stop["stop_reason"] == "requires_action"
    assert [(p["kind"], p["tool"], p["arguments"]) for p in stop["pending"]] == [("caller_tool", "notify", {"n": 1})]


async def test_a_wait_stops_when_an_approval_is_pending() -> None:
    w = world()
    stops: list[dict[str, Any]] = []
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:

            async def gated() -> None:
                await w.approvals.request(w.session, "notify", {}, origin="caller", caller=w.caller)

            nursery.start_soon(gated)
            stops.append(await w.turns.wait(CTX, w.caller, w.session, None, 0, 5))
            w.approvals.fail_caller(w.caller)
    [stop] = stops
    assert stop["stop_reason"] == "requires_approval"
    assert [a["tool_name"] for a in stop["approval_requests"]] == ["notify"]


async def test_a_wait_returns_the_turns_end_or_times_out() -> None:
    w = world()
    with trio.fail_after(5):
        stop = await w.turns.wait(CTX, w.caller, w.session, None, 0, 0.2)
        assert (stop["stop_reason"], stop["pending"]) == ("timeout", [])
        await w.frame_log.append(w.session, "assistant.done", {"text": "done"}, reply_to="m1")
        stop = await w.turns.wait(CTX, w.caller, w.session, None, 0, 5)
    assert (stop["stop_reason"], stop["text"], stop["msg_id"]) == ("end_turn", "done", "m1")


class RecordingMcpSession:
    """The SDK session of a 2026-07-28 request: records the events sent on it."""

    client_capabilities = None

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    async def send_notification(self, notification: Any, related_request_id: Any = None) -> None:
        """Record the event the notification carries."""
        self.sent.append(notification.params.data)


async def test_a_2026_07_28_wait_sends_the_sessions_events_but_not_the_request_its_stop_carries() -> None:
    """The stop lists the request whole, so its event does not ride the waiting request (its answer
    stays JSON); every other event does, before the stop, with the owner_key."""
    w = world()
    w.caller.owner_key = "k1"
    mcp = RecordingMcpSession()
    ctx = SimpleNamespace(protocol_version="2026-07-28", session=mcp, request_id=7)
    stops: list[dict[str, Any]] = []
    stopped = trio.Event()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:

            async def waiting() -> None:
                stops.append(await w.turns.wait(ctx, w.caller, w.session, None, 0, 5))
                stopped.set()

            async def agent() -> None:
                with contextlib.suppress(RelayError):  # the caller leaves below
                    await w.calls.relay(w.session, CallerToolSpec(name="notify"), {"n": 1})

            nursery.start_soon(waiting)
            await trio.testing.wait_all_tasks_blocked()  # the wait follows the session
            await w.frame_log.append(w.session, "assistant.delta", {"text": "thinking"})
            nursery.start_soon(agent)
            await stopped.wait()
            w.calls.fail_caller(w.caller)
    [stop] = stops
    assert stop["stop_reason"] == "requires_action"
    assert [(p["tool"], p["arguments"]) for p in stop["pending"]] == [("notify", {"n": 1})]
    assert [(e["type"], e["text"], e["owner_key"]) for e in mcp.sent] == [("assistant.delta", "thinking", "k1")]


async def test_a_2026_07_28_answers_wait_sends_what_came_between_the_answer_and_the_wait() -> None:
    """An answer with `wait` follows the session from before the answer is stored
    (`following_answer`): an event that comes before its wait follows the session (another
    server's frame, the agent's next line) rides the wait, in order, once, but the event of the
    caller's own answer (skipped for the caller, as ever); the session has no follower left after
    the wait; a stdio caller's answer gets no early follower."""
    w = world()
    w.caller.owner_key = "k1"
    mcp = RecordingMcpSession()
    ctx = SimpleNamespace(protocol_version="2026-07-28", session=mcp, request_id=8)
    assert w.turns.following_answer(CTX, w.caller, [w.session]) is None
    early = w.turns.following_answer(ctx, w.caller, [w.session])
    assert early is not None
    await w.frame_log.append(w.session, "caller_tool_result", {"request_id": "ctr-own", "result": {}}, skip=w.caller)
    await w.frame_log.append(w.session, "assistant.delta", {"text": "before the wait"})
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:

            async def agent() -> None:
                with contextlib.suppress(RelayError):  # the caller leaves below
                    await w.calls.relay(w.session, CallerToolSpec(name="notify"), {"n": 1})

            stops: list[dict[str, Any]] = []

            async def waiting() -> None:
                stops.append(await w.turns.wait(ctx, w.caller, w.session, None, 0, 5, early=early))

            nursery.start_soon(waiting)
            await trio.testing.wait_all_tasks_blocked()  # the wait follows the session
            await w.frame_log.append(w.session, "assistant.delta", {"text": "during the wait"})
            nursery.start_soon(agent)
            await trio.testing.wait_all_tasks_blocked()
            w.calls.fail_caller(w.caller)
    assert stops[0]["stop_reason"] == "requires_action"
    assert [e["text"] for e in mcp.sent] == ["before the wait", "during the wait"]
    assert not w.session.sinks
    early.hand_over(None, None)  # the answer's own end: nothing left to stop following
    assert not w.session.sinks


async def test_a_2026_07_28_wait_sends_a_held_request_event_its_stop_does_not_list() -> None:
    """An event held behind a request's is sent in order when the stop does not list the request
    (it ended first): a caller that reads events loses only what the stop carries."""
    sent: list[dict[str, Any]] = []
    started: list[bool] = []
    events = WaitEvents(SimpleNamespace(push=sent.append), lambda: started.append(True))
    events.push({"type": "caller_tool_request", "request_id": "ctr-1"})
    events.push({"type": "assistant.delta", "text": "a"})
    events.push({"type": "caller_tool_request", "request_id": "ctr-2"})
    assert sent == [] and started == []
    events.release({"pending": [{"kind": "caller_tool", "request_id": "ctr-2"}]})
    assert started == [True]
    assert sent == [{"type": "caller_tool_request", "request_id": "ctr-1"}, {"type": "assistant.delta", "text": "a"}]


class SpawnedTasks(trio.abc.Instrument):
    """The names of the tasks this module's waits start (`features/turns.py`)."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        """Note a task of the turn waits (its name is its function's qualified name)."""
        if "TurnWaits" in task.name:
            self.names.append(task.name.rsplit(".", 1)[-1])


async def test_a_2026_07_28_wait_stopped_by_a_caller_tool_request_starts_only_its_two_racers() -> None:
    """The wait watches for the request itself, starts no delivery task when it has no event to send
    and no watch of its stream (its door cancels it): the turn's end and an approval are its tasks."""
    w = world()
    ctx = SimpleNamespace(protocol_version="2026-07-28", session=RecordingMcpSession(), request_id=8,
                          request=SimpleNamespace(scope={"state": {STREAM_GONE_STATE: trio.Event()}}))
    spawned = SpawnedTasks()
    assert (await stopped_by_a_request(w, ctx, spawned))["stop_reason"] == "requires_action"
    assert sorted(spawned.names) == ["approval", "turn_end"], spawned.names
