"""Each HTTP/1.1 connection of the server's listeners: h11's parser and serializer driven by the
connection's task, each request's ASGI app in a task beside it.

Why not hypercorn's `TCPServer`: its path of a request is layers of events and awaits (its
protocol wrapper, `H11Protocol`, `HTTPStream`, a memory channel and a task per request, a lock
per write): about 14 passes of Trio's scheduler and 0.36–0.39 ms of server CPU for a bare JSON
answer, where h11 under one task answers for about 0.15 ms (`python bench/probe_bare_hypercorn.py
--server h11`). The server speaks HTTP/1.1 only (no TLS, HTTP/2 or WebSocket: a proxy in front
terminates those), so this module is the whole of what its listeners need; hypercorn still binds
the sockets and runs the ASGI lifespan (`HttpApi.serve`).

What a connection does (as hypercorn's did, the same bytes on the wire but for the `server`
header, which is not sent):
- reads with no deadline of its own: the body deadline (`DrainRequestBody`) and the keep-alive
  timer (`ConnectionWatch`, the connection's one other task) bound what a client may hold;
- answers a request h11 refuses (a head over `MAX_HEAD_BYTES`, bad syntax) with h11's status
  (431, 400, ...), `content-length: 0`, and closes;
- runs the app in a task of its own per request, reading the body ahead of it by at most
  `BODY_AHEAD_BYTES`; the app's `receive` gives `http.disconnect` once the client has gone or the
  response has ended;
- writes a response's head at `http.response.start` (unless the app holds it for its body,
  `GuardedStream.hold_next_send`), and the last body with the end of the message in one write;
- answers 500 (empty, `connection: close`) when the app ends without starting a response, and
  closes when it ends with the response unfinished or the request's body unread;
- says `connection: close` on its `max_requests`-th response, and closes after it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any
from urllib.parse import unquote
from wsgiref.handlers import format_date_time

import h11
import trio

from .connection_limits import HOLD_NEXT_SEND_STATE, WATCH_STATE, ConnectionWatch, GuardedStream

log = logging.getLogger("oubliette.server.http")

#: The most a request's head may take (h11's `max_incomplete_event_size`, hypercorn's default):
#: a larger one is answered 431.
MAX_HEAD_BYTES = 16 * 1024
#: Bytes of a request's body read ahead of the app: past them the connection stops reading until
#: the app takes them, so a client cannot make the server hold a body the app does not read.
BODY_AHEAD_BYTES = 64 * 1024
#: The most one read takes from the socket.
MAX_RECV = 64 * 1024
#: After answering a request it refuses, the connection reads on (and drops) at most this many
#: bytes, for at most this long, before it closes (`HTTP11Connection._linger`).
LINGER_BYTES = 1024 * 1024
LINGER_SECONDS = 1.0


class _Date:
    """The `date` header's value, formatted once a second."""

    second = -1
    value = b""

    @classmethod
    def now(cls) -> bytes:
        """The current second's `date` value."""
        second = int(time.time())
        if second != cls.second:
            cls.second, cls.value = second, format_date_time(second).encode("ascii")
        return cls.value


