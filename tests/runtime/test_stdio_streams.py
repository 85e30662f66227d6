"""One stdin line of the stdio MCP servers is bounded (oubliette_runtime/stdio_streams.py).

The unit tests read `StdinLines` over a real pipe, with its replies written through a real
`StdoutText` over another pipe. The end-to-end tests send a line one byte over the default
bound (16 MiB) to oubliette-server's stdio caller API and to oubliette-client's stdio MCP
server, and check the error response names the request and the server goes on serving.
"""

from __future__ import annotations

import json
import os
import subprocess
import tracemalloc
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any, cast

import pytest
import trio
import trio.testing

from harness import PYTHON, Deployment, HandMcp
from task_steps import counted_steps
from protocol.errors import INVALID_REQUEST
from protocol.limits import MAX_PAYLOAD_BYTES_CEILING
from oubliette_runtime.stdio_streams import (
    DEFAULT_MAX_STDIN_LINE_BYTES,
    StdinLines,
    StdoutText,
    claimed_stdio,
    request_id_of,
)

TIMEOUT = 20


def fd_pipe() -> tuple[trio.lowlevel.FdStream, trio.lowlevel.FdStream]:
    """(read end, write end) of a real pipe, as Trio streams."""
    read_fd, write_fd = os.pipe()
    return trio.lowlevel.FdStream(read_fd), trio.lowlevel.FdStream(write_fd)


class Wire:
    """`StdinLines` over one pipe (the test writes into `feed`), answering through a `StdoutText`
    over another (the test reads `replies`). `lines` fills as the reader yields."""

    def __init__(self, max_line_bytes: int) -> None:
        stdin, self.feed = fd_pipe()
        self.replies_end, stdout = fd_pipe()
        self.stdin = stdin
        self.stdout = StdoutText(stdout, on_broken=stdin.close)
        self.reader = StdinLines(stdin, max_line_bytes=max_line_bytes, reply=self.stdout.write)
        self.lines: list[str] = []
        self.ended = trio.Event()
        self._stdout_stream = stdout
        self._reply_buffer = b""

    async def read_all(self) -> None:
        async for line in self.reader:
            self.lines.append(line)
        self.ended.set()

    async def send(self, *pieces: bytes) -> None:
        """Each piece in its own write, read by the reader before the next is written."""
        for piece in pieces:
            await self.feed.send_all(piece)
            await trio.testing.wait_all_tasks_blocked()

    async def end(self) -> None:
        """EOF on the reader's side; waits until the reader has finished."""
        await self.feed.aclose()
        with trio.fail_after(TIMEOUT):
            await self.ended.wait()

    async def reply(self) -> dict[str, Any]:
        """The next line written to stdout."""
        with trio.fail_after(TIMEOUT):
            while b"\n" not in self._reply_buffer:
                chunk = await self.replies_end.receive_some(65536)
                assert chunk, "stdout ended"
                self._reply_buffer += chunk
        line, self._reply_buffer = self._reply_buffer.split(b"\n", 1)
        return json.loads(line)

    async def no_more_replies(self) -> None:
        """Nothing else was written to stdout (closes it to see the end)."""
        await self._stdout_stream.aclose()
        with trio.fail_after(TIMEOUT):
            rest = self._reply_buffer + await self.replies_end.receive_some(65536)
        assert rest == b""

    def close(self) -> None:
        for stream in (self.stdin, self.feed, self.replies_end, self._stdout_stream):
            stream.close()


@asynccontextmanager
async def wire(max_line_bytes: int = DEFAULT_MAX_STDIN_LINE_BYTES) -> AsyncIterator[Wire]:
    w = Wire(max_line_bytes)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(w.read_all)
            yield w
            nursery.cancel_scope.cancel()
    finally:
        w.close()


def request_line(size: int, request_id: Any = 5) -> bytes:
    """A `tools/call` request of exactly `size` bytes (no newline)."""
    prefix = json.dumps({"jsonrpc": "2.0", "id": request_id, "method": "tools/call",
                         "params": {"name": "echo", "arguments": {"pad": ""}}}, separators=(",", ":"))
    pad = size - len(prefix)
    assert pad >= 0
    line = prefix.replace('"pad":""', '"pad":"' + "a" * pad + '"').encode()
    assert len(line) == size
    return line


