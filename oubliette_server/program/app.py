"""`OublietteServer`: the composition root. It builds the feature services, wires them, and runs them.

Nothing imports this module but the programs that start a server (the CLI
runner, embedding applications, tests): every service gets only what it uses.
The path of one relayed call through the rooms is in docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import socket
from typing import Any, Awaitable, Callable

import attrs
import trio

from oubliette_runtime.trace_spans import record_approval_decision, traced_relay_handler
from protocol import Frame, HandlerEntry, PeerLimits, messages, parse_relay_address
from protocol.frames import FrameType
from protocol.limits import Limits

from ..core.auth import HttpPrincipals, TokenAuthority, ensure_private_dir
from ..core.callers import CallerConnection, CallerRegistry
from ..core.client_connections import ClientConnections
from ..core.frame_log import FrameLog
from ..core.in_flight import InFlight
from ..core.instances import InstanceDirectory
from ..core.metrics import ServerMetrics, decision_of
from ..core.pending_requests import Crossing, SharedStore, SingleServer
from ..core.sessions import SessionRegistry
from ..doors.caller_api import CallerApi, serve_stdio_caller
from ..doors.health import Readiness
from ..doors.http_api import HttpApi
from ..doors.relay import SERVER_VERSION, RelayConnection, RelayHandlers, RelayListener
from ..features.approvals import (
    ApprovalElicitation,
    ApprovalService,
    ConnectionApprovals,
)
from ..features.approvals.toolset_forms import ToolsetForms
from ..features.caller_tool_relay import (
    CallerCallRegistry,
    CallerToolRelay,
    cancel_unanswered_requests,
)
from ..features.cluster import AbandonedRequests, InstanceLeases, LogBus, LogTail, holds_lease
from ..features.guests import (
    FailedStarts,
    GuestDelivery,
    GuestFrames,
    GuestPresence,
    InstanceStarter,
    OrphanedTurns,
)
from ..features.policy import PolicyGate, PolicyRules
from ..features.tether import Tether
from ..features.toolsets import ToolsetService
from ..features.toolsets.from_config import register_from_config
from ..features.turns import TurnWaits
from ..store.api import FrameStoreAPI, SharedStoreAPI, TurnEnded, shared_store
from ..store.chain import Signer
from ..store.opener import open_store
from .config import ServerConfig

log = logging.getLogger("oubliette.server")

#: The relay requests that open a span in the server (docs/OBSERVABILITY.md).
TRACED_METHODS = frozenset({messages.CALLER_TOOL, messages.TOOLSET_CALL, messages.APPROVAL})


@attrs.frozen
class ServingAddresses:
    """Where a serving `OublietteServer` listens: what `nursery.start(server.serve)` returns, and
    what the command line's ready line prints."""

    relay: str
    """The relay address (`unix:PATH` or `tcp:HOST:PORT`; a TCP port 0 is the port bound)."""
    http: list[str] = attrs.field(factory=list)
    """The URL of each `http` listener (`http://127.0.0.1:PORT`, `http://unix:PATH`), in order."""
    metrics: list[str] = attrs.field(factory=list)
    """The URL of each `metrics` listener, in order."""


