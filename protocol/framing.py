"""Newline-delimited JSON framing, with no I/O: bytes in, lines out; messages in, bytes out.

One JSON object per line keeps the wire format trivial to debug (``socat`` + eyes) and
lets either peer resynchronise on ``\\n``. A hard per-line limit stops a broken or hostile
peer from making us buffer without bound. :class:`LineBuffer` does the splitting for the
sans-IO core (``protocol.core``); whoever owns the stream feeds it.

Owns: nothing but bytes. Needs: nothing (no trio, no clock). For whoever owns a stream:
:func:`read_lines` (a line-based pipe's lines) and :func:`write_at_once` (what a free
non-blocking descriptor takes now: the relay peer's and the stdio writer's write without a task).
Raises: :class:`FrameTooLarge` (a ``RelayError``) and ``RelayError`` from :func:`decode`.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from typing import Any, Protocol

from .errors import INVALID_REQUEST, PARSE_ERROR, RelayError

__all__ = [
    "MAX_FRAME_BYTES",
    "RECEIVE_CHUNK_BYTES",
    "encode",
    "decode",
    "FrameTooLarge",
    "LineBuffer",
    "END_OF_STREAM",
    "read_lines",
]

#: Largest line (excluding the ``\n``) either side accepts.
MAX_FRAME_BYTES = 1024 * 1024
#: How much one ``receive_some`` asks for; big enough to amortise syscalls.
RECEIVE_CHUNK_BYTES = 64 * 1024


#: The wire's compact JSON text of a value, NaN and infinities refused (``ValueError``): they are
#: not JSON, and a peer in another language could not parse them. One encoder for every call
#: (``json.dumps`` with options builds a new one each time).
compact_json = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode


def encode(message: dict[str, Any]) -> bytes:
    """Serialise one message as a compact UTF-8 JSON line ending in ``\\n`` (:data:`compact_json`)."""
    return compact_json(message).encode("utf-8") + b"\n"


def write_at_once(fd: int, data: bytes | bytearray | memoryview) -> int:
    """How much of `data` a non-blocking descriptor takes now, written (0 when it is full or
    broken: the caller's ordinary write, under its deadline, then waits or fails as usual). A
    write that takes it whole needs no task, no lock round trip and no deadline: it cannot block."""
    try:
        return os.write(fd, data)
    except OSError:
        return 0


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def decode(line: bytes | bytearray) -> dict[str, Any]:
    """Parse one line (with or without its ``\\n``) into a JSON object.

    Raises :class:`RelayError` with ``PARSE_ERROR`` for bytes that are not UTF-8 JSON and
    ``INVALID_REQUEST`` for JSON that is not an object, so the caller can answer the peer
    with exactly that error.
    """
    try:
        text = bytes(line).decode("utf-8")
        obj = json.loads(text, parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise RelayError(PARSE_ERROR, f"frame is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise RelayError(INVALID_REQUEST, "frame is not a JSON object")
    return obj


class FrameTooLarge(RelayError):
    """A line longer than the frame limit: a protocol error that ends the connection."""

    limit: int

    def __init__(self, limit: int = MAX_FRAME_BYTES) -> None:
        super().__init__(
            INVALID_REQUEST,
            f"frame exceeds the limit of {limit} bytes",
            {"limit": limit},
        )
        self.args = (limit,)  # so pickle/copy call __init__(limit)
        self.limit = limit


class LineBuffer:
    """Split bytes fed in any chunking into lines, never holding more than about one frame.

    Feed it with :meth:`feed` (``b""`` means end of stream) and take lines with
    :meth:`next_line` until it returns ``None`` (needs more data). After the end of stream
    it returns :data:`END_OF_STREAM` once everything is consumed; a final line without ``\\n`` still
    counts as a line. A line over the limit raises :class:`FrameTooLarge` as soon as that
    is known (before its ``\\n`` arrives), and again on every later call: the stream has
    lost its framing. The buffer then holds nothing, so a hostile peer costs at most the
    limit plus one chunk.
    """

    def __init__(self, max_bytes: int = MAX_FRAME_BYTES) -> None:
        if max_bytes < 1:
            raise ValueError("max_bytes must be positive")
        self._max_bytes = max_bytes
        self._buf = bytearray()
        self._scanned = 0  # bytes of _buf already searched for b"\n"
        self._eof = False
        self._failed: FrameTooLarge | None = None

    @property
    def max_bytes(self) -> int:
        """The per-line limit this buffer enforces (excluding the ``\\n``)."""
        return self._max_bytes

    def feed(self, data: bytes | bytearray) -> None:
        """Add received bytes; ``b""`` marks the end of the stream."""
        if not data:
            self._eof = True
        elif self._failed is None:
            if self._eof:
                raise ValueError("data fed after the end of the stream")
            self._buf += data

    def next_line(self) -> bytes | None | _EndOfStream:
        """The next line without its ``\\n``; ``None`` when more data is needed; :data:`END_OF_STREAM` at the end."""
        if self._failed is not None:
            raise self._failed
        buf = self._buf
        idx = buf.find(b"\n", self._scanned)
        if idx >= 0:
            if idx > self._max_bytes:
                raise self._fail()
            line = bytes(buf[:idx])
            del buf[: idx + 1]  # CPython bytearray trims the front in O(1)
            self._scanned = 0
            return line
        self._scanned = len(buf)
        if len(buf) > self._max_bytes:
            raise self._fail()
        if not self._eof:
            return None
        if not buf:
            return END_OF_STREAM
        line = bytes(buf)
        buf.clear()
        self._scanned = 0
        return line

    def _fail(self) -> FrameTooLarge:
        self._failed = FrameTooLarge(self._max_bytes)
        self._buf = bytearray()  # drop the oversized data now
        self._scanned = 0
        return self._failed


class _EndOfStream:
    """The type of :data:`END_OF_STREAM`."""

    def __repr__(self) -> str:
        return "END_OF_STREAM"


#: What :meth:`LineBuffer.next_line` returns once the stream ended and every line was taken.
END_OF_STREAM = _EndOfStream()


class _ReceiveStream(Protocol):
    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray: ...


async def read_lines(stream: _ReceiveStream, max_bytes: int = MAX_FRAME_BYTES) -> AsyncIterator[bytes]:
    """Each line of a byte stream (e.g. a trio ``ReceiveStream``) until it ends.

    Reads only when a :class:`LineBuffer` needs more, so it never holds more than the limit
    plus one read; raises :class:`FrameTooLarge` like the buffer. For line-based pipes that
    are not relay connections (the relay peer feeds its core instead).
    """
    lines = LineBuffer(max_bytes)
    while True:
        line = lines.next_line()
        if line is None:
            lines.feed(bytes(await stream.receive_some(RECEIVE_CHUNK_BYTES)))
        elif line is END_OF_STREAM:
            return
        else:
            yield line  # type: ignore[misc]
