"""Approvals put to the person at the caller's MCP client, as elicitation forms.

While a `wait` call of the owning caller is in flight and its client declared the
elicitation capability, each pending approval of the session becomes a form (what the agent
wants to run, its arguments, a boolean `approve`, an optional `reason`; for a toolset's own
elicitation, the toolset's form):

- handshake era: an `elicitation/create` request on that `wait` call (`elicit_form` with the
  call's request id), while the wait goes on;
- 2026-07-28: the `wait` call returns an `input_required` result (one input request per
  approval, keyed by its request id, and a `requestState` naming the turn); the client's
  retry carries the answers and resumes the wait.

The person's answer and the caller's `approval_response` are one decision, taken through
`ApprovalService.answer`: whichever comes first wins, the other is refused as already
resolved. Which path a server uses is `approval_delivery` (`auto`, `elicitation`, `tool`).
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any, Literal

import mcp_types as types
import trio
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from protocol import RelayError

from ...store.api import AnswerNotRecorded
from .service import (
    DELIVERIES,
    ELICITATION_WHO,
    ApprovalService,
    Decision,
    PendingApproval,
)

if TYPE_CHECKING:
    from ...core.callers import CallerConnection
    from ...core.sessions import Session

log = logging.getLogger("oubliette.server.approvals.elicitation")

Delivery = Literal["auto", "elicitation", "tool"]
DECLINED = "declined by the user"
STATE_KIND = "oubliette-turn-wait/1"
NO_ELICITATION = (
    "this server puts approvals to a person (approval_delivery = elicitation) and the caller's client "
    "offers no elicitation"
)


def approval_form(entry: PendingApproval) -> tuple[str, dict[str, Any]]:
    """The elicitation message and flat schema for one approval request."""
    if entry.form is not None:
        message = f"The tool '{entry.tool_name}' asks: {entry.form['message']}"
        return message, dict(entry.form["requestedSchema"])
    shown = json.dumps(entry.arguments, indent=2, ensure_ascii=False, sort_keys=True)
    message = (
        f"The sandboxed agent (session {entry.session.id}, instance {entry.session.instance}) wants to run "
        f"'{entry.tool_name}' with these arguments:\n{shown}\n\nApprove it?"
    )
    schema = {
        "type": "object",
        "properties": {
            "approve": {"type": "boolean", "title": "Approve", "description": f"Let the agent run {entry.tool_name}"},
            "reason": {"type": "string", "title": "Reason", "description": "Optional; the agent sees it when you deny"},
        },
        "required": ["approve"],
    }
    return message, schema


def decision_from(entry: PendingApproval, action: str, content: dict[str, Any] | None) -> Decision:
    """The person's answer as a decision: accept+approve runs the tool; anything else denies."""
    content = dict(content or {})
    if entry.form is not None:  # a toolset's own form: its content goes back to the toolset
        if action == "accept":
            return Decision(approve=True, who=ELICITATION_WHO, content=content, action="accept")
        return Decision(approve=False, who=ELICITATION_WHO, reason=DECLINED, action=action)
    reason = content.get("reason") if isinstance(content.get("reason"), str) and content.get("reason") else None
    if action == "accept" and content.get("approve") is True:
        return Decision(approve=True, who=ELICITATION_WHO, reason=reason, action="accept")
    return Decision(approve=False, who=ELICITATION_WHO, reason=reason or DECLINED, action=action)


class InputRequired(Exception):
    """A 2026-07-28 `wait` stops for approvals the person must decide: answer `input_required`.

    Raised by the turn wait; the tool handler adds what it already has (`base`), and the tool
    table turns it into the `InputRequiredResult` (`ApprovalElicitation.result`).
    """

    def __init__(self, session: Session, approvals: list[PendingApproval], msg_id: str | None, after_seq: int, deadline: float) -> None:
        super().__init__("input required")
        self.session = session
        self.approvals = approvals
        self.msg_id = msg_id
        self.after_seq = after_seq
        self.deadline = deadline
        self.base: dict[str, Any] = {}


