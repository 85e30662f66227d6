"""Tests of the relay wire protocol package (`protocol/`)."""

from __future__ import annotations

import copy
import json
import pickle
import re
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

import protocol
from protocol import (
    ACK,
    APPEND_FRAME,
    APPEND_ID_FEATURE,
    CALLER_TOOL,
    CALLER_TOOLS_CONFIG,
    CANCEL,
    ERROR_NAMES,
    HELLO,
    INVALID_PARAMS,
    INVALID_REQUEST,
    MAX_FRAME_BYTES,
    METHOD_NOT_FOUND,
    PARAMS_TYPES,
    PARSE_ERROR,
    PROTOCOL_VERSION,
    RESULT_TYPES,
    SCHEMAS,
    TIMEOUT,
    TOOLSET_CALL,
    TOOLSETS_CONFIG,
    USER_MESSAGE,
    Ack,
    AppendFrame,
    AppendFrameResult,
    CallerToolCall,
    CallerToolResult,
    CallerToolsConfig,
    CallerToolSpec,
    Cancel,
    Frame,
    FrameTooLarge,
    Hello,
    HelloResult,
    END_OF_STREAM,
    LineBuffer,
    Notification,
    RelayError,
    Request,
    Response,
    SessionRef,
    ToolDescriptor,
    ToolsetCall,
    ToolsetCallResult,
    ToolsetsConfig,
    UnavailableToolset,
    ToolsetToolSpec,
    UserMessageDelivery,
    build_valid,
    decode,
    encode,
    error_response,
    notification,
    parse_message,
    parse_params,
    request,
    result_response,
    structure,
    unstructure,
    utc_timestamp,
    validate_params,
)
from protocol import schema_parts
from protocol.schemas import validator_for
from protocol.framing import RECEIVE_CHUNK_BYTES

DOCS = Path(__file__).resolve().parents[2] / "docs" / "PROTOCOL.md"


# --- helpers ------------------------------------------------------------------------------


def _frame(**over: Any) -> Frame:
    fields: dict[str, Any] = dict(
        v=1,
        seq=12,
        ts="2026-11-22T10:00:00.123Z",
        instance="box1",
        session=SessionRef(channel="mcp", id="s-4f2a"),
        type="user.message",
        msg_id="m-1",
        payload={"text": "hi"},
    )
    fields.update(over)
    return Frame(**fields)


