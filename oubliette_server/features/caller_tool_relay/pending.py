"""Relayed caller tool calls: one pending entry per call, ended by exactly one outcome.

The relay task waits for the caller inside a Trio cancel scope. Exactly one of
these ends it (docs/ARCHITECTURE.md, "The path of one relayed call"): the caller's result or error,
the timeout, the caller's connection ending, or the agent cancelling (which
cancels the waiting task itself). A late or second answer finds no pending
entry and is refused with a message that says what happened to the request.

A session's turn waits (`session_message` with `wait`) learn of a new pending request
through `wait_pending`, woken by a per-session `trio.Event` (as approvals do), never by
polling: a caller that reads no events still hears of every request.

With a shared store (the `SharedStore` crossing, docs/SCALING.md) the agent's call and its caller may be on two
servers. The agent's server, holding no caller for the session, waits for the request's
outcome frame in the log (its own timeout and the agent's cancel race the caller's answer
there); the caller's server lists the session's open requests read from the log as *remote*
pending calls and answers them with `append_outcome`. Every outcome is stored through
`append_outcome`, so exactly one wins across servers; a loser is told what happened.

Store first, then answer (docs/SECURITY.md): an outcome reaches the agent only once its frame
is stored. A caller's answer is stored while it holds the call's `claim`; if the store fails,
the call stays pending and the caller is told to send its answer again (`AnswerNotRecorded`),
and the timeout or the agent's cancel, waiting for the claim, may end it then instead. An end
the server decides (timeout, disconnect, the agent's cancel) is stored before the agent hears
it; if that store fails, the end stands for both sides (a late answer is refused with it) and
is stored once the store is back (`when_store_is_back`).
"""

from __future__ import annotations

import datetime
import logging
import secrets
from typing import TYPE_CHECKING, Any, Callable

import attrs
import trio

from oubliette_runtime.peer_text import bounded
from oubliette_runtime.trace_spans import current_meta
from protocol import CallerToolSpec, Frame, RelayError, errors
from protocol.frames import is_past, utc_timestamp
from protocol.schema_check import schema_problem

from ...core.frame_log import AppendFrame as AppendFn
from ...core.pending_requests import SERVER_SHUTDOWN, Crossing, PendingRequests, shut_down
from ...core.sessions import Session
from ...store.api import AnswerNotRecorded, StoreUnavailable, when_store_is_back
from ..cluster.log_bus import OUTCOME_TYPES, PROGRESS, REQUEST, REQUEST_TYPES

if TYPE_CHECKING:
    from ...core.callers import CallerConnection

log = logging.getLogger("oubliette.server.calls")

#: Hands a progress report (progress, total, message) to the agent's waiting call; never waits.
ProgressFn = Callable[[float, "float | None", "str | None"], None]
#: Told when a relayed call's wait is over: whether one outcome ended it, its error (None: a
#: result) and the seconds it took (the server's metrics).
EndedFn = Callable[[bool, "RelayError | None", float], None]


