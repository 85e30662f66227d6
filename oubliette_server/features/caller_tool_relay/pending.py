"""Relayed caller tool calls: one pending entry per call, ended by exactly one outcome.

The relay task waits for the caller inside a Trio cancel scope. Exactly one of
these ends it (docs/ARCHITECTURE.md, "The path of one relayed call"): the caller's result or error,
the timeout, the caller's connection ending, or the agent cancelling (which
cancels the waiting task itself). A late or second answer finds no pending
entry and is refused with a message that says what happened to the request.

The life of a request — waiting here or in the log, store first, then answer, one outcome
across servers — is the pending-request engine's (core/pending_requests/service.py); this
module says what is a caller tool call's own: its request and outcome frames
(`caller_tool_request`, `caller_tool_result`, `caller_tool_cancelled`), what the agent gets for
each (`CallOutcome`), how a late answer is refused (`NoLongerPending`), progress reports, and
that an answer identical to one whose commit the store could not confirm is that answer
(`_stored_retry`). A session's turn waits learn of a new pending request through
`wait_pending`, never by polling.
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
from protocol.frames import utc_timestamp
from protocol.schema_check import schema_problem

from ...core.frame_log import AppendFrame as AppendFn
from ...core.pending_requests import SERVER_SHUTDOWN, Crossing, Ends, Pending, PendingRequests
from ...core.server_owned import POLICY_KEY
from ...core.sessions import Session
from ...store.api import AnswerNotRecorded, StoreUnavailable
from ..cluster.log_bus import OUTCOME_TYPES, PROGRESS, REQUEST

if TYPE_CHECKING:
    from ...core.callers import CallerConnection

log = logging.getLogger("oubliette.server.calls")

#: Hands a progress report (progress, total, message) to the agent's waiting call; never waits.
ProgressFn = Callable[[float, "float | None", "str | None"], None]
#: Told when a relayed call's wait is over: whether one outcome ended it, its error (None: a
#: result) and the seconds it took (the server's metrics).
EndedFn = Callable[[bool, "RelayError | None", float], None]


@attrs.frozen
class CallOutcome:
    """How a relayed call ended: in the words a late answer is refused with (`how`), what the agent
    gets (`result` or `error`), and for an end the server decided, the `reason` its
    `caller_tool_cancelled` frame records (None: the caller's answer, a `caller_tool_result`)."""

    how: str
    result: Any = None
    error: RelayError | None = None
    reason: str | None = None


@attrs.define(eq=False)
class PendingCall(Pending[CallOutcome]):
    """One relayed caller tool call waiting for its caller (`Pending`: what the engine keeps of it)."""

    tool: str
    progress: ProgressFn | None = None
    arguments: Any = None
    wants_progress: bool = False
    """A remote request whose agent asked for progress reports (its request frame says so)."""

    @property
    def how(self) -> str:
        """How it ended ("" while pending)."""
        return "" if self.outcome is None else self.outcome.how

    @property
    def result(self) -> Any:
        """The caller's result, once an outcome with one is known (else None)."""
        return None if self.outcome is None else self.outcome.result

    @property
    def error(self) -> RelayError | None:
        """The error the agent gets, once an outcome with one is known (else None)."""
        return None if self.outcome is None else self.outcome.error

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


class CallerCallRegistry(PendingRequests[PendingCall, CallOutcome]):
    """Pending caller tool calls of the whole server, by request id (on the pending-request engine)."""

    REQUEST = REQUEST
    OUTCOMES = OUTCOME_TYPES
    ANSWER = ("the answer", "caller_tool_response")
    log = log

    def __init__(
        self, append_frame: AppendFn, default_timeout: float, crossing: Crossing | None = None,
        find_sessions: Callable[[str], list[Session]] | None = None,
        on_ended: EndedFn = lambda ended, error, seconds: None,
    ) -> None:
        """`crossing` (pending_requests/: `SingleServer` by default) and `find_sessions` (sessions by
        id) make calls work across servers; `on_ended` hears how each call of this server's agents ended."""
        super().__init__(append_frame, crossing)
        self._on_ended = on_ended
        self.default_timeout = default_timeout
        self._find_sessions = find_sessions or (lambda session_id: [])

    # -- a caller tool call's payloads and rules (the engine's hooks) ---------------------

    def _outcome_frame(self, entry: PendingCall, outcome: CallOutcome) -> tuple[str, dict[str, Any]]:
        """A caller's answer is a `caller_tool_result`; an end the server decided a `caller_tool_cancelled`."""
        payload: dict[str, Any] = {"request_id": entry.request_id, "tool": entry.tool}
        if outcome.reason is not None:
            return "caller_tool_cancelled", {**payload, "reason": outcome.reason}
        if outcome.error is not None:
            payload["error"] = outcome.error.message
        else:
            payload["result"] = outcome.result
        return "caller_tool_result", payload

    def _outcome_from(self, entry: PendingCall, frame: Frame) -> CallOutcome:
        return CallOutcome(how_it_ended(frame), **outcome_of_frame(frame, entry.session, entry.tool))

    def _remote_entry(self, frame: Frame, session: Session) -> PendingCall | None:
        """Another server's agent's request to this session's caller (one for another caller id is not its)."""
        p = frame.payload
        if p.get("caller_id") != session.caller_id:
            return None
        return PendingCall(
            request_id=str(p["request_id"]), session=session, caller=session.owner, tool=str(p.get("tool")),
            arguments=p.get("arguments"), expires_at=str(p.get("expires_at", "")),
            frame_seq=frame.seq, remote=True, wants_progress=p.get("progress") is True, meta=p.get("_meta"),
        )

    def _finished_record(self, entry: PendingCall) -> Finished:
        return Finished(entry.how, entry.session, entry.caller, entry.frame_seq, entry.unconfirmed)

    def _gone(self, entry: PendingCall) -> CallOutcome:
        """Its caller left: the call fails (the agent is told the caller disconnected)."""
        return CallOutcome("closed: the caller disconnected", error=RelayError(
            errors.PEER_DISCONNECTED,
            f"caller '{entry.session.caller_id}' disconnected before responding to '{entry.tool}'",
        ), reason="caller disconnected")

    def _same_answer(self, won: CallOutcome, answer: CallOutcome) -> bool:
        """The same result, or the same error text."""
        return won.how == answer.how and won.result == answer.result \
            and (won.error and won.error.message) == (answer.error and answer.error.message)

    def _refused(self, entry: PendingCall) -> NoLongerPending:
        finished = self._book.finished.get(entry.request_id)
        return NoLongerPending(entry.request_id, finished or Finished("ended", entry.session, entry.caller, entry.frame_seq))

    def _expired(self, entry: PendingCall) -> NoLongerPending:
        """Its server times it out at `expires_at`, storing that if it can: an answer stored after it
        would tell this caller "resolved" while the agent heard "timed out"."""
        finished = Finished("timed out", entry.session, entry.caller, entry.frame_seq)
        self._remote.pop(entry.request_id, None)
        self._book.remember(entry.request_id, finished)
        self._notify(entry.session)
        return NoLongerPending(entry.request_id, finished)

    # -- the agent's side ------------------------------------------------------------------

    async def relay(
        self, session: Session, spec: CallerToolSpec, arguments: dict, progress: ProgressFn | None = None,
        policy: dict[str, Any] | None = None,
    ) -> Any:
        """Ask the session's caller to run `spec` and wait for exactly one outcome.

        `progress` gets the caller's progress reports on the call while it waits (`progress`);
        `policy` is the policies' decision the request frame carries (`POLICY_KEY`, docs/POLICY.md).
        """
        started = trio.current_time()
        request_id = "ctr-" + secrets.token_hex(8)
        timeout = spec.timeout_ms / 1000 if spec.timeout_ms else self.default_timeout
        # The clock runs from here, while the caller decides: `expires_at` tells it how long it has.
        expires_at = utc_timestamp(datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=timeout))
        call = PendingCall(
            request_id=request_id, session=session, caller=session.owner, tool=spec.name,
            arguments=arguments, expires_at=expires_at, progress=progress, meta=current_meta(),
        )
        request: dict[str, Any] = {
            "request_id": request_id, "tool": spec.name, "arguments": arguments, "caller_id": session.caller_id,
            # The caller's server lists it with the request; `oubliette-server status` shows it.
            "expires_at": expires_at,
        }
        if call.meta is not None:
            request["_meta"] = call.meta  # the caller's execution of the tool joins the trace
        if policy is not None:
            request[POLICY_KEY] = policy
        on_progress = None
        if progress is not None:
            def on_progress(payload: dict[str, Any]) -> None:  # a report another server stored
                progress(*_progress_args(payload))
        try:
            # Across servers: the caller's server may forward progress reports.
            await self._ask(call, request, timeout, _call_ends(spec, session, timeout), recorded_only=False,
                            announce={"progress": True if progress is not None else None}, on_progress=on_progress)
        finally:
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
        here (another server's agent may have made it since the last read): first what the store
        knows whole without reading (the request's notice, heard here), then, if still unknown, the log."""
        for known in (True, False):
            if request_id in self._pending or request_id in self._remote:
                return
            for session in self._find_sessions(session_id):
                if session.is_owner(caller):
                    await self.sync(session, known=known)

    def _pending_of(self, caller: CallerConnection, session_id: str, request_id: str) -> PendingCall:
        """The pending call `request_id` of `caller` in `session_id`.

        Raises: `NoLongerPending` for a request that already ended; `RelayError` for an unknown
        id, the wrong session or another caller.
        """
        call = self._pending.get(request_id) or self._remote.get(request_id)
        if call is None or not self.is_open(call):
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

        The answering caller knows its answer: the event goes to the session's other sinks only,
        unless the session asked for it (`context.echo_own_answers`); the log has it.
        Returns the resolved call (its session and `frame_seq` say where its turn goes on).
        Raises: as `_pending_of`; `AnswerNotRecorded` when the store fails (the call stays pending).
        """
        await self._sync_for(caller, session_id, request_id)  # another server's agent may have asked
        try:
            call = self._pending_of(caller, session_id, request_id)
        except NoLongerPending as ended:
            retried = await self._stored_retry(ended.finished, request_id, result, error)
            if retried is None:
                raise
            return retried
        await self._answer(call, _answered(result, error), skip=None if call.session.echo_own_answers else caller)
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
        if not self._same_answer(self._outcome_from(call, outcome), _answered(result, error)):
            return None
        self._book.remember(request_id, attrs.evolve(finished, unconfirmed=False))  # confirmed: a later answer is refused
        return call

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


def _answered(result: Any, error: str | None) -> CallOutcome:
    """A caller's answer: its result, or its error text."""
    if error is not None:
        return CallOutcome("resolved with an error", error=RelayError(errors.TOOL_ERROR, str(error)))
    return CallOutcome("resolved", result=result)


def _call_ends(spec: CallerToolSpec, session: Session, timeout: float) -> Ends[CallOutcome]:
    """The ends the server decides for a call of `spec`, in the words the agent gets (each made when the call ends so)."""
    shutdown = "cancelled: the server shut down"
    return Ends(
        timeout=lambda: CallOutcome("timed out", error=_timed_out(spec, session, timeout), reason="timeout"),
        absent=lambda: CallOutcome("closed: the caller disconnected", error=RelayError(
            errors.PEER_DISCONNECTED,
            f"caller '{session.caller_id}' is not connected; caller tool '{spec.name}' cannot run",
        ), reason="caller disconnected"),
        cancelled=lambda: CallOutcome(
            "cancelled by the agent", error=RelayError(errors.CANCELLED, "cancelled by the agent"), reason="cancelled by the agent",
        ),
        shutdown=lambda: CallOutcome(shutdown, error=RelayError(errors.CANCELLED, shutdown), reason=SERVER_SHUTDOWN),
    )


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
