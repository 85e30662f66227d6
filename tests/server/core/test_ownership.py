"""A session belongs to the caller that opened it; a killed HTTP caller is noticed.

Two callers of one server are tested in process where the callers are
plain `CallerConnection`s (the `test_caller_responses` pattern), and against the
real server for 2026-07-28 callers, which share one bearer token. A last test kills a
real HTTP caller process (SIGKILL) while the agent's call waits on it.
"""

from __future__ import annotations

import re
import subprocess
import time
from typing import Any

import pytest
import trio

from harness import EVENT_TIMEOUT, PYTHON, Deployment, structured, text_of
from in_process_calls import INSTANCE, NOTIFY, SESSION, in_process, start_agent_call
from frame_polls import poll_frames

KILL_BOUND = 3.0
"""How soon after SIGKILL of its caller the agent's call must fail (the caller timeout is 60 s)."""


def refused(result: Any, session_id: str = SESSION) -> bool:
    return bool(result.is_error) and f"session '{session_id}' belongs to another caller" in text_of(result)


# -- in process --------------------------------------------------------------------


async def test_another_caller_can_neither_take_over_nor_watch_a_session(deployment: Deployment) -> None:
    """Declarations, messages and event reads into another caller's session are refused; its calls stay with the owner."""
    async with in_process(deployment) as proc:
        owner, owner_events = proc.open_caller()
        thief, thief_events = proc.open_caller()
        await proc.declare(owner, [NOTIFY])

        takeover = await proc.call(thief, "session_message", {
            "instance": INSTANCE, "session_id": SESSION, "message": "mine now",
            "context": {"caller_id": "myapp", "caller_tools": [NOTIFY]},
        })
        plain = await proc.call(thief, "session_message", {"instance": INSTANCE, "session_id": SESSION, "message": "hi"})
        read = await proc.call(thief, "session_events", {"session_id": SESSION})
        read_in = await proc.call(thief, "session_events", {"session_id": SESSION, "instance": INSTANCE})
        assert refused(takeover) and refused(plain) and refused(read) and refused(read_in)

        # The agent's next call still goes to the owner, and only the owner sees it.
        link = await proc.connect_agent(deployment)
        outcome, finished, _ = start_agent_call(proc.nursery, link)
        request = await owner_events.wait_type("caller_tool_request")
        answer = {"session_id": SESSION, "request_id": request["request_id"]}
        assert refused(await proc.call(thief, "caller_tool_response", dict(answer, result={"from": "thief"})))
        accepted = await proc.call(owner, "caller_tool_response", dict(answer, result={"from": "owner"}))
        assert structured(accepted) == {"resolved": True}
        with trio.fail_after(EVENT_TIMEOUT):
            await finished.wait()
        assert outcome["result"] == {"result": {"from": "owner"}}

        own = structured(await proc.call(owner, "session_events", {"session_id": SESSION}))
    assert thief_events.events == [], "nothing of the owner's session reached the other caller"
    types_seen = [f["type"] for f in own["frames"]]
    assert types_seen.count("user.message") == 1, "the refused messages were not stored"
    assert "caller_tool_request" in types_seen and "caller_tool_result" in types_seen


async def test_generated_session_ids_are_unguessable(deployment: Deployment) -> None:
    async with in_process(deployment) as proc:
        caller, _ = proc.open_caller()
        ids = {
            structured(await proc.call(caller, "session_message", {"instance": INSTANCE, "message": "hi"}))["session_id"]
            for _ in range(3)
        }
    assert len(ids) == 3
    for session_id in ids:
        assert re.fullmatch(r"s-[0-9a-f]{32}", session_id), session_id  # 128 random bits


async def test_a_session_opened_before_a_restart_cannot_be_claimed(deployment: Deployment) -> None:
    """Its owner is unknown after a restart: no MCP caller may take it (and so read its history)."""
    async with in_process(deployment) as proc:
        caller, _ = proc.open_caller()
        await proc.declare(caller, [NOTIFY])
    async with in_process(deployment) as proc:
        newcomer, _ = proc.open_caller()
        claim = await proc.call(newcomer, "session_message", {"instance": INSTANCE, "session_id": SESSION, "message": "hi"})
        read = await proc.call(newcomer, "session_events", {"session_id": SESSION, "instance": INSTANCE})
        fresh = await proc.call(newcomer, "session_message", {"instance": INSTANCE, "session_id": "s-new", "message": "hi"})
    assert refused(claim)
    assert read.is_error
    assert not fresh.is_error, text_of(fresh)


# -- 2026-07-28 callers share a bearer token -----------------------------------------


