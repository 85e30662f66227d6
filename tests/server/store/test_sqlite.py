"""Tests for the frame store (oubliette_server/store/sqlite.py)."""

from __future__ import annotations

import functools
from contextlib import asynccontextmanager
import os
import re
import stat
import sqlite3

import attrs
import pytest
import trio
import trio.testing

from oubliette_server.store.sqlite import (
    DEFAULT_LIMIT,
    MAX_LIMIT,
    CursorPruned,
    FrameQuery,
    FrameStore,
    format_ts,
)
from protocol import Frame
from frame_polls import two_session_polls

TS_RE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


@pytest.fixture
def store():
    s = FrameStore.in_memory()
    yield s
    s.close()


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / "data" / "frames.db"


async def add(store, instance="box1", *, channel="host", session_id="s1", type="assistant.delta", **kw):
    kw.setdefault("payload", {})
    return await store.append(instance, channel=channel, session_id=session_id, type=type, **kw)


class FakeClock:
    def __init__(self, now=1_800_000_000.0):
        self.now = now

    def __call__(self):
        return self.now


# -- seq ---------------------------------------------------------------------------------------


async def test_seq_strictly_increasing_and_independent_per_instance(store):
    a = [await add(store, "a") for _ in range(5)]
    b = [await add(store, "b", channel="mcp") for _ in range(3)]
    a += [await add(store, "a", channel="telegram", session_id="other") for _ in range(2)]
    assert [f.seq for f in a] == list(range(1, 8))
    assert [f.seq for f in b] == [1, 2, 3]
    assert await store.last_seq("a") == 7
    assert await store.last_seq("b") == 3
    assert await store.last_seq("nope") == 0
    assert await store.instances() == ["a", "b"]


async def test_append_returns_protocol_frame(store):
    f = await add(store, payload={"text": "hé", "n": [1, 2]}, type="user.message")
    assert isinstance(f, Frame)
    assert f.v == 1 and f.seq == 1 and f.instance == "box1"
    assert f.channel == "host" and f.session_id == "s1" and f.type == "user.message"
    assert re.fullmatch(r"m-[0-9a-f]{32}", f.msg_id)
    assert f.reply_to is None
    assert TS_RE.match(f.ts)
    assert f.payload == {"text": "hé", "n": [1, 2]}
    [q] = await store.query("box1", FrameQuery())
    assert q == f
    g = await add(store, msg_id="host-1", reply_to=f.msg_id)
    assert g.msg_id == "host-1" and g.reply_to == f.msg_id


async def test_to_wire(store):
    f = await add(store, payload={"text": "x"}, msg_id="m1")
    assert f.to_wire() == {
        "v": 1,
        "seq": 1,
        "ts": f.ts,
        "instance": "box1",
        "session": {"channel": "host", "id": "s1"},
        "type": "assistant.delta",
        "msg_id": "m1",
        "payload": {"text": "x"},
    }
    g = await add(store, reply_to="m1")
    assert g.to_wire()["reply_to"] == "m1"


def test_format_ts():
    assert format_ts(0) == "1970-01-01T00:00:00.000Z"
    assert format_ts(1_795_341_600.123) == "2026-11-22T10:00:00.123Z"
    assert format_ts(1_795_341_600.9999) == "2026-11-22T10:00:01.000Z"
    assert format_ts(-0.5) == "1969-12-31T23:59:59.500Z"


async def test_append_many_one_batch(store):
    await add(store)
    frames = await store.append_many(
        "box1",
        [
            {"channel": "host", "session_id": "s1", "type": "assistant.delta", "payload": {"i": 1}},
            {"channel": "host", "session_id": "s1", "type": "assistant.done", "payload": {"i": 2}, "msg_id": "x"},
            {"channel": "mcp", "session_id": "s2", "type": "user.message", "payload": {}, "reply_to": "x"},
        ],
    )
    assert [f.seq for f in frames] == [2, 3, 4]
    assert frames[1].msg_id == "x" and frames[2].reply_to == "x"
    assert await store.query("box1", FrameQuery(after_seq=1)) == frames
    assert await store.append_many("box1", []) == []
    assert await store.last_seq("box1") == 4


