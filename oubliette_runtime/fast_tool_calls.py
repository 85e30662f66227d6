"""Plain `tools/call` requests answered beside the MCP SDK's dispatcher, on a stdio MCP server.

Why: a relayed call crosses two MCP endpoints on top of what a direct stdio tool costs (the
agent's `tools/call` at oubliette-client, the caller's `caller_tool_response` at
oubliette-server), and at each the SDK's per-request machinery — surface validation, pydantic
params, the middleware chain, the request context, the result sieve and the hand-off to its
writer task — was about half of the process's CPU per call, all of it on the call's critical
path. A handshake-era `tools/call` has one fixed shape, so the program reads it straight off
the line, runs the same handler the SDK would, and writes the response line itself.

A line is taken only when all of these hold; any other line goes to the SDK unchanged, which
answers it exactly as before:

- it is a JSON-RPC request `{"jsonrpc": "2.0", "id": <string or integer>, "method":
  "tools/call", "params": {"name": <string>, "arguments"?: <object>, "_meta"?:
  {"progressToken"?: <string or integer>, ...}}}` with no other keys, whose `_meta` is not
  the 2026-07-28 envelope (`modern_envelope`: such a request always goes to the SDK);
- the program's `route(name, arguments)` gives a handler for it (each program takes only
  calls of a handshake-era peer that finished `initialize`, and only the tools it names);
- no other call taken here is in flight with the same id.

The handler returns what the SDK path would send for the same call (`call_result`: the
`CallToolResult` dumped and shaped for the negotiated version as the SDK does). `notifications/cancelled` for a taken call's id cancels it and no response is
sent, as the SDK does; the notification still reaches the SDK, which ignores ids it does not
hold. Each program's line router uses it (oubliette_client/line_router.py,
oubliette_server/doors/caller_api/stdio.py); `OUBLIETTE_FAST_PATH=0` turns both routers off.

Spans: a taken call gets the span the SDK would make (`tools/call {name}`, its attributes, under
the call's `_meta.traceparent`; oubliette_runtime/trace_spans.py `fast_call_span`) when spans are exported
or the call carries trace context to pass on, and none otherwise.

Owns: one task per taken call, in the nursery `run` holds; each writes its own response.
Needs: a `write(text)` safe to call from several tasks (`stdio_streams.StdoutText`).
Cancellation: cancelling `run` cancels every taken call; no response is written for them.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import trio

from .trace_spans import fast_call_span

__all__ = [
    "PARAM_KEYS", "REQUEST_KEYS", "FastToolCalls", "Handler", "Route", "SendProgress", "call_result", "fast_path_enabled", "is_request_id",
    "modern_envelope",
    "notification_line", "response_line", "tool_error",
]

#: Sends one `notifications/progress` on the call's token: (progress, total, message).
SendProgress = Callable[[float, "float | None", "str | None"], Awaitable[None]]
#: Runs one taken call: (progress token or None, its progress sender or None) → the result object (JSON).
Handler = Callable[["str | int | None", "SendProgress | None"], Awaitable[dict[str, Any]]]
#: (tool name, arguments) → the handler when this path takes the call, None to leave it to the SDK.
Route = Callable[[str, dict[str, Any]], "Handler | None"]

log = logging.getLogger("oubliette.fast_calls")

_CALL_MARK = '"tools/call"'
_CANCEL_MARK = '"notifications/cancelled"'
#: The keys of a plain `tools/call` request and of its params (the fixed shape the fast paths take).
REQUEST_KEYS = frozenset({"jsonrpc", "id", "method", "params"})
PARAM_KEYS = frozenset({"name", "arguments", "_meta"})
#: The `_meta` key that makes a request one of the 2026-07-28 era (the SDK's rule: the key alone).
_MODERN_META = "io.modelcontextprotocol/protocolVersion"
_OFF = frozenset({"0", "false", "no", "off"})


def fast_path_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """The one switch of what the programs do beside the MCP SDK and Python's defaults (their line
    routers, the frozen start-up heap): on unless `OUBLIETTE_FAST_PATH` is `0`, `false`, `no` or
    `off`, which leaves the SDK, the reference, to answer every line."""
    return environ.get("OUBLIETTE_FAST_PATH", "1").strip().lower() not in _OFF


def modern_envelope(meta: Any) -> bool:
    """Whether a request's `_meta` is the 2026-07-28 per-request envelope (its protocol version key)."""
    return isinstance(meta, dict) and _MODERN_META in meta


def is_request_id(value: Any) -> bool:
    """A JSON-RPC request id this path takes: a string or an integer (not a bool)."""
    return isinstance(value, (str, int)) and not isinstance(value, bool)


#: One encoder for every line (`json.dumps` with options builds a new one per call).
_ENCODE = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def _line(message: dict[str, Any]) -> str:
    """One JSON-RPC line, compact and UTF-8 like the SDK's stdio writer."""
    return _ENCODE(message) + "\n"


def response_line(request_id: str | int, result: Any) -> str:
    """A JSON-RPC result response as one stdio line, as the SDK would write it."""
    return _line({"jsonrpc": "2.0", "id": request_id, "result": result})


