"""The pending-request engine: the one home of requests that wait for exactly one outcome.

Caller tool requests (caller_tool_relay/pending.py) and approvals (approvals/service.py) are
both requests a caller answers, and both are a `PendingRequests` (service.py): the engine asks,
waits here or in the log, stores answers under the request's claim and adopts the outcome that
won; each kind says only its payloads and decision rules. Entries are kept in a `RequestBook`
(what is pending here, what another server asked through the shared log, what ended and how,
who waits for a change), and cross servers only through the `Crossing` (`SingleServer` does
nothing; with a shared store `SharedStore` reads and stores through the log). No kind asks
whether the store is shared: the composition root (app.py) picks the crossing once.
"""

from .book import RESOLVED_MEMORY, Pending, RequestBook
from .crossing import Crossing, SharedLog, SharedStore, SingleServer
from .service import SERVER_SHUTDOWN, Ends, PendingRequests, shut_down

__all__ = [
    "RESOLVED_MEMORY", "SERVER_SHUTDOWN", "Crossing", "Ends", "Pending", "PendingRequests", "RequestBook", "SharedLog", "SharedStore",
    "SingleServer", "shut_down",
]
