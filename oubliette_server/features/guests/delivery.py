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
from typing import Any, Awaitable, Callable, Protocol

import trio

from protocol import Frame, RelayError, messages
from protocol.frames import TURN_END_TYPES, FrameType

from ...store.api import CursorPruned, FrameQuery, FrameStoreAPI, StoreUnavailable

log = logging.getLogger("oubliette.server.guests")

GUEST_CURSOR = "guest.delivered"
DELIVERY_BATCH = 200
#: Backoff (first, longest; seconds) of a delivery loop whose store is unavailable (a database outage).
STORE_RETRY = (0.2, 5.0)

#: `(instance, frame, reason)`: record that a frame could not be delivered (ends its turn).
Undeliverable = Callable[[str, Frame, str], Awaitable[object]]
#: `holds(instance)`: whether this server still holds the instance (its lease, PostgreSQL store).
Holds = Callable[[str], Awaitable[bool]]


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

    def close_soon(self) -> None:
        """End the connection (another connection, possibly on another server, took its place)."""

    def close_after_answer(self, reason: str) -> None:
        """End the connection once the answer to the request being served is written."""


class GuestDelivery:
    """Tracks the one guest connection of each instance and feeds it messages.

    Needs: the frame store (messages and the durable `guest.delivered` cursor), and
    `on_undeliverable(instance, frame, reason)` that ends the turn of a frame that cannot be sent;
    with a shared store, `holds(instance)` (the instance lease, cluster/leases.py), asked before
    each batch is sent, so a server whose instance another server took over sends nothing more.
    `deliver(connection)` runs for as long as the connection serves; cancelling it leaves the
    cursor at the last acknowledged seq, so nothing is lost.
    """

    def __init__(self, store: FrameStoreAPI, on_undeliverable: Undeliverable = _log_only, holds: Holds | None = None) -> None:
        self.store = store
        self.on_undeliverable = on_undeliverable
        self.holds = holds
        self._guests: dict[str, GuestPeer] = {}
        self._in_flight: dict[GuestPeer, dict[str, tuple[str, str, bool]]] = {}
        """Per guest connection: msg_id -> (channel, session_id, started) of its delivered, unanswered messages."""
        self._ended: dict[str, set[str]] = {}
        """Per instance: the msg_ids of orphaned turns whose `session.error` is being stored (not delivered again)."""
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

    def turn_started(self, connection: GuestPeer, msg_id: str) -> None:
        """The guest appended a frame replying to `msg_id`: that turn runs (an orphan if the guest goes)."""
        turns = self._in_flight.get(connection)
        if turns is not None and msg_id in turns:
            channel, session_id, _ = turns[msg_id]
            turns[msg_id] = (channel, session_id, True)

    def turn_over(self, msg_id: str) -> None:
        """The turn of `msg_id` has its end in the log (stored now, or before: `TurnEnded`): it is
        no turn in flight any more, and no orphan when its guest goes."""
        for turns in self._in_flight.values():
            turns.pop(msg_id, None)

    async def still_holds(self, instance: str) -> bool:
        """Whether this server may serve `instance`'s guest: always alone on its log; with a shared
        store, while no other server took its lease over (`holds`)."""
        return self.holds is None or await self.holds(instance)

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

    async def acknowledge(self, connection: GuestPeer, seq: int) -> None:
        """Move the guest's cursor forward to `seq`; an ack past the end of the log is refused.

        An ack beyond the instance's last `seq` names frames that do not exist yet: storing
        it would skip the next messages, which the guest has never seen. Such an ack (and a
        `seq` no store could hold) is ignored with a warning; the connection stays up.
        """
        assert connection.instance is not None
        store = self.store
        last = await store.last_seq(connection.instance)
        if not 0 <= seq <= last:
            log.warning(
                "%r: ignoring ack of seq %d: the last seq of instance %r is %d",
                connection, seq, connection.instance, last,
            )
            return
        # One statement: two acks racing (or two servers) never move the cursor back.
        await store.advance_cursor(connection.instance, GUEST_CURSOR, seq)

    async def has_undelivered(self, instance: str) -> bool:
        """Whether a `user.message` after the guest's acknowledged cursor is waiting."""
        cursor = await self.store.get_cursor(instance, GUEST_CURSOR)
        query = FrameQuery(after_seq=cursor, types=(FrameType.USER_MESSAGE,), limit=1)
        try:
            return bool(await self.store.query(instance, query))
        except CursorPruned:
            return True

    async def waiting_messages(self, instance: str) -> list[Frame]:
        """The `user.message` frames after the guest's acknowledged cursor whose turn has not ended
        (the first `DELIVERY_BATCH`): what a guest that connected now would run."""
        cursor = await self.store.get_cursor(instance, GUEST_CURSOR)
        query = FrameQuery(after_seq=cursor, types=(FrameType.USER_MESSAGE,), limit=DELIVERY_BATCH)
        try:
            frames = await self.store.query(instance, query)
        except CursorPruned as exc:
            frames = await self.store.query(instance, FrameQuery(
                after_seq=exc.first_seq - 1, types=(FrameType.USER_MESSAGE,), limit=DELIVERY_BATCH,
            ))
        return [frame for frame in frames if not await self._answered(instance, frame.msg_id)]

    async def _answered(self, instance: str, msg_id: str) -> bool:
        """A turn that ended but whose acknowledgement was lost (the guest died right after) is not rerun."""
        if msg_id in self._ended.get(instance, ()):
            return True
        try:
            return bool(await self.store.query(instance, FrameQuery(types=TURN_END_TYPES, reply_to=msg_id, limit=1)))
        except CursorPruned as exc:  # retention deleted the oldest frames: search what it kept
            return bool(await self.store.query(instance, FrameQuery(
                after_seq=exc.first_seq - 1, types=TURN_END_TYPES, reply_to=msg_id, limit=1)))

    async def deliver(self, connection: GuestPeer) -> None:
        """Push every unacknowledged and every new `user.message` to the guest."""
        assert connection.instance is not None
        instance = connection.instance
        store = self.store
        cursor: int | None = None
        in_flight = self._in_flight.setdefault(connection, {})
        backoff = STORE_RETRY[0]
        while True:
            try:
                if cursor is None:
                    cursor = await store.get_cursor(instance, GUEST_CURSOR)
                query = FrameQuery(after_seq=cursor, types=(FrameType.USER_MESSAGE,), limit=DELIVERY_BATCH)
                try:
                    frames, _ = await store.wait_for_frames(instance, query, timeout=math.inf)
                except CursorPruned as exc:
                    log.warning("guest of %s: %s; delivering from there", instance, exc)
                    cursor = exc.first_seq - 1
                    continue
                if not await self.still_holds(instance):
                    # Another server took the instance over (its guest reconnected there): it
                    # delivers from the acknowledged cursor; sending here could run a turn twice.
                    log.warning("guest of %s: another server holds the instance now; closing %r", instance, connection)
                    connection.close_soon()
                    return
                for frame in frames:
                    if not await self._answered(instance, frame.msg_id):
                        in_flight[frame.msg_id] = (frame.channel, frame.session_id, False)
                        await self._send(connection, instance, frame)
                    cursor = frame.seq
                backoff = STORE_RETRY[0]
            except StoreUnavailable as exc:
                # The database is down (PostgreSQL store): keep the guest, try again with backoff;
                # the cursor in memory says where delivery stands.
                log.warning("guest of %s: %s; retrying delivery in %.1f s", instance, exc, backoff)
                await trio.sleep(backoff)
                backoff = min(backoff * 2, STORE_RETRY[1])

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
