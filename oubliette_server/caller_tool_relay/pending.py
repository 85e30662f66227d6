"""Relayed caller tool calls: one pending entry per call, ended by exactly one outcome.

The relay task waits for the caller inside a Trio cancel scope. Exactly one of
these ends it (DESIGN.md, "Caller tool relay"): the caller's result or error,
the timeout, the caller's connection ending, or the agent cancelling (which
cancels the waiting task itself). A late or second answer finds no pending
entry and is refused with a message that says what happened to the request.

A session's turn waits (`session_message` with `wait`) learn of a new pending request
through `wait_pending`, woken by a per-session `trio.Event` (as approvals do), never by
polling: a caller that reads no events still hears of every request.
"""

from __future__ import annotations

import collections
import datetime
import logging
import secrets
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import attrs
import trio

from protocol import CallerToolSpec, RelayError, errors
from protocol.frames import utc_timestamp
from protocol.schema_check import schema_problem

from ..sessions import Session

if TYPE_CHECKING:
    from ..callers import CallerConnection

log = logging.getLogger("oubliette.server.calls")

RESOLVED_MEMORY = 10_000

AppendFn = Callable[..., Awaitable[Any]]
#: Hands a progress report (progress, total, message) to the agent's waiting call; never waits.
ProgressFn = Callable[[float, "float | None", "str | None"], None]


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
    recorded: trio.Event = attrs.field(factory=trio.Event)
    """Set once the outcome's frame is stored (or its append failed): the agent is answered after it."""
    result: Any = None
    error: RelayError | None = None

    def summary(self) -> dict[str, Any]:
        """What a caller must answer: its entry in a turn stop's `pending` list."""
        return {
            "kind": "caller_tool", "request_id": self.request_id, "tool": self.tool,
            "arguments": self.arguments, "caller_id": self.session.caller_id, "expires_at": self.expires_at,
        }


@attrs.frozen
class Finished:
    """A request that is no longer pending: how it ended, and where, for late answers."""

    how: str
    session: Session
    caller: Any
    frame_seq: int


class NoLongerPending(RelayError):
    """An answer to a request that already ended (`finished` says how and where)."""

    def __init__(self, request_id: str, finished: Finished) -> None:
        super().__init__(
            errors.INVALID_REQUEST, f"request_id '{request_id}' is no longer pending: it was already {finished.how}",
        )
        self.finished = finished


