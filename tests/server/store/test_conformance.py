"""One suite, both frame stores: SQLite (store/sqlite.py) and PostgreSQL (store/postgres.py) keep the same promises.

Each test runs once per backend (the `backend` fixture). PostgreSQL is a real server started by
tests/support/postgres.py, one per pytest worker, with a fresh database per test. What only one backend
promises is said where it is tested: wake-ups across two store objects on one database are a
PostgreSQL promise (SQLite's wake-ups are in-process, docs/TETHER.md).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import pytest
import trio
import trio.testing

from protocol import errors
from protocol.frames import TURN_END_TYPES
from oubliette_server.program.config import ServerConfig
from oubliette_server.store.sqlite import FrameStore
from oubliette_server.store import postgres as postgres_store
from oubliette_server.store import sqlite as sqlite_store
from oubliette_server.store.api import (
    DECLARATION_KEY,
    MAX_RECORDED_INSTANCES,
    OWNER_KEY,
    SESSION_RECORD,
    CursorPruned,
    FrameQuery,
    FrameStoreAPI,
    RecordedSession,
    AppendIdReused,
    StoreUnavailable,
    TurnEnded,
)
from oubliette_server.store.postgres import MIGRATIONS, PostgresFrameStore
from frame_polls import two_session_polls

ROOT = Path(__file__).resolve().parents[3]


class Backend:
    """Where one backend's database lives; `open()` runs a store object on it (as a server would)."""

    def __init__(self, name: str, location: str) -> None:
        self.name = name
        self.location = location

    def make(self, **kw: Any) -> FrameStoreAPI:
        if self.name == "sqlite":
            return FrameStore(self.location, **kw)
        return PostgresFrameStore(self.location, **kw)

    @asynccontextmanager
    async def open(self, **kw: Any) -> AsyncIterator[FrameStoreAPI]:
        store = self.make(**kw)
        async with store.running():
            yield store


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "sqlite":
        return Backend("sqlite", str(tmp_path / "frames.sqlite3"))
    return Backend("postgres", request.getfixturevalue("pg_url"))


@pytest.fixture
async def store(backend: Backend) -> AsyncIterator[FrameStoreAPI]:
    async with backend.open() as s:
        yield s


async def add(store: FrameStoreAPI, instance: str = "box1", **kw: Any) -> Any:
    kw.setdefault("channel", "host")
    kw.setdefault("session_id", "s1")
    kw.setdefault("type", "assistant.delta")
    kw.setdefault("payload", {})
    return await store.append(instance, **kw)


async def race_on_two_stores(
    a: FrameStoreAPI, b: FrameStoreAPI, keys: list[str], call: Callable[[FrameStoreAPI, str, str], Awaitable[Any]],
) -> dict[str, list[Any]]:
    """`call(store, key, who)` for every key on both stores at once (`who`: "a" or "b"), as two
    servers sharing one database race: each key's results, in the order they came."""
    results: dict[str, list[Any]] = {}

    async def one(store: FrameStoreAPI, key: str, who: str) -> None:
        results.setdefault(key, []).append(await call(store, key, who))

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for key in keys:
                nursery.start_soon(one, a, key, "a")
                nursery.start_soon(one, b, key, "b")
    return results


async def race_held_at_the_row(
    pg_url: str, a: FrameStoreAPI, b: FrameStoreAPI, call: Callable[[FrameStoreAPI, str], Awaitable[Any]], statement: str,
) -> list[Any]:
    """`call(store, who)` on both stores at once, the race made certain: a third connection holds
    box1's row of `instances` until both statements (beginning with `statement`) wait for it, then
    lets go. The results, in the order they came."""
    import psycopg

    raced: list[Any] = []

    async def send(store: FrameStoreAPI, who: str) -> None:
        raced.append(await call(store, who))

    with psycopg.connect(pg_url) as blocker:
        blocker.execute("SELECT 1 FROM instances WHERE name = 'box1' FOR UPDATE")
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send, a, "a")
                nursery.start_soon(send, b, "b")
                with psycopg.connect(pg_url, autocommit=True) as watcher:
                    while watcher.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE %s",
                        (statement + "%",),
                    ).fetchone()[0] < 2:  # type: ignore[index]
                        await trio.sleep(0.01)  # pg_stat_activity has no event to wait on
                blocker.rollback()
    return raced


async def seqs(store: FrameStoreAPI, instance: str = "box1", **kw: Any) -> list[int]:
    return [f.seq for f in await store.query(instance, FrameQuery(**kw))]


def test_both_implement_the_interface(tmp_path: Path) -> None:
    assert isinstance(FrameStore(tmp_path / "x.db"), FrameStoreAPI)
    assert isinstance(PostgresFrameStore("postgresql://u@/d?host=/nowhere"), FrameStoreAPI)


async def test_the_readiness_probe_passes_while_open_and_fails_once_closed(backend: Backend) -> None:
    """`check_available` (what /readyz asks): quiet on a running store, `StoreUnavailable` on one
    whose database is gone (here: closed), within its timeout."""
    store = backend.make()
    async with store.running():
        with trio.fail_after(5):
            await store.check_available(2.0)
    with trio.fail_after(5), pytest.raises(StoreUnavailable, match="store .* (is unavailable|LISTEN)"):
        await store.check_available(2.0)


# -- append and seq ------------------------------------------------------------------------


async def test_append_assigns_gapless_seq_per_instance(store: FrameStoreAPI) -> None:
    a = [await add(store, "a", payload={"i": i, "text": "é ✓"}) for i in range(5)]
    b = [await add(store, "b") for _ in range(3)]
    many = await store.append_many("a", [
        {"channel": "mcp", "session_id": "s2", "type": "user.message", "payload": {"n": n}} for n in range(3)
    ])
    assert [f.seq for f in a] == [1, 2, 3, 4, 5]
    assert [f.seq for f in b] == [1, 2, 3]
    assert [f.seq for f in many] == [6, 7, 8]
    assert await store.last_seq("a") == 8 and await store.last_seq("b") == 3 and await store.last_seq("c") == 0
    assert await store.instances() == ["a", "b"]
    stored = await store.query("a", FrameQuery(limit=200))
    assert stored == [*a, *many], "a query returns exactly what append returned"
    assert stored[0].payload == {"i": 0, "text": "é ✓"}


async def test_bad_input_stores_nothing(store: FrameStoreAPI) -> None:
    await add(store)
    with pytest.raises(ValueError):
        await add(store, payload={"x": float("nan")})
    with pytest.raises(TypeError):
        await add(store, payload=["not", "a", "dict"])
    with pytest.raises(ValueError):
        await add(store, channel="")
    with pytest.raises(TypeError):
        await store.append_many("box1", [{"channel": "host"}])
    assert (await add(store)).seq == 2


async def test_concurrent_appends_are_gapless_and_tailing_reader_misses_none(store: FrameStoreAPI) -> None:
    """Several writers on one instance; a reader following by after_seq sees every seq once."""
    writers, each = 4, 25
    seen: list[int] = []

    async def write(w: int) -> None:
        for i in range(each):
            await add(store, payload={"w": w, "i": i})

    async def read() -> None:
        after = 0
        while after < writers * each:
            frames, _ = await store.wait_for_frames("box1", FrameQuery(after_seq=after, limit=200), timeout=10)
            seen.extend(f.seq for f in frames)
            if frames:
                after = frames[-1].seq

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            for w in range(writers):
                nursery.start_soon(write, w)
    assert seen == list(range(1, writers * each + 1))


async def test_seq_survives_restart_and_retention(backend: Backend) -> None:
    async with backend.open(retention_frames=2, prune_every=1) as s:
        for _ in range(5):
            await add(s)
        await s.set_cursor("box1", "delivered", 4)
    async with backend.open(retention_frames=2, prune_every=1) as s:
        assert await s.last_seq("box1") == 5
        assert await s.pruned_below("box1") == 3
        assert await seqs(s, after_seq=3) == [4, 5]
        assert (await add(s)).seq == 6, "seq is never reset, not by a restart nor by pruning"
        assert await s.get_cursor("box1", "delivered") == 4


# -- queries -------------------------------------------------------------------------------


