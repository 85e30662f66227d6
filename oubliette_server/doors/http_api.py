"""The HTTP listener: the tether API and the caller's MCP over Streamable HTTP.

One HTTP/1.1 server (`HttpApi.serve`: each connection an `HTTP11Connection`) serves one Starlette app:

- `POST /v1/instances/{id}/tether`: ingress of a frame (a `user.message` wakes the instance);
- `GET  /v1/instances/{id}/tether/poll`: `{frames, next_seq, timed_out}`, long poll up to `wait_ms`;
- `GET  /v1/instances/{id}/tether/stream`: SSE, each event's id is its `seq`; `Last-Event-ID` resumes;
- `POST /v1/instances/{id}/sessions/{sid}/approvals`, `…/caller_tool_response`,
  `…/caller_tool_progress`: the operator answers for a session's caller (`AnswerRoutes`);
- `/mcp`: the caller's MCP (Streamable HTTP, SSE responses, `tools.listChanged` advertised);
- `GET /livez`, `GET /readyz` (no token: for load balancers and orchestrators) and
  `GET /v1/health` (the detailed view): `HealthRoutes`.
- `GET /metrics`: the server's Prometheus metrics (the HTTP token; or on a listener of its own,
  `serve_metrics`, without one: docs/OBSERVABILITY.md, "Metrics").

Auth: on TCP every request but `/livez` and `/readyz` needs `Authorization: Bearer <token>`: an HTTP
principal's (the admin's, `oubliette-server http-token`, or a named one's, `--principal NAME`),
which the policies scope (principal_access.py, docs/POLICY.md), or an instance's own
token for that instance's `/v1/instances/{id}/…` routes. A Unix socket
listener is created with mode 0600 and needs no token: file access is the
credential. /mcp also checks the Host header against loopback names plus
`allowed_hosts` (DNS-rebinding protection); see docs/TETHER.md for containers.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import secrets
import sqlite3
from typing import Any, Callable

import trio
from mcp.server.transport_security import TransportSecuritySettings
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from oubliette_runtime.fast_tool_calls import fast_path_enabled
from oubliette_runtime.peer_text import bounded
from protocol import RelayError, errors
from protocol.limits import LimitExceeded

from ..core.callers import CallerConnection, CallerRegistry, keyed_identity
from ..core.in_flight import InFlight
from ..core.instances import InstanceDirectory
from ..core.metrics import CONTENT_TYPE, ServerMetrics
from ..features.tether import Tether
from ..features.turns import STREAM_GONE_STATE
from ..store.api import StoreUnavailable
from .caller_api import CallerApi, build_caller_server
from .caller_api.http_fast import FastHttpCalls
from .caller_api.http_fast_handshake import FastHandshakeCalls
from .caller_api.mcp_server import call_as_caller
from .caller_api.schemas import OWNER_KEY_PATTERN
from .connection_limits import (
    HTTP_WRITE_SECONDS,
    ConnectionAcceptor,
    FloodLog,
    GuardedStream,
    HttpLimits,
)
from .health import Readiness
from .http11 import HTTP11Connection
from .principal_access import PRINCIPAL_STATE, Access, PrincipalAccess, request_principal

VerifyToken = Callable[[str, str], bool]
PrincipalOf = Callable[[str], "str | None"]
"""`HttpPrincipals.principal_of(token)`: the HTTP principal a bearer token is, or None."""

log = logging.getLogger("oubliette.server.http")
access_log = logging.getLogger("oubliette.access")
"""One INFO line per HTTP request (docs/CONFIG.md, "The HTTP access log"); never a token."""

MAX_BODY_BYTES = 1024 * 1024
SSE_KEEPALIVE_SECONDS = 15.0
INSTANCE_ROUTE = re.compile(r"^/v1/instances/([^/]+)/")
MCP_PATHS = ("/mcp", "/mcp/")
PUBLIC_PATHS = frozenset({"/livez", "/readyz"})
#: The `Host` every request on a Unix socket listener is read with (`UnixSocketHost`): a loopback name.
UNIX_SOCKET_HOST = b"localhost:0"
"""Paths served without a token: they say only whether the server is alive and ready."""
STORE_RETRY_AFTER = "2"
"""`Retry-After` (seconds) of a 503 for an unavailable store: the store reconnects by itself."""
OWNER_KEY = re.compile(OWNER_KEY_PATTERN)
HTTP_STATUS = {
    errors.INVALID_PARAMS: 400, errors.INVALID_REQUEST: 400, errors.PARSE_ERROR: 400,
    errors.NOT_FOUND: 404, errors.UNAUTHORIZED: 401, errors.DENIED: 403,
}



class BodyTooLarge(RelayError):
    """A request body over MAX_BODY_BYTES (HTTP 413)."""

    def __init__(self) -> None:
        super().__init__(errors.INVALID_REQUEST, f"request body is larger than {MAX_BODY_BYTES} bytes")


def error_response(err: RelayError, status: int | None = None) -> JSONResponse:
    """The JSON error shape `{"error": {code, name, message}}`; a body or value over a limit is 413
    (size) or 400 (depth); an unavailable store 503 with `Retry-After` and the advice to retry;
    other errors map by code."""
    message = err.message
    headers = None
    if isinstance(err, StoreUnavailable):
        # the database is down: try again later (the server recovers by itself)
        status, message, headers = status or 503, err.advice, {"Retry-After": STORE_RETRY_AFTER}
    elif status is None:
        if isinstance(err, BodyTooLarge):
            status = 413
        elif isinstance(err, LimitExceeded):
            status = 413 if err.is_size else 400
    return JSONResponse(
        {"error": {"code": err.code, "name": errors.ERROR_NAMES.get(err.code, "error"), "message": message}},
        status_code=status or HTTP_STATUS.get(err.code, 400), headers=headers,
    )


#: How long a refusal waits for the rest of its request's body (see `DrainRequestBody`).
DRAIN_SECONDS = 10.0


class BodyDeadline(RelayError):
    """A request body that did not arrive in full within the body deadline (HTTP 408)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(
            errors.TIMEOUT, f"the request body did not arrive in full within {seconds:g} s (http_body_timeout)",
        )


