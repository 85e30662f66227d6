"""What several servers sharing one store do together (docs/SCALING.md): the log as the bus
between them (`log_bus`), which server holds each instance's guest (`leases`) and closing the
requests a dead server left open (`abandoned_requests`).

With one server (SQLite) these do nothing; the features call them the same way either way.
"""

from .abandoned_requests import AbandonedRequests
from .leases import InstanceLeases
from .log_bus import LogBus

__all__ = ["AbandonedRequests", "InstanceLeases", "LogBus"]
