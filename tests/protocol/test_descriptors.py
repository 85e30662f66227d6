"""Tests of the tool descriptors and action contract (`protocol.descriptors`), the
reference endpoint `examples/mcp_echo.sh`, and the toolset relay messages."""

from __future__ import annotations

import copy
import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import jsonschema
import pytest
import trio

import protocol
from protocol import (
    ACTIONS,
    INVALID_PARAMS,
    NOT_FOUND,
    PEER_DISCONNECTED,
    SCHEMAS,
    TIMEOUT,
    TOOL_ERROR,
    TOOLSET_CALL,
    TOOLSETS_CONFIG,
    ActionError,
    ActionRequest,
    END_OF_STREAM,
    LineBuffer,
    Notification,
    RelayError,
    Request,
    Response,
    ToolDescriptor,
    ToolsetCall,
    ToolsetCallResult,
    ToolsetsConfig,
    ToolsetToolSpec,
    call_tool_response,
    decode,
    describe_tool_response,
    encode,
    list_tools_response,
    notification,
    parse_action_line,
    parse_action_request,
    parse_action_response,
    parse_action_response_line,
    parse_message,
    parse_params,
    request,
    result_response,
    structure,
    unstructure,
    validate_params,
)
from protocol.schemas import validator_for
from harness import ECHO_EXTERNAL

ROOT = Path(__file__).resolve().parents[2]
ECHO_SH = ROOT / "examples" / "mcp_echo.sh"
ECHO_PY = ROOT / "examples" / "mcp_echo.py"
TOOLSETS_DOC = ROOT / "docs" / "TOOLSETS.md"

ECHO = ECHO_EXTERNAL
ECHO_DESCRIPTOR = ToolDescriptor(**ECHO)


def _env() -> dict[str, str]:
    # The endpoint runs `python3` from PATH; make sure the one running the tests is first.
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def run_endpoint(stdin: str | bytes, *args: str) -> subprocess.CompletedProcess[bytes]:
    data = stdin.encode() if isinstance(stdin, str) else stdin
    return subprocess.run(
        [str(ECHO_SH), *args], input=data, capture_output=True, timeout=30, env=_env(), cwd=ROOT
    )


def ask(*requests: Any) -> list[Any]:
    """Send each request (an object, or a raw str line) on one stdin; the parsed answers."""
    lines = [r if isinstance(r, str) else json.dumps(r) for r in requests]
    proc = run_endpoint("".join(line + "\n" for line in lines))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == b""
    return [json.loads(line) for line in proc.stdout.decode().splitlines()]


def usage_error(message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"name": "mcp_echo", "category": "usage", "message": message}}


# --- the reference endpoint: the seed's three interactions ------------------------------------


def test_seed_list_tools() -> None:
    proc = run_endpoint('{"action":"list_tools"}\n')
    assert proc.returncode == 0 and proc.stderr == b""
    assert proc.stdout.count(b"\n") == 1
    assert json.loads(proc.stdout) == {"type": "result", "tools": [ECHO]}


def test_seed_describe_tool() -> None:
    proc = run_endpoint('{"action":"describe_tool","tool":"echo_external"}\n')
    assert proc.returncode == 0 and proc.stderr == b""
    assert json.loads(proc.stdout) == {"type": "result", "tool": ECHO}


def test_seed_call_tool() -> None:
    proc = run_endpoint(
        '{"action":"call_tool","tool":"echo_external","arguments":{"message":"hi"}}\n'
    )
    assert proc.returncode == 0 and proc.stderr == b""
    assert json.loads(proc.stdout) == {
        "type": "result",
        "tool": "echo_external",
        "result": {"echo": "hi"},
    }


def test_seed_commands_through_a_shell() -> None:
    # Exactly as the seed writes them: `echo '…' | ./endpoint`.
    for line, expected in [
        ('{"action":"list_tools"}', {"type": "result", "tools": [ECHO]}),
        ('{"action":"describe_tool","tool":"echo_external"}', {"type": "result", "tool": ECHO}),
        (
            '{"action":"call_tool","tool":"echo_external","arguments":{"message":"hi"}}',
            {"type": "result", "tool": "echo_external", "result": {"echo": "hi"}},
        ),
    ]:
        out = subprocess.run(
            f"echo '{line}' | ./examples/mcp_echo.sh",
            shell=True,
            capture_output=True,
            cwd=ROOT,
            env=_env(),
            timeout=30,
            check=True,
        ).stdout
        assert json.loads(out) == expected


