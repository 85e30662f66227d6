"""Pending approvals: one entry per gated call, ended by exactly one decision.

A gated call (a caller tool declared with `requires_approval`) asks `ApprovalService.request`
for a decision before anything runs. The service appends an `approval_request` frame (the frame
log pushes it to the session's followers, the owning caller among them) and waits in a Trio
cancel scope. Exactly one of these ends the wait: the owning caller's answer (`answer`,
`answer_batch`), the approval timeout, the owning caller's connection ending (`fail_caller`), or
the agent cancelling (the waiting task is cancelled). Every decision becomes one
`approval_resolved` frame, appended by the waiting task, so it always comes before whatever the
decision lets run. Anything but an answer fails closed: the call is denied with the reason.

A session's turn waits (`session_message` with `wait`) learn of a new pending approval through
`wait_pending`, woken by a per-session `trio.Event`, never by polling.

The life of a request — waiting here or in the log, store first, then answer, one decision
across servers, a losing answer refused with the decision that won (an identical one is an
idempotent success) — is the pending-request engine's (core/pending_requests/service.py); this
module says what is an approval's own: its frames (`approval_request`, `approval_resolved`),
its `Decision`, the checks of an answer (`_check`), and that every decision the server takes
(timeout, disconnect, the agent's cancel) is a denial: anything but an answer fails closed.
"""

from __future__ import annotations

import datetime
import logging
import secrets
from typing import TYPE_CHECKING, Any, Callable, Literal, cast, get_args

import attrs
import trio

from oubliette_runtime.trace_spans import approval_wait_span
from protocol import Frame, RelayError, errors
from protocol.schema_check import schema_problem
from protocol.timestamps import utc_timestamp

from ...core.frame_log import AppendFrame as AppendFn
from ...core.pending_requests import Crossing, Ends, Pending, PendingRequests
from ...core.server_owned import POLICY_KEY
from ...core.sessions import Session
from ...store.api import AnswerNotRecorded, StoreUnavailable
from ...store.chain import ARGUMENTS_DIGEST_KEY, value_digest

if TYPE_CHECKING:
    from ...core.callers import CallerConnection

log = logging.getLogger("oubliette.server.approvals")

DEFAULT_APPROVAL_TIMEOUT = 600.0
#: How approvals reach a person (`approval_delivery`; see elicitation.py). Here, not there, so
#: the command line can list them without importing the MCP SDK.
DELIVERIES: tuple[str, ...] = ("auto", "elicitation", "tool")
ELICITATION_WHO = "elicitation"
"""`Decision.who` of an answer the person gave in the caller's MCP client."""

Origin = Literal["caller", "toolset", "agent"]

#: Told when a gated call's wait is over: its decision (None: it ended without one) and the
#: seconds it took (the server's metrics).
DecidedFn = Callable[["Decision | None", float], None]

REQUEST = "approval_request"
RESOLVED = "approval_resolved"


@attrs.frozen
class Decision:
    """How an approval ended. `kind` "tool" is a client-side tool's own result (`tool_return`, `status`)."""

    approve: bool
    who: str
    reason: str | None = None
    kind: Literal["approval", "tool"] = "approval"
    updated_arguments: dict[str, Any] | None = None
    tool_return: Any = None
    status: Literal["success", "error"] | None = None
    content: dict[str, Any] | None = None
    """A toolset elicitation's answer: the form's content (on approve)."""
    action: str | None = None
    """How a person answered an elicitation form (`accept`, `decline`, `cancel`); None otherwise."""
    answer_digest: str | None = None
    """Set in a decision as an ended approval remembers it (`compact`): the digest of the values it
    no longer holds."""

    def describe(self) -> str:
        """The decision in words, as refusals of a contradicting re-answer quote it."""
        if self.kind == "tool":
            return f"answered with a tool return ({self.status})"
        verdict = "approved" if self.approve else "denied"
        return verdict if self.who.startswith("caller") else f"{verdict} ({self.who})"

    def same_answer_as(self, other: Decision) -> bool:
        """An identical re-answer (a retry): the same verdict, and for a tool return the same return
        (for an approval the same `updated_arguments`, or none); values compared as canonical JSON."""
        if self.kind != other.kind or self.approve != other.approve:
            return False
        if self.kind == "tool":
            return self.status == other.status and self.digest() == other.digest()
        return other.updated_arguments is None or self.digest() == other.digest()

    def digest(self) -> str:
        """The SHA-256 of the value a re-answer must repeat: the tool return, or the updated arguments."""
        if self.answer_digest is not None:
            return self.answer_digest
        return value_digest(self.tool_return if self.kind == "tool" else self.updated_arguments)

    def compact(self) -> Decision:
        """This decision as an ended approval remembers it (up to `RESOLVED_MEMORY` of them): the
        caller's values — `updated_arguments`, a `tool_return`, a form's `content`, each up to
        `max_payload_bytes` — dropped for their digest, all a retry is compared with. Whole, 10,000
        of them could hold 10 GiB."""
        kept = self.tool_return if self.kind == "tool" else self.updated_arguments
        digest = None if kept is None else self.digest()  # no value: `digest` of None, nothing to keep
        return attrs.evolve(self, updated_arguments=None, tool_return=None, content=None, answer_digest=digest)


