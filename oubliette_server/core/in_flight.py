"""Requests being answered now, counted so that a graceful stop can wait for them (bounded).

The relay connections count their requests here and the HTTP listeners theirs
(`http_api.CountRequests`); `OublietteServer.drain` waits for both to reach none before
the server is cancelled, as SIGTERM and a stdio hang-up do.
"""

from __future__ import annotations

import trio


class InFlight:
    """How many requests are being answered, and a wait for the moment none is.

    Owns: the count and its event. Needs: `started` and `finished` called once each per request.
    """

    def __init__(self) -> None:
        self.count = 0
        self._none = trio.Event()
        self._none.set()

    def started(self) -> None:
        """One more request is being answered."""
        if self.count == 0:
            self._none = trio.Event()
        self.count += 1

    def finished(self) -> None:
        """A request was answered (or ended); at none in flight, `wait_none` returns."""
        self.count -= 1
        if self.count == 0:
            self._none.set()

    async def wait_none(self) -> None:
        """Return once no request is in flight (at once if none is)."""
        await self._none.wait()
