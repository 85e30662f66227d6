"""Caller connections: who is on the other end of the caller-facing MCP.

A caller is one MCP connection (stdio, or one Streamable HTTP session). Frames
of the sessions it takes part in are pushed to it as `notifications/message`
events, in order, through a bounded queue drained by one sender task, so a
slow caller never blocks the relay. When the connection ends, `closed` is set
and every call waiting on it fails at once.

Fault isolation: the senders run in the server's long-lived nursery, so an
exception escaping one would end the server. Each sender contains any failure
of its own: it logs the reason and closes that caller (or, for a request-scoped
sink, stops that request's events) and nothing else.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import secrets
from typing import Any, Awaitable, Callable

import anyio
import mcp_types as types
import trio

from oubliette_runtime.fast_tool_calls import notification_line

from .ids import ADMIN_PRINCIPAL
from .task_host import TaskHost

log = logging.getLogger("oubliette.server.callers")

EVENT_LOGGER = "oubliette"
LOG_LEVELS = ("debug", "info", "notice", "warning", "error", "critical", "alert", "emergency")
"""MCP's logging levels (RFC 5424 severities), least severe first."""
EVENT_LEVEL: types.LoggingLevel = "info"
"""The level every caller event is sent at: a caller's `logging/setLevel` above it (`notice` or
higher) stops its events; `session_events` still reads them from the log."""
EVENT_QUEUE_SIZE = 10_000
_ids = itertools.count(1)


def keyed_identity(principal: str, owner_key: str) -> str:
    """The identity of a 2026-07-28 caller (token principal + `owner_key`), the same on every server
    of a deployment; a hash, so the log that records it never holds the key itself."""
    return "key:" + hashlib.sha256(f"{principal}:{owner_key}".encode()).hexdigest()[:32]


def event_notification(event: dict) -> types.LoggingMessageNotification:
    """The MCP `notifications/message` (logger `oubliette`) that carries one caller event."""
    return types.LoggingMessageNotification(
        params=types.LoggingMessageNotificationParams(level=EVENT_LEVEL, logger=EVENT_LOGGER, data=event)
    )


_GONE = (trio.BrokenResourceError, trio.ClosedResourceError, anyio.ClosedResourceError, anyio.BrokenResourceError)


class CallerConnection:
    """One caller; `push` queues an event for its standalone notification channel.

    `on_failed(caller)` is called when its sender fails (the registry closes the caller then).
    """

    def __init__(
        self, transport: str, label: str | None = None, on_failed: Callable[["CallerConnection"], object] | None = None,
    ) -> None:
        self.id = f"caller-{next(_ids)}"
        self.transport = transport
        self.label = label or self.id
        self.on_failed = on_failed
        self.closed = trio.Event()
        self.mcp_session: Any = None  # latest ServerSession; its standalone channel carries events
        self.owner_key: str | None = None  # 2026-07-28 HTTP callers: the key that names this caller
        #: The HTTP principal it acts as (its bearer token's; the policies say what it may do):
        #: `admin` for stdio and a Unix socket listener, whose file access is the credential.
        self.principal = ADMIN_PRINCIPAL
        #: A stdio caller's line writer: events go out as `notifications/message` lines without the SDK.
        self.write_line: Callable[[str], Awaitable[None]] | None = None
        #: Who this caller is for every server sharing the store (docs/SCALING.md): `keyed_identity`
        #: for a 2026-07-28 caller; a connection (stdio, a handshake-era MCP session) lives on one
        #: server only, so its identity is random and no other server's caller ever matches it.
        self.identity = "connection:" + secrets.token_hex(16)
        #: Whether its events are sent: False once the caller's `logging/setLevel` asked for
        #: messages more severe than `EVENT_LEVEL` only.
        self.wants_events = True
        self._send, self._receive = trio.open_memory_channel[dict](EVENT_QUEUE_SIZE)
        self._dropped = 0  # events dropped since the queue was last full

    def __repr__(self) -> str:
        return f"<CallerConnection {self.id} {self.transport} {self.label}>"

    @property
    def delivers(self) -> bool:
        """Whether an event pushed here can reach the caller (`sessions.delivers`): not a 2026-07-28
        caller's (`owner_key`), which has no notification channel (its events ride its requests, each
        with a follower of its own), so its sender drops every one."""
        return self.mcp_session is not None or self.owner_key is None

    def set_log_level(self, level: str) -> None:
        """The caller's `logging/setLevel`: events (sent at `EVENT_LEVEL`) go to it only while
        `level` is at or below that level."""
        self.wants_events = LOG_LEVELS.index(level) <= LOG_LEVELS.index(EVENT_LEVEL)

    def push(self, event: dict) -> None:
        """Queue an event for the caller without waiting; dropped when the caller's log level is above
        `EVENT_LEVEL`, or the caller closed, or it cannot be delivered (`delivers`: a 2026-07-28
        caller's own connection, whose sender would only wake to drop it), or (logged) its queue is full."""
        if self.closed.is_set() or not self.wants_events or not self.delivers:
            return
        try:
            self._send.send_nowait(event)
        except trio.WouldBlock:
            # One line when it starts dropping, one when it reads again: a sandbox writing frames
            # fast must not make a line per dropped event.
            if not self._dropped:
                log.warning("%s is not reading events; dropping them from seq %s until it does (read them with "
                            "session_events)", self, event.get("seq"))
            self._dropped += 1
        else:
            if self._dropped:
                log.warning("%s reads events again; %d were dropped (read them with session_events)", self, self._dropped)
                self._dropped = 0

    async def run_sender(self) -> None:
        """Deliver queued events until the connection closes; a failure closes this caller only."""
        async with self._receive:
            async for event in self._receive:
                session = self.mcp_session
                if session is None:
                    continue
                try:
                    if self.write_line is not None:
                        await self.write_line(notification_line("notifications/message", {
                            "level": EVENT_LEVEL, "logger": EVENT_LOGGER, "data": event,
                        }))
                    else:
                        await session.send_notification(event_notification(event))
                except _GONE:
                    return
                except Exception:
                    log.exception("%r: sending event seq %s failed; closing this caller", self, event.get("seq"))
                    if self.on_failed is not None:
                        self.on_failed(self)
                    else:
                        self.close()
                    return

    def close(self) -> None:
        """Mark the caller closed (`closed` is set) and end its sender once the queue drains; idempotent."""
        self.closed.set()
        self._send.close()