class Exchange:
    """One request on a connection and its response: the app's `receive` and `send`, the body the
    connection has read for it, and how far the response has got."""

    def __init__(self, connection: HTTP11Connection, scope: dict[str, Any]) -> None:
        self.connection = connection
        self.scope = scope
        self.started = False
        """The app sent `http.response.start`."""
        self.complete = False
        """The whole response is written (or would have been, to a client that left)."""
        self.gone = False
        """The client went away (or the connection broke): `receive` says `http.disconnect`, sends write nothing."""
        self._suppress_body = scope["method"] == "HEAD"
        self._body = bytearray()
        self._body_read = False  # the request's end is read
        self._end_given = False  # ... and given to the app
        self._changed = trio.Event()
        self._taken = trio.Event()

    # The connection's side.

    def body_read(self, data: bytes) -> None:
        """A part of the request's body came."""
        self._body += data
        self._changed.set()

    def end_read(self) -> None:
        """The request's body is whole."""
        self._body_read = True
        self._changed.set()

    def leave(self) -> None:
        """The client went away, or the response has ended: no more body, no more writes."""
        self.gone = True
        self._changed.set()
        self._taken.set()

    async def body_taken(self) -> None:
        """Wait until the app has taken the body read ahead of it down to `BODY_AHEAD_BYTES`."""
        while len(self._body) > BODY_AHEAD_BYTES and not self.gone:
            self._taken = trio.Event()
            await self._taken.wait()

    # The app's side.

    async def receive(self) -> dict[str, Any]:
        """ASGI `receive`: the body read so far (`more_body` until its end), then `http.disconnect`
        once the client has gone or the response has ended."""
        while True:
            if self._body or (self._body_read and not self._end_given):
                body = bytes(self._body)
                self._body.clear()
                self._taken.set()
                self._end_given = self._body_read
                return {"type": "http.request", "body": body, "more_body": not self._body_read}
            if self.gone or self.complete:
                return {"type": "http.disconnect"}
            self._changed = trio.Event()
            await self._changed.wait()

    async def send(self, message: dict[str, Any]) -> None:
        """ASGI `send` of `http.response.start` and `http.response.body`; nothing is written once
        the client has gone (as a write to a closed connection would not be)."""
        kind = message["type"]
        connection = self.connection
        if kind == "http.response.start" and not self.started:
            self.started = True
            status = int(message["status"])
            self._suppress_body = self._suppress_body or 100 <= status < 200 or status in (204, 304)
            head: Any = h11.Response(status_code=status, headers=[*message.get("headers", ()), *connection.added_headers()])
            data = b"" if self.gone else connection.serialize(head)
        elif kind == "http.response.body" and self.started and not self.complete:
            body = message.get("body", b"")
            data = b""
            if not self.gone and body and not self._suppress_body:
                data = connection.serialize(h11.Data(data=body))
            if not message.get("more_body", False):
                self.complete = True
                connection.stream.release_hold()  # a response's last write is never held
                if not self.gone:
                    data += connection.serialize(h11.EndOfMessage())
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r} (response started: {self.started}, ended: {self.complete})")
        await connection.write(data)