def assert_refusal(reply: dict[str, Any], request_id: Any, limit: int) -> None:
    assert reply["jsonrpc"] == "2.0"
    assert reply["id"] == request_id
    assert reply["error"]["code"] == INVALID_REQUEST == -32600
    assert f"longer than {limit} bytes" in reply["error"]["message"]
    assert reply["error"]["data"] == {"limit": "max_stdin_line_bytes", "max": limit}


# -- splitting --------------------------------------------------------------------------------


async def test_lines_split_across_chunks_arrive_whole() -> None:
    async with wire() as w:
        await w.send(b'{"a":', b'1}\n{"b"', b":2", b"}\n")
        assert w.lines == ['{"a":1}\n', '{"b":2}\n']
        await w.end()
        assert w.lines == ['{"a":1}\n', '{"b":2}\n']
        await w.no_more_replies()


async def test_several_lines_in_one_chunk_and_empty_lines() -> None:
    async with wire() as w:
        await w.send(b"one\ntwo\n\nthree\n")
        assert w.lines == ["one\n", "two\n", "\n", "three\n"]


async def test_a_final_line_without_newline_arrives_at_eof() -> None:
    async with wire() as w:
        await w.send(b"a\nlast")
        assert w.lines == ["a\n"]
        await w.end()
        assert w.lines == ["a\n", "last"]


async def test_invalid_utf8_is_replaced_and_a_character_split_across_chunks_stays_whole() -> None:
    async with wire() as w:
        await w.send(b"\xff\xfeok\n", b"caf\xc3", b"\xa9\n")
        assert w.lines == ["\ufffd\ufffdok\n", "café\n"]


# -- the bound --------------------------------------------------------------------------------


async def test_a_line_at_the_limit_passes_one_byte_over_is_refused_and_the_next_line_arrives() -> None:
    limit = 200
    async with wire(limit) as w:
        at_limit = request_line(limit, request_id=4)
        await w.send(at_limit + b"\n")
        assert w.lines == [at_limit.decode() + "\n"]
        await w.send(request_line(limit + 1, request_id=5) + b"\n", b'{"next":1}\n')
        assert_refusal(await w.reply(), 5, limit)
        assert w.lines == [at_limit.decode() + "\n", '{"next":1}\n']
        assert w.reader.refused == 1
        await w.end()
        await w.no_more_replies()  # one answer for one refused line, none for the others


async def test_an_oversized_line_split_at_every_point_is_refused_once() -> None:
    limit = 120
    line = request_line(limit + 10, request_id="abc") + b"\n"
    for cut in range(1, len(line)):
        async with wire(limit) as w:
            await w.send(line[:cut], line[cut:], b"ok\n")
            assert_refusal(await w.reply(), "abc", limit)
            assert w.lines == ["ok\n"], cut


async def test_an_oversized_line_in_many_chunks_is_never_held_and_the_next_line_arrives() -> None:
    """32 MiB in 64 KiB writes against a 1 KiB limit: the reader's memory stays far below the line."""
    limit, block = 1024, b"x" * 65536
    async with wire(limit) as w:
        tracemalloc.start()
        try:
            await w.send(b'{"jsonrpc":"2.0","id":77,"method":"tools/call","params":{"pad":"')
            for _ in range(512):
                await w.send(block)
            await w.send(b'"}}\n{"after":1}\n')
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert_refusal(await w.reply(), 77, limit)
        assert w.lines == ['{"after":1}\n']
    assert peak < 2 * 1024 * 1024, f"peak {peak} bytes while reading a 32 MiB line"


async def test_an_oversized_line_cut_short_by_eof_ends_as_eof_does() -> None:
    async with wire(100) as w:
        await w.send(b"first\n", request_line(500))
        await w.end()
        assert w.lines == ["first\n"]
        await w.no_more_replies()


async def test_a_refusal_to_a_reader_that_has_gone_ends_reading_quietly() -> None:
    """stdout broken while answering: stdin is closed with it (as in `claimed_stdio`), reading ends."""
    async with wire(100) as w:
        w.replies_end.close()
        await w.send(request_line(500, request_id=1) + b"\n")
        with trio.fail_after(TIMEOUT):
            await w.ended.wait()
        assert w.lines == []
        with pytest.raises(trio.BrokenResourceError):  # stdin was closed: nothing more is read
            await w.feed.send_all(b"unread\n")


