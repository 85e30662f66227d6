"""Helpers of tests/server/doors/test_http_api.py that other test files use
too, kept here so that no test file imports another."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import trio
import trio.testing

TETHER = "/v1/instances/{}/tether"
POLL = "/v1/instances/{}/tether/poll"
STREAM = "/v1/instances/{}/tether/stream"


def frame_body(
    channel: str, session: str, type_: str = "assistant.delta", text: str = "", **extra: Any
) -> dict[str, Any]:
    return {"type": type_, "session": {"channel": channel, "id": session}, "payload": {"text": text}, **extra}


async def post(rest: Any, instance: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await rest.post(TETHER.format(instance), json=body)
    assert response.status_code == 201, response.text
    return response.json()


async def poll(rest: Any, instance: str, params: Any = None) -> dict[str, Any]:
    response = await rest.get(POLL.format(instance), params=params)
    assert response.status_code == 200, response.text
    return response.json()


class SseEvents:
    """Server-sent events of a streaming response: `{"id", "event", "data"}` dicts (comments skipped)."""

    def __init__(self, response: Any) -> None:
        self.response = response
        self._lines = response.aiter_lines()

    async def next(self, timeout: float = 10.0) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        with trio.fail_after(timeout):
            async for line in self._lines:
                if line == "":
                    if fields:
                        if "data" in fields:
                            fields["data"] = json.loads(fields["data"])
                        return fields
                    continue
                if line.startswith(":"):
                    continue
                name, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                fields[name] = fields[name] + "\n" + value if name in fields else value
        raise AssertionError("the SSE stream ended")


@asynccontextmanager
async def sse(rest: Any, instance: str, params: Any = None, headers: Any = None) -> AsyncIterator[SseEvents]:
    async with rest.stream("GET", STREAM.format(instance), params=params, headers=headers) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        yield SseEvents(response)
