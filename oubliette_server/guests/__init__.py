"""The guest side of an instance, seen from the server.

- `delivery`: the one guest connection of each instance and the `user.message` frames fed to it;
- `wake`: start an instance's guest when a message arrives and it is not connected;
- `frames`: the frames a guest may append (`append_frame`) and its `ack`s;
- `orphans`: a guest that goes away mid-turn: its turns end with `session.error`;
- `failed_starts`: a start command that fails: the turns waiting for it end with `session.error`;
- `presence`: whether a message can reach a guest, and what to tell a caller when it cannot;
- `leases`: with a shared store, which server holds each instance's guest (a lease in the database).
"""

from .delivery import GuestDelivery
from .failed_starts import FailedStarts
from .guest_frames import GUEST_FRAME_TYPES, GuestFrames
from .leases import InstanceLeases, LeaseStore
from .orphans import OrphanedTurns
from .presence import GuestPresence
from .instance_starter import InstanceStarter

__all__ = [
    "GUEST_FRAME_TYPES", "FailedStarts", "GuestDelivery", "GuestFrames", "GuestPresence", "InstanceLeases", "InstanceStarter",
    "LeaseStore", "OrphanedTurns",
]