class HttpMiddleware:
    """An ASGI middleware over `app`: `handle` acts on the HTTP requests `wants(scope)` picks;
    every other scope (lifespan, a request it does not want) passes through untouched. The one
    home of that pass-through for the middlewares below."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def wants(self, scope: dict[str, Any]) -> bool:
        """Whether `handle` acts on this scope (default: every HTTP request)."""
        return scope["type"] == "http"

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if self.wants(scope):
            await self.handle(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def handle(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """The middleware's own work on one request it wants."""
        raise NotImplementedError


class CountRequests(HttpMiddleware):
    """ASGI middleware: each HTTP request but a GET is counted in `in_flight` while it is answered,
    so that a graceful stop (`OublietteServer.drain`) lets it finish. A GET (an SSE stream, a long
    poll, a read) is not: it may last for ever, and its client reads again from its cursor."""

    def __init__(self, app: Any, in_flight: InFlight) -> None:
        super().__init__(app)
        self.in_flight = in_flight

    def wants(self, scope: dict[str, Any]) -> bool:
        """HTTP requests other than GET (and HEAD)."""
        return scope["type"] == "http" and scope["method"] not in ("GET", "HEAD")

    async def handle(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Count the request for as long as the app answers it."""
        self.in_flight.started()
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight.finished()


class DrainRequestBody(HttpMiddleware):
    """ASGI middleware: a request's body arrives in full, within the body deadline, before its response starts.

    The deadline: a declared body must have arrived in full `body_timeout` seconds after the
    request's headers did. A client that sends it slower (a byte every few seconds, to hold a
    connection and its file descriptor) is cut off there: the app is cancelled (a read from
    outside its task sees `http.disconnect`), the client gets a JSON 408 with `connection:
    close`, and `on_timeout()` is called (the flood count). A read of a body that is complete
    (watching for a disconnect) has no deadline.

    The drain: the server keeps an HTTP/1.1 connection for the next request only when the
    request's body has been received by the time the response ends. A handler that answers
    without reading the body (a refused token, an unknown instance, a denied answer) would
    otherwise get its connection closed *after* a response that did not say so, whenever the
    body came in a later packet, and a client reusing the connection meets "server disconnected
    without sending a response". So the unread rest of a declared body is read and dropped
    here, up to `MAX_BODY_BYTES` and for at most `DRAIN_SECONDS` (and never past the body
    deadline); past either, the response says `connection: close`. A request without a
    declared body (no `content-length`, no chunked encoding) is passed through untouched, so
    nothing here ever reads alongside a handler that watches for disconnects.
    """

    def __init__(
        self, app: Any, body_timeout: float = HttpLimits().body_timeout, on_timeout: Callable[[], object] = lambda: None,
    ) -> None:
        super().__init__(app)
        self.body_timeout = body_timeout
        self.on_timeout = on_timeout

    def wants(self, scope: dict[str, Any]) -> bool:
        """HTTP requests that declare a body."""
        return scope["type"] == "http" and _declares_body(scope)

    async def handle(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Run the app with the body deadline and the drain."""
        deadline = trio.current_time() + self.body_timeout
        received_all = timed_out = started = False
        app_scope = trio.CancelScope()

        def note(message: dict[str, Any]) -> dict[str, Any]:
            nonlocal received_all
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                received_all = True
            return message

        async def tracked_receive() -> dict[str, Any]:
            nonlocal timed_out
            if received_all:
                return await receive()
            with trio.move_on_at(deadline):
                return note(await receive())
            timed_out = True
            app_scope.cancel()
            return {"type": "http.disconnect"}  # what a reader outside the app's task sees

        async def draining_send(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if not received_all:
                    dropped = 0
                    with trio.move_on_at(min(deadline, trio.current_time() + DRAIN_SECONDS)):
                        while not received_all and dropped <= MAX_BODY_BYTES:
                            dropped += len(note(await receive()).get("body", b""))
                    if not received_all:
                        message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        with app_scope:
            await self.app(scope, tracked_receive, draining_send)
        if timed_out:
            self.on_timeout()
            if not started:
                response = error_response(BodyDeadline(self.body_timeout), 408)
                response.headers["connection"] = "close"
                await response(scope, receive, send)


def _declares_body(scope: dict[str, Any]) -> bool:
    """Whether the request announced a body: a non-zero `content-length`, or chunked encoding."""
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            return value.strip() not in (b"0", b"")
        if name == b"transfer-encoding":
            return b"chunked" in value.lower()
    return False


class UnixSocketHost(HttpMiddleware):
    """ASGI middleware: on the Unix socket listener a request's `Host` is read as `localhost`.

    `/mcp`'s Host check is DNS-rebinding protection, for a browser tricked into reaching a TCP
    port on loopback; no browser reaches a socket file, and a Unix-socket client's URL names no
    host (`http://localhost/mcp`, `http://oubliette/mcp` and the rest all mean the socket).
    """

    def wants(self, scope: dict[str, Any]) -> bool:
        """HTTP requests on a Unix socket (the connection gives them no `server` address)."""
        return scope["type"] == "http" and scope.get("server") is None

    async def handle(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Run the app with the request's `Host` replaced."""
        headers = [(name, value) for name, value in scope["headers"] if name != b"host"]
        await self.app({**scope, "headers": [*headers, (b"host", UNIX_SOCKET_HOST)]}, receive, send)


#: The largest `/mcp` request body (the SDK refuses a larger one before parsing it); 4 MiB, the
#: SDK's own default, named here so the limit and the refusal that quotes it are one number. A
#: value inside it is still held to the size limits (docs/SECURITY.md).
MCP_MAX_BODY_BYTES = 4 * 1024 * 1024


class ExplainRefusals(HttpMiddleware):
    """ASGI middleware: three of `/mcp`'s refusals say why and what to do.

    - 421 for a `Host` it does not accept: the SDK's DNS-rebinding protection answers a bare
      "Invalid Host header"; behind a proxy or in a container network the fix is
      `--allowed-host` (or `[server] allowed_hosts`), which nothing named. The response becomes
      the documented JSON error shape.
    - 404 for an `Mcp-Session-Id` this server does not know (docs/SCALING.md, "What needs
      stickiness"): the SDK's "Session not found" does not say that a 2025-11-25 session lives
      in the memory of the server that opened it. The response stays a JSON-RPC error (what MCP
      clients read) with the same code and a message that begins with the SDK's words.
    - 413 for a body over `MCP_MAX_BODY_BYTES`: the SDK's plain-text "Request body too large"
      named no limit; it becomes a JSON-RPC error that does.
    """

    async def handle(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Run the app, rewriting those two refusals."""
        replaced = False
        on_mcp = scope.get("path") in MCP_PATHS
        session_id = _header(scope, b"mcp-session-id") if on_mcp else None

        async def explained(message: dict[str, Any]) -> None:
            nonlocal replaced
            if message["type"] == "http.response.start" and message["status"] == 421:
                replaced = True
                await error_response(RelayError(errors.INVALID_REQUEST, _host_refusal(scope)), 421)(scope, receive, send)
            elif message["type"] == "http.response.start" and message["status"] == 404 and session_id is not None:
                replaced = True
                await _unknown_session(session_id)(scope, receive, send)
            elif message["type"] == "http.response.start" and message["status"] == 413 and on_mcp:
                replaced = True
                await _mcp_body_too_large()(scope, receive, send)
            elif not replaced:  # the SDK's own body of a replaced response is dropped
                await send(message)

        await self.app(scope, receive, explained)


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")
"""The Host names /mcp always accepts on TCP, with any port or none (a client that names no port
sends the bare name); on a Unix socket the Host is not checked at all (`UnixSocketHost`)."""


def _host_refusal(scope: dict[str, Any]) -> str:
    host = next((value.decode("latin-1") for name, value in scope.get("headers", []) if name == b"host"), "")
    shown = json.dumps(host[:200])
    return (
        f"/mcp does not accept the Host header {shown} (it accepts 127.0.0.1, localhost and [::1], with any port or none); "
        f"to accept it, start the server with --allowed-host {host[:200] or 'HOST:PORT'} "
        "(or [server] allowed_hosts in the config file)"
    )


def _mcp_body_too_large() -> JSONResponse:
    """The 413 of a `/mcp` body over `MCP_MAX_BODY_BYTES`: a JSON-RPC error (id null) naming the limit."""
    return JSONResponse({"jsonrpc": "2.0", "id": None, "error": {"code": errors.INVALID_REQUEST, "message": (
        f"Request body too large: /mcp takes at most {MCP_MAX_BODY_BYTES} bytes in one request "
        "(a value inside it is also held to the size limits of docs/SECURITY.md)"
    )}}, status_code=413)


def _unknown_session(session_id: str) -> JSONResponse:
    """The 404 of an unknown `Mcp-Session-Id`: a JSON-RPC error (id null) that says where sessions live."""
    return JSONResponse({"jsonrpc": "2.0", "id": None, "error": {"code": errors.INVALID_REQUEST, "message": (
        f"Session not found: this server does not know MCP session {json.dumps(session_id[:64])}. A 2025-11-25 "
        "session lives in the memory of the server that opened it (another server of this deployment, or "
        "this one before a restart); start a new session with initialize"
    )}}, status_code=404)


class BearerAuth(HttpMiddleware):
    """ASGI middleware: TCP requests need a valid bearer token; Unix socket ones rely on the file mode.

    A principal's token (`principal_of`) is put in the scope's state with its principal
    (`PRINCIPAL_STATE`); an instance's token passes on that instance's routes only.
    `on_refused(reason)` ("missing_token" or "bad_token") hears of each refusal (metrics)."""

    def __init__(
        self, app: Any, verify_token: VerifyToken, principal_of: PrincipalOf,
        on_refused: Callable[[str], object] = lambda reason: None,
    ) -> None:
        super().__init__(app)
        self.verify_token = verify_token
        self.principal_of = principal_of
        self.on_refused = on_refused

    def wants(self, scope: dict[str, Any]) -> bool:
        """HTTP requests over TCP, but the probes (a Unix socket listener has no `server`)."""
        return scope["type"] == "http" and scope.get("server") is not None and scope["path"] not in PUBLIC_PATHS

    async def handle(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Pass the request on with a valid token; else answer 401."""
        token = _bearer(scope)
        if token is not None and (principal := self._allowed(token, scope["path"])) is not False:
            state = scope.setdefault("state", {})
            state["oubliette_token"] = token
            if principal is not None:
                state[PRINCIPAL_STATE] = principal
            await self.app(scope, receive, send)
            return
        message = "missing bearer token" if token is None else "this bearer token is not valid for this resource"
        self.on_refused("missing_token" if token is None else "bad_token")
        response = error_response(RelayError(errors.UNAUTHORIZED, message))
        response.headers["WWW-Authenticate"] = 'Bearer realm="oubliette"'
        await response(scope, receive, send)

    def _allowed(self, token: str, path: str) -> str | None | bool:
        """The token's principal; None for an instance's token on its own routes; False: refused."""
        principal = self.principal_of(token)
        if principal is not None:
            return principal
        match = INSTANCE_ROUTE.match(path)
        return None if match is not None and self.verify_token(match.group(1), token) else False


class StreamWatch(HttpMiddleware):
    """ASGI middleware for /mcp: notices a client that goes away before its response has ended.

    Each request's scope state gets an event (`STREAM_GONE_STATE`) set when `http.disconnect`
    arrives before the response's last body: a `session_message` waiting on that request sees
    it. A handshake-era standalone stream (a GET with `Mcp-Session-Id` that was answered 200)
    that drops calls `on_standalone_dropped(mcp_session_id)`. Detection needs someone reading
    `receive`: the SDK's SSE responses do, to notice disconnects themselves.
    """

    def __init__(self, app: Any, on_standalone_dropped: Callable[[str], object]) -> None:
        super().__init__(app)
        self.on_standalone_dropped = on_standalone_dropped

    def wants(self, scope: dict[str, Any]) -> bool:
        """HTTP requests to `/mcp`."""
        return scope["type"] == "http" and scope["path"] in MCP_PATHS

    async def handle(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Run the app, watching for the client going away."""
        gone = trio.Event()
        scope.setdefault("state", {})[STREAM_GONE_STATE] = gone
        status: int | None = None
        finished = False

        async def watched_send(message: dict[str, Any]) -> None:
            nonlocal status, finished
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
            await send(message)

        async def watched_receive() -> dict[str, Any]:
            message = await receive()
            if message["type"] == "http.disconnect" and not finished:
                gone.set()
            return message

        try:
            await self.app(scope, watched_receive, watched_send)
        finally:
            if gone.is_set() and scope["method"] == "GET" and status == 200:
                session_id = _header(scope, b"mcp-session-id")
                if session_id:
                    self.on_standalone_dropped(session_id)


class ErrorBoundary(HttpMiddleware):
    """ASGI middleware inside the Starlette app: the one place an HTTP request's exception becomes an answer.

    Every HTTP error is the JSON error shape: a failure of the store (`sqlite3.Error`: a full
    disk, a damaged page) or a bug answers 500 `{"error": {...}}` (not Starlette's plain text),
    logged once: the store's as one ERROR line (its message says what failed), anything else
    with its traceback. A client that went away mid-request (`ClientDisconnect`) is not an
    error of the server: one DEBUG line, nothing sent. After the response has started nothing
    more can be sent; the failure is logged the same way.
    """

    async def handle(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Run the app; an exception out of it becomes the JSON 500."""
        started = False

        async def watched_send(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except Exception as raised:
            exc = _sole(raised)  # a handler's nursery wraps what it raised in a group
            if isinstance(exc, ClientDisconnect):
                log.debug("%s %s: the client went away before its request was read", scope["method"], scope["path"])
                return
            if isinstance(exc, sqlite3.Error):
                log.error("%s %s: the frame store failed: %s", scope["method"], bounded(scope["path"]), exc)
                err = RelayError(errors.INTERNAL_ERROR, f"the frame store failed: {exc}")
            else:
                log.exception("%s %s failed", scope["method"], bounded(scope["path"]))
                err = RelayError(errors.INTERNAL_ERROR, "internal server error (the server log says more)")
        else:
            return
        if not started:
            await error_response(err, 500)(scope, receive, send)


class AccessLog(HttpMiddleware):
    """ASGI middleware, outermost: one INFO line per HTTP request on `oubliette.access`.

    The line: the client's address (`unix` for the Unix socket listener), method, path (no
    query string), status, duration, and for an error status the reason the answer gave (the
    JSON error's message, or the start of a plain-text body, e.g. the SDK's `Invalid Host
    header`). Never a header, so never a token. A request that ended without a response (the
    client went away, the server stopped) is logged with status `-`. The facts are also the
    record's extra fields (`--log-format json` writes them as keys). `on_answered(status)` hears
    of every request's status (None: no answer), logged or not (metrics).
    """

    def __init__(self, app: Any, on_answered: Callable[[int | None], object] | None = None) -> None:
        super().__init__(app)
        self.on_answered = on_answered

    def wants(self, scope: dict[str, Any]) -> bool:
        """HTTP requests, while the access log or `on_answered` listens."""
        return scope["type"] == "http" and (access_log.isEnabledFor(logging.INFO) or self.on_answered is not None)

    async def handle(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Run the app, then log its answer."""
        logged = access_log.isEnabledFor(logging.INFO)
        began = trio.current_time()
        status: int | None = None
        error_body = bytearray()

        async def logged_send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and status is not None and status >= 400:
                error_body.extend(message.get("body", b"")[: 1024 - len(error_body)])
            await send(message)

        try:
            await self.app(scope, receive, logged_send)
        finally:
            if self.on_answered is not None:
                self.on_answered(status)
            if logged:
                client = scope.get("client")
                reason = _refusal_reason(bytes(error_body)) if status is not None and status >= 400 else ""
                host = "unix" if not client else f"[{client[0]}]:{client[1]}" if ":" in client[0] else f"{client[0]}:{client[1]}"
                seconds = trio.current_time() - began
                # The same facts as keys of their own for `--log-format json` (as the relay's lines have).
                fields = {"peer": host, "method": bounded(scope["method"]), "path": bounded(scope["path"]),
                          "status": status, "duration_s": round(seconds, 4), "reason": bounded(reason) if reason else None}
                access_log.info(
                    "%s %s %s %s %.1f ms%s", host, fields["method"], fields["path"], status if status is not None else "-",
                    seconds * 1000, f" - {fields['reason']}" if reason else "", extra=fields,
                )


def _sole(exc: BaseException) -> BaseException:
    """The exception alone in `exc`'s (nested) exception groups, else `exc` itself."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _refusal_reason(body: bytes) -> str:
    """What an error answer says: the JSON error's message, else the start of its text."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", errors="replace").strip()[:200]


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return value.decode("latin-1")
    return None


def _bearer(scope: dict[str, Any]) -> str | None:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


def _int_param(request: Request, name: str, default: int) -> int:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise RelayError(errors.INVALID_PARAMS, f"{name} must be an integer, got {raw!r}") from None


def _types_param(request: Request) -> list[str] | None:
    values = [t for raw in request.query_params.getlist("types") for t in raw.split(",") if t]
    return values or None


async def _unless_disconnected(request: Request, wait: Any) -> Any:
    """`await wait()`, cancelled when the HTTP client disconnects first (then None).

    A long poll ends with its request (the tether's rule: "cancellation via request context")
    instead of holding a frame-store waiter until `wait_ms` runs out.
    """
    answer: list[Any] = []
    async with trio.open_nursery() as nursery:

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            nursery.cancel_scope.cancel()

        nursery.start_soon(watch)
        try:
            answer.append(await wait())
        except RelayError as err:
            answer.append(err)
        nursery.cancel_scope.cancel()
    if not answer:
        return None
    if isinstance(answer[0], RelayError):
        raise answer[0]
    return answer[0]


class TetherRoutes:
    """The `/v1/instances/{id}/tether…` endpoints: HTTP adapters over `Tether`."""

    def __init__(self, tether: Tether, instances: InstanceDirectory) -> None:
        self.tether = tether
        self.instances = instances

    def routes(self) -> list[Route]:
        """The Starlette routes: tether ingress, poll, stream."""
        return [
            Route("/v1/instances/{instance}/tether", self.ingress, methods=["POST"]),
            Route("/v1/instances/{instance}/tether/poll", self.poll, methods=["GET"]),
            Route("/v1/instances/{instance}/tether/stream", self.stream, methods=["GET"]),
        ]

    async def ingress(self, request: Request) -> Response:
        """`POST /v1/instances/{id}/tether`: store one frame; 201 with its `msg_id` and `seq`.

        Errors are JSON responses: 413 for a body or value over the size limits, 400/404 for the
        rest (by error code).
        """
        try:
            body = await self._json_body(request)
            frame = await self.tether.ingest(request.path_params["instance"], body)  # its checks, then the lookup
        except RelayError as err:
            return error_response(err)
        return JSONResponse(
            {"msg_id": frame.msg_id, "session_id": frame.session_id, "ingress_seq": frame.seq, "frame": frame.to_wire()},
            status_code=201,
        )

    @staticmethod
    async def _json_body(request: Request) -> Any:
        body = bytearray()
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > MAX_BODY_BYTES:
                raise BodyTooLarge()
        try:
            return json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise RelayError(errors.PARSE_ERROR, f"request body is not valid JSON: {exc}") from None
        except RecursionError:  # Python's parser gives up on very deep input: the client's error, not ours
            raise RelayError(
                errors.PARSE_ERROR, "request body is nested too deeply to parse (see max_payload_depth)"
            ) from None

    async def poll(self, request: Request) -> Response:
        """`GET …/tether/poll`: frames after `after_seq`, long-polling up to `wait_ms`; 499 when the client left first."""
        try:
            instance = await self.instances.require_known(request.path_params["instance"])
            filters: dict[str, Any] = dict(
                channel=request.query_params.get("channel") or None,
                session_id=request.query_params.get("session_id") or None,
                after_seq=_int_param(request, "after_seq", 0),
                limit=_int_param(request, "limit", 50),
                wait_ms=_int_param(request, "wait_ms", 0),
                types=_types_param(request),
                reply_to=request.query_params.get("reply_to_msg_id") or None,
            )
            result = await _unless_disconnected(request, lambda: self.tether.read(instance, **filters))
        except RelayError as err:
            return error_response(err)
        if result is None:
            return Response(status_code=499)  # the client went away; nobody reads this
        return JSONResponse(result)

    async def stream(self, request: Request) -> Response:
        """`GET …/tether/stream`: SSE of the frames after `Last-Event-ID` (or `after_seq`), with keepalives.

        Ends when the client disconnects; errors found before the stream starts are JSON responses.
        """
        try:
            instance = await self.instances.require_known(request.path_params["instance"])
            last_event_id = request.headers.get("last-event-id")
            if last_event_id is not None:
                try:
                    after_seq = int(last_event_id)
                except ValueError:
                    raise RelayError(errors.INVALID_PARAMS, f"Last-Event-ID must be a seq, got {last_event_id!r}") from None
            else:
                after_seq = _int_param(request, "after_seq", 0)
            frames = await self.tether.stream(
                instance, after_seq=after_seq, keepalive_seconds=SSE_KEEPALIVE_SECONDS,
                channel=request.query_params.get("channel") or None,
                session_id=request.query_params.get("session_id") or None,
                types=_types_param(request),
                reply_to=request.query_params.get("reply_to_msg_id") or None,
            )
        except RelayError as err:
            return error_response(err)

        async def events() -> Any:
            try:
                async for frame in frames:
                    if frame is None:
                        yield ": keepalive\n\n"
                    else:
                        yield f"id: {frame['seq']}\nevent: frame\ndata: {json.dumps(frame, ensure_ascii=False)}\n\n"
            except StoreUnavailable as exc:  # the stream ends with why; the client resumes by Last-Event-ID
                yield f"event: error\ndata: {json.dumps({'error': {'message': exc.advice}}, ensure_ascii=False)}\n\n"

        return StreamingResponse(
            events(), media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )


class HealthRoutes:
    """`/livez`, `/readyz` and `/v1/health`: HTTP adapters over `Readiness` (docs/CONFIG.md,
    "Health endpoints")."""

    def __init__(
        self, readiness: Readiness, instances: InstanceDirectory, identity: dict[str, Any] | None = None,
    ) -> None:
        self.readiness = readiness
        self.instances = instances
        self.identity = identity or {}

    def routes(self) -> list[Route]:
        """The three probes' routes (each GET only)."""
        probes = {"/livez": self.livez, "/readyz": self.readyz, "/v1/health": self.health}
        return [Route(path, probe, methods=["GET"]) for path, probe in probes.items()]

    async def livez(self, request: Request) -> Response:
        """`GET /livez`: 200 `{"ok": true}` while the process serves HTTP (no token, no store)."""
        return JSONResponse({"ok": True})

    async def readyz(self, request: Request) -> Response:
        """`GET /readyz`: 200 when the store answers in time and the relay listener is up; else 503
        with the `reasons` (no token: nothing in it names an address or a URL)."""
        report = await self.readiness.check()
        body: dict[str, Any] = {"ok": report.ok, "checks": {n: c.public() for n, c in report.checks.items()}}
        if not report.ok:
            body["reasons"] = report.reasons()
        return JSONResponse(body, status_code=200 if report.ok else 503)

    async def health(self, request: Request) -> Response:
        """`GET /v1/health`: `ok` as `/readyz` has it (200, or 503), each check with its `detail`,
        the connected instances, and which server and store answered (`server`, `store`: behind a
        load balancer, the identity tells the servers apart)."""
        report = await self.readiness.check()
        return JSONResponse(
            {"ok": report.ok, "checks": {n: c.detailed() for n, c in report.checks.items()},
             "connected_instances": self.instances.connected_instances(), **self.identity},
            status_code=200 if report.ok else 503,
        )


class AnswerRoutes:
    """The operator's answers over HTTP, for tether users whose program holds no MCP session:

    - `POST /v1/instances/{id}/sessions/{session_id}/approvals`: `approval_response`;
    - `POST /v1/instances/{id}/sessions/{session_id}/caller_tool_response`: `caller_tool_response`;
    - `POST /v1/instances/{id}/sessions/{session_id}/caller_tool_progress`: `caller_tool_progress`.

    Each body is the tool's arguments without `session_id` (`wait` too, where the tool takes it);
    the answer is given for the session's owning caller and is refused like the tool's. Only an
    HTTP principal the policies let `answer` the instance (`PrincipalAccess`) answers here, or a
    Unix socket listener (file mode 0600). An instance token, which its sandbox holds, is
    refused: an agent must never approve its own calls nor make up the caller's results.
    """

    def __init__(self, tools: CallerApi) -> None:
        self.tools = tools
        self._doors = {
            "approvals": tools.approval_response_over_http,
            "caller_tool_response": tools.caller_tool_response_over_http,
            "caller_tool_progress": tools.caller_tool_progress_over_http,
        }

    def routes(self) -> list[Route]:
        """The routes this adapter serves."""
        return [
            Route(f"/v1/instances/{{instance}}/sessions/{{session_id}}/{name}", self._answer_with(door), methods=["POST"])
            for name, door in self._doors.items()
        ]

    def _answer_with(self, door: Callable[[str, dict[str, Any]], Any]) -> Callable[[Request], Any]:
        async def answer(request: Request) -> Response:
            return await self.answer(request, door)

        return answer

    async def answer(self, request: Request, door: Callable[[str, dict[str, Any]], Any]) -> Response:
        """POST a tool's body for a session to `door`; answers as the tool does, or a JSON error."""
        if request.scope.get("server") is not None and PRINCIPAL_STATE not in request.scope.get("state", {}):
            return error_response(RelayError(errors.DENIED, (
                "only the HTTP admin token, or a principal's the policies let answer this instance, may answer "
                "for a caller; an instance's token may not")))
        try:
            body = await TetherRoutes._json_body(request)
            if not isinstance(body, dict):
                raise RelayError(errors.INVALID_PARAMS, "the body must be a JSON object")
            args = {**body, "session_id": request.path_params["session_id"]}
            answered = await _unless_disconnected(request, lambda: door(request.path_params["instance"], args))
        except RelayError as err:
            return error_response(err)
        if answered is None:
            return Response(status_code=499)
        return JSONResponse(answered)


class HttpApi:
    """Builds the ASGI app and serves it on the configured listeners.

    Needs: the caller registry (one caller per MCP session or per bearer token), the caller
    tools, the tether and instance directory (for the routes), `verify_token(name, token)`,
    the extra Host names allowed on /mcp, `principal_of(token)` and `access(principal, action,
    resource)` (docs/POLICY.md, "HTTP principals"), the `HttpLimits` (docs/SECURITY.md, "Slow HTTP
    clients"), the readiness checks (for the probes), and with the server's `metrics`,
    `GET /metrics` and the request and refusal counts. Start `serve` (and `serve_metrics`) with
    `nursery.start`: it reports the bound URLs.
    """

    def __init__(
        self,
        *,
        callers: CallerRegistry,
        tools: CallerApi,
        tether: Tether,
        instances: InstanceDirectory,
        verify_token: VerifyToken,
        allowed_hosts: list[str],
        readiness: Readiness,
        identity: dict[str, Any] | None = None,
        limits: HttpLimits | None = None,
        metrics: ServerMetrics | None = None,
        principal_of: PrincipalOf,
        access: Access,
        in_flight: InFlight | None = None,
    ) -> None:
        self.principal_of = principal_of
        """Which HTTP principal a bearer token is (`HttpPrincipals.principal_of`)."""
        self.access = access
        """`PolicyGate.require`: what a principal may do (principal_access.py)."""
        self.metrics = metrics
        self.in_flight = in_flight or InFlight()
        """The requests (but GETs) being answered: a graceful stop waits for them (`CountRequests`)."""
        self.limits = limits or HttpLimits()
        """What HTTP clients may hold: the connection cap, the body deadline, keep-alive limits."""
        self.flood = FloodLog(log, "HTTP")
        """Counts refused connections, cut-off bodies and failed accepts; one WARNING per interval."""
        self.identity = identity or {}
        """What `/v1/health` says of this server: `{"server": {...}, "store": "..."}`."""
        self.readiness = readiness
        self.callers = callers
        self.tools = tools
        self.tether = tether
        self.instances = instances
        self.verify_token = verify_token
        self.allowed_hosts = allowed_hosts
        self._modern_callers: dict[tuple[str, str], CallerConnection] = {}
        self._modern_in_flight: dict[CallerConnection, int] = {}
        self._modern_names: dict[CallerConnection, tuple[str, str]] = {}
        self._legacy_callers: dict[int, CallerConnection] = {}
        self._legacy_by_mcp_session: dict[str, CallerConnection] = {}
        self.mcp = build_caller_server(tools, self._resolve_caller, self._release_caller)
        self.fast: FastHttpCalls | None = None
        """The 2026-07-28 fast path in front of the SDK's `/mcp` once `asgi_app` built it (`OUBLIETTE_FAST_PATH`)."""
        self.fast_handshake: FastHandshakeCalls | None = None
        """The handshake-era fast path in front of `fast`, built with it."""

    def _resolve_caller(self, ctx: Any, arguments: dict[str, Any] | None) -> CallerConnection | None:
        """Who sends this request (docs/SECURITY.md, "Callers and sessions").

        Handshake era: the MCP session (`Mcp-Session-Id`). 2026-07-28 has no session: the
        bearer-token principal plus the `owner_key` argument; a request without one is a new
        caller with a fresh key, which `session_message` returns.
        """
        if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS:
            return None if arguments is None else self._modern_caller(ctx, arguments.get("owner_key"))
        connection = ctx.session._connection  # the SDK's per-connection state; its exit stack runs on close
        caller = self._legacy_callers.get(id(connection))
        principal = request_principal(getattr(ctx.request, "state", None))
        if caller is not None and caller.principal != principal:
            raise RelayError(errors.DENIED, (  # an MCP session is one principal's, whoever learns its id
                f"this MCP session acts as principal '{caller.principal}' (its first call's token), not '{principal}'; "
                "open a session of your own with initialize"
            ))
        if caller is None:
            mcp_session_id = connection.session_id
            caller = self.callers.open("http", f"http-session-{mcp_session_id or id(connection)}")
            caller.principal = principal
            self._legacy_callers[id(connection)] = caller
            if mcp_session_id:
                self._legacy_by_mcp_session[mcp_session_id] = caller

            async def closed() -> None:
                self._legacy_callers.pop(id(connection), None)
                self._legacy_by_mcp_session.pop(mcp_session_id or "", None)
                self.callers.close(caller)

            connection.exit_stack.push_async_callback(closed)
        caller.mcp_session = ctx.session
        return caller

    def _modern_caller(self, ctx: Any, owner_key: Any) -> CallerConnection:
        token = getattr(getattr(ctx.request, "state", None), "oubliette_token", None) or "unix-socket"
        principal = hashlib.sha256(token.encode()).hexdigest()[:16]
        if not (isinstance(owner_key, str) and OWNER_KEY.fullmatch(owner_key)):
            owner_key = secrets.token_urlsafe(24)  # 192 bits; a bad key is refused by the tool's schema anyway
        caller = self._modern_callers.get((principal, owner_key))
        if caller is None:
            caller = self.callers.open("http", f"http-modern-{principal[:8]}-{owner_key[:6]}")
            caller.owner_key = owner_key
            caller.identity = keyed_identity(principal, owner_key)
            caller.principal = request_principal(getattr(ctx.request, "state", None))
            self._modern_callers[(principal, owner_key)] = caller
            self._modern_names[caller] = (principal, owner_key)
        self._modern_in_flight[caller] = self._modern_in_flight.get(caller, 0) + 1
        return caller

    def _release_caller(self, caller: CallerConnection) -> None:
        """A 2026-07-28 caller with no request in flight that owns no session is forgotten."""
        if caller.owner_key is None:
            return
        left = self._modern_in_flight.get(caller, 1) - 1
        if left > 0:
            self._modern_in_flight[caller] = left
            return
        self._modern_in_flight.pop(caller, None)
        if not self.tools.sessions.owned_by(caller):
            self._modern_callers.pop(self._modern_names.pop(caller), None)
            self.callers.close(caller)

    def _caller_session(self, mcp_session_id: str) -> Any:
        """The `ServerSession` of that MCP session's caller, once its first call made one (else None)."""
        caller = self._legacy_by_mcp_session.get(mcp_session_id)
        return None if caller is None else caller.mcp_session

    def _standalone_stream_dropped(self, mcp_session_id: str) -> None:
        """A handshake-era caller's GET stream dropped (e.g. the process was killed): its calls fail now.

        The caller itself stays: a client that reconnects its stream keeps its sessions; only
        the end of its MCP session (DELETE, or the transport closing) closes it.
        """
        caller = self._legacy_by_mcp_session.get(mcp_session_id)
        if caller is not None:
            failed = self.tools.turns.caller_gone(caller)
            log.info("%r: standalone stream dropped; %d pending call(s) failed", caller, failed)

    def asgi_app(self) -> Any:
        """The ASGI app: `/mcp` (with Host checks) and the tether routes, behind the bearer-token check."""
        allowed = [*LOOPBACK_HOSTS, *(f"{host}:*" for host in LOOPBACK_HOSTS), *self.allowed_hosts]
        security = TransportSecuritySettings(
            enable_dns_rebinding_protection=True,
            allowed_hosts=allowed,
            allowed_origins=[f"http://{host}" for host in allowed] + [f"https://{host}" for host in allowed],
        )
        starlette = self.mcp.streamable_http_app(
            streamable_http_path="/mcp",
            max_request_body_size=MCP_MAX_BODY_BYTES,
            transport_security=security,
            custom_starlette_routes=[
                *TetherRoutes(self.tether, self.instances).routes(),
                *HealthRoutes(self.readiness, self.instances, self.identity).routes(),
                *AnswerRoutes(self.tools).routes(),
                *self._metrics_routes(),
            ],
        )
        starlette.router.default = _not_found  # unknown paths answer the JSON error shape too
        starlette.add_middleware(ErrorBoundary)  # inside Starlette's own (plain-text 500) error middleware
        refused = functools.partial(self.metrics.auth_refused, "http") if self.metrics else lambda reason: None
        mcp: Any = StreamWatch(starlette, self._standalone_stream_dropped)
        if fast_path_enabled():  # a 2026-07-28 caller's answers and long polls beside the SDK (http_fast.py)
            call = functools.partial(call_as_caller, self.tools, self._resolve_caller, self._release_caller)
            self.fast = FastHttpCalls(mcp, self.mcp, security, MCP_MAX_BODY_BYTES, MCP_PATHS[0], call)
            # and a handshake-era caller's answers on its live session (http_fast_handshake.py)
            self.fast_handshake = FastHandshakeCalls(self.fast, self.mcp.session_manager, self._caller_session)
            mcp = self.fast_handshake
        watched = UnixSocketHost(ExplainRefusals(mcp))
        scoped = PrincipalAccess(watched, self.access, error_response)
        return self._outer(BearerAuth(scoped, self.verify_token, self.principal_of, refused))

    def _outer(self, app: Any, flood: FloodLog | None = None) -> Any:
        """`app` in the middleware every listener has outside it: the access log, the body deadline."""
        body_timeout = self.limits.body_timeout
        cut = flood or self.flood
        return AccessLog(CountRequests(DrainRequestBody(
            app, body_timeout, lambda: cut.count(f"requests cut off at the {body_timeout:g} s body deadline"),
        ), self.in_flight), self.metrics.http_answered if self.metrics else None)

    def _metrics_routes(self) -> list[Route]:
        """`GET /metrics`, when the server keeps metrics."""
        metrics = self.metrics
        if metrics is None:
            return []

        async def page(request: Request) -> Response:
            return Response(metrics.page(), media_type=CONTENT_TYPE)

        return [Route("/metrics", page, methods=["GET"])]

    def metrics_app(self, flood: FloodLog | None = None) -> Any:
        """The ASGI app of a metrics listener: `GET /metrics` without a token, nothing else (404)."""
        starlette = Starlette(routes=self._metrics_routes())
        starlette.router.default = _not_found
        return self._outer(starlette, flood)

    async def serve_metrics(self, binds: list[str], *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve `metrics_app` on `binds` (a listener of its own, for scrapers without the token), as `serve` does."""
        flood = FloodLog(log, "metrics HTTP")
        await self.serve(binds, app=self.metrics_app(flood), flood=flood, task_status=task_status)

    async def serve(
        self, binds: list[str], *, app: Any = None, flood: FloodLog | None = None,
        task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve the app (`asgi_app`, or `app` with its own `flood` log) over HTTP/1.1 on `binds`
        (`host:port` or `unix:PATH`) until cancelled, each connection an `HTTP11Connection`.

        Needs: `nursery.start`, which returns the bound addresses. Owns: the listeners, and at
        most `limits.connection_cap` connections at once over all of them (one over the cap is
        answered 503 and closed); a Unix socket is created mode 0600 (a file already at its path
        is replaced).
        Raises: `OSError` naming the addresses when one cannot be bound.
        Cancellation: every connection is closed; the Unix socket files are removed.

        Not `hypercorn.trio.serve`: it accepts through `trio.serve_listeners`, which has no cap
        and logs a traceback ten times a second when out of descriptors, and its connections
        cost a bare request twice the CPU (doors/http11.py). Hypercorn binds the sockets and runs
        the ASGI lifespan; our accept loop (`ConnectionAcceptor`) hands each connection to an
        `HTTP11Connection`.
        """
        import hypercorn.config
        from hypercorn.trio.lifespan import Lifespan
        from hypercorn.trio.statsd import StatsdLogger
        from hypercorn.utils import repr_socket_addr, wrap_app

        config = hypercorn.config.Config()
        config.bind = binds
        config.errorlog = logging.getLogger("oubliette.server.http.hypercorn")
        config.accesslog = None  # ours is `AccessLog`
        config.set_statsd_logger_class(StatsdLogger)
        unix_paths = [b[len("unix:"):] for b in binds if b.startswith("unix:")]
        for path in unix_paths:
            os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)
            if os.path.exists(path):
                os.unlink(path)
        try:
            sockets = config.create_sockets()  # bound, not listening: nobody can connect yet
        except OSError as exc:  # one line for the operator: which addresses, and why
            raise OSError(exc.errno, f"cannot listen on HTTP {', '.join(binds)}: {exc.strerror or exc}") from exc
        try:
            for path in unix_paths:
                os.chmod(path, 0o600)  # before listen, so without a process-wide umask
            listeners = []
            urls = []
            for sock in sockets.insecure_sockets:
                sock.listen(config.backlog)
                listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
                urls.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")
            flood = flood or self.flood
            app = app if app is not None else self.asgi_app()
            lifespan_state: dict[str, Any] = {}
            lifespan = Lifespan(wrap_app(app, config.wsgi_max_body_size, None), config, lifespan_state)
            keep_alive, max_requests = self.limits.keep_alive_timeout, self.limits.keep_alive_max_requests

            async def connection(stream: trio.abc.Stream) -> None:
                assert isinstance(stream, trio.SocketStream)
                guarded = GuardedStream(stream, HTTP_WRITE_SECONDS)
                await HTTP11Connection(app, guarded, lifespan_state, keep_alive_timeout=keep_alive, max_requests=max_requests).run()

            acceptor = ConnectionAcceptor(flood, log, cap=self.limits.connection_cap, refuse=_refuse_busy)
            async with trio.open_nursery() as nursery:
                await nursery.start(lifespan.handle_lifespan)
                await lifespan.wait_for_startup()
                await nursery.start(flood.serve)
                await nursery.start(acceptor.serve, connection, listeners)
                task_status.started(urls)
        finally:
            for sock in sockets.insecure_sockets:
                sock.close()
            for path in unix_paths:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)


def _busy_response() -> bytes:
    """The answer to a connection over the cap, written before any of its request is read."""
    body = json.dumps({"error": {
        "code": errors.INTERNAL_ERROR, "name": errors.ERROR_NAMES[errors.INTERNAL_ERROR],
        "message": "the server has as many HTTP connections open as it allows (http_max_connections); try again",
    }}).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
        f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


BUSY_RESPONSE = _busy_response()


async def _refuse_busy(stream: trio.abc.Stream) -> None:
    """Answer a connection over the cap with a JSON 503, then read what it sent until it closes
    (`ConnectionAcceptor` bounds this): closing with its request unread would reset the
    connection, and the client could lose the answer."""
    await stream.send_all(BUSY_RESPONSE)
    with contextlib.suppress(AttributeError):
        await stream.send_eof()  # type: ignore[attr-defined]
    while await stream.receive_some(65536):
        pass


async def _not_found(scope: Scope, receive: Receive, send: Send) -> None:
    """The router's answer for a path no route serves: the documented JSON error, 404."""
    err = RelayError(errors.NOT_FOUND, f"no such endpoint: {scope.get('method', '')} {scope.get('path', '')}".strip())
    await error_response(err, 404)(scope, receive, send)
