"""The tether (docs/TETHER.md): `tether_send` / `tether_read` end to end with the real programs.

The server runs as a stdio MCP server (`deployment.caller()`) or with HTTP listeners
(`deployment.http_server()`, whose `caller()` speaks MCP over Streamable HTTP); the guest
runtime is `oubliette-client run -- CMD` with small agent scripts written to the test's
directory. Waits are long polls or events bounded by `fail_after` (the one exception: a
guest's connection is seen by polling `/v1/health`, which has no push); the tests that must
see a read waiting inside the store embed the server (`deployment.embedded_http_server()`).
Timing assertions have wide margins.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
import trio
from mcp import Client

from harness import PYTHON, Deployment, structured, text_of

pytestmark = pytest.mark.in_process

TURN_TIMEOUT = 30.0
from protocol.frames import TURN_END_TYPES

# Answers with two lines: what it received, then a closing line.
TWO_LINE_AGENT = """
import sys
message = sys.stdin.read()
print("received: " + message, flush=True)
print("all done", flush=True)
"""

# Prints its session key (OUBLIETTE_SESSION, "channel:session_id"), then the message.
SESSION_AGENT = """
import os, sys
message = sys.stdin.read()
print(os.environ.get("OUBLIETTE_SESSION", "<no session>"), flush=True)
print(message, flush=True)
"""


def agent_command(deployment: Deployment, name: str, source: str) -> list[str]:
    directory = deployment.root / "agents"
    directory.mkdir(exist_ok=True)
    path = directory / f"{name}.py"
    path.write_text(source)
    return [PYTHON, str(path)]


async def tether_send(caller: Client, instance: str, text: str, **extra: Any) -> dict[str, Any]:
    result = await caller.call_tool("tether_send", {"instance": instance, "text": text, **extra})
    assert not result.is_error, text_of(result)
    return structured(result)


async def tether_read(caller: Client, instance: str, **extra: Any) -> dict[str, Any]:
    result = await caller.call_tool("tether_read", {"instance": instance, **extra})
    assert not result.is_error, text_of(result)
    return structured(result)


async def tether_error(caller: Client, tool: str, arguments: dict[str, Any]) -> str:
    """The error text of a tool call that must fail."""
    result = await caller.call_tool(tool, arguments)
    assert result.is_error, f"{tool} {arguments} should have failed: {text_of(result)}"
    return text_of(result)


async def read_turn(
    caller: Client, instance: str, after_seq: int, **extra: Any
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The seed's loop: `tether_read(after_seq=cursor, wait_ms=10000)`, cursor = next_seq, until
    a turn-ending frame. Returns (frames, the raw tether_read results)."""
    frames: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    cursor = after_seq
    with trio.fail_after(TURN_TIMEOUT):
        while True:
            result = await tether_read(caller, instance, after_seq=cursor, wait_ms=10000, **extra)
            results.append(result)
            assert set(result) == {"frames", "next_seq", "timed_out"}
            if result["frames"]:
                assert result["timed_out"] is False
                assert result["next_seq"] == result["frames"][-1]["seq"], "next_seq is the max seq returned"
            else:
                assert result["next_seq"] == cursor
            frames.extend(result["frames"])
            cursor = result["next_seq"]
            if any(f["type"] in TURN_END_TYPES for f in result["frames"]):
                return frames, results


def assert_wire_frame(frame: dict[str, Any], instance: str) -> None:
    """The seed's output frame format (type, seq, ts, payload) plus this system's frame fields."""
    assert isinstance(frame["seq"], int) and frame["seq"] >= 1
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", frame["ts"]), frame["ts"]
    assert isinstance(frame["type"], str)
    assert isinstance(frame["payload"], dict)
    assert frame["v"] == 1 and frame["instance"] == instance
    assert frame["msg_id"]


# -- the usage pattern ---------------------------------------------------------------------


