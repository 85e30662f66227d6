"""`oubliette-client endpoint` and `oubliette-client tools`: the action contract, end to end.

Every test starts the real programs: oubliette-server as the caller's stdio MCP
server with a TOML config (`--config`) that registers command toolsets, and
oubliette-client's action-contract face as a subprocess inside "box1",
bound to session `mcp:s1`. The command toolsets are the reference endpoint
`examples/mcp_echo.py`, or a small wrapper around it that logs every request
it receives, so a test can prove that a refused request never reached it.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import subprocess
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
import trio

from harness import ECHO_EXTERNAL, EVENT_TIMEOUT, PYTHON, Deployment, env_without_oubliette, text_of

pytestmark = pytest.mark.in_process

REPO = Path(__file__).resolve().parents[2]
MCP_ECHO = REPO / "examples" / "mcp_echo.py"

# Bound on one whole `oubliette-client` run (start, connect, answer, exit) on a slow machine.
RUN_BOUND = 60.0

DESCRIPTOR_FIELDS = {"name", "description", "command", "origin", "safety", "input_schema", "result_schema"}

# The reference endpoint's descriptor of echo_external, published behind the prefix "ext".
ECHO_DESCRIPTOR = {**ECHO_EXTERNAL, "name": "ext.echo_external"}

NOTIFY_SCHEMA = {
    "type": "object",
    "properties": {"message": {"type": "string"}, "urgent": {"type": "boolean"}},
    "required": ["message"],
}
NOTIFY = {"name": "send_notification", "description": "Send notification", "inputSchema": NOTIFY_SCHEMA}

# A command endpoint that appends every request line it receives to a log file (argv[1]) before
# answering it. Mode "echo" answers like mcp_echo; "wrong-result" answers call_tool with a
# result that violates echo_external's result_schema.
LOGGING_ENDPOINT = """\
import json, sys
sys.path.insert(0, {examples!r})
import mcp_echo

log_path, mode = sys.argv[1], sys.argv[2]
for line in sys.stdin.buffer:
    with open(log_path, "ab") as log:
        log.write(line.rstrip(b"\\n") + b"\\n")
    response = mcp_echo.respond(line)
    if mode == "wrong-result" and response.get("type") == "result" and "result" in response:
        response = {{"type": "result", "tool": response["tool"], "result": {{"wrong": 1}}}}
    sys.stdout.write(json.dumps(response) + "\\n")
    sys.stdout.flush()
