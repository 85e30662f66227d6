"""The relay methods of a guest connection: `append_frame` (request) and `ack` (notification)."""

from __future__ import annotations

from protocol import RelayError, errors, messages
from protocol.frames import TURN_END_TYPES, FrameType, frame_type_problem
from protocol.session_keys import check_session, shown

from ...core.frame_log import AppendFrame as Append
from ...core.server_owned import refuse_server_owned
from ...core.sessions import Session, SessionRegistry, session_has_frames
from ...store.api import FrameStoreAPI, check_resend
from .delivery import GuestDelivery, GuestPeer

GUEST_FRAME_TYPES = frozenset({FrameType.ASSISTANT_DELTA, FrameType.STATUS_PRESENCE, *TURN_END_TYPES})



class GuestFrames:
    """Stores what a guest reports about its turns; refuses what only the server states (server_owned.py).

    A guest appends to the sessions of its instance that the server knows (held in memory, or
    with frames in the log: the ones it was sent messages in); it cannot open a session, so it
    cannot fill the server's memory with sessions (docs/SECURITY.md, "Session keys at every door").

    Needs: the session registry, the frame log's `append`, guest delivery (for acks), and the
    store (is a forgotten session in the log?).
    A frame sent with an `append_id` is stored once however often the guest resends it (to this
    server or another sharing the store, docs/TETHER.md "Exactly-once appends"): a resend is
    answered with the stored frame's seq and msg_id, also a resent turn end; an id sent again with
    another frame is refused (`AppendIdReused`, -32602 naming the id), nothing stored.

    Raises: `RelayError(INVALID_PARAMS)` for a frame type or payload key a guest may not append,
    a session key outside the grammar (protocol/session_keys.py), a malformed `append_id` or one
    used before for another frame;
    `RelayError(NOT_FOUND)` for a session the server does not know.
    """

    def __init__(
        self, sessions: SessionRegistry, append: Append, delivery: GuestDelivery, store: FrameStoreAPI,
    ) -> None:
        self.sessions = sessions
        self.append = append
        self.delivery = delivery
        self.store = store

    async def append_frame(self, connection: GuestPeer, request: messages.AppendFrame) -> messages.AppendFrameResult:
        """The `append_frame` relay method: store a frame the guest reports about a turn.

        Raises: `RelayError(INVALID_PARAMS)` for a bad session key, a type or payload key only the
        server writes (`refuse_server_owned`, the rule of every door) or another type a guest may not
        append, before any turn is touched; `RelayError(NOT_FOUND)` for an unknown session; the frame
        log's refusals (limits) as they are. Nothing is stored then. A resend of a frame stored with
        its `append_id` is answered with that frame (`FrameLog.append`), nothing stored again.
        """
        check_session(request.session.channel, request.session.id)
        if request.append_id is not None and not messages.is_append_id(request.append_id):
            raise RelayError(
                errors.INVALID_PARAMS, "append_id must be 1-64 characters of A-Z a-z 0-9 _ - (chosen once per frame)",
            )
        problem = frame_type_problem(request.type)
        if problem is not None:
            raise RelayError(errors.INVALID_PARAMS, problem)
        refuse_server_owned(request.type, request.payload)
        if request.type not in GUEST_FRAME_TYPES:
            raise RelayError(
                errors.INVALID_PARAMS,
                f"a guest may append {', '.join(sorted(GUEST_FRAME_TYPES))}; not {shown(request.type)}",
            )
        assert connection.instance is not None
        session = await self._known_session(connection.instance, request.session.channel, request.session.id)
        ends_turn = request.type in TURN_END_TYPES and request.reply_to is not None
        if ends_turn:
            assert request.reply_to is not None
            if not await self.delivery.turn_ended(connection, request.reply_to):
                resent = await self._stored_before(connection.instance, request)
                if resent is not None:
                    return resent  # this end was stored: the turn ended with it
                raise RelayError(
                    errors.INVALID_REQUEST,
                    f"the turn of message {request.reply_to!r} has ended already (a turn ends once; the server "
                    "ends it with session.error when its guest disconnects mid-turn)",
                )
        elif request.reply_to is not None:
            self.delivery.turn_started(connection, request.reply_to)
        try:
            frame = await self.append(
                session, request.type, request.payload, reply_to=request.reply_to, append_id=request.append_id,
            )
        finally:
            if ends_turn:
                assert request.reply_to is not None
                self.delivery.turn_end_stored(connection, request.reply_to)
        return messages.AppendFrameResult(seq=frame.seq, msg_id=frame.msg_id)

    async def _stored_before(self, instance: str, request: messages.AppendFrame) -> messages.AppendFrameResult | None:
        """Where the frame of the request's `append_id` landed, if the log has it (a resent turn end);
        `AppendIdReused` if the id's frame is another frame (`check_resend`, as `append_once`)."""
        if request.append_id is None:
            return None
        frame = await self.store.frame_of_append_id(instance, request.append_id)
        if frame is None:
            return None
        check_resend(
            frame, request.append_id, request.session.channel, request.session.id, request.type, request.payload,
            request.reply_to,
        )
        return messages.AppendFrameResult(seq=frame.seq, msg_id=frame.msg_id)

    async def _known_session(self, instance: str, channel: str, session_id: str) -> Session:
        """The session if the server holds it or its log has frames of it (made again after it was
        forgotten); else `NOT_FOUND`."""
        session = self.sessions.get(instance, channel, session_id)
        if session is not None:
            return session
        if not await session_has_frames(self.store, instance, channel, session_id):
            raise RelayError(
                errors.NOT_FOUND,
                f"unknown session '{channel}:{session_id}' of instance '{instance}': a guest appends to the "
                "sessions it was sent messages in; it cannot open one",
            )
        return self.sessions.get_or_create(instance, channel, session_id)

    async def ack(self, connection: GuestPeer, ack: messages.Ack) -> None:
        """The `ack` relay notification: move the guest's delivery cursor (see `GuestDelivery.acknowledge`)."""
        await self.delivery.acknowledge(connection, ack.seq)
