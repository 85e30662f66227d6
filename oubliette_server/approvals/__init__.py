"""Approvals (seed 002): approval requests, their decisions and their timeouts.

- `service`: `ApprovalService`, one pending entry per gated call, ended by exactly one
  decision (the owning caller's answer, the person's answer to an elicitation, the timeout,
  the caller's disconnect, the agent's cancel), each recorded as an `approval_resolved` frame.
- `elicitation`: `ApprovalElicitation`, which puts pending approvals to the person at the
  caller's MCP client while a `wait` call is in flight (`approval_delivery`).
- `gate`: `ConnectionApprovals`, approvals a sandbox connection asks for (the agent's own
  actions, gated toolset tools), decided by the owning caller of the connection's session.
"""

from .elicitation import DELIVERIES, ApprovalElicitation, InputRequired
from .gate import ConnectionApprovals
from .service import DEFAULT_APPROVAL_TIMEOUT, ELICITATION_WHO, ApprovalService, Decision, PendingApproval

__all__ = [
    "DEFAULT_APPROVAL_TIMEOUT", "DELIVERIES", "ELICITATION_WHO", "ApprovalElicitation", "ApprovalService",
    "ConnectionApprovals", "Decision", "InputRequired", "PendingApproval",
]
