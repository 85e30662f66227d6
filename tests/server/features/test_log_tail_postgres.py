"""The log tail on a real PostgreSQL (docs/SCALING.md, "The log tail").

The notices of appends (`NOTIFY oubliette_frames` with the instance and its seqs) as a store
object hears them, and a real server A whose caller gets, as pushed events, the frames another
writer of the log appended — also those appended while A's `LISTEN` connection was down. The
other writer is the test's own store object: to A it is another server like any other (the
log is all that passes between servers), and it lets the test append exactly while A cannot
listen. Two real servers and a real agent: tests/e2e/test_cluster_calls.py.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
import trio

from harness import EVENT_TIMEOUT, Deployment
from oubliette_server.store.api import CursorPruned, FrameFields, FrameQuery
from oubliette_server.store.postgres import PostgresFrameStore, notice_payload, parse_notice, read_notice
from loop_caller import INSTANCE, IDLE

LISTEN_QUERY = "LISTEN oubliette_frames"


class Notices:
    """An `AppendNoticeHook` that keeps what it hears and can be awaited."""

    def __init__(self) -> None:
        self.heard: list[tuple[str, int | None, int | None]] = []
        self.fields: list[list[FrameFields] | None] = []
        self.missed_count = 0
        self._changed = trio.Event()

    def appended(self, instance: str, first: int | None, last: int | None, fields: list[FrameFields] | None = None) -> None:
        self.heard.append((instance, first, last))
        self.fields.append(fields)
        self._changed.set()
        self._changed = trio.Event()

    def missed(self) -> None:
        self.missed_count += 1

    async def until(self, count: int) -> None:
        with trio.fail_after(EVENT_TIMEOUT):
            while len(self.heard) < count:
                await self._changed.wait()


def test_a_notice_names_the_instance_and_the_seqs_and_an_older_servers_is_read_too() -> None:
    assert parse_notice(notice_payload("box1", 7, 9)) == ("box1", 7, 9)
    assert parse_notice(notice_payload("a\tb", 1, 1)) == ("a\tb", 1, 1), "split from the right"
    assert parse_notice("box1") == ("box1", None, None), "an earlier version's payload is the instance alone"


def test_a_notice_names_each_frames_filter_fields_bounded_and_escaped() -> None:
    """The fields a long poll and the log tail filter on ride the notice, so a server learns them
    without a read; a tab or a quote in them cannot break the payload apart, and a list too long
    for NOTIFY is left out (the reader then reads, as for an older server's notice)."""
    fields = [("mcp", "s1", "caller_tool_request", None), ("mcp", 'a\tb"]', "caller_tool_result", "m1")]
    payload = notice_payload("a\tb", 4, 5, fields)
    assert read_notice(payload) == ("a\tb", 4, 5, fields)
    assert parse_notice(payload) == ("a\tb", 4, 5)
    assert read_notice(notice_payload("box1", 7, 9)) == ("box1", 7, 9, None), "the seqs alone: no fields"
    assert read_notice(notice_payload("box1", 7, 8, fields[:1])) == ("box1", 7, 8, None), "one per seq, or none"
    many = [("mcp", "s" * 128, "assistant.delta", None)] * 50
    assert len(notice_payload("box1", 1, 50, many)) < 200 and read_notice(notice_payload("box1", 1, 50, many))[3] is None


async def test_every_kind_of_append_by_another_store_is_heard_with_its_seqs(pg_url: str) -> None:
    writer, reader = PostgresFrameStore(pg_url), PostgresFrameStore(pg_url)
    notices = Notices()
    async with writer.running(), reader.running():
        reader.hear_appends(notices)
        one = await writer.append(INSTANCE, channel="mcp", session_id="s", type="assistant.delta", payload={})
        many = await writer.append_many(INSTANCE, [
            {"channel": "mcp", "session_id": "s", "type": "assistant.delta", "payload": {"text": str(i)}} for i in range(3)
        ])
        outcome = await writer.append_outcome(INSTANCE, "r1", channel="mcp", session_id="s",
                                              type="caller_tool_result", payload={"request_id": "r1"})
        assert outcome is not None
        await notices.until(3)
    assert notices.heard == [
        (INSTANCE, one.seq, one.seq), (INSTANCE, many[0].seq, many[-1].seq), (INSTANCE, outcome.seq, outcome.seq),
    ]
    delta, result = ("mcp", "s", "assistant.delta", None), ("mcp", "s", "caller_tool_result", None)
    assert notices.fields == [[delta], [delta] * 3, [result]], "each frame's filter fields ride its notice"


async def test_the_tails_read_on_the_loop_is_query_without_filters(pg_url: str) -> None:
    """`frames_after` (the log tail's read, sent on the Trio loop) returns what `query` returns,
    refuses a cursor below what retention deleted as `query` does, and survives its connection
    being cut."""
    store = PostgresFrameStore(pg_url, retention_frames=5, prune_every=1)
    async with store.running():
        assert await store.frames_after("nobody", 0, 10) == []
        for i in range(8):
            await store.append(INSTANCE, channel="mcp", session_id=f"s{i % 2}", type="assistant.delta",
                               payload={"text": f"é{i}", "n": i}, reply_to="m1" if i == 3 else None)
        kept = await store.query(INSTANCE, FrameQuery(after_seq=3, limit=10))
        assert await store.frames_after(INSTANCE, 3, 10) == kept
        assert await store.frames_after(INSTANCE, 3, 2) == kept[:2]
        with pytest.raises(CursorPruned):
            await store.frames_after(INSTANCE, 0, 10)
        # Sent unchecked on an idle connection (a read), and once more on a new one when it is gone.
        dbname = psycopg.conninfo.conninfo_to_dict(pg_url)["dbname"]
        with psycopg.connect(pg_url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                          "WHERE datname = %s AND pid <> pg_backend_pid()", (dbname,))
        with trio.fail_after(EVENT_TIMEOUT):
            assert await store.frames_after(INSTANCE, 3, 10) == kept


async def listeners(admin: psycopg.Connection, dbname: str) -> int:
    row = admin.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND query = %s", (dbname, LISTEN_QUERY),
    ).fetchone()
    assert row is not None
    return int(row[0])