class ChunkedStream(trio.abc.ReceiveStream):
    """Yields the given chunks one per receive_some, then EOF; counts what was read."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = list(chunks)
        self.bytes_read = 0
        self.calls = 0

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        self.calls += 1
        if not self.chunks:
            return b""
        chunk = self.chunks.pop(0)
        if max_bytes is not None and len(chunk) > max_bytes:
            self.chunks.insert(0, chunk[max_bytes:])
            chunk = chunk[:max_bytes]
        self.bytes_read += len(chunk)
        return chunk

    async def aclose(self) -> None:
        pass


class EndlessStream(trio.abc.ReceiveStream):
    """A peer that sends b"a" forever and never a newline."""

    def __init__(self) -> None:
        self.bytes_read = 0

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        n = max_bytes or 65536
        self.bytes_read += n
        return b"a" * n

    async def aclose(self) -> None:
        pass


ECHO_DESCRIPTOR = ToolDescriptor(
    name="echo_external",
    description="Echo a message back from outside the sandbox",
    command="echo_external --message TEXT",
    origin="remote",
    safety="read-only; no side effects",
    input_schema={
        "type": "object",
        "properties": {"message": {"type": "string"}},
        "required": ["message"],
        "additionalProperties": False,
    },
    result_schema={
        "type": "object",
        "properties": {"echo": {"type": "string"}},
        "required": ["echo"],
    },
)

# A sample instance of every message class, used for round trips.
SAMPLES: dict[str, Any] = {
    "hello": Hello(protocol=PROTOCOL_VERSION, role="client", instance="box1", token="t0k"),
    "hello+session": Hello(
        protocol=PROTOCOL_VERSION, role="guest", instance="box1", token="t", session="s-1"
    ),
    "hello_result": HelloResult(
        protocol=PROTOCOL_VERSION, server_version="0.1.0", instance="box1", session="s-1"
    ),
    "hello_result-features": HelloResult(
        protocol=PROTOCOL_VERSION, server_version="0.1.0", instance="box1", features=[APPEND_ID_FEATURE]
    ),
    "caller_tool_spec": CallerToolSpec(
        name="get_weather",
        description="Weather",
        inputSchema={"type": "object", "properties": {"city": {"type": "string"}}},
        requires_approval=True,
        timeout_ms=5000,
    ),
    "caller_tools_config": CallerToolsConfig(
        session_id="s-1",
        caller_id="myapp",
        tools=[CallerToolSpec(name="a"), CallerToolSpec(name="b", timeout_ms=10)],
    ),
    "caller_tool_spec-result_schema": CallerToolSpec(
        name="get_weather",
        resultSchema={"type": "object", "required": ["temp_c"]},
    ),
    "caller_tools_config-empty": CallerToolsConfig(session_id="s-1", caller_id="c", tools=[]),
    "caller_tool": CallerToolCall(tool="get_weather", arguments={"city": "Oslo"}, caller_id="c"),
    "caller_tool-minimal": CallerToolCall(tool="x"),
    "caller_tool_result": CallerToolResult(result={"temp_c": 4, "list": [1, None, "x"]}),
    "caller_tool_result-null": CallerToolResult(result=None),
    "cancel-int": Cancel(id=7),
    "cancel-str": Cancel(id="req-7"),
    "user_message": UserMessageDelivery(frame=_frame()),
    "ack": Ack(seq=12),
    "append_frame": AppendFrame(
        session=SessionRef(channel="host", id="default"),
        type="assistant.delta",
        payload={"text": "hello"},
        reply_to="m-1",
    ),
    "append_frame-append_id": AppendFrame(
        session=SessionRef(channel="mcp", id="s"), type="status.presence", append_id="0f3a-b_9",
    ),
    "append_frame-minimal": AppendFrame(
        session=SessionRef(channel="mcp", id="s"), type="status.presence"
    ),
    "append_frame_result": AppendFrameResult(seq=13, msg_id="m-2"),
    "frame": _frame(reply_to="m-0", type="caller_tool_request"),
    "session_ref": SessionRef(channel="mcp", id="s-4f2a"),
    "tool_descriptor": ECHO_DESCRIPTOR,
    "toolset_tool_spec": ToolsetToolSpec(
        name="ext.echo_external",
        toolset="ext",
        tool="echo_external",
        description="Echo",
        inputSchema=ECHO_DESCRIPTOR.input_schema,
        descriptor=ECHO_DESCRIPTOR,
    ),
    "toolset_tool_spec-minimal": ToolsetToolSpec(name="fs_read", toolset="files", tool="read"),
    "toolsets_config": ToolsetsConfig(
        tools=[
            ToolsetToolSpec(name="ext_echo_external", toolset="ext", tool="echo_external"),
            ToolsetToolSpec(
                name="fs_read", toolset="files", tool="read", descriptor=ECHO_DESCRIPTOR
            ),
        ],
        separator="_",
    ),
    "toolsets_config-empty": ToolsetsConfig(tools=[]),
    "unavailable_toolset": UnavailableToolset(toolset="time", prefix="time", reason="it exited"),
    "toolsets_config+unavailable": ToolsetsConfig(
        tools=[], unavailable=[UnavailableToolset(toolset="time", prefix="time", reason="MCP toolset 'time' could not start")],
    ),
    "toolset_call": ToolsetCall(name="ext.echo_external", arguments={"message": "hi"}),
    "toolset_call-minimal": ToolsetCall(name="ext.list"),
    "toolset_call_result": ToolsetCallResult(result={"echo": "hi"}),
    "toolset_call_result-content": ToolsetCallResult(
        result=[1, "two"], content=[{"type": "text", "text": "[1, \"two\"]"}]
    ),
    "toolset_call_result-empty": ToolsetCallResult(),
    "toolset_tool_spec-gated": ToolsetToolSpec(name="fs.rm", toolset="files", tool="rm", approval_timeout_ms=600000),
    "toolset_call-progress": ToolsetCall(name="ext.list", progress_ref="p-3"),
    "caller_tool-progress": CallerToolCall(tool="x", progress_ref="p-1"),
    "approval": protocol.AgentApproval(
        tool_name="Bash", arguments={"command": "ls"}, tool_use_id="toolu_01", progress_ref="p-2",
    ),
    "approval-minimal": protocol.AgentApproval(tool_name="Edit"),
    "approval_result": protocol.AgentApprovalResult(approve=True, updated_arguments={"command": "ls -l"}),
    "approval_result-deny": protocol.AgentApprovalResult(approve=False, reason="not on this host"),
    "progress": protocol.Progress(ref="p-1", progress=0.5, total=1.0, message="halfway"),
    "progress-minimal": protocol.Progress(ref="p-1", progress=3),
}


# --- errors -------------------------------------------------------------------------------


def test_error_codes_and_names() -> None:
    assert protocol.PARSE_ERROR == -32700
    assert protocol.INVALID_REQUEST == -32600
    assert protocol.METHOD_NOT_FOUND == -32601
    assert protocol.INVALID_PARAMS == -32602
    assert protocol.INTERNAL_ERROR == -32603
    assert protocol.TIMEOUT == -32001
    assert protocol.PEER_DISCONNECTED == -32002
    assert protocol.CANCELLED == -32003
    assert protocol.TOOL_ERROR == -32004
    assert protocol.NOT_FOUND == -32005
    assert protocol.UNAUTHORIZED == -32006
    assert protocol.DENIED == -32007
    assert ERROR_NAMES[TIMEOUT] == "timeout"
    assert len(ERROR_NAMES) == 12
    assert len(set(ERROR_NAMES.values())) == 12


def test_relay_error_dict_round_trip() -> None:
    err = RelayError(TIMEOUT, "too slow", {"after_ms": 5})
    assert str(err) == "too slow"
    assert err.name == "timeout"
    assert err.to_dict() == {"code": -32001, "message": "too slow", "data": {"after_ms": 5}}
    back = RelayError.from_dict(err.to_dict())
    assert (back.code, back.message, back.data) == (TIMEOUT, "too slow", {"after_ms": 5})
    assert RelayError(TIMEOUT, "x").to_dict() == {"code": -32001, "message": "x"}
    assert RelayError(-1, "x").name == "error"
    assert "too slow" in repr(err)


def test_relay_error_from_dict_rejects_bad_shapes() -> None:
    for bad in ({}, {"code": "1", "message": "m"}, {"code": True, "message": "m"}, {"code": 1}):
        with pytest.raises(ValueError):
            RelayError.from_dict(bad)


def test_relay_errors_pickle() -> None:
    err = pickle.loads(pickle.dumps(RelayError(TIMEOUT, "m", [1])))
    assert (err.code, err.message, err.data) == (TIMEOUT, "m", [1])
    big = pickle.loads(pickle.dumps(FrameTooLarge(10)))
    assert isinstance(big, FrameTooLarge) and big.limit == 10 and big.code == INVALID_REQUEST


# --- encode / decode --------------------------------------------------------------------


def test_encode_is_compact_utf8_line() -> None:
    data = encode({"a": [1, 2], "b": "ø✓"})
    assert data == '{"a":[1,2],"b":"ø✓"}\n'.encode()
    assert data.count(b"\n") == 1  # newlines inside strings are escaped
    assert encode({"s": "x\ny"}).count(b"\n") == 1


def test_encode_decode_round_trip() -> None:
    msg = {"jsonrpc": "2.0", "id": 1, "method": "m", "params": {"x": [None, True, 1.5, "é"]}}
    assert decode(encode(msg)) == msg
    assert decode(encode(msg).rstrip(b"\n")) == msg


def test_encode_refuses_nan() -> None:
    with pytest.raises(ValueError):
        encode({"x": float("nan")})


@pytest.mark.parametrize(
    "line",
    [b"", b"not json", b"{", b'{"a":1}x', b"\xff\xfe{}", b'{"x":NaN}', b'{"x":Infinity}'],
)
def test_decode_parse_errors(line: bytes) -> None:
    with pytest.raises(RelayError) as info:
        decode(line)
    assert info.value.code == PARSE_ERROR
    assert str(info.value).startswith("frame is not valid JSON: ")


@pytest.mark.parametrize("line", [b"[]", b"1", b'"s"', b"null", b"true", b"[{}]"])
def test_decode_non_object(line: bytes) -> None:
    with pytest.raises(RelayError) as info:
        decode(line)
    assert info.value.code == INVALID_REQUEST
    assert str(info.value) == "frame is not a JSON object"


# --- LineBuffer over streams ------------------------------------------------------------------


class LineReader:
    """The read side of the relay peer in miniature: receive_some only while the buffer needs data."""

    def __init__(self, stream: trio.abc.ReceiveStream, max_bytes: int = MAX_FRAME_BYTES) -> None:
        self._stream = stream
        self._lines = LineBuffer(max_bytes)

    async def read_line(self) -> bytes | None:
        while (line := self._lines.next_line()) is None:
            self._lines.feed(await self._stream.receive_some(RECEIVE_CHUNK_BYTES))
        return None if line is END_OF_STREAM else line


async def _read_all(reader: LineReader) -> list[bytes]:
    lines = []
    while (line := await reader.read_line()) is not None:
        lines.append(line)
    return lines


async def test_line_reader_lines_split_across_chunks() -> None:
    stream = ChunkedStream([b'{"a":', b"1}\n{", b'"b"', b":2}", b"\n"])
    assert await _read_all(LineReader(stream)) == [b'{"a":1}', b'{"b":2}']


async def test_line_reader_many_lines_per_chunk() -> None:
    payload = b"".join(b"line%d\n" % i for i in range(1000))
    reader = LineReader(ChunkedStream([payload]))
    assert await _read_all(reader) == [b"line%d" % i for i in range(1000)]


async def test_line_reader_byte_by_byte() -> None:
    data = b"ab\n\ncd\n"
    reader = LineReader(ChunkedStream([bytes([b]) for b in data]))
    assert await _read_all(reader) == [b"ab", b"", b"cd"]


async def test_line_reader_eof_behaviour() -> None:
    assert await LineReader(ChunkedStream([])).read_line() is None
    reader = LineReader(ChunkedStream([b"a\npartial"]))
    assert await reader.read_line() == b"a"
    assert await reader.read_line() == b"partial"
    assert await reader.read_line() is None
    assert await reader.read_line() is None  # stays at EOF


async def test_line_reader_over_memory_stream() -> None:
    send, recv = trio.testing.memory_stream_one_way_pair()
    reader = LineReader(recv)
    msgs = [{"jsonrpc": "2.0", "method": "ack", "params": {"seq": i}} for i in range(50)]
    async with trio.open_nursery() as nursery:

        async def writer() -> None:
            for m in msgs:
                await send.send_all(encode(m))
            await send.aclose()

        nursery.start_soon(writer)
        got = [decode(line) for line in await _read_all(reader)]
    assert got == msgs


async def test_line_reader_over_socket_pair() -> None:
    a, b = trio.socket.socketpair()
    left, right = trio.SocketStream(a), trio.SocketStream(b)
    async with left, right:
        reader = LineReader(right)
        big = {"blob": "x" * 300_000}
        async with trio.open_nursery() as nursery:

            async def produce() -> None:
                await left.send_all(encode({"n": 1}))
                await left.send_all(encode(big))
                await left.send_all(encode({"n": 2}))
                await left.aclose()

            nursery.start_soon(produce)
            got = [decode(line) for line in await _read_all(reader)]
    assert got == [{"n": 1}, big, {"n": 2}]


async def test_line_reader_limit_is_exclusive_of_newline() -> None:
    reader = LineReader(ChunkedStream([b"12345\n", b"123456\n"]), max_bytes=5)
    assert await reader.read_line() == b"12345"
    with pytest.raises(FrameTooLarge):
        await reader.read_line()


async def test_line_reader_oversized_partial_line_at_eof() -> None:
    reader = LineReader(ChunkedStream([b"123456"]), max_bytes=5)
    with pytest.raises(FrameTooLarge):
        await reader.read_line()


async def test_line_reader_oversized_raises_without_reading_everything() -> None:
    stream = EndlessStream()
    reader = LineReader(stream)
    with pytest.raises(FrameTooLarge) as info:
        await reader.read_line()
    err = info.value
    assert isinstance(err, RelayError)
    assert err.code == INVALID_REQUEST
    assert str(MAX_FRAME_BYTES) in str(err)
    # Stopped within one chunk of the limit rather than buffering forever.
    assert MAX_FRAME_BYTES < stream.bytes_read <= MAX_FRAME_BYTES + RECEIVE_CHUNK_BYTES
    # The reader stays failed: the framing is lost.
    with pytest.raises(FrameTooLarge):
        await reader.read_line()


async def test_line_reader_oversized_line_after_good_lines_in_one_chunk() -> None:
    stream = ChunkedStream([b"ok\n" + b"y" * 100 + b"\nnever"])
    reader = LineReader(stream, max_bytes=10)
    assert await reader.read_line() == b"ok"
    with pytest.raises(FrameTooLarge) as info:
        await reader.read_line()
    assert "10 bytes" in str(info.value)


async def test_line_reader_oversized_over_memory_stream_stops_early() -> None:
    send, recv = trio.testing.memory_stream_one_way_pair()
    reader = LineReader(recv, max_bytes=1000)
    sent = 0
    caught: list[BaseException] = []

    async def flood() -> None:
        nonlocal sent
        while True:  # a peer that never sends a newline
            await send.send_all(b"z" * 100)
            sent += 100
            await trio.sleep(0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(flood)
        try:
            await reader.read_line()
        except FrameTooLarge as exc:
            caught.append(exc)
        nursery.cancel_scope.cancel()
    assert len(caught) == 1
    assert sent < 100_000


# --- envelope ------------------------------------------------------------------------------


def test_parse_valid_messages() -> None:
    assert parse_message({"jsonrpc": "2.0", "id": 1, "method": "m", "params": {"a": 1}}) == (
        Request(1, "m", {"a": 1})
    )
    assert parse_message({"jsonrpc": "2.0", "id": "x", "method": "m"}) == Request("x", "m", {})
    assert parse_message({"jsonrpc": "2.0", "method": "n"}) == Notification("n", {})
    assert parse_message({"jsonrpc": "2.0", "id": 1, "result": None}) == Response(1, None)
    resp = parse_message(
        {"jsonrpc": "2.0", "id": None, "error": {"code": -32001, "message": "t", "data": 1}}
    )
    assert isinstance(resp, Response) and resp.is_error and resp.id is None
    assert resp.error is not None
    assert (resp.error.code, resp.error.message, resp.error.data) == (-32001, "t", 1)
    # Unknown extra members are tolerated.
    assert parse_message({"jsonrpc": "2.0", "method": "n", "x-ext": 1}) == Notification("n", {})


@pytest.mark.parametrize(
    ("obj", "fragment"),
    [
        ([], "not a JSON object"),
        ({"id": 1, "method": "m"}, "'jsonrpc'"),
        ({"jsonrpc": "1.0", "id": 1, "method": "m"}, "'jsonrpc' must be \"2.0\""),
        ({"jsonrpc": 2.0, "id": 1, "method": "m"}, "'jsonrpc' must be \"2.0\""),
        ({"jsonrpc": "2.0", "id": 1, "method": 5}, "'method' must be a non-empty string"),
        ({"jsonrpc": "2.0", "id": 1, "method": ""}, "'method' must be a non-empty string"),
        ({"jsonrpc": "2.0", "id": 1.5, "method": "m"}, "'id' of 'm' must be"),
        ({"jsonrpc": "2.0", "id": True, "method": "m"}, "'id' of 'm' must be"),
        ({"jsonrpc": "2.0", "id": None, "method": "m"}, "'id' of 'm' must be"),
        ({"jsonrpc": "2.0", "id": [1], "method": "m"}, "'id' of 'm' must be"),
        ({"jsonrpc": "2.0", "id": 1, "method": "m", "params": [1]}, "'params' of 'm' must be an object"),
        ({"jsonrpc": "2.0", "method": "m", "params": "x"}, "'params' of 'm' must be an object"),
        ({"jsonrpc": "2.0", "method": "m", "params": None}, "'params' of 'm' must be an object"),
        ({"jsonrpc": "2.0", "id": 1, "method": "m", "result": 1}, "must not carry 'result'"),
        ({"jsonrpc": "2.0", "id": 1}, "neither 'method' nor"),
        ({"jsonrpc": "2.0"}, "neither 'method' nor"),
        ({"jsonrpc": "2.0", "id": 1, "result": 1, "error": {"code": 1, "message": "m"}}, "both"),
        ({"jsonrpc": "2.0", "result": 1}, "must carry 'id'"),
        ({"jsonrpc": "2.0", "id": None, "result": 1}, "result response must be"),
        ({"jsonrpc": "2.0", "id": 1.0, "result": 1}, "result response must be"),
        ({"jsonrpc": "2.0", "id": {}, "error": {"code": 1, "message": "m"}}, "error response must be"),
        ({"jsonrpc": "2.0", "id": 1, "error": "boom"}, "'error' must be an object"),
        ({"jsonrpc": "2.0", "id": 1, "error": {"message": "m"}}, "'error.code' must be an integer"),
        ({"jsonrpc": "2.0", "id": 1, "error": {"code": "1", "message": "m"}}, "'error.code'"),
        ({"jsonrpc": "2.0", "id": 1, "error": {"code": False, "message": "m"}}, "'error.code'"),
        ({"jsonrpc": "2.0", "id": 1, "error": {"code": 1}}, "'error.message' must be a string"),
        ({"jsonrpc": "2.0", "id": 1, "error": {"code": 1, "message": 2}}, "'error.message'"),
    ],
)
def test_parse_message_rejects(obj: Any, fragment: str) -> None:
    with pytest.raises(RelayError) as info:
        parse_message(obj)
    assert info.value.code == INVALID_REQUEST
    assert fragment in str(info.value)


def test_builders() -> None:
    assert request(1, "m", {"a": 1}) == {"jsonrpc": "2.0", "id": 1, "method": "m", "params": {"a": 1}}
    assert request("r", "m") == {"jsonrpc": "2.0", "id": "r", "method": "m", "params": {}}
    assert notification("n", {"b": 2}) == {"jsonrpc": "2.0", "method": "n", "params": {"b": 2}}
    assert result_response(3, [1]) == {"jsonrpc": "2.0", "id": 3, "result": [1]}
    assert result_response(3, None) == {"jsonrpc": "2.0", "id": 3, "result": None}
    assert error_response(None, RelayError(TIMEOUT, "t")) == {
        "jsonrpc": "2.0",
        "id": None,
        "error": {"code": -32001, "message": "t"},
    }
    # attrs instances are unstructured.
    assert notification(ACK, Ack(seq=3))["params"] == {"seq": 3}
    assert result_response(1, AppendFrameResult(seq=1, msg_id="m"))["result"] == {
        "seq": 1,
        "msg_id": "m",
    }
    with pytest.raises(TypeError):
        request(1, "m", [1, 2])


def test_builders_parse_back() -> None:
    for wire in (
        request(1, CALLER_TOOL, CallerToolCall(tool="t")),
        notification(CANCEL, Cancel(id=1)),
        result_response(1, {"ok": True}),
        error_response(1, RelayError(INVALID_PARAMS, "bad", {"path": "$"})),
    ):
        msg = parse_message(decode(encode(wire)))
        assert isinstance(msg, (Request, Notification, Response))
    resp = parse_message(error_response(9, RelayError(INVALID_PARAMS, "bad", {"path": "$"})))
    assert isinstance(resp, Response) and resp.error is not None
    assert resp.error.to_dict() == {"code": INVALID_PARAMS, "message": "bad", "data": {"path": "$"}}


# --- messages ------------------------------------------------------------------------------


def test_every_method_has_a_params_type_and_only_requests_have_result_types() -> None:
    """The method tables agree: every method is structured on arrival, and notifications expect no result."""
    assert set(PARAMS_TYPES) == set(protocol.METHODS)
    assert set(RESULT_TYPES) <= set(PARAMS_TYPES)
    for method in (CALLER_TOOLS_CONFIG, CANCEL, TOOLSETS_CONFIG):
        assert method not in RESULT_TYPES


def test_defaults() -> None:
    spec = CallerToolSpec(name="t")
    assert spec.inputSchema == {"type": "object"}
    assert spec.inputSchema is not CallerToolSpec(name="u").inputSchema  # factory, not shared
    assert (spec.description, spec.requires_approval, spec.timeout_ms) == ("", False, None)
    assert CallerToolCall(tool="t").arguments == {}
    assert CallerToolCall(tool="t").caller_id is None
    assert _frame(payload={}).reply_to is None
    assert AppendFrame(session=SessionRef(channel="a", id="b"), type="t").payload == {}
    assert spec.resultSchema is None
    tspec = ToolsetToolSpec(name="p.t", toolset="p", tool="t")
    assert (tspec.description, tspec.inputSchema, tspec.descriptor) == ("", {"type": "object"}, None)
    assert tspec.inputSchema is not ToolsetToolSpec(name="p.u", toolset="p", tool="u").inputSchema
    assert ToolsetsConfig(tools=[]).separator == "."
    assert ToolsetCall(name="p.t").arguments == {}
    assert ToolsetCall(name="p.t").arguments is not ToolsetCall(name="p.u").arguments
    assert (ToolsetCallResult().result, ToolsetCallResult().content) == (None, None)


def test_messages_are_frozen() -> None:
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        Ack(seq=1).seq = 2  # type: ignore[misc]


def test_session_ref_keys() -> None:
    ref = SessionRef(channel="mcp", id="s-1")
    assert ref.key == "mcp:s-1" == str(ref)
    assert SessionRef.parse_key("mcp:s-1") == ref
    assert SessionRef.parse_key("s-1") == ref
    assert SessionRef.parse_key("telegram:123:456") == SessionRef(channel="telegram", id="123:456")
    for bad in ("", ":x", "host:"):
        with pytest.raises(ValueError):
            SessionRef.parse_key(bad)


def test_utc_timestamp() -> None:
    pattern = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$")
    assert pattern.match(utc_timestamp())
    when = datetime(2026, 11, 22, 10, 0, 0, 123456, tzinfo=timezone.utc)
    assert utc_timestamp(when) == "2026-11-22T10:00:00.123Z"
    plus_two = when.astimezone(timezone(timedelta(hours=2)))
    assert utc_timestamp(plus_two) == "2026-11-22T10:00:00.123Z"
    assert utc_timestamp(datetime(2026, 1, 2, 3, 4, 5)) == "2026-01-02T03:04:05.000Z"
    validate_params("frame", unstructure(_frame(ts=utc_timestamp())))


# --- conversion ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_round_trip_every_message_class(name: str) -> None:
    obj = SAMPLES[name]
    data = unstructure(obj)
    wire = decode(encode(data))  # survives real JSON
    assert wire == data
    validate_params(name.split("-")[0].split("+")[0], wire)  # and matches its schema
    assert structure(wire, type(obj)) == obj


def test_every_message_class_has_a_sample() -> None:
    classes = {type(v) for v in SAMPLES.values()}
    module_classes = {
        v for v in vars(protocol.messages).values() if isinstance(v, type) and attrs.has(v)
    }
    assert module_classes == classes


def test_unstructure_omits_optional_none_only() -> None:
    assert unstructure(CallerToolCall(tool="t")) == {"tool": "t", "arguments": {}}
    assert unstructure(_frame(payload={"k": None}))["payload"] == {"k": None}
    assert "reply_to" not in unstructure(_frame())
    assert unstructure(CallerToolResult(result=None)) == {"result": None}
    assert unstructure(CallerToolSpec(name="t")) == {
        "name": "t",
        "description": "",
        "inputSchema": {"type": "object"},
        "requires_approval": False,
    }
    assert unstructure(CallerToolSpec(name="t", resultSchema={"type": "object"}))[
        "resultSchema"
    ] == {"type": "object"}
    assert unstructure(ToolsetToolSpec(name="p.t", toolset="p", tool="t")) == {
        "name": "p.t",
        "toolset": "p",
        "tool": "t",
        "description": "",
        "inputSchema": {"type": "object"},
    }
    assert unstructure(ToolsetsConfig(tools=[])) == {"tools": [], "separator": "."}
    assert unstructure(ToolsetCallResult()) == {}
    assert unstructure(ToolsetCallResult(result={"a": 1})) == {"result": {"a": 1}}
    assert structure({}, ToolsetCallResult) == ToolsetCallResult()
    assert structure({"result": None, "content": None}, ToolsetCallResult) == ToolsetCallResult()
    assert ECHO_DESCRIPTOR.to_dict() == unstructure(ECHO_DESCRIPTOR)
    assert list(ECHO_DESCRIPTOR.to_dict()) == [
        "name",
        "description",
        "command",
        "origin",
        "safety",
        "input_schema",
        "result_schema",
    ]


def test_structure_tolerates_unknown_keys_and_null_optionals() -> None:
    call = structure({"tool": "t", "future": 1, "caller_id": None}, CallerToolCall)
    assert call == CallerToolCall(tool="t")
    frame = structure({**unstructure(_frame()), "x": {"y": 1}}, Frame)
    assert frame == _frame()


def test_structure_copies_dicts() -> None:
    args = {"a": 1}
    call = structure({"tool": "t", "arguments": args}, CallerToolCall)
    args["a"] = 2
    assert call.arguments == {"a": 1}


@pytest.mark.parametrize(
    ("data", "cls", "expected"),
    [
        ({}, CallerToolCall, "invalid caller_tool params: 'tool' is required"),
        ({"tool": 1}, CallerToolCall, "invalid caller_tool params: 'tool' must be a string, got integer"),
        (
            {"tool": "t", "arguments": []},
            CallerToolCall,
            "invalid caller_tool params: 'arguments' must be an object, got array",
        ),
        ([], CallerToolCall, "invalid caller_tool params: must be an object, got array"),
        (None, Ack, "invalid ack params: must be an object, got null"),
        ({"seq": "5"}, Ack, "invalid ack params: 'seq' must be an integer, got string"),
        ({"seq": 5.0}, Ack, "invalid ack params: 'seq' must be an integer, got number"),
        ({"seq": True}, Ack, "invalid ack params: 'seq' must be an integer, got boolean"),
        ({"id": None}, Cancel, "invalid cancel params: 'id' must be an integer or a string, got null"),
        ({"id": False}, Cancel, "'id' must be an integer or a string, got boolean"),
        (
            {"protocol": "p", "role": "client", "instance": "i", "token": "t", "session": 3},
            Hello,
            "invalid hello params: 'session' must be a string or null, got integer",
        ),
        (
            {"name": "t", "requires_approval": "yes"},
            CallerToolSpec,
            "'requires_approval' must be a boolean, got string",
        ),
        (
            {"session_id": "s", "caller_id": "c", "tools": {"name": "t"}},
            CallerToolsConfig,
            "invalid caller_tools_config params: 'tools' must be an array, got object",
        ),
        (
            {"session_id": "s", "caller_id": "c", "tools": [{"name": "a"}, {}, 3]},
            CallerToolsConfig,
            "invalid caller_tools_config params: 'tools[1].name' is required; "
            "'tools[2]' must be an object, got integer",
        ),
        (
            {"frame": {**unstructure(_frame()), "session": "mcp:s"}},
            UserMessageDelivery,
            "invalid user_message params: 'frame.session' must be an object, got string",
        ),
        (
            {"frame": {k: v for k, v in unstructure(_frame()).items() if k != "seq"}},
            UserMessageDelivery,
            "invalid user_message params: 'frame.seq' is required",
        ),
        (
            {"session": {"channel": "mcp"}, "type": "t"},
            AppendFrame,
            "invalid append_frame params: 'session.id' is required",
        ),
        ({"seq": 1}, AppendFrameResult, "invalid append_frame result: 'msg_id' is required"),
        ({}, CallerToolResult, "invalid caller_tool result: 'result' is required"),
        ({"channel": 1, "id": "x"}, SessionRef, "invalid session: 'channel' must be a string"),
        (
            {"name": "t", "resultSchema": []},
            CallerToolSpec,
            "invalid caller tool spec: 'resultSchema' must be an object or null, got array",
        ),
        ({"tools": [{"name": "p.t", "tool": "t"}]}, ToolsetsConfig, "'tools[0].toolset' is required"),
        (
            {"tools": [], "separator": 1},
            ToolsetsConfig,
            "invalid toolsets_config params: 'separator' must be a string, got integer",
        ),
        (
            {"name": "p.t", "toolset": "p", "tool": "t", "descriptor": "echo"},
            ToolsetToolSpec,
            "invalid toolset tool spec: 'descriptor' must be an object or null, got string",
        ),
        (
            {"name": "p.t", "toolset": "p", "tool": "t", "descriptor": {"name": "echo"}},
            ToolsetToolSpec,
            "'descriptor.command' is required",
        ),
        ({}, ToolsetCall, "invalid toolset_call params: 'name' is required"),
        (
            {"name": "p.t", "arguments": "{}"},
            ToolsetCall,
            "invalid toolset_call params: 'arguments' must be an object, got string",
        ),
        (
            {"content": {"type": "text"}},
            ToolsetCallResult,
            "invalid toolset_call result: 'content' must be an array or null, got object",
        ),
        ({"content": ["x"]}, ToolsetCallResult, "'content[0]' must be an object, got string"),
        ({"name": "echo"}, ToolDescriptor, "invalid tool descriptor: 'description' is required"),
        (
            {**unstructure(ECHO_DESCRIPTOR), "input_schema": True},
            ToolDescriptor,
            "invalid tool descriptor: 'input_schema' must be an object, got boolean",
        ),
    ],
)
def test_structure_errors_are_clear(data: Any, cls: type, expected: str) -> None:
    with pytest.raises(RelayError) as info:
        structure(data, cls)
    assert info.value.code == INVALID_PARAMS
    assert expected in str(info.value)
    assert info.value.data["errors"]


def test_structure_custom_label() -> None:
    with pytest.raises(RelayError, match=r"^invalid my thing: 'seq' is required$"):
        structure({}, Ack, what="my thing")


def test_structure_reports_every_problem() -> None:
    with pytest.raises(RelayError) as info:
        structure({"protocol": 1, "role": 2}, Hello)
    problems = info.value.data["errors"]
    assert len(problems) == 4
    assert "'protocol' must be a string, got integer" in problems
    assert "'instance' is required" in problems


# --- schemas -------------------------------------------------------------------------------


def test_schemas_cover_every_method_and_are_valid() -> None:
    import jsonschema

    for name in (
        *protocol.METHODS,
        "frame",
        "hello_result",
        "toolset_call_result",
        "tool_descriptor",
        "action_request",
        "action_response",
    ):
        assert name in SCHEMAS
    for name, schema in SCHEMAS.items():
        assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
        jsonschema.Draft202012Validator.check_schema(schema)


def test_schemas_defaults_match_classes() -> None:
    # Every required property in a schema is a field without default in its class, and
    # every class field is described by the schema.
    pairs = {**{m: c for m, c in PARAMS_TYPES.items()}, "frame": Frame, "hello_result": HelloResult}
    pairs.update(
        caller_tool_result=CallerToolResult,
        append_frame_result=AppendFrameResult,
        caller_tool_spec=CallerToolSpec,
        session_ref=SessionRef,
        toolset_tool_spec=ToolsetToolSpec,
        unavailable_toolset=UnavailableToolset,
        toolset_call_result=ToolsetCallResult,
        approval_result=protocol.AgentApprovalResult,
        tool_descriptor=ToolDescriptor,
        action_request=protocol.ActionRequest,
    )
    # action_response is a union of shapes with no class (tests/protocol/test_descriptors.py covers it).
    assert set(pairs) | {"action_response"} == set(SCHEMAS)
    for name, cls in pairs.items():
        fields = attrs.fields(cls)
        required = {f.name for f in fields if f.default is attrs.NOTHING}
        assert set(SCHEMAS[name]["required"]) == required, name
        assert set(SCHEMAS[name]["properties"]) == {f.name for f in fields}, name


# The shapes whose schema is derived from a class (all but the action contract's two unions).
DERIVED: dict[str, type[Any]] = {
    **PARAMS_TYPES, **{f"{method}_result": cls for method, cls in RESULT_TYPES.items()},
    "frame": Frame, "session_ref": SessionRef, "caller_tool_spec": CallerToolSpec, "toolset_tool_spec": ToolsetToolSpec,
    "unavailable_toolset": UnavailableToolset, "tool_descriptor": ToolDescriptor,
}


def near(tp: Any) -> Any:
    """Values shaped like a field of type `tp`, mostly: the right JSON type around its bounds
    three times in four, else another JSON type or null; an attrs class as an object with its
    required members (or, once in a while, any of its members) and an unknown one."""
    import types
    import typing

    from hypothesis import strategies as st

    others = st.one_of(st.none(), st.booleans(), st.integers(-2, 2), st.sampled_from([1.0, 0.5, -1.5]),
                       st.sampled_from(["", "x", "a b", "client", "local", "mcp"]), st.just([]), st.just({}))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return st.one_of([near(arg) for arg in typing.get_args(tp)])
    if attrs.has(tp):
        hints = typing.get_type_hints(tp)
        required = {f.name: near(hints[f.name]) for f in attrs.fields(tp) if f.default is attrs.NOTHING}
        optional = {f.name: near(hints[f.name]) for f in attrs.fields(tp) if f.default is not attrs.NOTHING}
        right = st.one_of(
            st.fixed_dictionaries(required, optional={**optional, "unknown": st.just(1)}),
            st.fixed_dictionaries({}, optional={**required, **optional}),
        )
    elif typing.get_origin(tp) is list:
        right = st.lists(near(typing.get_args(tp)[0]), max_size=3)
    elif tp in (str, int, float, bool, type(None)):
        right = {
            str: st.one_of(st.sampled_from(["", "client", "guest", "local", "remote", "has space", "a" * 65, "a" * 129,
                                            "0f3a-b_9", "a/b", "2026-11-22T10:00:00.123Z", "mcp", "s-1\n"]),
                           st.text(max_size=4)),
            int: st.sampled_from([-1, 0, 1, 2**40, True]),
            float: st.sampled_from([0, 1, 0.5, -2.5, True]),
            bool: st.booleans(),
            type(None): st.none(),
        }[tp]
    else:  # a JSON object or any JSON value
        right = st.dictionaries(st.sampled_from(["a", "type", "x"]), st.integers(0, 3), max_size=2)
    return st.one_of(right, right, right, others)


def test_the_schemas_reject_what_the_converter_rejects_and_build_what_it_builds() -> None:
    """Each derived schema is at least as strict as the strict converter (a value the converter
    refuses, the schema refuses), and a value the schema accepts is built by `build_valid`, with no
    second check, into exactly what `structure` makes of it: the relay's one check is enough."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(data=st.data())
    def check(data: Any) -> None:
        name = data.draw(st.sampled_from(sorted(DERIVED)))
        cls = DERIVED[name]
        value = data.draw(near(cls))
        accepted = validator_for(name).is_valid(value)
        try:
            strict = structure(value, cls)
        except RelayError:
            assert not accepted, (name, value)
            return
        if accepted:
            assert build_valid(value, cls) == strict, (name, value)

    check()


