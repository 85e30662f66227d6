"""A 2026-07-28 caller's `caller_tool_response` and `session_events` on `/mcp`, answered beside the
MCP SDK: the HTTP twin of the stdio line router (stdio.py, `oubliette_runtime/fast_tool_calls.py`).

Why: a relayed call for a caller over HTTP is two POSTs (the `session_events` long poll that
brings the request, the `caller_tool_response` that answers it), and each went through Starlette's
routing and middleware, the SDK's session manager and its modern request handler (OpenTelemetry
and request-state middlewares, pydantic validation of the params, the result dump): most of the
server's CPU per relayed call (docs/SCALING.md, "A caller over HTTP"). A 2026-07-28 `tools/call`
is one self-contained POST of a fixed shape, so this ASGI app, in front of the SDK's, reads it,
runs the same checks with the SDK's own functions, the same call (`call_as_caller`) and the
SDK's own result shaping and writer.

A request is taken only when all of these hold; any other request goes to the SDK unchanged
(its body, once read here, replayed), which answers it exactly as before — every refusal
(Content-Type, Host, Origin, Accept, protocol version, the `Mcp-Method`/`Mcp-Name`/`Mcp-Param-*`
headers, the body limit, non-JSON, a malformed envelope) is the SDK's:

- a POST to `/mcp` whose `MCP-Protocol-Version` is a 2026-07-28-era version, that passes the
  SDK's transport security (`TransportSecurityMiddleware`: Content-Type, Host, Origin) and Accept
  check (JSON and SSE), with a body within the SDK's limit;
- the body is `{"jsonrpc": "2.0", "id": <string or integer>, "method": "tools/call", "params":
  {"name": ..., "arguments": {...}, "_meta": {...}}}` with no other keys, the SDK's header ladder
  (`find_duplicated_routing_header`, `classify_inbound_request`, `validate_mcp_param_headers`
  against the tool's `inputSchema`) and its surface validation of the params pass;
- the tool is `session_events`, `caller_tool_progress` or `caller_tool_response`, and the arguments
  carry an `owner_key` string (without one the caller is a new one that owns nothing: the SDK's);
  a `caller_tool_response` with `wait` only from a client that declares no elicitation in its
  envelope (with elicitation a wait that stops for an approval answers `input_required`, whose
  `requestState` the SDK's `RequestStateBoundary` seals: the SDK's).

A call with `wait` runs with the context the SDK's runner makes (`ServerRunner._make_context`:
its `ServerSession` over the SDK's single-exchange dispatch context), so the session's events
that ride the request are encoded as the SDK encodes them; its sink (`_ResponseWriter`) writes
each onto the response from the task that sends it: the first one commits the answer to SSE.

The answer is what the SDK would send: the tool's result shaped by the SDK's runner
(`ServerRunner._serialize`: the version's result surface, `resultType`, the `serverInfo` stamp),
written by the SDK's writer: JSON when the call ends within the SDK's keepalive interval without
an event, else an SSE stream of the events, keepalive pings and the response event, as the SDK
commits to SSE. A client that
goes away cancels the call, as on the SDK's path. A taken call gets the span the SDK would make
(`fast_call_span`). `OUBLIETTE_FAST_PATH=0` leaves every request to the SDK;
tests/server/doors/test_http_caller.py drives the same requests both ways.

Owns: no task. The call runs in the request's own task; the watch for the client's disconnect
and the keepalive pings are the connection's task's (`ConnectionWatch`, in the scope's state
under `WATCH_STATE`), so a request is taken only on a connection of our HTTP server
(`HttpApi.serve`) that watches no other request; any other goes to the SDK.
Needs: the SDK `Server` (its tool schemas, result shaping), the transport security settings
the SDK's app has, the body limit, and `call(ctx, name, arguments)`.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from types import SimpleNamespace
from typing import Any, Awaitable, Callable, cast

import anyio
from mcp.server import _streamable_http_modern as sdk_http  # the SDK's own writers and keepalive interval
from mcp.server.lowlevel.server import Server
from mcp.server.connection import Connection
from mcp.server.runner import ServerRunner, _extract_meta, aclose_shielded, modern_error_data
from mcp.server.streamable_http import check_accept_headers
from mcp.server.transport_security import TransportSecurityMiddleware, TransportSecuritySettings
from mcp.shared.inbound import (
    MCP_PARAM_HEADER_PREFIX,
    InboundModernRoute,
    classify_inbound_request,
    find_duplicated_routing_header,
    validate_mcp_param_headers,
    x_mcp_header_map,
)
from mcp.shared.jsonrpc_dispatcher import progress_token_from_params
from mcp.shared.message import ServerMessageMetadata
from mcp.shared.transport_context import TransportContext
from mcp_types import JSONRPCError, JSONRPCResponse
from mcp_types import methods as sdk_methods
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import ValidationError
from starlette.datastructures import State
from starlette.requests import Request

from oubliette_runtime.fast_tool_calls import PARAM_KEYS, REQUEST_KEYS, is_request_id
from oubliette_runtime.trace_spans import fast_call_span

from ..connection_limits import WATCH_STATE, ConnectionWatch, QuickLock, WatchedRequest, hold_next_send

log = logging.getLogger("oubliette.fast_calls")
_sdk_security_log = logging.getLogger("mcp.server.transport_security")

#: `(ctx, tool name, arguments) -> CallToolResult`: the caller's call (`call_as_caller`).
Call = Callable[[Any, str, dict[str, Any]], Awaitable[Any]]

FAST_TOOLS = frozenset({"caller_tool_response", "caller_tool_progress", "session_events"})
#: The tool whose `wait` the fast path takes (from a client without elicitation).
WAITING_TOOL = "caller_tool_response"
_MODERN = frozenset(version.encode() for version in MODERN_PROTOCOL_VERSIONS)
_PARAM_HEADER = MCP_PARAM_HEADER_PREFIX.lower()
_SSE_PING = {"type": "http.response.body", "body": b": ping\r\n\r\n", "more_body": True}


class FastHttpCalls:
    """ASGI app in front of the SDK's `/mcp` (`app`): takes the calls of the module docstring.

    `taken` counts the requests answered here.
    """

    def __init__(
        self, app: Any, server: Server, security: TransportSecuritySettings, max_body: int, path: str, call: Call,
    ) -> None:
        self.app = app
        self.server = server
        self.security = TransportSecurityMiddleware(security)
        self.max_body = max_body
        self.path = path
        self.call = call
        self.taken = 0
        self._shaper = ServerRunner(server, cast(Any, None), None)  # only its result shaping is used
        self._declared: dict[int, tuple[Any, bool]] = {}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if not self._candidate(scope):
            await self.app(scope, receive, send)
            return
        body, rest = await self._read_body(scope, receive)
        taken = None if body is None else self._parse(scope, body)
        watch = scope.get("state", {}).get(WATCH_STATE)
        if taken is None or watch is None or not watch.free():  # no watch: not our HTTP server's connection
            await self.app(scope, _replay(rest, receive), send)
            return
        self.taken += 1
        log.debug("tools/call %r taken off the SDK's path", taken[1]["id"])
        await self._answer(scope, receive, send, watch, *taken)

    def _candidate(self, scope: dict[str, Any]) -> bool:
        """A POST to the path with a 2026-07-28-era `MCP-Protocol-Version` (the SDK's era routing)."""
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != self.path:
            return False
        return next((value for name, value in scope["headers"] if name == b"mcp-protocol-version"), None) in _MODERN

    async def _read_body(self, scope: dict[str, Any], receive: Any) -> tuple[bytes | None, list[dict[str, Any]]]:
        """The whole body within the limit (else None), and the messages read, for the SDK to read again."""
        declared = next((value for name, value in scope["headers"] if name == b"content-length"), None)
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body):
            return None, []
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: the SDK's to see
                return None, [{"type": "http.request", "body": b"".join(chunks), "more_body": True}, message]
            chunk = message.get("body", b"")
            chunks.append(chunk)
            size += len(chunk)
            more = message.get("more_body", False)
            if size > self.max_body or not more:
                body = b"".join(chunks)
                return (None if more or size > self.max_body else body), [{"type": "http.request", "body": body, "more_body": more}]

    def _parse(self, scope: dict[str, Any], body: bytes) -> tuple[Request, dict[str, Any], InboundModernRoute] | None:
        """(the request, its JSON-RPC message, the SDK's verdict on it) of a call taken here, else None."""
        raw, headers = _header_views(scope)
        if not self._secure(headers):
            return None
        has_json, has_sse = check_accept_headers(cast(Request, SimpleNamespace(headers=headers)))
        if not (has_json and has_sse):
            return None
        try:
            message = json.loads(body)
        except (ValueError, RecursionError):
            return None
        if not isinstance(message, dict) or message.keys() != REQUEST_KEYS:
            return None
        if message["jsonrpc"] != "2.0" or message["method"] != "tools/call" or not is_request_id(message["id"]):
            return None
        params = message["params"]
        if not isinstance(params, dict) or not params.keys() <= PARAM_KEYS:
            return None
        name, arguments, meta = params.get("name"), params.get("arguments"), params.get("_meta")
        if name not in FAST_TOOLS or not isinstance(arguments, dict) or not isinstance(meta, dict):
            return None
        if not isinstance(arguments.get("owner_key"), str):
            return None
        waits = arguments.get("wait", False) is not False
        if waits and name != WAITING_TOOL:
            return None
        if find_duplicated_routing_header(raw) is not None:
            return None
        verdict = classify_inbound_request(message, headers=headers)
        if not isinstance(verdict, InboundModernRoute):
            return None
        if waits and verdict.client_capabilities.get("elicitation") is not None:
            return None
        schema = self.server.get_tool_input_schema(name) if self.server.get_tool_input_schema else None
        request = Request(scope)
        if schema is None or (self._declares_headers(schema) and validate_mcp_param_headers(schema, arguments, request.headers)):
            return None
        try:
            sdk_methods.validate_client_request("tools/call", verdict.protocol_version, params)
        except (KeyError, ValidationError):
            return None
        return request, message, verdict

    def _declares_headers(self, schema: Any) -> bool:
        """Whether `schema` declares an `Mcp-Param-*` header (`x-mcp-header`): without one the SDK's
        check of a call's headers passes whatever they are, so it is not walked per request."""
        known = self._declared.get(id(schema))
        if known is None or known[0] is not schema:
            known = self._declared[id(schema)] = (schema, bool(x_mcp_header_map(schema)))
        return known[1]

    def _secure(self, headers: Any) -> bool:
        """The SDK's transport security of a POST (`TransportSecurityMiddleware.validate_request`:
        Content-Type, Host, Origin), its own checks run without their warnings: a request refused
        goes on to the SDK, which refuses it and logs it once."""
        security = self.security
        if not security.settings.enable_dns_rebinding_protection:
            return False
        _sdk_security_log.disabled = True  # no await until it is back: no other task logs meanwhile
        try:
            return bool(
                security._validate_content_type(headers.get("content-type"))
                and security._validate_host(headers.get("host"))
                and security._validate_origin(headers.get("origin"))
            )
        finally:
            _sdk_security_log.disabled = False

    async def _answer(
        self, scope: dict[str, Any], receive: Any, send: Any, watch: ConnectionWatch,
        request: Request, message: dict[str, Any], verdict: InboundModernRoute,
    ) -> None:
        """Run the call and write its answer as the SDK's SSE-mode writer does (`handle_modern_request`):
        JSON if it ends within the keepalive interval without an event, else SSE; the client leaving cancels it."""
        request_id, params, version = message["id"], message["params"], verdict.protocol_version
        writer = _ResponseWriter(scope, send)
        if params["arguments"].get("wait", False) is False:
            ctx: Any = SimpleNamespace(protocol_version=version, request=SimpleNamespace(state=State(scope.setdefault("state", {}))))
            await self._answer_in_request_task(receive, writer, watch, ctx, message, version)
            return
        # its events ride this request: the SDK's context, whose sink writes them onto the response
        connection = Connection.from_envelope(version, verdict.client_info, verdict.client_capabilities)
        dctx = sdk_http._SingleExchangeDispatchContext(
            transport=TransportContext(kind="streamable-http", can_send_request=False, headers=request.headers),
            request_id=request_id, message_metadata=ServerMessageMetadata(request_context=request),
            progress_token=progress_token_from_params(params), sink=cast(Any, writer),
        )
        ctx = ServerRunner(self.server, connection, None)._make_context(
            dctx, "tools/call", params, _extract_meta(params), version)
        try:
            await self._answer_in_request_task(receive, writer, watch, ctx, message, version)
        finally:
            await aclose_shielded(connection)

    async def _outcome(self, ctx: Any, message: dict[str, Any], version: str) -> JSONRPCResponse | JSONRPCError:
        """The call's JSON-RPC answer: its result shaped as the SDK's runner shapes it, or the error its
        exception-to-wire boundary makes; under the span the SDK would make (`fast_call_span`)."""
        request_id, params = message["id"], message["params"]
        name = params["name"]
        with fast_call_span(name, request_id, params["_meta"]) as ended:
            try:
                result = self._shaper._serialize("tools/call", version, await self.call(ctx, name, params["arguments"]))
            except Exception as exc:  # as the SDK's exception-to-wire boundary
                return JSONRPCError(jsonrpc="2.0", id=request_id, error=modern_error_data(exc))
            ended(result)
            return JSONRPCResponse(jsonrpc="2.0", id=request_id, result=result)

    async def _answer_in_request_task(
        self, receive: Any, writer: _ResponseWriter, watch: ConnectionWatch, ctx: Any, message: dict[str, Any], version: str,
    ) -> None:
        """The call runs in the request's own task, watched by its connection's task (`ConnectionWatch`:
        no task or nursery of the request's own): the client leaving cancels the call, and past each
        keepalive interval without an event the answer is committed to SSE and pinged, as the SDK's
        writer does. The call's events (a `wait`'s) are written by the task that sends them, through
        `writer` (the SDK's dispatch context's sink). The answer is written once the call has
        returned, after a ping being written: the last writer."""
        outcome: JSONRPCResponse | JSONRPCError | None = None
        with watch.watching(writer.ping, sdk_http._SSE_PING_INTERVAL) as writer.watched, writer.watched.call:
            try:
                outcome = await self._outcome(ctx, message, version)
            finally:
                writer.closed = True
        if outcome is None:  # the client went away: nothing to answer
            return
        async with writer.lock:
            if writer.sse:  # the event and the body's end are one write
                await writer.asgi_send({"type": "http.response.body", "body": sdk_http._sse_event(outcome), "more_body": False})
            else:
                hold_next_send(writer.scope)  # the head goes out with the body (and its end)
                await sdk_http._write(outcome, writer.scope, receive, writer.asgi_send)


