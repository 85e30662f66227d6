"""The one relay peer: its sans-IO core (no sockets, no trio), the Trio peer over memory
streams, and the server end to end with a sandbox that stops reading.

- Core: bytes in, events out, at every split; frames over the limit; garbage; late,
  duplicate and unknown responses; a first message that is not `hello`; the role table.
- Peer: two peers on `memory_stream_pair()`; a `lockstep_stream_pair()` whose far side never
  reads for the write deadline and the full queue; request deadlines and `cancel`; an
  inbound `cancel` that cancels exactly one request; bursts of answers (timeouts, refusals)
  that all reach a reading peer, and a peer that reads none of them cut off by the deadline. `MockClock(autojump_threshold=0)`
  makes the deadlines instant.
- End to end: a stalled sandbox connection does not delay another caller's
  `session_message` or `register_toolset`, and is closed after the write deadline.
"""

from __future__ import annotations

import json
import select
import socket
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import pytest
import trio
import trio.testing

from harness import EVENT_TIMEOUT, Deployment
from task_steps import counted_steps
from oubliette_runtime.state_changes import StateChanges
from protocol.framing import LineBuffer
from protocol.peer import _Outgoing
from protocol import (
    CANCELLED,
    INTERNAL_ERROR,
    INVALID_PARAMS,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    PARSE_ERROR,
    PEER_DISCONNECTED,
    PROTOCOL_VERSION,
    TIMEOUT,
    ConnectionClosed,
    FrameTooLarge,
    HandlerEntry,
    LocalProtocolError,
    NEED_DATA,
    NotificationReceived,
    NotificationRejected,
    PeerLimits,
    RelayCore,
    RelayError,
    RelayPeer,
    RemoteProtocolError,
    RequestReceived,
    RequestRejected,
    ResponseReceived,
    messages,
)
from peer_in_process import INSTANCE, in_process

HELLO = {"protocol": PROTOCOL_VERSION, "role": "client", "instance": "box1", "token": "t"}
GUEST_HELLO = dict(HELLO, role="guest")


def line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode() + b"\n"


def hello_line(id: int = 0, params: dict[str, Any] = HELLO) -> bytes:
    return line({"jsonrpc": "2.0", "id": id, "method": "hello", "params": params})


def events_of(core: RelayCore) -> list[Any]:
    out = []
    while (event := core.next_event()) is not NEED_DATA:
        out.append(event)
        if isinstance(event, ConnectionClosed):
            break
        if isinstance(event, RequestReceived) and event.method == "hello" and core.our_role == "server":
            break  # the server answers hello before it reads on
    return out


def decoded(data: bytes) -> dict[str, Any]:
    assert data.endswith(b"\n") and data.count(b"\n") == 1
    return json.loads(data)


def open_server_core(role: str = "client") -> RelayCore:
    """A server core whose handshake with a `role` peer completed."""
    core = RelayCore("server")
    core.receive_data(hello_line(params=dict(HELLO, role=role)))
    [hello] = events_of(core)
    core.send_response(hello.id, {"ok": True})
    return core


# == the sans-IO core =================================================================================


def test_core_events_are_the_same_at_every_split() -> None:
    """A server reading hello, a request, a notification and the end, split at every byte."""
    stream = (
        hello_line()
        + line({"jsonrpc": "2.0", "id": 7, "method": "caller_tool", "params": {"tool": "t", "arguments": {"ü": 1}}})
        + line({"jsonrpc": "2.0", "method": "cancel", "params": {"id": 7}})
    )
    expected = [
        RequestReceived(7, "caller_tool", {"tool": "t", "arguments": {"ü": 1}}),
        NotificationReceived("cancel", {"id": 7}),
        ConnectionClosed(),
    ]
    for cut in range(len(stream) + 1):
        core = RelayCore("server")
        seen: list[Any] = []
        for chunk in [part for part in (stream[:cut], stream[cut:]) if part] + [b""]:  # b"": the end
            core.receive_data(chunk)
            while (event := core.next_event()) is not NEED_DATA:
                seen.append(event)
                if isinstance(event, RequestReceived) and event.method == "hello":
                    core.send_response(event.id, {})
                if isinstance(event, ConnectionClosed):
                    break
            if seen and isinstance(seen[-1], ConnectionClosed):
                break
        assert seen[0] == RequestReceived(0, "hello", HELLO), cut
        assert seen[1:] == expected, cut


def test_core_byte_by_byte_and_final_line_without_newline() -> None:
    core = open_server_core("guest")
    data = line({"jsonrpc": "2.0", "method": "ack", "params": {"seq": 1}}) + b'{"jsonrpc":"2.0","method":"ack","params":{"seq":2}}'
    for byte in data:
        core.receive_data(bytes([byte]))
    core.receive_data(b"")
    assert events_of(core) == [
        NotificationReceived("ack", {"seq": 1}), NotificationReceived("ack", {"seq": 2}), ConnectionClosed(),
    ]
    assert core.next_event() == ConnectionClosed()  # stays at the end


def test_core_oversized_frame_is_a_remote_error_known_before_its_newline() -> None:
    core = RelayCore("server", max_frame_bytes=100)
    core.receive_data(b"x" * 101)  # no newline yet: already too long
    with pytest.raises(RemoteProtocolError) as info:
        core.next_event()
    err = info.value
    assert err.code == INVALID_REQUEST and err.request_id is None
    assert "100" in err.message and err.data == {"limit": 100}
    assert decoded(core.send_protocol_error(err)) == {
        "jsonrpc": "2.0", "id": None, "error": {"code": INVALID_REQUEST, "message": err.message, "data": {"limit": 100}},
    }
    core.receive_data(b"\n" + hello_line())
    with pytest.raises(RemoteProtocolError):  # the framing is lost for good
        core.next_event()
    assert core.must_close


def padded_hello(size: int) -> bytes:
    """A hello line of exactly `size` bytes before its newline (unknown params are ignored)."""
    body = {"jsonrpc": "2.0", "id": 0, "method": "hello", "params": dict(HELLO, pad="")}
    pad = size - len(json.dumps(body))
    return json.dumps(dict(body, params=dict(HELLO, pad="x" * pad))).encode() + b"\n"


def test_core_frame_limit_excludes_the_newline() -> None:
    core = RelayCore("server", max_frame_bytes=200)
    core.receive_data(padded_hello(200))
    assert [e.method for e in events_of(core)] == ["hello"]
    core = RelayCore("server", max_frame_bytes=200)
    core.receive_data(padded_hello(201))
    with pytest.raises(RemoteProtocolError) as info:
        core.next_event()
    assert isinstance(info.value, RemoteProtocolError) and info.value.data == {"limit": 200}