@attrs.define(eq=False)
class PendingCall:
    """One relayed caller tool call waiting for its caller; `done` is set by exactly one outcome."""

    request_id: str
    session: Session
    caller: CallerConnection | None
    tool: str
    progress: ProgressFn | None = None
    arguments: Any = None
    expires_at: str = ""
    frame_seq: int = 0
    """The seq of its `caller_tool_request` frame; 0 until stored (not yet listed as pending)."""
    done: trio.Event = attrs.field(factory=trio.Event)
    """Set by its one outcome: a caller's answer only once its frame is stored."""
    claim: trio.Lock = attrs.field(factory=trio.Lock)
    """Held while a caller's answer is being stored: the timeout and the agent's cancel wait for it,
    then find the call answered, or still pending if that store failed."""
    caller_left: bool = False
    """The caller left while its answer was being stored: if that store fails, the call ends as a disconnect."""
    waiting: trio.CancelScope | None = None
    """Its wait for an outcome in the shared log (`_outcome_or_end`), stopped when it ends here."""
    unrecorded: str | None = None
    """The reason of an end the server decided whose `caller_tool_cancelled` frame is still to be
    stored (by the waiting task, before the agent hears of it)."""
    how: str = ""
    """How it ended, in the words a late answer is refused with ("resolved", "timed out", …)."""
    result: Any = None
    error: RelayError | None = None
    remote: bool = False
    """A request another server's agent made, read from the shared log (answered through it)."""
    in_log: bool = False
    """This server's agent's request whose caller is on another server (it waits in the log)."""
    wants_progress: bool = False
    """A remote request whose agent asked for progress reports (its request frame says so)."""
    meta: dict[str, str] | None = None
    """The server's span of the call as W3C trace context (`traceparent`, `tracestate`), for the caller."""
    unconfirmed: bool = False
    """An answer to it was refused as not recorded (`AnswerNotRecorded`), yet its commit may have
    happened unseen: once the call has ended, an identical retry is taken as that answer."""

    def summary(self) -> dict[str, Any]:
        """What a caller must answer: its entry in a turn stop's `pending` list (with `_meta`: the trace to join)."""
        entry = {
            "kind": "caller_tool", "request_id": self.request_id, "tool": self.tool,
            "arguments": self.arguments, "caller_id": self.session.caller_id, "expires_at": self.expires_at,
        }
        return entry if self.meta is None else {**entry, "_meta": self.meta}


@attrs.frozen
class Finished:
    """A request that is no longer pending: how it ended, and where, for late answers."""

    how: str
    session: Session
    caller: Any
    frame_seq: int
    unconfirmed: bool = False
    """An answer to it may have been stored without the store confirming it (see `PendingCall`)."""


class NoLongerPending(RelayError):
    """An answer to a request that already ended (`finished` says how and where)."""

    def __init__(self, request_id: str, finished: Finished) -> None:
        super().__init__(
            errors.INVALID_REQUEST, f"request_id '{request_id}' is no longer pending: it was already {finished.how}",
        )
        self.finished = finished


