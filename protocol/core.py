"""The relay connection as a sans-IO state machine: bytes in, events out; calls in, bytes out.

In the manner of h11: :class:`RelayCore` never touches a socket or a clock. Whoever owns
the stream feeds it received bytes (:meth:`RelayCore.receive_data`, ``b""`` = end of
stream), takes events (:meth:`RelayCore.next_event`) and writes the bytes that the
``send_*`` methods return. Timeouts and tasks live in the shell (``protocol.peer``).

It owns everything about the wire that does not need I/O:

- line splitting with the frame limit (``MAX_FRAME_BYTES`` by default, settable);
- the JSON-RPC envelope (``protocol.jsonrpc.parse_message``);
- id allocation and the set of ids we wait for: a late, duplicate or unknown response is
  dropped here, so the shell only ever sees answers it is waiting for;
- the ids of inbound requests not answered yet (a second request with such an id is
  rejected; answering an id that was never asked is our bug);
- the hello gate: before the handshake completes, only ``hello`` may be sent or received.
  A server-side core answers anything else with the documented error (``INVALID_REQUEST``)
  and the connection ends. The server may send the configuration notifications marked
  ``before_hello`` between reading ``hello`` and answering it;
- which role may send which method to which role, as data (:data:`METHOD_RULES`).

Needs: nothing (no trio, no clock). Raises: :class:`RemoteProtocolError` from
:meth:`RelayCore.next_event` when the peer broke the protocol (send
:meth:`RelayCore.send_protocol_error`, then close); :class:`LocalProtocolError` when we
tried something illegal (a bug); :class:`~protocol.framing.FrameTooLarge` from a ``send_*``
whose frame the peer would refuse. Any other exception is a bug.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any, Literal

import attrs

from . import messages
from .errors import INTERNAL_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, RelayError
from .framing import END_OF_STREAM, MAX_FRAME_BYTES, FrameTooLarge, LineBuffer, decode, encode
from .jsonrpc import Notification, Request, Response, error_response, notification, parse_message
from .jsonrpc import request as request_dict
from .jsonrpc import result_response

__all__ = [
    "ROLE_SERVER",
    "PEER_ROLES",
    "MethodRule",
    "METHOD_RULES",
    "senders_of",
    "ProtocolError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "RelayEvent",
    "RequestReceived",
    "NotificationReceived",
    "ResponseReceived",
    "RequestRejected",
    "NotificationRejected",
    "ConnectionClosed",
    "NEED_DATA",
    "EncodedNotification",
    "encode_notification",
    "RelayCore",
]

RequestId = int | str

#: The role of oubliette-server on a connection; the other side is ``client`` or ``guest``.
ROLE_SERVER = "server"
#: Every role a connection end can have.
PEER_ROLES: tuple[str, ...] = (ROLE_SERVER, messages.ROLE_CLIENT, messages.ROLE_GUEST)

_CLIENT, _GUEST = messages.ROLE_CLIENT, messages.ROLE_GUEST


@attrs.frozen
class MethodRule:
    """Who may send a method to whom, and whether it is a request or a notification."""

    kind: Literal["request", "notification"]
    routes: frozenset[tuple[str, str]]
    """(sender role, receiver role) pairs."""
    before_hello: bool = False
    """The server may send it after reading ``hello`` and before answering it (configuration)."""


#: The protocol's legal moves (docs/PROTOCOL.md), one entry per method.
METHOD_RULES: Mapping[str, MethodRule] = {
    messages.HELLO: MethodRule("request", frozenset({(_CLIENT, ROLE_SERVER), (_GUEST, ROLE_SERVER)})),
    messages.CALLER_TOOLS_CONFIG: MethodRule(
        "notification", frozenset({(ROLE_SERVER, _CLIENT)}), before_hello=True
    ),
    messages.TOOLSETS_CONFIG: MethodRule("notification", frozenset({(ROLE_SERVER, _CLIENT)}), before_hello=True),
    messages.CALLER_TOOL: MethodRule("request", frozenset({(_CLIENT, ROLE_SERVER)})),
    messages.TOOLSET_CALL: MethodRule("request", frozenset({(_CLIENT, ROLE_SERVER)})),
    messages.APPROVAL: MethodRule("request", frozenset({(_CLIENT, ROLE_SERVER)})),
    messages.PROGRESS: MethodRule("notification", frozenset({(ROLE_SERVER, _CLIENT)})),
    messages.APPEND_FRAME: MethodRule("request", frozenset({(_GUEST, ROLE_SERVER)})),
    messages.ACK: MethodRule("notification", frozenset({(_GUEST, ROLE_SERVER)})),
    messages.USER_MESSAGE: MethodRule("notification", frozenset({(ROLE_SERVER, _GUEST)})),
    messages.CANCEL: MethodRule(
        "notification",
        frozenset({(ROLE_SERVER, _CLIENT), (ROLE_SERVER, _GUEST), (_CLIENT, ROLE_SERVER), (_GUEST, ROLE_SERVER)}),
    ),
}


def senders_of(method: str) -> tuple[str, ...]:
    """The roles that may send ``method`` (sorted); empty for a method the protocol lacks."""
    rule = METHOD_RULES.get(method)
    return tuple(sorted({sender for sender, _ in rule.routes})) if rule else ()


def _allowed(method: str, kind: str, sender: str, receiver: str | None) -> bool:
    rule = METHOD_RULES.get(method)
    if rule is None or rule.kind != kind:
        return False
    if receiver is None:
        return any(s == sender for s, _ in rule.routes)
    return (sender, receiver) in rule.routes


# -- errors ----------------------------------------------------------------------------------


class ProtocolError(RelayError):
    """A break of the relay protocol; see the two subclasses."""


class LocalProtocolError(ProtocolError):
    """We tried something the protocol forbids: a bug on this side, never the peer's fault.

    It is a :class:`RelayError` (``INTERNAL_ERROR``) so that a shell can hand it to callers
    that only expect ``RelayError``.
    """

    def __init__(self, message: str) -> None:
        super().__init__(INTERNAL_ERROR, message)
        self.args = (message,)


class RemoteProtocolError(ProtocolError):
    """The peer sent bytes that break the protocol: answer with one error object, then close.

    ``request_id`` is the id of the offending request when it could be read (the error
    response carries it), otherwise ``None``.
    """

    request_id: RequestId | None

    def __init__(self, code: int, message: str, data: Any = None, request_id: RequestId | None = None) -> None:
        super().__init__(code, message, data)
        self.args = (code, message, data, request_id)
        self.request_id = request_id

    @classmethod
    def wrap(cls, err: RelayError, request_id: RequestId | None = None) -> RemoteProtocolError:
        """The same code, message and data as ``err``."""
        return cls(err.code, err.message, err.data, request_id)


# -- events ----------------------------------------------------------------------------------


class RelayEvent:
    """Base class of everything :meth:`RelayCore.next_event` returns (besides ``NEED_DATA``)."""

    __slots__ = ()


@attrs.frozen
class RequestReceived(RelayEvent):
    """The peer asks; answer with :meth:`RelayCore.send_response` or :meth:`RelayCore.send_error`."""

    id: RequestId
    method: str
    params: dict[str, Any]


@attrs.frozen
class NotificationReceived(RelayEvent):
    """A one-way message the peer's role may send us (``cancel`` included)."""

    method: str
    params: dict[str, Any]