@pytest.mark.real_programs
async def test_send_then_read_loop_until_done(deployment: Deployment) -> None:
    """The tether's usage pattern (docs/TETHER.md): tether_send, then tether_read from ingress_seq with next_seq until assistant.done."""
    config = deployment.config_file("agent1")
    text = "Analyze the data in /workspace/data.csv"
    command = agent_command(deployment, "two_lines", TWO_LINE_AGENT)
    async with deployment.caller("--config", str(config)) as (caller, _), deployment.guest("agent1", command):
        before_ms = int(time.time() * 1000)
        sent = await tether_send(caller, "agent1", text)
        after_ms = int(time.time() * 1000)
        assert set(sent) == {"msg_id", "session_id", "ingress_seq"}
        assert sent["session_id"] == "default"
        assert isinstance(sent["ingress_seq"], int) and sent["ingress_seq"] >= 1
        # msg_id is "host-{timestamp}" (plus a suffix that keeps two sends in one millisecond apart).
        match = re.fullmatch(r"host-(\d+)(-[0-9a-f]+)?", sent["msg_id"])
        assert match, sent["msg_id"]
        assert before_ms - 1000 <= int(match.group(1)) <= after_ms + 1000
        msg_id = sent["msg_id"]

        frames, results = await read_turn(caller, "agent1", after_seq=sent["ingress_seq"])

        types = [f["type"] for f in frames]
        assert types == ["status.presence", "assistant.delta", "assistant.delta", "assistant.done"], types
        presence, *deltas, done = frames
        assert presence["payload"] == {"state": "thinking"}
        assert [d["payload"]["text"] for d in deltas] == [f"received: {text}", "all done"]
        assert done["payload"]["text"] == f"received: {text}\nall done"
        for frame in frames:
            assert_wire_frame(frame, "agent1")
            assert frame["reply_to"] == msg_id
            assert frame["session"] == {"channel": "host", "id": "default"}
            assert frame["seq"] > sent["ingress_seq"], "after_seq=ingress_seq skips the sent message"
            assert frame["type"] != "user.message" and frame["msg_id"] != msg_id
        seqs = [f["seq"] for f in frames]
        assert seqs == sorted(set(seqs))
        assert results[-1]["next_seq"] == done["seq"]

        # Reading the whole session from 0 (the seed's "Start with 0") gives the same
        # frames: the host's own message is not part of what tether_read returns.
        again = await tether_read(caller, "agent1", after_seq=0)
        assert again["frames"] == frames
        assert again["next_seq"] == done["seq"] and again["timed_out"] is False

        # Past the end: nothing more, at once.
        tail = await tether_read(caller, "agent1", after_seq=done["seq"])
        assert tail == {"frames": [], "next_seq": done["seq"], "timed_out": False}


async def test_conversation_over_streamable_http_caller(deployment: Deployment) -> None:
    """The same loop from an MCP caller over Streamable HTTP, in a named session, two turns."""
    config = deployment.config_file("agent1")
    command = agent_command(deployment, "two_lines", TWO_LINE_AGENT)
    async with deployment.http_server("--config", str(config)) as server, deployment.guest("agent1", command):
        async with server.caller() as (caller, _):
            cursor = 0
            for text in ("first task", "second task"):
                sent = await tether_send(caller, "agent1", text, session_id="debug-session-1")
                assert sent["session_id"] == "debug-session-1"
                assert sent["ingress_seq"] > cursor
                frames, _ = await read_turn(caller, "agent1", after_seq=sent["ingress_seq"], session_id="debug-session-1")
                assert frames[-1]["type"] == "assistant.done"
                assert frames[-1]["payload"]["text"] == f"received: {text}\nall done"
                assert {f["reply_to"] for f in frames} == {sent["msg_id"]}
                assert {(f["session"]["channel"], f["session"]["id"]) for f in frames} == {("host", "debug-session-1")}
                cursor = frames[-1]["seq"]
            # The default session of the same instance is empty.
            empty = await tether_read(caller, "agent1")
            assert empty == {"frames": [], "next_seq": 0, "timed_out": False}


