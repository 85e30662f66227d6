"""`OublietteServer`: the embeddable host daemon that ties the pieces together.

It owns the frame store, the sessions, the pending caller tool calls, the
callers and the relay connections. Every frame goes through `append_frame`,
which stores it and pushes it to the session's event sinks. A Trio program
can run it in its own nursery with `await nursery.start(server.serve)`.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from protocol import (
    CallerToolSpec,
    HandlerEntry,
    PeerLimits,
    RelayError,
    SessionRef,
    errors,
    messages,
    parse_relay_address,
    unstructure,
)

from .auth import TokenAuthority, check_instance_id, ensure_private_dir
from .caller_calls import CallerCallRegistry
from .callers import CallerConnection
from .config import ServerConfig
from .guests import GuestDelivery
from .relay import RelayConnection, RelayHandlers, RelayListener
from .sessions import Session, SessionRegistry
from .store import FrameStore, StoredFrame
from .toolsets import (
    CommandToolset,
    McpToolset,
    Toolset,
    ToolsetDefinition,
    ToolsetFactory,
    ToolsetRegistry,
    ToolRouter,
    ToolSpec,
)
from .toolsets.sessions import ToolsetSessions
from .wake import InstanceStarter

log = logging.getLogger("oubliette.server")

GUEST_FRAME_TYPES = frozenset({"assistant.delta", "assistant.done", "status.presence", "session.error"})


def frame_event(frame: StoredFrame) -> dict[str, Any]:
    """The flattened event a caller receives for a frame (DESIGN.md, "Events to the caller")."""
    event: dict[str, Any] = dict(frame.payload)
    event.update(
        type=frame.type, seq=frame.seq, ts=frame.ts, instance=frame.instance,
        channel=frame.channel, session_id=frame.session_id, msg_id=frame.msg_id,
    )
    if frame.reply_to is not None:
        event["reply_to"] = frame.reply_to
    return event


class OublietteServer:
    def __init__(self, config: ServerConfig, *, store: FrameStore | None = None) -> None:
        self.config = config
        ensure_private_dir(config.data_dir)
        self.tokens = TokenAuthority.for_data_dir(config.data_dir)
        self.store = store or FrameStore(
            config.frame_store_path,
            retention_frames=config.retention_frames,
            retention_seconds=config.retention_seconds,
        )
        self.sessions = SessionRegistry()
        self.calls = CallerCallRegistry(self.append_frame, config.caller_timeout)
        self.guests = GuestDelivery(self)
        self.starter = InstanceStarter(self)
        self.toolsets = ToolsetRegistry()
        self.toolset_sessions = ToolsetSessions(self.toolsets, config.tool_separator, self._push_toolsets)
        self._clients: dict[str, set[RelayConnection]] = {}
        self._callers: set[CallerConnection] = set()
        self._seen_instances: set[str] = set()
        self._nursery: trio.Nursery | None = None
        self._requests_in_flight = 0
        self._drained = trio.Event()
        self._drained.set()
        self.relay_handlers: RelayHandlers = self._relay_handler_table()

    # -- running -------------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen for sandboxes until cancelled."""
        address = parse_relay_address(self.config.relay_address)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await nursery.start(RelayListener(address, self._relay_connection).serve)
                task_status.started()
        finally:
            self.store.close()

    def relay_request_started(self) -> None:
        if self._requests_in_flight == 0:
            self._drained = trio.Event()
        self._requests_in_flight += 1

    def relay_request_finished(self) -> None:
        self._requests_in_flight -= 1
        if self._requests_in_flight == 0:
            self._drained.set()

    async def drain(self, timeout: float) -> None:
        """Let relay requests that are ending send their answers (bounded) before shutdown."""
        with trio.move_on_after(timeout):
            await self._drained.wait()

    # -- frames --------------------------------------------------------------------------

    async def append_frame(
        self,
        session: Session,
        type: str,
        payload: dict[str, Any],
        *,
        reply_to: str | None = None,
        msg_id: str | None = None,
    ) -> StoredFrame:
        """Store a frame of `session` and push it to everyone following the session."""
        frame = await self.store.append(
            session.instance, channel=session.channel, session_id=session.id,
            type=type, payload=payload, msg_id=msg_id, reply_to=reply_to,
        )
        if session.sinks:
            event = frame_event(frame)
            for sink in list(session.sinks):
                sink.push(event)
        return frame

    async def ingress(
        self,
        instance: str,
        channel: str,
        session_id: str,
        type: str,
        payload: dict[str, Any],
        *,
        msg_id: str | None = None,
        reply_to: str | None = None,
    ) -> StoredFrame:
        """Append a frame from outside the sandbox; a `user.message` wakes the instance."""
        session = self.sessions.get_or_create(instance, channel, session_id)
        frame = await self.append_frame(session, type, payload, msg_id=msg_id, reply_to=reply_to)
        if type == "user.message":
            self.starter.wake(instance)
        return frame

    @property
    def nursery(self) -> trio.Nursery | None:
        return self._nursery

    # -- callers -------------------------------------------------------------------------

    def open_caller(self, transport: str, label: str | None = None) -> CallerConnection:
        caller = CallerConnection(transport, label)
        self._callers.add(caller)
        if self._nursery is not None:
            self._nursery.start_soon(caller.run_sender)
        log.info("%r connected", caller)
        return caller

    def close_caller(self, caller: CallerConnection) -> None:
        """The caller is gone: its pending calls fail now and it gets no more events."""
        if caller not in self._callers:
            return
        self._callers.discard(caller)
        caller.close()
        self.sessions.drop_sink(caller)
        failed = self.calls.fail_caller(caller)
        log.info("%r disconnected; %d pending call(s) failed", caller, failed)

    def instance_known(self, instance: str) -> bool:
        """Configured, connected since start, or with frames in the log."""
        return (
            instance in self.config.instances
            or instance in self._seen_instances
            or self.store.last_seq(instance) > 0
        )

    def require_known_instance(self, instance: str) -> str:
        reason = check_instance_id(instance)
        if reason:
            raise RelayError(errors.INVALID_PARAMS, reason)
        if not self.instance_known(instance):
            raise RelayError(
                errors.NOT_FOUND,
                f"unknown instance '{instance}': it is not configured, has not connected, and has no frames",
            )
        return instance

    def connected_instances(self) -> list[str]:
        names = set(self.guests.connected_instances())
        names.update(name for name, conns in self._clients.items() if conns)
        return sorted(names)

    def resolve_instance(self, instance: str | None) -> str:
        """The given instance, or the only connected one; otherwise a clear error."""
        if instance:
            reason = check_instance_id(instance)
            if reason:
                raise RelayError(errors.INVALID_PARAMS, reason)
            return instance
        connected = self.connected_instances()
        if len(connected) == 1:
            return connected[0]
        if not connected:
            raise RelayError(errors.NOT_FOUND, "no instance is connected; pass 'instance' explicitly")
        raise RelayError(
            errors.INVALID_PARAMS,
            f"several instances are connected ({', '.join(connected)}); pass 'instance' to choose one",
        )

    async def declare_caller_tools(
        self, session: Session, caller: CallerConnection, caller_id: str, tools: list[CallerToolSpec]
    ) -> None:
        """Record the caller's tools and queue them to the clients that see the session (never waits on a socket)."""
        session.declare_caller_tools(caller, caller_id, tools)
        config = unstructure(messages.CallerToolsConfig(session_id=session.id, caller_id=caller_id, tools=tools))
        for connection in list(self._clients.get(session.instance, ())):
            if self._client_sees(connection, session):
                connection.notify(messages.CALLER_TOOLS_CONFIG, config)

    def _client_sees(self, connection: RelayConnection, session: Session) -> bool:
        """A client bound to a session sees that session's tools; an unbound one the latest per caller."""
        if connection.session_key is not None:
            return SessionRef.parse_key(connection.session_key).key == session.key
        latest = self.sessions.latest_declarations(session.instance).get(session.caller_id or "")
        return latest is session

    # -- toolsets (seed 003): the code-driven API -----------------------------------------

    async def register_toolset(
        self,
        toolset_id: str,
        prefix: str,
        tools: list[ToolSpec],
        *,
        factory: ToolsetFactory | None = None,
        ref: Toolset | None = None,
        kind: str = "code",
    ) -> ToolsetDefinition:
        """Register a toolset: `factory` makes one per session (stopped with it), `ref` is one shared toolset."""
        definition = ToolsetDefinition(toolset_id, prefix, list(tools), factory=factory, ref=ref, kind=kind)
        self.toolsets.register(definition)
        await self.refresh_toolsets()
        return definition

    async def register_mcp_toolset(
        self,
        toolset_id: str,
        prefix: str,
        command: str,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        roots: list[str] | None = None,
    ) -> ToolsetDefinition:
        """Start a stdio MCP server with the SDK's client, list its tools, and register them (shared)."""
        if self._nursery is None:
            raise RuntimeError("start the server (serve) before registering an MCP toolset")
        toolset = McpToolset(toolset_id, command, args, env, cwd, roots, nursery=self._nursery)
        tools = await toolset.start()
        try:
            return await self.register_toolset(toolset_id, prefix, tools, ref=toolset, kind="mcp")
        except Exception:
            await toolset.aclose()
            raise

    async def register_command_toolset(
        self,
        toolset_id: str,
        prefix: str,
        command: str | list[str],
        *,
        timeout: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> ToolsetDefinition:
        """Register an endpoint speaking seed 001's action contract; discovery failures leave it empty."""
        options: dict[str, Any] = {"env": env, "cwd": cwd}
        if timeout is not None:
            options["timeout"] = timeout
        toolset = CommandToolset(toolset_id, command, **options)
        tools = await toolset.discover()
        return await self.register_toolset(toolset_id, prefix, tools, ref=toolset, kind="command")

    async def unregister_toolset(self, toolset_id: str) -> None:
        definition = self.toolsets.unregister(toolset_id)
        await self.refresh_toolsets()
        if definition.ref is not None:
            await definition.ref.aclose()

    async def update_allowed_toolsets(self, instance: str, toolset_ids: list[str]) -> None:
        """Set which toolsets an instance's agents see (empty by default); agents are told at once."""
        self.toolsets.set_allowed(instance, toolset_ids)
        await self.refresh_toolsets(instance)

    async def refresh_toolsets(self, instance: str | None = None) -> None:
        """Rebind every session's toolsets (of one instance) and tell clients whose list changed."""
        await self.toolset_sessions.refresh(instance)

    async def _push_toolsets(self, router: ToolRouter) -> None:
        """Queue the router's list to its connections (never waits on a socket)."""
        config = {"tools": router.published(), "separator": router.separator}
        for connections in self._clients.values():
            for connection in list(connections):
                if connection.router is router:
                    connection.notify(messages.TOOLSETS_CONFIG, config)

    # -- relay connections ---------------------------------------------------------------

    def _relay_connection(self, stream: trio.abc.Stream, peer_name: str) -> RelayConnection:
        """A sandbox connection, given only what it uses of the server."""
        return RelayConnection(
            stream, peer_name,
            verify_token=self.tokens.verify,
            handlers=self.relay_handlers,
            on_open=self.relay_connection_opened,
            on_close=self.relay_connection_closed,
            limits=PeerLimits(write_timeout=self.config.relay_write_timeout),
            on_request_started=self.relay_request_started,
            on_request_finished=self.relay_request_finished,
        )

    async def relay_connection_opened(self, connection: RelayConnection) -> None:
        """Register a connection that passed `hello`; queue its configuration before the hello answer."""
        assert connection.instance is not None
        self._seen_instances.add(connection.instance)
        if connection.role == "guest":
            previous = self.guests.attach(connection)
            self.starter.guest_connected(connection.instance)
            if previous is not None:
                log.warning("%r replaces the instance's previous guest %r", connection, previous)
                previous.close_soon()
            connection.start_soon(self.guests.deliver, connection)
            return
        self._clients.setdefault(connection.instance, set()).add(connection)
        router = await self.toolset_sessions.attach(connection)
        await connection.send_notification(
            messages.TOOLSETS_CONFIG, {"tools": router.published(), "separator": router.separator},
        )
        for session in self._sessions_visible_to(connection):
            config = messages.CallerToolsConfig(
                session_id=session.id, caller_id=session.caller_id or "",
                tools=list(session.caller_tools.values()),
            )
            await connection.send_notification(messages.CALLER_TOOLS_CONFIG, unstructure(config))

    def _sessions_visible_to(self, connection: RelayConnection) -> list[Session]:
        assert connection.instance is not None
        if connection.session_key is not None:
            ref = SessionRef.parse_key(connection.session_key)
            session = self.sessions.get(connection.instance, ref.channel, ref.id)
            return [session] if session is not None and session.caller_id else []
        return list(self.sessions.latest_declarations(connection.instance).values())

    def relay_connection_closed(self, connection: RelayConnection) -> None:
        if connection.instance is None:
            return
        if connection.role == "guest":
            self.guests.detach(connection)
            if self.guests.has_undelivered(connection.instance):
                # A message may have arrived after the guest died but before we noticed: wake it now.
                self.starter.wake(connection.instance)
        else:
            self._clients.get(connection.instance, set()).discard(connection)
            self.toolset_sessions.detach(connection, self._nursery)
        log.info("%r disconnected", connection)

    def _relay_handler_table(self) -> RelayHandlers:
        """What each role may ask of the server: `{(role, method): HandlerEntry}`; the peer
        validates and structures params before a handler (connection, params) runs."""
        return {
            ("client", messages.CALLER_TOOL): HandlerEntry(messages.CallerToolCall, self._relay_caller_tool),
            ("client", messages.TOOLSET_CALL): HandlerEntry(messages.ToolsetCall, self._relay_toolset_call),
            ("guest", messages.APPEND_FRAME): HandlerEntry(messages.AppendFrame, self._relay_append_frame),
            ("guest", messages.ACK): HandlerEntry(messages.Ack, self._relay_ack),
        }

    async def _relay_caller_tool(
        self, connection: RelayConnection, call: messages.CallerToolCall
    ) -> messages.CallerToolResult:
        session, spec = self._find_caller_tool(connection, call)
        result = await self.calls.relay(session, spec, call.arguments)
        return messages.CallerToolResult(result=result)

    async def _relay_append_frame(
        self, connection: RelayConnection, request: messages.AppendFrame
    ) -> messages.AppendFrameResult:
        if request.type not in GUEST_FRAME_TYPES:
            raise RelayError(
                errors.INVALID_PARAMS,
                f"a guest may append {', '.join(sorted(GUEST_FRAME_TYPES))}; not {request.type!r}",
            )
        assert connection.instance is not None
        session = self.sessions.get_or_create(connection.instance, request.session.channel, request.session.id)
        frame = await self.append_frame(session, request.type, request.payload, reply_to=request.reply_to)
        return messages.AppendFrameResult(seq=frame.seq, msg_id=frame.msg_id)

    async def _relay_toolset_call(
        self, connection: RelayConnection, call: messages.ToolsetCall
    ) -> messages.ToolsetCallResult:
        if connection.router is None:
            raise RelayError(errors.NOT_FOUND, "no toolsets are bound to this connection")
        outcome = await connection.router.call(call.name, call.arguments)
        if outcome.is_error:
            raise RelayError(errors.TOOL_ERROR, outcome.error or f"{call.name} failed")
        return messages.ToolsetCallResult(result=outcome.result, content=outcome.content)

    async def _relay_ack(self, connection: RelayConnection, ack: messages.Ack) -> None:
        self.guests.acknowledge(connection, ack.seq)

    def _find_caller_tool(
        self, connection: RelayConnection, call: messages.CallerToolCall
    ) -> tuple[Session, CallerToolSpec]:
        assert connection.instance is not None
        candidates = self._sessions_visible_to(connection)
        if call.caller_id is not None:
            candidates = [s for s in candidates if s.caller_id == call.caller_id]
        for session in sorted(candidates, key=lambda s: s.declared_at, reverse=True):
            spec = session.caller_tools.get(call.tool)
            if spec is not None:
                return session, spec
        who = f"caller '{call.caller_id}'" if call.caller_id else "any caller"
        raise RelayError(errors.NOT_FOUND, f"unknown caller tool '{call.tool}' for {who} of this session")