class RequestScopedSink:
    """Events for one in-flight request (2026-07-28 callers have no standalone channel)."""

    def __init__(self, mcp_session: Any, request_id: Any) -> None:
        self._mcp_session = mcp_session
        self._request_id = request_id
        self._send, self._receive = trio.open_memory_channel[dict](EVENT_QUEUE_SIZE)

    def push(self, event: dict) -> None:
        """Queue an event for the request without waiting; dropped when the queue is full or closed."""
        try:
            self._send.send_nowait(event)
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    async def run(self) -> None:
        """Deliver this request's events; a failure ends them (logged), never the request or the server."""
        async with self._receive:
            async for event in self._receive:
                try:
                    await self._mcp_session.send_notification(
                        event_notification(event), related_request_id=self._request_id
                    )
                except _GONE:
                    return
                except Exception:
                    log.exception("events of request %r: sending seq %s failed; no more events on it",
                                  self._request_id, event.get("seq"))
                    return

    def close(self) -> None:
        """No more events: `run` ends once the queued ones are sent."""
        self._send.close()


class CallerRegistry:
    """The connected callers; runs each one's event sender in its own nursery.

    Owns: a nursery (started with `await nursery.start(registry.serve)`) holding one sender
    task per caller. Needs: `on_closed(caller)`, called once when a caller goes away (its
    pending calls fail, it stops following sessions).
    """

    def __init__(self, on_closed: Callable[[CallerConnection], object]) -> None:
        self._on_closed = on_closed
        self._callers: set[CallerConnection] = set()
        self._tasks = TaskHost()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the senders until cancelled."""
        await self._tasks.serve(task_status=task_status)

    def open(self, transport: str, label: str | None = None) -> CallerConnection:
        """A new caller; its events flow once the registry is serving."""
        caller = CallerConnection(transport, label, on_failed=self.close)
        self._callers.add(caller)
        self._tasks.start_soon(caller.run_sender)  # before `serve`: when it starts
        log.info("%r connected", caller)
        return caller

    def count(self) -> int:
        """How many callers are connected now."""
        return len(self._callers)

    def close(self, caller: CallerConnection) -> None:
        """The caller is gone: it gets no more events and `on_closed` fails what waits on it."""
        if caller not in self._callers:
            return
        self._callers.discard(caller)
        caller.close()
        self._on_closed(caller)