def test_the_schemas_are_derived_from_the_classes() -> None:
    """A bound written on a field is in the published schema; a type it does not narrow is refused."""
    assert SCHEMAS[ACK]["properties"]["seq"] == {"type": "integer", "minimum": 0}
    assert SCHEMAS["caller_tool_spec"]["properties"]["timeout_ms"] == {"type": "integer", "minimum": 1}
    assert SCHEMAS[CALLER_TOOL]["properties"]["progress_ref"] == {
        "type": ["string", "null"], "minLength": 1, "maxLength": 128}
    assert SCHEMAS["toolset_tool_spec"]["properties"]["descriptor"]["oneOf"][0] == {"type": "null"}

    @attrs.define
    class Widening:
        count: int | None = schema_parts.bounded({"type": "string"}, default=None)

    with pytest.raises(TypeError, match="widens"):
        schema_parts.schema_of(Widening)


@pytest.mark.parametrize(
    ("method", "params", "path", "fragment"),
    [
        (HELLO, {"protocol": "p", "role": "admin", "instance": "i", "token": "t"}, "$.role", "is not one of"),
        (HELLO, {"protocol": "p", "role": "client", "token": "t"}, "$", "'instance' is a required property"),
        (HELLO, {"protocol": "p", "role": "client", "instance": "", "token": "t"}, "$.instance", "non-empty"),
        (ACK, {"seq": -1}, "$.seq", "minimum"),
        (ACK, {"seq": 1.0}, "$.seq", "not of type 'integer'"),
        (ACK, {"seq": True}, "$.seq", "not of type 'integer'"),
        (CANCEL, {"id": None}, "$.id", "not of type"),
        (CALLER_TOOL, {"tool": "t", "arguments": "x"}, "$.arguments", "not of type 'object'"),
        (
            CALLER_TOOLS_CONFIG,
            {"session_id": "s", "caller_id": "c", "tools": [{"name": "a", "timeout_ms": 0}]},
            "$.tools[0].timeout_ms",
            "minimum",
        ),
        (
            USER_MESSAGE,
            {"frame": {**unstructure(_frame()), "ts": "yesterday"}},
            "$.frame.ts",
            "does not match",
        ),
        (APPEND_FRAME, {"session": {"channel": "mcp", "id": "s"}}, "$", "'type' is a required property"),
        (APPEND_FRAME, {"session": {"channel": "mcp", "id": "s"}, "type": "t", "append_id": "a" * 65}, "$.append_id",
         "does not match"),
        (APPEND_FRAME, {"session": {"channel": "mcp", "id": "s"}, "type": "t", "append_id": "a/b"}, "$.append_id",
         "does not match"),
        (APPEND_FRAME, {"session": {"channel": "mcp", "id": "s"}, "type": "t", "append_id": 7}, "$.append_id",
         "not of type"),
        ("hello_result", {"protocol": "p", "server_version": "1", "instance": "i", "features": "append_id"},
         "$.features", "not of type 'array'"),
        ("frame", {**unstructure(_frame()), "payload": []}, "$.payload", "not of type 'object'"),
        ("hello_result", {"protocol": "p", "instance": "i"}, "$", "'server_version'"),
        (
            CALLER_TOOLS_CONFIG,
            {"session_id": "s", "caller_id": "c", "tools": [{"name": "a", "resultSchema": "x"}]},
            "$.tools[0].resultSchema",
            "not of type",
        ),
        (TOOLSETS_CONFIG, {}, "$", "'tools' is a required property"),
        (TOOLSETS_CONFIG, {"tools": [], "separator": ""}, "$.separator", "non-empty"),
        (
            TOOLSETS_CONFIG,
            {"tools": [{"name": "p.t", "toolset": "p", "tool": ""}]},
            "$.tools[0].tool",
            "non-empty",
        ),
        (
            TOOLSETS_CONFIG,
            {"tools": [{"name": "p.t", "toolset": "p", "tool": "t", "inputSchema": []}]},
            "$.tools[0].inputSchema",
            "not of type 'object'",
        ),
        (
            TOOLSETS_CONFIG,
            {
                "tools": [
                    {
                        "name": "p.t",
                        "toolset": "p",
                        "tool": "t",
                        "descriptor": {**unstructure(ECHO_DESCRIPTOR), "origin": "mars"},
                    }
                ]
            },
            "$.tools[0].descriptor.origin",
            "is not one of",
        ),
        (TOOLSET_CALL, {"arguments": {}}, "$", "'name' is a required property"),
        (TOOLSET_CALL, {"name": ""}, "$.name", "non-empty"),
        (TOOLSET_CALL, {"name": "p.t", "arguments": [1]}, "$.arguments", "not of type 'object'"),
        ("toolset_call_result", {"content": [1]}, "$.content[0]", "not of type 'object'"),
        ("toolset_call_result", [], "$", "not of type 'object'"),
        (
            "tool_descriptor",
            {**unstructure(ECHO_DESCRIPTOR), "origin": "mars"},
            "$.origin",
            "is not one of",
        ),
        (
            "tool_descriptor",
            {k: v for k, v in unstructure(ECHO_DESCRIPTOR).items() if k != "safety"},
            "$",
            "'safety' is a required property",
        ),
    ],
)
def test_validate_params_errors(method: str, params: Any, path: str, fragment: str) -> None:
    with pytest.raises(RelayError) as info:
        validate_params(method, params)
    err = info.value
    assert err.code == INVALID_PARAMS
    assert err.data == {"path": path}
    assert path in str(err) and fragment in str(err)
    assert str(err).startswith("invalid ")