class CallerCallRegistry(PendingRequests[PendingCall]):
    """Pending caller tool calls of the whole server, by request id (on the pending-request engine)."""

    def __init__(
        self, append_frame: AppendFn, default_timeout: float, crossing: Crossing | None = None,
        find_sessions: Callable[[str], list[Session]] | None = None,
        on_ended: EndedFn = lambda ended, error, seconds: None,
    ) -> None:
        """`crossing` (pending_requests/: `SingleServer` by default) and `find_sessions` (sessions by
        id) make calls work across servers; `on_ended` hears how each call of this server's agents ended."""
        super().__init__(append_frame, crossing, REQUEST_TYPES)
        self._on_ended = on_ended
        self.default_timeout = default_timeout
        self._find_sessions = find_sessions or (lambda session_id: [])

    def is_open(self, entry: PendingCall) -> bool:
        """The call has no outcome yet."""
        return not entry.done.is_set()

    async def sync(self, session: Session) -> None:
        """Shared store, a session this server's caller owns: read the session's caller tool frames
        since the last read, and keep the requests of other servers' agents that have no outcome
        yet as remote pending calls (those that got one are remembered as finished)."""
        changed = False
        for request_id, frame in await self._book.read_news(session, REQUEST):
            if frame.type == REQUEST:
                if frame.payload.get("caller_id") != session.caller_id:
                    continue
                self._remote[request_id] = PendingCall(
                    request_id=request_id, session=session, caller=session.owner, tool=str(frame.payload.get("tool")),
                    arguments=frame.payload.get("arguments"), expires_at=str(frame.payload.get("expires_at", "")),
                    frame_seq=frame.seq, remote=True, wants_progress=frame.payload.get("progress") is True,
                    meta=frame.payload.get("_meta"),
                )
                changed = True
            else:
                call = self._remote.pop(request_id, None)
                if call is not None:
                    self._remember(request_id, Finished(how_it_ended(frame), session, call.caller, call.frame_seq))
                    changed = True
        if changed:
            self._notify(session)

    async def relay(
        self, session: Session, spec: CallerToolSpec, arguments: dict, progress: ProgressFn | None = None,
    ) -> Any:
        """Ask the session's caller to run `spec` and wait for exactly one outcome.

        `progress` gets the caller's progress reports on the call while it waits (`progress`).
        """
        started = trio.current_time()
        request_id = "ctr-" + secrets.token_hex(8)
        caller = session.owner
        timeout = spec.timeout_ms / 1000 if spec.timeout_ms else self.default_timeout
        # The clock runs from here, while the caller decides: `expires_at` tells it how long it has.
        expires_at = utc_timestamp(datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=timeout))
        call = PendingCall(
            request_id=request_id, session=session, caller=caller, tool=spec.name,
            arguments=arguments, expires_at=expires_at, progress=progress, meta=current_meta(),
        )
        self._pending[request_id] = call
        try:
            # Shared store: the owner (by identity) or the operator may answer on any server, so the
            # call waits in the log even when its caller is connected here (docs/SCALING.md).
            call.in_log = (caller is None or not caller.closed.is_set()) \
                and await self.crossing.owner_elsewhere(session, recorded_only=False)
            request: dict[str, Any] = {
                "request_id": request_id, "tool": spec.name, "arguments": arguments, "caller_id": session.caller_id,
                # The caller's server lists it with the request; `oubliette-server status` shows it.
                "expires_at": expires_at,
            }
            if call.meta is not None:
                request["_meta"] = call.meta  # the caller's execution of the tool joins the trace
            # Across servers: the caller's server may forward progress reports.
            self.crossing.announce(request, progress=True if progress is not None else None)
            frame = await self._append_frame(session, "caller_tool_request", request)
            call.frame_seq = frame.seq
            self._notify(session)
            if call.in_log:
                await self._wait_in_log(call, spec, timeout)
            elif caller is None or caller.closed.is_set():
                self._finish(call, "closed: the caller disconnected", error=RelayError(
                    errors.PEER_DISCONNECTED,
                    f"caller '{session.caller_id}' is not connected; caller tool '{spec.name}' cannot run",
                ), unrecorded="caller disconnected")
            else:
                await self._await_outcome(call, timeout, lambda: self._finish(
                    call, "timed out", error=_timed_out(spec, session, timeout), unrecorded="timeout",
                ))
            await self._record_end(call)
        except trio.Cancelled as cancelled:
            if shut_down(cancelled):
                how, reason = "cancelled: the server shut down", SERVER_SHUTDOWN
            else:
                how = reason = "cancelled by the agent"
            await self._end_if_open(call, lambda: self._finish(
                call, how, error=RelayError(errors.CANCELLED, how), unrecorded=reason,
            ))
            with trio.CancelScope(shield=True):
                await self._record_end(call)
            raise
        finally:
            self._pending.pop(request_id, None)
            seconds = trio.current_time() - started
            self._on_ended(call.done.is_set(), call.error, seconds)
            # One line per request's end, for the operator: never its arguments or its result.
            log.info(
                "caller tool request %s ended: %s (instance %s, session %s, tool %s, %.1f ms)", request_id,
                call.how if call.done.is_set() else "not ended (its request was not stored)",
                session.instance, session.key, bounded(spec.name), seconds * 1000,
            )
        if call.error is not None:
            raise call.error
        return self.check_result(spec, call.result)

    async def _wait_in_log(self, call: PendingCall, spec: CallerToolSpec, timeout: float) -> None:
        """Shared store: wait for the request's outcome frame, whichever server appends it, or for its
        end here (an answer stored through this server, its caller leaving: `_record_end` stores that).

        At the timeout this server tries to store `caller_tool_cancelled` (timeout); if an answer
        won the race in the database, the agent gets that answer instead.
        """
        session = call.session
        outcome: Frame | None = None
        on_progress = None
        if call.progress is not None:
            report = call.progress

            def on_progress(payload: dict[str, Any]) -> None:
                report(*_progress_args(payload))

        outcome = await self._outcome_or_end(call, timeout, lambda: self.crossing.wait_outcome(
            session, call.request_id, call.frame_seq, OUTCOME_TYPES, on_progress,
        ))
        if call.done.is_set():
            return
        if outcome is None:  # stored by `_record_end`, unless an answer won the race in the database
            self._finish(call, "timed out", error=_timed_out(spec, session, timeout), unrecorded="timeout")
            return
        self._finish(call, how_it_ended(outcome), **outcome_of_frame(outcome, session, spec.name))

    async def _record_end(self, call: PendingCall) -> None:
        """Store the `caller_tool_cancelled` frame of an end the server decided, before the agent hears it.

        With a shared store, an outcome stored first by any server (an answer that won the race in
        the database) is the call's instead. If the store fails, the end stands for both sides (a
        late answer is refused with it): it is logged, and stored once the store is back (if this
        server stops first: `restart.py` on its next start, or the shared store's sweep).
        """
        reason, call.unrecorded = call.unrecorded, None
        if reason is None:
            return
        payload = {"request_id": call.request_id, "tool": call.tool, "reason": reason}
        session = call.session
        try:
            stored = await self._record(session, "caller_tool_cancelled", payload)
        except StoreUnavailable as exc:
            log.warning("request %s ended (%s); storing its end when the store is back: %s", call.request_id, reason, exc)
            self._tasks.start_soon(when_store_is_back, lambda: self._record(session, "caller_tool_cancelled", payload))
            return
        if stored is None:
            winner = await self.crossing.outcome_of(call.session, call.request_id, call.frame_seq, OUTCOME_TYPES)
            if winner is None:  # the winner is committed before we lost: unreachable but for retention
                raise RelayError(errors.INTERNAL_ERROR, f"request '{call.request_id}' ended, but its outcome is not in the log")
            self._adopt(call, winner)

    def _adopt(self, call: PendingCall, winner: Frame) -> None:
        """The outcome another server stored first is `call`'s, here as everywhere."""
        outcome = outcome_of_frame(winner, call.session, call.tool)
        call.result = outcome.get("result")
        call.error = outcome.get("error")
        call.how = how_it_ended(winner)
        self._remember(call.request_id, Finished(how_it_ended(winner), call.session, call.caller, call.frame_seq))

    async def _record(self, session: Session, type: str, payload: dict[str, Any], *, skip: Any = None) -> Frame | None:
        """Store an outcome frame: with a shared store through `append_outcome` (None if another won)."""
        return await self.crossing.store_outcome(self._append_frame, session, type, payload, skip=skip)

    def _remember(self, request_id: str, finished: Finished) -> None:
        self._book.remember(request_id, finished)

    @staticmethod
    def check_result(spec: CallerToolSpec, result: Any) -> Any:
        """`result`, or `RelayError(TOOL_ERROR)` when it does not match the tool's `resultSchema`."""
        if spec.resultSchema is not None:
            problem = schema_problem(
                spec.resultSchema, result, f"the result of caller tool '{spec.name}' does not match its resultSchema",
            )
            if problem:
                raise RelayError(errors.TOOL_ERROR, problem)
        return result

    async def _close_remote(self, sessions: list[Session]) -> None:
        """Their caller left: the requests other servers' agents made in `sessions` get
        `caller_tool_cancelled` (caller disconnected), so those agents fail now, not at their timeout."""
        for session in sessions:
            try:
                await self.sync(session)
                for call in [c for c in self._remote.values() if c.session is session]:
                    self._remote.pop(call.request_id, None)
                    self._remember(call.request_id, Finished("closed: the caller disconnected", session, call.caller, call.frame_seq))
                    await self._record(session, "caller_tool_cancelled", {
                        "request_id": call.request_id, "tool": call.tool, "reason": "caller disconnected",
                    })
            except Exception:
                log.exception("session %s: could not close the requests of a departed caller", session.key)
            self._notify(session)

    def _end_disconnected(self, call: PendingCall) -> None:
        """Its caller left: the call fails (the agent is told the caller disconnected)."""
        self._finish_disconnected(call)

    def _finish_disconnected(self, call: PendingCall) -> None:
        self._finish(call, "closed: the caller disconnected", error=RelayError(
            errors.PEER_DISCONNECTED,
            f"caller '{call.session.caller_id}' disconnected before responding to '{call.tool}'",
        ), unrecorded="caller disconnected")

    def _finish(
        self, call: PendingCall, how: str, *, result: Any = None, error: RelayError | None = None,
        unrecorded: str | None = None,
    ) -> None:
        """End `call` with its one outcome. `unrecorded`: the reason of an end the server decided,
        which the waiting task stores (`_record_end`) before it answers the agent."""
        call.result = result
        call.error = error
        call.unrecorded = unrecorded
        call.how = how
        self._ended(call)
        self._remember(call.request_id, Finished(how, call.session, call.caller, call.frame_seq, call.unconfirmed))
        self._notify(call.session)

    async def progress(
        self, caller: CallerConnection, session_id: str, request_id: str,
        progress: float, total: float | None = None, message: str | None = None,
    ) -> bool:
        """Hand the caller's progress report on a pending call to the agent; False if it asked for none.

        Another server's request (shared store): the report is stored as a `caller_tool_progress`
        frame, which the agent's server forwards to the waiting call.
        Raises: `RelayError` as `respond` does for a call that is not pending, in another session,
        or another caller's.
        """
        await self._sync_for(caller, session_id, request_id)
        call = self._pending_of(caller, session_id, request_id)
        if call.remote:
            if not call.wants_progress:
                return False
            report: dict[str, Any] = {"request_id": request_id, "progress": progress}
            if total is not None:
                report["total"] = total
            if message is not None:
                report["message"] = message
            try:
                await self._append_frame(call.session, PROGRESS, report, skip=caller)
            except StoreUnavailable as exc:  # never stored, so never forwarded
                raise AnswerNotRecorded(
                    "the progress report", request_id, exc, until=call.expires_at, again="caller_tool_progress",
                ) from exc
            return True
        if call.progress is None:
            return False
        call.progress(progress, total, message)
        return True

    async def _sync_for(self, caller: CallerConnection, session_id: str, request_id: str) -> None:
        """Shared store: read the log of `caller`'s sessions `session_id` when `request_id` is not known
        here (another server's agent may have made it since the last read)."""
        if request_id not in self._pending and request_id not in self._remote:
            for session in self._find_sessions(session_id):
                if session.is_owner(caller):
                    await self.sync(session)

    def _pending_of(self, caller: CallerConnection, session_id: str, request_id: str) -> PendingCall:
        """The pending call `request_id` of `caller` in `session_id`.

        Raises: `NoLongerPending` for a request that already ended; `RelayError` for an unknown
        id, the wrong session or another caller.
        """
        call = self._pending.get(request_id) or self._remote.get(request_id)
        if call is None or call.done.is_set():
            finished = self._book.finished.get(request_id)
            if finished is not None:
                raise NoLongerPending(request_id, finished)
            raise RelayError(errors.NOT_FOUND, f"unknown request_id '{request_id}'")
        if call.session.id != session_id:
            raise RelayError(
                errors.INVALID_PARAMS,
                f"request_id '{request_id}' belongs to session '{call.session.id}', not '{session_id}'",
            )
        if call.caller is not caller and not (call.caller is None and call.session.same_caller(caller)):
            raise RelayError(
                errors.UNAUTHORIZED,
                f"session '{session_id}' belongs to another caller: request_id '{request_id}' may only be answered by the caller that declared "
                f"'{call.session.caller_id}' tools in session '{session_id}'",
            )
        return call

    async def respond(
        self,
        caller: CallerConnection,
        session_id: str,
        request_id: str,
        result: Any = None,
        error: str | None = None,
    ) -> PendingCall:
        """Resolve a pending call with the caller's answer; refuse anything else clearly.

        Returns the resolved call (its session and `frame_seq` say where its turn goes on).
        Raises: as `_pending_of`.
        """
        await self._sync_for(caller, session_id, request_id)  # another server's agent may have asked
        try:
            call = self._pending_of(caller, session_id, request_id)
        except NoLongerPending as ended:
            retried = await self._stored_retry(ended.finished, request_id, result, error)
            if retried is None:
                raise
            return retried
        if call.remote or call.in_log:
            # Another server's request, or one of this server's agent whose caller declared on
            # another server (it waits in the log): the log decides which outcome wins.
            return await self._respond_remote(call, caller, result, error)
        payload = _result_payload(call, result, error)
        # The answering caller knows its answer: the event goes to the session's other sinks
        # only, unless the session asked for it (`context.echo_own_answers`); the log has it.
        # The agent is answered only once the result frame is stored: what the agent got is in
        # the log, even if the server dies right after; a failed store leaves the call pending.
        skip = None if call.session.echo_own_answers else caller
        async with call.claim:
            if call.done.is_set():  # the timeout or the agent's cancel ended it while we waited
                raise NoLongerPending(request_id, self._finished_or_ended(call))
            try:
                stored = await self._record(call.session, "caller_tool_result", payload, skip=skip)
            except StoreUnavailable as exc:
                call.unconfirmed = True
                if call.caller_left:  # it left meanwhile: nobody will send it again
                    self._finish_disconnected(call)
                raise AnswerNotRecorded(
                    "the answer", request_id, exc, until=call.expires_at, again="caller_tool_response",
                ) from exc
            call.unconfirmed = False  # the store answered: a later answer is refused
            if stored is None:  # shared store: an outcome stored first (an earlier try of this answer?) wins
                winner = await self.crossing.outcome_of(call.session, request_id, call.frame_seq, OUTCOME_TYPES)
                if winner is None:  # the winner is committed before we lost: unreachable but for retention
                    raise RelayError(errors.INTERNAL_ERROR, f"request '{request_id}' ended, but its outcome is not in the log")
                self._finish(call, how_it_ended(winner), **outcome_of_frame(winner, call.session, call.tool))
                if not _same_answer(winner, payload):
                    raise NoLongerPending(request_id, self._finished_or_ended(call))
                return call  # the same answer, stored by a try whose end the store could not confirm
            if error is not None:
                self._finish(call, "resolved with an error", error=RelayError(errors.TOOL_ERROR, str(error)))
            else:
                self._finish(call, "resolved", result=result)
        return call

    async def _stored_retry(self, finished: Finished, request_id: str, result: Any, error: str | None) -> PendingCall | None:
        """Shared store: an answer identical to the one the log holds for a request whose answer was
        refused as not recorded is a retry of it (that try was committed, but the store could not
        confirm it, and the agent, waiting in the log, may already have it): the call it answered,
        else None (any other late answer is refused, as on one server)."""
        if not finished.unconfirmed or not finished.how.startswith("resolved"):
            return None
        outcome = await self.crossing.outcome_of(finished.session, request_id, finished.frame_seq, OUTCOME_TYPES)
        if outcome is None:
            return None
        call = PendingCall(
            request_id=request_id, session=finished.session, caller=finished.caller,
            tool=str(outcome.payload.get("tool")), frame_seq=finished.frame_seq,
        )
        if not _same_answer(outcome, _result_payload(call, result, error)):
            return None
        self._remember(request_id, attrs.evolve(finished, unconfirmed=False))  # confirmed: a later answer is refused
        return call

    def _finished_or_ended(self, call: PendingCall) -> Finished:
        return self._book.finished.get(call.request_id) or Finished("ended", call.session, call.caller, call.frame_seq)

    async def _respond_remote(
        self, call: PendingCall, caller: CallerConnection, result: Any, error: str | None,
    ) -> PendingCall:
        """Answer another server's request: the answer is stored only if no outcome won before it
        (that server's timeout, the agent's cancel, another answer); else `NoLongerPending`."""
        payload = _result_payload(call, result, error)
        session = call.session
        if call.remote and is_past(call.expires_at):
            # Its server times it out at `expires_at`, storing that if it can: an answer stored
            # after it would tell this caller "resolved" while the agent heard "timed out".
            finished = Finished("timed out", session, caller, call.frame_seq)
            self._remote.pop(call.request_id, None)
            self._remember(call.request_id, finished)
            self._notify(session)
            raise NoLongerPending(call.request_id, finished)
        try:
            stored = await self._record(session, "caller_tool_result", payload, skip=None if session.echo_own_answers else caller)
        except StoreUnavailable as exc:  # nothing stored, so nobody answered: it stays pending
            call.unconfirmed = True
            raise AnswerNotRecorded(
                "the answer", call.request_id, exc, until=call.expires_at, again="caller_tool_response",
            ) from exc
        self._remote.pop(call.request_id, None)
        if stored is None:
            outcome = await self.crossing.outcome_of(session, call.request_id, call.frame_seq, OUTCOME_TYPES)
            if outcome is None or not _same_answer(outcome, payload):
                finished = Finished(how_it_ended(outcome) if outcome else "ended", session, caller, call.frame_seq)
                self._remember(call.request_id, finished)
                self._notify(session)
                raise NoLongerPending(call.request_id, finished)
            stored = outcome  # the same answer, stored by a try whose end the store could not confirm
        call.unconfirmed = False  # answered: a later answer is refused
        if call.remote:
            call.done.set()
            self._remember(call.request_id, Finished(how_it_ended(stored), session, caller, call.frame_seq))
        else:  # this server's agent waits in the log: finish its call now (it reads the same frame)
            self._finish(call, how_it_ended(stored), **outcome_of_frame(stored, session, call.tool))
        self._notify(session)
        return call