async def test_filtered_query(store: FrameStoreAPI) -> None:
    await add(store, type="user.message", msg_id="m-u1")                           # 1
    await add(store, type="assistant.delta", reply_to="m-u1")                      # 2
    await add(store, type="status.presence", reply_to="m-u1")                      # 3
    await add(store, channel="mcp", type="user.message")                           # 4
    await add(store, session_id="s2", type="user.message", msg_id="m-u3")          # 5
    await add(store, type="assistant.done", reply_to="m-u1")                       # 6
    await add(store, channel="mcp", type="assistant.done")                         # 7
    await add(store, session_id="s2", type="assistant.done", reply_to="m-u3")      # 8
    await add(store, "box2")
    assert await seqs(store) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert await seqs(store, channel="mcp") == [4, 7]
    assert await seqs(store, session_id="s1") == [1, 2, 3, 4, 6, 7]
    assert await seqs(store, channel="host", session_id="s1", after_seq=2) == [3, 6]
    assert await seqs(store, types=["assistant.done", "user.message"]) == [1, 4, 5, 6, 7, 8]
    assert await seqs(store, types=["assistant.done", "user.message"], after_seq=4, limit=2) == [5, 6]
    assert await seqs(store, channel="host", session_id="s1", types=["assistant.done", "status.presence"]) == [3, 6]
    assert await seqs(store, reply_to="m-u1") == [2, 3, 6]
    assert await seqs(store, reply_to="m-u3", channel="host", session_id="s2") == [8]
    assert await seqs(store, types=[]) == await seqs(store)
    assert await seqs(store, after_seq=100) == []
    assert await seqs(store, "box2") == [1]
    assert await seqs(store, "nobody") == []


# -- a session's records across instances (docs/SCALING.md, "Every server knows every session") --


async def record(store: FrameStoreAPI, instance: str, payload: dict[str, Any], session_id: str = "s1") -> None:
    await add(store, instance, channel="mcp", session_id=session_id, type=SESSION_RECORD, payload=payload)


async def test_session_records_name_each_instance_with_its_first_owner_and_last_declaration(store: FrameStoreAPI) -> None:
    tools = {"caller_id": "myapp", "tools": [{"name": "notify"}]}
    again = {"caller_id": "myapp", "tools": [{"name": "notify"}, {"name": "ask é"}]}
    await record(store, "b", {OWNER_KEY: "key:bob", DECLARATION_KEY: tools})  # b made before a
    await add(store, "a", channel="mcp", type="user.message", payload={OWNER_KEY: "not a record"})
    await record(store, "b", {OWNER_KEY: "key:later", DECLARATION_KEY: again})
    await record(store, "b", {OWNER_KEY: "key:bob"})  # recorded again, declaring nothing
    await record(store, "a", {OWNER_KEY: 7})  # an owner that is no identity counts for nothing
    await record(store, "a", {OWNER_KEY: "key:ann", DECLARATION_KEY: "not a declaration"})
    await record(store, "c", {OWNER_KEY: "key:cy"}, session_id="s2")
    await add(store, "c", channel="host", session_id="s1", type=SESSION_RECORD, payload={OWNER_KEY: "key:other channel"})

    assert await store.session_records("mcp", "s1") == [
        RecordedSession("a", "key:ann", None), RecordedSession("b", "key:bob", again),
    ], "by instance name, as instances() sorts them"
    assert await store.session_records("mcp", "s2") == [RecordedSession("c", "key:cy", None)]
    assert await store.session_records("mcp", "s-unknown") == []
    assert await store.session_records("mcp", "s1", limit=1) == [RecordedSession("a", "key:ann", None)], \
        "at most `limit` instances, the first by name"
    assert await store.session_records("mcp", "s1", instance="b") == [RecordedSession("b", "key:bob", again)], \
        "one instance's records (LogBus.session_record)"
    assert await store.session_records("mcp", "s2", instance="a") == []


async def test_session_records_are_bounded_and_read_by_their_index(backend: Backend) -> None:
    """However many instances hold the id, one query reports at most `MAX_RECORDED_INSTANCES`; its
    plan reads the frames through the partial index of session records, never by a scan."""
    async with backend.open() as store:
        for n in range(MAX_RECORDED_INSTANCES + 5):
            await record(store, f"box{n:03}", {OWNER_KEY: "key:owner"})
        for instance in ("box000", "box001"):
            await store.append_many(instance, [
                {"channel": "mcp", "session_id": f"s{i % 7}", "type": "user.message", "payload": {"i": i}}
                for i in range(200)
            ])
        found = await store.session_records("mcp", "s1")
        assert [r.instance for r in found] == [f"box{n:03}" for n in range(MAX_RECORDED_INSTANCES)]
        assert {r.owner for r in found} == {"key:owner"}
        assert await store.session_records("mcp", "s1", instance="box001") == [RecordedSession("box001", "key:owner", None)]
        plans = []
        # Across instances (learn), in one (LogBus.session_record), and one owner's across instances.
        for instance, owner in ((None, None), ("box001", None), (None, "key:owner")):
            params = {"sid": "s1", "ch": "mcp", "limit": 100, "inst": instance, "owner": owner}
            module = sqlite_store if isinstance(store, FrameStore) else postgres_store
            sql = module.SESSION_RECORDS_SQL if owner is None else module.OWNED_SESSION_RECORDS_SQL
            if isinstance(store, FrameStore):
                plans.append([row[3] for row in store._db.execute("EXPLAIN QUERY PLAN " + sql, params)])
            else:
                import psycopg

                with psycopg.connect(backend.location) as conn:
                    conn.execute("ANALYZE frames")
                    plans.append([row[0] for row in conn.execute("EXPLAIN " + sql, params)])
    for plan in plans:
        along = [step for step in plan if "frames_session_records" in step or "frames_session_owners" in step]
        assert len(along) >= 3, plan  # the instances, an owner, a declaration: each along a records index
        assert not any("Seq Scan" in step or step.startswith(("SCAN frames", "SCAN f ")) for step in plan), plan
    assert any("frames_session_owners" in step for step in plans[2]), plans[2]  # one owner's instances, by its index


async def test_a_callers_own_session_records_are_found_whatever_others_recorded_under_its_id(store: FrameStoreAPI) -> None:
    """A session id is a name: another caller may record it in more instances than the bound, all
    named before the owner's. `owner=` finds the owner's own instances all the same (the first
    owner is what counts), within the bound."""
    for n in range(MAX_RECORDED_INSTANCES):
        await record(store, f"a{n:03}", {OWNER_KEY: "key:other"})
    await record(store, "zz-mine", {OWNER_KEY: "key:me", DECLARATION_KEY: {"caller_id": "app", "tools": []}})
    await record(store, "zz-mine", {OWNER_KEY: "key:other"})
    await record(store, "zz-theirs", {OWNER_KEY: "key:other"})
    await record(store, "zz-theirs", {OWNER_KEY: "key:me"})  # not its first owner: not the caller's
    assert "zz-mine" not in [r.instance for r in await store.session_records("mcp", "s1")], \
        "the bound is filled by the other caller's instances"
    assert await store.session_records("mcp", "s1", owner="key:me") == [
        RecordedSession("zz-mine", "key:me", {"caller_id": "app", "tools": []})
    ]
    assert await store.session_records("mcp", "s1", owner="key:me", instance="zz-mine") != []
    assert await store.session_records("mcp", "s1", owner="key:me", instance="a000") == []
    assert await store.session_records("mcp", "s1", owner="key:nobody") == []
    assert len(await store.session_records("mcp", "s1", owner="key:other")) == MAX_RECORDED_INSTANCES


async def test_a_log_made_before_the_records_index_gets_it_when_opened(backend: Backend) -> None:
    """A store made by an earlier version (no `frames_session_records`; on PostgreSQL, schema
    version 5) gets the index when a server opens it, and its records are found through it."""
    async with backend.open() as store:
        await record(store, "box1", {OWNER_KEY: "key:owner"})
    if backend.name == "sqlite":
        import sqlite3

        with sqlite3.connect(backend.location) as conn:
            conn.execute("DROP INDEX frames_session_records")
    else:
        import psycopg

        with psycopg.connect(backend.location, autocommit=True) as conn:
            conn.execute("DROP INDEX frames_session_records")
            conn.execute("DELETE FROM oubliette_schema WHERE version = 6")
    async with backend.open() as store:
        assert await store.session_records("mcp", "s1") == [RecordedSession("box1", "key:owner", None)]
    if backend.name == "postgres":
        with psycopg.connect(backend.location) as conn:
            assert conn.execute("SELECT 1 FROM pg_indexes WHERE indexname = 'frames_session_records'").fetchone(), \
                "migration 6 applied to a database at version 5"