def error_line(request_id: str | int, code: int, message: str) -> str:
    """A JSON-RPC error response as one stdio line."""
    return _line({"jsonrpc": "2.0", "id": request_id, "error": {"code": code, "message": message}})


def call_result(result: Any, version: str) -> dict[str, Any]:
    """A `CallToolResult` model as the SDK puts it on the wire for protocol `version`.

    The same two steps as the SDK's runner: the model's JSON dump, then the version's result
    surface (which drops what that version does not have, e.g. `resultType` before 2026-07-28).
    """
    from mcp_types.methods import serialize_server_result

    dumped = result.model_dump(by_alias=True, mode="json", exclude_none=True)
    return serialize_server_result("tools/call", version, dumped)


def tool_error(text: str) -> Any:
    """An MCP tool result (`CallToolResult`) that reports `text` as an error (`is_error=True`)."""
    import mcp_types as types  # on first use: the client's cold start does not load the SDK's types

    return types.CallToolResult(content=[types.TextContent(text=text)], is_error=True)


def notification_line(method: str, params: dict[str, Any] | None = None) -> str:
    """A JSON-RPC notification as one stdio line, as the SDK would write it (no params: none written)."""
    return _line({"jsonrpc": "2.0", "method": method, **({} if params is None else {"params": params})})


class FastToolCalls:
    """Takes plain `tools/call` lines off the SDK's path when `route` says so (see module docstring).

    Owns: the in-flight table (request id → cancel scope) and the tasks answering the calls.
    Needs: `route` and the shared writer.
    """

    def __init__(self, route: Route, write: Callable[[str], Awaitable[None]]) -> None:
        self.route = route
        self.write = write
        self.taken = 0
        self._in_flight: dict[str | int, trio.CancelScope] = {}
        self._nursery: trio.Nursery | None = None

    @property
    def in_flight(self) -> int:
        """How many taken calls are not answered yet."""
        return len(self._in_flight)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold the nursery of taken calls until cancelled; `started()` once lines may be taken."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    async def lines(self, source: AsyncIterable[str]) -> AsyncIterator[str]:
        """The lines of `source` the SDK must see: all but the calls taken here."""
        async for line in source:
            if not self.take(line):
                yield line

    def take(self, line: str) -> bool:
        """Start answering `line` when it is a call this path takes (True); a cancel of a taken
        call cancels it and, like every other line, is the SDK's too (False)."""
        if self._nursery is None:
            return False
        if _CANCEL_MARK in line:
            self._cancel(line)
            return False
        if _CALL_MARK not in line:
            return False
        call = self._parse_call(line)
        if call is None:
            return False
        request_id, handler, token, name, meta = call
        log.debug("tools/call %r taken off the SDK's path", request_id)
        scope = trio.CancelScope()
        self._in_flight[request_id] = scope
        self.taken += 1
        self._nursery.start_soon(self._answer, scope, request_id, handler, token, name, meta)
        return True

    def _parse_call(self, line: str) -> tuple[str | int, Handler, str | int | None, str, dict[str, Any]] | None:
        """(id, handler, progress token, tool name, `_meta`) of a call this path takes, else None."""
        try:
            message = json.loads(line)
        except (ValueError, RecursionError):  # not ours: the SDK answers it with its own error
            return None
        if not isinstance(message, dict) or message.keys() != REQUEST_KEYS:
            return None
        if message["jsonrpc"] != "2.0" or message["method"] != "tools/call":
            return None
        request_id, params = message["id"], message["params"]
        if not is_request_id(request_id) or request_id in self._in_flight:
            return None
        if not isinstance(params, dict) or not params.keys() <= PARAM_KEYS:
            return None
        name, arguments, meta = params.get("name"), params.get("arguments", {}), params.get("_meta", {})
        if not isinstance(name, str) or not isinstance(arguments, dict):
            return None
        if not isinstance(meta, dict) or modern_envelope(meta):
            return None
        token = meta.get("progressToken")
        if token is not None and not is_request_id(token):
            return None
        handler = self.route(name, arguments)
        return None if handler is None else (request_id, handler, token, name, meta)

    def _cancel(self, line: str) -> None:
        try:
            message = json.loads(line)
        except (ValueError, RecursionError):
            return
        params = message.get("params") if isinstance(message, dict) else None
        request_id = params.get("requestId") if isinstance(params, dict) else None
        if is_request_id(request_id) and request_id in self._in_flight:
            self._in_flight[request_id].cancel()

    async def _answer(
        self, scope: trio.CancelScope, request_id: str | int, handler: Handler, token: str | int | None,
        name: str, meta: dict[str, Any],
    ) -> None:
        result = None
        try:
            with scope, fast_call_span(name, request_id, meta) as ended:
                result = await handler(token, None if token is None else self._progress_sender(token))
                ended(result)
        finally:
            del self._in_flight[request_id]
        if result is not None:
            await self.write(response_line(request_id, result))

    def _progress_sender(self, token: str | int) -> SendProgress:
        async def send(progress: float, total: float | None, message: str | None) -> None:
            params: dict[str, Any] = {"progressToken": token, "progress": progress}
            if total is not None:
                params["total"] = total
            if message is not None:
                params["message"] = message
            await self.write(notification_line("notifications/progress", params))
        return send