async def test_bad_input_consumes_no_seq(store):
    await add(store)
    with pytest.raises(TypeError):
        await add(store, payload={"x": object()})
    with pytest.raises(ValueError):
        await add(store, payload={"x": float("nan")})
    with pytest.raises(TypeError):
        await add(store, payload=["not", "a", "dict"])
    with pytest.raises(ValueError):
        await add(store, channel="")
    with pytest.raises(ValueError):
        await add(store, "")
    good = {"channel": "host", "session_id": "s1", "type": "t", "payload": {}}
    with pytest.raises(TypeError, match="unknown keys"):
        await store.append_many("box1", [good, {**good, "bogus": 1}])
    with pytest.raises(TypeError, match="missing"):
        await store.append_many("box1", [good, {"channel": "host"}])
    assert await store.last_seq("box1") == 1
    assert (await add(store)).seq == 2
    assert len(await store.query("box1", FrameQuery())) == 2


async def test_appends_of_a_burst_share_one_commit(store):
    """Group commit: appends from tasks that run together are stored by one transaction, seqs gapless in order."""
    await add(store)
    statements: list[str] = []
    store._db.set_trace_callback(statements.append)
    results: dict[int, int] = {}

    async def one(i: int) -> None:
        results[i] = (await store.append("box1", channel="host", session_id="s", type="t", payload={"i": i})).seq

    async with trio.open_nursery() as nursery:
        for i in range(10):
            nursery.start_soon(one, i)
    store._db.set_trace_callback(None)
    assert sorted(results.values()) == list(range(2, 12))
    assert statements.count("COMMIT") == 1, statements
    assert [f.payload["i"] for f in await store.query("box1", FrameQuery(after_seq=1))] == [
        i for i, _ in sorted(results.items(), key=lambda kv: kv[1])
    ]
    assert await store.last_seq("box1") == 11


async def test_a_lone_append_is_one_autocommit_insert_and_a_failed_one_stores_nothing(store):
    """A lone frame of a known instance is one INSERT that SQLite commits by itself; when it
    fails, nothing is stored, no transaction is left open and the seq is handed out again."""
    await add(store)
    statements: list[str] = []
    store._db.set_trace_callback(statements.append)
    assert (await add(store, payload={"n": 2})).seq == 2
    assert [s.split()[0] for s in statements] == ["INSERT"]
    store._db.execute("INSERT INTO frames VALUES (1, 3, 'ts', 'host', 's', 't', 'rogue', NULL, '{}', NULL, NULL, NULL)")
    with pytest.raises(sqlite3.IntegrityError):
        await add(store, payload={"n": 3})
    store._db.set_trace_callback(None)
    assert not store._db.in_transaction
    assert await store.last_seq("box1") == 2
    store._db.execute("DELETE FROM frames WHERE msg_id = 'rogue'")
    assert (await add(store, payload={"n": 3})).seq == 3
    assert [f.payload for f in await store.query("box1", FrameQuery(after_seq=1))] == [{"n": 2}, {"n": 3}]


async def test_a_failed_group_commit_fails_every_append_and_reuses_the_seqs(store):
    await add(store)
    # Another writer took seq 2 behind the store's back: the next commit fails as a whole.
    store._db.execute("INSERT INTO frames VALUES (1, 2, 'ts', 'host', 's', 't', 'rogue', NULL, '{}', NULL, NULL, NULL)")
    failures: list[BaseException] = []

    async def one() -> None:
        try:
            await add(store)
        except sqlite3.IntegrityError as exc:
            failures.append(exc)

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(one)
    assert len(failures) == 3
    assert await store.last_seq("box1") == 1
    store._db.execute("DELETE FROM frames WHERE msg_id = 'rogue'")
    assert (await add(store)).seq == 2


async def test_append_when_already_cancelled_stores_nothing(store):
    with trio.CancelScope() as scope:
        scope.cancel()
        await add(store)
    assert scope.cancelled_caught
    assert await store.last_seq("box1") == 0


# -- persistence -------------------------------------------------------------------------------