def test_validate_params_unknown_method() -> None:
    with pytest.raises(RelayError) as info:
        validate_params("nope", {})
    assert info.value.code == METHOD_NOT_FOUND


def test_validate_params_truncates_huge_values() -> None:
    with pytest.raises(RelayError) as info:
        validate_params(ACK, {"seq": "x" * 10_000})
    assert len(str(info.value)) < 400


def test_parse_params() -> None:
    assert parse_params(ACK, {"seq": 4}) == Ack(seq=4)
    with pytest.raises(RelayError) as info:
        parse_params(ACK, {"seq": "4"})
    assert info.value.code == INVALID_PARAMS
    with pytest.raises(RelayError) as info:
        parse_params("unknown", {})
    assert info.value.code == METHOD_NOT_FOUND


def test_samples_do_not_mutate() -> None:
    before = copy.deepcopy(unstructure(SAMPLES["user_message"]))
    data = unstructure(SAMPLES["user_message"])
    data["frame"]["payload"]["text"] = "changed"
    assert unstructure(SAMPLES["user_message"]) == before


# --- docs ----------------------------------------------------------------------------------

_EXAMPLE_RE = re.compile(r"<!-- example: ([^>]*?) -->\s*```json\n(.*?)```", re.DOTALL)


def _doc_examples() -> list[tuple[str, str]]:
    return _EXAMPLE_RE.findall(DOCS.read_text(encoding="utf-8"))