@pytest.mark.parametrize(
    "data, code, fragment",
    [
        (b"this is {not json\n", PARSE_ERROR, "not valid JSON"),
        (b"\xff\xfe\n", PARSE_ERROR, "not valid JSON"),
        (b"[1, 2]\n", INVALID_REQUEST, "not a JSON object"),
        (b'{"jsonrpc": "1.0", "id": 1, "method": "x"}\n', INVALID_REQUEST, "jsonrpc"),
        (b'{"jsonrpc": "2.0", "id": 1, "method": "caller_tool", "params": [1]}\n', INVALID_REQUEST, "params"),
    ],
)
def test_core_garbage_is_a_remote_error(data: bytes, code: int, fragment: str) -> None:
    core = open_server_core()
    core.receive_data(data)
    with pytest.raises(RemoteProtocolError) as info:
        core.next_event()
    assert info.value.code == code and fragment in info.value.message
    with pytest.raises(LocalProtocolError):  # nothing but the error object may follow
        core.send_notification("caller_tools_config", {})


@pytest.mark.parametrize(
    "first, request_id, what",
    [
        ({"jsonrpc": "2.0", "id": 3, "method": "caller_tool", "params": {"tool": "t"}}, 3, "caller_tool"),
        ({"jsonrpc": "2.0", "method": "ack", "params": {"seq": 1}}, None, "ack"),
        ({"jsonrpc": "2.0", "id": 0, "result": {}}, None, "a response"),
    ],
)
def test_core_first_message_must_be_hello(first: dict[str, Any], request_id: Any, what: str) -> None:
    core = RelayCore("server")
    core.receive_data(line(first) + hello_line())
    with pytest.raises(RemoteProtocolError) as info:
        core.next_event()
    err = info.value
    assert err.code == INVALID_REQUEST and err.request_id == request_id
    assert err.message == f"the first message must be the request 'hello', got {what}"
    assert decoded(core.send_protocol_error(err))["id"] == request_id


def test_core_client_drops_late_duplicate_and_unknown_responses() -> None:
    core = RelayCore("client")
    hello_id, data = core.send_request("hello", HELLO)
    assert hello_id == 0 and decoded(data)["method"] == "hello"
    core.receive_data(line({"jsonrpc": "2.0", "id": 0, "result": {"instance": "box1"}}))
    assert events_of(core) == [ResponseReceived(0, {"instance": "box1"})]
    assert core.handshake_complete

    first, _ = core.send_request("caller_tool", {"tool": "a", "arguments": {}})
    late, _ = core.send_request("caller_tool", {"tool": "b", "arguments": {}})
    assert core.pending == {first, late}
    assert decoded(core.send_cancel(late) or b"") == {"jsonrpc": "2.0", "method": "cancel", "params": {"id": late}}
    assert core.send_cancel(late) is None  # nothing left to cancel
    core.receive_data(
        line({"jsonrpc": "2.0", "id": late, "error": {"code": CANCELLED, "message": "cancelled"}})  # late
        + line({"jsonrpc": "2.0", "id": 99, "result": 1})  # never asked
        + line({"jsonrpc": "2.0", "id": None, "error": {"code": -32600, "message": "x"}})  # no id
        + line({"jsonrpc": "2.0", "id": first, "result": "one"})
        + line({"jsonrpc": "2.0", "id": first, "result": "again"})  # duplicate
        + line({"jsonrpc": "2.0", "id": 0, "result": {}})  # hello answered twice
    )
    assert events_of(core) == [ResponseReceived(first, "one")]
    assert core.pending == frozenset()


def test_core_error_response_carries_the_peers_error() -> None:
    core = RelayCore("guest")
    core.send_request("hello", GUEST_HELLO)
    core.receive_data(line({"jsonrpc": "2.0", "id": 0, "error": {"code": -32006, "message": "wrong token"}}))
    [event] = events_of(core)
    assert isinstance(event, ResponseReceived) and event.error is not None
    assert (event.error.code, event.error.message) == (-32006, "wrong token")
    assert core.must_close and not core.handshake_complete
    with pytest.raises(LocalProtocolError):
        core.send_notification("ack", {"seq": 1})


def test_core_hello_gate_on_the_client() -> None:
    core = RelayCore("client")
    with pytest.raises(LocalProtocolError):
        core.send_request("caller_tool", {"tool": "t"})  # hello first
    core.send_request("hello", HELLO)
    with pytest.raises(LocalProtocolError):
        core.send_request("caller_tool", {"tool": "t"})  # not before hello is answered
    # Configuration may come before the hello answer; other messages are refused.
    config = {"session_id": "s", "caller_id": "c", "tools": []}
    core.receive_data(
        line({"jsonrpc": "2.0", "method": "caller_tools_config", "params": config})
        + line({"jsonrpc": "2.0", "id": 5, "method": "caller_tool", "params": {}})
        + line({"jsonrpc": "2.0", "method": "cancel", "params": {"id": 1}})
        + line({"jsonrpc": "2.0", "id": 0, "result": {}})
    )
    events = events_of(core)
    assert events[0] == NotificationReceived("caller_tools_config", config)
    assert isinstance(events[1], RequestRejected) and events[1].error.code == METHOD_NOT_FOUND
    assert decoded(core.send_rejection(events[1]))["error"]["message"] == "this client serves no method 'caller_tool'"
    assert isinstance(events[2], NotificationRejected) and "before the handshake" in events[2].error.message
    assert events[3] == ResponseReceived(0, {})
    core.send_request("caller_tool", {"tool": "t"})  # open now


def test_core_hello_gate_on_the_server() -> None:
    core = RelayCore("server")
    with pytest.raises(LocalProtocolError):
        core.send_notification("caller_tools_config", {})  # nobody said hello yet
    core.receive_data(hello_line(id=4))
    [hello] = events_of(core)
    assert hello == RequestReceived(4, "hello", HELLO)
    with pytest.raises(LocalProtocolError):
        core.next_event()  # answer hello before reading on
    # Between reading hello and answering it, only the configuration may be sent.
    core.send_notification("toolsets_config", {"tools": []})
    with pytest.raises(LocalProtocolError):
        core.send_notification("cancel", {"id": 1})
    assert decoded(core.send_response(4, {"instance": "box1"})) == {"jsonrpc": "2.0", "id": 4, "result": {"instance": "box1"}}
    assert core.handshake_complete and core.peer_role == "client"


def test_core_refused_hello_closes() -> None:
    core = RelayCore("server")
    core.receive_data(hello_line(id=1, params=dict(HELLO, token="bad")))
    events_of(core)
    assert decoded(core.send_error(1, RelayError(-32006, "wrong token")))["error"]["code"] == -32006
    assert core.must_close
    with pytest.raises(LocalProtocolError):
        core.send_notification("caller_tools_config", {})


