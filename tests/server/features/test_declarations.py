"""Declaration fan-out: one caller tool declaration reaches every client connection of an
instance, encoded once; and an instance's client connections are bounded per server.

- The server encodes a `caller_tools_config` once per declaration, however many client
  connections see it, and each gets the same bytes (counted at the encoder, so the check does
  not depend on the machine's speed; bench/bench_fanout.py measures the time).
- A toolset change pushed to the connections of one session's router is encoded once too.
- The connection over `max_client_connections` is refused at `hello` with an error that names
  the limit; guest connections do not count, and a place freed by a closed connection is taken
  again. oubliette-client's link, refused so, backs off (no hot loop of hellos) and connects
  once a place is free.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any

import pytest
import trio

import protocol.core
from harness import EVENT_TIMEOUT, Deployment, RawRelay
from protocol import DENIED, messages
from peer_in_process import INSTANCE, in_process

CLIENTS = 20


async def raw_clients(
    stack: AsyncExitStack, deployment: Deployment, count: int, token: str, session: str | None = "mcp:s1",
) -> list[RawRelay]:
    """`count` raw client connections of box1, each past its hello (closed with `stack`)."""
    relays = []
    for _ in range(count):
        relay = await stack.enter_async_context(RawRelay.connect(deployment))
        assert "result" in await relay.hello(INSTANCE, token, session=session)
        relays.append(relay)
    return relays


def count_encodes(monkeypatch: pytest.MonkeyPatch, method: str) -> list[int]:
    """Count the lines the relay core encodes for `method` (its one encoder, `protocol.core.encode`)."""
    counted: list[int] = []
    real = protocol.core.encode

    def counting(message: dict[str, Any]) -> bytes:
        if message.get("method") == method:
            counted.append(1)
        return real(message)

    monkeypatch.setattr(protocol.core, "encode", counting)
    return counted


BIG_TOOL = {"name": "big", "description": "d" * 200_000, "inputSchema": {"type": "object"}}


async def test_a_declaration_is_encoded_once_for_every_client_connection(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with in_process(deployment) as proc, AsyncExitStack() as stack:
        relays = await raw_clients(stack, deployment, CLIENTS, proc.server.tokens.token_for(INSTANCE))
        assert len(proc.server.clients.of_instance(INSTANCE)) == CLIENTS
        encodes = count_encodes(monkeypatch, messages.CALLER_TOOLS_CONFIG)
        owner, _ = proc.open_caller()
        await proc.declare(owner, "s1", "myapp", [BIG_TOOL])
        assert len(encodes) == 1, f"encoded {len(encodes)} times for {CLIENTS} connections"
        received = [await relay.receive(EVENT_TIMEOUT) for relay in relays]
        assert received[0] is not None and received[0]["method"] == messages.CALLER_TOOLS_CONFIG
        assert received[0]["params"]["tools"][0]["description"] == BIG_TOOL["description"]
        assert all(config == received[0] for config in received)


async def test_a_toolset_change_is_encoded_once_for_a_sessions_connections(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from oubliette_server.features.toolsets import FunctionToolset, ToolSpec

    async with in_process(deployment) as proc:
        await proc.server.register_toolset(
            "ts", "ts", [ToolSpec(name="ping")], ref=FunctionToolset({"ping": lambda arguments: trio.sleep(0)}))
        async with AsyncExitStack() as stack:
            relays = await raw_clients(stack, deployment, CLIENTS, proc.server.tokens.token_for(INSTANCE))
            encodes = count_encodes(monkeypatch, messages.TOOLSETS_CONFIG)
            await proc.server.update_allowed_toolsets(INSTANCE, ["ts"])  # every agent of the session is told
            assert len(encodes) == 1, f"encoded {len(encodes)} times for {CLIENTS} connections of one session"
            for relay in relays:
                config = await relay.receive(EVENT_TIMEOUT)
                assert config is not None and config["method"] == messages.TOOLSETS_CONFIG and config["params"]["tools"]


async def test_the_client_connection_over_the_limit_is_refused_at_hello(deployment: Deployment) -> None:
    async with in_process(deployment, max_client_connections=3) as proc, AsyncExitStack() as stack:
        token = proc.server.tokens.token_for(INSTANCE)
        first = await stack.enter_async_context(RawRelay.connect(deployment))
        assert "result" in await first.hello(INSTANCE, token)  # unbound: counts the same
        await raw_clients(stack, deployment, 2, token)

        async with RawRelay.connect(deployment) as over:
            answer = await over.hello(INSTANCE, token, session="mcp:s1")
            assert answer["error"]["code"] == DENIED
            assert answer["error"]["message"] == (
                f"instance '{INSTANCE}' already has 3 client connections on this server, the limit "
                "(max_client_connections); close one or raise the limit")
            assert await over.closed(EVENT_TIMEOUT)  # refused, then closed
        assert len(proc.server.clients.of_instance(INSTANCE)) == 3

        guest = await stack.enter_async_context(RawRelay.connect(deployment))
        assert "result" in await guest.hello(INSTANCE, token, role="guest"), "a guest is not a client connection"

        # A place freed by a closed connection is taken again (once the server's client set,
        # which signals each change, has let it go).
        await first.stream.aclose()
        clients = proc.server.clients
        with trio.fail_after(EVENT_TIMEOUT):
            await clients.changed.until(lambda: len(clients.of_instance(INSTANCE)) != 3)
        await raw_clients(stack, deployment, 1, token)


async def test_oubliette_client_over_the_limit_backs_off_and_connects_once_a_place_is_free(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The refusal is not final: the client keeps trying, with its growing backoff (never a hot
    loop of hellos), says why, and connects when another client connection has ended."""
    from oubliette_client.relay_link import BACKOFF_INITIAL, RelayLink
    from oubliette_client.settings import RelaySettings

    async def ignore(method: str, params: Any) -> None:
        pass

    async with in_process(deployment, max_client_connections=1) as proc:
        settings = RelaySettings(relay=deployment.relay, instance=INSTANCE, token=proc.server.tokens.token_for(INSTANCE))
        refusals: list[float] = []
        fourth = trio.Event()
        add = proc.server.clients.add

        def counting_add(connection: Any) -> None:
            try:
                add(connection)
            except Exception:
                refusals.append(trio.current_time())
                if len(refusals) == 4:
                    fourth.set()
                raise

        monkeypatch.setattr(proc.server.clients, "add", counting_add)
        first, first_scope = RelayLink(settings, "client", ignore), trio.CancelScope()
        proc.nursery.start_soon(run_in, first_scope, first)
        with trio.fail_after(EVENT_TIMEOUT):
            await first.wait_connected()
        second = RelayLink(settings, "client", ignore)
        proc.nursery.start_soon(second.run)
        with trio.fail_after(EVENT_TIMEOUT):
            await fourth.wait()
        assert "max_client_connections" in second.last_error and second.refused is None and not second.connected
        # Three waits of the backoff (0.1, 0.2, 0.4 s, each -20 % at worst); a reset backoff would be 3 x 0.1 s.
        assert refusals[3] - refusals[0] >= (1 + 2 + 4) * BACKOFF_INITIAL * 0.8
        first_scope.cancel()  # the first client goes away: its place is free
        with trio.fail_after(EVENT_TIMEOUT + 5):  # the backoff grows to 5 s at most
            await second.wait_connected()


async def run_in(scope: trio.CancelScope, link: Any) -> None:
    """Run `link` until `scope` is cancelled."""
    with scope:
        await link.run()


def test_the_client_connection_limit_is_a_setting(tmp_path: Any) -> None:
    from oubliette_server.program.config import ServerConfig, load_config_file

    assert ServerConfig(data_dir=tmp_path).max_client_connections == 64
    path = tmp_path / "server.toml"
    path.write_text("[server]\nmax_client_connections = 8\n")
    assert ServerConfig(data_dir=tmp_path, **load_config_file(path)).max_client_connections == 8
    path.write_text("[server]\nmax_client_connections = \"8\"\n")
    with pytest.raises(ValueError, match="max_client_connections must be an integer"):
        load_config_file(path)
    for bad in (0, 10_001):
        with pytest.raises(ValueError, match="max_client_connections must be between 1 and 10000"):
            ServerConfig(data_dir=tmp_path, max_client_connections=bad)
