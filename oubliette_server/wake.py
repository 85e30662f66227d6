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
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from .app import OublietteServer

log = logging.getLogger("oubliette.server.wake")

DEFAULT_START_GRACE = 60.0


class InstanceStarter:
    def __init__(self, server: OublietteServer, start_grace: float = DEFAULT_START_GRACE) -> None:
        self.server = server
        self.start_grace = start_grace
        self._starting: dict[str, float] = {}
        self.starts: dict[str, int] = {}
        """How many times each instance's start command ran (for status and tests)."""

    def guest_connected(self, instance: str) -> None:
        self._starting.pop(instance, None)

    def wake(self, instance: str) -> bool:
        """Start the instance's guest if it has a start command and is not up; True if started."""
        command = self.server.config.start_command(instance)
        if not command or self.server.guests.guest_for(instance) is not None:
            return False
        since = self._starting.get(instance)
        if since is not None and trio.current_time() - since < self.start_grace:
            return False
        nursery = self.server.nursery
        if nursery is None:
            return False
        started = self._starting[instance] = trio.current_time()
        self.starts[instance] = self.starts.get(instance, 0) + 1
        nursery.start_soon(self._run, instance, command, started)
        return True

    def _start_failed(self, instance: str, started: float) -> None:
        """Allow a new start, unless a later start (begun after this one's guest dropped) is in progress."""
        if self._starting.get(instance) == started:
            del self._starting[instance]

    async def _run(self, instance: str, command: list[str], started: float) -> None:
        env = {
            **os.environ,
            "OUBLIETTE_INSTANCE": instance,
            "OUBLIETTE_TOKEN": self.server.tokens.token_for(instance),
            "OUBLIETTE_RELAY": self.server.config.relay_address,
        }
        log.info("waking %s: %s", instance, " ".join(command))
        try:
            result = await trio.run_process(
                command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, check=False,
            )
        except OSError as exc:
            log.error("cannot run the start command of %s: %s", instance, exc)
            self._start_failed(instance, started)
            return
        if result.returncode != 0:
            log.error("start command of %s exited with status %d (its stderr is this server's)", instance, result.returncode)
            self._start_failed(instance, started)
