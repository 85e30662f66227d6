"""Sandbox connections to the relay: authentication and registration over the shared peer.

`RelayListener` accepts connections on one address (Unix socket by default, or TCP) and
hands each stream to a connection factory. `RelayConnection` adds to the protocol's
`RelayPeer` only what the server alone knows: the `hello` check (protocol version, role,
instance id, token) and the hand-off to the rest of the server (`on_open` before the
hello answer, `on_close` at the end). Everything else - framing, the hello gate, request
tasks and `cancel`, the write deadline and the outgoing queue - is the peer's.

Owns: the connection's stream and tasks (through its peer). Needs: `verify_token`, the
`{(role, method): HandlerEntry}` table (handlers take the connection first), the
`on_open`/`on_close` hooks and `PeerLimits`. Raises: nothing out of `run` but
cancellation; one connection's failure never reaches the listener.

The relay access log: one INFO line on `oubliette.access` (as the HTTP API's) when a connection
is admitted, when it is refused (the reason: a wrong token, a bad hello, a limit, no hello in
time) and when an admitted one closes (its duration and why) - never a token. The fields are
also on the record (`extra`), so `--log-format json` writes them as their own keys. A
connection evicted at the relay's cap before its hello has no line: a flood of them is counted
in the listener's flood WARNING and a metric instead (docs/SECURITY.md, "Relay connections that
never say hello").
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

import attrs
import trio

from protocol import (
    PROTOCOL_VERSION,
    ROLE_SERVER,
    VERSION,
    EncodedNotification,
    HandlerEntry,
    PeerLimits,
    RelayAddress,
    RelayCore,
    RelayError,
    RelayPeer,
    errors,
    messages,
)
from oubliette_runtime.peer_text import bounded

from ..core.auth import check_hello
from .connection_limits import ConnectionAcceptor, FloodLog, RelayLimits

log = logging.getLogger("oubliette.server.relay")
access_log = logging.getLogger("oubliette.access")
"""One INFO line per relay connection event (docs/OBSERVABILITY.md, "The relay access log"); never a token."""

#: A refusal's message that would show a hello's token (a wrong type is echoed by the schema check).
_TOKEN_VALUE = re.compile(r"(\$\.token\b).*", re.DOTALL)

SERVER_VERSION = VERSION
#: The Unix socket's listen backlog, as `trio.open_tcp_listeners` asks for TCP (the kernel caps it at
#: `net.core.somaxconn`). A connection waiting there holds no descriptor of the server, and it is
#: accepted in turn; with a short backlog, connections that never say hello kept it full and a
#: sandbox's connect failed at once (EAGAIN) instead of waiting its turn.
UNIX_BACKLOG = 0xFFFF

#: What a relay handler takes: the connection asking, then its structured params.
RelayHandlers = Mapping[tuple[str, str], HandlerEntry[Any]]


class _RoleHandlers(Mapping[str, HandlerEntry[Any]]):
    """The connection's view of the server's table: its own `hello`, then its role's methods."""

    def __init__(self, connection: RelayConnection, table: RelayHandlers) -> None:
        self._connection = connection
        self._table = table
        self._hello = HandlerEntry(messages.Hello, connection._hello)

    def __getitem__(self, method: str) -> HandlerEntry[Any]:
        if method == messages.HELLO and self._connection.role is None:
            return self._hello
        entry = self._table[(self._connection.role or "", method)]
        return HandlerEntry(entry.params_type, functools.partial(entry.handler, self._connection))

    def __iter__(self) -> Iterator[str]:
        return (method for role, method in self._table if role == self._connection.role)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def unknown_method(self, method: str) -> str:
        roles = sorted(role for role, name in self._table if name == method)
        if roles:
            return f"method {method!r} is for role {' or '.join(map(repr, roles))} connections"
        return f"unknown method {method!r}"


