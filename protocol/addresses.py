"""Relay addresses: `unix:PATH` (default) or `tcp:HOST:PORT`."""

from __future__ import annotations

import attrs
import trio

__all__ = ["RelayAddress", "connect_relay", "parse_relay_address"]


@attrs.define(frozen=True)
class RelayAddress:
    """Where the relay listens: a Unix socket `path` (`kind` "unix") or `host`:`port` (`kind` "tcp").

    Immutable; `str()` gives back the `unix:PATH` / `tcp:HOST:PORT` text `parse_relay_address` reads.
    """

    kind: str  # "unix" | "tcp"
    path: str = ""
    host: str = ""
    port: int = 0

    def __str__(self) -> str:
        return f"unix:{self.path}" if self.kind == "unix" else f"tcp:{self.host}:{self.port}"


def parse_relay_address(text: str) -> RelayAddress:
    """Parse `unix:PATH` or `tcp:HOST:PORT`; anything else raises `ValueError` (a usage error).

    No bare path: `http://0.0.0.0:7000` has a slash, and was once taken for a Unix socket named
    `http:/…`, so a mistyped address made a directory instead of an error.
    """
    if text.startswith("unix:"):
        path = text[len("unix:"):]
        if not path:
            raise ValueError(f"relay address {text!r} has no socket path")
        return RelayAddress("unix", path=path)
    if text.startswith("tcp:"):
        host, sep, port = text[len("tcp:"):].rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"relay address {text!r} must look like tcp:HOST:PORT")
        return RelayAddress("tcp", host=host.strip("[]"), port=int(port))
    raise ValueError(f"relay address {text!r} must start with unix: or tcp:")


async def connect_relay(address: RelayAddress) -> trio.abc.Stream:
    """Open a stream to the relay at `address`."""

    if address.kind == "unix":
        return await trio.open_unix_socket(address.path)
    return await trio.open_tcp_stream(address.host, address.port)
