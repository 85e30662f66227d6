"""What relay connections that never say hello can make the server do (docs/SECURITY.md, "Relay
connections that never say hello"): at `relay_max_connections` the oldest connections without a
valid hello are evicted for a newcomer, an authenticated one never; a connection has
`relay_hello_timeout` to send its hello; the settings and their defaults; what an idle
connection holds (docs/SCALING.md, "Many sandboxes on one server"). (The flood with a lowered
descriptor limit is in tests/e2e/test_faults.py; a trickled hello against the deadline in
tests/protocol/test_peer.py.)"""

from __future__ import annotations

import gc
import tracemalloc
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import trio
import trio.testing

from harness import Deployment, RawRelay

from oubliette_server.doors.connection_limits import EVICTIONS_AT_ONCE, RelayLimits, descriptor_shares
from oubliette_server.program.config import ServerConfig, load_config_file

CAP = EVICTIONS_AT_ONCE + 4


def _config(deployment: Deployment, text: str) -> Path:
    path = deployment.root / "relay.toml"
    path.write_text("[server]\n" + text + "\n[instances.box1]\n")
    return path


async def test_the_oldest_connections_without_a_hello_are_evicted_first_and_an_authenticated_one_never(
    deployment: Deployment,
) -> None:
    """At a cap of 20: one sandbox that said hello, then 19 connections that said nothing. The 20th
    silent one evicts the 16 oldest silent ones (closed without a word); the 3 youngest, the
    newcomer and the authenticated sandbox are still served."""
    config = _config(deployment, f"relay_max_connections = {CAP}")
    async with deployment.http_server("--config", str(config)) as server:
        async with RawRelay.connect(deployment) as sandbox:
            assert "result" in await sandbox.hello("box1", deployment.token("box1"))
            streams = [await trio.open_unix_socket(str(deployment.socket)) for _ in range(CAP)]  # the last one: the newcomer
            try:
                silent = [RawRelay(stream) for stream in streams]
                for relay in silent[:EVICTIONS_AT_ONCE]:
                    assert await relay.closed() and not relay._buffer, "evicted without a word"
                for relay in silent[EVICTIONS_AT_ONCE:]:
                    assert "result" in await relay.hello("box1", deployment.token("box1"))
                # The authenticated sandbox is still served: an unknown method is answered, not closed.
                await sandbox.send({"jsonrpc": "2.0", "id": 7, "method": "no_such_method", "params": {}})
                answer = await sandbox.receive()
                assert answer is not None and answer["id"] == 7 and "error" in answer, answer
            finally:
                for stream in streams:
                    await stream.aclose()
        flood = await server.wait_stderr(f"connections without a valid hello evicted at the cap of {CAP}")
        assert f": {EVICTIONS_AT_ONCE} connections without a valid hello evicted" in flood[0], flood
        async with server.unix_rest() as rest:
            metrics = (await rest.get("/metrics")).text
        assert f"oubliette_relay_evictions_total {float(EVICTIONS_AT_ONCE)}" in metrics


async def test_when_every_connection_said_hello_a_newcomer_is_closed(deployment: Deployment) -> None:
    """At a cap of 2, two sandboxes that said hello: a third connection is closed at once, and
    both sandboxes are still served."""
    config = _config(deployment, "relay_max_connections = 2")
    async with deployment.http_server("--config", str(config)) as server:
        async with RawRelay.connect(deployment) as first, RawRelay.connect(deployment) as second:
            for relay in (first, second):
                assert "result" in await relay.hello("box1", deployment.token("box1"))
            async with RawRelay.connect(deployment) as third:
                assert await third.closed()
            for n, relay in enumerate((first, second)):
                await relay.send({"jsonrpc": "2.0", "id": n + 1, "method": "no_such_method", "params": {}})
                answer = await relay.receive()
                assert answer is not None and answer["id"] == n + 1, answer
        await server.wait_stderr("1 connections refused at the cap of 2")