@attrs.define(eq=False)
class PendingApproval(Pending[Decision]):
    """One approval request waiting for its decision (`Pending`: what the engine keeps of it; its
    `outcome` is the decision)."""

    tool_name: str
    arguments: dict[str, Any]
    origin: Origin
    input_schema: dict[str, Any] | None = None
    allows_tool_return: bool = False
    form: dict[str, Any] | None = None
    """A toolset's own elicitation (`message`, `requestedSchema`): answered with `content`."""
    tool_use_id: str | None = None

    @property
    def decision(self) -> Decision | None:
        """The decision, once one is known (else None)."""
        return self.outcome

    def summary(self) -> dict[str, Any]:
        """What a caller must answer: the `approval_requests` entry of a turn stop (with `_meta`: the trace to join)."""
        summary = {
            "request_id": self.request_id, "tool_name": self.tool_name, "arguments": self.arguments,
            "origin": self.origin, "expires_at": self.expires_at,
        }
        if self.form is not None:
            summary["elicitation"] = self.form
        if self.tool_use_id is not None:
            summary["tool_use_id"] = self.tool_use_id  # the agent's own id of the action (origin "agent")
        if self.meta is not None:
            summary["_meta"] = self.meta  # the trace the caller's decision joins
        return summary


@attrs.frozen
class _Finished:
    session_id: str
    caller: Any
    decision: Decision
    frame_seq: int
    recorded: trio.Event
    session: Session | None = None


def decision_of(payload: dict[str, Any]) -> Decision:
    """The decision an `approval_resolved` frame records (stored by any server of the deployment)."""
    kind = payload.get("kind")
    status = payload.get("status")
    return Decision(
        approve=payload.get("approve") is True, who=str(payload.get("who") or "unknown"),
        reason=payload.get("reason") if isinstance(payload.get("reason"), str) else None,
        kind="tool" if kind == "tool" else "approval",
        updated_arguments=payload.get("updated_arguments") if isinstance(payload.get("updated_arguments"), dict) else None,
        tool_return=payload.get("tool_return"),
        status=status if status in ("success", "error") else None,
        content=payload.get("content") if isinstance(payload.get("content"), dict) else None,
        action=payload.get("action") if isinstance(payload.get("action"), str) else None,
    )


def _iso_in(seconds: float) -> str:
    return utc_timestamp(datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=seconds))


