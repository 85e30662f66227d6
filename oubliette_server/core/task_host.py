"""A nursery a long-lived service runs its children in, open only while the service serves.

Callers' event senders, shared MCP toolsets and start commands are started from
synchronous code (a caller connecting, a message arriving); they need a nursery
that outlives the call that starts them and closes with the server.
"""

from __future__ import annotations

import trio


class TaskHost:
    """Holds a nursery for as long as `serve` runs; `nursery` is None before and while stopping.

    Owns: the nursery and every task started in it (cancelled when `serve` is cancelled).
    Needs: `await nursery.start(host.serve)` in the server's nursery.
    """

    def __init__(self) -> None:
        self.nursery: trio.Nursery | None = None

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Open the nursery, report started, and hold it until cancelled."""
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self.nursery = None  # stopping: nothing new starts while the children end
