"""Stdin and stdout as cancellable Trio streams, for the stdio MCP servers of both programs.

The MCP SDK's stdio transport reads and writes the standard streams through worker threads
(`anyio.wrap_file`). A read blocked in a thread cannot be cancelled, so SIGTERM could not stop
a server whose caller keeps stdin open, and every line costs a thread hop. `claimed_stdio()`
gives the SDK's `stdio_server(stdin=..., stdout=...)` the two objects it uses — `async for line
in stdin`, `await stdout.write(text)` and `await stdout.flush()` — on Trio `FdStream`s over
private duplicates of fd 0 and 1, and diverts fd 0 (to the null device) and fd 1 (to stderr)
while serving, so a stray print or a child process never writes into the MCP stream.  EOF on stdin ends the
server; so does a broken stdout (the reader went away): stdin is then closed, which the reader
sees as EOF.

Owns: the two duplicated descriptors (closed on exit; fd 0 and 1 are restored).
Needs: a running Trio loop for the streams (anyio on the Trio backend is the same loop).
Cancellation: a read or write in progress is cancelled like any Trio stream operation.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager

import anyio
import trio

__all__ = ["StdinLines", "StdoutText", "claimed_stdio"]

_CHUNK = 64 * 1024


class StdinLines:
    """`async for line in stdin`: UTF-8 text lines (with their `\\n`) from a byte stream."""

    def __init__(self, stream: trio.lowlevel.FdStream) -> None:
        self._stream = stream

    def __aiter__(self) -> AsyncIterator[str]:
        return self._lines()

    async def _lines(self) -> AsyncIterator[str]:
        buffer = b""
        while True:
            try:
                chunk = await self._stream.receive_some(_CHUNK)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                chunk = b""
            if not chunk:
                if buffer:
                    yield buffer.decode("utf-8", errors="replace")
                return
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                yield line.decode("utf-8", errors="replace") + "\n"


class StdoutText:
    """`await stdout.write(text)`: UTF-8 text to a byte stream, written whole (no buffering to flush).

    `on_broken` runs when the reader has gone away (broken pipe): `claimed_stdio` closes stdin
    with it, so the server sees EOF and ends, instead of reading requests it can never answer."""

    def __init__(self, stream: trio.lowlevel.FdStream, on_broken: Callable[[], None] | None = None) -> None:
        self._stream = stream
        self._on_broken = on_broken
        self._lock = trio.StrictFIFOLock()

    async def write(self, text: str) -> None:
        """Write `text` whole; safe from several tasks (lines never interleave).

        A reader that has gone away ends the writer as the SDK expects (closed stream)."""
        try:
            async with self._lock:
                await self._stream.send_all(text.encode("utf-8"))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            if self._on_broken is not None:
                self._on_broken()
            raise anyio.ClosedResourceError from None

    async def flush(self) -> None:
        """Nothing is buffered: every write went to the descriptor."""
        await trio.lowlevel.checkpoint()


@contextmanager
def claimed_stdio() -> Iterator[tuple[StdinLines, StdoutText]]:
    """The process's stdin and stdout as the SDK's stdio transport wants them; see the module docstring."""
    wire_in, wire_out = os.dup(0), os.dup(1)
    saved_in, saved_out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    stdin_stream = trio.lowlevel.FdStream(wire_in)
    stdout_stream = trio.lowlevel.FdStream(wire_out)
    try:
        yield StdinLines(stdin_stream), StdoutText(stdout_stream, on_broken=stdin_stream.close)
    finally:
        stdin_stream.close()
        stdout_stream.close()
        os.dup2(saved_in, 0)
        os.dup2(saved_out, 1)
        os.close(saved_in)
        os.close(saved_out)
