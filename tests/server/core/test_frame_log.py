"""The frame log's rooms alone: `FrameLog` (store, then push), `Tether` (send, read, wait) and
`InstanceDirectory` (which instances exist), on the in-memory store with recording sinks
(tests/support/fakes.py). No relay socket, no HTTP, no program: what each service promises, and the
room named in every failure. (The same paths through the real programs: tests/server/features/test_tether.py,
tests/server/doors/test_http_api.py, tests/server/core/test_server_owned.py.)
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from fakes import RecordingSink
from oubliette_server.core.frame_log import FrameLog
from oubliette_server.core.instances import InstanceDirectory
from oubliette_server.core.sessions import SessionRegistry
from oubliette_server.store.sqlite import FrameStore
from oubliette_server.store.api import FrameQuery
from oubliette_server.features.tether import TETHER_CHANNEL, Tether
from protocol import RelayError, errors
from protocol.limits import LimitExceeded, Limits

INSTANCE = "box1"
BOUND = 5.0


class Rooms:
    """A frame log, a tether and an instance directory over one in-memory store; `woken` lists
    the instances `FrameLog.ingress` woke."""

    def __init__(self, configured: tuple[str, ...] = (INSTANCE,), limits: Limits | None = None) -> None:
        self.store = FrameStore.in_memory()
        self.sessions = SessionRegistry()
        self.woken: list[str] = []
        self.connected: list[str] = []
        self.log = FrameLog(self.store, self.sessions, on_user_message=self.woken.append, limits=limits)
        self.instances = InstanceDirectory(configured, self.store.last_seq, lambda: self.connected)
        self.tether = Tether(self.store, self.log, self.instances, limits)

    async def frames(self, instance: str = INSTANCE) -> list[Any]:
        """Every frame of `instance` in the log."""
        return await self.store.query(instance, FrameQuery(limit=200))


@pytest.fixture
def rooms() -> Rooms:
    return Rooms()


# -- FrameLog ------------------------------------------------------------------------------


async def test_frame_log_stores_then_pushes_to_every_follower_but_the_skipped_one(rooms: Rooms) -> None:
    session = rooms.sessions.get_or_create(INSTANCE, "mcp", "s1")
    follower, author = RecordingSink(), RecordingSink()
    session.sinks.update({follower, author})

    frame = await rooms.log.append(session, "assistant.delta", {"text": "hi"}, skip=author)

    stored = await rooms.frames()
    assert [f.seq for f in stored] == [frame.seq], f"FrameLog.append: the frame is not stored once: {stored}"
    assert follower.events == [frame.to_event()], f"FrameLog.append: the follower got {follower.events}"
    assert author.events == [], f"FrameLog.append: the skipped sink got {author.events}"


async def test_frame_log_record_is_stored_and_pushed_to_nobody(rooms: Rooms) -> None:
    session = rooms.sessions.get_or_create(INSTANCE, "mcp", "s1")
    follower = RecordingSink()
    session.sinks.add(follower)

    await rooms.log.record(session, "session_record", {"owner": "connection:x"})

    assert [f.type for f in await rooms.frames()] == ["session_record"], "FrameLog.record: not stored"
    assert follower.events == [], f"FrameLog.record: a server's record reached a follower: {follower.events}"


async def test_frame_log_stores_one_outcome_of_a_request(rooms: Rooms) -> None:
    session = rooms.sessions.get_or_create(INSTANCE, "mcp", "s1")
    follower = RecordingSink()
    session.sinks.add(follower)

    first = await rooms.log.append_outcome(session, "caller_tool_result", {"request_id": "r1"}, "r1")
    second = await rooms.log.append_outcome(session, "caller_tool_cancelled", {"request_id": "r1"}, "r1")

    assert first is not None and second is None, f"FrameLog.append_outcome: two outcomes of r1: {first}, {second}"
    assert [e["type"] for e in follower.events] == ["caller_tool_result"], (
        f"FrameLog.append_outcome: the refused outcome was pushed: {follower.events}")


async def test_frame_log_refuses_an_undeliverable_frame_before_storing_it() -> None:
    rooms = Rooms(limits=Limits(max_payload_bytes=1024, max_frame_bytes=2048))
    session = rooms.sessions.get_or_create(INSTANCE, "mcp", "s1")
    follower = RecordingSink()
    session.sinks.add(follower)

    with pytest.raises(LimitExceeded):
        await rooms.log.append(session, "assistant.delta", {"text": "x" * 4096})

    assert await rooms.frames() == [], "FrameLog.append: a frame over the limits was stored"
    assert follower.events == [], "FrameLog.append: a frame over the limits was pushed"


@pytest.mark.parametrize("type, payload", [
    ("caller_tool_result", {"request_id": "r1"}),
    ("session_record", {"owner": "connection:x"}),
    ("user.message", {"text": "hi", "caller_tools": []}),
    ("user.message", {"text": "hi", "owner": "someone"}),
])
async def test_frame_log_ingress_refuses_what_only_the_server_writes(
    rooms: Rooms, type: str, payload: dict[str, Any],
) -> None:
    with pytest.raises(RelayError) as refused:
        await rooms.log.ingress(INSTANCE, "host", "s1", type, payload)

    assert refused.value.code == errors.INVALID_PARAMS, f"FrameLog.ingress: {refused.value!r}"
    assert await rooms.frames() == [], f"FrameLog.ingress: a refused {type} was stored"
    assert rooms.sessions.get(INSTANCE, "host", "s1") is None, "FrameLog.ingress: a refused frame made a session"
    assert rooms.woken == [], f"FrameLog.ingress: a refused frame woke {rooms.woken}"


async def test_frame_log_ingress_wakes_the_instance_for_a_user_message_only(rooms: Rooms) -> None:
    await rooms.log.ingress(INSTANCE, "host", "s1", "status.presence", {"state": "idle"})
    assert rooms.woken == [], f"FrameLog.ingress: a status frame woke {rooms.woken}"

    frame = await rooms.log.ingress(INSTANCE, "host", "s1", "user.message", {"text": "hi"}, msg_id="m1")

    assert rooms.woken == [INSTANCE], f"FrameLog.ingress: a user.message woke {rooms.woken}"
    assert (frame.type, frame.msg_id) == ("user.message", "m1"), f"FrameLog.ingress: stored {frame}"
    assert rooms.sessions.get(INSTANCE, "host", "s1") is not None, "FrameLog.ingress: no session held"


# -- Tether --------------------------------------------------------------------------------


async def test_tether_send_stores_a_user_message_on_the_host_channel_and_wakes(rooms: Rooms) -> None:
    sent = await rooms.tether.send(INSTANCE, "hello")

    [frame] = await rooms.frames()
    assert (frame.type, frame.channel, frame.session_id) == ("user.message", TETHER_CHANNEL, "default"), (
        f"Tether.send: stored {frame}")
    assert sent == {"msg_id": frame.msg_id, "session_id": "default", "ingress_seq": frame.seq}, f"Tether.send: {sent}"
    assert frame.msg_id.startswith("host-"), f"Tether.send: msg_id {frame.msg_id}"
    assert rooms.woken == [INSTANCE], f"Tether.send: woke {rooms.woken}"


async def test_tether_send_refuses_an_unknown_instance_and_a_bad_session(rooms: Rooms) -> None:
    with pytest.raises(RelayError) as unknown:
        await rooms.tether.send("nobody", "hello")
    assert unknown.value.code == errors.NOT_FOUND and "unknown instance 'nobody'" in unknown.value.message, (
        f"Tether.send: {unknown.value!r}")
    with pytest.raises(RelayError) as bad:
        await rooms.tether.send(INSTANCE, "hello", session_id="bad\n")
    assert bad.value.code == errors.INVALID_PARAMS, f"Tether.send: {bad.value!r}"
    assert await rooms.frames() == [] and rooms.woken == [], "Tether.send: a refused send left something behind"


async def test_tether_read_waits_for_the_append_that_wakes_it(rooms: Rooms) -> None:
    session = rooms.sessions.get_or_create(INSTANCE, TETHER_CHANNEL, "default")
    got: dict[str, Any] = {}

    async def read() -> None:
        got.update(await rooms.tether.read(INSTANCE, channel=None, session_id=None, wait_ms=30_000))

    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            await trio.testing.wait_all_tasks_blocked()
            assert rooms.store.waiter_count(INSTANCE) == 1, "Tether.read: not waiting in the store"
            frame = await rooms.log.append(session, "assistant.done", {"text": "done"})

    assert got["timed_out"] is False and got["next_seq"] == frame.seq, f"Tether.read: {got}"
    assert [f["seq"] for f in got["frames"]] == [frame.seq], f"Tether.read: {got['frames']}"
    assert rooms.store.waiter_count(INSTANCE) == 0, "Tether.read: a waiter was left behind"


async def test_tether_read_filters_by_default_type_and_times_out_on_the_clock(
    rooms: Rooms, autojump_clock: trio.testing.MockClock,
) -> None:
    await rooms.tether.send(INSTANCE, "hello")  # the host's own message: not what tether_read returns

    got = await rooms.tether.read(
        INSTANCE, channel=TETHER_CHANNEL, session_id="default", wait_ms=1000,
        types=["assistant.delta", "assistant.done", "status.presence", "session.error"],
    )

    assert got == {"frames": [], "next_seq": 0, "timed_out": True}, f"Tether.read: {got}"


async def test_tether_stream_raises_before_it_starts_then_yields_frames_and_idle_marks(
    rooms: Rooms, autojump_clock: trio.testing.MockClock,
) -> None:
    with pytest.raises(RelayError) as bad:
        await rooms.tether.stream(INSTANCE, after_seq=0, keepalive_seconds=1, channel="a b")
    assert bad.value.code == errors.INVALID_PARAMS, f"Tether.stream: a bad filter gave {bad.value!r}"

    sent = await rooms.tether.send(INSTANCE, "hello")
    frames = await rooms.tether.stream(INSTANCE, after_seq=0, keepalive_seconds=1)
    first = await frames.__anext__()
    idle = await frames.__anext__()  # nothing new within the keepalive: one idle mark
    assert first["seq"] == sent["ingress_seq"] and idle is None, f"Tether.stream: {first}, then {idle}"
    await frames.aclose()


@pytest.mark.parametrize("arguments, word", [
    ({"wait_ms": -1}, "wait_ms"),
    ({"wait_ms": 30_001}, "wait_ms"),
    ({"channel": "a b"}, "channel"),
    ({"session_id": "s\n"}, "session"),
    ({"limit": 0}, "limit"),
])
async def test_tether_read_refuses_bad_arguments(rooms: Rooms, arguments: dict[str, Any], word: str) -> None:
    call: dict[str, Any] = {"channel": None, "session_id": None, **arguments}
    with pytest.raises(RelayError) as refused:
        await rooms.tether.read(INSTANCE, **call)
    assert refused.value.code == errors.INVALID_PARAMS and word in refused.value.message, (
        f"Tether.read{arguments}: {refused.value!r}")


async def test_tether_ingest_validates_before_the_frame_log_sees_it(rooms: Rooms) -> None:
    good = {"session": {"channel": "host", "id": "s1"}, "type": "user.message", "payload": {"text": "hi"}}
    frame = await rooms.tether.ingest(INSTANCE, good)
    assert frame.type == "user.message" and rooms.woken == [INSTANCE], f"Tether.ingest: {frame}, woke {rooms.woken}"

    for bad in ({"type": "user.message"}, {**good, "session": {"channel": "host", "id": "s\n"}}, "not an object"):
        with pytest.raises(RelayError) as refused:
            await rooms.tether.ingest(INSTANCE, bad)
        assert refused.value.code == errors.INVALID_PARAMS, f"Tether.ingest({bad!r}): {refused.value!r}"
    assert len(await rooms.frames()) == 1, "Tether.ingest: a refused frame was stored"


# -- InstanceDirectory ---------------------------------------------------------------------


async def test_instance_directory_knows_configured_seen_logged_and_leased_instances() -> None:
    store = FrameStore.in_memory()
    leased = {"elsewhere"}

    async def held_elsewhere(instance: str) -> bool:
        return instance in leased

    directory = InstanceDirectory(["conf"], store.last_seq, lambda: [], held_elsewhere)
    directory.saw("seen")
    await store.append("logged", channel="host", session_id="s", type="user.message", payload={"text": "hi"})

    for instance in ("conf", "seen", "logged", "elsewhere"):
        assert await directory.known(instance), f"InstanceDirectory.known: {instance} is unknown"
    assert not await directory.known("nobody"), "InstanceDirectory.known: 'nobody' is known"
    assert directory.named() == ["conf", "seen"], f"InstanceDirectory.named: {directory.named()}"
    with pytest.raises(RelayError) as unknown:
        await directory.require_known("nobody")
    assert unknown.value.code == errors.NOT_FOUND and "to any server" in unknown.value.message, (
        f"InstanceDirectory.require_known: {unknown.value!r}")
    with pytest.raises(RelayError) as bad:
        await directory.require_known("bad id")
    assert bad.value.code == errors.INVALID_PARAMS, f"InstanceDirectory.require_known: {bad.value!r}"


async def test_instance_directory_resolves_the_only_connected_instance() -> None:
    connected: list[str] = []

    async def no_frames(instance: str) -> int:
        return 0

    directory = InstanceDirectory([], no_frames, lambda: connected)
    with pytest.raises(RelayError) as none:
        directory.resolve(None)
    assert none.value.code == errors.NOT_FOUND, f"InstanceDirectory.resolve with none connected: {none.value!r}"

    connected.append("b")
    assert directory.resolve(None) == "b", "InstanceDirectory.resolve: not the only connected instance"
    assert directory.resolve("a") == "a", "InstanceDirectory.resolve: not the named instance"

    connected.append("a")
    with pytest.raises(RelayError) as several:
        directory.resolve(None)
    assert several.value.code == errors.INVALID_PARAMS and "(a, b)" in several.value.message, (
        f"InstanceDirectory.resolve with two connected: {several.value!r}")
