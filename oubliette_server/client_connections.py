"""The `client`-role relay connections of each instance (the agents' `oubliette-client`s).

Caller tool declarations and toolset changes are pushed to these; the guest
connection of an instance is tracked by guest delivery instead.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Protocol

from protocol import messages, unstructure

#: Hands one progress report (progress, total, message) to the agent's waiting call; never waits.
ProgressFn = Callable[[float, "float | None", "str | None"], None]


class ClientPeer(Protocol):
    """A client connection, as far as the services that push to it care."""

    instance: str | None
    session_key: str | None
    router: Any

    def notify(self, method: str, params: dict) -> None:
        """Queue a notification; never waits on the socket (a stalled peer is closed instead)."""


class ClientConnections:
    """Live client connections by instance. Owns nothing: connections close themselves."""

    def __init__(self) -> None:
        self._by_instance: dict[str, set[ClientPeer]] = {}

    def add(self, connection: ClientPeer) -> None:
        """Track a client connection that passed `hello` (its instance must be set)."""
        assert connection.instance is not None
        self._by_instance.setdefault(connection.instance, set()).add(connection)

    def discard(self, connection: ClientPeer) -> None:
        """Stop tracking a connection; one never added is ignored."""
        if connection.instance is not None:
            self._by_instance.get(connection.instance, set()).discard(connection)

    def of_instance(self, instance: str) -> list[ClientPeer]:
        """The instance's live client connections (a copy)."""
        return list(self._by_instance.get(instance, ()))

    def __iter__(self) -> Iterator[ClientPeer]:
        for connections in list(self._by_instance.values()):
            yield from list(connections)

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