async def test_a_silent_connection_is_refused_at_relay_hello_timeout(deployment: Deployment) -> None:
    config = _config(deployment, "relay_hello_timeout = 1")
    async with deployment.http_server("--config", str(config)):
        async with RawRelay.connect(deployment) as relay:
            began = trio.current_time()
            error = await relay.receive()
            took = trio.current_time() - began
    assert error is not None and error["error"]["message"] == "no hello within 1 s", error
    assert 0.9 <= took < 5, took


def test_the_relay_settings_and_their_defaults(tmp_path: Path) -> None:
    path = tmp_path / "server.toml"
    path.write_text("[server]\nrelay_max_connections = 50\nrelay_hello_timeout = 2.5\n")
    assert ServerConfig(**load_config_file(path)).relay_limits == RelayLimits(max_connections=50, hello_timeout=2.5)
    default = ServerConfig().relay_limits
    assert (default.max_connections, default.hello_timeout) == (None, 5.0)
    assert default.connection_cap == descriptor_shares().relay
    for bad in ({"relay_max_connections": 0}, {"relay_hello_timeout": 0}, {"relay_hello_timeout": -1.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServerConfig(**bad)


def _tasks_under(task: trio.lowlevel.Task) -> int:
    """`task` and every task below it."""
    return 1 + sum(_tasks_under(child) for nursery in task.child_nurseries for child in nursery.child_tasks)


async def test_an_idle_sandbox_connection_is_one_task_and_a_guests_delivery_one_more(deployment: Deployment) -> None:
    """Ten clients and ten guests, each of an instance of its own, their hellos answered and then
    idle: the server holds one task for each connection (parked in its read) and one more for each
    guest's delivery, nothing else (it held three and four before: a nursery's waiter, a task that
    waited for the hello, the writer). What one server's 19,000 sandboxes cost is mostly this."""
    async with deployment.embedded(), AsyncExitStack() as stack:
        root = trio.lowlevel.current_root_task()
        await trio.testing.wait_all_tasks_blocked()
        before = _tasks_under(root)
        for n in range(20):
            relay = await stack.enter_async_context(RawRelay.connect(deployment))
            role, instance = ("guest" if n % 2 else "client"), f"idle{n}"
            assert "result" in await relay.hello(instance, deployment.token(instance), role=role)
        await trio.testing.wait_all_tasks_blocked()
        assert _tasks_under(root) - before == 10 + 10 * 2


async def test_an_idle_sandbox_connection_costs_the_server_at_most_16_kb(deployment: Deployment) -> None:
    """100 connections (half guests, half clients, each of an instance of its own) said hello and
    sit idle: what the server's code (relay, peer, store, and the trio objects it made for them)
    allocated for them is at most 16 KB each (it was 25.8 KB; docs/SCALING.md, "Many sandboxes on
    one server"). The test's own ends of the sockets are not counted: only allocations with a frame
    of oubliette_server or protocol in their traceback."""
    count = 100
    ours = [tracemalloc.Filter(True, f"*/{package}/*", all_frames=True) for package in ("oubliette_server", "protocol")]
    tokens = {f"idle{n}": deployment.token(f"idle{n}") for n in range(count)}
    async with deployment.embedded(), AsyncExitStack() as stack:
        tracemalloc.start(16)
        try:
            gc.collect()
            before = tracemalloc.take_snapshot().filter_traces(ours)
            for n, (instance, token) in enumerate(tokens.items()):
                relay = await stack.enter_async_context(RawRelay.connect(deployment))
                assert "result" in await relay.hello(instance, token, role="guest" if n % 2 else "client")
            await trio.testing.wait_all_tasks_blocked()
            gc.collect()
            after = tracemalloc.take_snapshot().filter_traces(ours)
        finally:
            tracemalloc.stop()
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    assert grown / count <= 16_000, f"{grown / count:.0f} bytes per idle connection"
