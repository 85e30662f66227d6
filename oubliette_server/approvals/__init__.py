"""Approvals (seed 002): approval requests, their decisions and their timeouts.

- `service`: `ApprovalService`, one pending entry per gated call, ended by exactly one
  decision (the owning caller's answer, the timeout, the caller's disconnect, the agent's
  cancel), each recorded as an `approval_resolved` frame.
- `gate`: `ConnectionApprovals`, approvals a sandbox connection asks for (the agent's own
  actions, gated toolset tools), decided by the owning caller of the connection's session.
"""

from .gate import ConnectionApprovals
from .service import DEFAULT_APPROVAL_TIMEOUT, ApprovalService, Decision, PendingApproval

__all__ = ["DEFAULT_APPROVAL_TIMEOUT", "ApprovalService", "ConnectionApprovals", "Decision", "PendingApproval"]
