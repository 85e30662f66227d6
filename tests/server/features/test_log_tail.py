"""The log tail alone (`LogTail`): with a shared store, other servers' frames reach this server's followers.

The shared log is a double: the in-memory SQLite store holds the frames, and every append, by
this server (through `FrameLog`) or by "another server" (`elsewhere`), sends its notice to the
tail as PostgreSQL's NOTIFY does; notices can be lost (a listener cut) or come before this
server's own append has returned, and reads can fail (an outage). The same path through the
real programs on a real PostgreSQL: tests/e2e/test_cluster_calls.py, tests/server/features/test_log_tail_postgres.py.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

import pytest
import trio
import trio.testing

from fakes import RecordingSink
from oubliette_server.core.frame_log import FrameLog
from oubliette_server.features.cluster.log_tail import LogTail
from oubliette_server.core.metrics import ServerMetrics
from oubliette_server.core.server_owned import POLICY_DECISION, SESSION_RECORD
from oubliette_server.core.sessions import Session, SessionRegistry
from oubliette_server.store.sqlite import FrameStore
from oubliette_server.store.api import AppendNoticeHook, FrameQuery, StoreUnavailable
from protocol import Frame

INSTANCE = "box1"
BOUND = 5.0


class SharedLogDouble:
    """One log two servers share, in memory: `FrameLog`'s appends (this server) and `elsewhere`
    (another server) both notify the hooks (with `name_fields`, naming each frame's filter fields
    as PostgreSQL's notices do); `lose_notices`, `fail_reads`, `query_gate` and
    `append_gate` make the listener cut, the outage, and a read that sees an append of this
    server that has not returned yet."""

    def __init__(self) -> None:
        self.store = FrameStore.in_memory()
        self.hooks: list[AppendNoticeHook] = []
        self.reads = 0
        self.fail_reads = 0
        self.fail_with: Exception = StoreUnavailable("the store is unavailable: cut")
        self.lose_notices = False
        self.name_fields = False
        self.query_gate: trio.Event | None = None
        self.append_gate: trio.Event | None = None

    def hear_appends(self, hook: AppendNoticeHook) -> None:
        self.hooks.append(hook)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def frames_after(self, instance: str, after_seq: int, limit: int) -> list[Frame]:
        self.reads += 1
        if self.fail_reads:
            self.fail_reads -= 1
            raise self.fail_with
        if self.query_gate is not None:
            await self.query_gate.wait()
        return await self.store.query(instance, FrameQuery(after_seq=after_seq, limit=limit))

    def _notice(self, frame: Frame) -> None:
        if not self.lose_notices:
            fields = [(frame.channel, frame.session_id, frame.type, frame.reply_to)] if self.name_fields else None
            for hook in self.hooks:
                hook.appended(frame.instance, frame.seq, frame.seq, fields)

    async def append(self, instance: str, **fields: Any) -> Frame:
        """This server's append: committed and noticed before it returns (the notice overtakes
        it), and with `append_gate` returned only once that is set."""
        frame = await self.store.append(instance, **fields)
        self._notice(frame)
        if self.append_gate is not None:
            await self.append_gate.wait()
        return frame

    async def elsewhere(self, session: Session, type: str, payload: dict[str, Any]) -> Frame:
        """Another server appends to `session`: only the notice reaches this one."""
        frame = await self.store.append(session.instance, channel=session.channel, session_id=session.id,
                                        type=type, payload=payload)
        self._notice(frame)
        return frame


class Server:
    """This server's rooms over the double: sessions, the tail (serving) and a frame log that tells it its appends."""

    def __init__(self, log: SharedLogDouble, on_pushed: Any = None) -> None:
        self.log = log
        self.sessions = SessionRegistry()
        self.tail = LogTail(log, self.sessions, **({"on_pushed": on_pushed} if on_pushed else {}))
        self.frame_log = FrameLog(log, self.sessions, local_appends=self.tail)  # type: ignore[arg-type]

    def followed(self, session_id: str = "s1") -> tuple[Session, RecordingSink]:
        session = self.sessions.get_or_create(INSTANCE, "mcp", session_id)
        sink = RecordingSink()
        self.sessions.follow(session, sink)
        return session, sink

    async def caught_up(self) -> None:
        with trio.fail_after(BOUND):
            await self.tail.caught_up(INSTANCE)


@pytest.fixture
async def server(nursery: trio.Nursery) -> AsyncIterator[Server]:
    here = Server(SharedLogDouble())
    await nursery.start(here.tail.serve)
    yield here


def seqs(sink: RecordingSink) -> list[int]:
    return [event["seq"] for event in sink.events]


async def test_another_servers_frames_are_pushed_to_the_followers_here_once(server: Server) -> None:
    session, sink = server.followed()
    other, other_sink = server.followed("s2")
    await server.frame_log.append(session, "user.message", {"text": "hi"})  # seq 1, pushed by FrameLog
    request = await server.log.elsewhere(session, "caller_tool_request", {"request_id": "r1"})
    delta = await server.log.elsewhere(other, "assistant.delta", {"text": "x"})
    await server.caught_up()
    assert seqs(sink) == [1, request.seq], "log tail: the other server's request reaches its session's follower, once"
    assert seqs(other_sink) == [delta.seq], "log tail: each frame goes to its own session's followers only"
    assert sink.events[1] == request.to_event(), "log tail: the event is the one a local append pushes"
    assert server.tail.pushed == 2