async def test_restart_keeps_seq_frames_and_cursors(db_path):
    s = FrameStore(db_path)
    for i in range(3):
        await add(s, payload={"i": i})
    await add(s, "other")
    await s.set_cursor("box1", "delivered", 2)
    before = await s.query("box1", FrameQuery())
    s.close()
    s.close()  # idempotent

    s = FrameStore(db_path)
    try:
        assert await s.last_seq("box1") == 3
        assert await s.query("box1", FrameQuery()) == before
        assert await s.get_cursor("box1", "delivered") == 2
        assert (await add(s)).seq == 4
        assert (await add(s, "other")).seq == 2
        assert await s.instances() == ["box1", "other"]
    finally:
        s.close()


async def test_named_cursors(db_path):
    s = FrameStore(db_path)
    assert await s.get_cursor("box1", "delivered") == 0
    await s.set_cursor("box1", "delivered", 5)
    await s.set_cursor("box1", "delivered", 7)
    await s.set_cursor("box1", "acked", 3)
    await s.set_cursor("box2", "delivered", 1)
    with pytest.raises(ValueError):
        await s.set_cursor("box1", "delivered", -1)
    s.close()
    s = FrameStore(db_path)
    try:
        assert await s.get_cursor("box1", "delivered") == 7
        assert await s.get_cursor("box1", "acked") == 3
        assert await s.get_cursor("box2", "delivered") == 1
        assert await s.get_cursor("box2", "acked") == 0
    finally:
        s.close()


async def test_file_mode_0600_and_parent_created(db_path):
    assert not db_path.parent.exists()
    s = FrameStore(db_path)
    try:
        await add(s)
        assert stat.S_IMODE(os.stat(db_path).st_mode) == 0o600
        wal = db_path.with_name(db_path.name + "-wal")
        assert wal.exists()
        assert stat.S_IMODE(os.stat(wal).st_mode) == 0o600
        assert s._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert s._db.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
    finally:
        s.close()


async def test_durability_full(tmp_path):
    s = FrameStore(tmp_path / "f.db", durability="full")
    try:
        assert s._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        assert (await add(s)).seq == 1
    finally:
        s.close()
    with pytest.raises(ValueError, match="durability"):
        FrameStore(tmp_path / "g.db", durability="paranoid")


async def test_closed_store_refuses(tmp_path):
    s = FrameStore(tmp_path / "f.db")
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        await s.last_seq("box1")


def test_newer_schema_refused(tmp_path):
    path = tmp_path / "f.db"
    FrameStore(path).close()
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA user_version=99")
    with pytest.raises(RuntimeError, match="schema version 99"):
        FrameStore(path)


# -- query filters -----------------------------------------------------------------------------


@pytest.fixture
async def populated(store):
    # seq: 1 host/s1 user.message m-u1
    #      2 host/s1 status.presence (reply m-u1)
    #      3 host/s1 assistant.delta (reply m-u1)
    #      4 mcp/s1  user.message m-u2
    #      5 host/s2 user.message m-u3
    #      6 host/s1 assistant.done (reply m-u1)
    #      7 mcp/s1  assistant.done (reply m-u2)
    #      8 host/s2 assistant.done (reply m-u3)
    spec = [
        ("host", "s1", "user.message", "m-u1", None),
        ("host", "s1", "status.presence", None, "m-u1"),
        ("host", "s1", "assistant.delta", None, "m-u1"),
        ("mcp", "s1", "user.message", "m-u2", None),
        ("host", "s2", "user.message", "m-u3", None),
        ("host", "s1", "assistant.done", None, "m-u1"),
        ("mcp", "s1", "assistant.done", None, "m-u2"),
        ("host", "s2", "assistant.done", None, "m-u3"),
    ]
    for ch, sid, typ, mid, rt in spec:
        await add(store, channel=ch, session_id=sid, type=typ, msg_id=mid, reply_to=rt)
    await add(store, "box2", channel="host", session_id="s1", type="user.message")
    return store


async def seqs(store, instance="box1", **kw):
    return [f.seq for f in await store.query(instance, FrameQuery(**kw))]


