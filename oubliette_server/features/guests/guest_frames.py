"""The relay methods of a guest connection: `append_frame` (request) and `ack` (notification)."""

from __future__ import annotations

from protocol import RelayError, errors, messages
from protocol.frames import TURN_END_TYPES, FrameType, frame_type_problem
from protocol.session_keys import check_session, shown

from ...core.frame_log import AppendFrame as Append
from ...core.server_owned import refuse_server_owned
from ...core.sessions import Session, SessionRegistry, session_has_frames
from ...store.api import FrameStoreAPI, TurnEnded
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
    another frame is refused (`AppendIdReused`, -32602 naming the id), nothing stored. A turn ends once: a
    second end is refused by the store (`TurnEnded`, docs/SECURITY.md "One turn end per message").
    With a shared store, a frame of a turn from the guest of an instance another server took over
    is refused and the guest closed: that server's guest runs the turn now.

    Raises: `RelayError(INVALID_PARAMS)` for a frame type or payload key a guest may not append,
    a session key outside the grammar (protocol/session_keys.py), a malformed `append_id` or one
    used before for another frame;
    `RelayError(NOT_FOUND)` for a session the server does not know; `RelayError(INVALID_REQUEST)`
    for a second end of a turn, or a frame of a turn of an instance this server no longer holds.
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
        ends = request.reply_to if request.type in TURN_END_TYPES else None  # the message whose turn this ends
        if request.reply_to is not None:
            await self._refuse_if_taken_over(connection)
            if ends is None:
                self.delivery.turn_started(connection, request.reply_to)
        try:
            frame = await self.append(
                session, request.type, request.payload, reply_to=request.reply_to, append_id=request.append_id,
            )
        except TurnEnded as ended:  # (a resend with the end's append_id gets the stored end from `append`)
            self.delivery.turn_over(ended.end.reply_to or "")
            raise RelayError(
                errors.INVALID_REQUEST,
                f"{ended.message} (the server ends a turn with session.error when its guest disconnects mid-turn, "
                "or its start fails)",
            ) from None
        if ends is not None:
            # Only once the end is stored: an end cut short (the guest left mid-append) leaves an orphan.
            self.delivery.turn_over(ends)
        return messages.AppendFrameResult(seq=frame.seq, msg_id=frame.msg_id)

    async def _refuse_if_taken_over(self, connection: GuestPeer) -> None:
        """A frame of a turn from a guest whose instance another server took over (its lease,
        shared store): refused, and the connection closed once the guest has read why. That
        server delivers the turn's message to its own guest, which ends it there."""
        assert connection.instance is not None
        if await self.delivery.still_holds(connection.instance):
            return
        why = (
            f"this server no longer holds instance {connection.instance!r}: another server took it over (a guest "
            "connected there), and its guest runs the turns now; nothing was stored"
        )
        connection.close_after_answer(why)
        raise RelayError(errors.INVALID_REQUEST, why)

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