async def test_unknown_instance_is_refused_until_its_guest_connects(deployment: Deployment) -> None:
    """Not configured, never connected, no frames: both tools refuse it (and store nothing); once its guest connects it works."""
    command = agent_command(deployment, "two_lines", TWO_LINE_AGENT)
    async with deployment.http_server() as server:
        async with server.caller() as (caller, _):
            for tool, arguments in (
                ("tether_send", {"instance": "agent1", "text": "hello?"}),
                ("tether_read", {"instance": "agent1"}),
                ("tether_read", {"instance": "agent1", "wait_ms": 5000}),
            ):
                message = await tether_error(caller, tool, arguments)
                assert "unknown instance 'agent1'" in message, message
            async with server.rest() as rest:
                refused = await rest.get("/v1/instances/agent1/tether/poll")
                assert refused.status_code == 404, "the refused send must not have stored a frame"

            async with deployment.guest("agent1", command):
                await server.wait_connected("agent1")
                sent = await tether_send(caller, "agent1", "hello?")
                frames, _ = await read_turn(caller, "agent1", after_seq=sent["ingress_seq"])
                assert frames[-1]["payload"]["text"] == "received: hello?\nall done"


async def test_bad_arguments_are_clear_errors(deployment: Deployment) -> None:
    config = deployment.config_file("agent1")
    async with deployment.caller("--config", str(config)) as (caller, _):
        assert "invalid instance id" in await tether_error(caller, "tether_send", {"instance": "no such/box", "text": "x"})
        assert "invalid session_id" in await tether_error(
            caller, "tether_send", {"instance": "agent1", "text": "x", "session_id": "has space"}
        )
        assert "text" in await tether_error(caller, "tether_send", {"instance": "agent1"})
        assert "instance" in await tether_error(caller, "tether_read", {})
        assert "after_seq" in await tether_error(caller, "tether_read", {"instance": "agent1", "after_seq": -1})
        assert "invalid session_id" in await tether_error(caller, "tether_read", {"instance": "agent1", "session_id": "a b"})
        # Nothing was stored by the refused sends.
        stored = await tether_read(caller, "agent1", types=["user.message"])
        assert stored["frames"] == []


# -- filters, limits and the long poll -----------------------------------------------------


async def post_frames(rest: Any, instance: str, frames: list[dict[str, Any]]) -> list[dict[str, Any]]:
    stored = []
    for frame in frames:
        response = await rest.post(f"/v1/instances/{instance}/tether", json=frame)
        assert response.status_code == 201, response.text
        stored.append(response.json()["frame"])
    return stored


def host_frame(type_: str, text: str, *, session: str = "default", reply_to: str | None = None) -> dict[str, Any]:
    frame: dict[str, Any] = {"type": type_, "session": {"channel": "host", "id": session}, "payload": {"text": text}}
    if reply_to is not None:
        frame["reply_to"] = reply_to
    return frame