async def test_frames_appended_while_the_servers_listen_connection_was_down_still_reach_its_caller(
    pg_url: str, postgres_server: Any,
) -> None:
    """The caller on A follows its session; A's `LISTEN` connection is cut and cannot come back
    (the database takes no new connections) while another writer appends three frames to the
    session, whose notices A never gets. When A listens again its tail reads from its cursor:
    the caller gets all three pushed, once each."""
    dbname = psycopg.conninfo.conninfo_to_dict(pg_url)["dbname"]
    a = Deployment(store=pg_url)
    other = PostgresFrameStore(pg_url)
    try:
        async with a.http_server("--config", str(a.config_file(INSTANCE))) as server_a, \
                server_a.caller(mode="legacy") as (client, events), other.running():
            with trio.fail_after(EVENT_TIMEOUT):
                sent = await client.call_tool("session_message", {
                    "instance": INSTANCE, "session_id": "s1", "message": IDLE,
                })
            assert not sent.is_error, sent
            first = await other.append(INSTANCE, channel="mcp", session_id="s1", type="assistant.delta",
                                       payload={"text": "before"})
            await events.wait_type("assistant.delta", seq=first.seq)  # the tail pushes another writer's frame

            with psycopg.connect(postgres_server.url(), autocommit=True) as admin:
                admin.execute(f'ALTER DATABASE "{dbname}" WITH ALLOW_CONNECTIONS false')
                try:
                    admin.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND query = %s",
                        (dbname, LISTEN_QUERY),
                    )
                    with trio.fail_after(EVENT_TIMEOUT):  # the cut backends are gone
                        while await listeners(admin, dbname):
                            await trio.sleep(0.01)  # pg_stat_activity has no event to wait on
                    # A cannot listen now: these notices are lost to it.
                    lost = [await other.append(INSTANCE, channel="mcp", session_id="s1", type="assistant.delta",
                                               payload={"text": f"while away {i}"}) for i in range(3)]
                finally:
                    admin.execute(f'ALTER DATABASE "{dbname}" WITH ALLOW_CONNECTIONS true')
            for frame in lost:
                await events.wait_type("assistant.delta", seq=frame.seq)
            after = await other.append(INSTANCE, channel="mcp", session_id="s1", type="assistant.delta",
                                       payload={"text": "after"})
            await events.wait_type("assistant.delta", seq=after.seq)
            seqs = [e["seq"] for e in events.events if e.get("session_id") == "s1"]
            assert len(seqs) == len(set(seqs)), f"an event was pushed twice: {seqs}"
            stored = await other.query(INSTANCE, FrameQuery(session_id="s1", types=("assistant.delta",), limit=50))
            assert [f.seq for f in stored] == [first.seq, *(f.seq for f in lost), after.seq]
    finally:
        a.cleanup()
