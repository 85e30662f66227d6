"""What every pending-request service shares: its book, its crossing, its waits, its tasks.

`CallerCallRegistry` (caller tool requests) and `ApprovalService` (approvals) are both a
`PendingRequests`: they add how a request is made, answered and read from the shared log
(`sync`), and which of their entries are still open (`is_open`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Awaitable, Callable, Generic

import trio

from ..frame_log import AppendFrame as AppendFn
from ..sessions import Session
from ..task_host import TaskHost
from .book import E, RequestBook
from .crossing import Crossing, SingleServer

if TYPE_CHECKING:
    from protocol import Frame

#: The reason a stopping server gives trio when it cancels everything (`trio.CancelScope.cancel(reason=...)`,
#: program/runner.py). A request cancelled with it records the server's shutdown as its end, not the
#: agent's cancel: trio hands a scope's reason down to every scope inside it not cancelled before.
SERVER_SHUTDOWN = "server shutdown"


def shut_down(cancelled: trio.Cancelled) -> bool:
    """`cancelled` comes from the server stopping (SIGTERM, SIGINT, its stdio caller gone), not from
    the agent's cancel or its connection ending, which reach a request's handler with no such reason."""
    return cancelled.reason == SERVER_SHUTDOWN


class PendingRequests(Generic[E]):
    """The pending requests of one kind of the whole server, by request id.

    Needs: the frame log's `append`, the crossing (`SingleServer` by default), and the frame
    types of its requests and outcomes. `serve` (started with `nursery.start`) holds the tasks
    that close a departed owner's requests of other servers (a shared store only).
    """

    def __init__(self, append_frame: AppendFn, crossing: Crossing | None, types: tuple[str, ...]) -> None:
        self._append_frame = append_frame
        self.crossing: Crossing = crossing or SingleServer()
        self._book: RequestBook[E] = RequestBook(self.crossing, types)
        self._pending = self._book.local
        self._remote = self._book.remote
        self._tasks = TaskHost()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold the nursery in which a departed owner's requests of other servers are closed (shared store)."""
        await self._tasks.serve(task_status=task_status)

    @property
    def pending(self) -> dict[str, E]:
        """This server's requests waiting now, by request id (the live dict, for reading)."""
        return self._pending

    def holds(self, session: Session) -> bool:
        """Some request of `session` has not ended (stored or not, this server's or another's): the
        session registry keeps the session in memory meanwhile."""
        return self._book.holds(session)

    def is_open(self, entry: E) -> bool:
        """`entry` still waits for its outcome (each service says how it knows)."""
        raise NotImplementedError

    def pending_for(self, session: Session) -> list[E]:
        """The open requests of `session`, oldest first (stored, not yet ended); with a shared
        store, also those of other servers, as last read from the log."""
        return self._book.listed(session, self.is_open)

    async def sync(self, session: Session) -> None:
        """Read what other servers stored about `session`'s requests since the last read (nothing on one server)."""
        raise NotImplementedError

    async def wait_pending(self, session: Session) -> list[E]:
        """Return the session's pending requests as soon as there is at least one (with a shared
        store, woken also by a request another server appends)."""
        return await self._book.wait_pending(session, self.sync, self.pending_for)

    def _notify(self, session: Session) -> None:
        self._book.notify(session)

    def fail_caller(self, caller: object, session: Session | None = None) -> int:
        """The owner's connection (or, with `session`, its wait on that session) ended: each of its
        open requests (of `session`, if given) ends now (`_end_disconnected`), or, if its answer is
        being stored, when that store fails (`caller_left`); those of other servers in its sessions
        are closed through the log (`_close_remote`). Returns how many requests it ended."""
        failed = 0
        for entry in list(self._pending.values()):
            if entry.caller is caller and self.is_open(entry) and session in (None, entry.session):
                if entry.claim.locked():  # its answer is being stored: that store decides
                    entry.caller_left = True
                else:
                    self._end_disconnected(entry)
                failed += 1
        gone = self._book.followed_sessions(caller, session)  # across servers only
        if gone:
            failed += sum(1 for entry in self._book.remote_of(gone) if self.is_open(entry))
            self._tasks.start_soon(self._close_remote, gone)
        return failed

    def _end_disconnected(self, entry: E) -> None:
        """End `entry` because its owner left (each service says how)."""
        raise NotImplementedError

    async def _close_remote(self, sessions: list[Session]) -> None:
        """The owner left: close other servers' requests in `sessions` through the log."""
        raise NotImplementedError

    async def _await_outcome(self, entry: E, seconds: float, time_out: Callable[[], None]) -> None:
        """Wait at most `seconds` for `entry`'s one outcome; past its deadline, `time_out()` ends it,
        unless an answer being stored under its claim (store first, then answer) ends it first."""
        with trio.move_on_after(seconds):
            await entry.done.wait()
        if not self.is_open(entry):
            return  # answered (or ended) in time: no claim to take, no extra trip through the scheduler
        async with entry.claim:  # an answer being stored goes first: stored, it wins
            if self.is_open(entry):
                time_out()

    @staticmethod
    async def _outcome_or_end(entry: E, seconds: float, wait_outcome: Callable[[], Awaitable[Frame]]) -> Frame | None:
        """A request that may be answered on any server (shared store): wait at most `seconds` for
        its outcome frame in the log (`wait_outcome`, whoever stores it) or for its end here
        (`_ended`: an answer stored through this server, its owner leaving), whichever comes
        first; the log's outcome frame, or None (ended here, or the time is up). No child task:
        the agent's cancel reaches the caller as a plain `Cancelled`."""
        with trio.move_on_after(seconds) as entry.waiting:
            if not entry.done.is_set():
                return await wait_outcome()
        return None

    @staticmethod
    def _ended(entry: E) -> None:
        """`entry` has its one outcome: set `done`, and stop its wait in the log (`_outcome_or_end`)."""
        entry.done.set()
        if entry.waiting is not None:
            entry.waiting.cancel()

    async def _end_if_open(self, entry: E, end: Callable[[], None]) -> None:
        """The agent cancelled, or the server stops (`shut_down`): holding `entry`'s claim (an answer
        being stored goes first: stored, it wins), `end()` it if still open; shielded, for the cancel
        must finish."""
        with trio.CancelScope(shield=True):
            async with entry.claim:
                if self.is_open(entry):
                    end()
