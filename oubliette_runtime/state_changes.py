"""A wake-up for tasks waiting until some in-process state holds (`StateChanges`).

The owner of the state calls `changed()` after each change; a waiter (a test, most often)
calls `until(predicate)` and sleeps until the predicate holds, instead of checking it on a
timer. With nobody waiting, `changed()` is one attribute test: the owners call it on hot paths.
"""

from __future__ import annotations

from typing import Callable

import trio


class StateChanges:
    """Wakes the tasks in `until` at each `changed()`; holds no event while nobody waits."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event: trio.Event | None = None

    def changed(self) -> None:
        """The state changed: each waiting task looks at its predicate again."""
        event = self._event
        if event is not None:
            self._event = None
            event.set()

    async def until(self, holds: Callable[[], bool]) -> None:
        """Return once `holds()` is true, looked at now and after each `changed()` (no deadline
        of its own: the caller bounds it)."""
        while not holds():
            if self._event is None:
                self._event = trio.Event()
            await self._event.wait()