def test_core_role_table() -> None:
    guest = open_server_core("guest")
    guest.receive_data(
        line({"jsonrpc": "2.0", "id": 1, "method": "caller_tool", "params": {}})
        + line({"jsonrpc": "2.0", "id": 2, "method": "no_such_method", "params": {}})
        + line({"jsonrpc": "2.0", "id": 3, "method": "append_frame", "params": {}})
        + line({"jsonrpc": "2.0", "id": 3, "method": "append_frame", "params": {}})
        + line({"jsonrpc": "2.0", "id": 4, "method": "hello", "params": GUEST_HELLO})
        + line({"jsonrpc": "2.0", "method": "toolsets_config", "params": {}})
    )
    wrong_role, unknown, append, duplicate, hello_again, wrong_way = events_of(guest)
    assert wrong_role.error.code == METHOD_NOT_FOUND
    assert wrong_role.error.message == "method 'caller_tool' is for role 'client' connections"
    assert unknown.error.code == METHOD_NOT_FOUND and unknown.error.message == "unknown method 'no_such_method'"
    assert append == RequestReceived(3, "append_frame", {})
    assert isinstance(duplicate, RequestRejected) and duplicate.error.code == INVALID_REQUEST
    assert "already in flight" in duplicate.error.message
    assert isinstance(hello_again, RequestRejected) and hello_again.error.code == INVALID_REQUEST
    assert isinstance(wrong_way, NotificationRejected)
    # What a server may send to a guest, and to a client.
    guest.send_notification("user_message", {})
    with pytest.raises(LocalProtocolError):
        guest.send_notification("caller_tools_config", {})
    with pytest.raises(LocalProtocolError):
        open_server_core("client").send_notification("user_message", {})
    with pytest.raises(LocalProtocolError):
        open_server_core("client").send_request("caller_tool", {})  # the server asks nothing
    client = RelayCore("client")
    client.send_request("hello", HELLO)
    client.receive_data(line({"jsonrpc": "2.0", "id": 0, "result": {}}))
    events_of(client)
    with pytest.raises(LocalProtocolError):
        client.send_request("append_frame", {})  # a guest's method


def test_core_answers_only_what_was_asked_and_keeps_oversized_answers_answerable() -> None:
    core = open_server_core()
    with pytest.raises(LocalProtocolError):
        core.send_response(9, {})
    core.receive_data(line({"jsonrpc": "2.0", "id": "a", "method": "caller_tool", "params": {}}))
    events_of(core)
    core.max_frame_bytes = 200
    with pytest.raises(FrameTooLarge):
        core.send_response("a", "x" * 300)
    assert core.inbound == {"a"}
    assert decoded(core.send_error("a", RelayError(INTERNAL_ERROR, "too large")))["id"] == "a"
    assert core.inbound == frozenset()


def test_core_sends_a_notification_encoded_once_as_it_would_send_it() -> None:
    """`encode_notification` + `send_encoded`: the same bytes as `send_notification`, with the
    same checks on each connection (its role, its phase, its frame limit)."""
    from protocol import encode_notification

    params = {"session_id": "s", "caller_id": "c", "tools": []}
    note = encode_notification("caller_tools_config", params)
    client_side = open_server_core("client")
    assert client_side.send_encoded(note) is note.data  # the very bytes, not a copy
    assert note.data == client_side.send_notification("caller_tools_config", params)
    with pytest.raises(LocalProtocolError):  # a guest is not sent a client's configuration
        open_server_core("guest").send_encoded(note)
    with pytest.raises(LocalProtocolError):  # nor anything before its hello
        RelayCore("server").send_encoded(note)
    client_side.max_frame_bytes = len(note.data) - 2
    with pytest.raises(FrameTooLarge):
        client_side.send_encoded(note)
    with pytest.raises(LocalProtocolError):
        encode_notification("caller_tool", {})  # a request, not a notification
    with pytest.raises(LocalProtocolError):
        encode_notification("caller_tools_config", {"x": float("nan")})


def test_core_never_imports_trio() -> None:
    from pathlib import Path

    import protocol.core as core_module

    source = Path(core_module.__file__).read_text()
    assert "import trio" not in source and "from trio" not in source


# == the Trio peer ===================================================================================


class Server:
    """The far end of a peer test: a server-role peer with a hello and a few handlers."""

    def __init__(self) -> None:
        self.started: dict[str, trio.Event] = {}
        self.cancelled: list[str] = []
        self.cancelled_changed = StateChanges()
        self.release = trio.Event()
        self.configs_before_hello = 0

    async def hello(self, hello: messages.Hello) -> messages.HelloResult:
        for _ in range(self.configs_before_hello):
            await self.peer.send_notification(
                "caller_tools_config", {"session_id": "s", "caller_id": "c", "tools": []})
        return messages.HelloResult(protocol=PROTOCOL_VERSION, server_version="t", instance=hello.instance)

    async def cancelled_reach(self, count: int) -> None:
        """Until `count` handlers were cancelled (`cancelled` has that many)."""
        await self.cancelled_changed.until(lambda: len(self.cancelled) >= count)

    async def caller_tool(self, call: messages.CallerToolCall) -> Any:
        self.started.setdefault(call.tool, trio.Event()).set()
        if call.tool == "boom":
            raise ValueError("a bug")
        if call.tool == "refuse":
            raise RelayError(-32004, "no thanks")
        if call.tool == "refuse and close":
            self.peer.close_after_answer("the test closes after this answer")
            raise RelayError(-32004, "no thanks, and goodbye")
        if call.tool == "late":  # like a caller that never answers: the server's own deadline passes
            await trio.sleep(10)
            raise RelayError(TIMEOUT, "the caller did not answer within 10 s")
        if call.tool.startswith("wait"):
            try:
                await self.release.wait()
            except trio.Cancelled:
                self.cancelled.append(call.tool)
                self.cancelled_changed.changed()
                raise
        return messages.CallerToolResult(result={"echo": call.arguments})

    def handlers(self) -> dict[str, HandlerEntry[Any]]:
        return {
            "hello": HandlerEntry(messages.Hello, self.hello),
            "caller_tool": HandlerEntry(messages.CallerToolCall, self.caller_tool),
        }


def socket_stream_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    """Two ends of a Unix socket pair, as a relay connection's streams are."""
    a, b = trio.socket.socketpair()
    return trio.SocketStream(a), trio.SocketStream(b)


@asynccontextmanager
async def peers(
    limits: PeerLimits = PeerLimits(), server: Server | None = None, *, over_socket: bool = False,
) -> AsyncIterator[tuple[RelayPeer, Server, list[Any]]]:
    """A client peer, handshake done, talking to a server peer over a memory stream pair (or a socket pair)."""
    server = server or Server()
    left, right = socket_stream_pair() if over_socket else trio.testing.memory_stream_pair()
    server.peer = RelayPeer(right, RelayCore("server"), name="server", limits=limits)
    notes: list[Any] = []

    async def note(params: Any) -> None:
        notes.append(params)

    client = RelayPeer(left, RelayCore("client"), name="client", limits=limits)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.peer.serve, server.handlers())
        await nursery.start(client.serve, {"caller_tools_config": HandlerEntry(messages.CallerToolsConfig, note)})
        await client.request("hello", HELLO, timeout=5)
        yield client, server, notes
        nursery.cancel_scope.cancel()