async def test_query_filters(populated):
    s = populated
    assert await seqs(s) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert await seqs(s, channel="host") == [1, 2, 3, 5, 6, 8]
    assert await seqs(s, channel="mcp") == [4, 7]
    assert await seqs(s, session_id="s1") == [1, 2, 3, 4, 6, 7]
    assert await seqs(s, channel="host", session_id="s1") == [1, 2, 3, 6]
    assert await seqs(s, channel="host", session_id="s1", after_seq=2) == [3, 6]
    assert await seqs(s, types=("assistant.done",)) == [6, 7, 8]
    assert await seqs(s, types=["assistant.done", "user.message"]) == [1, 4, 5, 6, 7, 8]
    assert await seqs(s, types=["assistant.done", "user.message"], after_seq=4, limit=2) == [5, 6]
    assert await seqs(s, types=["assistant.done", "user.message"], channel="mcp") == [4, 7]
    assert await seqs(s, channel="host", session_id="s1", types=["assistant.done", "status.presence"]) == [2, 6]
    assert await seqs(s, reply_to="m-u1") == [2, 3, 6]
    assert await seqs(s, reply_to="m-u1", types=["assistant.done"]) == [6]
    assert await seqs(s, reply_to="m-u1", after_seq=3) == [6]
    assert await seqs(s, reply_to="m-u2", channel="host") == []
    assert await seqs(s, reply_to="m-u3", channel="host", session_id="s2") == [8]
    assert await seqs(s, after_seq=6) == [7, 8]
    assert await seqs(s, after_seq=8) == []
    assert await seqs(s, after_seq=100) == []
    assert await seqs(s, limit=3) == [1, 2, 3]
    assert await seqs(s, after_seq=2, limit=1) == [3]
    assert await seqs(s, types=[]) == await seqs(s)  # empty types list = no filter
    assert await seqs(s, types=["nope"]) == []
    assert await seqs(s, "box2") == [1]
    assert await seqs(s, "box3") == []
    assert (await s.query("box1", FrameQuery(reply_to="m-u1")))[0].to_wire()["reply_to"] == "m-u1"


async def test_many_types_fall_back_to_row_filter(populated):
    many = ["assistant.done"] + [f"t{i}" for i in range(30)]
    assert await seqs(populated, types=many) == [6, 7, 8]
    assert await seqs(populated, types=many, channel="host") == [6, 8]


async def test_limit_caps_results(store):
    await store.append_many(
        "box1", [{"channel": "host", "session_id": "s", "type": "t", "payload": {}} for _ in range(250)]
    )
    assert len(await store.query("box1", FrameQuery())) == DEFAULT_LIMIT
    got = await store.query("box1", FrameQuery(limit=MAX_LIMIT))
    assert [f.seq for f in got] == list(range(1, 201))
    got = await store.query("box1", FrameQuery(limit=MAX_LIMIT, after_seq=200))
    assert [f.seq for f in got] == list(range(201, 251))


@pytest.mark.parametrize("limit", [0, -1, MAX_LIMIT + 1, 10_000])
def test_limit_out_of_bounds(limit):
    with pytest.raises(ValueError, match=f"limit must be between 1 and {MAX_LIMIT}, got {limit}"):
        FrameQuery(limit=limit)


def test_query_validation():
    assert FrameQuery().limit == 50 and FrameQuery().after_seq == 0
    FrameQuery(limit=1)
    FrameQuery(limit=200)
    with pytest.raises(ValueError, match="after_seq must be >= 0"):
        FrameQuery(after_seq=-1)
    with pytest.raises(TypeError, match="limit must be an integer"):
        FrameQuery(limit="10")
    with pytest.raises(TypeError, match="limit must be an integer"):
        FrameQuery(limit=True)
    with pytest.raises(TypeError, match="after_seq must be an integer"):
        FrameQuery(after_seq=1.5)
    with pytest.raises(TypeError, match="single str"):
        FrameQuery(types="assistant.done")
    with pytest.raises(TypeError):
        FrameQuery(types=[1])
    with pytest.raises(TypeError):
        FrameQuery(channel=3)
    assert FrameQuery(types=["a", "b", "a"]).types == ("a", "b")


