"""A failed start ends the turns that waited for it: the caller reads why, not a timeout.

When an instance's start command fails (it cannot run, exits non-zero, or brings up no guest
within `start_timeout`; guests/instance_starter.py), every message waiting for that guest gets a
`session.error` frame (reason `start_failed`) replying to it, carrying the start's reason
(exit status, the last lines of its stderr). A `session_message` waiting on such a turn
returns `stop_reason: "error"` with that text at once; the log, `session_events` and every
server of a shared store read the same answer. As with orphaned turns, an ended message is
not run later by a guest that connects after all (delivery skips answered messages): the
caller sends it again once the start is fixed. A burst of messages may see several starts fail
and overlap in ending the same waiting turns: each turn ends once, the store refusing a second
end (`TurnEnded`), which is skipped here.
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable

import trio

from protocol.frames import FrameType

from ...core.frame_log import AppendFrame as Append
from ...core.sessions import SessionRegistry
from ...core.task_host import TaskHost
from ...store.api import StoreUnavailable, TurnEnded
from .delivery import GuestDelivery

log = logging.getLogger("oubliette.server.guests")

START_FAILED_REASON = "start_failed"



class FailedStarts:
    """Ends with `session.error` the turns of the messages a failed start left waiting.

    Owns: a nursery (start it with `await nursery.start(failed.serve)`) holding one short task
    per failed start. Needs: guest delivery (the messages not yet delivered), the session
    registry, the frame log's `append`, and `connected_anywhere(instance)`: a guest connected
    meanwhile (here, or to another server of a shared store) runs the messages, so none ends.
    """

    def __init__(
        self, delivery: GuestDelivery, sessions: SessionRegistry, append: Append,
        connected_anywhere: Callable[[str], Awaitable[bool]],
    ) -> None:
        self.delivery = delivery
        self.sessions = sessions
        self.append = append
        self.connected_anywhere = connected_anywhere
        self._tasks = TaskHost()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold the nursery until cancelled."""
        await self._tasks.serve(task_status=task_status)

    def start_failed(self, instance: str, reason: str) -> None:
        """The instance's start failed (`InstanceStarter`'s `on_start_failed`): end its waiting turns."""
        self._tasks.start_soon(self._end_waiting, instance, reason)

    async def _end_waiting(self, instance: str, reason: str) -> None:
        ended = 0
        try:
            if await self.connected_anywhere(instance):
                return
            for frame in await self.delivery.waiting_messages(instance):
                session = self.sessions.get_or_create(instance, frame.channel, frame.session_id)
                try:
                    await self.append(
                        session, FrameType.SESSION_ERROR, {"message": reason, "reason": START_FAILED_REASON},
                        reply_to=frame.msg_id,
                    )
                    ended += 1
                except TurnEnded:
                    pass  # another failed start (or the guest) ended it meanwhile
        except StoreUnavailable as exc:  # a database outage must not take the server down
            log.error("could not end the turns waiting for the start of %s: %s", instance, exc)
            return
        if ended:
            log.warning("the start of %s failed; ended %d waiting turn(s) with session.error", instance, ended)