"""


# -- helpers ---------------------------------------------------------------------------------


def toml_list(parts: list[str]) -> str:
    return "[" + ", ".join(json.dumps(str(part)) for part in parts) + "]"


def write_config(deployment: Deployment, toolsets: dict[str, tuple[str, list[str]]], allowed: list[str]) -> Path:
    """A server config registering command toolsets `{id: (prefix, command)}`; box1 may use `allowed`."""
    lines: list[str] = []
    for toolset_id, (prefix, command) in toolsets.items():
        lines += [f"[toolsets.{toolset_id}]", 'kind = "command"', f"prefix = {json.dumps(prefix)}",
                  f"command = {toml_list(command)}", ""]
    lines += ["[allowlists]", f"box1 = {toml_list(allowed)}"]
    path = deployment.root / "endpoint-test.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def echo_config(deployment: Deployment) -> Path:
    return write_config(deployment, {"echo": ("ext", [PYTHON, str(MCP_ECHO)])}, ["echo"])


class RequestLog:
    """The wrapper endpoint's log of every request line it received."""

    def __init__(self, deployment: Deployment, mode: str = "echo") -> None:
        self.script = deployment.root / f"logging_endpoint_{mode}.py"
        self.script.write_text(LOGGING_ENDPOINT.format(examples=str(MCP_ECHO.parent)))
        self.path = deployment.root / f"requests_{mode}.log"
        self.command = [PYTHON, str(self.script), str(self.path), mode]

    def requests(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def calls(self) -> list[dict[str, Any]]:
        return [r for r in self.requests() if r.get("action") == "call_tool"]


def client_env(deployment: Deployment, session: str | None = "mcp:s1") -> dict[str, str]:
    return {**env_without_oubliette(), **deployment.client_env("box1", session)}


def lines_of(*requests: Any) -> bytes:
    """One request per line; a str is sent as it is, anything else as JSON."""
    return b"".join((r if isinstance(r, str) else json.dumps(r)).encode() + b"\n" for r in requests)


async def run_endpoint(env: dict[str, str], stdin: bytes, *args: str) -> tuple[list[dict[str, Any]], int]:
    """`oubliette-client endpoint` with `stdin` (closed after it): its response lines and exit status."""
    with trio.fail_after(RUN_BOUND):
        done = await trio.run_process(
            [PYTHON, "-m", "oubliette_client", "endpoint", *args],
            stdin=stdin, capture_stdout=True, env=env, check=False,
        )
    return [json.loads(line) for line in done.stdout.decode().splitlines()], done.returncode


async def run_tools(env: dict[str, str], *words: str) -> tuple[dict[str, Any], int]:
    """`oubliette-client tools WORDS…`: its stdout as JSON, and its exit status."""
    with trio.fail_after(RUN_BOUND):
        done = await trio.run_process(
            [PYTHON, "-m", "oubliette_client", "tools", *words],
            stdin=subprocess.DEVNULL, capture_stdout=True, env=env, check=False,
        )
    return json.loads(done.stdout), done.returncode


class EndpointProcess:
    """An interactive `oubliette-client endpoint`: write request lines, read response lines."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self._buffer = bytearray()

    async def send(self, request: Any) -> None:
        assert self.process.stdin is not None
        await self.process.stdin.send_all(lines_of(request))

    async def receive(self, timeout: float = EVENT_TIMEOUT) -> dict[str, Any]:
        assert self.process.stdout is not None
        with trio.fail_after(timeout):
            while b"\n" not in self._buffer:
                chunk = await self.process.stdout.receive_some(65536)
                assert chunk, "the endpoint closed stdout before answering"
                self._buffer.extend(chunk)
        end = self._buffer.index(b"\n")
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 1]
        return json.loads(line)

    async def ask(self, request: Any) -> dict[str, Any]:
        await self.send(request)
        return await self.receive()

    async def finish(self) -> int:
        """Close stdin (EOF) and wait for the endpoint to exit; its exit status."""
        assert self.process.stdin is not None
        await self.process.stdin.aclose()
        with trio.fail_after(RUN_BOUND):
            return await self.process.wait()


@asynccontextmanager
async def open_endpoint(env: dict[str, str], *args: str) -> AsyncIterator[EndpointProcess]:
    process = await trio.lowlevel.open_process(
        [PYTHON, "-m", "oubliette_client", "endpoint", *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
    )
    try:
        yield EndpointProcess(process)
    finally:
        if process.returncode is None:
            process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()


async def declare(caller: Any, session_id: str, tools: list[dict[str, Any]], caller_id: str = "myapp") -> None:
    result = await caller.call_tool("session_message", {
        "instance": "box1", "session_id": session_id, "message": "hi",
        "context": {"caller_id": caller_id, "caller_tools": tools},
    })
    assert not result.is_error, text_of(result)


def assert_usage_error(response: dict[str, Any], fragment: str) -> None:
    assert response["type"] == "error", response
    assert set(response) == {"type", "error"}
    error = response["error"]
    assert error["name"] == "oubliette-client"
    assert error["category"] == "usage"
    assert fragment in error["message"], error["message"]


SEED_LIST = {"action": "list_tools"}
SEED_DESCRIBE = {"action": "describe_tool", "tool": "ext.echo_external"}
SEED_CALL = {"action": "call_tool", "tool": "ext.echo_external", "arguments": {"message": "hi"}}


# -- 1. the action contract's example interactions through `oubliette-client endpoint` ---------------------


@pytest.mark.real_programs
async def test_seed_interactions_through_the_endpoint(deployment: Deployment) -> None:
    """list_tools, describe_tool and call_tool of the reference echo endpoint, each in its own run."""
    async with deployment.caller("--config", str(echo_config(deployment))):
        env = client_env(deployment)
        (listed,), listed_status = await run_endpoint(env, lines_of(SEED_LIST))
        (described,), described_status = await run_endpoint(env, lines_of(SEED_DESCRIBE))
        (called,), called_status = await run_endpoint(env, lines_of(SEED_CALL))
    assert (listed_status, described_status, called_status) == (0, 0, 0)

    assert set(listed) == {"type", "tools"} and listed["type"] == "result"
    tools = {tool["name"]: tool for tool in listed["tools"]}
    assert "ext.echo_external" in tools
    assert set(tools["ext.echo_external"]) == DESCRIPTOR_FIELDS
    assert tools["ext.echo_external"] == ECHO_DESCRIPTOR
    assert tools["ext.echo_external"]["origin"] == "remote"

    assert described == {"type": "result", "tool": ECHO_DESCRIPTOR}
    assert called == {"type": "result", "tool": "ext.echo_external", "result": {"echo": "hi"}}


async def test_several_requests_on_one_stdin_are_answered_in_order(deployment: Deployment) -> None:
    """One response line per request line, in the order of the requests."""
    requests = [
        SEED_LIST,
        SEED_DESCRIBE,
        SEED_CALL,
        {"action": "call_tool", "tool": "ext.echo_external", "arguments": {"message": "second"}},
        {"action": "describe_tool", "tool": "ext.no_such_tool"},
        {"action": "call_tool", "tool": "ext.echo_external", "arguments": {"message": "third"}},
    ]
    async with deployment.caller("--config", str(echo_config(deployment))):
        responses, status = await run_endpoint(client_env(deployment), lines_of(*requests))
    assert status == 0
    assert len(responses) == len(requests)
    assert responses[0]["type"] == "result" and [t["name"] for t in responses[0]["tools"]] == ["ext.echo_external"]
    assert responses[1] == {"type": "result", "tool": ECHO_DESCRIPTOR}
    assert responses[2] == {"type": "result", "tool": "ext.echo_external", "result": {"echo": "hi"}}
    assert responses[3] == {"type": "result", "tool": "ext.echo_external", "result": {"echo": "second"}}
    assert responses[4]["type"] == "error" and responses[4]["error"]["category"] == "not_found"
    assert responses[5] == {"type": "result", "tool": "ext.echo_external", "result": {"echo": "third"}}


async def test_interactive_endpoint_answers_each_line_at_once(deployment: Deployment) -> None:
    """A long-lived pipe: each request is answered before the next is written; EOF ends the endpoint."""
    async with deployment.caller("--config", str(echo_config(deployment))):
        async with open_endpoint(client_env(deployment)) as endpoint:
            listed = await endpoint.ask(SEED_LIST)
            described = await endpoint.ask(SEED_DESCRIBE)
            called = await endpoint.ask(SEED_CALL)
            status = await endpoint.finish()
    assert listed == {"type": "result", "tools": [ECHO_DESCRIPTOR]}
    assert described == {"type": "result", "tool": ECHO_DESCRIPTOR}
    assert called == {"type": "result", "tool": "ext.echo_external", "result": {"echo": "hi"}}
    assert status == 0


# -- 2. the same through `oubliette-client tools` ---------------------------------------------


async def test_seed_interactions_through_tools_commands(deployment: Deployment) -> None:
    async with deployment.caller("--config", str(echo_config(deployment))):
        env = client_env(deployment)
        listed, listed_status = await run_tools(env, "list")
        described, described_status = await run_tools(env, "describe", "ext.echo_external")
        called, called_status = await run_tools(env, "call", "ext.echo_external", '{"message":"hi"}')
    assert (listed_status, described_status, called_status) == (0, 0, 0)
    assert listed["type"] == "result"
    tools = {tool["name"]: tool for tool in listed["tools"]}
    assert set(tools["ext.echo_external"]) == DESCRIPTOR_FIELDS
    assert tools["ext.echo_external"] == ECHO_DESCRIPTOR
    assert described == {"type": "result", "tool": ECHO_DESCRIPTOR}
    assert called == {"type": "result", "tool": "ext.echo_external", "result": {"echo": "hi"}}


# -- 3. non-object payloads and arguments are refused before anything is sent ------------------


async def test_non_object_requests_and_arguments_are_refused_before_sending(deployment: Deployment) -> None:
    log = RequestLog(deployment)
    config = write_config(deployment, {"echo": ("ext", log.command)}, ["echo"])
    requests = [
        "this is not JSON",
        json.dumps([{"action": "call_tool", "tool": "ext.echo_external", "arguments": {"message": "in an array"}}]),
        {"action": "call_tool", "tool": "ext.echo_external", "arguments": [1]},
        {"action": "call_tool", "tool": "ext.echo_external", "arguments": "x"},
        {"action": "call_tool", "tool": "ext.echo_external", "arguments": {"message": "valid"}},
    ]
    async with deployment.caller("--config", str(config)):
        responses, status = await run_endpoint(client_env(deployment), lines_of(*requests))
        # The valid call came back, so the wrapper logged it (it logs before it answers).
        calls = log.calls()
    assert status == 0
    assert len(responses) == len(requests)
    assert_usage_error(responses[0], "request is not valid JSON")
    assert_usage_error(responses[1], "request must be a JSON object, got array")
    assert_usage_error(responses[2], "call_tool 'arguments' must be a JSON object, got array")
    assert_usage_error(responses[3], "call_tool 'arguments' must be a JSON object, got string")
    assert responses[4] == {"type": "result", "tool": "ext.echo_external", "result": {"echo": "valid"}}
    assert calls == [{"action": "call_tool", "tool": "echo_external", "arguments": {"message": "valid"}}]


async def test_tools_call_refuses_arguments_that_are_not_a_json_object(deployment: Deployment) -> None:
    log = RequestLog(deployment)
    config = write_config(deployment, {"echo": ("ext", log.command)}, ["echo"])
    async with deployment.caller("--config", str(config)):
        env = client_env(deployment)
        with trio.fail_after(RUN_BOUND):
            not_json = await trio.run_process(
                [PYTHON, "-m", "oubliette_client", "tools", "call", "ext.echo_external", "not json"],
                stdin=subprocess.DEVNULL, capture_stdout=True, capture_stderr=True, env=env, check=False,
            )
        array, array_status = await run_tools(env, "call", "ext.echo_external", "[1]")
        string, string_status = await run_tools(env, "call", "ext.echo_external", '"x"')
        valid, valid_status = await run_tools(env, "call", "ext.echo_external", '{"message":"valid"}')
        calls = log.calls()
    # the person's typo on the command line: a usage error (2), one line on stderr, nothing on stdout
    assert (not_json.returncode, not_json.stdout) == (2, b"")
    assert not_json.stderr.decode().splitlines() == [
        "oubliette-client tools: error: arguments are not valid JSON: Expecting value: line 1 column 1 (char 0) (see --help)"
    ]
    assert array_status == 1
    assert_usage_error(array, "call_tool 'arguments' must be a JSON object, got array")
    assert string_status == 1
    assert_usage_error(string, "call_tool 'arguments' must be a JSON object, got string")
    assert valid_status == 0
    assert valid == {"type": "result", "tool": "ext.echo_external", "result": {"echo": "valid"}}
    assert calls == [{"action": "call_tool", "tool": "echo_external", "arguments": {"message": "valid"}}]


# -- 4. unknown tools and input_schema violations ----------------------------------------------


async def test_unknown_tools_and_schema_violations_are_refused_before_sending(deployment: Deployment) -> None:
    log = RequestLog(deployment)
    config = write_config(deployment, {"echo": ("ext", log.command)}, ["echo"])
    requests = [
        {"action": "call_tool", "tool": "ext.no_such_tool", "arguments": {"message": "x"}},
        {"action": "describe_tool", "tool": "ext.no_such_tool"},
        {"action": "call_tool", "tool": "nope.echo_external", "arguments": {"message": "x"}},
        {"action": "call_tool", "tool": "ext.echo_external", "arguments": {}},
        {"action": "call_tool", "tool": "ext.echo_external"},
        {"action": "call_tool", "tool": "ext.echo_external", "arguments": {"message": 42}},
        {"action": "call_tool", "tool": "ext.echo_external", "arguments": {"message": "valid"}},
    ]
    async with deployment.caller("--config", str(config)):
        responses, status = await run_endpoint(client_env(deployment), lines_of(*requests))
        calls = log.calls()
    assert status == 0
    assert len(responses) == len(requests)
    unknown_call, unknown_describe, unknown_prefix, empty, absent, wrong_type, valid = responses

    for response in (unknown_call, unknown_describe, unknown_prefix):
        assert response["type"] == "error", response
        assert response["error"]["name"] == "oubliette-client"
        assert response["error"]["category"] == "not_found"
    assert "unknown tool 'ext.no_such_tool'" in unknown_call["error"]["message"]
    assert "ext.echo_external" in unknown_call["error"]["message"], "the error lists the tools that exist"
    assert "unknown tool 'ext.no_such_tool'" in unknown_describe["error"]["message"]
    assert "Toolset not found" in unknown_prefix["error"]["message"]
    assert "'nope'" in unknown_prefix["error"]["message"]

    assert_usage_error(empty, "'message' is a required property")
    assert_usage_error(absent, "'message' is a required property")
    assert_usage_error(wrong_type, "42 is not of type 'string'")
    assert "invalid arguments for ext.echo_external" in wrong_type["error"]["message"]

    assert valid == {"type": "result", "tool": "ext.echo_external", "result": {"echo": "valid"}}
    assert calls == [{"action": "call_tool", "tool": "echo_external", "arguments": {"message": "valid"}}]


# -- 5. caller tools are in the catalog too -----------------------------------------------------


@pytest.mark.real_programs
async def test_caller_tools_are_listed_and_relayed_through_the_endpoint(deployment: Deployment) -> None:
    async with deployment.caller("--config", str(echo_config(deployment))) as (caller, events):
        await declare(caller, "s1", [NOTIFY])
        async with open_endpoint(client_env(deployment, "mcp:s1")) as endpoint:
            listed = await endpoint.ask(SEED_LIST)
            described = await endpoint.ask({"action": "describe_tool", "tool": "myapp_send_notification"})

            called: dict[str, Any] = {}
            async with trio.open_nursery() as nursery:
                async def call() -> None:
                    called["response"] = await endpoint.ask({
                        "action": "call_tool", "tool": "myapp_send_notification",
                        "arguments": {"message": "to bob"},
                    })

                nursery.start_soon(call)
                request = await events.wait_type("caller_tool_request", session_id="s1")
                assert "response" not in called, "the endpoint waits for the caller's answer"
                reply = await caller.call_tool("caller_tool_response", {
                    "session_id": "s1", "request_id": request["request_id"], "result": {"sent": True},
                })
                assert not reply.is_error, text_of(reply)
            echo = await endpoint.ask(SEED_CALL)
            status = await endpoint.finish()

    assert listed["type"] == "result"
    tools = {tool["name"]: tool for tool in listed["tools"]}
    assert set(tools) == {"myapp_send_notification", "ext.echo_external"}
    notify = tools["myapp_send_notification"]
    assert set(notify) == DESCRIPTOR_FIELDS
    assert notify["input_schema"] == NOTIFY_SCHEMA
    assert notify["description"] == "Send notification"
    assert notify["origin"] == "remote"
    assert tools["ext.echo_external"] == ECHO_DESCRIPTOR
    assert described == {"type": "result", "tool": notify}

    assert request["tool"] == "send_notification"
    assert request["caller_id"] == "myapp"
    assert request["arguments"] == {"message": "to bob"}
    assert called["response"] == {"type": "result", "tool": "myapp_send_notification", "result": {"sent": True}}
    assert echo == {"type": "result", "tool": "ext.echo_external", "result": {"echo": "hi"}}
    assert status == 0


# -- 6. a failing remote endpoint does not break the catalog -------------------------------------


async def test_failing_command_endpoints_leave_the_rest_of_the_catalog_working(deployment: Deployment) -> None:
    config = write_config(deployment, {
        "echo": ("ext", [PYTHON, str(MCP_ECHO)]),
        "exits": ("exits", [PYTHON, "-c", "import sys; sys.exit(1)"]),
        "missing": ("missing", [str(deployment.root / "no-such-program")]),
        "garbage": ("garbage", [PYTHON, "-c", "print('this is not JSON at all')"]),
    }, ["exits", "missing", "echo", "garbage"])
    async with deployment.caller("--config", str(config)) as (caller, _events):
        # The server started and serves its caller.
        assert "session_message" in {tool.name for tool in (await caller.list_tools()).tools}
        responses, status = await run_endpoint(client_env(deployment), lines_of(SEED_LIST, SEED_CALL))
    assert status == 0
    listed, called = responses
    assert listed == {"type": "result", "tools": [ECHO_DESCRIPTOR]}
    assert called == {"type": "result", "tool": "ext.echo_external", "result": {"echo": "hi"}}


# -- 7. the relay being down -------------------------------------------------------------------


async def run_failing(env: dict[str, str], *args: str, stdin: bytes = b"") -> tuple[bytes, list[str], int]:
    """`oubliette-client ARGS…` expected to fail: its stdout, its stderr lines, its exit status."""
    with trio.fail_after(RUN_BOUND):
        done = await trio.run_process(
            [PYTHON, "-m", "oubliette_client", *args],
            stdin=stdin, capture_stdout=True, capture_stderr=True, env=env, check=False,
        )
    return done.stdout, done.stderr.decode().splitlines(), done.returncode


async def test_relay_down_endpoint_exits_1_with_one_line_saying_why(deployment: Deployment) -> None:
    """Not an empty tool list with exit 0: the caller learns the relay is down."""
    assert not deployment.socket.exists()
    out, err, status = await run_failing(
        client_env(deployment), "endpoint", "--connect-wait", "0.3", stdin=lines_of(SEED_LIST, SEED_CALL),
    )
    assert status == 1 and out == b""
    assert len(err) == 1, err
    assert "cannot connect" in err[0] and deployment.relay in err[0] and "oubliette-server running" in err[0], err
    # a server may still be starting (its socket not bound yet): the line says how long the
    # command waited and which option waits longer
    assert err[0].endswith(
        "; no relay within 0.3 s (is oubliette-server running, or still starting? set OUBLIETTE_RELAY or --relay; "
        "--connect-wait waits longer)"
    ), err


async def test_a_peer_that_is_not_a_relay_is_named_so(deployment: Deployment) -> None:
    """A relay address that reaches another program (an HTTP server, say the server's own --http):
    one line that says the peer is not a relay, not "is oubliette-server running?"."""

    async def http_server(stream: trio.SocketStream) -> None:
        await stream.send_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, http_server, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        env = {**client_env(deployment), "OUBLIETTE_RELAY": f"tcp:127.0.0.1:{port}"}
        out, err, status = await run_failing(env, "tools", "--connect-wait", "0.5", "list")
        nursery.cancel_scope.cancel()
    assert status == 1 and out == b"", err
    assert len(err) == 1, err  # the retries log nothing more at the default level
    assert err[0].startswith(f"oubliette-client: error: the peer at tcp:127.0.0.1:{port} is not an oubliette-server relay ("), err
    assert err[0].endswith("names the server's relay address (its --relay), not its --http; gave up after 0.5 s"), err
    assert "is oubliette-server running" not in err[0]


def test_tools_and_endpoint_wait_for_a_server_that_is_starting() -> None:
    """Their default relay wait outlasts a server's start on a loaded host (5-6.5 s seen)."""
    from oubliette_client.cli import main

    for command in ("tools", "endpoint"):
        with pytest.raises(SystemExit), contextlib.redirect_stdout(io.StringIO()) as shown:
            main([command, "--help"])
        assert "seconds to wait for the relay (default 15)" in " ".join(shown.getvalue().split()), shown.getvalue()


async def test_relay_down_tools_exits_1_with_one_line_saying_why(deployment: Deployment) -> None:
    for words in (["list"], ["call", "ext.echo_external", '{"message":"hi"}']):
        out, err, status = await run_failing(client_env(deployment), "tools", "--connect-wait", "0.3", *words)
        assert status == 1 and out == b"", (words, out)
        assert len(err) == 1 and "cannot connect" in err[0] and deployment.relay in err[0], err


# -- 8. results are checked against result_schema ------------------------------------------------


async def test_result_violating_result_schema_is_an_error(deployment: Deployment) -> None:
    log = RequestLog(deployment, mode="wrong-result")
    config = write_config(deployment, {"echo": ("ext", log.command)}, ["echo"])
    async with deployment.caller("--config", str(config)):
        (response,), status = await run_endpoint(client_env(deployment), lines_of(SEED_CALL))
        calls_after_endpoint = log.calls()
        async with deployment.agent("box1", "mcp:s1") as agent:
            mcp_result = await agent.call_tool("ext.echo_external", {"message": "hi"})
        calls_after_agent = log.calls()

    # The wrapper was really called (the arguments were fine); its answer was refused.
    assert calls_after_endpoint == [{"action": "call_tool", "tool": "echo_external", "arguments": {"message": "hi"}}]
    assert status == 0
    assert response["type"] == "error", response
    assert response["error"]["name"] == "oubliette-client"
    assert "result_schema" in response["error"]["message"]
    assert "'echo' is a required property" in response["error"]["message"]

    assert len(calls_after_agent) == 2
    assert mcp_result.is_error
    assert "result_schema" in text_of(mcp_result)
