"""The relay listener: sandboxes connect here (Unix socket by default, or TCP).

Each connection gets its own task and nursery. The first message must be
`hello`; after it, every request runs in its own task (no head-of-line
blocking) under a cancel scope that a `cancel` notification, or the end of the
connection, cancels. A protocol error (bad JSON, a frame over the limit) gets
an error object naming the problem and closes that connection only.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Protocol

import trio

from protocol import (
    PROTOCOL_VERSION,
    FrameWriter,
    LineReader,
    Notification,
    RelayAddress,
    RelayError,
    Request,
    Response,
    decode,
    errors,
    jsonrpc,
    messages,
    parse_message,
    structure,
    unstructure,
    validate_params,
)

from .auth import check_hello

log = logging.getLogger("oubliette.server.relay")

HELLO_TIMEOUT = 10.0
SERVER_VERSION = "0.1.0"


class RelayHost(Protocol):
    """What a relay connection needs from the server that accepted it."""

    def verify_token(self, instance: str, token: object) -> bool: ...
    async def relay_connection_opened(self, connection: "RelayConnection") -> None: ...
    def relay_connection_closed(self, connection: "RelayConnection") -> None: ...
    def relay_notification(self, connection: "RelayConnection", method: str, params: dict[str, Any]) -> bool: ...
    async def handle_relay_request(self, connection: "RelayConnection", method: str, params: dict[str, Any]) -> Any: ...
    def relay_request_started(self) -> None: ...
    def relay_request_finished(self) -> None: ...

    @property
    def guests(self) -> Any: ...


class RelayConnection:
    """One sandbox connection, bound to its instance (and session) after `hello`."""

    def __init__(self, server: RelayHost, stream: trio.abc.Stream, peer: str) -> None:
        self.server = server
        self.stream = stream
        self.peer = peer
        self.reader = LineReader(stream)
        self.writer = FrameWriter(stream)
        self.role: str | None = None
        self.instance: str | None = None
        self.session_key: str | None = None
        self._in_flight: dict[Any, trio.CancelScope] = {}
        self.router: Any = None  # the session's ToolRouter, for client connections
        self._nursery: trio.Nursery | None = None

    def __repr__(self) -> str:
        return f"<RelayConnection {self.role} {self.instance} {self.session_key or ''} {self.peer}>"

    # -- sending -------------------------------------------------------------------------

    async def notify(self, method: str, params: dict) -> None:
        try:
            await self.writer.send(jsonrpc.notification(method, params))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            log.debug("%r: notification %s dropped, connection gone", self, method)

    async def _reply(self, request_id: Any, result: Any = None, error: RelayError | None = None) -> None:
        message = jsonrpc.error_response(request_id, error) if error else jsonrpc.result_response(request_id, result)
        try:
            await self.writer.send(message)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            log.debug("%r: reply to %r dropped, connection gone", self, request_id)

    # -- lifecycle -----------------------------------------------------------------------

    def close_soon(self) -> None:
        """End this connection (e.g. a newer guest replaced it)."""
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                try:
                    if await self._handshake():
                        await self._read_loop()
                finally:
                    nursery.cancel_scope.cancel()
        except* (trio.BrokenResourceError, trio.ClosedResourceError) as group:
            # Raised inside the nursery, so wrapped in an ExceptionGroup (e.g. ECONNRESET from a killed peer).
            log.debug("%r: connection ended: %s", self, group.exceptions[0])
        finally:
            self.server.relay_connection_closed(self)
            with trio.CancelScope(shield=True):
                await self.stream.aclose()

    async def _read_message(self) -> Request | Response | Notification | None:
        line = await self.reader.read_line()
        if line is None:
            return None
        return parse_message(decode(line))

    async def _protocol_error(self, err: RelayError, request_id: Any = None) -> None:
        log.warning("%r: protocol error, closing: %s", self, err.message)
        await self._reply(request_id, error=err)

    async def _handshake(self) -> bool:
        """Read and answer `hello`; on any problem answer with an error and return False."""
        try:
            with trio.fail_after(HELLO_TIMEOUT):
                message = await self._read_message()
        except trio.TooSlowError:
            await self._protocol_error(RelayError(errors.INVALID_REQUEST, f"no hello within {HELLO_TIMEOUT:g} s"))
            return False
        except RelayError as err:
            await self._protocol_error(err)
            return False
        if message is None:
            return False
        if not isinstance(message, Request) or message.method != messages.HELLO:
            what = message.method if isinstance(message, (Request, Notification)) else "a response"
            request_id = message.id if isinstance(message, Request) else None
            await self._protocol_error(
                RelayError(errors.INVALID_REQUEST, f"the first message must be the request 'hello', got {what}"),
                request_id,
            )
            return False
        try:
            validate_params(messages.HELLO, message.params)
            hello = structure(message.params, messages.Hello)
            check_hello(hello, self.server.verify_token)
        except RelayError as err:
            await self._protocol_error(err, message.id)
            return False
        self.role, self.instance = hello.role, hello.instance
        self.session_key = hello.session
        await self.server.relay_connection_opened(self)
        await self._reply(
            message.id,
            unstructure(messages.HelloResult(
                protocol=PROTOCOL_VERSION, server_version=SERVER_VERSION,
                instance=hello.instance, session=hello.session,
            )),
        )
        log.info("%r: connected", self)
        if self.role == "guest":
            assert self._nursery is not None
            self._nursery.start_soon(self.server.guests.deliver, self)
        return True

    async def _read_loop(self) -> None:
        assert self._nursery is not None
        while True:
            try:
                message = await self._read_message()
            except RelayError as err:
                await self._protocol_error(err)
                return
            if message is None:
                return
            if isinstance(message, Request):
                if message.id in self._in_flight:
                    await self._reply(message.id, error=RelayError(
                        errors.INVALID_REQUEST, f"request id {message.id!r} is already in flight"))
                    continue
                scope = trio.CancelScope()
                self._in_flight[message.id] = scope
                self._nursery.start_soon(self._serve_request, message, scope)
            elif isinstance(message, Notification):
                await self._on_notification(message)
            else:
                log.debug("%r: ignoring a response to id %r", self, message.id)

    async def _on_notification(self, message: Notification) -> None:
        try:
            if message.method == messages.CANCEL:
                validate_params(message.method, message.params)
                scope = self._in_flight.get(structure(message.params, messages.Cancel).id)
                if scope is not None:
                    scope.cancel()
            elif not self.server.relay_notification(self, message.method, message.params):
                log.warning("%r: ignoring unknown notification %r", self, message.method)
        except RelayError as err:
            log.warning("%r: bad %s notification: %s", self, message.method, err.message)

    async def _serve_request(self, request: Request, scope: trio.CancelScope) -> None:
        self.server.relay_request_started()
        try:
            result: Any = None
            error: RelayError | None = None
            with scope:
                try:
                    result = await self.server.handle_relay_request(self, request.method, request.params)
                except RelayError as err:
                    error = err
                except Exception as exc:  # a bug must not take the connection down
                    log.exception("%r: %s failed", self, request.method)
                    error = RelayError(errors.INTERNAL_ERROR, f"internal error: {exc}")
            if scope.cancelled_caught:
                error = RelayError(errors.CANCELLED, f"request {request.id!r} was cancelled")
            # Reply outside the request's scope: a `cancel` that crosses the reply must not cut
            # the frame in half (that would break the writer and every later reply).
            await self._reply(request.id, result, error)
        finally:
            self._in_flight.pop(request.id, None)
            self.server.relay_request_finished()


class RelayListener:
    """Accepts sandbox connections on one address."""

    def __init__(self, server: RelayHost, address: RelayAddress) -> None:
        self.server = server
        self.address = address

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await self._open()
        log.info("relay listening on %s", self.address)
        try:
            await trio.serve_listeners(self._handle, listeners, task_status=task_status)
        finally:
            if self.address.kind == "unix":
                with trio.CancelScope(shield=True):
                    try:
                        os.unlink(self.address.path)
                    except FileNotFoundError:
                        pass

    async def _open(self) -> list[trio.SocketListener]:
        if self.address.kind == "tcp":
            return await trio.open_tcp_listeners(self.address.port, host=self.address.host)
        path = self.address.path
        os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)
        if os.path.exists(path):
            await self._remove_stale_socket(path)
        sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # created 0600: only the owner may connect
        try:
            await sock.bind(path)
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o600)
        sock.listen(128)
        return [trio.SocketListener(sock)]

    @staticmethod
    async def _remove_stale_socket(path: str) -> None:
        try:
            probe = await trio.open_unix_socket(path)
        except OSError:
            os.unlink(path)
            return
        await probe.aclose()
        raise OSError(f"relay socket {path} is in use by another server")

    async def _handle(self, stream: trio.abc.Stream) -> None:
        peer = "unix" if self.address.kind == "unix" else _peer_name(stream)
        try:
            await RelayConnection(self.server, stream, peer).run()
        except Exception:  # one connection's failure must never take the listener (and the server) down
            log.exception("relay connection from %s failed", peer)


def _peer_name(stream: trio.abc.Stream) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]  # type: ignore[attr-defined]
        return f"{host}:{port}"
    except Exception:
        return "tcp"