# -- long poll -----------------------------------------------------------------------------


async def test_wait_wakes_on_append_and_times_out(store: FrameStoreAPI) -> None:
    await add(store)
    got: list[Any] = []

    async def waiter() -> None:
        got.append(await store.wait_for_frames("box1", FrameQuery(after_seq=1, types=("assistant.done",)), 10))

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            while store.waiter_count("box1") != 1:
                await trio.testing.wait_all_tasks_blocked()
            await add(store)  # does not match: the waiter keeps waiting
            done = await add(store, type="assistant.done")
    [(frames, timed_out)] = got
    assert [f.seq for f in frames] == [done.seq] and not timed_out
    assert store.waiter_count() == 0
    assert await store.wait_for_frames("box1", FrameQuery(after_seq=3), 0.05) == ([], True)
    assert await store.wait_for_frames("box1", FrameQuery(after_seq=3), 0) == ([], False)


async def test_a_notice_wakes_only_the_long_polls_that_may_want_its_frames(pg_url: str) -> None:
    """Two sessions' long polls on one instance of this server: another server's append to one session
    wakes that session's poll alone (its notice names the frame's fields); the other poll's event is
    not set, and it keeps waiting (PostgreSQL: each notice is heard by every server)."""
    backend = Backend("postgres", pg_url)
    async with backend.open() as here, backend.open() as there:
        assert isinstance(here, PostgresFrameStore)
        reads = CountedReads(here)
        async with two_session_polls(here) as (got, y_poll):
            reads.heard = trio.Event()
            frame = await add(there, session_id="x")
            await reads.heard.wait()
            assert not y_poll.woken.is_set(), "the notice names a frame of x only"
            await here.waiters_changed.until(lambda: here.waiter_count("box1") == 1)  # x's poll has its answer
            assert list(got) == ["x"] and not y_poll.woken.is_set()
        assert got == {"x": ([frame], False)}


async def test_wait_cancelled_leaves_nothing(store: FrameStoreAPI) -> None:
    with trio.move_on_after(0.05):
        await store.wait_for_frames("box1", FrameQuery(), 10)
    assert store.waiter_count() == 0
    assert (await add(store)).seq == 1


async def test_wait_wakes_across_two_store_objects(pg_url: str) -> None:
    """Two servers on one database: an append through one wakes a waiter of the other
    (PostgreSQL only: SQLite promises in-process wake-ups, docs/TETHER.md)."""
    backend = Backend("postgres", pg_url)
    async with backend.open() as a, backend.open() as b:
        got: list[Any] = []

        async def waiter() -> None:
            got.append(await b.wait_for_frames("box1", FrameQuery(), 10))

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(waiter)
                while b.waiter_count("box1") != 1:
                    await trio.testing.wait_all_tasks_blocked()
                frame = await add(a)
        [(frames, timed_out)] = got
        assert frames == [frame] and not timed_out


class CountedReads:
    """Counts a PostgreSQL store's long-poll reads of the log (`_read_on_loop`; `of(session_id)`: those
    of one session's queries); `after(n)` is set once `n` have ended, and `heard` at each NOTIFY the
    store hears (a fresh one taken by `next`)."""

    def __init__(self, store: PostgresFrameStore) -> None:
        self.count = 0
        self.last = 0
        self.notices: list[tuple[str, int | None]] = []
        self.sessions: list[str | None] = []
        self._ended = 0
        self._after: dict[int, trio.Event] = {}
        self.heard = trio.Event()
        real_read = store._read_on_loop

        async def counted(*args: Any) -> Any:
            self.count += 1
            self.sessions.append(args[1].session_id)
            try:
                return await real_read(*args)
            finally:
                self._ended += 1
                self.after(self._ended).set()

        store._read_on_loop = counted  # type: ignore[method-assign, assignment]
        store.hear_appends(self)

    def after(self, n: int) -> trio.Event:
        return self._after.setdefault(n, trio.Event())

    def of(self, session_id: str) -> int:
        return self.sessions.count(session_id)

    def appended(self, instance: str, first: int | None, last: int | None, fields: Any = None) -> None:
        self.last = max(self.last, last or 0)
        self.notices.append((instance, last))
        self.heard.set()

    async def until(self, seq: int) -> None:
        """Return once the store heard the notices up to `seq`."""
        while self.last < seq:
            self.heard = trio.Event()
            await self.heard.wait()

    def missed(self) -> None:
        pass


async def test_a_waiter_reads_nothing_for_this_servers_appends_it_does_not_match(pg_url: str) -> None:
    """A long poll woken by this store's own append of another session (directly, then by the
    append's NOTIFY through LISTEN) reads the log no more: it knows that frame is not for it. An
    append it matches ends the wait with that frame, from memory: this server stored it, so it
    knows it whole (PostgreSQL: its reads cost round trips)."""
    async with Backend("postgres", pg_url).open() as s:
        assert isinstance(s, PostgresFrameStore)
        reads = CountedReads(s)
        got: list[Any] = []

        async def waiter() -> None:
            got.append(await s.wait_for_frames("box1", FrameQuery(session_id="mine"), 10))

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(waiter)
                await reads.after(1).wait()
                await add(s)  # session s1
                await reads.heard.wait()
                await trio.testing.wait_all_tasks_blocked()
                assert reads.count == 1, "no read for a frame of another session appended here"
                mine = await s.append("box1", channel="mcp", session_id="mine", type="user.message", payload={})
        assert got == [([mine], False)] and reads.count == 1, "this server's own frame is not read back"


def recorded_calls(owner: Any, name: str) -> list[Any]:
    """Wrap the method `name` of `owner` (async or not: the wrapper returns what it returns) so that
    each call's first argument is recorded in the list returned."""
    calls: list[Any] = []
    real = getattr(owner, name)

    def recorded(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[0] if args else None)
        return real(*args, **kwargs)

    setattr(owner, name, recorded)
    return calls


async def test_a_query_is_one_statement_on_the_loop_not_a_pooled_transaction(pg_url: str) -> None:
    """`query` (a server reading the requests of a session another server's agent made, before it
    takes an answer) is sent on the Trio loop like a long poll's read: no worker thread, no pooled
    transaction (BEGIN, the query, COMMIT after the pool's check)."""
    async with Backend("postgres", pg_url).open() as s:
        assert isinstance(s, PostgresFrameStore)
        frame = await add(s)
        pooled = recorded_calls(s, "_run")
        assert await s.query("box1", FrameQuery(session_id=frame.session_id, types=(frame.type,))) == [frame]
        assert pooled == []


async def test_waiters_learn_another_servers_append_from_its_notice_and_only_the_matching_one_reads(pg_url: str) -> None:
    """Two long polls of one instance on one server, and another server's append of a third
    session: its NOTIFY names the frame's session, so neither wakes, nor reads the log or its
    fields; an append of one's session is read by that one alone."""
    backend = Backend("postgres", pg_url)
    async with backend.open() as here, backend.open() as there:
        assert isinstance(here, PostgresFrameStore)
        reads = CountedReads(here)
        sent = recorded_calls(here._statements, "rows")
        woken = recorded_calls(here, "_skip_known")
        got: list[Any] = []
        x_answered = trio.Event()

        async def wait_for(session_id: str) -> None:
            got.append(await here.wait_for_frames("box1", FrameQuery(session_id=session_id), 20))
            x_answered.set()

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(wait_for, "y")
                nursery.start_soon(wait_for, "x")
                await reads.after(2).wait()
                before = len(sent)
                await add(there, session_id="other")
                await reads.heard.wait()
                await trio.testing.wait_all_tasks_blocked()
                assert reads.count == 2, "no waiter reads the log for another server's frame of another session"
                assert sent[before:] == [], "nor its fields: the notice named them"
                assert woken == [], "nor wakes: the notice matches no query waiting here"
                mine = await add(there, session_id="x")
                await x_answered.wait()
                nursery.cancel_scope.cancel()
        assert got == [([mine], False)] and reads.count == 2, "the waiter of x took its frame from the notice; y did not read"