async def test_a_line_to_a_free_pipe_is_written_in_the_step_it_is_written_in() -> None:
    """No write in progress: the line goes to the pipe at once, with no scheduler round trip (the
    lock's and the stream's checkpoint were two of them for every line of a relayed call)."""
    read_end, write_end = fd_pipe()
    async with read_end, write_end:
        stdout = StdoutText(write_end)
        with counted_steps() as steps:
            await stdout.write("one line\n")
        assert steps.count == 0
        with trio.fail_after(TIMEOUT):
            assert await read_end.receive_some() == b"one line\n"


async def test_a_line_that_arrives_while_stdin_waits_is_read_in_one_step() -> None:
    """Between the lines of a relayed call stdin has nothing: the reader waits for the pipe and
    reads in the step it wakes in (the stream's `receive_some` took a checkpoint first: two)."""
    read_end, feed = fd_pipe()
    lines = cast(AsyncGenerator[str, None], StdinLines(read_end).__aiter__())  # `_lines`, a generator
    async with read_end, feed, aclosing(lines), trio.open_nursery() as nursery:

        async def send_when_the_reader_waits() -> None:
            await trio.testing.wait_all_tasks_blocked()
            await feed.send_all(b"one line\n")

        nursery.start_soon(send_when_the_reader_waits)
        with counted_steps() as steps, trio.fail_after(TIMEOUT):
            assert await lines.__anext__() == "one line\n"
        assert steps.count == 1


async def test_a_line_the_pipe_takes_in_part_ends_before_the_next_line_begins() -> None:
    """A line longer than the pipe holds is written on under the lock: a line written meanwhile
    by another task waits for it, and the reader gets both whole, in order."""
    read_end, write_end = fd_pipe()
    long_line = "x" * 300_000 + "\n"
    async with read_end, write_end, trio.open_nursery() as nursery:
        stdout = StdoutText(write_end)
        nursery.start_soon(stdout.write, long_line)
        await trio.testing.wait_all_tasks_blocked()  # the pipe is full: the rest waits under the lock
        nursery.start_soon(stdout.write, "short\n")
        await trio.testing.wait_all_tasks_blocked()
        received = b""
        with trio.fail_after(TIMEOUT):
            while len(received) < len(long_line) + len("short\n"):
                received += await read_end.receive_some()
    assert received == (long_line + "short\n").encode()


async def test_a_bound_below_one_byte_is_refused() -> None:
    read_end, write_end = fd_pipe()
    try:
        with pytest.raises(ValueError, match="max_line_bytes"):
            StdinLines(read_end, max_line_bytes=0)
    finally:
        read_end.close()
        write_end.close()


async def test_the_default_bound_holds_the_largest_accepted_value_many_times_over() -> None:
    """A value at the payload limit, even escaped and indented by a caller's SDK, fits one line."""
    assert DEFAULT_MAX_STDIN_LINE_BYTES >= 16 * MAX_PAYLOAD_BYTES_CEILING
    read_end, write_end = fd_pipe()
    try:
        assert StdinLines(read_end).max_line_bytes == DEFAULT_MAX_STDIN_LINE_BYTES
    finally:
        read_end.close()
        write_end.close()


async def test_claimed_stdio_passes_its_bound_and_answers_on_its_stdout() -> None:
    """`claimed_stdio(max_line_bytes=...)` over fd 0 and 1 (pipes here); both are restored after."""
    stdin_read, stdin_write = os.pipe()
    stdout_read, stdout_write = os.pipe()
    saved_in, saved_out = os.dup(0), os.dup(1)
    try:
        os.dup2(stdin_read, 0)
        os.dup2(stdout_write, 1)
        with claimed_stdio(max_line_bytes=100) as (stdin, stdout):
            os.write(stdin_write, request_line(150, request_id="q") + b"\nok\n")
            os.close(stdin_write)
            lines = []
            with trio.fail_after(TIMEOUT):
                async for line in stdin:
                    lines.append(line)
    finally:
        os.dup2(saved_in, 0)
        os.dup2(saved_out, 1)
        for fd in (saved_in, saved_out, stdin_read, stdout_write):
            os.close(fd)
    assert lines == ["ok\n"]
    written = os.read(stdout_read, 65536)
    os.close(stdout_read)
    assert_refusal(json.loads(written), "q", 100)


# -- the id of a line too long to parse ---------------------------------------------------------


