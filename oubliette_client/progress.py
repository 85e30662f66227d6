"""Progress for one waiting agent call: heartbeats and forwarded reports on the agent's `progressToken`.

An MCP host resets its idle timer on each `notifications/progress` for a call's token (Claude
Code: 30 min on stdio), so a call that waits for a decision or a slow caller must keep sending
them. One task per call (`run`) sends everything, so the values are strictly increasing and
nothing is sent once the call has its response (the task is cancelled before the response is
returned). Heartbeats come at most every `interval` seconds and advance the last value by 1;
a report from the caller or a toolset (the relay's `progress` notification) is forwarded with
its own value and total when that value is above the last one sent, otherwise as the last value
plus 1 with its message (and no total, which it could exceed).
"""

from __future__ import annotations

import itertools
import logging
from typing import Awaitable, Callable, Protocol

import attrs
import trio

log = logging.getLogger("oubliette.client.progress")

#: Seconds between heartbeats while a call waits (`--progress-interval`, `OUBLIETTE_PROGRESS_INTERVAL`).
DEFAULT_PROGRESS_INTERVAL = 15.0

#: Sends one `notifications/progress` for the call's token: (progress, total, message).
SendProgress = Callable[[float, "float | None", "str | None"], Awaitable[None]]

_refs = itertools.count(1)


def new_progress_ref() -> str:
    """A `progress_ref` no other call of this process carries: the server's reports on a call name it."""
    return f"p-{next(_refs)}"


class ProgressSink(Protocol):
    """Where the relay's progress reports on one call go (`SandboxTools.call`): `report` never waits."""

    ref: str

    def report(self, progress: float, total: float | None = None, message: str | None = None) -> None:
        """Take one report on the call (called in the relay connection's task; must not block)."""


@attrs.frozen
class _Report:
    progress: float
    total: float | None
    message: str | None


class AgentProgress:
    """The progress notifications of one agent call.

    Owns: nothing but a small queue of reports; `run` (start it in the call's nursery) is the
    only sender. `report` never waits: a report that finds the queue full is dropped (the next
    one or a heartbeat still tells the agent the call is alive).
    Cancellation: cancelling `run` stops all sending; a notification is either sent whole or not at all.
    """

    def __init__(self, send: SendProgress, interval: float = DEFAULT_PROGRESS_INTERVAL, waiting_for: str = "") -> None:
        self.ref = new_progress_ref()
        """The `progress_ref` the relay request carries, so the server's reports reach this call."""
        self._send = send
        self.interval = interval
        self.waiting_for = waiting_for
        self.last = 0.0
        self.sent = 0
        self._in, self._out = trio.open_memory_channel[_Report](16)

    def report(self, progress: float, total: float | None = None, message: str | None = None) -> None:
        """Queue a report from the caller or a toolset (never waits)."""
        try:
            self._in.send_nowait(_Report(progress, total, message))
        except trio.WouldBlock:
            log.debug("progress report for %s dropped: the agent is not keeping up", self.ref)

    async def run(self) -> None:
        """Send heartbeats and queued reports until cancelled."""
        while True:
            report = None
            with trio.move_on_after(self.interval):
                report = await self._out.receive()
            if report is None:
                await self._emit(self.last + 1, None, self.waiting_for or None)
            else:
                await self._forward(report)

    async def drain(self) -> None:
        """Send the reports still queued (the call answered right after them); call it once `run` has stopped."""
        while True:
            try:
                report = self._out.receive_nowait()
            except trio.WouldBlock:
                return
            await self._forward(report)

    async def _forward(self, report: _Report) -> None:
        if report.progress > self.last:
            await self._emit(report.progress, report.total, report.message)
        else:  # strictly increasing for the agent; no total, which this value could exceed
            await self._emit(self.last + 1, None, report.message)

    async def _emit(self, value: float, total: float | None, message: str | None) -> None:
        self.last = value
        self.sent += 1
        try:
            await self._send(value, total, message)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            log.debug("progress for %s not sent: %s", self.ref, exc)