class _ResponseWriter:
    """The response of a taken call while it runs: commits it to SSE at its first event or ping (the
    head goes out with it, `hold_next_send`), one writer at a time (`lock`).

    It is also the sink of the SDK's dispatch context (`send`, as its memory stream's): a call's
    event goes out from the task that sends it, and pushes the next ping a keepalive interval on
    (`watched.quiet`), as the SDK's writer pings only past an interval without an event. Once the
    call has returned (`closed`) an event is dropped, as the SDK drops one sent after its stream closed.
    """

    def __init__(self, scope: dict[str, Any], send: Any) -> None:
        self.scope = scope
        self.asgi_send = send
        self.sse = False
        self.closed = False
        self.watched: WatchedRequest | None = None
        self.lock = QuickLock()

    async def write(self, message: dict[str, Any]) -> None:
        """Send one body message of the SSE stream, its head first if not sent yet."""
        async with self.lock:
            if not self.sse:
                self.sse = True
                hold_next_send(self.scope)
                await self.asgi_send({"type": "http.response.start", "status": 200, "headers": sdk_http._SSE_HEADERS})
            await self.asgi_send(message)

    async def ping(self) -> None:
        """A keepalive ping (on the connection's task), unless the call has returned."""
        if not self.closed:
            await self.write(_SSE_PING)

    async def send(self, data: bytes) -> None:
        """One SSE event of the call (the SDK's `_sse_event` bytes)."""
        if self.closed:
            raise anyio.ClosedResourceError
        await self.write({"type": "http.response.body", "body": data, "more_body": True})
        if self.watched is not None:
            self.watched.quiet()


def _header_views(scope: dict[str, Any]) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """The request's headers decoded in one pass: every line (for the SDK's duplicate check) and the
    first value of each name, the mapping `dict(request.headers)` gives (a Starlette `Headers`
    scans every line for each name it is asked: eleven scans a request here)."""
    raw = [(name.decode("latin-1"), value.decode("latin-1")) for name, value in scope["headers"]]
    first: dict[str, str] = {}
    for name, value in raw:
        first.setdefault(name, value)
    return raw, first


def _replay(messages: list[dict[str, Any]], receive: Any) -> Any:
    """`receive` with the messages already read given first."""
    queue = deque(messages)

    async def replay() -> dict[str, Any]:
        return queue.popleft() if queue else await receive()

    return replay
