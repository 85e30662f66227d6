"""The one Trio relay peer, used by oubliette-server and oubliette-client alike.

:class:`RelayPeer` is the I/O shell around the sans-IO :class:`~protocol.core.RelayCore`:
it reads the stream into the core, runs what the events ask for, and writes what the core
encodes.

Owns: the stream (closed when :meth:`RelayPeer.serve` returns); a nursery with one writer
task that drains the outgoing queue while frames wait (started by the first, ended by the
last: an idle connection holds no task for it), each ``send_all`` under
``fail_after(write_timeout)``; on a socket, a frame queued when nothing waits before it is
written at once by the task that queued it while the non-blocking send takes it whole (no
writer task, no deadline: such a send cannot block), the rest left to the writer; one task
and one cancel scope per inbound request.
Needs: a :class:`~protocol.core.RelayCore` for our role and a handler table; start it with
``await nursery.start(peer.serve, handlers)`` (``request``/``notify`` work once started).
Raises: callers of :meth:`RelayPeer.request` only ever see :class:`RelayError` -
``TIMEOUT`` when the deadline passes, ``PEER_DISCONNECTED`` when the connection ends first,
the peer's own error otherwise. Handler exceptions become error responses in one place.
Cancellation: cancelling ``serve`` closes the connection; every pending request then fails
with ``PEER_DISCONNECTED`` and every inbound request's handler is cancelled. A cancelled
``request`` tells the peer (``cancel {id}``) and removes its waiter.

Nothing here awaits a socket inline on behalf of someone else: :meth:`RelayPeer.notify`
only enqueues, and a connection whose queue is full, or whose write does not finish within
the write deadline, is closed with a logged reason.

Room in the queue (docs/PROTOCOL.md, "Room for answers"). What this side pushes on its own
(notifications, its requests) shares ``queue_frames`` places; a ``notify`` that finds none is
a stalled peer. What answers the peer - the response to each of its requests, and the
``cancel`` of each of our requests we stopped waiting for - is never counted there: there is
at most one per request in flight, and the peer's requests in flight are bounded
(``max_requests_in_flight``: at that many, the read loop reads nothing more until an answer
is written). So a burst of answers (a hundred calls timing out together, a hundred refused
requests in one write) waits for the writer, and only the write deadline cuts a peer off.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Generic, TypeVar

import attrs
import trio

from . import messages
from .core import (
    NEED_DATA,
    ConnectionClosed,
    EncodedNotification,
    LocalProtocolError,
    NotificationReceived,
    NotificationRejected,
    RelayCore,
    RemoteProtocolError,
    RequestReceived,
    RequestRejected,
    ResponseReceived,
    ROLE_SERVER,
)
from .errors import CANCELLED, INTERNAL_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, PEER_DISCONNECTED, TIMEOUT, RelayError
from .framing import RECEIVE_CHUNK_BYTES, FrameTooLarge, write_at_once
from .schemas import parse_params

__all__ = [
    "DEFAULT_WRITE_TIMEOUT",
    "DEFAULT_QUEUE_FRAMES",
    "DEFAULT_MAX_REQUESTS_IN_FLIGHT",
    "HELLO_TIMEOUT",
    "PeerLimits",
    "HandlerEntry",
    "RelayPeer",
]

log = logging.getLogger("oubliette.relay.peer")

#: Seconds one frame may take to be written before the peer counts as not reading.
DEFAULT_WRITE_TIMEOUT = 10.0
#: Frames waiting to be written before the connection counts as stalled.
DEFAULT_QUEUE_FRAMES = 64
#: The peer's requests this side holds at once (running, or answered and not yet written); at
#: this many the connection reads nothing more until one answer is written. Far above what an
#: agent runs at once (a relayed call per tool call in flight), it bounds what the answers may
#: hold in the queue.
DEFAULT_MAX_REQUESTS_IN_FLIGHT = 256
#: The largest frame written at once by the task that queues it when the socket is free (`RelayPeer`,
#: "Writing"); a larger one goes to the writer task, so a big fan-out's copies are not one long step.
AT_ONCE_BYTES = 64 * 1024
#: Seconds from connecting to a completed handshake.
HELLO_TIMEOUT = 10.0

P = TypeVar("P")


@attrs.frozen
class PeerLimits:
    """The deadlines and bounds of one connection (all settable; see docs/PROTOCOL.md)."""

    write_timeout: float = DEFAULT_WRITE_TIMEOUT
    """Seconds one ``send_all`` may take; then the connection is closed."""
    queue_frames: int = DEFAULT_QUEUE_FRAMES
    """Notifications and requests of ours that may wait to be written; a ``notify`` that finds
    them full closes the connection (answers to the peer are bounded by ``max_requests_in_flight``)."""
    max_requests_in_flight: int = DEFAULT_MAX_REQUESTS_IN_FLIGHT
    """The peer's requests held at once, from being read until their answer is written; at this
    many, nothing more is read (backpressure, never a disconnect)."""
    hello_timeout: float = HELLO_TIMEOUT
    """Server: seconds to receive ``hello``. Client: seconds to get its answer."""


@attrs.frozen
class HandlerEntry(Generic[P]):
    """How to serve one method: params are checked once, by the peer, against the method's JSON
    Schema (derived from ``params_type``) and built into ``params_type`` before ``handler`` sees them.

    A request handler's return value (an attrs instance or plain JSON) is the result; a
    notification handler's is ignored.
    """

    params_type: type[P]
    #: Called with the params; a server's relay table (doors/relay.py) holds handlers that take the
    #: connection first, bound per connection before the peer calls them.
    handler: Callable[..., Awaitable[Any]]


@attrs.define(eq=False)
class _Waiter:
    done: trio.Event = attrs.field(factory=trio.Event)
    result: Any = None
    error: RelayError | None = None


class _Room:
    """Bounded places for frames of one kind: taken when queued, given back when done with.

    A closed connection wakes whoever waits for room (:meth:`wake_all`), who then sees it closed.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.used = 0
        self._lot: trio.lowlevel.ParkingLot | None = None
        """Made by the first wait for room: most connections never wait, and each holds two rooms."""

    def try_take(self) -> bool:
        """Take a place if one is free."""
        if self.used >= self.size:
            return False
        self.used += 1
        return True

    async def take(self, closed: Callable[[], bool]) -> bool:
        """Wait for a place (no checkpoint when one is free); False (nothing taken) once
        ``closed()`` says the connection ended."""
        while not closed():
            if self.try_take():
                return True
            if self._lot is None:
                self._lot = trio.lowlevel.ParkingLot()
            await self._lot.park()
        return False

    def give(self) -> None:
        """A frame was written (or dropped): its place is free again."""
        self.used -= 1
        if self._lot is not None:
            self._lot.unpark()

    def wake_all(self) -> None:
        """Wake every waiter (the connection ended)."""
        if self._lot is not None:
            self._lot.unpark_all()


