"""What a server spends hearing one NOTIFY of another server's append: the floor under the three-to-one ratio.

    python bench/probe_notices.py [--notices N] [--rate R] [--rounds K]

Every append on the PostgreSQL store sends one NOTIFY, and every server's LISTEN connection hears
it (docs/SCALING.md, "An instance followed after its long poll returns, and the notices' share of
the gap"). This starts a throwaway PostgreSQL (tests/support/postgres.py), then, for each mode, a
listening process of its own, and sends it ``--notices`` notices of one frame each (a
``caller_tool_request`` as the store's appends send it, `notice_frames`) at ``--rate`` a second
from this process. The listener's CPU (utime + stime, all its threads) over the notices, divided
by their number, is the cost of hearing one:

- ``bare``: Trio and psycopg alone: the LISTEN connection's socket waited on with
  `trio.lowlevel.wait_readable`, `consume_input()`, `notifies()`, the notice dropped. The floor.
- ``store``: a `PostgresFrameStore`'s own listener, the notices of an instance no long poll waits
  on there (a server that holds nothing of it).
- ``followed``: the same with a long poll waiting on the instance (its notices' frames kept).

Modes alternate, ``--rounds`` times; the median of each is printed. With ``BENCH_PROFILE_DIR=DIR``
(and ``BENCH_PROFILE_CPU=1``, on CPU time) each listener runs under cProfile, as bench_relay.py's
programs do: ``DIR/listener-MODE.prof``, its last round's. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support")]

import psycopg  # noqa: E402
import trio  # noqa: E402
import trio.testing  # noqa: E402

from bench_relay import profiled  # noqa: E402
from oubliette_server.store.api import FrameQuery  # noqa: E402
from oubliette_server.store.postgres import NOTIFY_CHANNEL, PostgresFrameStore, notice_payload  # noqa: E402

MODES = ("bare", "store", "followed")
INSTANCE = "box1"
#: The instance names of the notices that start and stop a listener's count.
START, STOP = "probe-start", "probe-stop"
FRAME = ["mcp", "session-0", "caller_tool_request", None, "2026-11-29T20:00:00.000000Z", "m-0123456789",
         json.dumps({"request_id": "r-0123456789abcdef", "tool": "echo", "arguments": {"text": "0-12"},
                     "caller_id": "bench", "expires_at": 1764446400.0, "wants_progress": False})]


def notice(seq: int) -> str:
    """The notice of one append of `FRAME` at `seq`, as the store sends it."""
    tail = "\t[" + json.dumps(FRAME[:6], separators=(",", ":"))[:-1] + "," + FRAME[6] + "]]"
    return notice_payload(INSTANCE, seq, seq, tail=tail)


class Count:
    """A listener's count: CPU seconds from the start notice to the stop notice, and notices between."""

    def __init__(self) -> None:
        self.started = 0.0
        self.heard = 0
        self.done = trio.Event()

    def hear(self, instance: str) -> None:
        if instance == START:
            self.started, self.heard = time.process_time(), 0
        elif instance == STOP:
            print(json.dumps({"cpu": time.process_time() - self.started, "heard": self.heard}), flush=True)
            self.done.set()
        else:
            self.heard += 1

    # the store's notice hook (`hear_appends`)
    def appended(self, instance: str, first: int | None, last: int | None, fields: Any = None) -> None:
        self.hear(instance)

    def missed(self) -> None:
        pass


async def listen(mode: str, url: str) -> None:
    """The listening process: says "ready", then counts until the stop notice."""
    count = Count()
    if mode == "bare":
        conn = psycopg.connect(url, autocommit=True)
        conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
        pgconn = conn.pgconn
        print("ready", flush=True)
        while not count.done.is_set():
            await trio.lowlevel.wait_readable(pgconn.socket)
            pgconn.consume_input()
            while (note := pgconn.notifies()) is not None:
                count.hear(note.extra.decode().partition("\t")[0])
        return
    store = PostgresFrameStore(url)
    async with store.running(), trio.open_nursery() as nursery:
        store.hear_appends(count)
        if mode == "followed":
            never = FrameQuery(session_id="nobody", after_seq=2**62)
            nursery.start_soon(store.wait_for_frames, INSTANCE, never, 3600.0)
            while store.waiter_count(INSTANCE) == 0:
                await trio.testing.wait_all_tasks_blocked()
        print("ready", flush=True)
        await count.done.wait()
        nursery.cancel_scope.cancel()


def hear(mode: str, url: str, notices: int, rate: float) -> float:
    """One round of `mode`: the listener's CPU per notice, microseconds."""
    listener = subprocess.Popen([sys.executable, *profiled(f"listener-{mode}"), "-m", "probe_notices", "--listen", mode, url],
                                stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent)
    assert listener.stdout is not None
    try:
        if listener.stdout.readline().strip() != "ready":
            raise SystemExit(f"the {mode} listener did not start")
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("SELECT pg_notify(%s, %s)", (NOTIFY_CHANNEL, START))
            start = time.perf_counter()
            for i in range(notices):
                conn.execute("SELECT pg_notify(%s, %s)", (NOTIFY_CHANNEL, notice(100 + i)))
                time.sleep(max(0.0, start + (i + 1) / rate - time.perf_counter()))  # an open-loop schedule
            conn.execute("SELECT pg_notify(%s, %s)", (NOTIFY_CHANNEL, STOP))
        result = json.loads(listener.stdout.readline())
    finally:
        listener.wait(timeout=30)
    if result["heard"] != notices:
        raise SystemExit(f"the {mode} listener heard {result['heard']} notices of {notices}")
    return float(result["cpu"]) / notices * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--notices", type=int, default=6000, help="notices a round (default 6000)")
    parser.add_argument("--rate", type=float, default=380.0,
                        help="notices a second (default 380: what each of bench_cluster.py's three servers hears)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each mode, alternating (default 3)")
    parser.add_argument("--listen", nargs=2, metavar=("MODE", "URL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.listen:
        trio.run(listen, *args.listen)
        return 0
    from postgres import PostgresServer

    pg = PostgresServer()
    pg.start()
    try:
        url = pg.new_database()

        async def migrate() -> None:
            async with PostgresFrameStore(url).running():
                pass

        trio.run(migrate)
        runs: dict[str, list[float]] = {mode: [] for mode in MODES}
        for _ in range(args.rounds):
            for mode in MODES:
                runs[mode].append(hear(mode, url, args.notices, args.rate))
        print(f"CPU of the listening process per notice heard, {args.notices} notices at {args.rate:.0f}/s, "
              f"{args.rounds} rounds each (median; each round):")
        for mode in MODES:
            print(f"  {mode:9s} {statistics.median(runs[mode]):5.0f} µs   ({', '.join(f'{v:.0f}' for v in runs[mode])})")
        return 0
    finally:
        pg.stop()


if __name__ == "__main__":
    sys.exit(main())
