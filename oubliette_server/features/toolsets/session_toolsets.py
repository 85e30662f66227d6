"""Toolset sessions: one ToolRouter per agent session, shared by that session's client connections.

A session is a client connection's `channel:session_id` (or the connection
itself when it is bound to none). The first connection of a session makes its
router, which binds the toolsets the instance is allowed; the last one to go
stops it, and with it the per-session toolsets it spawned. Registry changes
rebind the routers and `push` tells the connections whose list changed.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Protocol

from .registry import ToolsetRegistry
from .router import ToolRouter


class RouterHolder(Protocol):
    """A client connection, as far as toolsets care (its router is kept here, not on it)."""

    instance: str | None
    session_key: str | None


Push = Callable[[ToolRouter], Awaitable[None]]


class ToolsetSessions:
    """One `ToolRouter` per agent session, shared by that session's client connections.

    Owns: the routers; the last connection of a session to detach stops its router (in the
    nursery given to `detach`). Needs: the registry, the separator, and `push(router)` to
    tell the connections of a router whose list changed.
    """

    def __init__(self, registry: ToolsetRegistry, separator: str, push: Push) -> None:
        self.registry = registry
        self.separator = separator
        self._push = push
        self._routers: dict[tuple[str, str], ToolRouter] = {}
        self._router_of: dict[RouterHolder, ToolRouter] = {}

    @staticmethod
    def _key(connection: RouterHolder) -> tuple[str, str]:
        assert connection.instance is not None
        return connection.instance, connection.session_key or f"connection:{id(connection)}"

    async def attach(self, connection: RouterHolder) -> ToolRouter:
        """Give the connection its session's router, bound to what the instance is allowed."""
        key = self._key(connection)
        router = self._routers.get(key)
        if router is None:
            router = self._routers[key] = ToolRouter(self.separator, f"{key[0]}/{key[1]}")
        router.references += 1
        self._router_of[connection] = router
        # A new router binds here; an existing one may still be binding for the session's
        # first connection: this waits for that (and is a no-op rebind otherwise).
        await router.bind(self.registry.allowed_definitions(key[0]))
        return router

    def detach(self, connection: RouterHolder, start_soon: Callable[[Callable[[], Awaitable[Any]]], object]) -> None:
        """The connection is gone; the session's last one stops the router (a task `start_soon` starts)."""
        router = self._router_of.pop(connection, None)
        if router is None:
            return
        router.references -= 1
        if router.references == 0:
            key = self._key(connection)
            if self._routers.get(key) is router:
                del self._routers[key]
            start_soon(router.stop)

    def router_of(self, connection: RouterHolder) -> ToolRouter | None:
        """The router of the connection's session, or None when it is not attached."""
        return self._router_of.get(connection)

    async def refresh(self, instance: str | None = None) -> None:
        """Rebind every router (of one instance) and push the lists that changed."""
        for (router_instance, _), router in list(self._routers.items()):
            if instance is not None and router_instance != instance:
                continue
            if await router.bind(self.registry.allowed_definitions(router_instance)):
                await self._push(router)