@attrs.frozen
class _Outgoing:
    data: bytes
    on_written: Callable[[], None] | None = None
    room: _Room | None = None
    """Given back as soon as the writer takes the frame (a place in ``queue_frames``)."""


_CLOSE = object()  # queue marker: everything before it is written, then the connection ends


class RelayPeer:
    """One relay connection end: requests out with deadlines, requests in with handlers.

    ``name`` labels the connection in logs (it is formatted with ``%r`` each time, so an
    owner can pass itself). ``on_request_started``/``on_request_finished`` are called
    around each inbound request other than ``hello``; "finished" comes once its answer has
    been written (or dropped with the connection).

    Owns: the stream (closed, forcefully, when :meth:`serve` returns) and, inside
    :meth:`serve`, the only writer task while frames wait, draining the outgoing queue (``limits.queue_frames``
    places for what we push, one per request in flight for the answers), and one task per
    inbound request. Needs: :meth:`serve` running (``nursery.start``) for anything to be
    written or read. Raises: :meth:`request`, :meth:`notify` and :meth:`send_notification`
    raise only ``RelayError``; a write past ``limits.write_timeout``, or a :meth:`notify`
    that finds no place, closes the connection, and every waiting request fails with
    ``PEER_DISCONNECTED``. A burst of answers never does.
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        core: RelayCore,
        *,
        name: object = "relay peer",
        limits: PeerLimits = PeerLimits(),
        on_request_started: Callable[[], None] | None = None,
        on_request_finished: Callable[[], None] | None = None,
    ) -> None:
        self._stream = stream
        self._core = core
        self.name = name
        self.limits = limits
        self._on_started = on_request_started
        self._on_finished = on_request_finished
        # Unbounded: what may wait in it is bounded by the two rooms (and by our own requests in
        # flight, one `cancel` each at most). A list, not a deque: an idle connection's empty one
        # is 56 bytes, not 760, and it holds a few frames at a time.
        self._queue: list[_Outgoing | object] = []
        self._writing = False
        """Whether the writer task runs: it is started by the first frame queued and ends when
        the queue is empty, so an idle connection holds no task for it."""
        self._flushed: trio.Event | None = None
        """Made by a close after flushing: set when the writer stopped (`_CLOSE` met, or a failed write)."""
        self._nursery: trio.Nursery | None = None
        self._on_opened: Callable[[trio.Nursery], None] | None = None
        self._pushed = _Room(limits.queue_frames)
        self._answers = _Room(limits.max_requests_in_flight)
        self._waiters: dict[Any, _Waiter] = {}
        self._in_flight: dict[Any, trio.CancelScope] = {}
        self._scope: trio.CancelScope | None = None
        self._close_reason: str | None = None
        self._close_after_answer: str | None = None
        self._hello_deadline = math.inf
        self.opened = trio.Event()
        """Set once the handshake completed (server: hello answered; client: answer read)."""
        self.refusal: str | None = None
        """Why the connection ended before its handshake completed, logged by its owner: a server's
        refused hello (its error message) or, either side, the peer's protocol error (a client's
        peer that is not a relay at all: `RelayLink` says so, not "is the server running?")."""
        self.closed = trio.Event()
        """Set once the connection ended; :attr:`close_reason` says why."""

    def __repr__(self) -> str:
        return f"<RelayPeer {self.name!r}>"

    @property
    def core(self) -> RelayCore:
        """The protocol state of this connection."""
        return self._core

    @property
    def close_reason(self) -> str | None:
        """Why the connection ended (or is ending); ``None`` while it is up."""
        return self._close_reason

    @property
    def is_closed(self) -> bool:
        """Whether the connection ended or is ending."""
        return self._close_reason is not None

    # -- running ------------------------------------------------------------------------------

    async def serve(
        self,
        handlers: Mapping[str, HandlerEntry[Any]],
        *,
        unknown_method: Callable[[str], str] | None = None,
        on_opened: Callable[[trio.Nursery], None] | None = None,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run the connection until it ends; start it with ``nursery.start`` (or await it: it
        needs no nursery of its caller's, which saves an idle connection a task).

        ``handlers`` maps each method this side serves (requests and notifications) to
        its :class:`HandlerEntry`; ``cancel`` is built in. ``unknown_method(method)`` words
        the ``METHOD_NOT_FOUND`` for a method the protocol allows but ``handlers`` lacks.
        ``on_opened(nursery)`` is called once the handshake completed (:attr:`opened`), with
        the connection's nursery, for tasks that live as long as the connection.
        Returns when the peer ends the stream, after a protocol error (answered, then
        closed), a refused hello, a failed or late write, or :meth:`close`.
        """
        self._on_opened = on_opened
        try:
            async with trio.open_nursery() as nursery:
                self._scope, self._nursery = nursery.cancel_scope, nursery
                if self._close_reason is not None:
                    nursery.cancel_scope.cancel()
                self._start_writer()
                task_status.started()
                if await self._read_loop(nursery, handlers, unknown_method):
                    assert self._flushed is not None
                    await self._flushed.wait()
                nursery.cancel_scope.cancel()
        finally:
            self._nursery = None
            self._finish(self._close_reason or "the connection ended")
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(self._stream)

    def close(self, reason: str, *, quiet: bool = False) -> None:
        """End the connection now (queued frames are dropped), logging ``reason`` unless ``quiet``
        (its owner accounts for it otherwise: the relay counts the connections it evicts)."""
        if self._close_reason is None:
            if not quiet:
                log.warning("%r: closing: %s", self.name, reason)
            self._close_reason = reason
        self._fail_waiters(reason)
        self._wake_room_waiters()
        if self._scope is not None:
            self._scope.cancel()

    def close_after_answer(self, reason: str) -> None:
        """End the connection once the next answer is queued (written first), logging `reason`: a
        handler that refuses a request and ends its connection calls it, so the peer reads why."""
        log.warning("%r: closing after this answer: %s", self.name, reason)
        self._close_after_answer = reason

    def _wake_room_waiters(self) -> None:
        self._pushed.wake_all()
        self._answers.wake_all()

    def _finish(self, reason: str) -> None:
        if self._close_reason is None:
            self._close_reason = reason
        self._fail_waiters(self._close_reason)
        self._wake_room_waiters()
        self._drop_queued()  # and a frame queued from now on is dropped at once (`_put`: closed)
        self.closed.set()

    def _fail_waiters(self, reason: str) -> None:
        for waiter in list(self._waiters.values()):
            if not waiter.done.is_set():
                waiter.error = RelayError(PEER_DISCONNECTED, reason)
                waiter.done.set()

    # -- writing ------------------------------------------------------------------------------

    def _start_writer(self) -> None:
        """Write what waits: at once while the socket takes it (`_write_at_once`), else from the
        writer task, started if it is not running (nor can be yet: before `serve`)."""
        if not self._queue or self._writing or self._nursery is None:
            return
        self._writing = True  # a frame queued by a callback of a frame written at once waits its turn
        if self._write_at_once():
            self._writing = False
            return
        try:
            self._nursery.start_soon(self._write_loop)
        except RuntimeError:  # the connection's nursery is ending (closed to new tasks): a
            self._writing = False
            self._drop_queued()  # frame queued now, such as a cancelled request's cancel, is never written

    def _write_at_once(self) -> bool:
        """Write the queued frames in the calling task while a socket's non-blocking send takes
        each whole: no writer task, no scheduler round trip, and no deadline, for such a send
        cannot block. True: everything was written. A frame the socket takes in part or not at all
        (its buffer is full, or it broke: the writer task tries again and ends the connection as
        usual), a frame over `AT_ONCE_BYTES` (a long copy would hold
        the loop), and any other stream leave the rest to the task, which writes under the write
        deadline and closes the connection on a failed write."""
        if not isinstance(self._stream, trio.SocketStream):
            return False
        queue = self._queue
        while queue:
            item = queue[0]
            if not isinstance(item, _Outgoing) or len(item.data) > AT_ONCE_BYTES:  # `_CLOSE`: the task's
                return False
            sent = write_at_once(self._stream.socket.fileno(), item.data)
            if sent < len(item.data):
                queue[0] = attrs.evolve(item, data=item.data[sent:])
                return False
            queue.pop(0)
            self._done_with(item)
        return True

    async def _write_loop(self) -> None:
        """The only task that writes to the stream, while frames wait (`_start_writer` starts it)."""
        try:
            while self._queue:
                item = self._queue.pop(0)
                if item is _CLOSE:  # what was queued before it is written: the connection ends now
                    if self._scope is not None:
                        self._scope.cancel()
                    return
                assert isinstance(item, _Outgoing)
                if item.room is not None:
                    item.room.give()
                try:
                    with trio.fail_after(self.limits.write_timeout):
                        await self._stream.send_all(item.data)
                except trio.TooSlowError:
                    self.close(f"a write did not finish within {self.limits.write_timeout:g} s (the peer is not reading)")
                    return
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    self.close(f"a write failed: {exc or type(exc).__name__}")
                    return
                finally:
                    if item.on_written is not None:
                        item.on_written()
        finally:
            self._writing = False
            if self._flushed is not None:
                self._flushed.set()

    def _drop_queued(self) -> None:
        """Frames that will never be written still count as finished for their owners."""
        while self._queue:
            item = self._queue.pop(0)
            if isinstance(item, _Outgoing):
                self._done_with(item)

    @staticmethod
    def _done_with(item: _Outgoing) -> None:
        """A frame written at once, or one that will never be written: its place is free again, and it counts as finished."""
        if item.room is not None:
            item.room.give()
        if item.on_written is not None:
            item.on_written()

    def _put(self, item: _Outgoing) -> bool:
        """Queue a frame whose place is already accounted for; False (and dropped) once closed."""
        if self._close_reason is None:
            self._queue.append(item)
            self._start_writer()
            return True
        self._done_with(item)
        return False

    def _push_nowait(self, data: bytes) -> bool:
        """Queue a frame of our own without waiting; no place left means the peer stalled: close."""
        if self._close_reason is not None:
            return False
        if not self._pushed.try_take():
            self.close(f"{self.limits.queue_frames} frames are waiting to be written (the peer is not reading)")
            return False
        return self._put(_Outgoing(data, room=self._pushed))

    async def _push(self, data: bytes) -> None:
        """Queue a frame of our own, waiting for a place (bounded: the writer drains under its deadline)."""
        await trio.lowlevel.checkpoint()
        if self._close_reason is not None or not await self._pushed.take(lambda: self._close_reason is not None):
            raise self._disconnected()
        if not self._put(_Outgoing(data, room=self._pushed)):
            raise self._disconnected()

    def _answer(self, data: bytes, on_written: Callable[[], None] | None) -> None:
        """Queue the answer to one of the peer's requests: its place was taken when the request was read."""
        self._put(_Outgoing(data, on_written))

    def _disconnected(self) -> RelayError:
        return RelayError(PEER_DISCONNECTED, self._close_reason or "the connection ended")

    # -- outbound -----------------------------------------------------------------------------

    async def request(self, method: str, params: Any = None, *, timeout: float) -> Any:
        """Send a request and wait at most ``timeout`` seconds for its result.

        Raises ``RelayError``: ``TIMEOUT`` (after sending ``cancel {id}``),
        ``PEER_DISCONNECTED`` when the connection ends first, or the peer's error. On
        cancellation it sends ``cancel {id}`` too; either way the waiter is removed.
        """
        if self._close_reason is not None:
            raise self._disconnected()
        request_id, data = self._core.send_request(method, params)
        waiter = _Waiter()
        self._waiters[request_id] = waiter
        sent = False
        try:
            with trio.fail_after(timeout):
                await self._push(data)
                sent = True
                await waiter.done.wait()
        except trio.TooSlowError:
            self._cancel_outbound(request_id, sent)
            raise RelayError(TIMEOUT, f"no answer to {method} within {timeout:g} s") from None
        except BaseException:
            self._cancel_outbound(request_id, sent)
            raise
        finally:
            del self._waiters[request_id]
            self._core.forget(request_id)
        if waiter.error is not None:
            raise waiter.error
        return waiter.result

    def _cancel_outbound(self, request_id: Any, sent: bool) -> None:
        """Tell the peer we stopped waiting; only enqueues, so it is bounded and needs no shield.

        Outside ``queue_frames``: at most one ``cancel`` per request of ours in flight, so a
        hundred requests timing out together never make this side close its own connection.
        """
        if not sent or self._close_reason is not None:
            return
        data = self._core.send_cancel(request_id)
        if data is not None:
            self._put(_Outgoing(data))

    def notify(self, method: str, params: Any = None) -> None:
        """Queue a notification; never waits. A full queue closes the connection as stalled.

        Raises ``RelayError(PEER_DISCONNECTED)`` when the connection is (now) closed.
        """
        if self._close_reason is not None:
            raise self._disconnected()
        if not self._push_nowait(self._core.send_notification(method, params)):
            raise self._disconnected()

    def notify_encoded(self, note: EncodedNotification) -> None:
        """Queue a notification encoded once for many connections (:func:`~protocol.core.encode_notification`):
        the same bytes go to each, checked against this connection's role and frame limit.

        Raises like :meth:`notify`, and :class:`FrameTooLarge` for a frame over this connection's limit.
        """
        if self._close_reason is not None:
            raise self._disconnected()
        if not self._push_nowait(self._core.send_encoded(note)):
            raise self._disconnected()

    async def send_notification(self, method: str, params: Any = None) -> None:
        """Queue a notification, waiting for room: for this connection's own producers (a
        guest's message delivery, the configuration before the hello answer) - never for
        pushes from one connection's work to another. Raises like :meth:`notify`."""
        await self._push(self._core.send_notification(method, params))

    # -- inbound ------------------------------------------------------------------------------

    async def _receive_some(self) -> bytes | bytearray | None:
        """Bytes from the stream; ``None`` when the hello deadline passed (after it, a quiet peer is
        never cut off: an agent may sit idle for hours, and the protocol has no keepalive). Without
        a deadline the read takes no cancel scope: an idle connection's parked read holds less."""
        if self._core.our_role == ROLE_SERVER and not self._core.handshake_complete:
            with trio.move_on_at(self._hello_deadline):
                return await self._receive_or_eof()
            return None
        return await self._receive_or_eof()

    async def _receive_or_eof(self) -> bytes | bytearray:
        """Bytes from the stream; ``b""`` when it ended or broke.

        A socket stream is first waited on with ``wait_readable``: the read then parks two frames
        deep instead of trio's whole ``receive_some`` stack, about 1.8 KB less for each idle
        connection (docs/SCALING.md, "Many sandboxes on one server"), and what it has is read in
        the same step (``receive_some`` would take one more scheduler round trip, its checkpoint)."""
        try:
            if isinstance(self._stream, trio.SocketStream):
                await trio.lowlevel.wait_readable(self._stream.socket)
                try:
                    return os.read(self._stream.socket.fileno(), RECEIVE_CHUNK_BYTES)
                except OSError:
                    pass  # nothing after all, broken or closed: the stream's own read says which
            return await self._stream.receive_some(RECEIVE_CHUNK_BYTES)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return b""

    async def _read_loop(
        self,
        nursery: trio.Nursery,
        handlers: Mapping[str, HandlerEntry[Any]],
        unknown_method: Callable[[str], str] | None,
    ) -> bool:
        """Read and dispatch until the connection ends; True if queued frames must be flushed first."""
        self._hello_deadline = trio.current_time() + self.limits.hello_timeout
        while True:
            try:
                event = self._core.next_event()
            except RemoteProtocolError as err:
                return self._protocol_error(err)
            if event is NEED_DATA:
                data = await self._receive_some()
                if data is None:
                    return self._protocol_error(RemoteProtocolError(
                        INVALID_REQUEST, f"no hello within {self.limits.hello_timeout:g} s"))
                self._core.receive_data(data)
            elif isinstance(event, ConnectionClosed):
                self._close_reason = self._close_reason or "the peer closed the connection"
                return False
            elif isinstance(event, ResponseReceived):
                self._resolve(event)
                if self._core.handshake_complete:
                    self._opened(nursery)
            elif isinstance(event, RequestReceived):
                if self._core.handshake_complete:
                    if not await self._room_for_answer():
                        return False
                    scope = trio.CancelScope()
                    self._in_flight[event.id] = scope
                    nursery.start_soon(self._serve_request, event, scope, handlers, unknown_method)
                else:  # hello: answered before anything else is read
                    await self._serve_hello(event, handlers, unknown_method)
                    if self._core.must_close:
                        return self._close_after_flush("the hello was refused")
                    self._opened(nursery)
            elif isinstance(event, NotificationReceived):
                await self._on_notification(event, handlers)
            elif isinstance(event, RequestRejected):
                if not await self._room_for_answer():
                    return False
                self._answer(self._core.send_rejection(event), self._answers.give)
            elif isinstance(event, NotificationRejected):
                log.warning("%r: ignoring notification %s: %s", self.name, event.method, event.error.message)

    def _opened(self, nursery: trio.Nursery) -> None:
        """The handshake completed: `opened` is set, and `on_opened` told once."""
        if not self.opened.is_set():
            self.opened.set()
            if self._on_opened is not None:
                self._on_opened(nursery)

    async def _room_for_answer(self) -> bool:
        """Take the place of one more request's answer; at ``max_requests_in_flight`` read
        nothing until an answer is written (False: the connection ended meanwhile)."""
        if self._answers.used >= self._answers.size:
            log.debug("%r: %d requests in flight; reading waits for an answer to be written", self.name, self._answers.used)
        return await self._answers.take(lambda: self._close_reason is not None)

    def _close_after_flush(self, reason: str) -> bool:
        """Stop taking new frames; True if the writer will write what is queued, then stop."""
        if self._close_reason is not None:
            return False
        self._close_reason = reason
        self._flushed = trio.Event()
        self._queue.append(_CLOSE)
        self._start_writer()
        return True

    def _protocol_error(self, err: RemoteProtocolError) -> bool:
        """Answer a protocol break with one error object, then close (after flushing).

        Before the handshake it is a refusal (`refusal`, logged by the owner), else a WARNING."""
        if not self._core.handshake_complete:
            self.refusal = f"protocol error: {err.message}"
            log.debug("%r: protocol error before hello, closing: %s", self.name, err.message)
        else:
            log.warning("%r: protocol error, closing: %s", self.name, err.message)
        if not self._put(_Outgoing(self._core.send_protocol_error(err))):
            return False
        return self._close_after_flush(f"protocol error: {err.message}")

    def _resolve(self, event: ResponseReceived) -> None:
        waiter = self._waiters.get(event.id)
        if waiter is None or waiter.done.is_set():
            return
        waiter.result, waiter.error = event.result, event.error
        waiter.done.set()

    async def _call(
        self,
        method: str,
        params: dict[str, Any],
        handlers: Mapping[str, HandlerEntry[Any]],
        unknown_method: Callable[[str], str] | None,
    ) -> Any:
        entry = handlers.get(method)
        if entry is None:
            why = unknown_method(method) if unknown_method else f"this {self._core.our_role} serves no method {method!r}"
            raise RelayError(METHOD_NOT_FOUND, why)
        return await entry.handler(parse_params(method, params, entry.params_type))

    async def _answered(
        self, event: RequestReceived, handlers: Mapping[str, HandlerEntry[Any]], unknown_method: Callable[[str], str] | None
    ) -> tuple[Any, RelayError | None]:
        """Run the handler: the single place where handler exceptions become error responses."""
        try:
            return await self._call(event.method, event.params, handlers, unknown_method), None
        except RelayError as err:
            return None, err
        except Exception as exc:  # a bug must not take the connection down
            log.exception("%r: %s failed", self.name, event.method)
            return None, RelayError(INTERNAL_ERROR, f"internal error: {exc}")

    async def _serve_hello(
        self, event: RequestReceived, handlers: Mapping[str, HandlerEntry[Any]], unknown_method: Callable[[str], str] | None
    ) -> None:
        result, error = await self._answered(event, handlers, unknown_method)
        if error is not None:
            self.refusal = error.message
            log.debug("%r: hello refused: %s", self.name, error.message)
        self._respond(event.id, result, error)

    async def _serve_request(
        self,
        event: RequestReceived,
        scope: trio.CancelScope,
        handlers: Mapping[str, HandlerEntry[Any]],
        unknown_method: Callable[[str], str] | None,
    ) -> None:
        if self._on_started is not None:
            self._on_started()

        def finished() -> None:  # its answer was written or dropped: the place is free again
            self._answers.give()
            if self._on_finished is not None:
                self._on_finished()

        answered = False
        try:
            result: Any = None
            error: RelayError | None = None
            with scope:
                result, error = await self._answered(event, handlers, unknown_method)
            if scope.cancelled_caught:
                error = RelayError(CANCELLED, f"request {event.id!r} was cancelled")
            # Answered outside the request's scope: a `cancel` that crosses the answer does not
            # cut it (and only the writer task writes, under its own deadline).
            answered = True
            self._respond(event.id, result, error, finished)
        finally:
            self._in_flight.pop(event.id, None)
            if not answered:
                finished()

    def _respond(
        self, request_id: Any, result: Any, error: RelayError | None, on_written: Callable[[], None] | None = None
    ) -> None:
        try:
            try:
                if error is not None:
                    data = self._core.send_error(request_id, error)
                else:
                    data = self._core.send_response(request_id, result)
            except FrameTooLarge as err:
                data = self._core.send_error(
                    request_id, RelayError(INTERNAL_ERROR, f"the answer is too large to send: {err.message}"))
            except LocalProtocolError as err:
                log.error("%r: cannot answer %r: %s", self.name, request_id, err.message)
                data = self._core.send_error(request_id, RelayError(INTERNAL_ERROR, err.message))
        except LocalProtocolError as err:  # the connection is ending: nothing to answer on
            log.debug("%r: answer to %r dropped: %s", self.name, request_id, err.message)
            if on_written is not None:
                on_written()
            return
        self._answer(data, on_written)
        if self._close_after_answer is not None:
            self._close_after_flush(self._close_after_answer)

    async def _on_notification(self, event: NotificationReceived, handlers: Mapping[str, HandlerEntry[Any]]) -> None:
        """Notifications run in order, in the read loop: keep their handlers short."""
        try:
            if event.method == messages.CANCEL:
                scope = self._in_flight.get(parse_params(event.method, event.params).id)
                if scope is not None:
                    scope.cancel()
                return
            entry = handlers.get(event.method)
            if entry is None:
                log.warning("%r: ignoring notification %s: nothing serves it", self.name, event.method)
                return
            await entry.handler(parse_params(event.method, event.params, entry.params_type))
        except RelayError as err:
            log.warning("%r: bad %s notification: %s", self.name, event.method, err.message)
        except Exception:
            log.exception("%r: %s notification failed", self.name, event.method)
