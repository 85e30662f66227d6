"""A nursery a long-lived service runs its children in, open only while the service serves.

Callers' event senders, shared MCP toolsets and start commands are started from
synchronous code (a caller connecting, a message arriving); they need a nursery
that outlives the call that starts them and closes with the server. Work handed
to the host before `serve` opens its nursery waits there and starts with it, so
nothing a service is asked to do before the server serves is lost.
"""

from __future__ import annotations

import functools
from typing import Any, Awaitable, Callable

import trio


class TaskHost:
    """Holds a nursery for as long as `serve` runs; `start_soon` runs work in it.

    Owns: the nursery and every task started in it (cancelled when `serve` is cancelled), and
    the work queued before `serve` (started in order when it opens).
    Needs: `await nursery.start(host.serve)` in the server's nursery.
    """

    def __init__(self) -> None:
        self.nursery: trio.Nursery | None = None
        """The open nursery while serving; None before `serve` and once it stops."""
        self._queued: list[Callable[[], Awaitable[Any]]] | None = []
        """Work asked for before `serve`; None once `serve` has started (nothing queues after)."""

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Open the nursery, start the queued work, report started, and hold it until cancelled."""
        async with trio.open_nursery() as nursery:
            queued, self._queued = self._queued or [], None
            self.nursery = nursery
            for work in queued:
                nursery.start_soon(work)
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self.nursery = None  # stopping: nothing new starts while the children end

    def start_soon(self, function: Callable[..., Awaitable[Any]], *args: Any) -> bool:
        """Run `function(*args)` in the host's nursery: now while serving, when `serve` starts if
        it has not yet. Returns False, running nothing, once the host has stopped (or is
        stopping): the server is going away and its work would be cancelled at once."""
        if self.nursery is not None:
            self.nursery.start_soon(function, *args)
            return True
        if self._queued is not None:
            self._queued.append(functools.partial(function, *args))
            return True
        return False

    @property
    def stopped(self) -> bool:
        """Whether `serve` has started and is no longer running (stopping, or stopped)."""
        return self.nursery is None and self._queued is None
