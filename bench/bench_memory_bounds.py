"""What each bounded memory of the server costs at its limit, measured in this process.

    python bench/bench_memory_bounds.py            # every bound, to its limit and twice past it (~1-2 min)
    python bench/bench_memory_bounds.py --quick    # a tenth of each bound (a smoke run, ~10 s)
    python bench/bench_memory_bounds.py --only book-calls --only sessions

A busy server keeps a few memories that grow with its traffic until a bound stops them
(docs/SECURITY.md, "Memory and descriptors over time"). Each is filled here through its real API,
in this process, with the values a running server puts in it, and measured with ``tracemalloc``
(every Python allocation still held, after a collection): once the bound is reached, and again
after as many entries again, when the oldest have been dropped as many times as the bound: that
is what the full memory costs for good (a dict that drops its oldest keys keeps a larger table
than one only filled; filling it further costs nothing more). Each line gives the bytes one entry
holds when the bound is reached and the MiB the memory holds then and for good. The baseline, measured in the same run,
is an idle ``oubliette-server`` (started here with a relay socket and an empty data directory):
its RSS is what the bounded memories add to.

SQLite's own allocations (its page cache, bounded by ``PRAGMA cache_size``) are not Python's and
are not traced here; bench/soak.py sees them in the server's RSS.
"""

from __future__ import annotations

import argparse
import gc
import logging
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Awaitable, Callable

import trio
import trio.testing

from oubliette_server.core.callers import EVENT_QUEUE_SIZE, CallerConnection
from oubliette_server.core.pending_requests import RESOLVED_MEMORY
from oubliette_server.core.sessions import DEFAULT_MAX_SESSIONS, Session, SessionRegistry
from oubliette_server.features.approvals.service import ApprovalService, Decision
from oubliette_server.features.caller_tool_relay.pending import CallerCallRegistry
from oubliette_server.features.cluster.log_tail import MAX_INSTANCES, LogTail
from oubliette_server.store.sqlite import OUTCOME_MEMORY, FrameStore
from protocol import schema_check
from protocol.limits import Limits
from protocol.messages import CallerToolSpec

PYTHON = sys.executable
ECHO = CallerToolSpec(name="echo", inputSchema={"type": "object", "properties": {"text": {"type": "string"}}})
ENVELOPE_CACHE = 4096  # protocol/limits.py: functools.lru_cache of `_frame_overhead`
ACCEPTORS_MAX = schema_check._ACCEPTORS_MAX