async def test_types_and_reply_to_filters_isolate_one_task(deployment: Deployment) -> None:
    """Two messages in one session: reply_to_msg_id isolates each task's response, types narrows it."""
    config = deployment.config_file("agent1")
    command = agent_command(deployment, "two_lines", TWO_LINE_AGENT)
    async with deployment.caller("--config", str(config)) as (caller, _), deployment.guest("agent1", command):
        first = await tether_send(caller, "agent1", "task one", session_id="multi")
        second = await tether_send(caller, "agent1", "task two", session_id="multi")
        assert second["ingress_seq"] > first["ingress_seq"]

        # Follow only the second task's response; the first one's frames never show up.
        frames, _ = await read_turn(
            caller, "agent1", after_seq=first["ingress_seq"], session_id="multi", reply_to_msg_id=second["msg_id"],
        )
        assert [f["type"] for f in frames] == ["status.presence", "assistant.delta", "assistant.delta", "assistant.done"]
        assert {f["reply_to"] for f in frames} == {second["msg_id"]}
        assert frames[-1]["payload"]["text"] == "received: task two\nall done"

        # The session runs one turn at a time, so the first task ended before the second began.
        first_frames = (await tether_read(
            caller, "agent1", session_id="multi", reply_to_msg_id=first["msg_id"],
        ))["frames"]
        assert [f["type"] for f in first_frames] == ["status.presence", "assistant.delta", "assistant.delta", "assistant.done"]
        assert {f["reply_to"] for f in first_frames} == {first["msg_id"]}
        assert first_frames[-1]["payload"]["text"] == "received: task one\nall done"
        assert first_frames[-1]["seq"] < frames[0]["seq"]

        everything = (await tether_read(caller, "agent1", session_id="multi"))["frames"]
        assert everything == first_frames + frames

        dones = await tether_read(caller, "agent1", session_id="multi", types=["assistant.done"])
        assert [f["payload"]["text"] for f in dones["frames"]] == [
            "received: task one\nall done", "received: task two\nall done",
        ]
        assert dones["next_seq"] == frames[-1]["seq"]
        deltas = await tether_read(
            caller, "agent1", session_id="multi", types=["assistant.delta"], reply_to_msg_id=first["msg_id"],
        )
        assert [f["payload"]["text"] for f in deltas["frames"]] == ["received: task one", "all done"]
        both = await tether_read(caller, "agent1", session_id="multi", types=["status.presence", "assistant.done"])
        assert [f["type"] for f in both["frames"]] == ["status.presence", "assistant.done"] * 2
        # Asking for the host's own messages by type returns them (and only them).
        own = await tether_read(caller, "agent1", session_id="multi", types=["user.message"])
        assert [f["msg_id"] for f in own["frames"]] == [first["msg_id"], second["msg_id"]]
        assert [f["payload"]["text"] for f in own["frames"]] == ["task one", "task two"]


async def test_limit_default_max_and_bounds(deployment: Deployment) -> None:
    config = deployment.config_file("box1")
    async with deployment.http_server("--config", str(config)) as server:
        async with server.rest() as rest:
            stored = await post_frames(rest, "box1", [host_frame("assistant.delta", f"d{n}") for n in range(205)])
        seqs = [f["seq"] for f in stored]
        async with server.caller() as (caller, _):
            default = await tether_read(caller, "box1")
            assert [f["seq"] for f in default["frames"]] == seqs[:50], "default limit is 50"
            assert default["next_seq"] == seqs[49]
            rest_of_them = await tether_read(caller, "box1", after_seq=default["next_seq"], limit=200)
            assert [f["seq"] for f in rest_of_them["frames"]] == seqs[50:]
            assert len(rest_of_them["frames"]) == 155 and rest_of_them["next_seq"] == seqs[-1]
            biggest = await tether_read(caller, "box1", limit=200)
            assert [f["seq"] for f in biggest["frames"]] == seqs[:200]
            one = await tether_read(caller, "box1", limit=1, after_seq=seqs[9])
            assert [f["seq"] for f in one["frames"]] == [seqs[10]]

            too_many = await tether_error(caller, "tether_read", {"instance": "box1", "limit": 201})
            assert "limit" in too_many and "200" in too_many, too_many
            zero = await tether_error(caller, "tether_read", {"instance": "box1", "limit": 0})
            assert "limit" in zero, zero
            negative = await tether_error(caller, "tether_read", {"instance": "box1", "limit": -5})
            assert "limit" in negative, negative


async def test_wait_ms_bounds_and_immediate_return(deployment: Deployment) -> None:
    config = deployment.config_file("box1")
    async with deployment.caller("--config", str(config)) as (caller, _):
        started = time.monotonic()
        result = await tether_read(caller, "box1", wait_ms=0)
        assert time.monotonic() - started < 5
        assert result == {"frames": [], "next_seq": 0, "timed_out": False}
        # wait_ms left out is 0 too.
        assert await tether_read(caller, "box1", after_seq=7) == {"frames": [], "next_seq": 7, "timed_out": False}

        too_long = await tether_error(caller, "tether_read", {"instance": "box1", "wait_ms": 30001})
        assert "wait_ms" in too_long and "30000" in too_long, too_long
        negative = await tether_error(caller, "tether_read", {"instance": "box1", "wait_ms": -1})
        assert "wait_ms" in negative, negative