async def test_a_long_poll_that_knows_every_frame_after_its_seq_waits_without_a_first_read(pg_url: str) -> None:
    """A long poll that starts after frames this server knows (its own append; another server's,
    named by its notice) none of which matches it waits without reading the log (the caller's
    next poll after an answer, the agent's wait for an outcome after its own request); the
    append it waits for is returned from its notice, without a read."""
    backend = Backend("postgres", pg_url)
    async with backend.open() as here, backend.open() as there:
        assert isinstance(here, PostgresFrameStore)
        reads = CountedReads(here)
        got: list[Any] = []
        answered = trio.Event()

        async def wait_for(session_id: str, after_seq: int) -> None:
            got.append(await here.wait_for_frames("box1", FrameQuery(session_id=session_id, after_seq=after_seq), 20))
            answered.set()

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(wait_for, "y", 0)  # an instance waited on: its notices are kept
                await reads.after(1).wait()
                own = await add(here, session_id="x")
                reads.heard = trio.Event()
                other = await add(there, session_id="w")
                await reads.heard.wait()
                nursery.start_soon(wait_for, "z", own.seq - 1)
                while here.waiter_count("box1") != 2:
                    await trio.testing.wait_all_tasks_blocked()
                await trio.testing.wait_all_tasks_blocked()
                assert reads.count == 1, f"seqs {own.seq} and {other.seq} are known here and not z's: no read"
                mine = await add(there, session_id="z")
                await answered.wait()
                nursery.cancel_scope.cancel()
        assert got == [([mine], False)] and reads.count == 1, "z's waiter took its frame from the notice"


async def a_long_poll_after_lost_notices_reads(
    pg_url: str, lose: Callable[[PostgresFrameStore, PostgresFrameStore], Awaitable[tuple[int, Any]]],
) -> None:
    """With a long poll waiting on box1 here (so what is heard is kept), `lose(here, there)` appends
    and has `here` miss what another server appended (its seq and that frame come back): a long
    poll of the missed frame's session that starts after the seq gets that frame at once."""
    backend = Backend("postgres", pg_url)
    async with backend.open() as here, backend.open() as there:
        assert isinstance(here, PostgresFrameStore) and isinstance(there, PostgresFrameStore)

        async def wait_for_y() -> None:
            await here.wait_for_frames("box1", FrameQuery(session_id="y"), 20)

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(wait_for_y)
                while here.waiter_count("box1") != 1:
                    await trio.testing.wait_all_tasks_blocked()
                after, missed = await lose(here, there)
                with trio.fail_after(5):
                    frames, timed_out = await here.wait_for_frames(
                        "box1", FrameQuery(session_id=missed.session_id, after_seq=after), 20)
                nursery.cancel_scope.cancel()
        assert frames == [missed] and not timed_out


async def test_after_the_listener_reconnects_a_new_long_poll_reads_what_it_may_have_missed(pg_url: str) -> None:
    """Notices sent while the LISTEN connection was down are lost, so what the store heard before
    no longer says what committed: a long poll that starts after the reconnect reads the log, and
    gets another server's frame appended meanwhile at once."""
    import threading

    import psycopg

    async def lose(here: PostgresFrameStore, there: PostgresFrameStore) -> tuple[int, Any]:
        lost, back = trio.Event(), trio.Event()
        gate = threading.Event()
        real_connect, real_replace = here._listen_connection, here._replace_broken_connections

        def gated_connect() -> Any:
            gate.wait(10)  # the reconnect waits until another server's append is made meanwhile
            return real_connect()

        async def replace() -> None:
            lost.set()
            await real_replace()

        class Missed:
            def appended(self, *args: Any) -> None:
                pass

            def missed(self) -> None:
                back.set()

        here._listen_connection = gated_connect  # type: ignore[method-assign]
        here._replace_broken_connections = replace  # type: ignore[method-assign]
        own = await add(here, session_id="x")
        here.hear_appends(Missed())
        dbname = psycopg.conninfo.conninfo_to_dict(pg_url)["dbname"]
        with psycopg.connect(pg_url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                          "WHERE datname = %s AND query LIKE 'LISTEN%%'", (dbname,))
        await lost.wait()
        missed = await add(there, session_id="z")  # its notice never reaches `here`
        gate.set()
        await back.wait()
        return own.seq, missed

    await a_long_poll_after_lost_notices_reads(pg_url, lose)


async def test_after_a_notice_without_seqs_a_new_long_poll_reads(pg_url: str) -> None:
    """An earlier server's notice names the instance alone: frames of unknown seqs committed, so
    what was heard no longer says what did, and a long poll that starts then reads the log."""

    async def lose(here: PostgresFrameStore, there: PostgresFrameStore) -> tuple[int, Any]:
        real_on_notice = here._on_notice
        swallowed = trio.Event()

        def as_an_earlier_server_sent_it(payload: str) -> None:
            instance, _, _, fields = postgres_store.read_notice(payload)
            if fields is None or fields[0][1] != "z":
                real_on_notice(payload)
                return
            real_on_notice(instance)  # z's, as an earlier server sent it: the instance alone
            swallowed.set()

        here._on_notice = as_an_earlier_server_sent_it  # type: ignore[method-assign]
        own = await add(here, session_id="x")
        missed = await add(there, session_id="z")
        await swallowed.wait()
        return own.seq, missed

    await a_long_poll_after_lost_notices_reads(pg_url, lose)


@asynccontextmanager
async def heard_here(
    pg_url: str, here_kw: dict[str, Any] | None = None, seconds: float = 20, **there_kw: Any,
) -> AsyncIterator[tuple[PostgresFrameStore, PostgresFrameStore, CountedReads]]:
    """Two store objects on one database, as two servers (`here`, `there`), with a long poll of a
    session nobody appends to waiting on box1 here (so what `here` hears of box1 is kept) and
    `here`'s reads counted; ended (and the long poll cancelled) within `seconds`."""
    backend = Backend("postgres", pg_url)
    async with backend.open(**(here_kw or {})) as here, backend.open(**there_kw) as there:
        assert isinstance(here, PostgresFrameStore) and isinstance(there, PostgresFrameStore)

        async def wait_for_nobody() -> None:
            after = 0
            while True:
                try:
                    await here.wait_for_frames("box1", FrameQuery(session_id="nobody", after_seq=after), 60)
                except CursorPruned as exc:
                    after = exc.first_seq - 1

        with trio.fail_after(seconds):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(wait_for_nobody)
                while here.waiter_count("box1") != 1:
                    await trio.testing.wait_all_tasks_blocked()
                try:
                    yield here, there, CountedReads(here)
                finally:
                    nursery.cancel_scope.cancel()

async def test_a_frame_from_another_servers_notice_is_the_frame_a_read_returns(pg_url: str) -> None:
    """Another server's append carries its whole frame in its notice: a long poll here that matches it
    gets it without reading, and it is the frame a read returns, to the payload's JSON text and the
    ts (nested values, non-ASCII text, floats, escapes)."""
    payload = {"nested": {"list": [1, 2.5, None, True, "é\t\"q\"\\"], "deep": {"x": 1e-7}}, "text": "héllo ☃ \x01",
               "big": 12345678901234567890, "neg": -0.0}
    async with heard_here(pg_url) as (here, there, reads):
        sent = await add(there, session_id="z", type="caller_tool_request", reply_to="m-1", payload=payload)
        await reads.until(sent.seq)
        heard, _ = await here.wait_for_frames("box1", FrameQuery(session_id="z", after_seq=sent.seq - 1), 20)
        assert reads.count == 0, "the notice carried the frame: no read"
        read = await here.query("box1", FrameQuery(session_id="z", after_seq=sent.seq - 1))
    assert heard == read == [sent]
    assert json.dumps(heard[0].payload) == json.dumps(read[0].payload) and heard[0].ts == read[0].ts
    assert heard[0].to_wire() == read[0].to_wire()


async def test_a_frame_too_large_for_its_notice_is_read(pg_url: str) -> None:
    """A frame past `MAX_NOTICE_FRAMES` is told of by its fields alone (NOTIFY's payload is bounded):
    a long poll that matches it reads it."""
    async with heard_here(pg_url) as (here, there, reads):
        sent = await add(there, session_id="z", payload={"text": "é" * postgres_store.MAX_NOTICE_FRAMES})
        await reads.until(sent.seq)
        got, _ = await here.wait_for_frames("box1", FrameQuery(session_id="z", after_seq=sent.seq - 1), 20)
    assert got == [sent] and reads.count == 1
    assert postgres_store.read_whole_notice(postgres_store.notice_payload("box1", 1, 1, tail=postgres_store.notice_frames(
        [("host", "z", "t", "m", None, json.dumps({"text": "é" * 3000}, ensure_ascii=False), {}, None)], "ts")))[4] is None, \
        "3,000 two-byte characters: past the bound in bytes, fields alone"


