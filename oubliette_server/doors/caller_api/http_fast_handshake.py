"""A handshake-era (2025-11-25) caller's `caller_tool_response` and `caller_tool_progress` on `/mcp`,
answered beside the MCP SDK: the twin of `http_fast.py` (`FastHttpCalls`, the 2026-07-28 era) for
a caller with an `Mcp-Session-Id`, and of the stdio line router's handshake-era calls (stdio.py).

Why: a relayed call for such a caller is the event on its standalone GET stream and one POST
of the answer, and that POST went through Starlette's routing, the SDK's session manager, the
session's transport (an `EventSourceResponse` with its ping, disconnect and exit-signal tasks,
two memory streams), the session's dispatcher and runner (pydantic params, middlewares) and back
through the transport's message router: most of the server's CPU per relayed call, all of it on
the call's path (docs/SCALING.md, "A caller over HTTP"). The answer is one POST of a fixed shape
on a session that is already live, so this ASGI app, in front of `FastHttpCalls`, reads it, runs
the same checks with the SDK's own functions, the same call (`call_as_caller`) and writes the
bytes the SDK's transport would.

A request is taken only when all of these hold; any other request goes on unchanged (its body,
once read here, replayed), so every refusal, an unknown, closed or idle-expired session
included, is the SDK's:

- a POST to `/mcp` with an `Mcp-Session-Id` the SDK's session manager holds, for a transport
  that is not terminated nor expiring, opened by the same credential (the manager's owner
  check), in SSE mode with no event store (so the SDK's answer has no event ids nor priming
  event), whose caller made its first call through the SDK (so its `ServerSession` and its
  negotiated version are known, the handshake done); an `MCP-Protocol-Version` absent or of
  the handshake era (the manager's era routing);
- the SDK's transport security (`TransportSecurityMiddleware`: Content-Type, Host, Origin), its
  Content-Type and Accept checks (JSON and SSE), a body within the SDK's limit;
- the body is `{"jsonrpc": "2.0", "id": <string or integer>, "method": "tools/call", "params":
  {"name": ..., "arguments": {...}, "_meta"?: {...}}}` with no other keys, without the 2026-07-28
  envelope, and the SDK's surface validation of the params passes;
- the tool is `caller_tool_response` without `wait` (a wait's events ride its request: the SDK's)
  or `caller_tool_progress`.

The answer is the SDK transport's: its `EventSourceResponse` headers with the session id, then
the response as one SSE `event: message` (the SDK's `_create_event_data`, sse-starlette's
encoding), a keepalive ping as sse-starlette writes one if the call outlasts its interval, and
the end. The call's result is shaped by the SDK's runner (`ServerRunner._serialize`) and an
exception becomes the error the SDK's dispatcher writes. As on the SDK's path a client that goes
away does not cancel the call (its answer is stored, then dropped). A `notifications/cancelled`
on the session for a call taken here cancels it, and it is answered with the error the SDK's
transport writes for a cancelled request (`REQUEST_CANCELLED`, even if the call had ended); the
notification still goes to the SDK, which answers it 202 and holds no such request. The request holds the
session open while it runs, as the transport's idle bookkeeping does. A taken call gets the
span the SDK would make (`fast_call_span`). `OUBLIETTE_FAST_PATH=0` leaves every request to the
SDK; tests/server/doors/test_http_caller.py drives the same requests both ways.

Owns: per taken request, its cancel scope in the in-flight table (session id, request id) while
it runs. No task: the call runs in the request's own task and its keepalive pings are the
connection's task's (`ConnectionWatch`), so a request is taken only on a connection of our HTTP
server (`HttpApi.serve`) that watches no other request; any other goes to the SDK.
Needs: the 2026-07-28 fast path (whose body reading, security check and result shaping it
uses, and which gets every request not taken here), the SDK's session manager, and
`session_of(mcp_session_id)`: the `ServerSession` of the caller of that MCP session, if any.
"""

from __future__ import annotations