@pytest.mark.parametrize(
    "kw, index",
    [
        ({"channel": "host", "session_id": "s1", "after_seq": 900}, "frames_by_session"),
        ({"channel": "host", "session_id": "s1", "types": ["assistant.done"]}, "frames_by_session"),
        ({"session_id": "s1"}, "frames_by_session"),
        ({"types": ["assistant.done"]}, "frames_by_type"),
        ({"types": ["assistant.done", "user.message"]}, "COVERING INDEX frames_by_type"),
        ({"types": ["assistant.done", "user.message"], "channel": "mcp"}, "frames_by_type"),
        ({"types": ["assistant.done"], "channel": "mcp"}, "frames_by_type"),
        ({"reply_to": "m-u1"}, "frames_by_reply"),
        ({"reply_to": "m-u1", "channel": "host", "session_id": "s1"}, "frames_by_reply"),
        ({"after_seq": 900}, "PRIMARY KEY"),
        ({"channel": "host"}, "PRIMARY KEY"),
    ],
)
async def test_query_plans_use_indexes(populated, kw, index):
    plan = populated.query_plan("box1", FrameQuery(**kw))
    searches = [p for p in plan if p.startswith("SEARCH frames")]
    assert searches and any(index in p for p in searches), plan
    assert all(p.startswith(("SEARCH frames USING INDEX", "SEARCH frames USING COVERING INDEX",
                             "SEARCH frames USING PRIMARY KEY")) for p in searches), plan
    assert not any(p.startswith("SCAN frames") for p in plan), plan
    if "session_id" in kw and "channel" in kw or "types" in kw and len(kw["types"]) == 1:
        assert not any("TEMP B-TREE" in p for p in plan), plan


# -- long poll ---------------------------------------------------------------------------------


async def test_wait_returns_as_soon_as_frame_appended(store):
    await add(store)  # seq 1, before the waiter's cursor
    result = {}

    async def waiter():
        t0 = trio.current_time()
        result["r"] = await store.wait_for_frames("box1", FrameQuery(channel="host", session_id="s1", after_seq=1), 10)
        result["elapsed"] = trio.current_time() - t0

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        assert "r" not in result  # it is really waiting
        assert store.waiter_count("box1") == 1
        f = await add(store, payload={"text": "hi"})
    frames, timed_out = result["r"]
    assert frames == [f] and timed_out is False
    assert result["elapsed"] < 1.0
    assert store.waiter_count() == 0 and store._waiters == {}


async def test_wait_wakes_every_waiter_with_its_own_filter(store):
    results = {}

    async def waiter(name, q, instance="box1"):
        results[name] = await store.wait_for_frames(instance, q, 10)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter, "s1", FrameQuery(session_id="s1", channel="host"))
        nursery.start_soon(waiter, "s2", FrameQuery(session_id="s2", channel="host"))
        nursery.start_soon(waiter, "done", FrameQuery(types=["assistant.done"]))
        nursery.start_soon(waiter, "other-instance", FrameQuery(), "box2")
        await trio.testing.wait_all_tasks_blocked()
        assert store.waiter_count() == 4
        a = await add(store, session_id="s1")
        await trio.testing.wait_all_tasks_blocked()
        assert set(results) == {"s1"}
        b = await add(store, session_id="s2", type="assistant.done")
        await trio.testing.wait_all_tasks_blocked()
        assert set(results) == {"s1", "s2", "done"}
        c = await add(store, "box2")
    assert results["s1"] == ([a], False)
    assert results["s2"] == ([b], False)
    assert results["done"] == ([b], False)
    assert results["other-instance"] == ([c], False)


async def test_wait_non_matching_filter_times_out(store):
    result = {}

    async def waiter():
        t0 = trio.current_time()
        result["r"] = await store.wait_for_frames("box1", FrameQuery(session_id="s2", channel="host"), 0.3)
        result["elapsed"] = trio.current_time() - t0

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        for _ in range(5):
            await trio.testing.wait_all_tasks_blocked()
            await add(store, session_id="s1")
            await add(store, "box2", session_id="s2")
    assert result["r"] == ([], True)
    assert result["elapsed"] >= 0.3
    assert store.waiter_count() == 0 and store._waiters == {}


