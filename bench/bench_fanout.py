"""How long one caller tool declaration blocks the server's event loop, fanned out to many clients.

    python bench/bench_fanout.py [--connections N] [--kib K] [--rounds R]

An ``OublietteServer`` runs in this process with N (default 100) raw client connections of
instance ``box1`` bound to one session, each drained by a reader task. A declaration of one
caller tool whose description makes the ``caller_tools_config`` about K KiB (default 949) is
fanned out to all of them, R times (default 3) each way, alternating:

- **per connection** (the baseline, how the server did it before): the declaration's params
  handed to each connection's ``notify``, which encodes them again for each one;
- **encoded once** (now): ``CallerToolRelay.declare`` itself, which encodes once
  (``encode_notification``) and queues the same bytes on each connection (``notify_encoded``).

The figure is the loop's block: the longest gap between two wake-ups of a task that sleeps
1 ms in a loop while the fan-out runs (the fan-out has no checkpoint, so it is the fan-out's
own time, and nothing else on the server runs meanwhile). Between rounds every reader reads
the whole configuration, so no round pays for the previous one's writes. Under a minute.
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from oubliette_server.program.app import OublietteServer  # noqa: E402
from oubliette_server.program.config import ServerConfig  # noqa: E402
from protocol import PROTOCOL_VERSION, CallerToolSpec, messages, unstructure  # noqa: E402

INSTANCE = "box1"
SESSION = "s1"


class Readers:
    """The raw client connections, each read to the end of every line the server sends."""

    def __init__(self) -> None:
        self.lines = 0
        self.changed = trio.Event()

    async def read(self, stream: trio.SocketStream) -> None:
        buffer = b""
        while chunk := await stream.receive_some(1 << 20):
            buffer += chunk
            *whole, buffer = buffer.split(b"\n")
            self.lines += len(whole)
            if whole:
                self.changed.set()
                self.changed = trio.Event()

    async def wait_for(self, lines: int) -> None:
        with trio.fail_after(120):
            while self.lines < lines:
                await self.changed.wait()


async def connect(socket_path: str, token: str) -> trio.SocketStream:
    """A client connection bound to the session, after its hello answer."""
    stream = await trio.open_unix_socket(socket_path)
    hello = {"protocol": PROTOCOL_VERSION, "role": "client", "instance": INSTANCE, "token": token,
             "session": f"mcp:{SESSION}"}
    await stream.send_all(json.dumps({"jsonrpc": "2.0", "id": 0, "method": "hello", "params": hello}).encode() + b"\n")
    buffer = b""
    while not any(json.loads(x).get("id") == 0 for x in buffer.split(b"\n")[:-1]):
        chunk = await stream.receive_some(1 << 16)
        if not chunk:
            raise SystemExit(f"the server refused the connection: {buffer!r}")
        buffer += chunk
    return stream


async def longest_gap(work: Any) -> float:
    """The longest the loop went without waking a 1 ms ticker while `work()` ran."""
    gaps: list[float] = []
    done = False

    async def tick() -> None:
        last = time.perf_counter()
        while not done:
            await trio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    async with trio.open_nursery() as nursery:
        nursery.start_soon(tick)
        await trio.sleep(0.01)
        await work()
        await trio.sleep(0.01)
        done = True
    return max(gaps)


async def main(connections: int, kib: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory(prefix="oubliette-fanout-") as tmp:
        socket_path = f"{tmp}/relay.sock"
        server = OublietteServer(ServerConfig(
            data_dir=Path(tmp) / "data", relay=f"unix:{socket_path}", max_client_connections=max(64, connections)))
        readers = Readers()
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            token = server.tokens.token_for(INSTANCE)
            for _ in range(connections):
                nursery.start_soon(readers.read, await connect(socket_path, token))
            relay = server.caller_tools
            session = server.sessions.get_or_create(INSTANCE, "mcp", SESSION)
            caller = server.open_caller("bench")
            session.owner = caller  # what session_message does for the first caller of a session
            tool = CallerToolSpec(name="big", description="d" * (kib * 1024 - 200), inputSchema={"type": "object"})
            config = unstructure(messages.CallerToolsConfig(session_id=SESSION, caller_id="bench", tools=[tool]))
            size = len(json.dumps({"jsonrpc": "2.0", "method": messages.CALLER_TOOLS_CONFIG, "params": config}))
            conns = server.clients.of_instance(INSTANCE)
            assert len(conns) == connections

            async def per_connection() -> None:
                for connection in conns:
                    connection.notify(messages.CALLER_TOOLS_CONFIG, config)

            async def encoded_once() -> None:
                await relay.declare(session, caller, "bench", [tool])

            results: dict[str, list[float]] = {"per connection": [], "encoded once": []}
            expected = readers.lines
            for _ in range(rounds):
                for name, work in (("per connection", per_connection), ("encoded once", encoded_once)):
                    results[name].append(await longest_gap(work))
                    expected += connections
                    await readers.wait_for(expected)
            nursery.cancel_scope.cancel()

    print(f"fan-out of one {size / 1024:.0f} KiB caller_tools_config to {connections} client connections, {rounds} rounds each")
    for name, gaps in results.items():
        print(f"  {name:15} loop blocked: median {statistics.median(gaps) * 1000:8.1f} ms  "
              f"max {max(gaps) * 1000:8.1f} ms  ({', '.join(f'{g * 1000:.1f}' for g in gaps)})")
    before, after = (statistics.median(results[k]) for k in ("per connection", "encoded once"))
    print(f"  ratio per connection / encoded once: {before / after if after else math.inf:.1f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=100)
    parser.add_argument("--kib", type=int, default=949)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    trio.run(main, args.connections, args.kib, args.rounds)