def _result_payload(call: PendingCall, result: Any, error: str | None) -> dict[str, Any]:
    """The `caller_tool_result` frame's payload of a caller's answer to `call`."""
    payload: dict[str, Any] = {"request_id": call.request_id, "tool": call.tool}
    if error is not None:
        payload["error"] = str(error)
    else:
        payload["result"] = result
    return payload


def _same_answer(frame: Frame, payload: dict[str, Any]) -> bool:
    """Whether the stored outcome `frame` is the answer `payload` (a retry of it, already stored)."""
    return frame.type == "caller_tool_result" and all(frame.payload.get(key) == value for key, value in payload.items()) \
        and ("error" in frame.payload) == ("error" in payload)


def _progress_args(payload: dict[str, Any]) -> tuple[float, float | None, str | None]:
    """A `caller_tool_progress` frame's payload as `(progress, total, message)` (bad values dropped)."""
    progress = payload.get("progress")
    total = payload.get("total")
    message = payload.get("message")
    return (
        float(progress) if isinstance(progress, (int, float)) else 0.0,
        float(total) if isinstance(total, (int, float)) else None,
        message if isinstance(message, str) else None,
    )


def _timed_out(spec: CallerToolSpec, session: Session, timeout: float) -> RelayError:
    return RelayError(
        errors.TIMEOUT,
        f"caller tool '{spec.name}' timed out after {timeout:g} s: caller '{session.caller_id}' did not respond",
    )


