"""The caller-facing MCP tools: `session_message`, `caller_tool_response`, `approval_response`,
`session_events`, tether.

Thin adapters: each handler checks its arguments against the tool's schema and
calls the feature service that does the work (caller tool relay, frame log,
tether). `CallerApi.call` is the one place a tool's failure becomes an MCP
tool error.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any, Awaitable, Callable

import mcp_types as types

from oubliette_runtime.fast_tool_calls import tool_error
from oubliette_runtime.trace_spans import current_meta
from protocol import CallerToolSpec, RelayError, build_valid, errors
from protocol.descriptors import DESCRIPTOR_META_KEY, build_descriptor
from protocol.frames import FrameType
from protocol.limits import Limits
from protocol.schema_check import first_problem
from protocol.session_keys import channel_problem

from ...core.callers import CallerConnection
from ...core.frame_log import FrameLog
from ...core.ids import strict_validator
from ...core.instances import InstanceDirectory
from ...core.server_owned import OWNER_KEY, SESSION_RECORD, refuse_server_owned
from ...core.sessions import Session, SessionRegistry, session_has_frames
from ...features.approvals import (
    ApprovalElicitation,
    ApprovalService,
    Decision,
    InputRequired,
)
from ...features.caller_tool_relay import (
    CallerCallRegistry,
    CallerToolRelay,
    NoLongerPending,
)
from ...features.tether import (
    DEFAULT_TETHER_SESSION,
    EGRESS_TYPES,
    TETHER_CHANNEL,
    Tether,
)
from ...features.turns import TurnWaits
from ...store.api import FrameStoreAPI, StoreUnavailable
from . import schemas

ToolHandler = Callable[[Any, CallerConnection, dict[str, Any]], Awaitable[dict[str, Any]]]
Access = Callable[[str, str, str], None]
"""`PolicyGate.require(principal, action, instance)`: refuse with `RelayError(DENIED)` unless permitted."""


def _anyone(principal: str, action: str, instance: str) -> None:
    """The access of an API built without a policy gate (a test, a piece embedded alone): everything."""


SESSION_CHANNEL = "mcp"


# The caller's own values each tool holds to the size and depth limits (`CallerApi._check_own_values`).
_LIMITED_FIELDS: dict[str, tuple[str, ...]] = {
    "session_message": ("message", "context"),
    "caller_tool_response": ("result", "error"),
    "approval_response": ("reason", "updated_arguments", "content", "approvals"),
}


def _http_context() -> Any:
    """The request context of an HTTP door: no MCP session, so no elicitation and no stream to watch."""
    return SimpleNamespace(protocol_version=None)


def tool_result(payload: dict[str, Any]) -> types.CallToolResult:
    """An MCP tool result carrying `payload` both as JSON text and as structured content."""
    return types.CallToolResult(
        content=[types.TextContent(text=json.dumps(payload, ensure_ascii=False))],
        structured_content=payload,
    )


class CallerApi:
    """The caller-facing tool table and its handlers.

    Needs: the instance directory, sessions, the caller tool relay and its pending calls, the
    turn waits (turns.py), the frame log, the store (a session's history), the tether, the
    approval service, the longest `wait` a `session_message` may ask for, the limits: each
    handler checks the caller's own values first, so a refusal stores nothing. `access`
    (`PolicyGate.require`) says whether the caller's HTTP principal may message, answer or read
    an instance: each handler asks it once it knows the instance, before it acts (`_may`).
    """

    def __init__(
        self,
        *,
        instances: InstanceDirectory,
        sessions: SessionRegistry,
        caller_tools: CallerToolRelay,
        calls: CallerCallRegistry,
        turns: TurnWaits,
        frame_log: FrameLog,
        store: FrameStoreAPI,
        tether: Tether,
        approvals: ApprovalService,
        session_wait_limit: float,
        limits: Limits | None = None,
        elicitation: ApprovalElicitation | None = None,
        access: Access = _anyone,
    ) -> None:
        self.access = access
        self.instances = instances
        self.sessions = sessions
        self.caller_tools = caller_tools
        self.calls = calls
        self.turns = turns
        self.frame_log = frame_log
        self.store = store
        self.tether = tether
        self.approvals = approvals
        self.elicitation = elicitation or ApprovalElicitation(approvals)
        self.session_wait_limit = session_wait_limit
        self.limits = limits or Limits()
        self.tools: dict[str, tuple[types.Tool, ToolHandler]] = {}
        self._validators: dict[str, Any] = {}
        self.add(
            "session_message", schemas.SESSION_MESSAGE_DESCRIPTION, schemas.SESSION_MESSAGE, self.session_message,
        )
        self.add(
            "caller_tool_response", schemas.CALLER_TOOL_RESPONSE_DESCRIPTION, schemas.CALLER_TOOL_RESPONSE,
            self.caller_tool_response,
        )
        self.add(
            "caller_tool_progress",
            "Report progress on a pending caller_tool_request you are still working on: the agent gets it as "
            "MCP progress (which keeps its call from timing out for inactivity).",
            schemas.CALLER_TOOL_PROGRESS, self.caller_tool_progress,
        )
        self.add(
            "approval_response", schemas.APPROVAL_RESPONSE_DESCRIPTION, schemas.APPROVAL_RESPONSE, self.approval_response,
        )
        self.add(
            "session_events",
            "Read the frames of a session after a cursor; long-polls up to wait_ms.",
            schemas.SESSION_EVENTS, self.session_events,
        )
        self.add("tether_send", schemas.TETHER_SEND_DESCRIPTION, schemas.TETHER_SEND, self.tether_send)
        self.add("tether_read", schemas.TETHER_READ_DESCRIPTION, schemas.TETHER_READ, self.tether_read)

    def add(self, name: str, description: str, schema: dict[str, Any], handler: ToolHandler) -> None:
        """Add a caller-facing tool: its descriptor, its MCP `Tool`, its handler and its compiled argument validator."""
        descriptor = build_descriptor(
            name, description=description, command=f"tools/call {name} '<arguments as JSON>'",
            origin="local", safety=schemas.SAFETY[name], input_schema=schema,
            result_schema=schemas.RESULT_SCHEMAS[name],
        ).to_dict()
        tool = types.Tool(name=name, description=description, input_schema=schema, _meta={DESCRIPTOR_META_KEY: descriptor})
        self.tools[name] = (tool, handler)
        self._validators[name] = strict_validator(schema)  # compiled once; `$` is the end of the string

    async def call(
        self, ctx: Any, caller: CallerConnection, name: str, arguments: dict[str, Any],
        resume: tuple[str, dict[str, Any] | None] | None = None,
    ) -> types.CallToolResult | types.InputRequiredResult:
        """Run the tool `name` for `caller`: arguments checked against its schema, then its handler.

        `resume` (2026-07-28) is a retry's `(requestState, inputResponses)`: the person's answers
        are applied and the interrupted `wait` goes on, instead of running the tool again. A wait
        that stops for approvals the person decides returns an `input_required` result.

        Raises: nothing for a caller's mistake: an unknown tool, invalid arguments or a handler's
        `RelayError` (limits included) come back as an MCP tool error; anything else is a bug.
        Cancellation: the handler's own (a `wait` stops waiting; what was stored stays stored).
        """
        entry = self.tools.get(name)
        if entry is None:
            return tool_error(f"unknown tool '{name}'; this server has: {', '.join(sorted(self.tools))}")
        _, handler = entry
        problem = first_problem(self._validators[name], arguments, "invalid arguments")
        if problem:
            return tool_error(f"{name}: {problem}")
        try:
            if resume is not None:
                return tool_result(await self._resume_wait(ctx, caller, *resume))
            self._check_own_values(name, arguments)
            return tool_result(await handler(ctx, caller, arguments))
        except InputRequired as need:
            return self.elicitation.result(need)
        except StoreUnavailable as err:
            return tool_error(f"{name}: {err.advice}")
        except RelayError as err:
            return tool_error(f"{name}: {err.message}")

    async def _resume_wait(
        self, ctx: Any, caller: CallerConnection, request_state: str, responses: dict[str, Any] | None
    ) -> dict[str, Any]:
        """A 2026-07-28 retry: apply the person's answers, then wait on the same turn again."""
        state = self.elicitation.read_state(request_state)
        if state is None:
            raise RelayError(errors.INVALID_PARAMS, "requestState is not one this server issued")
        session = self.sessions.get(state["instance"], state["channel"], state["session_id"])
        if session is None:
            raise RelayError(errors.NOT_FOUND, f"unknown session '{state['session_id']}'")
        session.check_owner(caller)
        self._may(caller, "answer", session.instance)
        await self.elicitation.apply_responses(caller, state, responses)
        result = dict(state.get("base") or {})
        try:
            result.update(await self.turns.wait(
                ctx, caller, session, state.get("msg_id"), int(state["after_seq"]), self.elicitation.seconds_left(state),
            ))
        except InputRequired as need:
            need.base = dict(state.get("base") or {})
            raise
        return result

    # -- who may (docs/POLICY.md, "HTTP principals") -------------------------------------------

    def _may(self, caller: CallerConnection, action: str, instance: str) -> None:
        """Refuse unless the caller's principal may `action` (message, answer, read) `instance`."""
        self.access(caller.principal, action, instance)

    def _may_answer(self, caller: CallerConnection, sessions: list[Session]) -> None:
        """Refuse an answer in sessions of an instance the caller's principal may not answer."""
        for session in sessions:
            self.access(caller.principal, "answer", session.instance)

    # -- session_message -----------------------------------------------------------------

    async def _open_session(self, instance: str, session_id: str | None, caller: CallerConnection) -> Session:
        """The caller's session `session_id`, claimed for it if nobody opened it (`SessionRegistry.claim`)."""
        return await self.sessions.claim(
            instance, SESSION_CHANNEL, session_id, caller,
            lambda session_id: session_has_frames(self.store, instance, SESSION_CHANNEL, session_id),
        )

    async def _owned(self, caller: CallerConnection, session_id: str, instance: str | None = None) -> list[Session]:
        """The caller's `mcp` sessions with this id (`SessionRegistry.owns`)."""
        return await self.sessions.owns(caller, session_id, SESSION_CHANNEL, instance)

    async def session_message(self, ctx: Any, caller: CallerConnection, args: dict[str, Any]) -> dict[str, Any]:
        """Send a message to an instance's agent, declaring the caller's tools first if given; with `wait`,
        wait (up to `session_wait_limit`) for the turn's end.

        Raises: `RelayError` for limits, an instance that cannot be resolved, or a refused
        declaration; a turn that does not end in time returns `stop_reason: "timeout"`. A message
        nothing can run yet (no guest connected anywhere, no start command) is stored all the
        same: the result says so in `notice`, and a `wait` stops after `NO_GUEST_GRACE` with
        `stop_reason: "no_guest"` and that text instead of waiting out its time.
        """
        instance = self.instances.resolve(args.get("instance"))
        self._may(caller, "message", instance)
        session = await self._open_session(instance, args.get("session_id"), caller)
        await self.approvals.sync(session)  # shared store: another server's gated call may be asking
        self._refuse_while_approval_pending(session)
        context = args.get("context")
        if context is not None:
            tools = [build_valid(tool, CallerToolSpec) for tool in context.get("caller_tools", [])]  # checked by the tool's schema
            declared = await self.caller_tools.declare(
                session, caller, context["caller_id"], tools, bool(context.get("echo_own_answers", False)),
            )
        else:
            declared = {}
        if self.caller_tools.needs_record(session, caller, declared):
            # The log records who owns the session and what it declared, so the other servers know the
            # same caller and its tools: in a frame only the server appends (server_owned.py), before
            # the message that may start the turn whose client reads it.
            await self.frame_log.record(session, SESSION_RECORD, {OWNER_KEY: caller.identity, **declared})
            self.sessions.note_owner(session, caller.identity)  # recorded: a message that declares nothing need not again
        self.sessions.follow(session, caller)
        message: dict[str, Any] = {"text": args["message"]}
        if (meta := current_meta()) is not None:
            message["_meta"] = meta  # the caller's trace, through this server's span: the agent command's TRACEPARENT
        frame = await self.frame_log.ingress(instance, session.channel, session.id, FrameType.USER_MESSAGE, message)
        result: dict[str, Any] = {
            "session_id": session.id, "instance": instance, "msg_id": frame.msg_id, "ingress_seq": frame.seq,
        }
        if caller.owner_key is not None:
            result["owner_key"] = caller.owner_key  # 2026-07-28: pass it back to act in this session again
        wait = args.get("wait", False)
        if wait is False:
            if self.turns.guest_absent is not None and (notice := await self.turns.guest_absent(instance)) is not None:
                result["notice"] = notice
            return result
        seconds = self._wait_seconds(wait)
        try:
            result.update(await self.turns.wait(
                ctx, caller, session, frame.msg_id, frame.seq, seconds, watch_guest=True,
            ))
        except InputRequired as need:
            need.base = result
            raise
        return result

    def _wait_seconds(self, wait: Any) -> float:
        """A `wait` argument's seconds: `true` is the server's limit, a number at most that."""
        limit = self.session_wait_limit
        return limit if wait is True else min(float(wait), limit)

    def _refuse_while_approval_pending(self, session: Session | None) -> None:
        """PENDING_APPROVAL: a session whose turn waits on a decision takes no new message."""
        pending = self.approvals.pending_for(session) if session is not None else []
        if pending:
            ids = ", ".join(p.request_id for p in pending)
            raise RelayError(
                errors.INVALID_REQUEST,
                f"PENDING_APPROVAL: session '{session.id}' is waiting on approval request(s) {ids}; "  # type: ignore[union-attr]
                "answer them with approval_response before sending a new message",
            )

    # -- caller_tool_response ------------------------------------------------------------

    async def caller_tool_response(self, ctx: Any, caller: CallerConnection, args: dict[str, Any]) -> dict[str, Any]:
        """Answer a pending `caller_tool_request` with `result` or `error`; with `wait`, go on waiting
        on the same turn and return its next stop, as `session_message` does.

        With `wait`, an answer to one of the caller's own requests that already ended (timed out,
        cancelled by the agent, answered before) records nothing and returns `resolved: false`,
        `not_pending` (what happened to it) and the turn's next stop: the loop goes on.
        Raises: `RelayError` for both or neither, a value over the limits (the call stays pending),
        or a request id that is not pending for this caller (without `wait`: also one that ended).
        """
        sessions = await self._owned(caller, args["session_id"])
        self._may_answer(caller, sessions)
        return await self._respond(ctx, caller, args, sessions)

    async def _respond(
        self, ctx: Any, caller: CallerConnection, args: dict[str, Any], sessions: list[Session] | None = None,
    ) -> dict[str, Any]:
        """`caller_tool_response` once its door let the answer through (the caller's `sessions`
        with this id, when looked up: a wait follows them from before the answer is stored)."""
        wait = args.get("wait", False)
        early = self.turns.following_answer(ctx, caller, sessions) if wait is not False and sessions else None
        try:
            try:
                call = await self.calls.respond(
                    caller, args["session_id"], args["request_id"], result=args.get("result"), error=args.get("error"),
                )
            except NoLongerPending as late:
                finished = late.finished
                mine = finished.caller is caller or finished.session.owner is caller or finished.session.same_caller(caller)
                if wait is False or not mine or finished.session.id != args["session_id"]:
                    raise
                answered: dict[str, Any] = {"resolved": False, "not_pending": late.message}
                session, after_seq = finished.session, finished.frame_seq
            else:
                answered = {"resolved": True}
                session, after_seq = call.session, call.frame_seq
            if wait is False:
                return answered
            answered.update(await self.turns.wait(ctx, caller, session, None, after_seq, self._wait_seconds(wait), early=early))
            return answered
        finally:
            if early is not None:
                early.hand_over(None, None)  # stops following, if the wait did not take them

    async def caller_tool_progress(self, ctx: Any, caller: CallerConnection, args: dict[str, Any]) -> dict[str, Any]:
        """Forward a progress report on a pending `caller_tool_request` to the agent's waiting call.

        `forwarded` is false when the agent's client asked for no progress on that call.
        Raises: `RelayError` for a request id that is not pending for this caller (as `caller_tool_response`).
        """
        self._may_answer(caller, await self._owned(caller, args["session_id"]))
        return await self._progress(caller, args)

    async def _progress(self, caller: CallerConnection, args: dict[str, Any]) -> dict[str, Any]:
        """`caller_tool_progress` once its door let the report through (the caller's sessions looked up)."""
        forwarded = await self.calls.progress(
            caller, args["session_id"], args["request_id"],
            args["progress"], args.get("total"), args.get("message"),
        )
        return {"forwarded": forwarded}

    # -- approval_response ---------------------------------------------------------------

    async def approval_response(self, ctx: Any, caller: CallerConnection, args: dict[str, Any]) -> dict[str, Any]:
        """Decide one approval (`request_id`, `approve`) or all of the session's (`approvals`)."""
        session = await self._approval_session(caller, args["session_id"], args.get("instance"))
        self._may(caller, "answer", session.instance)
        return await self._answer_approvals(ctx, caller, caller.id, session, args)

    async def approval_response_over_http(self, instance: str, args: dict[str, Any]) -> dict[str, Any]:
        """The HTTP door (operator's bearer token): answer for the session's owning caller, `who` "http".

        `args` is the tool's body with `session_id`; refused like the tool, with the same messages.
        """
        session, owner = await self._http_session("approval_response", instance, args, "has no approvals")
        return await self._answer_approvals(_http_context(), owner, "http", session, args)

    async def caller_tool_response_over_http(self, instance: str, args: dict[str, Any]) -> dict[str, Any]:
        """The HTTP door for `caller_tool_response`: the operator answers for the session's owning caller.

        Tether users whose program cannot hold an MCP session answer the requests it relayed here;
        refused like the tool, with the same messages.
        """
        _, owner = await self._http_session("caller_tool_response", instance, args, "has no caller tool requests")
        await self._owned(owner, args["session_id"])
        return await self._respond(_http_context(), owner, args)  # the HTTP door asked for its own principal

    async def caller_tool_progress_over_http(self, instance: str, args: dict[str, Any]) -> dict[str, Any]:
        """The HTTP door for `caller_tool_progress`, as `caller_tool_response_over_http`."""
        _, owner = await self._http_session("caller_tool_progress", instance, args, "has no caller tool requests")
        await self._owned(owner, args["session_id"])
        return await self._progress(owner, args)  # the HTTP door asked for its own principal

    async def _http_session(
        self, tool: str, instance: str, args: dict[str, Any], none: str,
    ) -> tuple[Session, CallerConnection]:
        """The owned `mcp` session an HTTP answer (`args`, the tool's body with `session_id`) is for,
        and the caller the operator answers as: its owner here, or (shared store, a session opened on
        another server) a stand-in with the owner identity the log recorded.

        Raises: `RelayError` for a body the tool's schema refuses, or a session of `instance`
        that no caller owns (`NOT_FOUND`, "… `none`").
        """
        problem = first_problem(self._validators[tool], args, "invalid body")
        if problem:
            raise RelayError(errors.INVALID_PARAMS, problem)
        self._check_own_values(tool, args)
        matches = self.sessions.find_by_id(args["session_id"], instance) \
            or await self.sessions.learn(args["session_id"], SESSION_CHANNEL, instance)
        owned = [s for s in matches if s.owner is not None]
        if owned:
            assert owned[0].owner is not None
            return owned[0], owned[0].owner
        mcp = [s for s in matches if s.channel == SESSION_CHANNEL]
        await self.sessions.load_owners(mcp)
        recorded = [s for s in mcp if s.owner_identity is not None]
        if not recorded:
            raise RelayError(errors.NOT_FOUND, f"session '{args['session_id']}' of instance '{instance}' {none}")
        stand_in = CallerConnection("http", "http-door")
        stand_in.identity = recorded[0].owner_identity or stand_in.identity
        stand_in.close()  # it follows nothing and is told nothing: it only answers
        return recorded[0], stand_in

    def _check_own_values(self, tool: str, args: dict[str, Any]) -> None:
        """This door's checks that need no I/O (the answer's form, sizes and depth), in one place and
        before any lookup: a shared store's session lookup queries the database, and an oversized or
        malformed value is refused without it (a refused answer leaves its call pending, to answer again).
        """
        if tool == "caller_tool_response":
            if args.get("error") is None and "result" not in args:
                raise RelayError(errors.INVALID_PARAMS, "give either 'result' or 'error'")
            if args.get("error") is not None and args.get("result") is not None:
                raise RelayError(errors.INVALID_PARAMS, "give 'result' or 'error', not both")
        if tool == "approval_response" and ("request_id" in args or "approve" in args) == ("approvals" in args):
            raise RelayError(
                errors.INVALID_PARAMS, "give either 'request_id' and 'approve' (one decision) or 'approvals' (all of them)",
            )
        for field in _LIMITED_FIELDS.get(tool, ()):
            if args.get(field) is not None:
                self.limits.check_value(args[field], field)

    async def _answer_approvals(
        self, ctx: Any, caller: CallerConnection, who: str, session: Session, args: dict[str, Any]
    ) -> dict[str, Any]:
        await self.sessions.load_owners([session])
        await self.approvals.sync(session)  # shared store: another server's gated call may be asking
        single = "approvals" not in args
        if single:
            if "request_id" not in args or "approve" not in args:
                raise RelayError(errors.INVALID_PARAMS, "the single form needs both 'request_id' and 'approve'")
            decision = Decision(
                approve=args["approve"], who=who, reason=args.get("reason"),
                updated_arguments=args.get("updated_arguments"), content=args.get("content"),
            )
            answered = await self.approvals.answer(caller, session.id, args["request_id"], decision)
        else:
            answers = [(item["tool_call_id"], self._batch_decision(who, item)) for item in args["approvals"]]
            answered = await self.approvals.answer_batch(caller, session, answers)
        after_seq = answered.pop("after_seq")
        wait = args.get("wait", False)
        if wait is False:
            return answered
        try:
            answered.update(await self.turns.wait(ctx, caller, session, None, after_seq, self._wait_seconds(wait)))
        except InputRequired as need:
            need.base = answered
            raise
        return answered

    @staticmethod
    def _batch_decision(who: str, item: dict[str, Any]) -> Decision:
        if item["type"] == "tool":
            return Decision(approve=True, who=who, kind="tool", tool_return=item["tool_return"], status=item["status"])
        return Decision(approve=item["approve"], who=who, reason=item.get("reason"))

    async def _approval_session(self, caller: CallerConnection, session_id: str, instance: str | None) -> Session:
        """The session an `approval_response` is for: held here, or (shared store) learned from the log;
        the caller's own first (`SessionRegistry.mine_first`: other callers' sessions of the id never hide it)."""
        mine, known = await self.sessions.mine_first(caller, session_id, SESSION_CHANNEL, instance)
        matches = mine or known
        if not matches:
            raise RelayError(errors.NOT_FOUND, f"unknown session '{session_id}'")
        if len(matches) > 1:
            raise RelayError(errors.INVALID_PARAMS, f"session '{session_id}' exists in several instances; pass 'instance'")
        return matches[0]

    # -- session_events ------------------------------------------------------------------

    async def session_events(self, ctx: Any, caller: CallerConnection, args: dict[str, Any]) -> dict[str, Any]:
        """Read a session's frames after a cursor, long-polling up to `wait_ms`.

        Raises: `RelayError` for a bad channel, an unknown instance or session, or a session id
        that exists in several instances without `instance`.
        """
        session_id = args["session_id"]
        if args.get("instance"):
            self._may(caller, "read", args["instance"])  # before any lookup, as tether_read
        channel = args.get("channel", SESSION_CHANNEL)
        problem = channel_problem(channel)
        if problem:
            raise RelayError(errors.INVALID_PARAMS, problem)
        if channel == SESSION_CHANNEL:
            # Sessions of session_message are read by their owner only; other channels are the
            # tether's, which tether_read serves to every caller anyway.
            known = await self.instances.require_known(args["instance"]) if args.get("instance") else None
            mine = await self._owned(caller, session_id, known)
            if not mine:
                raise RelayError(errors.NOT_FOUND, f"unknown session '{session_id}'")
            if len(mine) > 1:
                raise RelayError(errors.INVALID_PARAMS, f"session '{session_id}' exists in several instances; pass 'instance'")
            instance = mine[0].instance
        elif args.get("instance"):
            # Like tether_read: an instance the server has never heard of is an error, not an empty log.
            instance = await self.instances.require_known(args["instance"])
        else:
            matches = [s for s in self.sessions.find_by_id(session_id) if s.channel == channel]
            if len(matches) != 1:
                if not matches:
                    raise RelayError(errors.NOT_FOUND, f"unknown session '{session_id}'; pass 'instance' to read its log")
                raise RelayError(errors.INVALID_PARAMS, f"session '{session_id}' exists in several instances; pass 'instance'")
            instance = matches[0].instance
        self._may(caller, "read", instance)
        return await self.tether.read(
            instance, channel=channel, session_id=session_id,
            after_seq=args.get("after_seq", 0), limit=args.get("limit", 50),
            wait_ms=args.get("wait_ms", 0), types=args.get("types"),
        )

    # -- tether (docs/TETHER.md) ---------------------------------------------------------------

    async def tether_send(self, ctx: Any, caller: CallerConnection, args: dict[str, Any]) -> dict[str, Any]:
        """The tether's `tether_send`: ingress a `user.message` on the tether channel (see `Tether.send`).

        Its schema is the original tether's, open to other arguments (ignored); a key only the server writes
        is refused as at every door (server_owned.py), so nobody takes it for stored.
        """
        refuse_server_owned(None, args, "argument")
        self._may(caller, "message", args["instance"])
        return await self.tether.send(args["instance"], args["text"], args.get("session_id"))

    async def tether_read(self, ctx: Any, caller: CallerConnection, args: dict[str, Any]) -> dict[str, Any]:
        """The tether's `tether_read`: the tether session's egress frames after a cursor (see `Tether.read`).

        Raises: `RelayError` for an unknown instance or a bad session id.
        """
        self._may(caller, "read", args["instance"])  # first: a refused principal learns not even whether it exists
        instance = await self.instances.require_known(args["instance"])
        session_id = args.get("session_id", DEFAULT_TETHER_SESSION)  # checked by `Tether.read`, as every filter
        return await self.tether.read(
            instance, channel=TETHER_CHANNEL, session_id=session_id,
            after_seq=args.get("after_seq", 0), limit=args.get("limit", 50), wait_ms=args.get("wait_ms", 0),
            types=args.get("types") or list(EGRESS_TYPES), reply_to=args.get("reply_to_msg_id"),
        )
