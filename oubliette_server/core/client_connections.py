"""The `client`-role relay connections of each instance (the agents' `oubliette-client`s).

Caller tool declarations and toolset changes are pushed to these; the guest
connection of an instance is tracked by guest delivery instead. An instance may have at most
`max_client_connections` of them on this server (docs/SECURITY.md, "Declaration fan-out"):
each declaration goes to every one, so their number is what one declaration costs.
"""

from __future__ import annotations

from typing import Callable, Iterator, Protocol

from oubliette_runtime.state_changes import StateChanges
from protocol import EncodedNotification, RelayError, errors, messages, unstructure

#: Client connections one instance may have on one server: far more than the agents (one
#: `oubliette-client` each) a sandbox runs at once, few enough that one declaration pushed to
#: every one stays cheap.
DEFAULT_MAX_CLIENT_CONNECTIONS = 64

#: Hands one progress report (progress, total, message) to the agent's waiting call; never waits.
ProgressFn = Callable[[float, "float | None", "str | None"], None]


class ClientPeer(Protocol):
    """A client connection, as far as the services that push to it care."""

    instance: str | None
    session_key: str | None

    def notify(self, method: str, params: dict) -> None:
        """Queue a notification; never waits on the socket (a stalled peer is closed instead)."""

    def notify_encoded(self, note: EncodedNotification) -> None:
        """Queue a notification encoded once for many connections; never waits, like `notify`."""


class ClientConnections:
    """Live client connections by instance, at most `max_per_instance` each. Owns nothing:
    connections close themselves. `changed` is signalled as each connection is added or
    discarded (what a test waits on to know a closed connection's place is free)."""

    def __init__(self, max_per_instance: int = DEFAULT_MAX_CLIENT_CONNECTIONS) -> None:
        self.max_per_instance = max_per_instance
        self._by_instance: dict[str, set[ClientPeer]] = {}
        self.changed = StateChanges()

    def add(self, connection: ClientPeer) -> None:
        """Track a client connection that passed `hello` (its instance must be set).

        Raises `RelayError(DENIED)` when the instance already has `max_per_instance` (the hello
        is refused with it; the client tries again later, when one may have ended).
        """
        assert connection.instance is not None
        connections = self._by_instance.setdefault(connection.instance, set())
        if connection not in connections and len(connections) >= self.max_per_instance:
            raise RelayError(errors.DENIED, (
                f"instance {connection.instance!r} already has {len(connections)} client connections on this server, "
                f"the limit (max_client_connections); close one or raise the limit"))
        connections.add(connection)
        self.changed.changed()

    def discard(self, connection: ClientPeer) -> None:
        """Stop tracking a connection; one never added is ignored."""
        if connection.instance is not None:
            self._by_instance.get(connection.instance, set()).discard(connection)
            self.changed.changed()

    def of_instance(self, instance: str) -> list[ClientPeer]:
        """The instance's live client connections (a copy)."""
        return list(self._by_instance.get(instance, ()))

    def __iter__(self) -> Iterator[ClientPeer]:
        for connections in list(self._by_instance.values()):
            yield from list(connections)

    def count(self) -> int:
        """How many client connections are live now, over all instances."""
        return sum(len(connections) for connections in self._by_instance.values())

    def instances(self) -> list[str]:
        """Instances with at least one live client connection."""
        return [name for name, conns in self._by_instance.items() if conns]


def progress_sink(connection: ClientPeer, ref: str | None) -> ProgressFn | None:
    """Progress reports for the client's request `ref`, as `progress` notifications (None without a ref)."""
    if ref is None:
        return None

    def send(progress: float, total: float | None, message: str | None) -> None:
        report = messages.Progress(ref=ref, progress=progress, total=total, message=message)
        connection.notify(messages.PROGRESS, unstructure(report))  # queued: never waits on a socket

    return send
