"""Benchmark of the frame stores (oubliette_server/store/sqlite.py, and store/postgres.py in section 4).

    python bench/bench_store.py [--frames N] [--appends N] [--rounds N] [--dir DIR] [--pg URL] [--skip-sqlite] [--append-only] [--wake-only]

Every figure is printed next to a baseline measured in the same run, on the same machine:

1. Append throughput (frames/s), durability "normal" (and a short "full" run): single
   ``append`` calls and ``append_many`` batches, against raw ``sqlite3`` INSERT + COMMIT of
   the same rows (same schema, same pragmas, payload already serialized) — ratio ours/baseline.
   Single appends alternate with the raw baseline in 20 chunks (the ratio of the totals and the
   median of the chunks' ratios), so that a load that drifts during the run hits both alike.
   A second raw baseline builds each row in the loop from the fields and payload dict ours gets
   (``json.dumps``, a random ``msg_id``, the timestamp), and a third, the floor of any append
   that is a Trio checkpoint, does that, one autocommit ``INSERT`` (ours for a lone frame) and
   one ``trio.lowlevel.cancel_shielded_checkpoint`` per row.  The CPU time per append of all
   four is printed beside the wall-clock ratios.  ``--append-only`` runs this section alone.
2. Query latency (median, p99) at ``--frames`` (default 1,000,000) frames in one instance, for
   channel+session with ``after_seq`` near the end, a ``types`` filter, a ``reply_to`` filter,
   against a plain ``SELECT … WHERE iid=? AND seq>? ORDER BY seq LIMIT 50`` run raw.  The rows
   are generated with ``executemany`` in big transactions.
3. Long-poll wake latency: one task in ``wait_for_frames``, another appends; append start →
   waiter returns (median, p99), against a bare ``trio.Event`` set → wait wakeup. Then the CPU of
   an append to one session while ``--parked`` (default 100) other sessions' long polls wait on
   the instance, against the same appends with none parked, and how often those polls looked at
   the log per append. ``--wake-only`` runs this section alone.
4. PostgreSQL column (store/postgres.py), beside SQLite in the same run: single durable appends
   (PostgreSQL ``synchronous_commit=on`` with fsync on, against SQLite ``synchronous=FULL``;
   target ratio >= 0.5), and the wake across processes: another process appends through its
   own store object, this one waits in ``wait_for_frames`` (NOTIFY → LISTEN; target median
   < 1 ms).  ``--pg URL`` uses your database; by default a throwaway PostgreSQL 15 is started
   as in the tests (tests/support/postgres.py, fsync on).  ``--skip-sqlite`` runs section 4 only.

Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio
import trio.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from oubliette_server.store import sqlite as store_mod  # noqa: E402
from oubliette_server.store.sqlite import FrameQuery, FrameStore, format_ts  # noqa: E402

INSTANCE = "box1"
SESSIONS = 200
PAYLOAD = {"text": "Here is a chunk of the answer, about as long as a streamed delta."}


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def us(x: float) -> str:
    return f"{x * 1e6:8.1f} µs"


#: The raw baselines' insert: the columns their rows fill (the store's own columns beyond them, NULL).
RAW_INSERT = (
    "INSERT INTO frames (iid, seq, ts, channel, session_id, type, msg_id, reply_to, payload, append_id) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)

def raw_connect(path: Path, durability: str) -> sqlite3.Connection:
    """A bare connection with the store's schema and pragmas."""
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute(f"PRAGMA synchronous={durability.upper()}")
    db.execute("PRAGMA temp_store=MEMORY")
    db.execute("PRAGMA cache_size=-32768")
    db.executescript(store_mod._SCHEMA)
    db.execute("INSERT INTO instances (name, last_seq, pruned_below) VALUES (?, 0, 0)", (INSTANCE,))
    return db


