"""Orphans on the server side, with the real programs.

- SIGKILL of the guest runtime mid-turn: the server ends the turn with `session.error`
  and a waiting `session_message` returns `stop_reason: "error"` at once;
- kill -9 of the server with a caller tool request pending: after a restart the log
  has a `caller_tool_cancelled` frame (reason "server restarted") for it;
- SIGTERM of the server with a caller tool request pending: the log has one
  `caller_tool_cancelled` for it, reason "server shutdown" (not the agent's cancel);
- kill -9 of the server mid-turn, seen from the guest runtime: it waits for the relay to come
  back without spinning (its CPU stays low) and still stops at once on SIGTERM.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any, Callable

import trio

from harness import DEMO_AGENT, EVENT_TIMEOUT, Deployment, HttpServer, structured, text_of
from frame_polls import poll_frames

GUEST_GONE_BOUND = 5.0
"""How soon after SIGKILL of the guest runtime a waiting session_message must return."""

BLOCKING_AGENT = ["-c", "import sys, time; sys.stdin.read(); print('started', flush=True); time.sleep(120)"]
NOTIFY = {"name": "send_notification", "inputSchema": {"type": "object"}}
IDLE_WINDOW = 3.0
"""How long the guest's CPU is watched after its server died (a spinning loop burns ~all of it)."""
IDLE_CPU_SHARE = 0.25
"""The most of IDLE_WINDOW the guest may spend on a CPU while its relay is gone."""


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process, from /proc (Linux)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def test_killed_guest_ends_the_turn_with_an_error_at_once(deployment: Deployment) -> None:
    async with deployment.caller() as (caller, events):
        async with deployment.guest("box1", [sys.executable, *BLOCKING_AGENT]) as guest, trio.open_nursery() as nursery:
            outcome: dict[str, Any] = {}
            finished = trio.Event()

            async def converse() -> None:
                outcome["reply"] = await caller.call_tool("session_message", {
                    "instance": "box1", "session_id": "o1", "message": "work", "wait": 60,
                })
                outcome["at"] = time.monotonic()
                finished.set()

            nursery.start_soon(converse)
            await events.wait_for(lambda e: e.get("type") == "assistant.delta" and e.get("text") == "started")
            guest.kill()
            killed_at = time.monotonic()
            with trio.fail_after(30):
                await finished.wait()
        frames = structured(await caller.call_tool("session_events", {"session_id": "o1", "types": ["session.error"]}))
    reply = outcome["reply"]
    assert not reply.is_error, text_of(reply)
    turn = structured(reply)
    assert turn["stop_reason"] == "error"
    assert turn["text"] == "the guest disconnected mid-turn"
    assert outcome["at"] - killed_at < GUEST_GONE_BOUND, f"took {outcome['at'] - killed_at:.1f} s"
    assert [(f["reply_to"], f["payload"]["reason"]) for f in frames["frames"]] == [(turn["msg_id"], "guest_disconnected")]


async def stopped_with_a_request_pending(deployment: Deployment, session_id: str, stop: Callable[[HttpServer], None]) -> dict:
    """A real server with an agent's caller tool request waiting for its caller in `session_id`,
    stopped by `stop(server)` (which must end its process); the request's event."""
    async with deployment.http_server() as server:
        async with server.caller() as (caller, events):
            declared = await caller.call_tool("session_message", {
                "instance": "box1", "session_id": session_id, "message": "hi",
                "context": {"caller_id": "myapp", "caller_tools": [NOTIFY]},
            })
            assert not declared.is_error, text_of(declared)
            async with deployment.agent("box1", f"mcp:{session_id}") as agent, trio.open_nursery() as nursery:

                async def agent_call() -> None:
                    await agent.call_tool("myapp_send_notification", {"message": "hi"})

                nursery.start_soon(agent_call)
                request = await events.wait_type("caller_tool_request", timeout=EVENT_TIMEOUT)
                stop(server)
                with trio.fail_after(15):
                    await server.process.wait()
                nursery.cancel_scope.cancel()
    return request


async def test_a_request_left_open_by_a_killed_server_is_cancelled_on_restart(deployment: Deployment) -> None:
    # kill -9: no outcome frame is written
    request = await stopped_with_a_request_pending(deployment, "r1", lambda server: server.process.kill())
    async with deployment.http_server() as restarted:
        cancelled = await poll_frames(restarted, "r1", "caller_tool_cancelled")
        requests = await poll_frames(restarted, "r1", "caller_tool_request")
    assert [(f["payload"]["request_id"], f["payload"]["reason"]) for f in cancelled] == [
        (request["request_id"], "server restarted")
    ]
    assert [f["payload"]["request_id"] for f in requests] == [request["request_id"]]


async def test_a_request_pending_at_sigterm_is_stored_as_ended_by_the_shutdown(deployment: Deployment) -> None:
    """The server stops (SIGTERM) while a caller tool request waits for its caller: the log says
    the server's shutdown ended it, not the agent (which cancelled nothing)."""
    request = await stopped_with_a_request_pending(deployment, "t1", lambda server: server.process.send_signal(signal.SIGTERM))
    async with deployment.http_server() as restarted:
        cancelled = await poll_frames(restarted, "t1", "caller_tool_cancelled")
    assert [(f["payload"]["request_id"], f["payload"]["reason"]) for f in cancelled] == [
        (request["request_id"], "server shutdown")
    ]


async def test_a_guest_whose_server_died_mid_turn_waits_quietly_and_stops_on_sigterm(deployment: Deployment) -> None:
    async with deployment.http_server() as server, server.caller() as (caller, events):
        async with deployment.guest("box1", DEMO_AGENT) as guest:
            sent = await caller.call_tool("session_message", {
                "instance": "box1", "session_id": "spin", "message": 'Please call myapp_send_notification {"text": "hi"}',
                "context": {"caller_id": "myapp", "caller_tools": [NOTIFY]},
            })
            assert not sent.is_error, text_of(sent)
            await events.wait_type("caller_tool_request", timeout=EVENT_TIMEOUT)
            server.process.kill()  # the agent's call fails; the guest's frames have nowhere to go
            with trio.fail_after(10):
                await server.process.wait()
            before = cpu_seconds(guest.pid)
            await trio.sleep(IDLE_WINDOW)  # a measurement window, not a wait for an event
            assert guest.returncode is None, "the guest runtime should keep waiting for its relay"
            burnt = cpu_seconds(guest.pid) - before
            assert burnt < IDLE_CPU_SHARE * IDLE_WINDOW, f"the guest spent {burnt:.2f} s of CPU in {IDLE_WINDOW} s"
            guest.terminate()
            with trio.fail_after(10):
                code = await guest.wait()
            assert code in (0, 143, -15), code
