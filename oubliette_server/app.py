"""`OublietteServer`: the composition root. It builds the feature services, wires them, and runs them.

Nothing imports this module but the programs that start a server (the CLI
runner, embedding applications, tests): every service gets only what it uses.
The path of one relayed call through the rooms is in docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from protocol import RelayError, errors, messages, parse_relay_address, structure, unstructure, validate_params

from .auth import TokenAuthority, ensure_private_dir
from .caller_api import CallerTools, serve_stdio_caller
from .caller_tool_relay import CallerCallRegistry, CallerToolRelay, cancel_unanswered_requests
from .callers import CallerConnection, CallerRegistry
from .client_connections import ClientConnections
from .config import ServerConfig
from .frame_log import FrameLog
from .guests import GuestDelivery, GuestFrames, InstanceStarter, OrphanedTurns
from .http_api import HttpApi
from .instances import InstanceDirectory
from .relay import RelayConnection, RelayListener
from .sessions import SessionRegistry
from .store import FrameStore
from .tether import Tether
from .toolsets import Toolset, ToolsetDefinition, ToolsetFactory, ToolsetService, ToolSpec

log = logging.getLogger("oubliette.server")

# (role, method) -> (params type, handler(connection, params) -> result message)
RelayTable = dict[tuple[str, str], tuple[type, Any]]


class OublietteServer:
    """The host daemon as a library: run it in your nursery with `await nursery.start(server.serve)`.

    Owns: the frame store (closed when `serve` ends), the relay listener, and the nurseries of
    its services (callers' event senders, toolsets, start commands). `serve` reports started once
    the relay socket is bound; cancelling it closes every connection and stops every child.
    Needs: a `ServerConfig`; the data directory is created (mode 0700) with the token secret.
    Raises: `OSError` from `serve` when the relay address cannot be bound.

    The services are attributes, for embedding and tests: `store`, `sessions`, `frame_log`,
    `callers`, `caller_tools` (with `calls`, its pending calls), `toolsets`, `guests`, `orphans`,
    `starter`, `tether`, `instances`, `tokens`.
    """

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
        self.clients = ClientConnections()
        self.guests = GuestDelivery(self.store)
        self.instances = InstanceDirectory(
            config.instances, self.store.last_seq,
            lambda: [*self.guests.connected_instances(), *self.clients.instances()],
        )
        self.starter = InstanceStarter(
            config.start_command, self.tokens.token_for, config.relay_address,
            lambda instance: self.guests.guest_for(instance) is not None,
            start_grace=config.start_timeout,
        )
        self.frame_log = FrameLog(self.store, self.sessions, on_user_message=self.starter.wake)
        self.calls = CallerCallRegistry(self.frame_log.append, config.caller_timeout)
        self.caller_tools = CallerToolRelay(self.sessions, self.clients, self.calls)
        self.callers = CallerRegistry(on_closed=self._caller_closed)
        self.toolsets = ToolsetService(config.tool_separator, self.clients)
        self.guest_frames = GuestFrames(self.sessions, self.frame_log.append, self.guests)
        self.orphans = OrphanedTurns(self.guests, self.sessions, self.frame_log.append)
        self.tether = Tether(self.store, self.frame_log, self.instances)
        self.relay_table: RelayTable = {
            ("client", messages.CALLER_TOOL): (messages.CallerToolCall, self.caller_tools.call),
            ("client", messages.TOOLSET_CALL): (messages.ToolsetCall, self.toolsets.call),
            ("guest", messages.APPEND_FRAME): (messages.AppendFrame, self.guest_frames.append_frame),
        }
        self._requests_in_flight = 0
        self._drained = trio.Event()
        self._drained.set()

    # -- running -------------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the services and listen for sandboxes until cancelled."""
        address = parse_relay_address(self.config.relay_address)
        try:
            await cancel_unanswered_requests(self.store, self.sessions, self.frame_log.append)
            async with trio.open_nursery() as nursery:
                await nursery.start(self.orphans.serve)
                await nursery.start(self.callers.serve)
                await nursery.start(self.toolsets.serve)
                await nursery.start(self.starter.serve)
                await nursery.start(RelayListener(self, address).serve)
                task_status.started()
        finally:
            self.store.close()

    def caller_api(self) -> CallerTools:
        """The caller-facing tools, bound to this server's services (one per transport)."""
        return CallerTools(
            instances=self.instances, sessions=self.sessions, caller_tools=self.caller_tools,
            frame_log=self.frame_log, store=self.store, tether=self.tether,
            session_wait_limit=self.config.session_wait_limit,
        )

    async def serve_stdio_caller(self) -> None:
        """Serve one caller on this process's stdin/stdout until it disconnects."""
        await serve_stdio_caller(self.callers, self.caller_api())

    def http_api(self) -> HttpApi:
        """The HTTP listener (tether routes and /mcp); start its `serve` with `nursery.start`."""
        return HttpApi(
            callers=self.callers, tools=self.caller_api(), tether=self.tether, instances=self.instances,
            verify_token=self.tokens.verify, allowed_hosts=self.config.allowed_hosts,
        )

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

    # -- callers -------------------------------------------------------------------------

    def open_caller(self, transport: str, label: str | None = None) -> CallerConnection:
        """A caller connection of an embedding transport; close it with `close_caller`."""
        return self.callers.open(transport, label)

    def close_caller(self, caller: CallerConnection) -> None:
        self.callers.close(caller)

    def _caller_closed(self, caller: CallerConnection) -> None:
        """The caller is gone: its pending calls fail now and it follows no session."""
        self.sessions.drop_sink(caller)
        failed = self.calls.fail_caller(caller)
        log.info("%r disconnected; %d pending call(s) failed", caller, failed)

    def connected_instances(self) -> list[str]:
        return self.instances.connected_instances()

    # -- toolsets (seed 003): the embedding API -------------------------------------------

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
        return await self.toolsets.register_toolset(toolset_id, prefix, tools, factory=factory, ref=ref, kind=kind)

    async def register_mcp_toolset(
        self,
        toolset_id: str,
        prefix: str,
        command: str,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        roots: list[str] | None = None,
        *,
        call_timeout: float | None = None,
    ) -> ToolsetDefinition:
        """Start a stdio MCP server, list its tools, register them (shared); `call_timeout` bounds each call."""
        return await self.toolsets.register_mcp_toolset(
            toolset_id, prefix, command, args, env, cwd, roots, call_timeout=call_timeout,
        )

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
        return await self.toolsets.register_command_toolset(
            toolset_id, prefix, command, timeout=timeout, env=env, cwd=cwd,
        )

    async def unregister_toolset(self, toolset_id: str) -> None:
        await self.toolsets.unregister_toolset(toolset_id)

    async def update_allowed_toolsets(self, instance: str, toolset_ids: list[str]) -> None:
        """Set which toolsets an instance's agents see (empty by default); agents are told at once."""
        await self.toolsets.update_allowed_toolsets(instance, toolset_ids)

    # -- relay connections ---------------------------------------------------------------

    def verify_token(self, instance: str, token: object) -> bool:
        return self.tokens.verify(instance, token)

    async def relay_connection_opened(self, connection: RelayConnection) -> None:
        """Register a connection that passed `hello`; send its configuration first."""
        assert connection.instance is not None
        self.instances.saw(connection.instance)
        if connection.role == "guest":
            previous = self.guests.attach(connection)
            self.starter.guest_connected(connection.instance)
            if previous is not None:
                log.warning("%r replaces the instance's previous guest %r", connection, previous)
                previous.close_soon()  # type: ignore[attr-defined]
            return
        self.clients.add(connection)
        await connection.notify(messages.TOOLSETS_CONFIG, await self.toolsets.attach(connection))
        for config in self.caller_tools.configs_for(connection):
            await connection.notify(messages.CALLER_TOOLS_CONFIG, config)

    def relay_connection_closed(self, connection: RelayConnection) -> None:
        if connection.instance is None:
            return
        if connection.role == "guest":
            self.guests.detach(connection)
            self.orphans.guest_gone(connection)
            if self.guests.has_undelivered(connection.instance):
                # A message may have arrived after the guest died but before we noticed: wake it now.
                self.starter.wake(connection.instance)
        else:
            self.clients.discard(connection)
            self.toolsets.detach(connection)
        log.info("%r disconnected", connection)

    def relay_notification(self, connection: RelayConnection, method: str, params: dict[str, Any]) -> bool:
        """Handle a guest's `ack`; False for a notification nobody handles."""
        if method == messages.ACK and connection.role == "guest":
            validate_params(method, params)
            self.guest_frames.ack(connection, structure(params, messages.Ack))
            return True
        return False

    async def handle_relay_request(self, connection: RelayConnection, method: str, params: dict[str, Any]) -> Any:
        """Dispatch one relay request through the `(role, method)` table; params checked once."""
        entry = self.relay_table.get((connection.role or "", method))
        if entry is None:
            roles = sorted(role for role, name in self.relay_table if name == method)
            if roles:
                raise RelayError(errors.METHOD_NOT_FOUND, f"method {method!r} is for role {roles[0]!r} connections")
            raise RelayError(errors.METHOD_NOT_FOUND, f"unknown method {method!r}")
        params_type, handler = entry
        validate_params(method, params)
        return unstructure(await handler(connection, structure(params, params_type)))
