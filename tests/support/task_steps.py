"""How many times the scheduler runs the current task: a scheduler round trip is one step more.

The hot paths take a free lock and write to a free descriptor in the step they are in; a test
asserts it by counting the steps between two points (`counted_steps`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import trio


class TaskSteps(trio.abc.Instrument):
    """Counts the steps of the task that made it (each is a round trip through the scheduler)."""

    def __init__(self) -> None:
        self.task = trio.lowlevel.current_task()
        self.count = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        """One more step of the watched task."""
        if task is self.task:
            self.count += 1


@contextmanager
def counted_steps() -> Iterator[TaskSteps]:
    """The current task's steps while the block runs (`TaskSteps.count`, 0 for a block that never yields)."""
    steps = TaskSteps()
    trio.lowlevel.add_instrument(steps)
    try:
        yield steps
    finally:
        trio.lowlevel.remove_instrument(steps)
