"""Helpers of tests/e2e/test_faults.py that bench/probe_turn_ends.py runs too (a burst of messages
to an instance whose start command fails), kept here so that nothing imports a test file."""

from __future__ import annotations

import sys
from typing import Any

import trio

from harness import Deployment

BURST = 60
SESSION = {"channel": "host", "id": "b"}


async def post_message(rest: Any, instance: str, text: str) -> None:
    response = await rest.post(f"/v1/instances/{instance}/tether", json={
        "type": "user.message", "session": SESSION, "payload": {"text": text},
    })
    assert response.status_code == 201, response.text


async def burst_to_a_failing_start(deployment: Deployment, messages: int = BURST) -> dict[str, int]:
    """`messages` posted at once to `box2`, whose start command exits 1: each one wakes it, and each
    failed start ends the turns waiting for it (failed starts overlap while the burst arrives).
    Once every message has an end, the server stops: the turn ends of each message in its log."""
    config = deployment.config_file(start={"box2": [sys.executable, "-c", "import sys; sys.exit(1)"]})
    async with deployment.http_server("--config", str(config)) as server, server.rest() as rest:
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for n in range(messages):
                    nursery.start_soon(post_message, rest, "box2", f"m{n}")
            after = 0
            ended: set[str] = set()
            while len(ended) < messages:  # the failed starts' session.error frames, as they come
                polled = (await rest.get("/v1/instances/box2/tether/poll", params={
                    "after_seq": after, "wait_ms": 10_000, "types": "session.error"})).json()
                ended.update(f["reply_to"] for f in polled["frames"])
                after = polled.get("next_seq", after)
    return deployment.turn_ends("box2")