async def test_wait_returns_match_after_non_matching_frames(store):
    result = {}

    async def waiter():
        result["r"] = await store.wait_for_frames("box1", FrameQuery(types=["assistant.done"]), 10)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        for _ in range(3):
            await trio.testing.wait_all_tasks_blocked()
            await add(store, type="assistant.delta")
            await trio.testing.wait_all_tasks_blocked()
            assert "r" not in result
        done = await add(store, type="assistant.done")
    assert result["r"] == ([done], False)


@asynccontextmanager
async def parked_long_poll(store, q):
    """`wait_for_frames(q)` on box1, parked (waiting for frames), the statements run from then on
    traced: (its answer when it has one, or the `CursorPruned` it raised; the statements)."""
    got, statements = [], []

    async def waiter():
        try:
            got.append(await store.wait_for_frames("box1", q, 10))
        except CursorPruned as refused:
            got.append(refused)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            while store.waiter_count("box1") != 1:
                await trio.testing.wait_all_tasks_blocked()
            store._db.set_trace_callback(statements.append)
            try:
                yield got, statements
            finally:
                store._db.set_trace_callback(None)


async def long_poll_through_a_burst(store, q, burst):
    """`wait_for_frames(q)` woken by one commit of `burst` (appends' keyword arguments, started
    together: one group commit); its answer (or the `CursorPruned` it raised) and the statements
    run from the burst on."""
    async with parked_long_poll(store, q) as (got, statements):
        async with trio.open_nursery() as appends:
            for kw in burst:
                appends.start_soon(functools.partial(add, store, **kw))
    return got[0], statements


async def test_a_long_poll_woken_by_a_commit_takes_its_frames_without_reading_the_log(store):
    """The waiter woken by the commit that stored every frame after what it has seen takes them as
    that commit stored them, its filters applied as the query's SQL applies them: no statement reads
    the log after the wake, and the frames are those a read of the log gives."""
    await add(store)
    q = FrameQuery(session_id="s1", channel="host", after_seq=1, types=("assistant.delta", "assistant.done"), limit=2)
    burst = [{"session_id": "s2"}, {"type": "assistant.done", "payload": {"n": 1}}, {"type": "user.message"},
             {"channel": "tether"}, {"payload": {"n": 2}}, {"payload": {"n": 3}}]
    answer, statements = await long_poll_through_a_burst(store, q, burst)
    assert not [s for s in statements if s.startswith("SELECT")], statements
    assert answer == (await store.query("box1", q), False)
    assert len(answer[0]) == 2


async def test_a_long_poll_waits_on_through_a_commit_it_does_not_want_without_a_wake_or_a_read(store):
    """A caller's next long poll, parked while its answer is stored: the answer's commit, which it does
    not want, neither wakes it nor reads the log (it is moved past those frames); the next commit's
    match is its answer, taken from that commit's rows. Only a wake of every waiter (a store's fault)
    makes its look read the log."""
    await add(store)
    async with parked_long_poll(store, FrameQuery(types=("assistant.done",), after_seq=1)) as (got, statements):
        [parked] = store._waiters["box1"]
        await add(store, type="assistant.delta")  # not wanted: no wake
        await trio.testing.wait_all_tasks_blocked()
        assert not parked.woken.is_set() and parked.seen == 2 and not got
        assert not [s for s in statements if s.startswith("SELECT")], statements
        store._wake_all()  # every waiter woken with no commit: the look reads the log, and waits again
        await trio.testing.wait_all_tasks_blocked()
        assert store.waiter_count("box1") == 1 and not got
        assert [s for s in statements if s.startswith("SELECT")], statements
        statements.clear()
        done = await add(store, type="assistant.done")
    assert got == [([done], False)]
    assert not [s for s in statements if s.startswith("SELECT")], statements


async def test_an_append_wakes_only_the_long_polls_that_may_want_its_frames(store):
    """Two sessions' long polls on one instance: an append to one session wakes its poll alone; the
    other's event is not set, it is moved past the frame, and its own append is its answer."""
    async with two_session_polls(store) as (got, y_poll):
        x = await add(store, session_id="x")
        assert not y_poll.woken.is_set() and y_poll.seen == x.seq
        await trio.testing.wait_all_tasks_blocked()
        assert list(got) == ["x"] and store.waiter_count("box1") == 1
        y = await add(store, session_id="y")
        await trio.testing.wait_all_tasks_blocked()
    assert got == {"x": ([x], False), "y": ([y], False)}


