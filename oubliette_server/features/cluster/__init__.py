"""What several servers sharing one store do together (docs/SCALING.md): the log as the bus
between them (`log_bus`), which server holds each instance's guest (`leases`) and closing the
requests a dead server left open (`abandoned_requests`), and the one tail of the log per server
that pushes other servers' frames to the callers connected here (`log_tail`).

With one server (SQLite) these do nothing; the features call them the same way either way.
"""

from .abandoned_requests import AbandonedRequests
from .leases import InstanceLeases, holds_lease
from .log_bus import LogBus
from .log_tail import LogTail

__all__ = ["AbandonedRequests", "InstanceLeases", "LogBus", "LogTail", "holds_lease"]