def test_every_docs_json_block_is_checked() -> None:
    text = DOCS.read_text(encoding="utf-8")
    assert text.count("```json") == len(_doc_examples()) > 15


@pytest.mark.parametrize(("kind", "body"), _doc_examples())
def test_docs_examples_validate(kind: str, body: str) -> None:
    obj = json.loads(body)
    words = kind.split()
    if words[0] != "message":
        validate_params(words[0], obj)
        structure(obj, {"frame": Frame, "hello_result": HelloResult}[words[0]])
        return
    assert len(encode(obj)) <= MAX_FRAME_BYTES
    assert body.strip() == encode(obj).decode().strip(), "examples are shown as on the wire"
    msg = parse_message(obj)
    if isinstance(msg, (Request, Notification)):
        parse_params(msg.method, msg.params)
    elif msg.error is not None:
        assert msg.error.code in ERROR_NAMES
    else:
        opts = dict(w.split("=", 1) for w in words[1:])
        result_schema = opts["result"]
        validate_params(result_schema, msg.result)
        method = result_schema.removesuffix("_result")
        structure(msg.result, RESULT_TYPES[method])


# --- package hygiene -------------------------------------------------------------------------


def test_public_names_exist() -> None:
    for name in protocol.__all__:
        assert hasattr(protocol, name), name


