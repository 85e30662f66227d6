"""A healthy call's latency before and after a flood of refused and forgotten sessions.

The attack this answers (docs/SECURITY.md, "Session keys at every door"): a guest made a session
per `append_frame` with any key, the server kept them all and scanned them on every lookup (a
healthy call's median went from 8.6 to 35 ms after 100,000). Here one `OublietteServer` runs in
this process (`max_sessions` 1,000) with a caller that owns session `s1` and a raw guest:

1. healthy calls, measured: the guest appends an `assistant.delta` to `s1` (relay `append_frame`:
   key check, registry lookup, store, push to the owner), then the caller reads it back with
   `session_events` (lookup by id, store read);
2. the flood: guest appends with bad keys (newline, NUL, lone surrogate, 200 characters, and a
   few of 500 kB), guest appends to well-formed keys the server does not know, `tether_send` to
   distinct sessions of another instance (made, then forgotten past `max_sessions`), and sessions made straight in
   the registry (as the old door let a guest make them), forgotten as well;
3. the healthy calls again; the medians, the server's RSS and the sessions held are printed.

    python bench/bench_sessions.py            # ~30 s on a quiet machine
    python bench/bench_sessions.py --quick    # smaller counts, a smoke run

It also runs against a server from before the bound (no `max_sessions`), to compare.
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import attrs
import trio

from oubliette_server.program.app import OublietteServer
from oubliette_server.program.config import ServerConfig

INSTANCE = "box1"
OTHER = "box2"  # the tether_send sessions' instance: no guest there, so nothing is delivered to ours
MAX_SESSIONS = 1_000
WINDOW = 32  # requests in flight during a flood


def rss_mb() -> float:
    """This process's resident set size, in MB (the server runs in it)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Guest:
    """A raw guest relay connection. One task reads every line (the deliveries of the messages
    sent meanwhile too: a guest that stops reading is disconnected) and hands each response to
    its request."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.next_id = 0
        self.waiting: dict[int, trio.MemorySendChannel[dict[str, Any]]] = {}
        self.sending = trio.Lock()  # one writer at a time on the stream

    async def read(self) -> None:
        """Run in a nursery: route responses to their requests, drop deliveries."""
        buffer = bytearray()
        while chunk := await self.stream.receive_some(1 << 20):
            buffer.extend(chunk)
            *lines, rest = buffer.split(b"\n")
            buffer = bytearray(rest)
            for line in lines:
                message = json.loads(line)
                channel = self.waiting.pop(message.get("id"), None) if "method" not in message else None
                if channel is not None:
                    channel.send_nowait(message)
        raise ConnectionError("the server closed the guest connection (see its log above)")

    async def request(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        request_id = self.next_id
        self.next_id += 1
        send, receive = trio.open_memory_channel[dict[str, Any]](1)
        self.waiting[request_id] = send
        line = json.dumps({"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}) + "\n"
        async with self.sending:
            await self.stream.send_all(line.encode())
        return await receive.receive()

    async def flood(self, params: list[dict[str, Any]]) -> dict[int, int]:
        """Every append, `WINDOW` in flight; error code -> count (0: stored)."""
        codes: dict[int, int] = {}
        window = trio.Semaphore(WINDOW)

        async def one(p: dict[str, Any]) -> None:
            try:
                code = (await self.request("append_frame", p)).get("error", {}).get("code", 0)
                codes[code] = codes.get(code, 0) + 1
            finally:
                window.release()

        async with trio.open_nursery() as nursery:
            for p in params:
                await window.acquire()
                nursery.start_soon(one, p)
        return codes


async def healthy_calls(app: OublietteServer, caller: Any, guest: Guest, count: int) -> list[float]:
    """`count` healthy calls, each: append to s1 through the relay, read it back as the caller."""
    tools = app.caller_api()
    ctx = SimpleNamespace(protocol_version="2025-11-25", session=None, request_id=None)
    times = []
    for n in range(count):
        start = time.perf_counter()
        answer = await guest.request("append_frame", {
            "session": {"channel": "mcp", "id": "s1"}, "type": "assistant.delta", "payload": {"text": f"h{n}"}})
        seq = answer["result"]["seq"]
        read = await tools.call(ctx, caller, "session_events", {"instance": INSTANCE, "session_id": "s1", "after_seq": seq - 1})
        assert not read.is_error and read.structured_content["frames"][0]["seq"] == seq
        times.append(time.perf_counter() - start)
    return times


def bad_keys(count: int) -> list[dict[str, Any]]:
    kinds = [("mcp", "s\n{}"), ("mcp", "s\x00{}"), ("mcp", "\ud800{}"), ("mcp", "{}" + "x" * 200), ("c\n{}", "s1")]
    out = []
    for n in range(count):
        channel, session_id = kinds[n % len(kinds)]
        out.append({"session": {"channel": channel.format(n), "id": session_id.format(n)},
                    "type": "assistant.delta", "payload": {}})
    return out


async def main(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="bench-sessions-", dir="/tmp"))
    try:
        bound = {"max_sessions": MAX_SESSIONS} if "max_sessions" in attrs.fields_dict(ServerConfig) else {}
        config = ServerConfig(data_dir=root / "data", relay=f"unix:{root / 'relay.sock'}",
                              instances={INSTANCE: {}, OTHER: {}}, **bound)
        app = OublietteServer(config)
        async with trio.open_nursery() as nursery:
            await nursery.start(app.serve)
            caller = app.open_caller("bench")
            tools = app.caller_api()
            ctx = SimpleNamespace(protocol_version="2025-11-25", session=None, request_id=None)
            opened = await tools.call(ctx, caller, "session_message", {"instance": INSTANCE, "session_id": "s1", "message": "hi"})
            assert not opened.is_error
            stream = await trio.open_unix_socket(str(root / "relay.sock"))
            guest = Guest(stream)
            nursery.start_soon(guest.read)
            hello = await guest.request("hello", {"protocol": "oubliette-relay/1", "role": "guest", "instance": INSTANCE,
                                                  "token": app.tokens.token_for(INSTANCE)})
            assert "result" in hello, hello

            await healthy_calls(app, caller, guest, args.warmup)
            rss_before = rss_mb()
            before = await healthy_calls(app, caller, guest, args.calls)

            started = time.perf_counter()
            refused = await guest.flood(bad_keys(args.bad))
            huge = [{"session": {"channel": "mcp", "id": "x" * 500_000}, "type": "assistant.delta", "payload": {}}] * args.huge
            refused_huge = await guest.flood(huge)
            unknown = await guest.flood([{"session": {"channel": "mcp", "id": f"made-up-{n}"}, "type": "assistant.delta",
                                          "payload": {}} for n in range(args.unknown)])
            for n in range(args.tether):
                sent = await tools.call(ctx, caller, "tether_send", {"instance": OTHER, "text": "x", "session_id": f"t{n}"})
                assert not sent.is_error
            for n in range(args.direct):
                app.sessions.get_or_create(INSTANCE, "mcp", f"direct-{n}")
            flood_seconds = time.perf_counter() - started

            after = await healthy_calls(app, caller, guest, args.calls)
            rss_after = rss_mb()
            nursery.cancel_scope.cancel()
        await stream.aclose()

        def ms(times: list[float]) -> str:
            q = statistics.quantiles(times, n=20)
            return f"median {statistics.median(times) * 1000:.2f} ms, p95 {q[18] * 1000:.2f} ms"

        print(f"healthy call (append_frame to s1 + session_events), {args.calls} calls each:")
        print(f"  before the flood: {ms(before)}")
        print(f"  after the flood:  {ms(after)}")
        print(f"  ratio of medians: {statistics.median(after) / statistics.median(before):.2f}")
        print(f"flood ({flood_seconds:.1f} s): bad keys {refused}, 500 kB keys {refused_huge}, "
              f"unknown sessions {unknown}, tether_send sessions {args.tether}, made in the registry {args.direct}")
        held = collections.Counter(session.instance for session in app.sessions.all())
        print(f"sessions held: {INSTANCE} {held[INSTANCE]}, {OTHER} {held[OTHER]} "
              f"(max_sessions {bound.get('max_sessions', 'none')}); forgotten {getattr(app.sessions, 'forgotten', 0)}")
        print(f"RSS of this process (server + bench): {rss_before:.0f} MB before, {rss_after:.0f} MB after")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--bad", type=int, default=10_000)
    parser.add_argument("--huge", type=int, default=100)
    parser.add_argument("--unknown", type=int, default=10_000)
    parser.add_argument("--tether", type=int, default=3_000)
    parser.add_argument("--direct", type=int, default=100_000)
    parser.add_argument("--quick", action="store_true", help="smaller counts, a smoke run")
    arguments = parser.parse_args()
    if arguments.quick:
        arguments.calls, arguments.warmup, arguments.bad, arguments.huge = 100, 20, 1_000, 20
        arguments.unknown, arguments.tether, arguments.direct = 1_000, 1_500, 5_000
    trio.run(main, arguments)
