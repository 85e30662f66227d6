"""Delivery of `user.message` frames to an instance's guest runtime.

The server keeps, per instance, a durable cursor: the highest `seq` the guest
has acknowledged. A guest that connects gets every `user.message` after it,
then new ones as they are appended (the store wakes the delivery task). If the
connection drops between delivery and acknowledgement, the frame is delivered
again on reconnect; the guest runtime drops a `seq` it has already seen, so
each message runs once.

It also knows the turns in flight of each guest connection: messages delivered,
started (the guest appended a frame replying to them, e.g. the runtime's
`status.presence`) and not yet answered by `assistant.done` / `session.error`.
When the guest goes away they are orphans (`guests/orphans.py` ends them with
`session.error`). A message delivered but not started (queued behind another
turn, or never read) is delivered again to the next guest, as before.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Protocol

import trio

from protocol import messages

from ..store import CursorPruned, FrameQuery, FrameStore

log = logging.getLogger("oubliette.server.guests")

GUEST_CURSOR = "guest.delivered"
DELIVERY_BATCH = 200
TURN_END_TYPES = ("assistant.done", "session.error")


class GuestPeer(Protocol):
    """A guest connection, as far as delivery cares."""

    instance: str | None

    async def notify(self, method: str, params: dict[str, Any]) -> None: ...


class GuestDelivery:
    """Tracks the one guest connection of each instance and feeds it messages.

    Needs: the frame store (messages and the durable `guest.delivered` cursor).
    `deliver(connection)` runs for as long as the connection serves; cancelling it leaves the
    cursor at the last acknowledged seq, so nothing is lost.
    """

    def __init__(self, store: FrameStore) -> None:
        self.store = store
        self._guests: dict[str, GuestPeer] = {}
        self._in_flight: dict[GuestPeer, dict[str, tuple[str, str, bool]]] = {}
        """Per guest connection: msg_id -> (channel, session_id, started) of its delivered, unanswered messages."""
        self._ended: dict[str, set[str]] = {}
        self.connected_changed = trio.Event()

    def guest_for(self, instance: str) -> GuestPeer | None:
        return self._guests.get(instance)

    def connected_instances(self) -> list[str]:
        return sorted(self._guests)

    def attach(self, connection: GuestPeer) -> GuestPeer | None:
        """Make `connection` the instance's guest; return the one it replaces."""
        assert connection.instance is not None
        previous = self._guests.get(connection.instance)
        self._guests[connection.instance] = connection
        self._signal()
        return previous

    def detach(self, connection: GuestPeer) -> None:
        if connection.instance and self._guests.get(connection.instance) is connection:
            del self._guests[connection.instance]
            self._signal()

    def turn_started(self, connection: GuestPeer, msg_id: str) -> None:
        """The guest appended a frame replying to `msg_id`: that turn runs (an orphan if the guest goes)."""
        turns = self._in_flight.get(connection)
        if turns is not None and msg_id in turns:
            channel, session_id, _ = turns[msg_id]
            turns[msg_id] = (channel, session_id, True)

    def turn_ended(self, connection: GuestPeer, msg_id: str) -> bool:
        """Record the end of the turn of `msg_id`; False if it had ended already (refuse a second end)."""
        assert connection.instance is not None
        for turns in self._in_flight.values():
            turns.pop(msg_id, None)
        if msg_id in self._ended.get(connection.instance, ()) or self._answered(connection.instance, msg_id):
            return False
        return True

    def orphaned_turns(self, connection: GuestPeer) -> list[tuple[str, str, str]]:
        """The guest is gone: its turns in flight, `(msg_id, channel, session_id)`, now ended by the caller of this.

        A turn that another (newer) guest connection of the instance has in flight is not an
        orphan. The returned turns count as ended at once, so none is delivered again.
        """
        turns = self._in_flight.pop(connection, {})
        elsewhere = {msg_id for other in self._in_flight.values() for msg_id in other}
        orphans = [
            (msg_id, channel, session_id) for msg_id, (channel, session_id, started) in turns.items()
            if started and msg_id not in elsewhere
        ]
        if orphans and connection.instance is not None:
            self._ended.setdefault(connection.instance, set()).update(msg_id for msg_id, _, _ in orphans)
        return orphans

    def orphans_closed(self, instance: str, msg_ids: list[str]) -> None:
        """Their `session.error` frames are stored: the log answers for them from now on."""
        ended = self._ended.get(instance)
        if ended is not None:
            ended.difference_update(msg_ids)
            if not ended:
                del self._ended[instance]

    def _signal(self) -> None:
        self.connected_changed.set()
        self.connected_changed = trio.Event()

    def acknowledge(self, connection: GuestPeer, seq: int) -> None:
        assert connection.instance is not None
        store = self.store
        if seq > store.get_cursor(connection.instance, GUEST_CURSOR):
            store.set_cursor(connection.instance, GUEST_CURSOR, seq)

    def has_undelivered(self, instance: str) -> bool:
        """Whether a `user.message` after the guest's acknowledged cursor is waiting."""
        query = FrameQuery(after_seq=self.store.get_cursor(instance, GUEST_CURSOR), types=("user.message",), limit=1)
        try:
            return bool(self.store.query(instance, query))
        except CursorPruned:
            return True

    def _answered(self, instance: str, msg_id: str) -> bool:
        """A turn that ended but whose acknowledgement was lost (the guest died right after) is not rerun."""
        if msg_id in self._ended.get(instance, ()):
            return True
        query = FrameQuery(types=TURN_END_TYPES, reply_to=msg_id, limit=1)
        return bool(self.store.query(instance, query))

    async def deliver(self, connection: GuestPeer) -> None:
        """Push every unacknowledged and every new `user.message` to the guest."""
        assert connection.instance is not None
        instance = connection.instance
        store = self.store
        cursor = store.get_cursor(instance, GUEST_CURSOR)
        in_flight = self._in_flight.setdefault(connection, {})
        while True:
            query = FrameQuery(after_seq=cursor, types=("user.message",), limit=DELIVERY_BATCH)
            try:
                frames, _ = await store.wait_for_frames(instance, query, timeout=math.inf)
            except CursorPruned as exc:
                log.warning("guest of %s: %s; delivering from there", instance, exc)
                cursor = exc.first_seq - 1
                continue
            for frame in frames:
                if not self._answered(instance, frame.msg_id):
                    in_flight[frame.msg_id] = (frame.channel, frame.session_id, False)
                    await connection.notify(messages.USER_MESSAGE, {"frame": frame.to_wire()})
                cursor = frame.seq
