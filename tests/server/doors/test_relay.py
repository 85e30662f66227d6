"""The relay socket at the protocol level, against the real server process.

A raw connection (`RawRelay`) speaks the wire protocol by hand: the handshake,
a relayed `caller_tool` request (REQ-CTR-005), `cancel`, and every kind of bad
input. Each bad input gets an error naming the problem; the protocol errors
close that connection, the per-request errors leave it usable, and in every case
a healthy session next to it goes on relaying caller tool calls.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path
from typing import Any, Awaitable, Callable

import pytest
import trio

from harness import EVENT_TIMEOUT, PYTHON, Deployment, RawRelay, structured, text_of
from raw_relay_calls import (
    INSTANCE,
    PROTOCOL,
    SESSION,
    SESSION_KEY,
    Env,
    caller_tool_request,
    handshake,
    hello_params,
    response_to,
)

pytestmark = pytest.mark.in_process

MAX_FRAME_BYTES = 1024 * 1024

NOTIFY = {
    "name": "send_notification",
    "description": "Send notification",
    "inputSchema": {"type": "object", "properties": {"message": {"type": "string"}}},
}


async def declare(caller: Any, tools: list[dict], session_id: str = SESSION) -> None:
    result = await caller.call_tool("session_message", {
        "instance": INSTANCE, "session_id": session_id, "message": "hi",
        "context": {"caller_id": "myapp", "caller_tools": tools},
    })
    assert not result.is_error, text_of(result)


# -- REQ-CTR-005 ------------------------------------------------------------------------


@pytest.mark.real_programs
async def test_socket_request_and_response(deployment: Deployment) -> None:
    """REQ-CTR-005: hello, the tools config before the hello response, caller_tool, the caller's result."""
    async with deployment.caller() as (caller, events):
        await declare(caller, [NOTIFY])
        token = deployment.token(INSTANCE)
        async with RawRelay.connect(deployment) as raw:
            before, hello = await handshake(raw, token)
            assert "error" not in hello, hello
            assert hello["result"]["protocol"] == PROTOCOL
            assert hello["result"]["instance"] == INSTANCE and hello["result"]["session"] == SESSION_KEY
            assert isinstance(hello["result"]["server_version"], str) and hello["result"]["server_version"]
            configs = [m for m in before if m.get("method") == "caller_tools_config"]
            assert len(configs) == 1, before
            assert "id" not in configs[0], "caller_tools_config is a notification"
            config = configs[0]["params"]
            assert config["session_id"] == SESSION and config["caller_id"] == "myapp"
            assert [t["name"] for t in config["tools"]] == ["send_notification"]
            assert config["tools"][0]["description"] == "Send notification"
            assert config["tools"][0]["inputSchema"] == NOTIFY["inputSchema"]

            await raw.send({"jsonrpc": "2.0", "id": 1, "method": "caller_tool",
                            "params": {"tool": "send_notification", "arguments": {}}})
            request = await events.wait_type("caller_tool_request")
            assert request["tool"] == "send_notification"
            assert request["arguments"] == {}
            assert request["session_id"] == SESSION
            assert request["request_id"]
            answer = await caller.call_tool("caller_tool_response", {
                "session_id": SESSION, "request_id": request["request_id"], "result": {"status": "sent"},
            })
            assert structured(answer) == {"resolved": True}
            assert await response_to(raw, 1) == {"jsonrpc": "2.0", "id": 1, "result": {"result": {"status": "sent"}}}


# -- bad input --------------------------------------------------------------------------

BadCase = Callable[[RawRelay, Env], Awaitable[None]]


