"""Approvals (docs/APPROVALS.md): approval requests, their decisions and their timeouts.

- `service`: `ApprovalService`, one pending entry per gated call, ended by exactly one
  decision (the owning caller's answer, the person's answer to an elicitation, the timeout,
  the caller's disconnect, the agent's cancel), each recorded as an `approval_resolved` frame.
- `elicitation`: `ApprovalElicitation`, which puts pending approvals to the person at the
  caller's MCP client while a `wait` call is in flight (`approval_delivery`).
- `gate`: `ConnectionApprovals`, approvals a sandbox connection asks for (the agent's own
  actions, gated toolset tools), decided by the owning caller of the connection's session.

The names below are imported on first use (PEP 562): `elicitation` needs the MCP SDK, which the
command line's `--help` and `token` must not pay for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from protocol import lazy_exports

if TYPE_CHECKING:
    from .connection_approvals import ConnectionApprovals
    from .elicitation import ApprovalElicitation, InputRequired
    from .service import (
        DEFAULT_APPROVAL_TIMEOUT,
        DELIVERIES,
        ELICITATION_WHO,
        ApprovalService,
        Decision,
        PendingApproval,
    )

__all__ = [
    "DEFAULT_APPROVAL_TIMEOUT", "DELIVERIES", "ELICITATION_WHO", "ApprovalElicitation", "ApprovalService",
    "ConnectionApprovals", "Decision", "InputRequired", "PendingApproval",
]

_MODULE_OF = {
    "ApprovalElicitation": ".elicitation", "InputRequired": ".elicitation", "ConnectionApprovals": ".connection_approvals",
    **{name: ".service" for name in (
        "DEFAULT_APPROVAL_TIMEOUT", "DELIVERIES", "ELICITATION_WHO", "ApprovalService", "Decision", "PendingApproval",
    )},
}


__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF, __all__, globals())