class ApprovalService(PendingRequests[PendingApproval, Decision]):
    """The pending approvals of the whole server, by request id.

    Needs: the frame log's `append` (frames go to the store, then to the session's followers),
    the default approval timeout in seconds, and the crossing (`SingleServer` or `SharedStore`). Each
    pending approval is waited for by the task of the call it gates (on the pending-request engine).
    Raises (from `answer`, `answer_batch`): `RelayError` with a message naming the request ids
    for an unknown id, another caller, a wrong session, a contradicting re-answer, an answer the
    request cannot take, or updated arguments that fail the tool's schema; the approval then
    stays pending.
    """

    REQUEST = REQUEST
    OUTCOMES = (RESOLVED,)
    ANSWER = ("the decision", "approval_response")
    log = log

    def __init__(
        self, append_frame: AppendFn, default_timeout: float = DEFAULT_APPROVAL_TIMEOUT,
        crossing: Crossing | None = None, on_decided: DecidedFn = lambda decision, seconds: None,
    ) -> None:
        """`crossing` (pending_requests/: `SingleServer` by default) makes approvals work across
        servers; `on_decided` hears how each of this server's gated calls was decided."""
        super().__init__(append_frame, crossing)
        self._on_decided = on_decided
        self.default_timeout = default_timeout
        self._finished = self._book.finished

    # -- an approval's payloads and rules (the engine's hooks) ------------------------------

    def _outcome_frame(self, entry: PendingApproval, outcome: Decision) -> tuple[str, dict[str, Any]]:
        return RESOLVED, resolved_payload(entry.request_id, entry.tool_name, entry.arguments, outcome)

    def _outcome_from(self, entry: PendingApproval, frame: Frame) -> Decision:
        return decision_of(frame.payload)

    def _finished_record(self, entry: PendingApproval) -> _Finished:
        """The decision, compacted (`Decision.compact`): what a retry is compared with."""
        assert entry.decision is not None
        return _Finished(
            entry.session.id, entry.caller, entry.decision.compact(), entry.frame_seq, entry.recorded, entry.session,
        )

    def _gone(self, entry: PendingApproval) -> Decision:
        """Its owner left: the approval is denied (fail closed)."""
        return _disconnected()

    def _same_answer(self, won: Decision, answer: Decision) -> bool:
        """The same decision (`Decision.same_answer_as`) on the same path: the person's answer in
        the caller's MCP client and the caller's are one decision, the second one refused."""
        return (won.who == ELICITATION_WHO) == (answer.who == ELICITATION_WHO) and won.same_answer_as(answer)

    def _refused(self, entry: PendingApproval) -> RelayError:
        assert entry.decision is not None
        return RelayError(errors.INVALID_REQUEST, f"approval '{entry.request_id}' is already resolved: {entry.decision.describe()}")

    def _expired(self, entry: PendingApproval) -> RelayError:
        """Its server denies it at `expires_at`, storing that if it can: a decision stored after it
        would tell this caller "resolved" while the gated call was denied."""
        return RelayError(
            errors.INVALID_REQUEST,
            f"approval '{entry.request_id}' is already resolved: denied (timeout): it expired at "
            f"{entry.expires_at}, and its gated call is denied at its approval timeout",
        )

    # -- what is pending ---------------------------------------------------------------

    def find(self, request_id: str) -> PendingApproval | None:
        """The pending approval `request_id`, this server's or (shared store) another's."""
        return self._book.find(request_id)

    async def wait_changed(self, session: Session) -> None:
        """Return at the session's next change: an approval requested or decided (on any server)."""
        await self._book.wait_change(session, self.sync)

    def _remote_entry(self, frame: Frame, session: Session) -> PendingApproval:
        """Another server's `approval_request` frame as a pending approval this server's owner answers."""
        p = frame.payload
        origin = p.get("origin")
        arguments = p.get("arguments")
        return PendingApproval(
            request_id=str(p["request_id"]), session=session, tool_name=str(p.get("tool_name")),
            arguments=arguments if isinstance(arguments, dict) else {},
            origin=cast(Origin, origin) if origin in get_args(Origin) else "agent",
            caller=session.owner, expires_at=str(p.get("expires_at", "")),
            input_schema=p.get("input_schema") if isinstance(p.get("input_schema"), dict) else None,
            allows_tool_return=p.get("allows_tool_return") is True,
            form=p.get("elicitation") if isinstance(p.get("elicitation"), dict) else None,
            tool_use_id=p.get("tool_use_id") if isinstance(p.get("tool_use_id"), str) else None,
            frame_seq=frame.seq, remote=True, meta=p.get("_meta") if isinstance(p.get("_meta"), dict) else None,
        )

    # -- the gated call's side -----------------------------------------------------------

    async def request(
        self,
        session: Session,
        tool_name: str,
        arguments: dict[str, Any],
        *,
        origin: Origin,
        caller: CallerConnection | None,
        timeout: float | None = None,
        input_schema: dict[str, Any] | None = None,
        allows_tool_return: bool = False,
        form: dict[str, Any] | None = None,
        tool_use_id: str | None = None,
        policy: dict[str, Any] | None = None,
    ) -> Decision:
        """Ask `caller` to decide on the call and wait for exactly one decision (`policy`: the
        policies' decision that gated it, carried by the `approval_request` frame, docs/POLICY.md).

        Cancellation: the approval is decided "cancelled" (denied; "server_shutdown" when the server stops),
        its `approval_resolved` frame is appended under a shield, and `Cancelled` propagates.
        """
        started = trio.current_time()
        seconds = self.default_timeout if timeout is None else timeout
        request_id = "apr-" + secrets.token_hex(8)
        # The wait is a span of its own; the caller gets it in `_meta` (its decision nests under it).
        with approval_wait_span(tool_name, request_id) as meta:
            entry = PendingApproval(
                request_id=request_id, session=session, tool_name=tool_name,
                arguments=arguments, origin=origin, caller=caller, expires_at=_iso_in(seconds),
                input_schema=input_schema, allows_tool_return=allows_tool_return, form=form, tool_use_id=tool_use_id,
                meta=meta,
            )
            ends = Ends(
                timeout=lambda: Decision(approve=False, who="timeout", reason=f"no decision within {seconds:g} s (approval timeout)"),
                absent=lambda: Decision(
                    approve=False, who="disconnect",
                    reason=f"the caller that owns '{tool_name}' is not connected; nobody can approve it",
                ),
                cancelled=lambda: Decision(approve=False, who="cancelled", reason="the agent cancelled the call"),
                shutdown=lambda: Decision(approve=False, who="server_shutdown", reason="the server shut down before a decision"),
            )
            try:
                # Across servers: what the owner's server checks an answer against; with no owner
                # connected here, it waits in the log only if the log records one.
                request = entry.summary()
                if policy is not None:
                    request[POLICY_KEY] = policy
                await self._ask(entry, request, seconds, ends, recorded_only=caller is None, announce={
                    "input_schema": input_schema, "allows_tool_return": True if allows_tool_return else None,
                })
            finally:
                self._on_decided(entry.decision, trio.current_time() - started)
            return self._decided(entry)

    @staticmethod
    def _decided(entry: PendingApproval) -> Decision:
        assert entry.decision is not None
        return entry.decision

    # -- the caller's side ---------------------------------------------------------------

    async def answer(self, caller: CallerConnection, session_id: str, request_id: str, decision: Decision) -> dict[str, Any]:
        """Decide one pending approval; an identical re-answer is an idempotent success."""
        outcome = self._check(caller, session_id, request_id, decision)
        if outcome is None:
            entry = self.find(request_id)
            assert entry is not None
            if await self._answer(entry, decision):
                return {"resolved": True, "after_seq": entry.frame_seq}
            outcome = self._check(caller, session_id, request_id, decision)  # another decision came first
            assert outcome is not None  # `_check` raises for any but an identical decision
        await outcome.recorded.wait()
        return {"resolved": True, "already_resolved": True, "after_seq": outcome.frame_seq}

    async def answer_batch(
        self, caller: CallerConnection, session: Session, answers: list[tuple[str, Decision]]
    ) -> dict[str, Any]:
        """Decide every pending approval of `session` at once (Letta's batch form).

        The ids must be exactly the session's pending ones (re-sent ids already decided by this
        caller count as idempotent retries); every answer is checked before any is applied.
        """
        ids = [request_id for request_id, _ in answers]
        if len(set(ids)) != len(ids):
            raise RelayError(errors.INVALID_PARAMS, "approvals: each tool_call_id may appear only once")
        pending_ids = sorted(p.request_id for p in self.pending_for(session))
        retries: list[_Finished] = []
        fresh: list[tuple[PendingApproval, Decision]] = []
        for request_id, decision in answers:
            outcome = self._check(caller, session.id, request_id, decision)
            if outcome is not None:
                retries.append(outcome)
            else:
                entry = self.find(request_id)
                assert entry is not None
                fresh.append((entry, decision))
        if sorted(entry.request_id for entry, _ in fresh) != pending_ids:
            listed = ", ".join(pending_ids) or "none"
            raise RelayError(
                errors.INVALID_PARAMS,
                f"approvals must answer exactly the pending request ids of session '{session.id}': {listed}; "
                "nothing was decided",
            )
        seqs = [entry.frame_seq for entry, _ in fresh] + [r.frame_seq for r in retries]
        for done, (entry, decision) in enumerate(fresh):
            try:
                if not await self._answer(entry, decision):
                    self._check(caller, session.id, entry.request_id, decision)  # raises unless identical
            except AnswerNotRecorded as exc:
                if done:  # say which decisions stand: the same batch again retries only the rest
                    stood = ", ".join(e.request_id for e, _ in fresh[:done])
                    raise StoreUnavailable(f"approvals {stood} were recorded; {exc.message}") from exc
                raise
        for entry, _ in fresh:
            await entry.recorded.wait()
        for retry in retries:
            await retry.recorded.wait()
        return {"resolved": True, "after_seq": min(seqs) if seqs else 0}

    def _check(
        self, caller: CallerConnection, session_id: str, request_id: str, decision: Decision
    ) -> _Finished | None:
        """Refuse an answer that may not be applied; a finished one answered the same way is returned."""
        entry = self.find(request_id)
        if entry is None or entry.decision is not None:
            finished = self._finished.get(request_id)
            if finished is None:
                raise RelayError(errors.NOT_FOUND, f"unknown approval request_id '{request_id}'")
            self._check_owner(caller, finished.caller, finished.session_id, session_id, request_id, finished.session)
            # The person's answer and the caller's are one decision: the second one is refused.
            one_path = (finished.decision.who == ELICITATION_WHO) == (decision.who == ELICITATION_WHO)
            if one_path and finished.decision.same_answer_as(decision):
                return finished
            raise RelayError(
                errors.INVALID_REQUEST,
                f"approval '{request_id}' is already resolved: {finished.decision.describe()}",
            )
        self._check_owner(caller, entry.caller, entry.session.id, session_id, request_id, entry.session)
        if decision.kind == "tool" and not entry.allows_tool_return:
            raise RelayError(
                errors.INVALID_PARAMS,
                f"approval '{request_id}' ({entry.origin} '{entry.tool_name}') cannot be answered with a tool return",
            )
        if decision.content is not None:
            if entry.form is None:
                raise RelayError(
                    errors.INVALID_PARAMS,
                    f"approval '{request_id}' is not a toolset's elicitation; 'content' answers only those",
                )
            if not decision.approve:
                raise RelayError(errors.INVALID_PARAMS, "content is only for an acceptance (approve: true)")
            problem = schema_problem(
                entry.form.get("requestedSchema") or {"type": "object"}, decision.content,
                f"content does not match the form of '{entry.tool_name}'",
            )
            if problem:
                raise RelayError(errors.INVALID_PARAMS, f"{problem}; approval '{request_id}' is still pending")
        if decision.updated_arguments is not None:
            if not decision.approve:
                raise RelayError(errors.INVALID_PARAMS, "updated_arguments are only for an approval (approve: true)")
            if entry.input_schema is not None:
                problem = schema_problem(
                    entry.input_schema, decision.updated_arguments,
                    f"updated_arguments do not match the inputSchema of '{entry.tool_name}'",
                )
                if problem:
                    raise RelayError(errors.INVALID_PARAMS, f"{problem}; approval '{request_id}' is still pending")
        return None

    @staticmethod
    def _check_owner(
        caller: Any, owner: Any, owner_session: str, session_id: str, request_id: str, session: Session | None = None,
    ) -> None:
        if owner_session != session_id:
            raise RelayError(
                errors.INVALID_PARAMS,
                f"approval '{request_id}' belongs to session '{owner_session}', not '{session_id}'",
            )
        if owner is None and session is not None and session.same_caller(caller):
            return  # the owner by identity, connected to this server, of a session opened on another
        if owner is not caller:
            raise RelayError(
                errors.UNAUTHORIZED,
                f"approval '{request_id}' may only be answered by the caller that owns session '{session_id}'",
            )


def _disconnected() -> Decision:
    return Decision(approve=False, who="disconnect", reason="the caller disconnected before deciding")


def resolved_payload(request_id: str, tool_name: str, arguments: Any, decision: Decision) -> dict[str, Any]:
    """The `approval_resolved` frame's payload for `decision` on request `request_id` (also the
    sweep's, which closes a dead server's request without its entry). It binds the decision to
    the hash of the `arguments` the request showed (`ARGUMENTS_DIGEST_KEY`), which `audit verify`
    checks against the `approval_request` frame (docs/AUDIT.md)."""
    payload: dict[str, Any] = {
        "request_id": request_id, "tool_name": tool_name, "approve": decision.approve,
        "reason": decision.reason, "who": decision.who, "kind": decision.kind,
        ARGUMENTS_DIGEST_KEY: value_digest(arguments),
    }
    if decision.updated_arguments is not None:
        payload["updated_arguments"] = decision.updated_arguments
    if decision.kind == "tool":
        payload.update(tool_return=decision.tool_return, status=decision.status)
    if decision.content is not None:
        payload["content"] = decision.content
    if decision.action is not None:
        payload["action"] = decision.action
    return payload
