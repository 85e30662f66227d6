"""Which instances exist: configured, connected since start, or with frames in the log; with a
shared store, also connected to another server of the deployment (its guest lease).

Callers name an instance or let the server pick the only connected one; the
tether refuses instances nobody has heard of. This module answers those
questions from narrow inputs (names, a last-seq lookup, a list of connected
instances) and knows nothing about connections themselves.
"""

from __future__ import annotations

from typing import Awaitable, Callable, Iterable

from protocol import RelayError, errors

from .auth import check_instance_id


class InstanceDirectory:
    """Answers "is this instance known", "which are connected", "which one did the caller mean".

    Needs: the configured instance names, `last_seq(instance)` of the frame log,
    `connected()` listing instances with a live guest or client connection, and, with a shared
    store, `held_elsewhere(instance)`: whether any server of the deployment holds its guest
    lease (docs/SCALING.md, "Which instances a server knows").
    Raises: `RelayError` (INVALID_PARAMS, NOT_FOUND) with a message a caller can act on.
    """

    def __init__(
        self,
        configured: Iterable[str],
        last_seq: Callable[[str], Awaitable[int]],
        connected: Callable[[], Iterable[str]],
        held_elsewhere: Callable[[str], Awaitable[bool]] | None = None,
    ) -> None:
        self._configured = set(configured)
        self._last_seq = last_seq
        self._connected = connected
        self._held_elsewhere = held_elsewhere
        self._seen: set[str] = set()

    def saw(self, instance: str) -> None:
        """An instance connected (it stays known for the life of the process)."""
        self._seen.add(instance)

    async def known(self, instance: str) -> bool:
        """Whether the server has heard of `instance`: configured, connected since start, with frames,
        or (shared store) its guest connected to a server of the deployment (its lease exists)."""
        if instance in self._configured or instance in self._seen or await self._last_seq(instance) > 0:
            return True
        return self._held_elsewhere is not None and await self._held_elsewhere(instance)

    def named(self) -> list[str]:
        """The instances known by name without reading the log (configured, or connected since start), sorted."""
        return sorted(self._configured | self._seen)

    def connected_instances(self) -> list[str]:
        """The instances with a live connection, sorted."""
        return sorted(set(self._connected()))

    async def require_known(self, instance: str) -> str:
        """`instance` if it is a valid id the server knows; otherwise a clear error."""
        reason = check_instance_id(instance)
        if reason:
            raise RelayError(errors.INVALID_PARAMS, reason)
        if not await self.known(instance):
            raise RelayError(
                errors.NOT_FOUND,
                f"unknown instance '{instance}': it is not configured, has not connected"
                f"{' to any server' if self._held_elsewhere is not None else ''}, and has no frames",
            )
        return instance

    def resolve(self, instance: str | None) -> str:
        """The given instance, or the only connected one; otherwise a clear error."""
        if instance:
            reason = check_instance_id(instance)
            if reason:
                raise RelayError(errors.INVALID_PARAMS, reason)
            return instance
        connected = self.connected_instances()
        if len(connected) == 1:
            return connected[0]
        if not connected:
            raise RelayError(errors.NOT_FOUND, "no instance is connected; pass 'instance' explicitly")
        raise RelayError(
            errors.INVALID_PARAMS,
            f"several instances are connected ({', '.join(connected)}); pass 'instance' to choose one",
        )