def frame_kwargs(i: int) -> dict:
    return {
        "channel": "host" if i % 2 else "mcp",
        "session_id": f"s{i % 20}",
        "type": "assistant.delta",
        "payload": PAYLOAD,
        "reply_to": f"m-u{i // 20}",
    }


# -- 1. append throughput ----------------------------------------------------------------------


async def bench_append(workdir: Path, n_single: int, n_batched: int, batch: int, durability: str) -> None:
    print(f"\n== append throughput, durability={durability!r} ==")
    kws = [frame_kwargs(i) for i in range(max(n_single, n_batched))]

    # single appends, ours and raw interleaved in chunks: on a shared machine the load drifts
    # within seconds, and a ratio of two runs taken apart measures the drift as much as the store.
    # Two raw baselines: "prebuilt" stores rows made before the clock starts (payload already
    # JSON, msg_id and ts fixed); "building" makes each row in the loop from the same fields
    # and payload dict as ours gets (json.dumps of the payload, a random msg_id, the clock's
    # timestamp), the least any append of a frame given as a dict must do. Both are
    # INSERT + COMMIT with the same schema and pragmas. The "floor" builds each row the same
    # way, stores it with one autocommit INSERT (as ours stores a lone frame) and then takes one
    # schedule point, as every Trio checkpoint must: no append that is a checkpoint can be
    # cheaper, so ours/floor is what the store's own work costs. Wall time is the figure; CPU
    # time of this thread (time.thread_time) is printed beside it, as it moves less with the load.
    st = FrameStore(workdir / f"append-{durability}.db", durability=durability)
    db = raw_connect(workdir / f"raw-{durability}.db", durability)
    db2 = raw_connect(workdir / f"raw2-{durability}.db", durability)
    db3 = raw_connect(workdir / f"raw3-{durability}.db", durability)
    ts = format_ts(time.time())
    text = json.dumps(PAYLOAD, separators=(",", ":"))
    rows = [
        (1, i + 1, ts, k["channel"], k["session_id"], k["type"], f"m-{i:032x}", k["reply_to"], text, None)
        for i, k in enumerate(kws)
    ]
    ins = RAW_INSERT
    dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode
    chunk = max(1, n_single // 20)
    wall = {"ours": 0.0, "prebuilt": 0.0, "building": 0.0, "floor": 0.0}
    cpu = dict.fromkeys(wall, 0.0)
    chunk_ratios = []
    for start in range(0, n_single, chunk):
        w0, c0 = time.perf_counter(), time.thread_time()
        for k in kws[start : start + chunk]:
            await st.append(INSTANCE, **k)
        w1, c1 = time.perf_counter(), time.thread_time()
        for r in rows[start : start + chunk]:
            db.execute("BEGIN")
            db.execute(ins, r)
            db.execute("COMMIT")
        w2, c2 = time.perf_counter(), time.thread_time()
        for i, k in enumerate(kws[start : start + chunk], start + 1):
            row = (1, i, format_ts(time.time()), k["channel"], k["session_id"], k["type"],
                   "m-" + os.urandom(16).hex(), k["reply_to"], dumps(k["payload"]), None)
            db2.execute("BEGIN")
            db2.execute(ins, row)
            db2.execute("COMMIT")
        w3, c3 = time.perf_counter(), time.thread_time()
        for i, k in enumerate(kws[start : start + chunk], start + 1):
            row = (1, i, format_ts(time.time()), k["channel"], k["session_id"], k["type"],
                   "m-" + os.urandom(16).hex(), k["reply_to"], dumps(k["payload"]), None)
            db3.execute(ins, row)
            await trio.lowlevel.cancel_shielded_checkpoint()
        w4, c4 = time.perf_counter(), time.thread_time()
        for name, w, c in (("ours", w1 - w0, c1 - c0), ("prebuilt", w2 - w1, c2 - c1), ("building", w3 - w2, c3 - c2),
                           ("floor", w4 - w3, c4 - c3)):
            wall[name] += w
            cpu[name] += c
        chunk_ratios.append((w2 - w1) / (w1 - w0))
    ours_single = n_single / wall["ours"]
    raw_single = n_single / wall["prebuilt"]
    building_single = n_single / wall["building"]
    floor_single = n_single / wall["floor"]
    # batches, ours and raw alternating
    rows2 = [(1, n_single + r[1], *r[2:]) for r in rows[:n_batched]]
    ours_time = raw_time = 0.0
    for i in range(0, n_batched, batch):
        t0 = time.perf_counter()
        await st.append_many(INSTANCE, kws[i : i + batch])
        t1 = time.perf_counter()
        db.execute("BEGIN")
        db.executemany(ins, rows2[i : i + batch])
        db.execute("COMMIT")
        t2 = time.perf_counter()
        ours_time += t1 - t0
        raw_time += t2 - t1
    ours_batch = n_batched / ours_time
    raw_batch = n_batched / raw_time
    st.close()
    db.close()
    db2.close()
    db3.close()

    print(f"single append     ours {ours_single:10,.0f} frames/s   raw {raw_single:10,.0f} frames/s   "
          f"ratio {ours_single / raw_single:.2f}   ({n_single} appends; median of "
          f"{len(chunk_ratios)} interleaved chunks {statistics.median(chunk_ratios):.2f})")
    print(f"  vs raw building each row (json.dumps, msg_id, ts) {building_single:10,.0f} frames/s   "
          f"ratio {ours_single / building_single:.2f}")
    print(f"  vs the floor of a Trio append (building, one autocommit INSERT, one schedule point) "
          f"{floor_single:10,.0f} frames/s   ratio {ours_single / floor_single:.2f}; the floor vs raw "
          f"{floor_single / raw_single:.2f}")
    print(f"  CPU µs per append: ours {cpu['ours'] / n_single * 1e6:.1f}, raw prebuilt "
          f"{cpu['prebuilt'] / n_single * 1e6:.1f} (ratio {cpu['prebuilt'] / cpu['ours']:.2f}), raw building "
          f"{cpu['building'] / n_single * 1e6:.1f} (ratio {cpu['building'] / cpu['ours']:.2f}), floor "
          f"{cpu['floor'] / n_single * 1e6:.1f} (ratio {cpu['floor'] / cpu['ours']:.2f}); load average "
          f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"append_many({batch:>3}) ours {ours_batch:10,.0f} frames/s   raw {raw_batch:10,.0f} frames/s   "
          f"ratio {ours_batch / raw_batch:.2f}   ({n_batched} frames)")


# -- 2. query latency at N frames ---------------------------------------------------------------

TURN = 20  # frames per turn: user.message, status.presence, 15 deltas, tool request/result, done


def generate(path: Path, n: int) -> tuple[FrameStore, float]:
    """n frames in one instance, written with executemany in big transactions."""
    st = FrameStore(path, retention_frames=None)
    db = st._db
    ts = format_ts(time.time())
    delta = json.dumps(PAYLOAD, separators=(",", ":"))
    small = '{"state":"thinking"}'

    def rows(start: int, stop: int):
        for seq in range(start, stop):
            turn, k = divmod(seq - 1, TURN)
            sid = turn % SESSIONS
            ch = "host" if sid % 2 else "mcp"
            user = f"m-u{turn}"
            if k == 0:
                yield (1, seq, ts, ch, f"s{sid}", "user.message", user, None, '{"text":"hi"}', None)
            elif k == 1:
                yield (1, seq, ts, ch, f"s{sid}", "status.presence", f"m-{seq}", user, small, None)
            elif k == TURN - 3:
                typ = "approval_request" if turn % 50 == 0 else "caller_tool_request"
                yield (1, seq, ts, ch, f"s{sid}", typ, f"m-r{turn}", user, '{"tool":"x"}', None)
            elif k == TURN - 2:
                yield (1, seq, ts, ch, f"s{sid}", "caller_tool_result", f"m-{seq}", f"m-r{turn}", "{}", None)
            elif k == TURN - 1:
                yield (1, seq, ts, ch, f"s{sid}", "assistant.done", f"m-{seq}", user, delta, None)
            else:
                yield (1, seq, ts, ch, f"s{sid}", "assistant.delta", f"m-{seq}", user, delta, None)

    t0 = time.perf_counter()
    db.execute("INSERT INTO instances (name, last_seq, pruned_below) VALUES (?, 0, 0)", (INSTANCE,))
    step = 100_000
    for start in range(1, n + 1, step):
        stop = min(n + 1, start + step)
        db.execute("BEGIN")
        db.executemany(RAW_INSERT, rows(start, stop))
        db.execute("UPDATE instances SET last_seq = ? WHERE name = ?", (stop - 1, INSTANCE))
        db.execute("COMMIT")
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.execute("ANALYZE")
    return st, time.perf_counter() - t0


def timed(fn, args_list) -> list[float]:
    out = []
    for args in args_list:
        t0 = time.perf_counter()
        fn(*args)
        out.append(time.perf_counter() - t0)
    return out


def bench_query(workdir: Path, n: int, iters: int) -> None:
    print(f"\n== query latency at {n:,} frames in one instance ==")
    st, gen = generate(workdir / "query.db", n)
    size = sum(p.stat().st_size for p in workdir.glob("query.db*"))
    print(f"generated in {gen:.1f} s (executemany, {100_000:,}-row transactions), db {size / 2**20:.0f} MiB")
    rnd = random.Random(1)
    turns = n // TURN
    db = st._db

    base_sql = f"SELECT {store_mod._COLS} FROM frames WHERE iid = ? AND seq > ? ORDER BY seq LIMIT 50"
    base_args = [(1, rnd.randrange(0, n)) for _ in range(iters)]
    baseline = timed(lambda iid, a: db.execute(base_sql, (iid, a)).fetchall(), base_args)

    cases = {
        "no filter (store.query)": [FrameQuery(after_seq=a) for _, a in base_args],
        "channel+session, after_seq near end": [
            FrameQuery(channel="host" if s % 2 else "mcp", session_id=f"s{s}", after_seq=max(0, n - rnd.randrange(0, 20_000)))
            for s in (rnd.randrange(SESSIONS) for _ in range(iters))
        ],
        "channel+session, after_seq=0": [
            FrameQuery(channel="host" if s % 2 else "mcp", session_id=f"s{s}")
            for s in (rnd.randrange(SESSIONS) for _ in range(iters))
        ],
        "types [assistant.done, approval_request]": [
            FrameQuery(types=("assistant.done", "approval_request"), after_seq=rnd.randrange(0, n)) for _ in range(iters)
        ],
        "types [approval_request] (rare, 1/1000)": [
            FrameQuery(types=("approval_request",), after_seq=rnd.randrange(0, n)) for _ in range(iters)
        ],
        "reply_to <user msg_id>": [FrameQuery(reply_to=f"m-u{rnd.randrange(turns)}") for _ in range(iters)],
    }
    print(f"{'query':45} {'median':>11} {'p99':>11}   rows/query  vs baseline median")
    bm = statistics.median(baseline)
    print(f"{'BASELINE raw SELECT iid=? AND seq>? LIMIT 50':45} {us(bm)} {us(pct(baseline, 99))}   "
          f"{sum(len(db.execute(base_sql, a).fetchall()) for a in base_args[:100]) / 100:10.1f}")
    for name, qs in cases.items():
        lat = timed(lambda q: st._query(INSTANCE, q), [(q,) for q in qs])  # the SQLite work itself, as before the async interface
        rows = sum(len(st._query(INSTANCE, q)) for q in qs[:100]) / 100
        print(f"{name:45} {us(statistics.median(lat))} {us(pct(lat, 99))}   {rows:10.1f}  x{statistics.median(lat) / bm:.2f}")
    print("plans:")
    for name, qs in cases.items():
        print(f"  {name}: {' | '.join(st.query_plan(INSTANCE, qs[0]))}")
    st.close()


# -- 3. long-poll wake latency -------------------------------------------------------------------


async def bench_wake(workdir: Path, rounds: int) -> None:
    print(f"\n== long-poll wake latency ({rounds} rounds) ==")
    st = FrameStore(workdir / "wake.db")
    lat: list[float] = []
    append_cost: list[float] = []

    async def waiter(send: trio.MemorySendChannel) -> None:
        after = 0
        while True:
            frames, timed_out = await st.wait_for_frames(
                INSTANCE, FrameQuery(channel="host", session_id="s1", after_seq=after), 10
            )
            t1 = time.perf_counter()
            assert frames and not timed_out
            after = frames[-1].seq
            await send.send(t1)

    send, recv = trio.open_memory_channel(1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter, send)
        for _ in range(rounds):
            await trio.testing.wait_all_tasks_blocked()
            t0 = time.perf_counter()
            await st.append(INSTANCE, channel="host", session_id="s1", type="assistant.delta", payload=PAYLOAD)
            append_cost.append(time.perf_counter() - t0)
            t1 = await recv.receive()
            lat.append(t1 - t0)
        nursery.cancel_scope.cancel()
    st.close()

    base: list[float] = []
    box: list[trio.Event] = [trio.Event()]

    async def ev_waiter(send: trio.MemorySendChannel) -> None:
        while True:
            await box[0].wait()
            t1 = time.perf_counter()
            box[0] = trio.Event()
            await send.send(t1)

    send, recv = trio.open_memory_channel(1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ev_waiter, send)
        for _ in range(rounds):
            await trio.testing.wait_all_tasks_blocked()
            t0 = time.perf_counter()
            box[0].set()
            t1 = await recv.receive()
            base.append(t1 - t0)
        nursery.cancel_scope.cancel()

    print(f"{'':38} {'median':>11} {'p99':>11}")
    print(f"{'append → wait_for_frames returns':38} {us(statistics.median(lat))} {us(pct(lat, 99))}")
    print(f"{'  of which the append call itself':38} {us(statistics.median(append_cost))} {us(pct(append_cost, 99))}")
    print(f"{'BASELINE bare trio.Event set → wait':38} {us(statistics.median(base))} {us(pct(base, 99))}")
    print(f"ratio (medians) {statistics.median(lat) / statistics.median(base):.1f}")


async def bench_parked_sessions(workdir: Path, appends: int, parked: int) -> None:
    """The CPU of an append to one session while `parked` other sessions' long polls wait on the
    instance, against the same appends with none parked (the baseline, same run): an append wakes
    only the polls that may want its frames, so the others cost it nothing."""
    print(f"\n== appends while other sessions' long polls wait ({appends} appends, {parked} polls) ==")
    st = FrameStore(workdir / "parked.db")

    async def cpu_per_append(polls: int) -> tuple[float, int]:
        looks = [0]
        real_read = st._read_after

        def counted(*args: Any, **kw: Any) -> Any:
            looks[0] += 1
            return real_read(*args, **kw)

        st._read_after = counted  # type: ignore[method-assign]
        try:
            async with trio.open_nursery() as nursery:
                for i in range(polls):
                    nursery.start_soon(st.wait_for_frames, INSTANCE, FrameQuery(channel="host", session_id=f"other-{i}"), 3600)
                while st.waiter_count(INSTANCE) != polls:
                    await trio.testing.wait_all_tasks_blocked()
                looks[0] = 0
                start = time.process_time()
                for _ in range(appends):
                    await st.append(INSTANCE, channel="host", session_id="s1", type="assistant.delta", payload=PAYLOAD)
                    await trio.testing.wait_all_tasks_blocked()  # whatever it woke has looked and waits again
                used = time.process_time() - start
                nursery.cancel_scope.cancel()
        finally:
            del st._read_after
        return used / appends, looks[0]

    base, _ = await cpu_per_append(0)
    with_polls, looks = await cpu_per_append(parked)
    st.close()
    print(f"{'BASELINE append, no poll parked':44} {us(base)} CPU")
    print(f"{f'append, {parked} other sessions parked':44} {us(with_polls)} CPU  ({with_polls / base:.2f}x;"
          f" the polls looked at the log {looks / appends:.1f} times per append)")


# -- 4. PostgreSQL beside SQLite ----------------------------------------------------------------

APPENDER = """
import sys, time, json, trio
from oubliette_server.store.postgres import PostgresFrameStore

async def main(url):
    store = PostgresFrameStore(url, pool_size=1)
    returned = []
    async with store.running():
        print("ready", flush=True)
        while (await trio.to_thread.run_sync(sys.stdin.readline)).strip() == "go":
            t0 = time.perf_counter()
            await store.append("wake", channel="host", session_id="s1", type="assistant.delta", payload={"t0": t0})
            returned.append(time.perf_counter())
    print(json.dumps(returned), flush=True)

trio.run(main, sys.argv[1])
"""


async def bench_postgres(workdir: Path, url: str, n: int, rounds: int) -> None:
    from oubliette_server.store.postgres import PostgresFrameStore

    print(f"\n== PostgreSQL beside SQLite: durable single appends ({n}) ==")
    kws = [frame_kwargs(i) for i in range(n)]
    sq = FrameStore(workdir / "pg-vs-sqlite.db", durability="full")
    t0 = time.perf_counter()
    lat_sq = []
    for k in kws:
        a = time.perf_counter()
        await sq.append(INSTANCE, **k)
        lat_sq.append(time.perf_counter() - a)
    rate_sq = n / (time.perf_counter() - t0)
    sq.close()
    pg = PostgresFrameStore(url)
    async with pg.running():
        t0 = time.perf_counter()
        lat_pg = []
        for k in kws:
            a = time.perf_counter()
            await pg.append(INSTANCE, **k)
            lat_pg.append(time.perf_counter() - a)
        rate_pg = n / (time.perf_counter() - t0)
    print(f"{'':34} {'frames/s':>10} {'median':>11} {'p99':>11}")
    print(f"{'SQLite synchronous=FULL':34} {rate_sq:10,.0f} {us(statistics.median(lat_sq))} {us(pct(lat_sq, 99))}")
    print(f"{'PostgreSQL synchronous_commit=on':34} {rate_pg:10,.0f} {us(statistics.median(lat_pg))} {us(pct(lat_pg, 99))}")
    print(f"ratio PostgreSQL/SQLite (frames/s) {rate_pg / rate_sq:.2f}   (target >= 0.5)")

    print(f"\n== PostgreSQL wake across processes ({rounds} rounds) ==")
    root = Path(__file__).resolve().parent.parent
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-c", APPENDER, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert proc.stdin is not None and proc.stdout is not None
    lines = LineReader(proc.stdout)
    assert await lines.next() == "ready"
    woken: list[tuple[float, float]] = []
    waiter_store = PostgresFrameStore(url)
    async with waiter_store.running():
        after = await waiter_store.last_seq("wake")
        for _ in range(rounds):
            got: list[Any] = []

            async def wait() -> None:
                got.extend((await waiter_store.wait_for_frames("wake", FrameQuery(after_seq=after), 10))[0])

            async with trio.open_nursery() as nursery:
                nursery.start_soon(wait)
                while waiter_store.waiter_count("wake") != 1:
                    await trio.testing.wait_all_tasks_blocked()
                await trio.testing.wait_all_tasks_blocked()
                await proc.stdin.send_all(b"go\n")
            t1 = time.perf_counter()
            woken.append((got[0].payload["t0"], t1))
            after = got[-1].seq
        await proc.stdin.send_all(b"stop\n")
        returned = json.loads(await lines.next())
    await proc.wait()
    from_start = [t1 - t0 for t0, t1 in woken]
    from_return = [t1 - r for (_, t1), r in zip(woken, returned)]
    print(f"{'':40} {'median':>11} {'p99':>11}")
    print(f"{'append start (A) → waiter returns (B)':40} {us(statistics.median(from_start))} {us(pct(from_start, 99))}")
    print(f"{'append returned (A) → waiter returns (B)':40} {us(statistics.median(from_return))} {us(pct(from_return, 99))}")
    print("(B's return includes its re-query after the NOTIFY; target: median < 1 ms from the commit)")


class LineReader:
    """Lines of a child's stdout."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.buffer = b""

    async def next(self) -> str:
        while b"\n" not in self.buffer:
            chunk = await self.stream.receive_some(65536)
            if not chunk:
                raise RuntimeError("the appender process ended")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()


async def amain(args: argparse.Namespace, workdir: Path) -> None:
    if args.wake_only:
        await bench_wake(workdir, args.rounds)
        await bench_parked_sessions(workdir, args.parked_appends, args.parked)
        return
    if args.append_only:
        await bench_append(workdir, args.appends, args.appends * 10, 100, "normal")
        await bench_append(workdir, args.full_appends, args.full_appends * 10, 100, "full")
        return
    if not args.skip_sqlite:
        await bench_append(workdir, args.appends, args.appends * 10, 100, "normal")
        await bench_append(workdir, args.full_appends, args.full_appends * 10, 100, "full")
        bench_query(workdir, args.frames, args.iters)
        await bench_wake(workdir, args.rounds)
        await bench_parked_sessions(workdir, args.parked_appends, args.parked)
    server = None
    url = args.pg
    if url is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
        from postgres import PostgresServer

        server = PostgresServer(fsync=True)
        server.start()
        url = server.new_database()
    try:
        await bench_postgres(workdir, url, args.pg_appends, args.pg_rounds)
    finally:
        if server is not None:
            server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames", type=int, default=1_000_000, help="frames in the query benchmark (default 1,000,000)")
    p.add_argument("--appends", type=int, default=5000, help="single appends, durability normal (batched: 10x)")
    p.add_argument("--full-appends", type=int, default=300, help="single appends, durability full (batched: 10x)")
    p.add_argument("--iters", type=int, default=2000, help="queries per case")
    p.add_argument("--rounds", type=int, default=2000, help="long-poll wake rounds")
    p.add_argument("--pg", default=None, help="PostgreSQL URI for section 4 (default: a throwaway server)")
    p.add_argument("--pg-appends", type=int, default=2000, help="durable single appends, PostgreSQL vs SQLite")
    p.add_argument("--pg-rounds", type=int, default=500, help="cross-process wake rounds")
    p.add_argument("--skip-sqlite", action="store_true", help="run only section 4")
    p.add_argument("--append-only", action="store_true", help="run only section 1 (append throughput)")
    p.add_argument("--wake-only", action="store_true", help="run only section 3 (long-poll wakes)")
    p.add_argument("--parked", type=int, default=100, help="other sessions' long polls parked in section 3's second part")
    p.add_argument("--parked-appends", type=int, default=2000, help="appends in section 3's second part")
    p.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one, removed)")
    args = p.parse_args()
    print(f"python {sys.version.split()[0]}, sqlite {sqlite3.sqlite_version}, trio {trio.__version__}, "
          f"{os.cpu_count()} CPUs")
    t0 = time.perf_counter()
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
        workdir = Path(tempfile.mkdtemp(dir=args.dir))
    else:
        workdir = Path(tempfile.mkdtemp(prefix="bench_store-"))
    try:
        trio.run(amain, args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
