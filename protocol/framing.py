"""Newline-delimited JSON framing over any Trio byte stream.

One JSON object per line keeps the wire format trivial to debug (``socat`` + eyes) and
lets either peer resynchronise on ``\\n``. A hard per-line limit stops a broken or hostile
peer from making us buffer without bound.
"""

from __future__ import annotations

import json
from typing import Any

import trio

from .errors import INVALID_REQUEST, PARSE_ERROR, RelayError

__all__ = [
    "MAX_FRAME_BYTES",
    "RECEIVE_CHUNK_BYTES",
    "encode",
    "decode",
    "FrameTooLarge",
    "LineReader",
    "FrameWriter",
]

#: Largest line (excluding the ``\n``) either side accepts.
MAX_FRAME_BYTES = 1024 * 1024
#: How much one ``receive_some`` asks for; big enough to amortise syscalls.
RECEIVE_CHUNK_BYTES = 64 * 1024


def encode(message: dict[str, Any]) -> bytes:
    """Serialise one message as a compact UTF-8 JSON line ending in ``\\n``.

    NaN and infinities are refused (``ValueError``) because they are not JSON and a peer
    in another language could not parse them.
    """
    text = json.dumps(message, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return text.encode("utf-8") + b"\n"


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


class LineReader:
    """Split a byte stream into lines, never holding more than about one frame.

    Not safe for concurrent readers: one task per connection reads.
    """

    def __init__(
        self, stream: trio.abc.ReceiveStream, max_bytes: int = MAX_FRAME_BYTES
    ) -> None:
        if max_bytes < 1:
            raise ValueError("max_bytes must be positive")
        self._stream = stream
        self._max_bytes = max_bytes
        self._buf = bytearray()
        self._scanned = 0  # bytes of _buf already searched for b"\n"
        self._eof = False
        self._failed: FrameTooLarge | None = None

    @property
    def max_bytes(self) -> int:
        """The per-line limit this reader enforces."""
        return self._max_bytes

    async def read_line(self) -> bytes | None:
        """The next line without its ``\\n``; ``None`` at a clean end of stream.

        A final line without ``\\n`` is still returned. Raises :class:`FrameTooLarge` as
        soon as the line being read is known to exceed the limit (and again on any
        later call: the stream has lost its framing).
        """
        if self._failed is not None:
            raise self._failed
        buf = self._buf
        while True:
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
            if self._eof:
                if not buf:
                    return None
                line = bytes(buf)
                buf.clear()
                self._scanned = 0
                return line
            chunk = await self._stream.receive_some(RECEIVE_CHUNK_BYTES)
            if not chunk:
                self._eof = True
            else:
                buf += chunk

    def _fail(self) -> FrameTooLarge:
        self._failed = FrameTooLarge(self._max_bytes)
        self._buf = bytearray()  # drop the oversized data now
        self._scanned = 0
        return self._failed


class FrameWriter:
    """Send whole frames; a lock keeps frames from concurrent tasks from interleaving.

    If a send is interrupted part-way (cancelled, or the stream broke), the frame boundary
    may be lost, so every later :meth:`send` raises ``trio.BrokenResourceError``: close the
    connection.
    """

    def __init__(
        self, stream: trio.abc.SendStream, max_bytes: int = MAX_FRAME_BYTES
    ) -> None:
        self._stream = stream
        self._max_bytes = max_bytes
        self._lock = trio.Lock()
        self._broken = False

    @property
    def stream(self) -> trio.abc.SendStream:
        """The underlying stream."""
        return self._stream

    async def send(self, message: dict[str, Any]) -> None:
        """Encode and send one message.

        Raises :class:`FrameTooLarge` (before sending anything) when the encoded line
        exceeds the limit the peer will enforce, so the caller can send an error instead.
        """
        data = encode(message)
        if len(data) - 1 > self._max_bytes:
            raise FrameTooLarge(self._max_bytes)
        async with self._lock:
            if self._broken:
                raise trio.BrokenResourceError("an earlier send was interrupted mid-frame")
            # A pending cancellation fires here, before any byte is written, so it does
            # not cost the connection its framing.
            await trio.lowlevel.checkpoint_if_cancelled()
            try:
                await self._stream.send_all(data)
            except BaseException:
                self._broken = True
                raise

    async def aclose(self) -> None:
        """Close the underlying stream (a send in progress fails with ``ClosedResourceError``)."""
        await self._stream.aclose()