def test_lazy_export_table_matches_each_modules_all() -> None:
    """protocol/__init__ imports a module on first use of one of its names, from a table: the table
    must list exactly each module's `__all__`, and every name must come from its own module."""
    import importlib

    for module_name, names in protocol._EXPORTS.items():
        module = importlib.import_module(f"protocol.{module_name}")
        assert tuple(module.__all__) == names, module_name
        for name in names:
            assert getattr(protocol, name) is getattr(module, name), name
    assert len(protocol.__all__) == len(set(protocol.__all__))


def test_importing_the_package_loads_no_layer_and_no_jsonschema() -> None:
    """Cold start: `import protocol` alone imports none of its modules, and the models a
    client needs before answering `initialize` do not import jsonschema (it loads on first check)."""
    code = (
        "import sys, protocol\n"
        "assert not [m for m in sys.modules if m.startswith('protocol.')], sorted(sys.modules)\n"
        "from protocol import CallerToolSpec, RelayError, build_descriptor, errors, messages\n"
        "from protocol.schema_check import compile_schema\n"
        "assert 'jsonschema' not in sys.modules\n"
        "assert 'protocol.peer' not in sys.modules and 'protocol.core' not in sys.modules\n"
        "compile_schema({'type': 'object'})\n"
        "assert 'jsonschema' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_protocol_imports_neither_program() -> None:
    pattern = re.compile(r"^\s*(from|import)\s+oubliette_(server|client)\b", re.MULTILINE)
    for path in Path(protocol.__file__).parent.glob("*.py"):
        assert not pattern.search(path.read_text(encoding="utf-8")), path


# --- the frame model's views and the ingress schema --------------------------------------------


def test_frame_to_wire_is_the_schema_shape_and_round_trips() -> None:
    frame = _frame(reply_to="m-0", payload={"text": "hi", "n": None})
    wire = frame.to_wire()
    assert wire == {
        "v": 1, "seq": 12, "ts": "2026-11-22T10:00:00.123Z", "instance": "box1",
        "session": {"channel": "mcp", "id": "s-4f2a"}, "type": "user.message", "msg_id": "m-1",
        "reply_to": "m-0", "payload": {"text": "hi", "n": None},
    }
    validate_params("frame", wire)
    assert structure(decode(encode(wire)), Frame) == frame
    assert "reply_to" not in _frame().to_wire()
    assert (frame.channel, frame.session_id) == ("mcp", "s-4f2a")


def test_frame_to_event_flattens_payload_under_frame_fields() -> None:
    frame = _frame(
        type="caller_tool_request", reply_to="m-0",
        payload={"request_id": "r1", "tool": "lookup", "arguments": {"q": 1}, "type": "spoofed", "seq": -1},
    )
    assert frame.to_event() == {
        "request_id": "r1", "tool": "lookup", "arguments": {"q": 1},
        "type": "caller_tool_request", "seq": 12, "ts": "2026-11-22T10:00:00.123Z", "instance": "box1",
        "channel": "mcp", "session_id": "s-4f2a", "msg_id": "m-1", "reply_to": "m-0",
    }
    assert "reply_to" not in _frame().to_event()
    assert frame.payload["type"] == "spoofed"  # the frame itself is untouched


def _ingress_problem(body: Any) -> str | None:
    from protocol.schema_check import compile_schema, first_problem

    return first_problem(compile_schema(protocol.INGRESS_SCHEMA), body, "invalid frame")


def test_ingress_schema_accepts_what_a_producer_may_send() -> None:
    good = {
        "v": 1, "type": "user.message", "session": {"channel": "host", "id": "job-7:a@b"},
        "payload": {"text": "hi"}, "msg_id": "m-x", "reply_to": "m-y",
    }
    assert _ingress_problem(good) is None
    assert _ingress_problem({"type": "status.presence", "session": {"channel": "c", "id": "s"}}) is None
    # Once the server adds what it assigns, an accepted ingress body is a valid frame.
    stored = {"msg_id": "m-1", **good, "seq": 1, "ts": utc_timestamp(), "instance": "box1"}
    validate_params("frame", stored)


@pytest.mark.parametrize(
    "change",
    [
        {"v": 2},
        {"type": "User Message"},
        {"type": ""},
        {"session": {"channel": "has space", "id": "s"}},
        {"session": {"channel": "c", "id": "x" * 129}},
        {"session": {"channel": "c"}},
        {"msg_id": ""},
        {"msg_id": "m" * 129},
        {"reply_to": None},
        {"payload": []},
        {"session": None},
    ],
)
def test_ingress_schema_refuses_what_the_frame_schema_narrows(change: dict[str, Any]) -> None:
    body = {"type": "user.message", "session": {"channel": "host", "id": "s"}, **change}
    problem = _ingress_problem(body)
    assert problem is not None and problem.startswith("invalid frame"), body


def test_caller_tool_spec_schema_is_the_strict_one() -> None:
    # The relay and the caller-facing session_message check the same spec (one schema).
    validate_params("caller_tool_spec", {"name": "lookup", "timeout_ms": 5, "resultSchema": None})
    for bad in ({"name": "has space"}, {"name": "x" * 129}, {"name": "t", "timeout_ms": None},
                {"name": "t", "timeout_ms": 0}, {"name": "t", "resultSchema": []}):
        with pytest.raises(RelayError) as info:
            validate_params("caller_tool_spec", bad)
        assert info.value.code == INVALID_PARAMS, bad
    with pytest.raises(RelayError):
        validate_params(CALLER_TOOLS_CONFIG, {"session_id": "s", "caller_id": "bad id", "tools": []})


def test_one_error_category_table() -> None:
    from protocol.errors import error_category

    assert RelayError(TIMEOUT, "slow").category == error_category(TIMEOUT) == "timeout"
    assert error_category(INVALID_PARAMS) == "usage"
    assert error_category(-1) == "tool"


def test_the_version_is_the_distributions() -> None:
    """`protocol.VERSION` (both programs' `--version`, `hello`, `serverInfo`) is pyproject's version."""
    from importlib import metadata

    assert protocol.VERSION == metadata.version("oubliette-relay")


# --- what the programs send --------------------------------------------------------------------


async def test_the_schemas_accept_every_message_the_programs_send(deployment: Any) -> None:
    """The real programs, a relay socket between them that records every line: the server, the
    guest runtime and the demo agent's oubliette-client, through a gated caller tool's whole turn.
    Every request's and notification's params, and every result, match the derived schema."""
    from harness import DEMO_AGENT, structured, text_of

    proxy = deployment.root / "recording.sock"
    lines: list[tuple[int, str, bytes]] = []  # (connection, who sent it, the line)
    acked = trio.Event()  # the guest acknowledges the turn's message once the turn has ended

    async def pump(source: trio.SocketStream, sink: trio.SocketStream, connection: int, who: str) -> None:
        buffer = b""
        while data := await source.receive_some(65536):
            await sink.send_all(data)
            buffer += data
            *whole, buffer = buffer.split(b"\n")
            lines.extend((connection, who, line) for line in whole)
            if any(json.loads(line).get("method") == ACK for line in whole):
                acked.set()
        await sink.send_eof()

    async def relay_through(stream: trio.SocketStream) -> None:
        connection = id(stream)
        async with stream, await trio.open_unix_socket(str(deployment.socket)) as server:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pump, stream, server, connection, "sandbox")
                nursery.start_soon(pump, server, stream, connection, "server")

    spec = {"name": "delete_file", "inputSchema": {"type": "object", "properties": {"path": {"type": "string"}}},
            "requires_approval": True, "timeout_ms": 30_000}
    async with deployment.caller() as (caller, _), trio.open_nursery() as nursery:
        sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        await sock.bind(str(proxy))
        sock.listen()
        listener = trio.SocketListener(sock)
        nursery.start_soon(trio.serve_listeners, relay_through, [listener])
        async with deployment.guest("box1", DEMO_AGENT, relay=f"unix:{proxy}"):
            with trio.fail_after(60):
                turn = structured(await caller.call_tool("session_message", {
                    "instance": "box1", "session_id": "s-wire", "context": {"caller_id": "myapp", "caller_tools": [spec]},
                    "message": 'Please call myapp_delete_file {"path": "/tmp/x"}', "wait": 60}))
                [asked] = turn["approval_requests"]
                acting = structured(await caller.call_tool("approval_response", {
                    "session_id": "s-wire", "request_id": asked["request_id"], "approve": True, "wait": 60}))
                [relayed] = acting["pending"]
                done = await caller.call_tool("caller_tool_response", {
                    "session_id": "s-wire", "request_id": relayed["request_id"], "result": {"deleted": True}, "wait": 60})
            assert structured(done)["stop_reason"] == "end_turn", text_of(done)
            with trio.fail_after(60):
                await acked.wait()
        nursery.cancel_scope.cancel()

    asked_for: dict[tuple[int, str, Any], str] = {}
    seen: set[str] = set()
    for connection, who, line in lines:
        message = json.loads(line)
        if "method" in message:
            validate_params(message["method"], message.get("params", {}))
            seen.add(message["method"])
            if "id" in message:
                asked_for[connection, who, message["id"]] = message["method"]
        elif "result" in message:
            answering = "server" if who == "sandbox" else "sandbox"
            method = asked_for[connection, answering, message["id"]]
            validate_params(f"{method}_result", message["result"])
            seen.add(f"{method}_result")
    assert {HELLO, "hello_result", CALLER_TOOLS_CONFIG, TOOLSETS_CONFIG, CALLER_TOOL, "caller_tool_result",
            USER_MESSAGE, ACK, APPEND_FRAME, "append_frame_result"} <= seen, seen