async def test_peer_request_and_configuration_before_the_hello_answer() -> None:
    server = Server()
    server.configs_before_hello = 3
    async with peers(server=server) as (client, server, notes):
        # The configuration was handled before request("hello") returned.
        assert len(notes) == 3 and all(isinstance(n, messages.CallerToolsConfig) for n in notes)
        assert client.opened.is_set() and server.peer.opened.is_set()
        result = await client.request("caller_tool", {"tool": "t", "arguments": {"a": 1}}, timeout=5)
        assert result == {"result": {"echo": {"a": 1}}}


def tasks_besides_serve() -> list[int]:
    """For each `serve` running in the test task's innermost nursery (`peers`'), the tasks of its own."""
    nursery = trio.lowlevel.current_task().child_nurseries[-1]
    return [sum(len(inner.child_tasks) for inner in serving.child_nurseries) for serving in nursery.child_tasks]


async def test_an_idle_peer_is_its_serve_task_alone_and_writes_from_a_task_only_while_frames_wait() -> None:
    """Once the handshake is done and nothing is asked, neither end runs a task besides `serve`
    (parked in its read): a writer task starts with the first queued frame and ends with the last
    written, so 19,000 idle sandboxes cost the server no writer each (docs/SCALING.md)."""
    async with peers() as (client, server, notes):
        await trio.testing.wait_all_tasks_blocked()
        assert tasks_besides_serve() == [0, 0]
        server.peer.notify("caller_tools_config", {"session_id": "s", "caller_id": "c", "tools": []})
        assert sorted(tasks_besides_serve()) == [0, 1], "the notification's writer"
        await trio.testing.wait_all_tasks_blocked()
        assert len(notes) == 1 and tasks_besides_serve() == [0, 0]
        assert await client.request("caller_tool", {"tool": "t", "arguments": {}}, timeout=5) == {"result": {"echo": {}}}
        await trio.testing.wait_all_tasks_blocked()
        assert tasks_besides_serve() == [0, 0]


async def test_on_a_socket_a_frame_is_written_at_once_by_the_task_that_queues_it() -> None:
    """Over a socket with room, a frame is written by the task that queues it: no writer task is
    started for it (a relayed call's answer costs no task), and idle stays `serve` alone."""
    async with peers(over_socket=True) as (client, server, notes):
        await trio.testing.wait_all_tasks_blocked()
        assert tasks_besides_serve() == [0, 0]
        server.peer.notify("caller_tools_config", {"session_id": "s", "caller_id": "c", "tools": []})
        assert tasks_besides_serve() == [0, 0] and not server.peer._queue, "written at once, no writer"
        await trio.testing.wait_all_tasks_blocked()
        assert len(notes) == 1
        assert await client.request("caller_tool", {"tool": "t", "arguments": {}}, timeout=5) == {"result": {"echo": {}}}
        await trio.testing.wait_all_tasks_blocked()
        assert tasks_besides_serve() == [0, 0] and server.peer._answers.used == 0


async def test_on_a_socket_what_arrives_while_the_peer_waits_is_read_in_one_step() -> None:
    """An idle connection waits for its socket and reads in the step it wakes in (trio's
    `receive_some` would take one step more, its checkpoint)."""
    near, far = socket_stream_pair()
    peer = RelayPeer(near, RelayCore("server"), name="reader")
    async with near, far, trio.open_nursery() as nursery:

        async def send_when_the_peer_waits() -> None:
            await trio.testing.wait_all_tasks_blocked()
            await far.send_all(hello_line())

        nursery.start_soon(send_when_the_peer_waits)
        with counted_steps() as steps, trio.fail_after(EVENT_TIMEOUT):
            assert await peer._receive_or_eof() == hello_line()
        assert steps.count == 1


async def test_what_a_full_socket_does_not_take_at_once_the_writer_finishes_in_order() -> None:
    """A frame the socket takes in part, and every frame after it, is the writer task's, which
    writes the rest in order; the far end reads every frame whole."""
    near, far = socket_stream_pair()
    near.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    core = RelayCore("server")
    core.receive_data(hello_line())
    core.send_response(events_of(core)[0].id, {})  # handshake done without bytes on the wire
    peer = RelayPeer(near, core, name="full")
    async with far, trio.open_nursery() as nursery:
        await nursery.start(peer.serve, {})
        sent = [{"session_id": f"s{i}", "caller_id": "c", "tools": [], "pad": "p" * 30_000} for i in range(8)]
        for params in sent:
            peer.notify("caller_tools_config", params)
        assert select.select([far.socket], [], [], 0)[0], "what the socket took was written at once"
        assert peer._queue, "the socket took part, the rest waits for the writer"
        assert len(nursery.child_tasks) == 1 and len(next(iter(nursery.child_tasks)).child_nurseries[0].child_tasks) == 1
        buffer = LineBuffer()
        received: list[dict[str, Any]] = []
        with trio.fail_after(EVENT_TIMEOUT):
            while len(received) < len(sent):
                buffer.feed(await far.receive_some())
                while (got := buffer.next_line()) is not None:
                    received.append(json.loads(got)["params"])
        assert received == sent
        await trio.testing.wait_all_tasks_blocked()
        assert not peer._queue and not peer._writing and peer._pushed.used == 0
        nursery.cancel_scope.cancel()


async def test_peer_handler_errors_become_error_responses_in_one_place() -> None:
    async with peers() as (client, server, _):
        with pytest.raises(RelayError) as refused:
            await client.request("caller_tool", {"tool": "refuse", "arguments": {}}, timeout=5)
        assert refused.value.code == -32004 and refused.value.message == "no thanks"
        with pytest.raises(RelayError) as bug:
            await client.request("caller_tool", {"tool": "boom", "arguments": {}}, timeout=5)
        assert bug.value.code == INTERNAL_ERROR and "a bug" in bug.value.message
        with pytest.raises(RelayError) as invalid:
            await client.request("caller_tool", {"tool": 5, "arguments": {}}, timeout=5)
        assert invalid.value.code == INVALID_PARAMS and "tool" in invalid.value.message
        assert "5" not in server.started  # the handler never saw invalid params
        with pytest.raises(RelayError) as missing:
            await client.request("toolset_call", {"name": "x", "arguments": {}}, timeout=5)
        assert missing.value.code == METHOD_NOT_FOUND and "toolset_call" in missing.value.message
        # The connection is still fine.
        assert await client.request("caller_tool", {"tool": "t", "arguments": {}}, timeout=5) == {"result": {"echo": {}}}


