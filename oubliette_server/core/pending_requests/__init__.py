"""The pending-request engine: the one home of requests that wait for exactly one outcome.

Caller tool requests (caller_tool_relay/pending.py) and approvals (approvals/service.py) are
both requests a caller answers: each keeps its entries in a `RequestBook` (what is pending
here, what another server asked through the shared log, what ended and how, who waits for a
change) and crosses servers only through its `Crossing` (`SingleServer` does nothing; with a
shared store `SharedStore` reads and stores through the log). No feature asks whether the
store is shared: the composition root (app.py) picks the crossing once.
"""

from .book import RESOLVED_MEMORY, RequestBook
from .crossing import Crossing, SharedLog, SharedStore, SingleServer
from .service import SERVER_SHUTDOWN, PendingRequests, shut_down

__all__ = [
    "RESOLVED_MEMORY", "SERVER_SHUTDOWN", "Crossing", "PendingRequests", "RequestBook", "SharedLog", "SharedStore",
    "SingleServer", "shut_down",
]
