"""The engine of requests a caller answers: ask and wait here or in the log, answer under the claim, adopt the winner.

`CallerCallRegistry` (caller tool requests) and `ApprovalService` (approvals) are both a
`PendingRequests`: the engine runs the one life of a request for both, and each kind adds only
its payloads and decision rules — the frame an outcome is stored as and the outcome a frame
records (`_outcome_frame`, `_outcome_from`), another server's request as an entry
(`_remote_entry`), what an ended request is remembered as (`_finished_record`), the end when
its owner leaves (`_gone`), whether an answer repeats the one that won (`_same_answer`), and the
refusals of a late answer (`_refused`, `_expired`).

One life, on one server or several (the crossing, crossing.py, is all that differs):

- asked (`_ask`): the request frame is stored; it waits here for its answer, or, when its owner
  may answer on another server, for its outcome in the log (`in_log`), raced against its end
  here; the timeout, the owner's absence or departure and the agent's cancel are ends the
  server decides, stored by the waiting task before the agent hears of them (`_record_end`);
- answered (`_answer`): here, under the request's `claim` (store first, then answer: the timeout
  and the agent's cancel wait for it); through the log for a request waiting there or another
  server's (`remote`, read by `sync`): the log lets one outcome win, and a loser adopts the
  winner (an identical one is a retry of an answer whose commit the store could not confirm).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable, ClassVar, Generic

import attrs
import trio

from protocol import RelayError, errors
from protocol.frames import is_past

from ...store.api import AnswerNotRecorded, StoreUnavailable, when_store_is_back
from ..frame_log import AppendFrame as AppendFn
from ..sessions import Session
from ..task_host import TaskHost
from .book import E, Outcome, RequestBook
from .crossing import Crossing, ProgressPayloadFn, SingleServer

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


@attrs.frozen
class Ends(Generic[Outcome]):
    """The ends the server decides for one request, each stored by its waiting task before the agent hears it.

    Each is made when the request ends so (most requests are answered, and an end's words and
    errors cost more to build than the rest of the engine's bookkeeping of a request)."""

    timeout: Callable[[], Outcome]
    absent: Callable[[], Outcome]
    """Its owner is not connected anywhere it could answer when it is asked."""
    cancelled: Callable[[], Outcome]
    shutdown: Callable[[], Outcome]


class PendingRequests(Generic[E, Outcome]):
    """The pending requests of one kind of the whole server, by request id.

    Needs: the frame log's `append`, the crossing (`SingleServer` by default), and the frame
    types of its requests and outcomes (the kind's `REQUEST` and `OUTCOMES`). `serve` (started
    with `nursery.start`) holds the tasks that close a departed owner's requests of other servers
    and store ends once the store is back.
    """

    REQUEST: ClassVar[str]
    OUTCOMES: ClassVar[tuple[str, ...]]
    #: What an answer is called, and the method that sends it again, in `AnswerNotRecorded`.
    ANSWER: ClassVar[tuple[str, str]]
    log: ClassVar[logging.Logger]

    def __init__(self, append_frame: AppendFn, crossing: Crossing | None) -> None:
        self._append_frame = append_frame
        self.crossing: Crossing = crossing or SingleServer()
        self._book: RequestBook[E] = RequestBook(self.crossing, (self.REQUEST, *self.OUTCOMES))
        self._pending = self._book.local
        self._remote = self._book.remote
        self._tasks = TaskHost()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold the nursery of the engine's own tasks (a departed owner's requests of other servers, late stores)."""
        await self._tasks.serve(task_status=task_status)

    # -- what a kind says --------------------------------------------------------------

    def _outcome_frame(self, entry: E, outcome: Outcome) -> tuple[str, dict[str, Any]]:
        """The frame type and payload `outcome` of `entry` is stored as."""
        raise NotImplementedError

    def _outcome_from(self, entry: E, frame: Frame) -> Outcome:
        """The outcome a stored outcome frame of `entry` records (any server stored it)."""
        raise NotImplementedError

    def _remote_entry(self, frame: Frame, session: Session) -> E | None:
        """Another server's request frame as an entry this server's owner answers (None: not for it)."""
        raise NotImplementedError

    def _finished_record(self, entry: E) -> Any:
        """What an ended `entry` is remembered as, for late answers."""
        raise NotImplementedError

    def _gone(self, entry: E) -> Outcome:
        """`entry`'s end when its owner leaves."""
        raise NotImplementedError

    def _same_answer(self, won: Outcome, answer: Outcome) -> bool:
        """`answer` repeats the outcome that `won` (a retry of it): taken as a success."""
        raise NotImplementedError

    def _refused(self, entry: E) -> RelayError:
        """The refusal of an answer to `entry`, which already ended."""
        raise NotImplementedError

    def _expired(self, entry: E) -> RelayError:
        """The refusal of an answer to another server's `entry` past its `expires_at` (its server ends it then)."""
        raise NotImplementedError

    # -- what is pending -----------------------------------------------------------------

    @property
    def pending(self) -> dict[str, E]:
        """This server's requests waiting now, by request id (the live dict, for reading)."""
        return self._pending

    def holds(self, session: Session) -> bool:
        """Some request of `session` has not ended (stored or not, this server's or another's): the
        session registry keeps the session in memory meanwhile."""
        return self._book.holds(session)

    def is_open(self, entry: E) -> bool:
        """`entry` still waits for its outcome."""
        return entry.outcome is None

    def pending_for(self, session: Session) -> list[E]:
        """The open requests of `session`, oldest first (stored, not yet ended); with a shared
        store, also those of other servers, as last read from the log."""
        return self._book.listed(session, self.is_open)

    async def sync(self, session: Session, *, known: bool = False) -> None:
        """Shared store, a session this server's caller owns: read the session's request and outcome
        frames since the last read; other servers' requests with no outcome yet become remote
        entries, and those that got one since end with it (nothing on one server). With `known`,
        only the frames the store knows whole without reading (its own appends, notices heard)."""
        changed = False
        for request_id, frame in await self._book.read_news(session, self.REQUEST, known=known):
            if frame.type == self.REQUEST:
                entry = self._remote_entry(frame, session)
                if entry is not None:
                    self._remote[request_id] = entry
                    changed = True
                continue
            ended = self._remote.pop(request_id, None)
            if ended is not None and self.is_open(ended):
                self._end(ended, self._outcome_from(ended, frame), recorded=True)
                changed = True
        if changed:
            self._notify(session)

    async def wait_pending(self, session: Session) -> list[E]:
        """Return the session's pending requests as soon as there is at least one (with a shared
        store, woken also by a request another server appends)."""
        return await self._book.wait_pending(session, self.sync, self.pending_for)

    def _notify(self, session: Session) -> None:
        self._book.notify(session)

    # -- the agent's side: ask, wait, the ends the server decides ------------------------

    async def _ask(
        self, entry: E, request: dict[str, Any], seconds: float, ends: Ends[Outcome], *, recorded_only: bool,
        announce: dict[str, Any], on_progress: ProgressPayloadFn | None = None,
    ) -> None:
        """Store `entry`'s request frame (`request`, with what other servers need: `announce`) and
        wait for exactly one outcome, at most `seconds`; it is `entry.outcome` on return.

        Shared store: the owner (by identity) or the operator may answer on any server, so the
        request waits in the log even when its owner is connected here (`in_log`; with
        `recorded_only`, only if the log records an owner), raced against its end here.
        Cancellation: ended `ends.cancelled` (`ends.shutdown` when the server stops, `shut_down`)
        unless an answer being stored wins, stored under a shield; `Cancelled` propagates.
        """
        session, caller = entry.session, entry.caller
        self._pending[entry.request_id] = entry
        try:
            entry.in_log = (caller is None or not caller.closed.is_set()) \
                and await self.crossing.owner_elsewhere(session, recorded_only=recorded_only)
            self.crossing.announce(request, **announce)
            frame = await self._append_frame(session, self.REQUEST, request)
            entry.frame_seq = frame.seq
            self._notify(session)
            if entry.in_log:
                outcome = await self._outcome_or_end(entry, seconds, lambda: self.crossing.wait_outcome(
                    session, entry.request_id, entry.frame_seq, self.OUTCOMES, on_progress,
                ))
                if self.is_open(entry) and outcome is not None:
                    self._end(entry, self._outcome_from(entry, outcome), recorded=True)
                elif self.is_open(entry):  # stored below, unless an answer won the race in the database
                    self._end(entry, ends.timeout())
            elif caller is None or caller.closed.is_set():
                if self.is_open(entry):
                    self._end(entry, ends.absent())
            else:
                await self._await_outcome(entry, seconds, lambda: self._end(entry, ends.timeout()))
            await self._record_end(entry)
        except trio.Cancelled as cancelled:
            withdrawn = ends.shutdown() if shut_down(cancelled) else ends.cancelled()
            await self._end_if_open(entry, lambda: self._end(entry, withdrawn))
            with trio.CancelScope(shield=True):
                await self._record_end(entry)  # with a shared store it loses to an outcome stored first
            raise
        finally:
            self._pending.pop(entry.request_id, None)
            entry.recorded.set()  # never leave an answerer waiting, even if recording failed

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

    async def _end_if_open(self, entry: E, end: Callable[[], None]) -> None:
        """The agent cancelled, or the server stops (`shut_down`): holding `entry`'s claim (an answer
        being stored goes first: stored, it wins), `end()` it if still open; shielded, for the cancel
        must finish."""
        with trio.CancelScope(shield=True):
            async with entry.claim:
                if self.is_open(entry):
                    end()

    async def _record_end(self, entry: E) -> None:
        """Store the end the server decided for its own `entry` (timeout, absence, departure, cancel)
        before the agent hears it.

        With a shared store it is stored with `append_outcome` too, so it can never be a second
        outcome: one stored first by any server (an answer that won the race in the database, the
        sweep of a server taken for dead) is the request's instead, here as everywhere. If the
        store fails, the end stands for both sides (a late answer is refused with it): it is
        logged, and stored once the store is back (if this server stops first: the restart's or
        the shared store's sweep)."""
        outcome = entry.outcome
        if entry.recorded.is_set() or outcome is None:
            return
        try:
            if await self._store(entry, outcome) is None:
                winner = await self._winner(entry)
                if winner is None:  # the winner is committed before we lost: unreachable but for retention
                    self.log.error("request %s lost to an outcome that is not in the log", entry.request_id)
                else:
                    self._adopt(entry, self._outcome_from(entry, winner))
        except StoreUnavailable as exc:
            self.log.warning("request %s ended; storing its end when the store is back: %s", entry.request_id, exc)
            self._tasks.start_soon(when_store_is_back, lambda: self._store(entry, outcome))
        finally:
            entry.recorded.set()

    # -- the answering side ----------------------------------------------------------------

    async def _answer(self, entry: E, outcome: Outcome, *, skip: Any = None) -> bool:
        """Store a caller's answer `outcome` to `entry`, then end `entry` with the outcome that won.

        Here (`entry` waits on this server, not in the log) the answer is stored holding its
        claim, so the timeout and the agent's cancel wait for it; through the log (`in_log`, or
        another server's request: `remote`) the log lets one outcome win. True: this answer is
        the outcome; False: an identical one ended it first (an earlier try whose commit the store
        could not confirm, or an end the server decided that this answer repeats).
        Raises: `_refused` when another outcome won; `_expired` for another server's request past
        `expires_at`; `AnswerNotRecorded` when the store fails (nothing ended: it stays pending,
        unless its owner left meanwhile: then it ends `_gone`).
        """
        if entry.remote or entry.in_log:
            if entry.remote and is_past(entry.expires_at):
                raise self._expired(entry)
            return await self._store_answer(entry, outcome, skip)
        try:  # free, as it nearly always is: taken without a scheduler round trip (the store is the checkpoint)
            entry.claim.acquire_nowait()
        except trio.WouldBlock:
            await entry.claim.acquire()
        try:
            if entry.outcome is not None:  # the timeout or the agent's cancel ended it while we waited
                if self._same_answer(entry.outcome, outcome):
                    return False
                raise self._refused(entry)
            return await self._store_answer(entry, outcome, skip)
        finally:
            entry.claim.release()

    async def _store_answer(self, entry: E, outcome: Outcome, skip: Any) -> bool:
        try:
            stored = await self._store(entry, outcome, skip=skip)
        except StoreUnavailable as exc:
            entry.unconfirmed = True
            if entry.caller_left and self.is_open(entry):  # it left meanwhile: nobody will send it again
                self._end(entry, self._gone(entry))
            words, again = self.ANSWER
            raise AnswerNotRecorded(words, entry.request_id, exc, until=entry.expires_at, again=again) from exc
        entry.unconfirmed = False  # the store answered: a later answer is refused
        if stored is not None:
            self._settle(entry, outcome)
            return True
        winner = await self._winner(entry)  # shared store: the outcome stored first wins
        if winner is None:  # the winner is committed before we lost: unreachable but for retention
            raise RelayError(errors.INTERNAL_ERROR, f"request '{entry.request_id}' ended, but its outcome is not in the log")
        won = self._outcome_from(entry, winner)
        self._settle(entry, won)
        if not self._same_answer(won, outcome):
            raise self._refused(entry)
        return False

    def _settle(self, entry: E, outcome: Outcome) -> None:
        """`outcome` is stored as `entry`'s: this server's copy of the request ends with it (one
        already ended here stores its own end next, and adopts this one: `_record_end`)."""
        if entry.remote:
            self._remote.pop(entry.request_id, None)
        if self.is_open(entry):
            self._end(entry, outcome, recorded=True)

    # -- the owner leaves ------------------------------------------------------------------

    def fail_caller(self, caller: object, session: Session | None = None) -> int:
        """The owner's connection (or, with `session`, its wait on that session) ended: each of its
        open requests (of `session`, if given) ends now (`_gone`), or, if its answer is being
        stored, when that store fails (`caller_left`); those of other servers in its sessions are
        closed through the log (`_close_remote`). Returns how many requests it ended."""
        failed = 0
        for entry in list(self._pending.values()):
            if entry.caller is caller and self.is_open(entry) and session in (None, entry.session):
                if entry.claim.locked():  # its answer is being stored: that store decides
                    entry.caller_left = True
                else:
                    self._end(entry, self._gone(entry))
                failed += 1
        gone = self._book.followed_sessions(caller, session)  # across servers only
        if gone:
            failed += sum(1 for entry in self._book.remote_of(gone) if self.is_open(entry))
            self._tasks.start_soon(self._close_remote, gone)
        return failed

    async def _close_remote(self, sessions: list[Session]) -> None:
        """The owner left: other servers' requests in `sessions` end `_gone` through the log, so
        their agents hear it now, not at their timeout (an outcome stored first stands)."""
        for session in sessions:
            try:
                await self.sync(session)
                for entry in [e for e in self._remote.values() if e.session is session and self.is_open(e)]:
                    gone = self._gone(entry)
                    if await self._store(entry, gone) is not None:
                        self._settle(entry, gone)
            except Exception:
                self.log.exception("session %s: could not close the requests of a departed caller", session.key)
            self._notify(session)

    # -- one outcome -------------------------------------------------------------------------

    def _end(self, entry: E, outcome: Outcome, *, recorded: bool = False) -> None:
        """End `entry` with its one outcome (`recorded`: its frame is stored already; else its
        waiting task stores it, `_record_end`), remember it, and wake its waits."""
        entry.outcome = outcome
        self._book.remember(entry.request_id, self._finished_record(entry))
        self._ended(entry)
        if recorded:
            entry.recorded.set()
        self._notify(entry.session)

    def _adopt(self, entry: E, outcome: Outcome) -> None:
        """The outcome another server stored first replaces the one decided here (`_record_end`)."""
        entry.outcome = outcome
        entry.unconfirmed = False
        self._book.remember(entry.request_id, self._finished_record(entry))

    @staticmethod
    def _ended(entry: E) -> None:
        """`entry` has its one outcome: set `done`, and stop its wait in the log (`_outcome_or_end`)."""
        entry.done.set()
        if entry.waiting is not None:
            entry.waiting.cancel()

    async def _store(self, entry: E, outcome: Outcome, *, skip: Any = None) -> Frame | None:
        """Store `outcome` as `entry`'s outcome frame (None: shared store, another outcome won)."""
        type, payload = self._outcome_frame(entry, outcome)
        return await self.crossing.store_outcome(self._append_frame, entry.session, type, payload, skip=skip)

    async def _winner(self, entry: E) -> Frame | None:
        """The outcome frame of `entry` stored first (shared store), if any."""
        return await self.crossing.outcome_of(entry.session, entry.request_id, entry.frame_seq, self.OUTCOMES)
