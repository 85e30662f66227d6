"""The guest rooms alone: `GuestDelivery` (feeds an instance's guest its messages from a durable
cursor) and `GuestFrames` (what a guest may append, a turn ends once), with a fake guest
connection (tests/support/fakes.py) on the in-memory store. The room is named in every failure.
(The same through the real programs: tests/client/test_guest.py, tests/server/features/test_orphans.py.)
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import trio
import trio.testing

from fakes import FakeRelayConnection
from oubliette_server.core.frame_log import FrameLog
from oubliette_server.features.guests.delivery import GUEST_CURSOR, GuestDelivery
from oubliette_server.features.guests.failed_starts import FailedStarts
from oubliette_server.features.guests.guest_frames import GuestFrames
from oubliette_server.features.guests.orphans import OrphanedTurns
from oubliette_server.core.sessions import SessionRegistry
from oubliette_server.store.sqlite import FrameStore
from oubliette_server.store.api import FrameQuery, StoreUnavailable
from protocol import Frame, RelayError, errors, messages

INSTANCE = "box1"
BOUND = 5.0


class Guests:
    """Guest delivery and guest frames over one in-memory store; `undeliverable` lists what
    delivery reported as `(instance, seq, reason)`."""

    def __init__(self, holds: Any = None) -> None:
        self.store = FrameStore.in_memory()
        self.sessions = SessionRegistry()
        self.log = FrameLog(self.store, self.sessions)
        self.undeliverable: list[tuple[str, int, str]] = []
        self.delivery = GuestDelivery(self.store, self.report, holds)
        self.frames = GuestFrames(self.sessions, self.log.append, self.delivery, self.store)

    async def report(self, instance: str, frame: Frame, reason: str) -> None:
        self.undeliverable.append((instance, frame.seq, reason))

    async def message(self, text: str, msg_id: str, session_id: str = "s1") -> Frame:
        """A `user.message` from outside the sandbox."""
        return await self.log.ingress(INSTANCE, "mcp", session_id, "user.message", {"text": text}, msg_id=msg_id)

    async def stored(self) -> list[Frame]:
        return await self.store.query(INSTANCE, FrameQuery(limit=200))


@pytest.fixture
def guests() -> Guests:
    return Guests()


def delivered_ids(guest: FakeRelayConnection) -> list[str]:
    return [params["frame"]["msg_id"] for params in guest.of_method(messages.USER_MESSAGE)]


async def delivering(nursery: trio.Nursery, guests: Guests, guest: FakeRelayConnection) -> trio.CancelScope:
    """Run `deliver(guest)` in `nursery` until the returned scope is cancelled."""
    scope = trio.CancelScope()

    async def run() -> None:
        with scope:
            await guests.delivery.deliver(guest)

    nursery.start_soon(run)
    return scope


# -- GuestDelivery -------------------------------------------------------------------------


async def test_delivery_sends_waiting_then_new_messages_in_order(guests: Guests) -> None:
    await guests.message("one", "m1")
    guest = FakeRelayConnection(INSTANCE)
    async with trio.open_nursery() as nursery:
        scope = await delivering(nursery, guests, guest)
        await guest.wait_notified(messages.USER_MESSAGE, 1, BOUND)
        await guests.message("two", "m2")
        await guest.wait_notified(messages.USER_MESSAGE, 2, BOUND)
        scope.cancel()
    assert delivered_ids(guest) == ["m1", "m2"], f"GuestDelivery.deliver: sent {delivered_ids(guest)}"


async def test_delivery_resends_the_unacknowledged_but_not_an_ended_turn(guests: Guests) -> None:
    first = await guests.message("one", "m1")
    await guests.message("two", "m2")
    await guests.message("three", "m3")
    session = guests.sessions.get_or_create(INSTANCE, "mcp", "s1")

    old = FakeRelayConnection(INSTANCE)
    async with trio.open_nursery() as nursery:
        scope = await delivering(nursery, guests, old)
        await old.wait_notified(messages.USER_MESSAGE, 3, BOUND)
        await guests.delivery.acknowledge(old, first.seq)
        scope.cancel()
    # m2's turn ended, but the guest died before acknowledging it: it is not run again.
    await guests.log.append(session, "assistant.done", {"text": "done"}, reply_to="m2")

    new = FakeRelayConnection(INSTANCE)
    async with trio.open_nursery() as nursery:
        scope = await delivering(nursery, guests, new)
        await new.wait_notified(messages.USER_MESSAGE, 1, BOUND)
        await trio.testing.wait_all_tasks_blocked()
        scope.cancel()
    assert delivered_ids(new) == ["m3"], f"GuestDelivery.deliver after a reconnect: sent {delivered_ids(new)}"
    assert await guests.store.get_cursor(INSTANCE, GUEST_CURSOR) == first.seq, "GuestDelivery: the cursor moved"


async def test_delivery_ignores_an_ack_past_the_end_of_the_log(guests: Guests) -> None:
    frame = await guests.message("one", "m1")
    guest = FakeRelayConnection(INSTANCE)

    await guests.delivery.acknowledge(guest, frame.seq + 5)
    assert await guests.store.get_cursor(INSTANCE, GUEST_CURSOR) == 0, "GuestDelivery.acknowledge: skipped ahead"
    await guests.delivery.acknowledge(guest, frame.seq)
    await guests.delivery.acknowledge(guest, 0)
    assert await guests.store.get_cursor(INSTANCE, GUEST_CURSOR) == frame.seq, (
        "GuestDelivery.acknowledge: the cursor did not move forward only")
    assert not await guests.delivery.has_undelivered(INSTANCE), "GuestDelivery.has_undelivered after the ack"


async def test_delivery_skips_and_reports_a_frame_it_cannot_send(guests: Guests) -> None:
    bad = await guests.message("one", "m1")
    await guests.message("two", "m2")
    guest = FakeRelayConnection(INSTANCE)
    guest.refuse(bad.seq)
    async with trio.open_nursery() as nursery:
        scope = await delivering(nursery, guests, guest)
        await guest.wait_notified(messages.USER_MESSAGE, 1, BOUND)
        scope.cancel()
    assert delivered_ids(guest) == ["m2"], f"GuestDelivery: sent {delivered_ids(guest)}"
    assert [(i, s) for i, s, _ in guests.undeliverable] == [(INSTANCE, bad.seq)], (
        f"GuestDelivery: reported {guests.undeliverable}")
    assert not guest.closed.is_set(), "GuestDelivery: one bad frame closed the guest"


async def test_delivery_closes_a_guest_whose_instance_another_server_holds() -> None:
    held = [True]

    async def holds(instance: str) -> bool:
        return held[0]

    guests = Guests(holds)
    guest = FakeRelayConnection(INSTANCE)
    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(guests.delivery.deliver, guest)
            await trio.testing.wait_all_tasks_blocked()
            held[0] = False
            await guests.message("one", "m1")
            await guest.closed.wait()
    assert delivered_ids(guest) == [], f"GuestDelivery: sent {delivered_ids(guest)} after losing the instance"


class OutageStore:
    """The in-memory store, whose long-poll read fails `outages` times first (a database outage)."""

    def __init__(self, outages: int) -> None:
        self.store = FrameStore.in_memory()
        self.outages = outages

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def wait_for_frames(self, instance: str, query: FrameQuery, timeout: float) -> Any:
        """`FrameStore.wait_for_frames`, or `StoreUnavailable` while outages remain."""
        if self.outages:
            self.outages -= 1
            raise StoreUnavailable("the test store is unavailable")
        return await self.store.wait_for_frames(instance, query, timeout)


async def test_delivery_keeps_the_guest_through_a_store_outage(autojump_clock: trio.testing.MockClock) -> None:
    store = OutageStore(outages=3)
    await store.append(INSTANCE, channel="mcp", session_id="s1", type="user.message", payload={"text": "hi"}, msg_id="m1")
    delivery = GuestDelivery(store)  # type: ignore[arg-type]
    guest = FakeRelayConnection(INSTANCE)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(delivery.deliver, guest)
        await guest.wait_notified(messages.USER_MESSAGE, 1, BOUND)
        nursery.cancel_scope.cancel()
    assert store.outages == 0 and delivered_ids(guest) == ["m1"], f"GuestDelivery after an outage: sent {delivered_ids(guest)}"
    assert not guest.closed.is_set(), "GuestDelivery: a store outage closed the guest"


async def test_delivery_tracks_one_guest_per_instance(guests: Guests) -> None:
    first, second = FakeRelayConnection(INSTANCE), FakeRelayConnection(INSTANCE)
    changed = guests.delivery.connected_changed
    assert guests.delivery.attach(first) is None, "GuestDelivery.attach: replaced a guest that was not there"
    assert changed.is_set(), "GuestDelivery.attach: connected_changed not signalled"
    assert guests.delivery.attach(second) is first, "GuestDelivery.attach: did not return the replaced guest"
    guests.delivery.detach(first)
    assert guests.delivery.guest_for(INSTANCE) is second, "GuestDelivery.detach: a replaced guest removed the new one"
    guests.delivery.detach(second)
    assert guests.delivery.connected_instances() == [], "GuestDelivery.detach: the guest is still listed"


# -- GuestFrames ---------------------------------------------------------------------------


def append(type: str, reply_to: str | None = None, session_id: str = "s1", **payload: Any) -> messages.AppendFrame:
    return messages.AppendFrame(
        session=messages.SessionRef(channel="mcp", id=session_id), type=type, payload=payload, reply_to=reply_to,
    )


@pytest.mark.parametrize("type, payload, code", [
    ("user.message", {"text": "hi"}, errors.INVALID_PARAMS),
    ("caller_tool_result", {}, errors.INVALID_PARAMS),
    ("assistant.delta", {"owner": "x"}, errors.INVALID_PARAMS),
    ("made.up", {}, errors.INVALID_PARAMS),
])
async def test_guest_frames_refuses_what_a_guest_may_not_append(
    guests: Guests, type: str, payload: dict[str, Any], code: int,
) -> None:
    await guests.message("one", "m1")
    before = await guests.stored()
    with pytest.raises(RelayError) as refused:
        await guests.frames.append_frame(FakeRelayConnection(INSTANCE), append(type, "m1", **payload))
    assert refused.value.code == code, f"GuestFrames.append_frame({type}): {refused.value!r}"
    assert await guests.stored() == before, f"GuestFrames.append_frame: a refused {type} was stored"


async def test_guest_frames_cannot_open_a_session(guests: Guests) -> None:
    with pytest.raises(RelayError) as refused:
        await guests.frames.append_frame(FakeRelayConnection(INSTANCE), append("assistant.delta", session_id="new", text="x"))
    assert refused.value.code == errors.NOT_FOUND, f"GuestFrames.append_frame to an unknown session: {refused.value!r}"
    assert guests.sessions.get(INSTANCE, "mcp", "new") is None, "GuestFrames: a guest made a session"


async def test_guest_frames_a_turn_ends_once(guests: Guests) -> None:
    await guests.message("one", "m1")
    guest = FakeRelayConnection(INSTANCE)

    started = await guests.frames.append_frame(guest, append("status.presence", "m1", state="working"))
    done = await guests.frames.append_frame(guest, append("assistant.done", "m1", text="done"))
    with pytest.raises(RelayError) as again:
        await guests.frames.append_frame(guest, append("session.error", "m1", message="late"))

    assert started.seq < done.seq, f"GuestFrames.append_frame: seqs {started.seq}, {done.seq}"
    assert again.value.code == errors.INVALID_REQUEST and "ended already" in again.value.message, (
        f"GuestFrames.append_frame: a second end of m1: {again.value!r}")
    ends = [f for f in await guests.stored() if f.type in ("assistant.done", "session.error")]
    assert len(ends) == 1, f"GuestFrames: the turn of m1 ended {len(ends)} times"


async def test_guest_frames_two_racing_ends_store_one(guests: Guests) -> None:
    await guests.message("one", "m1")
    guest = FakeRelayConnection(INSTANCE)
    outcomes: list[str] = []

    async def end(type: str) -> None:
        try:
            await guests.frames.append_frame(guest, append(type, "m1", text="end"))
            outcomes.append("stored")
        except RelayError as exc:
            outcomes.append(exc.message)

    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(end, "assistant.done")
            nursery.start_soon(end, "session.error")
    assert outcomes.count("stored") == 1, f"GuestFrames: racing ends of m1 gave {outcomes}"


async def test_guest_frames_refuses_a_turn_of_an_instance_another_server_took_over() -> None:
    """Shared store: once another server holds the instance's lease, this server's guest may not
    store frames of a turn (that server's guest runs it now): a clear refusal, nothing stored,
    and the connection closed after the answer; frames before the takeover were stored."""
    held = [True]

    async def holds(instance: str) -> bool:
        return held[0]

    guests = Guests(holds)
    await guests.message("one", "m1")
    guest = FakeRelayConnection(INSTANCE)
    await guests.frames.append_frame(guest, append("status.presence", "m1", state="thinking"))
    held[0] = False
    before = await guests.stored()
    for late in (append("assistant.delta", "m1", text="x"), append("assistant.done", "m1", text="done")):
        with pytest.raises(RelayError) as refused:
            await guests.frames.append_frame(guest, late)
        assert refused.value.code == errors.INVALID_REQUEST and "no longer holds instance" in refused.value.message, (
            f"GuestFrames after a takeover: {refused.value!r}")
    assert await guests.stored() == before, "GuestFrames: stored a turn frame of an instance taken over"
    assert guest.closed.is_set(), "GuestFrames: kept the guest of an instance taken over"


async def test_orphans_leave_the_turns_of_an_instance_another_server_took_over() -> None:
    """The guest of an instance taken over leaves mid-turn: this server ends none of its turns with
    `session.error` (the other server delivers their messages to its guest, which ends them)."""
    held = [True]

    async def holds(instance: str) -> bool:
        return held[0]

    guests = Guests(holds)
    orphans = OrphanedTurns(guests.delivery, guests.sessions, guests.log.append)
    guest = FakeRelayConnection(INSTANCE)
    await guests.message("one", "m1")
    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            await nursery.start(orphans.serve)
            scope = await delivering(nursery, guests, guest)
            await guest.wait_notified(messages.USER_MESSAGE, 1, BOUND)
            await guests.frames.append_frame(guest, append("status.presence", "m1", state="thinking"))
            scope.cancel()
            held[0] = False
            orphans.guest_gone(guest)
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
    ends = [f for f in await guests.stored() if f.type in ("assistant.done", "session.error")]
    assert ends == [], f"OrphanedTurns: ended turns of an instance another server holds: {ends}"


async def test_failed_starts_overlapping_end_each_waiting_turn_once(guests: Guests) -> None:
    """A burst of messages to an instance whose start command fails: several failed starts end the
    same waiting turns at once; each turn ends once (the store refuses a second end)."""
    failed = FailedStarts(guests.delivery, guests.sessions, guests.log.append, lambda instance: _false())
    for n in range(60):
        await guests.message(f"m{n}", f"m{n}")
    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            await nursery.start(failed.serve)
            for _ in range(3):
                failed.start_failed(INSTANCE, "the start command exited with status 1")
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
    ends: dict[str | None, int] = {}
    for frame in await guests.stored():
        if frame.type == "session.error":
            ends[frame.reply_to] = ends.get(frame.reply_to, 0) + 1
    assert ends == {f"m{n}": 1 for n in range(60)}, f"FailedStarts: turn ends per message {sorted(set(ends.values()))}"


async def _false() -> bool:
    return False


async def test_guest_frames_an_end_racing_the_orphans_of_its_turn_stores_one() -> None:
    """The guest sends a turn's end as its connection closes: the guest's end and the orphan's
    `session.error` race for the turn; one of them is stored."""
    guests = Guests()
    orphans = OrphanedTurns(guests.delivery, guests.sessions, guests.log.append)
    guest = FakeRelayConnection(INSTANCE)
    for n in range(20):
        await guests.message(f"m{n}", f"m{n}")
    outcomes: list[str] = []

    async def end(msg_id: str) -> None:
        try:
            await guests.frames.append_frame(guest, append("assistant.done", msg_id, text="done"))
            outcomes.append("stored")
        except RelayError as exc:
            outcomes.append(exc.message)

    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            await nursery.start(orphans.serve)
            scope = await delivering(nursery, guests, guest)
            await guest.wait_notified(messages.USER_MESSAGE, 20, BOUND)
            for n in range(20):
                await guests.frames.append_frame(guest, append("status.presence", f"m{n}", state="thinking"))
            scope.cancel()
            for n in range(20):
                nursery.start_soon(end, f"m{n}")
            orphans.guest_gone(guest)
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
    ends: dict[str | None, int] = {}
    for frame in await guests.stored():
        if frame.type in ("assistant.done", "session.error"):
            ends[frame.reply_to] = ends.get(frame.reply_to, 0) + 1
    assert ends == {f"m{n}": 1 for n in range(20)}, f"GuestFrames and OrphanedTurns: turn ends per message {ends}"


class Events:
    """A session follower (`EventSink`) that keeps what it is pushed."""

    def __init__(self) -> None:
        self.events: list[dict] = []

    def push(self, event: dict) -> None:
        self.events.append(event)


def once(type: str, append_id: Any, reply_to: str | None = "m1", **payload: Any) -> messages.AppendFrame:
    return attrs.evolve(append(type, reply_to, **payload), append_id=append_id)


async def test_guest_frames_a_resend_with_its_append_id_stores_once(guests: Guests) -> None:
    """A guest resends a frame (its connection broke before the answer) with the same `append_id`:
    one frame in the log, the same seq and msg_id in both answers, one event to the session's
    followers; another id, or none, stores as before."""
    await guests.message("one", "m1")
    follower = Events()
    session = guests.sessions.get(INSTANCE, "mcp", "s1")
    assert session is not None
    guests.sessions.follow(session, follower)
    guest = FakeRelayConnection(INSTANCE)

    first = await guests.frames.append_frame(guest, once("status.presence", "p-1", state="thinking"))
    again = await guests.frames.append_frame(FakeRelayConnection(INSTANCE), once("status.presence", "p-1", state="thinking"))
    other = await guests.frames.append_frame(guest, once("status.presence", "p-2", state="thinking"))
    plain = [await guests.frames.append_frame(guest, append("assistant.delta", "m1", text="x")) for _ in range(2)]

    assert again == first, f"GuestFrames: a resend got {again}, the first send {first}"
    presence = [f for f in await guests.stored() if f.type == "status.presence"]
    assert [f.seq for f in presence] == [first.seq, other.seq], f"GuestFrames: stored {presence}"
    assert plain[0].seq != plain[1].seq, "GuestFrames: frames without an append_id are each stored"
    assert [e["seq"] for e in follower.events if e["type"] == "status.presence"] == [first.seq, other.seq], (
        f"GuestFrames: the resend was pushed again: {follower.events}")


async def test_guest_frames_a_resent_turn_end_gets_its_frame_not_a_refusal(guests: Guests) -> None:
    """The end of a turn was stored, its answer lost: its resend is answered with the stored end
    (the turn ended with it); another end of that turn is still refused."""
    await guests.message("one", "m1")
    guest = FakeRelayConnection(INSTANCE)
    done = await guests.frames.append_frame(guest, once("assistant.done", "d-1", text="done"))
    assert await guests.frames.append_frame(guest, once("assistant.done", "d-1", text="done")) == done
    with pytest.raises(RelayError) as late:
        await guests.frames.append_frame(guest, once("session.error", "e-1", message="late"))
    assert late.value.code == errors.INVALID_REQUEST, f"GuestFrames: a second end of m1: {late.value!r}"
    ends = [f for f in await guests.stored() if f.type in ("assistant.done", "session.error")]
    assert len(ends) == 1, f"GuestFrames: the turn of m1 ended {len(ends)} times"


async def test_guest_frames_refuse_an_append_id_sent_again_with_another_frame(guests: Guests) -> None:
    """The end of m2 sent with the `append_id` of m1's end is not a resend: refused with -32602
    naming the id (it used to be answered with m1's seq, and m2's end was lost); so is m1's end
    resent with another text after its turn ended. Nothing is stored; m2's end with an id of its
    own is stored and ends m2's turn."""
    await guests.message("one", "m1")
    guest = FakeRelayConnection(INSTANCE)
    done = await guests.frames.append_frame(guest, once("assistant.done", "d-1", text="done"))
    await guests.message("two", "m2")
    before = await guests.stored()
    for resent in (once("assistant.done", "d-1", reply_to="m2", text="done"), once("assistant.done", "d-1", text="other")):
        with pytest.raises(RelayError) as refused:
            await guests.frames.append_frame(guest, resent)
        assert refused.value.code == errors.INVALID_PARAMS and "'d-1'" in refused.value.message, (
            f"GuestFrames: {resent} answered as a resend of {done}: {refused.value!r}")
    assert await guests.stored() == before, "GuestFrames: a refused append_id stored something"
    ended = await guests.frames.append_frame(guest, once("assistant.done", "d-2", reply_to="m2", text="two done"))
    assert ended.seq > done.seq and (await guests.stored())[-1].reply_to == "m2", "GuestFrames: m2's own end was not stored"


@pytest.mark.parametrize("append_id", ["a" * 65, "a b", "abc\n", "", "é", 7])
async def test_guest_frames_refuses_a_malformed_append_id(guests: Guests, append_id: Any) -> None:
    await guests.message("one", "m1")
    before = await guests.stored()
    with pytest.raises(RelayError) as refused:
        await guests.frames.append_frame(FakeRelayConnection(INSTANCE), once("status.presence", append_id))
    assert refused.value.code == errors.INVALID_PARAMS, f"GuestFrames: append_id {append_id!r}: {refused.value!r}"
    assert await guests.stored() == before, f"GuestFrames: a frame with append_id {append_id!r} was stored"


async def test_guest_frames_ack_moves_the_delivery_cursor(guests: Guests) -> None:
    frame = await guests.message("one", "m1")
    await guests.frames.ack(FakeRelayConnection(INSTANCE), messages.Ack(seq=frame.seq))
    assert await guests.store.get_cursor(INSTANCE, GUEST_CURSOR) == frame.seq, "GuestFrames.ack: the cursor did not move"
