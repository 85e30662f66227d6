"""The round-robin TCP proxy alone (bench/round_robin_proxy.py), in front of in-process backends.

What tests/e2e/test_round_robin_cluster.py relies on: each new connection goes to the next backend
and nothing else decides where (no affinity); a refusing backend is skipped for that connection
and the rotation goes on; bytes and a half-close pass both ways; a backend that breaks closes
the caller's connection at once, as a killed server does.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator, Awaitable, Callable

import trio

from round_robin_proxy import RoundRobinProxy

Handler = Callable[[bytes, trio.SocketStream], Awaitable[None]]


async def tagged_echo(tag: bytes, stream: trio.SocketStream) -> None:
    """Answer the bytes received up to EOF with `tag` + those bytes, then close."""
    data = b""
    while chunk := await stream.receive_some(1024):
        data += chunk
    await stream.send_all(tag + data)
    await stream.aclose()


@asynccontextmanager
async def proxy_in_front(tags: list[bytes], handler: Handler = tagged_echo,
                         dead: int | None = None) -> AsyncIterator[tuple[RoundRobinProxy, int]]:
    """Backends answering with their tag (backend `dead` a port nothing listens on), the proxy
    in front of them: (the proxy, its port)."""
    async with trio.open_nursery() as nursery:
        backends = []
        for i, tag in enumerate(tags):
            if i == dead:
                with trio.socket.socket() as unused:
                    await unused.bind(("127.0.0.1", 0))
                    backends.append(("127.0.0.1", unused.getsockname()[1]))  # closed again: refuses
                continue
            listeners = await nursery.start(trio.serve_tcp, lambda s, tag=tag: handler(tag, s), 0)
            backends.append(("127.0.0.1", listeners[0].socket.getsockname()[1]))
        proxy = RoundRobinProxy(backends)
        port = await nursery.start(proxy.serve)
        yield proxy, port
        nursery.cancel_scope.cancel()


async def exchange(port: int, data: bytes) -> bytes:
    """One connection: send `data`, half-close, read everything back."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(data)
        await stream.send_eof()
        answer = b""
        with trio.fail_after(10):
            while chunk := await stream.receive_some(1024):
                answer += chunk
    return answer


async def test_each_connection_goes_to_the_next_backend() -> None:
    async with proxy_in_front([b"A", b"B", b"C"]) as (proxy, port):
        answers = [await exchange(port, b"x%d" % i) for i in range(7)]
    assert answers == [b"Ax0", b"Bx1", b"Cx2", b"Ax3", b"Bx4", b"Cx5", b"Ax6"]
    assert proxy.order == [0, 1, 2, 0, 1, 2, 0] and proxy.counts == [3, 2, 2] and proxy.open == {}


async def test_a_refusing_backend_is_skipped_and_the_rotation_goes_on() -> None:
    async with proxy_in_front([b"A", b"B", b"C"], dead=1) as (proxy, port):
        answers = [await exchange(port, b"x") for _ in range(4)]
    assert answers == [b"Ax", b"Cx", b"Ax", b"Cx"]
    assert proxy.order == [0, 2, 0, 2] and proxy.refused == [0, 2, 0]


async def test_a_backend_that_breaks_closes_the_callers_connection() -> None:
    """A backend gone mid-connection (a server killed) ends the caller's connection at once (its
    EOF passed on), and the proxy lets go of both sides when the caller closes."""
    accepted = trio.Event()
    backend_streams: list[trio.SocketStream] = []

    async def hold(tag: bytes, stream: trio.SocketStream) -> None:
        backend_streams.append(stream)
        accepted.set()
        await trio.sleep_forever()

    async with proxy_in_front([b"A"], handler=hold) as (proxy, port):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            with trio.fail_after(10):
                await accepted.wait()
                await trio.aclose_forcefully(backend_streams[0])
                assert await stream.receive_some(1024) == b""
        with trio.fail_after(10):
            while proxy.open:  # bench/round_robin_proxy.py has no event for this: checked every 10 ms, bounded
                await trio.sleep(0.01)