class OublietteServer:
    """The host daemon as a library: run it in your nursery with `await nursery.start(server.serve)`.

    Owns: the frame store (run by `serve`, closed when it ends), the relay, HTTP and metrics
    listeners its config names, the configured toolsets, and the nurseries of its services
    (callers' event senders, toolsets, start commands). `serve` reports started, with the
    `ServingAddresses`, once all of them are up; cancelling it closes every connection and stops
    every child (docs/EMBEDDING.md).
    Needs: a `ServerConfig`; the data directory is created (mode 0700) with the token secret.
    Raises: `OSError` from `serve` when the relay or an HTTP address cannot be bound.

    The services are attributes, for embedding and tests: `store`, `sessions`, `frame_log`,
    `callers`, `caller_tools` (with `calls`, its pending calls), `approvals` (and `connection_approvals`, the
    agent's own actions and gated toolsets), `toolsets`, `guests`, `orphans`,
    `starter`, `tether`, `instances`, `tokens`, `metrics` (docs/OBSERVABILITY.md), `policy` (the
    policies' gate; `policy.reload()` reads the policy files again, docs/POLICY.md). The toolset embedding API — `register_toolset`,
    `register_mcp_toolset`, `register_command_toolset`, `unregister_toolset`,
    `update_allowed_toolsets` — is `ToolsetService`'s (see its docstrings and docs/TOOLSETS.md).
    """

    def __init__(self, config: ServerConfig, *, store: FrameStoreAPI | None = None) -> None:
        self.config = config
        ensure_private_dir(config.data_dir)
        self.tokens = TokenAuthority.for_data_dir(config.data_dir)
        # Who an HTTP bearer token is (the admin, or a named principal: docs/POLICY.md, "HTTP principals").
        self.principals = HttpPrincipals(self.tokens, config.http_principals, config.http_principal_token_files)
        self.store: FrameStoreAPI = store or open_store(
            config.store_url, config.frame_store_path,
            retention_frames=config.retention_frames, retention_seconds=config.retention_seconds,
            pool_size=config.store_pool_size, connect_timeout=config.store_connect_timeout,
            checkpoint_every=config.checkpoint_every,
            sign=None if config.audit_key is None else Signer(config.audit_key),
        )
        self.limits: Limits = config.limits
        self.shared_store: SharedStoreAPI | None = shared_store(self.store)
        """The store's shared-store capabilities (leases, the sweep), or None when this server is alone on its log."""
        self.server_id = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        """Which server of a deployment this is (host, process, a random tag)."""
        self.metrics = ServerMetrics()
        """This server's Prometheus metrics (its own registry); each service gets only the hook it calls."""
        # Each service is built after everything it uses. The one cycle — a stored `user.message`
        # wakes a start command, whose failure is stored in the log — is broken by this channel:
        # the frame log sends the instance, and `serve` hands it to the starter.
        wake_send, self._wakes = trio.open_memory_channel[str](math.inf)
        self.sessions = SessionRegistry(config.max_sessions)
        self.clients = ClientConnections(self.config.max_client_connections)
        # With a shared store, the frames other servers append reach the followers held here
        # through this server's one tail of the log; the frame log tells it which are its own.
        self.log_tail: LogTail | None = None
        if self.shared_store is not None:
            self.log_tail = LogTail(self.shared_store, self.sessions, on_pushed=self.metrics.log_tail_pushed)
        self.frame_log = FrameLog(
            self.store, self.sessions, on_user_message=wake_send.send_nowait, limits=self.limits,
            on_stored=self.metrics.frame_stored, local_appends=self.log_tail,
        )
        # With a shared store, which server holds an instance's guest is a lease in the database:
        # delivery stops as soon as another server takes the instance over.
        self.guests = GuestDelivery(
            self.store, on_undeliverable=self._undeliverable,
            holds=None if self.shared_store is None else holds_lease(self.shared_store, self.server_id),
        )
        # ... and every server closes the caller tool requests a dead server left open.
        self.leases: InstanceLeases | None = None
        self.abandoned: AbandonedRequests | None = None
        if self.shared_store is not None:
            self.leases = InstanceLeases(self.shared_store, self.server_id, config.store_lease_ttl, self.guests)
            self.abandoned = AbandonedRequests(
                self.shared_store, self.sessions, self.frame_log.append_outcome,
                period=config.store_lease_ttl, grace=config.store_lease_ttl,
            )
        guests, clients = self.guests, self.clients

        def guest_here(instance: str) -> bool:
            return guests.guest_for(instance) is not None

        self.instances = InstanceDirectory(
            config.instances, self.store.last_seq, lambda: [*guests.connected_instances(), *clients.instances()],
            # With a shared store, an instance whose guest is on another server exists here too.
            held_elsewhere=None if self.leases is None else self.leases.held_anywhere,
        )
        # Whether a message can reach a guest: connected here, to another server (its live lease),
        # or startable; else `session_message` says so instead of waiting in silence.
        self.presence = GuestPresence(
            guest_here, config.start_command, self.instances.named, self.instances.connected_instances,
            live_holder=None if self.leases is None else self.leases.live_holder,
        )
        self.failed_starts = FailedStarts(self.guests, self.sessions, self.frame_log.append, self.presence.connected_anywhere)
        self.starter = InstanceStarter(
            config.start_command, self.tokens.token_for, config.relay_address, guest_here,
            start_grace=config.start_timeout, on_start_failed=self.failed_starts.start_failed,
        )
        # With a shared store the log is the bus between servers for caller tool calls and approvals:
        # the one place that picks how pending requests cross servers (pending_requests/).
        self.crossing: Crossing = (
            SharedStore(LogBus(self.store, self.frame_log.append_outcome), self.server_id)
            if self.store.shared else SingleServer()
        )
        self.sessions.learn_from(self.crossing.record_of, self.crossing.recorded_sessions)
        self.calls = CallerCallRegistry(
            self.frame_log.append, config.caller_timeout, crossing=self.crossing, find_sessions=self.sessions.find_by_id,
            on_ended=self.metrics.relayed_call_ended,
        )
        self.approvals = ApprovalService(
            self.frame_log.append, config.approval_timeout, crossing=self.crossing,
            on_decided=self._approval_decided,
        )
        # A session with a request or approval not yet ended stays in memory (docs/CONFIG.md, max_sessions).
        self.sessions.keep_while(self.calls.holds)
        self.sessions.keep_while(self.approvals.holds)
        self.elicitation = ApprovalElicitation(self.approvals, config.approval_delivery)
        self.connection_approvals = ConnectionApprovals(self.sessions, self.approvals)
        # The deployment's policies decide every agent's tool call before anything is relayed or run
        # (docs/POLICY.md): the caller tool relay and the toolsets ask this gate as soon as they
        # found the tool a `caller_tool` or `toolset_call` names.
        self.policy = PolicyGate(
            PolicyRules.from_files(config.policy_files) if config.policy_files else PolicyRules.default(),
            files=config.policy_files, observe_only=config.policy_observe_only,
            record=self.frame_log.record, on_decided=self.metrics.policy_decided,
        )
        self.caller_tools = CallerToolRelay(
            self.sessions, self.clients, self.calls, self.approvals, policy=self.policy.check)
        self.callers = CallerRegistry(on_closed=self._caller_closed)
        self.toolset_forms = ToolsetForms(self.sessions, self.approvals)
        self.toolsets = ToolsetService(
            config.tool_separator, self.clients, self.connection_approvals, ask_caller=self.toolset_forms.ask,
            on_call=self.metrics.toolset_call_ended, policy=self.policy.check,
        )
        # The toolset embedding API (docs/TOOLSETS.md) is the toolset service's own methods.
        self.register_toolset = self.toolsets.register_toolset
        self.register_mcp_toolset = self.toolsets.register_mcp_toolset
        self.register_command_toolset = self.toolsets.register_command_toolset
        self.unregister_toolset = self.toolsets.unregister_toolset
        self.update_allowed_toolsets = self.toolsets.update_allowed_toolsets
        self.guest_frames = GuestFrames(self.sessions, self.frame_log.append, self.guests, self.store)
        self.orphans = OrphanedTurns(self.guests, self.sessions, self.frame_log.append)
        self.tether = Tether(self.store, self.frame_log, self.instances, self.limits)
        # What each role may ask of the server; the peer checks params once (the schema derived
        # from the params type) and builds the params type, before a handler (connection, params) runs. `cancel` is the peer's own. A sandbox's own
        # values (arguments, payloads) are checked against the limits before anything runs.
        self.relay_handlers: RelayHandlers = {
            ("client", messages.CALLER_TOOL): HandlerEntry(
                messages.CallerToolCall, self._limited(self.caller_tools.call, messages.CALLER_TOOL, "arguments")),
            ("client", messages.TOOLSET_CALL): HandlerEntry(
                messages.ToolsetCall, self._limited(self.toolsets.call, messages.TOOLSET_CALL, "arguments")),
            ("client", messages.APPROVAL): HandlerEntry(
                messages.AgentApproval,
                self._limited(self.connection_approvals.agent_approval, messages.APPROVAL, "arguments")),
            ("guest", messages.APPEND_FRAME): HandlerEntry(
                messages.AppendFrame, self._limited(self.guest_frames.append_frame, messages.APPEND_FRAME, "payload")),
            ("guest", messages.ACK): HandlerEntry(messages.Ack, self.guest_frames.ack),
        }
        self.relay_listening = False
        """Whether the relay listener accepts sandboxes (between `serve`'s start and its end)."""
        self.readiness = Readiness(self.store.check_available, lambda: self.relay_listening)
        # The state gauges are read from the services that keep the state, at scrape time.
        self.metrics.watch(
            pending_calls=lambda: len(self.calls.pending), pending_approvals=lambda: len(self.approvals.pending),
            guests=lambda: len(self.guests.connected_instances()), clients=self.clients.count,
            callers=self.callers.count, long_poll_waiters=self.store.waiter_count,
        )
        self._relay_verify_token = self.metrics.checking_relay_tokens(self.tokens.verify)
        self.relay_requests = InFlight()
        """The relay requests being answered (`drain` waits for them)."""
        self.http_requests = InFlight()
        """The HTTP requests other than GETs being answered (`drain` waits for them)."""

    # -- running -------------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[ServingAddresses] = trio.TASK_STATUS_IGNORED) -> None:
        """Start everything `config` names and serve until cancelled.

        Needs: `await nursery.start(server.serve)`, which returns the `ServingAddresses` once the
        relay listens, the configured toolsets and allowlists are registered and every HTTP and
        metrics listener is bound.
        Raises: `OSError` when the relay or an HTTP address cannot be bound (before started).
        Cancellation: every listener closes (Unix socket files removed), every relay and HTTP
        connection and service task ends, toolset processes and start commands are stopped,
        then the store is closed.
        """
        config = self.config
        address = parse_relay_address(config.relay_address)
        async with self.store.running():
            shared = await self.store.shared_secret(self.tokens.secret)
            if shared is not None:
                self.tokens.use_secret(shared)  # every server of the deployment accepts the same tokens
            if not self.store.shared:
                # With a shared store, another live server may own an open request: only a server
                # that is alone on its log can tell which requests a previous run left (docs/SCALING.md).
                await cancel_unanswered_requests(self.store, self.sessions, self.frame_log.append)
            async with trio.open_nursery() as nursery:
                if self.log_tail is not None:
                    await nursery.start(self.log_tail.serve)
                await nursery.start(self.orphans.serve)
                await nursery.start(self.callers.serve)
                await nursery.start(self.calls.serve)
                await nursery.start(self.approvals.serve)
                await nursery.start(self.toolsets.serve)
                await nursery.start(self.policy.watch)
                await nursery.start(self.failed_starts.serve)
                await nursery.start(self.starter.serve)
                await nursery.start(self._wake_on_messages)
                if self.leases is not None:
                    await nursery.start(self.leases.serve)
                if self.abandoned is not None:
                    await nursery.start(self.abandoned.serve)
                relay = await nursery.start(RelayListener(
                    address, self._relay_connection, self.config.relay_limits, on_evicted=self.metrics.relay_evicted,
                    group=self.config.relay_gid,
                ).serve)
                self.relay_listening = True
                try:
                    if config.toolsets or config.allowlists:
                        await register_from_config(self.toolsets, config.toolsets, config.allowlists)
                    http: list[str] = []
                    metrics: list[str] = []
                    if config.http or config.metrics:
                        api = self.http_api()
                        if config.http:
                            http = await nursery.start(api.serve, config.http)
                            log.info("HTTP listening on %s", ", ".join(http))
                        if config.metrics:
                            metrics = await nursery.start(api.serve_metrics, config.metrics)
                            log.info("metrics (no token) listening on %s", ", ".join(metrics))
                    # The relay as configured (as the ready line always printed it), unless the
                    # system chose its TCP port.
                    relay_text = config.relay_address if relay == address else str(relay)
                    task_status.started(ServingAddresses(relay=relay_text, http=http, metrics=metrics))
                    await trio.sleep_forever()
                finally:
                    self.relay_listening = False

    async def _wake_on_messages(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hand each instance the frame log says got a `user.message` to the starter (`_user_message_arrived`)."""
        task_status.started()
        async for instance in self._wakes:
            self._user_message_arrived(instance)

    def caller_api(self) -> CallerApi:
        """The caller-facing tools, bound to this server's services (one per transport)."""
        turns = TurnWaits(
            store=self.store, sessions=self.sessions, calls=self.calls, approvals=self.approvals,
            elicitation=self.elicitation, guest_absent=self.presence.absent,
            caught_up=None if self.log_tail is None else self.log_tail.caught_up,
        )
        return CallerApi(
            instances=self.instances, sessions=self.sessions, caller_tools=self.caller_tools, calls=self.calls,
            turns=turns, frame_log=self.frame_log, store=self.store, tether=self.tether, approvals=self.approvals,
            session_wait_limit=self.config.session_wait_limit, limits=self.limits, elicitation=self.elicitation,
            access=self.policy.require,
        )

    async def serve_stdio_caller(self) -> None:
        """Serve one caller on this process's stdin/stdout until it disconnects."""
        await serve_stdio_caller(self.callers, self.caller_api())

    def http_api(self) -> HttpApi:
        """The HTTP listener (tether routes, /mcp, /metrics); start its `serve` (or, for a metrics
        listener without a token, its `serve_metrics`) with `nursery.start`."""
        return HttpApi(
            callers=self.callers, tools=self.caller_api(), tether=self.tether, instances=self.instances,
            verify_token=self.tokens.verify, allowed_hosts=self.config.allowed_hosts, identity=self.identity(),
            principal_of=self.principals.principal_of, access=self.policy.require,
            limits=self.config.http_limits,
            readiness=self.readiness,
            metrics=self.metrics,
            in_flight=self.http_requests,
        )

    def identity(self) -> dict[str, Any]:
        """This server and its store, as `/v1/health` reports them (no secrets)."""
        return {"server": {"id": self.server_id, "version": SERVER_VERSION}, "store": self.store.describe()}

    async def drain(self, timeout: float) -> None:
        """A graceful stop's first step: let the relay and HTTP requests in flight send their
        answers, for at most `timeout` seconds; then cancel `serve`. Listeners keep accepting
        meanwhile (a request that arrives now is waited for too). HTTP GETs — SSE streams, long
        polls — are not waited for: their clients read again from their cursor."""
        with trio.move_on_after(timeout):
            await self.relay_requests.wait_none()
            await self.http_requests.wait_none()

    # -- callers -------------------------------------------------------------------------

    def open_caller(self, transport: str, label: str | None = None) -> CallerConnection:
        """A caller connection of an embedding transport; close it with `close_caller`."""
        return self.callers.open(transport, label)

    def close_caller(self, caller: CallerConnection) -> None:
        """End a caller from `open_caller`: no more events, its pending caller tool calls fail with
        `PEER_DISCONNECTED`, and it follows no session. Closing it again does nothing.
        """
        self.callers.close(caller)

    def _caller_closed(self, caller: CallerConnection) -> None:
        """The caller is gone: its pending calls fail now and it follows no session."""
        self.sessions.drop_sink(caller)
        failed = self.calls.fail_caller(caller)
        denied = self.approvals.fail_caller(caller)
        log.info("%r disconnected; %d pending call(s) failed, %d approval(s) denied", caller, failed, denied)

    def connected_instances(self) -> list[str]:
        """The instances with a live guest or client connection, sorted."""
        return self.instances.connected_instances()

    # -- relay connections ---------------------------------------------------------------

    def _relay_connection(self, stream: trio.abc.Stream, peer_name: str) -> RelayConnection:
        """A sandbox connection, given only what it uses of the server."""
        return RelayConnection(
            stream, peer_name,
            verify_token=self._relay_verify_token,
            token_hint=self.tokens.token_hint,
            handlers=self.relay_handlers,
            on_open=self.relay_connection_opened,
            on_close=self.relay_connection_closed,
            limits=PeerLimits(write_timeout=self.config.relay_write_timeout, hello_timeout=self.config.relay_hello_timeout),
            on_request_started=self.relay_requests.started,
            on_request_finished=self.relay_requests.finished,
        )

    async def relay_connection_opened(self, connection: RelayConnection) -> None:
        """Register a connection that passed `hello`; queue its configuration before the hello answer."""
        assert connection.instance is not None
        self.instances.saw(connection.instance)
        if connection.role == "guest":
            if self.leases is not None:
                await self.leases.take(connection)  # the database says who holds the instance; fails: hello refused
            previous = self.guests.attach(connection)
            self.starter.guest_connected(connection.instance)
            if previous is not None:
                log.warning("%r replaces the instance's previous guest %r", connection, previous)
                previous.close_soon()
            connection.start_soon(self.guests.deliver, connection)
            return
        self.clients.add(connection)
        await connection.send_notification(messages.TOOLSETS_CONFIG, await self.toolsets.attach(connection))
        await self.caller_tools.load_declaration(connection)
        for config in self.caller_tools.configs_for(connection):
            await connection.send_notification(messages.CALLER_TOOLS_CONFIG, config)

    def relay_connection_closed(self, connection: RelayConnection) -> None:
        """Forget a sandbox connection that ended (its `on_close` hook).

        A guest's instance is woken again if a message still waits for delivery; a client's
        session router is released (its per-session toolsets stop with the session's last one).
        """
        if connection.instance is None:
            return
        if connection.role == "guest":
            self.guests.detach(connection)
            if self.leases is not None:
                self.leases.release_soon(connection.instance)
            self.orphans.guest_gone(connection)
            # A message may have arrived after the guest died but before we noticed: wake it now.
            self.starter.wake_if(connection.instance, self._start_needed)
        else:
            self.clients.discard(connection)
            self.toolsets.detach(connection)

    def _limited(
        self, handler: Callable[[Any, Any], Awaitable[Any]], method: str, field: str
    ) -> Callable[[Any, Any], Awaitable[Any]]:
        """`handler`, refusing a request whose `field` is over the size or depth limit; a client's
        call or approval runs in the server's span of it (oubliette_runtime/trace_spans.py)."""

        async def checked(connection: Any, params: Any) -> Any:
            self.limits.check_value(getattr(params, field), f"{method} {field}")
            return await handler(connection, params)

        return traced_relay_handler(method, checked) if method in TRACED_METHODS else checked

    def _approval_decided(self, decision: Any, seconds: float) -> None:
        """An approval ended: counted in the metrics, and its decision marked on the span of the wait."""
        self.metrics.approval_decided(decision, seconds)
        record_approval_decision(decision_of(decision))

    def _user_message_arrived(self, instance: str) -> None:
        """Wake the instance (its start command) if its guest is not connected here, nor, with a
        shared store, to another server (its live lease says so)."""
        if self.leases is None:
            self.starter.wake(instance)
        else:
            self.starter.wake_if(instance, self.leases.not_held_elsewhere)

    async def _start_needed(self, instance: str) -> bool:
        """A guest left: start the instance again if a message waits for it, unless (shared store)
        another server holds it now (the guest moved there)."""
        if self.leases is not None and not await self.leases.not_held_elsewhere(instance):
            return False
        return await self.guests.has_undelivered(instance)

    async def _undeliverable(self, instance: str, frame: Frame, reason: str) -> None:
        """Guest delivery's safety net: end the frame's turn with `session.error` so nobody waits on it
        (unless it has ended already: the store keeps the first end, `TurnEnded`)."""
        session = self.sessions.get_or_create(instance, frame.channel, frame.session_id)
        with contextlib.suppress(TurnEnded):
            await self.frame_log.append(
                session, FrameType.SESSION_ERROR,
                {"message": f"message {frame.msg_id} (seq {frame.seq}) cannot be delivered to the guest: {reason}"},
                reply_to=frame.msg_id,
            )