def rss_kib(pid: int | str = "self") -> int:
    """VmRSS of a process, from /proc/PID/status, in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


def traced() -> int:
    """Python memory still held, after a full collection (bytes)."""
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


async def no_store(session: Session, type: str, payload: dict[str, Any], **_: Any) -> SimpleNamespace:
    """The frame log's `append`, keeping nothing: only the service's own memory is measured."""
    await trio.lowlevel.checkpoint()
    return SimpleNamespace(seq=1, type=type, payload=payload)


def owned_session() -> tuple[Session, CallerConnection]:
    caller = CallerConnection("stdio")
    return Session(instance="box1", channel="mcp", id="s1", caller_id="bench", owner=caller), caller


# -- each memory, filled through its real API: a function (count) -> the object holding it ------------
# A filler is handed how many entries to add each time it is called and keeps its state between calls.

Filler = Callable[[int], Awaitable[None]]


def book_calls() -> tuple[Filler, Any]:
    """Caller tool requests, each relayed and answered (`CallerCallRegistry.relay`, `respond`): the
    book remembers how each ended (`RequestBook.finished`, the last `RESOLVED_MEMORY`)."""
    session, caller = owned_session()
    calls = CallerCallRegistry(no_store, default_timeout=60)
    done = [0]

    async def fill(count: int) -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(count):
                ended = trio.Event()
                text = f"steady-{done[0]}"

                async def agent(text: str = text, ended: trio.Event = ended) -> None:
                    await calls.relay(session, ECHO, {"text": text})
                    ended.set()

                nursery.start_soon(agent)
                [call] = await calls.wait_pending(session)
                await calls.respond(caller, "s1", call.request_id, {"echo": text})
                await ended.wait()
                done[0] += 1

    return fill, calls


def book_approvals(updated: int = 0) -> Callable[[], tuple[Filler, Any]]:
    """Approvals, each asked and approved (`ApprovalService.request`, `answer`): the book remembers
    each decision (`RequestBook.finished`), with the caller's `updated_arguments` of `updated` bytes."""

    def make() -> tuple[Filler, Any]:
        session, caller = owned_session()
        approvals = ApprovalService(no_store)

        async def fill(count: int) -> None:
            async with trio.open_nursery() as nursery:
                for _ in range(count):
                    ended = trio.Event()

                    async def gated(ended: trio.Event = ended) -> None:
                        await approvals.request(session, "echo", {"text": "hi"}, origin="caller", caller=caller)
                        ended.set()

                    nursery.start_soon(gated)
                    [entry] = await approvals.wait_pending(session)
                    arguments = {"text": secrets.token_hex(updated // 2)} if updated else None
                    await approvals.answer(caller, "s1", entry.request_id,
                                           Decision(approve=True, who="caller", updated_arguments=arguments))
                    await ended.wait()

        return fill, approvals

    return make


def sqlite_outcomes(workdir: Path) -> Callable[[], tuple[Filler, Any]]:
    """Outcome frames stored with `append_outcome` on the SQLite store (a file): it remembers the
    request ids it recorded (`OUTCOME_MEMORY`). Its own page cache is SQLite's, not traced."""

    def make() -> tuple[Filler, Any]:
        store = FrameStore(workdir / "outcomes.db")
        done = [0]

        async def fill(count: int) -> None:
            for _ in range(count):
                done[0] += 1
                await store.append_outcome(
                    "box1", "ctr-" + secrets.token_hex(8), channel="mcp", session_id="s1",
                    type="caller_tool_result", payload={"request_id": "r", "result": {"echo": f"steady-{done[0]}"}},
                )

        return fill, store

    return make


def sessions(declared: bool) -> Callable[[], tuple[Filler, Any]]:
    """Sessions of one instance (`SessionRegistry.get_or_create`), idle: `max_sessions` are held.
    `declared`: each opened by a caller that declared the `echo` tool and left (as a caller's are)."""

    def make() -> tuple[Filler, Any]:
        registry = SessionRegistry()
        gone = CallerConnection("stdio")
        gone.closed.set()

        async def fill(count: int) -> None:
            for _ in range(count):
                session = registry.get_or_create("box1", "mcp", secrets.token_urlsafe(16))
                if declared:
                    registry.set_owner(session, gone)
                    registry.adopt_declaration(session, "bench", [ECHO])
            await trio.lowlevel.checkpoint()

        return fill, registry

    return make


class NoticesOnly:
    """A shared store that only notices appends: nobody follows here, so nothing is read."""

    def hear_appends(self, hook: Any) -> None:
        pass

    async def frames_after(self, instance: str, after_seq: int, limit: int) -> list[Any]:
        raise AssertionError("no follower: the tail reads nothing")


def log_tail(nursery: trio.Nursery) -> Callable[[], Awaitable[tuple[Filler, Any]]]:
    """Another server's appends to distinct instances (`LogTail.appended`, then its task): one
    cursor per instance, the `MAX_INSTANCES` least recently noticed."""

    async def make() -> tuple[Filler, Any]:
        tail = LogTail(NoticesOnly(), SessionRegistry())  # type: ignore[arg-type]
        await nursery.start(tail.serve)
        done = [0]

        async def fill(count: int) -> None:
            for _ in range(count):
                done[0] += 1
                tail.appended(f"box{done[0]}", 1, 1)
            await trio.testing.wait_all_tasks_blocked()  # the tail has handled every notice

        return fill, tail

    return make


def envelope_cache() -> tuple[Filler, Any]:
    """The frame-size check (`Limits.check_frame`) of frames with distinct `msg_id`s: the cache of
    envelope sizes (4,096 entries)."""
    limits = Limits()
    done = [0]

    async def fill(count: int) -> None:
        for _ in range(count):
            done[0] += 1
            limits.check_frame({"text": "hi"}, instance="box1", channel="mcp", session_id="s1",
                               type="user.message", msg_id=f"m-{secrets.token_hex(8)}")
        await trio.lowlevel.checkpoint()

    return fill, limits


def schemas() -> tuple[Filler, Any]:
    """Distinct tool schemas checked (`compile_schema`, then `first_problem` of one value): the
    compiled validators (1,024) and the acceptors of validators seen (4,096)."""
    done = [0]

    async def fill(count: int) -> None:
        for _ in range(count):
            done[0] += 1
            schema = {"type": "object", "properties": {f"text{done[0]}": {"type": "string"}, "n": {"type": "integer"}},
                      "required": [f"text{done[0]}"]}
            schema_check.first_problem(schema_check.compile_schema(schema), {f"text{done[0]}": "hi", "n": 1})
        await trio.lowlevel.checkpoint()

    return fill, None


def event_queue() -> tuple[Filler, Any]:
    """Events pushed to a caller that reads none (`CallerConnection.push`): its queue holds
    `EVENT_QUEUE_SIZE`, then drops (and logs) each new one. Each event is a stored
    `caller_tool_request` frame's (`Frame.to_event`) as the steady soak's."""
    caller = CallerConnection("stdio")
    store = FrameStore.in_memory()
    done = [0]

    async def fill(count: int) -> None:
        for _ in range(count):
            done[0] += 1
            frame = await store.append("box1", channel="mcp", session_id="s1", type="caller_tool_request", payload={
                "request_id": "ctr-" + secrets.token_hex(8), "tool": "echo", "arguments": {"text": f"steady-{done[0]}"},
                "caller_id": "soak", "expires_at": "2026-11-28T22:00:00.000Z",
            })
            caller.push(frame.to_event())

    return fill, (caller, store)


# -- the run -------------------------------------------------------------------------------------


async def measure(name: str, bound: int, make: Callable[[], Any], scale: float) -> dict[str, Any]:
    """Fill one memory to its bound (`bound * scale` entries), then as many again; what each holds."""
    count = max(1, int(bound * scale))
    before = traced()
    made = make()
    if isinstance(made, Awaitable):
        made = await made
    fill, holder = made
    empty = traced() - before
    start = time.perf_counter()
    await fill(count)
    at_bound = traced() - before - empty
    await fill(count)
    twice = traced() - before - empty
    seconds = time.perf_counter() - start
    del holder, fill, made
    return {"name": name, "bound": bound, "count": count, "per_entry": at_bound / count,
            "at_bound": at_bound, "twice": twice, "limit_mib": at_bound / count * bound / 2**20, "seconds": seconds}


async def idle_server_rss(workdir: Path) -> int:
    """The RSS of an idle oubliette-server (relay socket, empty data directory), once it is ready (KiB)."""
    process = await trio.lowlevel.open_process(
        [PYTHON, "-m", "oubliette_server", "--relay", f"unix:{workdir / 'relay.sock'}",
         "--data-dir", str(workdir / "data"), "--log-level", "WARNING"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        assert process.stderr is not None
        seen = b""
        with trio.fail_after(60):
            while b"oubliette-server ready" not in seen:
                chunk = await process.stderr.receive_some()
                if not chunk:
                    raise RuntimeError(f"oubliette-server exited before it was ready: {seen.decode()[-500:]}")
                seen += chunk
        return rss_kib(process.pid)
    finally:
        process.terminate()
        with trio.move_on_after(10):
            await process.wait()
        process.kill()


async def run(args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    scale = 0.1 if args.quick else 1.0
    async with trio.open_nursery() as nursery:
        memories: list[tuple[str, int, Callable[[], Any], str]] = [
            ("book-calls", RESOLVED_MEMORY, book_calls, "caller tool requests ended (RequestBook.finished)"),
            ("book-approvals", RESOLVED_MEMORY, book_approvals(), "approvals decided (RequestBook.finished)"),
            ("book-approvals-1k", RESOLVED_MEMORY, book_approvals(1024),
             "approvals decided with 1 KiB of updated_arguments"),
            ("sessions", DEFAULT_MAX_SESSIONS, sessions(declared=False), "idle sessions of one instance (max_sessions)"),
            ("sessions-declared", DEFAULT_MAX_SESSIONS, sessions(declared=True),
             "idle sessions with a declaration, owner gone"),
            ("event-queue", EVENT_QUEUE_SIZE, event_queue, "events queued for one caller that reads none"),
            ("log-tail", MAX_INSTANCES, log_tail(nursery), "the log tail's cursors (shared store)"),
            ("envelope-cache", ENVELOPE_CACHE, envelope_cache, "the frame-size check's envelope cache"),
            ("schemas", ACCEPTORS_MAX, schemas, "validators (1,024) and acceptors (4,096) of distinct schemas"),
            ("sqlite-outcomes", OUTCOME_MEMORY, sqlite_outcomes(workdir),
             "append_outcome's request ids (SQLite store; only a shared store's services call it)"),
        ]
        results = [{"name": "baseline", "rss_kib": await idle_server_rss(workdir)}]
        logging.getLogger("oubliette.server.callers").setLevel(logging.ERROR)  # the event queue's drops
        logging.getLogger("oubliette_server.core.callers").setLevel(logging.ERROR)
        tracemalloc.start()
        for name, bound, make, what in memories:
            if args.only and name not in args.only:
                continue
            print(f"  {name}: {what}, {int(bound * scale)} entries twice", file=sys.stderr, flush=True)
            results.append({**await measure(name, bound, make, scale), "what": what})
        tracemalloc.stop()
        nursery.cancel_scope.cancel()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tenth of each bound (the MiB at the limit extrapolated)")
    parser.add_argument("--only", action="append", default=[], help="measure only this memory (repeatable)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="oub-mem-", dir="/tmp"))  # short: Unix socket paths are limited
    try:
        results = trio.run(run, args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    baseline = results[0]["rss_kib"] / 1024
    print()
    print("Oubliette's bounded memories at their limits (tracemalloc, this process)")
    print(f"  python {sys.version.split()[0]}, trio {trio.__version__}")
    print(f"  baseline: an idle oubliette-server, RSS {baseline:.1f} MiB")
    print(f"  {'memory':<19} {'bound':>7} {'B/entry':>8} {'MiB at bound':>13} {'for good':>9}   what")
    for r in results[1:]:
        print(f"  {r['name']:<19} {r['bound']:>7} {r['per_entry']:>8.0f} {r['limit_mib']:>13.2f} "
              f"{r['twice'] / 2**20 * r['bound'] / r['count']:>9.2f}   {r['what']}")
    if args.quick:
        print("  (--quick: a tenth of each bound, the MiB extrapolated; 'for good' is not reached)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