async def send_ignoring_close(raw: RawRelay, data: bytes) -> None:
    """Send `data`; the server may close the connection before it has read all of it."""
    try:
        await raw.send_raw(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


async def not_json(bad: RawRelay, env: Env, *, after_hello: bool) -> None:
    if after_hello:
        await handshake(bad, env.token)
    await bad.send_raw(b"this is {not json\n")
    error = await bad.receive(EVENT_TIMEOUT)
    assert error is not None and error["id"] is None
    assert error["error"]["code"] == -32700
    assert "not valid JSON" in error["error"]["message"]
    assert await bad.closed(EVENT_TIMEOUT)


async def not_json_first(bad: RawRelay, env: Env) -> None:
    await not_json(bad, env, after_hello=False)


async def not_json_after_hello(bad: RawRelay, env: Env) -> None:
    await not_json(bad, env, after_hello=True)


async def not_an_object(bad: RawRelay, env: Env) -> None:
    await handshake(bad, env.token)
    await bad.send_raw(b"[1, 2, 3]\n")
    error = await bad.receive(EVENT_TIMEOUT)
    assert error is not None and error["id"] is None
    assert error["error"]["code"] == -32600
    assert "not a JSON object" in error["error"]["message"]
    assert await bad.closed(EVENT_TIMEOUT)


async def oversized(bad: RawRelay, env: Env, *, after_hello: bool) -> None:
    if after_hello:
        await handshake(bad, env.token)
    frame = caller_tool_request(5, {"message": "x" * (MAX_FRAME_BYTES + 4096)})
    line = json.dumps(frame).encode() + b"\n"
    assert len(line) > MAX_FRAME_BYTES + 4096
    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_ignoring_close, bad, line)
        error = await bad.receive(EVENT_TIMEOUT)
        assert error is not None and error["id"] is None
        assert error["error"]["code"] == -32600
        assert str(MAX_FRAME_BYTES) in error["error"]["message"] and "limit" in error["error"]["message"]
        assert error["error"].get("data") == {"limit": MAX_FRAME_BYTES}
        assert await bad.closed(EVENT_TIMEOUT)


async def oversized_first(bad: RawRelay, env: Env) -> None:
    await oversized(bad, env, after_hello=False)


async def oversized_after_hello(bad: RawRelay, env: Env) -> None:
    await oversized(bad, env, after_hello=True)


async def wrong_token(bad: RawRelay, env: Env) -> None:
    await bad.send({"jsonrpc": "2.0", "id": 0, "method": "hello", "params": hello_params("0" * 64)})
    error = await bad.receive(EVENT_TIMEOUT)
    assert error is not None and error["id"] == 0 and "result" not in error
    assert error["error"]["code"] == -32006
    assert "token" in error["error"]["message"] and INSTANCE in error["error"]["message"]
    assert await bad.closed(EVENT_TIMEOUT)


async def request_before_hello(bad: RawRelay, env: Env) -> None:
    await bad.send(caller_tool_request(1, {"message": "too early"}))
    error = await bad.receive(EVENT_TIMEOUT)
    assert error is not None and error["id"] == 1 and "result" not in error
    assert error["error"]["code"] == -32600
    assert "hello" in error["error"]["message"]
    assert await bad.closed(EVENT_TIMEOUT)


async def unsupported_protocol(bad: RawRelay, env: Env) -> None:
    await bad.send({"jsonrpc": "2.0", "id": 0, "method": "hello",
                    "params": hello_params(env.token, protocol="oubliette-relay/2")})
    error = await bad.receive(EVENT_TIMEOUT)
    assert error is not None and error["id"] == 0 and "result" not in error
    assert error["error"]["code"] == -32600
    assert "unsupported protocol" in error["error"]["message"]
    assert "oubliette-relay/2" in error["error"]["message"]
    assert await bad.closed(EVENT_TIMEOUT)


async def unknown_method(bad: RawRelay, env: Env) -> None:
    await handshake(bad, env.token)
    await bad.send({"jsonrpc": "2.0", "id": 5, "method": "no_such_method", "params": {}})
    error = await response_to(bad, 5)
    assert error["error"]["code"] == -32601
    assert "no_such_method" in error["error"]["message"]
    await env.relay_call(bad, 6, "same connection after an unknown method")


async def invalid_params(bad: RawRelay, env: Env) -> None:
    await handshake(bad, env.token)
    await bad.send({"jsonrpc": "2.0", "id": 5, "method": "caller_tool", "params": {"arguments": {}}})
    error = await response_to(bad, 5)
    assert error["error"]["code"] == -32602
    assert "tool" in error["error"]["message"]
    await bad.send({"jsonrpc": "2.0", "id": 6, "method": "caller_tool", "params": {"tool": 5, "arguments": {}}})
    error = await response_to(bad, 6)
    assert error["error"]["code"] == -32602
    assert "tool" in error["error"]["message"] and "string" in error["error"]["message"]
    await env.relay_call(bad, 7, "same connection after invalid params")


BAD_CASES: list[BadCase] = [
    not_json_first, not_json_after_hello, not_an_object, oversized_first, oversized_after_hello,
    wrong_token, request_before_hello, unsupported_protocol, unknown_method, invalid_params,
]