def how_it_ended(frame: Frame) -> str:
    """A request's outcome frame as the words a late answer is refused with ("already …")."""
    if frame.type == "caller_tool_result":
        return "resolved with an error" if "error" in frame.payload else "resolved"
    reason = frame.payload.get("reason")
    if reason == "timeout":
        return "timed out"
    if reason in ("caller disconnected", "cancelled by the agent"):
        return "closed: the caller disconnected" if reason == "caller disconnected" else "cancelled by the agent"
    return f"cancelled ({reason})"


def outcome_of_frame(frame: Frame, session: Session, tool: str) -> dict[str, Any]:
    """What the agent gets for an outcome frame another server stored: `result=` or `error=`."""
    if frame.type == "caller_tool_result":
        if "error" in frame.payload:
            return {"error": RelayError(errors.TOOL_ERROR, str(frame.payload["error"]))}
        return {"result": frame.payload.get("result")}
    reason = frame.payload.get("reason")
    if reason == "caller disconnected":
        return {"error": RelayError(errors.PEER_DISCONNECTED, f"caller '{session.caller_id}' disconnected before responding to '{tool}'")}
    if reason == "timeout":
        return {"error": RelayError(errors.TIMEOUT, f"caller tool '{tool}' timed out: caller '{session.caller_id}' did not respond")}
    return {"error": RelayError(errors.CANCELLED, f"cancelled: {reason}")}