import json
import logging
import math
from contextlib import contextmanager
from datetime import datetime, timezone
from types import SimpleNamespace
from typing import Any, Callable, Iterator
from weakref import WeakKeyDictionary

import anyio
import trio
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser, authorization_context
from mcp.server.streamable_http import REQUEST_CANCELLED, EventMessage, StreamableHTTPServerTransport, check_accept_headers
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.shared.dispatcher import coerce_request_id
from mcp.shared.jsonrpc_dispatcher import cancelled_request_id_from_params, handler_exception_to_error_data
from mcp_types import ErrorData, JSONRPCError, JSONRPCResponse
from mcp_types import methods as sdk_methods
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS
from pydantic import ValidationError
from sse_starlette import EventSourceResponse
from sse_starlette.event import ServerSentEvent, ensure_bytes
from starlette.datastructures import State
from starlette.requests import Request

from oubliette_runtime.fast_tool_calls import PARAM_KEYS, REQUEST_KEYS, is_request_id, modern_envelope
from oubliette_runtime.trace_spans import fast_call_span

from ..connection_limits import WATCH_STATE, ConnectionWatch, QuickLock
from .http_fast import FastHttpCalls, _replay

log = logging.getLogger("oubliette.fast_calls")

#: The tools taken here: they need no request-scoped channel (`caller_tool_response` only without `wait`).
FAST_TOOLS = frozenset({"caller_tool_response", "caller_tool_progress"})
_HANDSHAKE = frozenset(version.encode() for version in HANDSHAKE_PROTOCOL_VERSIONS)
_SEP = EventSourceResponse.DEFAULT_SEPARATOR
_CANCEL_MARK = b'"notifications/cancelled"'
_NOTIFICATION_KEYS = frozenset({"jsonrpc", "method", "params"})

#: `mcp_session_id -> ServerSession | None`: the session of that MCP session's caller, once it has one.
SessionOf = Callable[[str], Any]


