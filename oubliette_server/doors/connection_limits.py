"""What connections may hold of the server's file descriptors, and one accept loop for every listener.

Why: every accepted connection is a file descriptor, and the process has `RLIMIT_NOFILE` of
them. Slow HTTP clients, each sending its body a byte at a time, once held the server at that
limit: a new sandbox's relay hello, the operator's requests and SQLite itself then failed with
"Too many open files", and `trio.serve_listeners` logged an ERROR with a traceback ten times a
second for as long as the flood lasted. So:

- `ConnectionAcceptor` runs the accept loop of a set of listeners with an optional cap on the
  connections open at once. Over the cap, the relay makes room by closing its oldest
  connections that have not said a valid hello (`evict`), so connections that never say hello
  cannot keep a sandbox with a token out; otherwise (HTTP, or a relay full of authenticated
  sandboxes) the newcomer is handed to a `refuse` coroutine (HTTP answers 503) in one of a
  few refusal slots, or closed at once, and when the slots are busy too the loop stops
  accepting until one frees. So the descriptors it holds are bounded by the cap plus the
  refusal slots. An accept that fails for lack of descriptors or memory (`EMFILE`, `ENFILE`,
  `ENOMEM`, `ENOBUFS`) is retried after a short pause, counted, never a traceback.
- `FloodLog` turns such events into one WARNING per interval with counts, instead of a line
  per connection.
- `descriptor_shares` divides `RLIMIT_NOFILE` between the HTTP cap, the relay cap and a
  reserve for SQLite, start commands and the server's own pipes; `HttpLimits` and
  `RelayLimits` are each door's limits, with their defaults.
"""

from __future__ import annotations

import errno
import logging
import math
import resource
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import attrs
import trio

from protocol.framing import write_at_once

log = logging.getLogger("oubliette.server.http")

#: accept(2) errors that mean "no descriptor or memory right now", not "this listener is broken".
CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
#: How long an accept loop pauses after such an error. Nothing signals that a descriptor was
#: freed (any part of the process may free one), so the loop retries after this pause, as
#: `trio.serve_listeners` does, but counting instead of logging each failure.
ACCEPT_RETRY_SECONDS = 0.1
#: One flood WARNING at most this often.
FLOOD_LOG_SECONDS = 10.0
#: Connections over the cap being refused at once (each takes a descriptor for up to
#: `REFUSE_SECONDS`); past them the accept loop waits.
REFUSAL_SLOTS = 16
#: How long a refusal may take (write the answer, let the client read it).
REFUSE_SECONDS = 1.0
#: Connections evicted at once when the cap is reached: the accept loop waits for one of them to
#: end, and the others' slots then take the next accepts without a wait of their own.
EVICTIONS_AT_ONCE = 16
#: The least number of descriptors kept out of both doors' reach by the derived caps.
MIN_FD_RESERVE = 64
#: Seconds a relay connection has, from being accepted, to send its whole `hello` line.
DEFAULT_RELAY_HELLO_TIMEOUT = 5.0

DEFAULT_HTTP_BODY_TIMEOUT = 30.0
DEFAULT_HTTP_KEEP_ALIVE_TIMEOUT = 5.0
DEFAULT_HTTP_KEEP_ALIVE_MAX_REQUESTS = 1000
#: Seconds one write to an HTTP client may take: a client that reads nothing for this long is
#: disconnected (an SSE stream's keepalive is written every 15 s, so a live one never is).
HTTP_WRITE_SECONDS = 30.0
HOLD_NEXT_SEND_STATE = "oubliette_hold_next_send"
"""Key of the connection's `GuardedStream.hold_next_send` in each HTTP request's scope state."""
WATCH_STATE = "oubliette_connection_watch"
"""Key of the connection's `ConnectionWatch` in each HTTP request's scope state."""


def hold_next_send(scope: dict[str, Any]) -> None:
    """Have the request's connection send the next write's bytes with the one after it
    (`GuardedStream.hold_next_send`); nothing on a connection that has no `GuardedStream`."""
    hold = scope.get("state", {}).get(HOLD_NEXT_SEND_STATE)
    if hold is not None:
        hold()


