"""The caller-facing MCP server: the tools a caller (an app, or Claude Code on the host) uses.

One `mcp.server.Server` is built per transport; `resolve_caller` maps a request
to the `CallerConnection` it belongs to, which decides who may answer which
caller tool request and where events are pushed.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from typing import Any, Awaitable, Callable

import mcp_types as types
import trio
from mcp.server import Server
from mcp.server.lowlevel.server import NotificationOptions
from mcp.server.models import InitializationOptions
from mcp.server.subscriptions import InMemorySubscriptionBus, ListenHandler
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from protocol import FRAME_TYPES, CallerToolSpec, RelayError, errors, structure
from protocol.descriptors import DESCRIPTOR_META_KEY
from protocol.schema_check import first_problem

from . import caller_tools_schema as schemas
from .app import OublietteServer
from .callers import CallerConnection, RequestScopedSink
from .ids import channel_problem, session_id_problem, strict_validator
from .sessions import Session, new_session_id
from .store import CursorPruned, FrameQuery

log = logging.getLogger("oubliette.server.caller_mcp")

ResolveCaller = Callable[[Any], CallerConnection]
ToolHandler = Callable[[Any, CallerConnection, dict[str, Any]], Awaitable[dict[str, Any]]]

TURN_END_TYPES = ("assistant.done", "session.error")


def tool_result(payload: dict[str, Any]) -> types.CallToolResult:
    return types.CallToolResult(
        content=[types.TextContent(text=json.dumps(payload, ensure_ascii=False))],
        structured_content=payload,
    )


def tool_error(text: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(text=text)], is_error=True)


class CallerTools:
    """The tool table and its handlers, bound to one server."""

    def __init__(self, app: OublietteServer) -> None:
        self.app = app
        self.tools: dict[str, tuple[types.Tool, ToolHandler]] = {}
        self._validators: dict[str, Any] = {}
        self.add(
            "session_message",
            "Send a message to the agent of an instance. Optionally declare your caller tools "
            "(context.caller_tools) that the agent may call back; their requests reach you as "
            "caller_tool_request events. With wait, return when the turn ends.",
            schemas.SESSION_MESSAGE, self.session_message,
        )
        self.add(
            "caller_tool_response",
            "Answer a caller_tool_request with its result, or with error text.",
            schemas.CALLER_TOOL_RESPONSE, self.caller_tool_response,
        )
        self.add(
            "session_events",
            "Read the frames of a session after a cursor; long-polls up to wait_ms.",
            schemas.SESSION_EVENTS, self.session_events,
        )
        self.add("tether_send", schemas.TETHER_SEND_DESCRIPTION, schemas.TETHER_SEND, self.tether_send)
        self.add("tether_read", schemas.TETHER_READ_DESCRIPTION, schemas.TETHER_READ, self.tether_read)

    def add(self, name: str, description: str, schema: dict[str, Any], handler: ToolHandler) -> None:
        descriptor = {
            "name": name, "description": description, "command": f"tools/call {name} '<arguments as JSON>'",
            "origin": "local", "safety": schemas.SAFETY[name], "input_schema": schema,
            "result_schema": schemas.RESULT_SCHEMAS[name],
        }
        tool = types.Tool(name=name, description=description, input_schema=schema, meta={DESCRIPTOR_META_KEY: descriptor})
        self.tools[name] = (tool, handler)
        self._validators[name] = strict_validator(schema)

    async def call(self, ctx: Any, caller: CallerConnection, name: str, arguments: dict[str, Any]) -> types.CallToolResult:
        entry = self.tools.get(name)
        if entry is None:
            return tool_error(f"unknown tool '{name}'; this server has: {', '.join(sorted(self.tools))}")
        _, handler = entry
        problem = first_problem(self._validators[name], arguments, "invalid arguments")
        if problem:
            return tool_error(f"{name}: {problem}")
        try:
            return tool_result(await handler(ctx, caller, arguments))
        except RelayError as err:
            return tool_error(f"{name}: {err.message}")

    # -- session_message -----------------------------------------------------------------

    async def session_message(self, ctx: Any, caller: CallerConnection, args: dict[str, Any]) -> dict[str, Any]:
        app = self.app
        instance = app.resolve_instance(args.get("instance"))
        session = app.sessions.get_or_create(instance, "mcp", args.get("session_id") or new_session_id())
        context = args.get("context")
        if context is not None:
            tools = [structure(tool, CallerToolSpec) for tool in context.get("caller_tools", [])]
            await app.declare_caller_tools(session, caller, context["caller_id"], tools)
        session.sinks.add(caller)
        frame = await app.ingress(instance, session.channel, session.id, "user.message", {"text": args["message"]})
        result: dict[str, Any] = {
            "session_id": session.id, "instance": instance, "msg_id": frame.msg_id, "ingress_seq": frame.seq,
        }
        wait = args.get("wait", False)
        if wait is False:
            return result
        limit = app.config.session_wait_limit
        seconds = limit if wait is True else min(float(wait), limit)
        result.update(await self._wait_for_turn(ctx, caller, session, frame.msg_id, frame.seq, seconds))
        return result

    async def _wait_for_turn(
        self, ctx: Any, caller: CallerConnection, session: Session, msg_id: str, after_seq: int, seconds: float
    ) -> dict[str, Any]:
        query = FrameQuery(
            channel=session.channel, session_id=session.id, after_seq=after_seq,
            types=TURN_END_TYPES, reply_to=msg_id, limit=1,
        )
        async with trio.open_nursery() as nursery:
            sink = None
            if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS:
                # 2026-07-28 callers have no standalone stream: events ride this request.
                sink = RequestScopedSink(ctx.session, ctx.request_id)
                session.sinks.add(sink)
                nursery.start_soon(sink.run)
            try:
                frames, _ = await self.app.store.wait_for_frames(session.instance, query, timeout=seconds)
            finally:
                if sink is not None:
                    session.sinks.discard(sink)
                    sink.close()
        pending = [
            {"request_id": p.request_id, "tool": p.tool} for p in self.app.calls.pending_for(session)
        ]
        if not frames:
            return {"stop_reason": "timeout", "text": "", "pending": pending}
        end = frames[0]
        if end.type == "session.error":
            return {"stop_reason": "error", "text": end.payload.get("message", ""), "pending": pending}
        return {"stop_reason": "end_turn", "text": end.payload.get("text", ""), "pending": pending}

    # -- caller_tool_response ------------------------------------------------------------

    async def caller_tool_response(self, ctx: Any, caller: CallerConnection, args: dict[str, Any]) -> dict[str, Any]:
        if args.get("error") is None and "result" not in args:
            raise RelayError(errors.INVALID_PARAMS, "give either 'result' or 'error'")
        if args.get("error") is not None and args.get("result") is not None:
            raise RelayError(errors.INVALID_PARAMS, "give 'result' or 'error', not both")
        await self.app.calls.respond(
            caller, args["session_id"], args["request_id"], result=args.get("result"), error=args.get("error"),
        )
        return {"resolved": True}

    # -- session_events ------------------------------------------------------------------

    async def session_events(self, ctx: Any, caller: CallerConnection, args: dict[str, Any]) -> dict[str, Any]:
        session_id = args["session_id"]
        channel = args.get("channel", "mcp")
        problem = channel_problem(channel)
        if problem:
            raise RelayError(errors.INVALID_PARAMS, problem)
        if args.get("instance"):
            # Like tether_read: an instance the server has never heard of is an error, not an empty log.
            instance = self.app.require_known_instance(args["instance"])
        else:
            matches = [s for s in self.app.sessions.find_by_id(session_id) if s.channel == channel]
            if len(matches) != 1:
                if not matches:
                    raise RelayError(errors.NOT_FOUND, f"unknown session '{session_id}'; pass 'instance' to read its log")
                raise RelayError(errors.INVALID_PARAMS, f"session '{session_id}' exists in several instances; pass 'instance'")
            instance = matches[0].instance
        return await read_frames(
            self.app, instance, channel=channel, session_id=session_id,
            after_seq=args.get("after_seq", 0), limit=args.get("limit", 50),
            wait_ms=args.get("wait_ms", 0), types=args.get("types"),
        )

    # -- tether (seed 004) ---------------------------------------------------------------

    async def tether_send(self, ctx: Any, caller: CallerConnection, args: dict[str, Any]) -> dict[str, Any]:
        instance = self.app.require_known_instance(args["instance"])
        session_id = args.get("session_id") or DEFAULT_TETHER_SESSION
        check_session_id(session_id)
        frame = await self.app.ingress(
            instance, TETHER_CHANNEL, session_id, "user.message", {"text": args["text"]},
            msg_id=host_msg_id(),
        )
        return {"msg_id": frame.msg_id, "session_id": session_id, "ingress_seq": frame.seq}

    async def tether_read(self, ctx: Any, caller: CallerConnection, args: dict[str, Any]) -> dict[str, Any]:
        instance = self.app.require_known_instance(args["instance"])
        session_id = args.get("session_id") or DEFAULT_TETHER_SESSION
        check_session_id(session_id)
        return await read_frames(
            self.app, instance, channel=TETHER_CHANNEL, session_id=session_id,
            after_seq=args.get("after_seq", 0), limit=args.get("limit", 50), wait_ms=args.get("wait_ms", 0),
            types=args.get("types") or list(EGRESS_TYPES), reply_to=args.get("reply_to_msg_id"),
        )


TETHER_CHANNEL = "host"
DEFAULT_TETHER_SESSION = "default"
EGRESS_TYPES = tuple(t for t in FRAME_TYPES if t != "user.message")
"""What tether_read returns by default: the agent's side of the conversation, not the host's own messages."""
MAX_WAIT_MS = 30_000


def host_msg_id() -> str:
    """`host-{timestamp}` (seed 004), with a random suffix so two sends in one millisecond differ."""
    return f"host-{int(time.time() * 1000)}-{secrets.token_hex(3)}"


def check_session_id(session_id: str) -> None:
    """Refuse a malformed session id (full match: "s-1\\n" is not "s-1")."""
    problem = session_id_problem(session_id)
    if problem:
        raise RelayError(errors.INVALID_PARAMS, problem)


async def read_frames(
    app: OublietteServer,
    instance: str,
    *,
    channel: str | None,
    session_id: str | None,
    after_seq: int,
    limit: int,
    wait_ms: int,
    types: list[str] | None = None,
    reply_to: str | None = None,
) -> dict[str, Any]:
    """`{frames, next_seq, timed_out}`: the shape of session_events, tether_read and the poll endpoint."""
    if not 0 <= wait_ms <= MAX_WAIT_MS:
        raise RelayError(errors.INVALID_PARAMS, f"wait_ms must be between 0 and {MAX_WAIT_MS}, got {wait_ms}")
    try:
        query = FrameQuery(
            channel=channel, session_id=session_id, after_seq=after_seq,
            types=tuple(types) if types else None, reply_to=reply_to, limit=limit,
        )
    except ValueError as exc:
        raise RelayError(errors.INVALID_PARAMS, str(exc)) from None
    try:
        frames, timed_out = await app.store.wait_for_frames(instance, query, timeout=wait_ms / 1000)
    except CursorPruned as exc:
        raise RelayError(errors.NOT_FOUND, str(exc)) from None
    return {
        "frames": [f.to_wire() for f in frames],
        "next_seq": frames[-1].seq if frames else after_seq,
        "timed_out": timed_out,
    }


def build_caller_server(app: OublietteServer, tools: CallerTools, resolve_caller: ResolveCaller) -> Server:
    """An MCP server whose tool calls go to `tools`, with callers resolved per request."""

    async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        resolve_caller(ctx)
        return types.ListToolsResult(tools=[tool for tool, _ in tools.tools.values()])

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        caller = resolve_caller(ctx)
        return await tools.call(ctx, caller, params.name, dict(params.arguments or {}))

    return CallerMcpServer(
        "oubliette-server", version="0.1.0", on_list_tools=list_tools, on_call_tool=call_tool,
        # Served so 2026-07-28 callers see tools.listChanged too (as handshake-era ones do).
        on_subscriptions_listen=ListenHandler(InMemorySubscriptionBus()),
    )


class CallerMcpServer(Server):
    """Advertises `tools.listChanged` on every transport (the HTTP app asks with no options)."""

    def create_initialization_options(
        self, notification_options: NotificationOptions | None = None, *args: Any, **kwargs: Any
    ) -> InitializationOptions:
        return super().create_initialization_options(
            notification_options or NotificationOptions(tools_changed=True), *args, **kwargs
        )


def initialization_options(server: Server) -> InitializationOptions:
    return server.create_initialization_options()


async def serve_stdio_caller(app: OublietteServer) -> None:
    """Serve one caller on this process's stdin/stdout until it disconnects."""
    import mcp.server.stdio

    caller = app.open_caller("stdio")

    def resolve(ctx: Any) -> CallerConnection:
        if ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS:
            caller.mcp_session = ctx.session
        return caller

    server = build_caller_server(app, CallerTools(app), resolve)
    try:
        async with mcp.server.stdio.stdio_server() as (read_stream, write_stream):
            await server.run(read_stream, write_stream, initialization_options(server))
    finally:
        app.close_caller(caller)