async def test_a_long_poll_answered_from_memory_keeps_its_query(pg_url: str) -> None:
    """From memory a long poll gets what its read would: the frames after its seq that match every
    filter (channel, session, types, reply_to), in order, at most its limit."""
    async with heard_here(pg_url) as (here, there, reads):
        start = await add(here, session_id="z")
        for kw in ({"type": "a"}, {"type": "b"}, {"channel": "other", "type": "a"}, {"type": "a", "reply_to": "r"},
                   {"session_id": "y", "type": "a"}, {"type": "a"}, {"type": "a"}):
            await reads.until((await add(there, **{"session_id": "z", **kw})).seq)
        queries = [FrameQuery(channel="host", session_id="z", types=["a"], after_seq=start.seq, limit=2),
                   FrameQuery(session_id="z", reply_to="r", after_seq=start.seq),
                   FrameQuery(channel="other", after_seq=start.seq),
                   FrameQuery(types=["b", "a"], after_seq=start.seq + 1, limit=3)]
        got = [(await here.wait_for_frames("box1", q, 20))[0] for q in queries]
        assert reads.count == 0, "every frame after the seq is known whole here"
        read = [await here.query("box1", q) for q in queries]
    assert got == read and [len(frames) for frames in got] == [2, 1, 1, 3]


async def test_what_is_kept_is_bounded_and_only_of_instances_waited_on(pg_url: str) -> None:
    """A store keeps at most about `KNOWN_FRAMES_KEPT` frames of an instance a long poll waits on
    here, and nothing of one nobody waits on; a long poll further behind than that reads."""
    kept = postgres_store.KNOWN_FRAMES_KEPT
    async with heard_here(pg_url, seconds=60) as (here, there, reads):
        first = await add(there, session_id="z")
        await there.append_many("box1", [{"channel": "host", "session_id": "z", "type": "t", "payload": {"i": i}}
                                         for i in range(2 * kept + 10)])
        await add(there, instance="box2")
        last = await add(there, session_id="z")
        await reads.until(last.seq)  # (box2's notice came before: notices come in commit order)
        assert len(here._known["box1"]) <= 2 * kept and "box2" not in here._known
        got, _ = await here.wait_for_frames("box1", FrameQuery(session_id="z", after_seq=first.seq, limit=1), 20)
    assert got[0].seq == first.seq + 1 and reads.of("z") == 1, "past what is kept: read"