class CallerCallRegistry:
    """Pending caller tool calls of the whole server, by request id."""

    def __init__(self, append_frame: AppendFn, default_timeout: float) -> None:
        self._append_frame = append_frame
        self.default_timeout = default_timeout
        self._pending: dict[str, PendingCall] = {}
        self._finished: collections.OrderedDict[str, Finished] = collections.OrderedDict()
        self._changed: dict[int, trio.Event] = {}

    @property
    def pending(self) -> dict[str, PendingCall]:
        """The calls waiting now, by request id (the live dict, for reading)."""
        return self._pending

    def pending_for(self, session: Session) -> list[PendingCall]:
        """The calls of `session` waiting now for their caller, oldest first (stored, not yet ended)."""
        return [p for p in self._pending.values() if p.session is session and p.frame_seq and not p.done.is_set()]

    async def wait_pending(self, session: Session) -> list[PendingCall]:
        """Return the session's pending calls as soon as there is at least one."""
        while True:
            pending = self.pending_for(session)
            if pending:
                return pending
            event = self._changed.get(id(session))
            if event is None:
                event = self._changed[id(session)] = trio.Event()
            await event.wait()

    def _notify(self, session: Session) -> None:
        event = self._changed.pop(id(session), None)
        if event is not None:
            event.set()

    async def relay(
        self, session: Session, spec: CallerToolSpec, arguments: dict, progress: ProgressFn | None = None,
    ) -> Any:
        """Ask the session's caller to run `spec` and wait for exactly one outcome.

        `progress` gets the caller's progress reports on the call while it waits (`progress`).
        """
        request_id = "ctr-" + secrets.token_hex(8)
        caller = session.owner
        timeout = spec.timeout_ms / 1000 if spec.timeout_ms else self.default_timeout
        # The clock runs from here, while the caller decides: `expires_at` tells it how long it has.
        expires_at = utc_timestamp(datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=timeout))
        call = PendingCall(
            request_id=request_id, session=session, caller=caller, tool=spec.name,
            arguments=arguments, expires_at=expires_at, progress=progress,
        )
        self._pending[request_id] = call
        try:
            frame = await self._append_frame(
                session,
                "caller_tool_request",
                {"request_id": request_id, "tool": spec.name, "arguments": arguments, "caller_id": session.caller_id},
            )
            call.frame_seq = frame.seq
            self._notify(session)
            if caller is None or caller.closed.is_set():
                self._finish(call, "closed: the caller disconnected", error=RelayError(
                    errors.PEER_DISCONNECTED,
                    f"caller '{session.caller_id}' is not connected; caller tool '{spec.name}' cannot run",
                ))
            else:
                with trio.move_on_after(timeout):
                    await call.done.wait()
                if call.done.is_set():
                    await call.recorded.wait()
                if call.error is not None and call.error.code == errors.PEER_DISCONNECTED:
                    await self._append_frame(
                        session, "caller_tool_cancelled",
                        {"request_id": request_id, "tool": spec.name, "reason": "caller disconnected"},
                    )
            if not call.done.is_set():
                self._finish(call, "timed out", error=RelayError(
                    errors.TIMEOUT,
                    f"caller tool '{spec.name}' timed out after {timeout:g} s: "
                    f"caller '{session.caller_id}' did not respond",
                ))
                await self._append_frame(
                    session, "caller_tool_cancelled",
                    {"request_id": request_id, "tool": spec.name, "reason": "timeout"},
                )
        except trio.Cancelled:
            if not call.done.is_set():
                self._finish(call, "cancelled by the agent", error=RelayError(errors.CANCELLED, "cancelled"))
                with trio.CancelScope(shield=True):
                    await self._append_frame(
                        session, "caller_tool_cancelled",
                        {"request_id": request_id, "tool": spec.name, "reason": "cancelled by the agent"},
                    )
            raise
        finally:
            self._pending.pop(request_id, None)
        if call.error is not None:
            raise call.error
        return self.check_result(spec, call.result)

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

    def fail_caller(self, caller: CallerConnection, session: Session | None = None) -> int:
        """The caller's connection (or its stream in `session`) ended: every call waiting on it there fails now."""
        failed = 0
        for call in list(self._pending.values()):
            if call.caller is caller and not call.done.is_set() and session in (None, call.session):
                self._finish(call, "closed: the caller disconnected", error=RelayError(
                    errors.PEER_DISCONNECTED,
                    f"caller '{call.session.caller_id}' disconnected before responding to '{call.tool}'",
                ))
                failed += 1
        return failed

    def _finish(
        self, call: PendingCall, how: str, *, result: Any = None, error: RelayError | None = None,
        record_follows: bool = False,
    ) -> None:
        """Claim `call`'s one outcome. With `record_follows`, the claimer stores the outcome's frame
        and sets `call.recorded`; otherwise nothing is left to wait for."""
        call.result = result
        call.error = error
        call.done.set()
        if not record_follows:
            call.recorded.set()
        self._finished[call.request_id] = Finished(how, call.session, call.caller, call.frame_seq)
        while len(self._finished) > RESOLVED_MEMORY:
            self._finished.popitem(last=False)
        self._notify(call.session)

    def progress(
        self, caller: CallerConnection, session_id: str, request_id: str,
        progress: float, total: float | None = None, message: str | None = None,
    ) -> bool:
        """Hand the caller's progress report on a pending call to the agent; False if it asked for none.

        Raises: `RelayError` as `respond` does for a call that is not pending, in another session,
        or another caller's.
        """
        call = self._pending_of(caller, session_id, request_id)
        if call.progress is None:
            return False
        call.progress(progress, total, message)
        return True

    def _pending_of(self, caller: CallerConnection, session_id: str, request_id: str) -> PendingCall:
        """The pending call `request_id` of `caller` in `session_id`.

        Raises: `NoLongerPending` for a request that already ended; `RelayError` for an unknown
        id, the wrong session or another caller.
        """
        call = self._pending.get(request_id)
        if call is None or call.done.is_set():
            finished = self._finished.get(request_id)
            if finished is not None:
                raise NoLongerPending(request_id, finished)
            raise RelayError(errors.NOT_FOUND, f"unknown request_id '{request_id}'")
        if call.session.id != session_id:
            raise RelayError(
                errors.INVALID_PARAMS,
                f"request_id '{request_id}' belongs to session '{call.session.id}', not '{session_id}'",
            )
        if call.caller is not caller:
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
        call = self._pending_of(caller, session_id, request_id)
        if error is not None:
            self._finish(call, "resolved with an error", error=RelayError(errors.TOOL_ERROR, str(error)), record_follows=True)
            payload: dict[str, Any] = {"request_id": request_id, "tool": call.tool, "error": str(error)}
        else:
            self._finish(call, "resolved", result=result, record_follows=True)
            payload = {"request_id": request_id, "tool": call.tool, "result": result}
        # The answering caller knows its answer: the event goes to the session's other sinks
        # only, unless the session asked for it (`context.echo_own_answers`); the log has it.
        # The agent is answered only once the result frame is stored (`recorded`): what the
        # agent got is in the log, even if the server dies right after.
        echo = call.session.echo_own_answers
        try:
            await self._append_frame(call.session, "caller_tool_result", payload, skip=None if echo else caller)
        finally:
            call.recorded.set()
        return call