async def test_each_request_and_notification_is_checked_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The peer checks params once, against the schema derived from their class, and builds the
    class without the strict converter checking them a second time; a refusal still names the path."""
    import protocol.convert
    import protocol.schema_check

    checks: list[Any] = []
    first_error = protocol.schema_check.first_error
    monkeypatch.setattr(protocol.schema_check, "first_error", lambda v, value: checks.append(value) or first_error(v, value))
    class Counting:  # the strict converter, counting what it checks
        def structure(self, *args: Any) -> Any:
            checks.append(args)
            return strict.structure(*args)

        def __getattr__(self, name: str) -> Any:
            return getattr(strict, name)

    strict = protocol.convert.converter
    monkeypatch.setattr(protocol.convert, "converter", Counting())
    async with peers() as (client, server, notes):
        checks.clear()
        params = {"tool": "t", "arguments": {"a": 1}, "progress_ref": "p-1"}
        assert await client.request("caller_tool", params, timeout=5) == {"result": {"echo": {"a": 1}}}
        assert checks == [params]
        checks.clear()
        await server.peer.send_notification("caller_tools_config", {"session_id": "s", "caller_id": "c", "tools": []})
        assert await client.request("caller_tool", {"tool": "t"}, timeout=5) == {"result": {"echo": {}}}
        assert len(checks) == 2 and notes[-1] == messages.CallerToolsConfig(session_id="s", caller_id="c", tools=[])
        with pytest.raises(RelayError) as refused:
            await client.request("caller_tool", {"tool": "t", "progress_ref": ""}, timeout=5)
        assert refused.value.code == INVALID_PARAMS and refused.value.data == {"path": "$.progress_ref"}
        assert refused.value.message.startswith("invalid caller_tool params at $.progress_ref: ")


async def test_a_handler_that_closes_after_its_answer_has_the_answer_read_first() -> None:
    """`close_after_answer`: the refusal reaches the peer, then the connection ends."""
    async with peers() as (client, server, _):
        with pytest.raises(RelayError) as refused:
            await client.request("caller_tool", {"tool": "refuse and close", "arguments": {}}, timeout=5)
        assert refused.value.code == -32004 and refused.value.message == "no thanks, and goodbye", refused.value
        with trio.fail_after(5):
            await client.closed.wait()
        assert server.peer.close_reason == "the test closes after this answer"


async def test_peer_request_timeout_is_a_relay_error_and_sends_cancel(mock_clock: trio.testing.MockClock) -> None:
    mock_clock.autojump_threshold = 0
    async with peers() as (client, server, _):
        start = trio.current_time()
        with pytest.raises(RelayError) as info:
            await client.request("caller_tool", {"tool": "wait", "arguments": {}}, timeout=30)
        assert info.value.code == TIMEOUT and "30 s" in info.value.message
        assert trio.current_time() - start == pytest.approx(30)
        with trio.fail_after(1):
            await server.cancelled_reach(1)
        assert server.cancelled == ["wait"]  # the server got `cancel` and stopped the handler
        assert client.core.pending == frozenset() and client._waiters == {}


async def test_a_cancelled_request_sends_cancel_and_removes_its_waiter() -> None:
    async with peers() as (client, server, _):
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:

                async def cancel_when_started() -> None:
                    await server.started.setdefault("wait", trio.Event()).wait()
                    scope.cancel()

                nursery.start_soon(cancel_when_started)
                await client.request("caller_tool", {"tool": "wait", "arguments": {}}, timeout=30)
        assert scope.cancelled_caught
        with trio.fail_after(5):
            await server.cancelled_reach(1)
        assert server.cancelled == ["wait"]
        assert client._waiters == {} and client.core.pending == frozenset()


async def test_a_frame_queued_while_the_connection_ends_is_dropped_not_raised() -> None:
    """While the connection's nursery is ending it takes no new task; a frame queued then (a
    cancelled request's `cancel`, from the requesting task) is dropped and counted finished, and
    queueing it raises nothing into the requesting task."""
    async with peers() as (client, _server, _):
        async with trio.open_nursery() as ended:
            pass  # a nursery closed to new tasks, as the connection's is while it ends
        serving = client._nursery
        client._nursery = ended
        written: list[bool] = []
        try:
            assert client._put(_Outgoing(line({"jsonrpc": "2.0", "method": "cancel"}), on_written=lambda: written.append(True)))
        finally:
            client._nursery = serving
        assert written == [True] and not client._queue and not client._writing


async def test_an_inbound_cancel_cancels_exactly_that_request() -> None:
    async with peers() as (client, server, _):
        outcomes: dict[str, Any] = {}

        async def call(tool: str) -> None:
            try:
                outcomes[tool] = await client.request("caller_tool", {"tool": tool, "arguments": {}}, timeout=30)
            except RelayError as err:
                outcomes[tool] = err

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, "wait-a")
            with trio.fail_after(5):
                await server.started.setdefault("wait-a", trio.Event()).wait()
            [a_id] = server.peer._in_flight
            nursery.start_soon(call, "wait-b")
            with trio.fail_after(5):
                await server.started.setdefault("wait-b", trio.Event()).wait()
            assert len(server.peer._in_flight) == 2
            client.notify("cancel", {"id": a_id})
            with trio.fail_after(5):
                await server.cancelled_reach(1)
            assert server.cancelled == ["wait-a"]
            server.release.set()
        assert isinstance(outcomes["wait-a"], RelayError) and outcomes["wait-a"].code == CANCELLED
        assert outcomes["wait-b"] == {"result": {"echo": {}}}


async def test_closing_fails_every_pending_request_at_once() -> None:
    async with peers() as (client, server, _):
        async with trio.open_nursery() as nursery:
            errors: list[RelayError] = []

            async def call() -> None:
                with pytest.raises(RelayError) as info:
                    await client.request("caller_tool", {"tool": "wait", "arguments": {}}, timeout=300)
                errors.append(info.value)

            nursery.start_soon(call)
            with trio.fail_after(5):
                await server.started.setdefault("wait", trio.Event()).wait()
            server.peer.close("test says so")
        assert errors[0].code == PEER_DISCONNECTED
        with trio.fail_after(5):
            await client.closed.wait()
        assert server.cancelled == ["wait"]  # the end of the connection cancelled the handler
        with pytest.raises(RelayError) as after:
            await client.request("caller_tool", {"tool": "t", "arguments": {}}, timeout=5)
        assert after.value.code == PEER_DISCONNECTED


async def test_frames_from_many_tasks_never_interleave() -> None:
    """One writer task: concurrent requests, each with a large frame, arrive whole."""
    async with peers() as (client, server, _):
        async with trio.open_nursery() as nursery:
            results: dict[int, Any] = {}

            async def call(i: int) -> None:
                results[i] = await client.request(
                    "caller_tool", {"tool": "t", "arguments": {"i": i, "pad": "p" * (20_000 + i)}}, timeout=5)

            for i in range(20):
                nursery.start_soon(call, i)
        assert all(results[i]["result"]["echo"]["i"] == i for i in range(20))


async def test_a_too_large_answer_becomes_an_error_and_the_connection_survives() -> None:
    async with peers(PeerLimits()) as (client, server, _):
        server.peer.core.max_frame_bytes = 1000
        with pytest.raises(RelayError) as info:
            await client.request("caller_tool", {"tool": "t", "arguments": {"x": "y" * 2000}}, timeout=5)
        assert info.value.code == INTERNAL_ERROR and "too large" in info.value.message
        assert await client.request("caller_tool", {"tool": "t", "arguments": {}}, timeout=5) == {"result": {"echo": {}}}


async def stalled_peer(limits: PeerLimits) -> tuple[RelayPeer, trio.abc.Stream]:
    """A server peer past its handshake whose far side (returned) reads nothing more."""
    near, far = trio.testing.lockstep_stream_pair()
    core = RelayCore("server")
    core.receive_data(hello_line())
    core.send_response(events_of(core)[0].id, {})  # handshake done without bytes on the wire
    return RelayPeer(near, core, name="stalled", limits=limits), far


async def test_write_deadline_closes_a_peer_that_does_not_read(mock_clock: trio.testing.MockClock) -> None:
    mock_clock.autojump_threshold = 0
    peer, far = await stalled_peer(PeerLimits(write_timeout=7))
    async with trio.open_nursery() as nursery:
        await nursery.start(peer.serve, {})
        start = trio.current_time()
        peer.notify("caller_tools_config", {"session_id": "s", "caller_id": "c", "tools": []})
        assert trio.current_time() == start  # notify never waits
        with trio.fail_after(60):
            await peer.closed.wait()
        assert trio.current_time() - start == pytest.approx(7)
        assert "did not finish within 7 s" in (peer.close_reason or "")
    with trio.fail_after(60):  # what the cancelled write left, then the end: the stream was closed
        while await far.receive_some():
            pass
    with pytest.raises(RelayError) as info:
        peer.notify("caller_tools_config", {"session_id": "s", "caller_id": "c", "tools": []})
    assert info.value.code == PEER_DISCONNECTED


async def test_a_full_queue_closes_the_connection_at_once(mock_clock: trio.testing.MockClock) -> None:
    mock_clock.autojump_threshold = 0
    peer, far = await stalled_peer(PeerLimits(write_timeout=1000, queue_frames=2))
    config = {"session_id": "s", "caller_id": "c", "tools": []}
    async with trio.open_nursery() as nursery:
        await nursery.start(peer.serve, {})
        peer.notify("caller_tools_config", config)
        await trio.testing.wait_all_tasks_blocked()  # the writer holds the first frame
        start = trio.current_time()
        peer.notify("caller_tools_config", config)
        peer.notify("caller_tools_config", config)
        with pytest.raises(RelayError):
            peer.notify("caller_tools_config", config)  # no room: the peer is not reading
        with trio.fail_after(10):
            await peer.closed.wait()
        assert trio.current_time() == start
        assert "2 frames are waiting" in (peer.close_reason or "")


# -- room for answers: a burst of answers never disconnects a peer that reads ---------------------------

BURST = 120  # more than DEFAULT_QUEUE_FRAMES (64), which once bounded answers too


async def test_a_burst_of_answers_reaches_a_reading_peer(mock_clock: trio.testing.MockClock) -> None:
    """BURST calls whose deadlines pass together on the server: the client gets every -32001,
    none a "connection closed" (the answers once shared the 64 places of the notifications)."""
    mock_clock.autojump_threshold = 0
    async with peers() as (client, server, _):
        outcomes: list[Any] = []

        async def call() -> None:
            try:
                outcomes.append(await client.request("caller_tool", {"tool": "late", "arguments": {}}, timeout=60))
            except RelayError as err:
                outcomes.append(err)

        async with trio.open_nursery() as nursery:
            for _ in range(BURST):
                nursery.start_soon(call)
        assert len(outcomes) == BURST
        assert {(o.code, o.message) for o in outcomes} == {(TIMEOUT, "the caller did not answer within 10 s")}
        assert not server.peer.is_closed and not client.is_closed
        assert server.peer._answers.used == 0  # every place given back
        assert await client.request("caller_tool", {"tool": "t", "arguments": {}}, timeout=5) == {"result": {"echo": {}}}


async def test_a_burst_of_our_own_timeouts_does_not_close_our_connection(mock_clock: trio.testing.MockClock) -> None:
    """BURST requests of the client time out together: each sends `cancel`, which is not a
    stalled queue; the connection stays up and every request reports -32001."""
    mock_clock.autojump_threshold = 0
    async with peers() as (client, server, _):
        codes: list[int] = []

        async def call() -> None:
            with pytest.raises(RelayError) as info:
                await client.request("caller_tool", {"tool": "wait", "arguments": {}}, timeout=30)
            codes.append(info.value.code)

        async with trio.open_nursery() as nursery:
            for _ in range(BURST):
                nursery.start_soon(call)
        assert codes == [TIMEOUT] * BURST
        assert not client.is_closed, client.close_reason
        with trio.fail_after(60):
            await server.cancelled_reach(BURST)  # every `cancel` reached the server
        assert await client.request("caller_tool", {"tool": "t", "arguments": {}}, timeout=5) == {"result": {"echo": {}}}


async def test_a_burst_of_refused_requests_in_one_write_gets_every_answer() -> None:
    """BURST requests of each kind the server refuses at once (an unknown method, a method it does
    not serve, a tool that fails), all in one write: every one is answered, in order, and the
    connection goes on."""
    left, right = trio.testing.memory_stream_pair()
    server = Server()
    server.peer = RelayPeer(right, RelayCore("server"), name="server")
    kinds = [
        ("nope", {}, METHOD_NOT_FOUND),  # not in the protocol: refused by the core
        ("toolset_call", {"name": "x", "arguments": {}}, METHOD_NOT_FOUND),  # not served here
        ("caller_tool", {"tool": "refuse", "arguments": {}}, -32004),  # the handler refuses it
    ]
    burst = b"".join(
        line({"jsonrpc": "2.0", "id": 1 + i * len(kinds) + k, "method": method, "params": params})
        for i in range(BURST) for k, (method, params, _) in enumerate(kinds)
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(server.peer.serve, server.handlers())
        await left.send_all(hello_line() + burst)
        answers: dict[Any, Any] = {}
        buffer = b""
        with trio.fail_after(10):
            while len(answers) < 1 + BURST * len(kinds):
                buffer += await left.receive_some()
                *lines, buffer = buffer.split(b"\n")
                for raw in lines:
                    answer = json.loads(raw)
                    answers[answer["id"]] = answer
        assert "result" in answers.pop(0)  # the hello
        for request_id, answer in answers.items():
            assert answer["error"]["code"] == kinds[(request_id - 1) % len(kinds)][2], answer
        assert not server.peer.is_closed
        nursery.cancel_scope.cancel()


async def test_requests_in_flight_are_bounded_by_reading_less_not_by_disconnecting() -> None:
    """At `max_requests_in_flight` the server reads nothing more until an answer is written; the
    requests beyond it wait, and all are answered."""
    async with peers(PeerLimits(max_requests_in_flight=4)) as (client, server, _):
        results: list[Any] = []

        async def call(i: int) -> None:
            results.append(await client.request("caller_tool", {"tool": f"wait{i}", "arguments": {}}, timeout=30))

        async with trio.open_nursery() as nursery:
            for i in range(10):
                nursery.start_soon(call, i)
            await trio.testing.wait_all_tasks_blocked()
            assert len(server.started) == 4 and server.peer._answers.used == 4
            server.release.set()
        assert len(results) == 10 and not server.peer.is_closed
        assert server.peer._answers.used == 0


async def test_a_peer_that_stops_reading_is_still_cut_off_by_the_write_deadline(
    mock_clock: trio.testing.MockClock,
) -> None:
    """Answers have room, but only while the peer reads: one that sends BURST requests and reads
    nothing is closed when the first write has waited the write deadline (not earlier, for a full
    queue; not never)."""
    mock_clock.autojump_threshold = 0
    peer, far = await stalled_peer(PeerLimits(write_timeout=7))
    requests = b"".join(
        line({"jsonrpc": "2.0", "id": i, "method": "caller_tool", "params": {"tool": "t", "arguments": {}}})
        for i in range(1, BURST + 1)
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(peer.serve, {})  # serves nothing: each request is answered with an error
        start = trio.current_time()
        await far.send_all(requests)
        with trio.fail_after(60):
            await peer.closed.wait()
        assert trio.current_time() - start == pytest.approx(7)
        assert "did not finish within 7 s" in (peer.close_reason or "")
    assert peer._answers.used == 0  # answers dropped at the end gave their places back


async def test_server_hello_deadline(mock_clock: trio.testing.MockClock) -> None:
    mock_clock.autojump_threshold = 0
    left, right = trio.testing.memory_stream_pair()
    peer = RelayPeer(right, RelayCore("server"), name="server", limits=PeerLimits(hello_timeout=4))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(peer.serve, {})
        with trio.fail_after(60):
            await peer.closed.wait()
    error = json.loads(await left.receive_some())
    assert error["id"] is None and error["error"]["code"] == INVALID_REQUEST
    assert error["error"]["message"] == "no hello within 4 s"
    assert await left.receive_some() == b""


async def test_server_hello_deadline_covers_a_trickled_hello(mock_clock: trio.testing.MockClock) -> None:
    """A hello line sent a byte every half second is cut at the deadline from the connection's
    start, not from its last byte (docs/SECURITY.md, "Relay connections that never say hello")."""
    mock_clock.autojump_threshold = 0
    left, right = trio.testing.memory_stream_pair()
    peer = RelayPeer(right, RelayCore("server"), name="server", limits=PeerLimits(hello_timeout=4))
    line = b'{"jsonrpc": "2.0", "id": 0, "method": "hello", "params": {"protocol": "oubliette-relay/1"}}\n'

    async def trickle() -> None:
        for byte in line:
            await left.send_all(bytes([byte]))
            await trio.sleep(0.5)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(peer.serve, {})
        nursery.start_soon(trickle)
        start = trio.current_time()
        with trio.fail_after(60):
            await peer.closed.wait()
        assert trio.current_time() - start == pytest.approx(4)
        nursery.cancel_scope.cancel()
    assert peer.refusal == "protocol error: no hello within 4 s"


async def test_protocol_error_gets_one_error_object_then_the_end() -> None:
    left, right = trio.testing.memory_stream_pair()
    peer = RelayPeer(right, RelayCore("server"), name="server")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(peer.serve, {})
        await left.send_all(b"{nope\n")
        with trio.fail_after(5):
            await peer.closed.wait()
    received = b""
    while chunk := await left.receive_some():
        received += chunk
    [error] = [json.loads(x) for x in received.splitlines()]
    assert error["error"]["code"] == PARSE_ERROR


async def test_client_request_needs_a_handshake_and_fails_with_a_relay_error_only() -> None:
    left, _right = trio.testing.memory_stream_pair()
    peer = RelayPeer(left, RelayCore("client"), name="client")
    async with trio.open_nursery() as nursery:
        await nursery.start(peer.serve, {})
        with pytest.raises(RelayError):
            await peer.request("caller_tool", {"tool": "t"}, timeout=1)
        nursery.cancel_scope.cancel()


async def test_relay_link_request_deadline(deployment: Deployment) -> None:
    """RelayLink.request has a deadline (settable): the waiting side gets RelayError(TIMEOUT)."""
    from oubliette_client.relay_link import RelayLink
    from oubliette_client.settings import RelaySettings

    async with in_process(deployment, caller_timeout=60) as proc:
        owner, events = proc.open_caller()
        await proc.declare(owner, "s1", "myapp", [{"name": "slow", "inputSchema": {"type": "object"}}])
        settings = RelaySettings(relay=deployment.relay, instance=INSTANCE, token=proc.server.tokens.token_for(INSTANCE), session="mcp:s1")

        async def ignore(method: str, params: Any) -> None:
            pass

        link = RelayLink(settings, "client", ignore, request_timeout=0.5)
        proc.nursery.start_soon(link.run)
        with trio.fail_after(EVENT_TIMEOUT):
            await link.wait_connected()
        with pytest.raises(RelayError) as info:
            await link.request("caller_tool", {"tool": "slow", "arguments": {}})
        assert info.value.code == TIMEOUT and "0.5 s" in info.value.message
        # The server was told: the caller sees the call cancelled, nothing stays pending.
        request = await events.wait_type("caller_tool_request")
        await events.wait_type("caller_tool_cancelled", request_id=request["request_id"])
        assert proc.server.calls.pending == {}


async def test_a_request_waiting_for_the_connection_waits_while_the_peer_has_closed() -> None:
    """The link still says connected but its peer has closed (the server died a moment ago):
    a request that waits for the connection waits for the link's state to change, instead of
    failing at once; a retry loop around it (the guest's frame appends) must never spin."""
    from oubliette_client.relay_link import RelayLink
    from oubliette_client.settings import RelaySettings

    async def ignore(method: str, params: Any) -> None:
        pass

    class ClosedPeer:
        is_closed = True

        async def request(self, method: str, params: Any, timeout: float) -> Any:
            raise RelayError(PEER_DISCONNECTED, "closed")

    class OpenPeer:
        is_closed = False

        async def request(self, method: str, params: Any, timeout: float) -> Any:
            return {"sent": method}

    link = RelayLink(RelaySettings(relay="unix:/nonexistent/relay.sock", instance=INSTANCE, token="t"), "client", ignore)
    link._peer = ClosedPeer()  # type: ignore[assignment]
    link._set_state(True)
    with trio.move_on_after(0.2) as waited:
        await link.request("append_frame", {}, wait_for_connection=True)
    assert waited.cancelled_caught, "the request should wait while the peer is closed"

    async with trio.open_nursery() as nursery:
        answers: list[Any] = []

        async def waiting_request() -> None:
            answers.append(await link.request("append_frame", {}, wait_for_connection=True))

        nursery.start_soon(waiting_request)
        await trio.testing.wait_all_tasks_blocked()
        link._peer = OpenPeer()  # type: ignore[assignment]  # the link reconnected
        link._set_state(True)
    assert answers == [{"sent": "append_frame"}]


# == end to end: one sandbox that stops reading ========================================================


async def stalled_sandbox(deployment: Deployment, token: str) -> trio.SocketStream:
    """A raw client connection that says hello, then never reads (a small receive buffer)."""
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect(str(deployment.socket))
    stream = trio.SocketStream(sock)
    params = {"protocol": PROTOCOL_VERSION, "role": "client", "instance": INSTANCE, "token": token}
    await stream.send_all(line({"jsonrpc": "2.0", "id": 0, "method": "hello", "params": params}))
    buffer = b""
    with trio.fail_after(EVENT_TIMEOUT):
        while not any(json.loads(x).get("id") == 0 for x in buffer.splitlines() if x.endswith(b"}")):
            buffer += await stream.receive_some(65536)
    return stream


BIG_TOOL = {"name": "big", "description": "d" * 100_000, "inputSchema": {"type": "object"}}


async def test_a_stalled_sandbox_delays_no_other_caller_and_is_closed_after_the_write_deadline(
    deployment: Deployment,
) -> None:
    from oubliette_server.features.toolsets import FunctionToolset, ToolSpec

    write_timeout = 5.0
    async with in_process(deployment, relay_write_timeout=write_timeout) as proc:
        stalled = await stalled_sandbox(deployment, proc.server.tokens.token_for(INSTANCE))
        [connection] = proc.server.clients.of_instance(INSTANCE)
        caller_a, _ = proc.open_caller()
        caller_b, _ = proc.open_caller()
        # The instance may use toolset "ts", which comes back (is pushed) while the sandbox stalls.
        ping = [ToolSpec(name="ping")]
        await proc.server.register_toolset("ts", "ts", ping, ref=FunctionToolset({"ping": lambda arguments: trio.sleep(0)}))
        await proc.server.update_allowed_toolsets(INSTANCE, ["ts"])
        await proc.server.unregister_toolset("ts")

        # Fill the stalled connection's socket: each declaration is pushed to it (~100 kB each).
        for i in range(8):
            with trio.fail_after(1):
                await proc.declare(caller_a, f"a{i}", "a", [BIG_TOOL])

        # Another caller's session_message with caller tools, and a toolset registration:
        # each is pushed to the stalled connection too, and neither waits for it.
        with trio.fail_after(1):
            await proc.declare(caller_b, "b1", "b", [{"name": "other", "inputSchema": {"type": "object"}}])
        with trio.fail_after(1):
            await proc.server.register_toolset("ts", "ts", ping, ref=FunctionToolset({"ping": lambda arguments: trio.sleep(0)}))
        assert proc.server.clients.of_instance(INSTANCE) == [connection], "still connected: the calls did not wait for it"
        stalled_since = trio.current_time()

        # The stalled connection is closed once a write has waited the write deadline (the
        # server's client set signals each change).
        clients = proc.server.clients
        with trio.fail_after(write_timeout + EVENT_TIMEOUT):
            await clients.changed.until(lambda: not clients.of_instance(INSTANCE))
        assert "did not finish within 5 s" in (connection._peer.close_reason or "")
        with trio.fail_after(EVENT_TIMEOUT):  # what was sent before the end, then EOF
            while await stalled.receive_some(1 << 20):
                pass
        await stalled.aclose()
        assert trio.current_time() - stalled_since < write_timeout + EVENT_TIMEOUT


def test_client_request_deadline_is_settable_and_covers_a_caller_tools_own_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from oubliette_client.sandbox_tools import SandboxTools
    from oubliette_client.settings import add_relay_arguments, settings_from_args
    from protocol import CallerToolSpec

    parser = argparse.ArgumentParser()
    add_relay_arguments(parser)
    args = parser.parse_args(["--instance", "box1", "--token", "t"])
    assert settings_from_args(parser, args).request_timeout == 120
    monkeypatch.setenv("OUBLIETTE_REQUEST_TIMEOUT", "7.5")
    settings = settings_from_args(parser, args)
    assert settings.request_timeout == 7.5
    assert settings.environment()["OUBLIETTE_REQUEST_TIMEOUT"] == "7.5"  # passed on to the agent's client
    monkeypatch.setenv("OUBLIETTE_REQUEST_TIMEOUT", "soon")
    with pytest.raises(SystemExit):
        settings_from_args(parser, args)

    tools = SandboxTools(settings)
    assert tools.link.request_timeout == 7.5
    tools.registry.set_caller_tools("app", [
        CallerToolSpec(name="quick", inputSchema={"type": "object"}),
        CallerToolSpec(name="slow", inputSchema={"type": "object"}, timeout_ms=300_000),
    ])
    quick, slow = tools.registry.resolve("app_quick"), tools.registry.resolve("app_slow")
    assert quick is not None and slow is not None
    assert tools._caller_tool_deadline(quick) == 7.5
    assert tools._caller_tool_deadline(slow) == 310


def test_a_relay_setting_may_list_several_servers() -> None:
    """`--relay A,B` (servers of one deployment): each address is checked, the agents' clients
    get the same list, and the link starts with the first."""
    import argparse

    from oubliette_client.relay_link import RelayLink
    from oubliette_client.settings import add_relay_arguments, settings_from_args

    parser = argparse.ArgumentParser()
    add_relay_arguments(parser)
    args = parser.parse_args(["--instance", "box1", "--token", "t", "--relay", "unix:/run/a.sock, tcp:10.0.0.2:7700"])
    settings = settings_from_args(parser, args)
    assert settings.environment()["OUBLIETTE_RELAY"] == "unix:/run/a.sock, tcp:10.0.0.2:7700"

    async def ignore(method: str, params: Any) -> None:
        pass

    link = RelayLink(settings, "guest", ignore)
    assert link.addresses == ["unix:/run/a.sock", "tcp:10.0.0.2:7700"] and link.address == "unix:/run/a.sock"
    with pytest.raises(SystemExit):
        settings_from_args(parser, parser.parse_args(["--instance", "box1", "--token", "t", "--relay", "unix:/a.sock,nowhere"]))
