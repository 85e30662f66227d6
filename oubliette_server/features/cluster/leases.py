"""Instance presence as a lease (PostgreSQL store): which server holds each instance's guest.

With several servers on one database, an instance's guest connection is recorded in the
database as a lease that expires unless its server renews it (docs/SCALING.md, "Instance
leases"). A guest that connects takes its instance's lease over, whoever held it: as on one
server, the newer guest connection wins. The server that lost the lease stops delivering to
its guest at once (`holds`, asked before each delivery) and closes that connection at its
next renewal. A server that died simply stops renewing; the next guest takes the lease.

Owns: a nursery (start it with `await nursery.start(leases.serve)`) with the renewal task,
which renews every lease of this server (its own, saying it is alive, and its instances') in
one transaction every `ttl / 3` seconds, and the short release tasks. Needs: the PostgreSQL store's lease methods, this server's id, and
guest delivery (which knows the guests connected here). Raises: `StoreUnavailable` from
`take` (the guest's hello is refused: the database decides who holds an instance).
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable

import trio

from ...core.task_host import TaskHost
from ...store.api import LeaseStore, StoreUnavailable
from ..guests.delivery import GuestDelivery, GuestPeer

log = logging.getLogger("oubliette.server.guests")


def holds_lease(store: LeaseStore, server_id: str) -> Callable[[str], Awaitable[bool]]:
    """`holds(instance)`: whether this server still holds `instance`'s lease (no other server
    took it). Guest delivery asks it before each batch; it needs only the store, so delivery can
    be built before the leases that read delivery's guests."""

    async def holds(instance: str) -> bool:
        return await store.lease_holder(instance) in (server_id, None)

    return holds


class InstanceLeases:
    """This server's leases of the instances whose guests are connected to it."""

    def __init__(self, store: LeaseStore, server_id: str, ttl: float, delivery: GuestDelivery) -> None:
        if not ttl > 0:
            raise ValueError(f"lease_ttl must be a positive number of seconds; got {ttl!r}")
        self.store = store
        self.server_id = server_id
        self.ttl = ttl
        self.delivery = delivery
        self.holds = holds_lease(store, server_id)
        """Whether this server still holds `instance`'s lease (no other server took it)."""
        self._tasks = TaskHost()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Renew this server's leases every `ttl / 3` seconds until cancelled."""
        await self.renew()  # this server's own lease exists before any request names it
        async with trio.open_nursery() as nursery:
            await nursery.start(self._tasks.serve)
            task_status.started()
            while True:
                # A heartbeat on a clock, not a wait for an event: the lease's expiry is what
                # tells the other servers this one died.
                await trio.sleep(self.ttl / 3)
                await self.renew()

    async def take(self, connection: GuestPeer) -> None:
        """A guest connected here: take its instance's lease (from another server if need be)."""
        assert connection.instance is not None
        previous = await self.store.take_lease(connection.instance, self.server_id, self.ttl)
        if previous is not None:
            log.warning("%r takes instance %s over from server %s", connection, connection.instance, previous)

    async def held_anywhere(self, instance: str) -> bool:
        """Whether a server of the deployment holds (or held, and died without releasing) a lease
        of `instance`: its guest has connected, so the instance exists for every server."""
        return await self.store.lease_holder(instance) is not None

    async def live_holder(self, instance: str) -> str | None:
        """The server holding `instance`'s live lease (its guest is connected there), or None."""
        return await self.store.lease_holder(instance, live=True)

    async def not_held_elsewhere(self, instance: str) -> bool:
        """Whether no other server holds a live lease of `instance`: only then may this server run
        its start command (wake on message), else a second guest would take the instance over."""
        holder = await self.store.lease_holder(instance, live=True)
        return holder is None or holder == self.server_id

    async def renew(self) -> None:
        """Renew this server's own lease and its instances' in one transaction; close the guests
        whose lease another server took."""
        instances = self.delivery.connected_instances()
        try:
            held = await self.store.renew_leases(self.server_id, instances, self.ttl)
        except StoreUnavailable as exc:
            log.warning("could not renew this server's lease, nor those of its %d instance(s): %s", len(instances), exc)
            return
        for instance in set(instances) - held:
            guest = self.delivery.guest_for(instance)
            if guest is not None:
                log.warning("another server took instance %s over: closing its guest %r here", instance, guest)
                guest.close_soon()

    def release_soon(self, instance: str) -> None:
        """The instance's guest left this server: drop the lease, unless a new guest came meanwhile
        (once the server is stopping, it expires by itself)."""
        self._tasks.start_soon(self._release, instance)

    async def _release(self, instance: str) -> None:
        if self.delivery.guest_for(instance) is not None:
            return
        try:
            await self.store.release_lease(instance, self.server_id)
        except StoreUnavailable as exc:  # it expires by itself
            log.warning("could not release the lease of %s: %s", instance, exc)
