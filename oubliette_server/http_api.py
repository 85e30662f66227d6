"""The HTTP listener: the tether API and the caller's MCP over Streamable HTTP.

One hypercorn (Trio worker) server serves one Starlette app:

- `POST /v1/instances/{id}/tether`: ingress of a frame (a `user.message` wakes the instance);
- `GET  /v1/instances/{id}/tether/poll`: `{frames, next_seq, timed_out}`, long poll up to `wait_ms`;
- `GET  /v1/instances/{id}/tether/stream`: SSE, each event's id is its `seq`; `Last-Event-ID` resumes;
- `/mcp`: the caller's MCP (Streamable HTTP, SSE responses, `tools.listChanged` advertised).

Auth: on TCP every request needs `Authorization: Bearer <token>`: the server's
HTTP token (`oubliette-server http-token`) for everything, or an instance's own
token for that instance's `/v1/instances/{id}/…` routes. A Unix socket
listener is created with mode 0600 and needs no token: file access is the
credential. /mcp also checks the Host header against loopback names plus
`allowed_hosts` (DNS-rebinding protection); see docs/TETHER.md for containers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from typing import Any, Callable

import trio
from mcp.server.transport_security import TransportSecuritySettings
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from protocol import RelayError, errors
from protocol.limits import LimitExceeded

from .auth import HTTP_ADMIN
from .caller_api import CallerTools, build_caller_server
from .callers import CallerConnection, CallerRegistry
from .instances import InstanceDirectory
from .tether import Tether

VerifyToken = Callable[[str, str], bool]

log = logging.getLogger("oubliette.server.http")

MAX_BODY_BYTES = 1024 * 1024
SSE_KEEPALIVE_SECONDS = 15.0
INSTANCE_ROUTE = re.compile(r"^/v1/instances/([^/]+)/")
HTTP_STATUS = {
    errors.INVALID_PARAMS: 400, errors.INVALID_REQUEST: 400, errors.PARSE_ERROR: 400,
    errors.NOT_FOUND: 404, errors.UNAUTHORIZED: 401, errors.DENIED: 403,
}



class BodyTooLarge(RelayError):
    """A request body over MAX_BODY_BYTES (HTTP 413)."""

    def __init__(self) -> None:
        super().__init__(errors.INVALID_REQUEST, f"request body is larger than {MAX_BODY_BYTES} bytes")


def error_response(err: RelayError, status: int | None = None) -> JSONResponse:
    """A JSON error body for `err`, with `status` or the HTTP status its code maps to (400 by default)."""
    return JSONResponse(
        {"error": {"code": err.code, "name": errors.ERROR_NAMES.get(err.code, "error"), "message": err.message}},
        status_code=status or HTTP_STATUS.get(err.code, 400),
    )


class BearerAuth:
    """ASGI middleware: TCP requests need a valid bearer token; Unix socket ones rely on the file mode."""

    def __init__(self, app: Any, verify_token: VerifyToken) -> None:
        self.app = app
        self.verify_token = verify_token

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("server") is None:  # lifespan, or a Unix socket listener
            await self.app(scope, receive, send)
            return
        token = _bearer(scope)
        if token is not None and self._allowed(token, scope["path"]):
            scope.setdefault("state", {})["oubliette_token"] = token
            await self.app(scope, receive, send)
            return
        message = "missing bearer token" if token is None else "this bearer token is not valid for this resource"
        response = error_response(RelayError(errors.UNAUTHORIZED, message))
        response.headers["WWW-Authenticate"] = 'Bearer realm="oubliette"'
        await response(scope, receive, send)

    def _allowed(self, token: str, path: str) -> bool:
        if self.verify_token(HTTP_ADMIN, token):
            return True
        match = INSTANCE_ROUTE.match(path)
        return bool(match) and self.verify_token(match.group(1), token)


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

    A long poll ends with its request (seed 004: "cancellation via request context")
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
        """The Starlette routes: tether ingress, poll, stream, and `/v1/health`."""
        return [
            Route("/v1/instances/{instance}/tether", self.ingress, methods=["POST"]),
            Route("/v1/instances/{instance}/tether/poll", self.poll, methods=["GET"]),
            Route("/v1/instances/{instance}/tether/stream", self.stream, methods=["GET"]),
            Route("/v1/health", self.health, methods=["GET"]),
        ]

    async def health(self, request: Request) -> Response:
        """`GET /v1/health`: `ok` and the connected instances."""
        return JSONResponse({"ok": True, "connected_instances": self.instances.connected_instances()})

    async def ingress(self, request: Request) -> Response:
        """`POST /v1/instances/{id}/tether`: store one frame; 201 with its `msg_id` and `seq`.

        Errors are JSON responses: 413 for a body or value over the size limits, 400/404 for the
        rest (by error code).
        """
        try:
            instance = self.instances.require_known(request.path_params["instance"])
            body = await self._json_body(request)
            frame = await self.tether.ingest(instance, body)
        except BodyTooLarge as err:
            return error_response(err, 413)
        except LimitExceeded as err:
            return error_response(err, 413 if err.is_size else 400)
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
            instance = self.instances.require_known(request.path_params["instance"])
            filters = dict(
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
            instance = self.instances.require_known(request.path_params["instance"])
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
            async for frame in frames:
                if frame is None:
                    yield ": keepalive\n\n"
                else:
                    yield f"id: {frame['seq']}\nevent: frame\ndata: {json.dumps(frame, ensure_ascii=False)}\n\n"

        return StreamingResponse(
            events(), media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )


class HttpApi:
    """Builds the ASGI app and serves it on the configured listeners.

    Needs: the caller registry (one caller per MCP session or per bearer token), the caller
    tools, the tether and instance directory (for the routes), `verify_token(name, token)` and
    the extra Host names allowed on /mcp. Start `serve` with `nursery.start`: it reports the
    bound URLs.
    """

    def __init__(
        self,
        *,
        callers: CallerRegistry,
        tools: CallerTools,
        tether: Tether,
        instances: InstanceDirectory,
        verify_token: VerifyToken,
        allowed_hosts: list[str],
    ) -> None:
        self.callers = callers
        self.tether = tether
        self.instances = instances
        self.verify_token = verify_token
        self.allowed_hosts = allowed_hosts
        self._modern_callers: dict[str, CallerConnection] = {}
        self._legacy_callers: dict[int, CallerConnection] = {}
        self.mcp = build_caller_server(tools, self._resolve_caller)

    def _resolve_caller(self, ctx: Any) -> CallerConnection:
        """One caller per handshake-era MCP session; per bearer token on 2026-07-28 (no sessions)."""
        if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS:
            token = getattr(getattr(ctx.request, "state", None), "oubliette_token", None) or "unix-socket"
            key = hashlib.sha256(token.encode()).hexdigest()[:12]
            caller = self._modern_callers.get(key)
            if caller is None:
                caller = self._modern_callers[key] = self.callers.open("http", f"http-modern-{key}")
            return caller
        connection = ctx.session._connection  # the SDK's per-connection state; its exit stack runs on close
        caller = self._legacy_callers.get(id(connection))
        if caller is None:
            caller = self.callers.open("http", f"http-session-{connection.session_id or id(connection)}")
            self._legacy_callers[id(connection)] = caller

            async def closed() -> None:
                self._legacy_callers.pop(id(connection), None)
                self.callers.close(caller)

            connection.exit_stack.push_async_callback(closed)
        caller.mcp_session = ctx.session
        return caller

    def asgi_app(self) -> Any:
        """The ASGI app: `/mcp` (with Host checks) and the tether routes, behind the bearer-token check."""
        allowed = ["127.0.0.1:*", "localhost:*", "[::1]:*", *self.allowed_hosts]
        starlette = self.mcp.streamable_http_app(
            streamable_http_path="/mcp",
            transport_security=TransportSecuritySettings(
                enable_dns_rebinding_protection=True,
                allowed_hosts=allowed,
                allowed_origins=[f"http://{host}" for host in allowed] + [f"https://{host}" for host in allowed],
            ),
            custom_starlette_routes=TetherRoutes(self.tether, self.instances).routes(),
        )
        starlette.router.default = _not_found  # unknown paths answer the JSON error shape too
        return BearerAuth(starlette, self.verify_token)

    async def serve(self, binds: list[str], *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve the app with hypercorn on `binds` (`host:port` or `unix:PATH`) until cancelled.

        Needs: `nursery.start`, which returns the bound addresses. Owns: the listeners; a Unix
        socket is created mode 0600 (a file already at its path is replaced).
        Raises: `OSError` when an address cannot be bound.
        Cancellation: hypercorn stops, giving open requests up to a second.
        """
        import hypercorn.config
        import hypercorn.trio

        config = hypercorn.config.Config()
        config.bind = binds
        config.errorlog = logging.getLogger("oubliette.server.http.hypercorn")
        config.accesslog = None
        config.graceful_timeout = 1.0
        unix_paths = [b[len("unix:"):] for b in binds if b.startswith("unix:")]
        for path in unix_paths:
            os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)
            if os.path.exists(path):
                os.unlink(path)

        # Unix listeners are created 0600: hypercorn binds under a strict umask,
        # restored as soon as it reports its listeners bound.
        lock_down = _UmaskUntilStarted(task_status, unix_paths)
        try:
            await hypercorn.trio.serve(self.asgi_app(), config, task_status=lock_down)
        finally:
            lock_down.restore()


async def _not_found(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The router's answer for a path no route serves: the documented JSON error, 404."""
    err = RelayError(errors.NOT_FOUND, f"no such endpoint: {scope.get('method', '')} {scope.get('path', '')}".strip())
    await error_response(err, 404)(scope, receive, send)


class _UmaskUntilStarted:
    """A task_status for hypercorn: strict umask while binding, then chmod 0600 and report."""

    def __init__(self, inner: trio.TaskStatus[list[str]], unix_paths: list[str]) -> None:
        self._inner = inner
        self._paths = unix_paths
        self._old_umask: int | None = os.umask(0o177)

    def restore(self) -> None:
        if self._old_umask is not None:
            os.umask(self._old_umask)
            self._old_umask = None

    def started(self, value: Any = None) -> None:
        self.restore()
        for path in self._paths:
            os.chmod(path, 0o600)
        self._inner.started(value)
