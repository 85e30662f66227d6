"""Helpers of tests/e2e/test_cluster_calls.py that other test files use
too, kept here so that no test file imports another."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import trio
from loop_caller import INSTANCE, LOOP_AGENT
from tether_http import poll

from harness import Deployment, HttpServer


@asynccontextmanager
async def two_servers(pg_url: str) -> AsyncIterator[tuple[HttpServer, HttpServer]]:
    """Servers A and B on `pg_url`, both knowing `box1`; the guest of `box1` connected to B."""
    a, b = Deployment(store=pg_url), Deployment(store=pg_url)
    try:
        async with a.http_server("--config", str(a.config_file(INSTANCE))) as server_a, \
                b.http_server("--config", str(b.config_file(INSTANCE))) as server_b, \
                b.guest(INSTANCE, LOOP_AGENT):
            await server_b.wait_connected(INSTANCE)
            yield server_a, server_b
            assert server_a.process.returncode is None and server_b.process.returncode is None
    finally:
        a.cleanup()
        b.cleanup()


def one_outcome_each(frames: list[Any]) -> dict[str, Any]:
    """Every request in `frames` has exactly one outcome frame; the outcomes by request id."""
    requests = [f.payload["request_id"] for f in frames if f.type == "caller_tool_request"]
    outcomes: dict[str, list[Any]] = {}
    for f in frames:
        if f.type != "caller_tool_request":
            outcomes.setdefault(f.payload["request_id"], []).append(f)
    assert sorted(outcomes) == sorted(requests), (requests, outcomes)
    assert all(len(o) == 1 for o in outcomes.values()), outcomes
    return {rid: o[0] for rid, o in outcomes.items()}


async def turn_end(server: HttpServer, session_id: str) -> dict[str, Any]:
    """The one `assistant.done` frame of `session_id`'s turn, long-polled on `server` (bounded)."""
    async with server.rest() as rest:
        with trio.fail_after(30):
            done = await poll(rest, INSTANCE, {
                "channel": "mcp", "session_id": session_id, "types": "assistant.done", "wait_ms": 25_000,
            })
    [frame] = done["frames"]
    return frame  # type: ignore[no-any-return]
