"""The fast path for plain `tools/call` lines (oubliette_runtime/fast_tool_calls.py), on its own.

The tests feed lines to `FastToolCalls` in the test's loop. Each program's parity test, its line
router on and off, is in tests/client/test_early_handshake.py (the client) and
tests/server/doors/test_caller_line_router.py (the server).
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

import pytest
import trio
import trio.testing

from oubliette_runtime.fast_tool_calls import FastToolCalls, fast_path_enabled

TIMEOUT = 20


def call_line(request_id: Any = 7, name: str = "echo", arguments: Any = None, **extra: Any) -> str:
    params: dict[str, Any] = {"name": name, "arguments": {"x": 1} if arguments is None else arguments}
    params.update(extra.pop("params", {}))
    message = {"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": params, **extra}
    return json.dumps(message) + "\n"


class Harness:
    """A `FastToolCalls` with a route for tool `echo` whose calls wait for `release`."""

    def __init__(self) -> None:
        self.written: list[dict[str, Any]] = []
        self.wrote = trio.Event()
        self.release = trio.Event()
        self.started: list[Any] = []
        self.fast = FastToolCalls(self.route, self.write)

    def route(self, name: str, arguments: dict[str, Any]) -> Any:
        if name != "echo":
            return None

        async def handle(token: Any, send_progress: Any) -> dict[str, Any]:
            self.started.append(token)
            if send_progress is not None:
                await send_progress(1, 2, "half")
            await self.release.wait()
            return {"content": [{"type": "text", "text": json.dumps(arguments)}], "isError": False}
        return handle

    async def write(self, text: str) -> None:
        assert text.endswith("\n") and text.count("\n") == 1
        self.written.append(json.loads(text))
        self.wrote.set()

    async def feed(self, *lines: str) -> list[str]:
        """The lines that went through to the SDK."""
        async def source() -> AsyncIterator[str]:
            for line in lines:
                yield line

        return [line async for line in self.fast.lines(source())]


async def test_a_plain_call_is_answered_here_and_not_passed_on() -> None:
    h = Harness()
    async with trio.open_nursery() as nursery:
        await nursery.start(h.fast.run)
        assert await h.feed(call_line(7)) == []
        h.release.set()
        with trio.fail_after(TIMEOUT):
            await h.wrote.wait()
        nursery.cancel_scope.cancel()
    assert h.written == [{"jsonrpc": "2.0", "id": 7, "result": {
        "content": [{"type": "text", "text": '{"x": 1}'}], "isError": False}}]
    assert h.fast.taken == 1


@pytest.mark.parametrize("line", [
    call_line(params={"_meta": {"progressToken": 1, "io.modelcontextprotocol/protocolVersion": "2026-07-28"}}),
    call_line(params={"task": {}}),
    call_line(extra_key=1),
    call_line(True),
    call_line(1.5),
    call_line(None),
    call_line(arguments=[1]),
    call_line(name="other"),
    call_line(params={"_meta": {"progressToken": True}}),
    json.dumps({"jsonrpc": "2.0", "method": "tools/call", "params": {"name": "echo"}}) + "\n",
    json.dumps({"jsonrpc": "1.0", "id": 1, "method": "tools/call", "params": {"name": "echo"}}) + "\n",
    json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"name": "tools/call"}}) + "\n",
    '{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": \n',
    '["tools/call"]\n',
    '{"method": "tools/call", "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n",
    '{"method": "notifications/cancelled", "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n",
], ids=["modern-meta", "extra-param", "extra-key", "bool-id", "float-id", "null-id", "array-arguments",
        "unrouted-tool", "bool-token", "notification", "wrong-jsonrpc", "other-method", "broken-json", "array",
        "deep-call", "deep-cancel"])
async def test_every_other_line_goes_to_the_sdk_unchanged(line: str) -> None:
    h = Harness()
    async with trio.open_nursery() as nursery:
        await nursery.start(h.fast.run)
        assert await h.feed(line) == [line]
        nursery.cancel_scope.cancel()
    assert h.fast.taken == 0 and h.written == []


async def test_nothing_is_taken_before_run_has_started() -> None:
    h = Harness()
    assert await h.feed(call_line(7)) == [call_line(7)]


async def test_an_id_already_in_flight_goes_to_the_sdk() -> None:
    h = Harness()
    async with trio.open_nursery() as nursery:
        await nursery.start(h.fast.run)
        assert await h.feed(call_line(7), call_line(7), call_line("7")) == [call_line(7)]
        assert h.fast.taken == 2
        nursery.cancel_scope.cancel()


async def test_a_cancelled_call_gets_no_response_and_the_sdk_still_sees_the_cancel() -> None:
    h = Harness()
    cancel = json.dumps({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 7}}) + "\n"
    async with trio.open_nursery() as nursery:
        await nursery.start(h.fast.run)
        assert await h.feed(call_line(7), call_line(8), cancel) == [cancel]
        h.release.set()
        with trio.fail_after(TIMEOUT):
            while len(h.written) < 1:
                h.wrote = trio.Event()
                await h.wrote.wait()
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert [m["id"] for m in h.written] == [8]
    # the id is free again once its call ended
    assert h.fast._in_flight == {}


async def test_progress_goes_out_on_the_agents_token_before_the_response() -> None:
    h = Harness()
    async with trio.open_nursery() as nursery:
        await nursery.start(h.fast.run)
        await h.feed(call_line(7, params={"_meta": {"progressToken": "tok"}}))
        with trio.fail_after(TIMEOUT):
            await h.wrote.wait()
        h.release.set()
        with trio.fail_after(TIMEOUT):
            while len(h.written) < 2:
                h.wrote = trio.Event()
                await h.wrote.wait()
        nursery.cancel_scope.cancel()
    assert h.started == ["tok"]
    assert h.written[0] == {"jsonrpc": "2.0", "method": "notifications/progress",
                            "params": {"progressToken": "tok", "progress": 1, "total": 2, "message": "half"}}
    assert h.written[1]["id"] == 7


@pytest.mark.parametrize(("value", "enabled"), [(None, True), ("1", True), ("0", False), ("false", False), (" OFF ", False), ("no", False)])
def test_the_switch(value: str | None, enabled: bool) -> None:
    environ = {} if value is None else {"OUBLIETTE_FAST_PATH": value}
    assert fast_path_enabled(environ) is enabled
