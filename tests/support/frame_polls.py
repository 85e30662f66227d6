"""Helpers of tests/server/core/test_ownership.py that other test files use
too, kept here so that no test file imports another."""

from __future__ import annotations

import trio

from harness import EVENT_TIMEOUT, HttpServer


async def poll_frames(server: HttpServer, session_id: str, type_: str, count: int = 1) -> list[dict]:
    """Frames of the `mcp` session through the HTTP tether API, long-polled until `count` are there."""
    async with server.rest() as rest:
        with trio.fail_after(EVENT_TIMEOUT):
            while True:
                response = await rest.get("/v1/instances/box1/tether/poll", params={
                    "channel": "mcp", "session_id": session_id, "types": type_, "wait_ms": 2000})
                response.raise_for_status()
                frames = response.json()["frames"]
                if len(frames) >= count:
                    return frames
