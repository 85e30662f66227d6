"""A toolset's own elicitation, forwarded to the caller that owns the calling session.

An MCP toolset that asks for input during a call (`elicitation/create`) gets its form put to
the owning caller as an `approval_request` with origin `toolset` and the form (`elicitation`:
`message`, `requestedSchema`). It is answered on the same path as any approval: by the person
in the caller's MCP client (`ApprovalElicitation`), or with `approval_response` (`approve`
with `content`, or a denial). The answer goes back to the toolset: accept with the content,
decline, or cancel (timeout, the caller gone, the agent's cancel).
"""

from __future__ import annotations

import logging
from typing import Any

from protocol import SessionRef

from ...core.client_connections import ClientPeer
from ...core.sessions import SessionRegistry
from .service import ApprovalService

log = logging.getLogger("oubliette.server.approvals.toolset_forms")

NOT_ASKED = ("timeout", "cancelled", "disconnect", "server_shutdown")


class ToolsetForms:
    """Puts toolsets' forms to their session's caller. Needs: the sessions and the approval service."""

    def __init__(self, sessions: SessionRegistry, approvals: ApprovalService) -> None:
        self.sessions = sessions
        self.approvals = approvals

    async def ask(
        self, connection: ClientPeer, tool_name: str, arguments: dict[str, Any], message: str, schema: dict[str, Any]
    ) -> dict[str, Any]:
        """The form's answer, `{"action": ..., "content"?: ...}`; cancel when no caller owns the session."""
        session = None
        if connection.instance is not None and connection.session_key is not None:
            ref = SessionRef.parse_key(connection.session_key)
            session = self.sessions.get(connection.instance, ref.channel, ref.id)
        if session is None or session.owner is None:
            log.warning("toolset tool %s asked for input outside a caller's session; cancelled", tool_name)
            return {"action": "cancel"}
        decision = await self.approvals.request(
            session, tool_name, arguments, origin="toolset", caller=session.owner,
            form={"message": message, "requestedSchema": schema},
        )
        if decision.approve:
            return {"action": "accept", "content": decision.content or {}}
        if decision.action == "cancel" or decision.who in NOT_ASKED:
            return {"action": "cancel"}
        return {"action": "decline"}
