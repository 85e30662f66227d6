"""What the log tail adds to a push: a frame appended here against one appended by another server.

    python bench/bench_log_tail.py [--frames N] [--warmup W] [--pg URL]

Without ``--pg`` it starts its own throwaway PostgreSQL 15 (tests/support/postgres.py, fsync on) and
removes it at the end. Server A (``OublietteServer``, embedded in this process as
tests/support/harness.py embeds it, on the PostgreSQL store) has one caller: the SDK's ``mcp.Client``
over Streamable HTTP, handshake era, following its session. Alternately, one frame of the
session is appended **here** (A's ``FrameLog.append``: pushed by the frame log) and one by
**another server** (a second store object on the same database, a writer A knows only by its
NOTIFY: pushed by A's log tail). For each it times from the append's return to the event in the
caller's logging callback, and prints median and p99 of both and the difference of the medians:
what the cross-server path (NOTIFY, LISTEN, the tail's read on the Trio loop) adds to a push.
Caller and server share this process, so the two paths share the same scheduler and transport.

Not part of the test suite. bench/bench_cluster.py measures the same wake from outside, across
real programs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))
sys.path.insert(0, str(ROOT))

from harness import Deployment  # noqa: E402

from oubliette_server.store.postgres import PostgresFrameStore  # noqa: E402

INSTANCE = "bench"


def summary(name: str, values: list[float]) -> str:
    """`name median … ms p99 … ms` of `values` (milliseconds)."""
    p99 = sorted(values)[max(0, int(len(values) * 0.99) - 1)]
    return f"{name}: median {statistics.median(values):.2f} ms, p99 {p99:.2f} ms"


async def measure(url: str, frames: int, warmup: int) -> None:
    """Both paths, alternating, `frames` each after `warmup`."""
    deployment = Deployment(store=url)
    other = PostgresFrameStore(url)
    try:
        async with deployment.embedded(store=PostgresFrameStore(url), http=["127.0.0.1:0"],
                                       instances={INSTANCE: {}}) as embedded, other.running():
            async with embedded.http_server(deployment).caller(mode="legacy") as (client, events):
                await client.call_tool("session_message", {"instance": INSTANCE, "session_id": "s1", "message": "hi"})
                app = embedded.app
                session = app.sessions.get(INSTANCE, "mcp", "s1")
                here: list[float] = []
                elsewhere: list[float] = []
                for i in range(warmup + frames):
                    for found in (here, elsewhere):
                        frame: Any
                        if found is here:
                            frame = await app.frame_log.append(session, "assistant.delta", {"text": str(i)})
                        else:
                            frame = await other.append(INSTANCE, channel="mcp", session_id="s1",
                                                       type="assistant.delta", payload={"text": str(i)})
                        returned = time.perf_counter()
                        await events.wait_type("assistant.delta", seq=frame.seq)
                        if i >= warmup:
                            found.append((time.perf_counter() - returned) * 1000)
                        await trio.sleep(0.002)  # the caller's event sender drains: no queue behind the next
    finally:
        deployment.cleanup()
    print(summary("appended here (pushed by the frame log)", here))
    print(summary("appended by another server (pushed by the log tail)", elsewhere))
    print(f"the cross-server path adds (difference of medians): "
          f"{statistics.median(elsewhere) - statistics.median(here):.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=300, help="frames per path (default 300)")
    parser.add_argument("--warmup", type=int, default=20, help="frames per path not counted (default 20)")
    parser.add_argument("--pg", help="a libpq URI of an empty database (default: a throwaway PostgreSQL)")
    args = parser.parse_args()
    if args.pg:
        trio.run(measure, args.pg, args.frames, args.warmup)
        return
    from postgres import PostgresServer

    server = PostgresServer(fsync=True)
    server.start()
    try:
        trio.run(measure, server.new_database(), args.frames, args.warmup)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