@pytest.mark.parametrize("case", BAD_CASES, ids=[c.__name__ for c in BAD_CASES])
async def test_bad_input_leaves_other_sessions_unaffected(deployment: Deployment, case: BadCase) -> None:
    """Each bad input is answered as the protocol says; a healthy raw session next to it is unaffected."""
    async with deployment.caller() as (caller, events):
        await declare(caller, [NOTIFY])
        env = Env(caller, events, deployment.token(INSTANCE))
        async with RawRelay.connect(deployment) as healthy:
            await handshake(healthy, env.token)
            # A call in flight on the healthy connection while the bad input arrives.
            await healthy.send(caller_tool_request(1, {"message": "in flight"}))
            in_flight = await env.wait_request({"message": "in flight"})
            async with RawRelay.connect(deployment) as bad:
                await case(bad, env)
            await env.answer(in_flight, {"echo": "in flight"})
            assert await response_to(healthy, 1) == {
                "jsonrpc": "2.0", "id": 1, "result": {"result": {"echo": "in flight"}},
            }
            # And a whole new call afterwards.
            await env.relay_call(healthy, 2, "after the bad input")


async def test_bad_inputs_leave_a_connected_agent_unaffected(deployment: Deployment) -> None:
    """The SDK agent (through oubliette-client) stays connected through every bad input and keeps working."""
    async with deployment.caller() as (caller, events):
        await declare(caller, [NOTIFY])
        env = Env(caller, events, deployment.token(INSTANCE))
        async with deployment.agent(INSTANCE, SESSION_KEY) as agent, trio.open_nursery() as nursery:
            outcome: dict[str, Any] = {}
            finished = trio.Event()

            async def agent_call() -> None:
                outcome["result"] = await agent.call_tool("myapp_send_notification", {"message": "agent in flight"})
                finished.set()

            nursery.start_soon(agent_call)
            in_flight = await env.wait_request({"message": "agent in flight"})
            for case in BAD_CASES:
                async with RawRelay.connect(deployment) as bad:
                    await case(bad, env)
            assert not finished.is_set()
            await env.answer(in_flight, {"echo": "agent in flight"})
            with trio.fail_after(EVENT_TIMEOUT):
                await finished.wait()
            assert not outcome["result"].is_error, text_of(outcome["result"])
            assert outcome["result"].structured_content == {"echo": "agent in flight"}

            async def answer_next() -> None:
                await env.answer(await env.wait_request({"message": "agent afterwards"}), {"echo": "agent afterwards"})

            nursery.start_soon(answer_next)
            with trio.fail_after(EVENT_TIMEOUT):
                after = await agent.call_tool("myapp_send_notification", {"message": "agent afterwards"})
            assert not after.is_error, text_of(after)
            assert after.structured_content == {"echo": "agent afterwards"}


# -- socket file ------------------------------------------------------------------------


@pytest.mark.real_programs
async def test_relay_socket_is_private(deployment: Deployment) -> None:
    """The relay socket is created 0600, even when the server starts under a permissive umask."""
    old_umask = os.umask(0)  # inherited by the server process
    try:
        async with deployment.caller():
            info = os.stat(deployment.socket)
    finally:
        os.umask(old_umask)
    assert stat.S_ISSOCK(info.st_mode)
    assert stat.S_IMODE(info.st_mode) == 0o600, oct(stat.S_IMODE(info.st_mode))


#: A group of no user of the machine, and a user outside it: a sandbox's agent (docs/SECURITY.md, "The relay socket").
RELAY_GROUP = 4243
OTHER_UID = 10001


async def connect_as(uid: int, groups: list[int], path: Path) -> str:
    """Connect to the Unix socket at `path` as `uid` with these supplementary groups: "ok" or the errno's name."""
    probe = (
        "import errno, socket\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        f"try:\n    s.connect({str(path)!r}); print('ok')\n"
        "except OSError as exc:\n    print(errno.errorcode[exc.errno])\n"
    )
    groups_flag = ["--groups", ",".join(map(str, groups))] if groups else ["--clear-groups"]
    done = await trio.run_process(
        ["setpriv", "--reuid", str(uid), "--regid", str(uid), *groups_flag, "--", PYTHON, "-c", probe],
        capture_stdout=True, capture_stderr=True,
    )
    return done.stdout.decode().strip()


