"""Wake on message: start an instance's guest when a message arrives and it is not connected.

An instance may have a start command in the server's configuration (e.g.
`docker start box1`, or locally a command that starts `oubliette-client run`).
When a `user.message` is appended for an instance whose guest is not
connected, the command runs once; further messages do not start it again
while that start is in progress (until the guest connects, the command fails,
or `start_grace` seconds pass). The messages wait in the frame log and are
delivered when the guest connects. The command gets `OUBLIETTE_INSTANCE`,
`OUBLIETTE_TOKEN` and `OUBLIETTE_RELAY` in its environment.

A start that fails (the command cannot run, exits non-zero before its guest
connected, or no guest connects within `start_grace`) is reported to
`on_start_failed` with the reason a person can act on: the exit status and the
last lines of the command's stderr (each stderr line is also logged here), so
the messages waiting for that start can end with it instead of waiting in silence.
"""

from __future__ import annotations

import logging
import os
import subprocess
from functools import partial
from typing import Awaitable, Callable

import trio

from ...core.task_host import TaskHost

log = logging.getLogger("oubliette.server.wake")

DEFAULT_START_GRACE = 60.0
#: The last lines of a failed start command's stderr that its reason quotes, and their most bytes.
STDERR_TAIL_LINES = 5
STDERR_TAIL_BYTES = 2000
#: Seconds a failed start command's stderr gets to reach its end before its reason is written.
STDERR_DRAIN = 1.0


class InstanceStarter:
    """Runs an instance's start command when a message arrives and its guest is not connected.

    Owns: a nursery (start it with `await nursery.start(starter.serve)`) holding the start
    commands it runs; cancelling it terminates them. Needs: `start_command(instance)` from the
    config, `token_for(instance)`, the relay address handed to the command, and
    `is_connected(instance)`; `on_start_failed(instance, reason)` hears of every failed start
    that was the instance's latest and whose guest never connected (the messages waiting for
    it have nobody else to run them); the reason names the exit status and quotes the last
    lines of the command's stderr. A start is given `start_grace` seconds to connect its guest: past that deadline the command
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
        """Start the instance's guest if it has a start command and is not up; True if started
        (before `serve`: when it starts). False once the server is stopping."""
        command = self._start_command(instance)
        if not command or self._is_connected(instance):
            return False
        since = self._starting.get(instance)
        if since is not None and trio.current_time() - since < self.start_grace:
            return False
        if self._tasks.stopped:
            return False  # the server is stopping: no new guest
        started = self._starting[instance] = trio.current_time()
        connected = self._connected[instance] = trio.Event()
        self.starts[instance] = self.starts.get(instance, 0) + 1
        self._tasks.start_soon(self._run, instance, command, started, connected)  # before `serve`: when it starts
        return True

    def wake_if(self, instance: str, needed: Callable[[str], Awaitable[bool]]) -> None:
        """`wake` the instance if it has a start command and `await needed(instance)` says so.

        Why: a sync hook (a connection that closed) cannot read the store; the check runs as a
        task of this service's nursery, and only for instances that have a start command.
        """
        if not self._start_command(instance):
            return

        async def check() -> None:
            try:
                if await needed(instance):
                    self.wake(instance)
            except Exception:  # the store failed: the next message wakes the instance anyway
                log.exception("could not check whether instance %r has undelivered messages", instance)

        self._tasks.start_soon(check)

    def _start_failed(self, instance: str, started: float, reason: str) -> None:
        """Allow a new start and report the failure, unless its guest connected meanwhile or a later
        start (begun after this one's guest dropped) is in progress: that one still may bring it up."""
        if self._starting.get(instance) == started:
            del self._starting[instance]
            self._on_start_failed(instance, reason)

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
            self._start_failed(instance, started, reason)

    async def _run_command(self, instance: str, command: list[str], started: float) -> None:
        env = {
            **os.environ,
            "OUBLIETTE_INSTANCE": instance,
            "OUBLIETTE_TOKEN": self._token_for(instance),
            "OUBLIETTE_RELAY": self._relay_address,
        }
        log.info("waking %s: %s", instance, " ".join(command))
        stderr = StderrTail()
        failure: OSError | None = None
        async with trio.open_nursery() as nursery:
            try:
                process: trio.Process = await nursery.start(partial(
                    trio.run_process, command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE, check=False,
                ))
            except OSError as exc:
                failure = exc
            else:
                # Read in the service's nursery: a child the command left running (a guest runtime it
                # put in the background) may hold its stderr for as long as it lives.
                if not self._tasks.start_soon(stderr.read, instance, process.stderr):
                    nursery.start_soon(stderr.read, instance, process.stderr)  # stopping: read it here
        if failure is not None:
            log.error("cannot run the start command of %s: %s", instance, failure)
            self._start_failed(instance, started, f"cannot run the start command of {instance}: {failure}")
            return
        code = process.returncode
        if code != 0:
            log.error("start command of %s exited with status %d", instance, code)
            with trio.move_on_after(STDERR_DRAIN):
                await stderr.closed.wait()
            reason = f"the start command of {instance} exited with status {code}"
            tail = stderr.tail()
            self._start_failed(instance, started, f"{reason}; its stderr ends:\n{tail}" if tail else reason)


class StderrTail:
    """A start command's stderr: each line logged here, the last few KiB kept for its failure's reason."""

    def __init__(self) -> None:
        self._data = bytearray()
        self.closed = trio.Event()
        """Set at the end of the stream (every process holding it has closed it)."""

    def tail(self) -> str:
        """The last `STDERR_TAIL_LINES` non-empty lines read so far, at most `STDERR_TAIL_BYTES` of them."""
        lines = [line for line in self._data.decode(errors="replace").splitlines() if line.strip()]
        return "\n".join(lines[-STDERR_TAIL_LINES:])[-STDERR_TAIL_BYTES:]

    async def read(self, instance: str, stream: trio.abc.ReceiveStream | None) -> None:
        """Read `stream` to its end, logging each line."""
        assert stream is not None
        pending = bytearray()
        try:
            async with stream:
                while chunk := await stream.receive_some(65536):
                    self._data.extend(chunk)
                    del self._data[:-STDERR_TAIL_BYTES * 2]
                    pending.extend(chunk)
                    while (end := pending.find(b"\n")) >= 0:
                        log.warning("start command of %s: %s", instance, pending[:end].decode(errors="replace").rstrip())
                        del pending[: end + 1]
                    del pending[:-65536]  # a line without end is cut, not buffered without bound
                if pending:
                    log.warning("start command of %s: %s", instance, pending.decode(errors="replace").rstrip())
        finally:
            self.closed.set()