async def test_a_long_poll_whose_cursor_is_just_before_the_last_commit_reads_nothing_back(store):
    """A long poll that starts with only the last commit's frames after its cursor, one of them a
    match, looks at them as that commit stored them: no statement reads the log. Otherwise (more
    after its cursor, none a match, none at all) it reads the log; the answers are the log's."""
    await add(store)
    q = FrameQuery(types=("assistant.done",))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(store.wait_for_frames, "box1", FrameQuery(session_id="elsewhere"), 10)
        while store.waiter_count("box1") != 1:
            await trio.testing.wait_all_tasks_blocked()
        await add(store)
        done = await add(store, type="assistant.done")  # the last commit
        await trio.testing.wait_all_tasks_blocked()  # the other waiter has looked and waits again
        statements: list[str] = []
        store._db.set_trace_callback(statements.append)
        assert await store.wait_for_frames("box1", attrs.evolve(q, after_seq=2), 0) == ([done], False)
        assert not statements, statements
        assert await store.wait_for_frames("box1", attrs.evolve(q, after_seq=3), 0) == ([], False)
        assert statements
        statements.clear()
        assert await store.wait_for_frames("box1", attrs.evolve(q, after_seq=1), 0) == ([done], False)
        assert statements
        store._db.set_trace_callback(None)
        nursery.cancel_scope.cancel()


async def test_a_long_poll_woken_by_a_commit_that_retention_followed_reads_the_log():
    """Retention run by the commit that woke a waiter deleted frames it would have taken from that
    commit: the waiter reads the log, and its cursor, now below what is kept, is refused as a read's."""
    s = FrameStore.in_memory(retention_frames=2, prune_every=1)
    try:
        await add(s)
        answer, _ = await long_poll_through_a_burst(s, FrameQuery(after_seq=1), [{}, {}, {}])
        assert isinstance(answer, CursorPruned), answer
    finally:
        s.close()


async def test_wait_timeout_zero_returns_at_once(store):
    with trio.fail_after(1):
        assert await store.wait_for_frames("box1", FrameQuery(), 0) == ([], False)
        f = await add(store)
        assert await store.wait_for_frames("box1", FrameQuery(), 0) == ([f], False)
        assert await store.wait_for_frames("box1", FrameQuery(), 5) == ([f], False)
    assert store.waiter_count() == 0 and store._waiters == {}
    with pytest.raises(ValueError):
        await store.wait_for_frames("box1", FrameQuery(), -1)


async def test_wait_respects_autojump_deadline(store, autojump_clock):
    t0 = trio.current_time()
    assert await store.wait_for_frames("box1", FrameQuery(), 30) == ([], True)
    assert trio.current_time() - t0 == pytest.approx(30)


async def test_wait_cancellation_leaves_no_garbage(store):
    finished = []

    async def waiter():
        await store.wait_for_frames("box1", FrameQuery(), 10)
        finished.append(True)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        assert store.waiter_count("box1") == 2
        assert all(not parked.woken.is_set() for parked in store._waiters["box1"])
        nursery.cancel_scope.cancel()
    assert finished == []
    assert store.waiter_count() == 0
    assert store._waiters == {}
    # The store still works and a new waiter is woken normally.
    with trio.fail_after(2):
        async with trio.open_nursery() as nursery:
            got = []

            async def again():
                got.append(await store.wait_for_frames("box1", FrameQuery(), 10))

            nursery.start_soon(again)
            await trio.testing.wait_all_tasks_blocked()
            f = await add(store)
    assert got == [([f], False)]


async def test_wait_cancelled_propagates(store):
    with trio.move_on_after(0.05) as scope:
        await store.wait_for_frames("box1", FrameQuery(), 10)
        pytest.fail("should have been cancelled")  # pragma: no cover
    assert scope.cancelled_caught
    assert store._waiters == {}


# -- retention ---------------------------------------------------------------------------------