class ApprovalElicitation:
    """Decides how a waiting caller is asked, and asks.

    Needs: the approval service and the `approval_delivery` setting. Runs no tasks of its own:
    the handshake-era forms run in the turn wait's nursery (`serve_waiting`).
    """

    def __init__(self, approvals: ApprovalService, delivery: str = "auto") -> None:
        if delivery not in DELIVERIES:
            raise ValueError(f"approval_delivery must be one of {', '.join(DELIVERIES)}; got {delivery!r}")
        self.approvals = approvals
        self.delivery = delivery

    @staticmethod
    def offered(ctx: Any) -> bool:
        """Whether the caller's client declared the elicitation capability (on this request, in 2026-07-28)."""
        session = getattr(ctx, "session", None)
        capabilities = getattr(session, "client_capabilities", None)
        return getattr(capabilities, "elicitation", None) is not None

    def route(self, ctx: Any) -> Literal["tool", "elicit", "input_required", "deny"]:
        """How approvals reach the caller of this `wait` call."""
        if self.delivery == "tool" or getattr(ctx, "session", None) is None:
            return "tool"
        if not self.offered(ctx):
            return "deny" if self.delivery == "elicitation" else "tool"
        return "input_required" if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS else "elicit"

    # -- while a wait is in flight ---------------------------------------------------------

    async def approval_stop(self, ctx: Any, caller: CallerConnection, session: Session) -> list[PendingApproval] | None:
        """Return when the wait must stop for approvals (the ones pending), never for elicited ones.

        A `tool` route stops at the first pending approval; `input_required` too (the caller
        turns them into an `input_required` result); `elicit` asks the person for each one as it
        comes and never returns; `deny` denies each one at once (fail closed) and never returns.
        """
        route = self.route(ctx)
        if route in ("tool", "input_required"):
            return await self.approvals.wait_pending(session)
        async with trio.open_nursery() as nursery:
            seen: set[str] = set()
            while True:
                for entry in self.approvals.pending_for(session):
                    if entry.request_id in seen:
                        continue
                    seen.add(entry.request_id)
                    if route == "elicit":
                        nursery.start_soon(self._elicit_one, ctx, caller, entry)
                    else:
                        nursery.start_soon(self._apply, caller, entry,
                                           Decision(approve=False, who=ELICITATION_WHO, reason=NO_ELICITATION))
                await self.approvals.wait_changed(session)

    async def _elicit_one(self, ctx: Any, caller: CallerConnection, entry: PendingApproval) -> None:
        """Ask the person about one approval; give up when it is decided another way first."""
        message, schema = approval_form(entry)
        answer: types.ElicitResult | None = None
        async with trio.open_nursery() as nursery:

            async def decided_elsewhere() -> None:
                await entry.done.wait()
                nursery.cancel_scope.cancel()  # the SDK tells the client the request is cancelled

            nursery.start_soon(decided_elsewhere)
            try:
                answer = await ctx.session.elicit_form(message, schema, related_request_id=ctx.request_id)
            except Exception as exc:  # the client refused or failed: the approval stays for approval_response
                log.warning("approval %s: elicitation failed (%s); it stays pending", entry.request_id, exc)
            nursery.cancel_scope.cancel()
        if answer is not None:
            await self._apply(caller, entry, decision_from(entry, answer.action, answer.content))

    async def _apply(self, caller: CallerConnection, entry: PendingApproval, decision: Decision) -> None:
        try:
            await self.approvals.answer(caller, entry.session.id, entry.request_id, decision)
        except AnswerNotRecorded as err:  # not stored, so not decided: it stays for approval_response
            log.warning("approval %s: the person's answer was not recorded (%s)", entry.request_id, err.message)
        except RelayError as err:  # decided another way first: that decision stands
            log.info("approval %s: the person's answer came second (%s)", entry.request_id, err.message)

    # -- 2026-07-28: input_required and its retry -------------------------------------------

    def result(self, need: InputRequired) -> types.InputRequiredResult:
        """The `input_required` result: one form per approval, and the state to resume the wait with."""
        requests: dict[str, Any] = {}
        for entry in need.approvals:
            message, schema = approval_form(entry)
            requests[entry.request_id] = types.ElicitRequest(
                params=types.ElicitRequestFormParams(message=message, requested_schema=schema)
            )
        state = {
            "kind": STATE_KIND, "instance": need.session.instance, "channel": need.session.channel,
            "session_id": need.session.id, "msg_id": need.msg_id, "after_seq": need.after_seq,
            "deadline": need.deadline, "base": need.base, "asked": [e.request_id for e in need.approvals],
        }
        return types.InputRequiredResult(input_requests=requests, request_state=json.dumps(state))

    @staticmethod
    def read_state(request_state: str) -> dict[str, Any] | None:
        """The resumed wait's state (unsealed by the SDK's `RequestStateBoundary`), or None if it is not ours."""
        try:
            state = json.loads(request_state)
        except ValueError:
            return None
        return state if isinstance(state, dict) and state.get("kind") == STATE_KIND else None

    async def apply_responses(self, caller: CallerConnection, state: dict[str, Any], responses: dict[str, Any] | None) -> None:
        """Decide each asked approval from the person's answer (an absent answer leaves it pending)."""
        for request_id in state.get("asked", []):
            response = (responses or {}).get(request_id)
            if response is None:
                continue
            action = getattr(response, "action", None) or (response.get("action") if isinstance(response, dict) else None)
            content = getattr(response, "content", None) if not isinstance(response, dict) else response.get("content")
            entry = self.approvals.find(request_id)
            if entry is None:
                log.info("approval %s was decided before the person's answer came back", request_id)
                continue
            await self._apply(caller, entry, decision_from(entry, str(action or "cancel"), content))

    @staticmethod
    def seconds_left(state: dict[str, Any]) -> float:
        """What is left of the original `wait` (wall clock: the state crosses requests)."""
        return max(0.0, float(state.get("deadline", 0)) - time.time())