async def test_long_poll_times_out_after_wait_ms(deployment: Deployment) -> None:
    config = deployment.config_file("box1")
    async with deployment.caller("--config", str(config)) as (caller, _):
        sent = await tether_send(caller, "box1", "nobody is listening")
        started = time.monotonic()
        result = await tether_read(caller, "box1", after_seq=sent["ingress_seq"], wait_ms=300)
        elapsed = time.monotonic() - started
        assert result == {"frames": [], "next_seq": sent["ingress_seq"], "timed_out": True}
        assert 0.25 <= elapsed < 10, elapsed


async def test_long_poll_returns_as_soon_as_a_frame_is_appended(deployment: Deployment) -> None:
    """Event-driven: a 20 s tether_read that is waiting ends when a matching frame is appended.

    The server is embedded in the test's Trio loop so the test can see the read waiting
    in the frame store before it appends."""
    async with deployment.embedded_http_server("box1") as server:
        async with server.caller() as (caller, _), server.rest() as rest, trio.open_nursery() as nursery:
            outcome: dict[str, Any] = {}
            done = trio.Event()

            async def long_poll() -> None:
                started = time.monotonic()
                outcome["result"] = await tether_read(caller, "box1", after_seq=0, wait_ms=20000)
                outcome["elapsed"] = time.monotonic() - started
                done.set()

            nursery.start_soon(long_poll)
            await server.wait_waiters("box1", 1, timeout=10)
            # Another channel's frame wakes the store's waiters; this read goes on waiting.
            await post_frames(rest, "box1", [{
                "type": "assistant.delta", "session": {"channel": "telegram", "id": "default"}, "payload": {"text": "x"},
            }])
            appended_at = time.monotonic()
            [appended] = await post_frames(rest, "box1", [host_frame("assistant.delta", "wake up")])
            with trio.fail_after(10):
                await done.wait()
            returned_after = time.monotonic() - appended_at
        result = outcome["result"]
        assert result["timed_out"] is False
        assert [f["seq"] for f in result["frames"]] == [appended["seq"]]
        assert result["frames"][0]["payload"] == {"text": "wake up"}
        assert returned_after < 5, returned_after
        assert outcome["elapsed"] < 15, outcome["elapsed"]


@pytest.mark.real_programs
async def test_long_poll_over_stdio_wakes_on_tether_send(deployment: Deployment) -> None:
    """A tether_read waiting for the host's own messages (types filter) wakes on the next tether_send."""
    config = deployment.config_file("box1")
    async with deployment.caller("--config", str(config)) as (caller, _):
        outcome: dict[str, Any] = {}

        async def long_poll() -> None:
            started = time.monotonic()
            outcome["result"] = await tether_read(caller, "box1", types=["user.message"], wait_ms=20000)
            outcome["elapsed"] = time.monotonic() - started

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(long_poll)
                sent = await tether_send(caller, "box1", "ping")
    assert outcome["result"]["timed_out"] is False
    assert [f["msg_id"] for f in outcome["result"]["frames"]] == [sent["msg_id"]]
    assert outcome["elapsed"] < 5, outcome["elapsed"]


# -- channels --------------------------------------------------------------------------------


