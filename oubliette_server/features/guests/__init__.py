"""The guest side of an instance, seen from the server.

- `delivery`: the one guest connection of each instance and the `user.message` frames fed to it;
- `instance_starter`: start an instance's guest when a message arrives and it is not connected;
- `guest_frames`: the frames a guest may append (`append_frame`) and its `ack`s;
- `orphans`: a guest that goes away mid-turn: its turns end with `session.error`;
- `failed_starts`: a start command that fails: the turns waiting for it end with `session.error`;
- `presence`: whether a message can reach a guest, and what to tell a caller when it cannot.

Which server holds each instance's guest with a shared store is `cluster.leases`.
"""

from .delivery import GuestDelivery
from .failed_starts import FailedStarts
from .guest_frames import GUEST_FRAME_TYPES, GuestFrames
from .instance_starter import InstanceStarter
from .orphans import OrphanedTurns
from .presence import GuestPresence

__all__ = [
    "GUEST_FRAME_TYPES", "FailedStarts", "GuestDelivery", "GuestFrames", "GuestPresence", "InstanceStarter", "OrphanedTurns",
]