async def test_retention_frames_prunes_oldest():
    s = FrameStore.in_memory(retention_frames=10, prune_every=5)
    for _ in range(25):
        await add(s)
    assert await s.last_seq("box1") == 25
    assert await s.pruned_below("box1") == 15
    assert await seqs(s, after_seq=15) == list(range(16, 26))
    assert s._db.execute("SELECT count(*) FROM frames").fetchone()[0] == 10
    with pytest.raises(CursorPruned) as info:
        await s.query("box1", FrameQuery(after_seq=3))
    exc = info.value
    assert (exc.instance, exc.after_seq, exc.first_seq) == ("box1", 3, 16)
    assert str(exc) == (
        "cursor after_seq=3 is older than the retained log of instance 'box1' "
        "(oldest kept frame is seq 16); read from after_seq=15"
    )
    # Another instance is not affected.
    await add(s, "box2")
    assert await seqs(s, "box2") == [1]
    s.close()


async def test_cursor_pruned_message_matches_contract():
    s = FrameStore.in_memory(retention_frames=1000)
    batch = [{"channel": "host", "session_id": "s", "type": "t", "payload": {}}] * 500
    for _ in range(4):
        await s.append_many("box1", batch)
    assert await s.prune() == 0  # already applied automatically every 1000 appends
    with pytest.raises(CursorPruned) as info:
        await s.query("box1", FrameQuery(after_seq=3))
    assert str(info.value) == (
        "cursor after_seq=3 is older than the retained log of instance 'box1' "
        "(oldest kept frame is seq 1001); read from after_seq=1000"
    )
    with pytest.raises(CursorPruned):
        await s.wait_for_frames("box1", FrameQuery(after_seq=999), 1)
    assert s.waiter_count() == 0
    assert await seqs(s, after_seq=1000, limit=1) == [1001]
    s.close()


async def test_manual_prune_and_no_retention():
    s = FrameStore.in_memory(retention_frames=5, prune_every=1000)
    for _ in range(12):
        await add(s)
    assert len(await seqs(s)) == 12  # not yet applied
    assert await s.prune() == 7
    assert await seqs(s, after_seq=7) == [8, 9, 10, 11, 12]
    assert await s.prune() == 0
    s.close()
    s = FrameStore.in_memory(retention_frames=None, prune_every=1)
    for _ in range(20):
        await add(s)
    assert await s.prune() == 0 and len(await seqs(s)) == 20
    s.close()


async def test_retention_seconds_prunes_everything_and_seq_never_resets(db_path):
    clock = FakeClock()
    s = FrameStore(db_path, retention_seconds=60, clock=clock)
    for _ in range(3):
        await add(s)
    clock.now += 30
    for _ in range(2):
        await add(s)
    clock.now += 45  # the first three are 75 s old, the last two 45 s
    assert await s.prune() == 3
    assert await seqs(s, after_seq=3) == [4, 5]
    clock.now += 100
    assert await s.prune() == 2
    assert await seqs(s, after_seq=5) == []
    with pytest.raises(CursorPruned) as info:
        await s.query("box1", FrameQuery(after_seq=0))
    assert str(info.value) == (
        "cursor after_seq=0 is older than the retained log of instance 'box1' "
        "(every frame up to seq 5 has been pruned); read from after_seq=5"
    )
    assert (await add(s)).seq == 6
    s.close()

    s = FrameStore(db_path, retention_seconds=60, clock=clock)
    try:
        assert await s.last_seq("box1") == 6
        assert await s.pruned_below("box1") == 5
        assert (await add(s)).seq == 7
        assert await seqs(s, after_seq=5) == [6, 7]
    finally:
        s.close()


async def test_retention_applied_on_open(db_path):
    s = FrameStore(db_path, retention_frames=None)
    await s.append_many("box1", [{"channel": "host", "session_id": "s", "type": "t", "payload": {}}] * 30)
    s.close()
    s = FrameStore(db_path, retention_frames=10)
    try:
        assert await s.pruned_below("box1") == 20
        assert await seqs(s, after_seq=20) == list(range(21, 31))
    finally:
        s.close()


def test_constructor_validation(tmp_path):
    for kw in ({"retention_frames": 0}, {"retention_seconds": 0}, {"retention_seconds": -1}, {"prune_every": 0}):
        with pytest.raises(ValueError):
            FrameStore.in_memory(**kw)
