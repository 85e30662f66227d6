"""The sandbox (and a caller) are untrusted (docs/SECURITY.md): what they send breaks nothing else.

Each test plays the hostile or careless peer against the real programs: raw relay
connections (`RawRelay`), the caller's MCP tools, the HTTP tether API, and guest
runtimes with agent scripts written to the test's directory. Every wait is on an
event (a reply, a caller event, a socket, a pidfd) and bounded by `fail_after`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import trio
from mcp import Client

from harness import PYTHON, Deployment, EventLog, RawRelay, structured, text_of
from oubliette_client.mcp_config import config_file_name, write_mcp_config
from oubliette_client.settings import RelaySettings
from oubliette_server.core import ids
from protocol import session_keys
from oubliette_server.core.auth import TokenAuthority
from hello_checks import hello_error, hello_params

TURN_TIMEOUT = 30.0
UNAUTHORIZED, NOT_FOUND, INVALID_PARAMS, METHOD_NOT_FOUND = -32006, -32005, -32602, -32601
HUGE = 2**70


def agent_command(deployment: Deployment, name: str, source: str, *args: str) -> list[str]:
    directory = deployment.root / "agents"
    directory.mkdir(exist_ok=True)
    path = directory / f"{name}.py"
    path.write_text(source)
    return [PYTHON, str(path), *args]


async def call(caller: Client, tool: str, args: dict[str, Any]) -> Any:
    with trio.fail_after(TURN_TIMEOUT):
        return await caller.call_tool(tool, args)


async def refused(caller: Client, tool: str, args: dict[str, Any], *needles: str) -> str:
    result = await call(caller, tool, args)
    assert result.is_error, f"{tool} accepted {args!r}: {text_of(result)}"
    text = text_of(result)
    for needle in needles:
        assert needle in text, text
    return text


# -- full-match ids ------------------------------------------------------------------


def test_id_rules_are_full_match() -> None:
    """A trailing newline (or anything else around a valid id) makes it invalid, everywhere."""
    assert ids.instance_id_problem("boxA") is None
    for bad in ("boxA\n", "boxA\r\n", "\nboxA", "", "-x", "a" * 65, "bøx", "\ud800", 5, None):
        assert ids.instance_id_problem(bad) is not None, bad
    assert session_keys.session_id_problem("a@b:c") is None
    assert session_keys.session_id_problem("s-1\n") is not None
    assert session_keys.session_key_problem("mcp:a@b") is None and session_keys.session_key_problem("plain") is None
    for bad in ("", ":", "mcp:", ":id", "mcp:s\n", "ch\n:s", "\ud800", "a b:c"):
        assert session_keys.session_key_problem(bad) is not None, bad
    # The server's own schemas read `$` as ECMA-262 does: the end of the string.
    validator = ids.strict_validator(session_keys.SESSION_ID_SCHEMA)
    assert validator.is_valid("s-1") and not validator.is_valid("s-1\n")
    assert ids.ecma_regex(r"^[$]a\$$") == r"^[$]a\$\Z"


def test_token_command_refuses_trailing_newline(deployment: Deployment) -> None:
    ok = subprocess.run(
        [PYTHON, "-m", "oubliette_server", "token", "boxA", "--data-dir", str(deployment.data_dir)],
        capture_output=True, text=True, timeout=60,
    )
    assert ok.returncode == 0 and len(ok.stdout.strip()) == 64
    bad = subprocess.run(
        [PYTHON, "-m", "oubliette_server", "token", "boxA\n", "--data-dir", str(deployment.data_dir)],
        capture_output=True, text=True, timeout=60,
    )
    assert bad.returncode != 0 and bad.stdout == ""
    assert "invalid instance id" in bad.stderr


async def test_hello_refuses_instance_with_trailing_newline(deployment: Deployment) -> None:
    async with deployment.caller():
        token = TokenAuthority.for_data_dir(deployment.data_dir).token_for("boxA\n")  # the HMAC would verify
        error = await hello_error(deployment, hello_params("boxA\n", token))
        assert error["code"] == NOT_FOUND and "invalid instance id" in error["message"]


async def test_caller_ids_with_trailing_newline_are_refused(deployment: Deployment) -> None:
    async with deployment.caller("--config", str(deployment.config_file("box1"))) as (caller, _):
        await refused(caller, "session_message", {"instance": "box1", "session_id": "s-1\n", "message": "hi"}, "does not match")
        await refused(caller, "session_message", {
            "instance": "box1", "session_id": "s-1", "message": "hi",
            "context": {"caller_id": "app\n", "caller_tools": [{"name": "t"}]},
        }, "does not match")
        await refused(caller, "session_message", {
            "instance": "box1", "session_id": "s-1", "message": "hi",
            "context": {"caller_id": "app", "caller_tools": [{"name": "t\n"}]},
        }, "does not match")
        await refused(caller, "session_message", {"instance": "box1\n", "message": "hi"}, "invalid instance id")
        await refused(caller, "tether_send", {"instance": "box1", "session_id": "s\n", "text": "hi"}, "invalid session_id")
        await refused(caller, "session_events", {"instance": "box1", "session_id": "s", "channel": "mcp\n"}, "invalid channel")


async def test_http_refuses_instance_and_session_with_trailing_newline(deployment: Deployment) -> None:
    async with deployment.embedded_http_server("boxA") as server, server.rest() as rest:
        response = await rest.get("/v1/instances/boxA%0A/tether/poll")
        assert response.status_code == 400 and "invalid instance id" in response.text
        response = await rest.get("/v1/instances/boxA/tether/poll")
        assert response.status_code == 200
        response = await rest.post("/v1/instances/boxA/tether", json={
            "type": "user.message", "session": {"channel": "host", "id": "s\n"}, "payload": {"text": "x"},
        })
        assert response.status_code == 400 and "does not match" in response.text
        response = await rest.post("/v1/instances/boxA/tether", json={
            "type": "user.message\n", "session": {"channel": "host", "id": "s"}, "payload": {"text": "x"},
        })
        assert response.status_code == 400
        assert await server.app.store.last_seq("boxA") == 0  # nothing stored


# -- every bad hello is answered ---------------------------------------------------------


async def test_bad_hellos_get_an_error_before_the_close(deployment: Deployment) -> None:
    async with deployment.caller():
        token = deployment.token("box1")
        for bad_token in ("tökén", "\ud800", "x" * 64 + "é", ""):
            error = await hello_error(deployment, hello_params("box1", bad_token))
            assert error["code"] == UNAUTHORIZED, (bad_token, error)
        for session in ("", ":", "mcp:", ":s", "\ud800", "mcp:\ud800", "mcp:s\n"):
            error = await hello_error(deployment, hello_params("box1", token, session=session))
            assert error["code"] == INVALID_PARAMS and "invalid session" in error["message"], (session, error)
        # The same connection settings with a good session still work.
        async with RawRelay.connect(deployment) as relay:
            reply = await relay.hello("box1", token, session="mcp:a@b")
            assert reply["result"]["session"] == "mcp:a@b"


async def guest_round_trip(relay: RawRelay, request_id: int) -> dict[str, Any]:
    """A request the guest connection must answer: proves it is alive and has read everything before."""
    await relay.send({"jsonrpc": "2.0", "id": request_id, "method": "no_such_method", "params": {}})
    while True:
        message = await relay.receive()
        assert message is not None, "the server closed the guest connection"
        if message.get("id") == request_id:
            return message


async def test_ack_out_of_range_is_ignored_and_connection_survives(deployment: Deployment) -> None:
    """Acks of 2^63 (beyond SQLite), 2^70 and past the log's end: ignored, logged, the guest stays connected."""
    async with deployment.caller() as (caller, _):
        token = deployment.token("box1")
        async with RawRelay.connect(deployment) as guest:
            assert "result" in await guest.hello("box1", token, role="guest")
            for n, seq in enumerate((2**63, 2**63 - 1, HUGE, 1000)):
                await guest.send({"jsonrpc": "2.0", "method": "ack", "params": {"seq": seq}})
                reply = await guest_round_trip(guest, 10 + n)
                assert reply["error"]["code"] == METHOD_NOT_FOUND


