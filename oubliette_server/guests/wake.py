"""Wake on message: start an instance's guest when a message arrives and it is not connected.

An instance may have a start command in the server's configuration (e.g.
`docker start box1`, or locally a command that starts `oubliette-client run`).
When a `user.message` is appended for an instance whose guest is not
connected, the command runs once; further messages do not start it again
while that start is in progress (until the guest connects, the command fails,
or `start_grace` seconds pass). The messages wait in the frame log and are
delivered when the guest connects. The command gets `OUBLIETTE_INSTANCE`,
`OUBLIETTE_TOKEN` and `OUBLIETTE_RELAY` in its environment.
"""

from __future__ import annotations

import logging
import os
import subprocess
from typing import Awaitable, Callable

import trio
from ..task_host import TaskHost

log = logging.getLogger("oubliette.server.wake")

DEFAULT_START_GRACE = 60.0


class InstanceStarter:
    """Runs an instance's start command when a message arrives and its guest is not connected.

    Owns: a nursery (start it with `await nursery.start(starter.serve)`) holding the start
    commands it runs; cancelling it terminates them. Needs: `start_command(instance)` from the
    config, `token_for(instance)`, the relay address handed to the command, and
    `is_connected(instance)`; `on_start_failed(instance, reason)` hears of every failed start.
    A start is given `start_grace` seconds to connect its guest: past that deadline the command
    is terminated, the log says so, and a new message may start the instance again.
    """

    def __init__(
        self,
        start_command: Callable[[str], list[str] | None],
        token_for: Callable[[str], str],
        relay_address: str,
        is_connected: Callable[[str], bool],
        start_grace: float = DEFAULT_START_GRACE,
        on_start_failed: Callable[[str, str], object] = lambda instance, reason: None,
    ) -> None:
        self._start_command = start_command
        self._token_for = token_for
        self._relay_address = relay_address
        self._is_connected = is_connected
        self.start_grace = start_grace
        self._on_start_failed = on_start_failed
        self._tasks = TaskHost()
        self._starting: dict[str, float] = {}
        self._connected: dict[str, trio.Event] = {}
        self.starts: dict[str, int] = {}
        """How many times each instance's start command ran (for status and tests)."""

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold the start commands' nursery until cancelled."""
        await self._tasks.serve(task_status=task_status)

    def guest_connected(self, instance: str) -> None:
        """The instance's guest connected: its start is over, and the start's deadline watch stops."""
        self._starting.pop(instance, None)
        event = self._connected.pop(instance, None)
        if event is not None:
            event.set()

    def wake(self, instance: str) -> bool:
        """Start the instance's guest if it has a start command and is not up; True if started."""
        command = self._start_command(instance)
        if not command or self._is_connected(instance):
            return False
        since = self._starting.get(instance)
        if since is not None and trio.current_time() - since < self.start_grace:
            return False
        nursery = self._tasks.nursery
        if nursery is None:
            return False
        started = self._starting[instance] = trio.current_time()
        connected = self._connected[instance] = trio.Event()
        self.starts[instance] = self.starts.get(instance, 0) + 1
        nursery.start_soon(self._run, instance, command, started, connected)
        return True

    def wake_if(self, instance: str, needed: Callable[[str], Awaitable[bool]]) -> None:
        """`wake` the instance if it has a start command and `await needed(instance)` says so.

        Why: a sync hook (a connection that closed) cannot read the store; the check runs as a
        task of this service's nursery, and only for instances that have a start command.
        """
        nursery = self._tasks.nursery
        if nursery is None or not self._start_command(instance):
            return

        async def check() -> None:
            try:
                if await needed(instance):
                    self.wake(instance)
            except Exception:  # the store failed: the next message wakes the instance anyway
                log.exception("could not check whether instance %r has undelivered messages", instance)

        nursery.start_soon(check)

    def _start_failed(self, instance: str, started: float) -> None:
        """Allow a new start, unless a later start (begun after this one's guest dropped) is in progress."""
        if self._starting.get(instance) == started:
            del self._starting[instance]

    async def _run(self, instance: str, command: list[str], started: float, connected: trio.Event) -> None:
        """Run the start command; past the deadline with no guest connected, stop it and say so."""
        missed = False
        async with trio.open_nursery() as nursery:

            async def deadline() -> None:
                nonlocal missed
                with trio.move_on_after(self.start_grace):
                    await connected.wait()
                    return
                missed = True
                nursery.cancel_scope.cancel()  # terminates the command if it is still running

            nursery.start_soon(deadline)
            await self._run_command(instance, command, started)
            if self._starting.get(instance) != started:
                nursery.cancel_scope.cancel()  # it failed, or the guest is up: nothing left to watch
        if missed:
            reason = f"the guest of {instance} did not connect within {self.start_grace:g} s of its start command"
            log.error("%s; stopped the command (the next message starts it again)", reason)
            self._start_failed(instance, started)
            self._on_start_failed(instance, reason)

    async def _run_command(self, instance: str, command: list[str], started: float) -> None:
        env = {
            **os.environ,
            "OUBLIETTE_INSTANCE": instance,
            "OUBLIETTE_TOKEN": self._token_for(instance),
            "OUBLIETTE_RELAY": self._relay_address,
        }
        log.info("waking %s: %s", instance, " ".join(command))
        try:
            result = await trio.run_process(
                command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, check=False,
            )
        except OSError as exc:
            log.error("cannot run the start command of %s: %s", instance, exc)
            self._start_failed(instance, started)
            self._on_start_failed(instance, f"cannot run the start command of {instance}: {exc}")
            return
        if result.returncode != 0:
            log.error("start command of %s exited with status %d (its stderr is this server's)", instance, result.returncode)
            self._start_failed(instance, started)
            self._on_start_failed(instance, f"the start command of {instance} exited with status {result.returncode}")
