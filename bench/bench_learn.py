"""What an unknown session id costs a server on a shared store, per request: one query, not one per instance.

A request naming a session this server never held (`caller_tool_response`, `session_events`,
... without `instance`) makes `SessionRegistry.learn` look for the session in the log
(docs/SCALING.md, "Every server knows every session"). Before, that was `instances()` and then
one read of the session's `session_record` frames per instance; now it is one query along the
partial index `frames_session_records` (`FrameStoreAPI.session_records`). This runs both reads
for ids no log records, against a throwaway PostgreSQL 15 (tests/support/postgres.py) holding
`--instances` instances, each with a session and its record, and prints the median time of
each, and of the lookup of one caller's own sessions by its identity (`owner=`, along
`frames_session_owners`). With `--index-frames N` it also times building the index (migration 6)
over N frames, then migration 7 (the `append_id` column and its unique index), migration 8 (the
`ends_turn` column, filled on each turn's first end, and its unique index; one frame in ten made a
turn end first) and migration 9 (`frames_session_owners`) over the same frames.

    python bench/bench_learn.py                       # 1,000 instances, ~20 s
    python bench/bench_learn.py --index-frames 1000000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

from oubliette_server.core.server_owned import OWNER_KEY, SESSION_RECORD  # noqa: E402
from oubliette_server.core.sessions import Session  # noqa: E402
from oubliette_server.features.cluster.log_bus import LogBus  # noqa: E402
from oubliette_server.store.api import TURN_ENDS_INDEX  # noqa: E402
from oubliette_server.store.postgres import MIGRATIONS, PostgresFrameStore  # noqa: E402


async def per_instance(store: PostgresFrameStore, session_id: str) -> int:
    """The read before: every instance's name, then that instance's records of the session."""
    bus = LogBus(store, None)  # type: ignore[arg-type]  # reads only
    found = 0
    for name in await store.instances():
        owner, _ = await bus.session_record(Session(instance=name, channel="mcp", id=session_id))
        found += owner is not None
    return found


async def one_query(store: PostgresFrameStore, session_id: str) -> int:
    """The read now: one query across every instance's log."""
    return len(await store.session_records("mcp", session_id))


async def by_owner(store: PostgresFrameStore, session_id: str) -> int:
    """The caller's own, by its identity (`owner=`), when only other callers' sessions of the id were found."""
    return len(await store.session_records("mcp", session_id, owner="key:owner"))


async def run(url: str, instances: int, rounds: int) -> None:
    store = PostgresFrameStore(url)
    async with store.running():
        for n in range(instances):
            await store.append_many(f"box{n:05}", [
                {"channel": "mcp", "session_id": f"s-{n}", "type": SESSION_RECORD, "payload": {OWNER_KEY: "key:owner"}},
                *({"channel": "mcp", "session_id": f"s-{n}", "type": "user.message", "payload": {"i": i}} for i in range(9)),
            ])
        for name, read in (("one read per instance (before)", per_instance), ("one query (now)", one_query),
                           ("one owner's, by identity", by_owner)):
            times = []
            for r in range(rounds):
                began = time.perf_counter()
                assert await read(store, f"s-unknown-{r}") == 0
                times.append(time.perf_counter() - began)
            print(f"{name:34} unknown id, {instances} instances: median {statistics.median(times) * 1000:8.2f} ms"
                  f" over {rounds} requests")


def time_index_build(url: str, frames: int) -> None:
    """CREATE INDEX of migration 6 over `frames` frames, one in 100 a session record; then
    migrations 7 (`append_id`) and 8 (`ends_turn`) over the same table."""
    import psycopg

    store_url = url
    trio.run(lambda: _schema(store_url))
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DROP INDEX frames_session_records")
        conn.execute("DROP INDEX frames_session_owners")
        conn.execute(
            "INSERT INTO frames (instance, seq, ts, channel, session_id, type, msg_id, reply_to, payload) "
            "SELECT 'box' || (g %% 100), g, '2026-01-01T00:00:00.000Z', 'mcp', 's-' || (g / 50), "
            f"CASE WHEN g %% 100 = 0 THEN '{SESSION_RECORD}' ELSE 'assistant.delta' END, 'm-' || g, NULL, "
            "'{\"text\": \"a delta of some forty characters or so\"}' FROM generate_series(1, %s) g", (frames,))
        conn.execute("VACUUM ANALYZE frames")
        began = time.perf_counter()
        conn.execute(
            f"CREATE INDEX frames_session_records ON frames (session_id, channel, instance, seq) "
            f"WHERE type = '{SESSION_RECORD}'")
        took = time.perf_counter() - began
        row = conn.execute("SELECT count(*), pg_size_pretty(pg_table_size('frames')) FROM frames").fetchone()
        assert row is not None
        print(f"CREATE INDEX frames_session_records over {row[0]:,} frames ({row[1]}): {took:.2f} s")
        # Migration 7 (a guest's append_id): a nullable column, then its unique partial index.
        conn.execute("DROP INDEX frames_by_append_id")
        conn.execute("ALTER TABLE frames DROP COLUMN append_id")
        conn.execute("VACUUM ANALYZE frames")
        began = time.perf_counter()
        with conn.transaction():
            conn.execute("ALTER TABLE frames ADD COLUMN append_id text")
            conn.execute("CREATE UNIQUE INDEX frames_by_append_id ON frames (instance, append_id) "
                         "WHERE append_id IS NOT NULL")
        print(f"migration 7 (append_id column and index) over {row[0]:,} frames: {time.perf_counter() - began:.2f} s")
        # Migration 8 (one turn end per message): one frame in ten made a turn end replying to the
        # frame before it, then the column, its backfill (each turn's first end) and its unique index.
        conn.execute(f"DROP INDEX {TURN_ENDS_INDEX}")
        conn.execute("ALTER TABLE frames DROP COLUMN ends_turn")
        conn.execute("UPDATE frames SET type = 'assistant.done', reply_to = 'm-' || (seq - 1) WHERE seq % 10 = 5")
        conn.execute("VACUUM ANALYZE frames")
        began = time.perf_counter()
        with conn.transaction():
            for statement in dict(MIGRATIONS)[8].split(";"):
                if statement.strip():
                    conn.execute(statement)  # type: ignore[arg-type]  # our own constant SQL
        ends = conn.execute("SELECT count(*) FROM frames WHERE ends_turn IS NOT NULL").fetchone()
        print(f"migration 8 (ends_turn column, filled on {ends[0] if ends else 0:,} turn ends, and its unique index) "
              f"over {row[0]:,} frames: {time.perf_counter() - began:.2f} s")
        # Migration 9 (one owner's session records): a second partial index, the records' owner in it.
        began = time.perf_counter()
        conn.execute(dict(MIGRATIONS)[9])
        print(f"migration 9 (frames_session_owners) over {row[0]:,} frames: {time.perf_counter() - began:.2f} s")


async def _schema(url: str) -> None:
    async with PostgresFrameStore(url).running():
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--index-frames", type=int, default=0)
    parser.add_argument("--pg", help="a libpq URI of an empty database (default: a throwaway PostgreSQL 15)")
    args = parser.parse_args()
    server = None
    if args.pg is None:
        from postgres import PostgresServer

        server = PostgresServer()
        server.start()
    try:
        trio.run(run, args.pg or server.new_database(), args.instances, args.rounds)  # type: ignore[union-attr]
        if args.index_frames:
            time_index_build(args.pg or server.new_database(), args.index_frames)  # type: ignore[union-attr]
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