# -- an ack past the end does not hide the next message ------------------------------


async def test_ack_beyond_the_log_does_not_lose_the_next_message(deployment: Deployment) -> None:
    async with deployment.caller() as (caller, _):
        token = deployment.token("box1")
        async with RawRelay.connect(deployment) as guest:
            assert "result" in await guest.hello("box1", token, role="guest")
            await guest.send({"jsonrpc": "2.0", "method": "ack", "params": {"seq": 50}})
            await guest_round_trip(guest, 1)  # the ack has been handled
        result = await call(caller, "tether_send", {"instance": "box1", "text": "after the bad ack"})
        assert not result.is_error, text_of(result)
        seq = structured(result)["ingress_seq"]
        assert seq < 50
        async with RawRelay.connect(deployment) as guest:
            assert "result" in await guest.hello("box1", token, role="guest")
            message = await guest.receive(timeout=TURN_TIMEOUT)
            assert message is not None and message["method"] == "user_message"
            assert message["params"]["frame"]["seq"] == seq
            assert message["params"]["frame"]["payload"] == {"text": "after the bad ack"}


# -- after_seq range, unknown instances ------------------------------------------------


async def test_after_seq_out_of_range_and_unknown_instance(deployment: Deployment) -> None:
    async with deployment.caller("--config", str(deployment.config_file("box1"))) as (caller, _):
        sent = await call(caller, "tether_send", {"instance": "box1", "text": "hi", "session_id": "s1"})
        assert not sent.is_error, text_of(sent)
        await refused(caller, "tether_read", {"instance": "box1", "session_id": "s1", "after_seq": HUGE}, "after_seq")
        await refused(caller, "session_events", {"instance": "box1", "session_id": "s1", "channel": "host", "after_seq": HUGE}, "after_seq")
        ok = await call(caller, "tether_read", {"instance": "box1", "session_id": "s1", "after_seq": 2**63 - 1})
        assert not ok.is_error and structured(ok)["frames"] == []
        # Unknown instance: both refuse, the same way.
        read_error = await refused(caller, "tether_read", {"instance": "nobody", "session_id": "s1"}, "unknown instance")
        events_error = await refused(caller, "session_events", {"instance": "nobody", "session_id": "s1"}, "unknown instance")
        assert read_error.split(": ", 1)[1] == events_error.split(": ", 1)[1]


