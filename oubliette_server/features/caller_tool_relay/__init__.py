"""The caller tool relay: the agent calls a tool that the caller declared (docs/ARCHITECTURE.md,
"The path of one relayed call").

- `declarations`: which caller tools each session has and which client connection sees them;
  the `caller_tool` relay method.
- `pending`: one pending entry per relayed call, ended by exactly one outcome.
- `restart`: on start, requests a previous run left open get `caller_tool_cancelled` (server restarted).

With a shared store (PostgreSQL) the log carries declarations, requests and outcomes between
servers: `cluster.log_bus`.
"""

from .declarations import CallerToolRelay
from .pending import CallerCallRegistry, Finished, NoLongerPending, PendingCall
from .restart import cancel_unanswered_requests

__all__ = [
    "CallerCallRegistry", "CallerToolRelay", "Finished", "NoLongerPending", "PendingCall", "cancel_unanswered_requests",
]
