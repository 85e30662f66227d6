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

One line on stdin is at most `max_line_bytes` (default :data:`DEFAULT_MAX_STDIN_LINE_BYTES`,
16 MiB, not counting its newline). A longer line is never held whole: it is read and dropped
in chunks up to its newline, the sender gets one JSON-RPC error response on stdout (code
-32600, Invalid Request, the message naming the limit in bytes, `data: {"limit":
"max_stdin_line_bytes", "max": n}`, and the request's `id` when it can be read safely from the
line's first bytes, else `null`), and the next line is served as usual. A stream that ends in
the middle of such a line ends as EOF does. Splitting scans only each new chunk for the newline,
so reading is linear in the bytes received, however long a line is.

Owns: the two duplicated descriptors (closed on exit; fd 0 and 1 are restored).
Needs: a running Trio loop for the streams (anyio on the Trio backend is the same loop).
Cancellation: a read or write in progress is cancelled like any Trio stream operation.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager

import anyio
import trio

from protocol.errors import INVALID_REQUEST
from protocol.framing import write_at_once

__all__ = [
    "DEFAULT_MAX_STDIN_LINE_BYTES", "StdinLines", "StdoutText", "claimed_stdio", "oversized_line_error", "request_id_of",
]

log = logging.getLogger("oubliette.stdio")

_CHUNK = 64 * 1024

#: The longest line (one JSON-RPC message, without its newline) read from stdin.
#: Why 16 MiB: the largest value either program accepts is `protocol.limits.MAX_PAYLOAD_BYTES_CEILING`
#: (just under 1 MiB, measured as compact JSON with `ensure_ascii=False`), and the message that
#: carries it must still arrive whole, so an over-limit value gets the precise `max_payload_bytes`
#: refusal and a value at the limit passes. A caller's SDK may write the same value 3 times larger
#: (`ensure_ascii` writes a 2-byte letter as a 6-byte `\uXXXX`), wrap it again in a JSON string
#: (twice again at most: every quote and backslash escaped once more) and indent it, inside the
#: JSON-RPC and MCP envelopes: 16 times the payload ceiling leaves room for all of that, and still
#: bounds what one line may cost the process. `tests/runtime/test_stdio_streams.py` keeps it at least 16 times the ceiling.
DEFAULT_MAX_STDIN_LINE_BYTES = 16 * 1024 * 1024

#: How much of an oversized line is kept to look for its request id (the rest is dropped unread).
_ID_SCAN_BYTES = 4096
_SPECIAL = re.compile(rb'["{}\[\]]')
_STRING = re.compile(rb'"(?:[^"\\\x00-\x1f]|\\.)*"')
#: After a top-level `"id"` key: `:` and a JSON integer (at most 19 digits) or a string (at most
#: 128 bytes), then `,` or `}` so the value is known to be complete.
_ID_KEY = re.compile(rb"\s*:")
_ID_VALUE = re.compile(rb'\s*:\s*(-?(?:0|[1-9][0-9]{0,18})|"(?:[^"\\\x00-\x1f]|\\.){0,128}")\s*[,}]')


def request_id_of(head: bytes) -> str | int | None:
    """The `id` of the JSON-RPC message whose first bytes are `head`, or None if it is not plainly there.

    For answering a line too long to parse: only an `"id"` key of the top-level object counts
    (an `"id"` inside `params` would name someone else's request), with a bounded integer or
    string value that ends within `head`. Cost is linear in `len(head)` (a few KiB)."""
    i = len(head) - len(head.lstrip())
    if head[i : i + 1] != b"{":
        return None
    depth = 0
    while (special := _SPECIAL.search(head, i)) is not None:
        i = special.start()
        char = head[i]
        if char == 0x22:  # '"'
            string = _STRING.match(head, i)
            if string is None:  # runs past `head` (or is not JSON)
                return None
            i = string.end()
            if depth == 1 and string.group() == b'"id"':
                value = _ID_VALUE.match(head, i)
                if value is not None:  # a value "id" is followed by `,` or `}`, never `:`
                    try:
                        found = json.loads(value.group(1))
                    except ValueError:  # e.g. invalid UTF-8 or a bad escape in the string
                        return None
                    return found if isinstance(found, (str, int)) else None
                if _ID_KEY.match(head, i) is not None:  # the id is null, a float or too long
                    return None
            continue
        depth += 1 if char in b"{[" else -1
        if depth == 0:
            return None
        i += 1
    return None


def _first_bytes(parts: list[bytes], limit: int) -> bytes:
    """The first `limit` bytes of `parts` joined (without joining them all)."""
    head = bytearray()
    for part in parts:
        head += part[: limit - len(head)]
        if len(head) >= limit:
            break
    return bytes(head)


def oversized_line_error(request_id: str | int | None, max_line_bytes: int) -> str:
    """The JSON-RPC error response line that answers a stdin line over `max_line_bytes`."""
    return json.dumps({
        "jsonrpc": "2.0",
        "id": request_id,
        "error": {
            "code": INVALID_REQUEST,
            "message": (
                f"a line on stdin is longer than {max_line_bytes} bytes, the limit of one message "
                f"(max_stdin_line_bytes); it was discarded"
            ),
            "data": {"limit": "max_stdin_line_bytes", "max": max_line_bytes},
        },
    }) + "\n"


class StdinLines:
    """`async for line in stdin`: UTF-8 text lines (with their `\\n`) from a byte stream.

    A line longer than `max_line_bytes` (not counting its newline) is dropped in chunks as it
    arrives, and `reply` (the `StdoutText.write` of the same server) gets the error response
    for it; see the module docstring. Invalid UTF-8 is replaced (U+FFFD), as before."""

    def __init__(
        self,
        stream: trio.lowlevel.FdStream,
        *,
        max_line_bytes: int = DEFAULT_MAX_STDIN_LINE_BYTES,
        reply: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        if max_line_bytes < 1:
            raise ValueError(f"max_line_bytes must be at least 1, got {max_line_bytes!r}")
        self._stream = stream
        self.max_line_bytes = max_line_bytes
        self._reply = reply
        self.refused = 0
        """Oversized lines dropped so far."""

    def __aiter__(self) -> AsyncIterator[str]:
        return self._lines()

    async def _receive(self) -> bytes:
        """The next bytes of stdin (``b""`` at its end): waited for, then read in the same step, one
        scheduler round trip where the stream's ``receive_some`` takes two (its checkpoint, then
        its wait) when the caller has sent nothing yet, as between the lines of a relayed call."""
        if self._stream.fileno() >= 0:  # not closed (`on_broken`): else the stream's read raises that
            try:
                await trio.lowlevel.wait_readable(self._stream.fileno())
            except OSError:  # not a pipe epoll can wait on (a file, /dev/null): the stream's read, which never waits
                return await self._stream.receive_some(_CHUNK)
            try:
                return os.read(self._stream.fileno(), _CHUNK)
            except OSError:
                pass  # nothing after all, broken or closed meanwhile: the stream's own read says which
        return await self._stream.receive_some(_CHUNK)

    async def _lines(self) -> AsyncIterator[str]:
        parts: list[bytes] = []  # the current line so far, while it is within the limit
        size = 0  # its bytes so far (also while it is being dropped)
        head = b""  # the first bytes of a line over the limit, to find its id
        while True:
            try:
                chunk = await self._receive()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                chunk = b""
            if not chunk:
                if parts:
                    yield b"".join(parts).decode("utf-8", errors="replace")
                return  # an oversized line cut short by EOF is dropped without an answer
            start = 0
            while start < len(chunk):
                newline = chunk.find(b"\n", start)  # only the new bytes are scanned
                end = len(chunk) if newline < 0 else newline
                within = size <= self.max_line_bytes
                size += end - start
                if size <= self.max_line_bytes:
                    parts.append(chunk if start == 0 and end == len(chunk) else chunk[start:end])
                else:
                    if within:  # this piece takes the line over the limit: keep only its head
                        head = _first_bytes(parts, _ID_SCAN_BYTES)
                        parts = []
                    if len(head) < _ID_SCAN_BYTES:
                        head += chunk[start : min(end, start + _ID_SCAN_BYTES - len(head))]
                if newline < 0:
                    break
                if size <= self.max_line_bytes:
                    yield b"".join(parts).decode("utf-8", errors="replace") + "\n"
                else:
                    await self._refuse(head, size)
                parts, size, head = [], 0, b""
                start = newline + 1

    async def _refuse(self, head: bytes, size: int) -> None:
        """Answer a dropped oversized line (a broken stdout ends the reading through `on_broken`)."""
        self.refused += 1
        request_id = request_id_of(head)
        log.warning(
            "a %d-byte line on stdin (request id %r) is over the %d-byte limit; discarded",
            size, request_id, self.max_line_bytes,
        )
        if self._reply is None:
            return
        try:
            await self._reply(oversized_line_error(request_id, self.max_line_bytes))
        except anyio.ClosedResourceError:
            pass  # the reader has gone; stdin was closed with it, so the next read is EOF


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

        When no write is in progress the line goes to the pipe at once (`write_at_once`), the
        rest, if the pipe took only part of it, under the lock before anyone else's: no scheduler
        round trip for the lock or the stream's checkpoint, two of them per relayed call's line.
        A reader that has gone away ends the writer as the SDK expects (closed stream)."""
        data = text.encode("utf-8")
        try:
            if self._lock.locked():
                async with self._lock:
                    await self._stream.send_all(data)
                return
            await trio.lowlevel.checkpoint_if_cancelled()
            sent = write_at_once(self._stream.fileno(), data)
            if sent < len(data):
                self._lock.acquire_nowait()  # free: nobody ran since the line's first part
                try:
                    await self._stream.send_all(data[sent:])
                finally:
                    self._lock.release()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            if self._on_broken is not None:
                self._on_broken()
            raise anyio.ClosedResourceError from None

    async def flush(self) -> None:
        """Nothing is buffered: every write went to the descriptor."""
        await trio.lowlevel.checkpoint()


@contextmanager
def claimed_stdio(
    *, max_line_bytes: int = DEFAULT_MAX_STDIN_LINE_BYTES
) -> Iterator[tuple[StdinLines, StdoutText]]:
    """The process's stdin and stdout as the SDK's stdio transport wants them; see the module docstring.

    `max_line_bytes` bounds one stdin line; an oversized line is answered on this stdout."""
    wire_in, wire_out = os.dup(0), os.dup(1)
    saved_in, saved_out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    stdin_stream = trio.lowlevel.FdStream(wire_in)
    stdout_stream = trio.lowlevel.FdStream(wire_out)
    try:
        stdout = StdoutText(stdout_stream, on_broken=stdin_stream.close)
        yield StdinLines(stdin_stream, max_line_bytes=max_line_bytes, reply=stdout.write), stdout
    finally:
        stdin_stream.close()
        stdout_stream.close()
        os.dup2(saved_in, 0)
        os.dup2(saved_out, 1)
        os.close(saved_in)
        os.close(saved_out)