def test_endpoint_answers_validate_against_the_schemas() -> None:
    answers = ask(
        {"action": "list_tools"},
        {"action": "describe_tool", "tool": "echo_external"},
        {"action": "call_tool", "tool": "echo_external", "arguments": {"message": "x"}},
        {"action": "nope"},
    )
    for answer in answers:
        validate_params("action_response", answer)
    validate_params("tool_descriptor", answers[1]["tool"])
    assert ToolDescriptor.from_dict(answers[1]["tool"]) == ECHO_DESCRIPTOR
    # The result matches the tool's own result_schema, and the arguments its input_schema.
    jsonschema.validate(answers[2]["result"], ECHO["result_schema"])
    jsonschema.validate({"message": "x"}, ECHO["input_schema"])
    assert parse_action_response(answers[0], component="t", action="list_tools") is answers[0]
    assert parse_action_response(answers[1], component="t", tool="echo_external") is answers[1]
    assert parse_action_response(answers[2], component="t", action="call_tool") is answers[2]
    with pytest.raises(ActionError) as info:
        parse_action_response(answers[3], component="t")
    assert (info.value.name, info.value.category) == ("mcp_echo", "usage")


def test_endpoint_files() -> None:
    assert os.access(ECHO_SH, os.X_OK)
    assert ECHO_SH.read_text().splitlines()[0] == "#!/bin/sh"
    assert 'exec python3 "$(dirname "$0")/mcp_echo.py" "$@"' in ECHO_SH.read_text()
    # It stands alone, like a third party's endpoint: standard library only.
    source = ECHO_PY.read_text()
    imports = set(re.findall(r"^(?:from|import)\s+([\w.]+)", source, re.MULTILINE))
    assert imports <= {"__future__", "json", "os", "sys", "typing"}, imports


def test_endpoint_runs_with_python_directly() -> None:
    proc = subprocess.run(
        [sys.executable, str(ECHO_PY)],
        input=b'{"action":"list_tools"}',  # no final newline: still a request
        capture_output=True,
        timeout=30,
    )
    assert proc.returncode == 0
    assert json.loads(proc.stdout) == {"type": "result", "tools": [ECHO]}


# --- the reference endpoint: errors and several requests --------------------------------------


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "request is not valid JSON: Expecting value: line 1 column 1 (char 0)"),
        ('{"action":', "request is not valid JSON: "),
        ('{"x": NaN}', "request is not valid JSON: NaN is not JSON"),
        ("[1]", "request must be a JSON object, got array"),
        ('"list_tools"', "request must be a JSON object, got string"),
        ("{}", "request has no 'action' (one of list_tools, describe_tool, call_tool)"),
        (
            '{"action":"run"}',
            "unknown action 'run' (expected one of list_tools, describe_tool, call_tool)",
        ),
        ('{"action":5}', "unknown action 5 (expected one of list_tools, describe_tool, call_tool)"),
        ('{"action":"describe_tool"}', "describe_tool needs 'tool', a non-empty string"),
        ('{"action":"describe_tool","tool":""}', "describe_tool needs 'tool', a non-empty string"),
        ('{"action":"call_tool","tool":7}', "call_tool needs 'tool', a non-empty string"),
        (
            '{"action":"describe_tool","tool":"nope"}',
            "unknown tool 'nope' (this endpoint has: echo_external)",
        ),
        (
            '{"action":"call_tool","tool":"nope","arguments":{"message":"hi"}}',
            "unknown tool 'nope' (this endpoint has: echo_external)",
        ),
        (
            '{"action":"call_tool","tool":"echo_external","arguments":["hi"]}',
            "call_tool 'arguments' must be a JSON object, got array",
        ),
        (
            '{"action":"call_tool","tool":"echo_external","arguments":"{\\"message\\":\\"hi\\"}"}',
            "call_tool 'arguments' must be a JSON object, got string",
        ),
        ('{"action":"call_tool","tool":"echo_external"}', "echo_external needs 'message', a string"),
        (
            '{"action":"call_tool","tool":"echo_external","arguments":{}}',
            "echo_external needs 'message', a string",
        ),
        (
            '{"action":"call_tool","tool":"echo_external","arguments":{"message":1}}',
            "echo_external 'message' must be a string, got number",
        ),
        (
            '{"action":"call_tool","tool":"echo_external","arguments":{"message":null}}',
            "echo_external 'message' must be a string, got null",
        ),
        (
            '{"action":"call_tool","tool":"echo_external","arguments":{"message":"hi","x":1}}',
            "echo_external: unexpected argument(s) 'x'",
        ),
    ],
)
def test_endpoint_errors(line: str, message: str) -> None:
    (answer,) = ask(line)
    assert answer["type"] == "error"
    assert answer["error"]["name"] == "mcp_echo"
    assert answer["error"]["category"] == "usage"
    assert answer["error"]["message"].startswith(message)
    assert set(answer) == {"type", "error"}
    assert set(answer["error"]) == {"name", "category", "message"}
    validate_params("action_response", answer)