async def test_http_after_seq_out_of_range(deployment: Deployment) -> None:
    async with deployment.embedded_http_server("boxA") as server, server.rest() as rest:
        response = await rest.get("/v1/instances/boxA/tether/poll", params={"after_seq": str(HUGE)})
        assert response.status_code == 400 and "after_seq" in response.text
        response = await rest.get("/v1/instances/boxA/tether/stream", params={"after_seq": str(HUGE)})
        assert response.status_code == 400 and "after_seq" in response.text
        response = await rest.get("/v1/instances/boxA/tether/stream", headers={"Last-Event-ID": str(HUGE)})
        assert response.status_code == 400 and "after_seq" in response.text


# -- server-owned frame types and payload keys, at every door (docs/SECURITY.md) ---------------

FORGED_DECLARATION = {"caller_id": "myapp", "tools": [
    {"name": "rm", "description": "rm", "requires_approval": False, "inputSchema": {"type": "object"}}]}
FORGED_KEYS = {"caller_tools": FORGED_DECLARATION, "owner": "key:" + "0" * 32}


async def test_no_door_stores_a_server_owned_type_or_key(deployment: Deployment) -> None:
    """The sandbox, with only its instance token, at each door that stores a frame: the HTTP tether
    POST, a guest's `append_frame`, and a caller's `tether_send`. Every server-owned type and payload
    key is refused, naming it (HTTP 400 / -32602 / a tool error), nothing is stored, and the same
    door still takes an ordinary frame."""
    from oubliette_server.core.server_owned import SERVER_OWNED_TYPES

    session = {"channel": "mcp", "id": "s1"}
    async with deployment.embedded_http_server("box1") as server, \
            server.rest(token=deployment.token("box1")) as sandbox, server.caller(events=False) as (caller, _):
        store = server.app.store
        route = "/v1/instances/box1/tether"
        for key, value in FORGED_KEYS.items():
            for type_ in ("user.message", "assistant.done"):
                response = await sandbox.post(route, json={
                    "type": type_, "session": session, "payload": {"text": "rm", key: value}})
                assert response.status_code == 400, response.text
                error = response.json()["error"]
                assert error["code"] == INVALID_PARAMS and f"payload key '{key}' is written by the server only" in error["message"]
        for type_ in sorted(SERVER_OWNED_TYPES):
            response = await sandbox.post(route, json={"type": type_, "session": session, "payload": {}})
            assert response.status_code == 400 and f"'{type_}' are made by the server only" in response.text, response.text

        for key, value in FORGED_KEYS.items():
            await refused(caller, "tether_send", {"instance": "box1", "text": "rm", key: value},
                          f"argument key '{key}' is written by the server only")

        async with RawRelay.connect(deployment) as guest:
            assert "result" in await guest.hello("box1", deployment.token("box1"), role="guest")
            attempts = [(t, {}, f"'{t}' are made by the server only") for t in sorted(SERVER_OWNED_TYPES)]
            attempts += [("assistant.done", {"text": "rm", k: v}, f"payload key '{k}' is written by the server only")
                         for k, v in FORGED_KEYS.items()]
            for n, (type_, payload, needle) in enumerate(attempts):
                await guest.send({"jsonrpc": "2.0", "id": n, "method": "append_frame",
                                  "params": {"session": session, "type": type_, "payload": payload}})
                reply = await guest.receive()
                assert reply is not None and reply["id"] == n, reply
                assert reply["error"]["code"] == INVALID_PARAMS and needle in reply["error"]["message"], reply
            assert await store.last_seq("box1") == 0  # nothing, through any door

            # Each door still takes an ordinary frame (the guest's in a session the server knows:
            # a guest opens none).
            response = await sandbox.post(route, json={"type": "user.message", "session": session, "payload": {"text": "hi"}})
            assert response.status_code == 201, response.text
            await guest.send({"jsonrpc": "2.0", "id": 99, "method": "append_frame", "params": {
                "session": session, "type": "assistant.delta", "payload": {"text": "still here"}}})
            while (reply := await guest.receive()) is not None and reply.get("id") != 99:
                pass  # the user_message delivered to this guest comes first
            assert reply is not None and reply["result"]["seq"] == 2, reply
        sent = await call(caller, "tether_send", {"instance": "box1", "text": "hi"})
        assert not sent.is_error, text_of(sent)
        assert await store.last_seq("box1") == 3


