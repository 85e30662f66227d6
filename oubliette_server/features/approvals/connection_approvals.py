"""Approvals asked for by a sandbox connection: the owning caller of the connection's session decides.

Two gates go through here: the agent's own actions (the `approval` relay method, which
`oubliette-client`'s `permission_prompt` tool sends; origin "agent") and gated toolset tools
(origin "toolset"). A client connection is bound to one session (`OUBLIETTE_SESSION`); that
session's owner is the only one who may decide. Everything else fails closed: a connection
bound to no session, a session nobody opened, an owner that is not connected (with a shared
store: not connected to any server; an owner on another server decides through the log).
"""

from __future__ import annotations

import logging
from typing import Any

from protocol import SessionRef, messages

from ...core.client_connections import ClientPeer
from ...core.sessions import Session, SessionRegistry
from .service import ApprovalService, Decision, Origin

log = logging.getLogger("oubliette.server.approvals")


class ConnectionApprovals:
    """Ask the owning caller of a client connection's session for a decision.

    Needs: the session registry and the approval service. Runs no tasks; each request is
    waited for by the task of the call it gates.
    Raises: nothing of its own; a decision that could not be asked for is a denial with the reason.
    Cancellation: as `ApprovalService.request` (the approval is decided "cancelled").
    """

    def __init__(self, sessions: SessionRegistry, approvals: ApprovalService) -> None:
        self.sessions = sessions
        self.approvals = approvals

    def session_of(self, connection: ClientPeer) -> Session | None:
        """The session the connection is bound to, if it is bound to one the server knows."""
        if connection.instance is None or connection.session_key is None:
            return None
        ref = SessionRef.parse_key(connection.session_key)
        return self.sessions.get(connection.instance, ref.channel, ref.id)

    async def decide(
        self,
        connection: ClientPeer,
        tool_name: str,
        arguments: dict[str, Any],
        *,
        origin: Origin,
        timeout: float | None = None,
        input_schema: dict[str, Any] | None = None,
        tool_use_id: str | None = None,
        policy: dict[str, Any] | None = None,
    ) -> Decision:
        """Wait for the owning caller's decision on `tool_name`; a denial when nobody can decide
        (`policy`: the policies' decision the `approval_request` carries)."""
        session = self.session_of(connection)
        if session is None:
            why = (
                "this oubliette-client is bound to no session (OUBLIETTE_SESSION)"
                if connection.session_key is None
                else f"session '{connection.session_key}' has not been opened by any caller"
            )
            log.info("%r: %s '%s' denied: %s", connection, origin, tool_name, why)
            return Decision(approve=False, who="no-owner", reason=f"{why}; nobody can approve '{tool_name}'")
        return await self.approvals.request(
            session, tool_name, arguments, origin=origin, caller=session.owner, timeout=timeout,
            input_schema=input_schema, tool_use_id=tool_use_id, policy=policy,
        )

    async def agent_approval(self, connection: ClientPeer, ask: messages.AgentApproval) -> messages.AgentApprovalResult:
        """The `approval` relay method: the agent's own action, decided by the session's owner."""
        decision = await self.decide(
            connection, ask.tool_name, ask.arguments, origin="agent", tool_use_id=ask.tool_use_id,
        )
        if not decision.approve:
            return messages.AgentApprovalResult(approve=False, reason=decision.reason or "denied, no reason given")
        return messages.AgentApprovalResult(approve=True, updated_arguments=decision.updated_arguments)
