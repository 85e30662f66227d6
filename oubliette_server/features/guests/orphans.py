"""Orphaned turns: a guest that goes away mid-turn leaves its callers an answer, not a silence.

When a guest connection closes, every message it was given and had not answered
gets a `session.error` frame (reason `guest_disconnected`) replying to it, so a
`session_message` waiting on that turn returns `stop_reason: "error"` at once and
the message is not run again by the next guest. A turn that ended meanwhile (the store
refuses a second end: `TurnEnded`) is left as it ended; and with a shared store, a server
whose instance another server took over ends none: that server delivers the messages of
those turns to its own guest (they were never acknowledged), which ends them.
"""

from __future__ import annotations

import logging

import trio

from protocol.frames import FrameType

from ...core.frame_log import AppendFrame as Append
from ...core.sessions import SessionRegistry
from ...store.api import StoreUnavailable, TurnEnded
from .delivery import GuestDelivery, GuestPeer

log = logging.getLogger("oubliette.server.guests")

GUEST_GONE_REASON = "guest_disconnected"
GUEST_GONE_MESSAGE = "the guest disconnected mid-turn"



class OrphanedTurns:
    """Ends the turns in flight of a guest that went away.

    Owns: a nursery (start it with `await nursery.start(orphans.serve)`) holding one short task
    per closed guest connection. Needs: guest delivery (which knows the turns in flight), the
    session registry and the frame log's `append`.
    """

    def __init__(self, delivery: GuestDelivery, sessions: SessionRegistry, append: Append) -> None:
        self.delivery = delivery
        self.sessions = sessions
        self.append = append
        self._nursery: trio.Nursery | None = None

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold the nursery until cancelled."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            # The server is shutting down: guests that close after this are not orphaning turns
            # we could still end (there is nobody left to append for them).
            self._nursery = None

    def guest_gone(self, connection: GuestPeer) -> None:
        """Called when a guest connection closes (synchronously, from its connection's teardown)."""
        orphans = self.delivery.orphaned_turns(connection)
        if not orphans or connection.instance is None:
            return
        if self._nursery is None:
            log.info("server stopping: %d turn(s) of %s left open by its guest", len(orphans), connection.instance)
            return
        self._nursery.start_soon(self._close, connection.instance, orphans)

    async def _close(self, instance: str, orphans: list[tuple[str, str, str]]) -> None:
        try:
            if not await self.delivery.still_holds(instance):
                log.warning("the guest of %s left mid-turn; another server holds the instance now and runs "
                            "its %d turn(s)", instance, len(orphans))
                return
            for msg_id, channel, session_id in orphans:
                session = self.sessions.get_or_create(instance, channel, session_id)
                try:
                    await self.append(
                        session, FrameType.SESSION_ERROR,
                        {"message": GUEST_GONE_MESSAGE, "reason": GUEST_GONE_REASON}, reply_to=msg_id,
                    )
                except TurnEnded:
                    log.info("turn %s of %s had ended already; its end stands", msg_id, instance)
                except StoreUnavailable as exc:  # a database outage must not take the server down
                    log.error("could not end turn %s of %s with session.error: %s", msg_id, instance, exc)
            log.warning("the guest of %s disconnected mid-turn; ended %d turn(s) with session.error", instance, len(orphans))
        finally:
            self.delivery.orphans_closed(instance, [msg_id for msg_id, _, _ in orphans])