# -- one MCP config file per session --------------------------------------------------


def test_mcp_config_file_names_are_injective(tmp_path: Path) -> None:
    keys = ["mcp:a@b", "mcp:a_b", "mcp:a.b", "mcp:a:b", "mcp_a_b", "host:" + "x" * 128, "host:" + "x" * 127 + "y"]
    names = {config_file_name(key) for key in keys}
    assert len(names) == len(keys)
    settings = RelaySettings(relay="unix:/r", instance="box1", token="t")
    for key in keys:
        path = write_mcp_config(tmp_path, settings, key)
        config = json.loads(path.read_text())
        assert config["mcpServers"]["oubliette"]["env"]["OUBLIETTE_SESSION"] == key
        assert len(path.name) < 255


# Connects to the test's barrier socket and waits until the test closes it (so every turn has
# written its MCP config before any agent reads one), then prints the session its config binds.
CONFIG_READER_AGENT = """
import json, socket, sys
sys.stdin.read()
barrier = socket.socket(socket.AF_UNIX)
barrier.connect(sys.argv[2])
barrier.recv(1)
with open(sys.argv[1]) as handle:
    env = json.load(handle)["mcpServers"]["oubliette"]["env"]
print(env["OUBLIETTE_SESSION"], flush=True)
"""


async def test_sessions_with_similar_names_get_their_own_mcp_config(deployment: Deployment) -> None:
    """`a@b` and `a_b` run at once; each agent's config binds its own session."""
    barrier_path = str(deployment.root / "barrier.sock")
    listener = trio.socket.socket(trio.socket.AF_UNIX)
    await listener.bind(barrier_path)
    listener.listen(4)
    command = agent_command(deployment, "reader", CONFIG_READER_AGENT, "{mcp_config}", barrier_path)
    async with deployment.caller() as (caller, events), deployment.guest("box1", command):
        sent = {}
        for session in ("a@b", "a_b"):
            result = await call(caller, "session_message", {"instance": "box1", "session_id": session, "message": "go"})
            assert not result.is_error, text_of(result)
            sent[session] = structured(result)["msg_id"]
        with trio.fail_after(TURN_TIMEOUT):
            first, _ = await listener.accept()
            second, _ = await listener.accept()  # both turns run, both configs are written
        first.close()
        second.close()
        listener.close()
        for session, msg_id in sent.items():
            done = await events.wait_for(
                lambda e: e.get("reply_to") == msg_id and e.get("type") in ("assistant.done", "session.error"),
                timeout=TURN_TIMEOUT,
            )
            assert done["type"] == "assistant.done", done
            assert done["text"] == f"mcp:{session}"