class RelayConnection:
    """One sandbox connection, bound to its instance (and session) after `hello`.

    `role`, `instance` and `session_key` are None until the hello passed.
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        peer: str,
        *,
        verify_token: Callable[[str, str], bool],
        handlers: RelayHandlers,
        on_open: Callable[[RelayConnection], Awaitable[None]],
        on_close: Callable[[RelayConnection], None],
        limits: PeerLimits = PeerLimits(),
        on_request_started: Callable[[], None] | None = None,
        on_request_finished: Callable[[], None] | None = None,
        token_hint: Callable[[str], str] | None = None,
    ) -> None:
        self.peer = peer
        self._token_hint = token_hint
        self.role: str | None = None
        self.instance: str | None = None
        self.session_key: str | None = None
        self._verify_token = verify_token
        self._handlers = _RoleHandlers(self, handlers)
        self._on_open = on_open
        self._on_close = on_close
        self._opened_tasks: list[Callable[[], Awaitable[None]]] = []
        self._began = trio.current_time()
        self._claimed: tuple[str, str, str | None] | None = None  # the hello's role, instance, session
        self._evicted = False
        self._peer = RelayPeer(
            stream, RelayCore(ROLE_SERVER), name=self, limits=limits,
            on_request_started=on_request_started, on_request_finished=on_request_finished,
        )

    def __repr__(self) -> str:
        return f"<RelayConnection {self.role} {self.instance} {self.session_key or ''} {self.peer}>"

    # -- sending -------------------------------------------------------------------------

    def notify(self, method: str, params: Any) -> None:
        """Queue a notification; never waits for the socket (a stalled sandbox is closed instead)."""
        try:
            self._peer.notify(method, params)
        except RelayError as err:
            log.debug("%r: notification %s dropped: %s", self, method, err.message)

    def notify_encoded(self, note: EncodedNotification) -> None:
        """Queue a notification encoded once for many connections (a declaration's fan-out):
        the same bytes, never encoded again here; never waits, like `notify`."""
        try:
            self._peer.notify_encoded(note)
        except RelayError as err:
            log.debug("%r: notification %s dropped: %s", self, note.method, err.message)

    async def send_notification(self, method: str, params: Any) -> None:
        """Queue a notification, waiting for room: only for this connection's own producers.

        Raises `FrameTooLarge` (nothing sent) for a frame the sandbox could not read; a
        notification to a connection that has ended is dropped.
        """
        try:
            await self._peer.send_notification(method, params)
        except RelayError as err:
            if err.code != errors.PEER_DISCONNECTED:
                raise
            log.debug("%r: notification %s dropped: %s", self, method, err.message)

    # -- lifecycle -----------------------------------------------------------------------

    def start_soon(self, task: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Run `task(*args)` for the connection's life, starting once the hello is answered.

        Call it from `on_open`; the task is cancelled when the connection ends.
        """
        self._opened_tasks.append(functools.partial(task, *args))

    def close_soon(self) -> None:
        """End this connection (e.g. a newer guest replaced it)."""
        self._peer.close("replaced by a newer connection")

    def close_after_answer(self, reason: str) -> None:
        """End this connection once the answer being made is written (the peer reads why)."""
        self._peer.close_after_answer(reason)

    @property
    def authenticated(self) -> bool:
        """Whether its hello's token (and the rest of the hello) passed; from then on it is never evicted."""
        return self.role is not None

    def evict(self) -> None:
        """End this connection before its hello passed, without a word or an access line: the relay
        is at its cap and a newer connection needs the room (the listener counts it)."""
        self._evicted = True
        self._peer.close("evicted at the relay's cap", quiet=True)

    async def run(self) -> None:
        """Serve the connection until it ends (or is evicted); `on_close` runs whenever `on_open` did.

        The peer runs in this task, and its nursery holds the tasks `start_soon` asked for: an idle
        connection is one task parked in its read (and a guest's delivery), no more (docs/SCALING.md,
        "Many sandboxes on one server")."""
        try:
            await self._peer.serve(self._handlers, unknown_method=self._handlers.unknown_method, on_opened=self._opened)
        finally:
            if self.role is not None:
                self._on_close(self)
            if not self._evicted:
                self._log_end()

    def _opened(self, nursery: trio.Nursery) -> None:
        """The hello was answered: the access line, then the tasks `on_open` asked for."""
        self._access("connected")
        for task in self._opened_tasks:
            nursery.start_soon(task)
        self._opened_tasks.clear()

    async def _hello(self, hello: messages.Hello) -> messages.HelloResult:
        """Check the hello; register the connection (its configuration is queued before the answer)."""
        self._claimed = (hello.role, hello.instance, hello.session)
        check_hello(hello, self._verify_token, self._token_hint)
        self.role, self.instance, self.session_key = hello.role, hello.instance, hello.session
        await self._on_open(self)  # if it fails, the hello is refused and `on_close` still runs
        return messages.HelloResult(
            protocol=PROTOCOL_VERSION, server_version=SERVER_VERSION,
            instance=hello.instance, session=hello.session, features=[messages.APPEND_ID_FEATURE],
        )


    # -- the access log --------------------------------------------------------------------

    def _log_end(self) -> None:
        """The connection's last access line: closed (it was admitted), refused, or left before hello."""
        if self._peer.opened.is_set():
            self._access("closed", self._peer.close_reason or "the connection ended", duration=True)
        elif self._peer.refusal is not None:
            self._access("refused", _TOKEN_VALUE.sub(r"\1 (its value is not logged)", self._peer.refusal), duration=True)
        else:
            self._access("left before hello", self._peer.close_reason or "the connection ended", duration=True)

    def _access(self, event: str, reason: str | None = None, *, duration: bool = False) -> None:
        """One `oubliette.access` line: `PEER relay ROLE INSTANCE SESSION EVENT [after S s] [- REASON]`.

        Before the hello passed, the role, instance and session are the ones it claimed (escaped).
        """
        if not access_log.isEnabledFor(logging.INFO):
            return
        role, instance, session = (self.role, self.instance, self.session_key) if self.role else self._claimed or (None, None, None)
        fields: dict[str, Any] = {
            "event": event, "peer": self.peer, "role": bounded(role) if role else None,
            "instance": bounded(instance) if instance else None, "session": bounded(session) if session else None,
        }
        tail = ""
        if duration:
            fields["duration_s"] = round(trio.current_time() - self._began, 3)
            tail += f" after {fields['duration_s']:.3f} s"
        if reason:
            fields["reason"] = bounded(reason)
            tail += f" - {fields['reason']}"
        access_log.info(
            "%s relay %s %s %s %s%s", self.peer, fields["role"] or "-", fields["instance"] or "-",
            fields["session"] or "-", event, tail, extra=fields,
        )


class RelayListener:
    """Accepts sandbox connections on one address; `connection_factory(stream, peer_name)` makes each one.

    At most `limits.connection_cap` connections at once: at the cap, the oldest connections
    whose hello has not passed yet are evicted for the newcomer (`on_evicted` is told of each), so
    connections that never say hello cannot keep out a sandbox with a valid token; when every
    connection has passed its hello the newcomer is closed at once. Owns the listening socket
    (and the Unix socket file, removed at the end). Start it with `nursery.start(listener.serve)`:
    it is listening once started, which returns the bound address (a TCP port 0 replaced by the
    port the system chose).
    """

    def __init__(
        self, address: RelayAddress, connection_factory: Callable[[trio.abc.Stream, str], RelayConnection],
        limits: RelayLimits = RelayLimits(), on_evicted: Callable[[], None] = lambda: None,
        group: int | None = None,
    ) -> None:
        self.address = address
        self._connection_factory = connection_factory
        self.limits = limits
        self._on_evicted = on_evicted
        self.group = group
        """The group that may use the Unix socket besides the server's user (mode 0660), or None (0600)."""
        self._before_hello: dict[RelayConnection, None] = {}
        """Connections in the order they started, the oldest first; those that passed their
        hello are dropped from the front as eviction meets them (or when they end)."""

    async def serve(self, *, task_status: trio.TaskStatus[RelayAddress] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen and run one connection per accepted stream until cancelled.

        Raises: `OSError` when the address cannot be bound, or a Unix socket path is in use by a
        live server (a stale socket file is replaced). A connection's failure is logged, never
        raised. Cancellation: every connection is closed and the Unix socket file removed.
        """
        try:
            listeners = await self._open()
        except OSError as exc:  # one line for the operator: which address, and why
            raise OSError(exc.errno, f"cannot listen on the relay address {self.address}: {exc.strerror or exc}") from exc
        log.info("relay listening on %s", self.address)
        try:
            # Not trio.serve_listeners: out of descriptors, it logs a traceback ten times a second.
            flood = FloodLog(log, f"relay listener {self.address}")
            async with trio.open_nursery() as nursery:
                await nursery.start(flood.serve)
                acceptor = ConnectionAcceptor(flood, log, cap=self.limits.connection_cap, evict=self._evict_oldest)
                await nursery.start(acceptor.serve, self._handle, listeners)
                task_status.started(self._bound(listeners))
        finally:
            if self.address.kind == "unix":
                with trio.CancelScope(shield=True):
                    try:
                        os.unlink(self.address.path)
                    except FileNotFoundError:
                        pass

    def _bound(self, listeners: list[trio.SocketListener]) -> RelayAddress:
        """The address listened on: a TCP port 0 is the port the system chose."""
        if self.address.kind != "tcp" or self.address.port != 0:
            return self.address
        return attrs.evolve(self.address, port=listeners[0].socket.getsockname()[1])

    async def _open(self) -> list[trio.SocketListener]:
        if self.address.kind == "tcp":
            return await trio.open_tcp_listeners(self.address.port, host=self.address.host)
        path = self.address.path
        os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)
        if os.path.exists(path):
            await self._remove_stale_socket(path)
        sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        # 0600 (0660 with the sandboxes' group) before listen: until then nobody can connect, so the
        # file's first mode does not matter, and the process-wide umask is never changed (other
        # tasks and threads create files).
        await sock.bind(path)
        if self.group is not None:
            os.chown(path, -1, self.group)
        os.chmod(path, 0o600 if self.group is None else 0o660)
        sock.listen(UNIX_BACKLOG)
        return [trio.SocketListener(sock)]

    @staticmethod
    async def _remove_stale_socket(path: str) -> None:
        try:
            probe = await trio.open_unix_socket(path)
        except OSError:
            os.unlink(path)
            return
        await probe.aclose()
        raise OSError("in use by another server (stop it, or pass another --relay or --data-dir)")

    def _evict_oldest(self, count: int) -> int:
        """Evict the `count` oldest connections whose hello has not passed (fewer when there are not
        so many); how many it evicted."""
        evicted = 0
        while self._before_hello and evicted < count:
            connection = next(iter(self._before_hello))
            del self._before_hello[connection]
            if not connection.authenticated:
                connection.evict()
                self._on_evicted()
                evicted += 1
        return evicted

    async def _handle(self, stream: trio.abc.Stream) -> None:
        peer = "unix" if self.address.kind == "unix" else _peer_name(stream)
        connection = self._connection_factory(stream, peer)
        self._before_hello[connection] = None
        try:
            await connection.run()
        except Exception:  # one connection's failure must never take the listener (and the server) down
            log.exception("relay connection from %s failed", peer)
        finally:
            self._before_hello.pop(connection, None)


def _peer_name(stream: trio.abc.Stream) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]  # type: ignore[attr-defined]
        return f"{host}:{port}"
    except Exception:
        return "tcp"