def test_endpoint_invalid_utf8() -> None:
    proc = run_endpoint(b"\xff\xfe\n")
    assert proc.returncode == 0
    answer = json.loads(proc.stdout)
    assert answer["error"]["category"] == "usage"
    assert answer["error"]["message"].startswith("request is not valid JSON: ")


def test_endpoint_several_requests_on_one_stdin() -> None:
    answers = ask(
        {"action": "list_tools"},
        "garbage",
        {"action": "call_tool", "tool": "echo_external", "arguments": {"message": "one"}},
        {"action": "describe_tool", "tool": "echo_external"},
        {"action": "call_tool", "tool": "echo_external", "arguments": {"message": "twø ✓"}},
        {"action": "call_tool", "tool": "echo_external", "arguments": {"message": ""}},
    )
    assert answers == [
        {"type": "result", "tools": [ECHO]},
        usage_error("request is not valid JSON: Expecting value: line 1 column 1 (char 0)"),
        {"type": "result", "tool": "echo_external", "result": {"echo": "one"}},
        {"type": "result", "tool": ECHO},
        {"type": "result", "tool": "echo_external", "result": {"echo": "twø ✓"}},
        {"type": "result", "tool": "echo_external", "result": {"echo": ""}},
    ]


def test_endpoint_skips_blank_lines_and_stops_at_eof() -> None:
    proc = run_endpoint('\n  \n{"action":"list_tools"}\n\n')
    assert proc.returncode == 0
    assert len(proc.stdout.splitlines()) == 1
    assert run_endpoint("").stdout == b""
    assert run_endpoint("").returncode == 0


def test_endpoint_output_is_utf8_whatever_the_locale() -> None:
    env = {**_env(), "LC_ALL": "C", "LANG": "C", "PYTHONIOENCODING": "ascii"}
    proc = subprocess.run(
        [str(ECHO_SH)],
        input='{"action":"call_tool","tool":"echo_external","arguments":{"message":"ø"}}\n'.encode(),
        capture_output=True,
        env=env,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.decode("utf-8"))["result"] == {"echo": "ø"}


def test_endpoint_arguments() -> None:
    proc = run_endpoint("", "--help")
    assert proc.returncode == 0 and b"echo_external" in proc.stdout
    proc = run_endpoint("", "--bogus")
    assert proc.returncode == 2 and b"usage" in proc.stderr


