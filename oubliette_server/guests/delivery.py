"""Delivery of `user.message` frames to an instance's guest runtime.

The server keeps, per instance, a durable cursor: the highest `seq` the guest
has acknowledged. A guest that connects gets every `user.message` after it,
then new ones as they are appended (the store wakes the delivery task). If the
connection drops between delivery and acknowledgement, the frame is delivered
again on reconnect; the guest runtime drops a `seq` it has already seen, so
each message runs once.

A frame that cannot be sent (over the relay line limit, not encodable) is
skipped with a logged reason and a `session.error` for its turn, never retried:
retrying would drop the guest and redeliver the same frame forever. The
ingress limits make this unreachable; it is the safety net.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Awaitable, Callable, Protocol

import trio

from protocol import RelayError, messages

from protocol import Frame

from ..store import CursorPruned, FrameQuery, FrameStore

log = logging.getLogger("oubliette.server.guests")

GUEST_CURSOR = "guest.delivered"
DELIVERY_BATCH = 200
TURN_END_TYPES = ("assistant.done", "session.error")

#: `(instance, frame, reason)`: record that a frame could not be delivered (ends its turn).
Undeliverable = Callable[[str, Frame, str], Awaitable[object]]


async def _log_only(instance: str, frame: Frame, reason: str) -> None:
    pass


class GuestPeer(Protocol):
    """A guest connection, as far as delivery cares."""

    instance: str | None

    async def send_notification(self, method: str, params: dict[str, Any]) -> None:
        """Queue a notification to the guest, waiting for room in the connection's queue.

        Raises: `RelayError` (e.g. `FrameTooLarge`) for a frame that cannot be sent; delivery
        skips that frame.
        """


class GuestDelivery:
    """Tracks the one guest connection of each instance and feeds it messages.

    Needs: the frame store (messages and the durable `guest.delivered` cursor), and
    `on_undeliverable(instance, frame, reason)` that ends the turn of a frame that cannot be sent.
    `deliver(connection)` runs for as long as the connection serves; cancelling it leaves the
    cursor at the last acknowledged seq, so nothing is lost.
    """

    def __init__(self, store: FrameStore, on_undeliverable: Undeliverable = _log_only) -> None:
        self.store = store
        self.on_undeliverable = on_undeliverable
        self._guests: dict[str, GuestPeer] = {}
        self.connected_changed = trio.Event()

    def guest_for(self, instance: str) -> GuestPeer | None:
        """The instance's guest connection, or None when none is connected."""
        return self._guests.get(instance)

    def connected_instances(self) -> list[str]:
        """Instances whose guest is connected, sorted."""
        return sorted(self._guests)

    def attach(self, connection: GuestPeer) -> GuestPeer | None:
        """Make `connection` the instance's guest; return the one it replaces."""
        assert connection.instance is not None
        previous = self._guests.get(connection.instance)
        self._guests[connection.instance] = connection
        self._signal()
        return previous

    def detach(self, connection: GuestPeer) -> None:
        """Forget the connection if it is still the instance's guest (a replaced one is ignored)."""
        if connection.instance and self._guests.get(connection.instance) is connection:
            del self._guests[connection.instance]
            self._signal()

    def _signal(self) -> None:
        self.connected_changed.set()
        self.connected_changed = trio.Event()

    def acknowledge(self, connection: GuestPeer, seq: int) -> None:
        """Move the guest's cursor forward to `seq`; an ack past the end of the log is refused.

        An ack beyond the instance's last `seq` names frames that do not exist yet: storing
        it would skip the next messages, which the guest has never seen. Such an ack (and a
        `seq` no store could hold) is ignored with a warning; the connection stays up.
        """
        assert connection.instance is not None
        store = self.store
        last = store.last_seq(connection.instance)
        if not 0 <= seq <= last:
            log.warning(
                "%r: ignoring ack of seq %d: the last seq of instance %r is %d",
                connection, seq, connection.instance, last,
            )
            return
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
        query = FrameQuery(types=TURN_END_TYPES, reply_to=msg_id, limit=1)
        return bool(self.store.query(instance, query))

    async def deliver(self, connection: GuestPeer) -> None:
        """Push every unacknowledged and every new `user.message` to the guest."""
        assert connection.instance is not None
        instance = connection.instance
        store = self.store
        cursor = store.get_cursor(instance, GUEST_CURSOR)
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
                    await self._send(connection, instance, frame)
                cursor = frame.seq

    async def _send(self, connection: GuestPeer, instance: str, frame: Frame) -> None:
        """Send one frame; one that cannot be sent is reported and skipped, never retried."""
        try:
            await connection.send_notification(messages.USER_MESSAGE, {"frame": frame.to_wire()})
        except (RelayError, ValueError, TypeError, RecursionError) as exc:
            reason = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
            log.error("guest of %s: skipping undeliverable seq %d (%s): %s", instance, frame.seq, frame.msg_id, reason)
            try:
                await self.on_undeliverable(instance, frame, reason)
            except Exception:  # the report is best effort; the delivery loop must go on
                log.exception("guest of %s: could not record that seq %d is undeliverable", instance, frame.seq)