async def test_an_instance_is_followed_after_its_last_long_poll_returns(
    pg_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After the last long poll on an instance here returns, the store goes on keeping what it hears
    of it (an agent's next wait, a caller's next poll, come soon): a long poll that starts after a
    frame heard meanwhile takes it from memory, without a read. Past `KNOWN_AFTER_WAIT` instances
    left so, the one left first is forgotten, and its next long poll reads."""
    monkeypatch.setattr(postgres_store, "KNOWN_AFTER_WAIT", 1)
    backend = Backend("postgres", pg_url)
    async with backend.open() as here, backend.open() as there:
        assert isinstance(here, PostgresFrameStore)
        reads = CountedReads(here)
        got: list[Any] = []

        async def wait_for_z() -> None:
            got.append(await here.wait_for_frames("box1", FrameQuery(session_id="z"), 20))

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(wait_for_z)
                await reads.after(1).wait()
                first = await add(there, session_id="z")
            assert got == [([first], False)] and here.waiter_count("box1") == 0

            meanwhile = await add(there, session_id="z")  # no long poll on box1 here now
            await reads.until(meanwhile.seq)
            frames, _ = await here.wait_for_frames("box1", FrameQuery(session_id="z", after_seq=first.seq), 20)
            assert frames == [meanwhile] and reads.of("z") == 1, "followed after its long poll returned: no read"

            await here.wait_for_frames("box2", FrameQuery(session_id="q"), 0)  # box2 left after box1
            later = await add(there, session_id="z")
            await reads.until(later.seq)
            frames, _ = await here.wait_for_frames("box1", FrameQuery(session_id="z", after_seq=meanwhile.seq), 20)
    assert frames == [later] and reads.of("z") == 2, "box1 no longer followed: read"
    assert list(here._left) == ["box1"], "at most KNOWN_AFTER_WAIT followed so: box2, left first, forgotten"


async def test_whole_frames_kept_are_bounded_by_count_an_instance_and_by_bytes_in_all(
    pg_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Of an instance waited on, only the latest `KNOWN_WHOLE_KEPT` frames are kept whole; a frame
    larger than a notice carries is not, even when this server appended it; and the whole frames of
    every instance together stay within `KNOWN_WHOLE_BYTES`. A frame kept by its fields alone is
    read by the long poll that matches it."""
    latest = postgres_store.KNOWN_WHOLE_KEPT
    async with heard_here(pg_url, seconds=60) as (here, there, reads):
        sent = [await add(there, session_id="z", payload={"i": i}) for i in range(latest + 5)]
        await reads.until(sent[-1].seq)
        kept = here._known["box1"]
        assert [seq for seq, entry in kept.items() if entry[1] is not None] == [f.seq for f in sent[-latest:]]
        assert here._whole_bytes == sum(entry[2] for entry in kept.values()) > 0
        got, _ = await here.wait_for_frames("box1", FrameQuery(session_id="z", after_seq=sent[0].seq - 1, limit=1), 20)
        assert got == sent[:1] and reads.of("z") == 1, "older than the latest kept whole: read"

        big = await add(here, session_id="z", payload={"text": "x" * postgres_store.MAX_NOTICE_FRAMES})
        assert here._known["box1"][big.seq][1] is None

        monkeypatch.setattr(postgres_store, "KNOWN_WHOLE_BYTES", here._whole_bytes)  # full: no more kept whole
        more = await add(there, session_id="z", payload={"i": "more"})
        await reads.until(more.seq)
        assert here._known["box1"][more.seq][1] is None and here._whole_bytes <= postgres_store.KNOWN_WHOLE_BYTES
        got, _ = await here.wait_for_frames("box1", FrameQuery(session_id="z", after_seq=big.seq), 20)
        assert got == [more] and reads.of("z") == 2, "past the bytes kept: read"


async def test_frames_heard_are_forgotten_when_notices_may_be_lost(pg_url: str) -> None:
    """A frame known whole from its notice is not answered from memory once notices may have been
    lost (a notice without seqs, a reconnect of the listener: `_rewake_all`): the long poll reads."""
    async with heard_here(pg_url) as (here, there, reads):
        got = []
        for lose in (lambda: here._on_notice("box1"), here._rewake_all):
            sent = await add(there, session_id="z")
            await reads.until(sent.seq)
            assert here._known["box1"][sent.seq][1] == sent
            lose()
            assert "box1" not in here._known
            got.append((await here.wait_for_frames("box1", FrameQuery(session_id="z", after_seq=sent.seq - 1), 20))[0])
            assert got[-1] == [sent]
    assert reads.of("z") == 2


async def test_a_long_poll_below_a_retention_cut_raises_cursor_pruned_not_from_memory(pg_url: str) -> None:
    """Retention by another server, and by this one, cuts frames this server heard whole: a long
    poll from below the cut raises `CursorPruned` as its read would (the cut's NOTIFY names the
    instance alone, so what was heard of it is forgotten), not the frames from memory."""
    async with heard_here(pg_url, {"retention_frames": None}, retention_frames=2, prune_every=1000) as (here, there, reads):
        for i in range(4):
            await reads.until((await add(there, session_id="z", payload={"i": i})).seq)
        heard = len(reads.notices)
        assert await there.prune() == 2
        while len(reads.notices) == heard:  # the cut's notice: the instance alone
            reads.heard = trio.Event()
            await reads.heard.wait()
        assert reads.notices[-1] == ("box1", None)
        with pytest.raises(CursorPruned):
            await here.wait_for_frames("box1", FrameQuery(session_id="z"), 20)
        here.retention_frames = 1
        kept = await add(here, session_id="z")
        await reads.until(kept.seq)
        assert await here.prune() == 2
        with pytest.raises(CursorPruned):
            await here.wait_for_frames("box1", FrameQuery(session_id="z", after_seq=kept.seq - 2), 20)


# -- outcomes: exactly one per request ----------------------------------------------------


def outcome(store: FrameStoreAPI, request_id: str, how: str) -> Any:
    return store.append_outcome(
        "box1", request_id, channel="mcp", session_id="s1", type="caller_tool_result",
        payload={"request_id": request_id, "how": how},
    )


async def test_append_outcome_records_one_outcome_per_request(store: FrameStoreAPI) -> None:
    """The first outcome of a request is stored and returned; every later one stores nothing and
    returns None, also when many race; another request (or instance) has its own outcome."""
    first = await outcome(store, "r1", "first")
    assert first is not None and first.seq == 1 and first.payload["how"] == "first"
    assert await outcome(store, "r1", "second") is None
    won: list[Any] = []

    async def race(i: int) -> None:
        won.append(await outcome(store, "r2", f"racer {i}"))

    async with trio.open_nursery() as nursery:
        for i in range(8):
            nursery.start_soon(race, i)
    assert len([f for f in won if f is not None]) == 1
    assert await seqs(store) == [1, 2], "one frame per request; no seq was spent on a loser"
    other = await store.append_outcome("box2", "r1", channel="mcp", session_id="s1", type="t", payload={})
    assert other is not None and other.seq == 1
    with pytest.raises(ValueError):
        await store.append_outcome("box1", "", channel="mcp", session_id="s1", type="t", payload={})
    with pytest.raises(TypeError):  # a bad frame claims nothing: the request can still end
        await store.append_outcome("box1", "r3", channel="mcp", session_id="s1", type="t", payload=[])  # type: ignore[arg-type]
    assert await outcome(store, "r3", "after a refused one") is not None


async def test_append_outcome_one_winner_across_two_store_objects(pg_url: str) -> None:
    """Two servers on one database race outcomes for the same requests: each request gets exactly
    one outcome frame, and the other server's call returns None (PostgreSQL only: a SQLite log
    has one writer process)."""
    backend = Backend("postgres", pg_url)
    async with backend.open() as a, backend.open() as b:
        results = await race_on_two_stores(a, b, [f"r{n}" for n in range(20)], outcome)
        for request_id, got in results.items():
            assert len([f for f in got if f is not None]) == 1, (request_id, got)
        frames = await a.query("box1", FrameQuery(limit=200))
        assert sorted(f.payload["request_id"] for f in frames) == sorted(f"r{n}" for n in range(20))
        assert [f.seq for f in frames] == list(range(1, 21)), "gapless: a losing claim spends no seq"


async def test_retention_drops_old_claims_with_their_frames(pg_url: str) -> None:
    """A resolved request's claim goes with its frame (PostgreSQL keeps claims in a table)."""
    async with Backend("postgres", pg_url).open(retention_frames=2, prune_every=1) as s:
        for n in range(5):
            assert await outcome(s, f"r{n}", "x") is not None
        count = await s._run(lambda conn: conn.execute("SELECT count(*) FROM resolutions").fetchone()[0])  # type: ignore[attr-defined]
        assert count == 2


# -- append_once: a resent guest append stores once ---------------------------------------


def once(store: FrameStoreAPI, instance: str, append_id: str, text: str = "x") -> Any:
    return store.append_once(
        instance, append_id, channel="mcp", session_id="s1", type="status.presence", payload={"text": text},
    )


async def test_append_once_stores_one_frame_per_instance_and_id(store: FrameStoreAPI) -> None:
    """The same frame with the same (instance, append_id) twice is one frame, and the second call
    gets the first's seq, msg_id, ts and payload back without waking anyone; the same id in
    another instance is another frame; without an id every append stores, as before."""
    first, stored = await once(store, "box1", "a-1", "first")
    assert stored and first.seq == 1
    with trio.testing.assert_checkpoints():
        again, stored_again = await once(store, "box1", "a-1", "first")
    assert not stored_again and again == first, "the frame stored before"
    via_append = await add(
        store, "box1", append_id="a-1", channel="mcp", type="status.presence", payload={"text": "first"},
    )
    assert via_append == first, "`append` with an id is `append_once`"
    assert await store.frame_of_append_id("box1", "a-1") == first
    assert await store.frame_of_append_id("box1", "a-9") is None
    assert await store.frame_of_append_id("nobody", "a-1") is None
    other, other_stored = await once(store, "box2", "a-1")
    assert other_stored and other.seq == 1 and other.instance == "box2"
    plain = [await add(store, "box1", payload={"i": i}) for i in range(2)]
    assert [f.seq for f in plain] == [2, 3], "no id: stored each time, and no seq was spent on the resend"
    assert await seqs(store, "box1") == [1, 2, 3]
    assert await seqs(store, "box2") == [1]
    assert (await once(store, "box1", "a-2"))[1]
    racers: list[Any] = []

    async def race(i: int) -> None:
        racers.append(await once(store, "box1", "a-3", "one frame"))

    async with trio.open_nursery() as nursery:
        for i in range(8):
            nursery.start_soon(race, i)
    assert [stored for _, stored in racers].count(True) == 1
    assert all(frame == racers[0][0] for frame, _ in racers)
    assert await seqs(store, "box1") == [1, 2, 3, 4, 5]


async def test_append_once_refuses_an_id_sent_again_with_another_frame(store: FrameStoreAPI) -> None:
    """A resend is only a resend if it is the same frame: the id with another session, type,
    reply_to or payload is refused (-32602 naming the id and what differs), nothing stored or
    woken; the same payload with its keys in another order is the same frame; 1, 1.0 and true
    are three payloads (canonical JSON, not Python's ==)."""
    fields = dict(channel="mcp", session_id="s1", type="assistant.done", reply_to="m-1", payload={"text": "done", "n": 1})
    first, _ = await store.append_once("box1", "end-1", **fields)  # type: ignore[arg-type]
    for name, changed in [
        ("session", {"session_id": "s2"}), ("session", {"channel": "host"}), ("type", {"type": "session.error"}),
        ("reply_to", {"reply_to": "m-2"}), ("reply_to", {"reply_to": None}), ("payload", {"payload": {"text": "other", "n": 1}}),
        ("payload", {"payload": {"text": "done", "n": 1.0}}), ("payload", {"payload": {"text": "done", "n": True}}),
        ("payload", {"payload": {"text": "done"}}),
    ]:
        with pytest.raises(AppendIdReused) as refused:
            await store.append_once("box1", "end-1", **{**fields, **changed})  # type: ignore[arg-type]
        assert refused.value.code == errors.INVALID_PARAMS and "'end-1'" in refused.value.message, refused.value
        assert refused.value.data == {"append_id": "end-1", "differs": [name]}, (changed, refused.value.data)
        with pytest.raises(AppendIdReused):
            await store.append("box1", append_id="end-1", **{**fields, **changed})  # type: ignore[arg-type]
    assert await seqs(store, "box1") == [first.seq], "a refused id stored nothing"
    again, stored = await store.append_once("box1", "end-1", **{**fields, "payload": {"n": 1, "text": "done"}})  # type: ignore[arg-type]
    assert (again, stored) == (first, False), "the same frame, its keys in another order, is a resend"


async def test_append_once_refuses_a_bad_id_and_stores_nothing(store: FrameStoreAPI) -> None:
    for bad in ("", "a" * 65, "a b", "abc\n", "é"):
        with pytest.raises(ValueError, match="append_id"):
            await once(store, "box1", bad)
    with pytest.raises(ValueError):
        await store.append_once("box1", None, channel="mcp", session_id="s1", type="t", payload={})  # type: ignore[arg-type]
    assert await store.last_seq("box1") == 0


async def test_append_once_one_frame_across_two_store_objects(pg_url: str) -> None:
    """Two servers on one database race appends with the same ids (the guest resent to the other
    server while the first still stored): each id is one frame, both calls return it, and no seq
    is lost (PostgreSQL only: a SQLite log has one writer process)."""
    backend = Backend("postgres", pg_url)
    async with backend.open() as a, backend.open() as b:
        results = await race_on_two_stores(
            a, b, [f"id-{n}" for n in range(20)], lambda store, append_id, who: once(store, "box1", append_id))
        for append_id, got in results.items():
            assert [stored for _, stored in got].count(True) == 1, (append_id, got)
            assert got[0][0] == got[1][0], "both servers answer with the one frame"
        assert await seqs(store=a, limit=200) == list(range(1, 21)), "gapless: the loser spent no seq"

        # The race itself, made certain: both statements start (each sees no frame of the id)
        # while a third connection holds the instance's row, so both wait at the seq; released,
        # one stores and the other breaks the unique index, finds the frame and returns it.
        raced = await race_held_at_the_row(
            pg_url, a, b, lambda store, who: once(store, "box1", "raced"), "WITH found AS")
        assert [stored for _, stored in raced].count(True) == 1, raced
        assert raced[0][0] == raced[1][0] and raced[0][0].seq == 21
        assert await seqs(store=a, limit=200) == list(range(1, 22)), "gapless: the loser spent no seq"


async def test_a_log_made_before_append_ids_gets_them_when_opened(backend: Backend) -> None:
    """A store made by an earlier version (no `append_id` column; on PostgreSQL, schema version 6)
    gets the column and its unique index when a server opens it; its old frames stay as they were."""
    async with backend.open() as store:
        await add(store, "box1")
    if backend.name == "sqlite":
        import sqlite3

        with sqlite3.connect(backend.location) as conn:
            conn.execute("DROP INDEX frames_by_append_id")
            conn.execute("ALTER TABLE frames DROP COLUMN append_id")
            assert "append_id" not in {row[1] for row in conn.execute("PRAGMA table_info(frames)")}
    else:
        import psycopg

        with psycopg.connect(backend.location, autocommit=True) as conn:
            conn.execute("ALTER TABLE frames DROP COLUMN append_id")  # drops its index too
            conn.execute("DELETE FROM oubliette_schema WHERE version = 7")
    async with backend.open() as store:
        first, stored = await once(store, "box1", "a-1")
        assert stored and first.seq == 2
        assert (await once(store, "box1", "a-1"))[0] == first
        assert await seqs(store, "box1") == [1, 2]
    if backend.name == "sqlite":
        with sqlite3.connect(backend.location) as conn:
            assert conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'frames_by_append_id'").fetchone()
    else:
        with psycopg.connect(backend.location) as conn:
            assert conn.execute("SELECT 1 FROM pg_indexes WHERE indexname = 'frames_by_append_id'").fetchone(), \
                "migration 7 applied to a database at version 6"


# -- one turn end per message: the unique index on (instance, ends_turn) ---------------------


def end(store: FrameStoreAPI, msg_id: str, type: str = "assistant.done", instance: str = "box1", **kw: Any) -> Any:
    """An end of the turn of `msg_id` (through `append`, or `append_once` with `append_id`)."""
    if "append_id" in kw:
        return store.append_once(
            instance, kw.pop("append_id"), channel="mcp", session_id="s1", type=type, payload=kw, reply_to=msg_id,
        )
    return store.append(instance, channel="mcp", session_id="s1", type=type, payload=kw, reply_to=msg_id)


async def test_a_turn_ends_once_whichever_append_stores_its_end(store: FrameStoreAPI) -> None:
    """The first end of a message's turn is stored; a second one (the other type, through `append`,
    `append_once` with a new id or `append_many`) raises `TurnEnded` carrying the stored end, stores
    nothing and spends no seq; the first end's resend (its `append_id`) gets it back; frames that end
    nothing (a delta replying to the message, an end replying to nothing) and another message's or
    another instance's end are stored as before."""
    message = await add(store, "box1", type="user.message", payload={"text": "hi"})
    done = await end(store, message.msg_id, text="done", append_id="d-1")
    done = done[0]
    for second in (
        end(store, message.msg_id, "session.error", message="late"),
        end(store, message.msg_id, "assistant.done", text="again", append_id="d-2"),
        store.append_many("box1", [{"channel": "mcp", "session_id": "s1", "type": "session.error",
                                    "payload": {}, "reply_to": message.msg_id}]),
    ):
        with pytest.raises(TurnEnded) as refused:
            await second
        assert refused.value.end == done and "ended already" in refused.value.message, refused.value
        assert refused.value.code == errors.INVALID_REQUEST
    assert await end(store, message.msg_id, text="done", append_id="d-1") == (done, False), "a resend is not a second end"
    with pytest.raises(ValueError, match="ends once"):
        await store.append_many("box1", [
            {"channel": "mcp", "session_id": "s1", "type": t, "payload": {}, "reply_to": "m-other"}
            for t in ("assistant.done", "session.error")])
    delta = await add(store, "box1", reply_to=message.msg_id)
    loose = [await add(store, "box1", type="session.error") for _ in range(2)]
    other = await end(store, "m-other", "session.error")
    elsewhere = await end(store, message.msg_id, instance="box2")
    assert [delta.seq, *(f.seq for f in loose), other.seq] == [3, 4, 5, 6], "no seq spent on a refused end"
    assert elsewhere.seq == 1
    ends = await store.query("box1", FrameQuery(types=TURN_END_TYPES, reply_to=message.msg_id))
    assert ends == [done]

    racers: list[Any] = []

    async def race(i: int) -> None:
        try:
            racers.append(await end(store, "m-raced", "session.error" if i % 2 else "assistant.done", i=i))
        except TurnEnded as exc:
            racers.append(exc.end)

    async with trio.open_nursery() as nursery:
        for i in range(8):
            nursery.start_soon(race, i)
    assert all(frame == racers[0] for frame in racers), racers
    assert await seqs(store, "box1") == list(range(1, 8)), "one of eight racing ends stored, no seq spent"


async def test_a_turn_ends_once_across_two_store_objects(pg_url: str) -> None:
    """Two servers on one database end the same turns at once (a guest's end on one, an orphan's or
    a failed start's on the other): each turn has one end, both calls name it, and no seq is lost
    (PostgreSQL only: a SQLite log has one writer process). Then the race made certain: both
    statements wait at the instance's row, held by a third connection; released, one stores and
    the other breaks the unique index."""
    backend = Backend("postgres", pg_url)

    async def end_or_refused(store: FrameStoreAPI, msg_id: str, who: str) -> Any:
        try:
            return await end(store, msg_id, "assistant.done" if who == "a" else "session.error", who=who)
        except TurnEnded as exc:
            return exc.end

    async with backend.open() as a, backend.open() as b:
        results = await race_on_two_stores(a, b, [f"m-{n}" for n in range(20)], end_or_refused)
        for msg_id, got in results.items():
            assert got[0] == got[1], (msg_id, got)
        assert await seqs(store=a, limit=200) == list(range(1, 21)), "gapless: the loser spent no seq"

        raced = await race_held_at_the_row(
            pg_url, a, b, lambda store, who: end_or_refused(store, "m-raced", who), "WITH bumped AS")
        assert raced[0] == raced[1] and raced[0].seq == 21, raced
        assert await seqs(store=a, limit=200) == list(range(1, 22)), "gapless: the loser spent no seq"


async def test_a_log_made_before_turn_ends_were_unique_gets_the_index_when_opened(backend: Backend) -> None:
    """A store made by an earlier version (no `ends_turn` column; on PostgreSQL, schema version 7)
    that already holds two ends of one turn: opened, the first end is the turn's (the column is
    filled on it alone), the index is built, and a third end is refused with the first."""
    async with backend.open() as store:
        message = await add(store, "box1", type="user.message", payload={})
    if backend.name == "sqlite":
        import sqlite3

        with sqlite3.connect(backend.location) as conn:
            conn.execute("DROP INDEX frames_turn_ends")
            conn.execute("ALTER TABLE frames DROP COLUMN ends_turn")
            for seq, type in ((2, "assistant.done"), (3, "session.error")):
                conn.execute("INSERT INTO frames VALUES (1, ?, 'ts', 'mcp', 's1', ?, ?, ?, '{}', NULL, NULL)",
                             (seq, type, f"m-{seq}", message.msg_id))
    else:
        import psycopg

        with psycopg.connect(backend.location, autocommit=True) as conn:
            conn.execute("ALTER TABLE frames DROP COLUMN ends_turn")  # drops its index too
            conn.execute("DELETE FROM oubliette_schema WHERE version = 8")
            for seq, type in ((2, "assistant.done"), (3, "session.error")):
                conn.execute("INSERT INTO frames VALUES ('box1', %s, 'ts', 'mcp', 's1', %s, %s, %s, '{}', NULL, NULL)",
                             (seq, type, f"m-{seq}", message.msg_id))
            conn.execute("UPDATE instances SET last_seq = 3")
    async with backend.open() as store:
        with pytest.raises(TurnEnded) as refused:
            await end(store, message.msg_id, "session.error")
        assert (refused.value.end.seq, refused.value.end.type) == (2, "assistant.done")
        assert (await end(store, "m-next")).seq == 4
# -- retention and cursors -----------------------------------------------------------------


async def test_retention_and_cursor_pruned(backend: Backend) -> None:
    async with backend.open(retention_frames=10, prune_every=5) as s:
        for _ in range(25):
            await add(s)
        await add(s, "box2")
        assert await s.last_seq("box1") == 25
        assert await s.pruned_below("box1") == 15
        assert await seqs(s, after_seq=15) == list(range(16, 26))
        with pytest.raises(CursorPruned) as info:
            await s.query("box1", FrameQuery(after_seq=3))
        assert info.value.first_seq == 16 and "after_seq=15" in str(info.value)
        assert await seqs(s, "box2") == [1]
    async with backend.open(retention_frames=None) as s:
        assert await s.prune() == 0
        assert await seqs(s, after_seq=15) == list(range(16, 26))


async def test_retention_seconds(backend: Backend) -> None:
    now = [1_800_000_000.0]
    async with backend.open(retention_frames=None, retention_seconds=60, clock=lambda: now[0]) as s:
        for _ in range(3):
            await add(s)
        now[0] += 61
        await add(s)
        assert await s.prune() == 3
        assert await seqs(s, after_seq=3) == [4]
        now[0] += 61
        assert await s.prune() == 1
        with pytest.raises(CursorPruned, match="every frame up to seq 4 has been pruned"):
            await s.query("box1", FrameQuery())
        assert (await add(s)).seq == 5


async def test_cursors_set_advance_and_persist(backend: Backend) -> None:
    async with backend.open() as s:
        assert await s.get_cursor("box1", "delivered") == 0
        await s.set_cursor("box1", "delivered", 5)
        assert await s.advance_cursor("box1", "delivered", 3) is False, "an older ack never moves it back"
        assert await s.advance_cursor("box1", "delivered", 7) is True
        assert await s.advance_cursor("box2", "delivered", 1) is True
        await s.set_cursor("box1", "acked", 3)
        with pytest.raises(ValueError):
            await s.set_cursor("box1", "delivered", -1)
        async with trio.open_nursery() as nursery:  # racing acks: the highest wins
            for n in (20, 11, 15, 12):
                nursery.start_soon(s.advance_cursor, "box1", "race", n)
    async with backend.open() as s:
        assert await s.get_cursor("box1", "delivered") == 7
        assert await s.get_cursor("box1", "acked") == 3
        assert await s.get_cursor("box2", "delivered") == 1
        assert await s.get_cursor("box1", "race") == 20


# -- durability (docs/TETHER.md, "Storage and durability") ---------------------------------

APPENDER = """
import sys, trio
from oubliette_server.program.config import ServerConfig
from protocol import errors
from oubliette_server.store.sqlite import FrameStore
from oubliette_server.store.postgres import MIGRATIONS, PostgresFrameStore

async def main(kind, where, n):
    store = FrameStore(where) if kind == "sqlite" else PostgresFrameStore(where)
    async with store.running():
        for i in range(n):
            await store.append("box1", channel="host", session_id="s1", type="user.message", payload={"i": i})
        print("appended", flush=True)
        await trio.sleep_forever()

trio.run(main, sys.argv[1], sys.argv[2], int(sys.argv[3]))
"""


async def test_a_killed_process_loses_no_returned_append(backend: Backend) -> None:
    """kill -9 of the appending process right after `append` returned: every frame is there."""
    proc = subprocess.Popen(
        [sys.executable, "-c", APPENDER, backend.name, backend.location, "50"],
        stdout=subprocess.PIPE, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert proc.stdout is not None
        line = await trio.to_thread.run_sync(proc.stdout.readline)
        assert line.strip() == b"appended"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    async with backend.open() as s:
        assert await s.last_seq("box1") == 50
        frames = await s.query("box1", FrameQuery(limit=200))
        assert [f.payload["i"] for f in frames] == list(range(50))


# -- PostgreSQL only: start-up and outages -------------------------------------------------


async def test_unreachable_postgres_is_one_clear_error(tmp_path: Path) -> None:
    store = PostgresFrameStore(f"postgresql://postgres@/nope?host={tmp_path}", connect_timeout=1)
    with pytest.raises(StoreUnavailable, match="cannot reach the PostgreSQL store postgresql://postgres@"):
        async with store.running():
            pass


async def test_migrations_are_idempotent_with_servers_starting_together(pg_url: str) -> None:
    stores = [PostgresFrameStore(pg_url) for _ in range(4)]
    async with trio.open_nursery() as nursery:
        for st in stores:
            async def run(st: PostgresFrameStore = st) -> None:
                async with st.running():
                    await add(st)
            nursery.start_soon(run)
    async with Backend("postgres", pg_url).open() as s:
        assert await s.last_seq("box1") == 4
    import psycopg

    with psycopg.connect(pg_url) as conn:
        applied = conn.execute("SELECT version FROM oubliette_schema ORDER BY version").fetchall()
        assert applied == [(version,) for version, _ in MIGRATIONS], "each migration applied once"


async def test_postgres_recovers_after_its_connections_are_cut(pg_url: str) -> None:
    """Every connection of the store is killed (as when the database restarts): the listener
    reconnects and its waiters re-query, so an append made meanwhile is not missed; the pool
    replaces its broken connections, so the next calls work without a restart."""
    import psycopg

    backend = Backend("postgres", pg_url)
    async with backend.open() as a, backend.open() as b:
        await add(a)
        got: list[Any] = []

        async def waiter() -> None:
            got.append(await b.wait_for_frames("box1", FrameQuery(after_seq=1), 30))

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(waiter)
                while b.waiter_count("box1") != 1:
                    await trio.testing.wait_all_tasks_blocked()
                dbname = psycopg.conninfo.conninfo_to_dict(pg_url)["dbname"]
                with psycopg.connect(pg_url, autocommit=True) as admin:
                    killed = admin.execute(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE datname = %s AND pid <> pg_backend_pid()", (dbname,),
                    ).fetchone()
                assert killed is not None and killed[0] >= 2
                frame = await add(a)  # through a pool whose connections were all cut
        [(frames, timed_out)] = got
        assert frames == [frame] and not timed_out
        assert await b.last_seq("box1") == 2


# -- selection: --store and [store] ---------------------------------------------------------


def test_store_settings_from_the_config_file_and_flags(tmp_path: Path) -> None:
    from oubliette_server.program.cli import _serve_parser, build_config
    from oubliette_server.program.config import load_config_file
    from oubliette_server.store.opener import open_store

    config = tmp_path / "oubliette.toml"
    config.write_text('[store]\nurl = "postgresql://a@db/x"\npool_size = 7\nconnect_timeout = 3.5\n')
    loaded = load_config_file(config)
    assert {k: loaded[k] for k in ("store_url", "store_pool_size", "store_connect_timeout")} == {
        "store_url": "postgresql://a@db/x", "store_pool_size": 7, "store_connect_timeout": 3.5,
    }
    settings = build_config(_serve_parser().parse_args(["--config", str(config), "--store", "postgresql://b@/y?host=/s"]))
    assert settings.store_url == "postgresql://b@/y?host=/s", "--store overrides [store] url"
    assert settings.store_pool_size == 7
    store = open_store(settings.store_url, settings.frame_store_path, retention_frames=10, retention_seconds=None,
                       pool_size=settings.store_pool_size, connect_timeout=settings.store_connect_timeout)
    assert isinstance(store, PostgresFrameStore) and store.describe() == "postgresql://b@/y?host=/s"
    assert PostgresFrameStore("postgresql://u:secret@db.internal:5433/x?sslmode=require").describe() == (
        "postgresql://u@db.internal:5433/x"), "never the password"
    default = build_config(_serve_parser().parse_args(["--data-dir", str(tmp_path / "d")]))
    sqlite_store = open_store(default.store_url, default.frame_store_path, retention_frames=10, retention_seconds=None,
                              pool_size=1, connect_timeout=1)
    assert isinstance(sqlite_store, FrameStore) and sqlite_store.describe() == f"sqlite:{tmp_path / 'd' / 'frames.sqlite3'}"
    sqlite_store.close()
    for bad, message in (
        ('[store]\nurl = "mysql://x"\n', "must start with postgresql://"),
        ('[store]\nhost = "x"\n', "unknown [store] key 'host'"),
        ('[store]\npool_size = "4"\n', "[store] pool_size must be an integer, not a string (\"4\")"),
    ):
        config.write_text(bad)
        with pytest.raises(ValueError, match=re.escape(message)):
            ServerConfig(**load_config_file(config))