def fd_limit() -> int:
    """The process's soft `RLIMIT_NOFILE` (an unlimited one counts as 2**20)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 2**20 if soft == resource.RLIM_INFINITY else soft


@attrs.frozen
class DescriptorShares:
    """How the descriptor limit is shared by the caps that are not configured (docs/SECURITY.md)."""

    http: int
    """HTTP connections open at once (`http_max_connections`' default)."""
    relay: int
    """Relay connections open at once (`relay_max_connections`' default)."""
    reserve: int
    """Out of both doors' reach: the store, start commands, the server's own pipes, refusals."""


def descriptor_shares(nofile: int | None = None) -> DescriptorShares:
    """A reserve of a quarter of the descriptor limit (at least `MIN_FD_RESERVE`), the rest half
    to HTTP and half to the relay, each at least 1: 1024 descriptors give 384, 384 and 256.

    Why shares: a flood through one door must leave the other door and the store their descriptors."""
    limit = fd_limit() if nofile is None else nofile
    doors = max(2, limit - max(MIN_FD_RESERVE, limit // 4))
    return DescriptorShares(http=doors // 2, relay=doors - doors // 2, reserve=max(0, limit - doors))


@attrs.frozen
class HttpLimits:
    """What one HTTP client, and all of them together, may hold of the server (docs/SECURITY.md,
    "Slow HTTP clients"): the cap on open connections (None: HTTP's `descriptor_shares()`),
    the seconds a request's whole body has to arrive, and the keep-alive limits."""

    max_connections: int | None = None
    body_timeout: float = DEFAULT_HTTP_BODY_TIMEOUT
    keep_alive_timeout: float = DEFAULT_HTTP_KEEP_ALIVE_TIMEOUT
    keep_alive_max_requests: int = DEFAULT_HTTP_KEEP_ALIVE_MAX_REQUESTS

    @property
    def connection_cap(self) -> int:
        """The configured cap, or the one derived from `RLIMIT_NOFILE` now."""
        return self.max_connections if self.max_connections is not None else descriptor_shares().http


@attrs.frozen
class RelayLimits:
    """What sandbox connections, before and after their hello, may hold of the server
    (docs/SECURITY.md, "Relay connections that never say hello"): the cap on open relay
    connections (None: the relay's `descriptor_shares()`), at which the oldest one without a
    valid hello yet is closed to make room, and the seconds a new one has to send its hello."""

    max_connections: int | None = None
    hello_timeout: float = DEFAULT_RELAY_HELLO_TIMEOUT

    @property
    def connection_cap(self) -> int:
        """The configured cap, or the one derived from `RLIMIT_NOFILE` now."""
        return self.max_connections if self.max_connections is not None else descriptor_shares().relay


class FloodLog:
    """Counts what a flood costs and says it in one WARNING per `interval`, not once per event.

    `count("kind")` adds one; the first count after a quiet spell is logged at once (together
    with whatever else happened in the same moment), then at most one line per `interval` with
    the counts since the previous line. Owns: nothing; run `serve` with `nursery.start`.
    """

    def __init__(self, logger: logging.Logger, what: str, interval: float = FLOOD_LOG_SECONDS) -> None:
        self.logger = logger
        self.what = what
        self.interval = interval
        self.totals: dict[str, int] = {}
        """Every count since the start (for tests and embedders)."""
        self._pending: dict[str, int] = {}
        self._wake = trio.Event()

    def count(self, kind: str, n: int = 1) -> None:
        """Record `n` events of `kind` (a plural noun phrase, e.g. "connections refused at the cap")."""
        self._pending[kind] = self._pending.get(kind, 0) + n
        self.totals[kind] = self.totals.get(kind, 0) + n
        self._wake.set()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Write the WARNING lines until cancelled (then the counts not yet written are dropped)."""
        task_status.started()
        while True:
            await self._wake.wait()
            await trio.lowlevel.checkpoint()  # the events of this same moment join the line
            pending, self._pending, self._wake = self._pending, {}, trio.Event()
            self.logger.warning(
                "%s under pressure (one line per %g s at most): %s", self.what, self.interval,
                ", ".join(f"{n} {kind}" for kind, n in pending.items()),
            )
            await trio.sleep(self.interval)  # the rate limit itself: the next line waits this long


Handler = Callable[[trio.abc.Stream], Awaitable[object]]


class ConnectionAcceptor:
    """The accept loop of a set of listeners: at most `cap` connections handled at once.

    Owns: the listeners given to `serve` (closed when it ends) and each accepted stream (closed
    when its handler returns). At the cap, `evict(n)` may end up to `n` connections being
    handled to make room, and says how many it ended: the newcomer waits for the first slot
    they free, and they are counted in `flood` as "connections without a valid hello evicted".
    Otherwise the newcomer goes to `refuse(stream)` (with at most `REFUSAL_SLOTS` refusals at
    once, each cut at `REFUSE_SECONDS`), or is closed at once without `refuse`; either way it
    is counted in `flood` as "connections refused at the cap".
    Raises: an accept error other than running out of descriptors or memory (the listener is
    broken). A handler's exception is logged on `log`, never raised.
    """

    def __init__(
        self, flood: FloodLog, log: logging.Logger, *, cap: int | None = None,
        refuse: Handler | None = None, evict: Callable[[int], int] | None = None,
    ) -> None:
        self.flood = flood
        self.log = log
        self.cap = cap
        self._connections = trio.CapacityLimiter(cap) if cap is not None else None
        self._refusals = trio.CapacityLimiter(REFUSAL_SLOTS)
        self._refuse = refuse
        self._evict = evict

    async def serve(
        self, handler: Handler, listeners: list[trio.SocketListener], *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept on every listener and run `handler(stream)` for each connection until cancelled."""
        async with trio.open_nursery() as nursery:
            for listener in listeners:
                nursery.start_soon(self._accept_loop, listener, handler, nursery)
            task_status.started()

    async def _accept_loop(self, listener: trio.SocketListener, handler: Handler, nursery: trio.Nursery) -> None:
        async with listener:
            while True:
                try:
                    stream = await listener.accept()
                except OSError as exc:
                    if exc.errno not in CAPACITY_ERRNOS:
                        raise
                    self.flood.count(f"accepts failed ({errno.errorcode[exc.errno]}: {exc.strerror})")
                    await trio.sleep(ACCEPT_RETRY_SECONDS)
                    continue
                if self._connections is None:
                    nursery.start_soon(self._run, stream, handler, None)
                    continue
                try:
                    self._connections.acquire_on_behalf_of_nowait(stream)
                except trio.WouldBlock:
                    evicted = self._evict(EVICTIONS_AT_ONCE) if self._evict is not None else 0
                    if evicted:
                        self.flood.count(f"connections without a valid hello evicted at the cap of {self.cap}", evicted)
                        # The evicted connections' tasks end at their next checkpoint and give their slots,
                        # the first to this waiter: the descriptors held stay within the cap plus this one.
                        await self._connections.acquire_on_behalf_of(stream)
                        nursery.start_soon(self._run, stream, handler, self._connections)
                        continue
                    self.flood.count(f"connections refused at the cap of {self.cap}")
                    if self._refuse is None:
                        await trio.aclose_forcefully(stream)
                        continue
                    await self._refusals.acquire_on_behalf_of(stream)  # past the slots: stop accepting
                    nursery.start_soon(self._refused, stream)
                else:
                    nursery.start_soon(self._run, stream, handler, self._connections)

    async def _run(self, stream: trio.abc.Stream, handler: Handler, slot: trio.CapacityLimiter | None) -> None:
        try:
            await handler(stream)
        except Exception:  # one connection's failure never takes the listener down
            self.log.exception("connection failed")
        finally:
            await trio.aclose_forcefully(stream)
            if slot is not None:
                slot.release_on_behalf_of(stream)

    async def _refused(self, stream: trio.abc.Stream) -> None:
        assert self._refuse is not None
        try:
            with trio.move_on_after(REFUSE_SECONDS):
                await self._refuse(stream)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client left first; it was being refused anyway
        finally:
            await trio.aclose_forcefully(stream)
            self._refusals.release_on_behalf_of(stream)


class QuickLock:
    """A lock taken in the step that asks for it when it is free (`trio.Lock` always passes through
    the scheduler first: one round trip per take), for locks taken on every request (a connection's
    write lock, a fast-path response's writer's), each held only around work that checkpoints or
    cannot block. A task that finds it held waits its turn as on `trio.Lock`.
    """

    def __init__(self) -> None:
        self._lock = trio.Lock()

    async def acquire(self) -> None:
        """Take the lock: at once when free, else after the task holding it releases it."""
        try:
            self._lock.acquire_nowait()
        except trio.WouldBlock:
            await self._lock.acquire()

    def release(self) -> None:
        """Give the lock back."""
        self._lock.release()

    def locked(self) -> bool:
        """Whether a task holds the lock."""
        return self._lock.locked()

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self.release()


class Closable(Protocol):
    """What a `ConnectionWatch` closes at its keep-alive deadline: its connection."""

    async def close(self) -> None:
        """Close the connection (under a shield: it must end)."""


class ConnectionWatch:
    """The one task of an HTTP connection (`HTTP11Connection`) beside its reading and its request's
    app: the keep-alive deadline, and the watch of the request a fast path answers on it (`watching`).

    The keep-alive: the deadline of this task moves. `idle` (a response ended, or the connection
    opened) sets it `seconds` from now, `busy` (a request came) lifts it; at the deadline the
    connection is closed (`connection.close()`, shielded). `close()` ends the task: call it when
    the connection's reading ends, as its nursery waits for the task.

    The request watch: a request answered beside the SDK (caller_api/http_fast.py) needs what the
    SDK's writer gives its requests, a task beside the call that watches for the client leaving
    and pings past each keepalive interval without an event. That was a task and a nursery per
    request; here it is this task: the connection's reading ending (`close`: the client went away,
    or the connection broke) cancels the watched call, and the request's `ping` runs here at
    `WatchedRequest.ping_at`. One request at a time (`free`): HTTP/1.1 answers one at a time.
    """

    def __init__(self, connection: Closable, seconds: float) -> None:
        self.connection = connection
        self.seconds = seconds
        self._idle_deadline = math.inf
        self._request: WatchedRequest | None = None
        self._wait: trio.CancelScope | None = None
        self._started = False
        self._closed = False

    def start(self, nursery: trio.Nursery) -> None:
        """Start the task in `nursery`, the connection idle (its keep-alive deadline set)."""
        if not self._started and not self._closed:
            self._started = True
            self._idle_deadline = trio.current_time() + self.seconds
            nursery.start_soon(self._run)

    def idle(self) -> None:
        """The connection is idle: close it `seconds` from now."""
        self._idle_deadline = trio.current_time() + self.seconds
        self._move()

    def busy(self) -> None:
        """A request came: no deadline until the connection is idle again."""
        self._idle_deadline = math.inf
        self._move()

    def close(self) -> None:
        """The connection's reading ended: cancel the watched call (its client is gone) and end the
        task without closing anything."""
        self._closed = True
        if self._request is not None:
            self._request.call.cancel()
        if self._wait is not None:
            self._wait.cancel()

    def free(self) -> bool:
        """Whether `watching` may watch a request now: the task runs and watches none."""
        return self._started and not self._closed and self._request is None

    @contextmanager
    def watching(self, ping: Callable[[], Awaitable[None]], interval: float) -> Iterator[WatchedRequest]:
        """Watch a request while the block runs: run its call inside `WatchedRequest.call` (the
        client leaving cancels it), and `ping()` runs on this task `interval` seconds after the
        block began and after each ping, later when the request says so (`quiet`)."""
        if not self.free():
            raise RuntimeError("ConnectionWatch.watching: the connection is closed or watches a request")
        request = WatchedRequest(self, ping, interval)
        self._request = request
        self._move()
        try:
            yield request
        finally:
            self._request = None
            self._move()

    def _move(self) -> None:
        if self._wait is not None:
            request = self._request
            self._wait.deadline = self._idle_deadline if request is None else min(self._idle_deadline, request.ping_at)

    async def _run(self) -> None:
        while not self._closed:
            with trio.CancelScope() as self._wait:
                self._move()
                await trio.sleep_forever()
            self._wait = None
            request = self._request
            if self._closed:
                return
            if request is not None and trio.current_time() >= request.ping_at:
                await request.pinged()
            elif trio.current_time() >= self._idle_deadline:
                break
        if not self._closed:
            with trio.CancelScope(shield=True):
                await self.connection.close()


class WatchedRequest:
    """A request `ConnectionWatch.watching` watches: the scope its call runs in (`call`), and when
    its next keepalive ping is due (`ping_at`)."""

    def __init__(self, watch: ConnectionWatch, ping: Callable[[], Awaitable[None]], interval: float) -> None:
        self.call = trio.CancelScope()
        self.ping_at = trio.current_time() + interval
        self._watch = watch
        self._ping = ping
        self._interval = interval

    def quiet(self) -> None:
        """The request wrote an event: its next ping is an interval from now."""
        self.ping_at = trio.current_time() + self._interval
        self._watch._move()

    async def pinged(self) -> None:
        """Ping (on the connection's task); a ping that fails ends the call, as a failed write
        ended it when the ping had a task of its own, with the failure logged."""
        self.ping_at = trio.current_time() + self._interval
        try:
            await self._ping()
        except Exception:
            log.exception("the keepalive ping of an HTTP request failed; its call is cancelled")
            self.call.cancel()


class GuardedStream(trio.abc.HalfCloseableStream):
    """An HTTP connection's socket stream (`HTTP11Connection`'s): one send at a time, each within
    `write_timeout`.

    Why: hypercorn's connection of old wrote under its own lock in a shielded scope with no
    deadline, and ended a connection with `send_eof` outside that lock. A client that closed
    while its answer was being written made both send at once (`BusyResourceError`, a
    traceback per request, a free way to fill the log), and a client that stopped reading held
    its connection, and its descriptor, for ever. Here `send_eof` waits for the send in
    progress, and a send that cannot finish within `write_timeout` raises
    `BrokenResourceError`, which the connection takes as the client gone.
    """

    def __init__(self, inner: trio.SocketStream, write_timeout: float) -> None:
        self.inner = inner
        self.socket = inner.socket
        """The socket, which the connection asks for the addresses."""
        self.write_timeout = write_timeout
        self._sending = QuickLock()
        self._hold = False
        self._held = b""

    def hold_next_send(self) -> None:
        """Keep the next send's bytes until the send after it, which carries both: for a writer
        whose next two sends follow each other at once (a response's head and its body), so they
        cost one system call and one packet. A response's last send is never held (`release_hold`)."""
        self._hold = True

    def release_hold(self) -> None:
        """The next send is the last of a response: send it (with any bytes held) rather than hold it."""
        self._hold = False

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        """Send `data` (after bytes held for it), after any send in progress, within `write_timeout`.

        A response is sent once or a few times (its head, each part of a streamed body), so the
        lock is taken without a scheduler round trip when it is free (the socket's send is the
        checkpoint), bytes the socket takes whole at once are written in this step
        (`write_at_once`: no deadline to arm, no round trip; the rest, or a full socket, is written
        under the deadline), and an empty send, which has nothing to write, returns at once
        (a closed connection is then found by the next send or read). A send after
        `hold_next_send` only keeps its bytes (no checkpoint: it cannot block).
        """
        rest = self.send_now(data)
        if not rest:
            return
        await self._sending.acquire()  # free after a part was sent now: no checkpoint before the rest
        try:
            with trio.fail_after(self.write_timeout):
                await self.inner.send_all(rest)
        except trio.TooSlowError:
            raise trio.BrokenResourceError(f"the client read nothing for {self.write_timeout:g} s") from None
        finally:
            self._sending.release()

    def send_now(self, data: bytes | bytearray | memoryview) -> bytes | bytearray | memoryview:
        """What `send_all` does in the step that asks, without a checkpoint: keep `data` after
        `hold_next_send`, else send it after the bytes held, as far as the socket takes it at once
        when no send is in progress. The bytes left to send (all of them while a send is in
        progress), which `send_all` then sends in order: it takes the write lock, free whenever a
        part was sent here, before it can checkpoint."""
        if self._hold and data:
            self._hold = False
            self._held += data
            return b""
        if self._held:
            data, self._held = self._held + data, b""
        if not data or self._sending.locked() or self.socket is None:
            return data
        sent = write_at_once(self.socket.fileno(), data)
        return b"" if sent == len(data) else memoryview(data)[sent:]

    async def wait_send_all_might_not_block(self) -> None:
        """As the socket's."""
        await self.inner.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        """Half-close, once the send in progress (and any bytes held) has ended."""
        self._hold = False
        if self._held:
            await self.send_all(b"")
        async with self._sending:
            await self.inner.send_eof()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        """As the socket's."""
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        """Close the socket (a send in progress then fails with `ClosedResourceError`)."""
        await self.inner.aclose()