async def test_a_notice_naming_only_frames_nobody_here_follows_is_passed_without_a_read(server: Server) -> None:
    """A notice names its frames' filter fields: the tail reads the log only for a frame of a session
    someone follows here (and of a type pushed to anyone); another session's frames, or a
    `session_record`, pass the cursor unread, and the next frame followed here is read and pushed."""
    server.log.name_fields = True
    session, sink = server.followed()
    nobody = server.sessions.get_or_create(INSTANCE, "mcp", "s2")
    first = await server.log.elsewhere(session, "assistant.delta", {"text": "a"})
    await trio.testing.wait_all_tasks_blocked()
    reads = server.log.reads
    assert seqs(sink) == [first.seq] and reads == 1
    woken: list[str] = []
    real_read = server.tail._read

    async def counted_read(instance: str, *args: Any, **kwargs: Any) -> None:
        woken.append(instance)
        await real_read(instance, *args, **kwargs)

    server.tail._read = counted_read  # type: ignore[method-assign]
    for _ in range(3):
        await server.log.elsewhere(nobody, "assistant.delta", {"text": "x"})
    await server.log.elsewhere(session, SESSION_RECORD, {"owner": "o"})
    await trio.testing.wait_all_tasks_blocked()
    assert server.log.reads == reads, "no read for frames nobody here follows"
    assert woken == [], "nor a turn of the tail's task: the notice moved its cursor"
    delta = await server.log.elsewhere(session, "assistant.delta", {"text": "b"})
    await trio.testing.wait_all_tasks_blocked()
    assert seqs(sink) == [first.seq, delta.seq] and server.log.reads == reads + 1


class Undelivering(RecordingSink):
    """A follower events pushed to cannot reach (as a 2026-07-28 caller's own connection)."""

    delivers = False


async def test_frames_of_a_session_whose_followers_cannot_be_reached_are_not_read(server: Server) -> None:
    """A session followed only by sinks that deliver nothing (a 2026-07-28 caller that declared its
    tools here: its events ride its requests) costs no read of another server's frames."""
    server.log.name_fields = True
    session, sink = server.followed()
    first = await server.log.elsewhere(session, "assistant.delta", {"text": "a"})
    await trio.testing.wait_all_tasks_blocked()
    reads = server.log.reads
    silent = server.sessions.get_or_create(INSTANCE, "mcp", "s2")
    server.sessions.follow(silent, Undelivering())
    await server.log.elsewhere(silent, "caller_tool_request", {"request_id": "r1"})
    await trio.testing.wait_all_tasks_blocked()
    assert server.log.reads == reads and seqs(sink) == [first.seq]


async def test_this_servers_own_append_read_before_it_returned_is_not_pushed_again(server: Server) -> None:
    session, sink = server.followed()
    await server.log.elsewhere(session, "assistant.delta", {"text": "a"})  # the tail reads from here on
    await server.caught_up()
    server.log.query_gate, server.log.append_gate = trio.Event(), trio.Event()
    theirs = await server.log.elsewhere(session, "assistant.delta", {"text": "b"})  # the tail's read begins
    await trio.testing.wait_all_tasks_blocked()
    mine: list[Frame] = []
    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:

            async def append_here() -> None:
                mine.append(await server.frame_log.append(session, "caller_tool_result", {"request_id": "r1"}))

            nursery.start_soon(append_here)
            await trio.testing.wait_all_tasks_blocked()  # committed, not yet returned
            server.log.query_gate.set()  # the read sees it
            await trio.testing.wait_all_tasks_blocked()
            server.log.append_gate.set()
    await server.caught_up()
    assert sorted(seqs(sink)) == [1, theirs.seq, mine[0].seq], \
        "log tail: a frame appended here is pushed once (by FrameLog), even when the tail read it first"


async def test_notices_of_this_servers_own_appends_cost_no_read(server: Server) -> None:
    session, sink = server.followed()
    await server.log.elsewhere(session, "assistant.delta", {"text": "a"})
    await server.caught_up()
    reads = server.log.reads
    for i in range(5):
        await server.frame_log.append(session, "user.message", {"text": str(i)})
    await trio.testing.wait_all_tasks_blocked()
    assert server.log.reads == reads, "log tail: the notice of an append made here needs no read of the log"
    assert seqs(sink) == [1, 2, 3, 4, 5, 6]


