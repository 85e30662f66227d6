"""A plain round-robin TCP proxy: each new connection goes to the next backend, no affinity.

    python bench/round_robin_proxy.py [--listen HOST:PORT] BACKEND_HOST:PORT [BACKEND_HOST:PORT ...]

What a load balancer with no stickiness of any kind does (docs/SCALING.md, "No stickiness"):
it knows nothing of HTTP, MCP sessions, `owner_key`s or instances; it hands each accepted TCP
connection to the backend after the one the previous connection went to, and copies bytes
both ways until either side closes. A backend that refuses the connection (a killed server)
is skipped for that connection, as any load balancer's connect retry does: the next one in
the rotation takes it, and the rotation goes on after the one that did.

It lives in bench/ so that bench/bench_cluster.py and tests/e2e/test_round_robin_cluster.py both
import it (pytest's `pythonpath` has bench/); it needs only Trio. `RoundRobinProxy.order` is its
own record of where each connection went, which is what a test asserts on.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

import trio

CONNECT_TIMEOUT = 5.0
"""Seconds to wait for a backend to accept, before trying the next one."""
IDLE_TIMEOUT = 300.0
"""Seconds a connection may pass no byte either way before the proxy closes it (longer than any
long poll or SSE keep-alive of the servers behind it)."""
CHUNK = 65536


class RoundRobinProxy:
    """Listens on one TCP port; connection k goes to backend `k mod N` (skipping refusing ones)."""

    def __init__(self, backends: Sequence[tuple[str, int]], *, host: str = "127.0.0.1", port: int = 0) -> None:
        if not backends:
            raise ValueError("a round-robin proxy needs at least one backend")
        self.backends = list(backends)
        self.host = host
        self.port = port
        self.order: list[int] = []
        """The backend index each connection went to, in the order they were accepted."""
        self.refused: list[int] = [0] * len(self.backends)
        """Connections each backend refused (or did not accept in `CONNECT_TIMEOUT`)."""
        self.open: dict[int, int] = {}
        """Connections being copied now: connection number -> backend index."""
        self._next = 0
        self._accepted = 0

    @property
    def counts(self) -> list[int]:
        """How many connections each backend got."""
        return [self.order.count(i) for i in range(len(self.backends))]

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Accept connections until cancelled; `task_status.started(port)` once listening.

        Start it with `nursery.start`. Each connection is copied in its own task, closed
        (forcefully) when either side closes or breaks, or after `IDLE_TIMEOUT` of silence."""
        listeners = await trio.open_tcp_listeners(self.port, host=self.host)
        port = listeners[0].socket.getsockname()[1]
        task_status.started(port)
        await trio.serve_listeners(self._handle, listeners)

    async def _connect(self, number: int) -> trio.SocketStream | None:
        """The next backend in the rotation that accepts; None when none does."""
        for _ in range(len(self.backends)):
            index = self._next
            self._next = (self._next + 1) % len(self.backends)
            host, port = self.backends[index]
            try:
                with trio.fail_after(CONNECT_TIMEOUT):
                    stream = await trio.open_tcp_stream(host, port)
            except (OSError, trio.TooSlowError):
                self.refused[index] += 1
                continue
            self.order.append(index)
            self.open[number] = index
            return stream
        return None

    async def _handle(self, client: trio.SocketStream) -> None:
        number = self._accepted
        self._accepted += 1
        backend = await self._connect(number)
        if backend is None:  # every backend refused: the caller sees its connection closed
            await trio.aclose_forcefully(client)
            return
        idle = trio.CancelScope(deadline=trio.current_time() + IDLE_TIMEOUT)

        async def pipe(source: trio.SocketStream, sink: trio.SocketStream, both: trio.CancelScope) -> None:
            try:
                while chunk := await source.receive_some(CHUNK):
                    idle.deadline = trio.current_time() + IDLE_TIMEOUT
                    await sink.send_all(chunk)  # bounded by `idle`: a sink that stops reading stalls it
                await sink.send_eof()  # a half-close is passed on
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                both.cancel()  # one side broke (a killed server): end both

        try:
            with idle:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(pipe, client, backend, nursery.cancel_scope)
                    nursery.start_soon(pipe, backend, client, nursery.cancel_scope)
        finally:
            self.open.pop(number, None)
            with trio.CancelScope(shield=True):  # closing a socket does not wait
                await client.aclose()
                await backend.aclose()


def parse_address(text: str) -> tuple[str, int]:
    """`HOST:PORT` -> (host, port)."""
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


def main(argv: list[str] | None = None) -> int:
    """Run the proxy in the foreground until Ctrl-C; prints the port it listens on."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to listen on (default 127.0.0.1:0)")
    parser.add_argument("backends", nargs="+", help="HOST:PORT of each backend, in rotation order")
    args = parser.parse_args(argv)
    host, port = parse_address(args.listen)
    proxy = RoundRobinProxy([parse_address(b) for b in args.backends], host=host, port=port)

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            listening = await nursery.start(proxy.serve)
            print(f"round-robin proxy on {host}:{listening} -> {', '.join(args.backends)}", flush=True)

    try:
        trio.run(run)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