class HTTP11Connection:
    """One client's HTTP/1.1 connection over a `GuardedStream` (the module's docstring says what it does).

    Needs: the ASGI app, the stream, the lifespan's state (each request's scope gets a copy, with
    the connection's `ConnectionWatch` under `WATCH_STATE` and the stream's `hold_next_send` under
    `HOLD_NEXT_SEND_STATE`), the keep-alive seconds and the requests a connection may carry.
    Owns: the stream (closed when `run` returns) and its tasks: the reading (`run`'s), the
    keep-alive timer, the app of the request being answered.
    Cancellation: the app is cancelled and the stream closed.
    """

    def __init__(
        self, app: Any, stream: GuardedStream, state: dict[str, Any], *, keep_alive_timeout: float, max_requests: int,
    ) -> None:
        self.app = app
        self.stream = stream
        self.max_requests = max_requests
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.watch = ConnectionWatch(self, keep_alive_timeout)
        self.state = {**state, WATCH_STATE: self.watch, HOLD_NEXT_SEND_STATE: stream.hold_next_send}
        self.exchange: Exchange | None = None
        self.requests = 0
        self.closed = False
        self._cycle_ended = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._client: tuple[str, int] | None = None
        self._server: tuple[str, int] | None = None

    async def run(self) -> None:
        """Answer the client's requests until it leaves, the connection breaks, idles past the
        keep-alive or is closed after a response; then close the stream."""
        try:
            socket = self.stream.socket
            self._client = _address(socket.getpeername())
            self._server = _address(socket.getsockname())
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self.watch.start(nursery)
                try:
                    await self._read_requests()
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
                finally:
                    self.watch.close()
                    if self.exchange is not None:
                        self.exchange.leave()
        except OSError:
            pass  # the client was gone before its addresses could be read
        finally:
            await self.close()

    async def _read_requests(self) -> None:
        """Feed h11 what the client sends and act on its events; returns when the reading is over."""
        while not self.closed:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as error:
                await self._refuse(error.error_status_hint)
                return
            exchange = self.exchange
            if event is h11.NEED_DATA:
                if self.h11.they_are_waiting_for_100_continue:
                    await self.write(self.serialize(h11.InformationalResponse(status_code=100, headers=self.added_headers())))
                self.h11.receive_data(bytes(await self.stream.receive_some(MAX_RECV)))
            elif event is h11.PAUSED:  # the client sent its next request before this one's answer
                await self._cycle_ended.wait()
            elif isinstance(event, h11.Request):
                self._begin(event)
            elif isinstance(event, h11.Data) and exchange is not None:
                exchange.body_read(bytes(event.data))
                await exchange.body_taken()
            elif isinstance(event, h11.EndOfMessage) and exchange is not None:
                exchange.end_read()
            elif isinstance(event, h11.ConnectionClosed):
                return

    def _begin(self, request: h11.Request) -> None:
        """A request's head came: start its app."""
        assert self._nursery is not None
        self.requests += 1
        self.watch.busy()
        path, _, query = request.target.partition(b"?")
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": request.http_version.decode("ascii"),
            "method": request.method.decode("ascii").upper(),
            "scheme": "http",
            "path": unquote(path.decode("ascii")),
            "raw_path": path,
            "query_string": query,
            "root_path": "",
            "headers": list(request.headers),
            "client": self._client,
            "server": self._server,
            "state": self.state.copy(),
            "extensions": {},
        }
        self.exchange = Exchange(self, scope)
        self._cycle_ended = trio.Event()
        self._nursery.start_soon(self._answer, self.exchange)

    async def _answer(self, exchange: Exchange) -> None:
        """Run the app on one request, then end its cycle (`_ended`)."""
        try:
            await self.app(exchange.scope, exchange.receive, exchange.send)
        except Exception:
            log.exception("the HTTP app failed on a request")
        await self._ended(exchange)

    async def _ended(self, exchange: Exchange) -> None:
        """The app has returned: answer 500 if it never started a response; keep the connection for
        the next request if both sides are done with this one, else close it."""
        if not exchange.started and not exchange.gone:
            exchange.started = exchange.complete = True
            await self.write(self._empty_answer(500))
        exchange.leave()
        self.exchange = None
        if (exchange.complete and not self.closed
                and self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE):
            self.h11.start_next_cycle()
            self.watch.idle()
            self._cycle_ended.set()
        else:
            await self.close()

    async def _refuse(self, status: int) -> None:
        """The client sent what h11 cannot take: answer `status` if no response has begun, and close."""
        exchange = self.exchange
        if exchange is not None:
            exchange.leave()
        if self.h11.our_state in (h11.IDLE, h11.SEND_RESPONSE) and (exchange is None or not exchange.started):
            await self.write(self._empty_answer(status))
            await self._linger()
        await self.close()

    async def _linger(self) -> None:
        """Half-close, then read what the client still sends (at most `LINGER_BYTES`, for at most
        `LINGER_SECONDS`): closing with its bytes unread would reset the connection, and the
        client could lose the answer it is owed."""
        left = LINGER_BYTES
        with trio.move_on_after(LINGER_SECONDS), contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
            await self.stream.send_eof()
            while left > 0 and (data := await self.stream.receive_some(MAX_RECV)):
                left -= len(data)

    def _empty_answer(self, status: int) -> bytes:
        """An answer of the connection's own (a refused request, an app that did not answer): `status`,
        no body, and the connection closes after it."""
        head = h11.Response(status_code=status, headers=[(b"content-length", b"0"), (b"connection", b"close"), (b"date", _Date.now())])
        return self.serialize(head) + self.serialize(h11.EndOfMessage())

    def added_headers(self) -> list[tuple[bytes, bytes]]:
        """What the connection adds to each response head: `date`, and `connection: close` on the
        last request it takes."""
        if self.requests >= self.max_requests:
            return [(b"date", _Date.now()), (b"connection", b"close")]
        return [(b"date", _Date.now())]

    def serialize(self, event: Any) -> bytes:
        """h11's bytes for `event`; none once the client broke the protocol (h11's `ERROR`)."""
        try:
            return self.h11.send(event) or b""
        except h11.LocalProtocolError:
            if self.h11.their_state is h11.ERROR:
                return b""
            raise

    async def write(self, data: bytes) -> None:
        """Write `data` (nothing if empty, or once closed); a connection whose write fails is closed."""
        if not data or self.closed:
            return
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            await self.close()

    async def close(self) -> None:
        """Half-close after the write in progress, then close; once. The reading then ends."""
        if self.closed:
            return
        self.closed = True
        self._cycle_ended.set()
        try:
            with contextlib.suppress(trio.BrokenResourceError, trio.BusyResourceError, trio.ClosedResourceError, OSError):
                await self.stream.send_eof()
        finally:
            await trio.aclose_forcefully(self.stream)


def _address(address: Any) -> tuple[str, int] | None:
    """An address as ASGI's `client` and `server` give it: host and port, None for a Unix socket."""
    if isinstance(address, tuple):
        return address[0], address[1]
    return None