# -- no agent orphans ----------------------------------------------------

# Starts a long-lived child in the background, prints its pid, then stays in the turn (or,
# with "exit" as the message, ends the turn at once, leaving the child behind).
SPAWNING_AGENT = """
import subprocess, sys, time
message = sys.stdin.read()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(child.pid, flush=True)
if message != "exit":
    time.sleep(600)
"""


async def wait_gone(pidfd: int, timeout: float) -> None:
    """Until the process behind `pidfd` has exited (a pidfd becomes readable then)."""
    with trio.fail_after(timeout):
        await trio.lowlevel.wait_readable(pidfd)


async def spawned_child(caller: Client, events: EventLog, message: str, session: str) -> tuple[str, int]:
    result = await call(caller, "session_message", {"instance": "box1", "session_id": session, "message": message})
    assert not result.is_error, text_of(result)
    msg_id = structured(result)["msg_id"]
    delta = await events.wait_for(lambda e: e.get("reply_to") == msg_id and e.get("type") == "assistant.delta")
    return msg_id, os.pidfd_open(int(delta["text"]))


async def test_sigterm_of_the_guest_runtime_ends_the_agent_and_its_children(deployment: Deployment) -> None:
    command = agent_command(deployment, "spawner", SPAWNING_AGENT)
    async with deployment.caller() as (caller, events), deployment.guest("box1", command) as guest:
        _, pidfd = await spawned_child(caller, events, "stay", "s-orphan")
        try:
            guest.send_signal(signal.SIGTERM)
            with trio.fail_after(10):
                code = await guest.wait()
            assert code == 0  # stopping on request is success
            await wait_gone(pidfd, 5)  # it was ended before the runtime exited
        finally:
            os.close(pidfd)


