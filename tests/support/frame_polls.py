"""Long-poll helpers several test files use (tests/server/core/test_ownership.py, the store
tests), kept here so that no test file imports another."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import trio
import trio.testing

from harness import EVENT_TIMEOUT, HttpServer
from oubliette_server.store.api import FrameQuery, FrameStoreAPI, LongPollWaiters, ParkedPoll


@asynccontextmanager
async def two_session_polls(store: FrameStoreAPI) -> AsyncIterator[tuple[dict[str, Any], ParkedPoll]]:
    """Long polls of sessions `x` and `y` on `box1` of `store`, both parked: (each one's answer by
    session as it comes, `y`'s parked poll). Leaving cancels what still waits."""
    got: dict[str, Any] = {}

    async def wait_for(session_id: str) -> None:
        got[session_id] = await store.wait_for_frames("box1", FrameQuery(session_id=session_id), 20)

    assert isinstance(store, LongPollWaiters)
    with trio.fail_after(EVENT_TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait_for, "x")
            nursery.start_soon(wait_for, "y")
            while store.waiter_count("box1") != 2:
                await trio.testing.wait_all_tasks_blocked()
            [y_poll] = [parked for parked in store._waiters["box1"] if parked.q.session_id == "y"]
            yield got, y_poll
            nursery.cancel_scope.cancel()


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