class FastHandshakeCalls:
    """ASGI app in front of `modern` (`FastHttpCalls`): takes the calls of the module docstring.

    `taken` counts the requests answered here.
    """

    def __init__(self, modern: FastHttpCalls, manager: StreamableHTTPSessionManager, session_of: SessionOf) -> None:
        self.app = modern
        self.modern = modern
        self.manager = manager
        self.session_of = session_of
        self.taken = 0
        self._in_flight: dict[tuple[str, Any], trio.CancelScope] = {}
        self._headers: WeakKeyDictionary[StreamableHTTPServerTransport, list[tuple[bytes, bytes]]] = WeakKeyDictionary()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        session_id = self._candidate(scope)
        if session_id is None:
            await self.app(scope, receive, send)
            return
        body, rest = await self.modern._read_body(scope, receive)
        taken = None if body is None else self._parse(scope, session_id, body)
        watch = scope.get("state", {}).get(WATCH_STATE)
        if taken is None or watch is None or not watch.free():  # no watch: not our HTTP server's connection
            if body is not None and self._in_flight and _CANCEL_MARK in body:
                self._cancel(scope, session_id, body)
            await self.app(scope, _replay(rest, receive), send)
            return
        self.taken += 1
        log.debug("tools/call %r taken off the SDK's path (handshake era)", taken[3]["id"])
        await self._answer(scope, send, watch, session_id, *taken)

    def _candidate(self, scope: dict[str, Any]) -> str | None:
        """The session id of a POST to the path with an `Mcp-Session-Id` the SDK holds and a handshake-era
        (or no) `MCP-Protocol-Version` (the SDK's era routing), else None."""
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != self.modern.path:
            return None
        session_id = version = None
        for name, value in scope["headers"]:
            if name == b"mcp-session-id":
                session_id = value.decode("latin-1")
            elif name == b"mcp-protocol-version":
                version = value
        if session_id is None or (version is not None and version not in _HANDSHAKE):
            return None
        return session_id if session_id in self.manager._server_instances else None

    def _parse(
        self, scope: dict[str, Any], session_id: str, body: bytes,
    ) -> tuple[StreamableHTTPServerTransport, Any, str, dict[str, Any]] | None:
        """(the session's transport, its caller's `ServerSession`, the negotiated version, the JSON-RPC
        message) of a call taken here, else None."""
        accepted = self._accepted(scope, session_id)
        message = None if accepted is None else _json(body)
        if accepted is None or message is None:
            return None
        transport, session, version = accepted
        params = message.get("params") if message.keys() == REQUEST_KEYS else None
        if not (isinstance(params, dict) and params.keys() <= PARAM_KEYS and message["jsonrpc"] == "2.0"
                and message["method"] == "tools/call" and is_request_id(message["id"])):
            return None
        name, arguments, meta = params.get("name"), params.get("arguments"), params.get("_meta", {})
        if name not in FAST_TOOLS or not isinstance(arguments, dict) or not isinstance(meta, dict) or modern_envelope(meta):
            return None
        if arguments.get("wait", False) is not False:
            return None
        try:
            sdk_methods.validate_client_request("tools/call", version, params)
        except (KeyError, ValidationError):
            return None
        return transport, session, version, message

    def _cancel(self, scope: dict[str, Any], session_id: str, body: bytes) -> None:
        """Cancel the call taken here that a `notifications/cancelled` the SDK accepts names, as its dispatcher would."""
        message = _json(body) if self._accepted(scope, session_id) is not None else None
        if message is None or not message.keys() <= _NOTIFICATION_KEYS or message.get("jsonrpc") != "2.0":
            return
        params = message.get("params")
        if message.get("method") != "notifications/cancelled" or not isinstance(params, dict | None):
            return
        request_id = cancelled_request_id_from_params(params)
        cancel = None if request_id is None else self._in_flight.get((session_id, coerce_request_id(request_id)))
        if cancel is not None:
            cancel.cancel()

    def _accepted(self, scope: dict[str, Any], session_id: str) -> tuple[StreamableHTTPServerTransport, Any, str] | None:
        """(the session's transport, its caller's `ServerSession`, the negotiated version) when the SDK would
        hand this POST's message to that session, else None. Checked after the body is read: the session
        may have ended meanwhile."""
        transport = self.manager._server_instances.get(session_id)
        if transport is None or not self._live(scope, session_id, transport):
            return None
        session = self.session_of(session_id)
        connection = getattr(session, "_connection", None)
        if connection is None or not connection.initialize_accepted or connection.session_id != session_id:
            return None
        version = connection.protocol_version
        if version.encode() not in _HANDSHAKE:
            return None
        request = Request(scope)
        has_json, has_sse = check_accept_headers(request)
        if not (has_json and has_sse and self.modern._secure(request.headers) and transport._check_content_type(request)):
            return None
        return transport, session, version

    def _live(self, scope: dict[str, Any], session_id: str, transport: StreamableHTTPServerTransport) -> bool:
        """Whether the SDK would hand this request to the session's transport and its POST handler would
        answer it over SSE with nothing stored: the manager's owner check, the transport's state and mode."""
        user = scope.get("user")
        requestor = authorization_context(user) if isinstance(user, AuthenticatedUser) else None
        if requestor != self.manager._session_owners.get(session_id):
            return False
        idle = transport.idle_scope
        return not (transport.is_terminated or (idle is not None and idle.cancel_called)
                    or transport.is_json_response_enabled or transport._event_store is not None)

    async def _answer(
        self, scope: dict[str, Any], send: Any, watch: ConnectionWatch, session_id: str,
        transport: StreamableHTTPServerTransport, session: Any, version: str, message: dict[str, Any],
    ) -> None:
        """Run the call and write its answer as the SDK's transport does: the SSE head, the response event,
        the end; sse-starlette's keepalive pings meanwhile are the connection's task's (`ConnectionWatch`),
        one writer at a time. A client that goes away does not cancel the call (`watched.call` is not used)."""
        request_id, params = message["id"], message["params"]
        name, arguments = params["name"], params["arguments"]
        ctx = SimpleNamespace(protocol_version=version, session=session,
                              request=SimpleNamespace(state=State(scope.setdefault("state", {}))))
        key = (session_id, coerce_request_id(request_id))
        cancel = self._in_flight[key] = trio.CancelScope()
        cancelled = JSONRPCError(jsonrpc="2.0", id=request_id, error=ErrorData(code=REQUEST_CANCELLED, message="Request cancelled"))
        answer: JSONRPCResponse | JSONRPCError = cancelled
        try:
            writing = QuickLock()

            async def ping() -> None:
                async with writing:
                    await send({"type": "http.response.body", "body": _ping_event(), "more_body": True})

            with _held(transport), watch.watching(ping, EventSourceResponse.DEFAULT_PING_INTERVAL):
                async with writing:
                    await send({"type": "http.response.start", "status": 200, "headers": self._sse_headers(transport)})
                with cancel, fast_call_span(name, request_id, params.get("_meta", {})) as ended:
                    try:
                        result = self.modern._shaper._serialize("tools/call", version, await self.modern.call(ctx, name, arguments))
                    except Exception as exc:  # as the SDK dispatcher's exception-to-wire boundary
                        answer = JSONRPCError(jsonrpc="2.0", id=request_id, error=_error_data(exc, name))
                    else:
                        ended(result)
                        answer = JSONRPCResponse(jsonrpc="2.0", id=request_id, result=result)
                if cancel.cancel_called:  # the SDK's dispatcher drops what a cancelled request's handler returned
                    answer = cancelled
                event = ensure_bytes(transport._create_event_data(EventMessage(answer)), _SEP)
                async with writing:  # after a ping being written; the event and the body's end are one write
                    await send({"type": "http.response.body", "body": event, "more_body": False})
        finally:
            if self._in_flight.get(key) is cancel:  # a newer call with the same id keeps its entry, as in the SDK
                del self._in_flight[key]

    def _sse_headers(self, transport: StreamableHTTPServerTransport) -> list[tuple[bytes, bytes]]:
        """The response head the SDK's transport sends for a POST answered over SSE (built once per session)."""
        headers = self._headers.get(transport)
        if headers is None:
            headers = self._headers[transport] = EventSourceResponse(content=_no_content(), headers={
                "Cache-Control": "no-cache, no-transform",
                "Connection": "keep-alive",
                "Content-Type": "text/event-stream",
                "mcp-session-id": transport.mcp_session_id or "",
            }).raw_headers
        return headers