async def test_a_finished_turn_leaves_no_children(deployment: Deployment) -> None:
    command = agent_command(deployment, "spawner", SPAWNING_AGENT)
    async with deployment.caller() as (caller, events), deployment.guest("box1", command):
        msg_id, pidfd = await spawned_child(caller, events, "exit", "s-leftover")
        try:
            done = await events.wait_for(
                lambda e: e.get("reply_to") == msg_id and e.get("type") in ("assistant.done", "session.error"),
                timeout=TURN_TIMEOUT,
            )
            assert done["type"] == "assistant.done"
            await wait_gone(pidfd, 5)
        finally:
            os.close(pidfd)


@pytest.mark.parametrize("signum", [signal.SIGINT])
async def test_sigint_also_ends_the_turn(deployment: Deployment, signum: int) -> None:
    command = agent_command(deployment, "spawner", SPAWNING_AGENT)
    async with deployment.caller() as (caller, events), deployment.guest("box1", command) as guest:
        _, pidfd = await spawned_child(caller, events, "stay", "s-int")
        try:
            guest.send_signal(signum)
            with trio.fail_after(10):
                assert await guest.wait() == 0
            await wait_gone(pidfd, 5)
        finally:
            os.close(pidfd)


# -- response bursts: a sandbox that reads gets every answer ---------------------------------

BURST = 120  # more than the 64 frames that once held the answers too


async def test_a_burst_of_caller_timeouts_gets_every_answer(deployment: Deployment) -> None:
    """BURST `caller_tool` calls in one write, none answered by the caller: the real server's caller
    timeout passes for all of them at about the same moment, and the sandbox (reading) gets BURST
    answers -32001 on a connection that stays up, not a closed connection (docs/SECURITY.md,
    "Response bursts")."""
    async with deployment.caller("--caller-timeout", "1") as (caller, events):
        result = await caller.call_tool("session_message", {
            "instance": "box1", "session_id": "s-burst", "message": "hi",
            "context": {"caller_id": "myapp", "caller_tools": [{"name": "slow", "inputSchema": {"type": "object"}}]},
        })
        assert not result.is_error, text_of(result)
        async with RawRelay.connect(deployment) as relay:
            assert "result" in await relay.hello("box1", deployment.token("box1"), session="mcp:s-burst")
            await relay.send_raw(b"".join(
                json.dumps({"jsonrpc": "2.0", "id": i, "method": "caller_tool",
                            "params": {"tool": "slow", "arguments": {}}}).encode() + b"\n"
                for i in range(1, BURST + 1)
            ))
            answers: dict[int, Any] = {}
            while len(answers) < BURST:
                message = await relay.receive(timeout=30)
                assert message is not None, f"the server closed the connection after {len(answers)} answers"
                if "id" in message:
                    answers[message["id"]] = message
            assert sorted(answers) == list(range(1, BURST + 1))
            assert {answer["error"]["code"] for answer in answers.values()} == {-32001}
            assert (await guest_round_trip(relay, BURST + 1))["error"]["code"] == METHOD_NOT_FOUND  # still up


# -- peer strings in log lines ----------------------------------------------------------------


async def test_a_huge_tracestate_is_dropped_and_the_log_stays_small(deployment: Deployment) -> None:
    """Seen in an attack: a relay request whose `_meta.tracestate` was 900 KB and invalid made OpenTelemetry
    log all of it at WARNING, tracing off, default log level: 50 requests, 45 MB of log. Now the
    trace context is dropped at the door (`telemetry.peer_trace_context`) and every request, over
    the relay and over `/mcp`, is still answered, each adding at most a few hundred bytes of log."""
    from bench_peer_logs import INSTANCE, flood  # bench/, on the tests' path

    requests = 20
    async with deployment.http_server("--config", str(deployment.config_file(INSTANCE)), "--log-level", "INFO") as server:
        results = await flood(deployment, server, requests, 900_000)
    for door, answered, _, written in results:
        assert answered == requests, door
        assert written < 600 * requests, f"{door}: {written} bytes of log for {requests} requests"
    assert "xxxxxxxx" not in server.stderr.decode(errors="replace")