@attrs.frozen
class ResponseReceived(RelayEvent):
    """The answer to one of our requests that is still pending (others are dropped)."""

    id: RequestId
    result: Any = None
    error: RelayError | None = None


@attrs.frozen
class RequestRejected(RelayEvent):
    """A well-formed request this connection refuses (wrong role, unknown method, id in use).

    The connection goes on: answer it with :meth:`RelayCore.send_rejection`.
    """

    id: RequestId
    method: str
    error: RelayError


@attrs.frozen
class NotificationRejected(RelayEvent):
    """A well-formed notification the peer's role may not send now; nothing answers it."""

    method: str
    error: RelayError


@attrs.frozen
class ConnectionClosed(RelayEvent):
    """The peer ended the stream (every line before the end was returned first)."""


class _NeedData:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NEED_DATA"


#: :meth:`RelayCore.next_event` needs more bytes before it can say more.
NEED_DATA = _NeedData()

# -- a notification encoded once, sent on many connections ---------------------------------------


@attrs.frozen
class EncodedNotification:
    """A notification's bytes, encoded once for a fan-out (the same declaration to every client
    connection of an instance): each connection's core checks that it may send ``method`` now
    and that ``data`` fits its frame limit (:meth:`RelayCore.send_encoded`), and sends these bytes."""

    method: str
    data: bytes