class _Lines:
    """Lines from a pipe, split by the protocol's LineBuffer."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream = stream
        self._buffer = LineBuffer()

    async def read_line(self) -> bytes | None:
        while (line := self._buffer.next_line()) is None:
            self._buffer.feed(await self._stream.receive_some(65536))
        return None if line is END_OF_STREAM else line


async def test_endpoint_answers_each_line_on_a_long_lived_pipe() -> None:
    # The endpoint must answer each request as it arrives, not at EOF.
    proc = await trio.lowlevel.open_process(
        [str(ECHO_SH)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_env()
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        reader = _Lines(proc.stdout)
        with trio.fail_after(20):
            for i in range(3):
                call = {"action": "call_tool", "tool": "echo_external", "arguments": {"message": f"m{i}"}}
                await proc.stdin.send_all(encode(call))
                line = await reader.read_line()
                assert line is not None
                assert decode(line) == {
                    "type": "result",
                    "tool": "echo_external",
                    "result": {"echo": f"m{i}"},
                }
            await proc.stdin.send_all(b'{"action":"list_tools"}\n')
            line = await reader.read_line()
            assert line is not None and decode(line)["tools"][0]["name"] == "echo_external"
            await proc.stdin.aclose()
            assert await reader.read_line() is None
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


# --- docs/TOOLSETS.md ---------------------------------------------------------------------------

_CONSOLE_RE = re.compile(r"```console\n(.*?)```", re.DOTALL)


def _doc_sessions() -> list[tuple[str, str]]:
    """Every `$ command` of the console blocks, with the output shown under it."""
    sessions: list[tuple[str, str]] = []
    for block in _CONSOLE_RE.findall(TOOLSETS_DOC.read_text(encoding="utf-8")):
        for chunk in re.split(r"^\$ ", block, flags=re.MULTILINE)[1:]:
            command, _, output = chunk.partition("\n")
            sessions.append((command, output))
    return sessions


def test_toolsets_doc_shows_the_seed_interactions() -> None:
    text = TOOLSETS_DOC.read_text(encoding="utf-8")
    assert text.startswith("# Toolsets\n")
    assert "## The action contract" in text
    commands = [c for c, _ in _doc_sessions()]
    for line in (
        '{"action":"list_tools"}',
        '{"action":"describe_tool","tool":"echo_external"}',
        '{"action":"call_tool","tool":"echo_external","arguments":{"message":"hi"}}',
    ):
        assert f"echo '{line}' | ./examples/mcp_echo.sh" in commands


@pytest.mark.parametrize(("command", "output"), _doc_sessions())
def test_toolsets_doc_outputs_are_actual(command: str, output: str) -> None:
    proc = subprocess.run(
        command, shell=True, capture_output=True, cwd=ROOT, env=_env(), timeout=30, check=True
    )
    assert proc.stdout.decode() == output


# --- descriptors ------------------------------------------------------------------------------


def test_descriptor_round_trip() -> None:
    data = ECHO_DESCRIPTOR.to_dict()
    assert data == ECHO
    assert list(data) == list(ECHO)
    assert decode(encode(data)) == data
    assert structure(data, ToolDescriptor) == ECHO_DESCRIPTOR
    assert ToolDescriptor.from_dict(data) == ECHO_DESCRIPTOR
    validate_params("tool_descriptor", data)
    assert attrs.has(ToolDescriptor)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        ECHO_DESCRIPTOR.name = "x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        ToolDescriptor("n", "d", "c", "remote", "s", {}, {})  # type: ignore[misc]  # kw_only


def test_descriptor_ignores_unknown_members() -> None:
    assert ToolDescriptor.from_dict({**ECHO, "version": 2}) == ECHO_DESCRIPTOR


@pytest.mark.parametrize(
    ("change", "path", "fragment"),
    [
        ({"origin": "elsewhere"}, "$.origin", "is not one of"),
        ({"origin": None}, "$.origin", "is not one of"),
        ({"name": ""}, "$.name", "non-empty"),
        ({"name": 1}, "$.name", "not of type 'string'"),
        ({"input_schema": []}, "$.input_schema", "not of type 'object'"),
        ({"result_schema": "object"}, "$.result_schema", "not of type 'object'"),
        ({"safety": None}, "$.safety", "not of type 'string'"),
        ({"command": None}, "$.command", "not of type 'string'"),
    ],
)
def test_descriptor_schema_refuses(change: dict[str, Any], path: str, fragment: str) -> None:
    bad = {**ECHO, **change}
    with pytest.raises(RelayError) as info:
        ToolDescriptor.from_dict(bad)
    assert info.value.code == INVALID_PARAMS
    assert info.value.data == {"path": path}
    assert str(info.value).startswith("invalid tool descriptor at ")
    assert fragment in str(info.value)


@pytest.mark.parametrize("missing", list(ECHO))
def test_descriptor_every_member_is_required(missing: str) -> None:
    bad = {k: v for k, v in ECHO.items() if k != missing}
    with pytest.raises(RelayError, match=f"'{missing}' is a required property"):
        validate_params("tool_descriptor", bad)
    with pytest.raises(RelayError, match=f"'{missing}' is required"):
        structure(bad, ToolDescriptor)


def test_descriptor_structure_is_strict() -> None:
    with pytest.raises(RelayError) as info:
        structure({**ECHO, "input_schema": "{}"}, ToolDescriptor)
    assert str(info.value) == (
        "invalid tool descriptor: 'input_schema' must be an object, got string"
    )


# --- requests ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        ({"action": "list_tools"}, ActionRequest("list_tools")),
        ({"action": "list_tools", "tool": 5, "arguments": []}, ActionRequest("list_tools")),
        ({"action": "describe_tool", "tool": "echo"}, ActionRequest("describe_tool", "echo")),
        (
            {"action": "describe_tool", "tool": "echo", "arguments": "x"},
            ActionRequest("describe_tool", "echo"),
        ),
        ({"action": "call_tool", "tool": "echo"}, ActionRequest("call_tool", "echo", {})),
        (
            {"action": "call_tool", "tool": "echo", "arguments": None},
            ActionRequest("call_tool", "echo", {}),
        ),
        (
            {"action": "call_tool", "tool": "echo", "arguments": {"message": "hi"}, "x": 1},
            ActionRequest("call_tool", "echo", {"message": "hi"}),
        ),
    ],
)
def test_parse_action_request_accepts(obj: Any, expected: ActionRequest) -> None:
    assert parse_action_request(obj, component="c") == expected
    validate_params("action_request", obj)  # the schema agrees


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        (None, "request must be a JSON object, got null"),
        ([], "request must be a JSON object, got array"),
        ("list_tools", "request must be a JSON object, got string"),
        ({}, "request has no 'action' (one of list_tools, describe_tool, call_tool)"),
        ({"action": None}, "'action' must be a string (one of list_tools, describe_tool, call_tool), got null"),
        ({"action": 1}, "'action' must be a string (one of list_tools, describe_tool, call_tool), got integer"),
        ({"action": "List_Tools"}, "unknown action 'List_Tools' (expected one of list_tools, describe_tool, call_tool)"),
        ({"action": "describe_tool"}, "describe_tool needs 'tool', the name of a tool"),
        ({"action": "describe_tool", "tool": None}, "describe_tool needs 'tool', the name of a tool"),
        ({"action": "describe_tool", "tool": ""}, "describe_tool 'tool' must be a non-empty string, got an empty string"),
        ({"action": "call_tool", "tool": 3}, "call_tool 'tool' must be a non-empty string, got integer"),
        ({"action": "call_tool", "tool": ["echo"]}, "call_tool 'tool' must be a non-empty string, got array"),
        ({"action": "call_tool", "tool": "echo", "arguments": []}, "call_tool 'arguments' must be a JSON object, got array"),
        ({"action": "call_tool", "tool": "echo", "arguments": "{}"}, "call_tool 'arguments' must be a JSON object, got string"),
        ({"action": "call_tool", "tool": "echo", "arguments": 1}, "call_tool 'arguments' must be a JSON object, got integer"),
        ({"action": "call_tool", "tool": "echo", "arguments": True}, "call_tool 'arguments' must be a JSON object, got boolean"),
        ({"action": "call_tool", "tool": "echo", "arguments": [{"message": "hi"}]}, "call_tool 'arguments' must be a JSON object, got array"),
    ],
)
def test_parse_action_request_refuses(obj: Any, message: str) -> None:
    with pytest.raises(ActionError) as info:
        parse_action_request(obj, component="oubliette-client")
    err = info.value
    assert (err.name, err.category, err.message) == ("oubliette-client", "usage", message)
    assert err.envelope() == {
        "type": "error",
        "error": {"name": "oubliette-client", "category": "usage", "message": message},
    }
    # The schema refuses the same requests.
    assert not validator_for("action_request").is_valid(obj)


def test_parse_action_request_copies_arguments() -> None:
    args = {"message": "hi"}
    req = parse_action_request({"action": "call_tool", "tool": "t", "arguments": args}, component="c")
    args["message"] = "changed"
    assert req.arguments == {"message": "hi"}


def test_action_request_to_dict() -> None:
    assert ActionRequest("list_tools").to_dict() == {"action": "list_tools"}
    assert ActionRequest("describe_tool", "t").to_dict() == {"action": "describe_tool", "tool": "t"}
    req = ActionRequest("call_tool", "t", {"a": 1})
    assert req.to_dict() == {"action": "call_tool", "tool": "t", "arguments": {"a": 1}}
    assert parse_action_request(req.to_dict(), component="c") == req
    assert ActionRequest("call_tool", tool="t") == ActionRequest("call_tool", "t", None)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        req.tool = "u"  # type: ignore[misc]


def test_parse_action_line() -> None:
    assert parse_action_line('{"action":"list_tools"}', component="c") == ActionRequest("list_tools")
    assert parse_action_line(b'{"action":"describe_tool","tool":"t"}\n', component="c") == (
        ActionRequest("describe_tool", "t")
    )
    for line, start in [
        ("", "request is not valid JSON: Expecting value"),
        ("{", "request is not valid JSON: "),
        ('{"action":"list_tools"} x', "request is not valid JSON: Extra data"),
        ('{"action":"call_tool","tool":"t","arguments":{"n":NaN}}', "request is not valid JSON: NaN is not JSON"),
        (b"\xff", "request is not valid JSON: "),
        ("[]", "request must be a JSON object, got array"),
        ('{"action":"call_tool","tool":"t","arguments":[1]}', "call_tool 'arguments' must be a JSON object"),
    ]:
        with pytest.raises(ActionError) as info:
            parse_action_line(line, component="comp")
        assert (info.value.name, info.value.category) == ("comp", "usage")
        assert info.value.message.startswith(start), info.value.message


def test_the_action_schema_accepts_exactly_the_actions() -> None:
    assert SCHEMAS["action_request"]["properties"]["action"]["enum"] == list(ACTIONS)


# --- responses --------------------------------------------------------------------------------


def test_response_builders() -> None:
    assert list_tools_response([ECHO_DESCRIPTOR]) == {"type": "result", "tools": [ECHO]}
    assert list_tools_response([]) == {"type": "result", "tools": []}
    assert list_tools_response([ECHO]) == {"type": "result", "tools": [ECHO]}  # dicts too
    assert describe_tool_response(ECHO_DESCRIPTOR) == {"type": "result", "tool": ECHO}
    assert call_tool_response("echo_external", {"echo": "hi"}) == {
        "type": "result",
        "tool": "echo_external",
        "result": {"echo": "hi"},
    }
    assert call_tool_response("t", None) == {"type": "result", "tool": "t", "result": None}
    for built in (
        list_tools_response([ECHO_DESCRIPTOR]),
        describe_tool_response(ECHO_DESCRIPTOR),
        call_tool_response("t", [1, 2]),
    ):
        validate_params("action_response", built)
        assert parse_action_response(decode(encode(built)), component="c") == built
    with pytest.raises(TypeError):
        list_tools_response(["echo"])  # type: ignore[list-item]


def test_parse_action_response_returns_good_ones() -> None:
    listed = {"type": "result", "tools": [ECHO, {**ECHO, "name": "other", "origin": "local"}]}
    assert parse_action_response(listed, component="c") is listed
    assert parse_action_response({"type": "result", "tools": []}, component="c", action="list_tools")
    described = {"type": "result", "tool": ECHO}
    assert parse_action_response(described, component="c", action="describe_tool", tool="echo_external")
    called = {"type": "result", "tool": "echo_external", "result": {"echo": "hi"}, "extra": 1}
    assert parse_action_response(called, component="c", action="call_tool", tool="echo_external")
    for result in (None, 1, "s", [1], {"stdout": "x", "exit_code": 0}):
        obj = {"type": "result", "tool": "t", "result": result}
        assert parse_action_response(obj, component="c") is obj
        validate_params("action_response", obj)


def test_parse_action_response_raises_the_endpoints_own_error() -> None:
    envelope = {"type": "error", "error": {"name": "mcp_echo", "category": "usage", "message": "bad"}}
    with pytest.raises(ActionError) as info:
        parse_action_response(envelope, component="oubliette-client")
    assert (info.value.name, info.value.category, info.value.message) == ("mcp_echo", "usage", "bad")
    assert info.value.envelope() == envelope
    other = {"type": "error", "error": {"name": "x", "category": "quota", "message": "slow down"}}
    with pytest.raises(ActionError) as info:
        parse_action_response(other, component="c", action="call_tool")
    assert info.value.category == "quota"  # unknown categories pass through
    with pytest.raises(ActionError, match="^bad$"):
        parse_action_response_line(json.dumps(envelope), component="c")


@pytest.mark.parametrize(
    ("obj", "kwargs", "message"),
    [
        (None, {}, "response is not a JSON object (got null)"),
        ([ECHO], {}, "response is not a JSON object (got array)"),
        ({}, {}, "response 'type' must be \"result\" or \"error\", got missing"),
        ({"type": "ok", "tools": []}, {}, "response 'type' must be \"result\" or \"error\", got 'ok'"),
        ({"type": "error"}, {}, "error response has no 'error' object"),
        ({"type": "error", "error": "boom"}, {}, "error response has no 'error' object"),
        ({"type": "error", "error": {"name": "n", "message": "m"}}, {}, "error response's 'error.category' must be a string"),
        ({"type": "error", "error": {"name": "n", "category": "c", "message": 1}}, {}, "error response's 'error.message' must be a string"),
        ({"type": "result"}, {}, "result response has none of 'tools', 'tool' (a descriptor) or 'result'"),
        ({"type": "result", "tool": "t"}, {}, "result response has none of 'tools', 'tool' (a descriptor) or 'result'"),
        ({"type": "result", "tools": {}}, {}, "list_tools response 'tools' must be an array, got object"),
        ({"type": "result", "tools": [ECHO, {**ECHO, "origin": "mars"}]}, {}, "response 'tools[1]'.origin is not a valid tool descriptor: 'mars' is not one of ['local', 'remote']"),
        ({"type": "result", "tools": ["echo_external"]}, {}, "response 'tools[0]' is not a valid tool descriptor: 'echo_external' is not of type 'object'"),
        ({"type": "result", "tool": {"name": "echo_external"}}, {}, "response 'tool' is not a valid tool descriptor: "),
        ({"type": "result", "tool": ECHO}, {"action": "list_tools"}, "list_tools response 'tools' must be an array, got null"),
        ({"type": "result", "tools": [ECHO]}, {"action": "describe_tool"}, "describe_tool response has no 'tool'"),
        ({"type": "result", "tool": "echo_external"}, {"action": "describe_tool"}, "response 'tool' is not a valid tool descriptor: 'echo_external' is not of type 'object'"),
        ({"type": "result", "tool": ECHO}, {"tool": "other"}, "describe_tool response is about 'echo_external', not 'other'"),
        ({"type": "result", "tool": "t"}, {"action": "call_tool"}, "call_tool response has no 'result'"),
        ({"type": "result", "tool": "", "result": 1}, {}, "call_tool response 'tool' must be a non-empty string"),
        ({"type": "result", "result": 1}, {}, "call_tool response 'tool' must be a non-empty string"),
        ({"type": "result", "tool": "a", "result": 1}, {"tool": "b"}, "call_tool response is about 'a', not 'b'"),
    ],
)
def test_parse_action_response_refuses_malformed(obj: Any, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ActionError) as info:
        parse_action_response(obj, component="oubliette-server", **kwargs)
    err = info.value
    assert (err.name, err.category) == ("oubliette-server", "pipeline")
    assert err.message.startswith(message), err.message
    if not kwargs:  # without expectations, the schema refuses the same responses
        assert not validator_for("action_response").is_valid(obj)


def test_parse_action_response_line() -> None:
    assert parse_action_response_line('{"type":"result","tool":"t","result":{}}\n', component="c") == {
        "type": "result",
        "tool": "t",
        "result": {},
    }
    for line in ("", "usage: mcp_echo …", b"\xff", '{"type":"result","tool":"t","result":NaN}'):
        with pytest.raises(ActionError) as info:
            parse_action_response_line(line, component="c")
        assert (info.value.name, info.value.category) == ("c", "pipeline")
        assert info.value.message.startswith("response is not valid JSON: ")
    with pytest.raises(ValueError):
        parse_action_response({}, component="c", action="run")


# --- ActionError --------------------------------------------------------------------------------


def test_action_error() -> None:
    err = ActionError("mcp_echo", "tool", "disk full")
    assert isinstance(err, Exception)
    assert str(err) == "disk full"
    assert "mcp_echo" in repr(err) and "tool" in repr(err)
    assert err.envelope() == {
        "type": "error",
        "error": {"name": "mcp_echo", "category": "tool", "message": "disk full"},
    }
    back = pickle.loads(pickle.dumps(err))
    assert (back.name, back.category, back.message) == ("mcp_echo", "tool", "disk full")
    assert copy.copy(err).envelope() == err.envelope()
    validate_params("action_response", err.envelope())


def test_action_error_relay_mapping() -> None:
    relay = ActionError("e", "not_found", "no tool 'x'").to_relay_error()
    assert (relay.code, relay.message, relay.data) == (
        NOT_FOUND,
        "no tool 'x'",
        {"name": "e", "category": "not_found"},
    )
    assert ActionError("e", "usage", "m").to_relay_error().code == TOOL_ERROR
    assert ActionError("e", "tool", "m").to_relay_error().code == TOOL_ERROR
    # The one category table (protocol.errors), as the endpoint emits it: a timeout is "timeout".
    for code, category in [
        (NOT_FOUND, "not_found"),
        (TOOL_ERROR, "tool"),
        (TIMEOUT, "timeout"),
        (PEER_DISCONNECTED, "unavailable"),
        (INVALID_PARAMS, "usage"),
        (-32603, "tool"),
        (-1, "tool"),
    ]:
        err = ActionError.from_relay_error(RelayError(code, "text"), component="oubliette-client")
        assert (err.name, err.category, err.message) == ("oubliette-client", category, "text")


# --- the action schemas --------------------------------------------------------------------------


def test_action_schemas_are_valid() -> None:
    for name in ("tool_descriptor", "action_request", "action_response"):
        jsonschema.Draft202012Validator.check_schema(SCHEMAS[name])
        assert SCHEMAS[name]["$schema"] == "https://json-schema.org/draft/2020-12/schema"


def test_action_response_schema_error_envelope() -> None:
    good = {"type": "error", "error": {"name": "n", "category": "c", "message": "m"}}
    validate_params("action_response", good)
    for bad in (
        {"type": "error", "error": {"name": "n", "category": "c"}},
        {"type": "error"},
        {"type": "error", "error": {"name": 1, "category": "c", "message": "m"}},
        {"type": "result", "error": good["error"]},
    ):
        assert not validator_for("action_response").is_valid(bad), bad


# --- toolset relay messages ------------------------------------------------------------------------

CONFIG = ToolsetsConfig(
    tools=[
        ToolsetToolSpec(
            name="ext.echo_external",
            toolset="ext",
            tool="echo_external",
            description=ECHO["description"],
            inputSchema=ECHO["input_schema"],
            descriptor=ECHO_DESCRIPTOR,
        ),
        ToolsetToolSpec(name="fs.read_file", toolset="files", tool="read_file"),
    ]
)


def test_toolsets_config_round_trip_through_the_wire() -> None:
    wire = decode(encode(notification(TOOLSETS_CONFIG, CONFIG)))
    msg = parse_message(wire)
    assert isinstance(msg, Notification) and msg.method == "toolsets_config"
    assert msg.params["tools"][0]["descriptor"] == ECHO
    assert "descriptor" not in msg.params["tools"][1]  # None is left out
    assert msg.params["separator"] == "."
    assert parse_params(msg.method, msg.params) == CONFIG
    empty = parse_params(TOOLSETS_CONFIG, {"tools": []})
    assert empty == ToolsetsConfig(tools=[]) and empty.separator == "."
    assert parse_params(TOOLSETS_CONFIG, {"tools": [], "separator": "_"}).separator == "_"


def test_toolset_call_round_trip_through_the_wire() -> None:
    call = ToolsetCall(name="ext.echo_external", arguments={"message": "hi"})
    msg = parse_message(decode(encode(request(8, TOOLSET_CALL, call))))
    assert isinstance(msg, Request) and msg.method == "toolset_call"
    assert parse_params(msg.method, msg.params) == call
    assert parse_params(TOOLSET_CALL, {"name": "p.t"}) == ToolsetCall(name="p.t")
    for result in (
        ToolsetCallResult(result={"echo": "hi"}),
        ToolsetCallResult(result={"a": 1}, content=[{"type": "text", "text": "{\"a\": 1}"}]),
        ToolsetCallResult(content=[{"type": "text", "text": "plain"}]),
        ToolsetCallResult(),
    ):
        resp = parse_message(decode(encode(result_response(8, result))))
        assert isinstance(resp, Response) and not resp.is_error
        validate_params("toolset_call_result", resp.result)
        assert structure(resp.result, ToolsetCallResult) == result


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        ({"arguments": {}}, "'name' is a required property"),
        ({"name": "p.t", "arguments": []}, "$.arguments"),
        ({"name": 5}, "$.name"),
    ],
)
def test_toolset_call_params_refused(params: dict[str, Any], fragment: str) -> None:
    with pytest.raises(RelayError) as info:
        parse_params(TOOLSET_CALL, params)
    assert info.value.code == INVALID_PARAMS
    assert fragment in str(info.value)


def test_toolsets_config_params_refused() -> None:
    for params in (
        {},
        {"tools": {}},
        {"tools": [{"name": "p.t", "toolset": "p"}]},
        {"tools": [{"name": "p.t", "toolset": "p", "tool": "t", "descriptor": {"name": "t"}}]},
        {"tools": [], "separator": ""},
    ):
        with pytest.raises(RelayError) as info:
            parse_params(TOOLSETS_CONFIG, params)
        assert info.value.code == INVALID_PARAMS


def test_caller_tool_spec_result_schema() -> None:
    spec = protocol.CallerToolSpec(name="t", resultSchema={"type": "object", "required": ["ok"]})
    data = unstructure(spec)
    assert data["resultSchema"] == {"type": "object", "required": ["ok"]}
    assert structure(data, protocol.CallerToolSpec) == spec
    assert "resultSchema" not in unstructure(protocol.CallerToolSpec(name="t"))
    assert structure({"name": "t", "resultSchema": None}, protocol.CallerToolSpec).resultSchema is None
    validate_params("caller_tool_spec", data)
    with pytest.raises(RelayError):
        validate_params("caller_tool_spec", {"name": "t", "resultSchema": "object"})


# --- the one descriptor builder -------------------------------------------------------------------


def test_build_descriptor_fills_the_defaults_and_makes_a_valid_descriptor() -> None:
    built = protocol.build_descriptor(
        "ext.echo", description="Echo", safety="runs on the host", input_schema={"type": "object"},
    )
    assert isinstance(built, ToolDescriptor)
    assert built.to_dict() == {
        "name": "ext.echo", "description": "Echo",
        "command": "oubliette-client tools call ext.echo '<arguments as JSON>'",
        "origin": "remote", "safety": "runs on the host",
        "input_schema": {"type": "object"}, "result_schema": {},
    }
    validate_params("tool_descriptor", built.to_dict())
    assert ToolDescriptor.from_dict(built.to_dict()) == built
    local = protocol.build_descriptor(
        "tether_read", description="d", safety="read-only", input_schema={}, result_schema={"type": "object"},
        origin="local", command="tools/call tether_read",
    )
    assert (local.origin, local.command, local.result_schema) == ("local", "tools/call tether_read", {"type": "object"})
    with pytest.raises(ValueError):
        protocol.build_descriptor("t", description="", safety="", input_schema={}, origin="mars")
