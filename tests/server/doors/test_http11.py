"""Each HTTP/1.1 connection alone (`HTTP11Connection`, doors/http11.py), over a socket pair with a
small ASGI app: what the client is answered when it breaks the protocol, when the app fails or
leaves its response unfinished, keep-alive and its limit, bodies the app does not read, a client
that leaves, `Expect: 100-continue`, and the writes a response takes."""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import h11
import pytest
import trio
import trio.testing

from oubliette_server.doors import connection_limits
from oubliette_server.doors.connection_limits import GuardedStream, hold_next_send
from oubliette_server.doors.http11 import BODY_AHEAD_BYTES, MAX_RECV, HTTP11Connection

App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


async def answer_ok(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Read the whole body, answer `ok <method> <path> <body length>` as a sized body."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    text = f"ok {scope['method']} {scope['path']} {len(body)}".encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(text)).encode())]})
    await send({"type": "http.response.body", "body": text})


class Client:
    """The client's end of the socket pair; it writes raw requests and reads the answers with h11."""

    def __init__(self, sock: trio.socket.SocketType) -> None:
        self.stream = trio.SocketStream(sock)
        self.h11 = self._reader("GET")

    @staticmethod
    def _reader(method: str, data: bytes = b"") -> h11.Connection:
        """An h11 client that has sent a `method` request (the server's answer is framed by it)."""
        reader = h11.Connection(h11.CLIENT)
        reader.send(h11.Request(method=method, target="/", headers=[("host", "x")]))
        reader.send(h11.EndOfMessage())
        if data:  # b"" would say the connection closed
            reader.receive_data(data)
        return reader

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def event(self) -> Any:
        """The next event of the server's answer (bounded: the test fails, not hangs)."""
        with trio.fail_after(10):
            while (event := self.h11.next_event()) is h11.NEED_DATA:
                self.h11.receive_data(await self.stream.receive_some(1 << 16))
        return event

    async def answer(self, next_method: str = "GET") -> tuple[h11.Response, bytes]:
        """The next whole answer, its head and body; the one after it answers a `next_method` request."""
        head = await self.event()
        assert isinstance(head, h11.Response), head
        body = b""
        while not isinstance(event := await self.event(), h11.EndOfMessage):
            body += event.data
        self.h11 = self._reader(next_method, self.h11.trailing_data[0])
        return head, body

    async def rest(self) -> bytes:
        """Everything the server writes until it closes the connection."""
        got = bytearray()
        with trio.fail_after(10):
            while chunk := await self.stream.receive_some(1 << 16):
                got.extend(chunk)
        return bytes(got)


@asynccontextmanager
async def connection(app: App, *, max_requests: int = 100) -> AsyncIterator[tuple[Client, HTTP11Connection]]:
    """A connection serving `app` on one end of a socket pair, and the client on the other; the
    connection has ended when the block does."""
    ours, theirs = trio.socket.socketpair()
    served = HTTP11Connection(app, GuardedStream(trio.SocketStream(ours), 5.0), {}, keep_alive_timeout=30, max_requests=max_requests)
    client = Client(theirs)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(served.run)
        yield client, served
        await client.stream.aclose()
    assert served.closed


async def test_a_request_h11_refuses_is_answered_with_its_status_and_the_connection_closed() -> None:
    """Bad syntax gets 400, a head still incomplete past `MAX_HEAD_BYTES` 431: empty, `connection: close`, then the
    connection closes; the app is never called."""
    called: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        called.append(scope["path"])

    for request, status in [
        (b"GET / HTTP/1.1\r\nhost: x\r\nno colon here\r\n\r\n", b"400"),
        (b"GET / HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 100_000 + b"\r\n\r\n", b"431"),
    ]:
        async with connection(app) as (client, served):
            await client.send(request)
            answer = await client.rest()
            assert answer.startswith(b"HTTP/1.1 " + status), answer
            assert b"content-length: 0\r\n" in answer and b"connection: close\r\n" in answer
    assert called == []


async def test_an_app_that_fails_before_answering_gets_a_500_one_log_line_and_a_close(caplog: pytest.LogCaptureFixture) -> None:
    """The app raising before `http.response.start` (or returning without one) answers 500 and closes."""

    async def failing(scope: dict[str, Any], receive: Any, send: Any) -> None:
        raise RuntimeError("a bug")

    async def silent(scope: dict[str, Any], receive: Any, send: Any) -> None:
        pass

    for app, lines in [(failing, ["the HTTP app failed on a request"]), (silent, [])]:
        caplog.clear()
        async with connection(app) as (client, _):
            await client.send(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            answer = await client.rest()
        assert answer.startswith(b"HTTP/1.1 500 ") and answer.endswith(b"\r\n\r\n") and b"connection: close" in answer
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == lines


async def test_an_app_that_ends_with_its_response_unfinished_closes_the_connection() -> None:
    """A chunked response the app leaves without its end: the client gets what was written, then the
    close (no terminating chunk, so it can tell the response was cut short)."""

    async def cut_short(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"part", "more_body": True})

    async with connection(cut_short) as (client, _):
        await client.send(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        answer = await client.rest()
    assert answer.startswith(b"HTTP/1.1 200 ") and b"transfer-encoding: chunked" in answer.lower()
    assert answer.endswith(b"\r\n\r\n4\r\npart\r\n")


async def test_requests_on_one_connection_are_answered_in_order_and_the_last_allowed_says_close() -> None:
    """Keep-alive: three requests sent at once (pipelined), with `max_requests=2`, get two answers in
    order, the second with `connection: close`, then the close; a HEAD's answer has no body."""
    async with connection(answer_ok, max_requests=2) as (client, _):
        await client.send(
            b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n\r\nabc"
            b"HEAD /b HTTP/1.1\r\nhost: x\r\n\r\n"
            b"GET /c HTTP/1.1\r\nhost: x\r\n\r\n"
        )
        first, body = await client.answer(next_method="HEAD")
        assert body == b"ok POST /a 3" and (b"connection", b"close") not in first.headers
        second, body = await client.answer()
        assert body == b"" and (b"connection", b"close") in second.headers
        assert dict(second.headers)[b"content-length"] == b"12"  # what a GET would have had: "ok HEAD /b 0"
        assert client.h11.trailing_data[0] == b"" and await client.rest() == b""


async def test_a_body_the_app_does_not_take_is_read_no_further_than_the_bound() -> None:
    """A client sending a large body to an app that has not read it: the connection stops reading at
    `BODY_AHEAD_BYTES` (and one read) ahead of the app, and goes on as the app takes it."""
    size = 4 * 1024 * 1024
    started = trio.Event()
    go = trio.Event()

    async def slow(scope: dict[str, Any], receive: Any, send: Any) -> None:
        started.set()
        await go.wait()
        await answer_ok(scope, receive, send)

    async with connection(slow) as (client, served):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.send, b"POST /big HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % size + b"x" * size)
            await started.wait()
            await trio.testing.wait_all_tasks_blocked()
            assert served.exchange is not None
            held = len(served.exchange._body)
            assert BODY_AHEAD_BYTES < held <= BODY_AHEAD_BYTES + MAX_RECV
            go.set()
        _, body = await client.answer()
        assert body == b"ok POST /big %d" % size


async def test_the_app_hears_the_client_leave() -> None:
    """After the body, `receive` waits; the client closing makes it `http.disconnect`."""
    heard: list[str] = []

    async def waits(scope: dict[str, Any], receive: Any, send: Any) -> None:
        heard.append((await receive())["type"])
        heard.append((await receive())["type"])

    async with connection(waits) as (client, _):
        await client.send(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        await trio.testing.wait_all_tasks_blocked()
        assert heard == ["http.request"]
    assert heard == ["http.request", "http.disconnect"]


async def test_a_client_that_expects_100_continue_gets_it_before_sending_its_body() -> None:
    """`Expect: 100-continue`: the interim answer comes before the body is sent, then the answer."""
    async with connection(answer_ok) as (client, _):
        await client.send(b"PUT /u HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: 2\r\n\r\n")
        interim = await client.event()
        assert isinstance(interim, h11.InformationalResponse) and interim.status_code == 100
        await client.send(b"hi")
        _, body = await client.answer()
        assert body == b"ok PUT /u 2"


async def test_a_sized_answer_is_one_write_and_a_streamed_answer_ends_with_its_last_part(monkeypatch: pytest.MonkeyPatch) -> None:
    """A head held for its body (`hold_next_send`) and a sized body with its end: one write. A
    chunked answer: the head, each part, the last part with the end of the body; a hold before the
    last part is not kept (it would never be sent)."""

    async def sized(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        hold_next_send(scope)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def streamed(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"one", "more_body": True})
        hold_next_send(scope)
        await send({"type": "http.response.body", "body": b"two"})

    writes: list[bytes] = []

    def write_at_once(fd: int, data: bytes | bytearray | memoryview) -> int:
        writes.append(bytes(data))
        return os.write(fd, data)

    monkeypatch.setattr(connection_limits, "write_at_once", write_at_once)
    for app, expected in [(sized, b"ok"), (streamed, b"onetwo")]:
        writes.clear()
        async with connection(app) as (client, _):
            await client.send(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            _, body = await client.answer()
        assert body == expected
        assert len(writes) == (1 if app is sized else 3), writes
        assert writes[-1].endswith(b"ok" if app is sized else b"3\r\ntwo\r\n0\r\n\r\n")