async def test_same_session_id_on_two_channels_stays_separate(deployment: Deployment) -> None:
    """Sessions are per channel: telegram:12345 and host:12345 are different sessions, in the guest and in the log."""
    config = deployment.config_file("agent1")
    command = agent_command(deployment, "session_echo", SESSION_AGENT)
    async with deployment.http_server("--config", str(config)) as server, deployment.guest("agent1", command):
        async with server.caller() as (caller, _), server.rest() as rest:
            posted = await rest.post("/v1/instances/agent1/tether", json={
                "type": "user.message", "session": {"channel": "telegram", "id": "12345"},
                "payload": {"text": "from telegram"}, "msg_id": "tg-1",
            })
            assert posted.status_code == 201, posted.text
            sent = await tether_send(caller, "agent1", "from host", session_id="12345")

            host_frames, _ = await read_turn(caller, "agent1", after_seq=0, session_id="12345")
            assert host_frames[-1]["type"] == "assistant.done"
            assert host_frames[-1]["payload"]["text"] == "host:12345\nfrom host"
            for frame in host_frames:
                assert frame["session"] == {"channel": "host", "id": "12345"}
                assert frame["reply_to"] == sent["msg_id"]

            # The telegram turn, read through the poll endpoint until it is done.
            telegram: list[dict[str, Any]] = []
            cursor = 0
            with trio.fail_after(TURN_TIMEOUT):
                while not any(f["type"] == "assistant.done" for f in telegram):
                    response = await rest.get("/v1/instances/agent1/tether/poll", params={
                        "channel": "telegram", "session_id": "12345", "after_seq": cursor, "wait_ms": 10000,
                    })
                    assert response.status_code == 200, response.text
                    telegram.extend(response.json()["frames"])
                    cursor = response.json()["next_seq"]
            assert [f["type"] for f in telegram] == [
                "user.message", "status.presence", "assistant.delta", "assistant.delta", "assistant.done",
            ]
            assert telegram[0]["msg_id"] == "tg-1"
            assert telegram[-1]["payload"]["text"] == "telegram:12345\nfrom telegram"
            for frame in telegram:
                assert frame["session"] == {"channel": "telegram", "id": "12345"}
            assert {f["reply_to"] for f in telegram[1:]} == {"tg-1"}

            # tether_read (channel host) never returns telegram frames, even from 0 with every type.
            host_all = await tether_read(caller, "agent1", session_id="12345", after_seq=0, limit=200, types=[
                "user.message", "status.presence", "assistant.delta", "assistant.done", "session.error",
            ])
            assert host_all["frames"], host_all
            assert {f["session"]["channel"] for f in host_all["frames"]} == {"host"}
            assert "tg-1" not in {f.get("reply_to") for f in host_all["frames"]} | {f["msg_id"] for f in host_all["frames"]}
            # And the telegram channel alone has exactly the telegram frames.
            only_telegram = (await rest.get("/v1/instances/agent1/tether/poll", params={"channel": "telegram"})).json()
            assert only_telegram["frames"] == telegram


# -- persistence ---------------------------------------------------------------------------


@pytest.mark.real_programs
async def test_seq_and_cursors_survive_a_server_restart(deployment: Deployment) -> None:
    """seq is never reset: after a restart on the same data dir the next frame continues, old frames
    are still there, and a cursor taken before the restart still works."""
    config = deployment.config_file("box1")
    async with deployment.http_server("--config", str(config)) as server:
        async with server.rest() as rest:
            before = await post_frames(rest, "box1", [
                host_frame("user.message", "one"),
                host_frame("assistant.delta", "two"),
                host_frame("assistant.done", "three"),
            ])
            cursor = before[1]["seq"]
            old_log = (await rest.get("/v1/instances/box1/tether/poll")).json()["frames"]
            assert old_log == before
    assert server.process.returncode is not None, "the first server has stopped"

    # Started again without the config file: the instance is known by its frames.
    async with deployment.http_server() as server:
        async with server.rest() as rest:
            [after] = await post_frames(rest, "box1", [host_frame("assistant.delta", "four")])
            assert after["seq"] > before[-1]["seq"]
            assert after["seq"] == before[-1]["seq"] + 1

            everything = (await rest.get("/v1/instances/box1/tether/poll", params={"after_seq": 0})).json()
            assert everything["frames"] == old_log + [after]
            assert everything["next_seq"] == after["seq"]

            resumed = (await rest.get("/v1/instances/box1/tether/poll", params={"after_seq": cursor})).json()
            assert resumed["frames"] == [before[2], after]

        async with server.caller() as (caller, _):
            # The same cursor through tether_read (user.message is not returned by default).
            read = await tether_read(caller, "box1", after_seq=cursor)
            assert read["frames"] == [before[2], after]
            assert read["next_seq"] == after["seq"]
            read = await tether_read(caller, "box1", after_seq=before[0]["seq"])
            assert [f["payload"]["text"] for f in read["frames"]] == ["two", "three", "four"]