def _json(body: bytes) -> dict[str, Any] | None:
    """The body as a JSON object, else None."""
    try:
        message = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return message if isinstance(message, dict) else None


def _error_data(exc: Exception, name: str) -> ErrorData:
    """The error the SDK's dispatcher writes for a handler's exception (code 0 and its text when unmapped)."""
    error = handler_exception_to_error_data(exc)
    if error is None:
        log.exception("handler for %r raised", name)
        error = ErrorData(code=0, message=str(exc))
    return error


@contextmanager
def _held(transport: StreamableHTTPServerTransport) -> Iterator[None]:
    """The transport's idle bookkeeping around a request (`StreamableHTTPServerTransport.handle_request`):
    while one is in flight the session does not expire; the countdown starts again after the last."""
    idle, timeout = transport.idle_scope, transport._idle_timeout
    if idle is None or timeout is None:
        yield
        return
    transport._requests_in_flight += 1
    idle.deadline = math.inf
    try:
        yield
    finally:
        transport._requests_in_flight -= 1
        if not transport._requests_in_flight:
            idle.deadline = anyio.current_time() + timeout


def _ping_event() -> bytes:
    """sse-starlette's keepalive comment of an SSE response (`EventSourceResponse._ping`)."""
    return ServerSentEvent(comment=f"ping - {datetime.now(timezone.utc)}", sep=_SEP).encode()


async def _no_content() -> Any:
    """An empty body iterator (only the response's headers are used)."""
    return
    yield  # pragma: no cover
