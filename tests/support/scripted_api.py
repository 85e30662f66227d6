"""The HTTP side of the scripted model stand-ins (tests/support/fake_anthropic.py, tests/support/fake_gemini.py).

A real agent CLI runs offline against one of them on 127.0.0.1: each consumes a script of
replies, one per main-loop request, and records every request body, so a test asserts on what
the "model" was shown. This base holds what the two share: the script, and a small HTTP/1.1
server (h11: keep-alive, chunked streaming; one Trio task per connection, all in the server's
nursery). A subclass answers requests in its API's own shapes (`_respond`).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Generic, TypeVar, Union

import h11
import trio

Part = TypeVar("Part")
MAX_REQUEST_BYTES = 64 * 1024 * 1024
"""An agent CLI sends the whole conversation (system prompt, tool schemas) in every request."""


class ScriptedAPI(Generic[Part]):
    """The script and the server: `replies` are consumed one per main-loop request.

    A reply is a list of parts (text, tool calls) or a function of the request that returns
    one (to answer with what an earlier tool result said). Start the server with
    `await nursery.start(api.serve)`; `url` is then its base URL. When the script is used up,
    a further request gets `exhausted`, which no test expects.
    """

    def __init__(self, replies: list[Union[list[Part], Callable[[dict[str, Any]], list[Part]]]]) -> None:
        self.replies = list(replies)
        self.requests: list[dict[str, Any]] = []
        """Every model request body, in arrival order."""
        self.main_requests: list[dict[str, Any]] = []
        """The requests that consumed a scripted reply."""
        self.errors: list[Exception] = []
        """What the script's reply functions raised (their assertions on what the model saw)."""
        self.url = ""

    def next_reply(self, body: dict[str, Any], exhausted: list[Part], failed: Callable[[str], list[Part]]) -> list[Part]:
        """The script's next reply to a main-loop request `body` (recorded as such)."""
        self.main_requests.append(body)
        if not self.replies:
            return exhausted
        reply = self.replies.pop(0)
        if not callable(reply):
            return reply
        try:
            return reply(body)
        except Exception as error:  # a failed expectation of the test's script: kept for the test
            self.errors.append(error)
            return failed(f"(script failed: {error!r})")

    async def serve(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on 127.0.0.1 (a free port) until cancelled; `task_status.started(url)`."""
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        task_status.started(self.url)
        await trio.serve_listeners(self._connection, listeners)

    async def _connection(self, stream: trio.SocketStream) -> None:
        """One keep-alive connection: requests one after the other until the peer closes."""
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_BYTES)
        try:
            while True:
                request, body = await self._read_request(conn, stream)
                if request is None:
                    return
                await self._respond(conn, stream, request, body)
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.RemoteProtocolError):
            return
        finally:
            await trio.aclose_forcefully(stream)

    async def _read_request(self, conn: h11.Connection, stream: trio.SocketStream) -> tuple[h11.Request | None, bytes]:
        request: h11.Request | None = None
        body = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body.extend(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return request, bytes(body)
            elif isinstance(event, h11.ConnectionClosed):
                return None, b""

    async def _respond(self, conn: h11.Connection, stream: trio.SocketStream, request: h11.Request, body: bytes) -> None:
        raise NotImplementedError

    async def _stream(self, conn: h11.Connection, stream: trio.SocketStream, events: list[bytes]) -> None:
        """A 200 answer of server-sent events."""
        await self._send(conn, stream, h11.Response(status_code=200, headers=[
            ("content-type", "text/event-stream"), ("cache-control", "no-cache")]))
        for event in events:
            await self._send(conn, stream, h11.Data(data=event))
        await self._send(conn, stream, h11.EndOfMessage())

    async def _json(self, conn: h11.Connection, stream: trio.SocketStream, status: int, value: Any, *, head: bool = False) -> None:
        data = json.dumps(value).encode()
        await self._send(conn, stream, h11.Response(status_code=status, headers=[
            ("content-type", "application/json"), ("content-length", str(len(data)))]))
        if not head:
            await self._send(conn, stream, h11.Data(data=data))
        await self._send(conn, stream, h11.EndOfMessage())

    async def _send(self, conn: h11.Connection, stream: trio.SocketStream, event: Any) -> None:
        data = conn.send(event)
        if data:
            await stream.send_all(data)