@pytest.mark.parametrize(("head", "expected"), [
    (b'{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{"arguments":{"pad":"aaa', 5),
    (b'  {"id" : "req-1" , "method":"x"', "req-1"),
    (b'{"id":-12,"m":1}', -12),
    (b'{"id":"a\\"b\\u00e9","m":1}', 'a"b\u00e9'),
    (b'{"id":' + b"9" * 19 + b',"m":1}', int("9" * 19)),
    # only the top-level "id" names the request; an "id" inside params is someone else's
    (b'{"jsonrpc":"2.0","method":"tools/call","params":{"arguments":{"id":7},"x":[{"id":8}]},"id":9,', 9),
    (b'{"jsonrpc":"2.0","method":"tools/call","params":{"arguments":{"id":7,"pad":"aaaa', None),
    (b'{"method":"id","params":{"s":"\\"id\\":3"},"id":"z"}', "z"),
    (b'{"method":"x","params":"{\\"id\\":3}","pad":"aaaa', None),
    # not a bounded integer or string, or not complete within the head
    (b'{"id":null,"method":"x"', None),
    (b'{"id":1.5,"method":"x"', None),
    (b'{"id":1e3,"method":"x"', None),
    (b'{"id":true,"method":"x"', None),
    (b'{"id":' + b"9" * 20 + b',"m":1}', None),
    (b'{"id":"' + b"a" * 129 + b'","m":1}', None),
    (b'{"id":12', None),
    (b'{"id":"abc', None),
    (b'{"id":"\xff","m":1}', None),
    (b'[{"id":1,"method":"x"}', None),
    (b'"id":1', None),
    (b"", None),
    (b'{"a":{}}, {"id":1}', None),
])
def test_the_id_is_taken_only_from_the_top_level_object(head: bytes, expected: Any) -> None:
    assert request_id_of(head) == expected


def test_the_id_of_a_line_whose_head_is_one_long_string_is_not_guessed() -> None:
    assert request_id_of(b'{"params":"' + b"x" * 5000) is None


# -- end to end: both programs ----------------------------------------------------------------


def oversized_call(request_id: Any) -> bytes:
    """A `tools/call` line one byte over the default bound, with its newline."""
    return request_line(DEFAULT_MAX_STDIN_LINE_BYTES + 1, request_id) + b"\n"


async def initialize(agent: HandMcp) -> None:
    await agent.send({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "hand", "version": "1"}}})
    assert "result" in await agent.response(0)
    await agent.send({"jsonrpc": "2.0", "method": "notifications/initialized"})


async def check_refused_then_served(agent: HandMcp, request_id: Any, follow_up: dict[str, Any]) -> dict[str, Any]:
    """Send the oversized call, check its refusal, then send `follow_up`; its response."""
    with trio.fail_after(60):
        await initialize(agent)
        assert agent.process.stdin is not None
        await agent.process.stdin.send_all(oversized_call(request_id))
        assert_refusal(await agent.response(request_id), request_id, DEFAULT_MAX_STDIN_LINE_BYTES)
        await agent.send(follow_up)
        return await agent.response(follow_up["id"])


async def test_oubliette_server_refuses_an_oversized_stdin_line_and_keeps_serving(
    deployment: Deployment, tmp_path: Path,
) -> None:
    with (tmp_path / "server.log").open("w") as stderr:
        process = await trio.lowlevel.open_process(
            [PYTHON, "-m", "oubliette_server", "--relay", deployment.relay, "--data-dir", str(deployment.data_dir),
             "--log-level", "WARNING", *deployment.store_args()],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
        )
        try:
            listed = await check_refused_then_served(
                HandMcp(process), "big-1", {"jsonrpc": "2.0", "id": 3, "method": "tools/list"})
            assert "session_message" in [tool["name"] for tool in listed["result"]["tools"]]
            assert process.returncode is None
        finally:
            process.kill()
            await process.wait()
    assert "over the 16777216-byte limit; discarded" in (tmp_path / "server.log").read_text()


async def test_oubliette_client_refuses_an_oversized_stdin_line_and_keeps_serving(tmp_path: Path) -> None:
    process = await trio.lowlevel.open_process(
        [PYTHON, "-m", "oubliette_client", "--relay", f"unix:{tmp_path / 'no-relay.sock'}", "--instance", "box1",
         "--token", "t", "--connect-wait", "0"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )
    try:
        pong = await check_refused_then_served(HandMcp(process), 41, {"jsonrpc": "2.0", "id": 42, "method": "ping"})
        assert pong["result"] == {}
        assert process.returncode is None
    finally:
        process.kill()
        await process.wait()