async def test_notices_lost_while_the_listener_was_away_are_read_again_from_the_cursor(server: Server) -> None:
    session, sink = server.followed()
    first = await server.log.elsewhere(session, "assistant.delta", {"text": "a"})
    await server.caught_up()
    server.log.lose_notices = True
    lost = [await server.log.elsewhere(session, "assistant.delta", {"text": str(i)}) for i in range(3)]
    server.log.lose_notices = False
    await trio.testing.wait_all_tasks_blocked()
    assert seqs(sink) == [first.seq], "the notices were lost: nothing read yet"
    server.tail.missed()  # the listener reconnected
    await trio.testing.wait_all_tasks_blocked()
    assert seqs(sink) == [first.seq, *(f.seq for f in lost)], "log tail: nothing lost across a LISTEN reconnect"


async def test_a_read_that_fails_otherwise_is_contained_and_tried_again(
    server: Server, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture,
) -> None:
    session, sink = server.followed()
    server.log.fail_reads = 1
    server.log.fail_with = RuntimeError("a bug in the store")
    frame = await server.log.elsewhere(session, "caller_tool_request", {"request_id": "r1"})
    await server.caught_up()
    assert seqs(sink) == [frame.seq], "log tail: an unexpected failure ends neither the tail nor the server"
    assert "log tail: reading the frames other servers appended failed" in caplog.text


async def test_a_store_outage_delays_the_push_and_loses_nothing(
    server: Server, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture,
) -> None:
    session, sink = server.followed()
    server.log.fail_reads = 2
    frame = await server.log.elsewhere(session, "caller_tool_request", {"request_id": "r1"})
    await server.caught_up()
    assert seqs(sink) == [frame.seq], "log tail: read again after the outage, the frame is pushed"
    assert "log tail: cannot read the frames other servers appended" in caplog.text


async def test_an_instance_nobody_follows_here_is_not_read(server: Server) -> None:
    session = server.sessions.get_or_create(INSTANCE, "mcp", "s1")  # held (e.g. for the relay), no follower
    for i in range(3):
        await server.log.elsewhere(session, "assistant.delta", {"text": str(i)})
    await trio.testing.wait_all_tasks_blocked()
    assert server.log.reads == 0, "log tail: one read per wake of a followed instance only"
    sink = RecordingSink()
    server.sessions.follow(session, sink)
    later = await server.log.elsewhere(session, "assistant.delta", {"text": "later"})
    await server.caught_up()
    assert seqs(sink) == [later.seq], "log tail: a follower gets what is appended after it follows"


@pytest.mark.parametrize(("type", "payload"), [
    (SESSION_RECORD, {"owner": "key:abc"}),
    (POLICY_DECISION, {"tool": "myapp_rm", "kind": "caller", "owner": "myapp", "effect": "permit", "policies": ["p"]}),
])
async def test_server_records_are_pushed_to_nobody(server: Server, type: str, payload: dict) -> None:
    session, sink = server.followed()
    await server.log.elsewhere(session, type, payload)
    delta = await server.log.elsewhere(session, "assistant.delta", {"text": "a"})
    await server.caught_up()
    assert seqs(sink) == [delta.seq], f"log tail: a {type} is no event of the conversation"


async def test_memory_is_bounded_by_the_instances_it_keeps(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    import oubliette_server.features.cluster.log_tail as log_tail

    monkeypatch.setattr(log_tail, "MAX_INSTANCES", 3)
    for i in range(10):
        await server.log.store.append(f"box{i}", channel="mcp", session_id="s", type="assistant.delta", payload={})
        server.tail.appended(f"box{i}", 1, 1)
    await trio.testing.wait_all_tasks_blocked()
    assert len(server.tail._cursor) == 3 and not server.tail._here and not server.tail._dirty


async def test_the_pushes_are_counted_in_the_metrics(nursery: trio.Nursery) -> None:
    metrics = ServerMetrics()
    here = Server(SharedLogDouble(), on_pushed=metrics.log_tail_pushed)
    await nursery.start(here.tail.serve)
    session, _ = here.followed()
    await here.log.elsewhere(session, "assistant.delta", {"text": "a"})
    await here.caught_up()
    page = metrics.page().decode()
    assert "oubliette_log_tail_pushed_total 1.0" in page
    assert "oubliette_log_tail_push_seconds_count 1.0" in page


def test_the_registry_says_which_instances_are_followed_without_a_scan_and_keeps_nothing_after() -> None:
    sessions = SessionRegistry()
    one, two = sessions.get_or_create(INSTANCE, "mcp", "s1"), sessions.get_or_create(INSTANCE, "mcp", "s2")
    for i in range(100):
        sessions.get_or_create(INSTANCE, "mcp", f"idle{i}")  # held, followed by nobody
    a, b = RecordingSink(), RecordingSink()
    assert not sessions.followed(INSTANCE)
    sessions.follow(one, a)
    sessions.follow(two, b)
    assert sessions.followed(INSTANCE) and not sessions.followed("box2")
    sessions.unfollow(one, a)
    assert sessions.followed(INSTANCE), "s2 is still followed"
    sessions.drop_sink(b)  # its caller left
    assert not sessions.followed(INSTANCE) and not sessions._followed, "sessions: the index keeps nothing once unfollowed"
    sessions.follow(one, a)
    sessions.forget(one)
    assert not sessions._followed, "sessions: a forgotten session leaves the index"