def encode_notification(method: str, params: Any = None) -> EncodedNotification:
    """Encode a notification of the protocol once, whatever connections will carry it.

    Raises :class:`LocalProtocolError` for a method that is not a notification or params that
    do not encode (a bug).
    """
    rule = METHOD_RULES.get(method)
    if rule is None or rule.kind != "notification":
        raise LocalProtocolError(f"{method!r} is not a notification of the protocol")
    return EncodedNotification(method, _encoded(notification(method, params)))


def _encoded(message: dict[str, Any]) -> bytes:
    """One message's line; params that do not encode are our bug."""
    try:
        return encode(message)
    except (TypeError, ValueError) as exc:
        raise LocalProtocolError(f"cannot encode a {message.get('method', 'response')}: {exc}") from None


# -- the state machine ---------------------------------------------------------------------------

_AWAIT_HELLO = "await_hello"  # nothing exchanged yet
_HELLO_SENT = "hello_sent"  # client: hello sent, its answer not read yet
_HELLO_RECEIVED = "hello_received"  # server: hello read, not answered yet
_OPEN = "open"  # the handshake completed
_REFUSED = "refused"  # the server refused hello: close
_ERROR = "error"  # the peer broke the protocol: send the error, close


class RelayCore:
    """One end of one relay connection, without I/O.

    ``our_role`` is ``"server"`` for oubliette-server, else the hello role (``"client"`` or
    ``"guest"``). A server core learns the peer's role from ``hello`` when it answers it.
    Not thread-safe; one owner drives it.
    """

    def __init__(self, our_role: str, *, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        if our_role not in PEER_ROLES:
            raise ValueError(f"unknown role {our_role!r}; one of {', '.join(PEER_ROLES)}")
        self.our_role = our_role
        self.max_frame_bytes = max_frame_bytes
        self._lines = LineBuffer(max_frame_bytes)
        self._state = _AWAIT_HELLO
        self._peer_role: str | None = ROLE_SERVER if our_role != ROLE_SERVER else None
        self._hello_role: str | None = None  # server: the role the hello under check asks for
        self._hello_id: RequestId | None = None
        self._ids = itertools.count(0)  # hello is 0, as clients have always sent it
        self._pending: set[RequestId] = set()
        self._inbound: set[RequestId] = set()
        self._error: RemoteProtocolError | None = None
        self._eof = False

    def __repr__(self) -> str:
        return f"<RelayCore {self.our_role}<->{self._peer_role or '?'} {self._state}>"

    # -- state ------------------------------------------------------------------------------

    @property
    def peer_role(self) -> str | None:
        """The other end's role; ``None`` on a server until it answered ``hello``."""
        return self._peer_role

    @property
    def handshake_complete(self) -> bool:
        """Whether ``hello`` was answered with success."""
        return self._state == _OPEN

    @property
    def must_close(self) -> bool:
        """The connection can only end now: a refused hello or a protocol error."""
        return self._state in (_REFUSED, _ERROR)

    @property
    def pending(self) -> frozenset[RequestId]:
        """Ids of our requests whose response we still wait for."""
        return frozenset(self._pending)

    @property
    def inbound(self) -> frozenset[RequestId]:
        """Ids of the peer's requests not answered yet."""
        return frozenset(self._inbound)

    # -- receiving --------------------------------------------------------------------------

    def receive_data(self, data: bytes | bytearray) -> None:
        """Feed bytes read from the stream; ``b""`` means the peer ended it."""
        if not data:
            self._eof = True
        self._lines.feed(data)

    def next_event(self) -> RelayEvent | _NeedData:
        """The next event, or :data:`NEED_DATA`.

        Raises :class:`RemoteProtocolError` when the peer broke the protocol (and again on
        every later call), :class:`LocalProtocolError` when a server reads on before it
        answered ``hello``.
        """
        if self._error is not None:
            raise self._error
        if self._state == _HELLO_RECEIVED:
            raise LocalProtocolError("answer hello before reading further")
        while True:
            try:
                line = self._lines.next_line()
            except FrameTooLarge as err:
                raise self._fail(err) from None
            if line is None:
                return NEED_DATA
            if line is END_OF_STREAM:
                return ConnectionClosed()
            assert isinstance(line, bytes)
            try:
                message = parse_message(decode(line))
            except RelayError as err:
                raise self._fail(err) from None
            event = self._classify(message)
            if event is not None:
                return event

    def _fail(self, err: RelayError, request_id: RequestId | None = None) -> RemoteProtocolError:
        self._error = RemoteProtocolError.wrap(err, request_id)
        self._state = _ERROR
        return self._error

    def _classify(self, message: Request | Response | Notification) -> RelayEvent | None:
        if self.our_role == ROLE_SERVER and self._state == _AWAIT_HELLO:
            return self._first_message(message)
        if isinstance(message, Response):
            return self._response(message)
        if isinstance(message, Request):
            return self._request(message)
        return self._notification(message)

    def _first_message(self, message: Request | Response | Notification) -> RelayEvent:
        if isinstance(message, Request) and message.method == messages.HELLO:
            self._state = _HELLO_RECEIVED
            self._hello_id = message.id
            role = message.params.get("role")
            self._hello_role = role if role in (_CLIENT, _GUEST) else None
            self._inbound.add(message.id)
            return RequestReceived(message.id, message.method, message.params)
        what = message.method if isinstance(message, (Request, Notification)) else "a response"
        request_id = message.id if isinstance(message, Request) else None
        raise self._fail(
            RelayError(INVALID_REQUEST, f"the first message must be the request 'hello', got {what}"),
            request_id,
        )

    def _response(self, message: Response) -> RelayEvent | None:
        if message.id is None or message.id not in self._pending:
            return None  # late (timed out, cancelled), duplicate or never asked: drop it
        self._pending.discard(message.id)
        if message.id == self._hello_id and self._state == _HELLO_SENT:
            self._state = _REFUSED if message.error is not None else _OPEN
        return ResponseReceived(message.id, message.result, message.error)

    def _request(self, message: Request) -> RelayEvent:
        method = message.method
        if method == messages.HELLO and self.our_role == ROLE_SERVER:
            return RequestRejected(message.id, method, RelayError(
                INVALID_REQUEST, "this connection has already completed its hello"))
        if not _allowed(method, "request", self._peer_role or "", self.our_role) or self._state != _OPEN:
            return RequestRejected(message.id, method, RelayError(METHOD_NOT_FOUND, self._refusal(method)))
        if message.id in self._inbound:
            return RequestRejected(message.id, method, RelayError(
                INVALID_REQUEST, f"request id {message.id!r} is already in flight"))
        self._inbound.add(message.id)
        return RequestReceived(message.id, method, message.params)

    def _refusal(self, method: str) -> str:
        senders = senders_of(method)
        if not senders:
            return f"unknown method {method!r}"
        if self.our_role == ROLE_SERVER:
            roles = " or ".join(repr(r) for r in senders if r != ROLE_SERVER)
            if roles:
                return f"method {method!r} is for role {roles} connections"
        return f"this {self.our_role} serves no method {method!r}"

    def _notification(self, message: Notification) -> RelayEvent:
        method = message.method
        rule = METHOD_RULES.get(method)
        before_hello_ok = self._state == _HELLO_SENT and rule is not None and rule.before_hello
        if _allowed(method, "notification", self._peer_role or "", self.our_role) and (
            self._state == _OPEN or before_hello_ok
        ):
            return NotificationReceived(method, message.params)
        why = "before the handshake completed" if self._state != _OPEN else f"from a {self._peer_role}"
        return NotificationRejected(method, RelayError(
            METHOD_NOT_FOUND, f"notification {method!r} is not accepted {why}"))

    # -- sending ------------------------------------------------------------------------------

    def _encode(self, message: dict[str, Any]) -> bytes:
        data = _encoded(message)
        if len(data) - 1 > self.max_frame_bytes:
            raise FrameTooLarge(self.max_frame_bytes)
        return data

    def _check_can_send(self, method: str, kind: str) -> None:
        if self._state in (_REFUSED, _ERROR):
            raise LocalProtocolError(f"cannot send {method!r}: the connection must close ({self._state})")
        if not _allowed(method, kind, self.our_role, self._peer_role or self._hello_role):
            raise LocalProtocolError(f"a {self.our_role} may not send the {kind} {method!r} to this peer")
        if self._state == _OPEN:
            return
        if method == messages.HELLO and self._state == _AWAIT_HELLO:
            return
        rule = METHOD_RULES[method]
        if self._state == _HELLO_RECEIVED and rule.before_hello:
            return
        raise LocalProtocolError(f"cannot send {method!r} before the handshake completed")

    def send_request(self, method: str, params: Any = None) -> tuple[RequestId, bytes]:
        """A new request's id (now pending) and its bytes.

        Raises :class:`LocalProtocolError` if our role may not send it now,
        :class:`FrameTooLarge` if the frame is over the limit (nothing becomes pending).
        """
        self._check_can_send(method, "request")
        request_id = next(self._ids)
        data = self._encode(request_dict(request_id, method, params))
        self._pending.add(request_id)
        if method == messages.HELLO:
            self._hello_id = request_id
            self._state = _HELLO_SENT
        return request_id, data

    def send_notification(self, method: str, params: Any = None) -> bytes:
        """A notification's bytes; raises like :meth:`send_request`."""
        self._check_can_send(method, "notification")
        return self._encode(notification(method, params))

    def send_encoded(self, note: EncodedNotification) -> bytes:
        """The bytes of a notification encoded once for many connections (:func:`encode_notification`);
        checked and raising like :meth:`send_notification`, without encoding it again."""
        self._check_can_send(note.method, "notification")
        if len(note.data) - 1 > self.max_frame_bytes:
            raise FrameTooLarge(self.max_frame_bytes)
        return note.data

    def send_cancel(self, request_id: RequestId) -> bytes | None:
        """Stop waiting for ``request_id`` and return the ``cancel`` to send.

        ``None`` when there is nothing to cancel: its response came already, or the
        connection cannot carry it. A response that still arrives is dropped.
        """
        if request_id not in self._pending:
            return None
        self._pending.discard(request_id)
        if self._state != _OPEN:
            return None
        return self.send_notification(messages.CANCEL, {"id": request_id})

    def forget(self, request_id: RequestId) -> None:
        """Stop waiting for ``request_id`` without telling the peer (its response is dropped)."""
        self._pending.discard(request_id)

    def _answer(self, request_id: RequestId) -> None:
        if request_id not in self._inbound:
            raise LocalProtocolError(f"no request {request_id!r} of the peer is waiting for an answer")
        if self._state == _ERROR:
            raise LocalProtocolError("the connection must close after a protocol error")

    def send_response(self, request_id: RequestId, result: Any = None) -> bytes:
        """The success response to an inbound request.

        Answering the server's ``hello`` completes the handshake (the peer's role becomes
        the one hello asked for, which the server checked). Raises
        :class:`FrameTooLarge` (the request stays unanswered: send an error instead) or
        :class:`LocalProtocolError` for an id nobody asked.
        """
        self._answer(request_id)
        if request_id == self._hello_id and self._state == _HELLO_RECEIVED and self._hello_role is None:
            raise LocalProtocolError("hello asked for no valid role; refuse it")
        data = self._encode(result_response(request_id, result))
        self._inbound.discard(request_id)
        if request_id == self._hello_id and self._state == _HELLO_RECEIVED:
            self._state = _OPEN
            self._peer_role = self._hello_role
        return data

    def send_error(self, request_id: RequestId, error: RelayError) -> bytes:
        """The error response to an inbound request; refusing ``hello`` means the connection must close."""
        self._answer(request_id)
        data = self._encode(error_response(request_id, error))
        self._inbound.discard(request_id)
        if request_id == self._hello_id and self._state == _HELLO_RECEIVED:
            self._state = _REFUSED
        return data

    def send_rejection(self, event: RequestRejected) -> bytes:
        """The error response to a request the core rejected (the connection goes on)."""
        if self._state == _ERROR:
            raise LocalProtocolError("the connection must close after a protocol error")
        return self._encode(error_response(event.id, event.error))

    def send_protocol_error(self, err: RemoteProtocolError) -> bytes:
        """The one error object that answers a protocol break; then close the connection."""
        self._state = _ERROR
        self._error = self._error or err
        return encode(error_response(err.request_id, RelayError(err.code, err.message, err.data)))
