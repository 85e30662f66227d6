"""The relay methods of a guest connection: `append_frame` (request) and `ack` (notification)."""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from protocol import RelayError, errors, messages

from ..server_owned import refuse_server_owned
from ..sessions import Session, SessionRegistry
from .delivery import GuestDelivery, GuestPeer

GUEST_FRAME_TYPES = frozenset({"assistant.delta", "assistant.done", "status.presence", "session.error"})
TURN_END_TYPES = frozenset({"assistant.done", "session.error"})

Append = Callable[..., Awaitable[Any]]


class GuestFrames:
    """Stores what a guest reports about its turns; refuses what only the server states (server_owned.py).

    Needs: the session registry, the frame log's `append`, and guest delivery (for acks).
    Raises: `RelayError(INVALID_PARAMS)` for a frame type or payload key a guest may not append.
    """

    def __init__(self, sessions: SessionRegistry, append: Append, delivery: GuestDelivery) -> None:
        self.sessions = sessions
        self.append = append
        self.delivery = delivery

    async def append_frame(self, connection: GuestPeer, request: messages.AppendFrame) -> messages.AppendFrameResult:
        """The `append_frame` relay method: store a frame the guest reports about a turn.

        Raises: `RelayError(INVALID_PARAMS)` for a type or payload key only the server writes
        (`refuse_server_owned`, the rule of every door) or another type a guest may not append,
        before any turn is touched; the frame log's refusals (limits) as they are.
        """
        refuse_server_owned(request.type, request.payload)
        if request.type not in GUEST_FRAME_TYPES:
            raise RelayError(
                errors.INVALID_PARAMS,
                f"a guest may append {', '.join(sorted(GUEST_FRAME_TYPES))}; not {request.type!r}",
            )
        assert connection.instance is not None
        ends_turn = request.type in TURN_END_TYPES and request.reply_to is not None
        if ends_turn:
            assert request.reply_to is not None
            if not await self.delivery.turn_ended(connection, request.reply_to):
                raise RelayError(
                    errors.INVALID_REQUEST,
                    f"the turn of message {request.reply_to!r} has ended already (a turn ends once; the server "
                    "ends it with session.error when its guest disconnects mid-turn)",
                )
        elif request.reply_to is not None:
            self.delivery.turn_started(connection, request.reply_to)
        try:
            session: Session = self.sessions.get_or_create(
                connection.instance, request.session.channel, request.session.id)
            frame = await self.append(session, request.type, request.payload, reply_to=request.reply_to)
        finally:
            if ends_turn:
                assert request.reply_to is not None
                self.delivery.turn_end_stored(connection, request.reply_to)
        return messages.AppendFrameResult(seq=frame.seq, msg_id=frame.msg_id)

    async def ack(self, connection: GuestPeer, ack: messages.Ack) -> None:
        """The `ack` relay notification: move the guest's delivery cursor (see `GuestDelivery.acknowledge`)."""
        await self.delivery.acknowledge(connection, ack.seq)