@pytest.mark.real_programs
async def test_a_relay_group_lets_its_members_in_and_nobody_else(deployment: Deployment) -> None:
    """`--relay-group`: the socket is 0660 with that group (not 0600, never open to all), even under
    a permissive umask; a process of another uid connects with the group and is refused without it."""
    assert os.getuid() != OTHER_UID
    deployment.root.chmod(0o711)  # the socket's directory may be entered; the socket's mode decides
    old_umask = os.umask(0)
    try:
        async with deployment.caller("--relay-group", str(RELAY_GROUP)):
            info = os.stat(deployment.socket)
            member = await connect_as(OTHER_UID, [RELAY_GROUP], deployment.socket)
            stranger = await connect_as(OTHER_UID, [], deployment.socket)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(info.st_mode) == 0o660, oct(stat.S_IMODE(info.st_mode))
    assert info.st_gid == RELAY_GROUP
    assert (member, stranger) == ("ok", "EACCES")


def test_a_relay_group_may_come_from_the_config_file(tmp_path: Path) -> None:
    from oubliette_server.program.config import ServerConfig, load_config_file

    for value in ('"4243"', "4243"):
        (tmp_path / "c.toml").write_text(f"[server]\nrelay_group = {value}\n")
        assert ServerConfig(**load_config_file(tmp_path / "c.toml")).relay_gid == RELAY_GROUP


@pytest.mark.parametrize(("flags", "said"), [
    (["--relay-group", "no-such-group-here"], "relay_group: no group named 'no-such-group-here' on this host"),
    (["--relay", "tcp:127.0.0.1:0", "--relay-group", "4243"], "relay_group applies to a Unix relay socket"),
])
async def test_a_relay_group_that_cannot_apply_is_a_usage_error(deployment: Deployment, flags: list[str], said: str) -> None:
    done = await trio.run_process(
        [PYTHON, "-m", "oubliette_server", "--no-stdio", "--data-dir", str(deployment.data_dir), *flags],
        capture_stdout=True, capture_stderr=True, check=False, stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 2
    assert said in done.stderr.decode()


# -- cancel -----------------------------------------------------------------------------


async def test_cancel_from_raw_client(deployment: Deployment) -> None:
    """`cancel {id}` for an in-flight caller_tool: the caller is told, the client gets -32003 for that id."""
    async with deployment.caller() as (caller, events):
        await declare(caller, [NOTIFY])
        env = Env(caller, events, deployment.token(INSTANCE))
        async with RawRelay.connect(deployment) as raw:
            await handshake(raw, env.token)
            await raw.send(caller_tool_request(7, {"message": "cancel me"}))
            request = await env.wait_request({"message": "cancel me"})
            await raw.send({"jsonrpc": "2.0", "method": "cancel", "params": {"id": 7}})

            cancelled = await events.wait_type("caller_tool_cancelled", request_id=request["request_id"])
            assert cancelled["tool"] == "send_notification"
            assert cancelled["session_id"] == SESSION
            assert "cancel" in cancelled["reason"]
            response = await response_to(raw, 7)
            assert "result" not in response
            assert response["error"]["code"] == -32003

            late = await caller.call_tool("caller_tool_response", {
                "session_id": SESSION, "request_id": request["request_id"], "result": "too late",
            })
            assert late.is_error and "no longer pending" in text_of(late)

            # A cancel for an id that is not in flight is ignored; the connection goes on.
            await raw.send({"jsonrpc": "2.0", "method": "cancel", "params": {"id": 999}})
            await env.relay_call(raw, 8, "after the cancel")


async def test_cancel_crossing_a_large_response_keeps_the_connection(deployment: Deployment) -> None:
    """A `cancel` that arrives while a large result is being written: the client still gets that
    whole response (the call had finished) and the connection keeps its framing and stays usable."""
    big = "y" * 900_000  # far more than a socket buffer holds, so the server's write blocks
    async with deployment.caller() as (caller, events):
        await declare(caller, [NOTIFY])
        env = Env(caller, events, deployment.token(INSTANCE))
        async with RawRelay.connect(deployment) as raw:
            await handshake(raw, env.token)
            await raw.send(caller_tool_request(1, {"message": "big"}))
            request = await env.wait_request({"message": "big"})
            await env.answer(request, big)
            await raw.send({"jsonrpc": "2.0", "method": "cancel", "params": {"id": 1}})
            response = await response_to(raw, 1)
            assert response == {"jsonrpc": "2.0", "id": 1, "result": {"result": big}}
            await env.relay_call(raw, 2, "after the crossed cancel")
