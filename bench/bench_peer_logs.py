"""How much log a peer can make the server write: requests whose `_meta.tracestate` is huge and invalid.

    python bench/bench_peer_logs.py [--requests N] [--chars C]

Starts the real `oubliette-server` (SQLite, HTTP listeners, the default log level, tracing off,
as `tests/support/harness.py` does) and, over one raw relay connection as an instance's `client`, sends
N `caller_tool` requests for a tool nobody declared, each with a `_meta` whose `traceparent` is
valid and whose `tracestate` is C characters that are not a W3C list. Every request must be
answered (an error: the tool is unknown). It then sends N `tools/call` requests to `/mcp` (the
handshake era, `tether_read` with the same `_meta`). It prints the bytes the server wrote to
stderr for each burst and their time. docs/SECURITY.md, "Peer strings in log lines" quotes it.

Not part of the test suite.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))
sys.path.insert(0, str(ROOT))

from harness import Deployment, RawRelay  # noqa: E402

INSTANCE = "box1"
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def hostile_meta(chars: int) -> dict[str, Any]:
    """A valid `traceparent` with a `tracestate` of `chars` characters that is not a W3C list."""
    return {"traceparent": TRACEPARENT, "tracestate": "x" * chars}


async def relay_burst(deployment: Deployment, requests: int, chars: int) -> int:
    """`requests` caller_tool requests with the hostile `_meta`; how many were answered."""
    meta = hostile_meta(chars)
    answered = 0
    async with RawRelay.connect(deployment) as relay:
        hello = await relay.hello(INSTANCE, deployment.token(INSTANCE))
        assert "result" in hello, hello
        for number in range(1, requests + 1):
            await relay.send({"jsonrpc": "2.0", "id": number, "method": "caller_tool",
                              "params": {"tool": "nobody_declared", "arguments": {}, "_meta": meta}})
        while answered < requests:
            message = await relay.receive(timeout=60)
            assert message is not None, "the server closed the relay connection"
            if "id" in message:
                answered += 1
    return answered


async def mcp_burst(server: Any, requests: int, chars: int) -> int:
    """`requests` `tools/call` requests to `/mcp` with the hostile `_meta`; how many were answered."""
    async with server.caller(events=False) as (client, _):
        await client.call_tool("session_message", {"instance": INSTANCE, "session_id": "s1", "message": "hi"})
        for _ in range(requests):
            await client.call_tool("tether_read", {"instance": INSTANCE, "limit": 1}, meta=hostile_meta(chars))
    return requests


async def marker(deployment: Deployment, server: Any, name: str) -> None:
    """Wait until the server's stderr holds all it wrote for a burst: a relay connection refused
    after it leaves an access line, written after every line of the burst."""
    instance = "marker-" + "".join(c if c.isalnum() else "-" for c in name)
    async with RawRelay.connect(deployment) as relay:
        await relay.hello(instance, "not-a-token")
    await server.wait_stderr("oubliette.access", instance, timeout=60)


async def flood(deployment: Deployment, server: Any, requests: int, chars: int) -> list[tuple[str, int, float, int]]:
    """Both bursts against a running server: (door, requests answered, seconds, bytes of log written)."""
    results = []
    for name, burst in (("relay caller_tool", relay_burst(deployment, requests, chars)),
                        ("/mcp tools/call", mcp_burst(server, requests, chars))):
        before, started = len(server.stderr), time.perf_counter()
        answered = await burst
        seconds = time.perf_counter() - started
        await marker(deployment, server, name)
        results.append((name, answered, seconds, len(server.stderr) - before))
    return results


async def main(requests: int, chars: int) -> None:
    deployment = Deployment()
    try:
        async with deployment.http_server("--config", str(deployment.config_file(INSTANCE)), "--log-level", "INFO") as server:
            for name, answered, seconds, written in await flood(deployment, server, requests, chars):
                print(f"{name}: {answered}/{requests} answered in {seconds:.2f} s; "
                      f"server log {written:,} bytes ({written / requests:,.0f} bytes a request)")
    finally:
        deployment.cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--chars", type=int, default=900_000)
    args = parser.parse_args()
    trio.run(main, args.requests, args.chars)
