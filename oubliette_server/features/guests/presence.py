"""Whether an instance's messages can reach a guest, and what to say when they cannot.

A message for an instance with no guest connected, and no start command to bring one up,
waits in the log until a guest connects: nothing is wrong with the message, but a caller
that waits on its turn would wait out its whole `wait` in silence (a mistyped instance name
looks exactly like this). `GuestPresence.absent` says so in words a model can act on.

With a shared store (PostgreSQL, several servers) the guest may be connected to another
server: "no guest" means no server holds the instance's live lease (cluster/leases.py).
"""

from __future__ import annotations

from typing import Awaitable, Callable, Iterable

#: `lease_holder(instance)`: the server holding the instance's live lease, or None (shared store).
LiveHolder = Callable[[str], Awaitable[str | None]]


class GuestPresence:
    """Answers "can a message for this instance be run, now or once its start command ran?"

    Needs: `guest_here(instance)` (a guest connected to this server), `start_command(instance)`
    from the config, the instance names worth suggesting (`known()`: configured or seen, with the
    connected ones in `connected()`), and with a shared store `live_holder(instance)`.
    """

    def __init__(
        self,
        guest_here: Callable[[str], bool],
        start_command: Callable[[str], list[str] | None],
        known: Callable[[], Iterable[str]],
        connected: Callable[[], Iterable[str]],
        live_holder: LiveHolder | None = None,
    ) -> None:
        self._guest_here = guest_here
        self._start_command = start_command
        self._known = known
        self._connected = connected
        self._live_holder = live_holder

    async def connected_anywhere(self, instance: str) -> bool:
        """Whether a guest of `instance` is connected here or (shared store) to another live server."""
        if self._guest_here(instance):
            return True
        return self._live_holder is not None and await self._live_holder(instance) is not None

    async def absent(self, instance: str) -> str | None:
        """Why a message for `instance` cannot run now, with what to do; None when it can (a guest
        is connected somewhere, or the instance has a start command: a failed start is reported
        by the start itself)."""
        if self._start_command(instance) or await self.connected_anywhere(instance):
            return None
        connected = set(self._connected())
        others = sorted((set(self._known()) | connected) - {instance})
        if others:
            listed = ", ".join(f"{name} (connected)" if name in connected else name for name in others)
            names = f"the instances this server knows: {listed}"
        else:
            names = "this server knows no other instance"
        return (
            f"no guest is connected to instance '{instance}' and it has no start command, so nothing runs the "
            "message yet. It is stored and will be delivered when a guest connects. To fix: start a guest in the "
            f"sandbox with `oubliette-client run --instance {instance} -- AGENT_COMMAND` (its token: "
            f"`oubliette-server token {instance}`), or give the instance a start command in the server's config; "
            f"or check the instance name ({names}; the server's /v1/health lists the connected ones). "
            "Then read this turn's end with session_events (types ['assistant.done', 'session.error'], wait_ms)."
        )