async def test_modern_callers_with_one_bearer_token_are_different_callers(deployment: Deployment) -> None:
    """2026-07-28 has no session: a caller is the token's principal plus its owner_key."""
    async with deployment.http_server() as server:
        async with server.caller(mode="auto") as (a, _), server.caller(mode="auto") as (b, _):
            assert a.protocol_version == "2026-07-28"
            opened = structured(await a.call_tool("session_message", {
                "instance": "box1", "session_id": "m1", "message": "hi",
                "context": {"caller_id": "myapp", "caller_tools": [NOTIFY]},
            }))
            key = opened["owner_key"]
            assert len(key) >= 22

            b_plain = await b.call_tool("session_message", {"instance": "box1", "session_id": "m1", "message": "x"})
            b_read = await b.call_tool("session_events", {"session_id": "m1"})
            b_guess = await b.call_tool("session_events", {"session_id": "m1", "owner_key": "A" * 32})
            b_takeover = await b.call_tool("session_message", {
                "instance": "box1", "session_id": "m1", "message": "mine",
                "context": {"caller_id": "myapp", "caller_tools": [NOTIFY]},
            })
            a_keyless = await a.call_tool("session_events", {"session_id": "m1"})
            a_read = await a.call_tool("session_events", {"session_id": "m1", "owner_key": key, "types": ["user.message"]})
            a_again = await a.call_tool("session_message", {
                "instance": "box1", "session_id": "m1", "message": "again", "owner_key": key,
            })
    for result in (b_plain, b_read, b_guess, b_takeover, a_keyless):
        assert refused(result, "m1"), text_of(result)
    assert not a_read.is_error, text_of(a_read)
    assert [f["payload"]["text"] for f in structured(a_read)["frames"]] == ["hi"]
    assert not a_again.is_error and structured(a_again)["owner_key"] == key


# -- SIGKILL of an HTTP caller mid-call -------------------------------------------------

CALLER_PROGRAM = """
import sys, trio, httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

url, token, mode = sys.argv[1:4]
TIMEOUT_MS = int(sys.argv[4])

async def main():
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=60)
    transport = streamable_http_client(url, http_client=http)
    async with http, Client(transport, mode=mode, log_level="info") as client:
        args = {"instance": "box1", "session_id": "k1", "message": "hi",
                "context": {"caller_id": "myapp", "caller_tools": [
                    {"name": "send_notification", "inputSchema": {"type": "object"}, "timeout_ms": TIMEOUT_MS}]}}
        if mode == "legacy":
            await client.call_tool("session_message", args)
            print("declared", flush=True)
            await trio.sleep_forever()
        else:
            # 2026-07-28: no standalone stream; the wait returns as soon as the agent's call is pending.
            print("declared", flush=True)
            stop = await client.call_tool("session_message", dict(args, wait=True))
            print("stopped", stop.structured_content["stop_reason"], flush=True)
            await trio.sleep_forever()

trio.run(main)
"""


MODERN_TIMEOUT_MS = 3000
"""The 2026-07-28 caller's tool timeout: with no request in flight, nothing else can notice it is gone."""


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_killed_http_caller_fails_the_agents_call_at_once(deployment: Deployment, mode: str) -> None:
    """Handshake era: its standalone GET stream drops, and the call fails at once.

    2026-07-28: the caller's `session_message` with wait returned `requires_action` as soon as the
    call was pending, so no request of it is in flight when it is killed: nothing can
    see it go, and the call ends at the tool's timeout (`expires_at`), never hanging."""
    modern = mode != "legacy"
    async with deployment.http_server() as server:
        caller = await trio.lowlevel.open_process(
            [PYTHON, "-c", CALLER_PROGRAM, server.mcp_url, server.token, mode, str(MODERN_TIMEOUT_MS if modern else 60000)],
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
        )
        try:
            assert caller.stdout is not None
            output = bytearray()

            async def printed(needle: bytes) -> None:
                """Until the caller program has printed `needle` (its output may come in pieces)."""
                assert caller.stdout is not None
                with trio.fail_after(30):
                    while needle not in output:
                        chunk = await caller.stdout.receive_some(100)
                        assert chunk, f"the caller program exited: {bytes(output)!r}"
                        output.extend(chunk)

            await printed(b"declared")
            async with deployment.agent("box1", "mcp:k1") as agent, trio.open_nursery() as nursery:
                outcome: dict[str, Any] = {}
                finished = trio.Event()

                async def agent_call() -> None:
                    outcome["result"] = await agent.call_tool("myapp_send_notification", {"message": "hi"})
                    outcome["at"] = time.monotonic()
                    finished.set()

                nursery.start_soon(agent_call)
                request = (await poll_frames(server, "k1", "caller_tool_request"))[0]
                if modern:
                    await printed(b"stopped requires_action")
                caller.kill()
                killed_at = time.monotonic()
                with trio.fail_after(30):
                    await finished.wait()
        finally:
            if caller.returncode is None:
                caller.kill()
            await caller.wait()
        cancelled = await poll_frames(server, "k1", "caller_tool_cancelled")
    result = outcome["result"]
    took = outcome["at"] - killed_at
    if modern:
        assert result.is_error and "timed out after 3 s" in text_of(result), text_of(result)
        assert took < MODERN_TIMEOUT_MS / 1000 + KILL_BOUND, f"took {took:.1f} s"
        reason = "timeout"
    else:
        assert result.is_error and "disconnected" in text_of(result), text_of(result)
        assert took < KILL_BOUND, f"took {took:.1f} s, not at once"
        reason = "caller disconnected"
    assert [(f["payload"]["request_id"], f["payload"]["reason"]) for f in cancelled] == [
        (request["payload"]["request_id"], reason)
    ]
