"""The floor under a request on `/mcp`: the CPU of a bare ASGI app that answers at once, with
nothing of the SDK's or oubliette's on the path, under hypercorn's Trio worker or (`--server
oubliette`) under the server's own connection (`HTTP11Connection`, doors/http11.py: h11 under
one task), with no middleware.

    python bench/probe_bare_hypercorn.py [--requests N] [--rounds R] [--server hypercorn|oubliette]

The server (this file run with `--serve`, in a process of its own) answers every POST with a
body of the size of a relayed call's answer, in the two forms the SDK's Streamable HTTP writer
uses: `json` (one sized body: hypercorn's head, body and end) and `sse` (the SDK's SSE headers,
one event, then the response event and the end: four writes, as an answer with `wait` whose
events rode the request). The client reads each as the SDK's client does (`mcp.client.
streamable_http`): a JSON body whole, an SSE stream until its response event and then closes
it, which closes the connection (the chunked body's end is not read yet, so httpcore cannot
keep it), and `sse-to-end` reads the stream to its end (the connection kept). It prints the
server's CPU (utime + stime from /proc) per request of each, the medians of the rounds. Not part
of the test suite.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from functools import partial
from typing import Any

import trio

from bench_http import drain, read_stderr_line
from bench_relay import PYTHON, cpu_seconds

EVENT = b'event: message\r\ndata: {"jsonrpc":"2.0","method":"notifications/message","params":{"level":"info","logger":"oubliette","data":{"type":"caller_tool_request","request_id":"r-0123456789","tool":"echo","arguments":{"text":"call 1"}}}}\r\n\r\n'
ANSWER = json.dumps({"jsonrpc": "2.0", "id": 1, "result": {
    "content": [{"type": "text", "text": '{"stop_reason": "requires_action", "pending": []}'}],
    "structuredContent": {"stop_reason": "requires_action", "text": "", "pending": [], "resolved": True},
    "isError": False}}, separators=(",", ":")).encode()
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache, no-transform"),
               (b"connection", b"keep-alive"), (b"x-accel-buffering", b"no")]
FORMS = ("json", "sse", "sse-to-end")


async def bare_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answer a POST at once: JSON at `/json`, else SSE (an event, then the answer)."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    while (await receive()).get("more_body"):
        pass
    if scope["path"] == "/json":
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(ANSWER)).encode())]})
        await send({"type": "http.response.body", "body": ANSWER})
        return
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
    await send({"type": "http.response.body", "body": EVENT, "more_body": True})
    await send({"type": "http.response.body", "body": b"event: message\r\ndata: " + ANSWER + b"\r\n\r\n"})


async def serve(server: str) -> None:
    """The server process: the bare app under hypercorn's Trio worker or the server's own
    connection, its address on stderr."""
    if server == "oubliette":
        await serve_on_http11()
        return
    from hypercorn.config import Config
    from hypercorn.trio import serve as hypercorn_serve

    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = None
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(hypercorn_serve, bare_app, config))  # type: ignore[arg-type]
        print(f"listening on {binds[0]}", file=sys.stderr, flush=True)


async def serve_on_http11() -> None:
    """The bare app on each connection as `HttpApi.serve` runs it: `HTTP11Connection` over a `GuardedStream`."""
    from oubliette_server.doors.connection_limits import HTTP_WRITE_SECONDS, GuardedStream
    from oubliette_server.doors.http11 import HTTP11Connection

    async def connection(stream: trio.SocketStream) -> None:
        await HTTP11Connection(bare_app, GuardedStream(stream, HTTP_WRITE_SECONDS), {},
                               keep_alive_timeout=5.0, max_requests=10**9).run()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    host, port = listeners[0].socket.getsockname()[:2]
    print(f"listening on http://{host}:{port}", file=sys.stderr, flush=True)
    await trio.serve_listeners(connection, listeners)


async def one_request(client: Any, url: str, form: str) -> None:
    """One POST, read as the SDK's client reads its answer."""
    path = "/json" if form == "json" else "/sse"
    async with client.stream("POST", url + path, content=b'{"jsonrpc":"2.0","id":1,"method":"tools/call"}',
                             headers={"content-type": "application/json"}) as response:
        if form == "json":
            await response.aread()
            return
        async for line in response.aiter_lines():
            if line.startswith("data: ") and '"result"' in line and form == "sse":
                await response.aclose()  # as the SDK's client: its answer is in
                return


async def measure(requests: int, server_kind: str) -> dict[str, float]:
    """Server CPU ms per request of each form, one server for all."""
    import httpx2

    server = await trio.lowlevel.open_process([PYTHON, __file__, "--serve", "--server", server_kind], stderr=subprocess.PIPE)
    try:
        url = (await read_stderr_line(server, b"listening on ", "bare hypercorn")).strip()
        assert server.stderr is not None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain, server.stderr)
            used: dict[str, float] = {}
            async with httpx2.AsyncClient(timeout=30) as client:
                for form in FORMS:
                    for _ in range(50):  # warm-up
                        await one_request(client, url, form)
                    before = cpu_seconds(server.pid)
                    for _ in range(requests):
                        await one_request(client, url, form)
                    used[form] = (cpu_seconds(server.pid) - before) * 1000 / requests
            nursery.cancel_scope.cancel()
        return used
    finally:
        server.kill()
        await server.wait()


def main() -> None:
    """Run the rounds and print the medians."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--server", choices=("hypercorn", "oubliette"), default="hypercorn",
                        help="hypercorn's Trio worker, or the server's own connection (doors/http11.py)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        trio.run(serve, args.server)
        return
    runs = []
    for n in range(args.rounds):
        runs.append(trio.run(measure, args.requests, args.server))
        print(f"  round {n + 1}: " + ", ".join(f"{form} {ms:.3f} ms" for form, ms in runs[-1].items()), flush=True)
    print(f"server CPU per request under {args.server}, medians: " + ", ".join(
        f"{form} {statistics.median(r[form] for r in runs):.3f} ms" for form in FORMS))


if __name__ == "__main__":
    main()
