"""Toolsets (docs/TOOLSETS.md): the router, the registry, and the server's toolset API, in process.

The unit tests drive `ToolRouter` and `ToolsetRegistry` directly. The in-process
tests run `OublietteServer` in the test's own Trio loop (README.md, "Embedding"),
connect the client side (`SandboxTools`, what `oubliette-client` runs) over the
real relay socket, and change registrations and allowlists through the server's
code-driven API. The MCP toolset runs `mcp-server-time`, a reference MCP server
from the MCP project.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from harness import PYTHON, Deployment
from oubliette_client.sandbox_tools import SandboxTools
from oubliette_client.settings import RelaySettings
from oubliette_server.program.config import load_config_file
from oubliette_server.features.toolsets import (
    FunctionToolset,
    McpToolset,
    Toolset,
    ToolResult,
    ToolRouter,
    ToolsetDefinition,
    ToolsetRegistry,
    ToolSpec,
)
from protocol import RelayError, errors, messages
from echo_toolset import BOUND, ECHO_SPEC, ClosingToolset, EchoFactory, echo_handler, running

"""Upper bound on every wait for something the test caused (a connection, a push, a close)."""
MCP_BOUND = 60.0
"""Upper bound for waits that include starting an MCP server process."""

ECHO_ENDPOINT = str(Path(__file__).resolve().parents[3] / "examples" / "mcp_echo.py")


# -- toolsets used by the tests -------------------------------------------------------------


class RecordingToolset(Toolset):
    """Records each call it receives (the name it was given, the arguments) and answers `result`."""

    def __init__(self, result: Any = None) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.result = result
        self.closed = False

    async def call(self, tool: str, arguments: dict[str, Any]) -> ToolResult:
        self.calls.append((tool, dict(arguments)))
        if self.result is not None:
            return ToolResult.ok(self.result)
        return ToolResult.ok({"tool": tool, "arguments": arguments})

    async def aclose(self) -> None:
        self.closed = True


def definition(toolset_id: str, prefix: str, tools: list[ToolSpec], **kind: Any) -> ToolsetDefinition:
    return ToolsetDefinition(toolset_id, prefix, tools, **kind)


# -- 1. routing ------------------------------------------------------------------------------


async def test_router_routes_by_prefix_and_strips_the_prefix() -> None:
    ext, other = RecordingToolset(), RecordingToolset()
    router = ToolRouter(".", "test")
    await router.bind([
        definition("ext", "ext", [ToolSpec(name="echo")], ref=ext),
        definition("other", "other", [ToolSpec(name="echo"), ToolSpec(name="ping")], ref=other),
    ])
    assert [t["name"] for t in router.published()] == ["ext.echo", "other.echo", "other.ping"]

    result = await router.call("ext.echo", {"text": "hi"})
    assert not result.is_error
    assert ext.calls == [("echo", {"text": "hi"})], "the toolset gets its own tool name, without the prefix"
    assert other.calls == []

    await router.call("other.ping", {})
    assert other.calls == [("ping", {})]
    assert ext.calls == [("echo", {"text": "hi"})]


async def test_unknown_prefix_is_toolset_not_found() -> None:
    ext = RecordingToolset()
    router = ToolRouter(".", "test")
    await router.bind([definition("ext", "ext", [ToolSpec(name="echo")], ref=ext)])
    with pytest.raises(RelayError) as caught:
        await router.call("nope.echo", {})
    assert caught.value.code == errors.NOT_FOUND
    assert "Toolset not found" in caught.value.message
    assert "nope" in caught.value.message
    # A known prefix with a tool the toolset does not have names the toolset instead.
    with pytest.raises(RelayError) as caught:
        await router.call("ext.missing", {})
    assert caught.value.code == errors.NOT_FOUND
    assert "Toolset not found" not in caught.value.message
    assert "'ext'" in caught.value.message and "ext.missing" in caught.value.message
    assert ext.calls == []


async def test_a_toolsets_own_error_is_a_tool_result_error_with_its_text() -> None:
    async def broken(arguments: dict[str, Any]) -> Any:
        raise RuntimeError("disk full on /var")

    class Refusing(Toolset):
        async def call(self, tool: str, arguments: dict[str, Any]) -> ToolResult:
            return ToolResult.failure(f"{tool} refused: quota exceeded")

    router = ToolRouter(".", "test")
    await router.bind([
        definition("fn", "fn", [ToolSpec(name="write")], ref=FunctionToolset({"write": broken})),
        definition("ref", "ref", [ToolSpec(name="send")], ref=Refusing()),
    ])
    raised = await router.call("fn.write", {})
    assert raised.is_error and raised.error == "disk full on /var"
    returned = await router.call("ref.send", {})
    assert returned.is_error and returned.error == "send refused: quota exceeded"


async def test_arguments_are_validated_against_the_input_schema() -> None:
    toolset = RecordingToolset()
    router = ToolRouter(".", "test")
    await router.bind([definition("ext", "ext", [ECHO_SPEC], ref=toolset)])
    with pytest.raises(RelayError) as caught:
        await router.call("ext.echo", {"text": 42})
    assert caught.value.code == errors.INVALID_PARAMS
    assert "invalid arguments for ext.echo" in caught.value.message
    assert "text" in caught.value.message and "42 is not of type 'string'" in caught.value.message
    with pytest.raises(RelayError) as caught:
        await router.call("ext.echo", {})
    assert "'text' is a required property" in caught.value.message
    assert toolset.calls == [], "invalid arguments never reach the toolset"


async def test_the_result_is_validated_against_the_result_schema() -> None:
    good, bad = RecordingToolset(result={"echo": "hi"}), RecordingToolset(result={"echo": 7})
    router = ToolRouter(".", "test")
    await router.bind([
        definition("good", "good", [ECHO_SPEC], ref=good),
        definition("bad", "bad", [ECHO_SPEC], ref=bad),
    ])
    ok = await router.call("good.echo", {"text": "hi"})
    assert not ok.is_error and ok.result == {"echo": "hi"}
    mismatch = await router.call("bad.echo", {"text": "hi"})
    assert mismatch.is_error
    assert "the result of bad.echo does not match its result_schema" in (mismatch.error or "")
    assert "7 is not of type 'string'" in (mismatch.error or "")
    assert bad.calls == [("echo", {"text": "hi"})], "the call itself happened"


async def test_published_entries_carry_the_seed_001_descriptor() -> None:
    router = ToolRouter(".", "test")
    await router.bind([
        definition("ext", "ext", [ECHO_SPEC], ref=RecordingToolset()),
        definition("bare", "bare", [ToolSpec(name="ping")], ref=RecordingToolset()),
    ])
    entries = {entry["name"]: entry for entry in router.published()}
    echo = entries["ext.echo"]
    assert (echo["toolset"], echo["tool"], echo["inputSchema"]) == ("ext", "echo", ECHO_SPEC.input_schema)
    descriptor = echo["descriptor"]
    assert descriptor["name"] == "ext.echo"
    assert descriptor["origin"] == "remote"
    assert descriptor["description"] == "Echo the text back"
    assert descriptor["input_schema"] == ECHO_SPEC.input_schema
    assert descriptor["result_schema"] == ECHO_SPEC.result_schema
    assert descriptor["safety"] and descriptor["command"]
    assert entries["bare.ping"]["descriptor"]["input_schema"] == {"type": "object"}
    assert entries["bare.ping"]["descriptor"]["result_schema"] == {}


# -- 2. per-session and shared toolsets ------------------------------------------------------


async def test_factory_toolsets_are_spawned_per_session_and_stopped_with_it() -> None:
    factory = EchoFactory()
    ext = definition("ext", "ext", [ECHO_SPEC], factory=factory)
    first, second = ToolRouter(".", "box1/mcp:s1"), ToolRouter(".", "box1/mcp:s2")
    await first.bind([ext])
    await second.bind([ext])
    assert len(factory.made) == 2, "each session spawns its own toolset"
    one, two = factory.made
    assert one is not two
    assert first.bindings["ext"].toolset is one and first.bindings["ext"].spawned
    assert second.bindings["ext"].toolset is two

    assert not (await first.call("ext.echo", {"text": "a"})).is_error
    await first.stop()
    assert one.closed and one.close_count == 1
    assert not two.closed, "stopping one session leaves the other session's toolset running"
    assert (await second.call("ext.echo", {"text": "b"})).result == {"echo": "b"}

    await second.stop()
    assert two.closed and two.close_count == 1
    assert one.close_count == 1
    assert len(factory.made) == 2


async def test_an_async_factory_is_awaited() -> None:
    made: list[ClosingToolset] = []

    async def factory() -> ClosingToolset:
        await trio.lowlevel.checkpoint()
        made.append(ClosingToolset({"echo": echo_handler}))
        return made[-1]

    router = ToolRouter(".", "test")
    await router.bind([definition("ext", "ext", [ECHO_SPEC], factory=factory)])
    assert (await router.call("ext.echo", {"text": "x"})).result == {"echo": "x"}
    await router.stop()
    assert len(made) == 1 and made[0].closed


async def test_shared_refs_are_not_stopped_when_a_session_stops() -> None:
    shared = ClosingToolset({"echo": echo_handler})
    factory = EchoFactory()
    definitions = [
        definition("shared", "shared", [ECHO_SPEC], ref=shared),
        definition("ext", "ext", [ECHO_SPEC], factory=factory),
    ]
    first, second = ToolRouter(".", "s1"), ToolRouter(".", "s2")
    await first.bind(definitions)
    await second.bind(definitions)
    assert first.bindings["shared"].toolset is shared and not first.bindings["shared"].spawned
    assert second.bindings["shared"].toolset is shared

    await first.stop()
    await second.stop()
    assert all(t.closed for t in factory.made) and len(factory.made) == 2
    assert not shared.closed and shared.close_count == 0, "a session never stops a shared toolset"
    assert (await shared.call("echo", {"text": "still here"})).result == {"echo": "still here"}


async def test_rebinding_without_a_factory_toolset_stops_it_but_not_a_shared_one() -> None:
    shared = ClosingToolset({"echo": echo_handler})
    factory = EchoFactory()
    ext = definition("ext", "ext", [ECHO_SPEC], factory=factory)
    common = definition("shared", "shared", [ECHO_SPEC], ref=shared)
    router = ToolRouter(".", "s1")
    assert await router.bind([common, ext])
    assert await router.bind([])
    assert router.published() == []
    assert factory.made[0].closed
    assert not shared.closed
    assert not await router.bind([]), "no change, nothing to publish"


# -- 3. names --------------------------------------------------------------------------------


async def test_separator_inside_prefixes_and_tool_names_resolves_through_the_published_map() -> None:
    dotted, plain = RecordingToolset(), RecordingToolset()
    router = ToolRouter(".", "test")
    await router.bind([
        definition("dotted", "a.b", [ToolSpec(name="c.d")], ref=dotted),
        definition("plain", "a", [ToolSpec(name="b.x")], ref=plain),
    ])
    assert {t["name"] for t in router.published()} == {"a.b.c.d", "a.b.x"}
    # Splitting "a.b.c.d" on its first "." would send tool "b.c.d" to prefix "a".
    await router.call("a.b.c.d", {"n": 1})
    assert dotted.calls == [("c.d", {"n": 1})]
    assert plain.calls == []
    await router.call("a.b.x", {"n": 2})
    assert plain.calls == [("b.x", {"n": 2})]
    assert dotted.calls == [("c.d", {"n": 1})]


async def test_underscore_separator_publishes_prefix_underscore_tool() -> None:
    toolset = RecordingToolset()
    router = ToolRouter("_", "test")
    await router.bind([definition("ext", "ext", [ToolSpec(name="echo_external")], ref=toolset)])
    published = router.published()
    assert [t["name"] for t in published] == ["ext_echo_external"]
    assert published[0]["descriptor"]["name"] == "ext_echo_external"
    result = await router.call("ext_echo_external", {"message": "hi"})
    assert not result.is_error
    assert toolset.calls == [("echo_external", {"message": "hi"})]
    with pytest.raises(RelayError) as caught:
        await router.call("ext.echo_external", {})
    assert caught.value.code == errors.NOT_FOUND


async def test_a_published_name_over_64_characters_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    long_tool = "t" * 62
    router = ToolRouter(".", "test")
    with caplog.at_level(logging.WARNING, logger="oubliette.server.toolsets"):
        await router.bind([definition("ext", "ext", [ToolSpec(name=long_tool), ToolSpec(name="short")],
                                      ref=RecordingToolset())])
    published = f"ext.{long_tool}"
    assert len(published) > 64
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and published in r.getMessage()]
    assert len(warnings) == 1
    assert "64" in warnings[0].getMessage()
    assert not any("ext.short" in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert published in {t["name"] for t in router.published()}, "a long name is warned about, not dropped"


# -- 4. registry -----------------------------------------------------------------------------


def test_registry_allowlist_is_empty_by_default() -> None:
    registry = ToolsetRegistry()
    registry.register(definition("ext", "ext", [ECHO_SPEC], ref=RecordingToolset()))
    assert registry.allowed_ids("box1") == []
    assert registry.allowed_definitions("box1") == []
    registry.set_allowed("box1", ["ext"])
    assert registry.allowed_ids("box1") == ["ext"]
    assert registry.allowed_ids("box2") == [], "allowing one instance allows nothing for another"


def test_registry_refuses_an_unknown_toolset_id_in_an_allowlist() -> None:
    registry = ToolsetRegistry()
    registry.register(definition("ext", "ext", [ECHO_SPEC], ref=RecordingToolset()))
    with pytest.raises(ValueError, match="unknown toolset id.*nope"):
        registry.set_allowed("box1", ["ext", "nope"])
    assert registry.allowed_ids("box1") == [], "a refused allowlist changes nothing"


def test_registry_refuses_duplicate_ids_and_prefixes() -> None:
    registry = ToolsetRegistry()
    registry.register(definition("ext", "ext", [ECHO_SPEC], ref=RecordingToolset()))
    with pytest.raises(ValueError, match="id 'ext' is already registered"):
        registry.register(definition("ext", "other", [ECHO_SPEC], ref=RecordingToolset()))
    with pytest.raises(ValueError, match="prefix 'ext' is already used by toolset 'ext'"):
        registry.register(definition("ext2", "ext", [ECHO_SPEC], factory=EchoFactory()))
    assert list(registry.definitions) == ["ext"]


def test_registry_needs_exactly_one_of_factory_and_ref() -> None:
    registry = ToolsetRegistry()
    with pytest.raises(ValueError, match="exactly one of factory= or ref="):
        registry.register(definition("none", "none", []))
    with pytest.raises(ValueError, match="exactly one of factory= or ref="):
        registry.register(definition("both", "both", [], ref=RecordingToolset(), factory=EchoFactory()))
    assert registry.definitions == {}


# -- in-process server -----------------------------------------------------------------------


def toolset_names(tools: SandboxTools) -> set[str]:
    return {t.name for t in tools.registry.tools if t.kind == "toolset"}


async def wait_for_names(tools: SandboxTools, expected: set[str], timeout: float = BOUND) -> None:
    """Until the client's toolset tools are exactly `expected` (woken by each registry change)."""
    with trio.fail_after(timeout):
        while toolset_names(tools) != expected:
            await tools.registry.wait_changed(tools.registry.version)


# -- 5. allowlists, calls and session stop through the relay ---------------------------------


async def test_client_sees_toolsets_once_allowed_and_disconnecting_stops_its_factory_toolsets(
    deployment: Deployment,
) -> None:
    async with running(deployment) as run:
        server = run.server
        factory = EchoFactory()
        shared = ClosingToolset({"ping": lambda arguments: trio.lowlevel.checkpoint()})
        await server.register_toolset("ext", "ext", [ECHO_SPEC], factory=factory)
        await server.register_toolset("shared", "shared", [ToolSpec(name="ping")], ref=shared)

        tools, scope = await run.client("box1", "mcp:s1")
        assert toolset_names(tools) == set(), "no toolsets until the instance is allowed some"
        assert factory.made == [], "nothing is spawned for a session that may not use it"
        refused = await tools.call("ext.echo", {"text": "hi"})
        assert refused.is_error and "Toolset not found" in (refused.error or "")

        await server.update_allowed_toolsets("box1", ["shared", "ext"])
        await wait_for_names(tools, {"ext.echo", "shared.ping"})
        assert len(factory.made) == 1

        outcome = await tools.call("ext.echo", {"text": "hi"})
        assert not outcome.is_error, outcome.error
        assert outcome.result == {"echo": "hi"}
        pinged = await tools.call("shared.ping", {})
        assert not pinged.is_error, pinged.error

        scope.cancel()  # the client disconnects: its session router stops
        with trio.fail_after(BOUND):
            await factory.made[0].closed_event.wait()
            await trio.testing.wait_all_tasks_blocked()  # the router's stop (same loop) has finished
        assert factory.made[0].closed
        assert not shared.closed and shared.close_count == 0, "the shared toolset keeps running"


async def test_a_client_with_its_own_separator_shows_it_and_calls_by_the_servers_name(deployment: Deployment) -> None:
    """A client given its agent's separator (`OUBLIETTE_TOOL_SEPARATOR`, `_` for an agent that would
    rewrite the server's `.`) shows the server's `ext.echo` as `ext_echo`, descriptor included; a
    call of that reaches the toolset under the server's name; the dotted name is unknown to it, and
    an unknown prefix is still named as one."""
    async with running(deployment) as run:
        await run.server.register_toolset("ext", "ext", [ECHO_SPEC], factory=EchoFactory())
        await run.server.update_allowed_toolsets("box1", ["ext"])
        tools, _scope = await run.client("box1", "mcp:s1", tool_separator="_")
        await wait_for_names(tools, {"ext_echo"})
        [published] = [t for t in tools.registry.tools if t.kind == "toolset"]
        assert (published.descriptor["name"], published.server_name) == ("ext_echo", "ext.echo")
        outcome = await tools.call("ext_echo", {"text": "hi"})
        assert not outcome.is_error and outcome.result == {"echo": "hi"}, outcome
        dotted = await tools.call("ext.echo", {"text": "hi"})
        assert dotted.is_error and dotted.category == "not_found", dotted
        unknown = await tools.call("nope_echo", {})
        assert (unknown.error or "").startswith("Toolset not found: 'nope'"), unknown


async def test_the_server_answers_an_unknown_prefix_with_toolset_not_found(deployment: Deployment) -> None:
    """Bypassing the client's own check, a `toolset_call` for an unknown prefix is refused by the server."""
    async with running(deployment) as run:
        await run.server.register_toolset("ext", "ext", [ECHO_SPEC], factory=EchoFactory())
        await run.server.update_allowed_toolsets("box1", ["ext"])
        tools, _scope = await run.client("box1", "mcp:s1")
        with pytest.raises(RelayError) as caught:
            await tools.link.request(messages.TOOLSET_CALL, {"name": "nope.echo", "arguments": {}})
        assert caught.value.code == errors.NOT_FOUND
        assert "Toolset not found" in caught.value.message
        with pytest.raises(RelayError) as caught:
            await tools.link.request(messages.TOOLSET_CALL, {"name": "ext.echo", "arguments": {"text": 1}})
        assert caught.value.code == errors.INVALID_PARAMS


async def test_each_session_gets_its_own_factory_toolset(deployment: Deployment) -> None:
    async with running(deployment) as run:
        factory = EchoFactory()
        await run.server.register_toolset("ext", "ext", [ECHO_SPEC], factory=factory)
        await run.server.update_allowed_toolsets("box1", ["ext"])
        first, first_scope = await run.client("box1", "mcp:s1")
        second, second_scope = await run.client("box1", "mcp:s2")
        same_session, same_scope = await run.client("box1", "mcp:s1")
        assert len(factory.made) == 2, "two sessions, two toolsets; a second client of s1 shares s1's"
        for tools in (first, second, same_session):
            assert toolset_names(tools) == {"ext.echo"}
            assert (await tools.call("ext.echo", {"text": "x"})).result == {"echo": "x"}

        s1_toolset, s2_toolset = factory.made
        second_scope.cancel()
        with trio.fail_after(BOUND):
            await s2_toolset.closed_event.wait()
        assert not s1_toolset.closed

        first_scope.cancel()
        with trio.fail_after(BOUND):
            await trio.testing.wait_all_tasks_blocked()  # the server (same loop) has handled the disconnect
        # s1 still has a client: its toolset keeps running and answers.
        assert (await same_session.call("ext.echo", {"text": "still"})).result == {"echo": "still"}
        assert not s1_toolset.closed
        same_scope.cancel()
        with trio.fail_after(BOUND):
            await s1_toolset.closed_event.wait()
        assert s1_toolset.close_count == 1 and s2_toolset.close_count == 1


async def test_a_second_client_joining_while_the_session_toolset_starts_gets_its_tools(
    deployment: Deployment,
) -> None:
    """Two clients of one session connect while its (slow, async) factory toolset is still starting."""
    async with running(deployment) as run:
        gate = trio.Event()
        made: list[ClosingToolset] = []

        async def slow_factory() -> ClosingToolset:
            await gate.wait()
            made.append(ClosingToolset({"echo": echo_handler}))
            return made[-1]

        await run.server.register_toolset("ext", "ext", [ECHO_SPEC], factory=slow_factory)
        await run.server.update_allowed_toolsets("box1", ["ext"])

        clients: list[SandboxTools] = []
        for _ in range(2):
            tools = SandboxTools(RelaySettings(
                relay=deployment.relay, instance="box1", token=run.server.tokens.token_for("box1"),
                session="mcp:s1",
            ))
            run.nursery.start_soon(tools.link.run)
            clients.append(tools)
        with trio.fail_after(BOUND):
            # Server and clients share this loop: once everything is blocked, both handshakes
            # have gone as far as they can while the factory waits.
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
            for tools in clients:
                await tools.link.wait_connected()
        assert len(made) == 1, "one session, one toolset"
        for tools in clients:
            assert toolset_names(tools) == {"ext.echo"}
            assert (await tools.call("ext.echo", {"text": "x"})).result == {"echo": "x"}


async def test_registry_changes_reach_connected_clients(deployment: Deployment) -> None:
    async with running(deployment) as run:
        server = run.server
        shared = ClosingToolset({"echo": echo_handler})
        await server.register_toolset("one", "one", [ECHO_SPEC], ref=shared)
        await server.update_allowed_toolsets("box1", ["one"])
        tools, _scope = await run.client("box1", "mcp:s1")
        other, _other_scope = await run.client("box2", "mcp:s1")
        assert toolset_names(tools) == {"one.echo"}
        assert toolset_names(other) == set()

        factory = EchoFactory()
        await server.register_toolset("two", "two", [ECHO_SPEC], factory=factory)
        await server.update_allowed_toolsets("box1", ["one", "two"])
        await wait_for_names(tools, {"one.echo", "two.echo"})
        assert (await tools.call("two.echo", {"text": "2"})).result == {"echo": "2"}

        await server.unregister_toolset("two")
        await wait_for_names(tools, {"one.echo"})
        assert factory.made[0].closed, "the session's toolset stopped when its definition went away"
        gone = await tools.call("two.echo", {"text": "2"})
        assert gone.is_error and "Toolset not found" in (gone.error or "")

        await server.update_allowed_toolsets("box1", [])
        await wait_for_names(tools, set())
        assert not shared.closed
        assert toolset_names(other) == set(), "box2 was never allowed anything"
        with pytest.raises(ValueError, match="unknown toolset id"):
            await server.update_allowed_toolsets("box1", ["two"])


# -- 6. a failing command endpoint -----------------------------------------------------------


async def test_failing_command_endpoints_are_registered_without_tools(
    deployment: Deployment, caplog: pytest.LogCaptureFixture,
) -> None:
    async with running(deployment) as run:
        server = run.server
        with caplog.at_level(logging.WARNING, logger="oubliette.server.toolsets"):
            exits = await server.register_command_toolset(
                "exits", "exits", [PYTHON, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(1)"],
            )
            missing = await server.register_command_toolset("missing", "missing", "/nonexistent/endpoint --serve")
        assert exits.tools == [] and missing.tools == []
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("exits" in w and "status 1" in w and "boom" in w for w in warnings), warnings
        assert any("missing" in w and "/nonexistent/endpoint" in w for w in warnings), warnings

        ext = await server.register_command_toolset("ext", "ext", [PYTHON, ECHO_ENDPOINT])
        assert [t.name for t in ext.tools] == ["echo_external"]
        await server.update_allowed_toolsets("box1", ["exits", "ext", "missing"])
        tools, _scope = await run.client("box1", "mcp:s1")
        assert toolset_names(tools) == {"ext.echo_external"}
        outcome = await tools.call("ext.echo_external", {"message": "still works"})
        assert not outcome.is_error, outcome.error
        assert outcome.result == {"echo": "still works"}
        refused = await tools.call("ext.echo_external", {"message": "x", "extra": 1})
        assert refused.is_error and refused.category == "usage"


async def test_config_file_toolsets_and_allowlists_are_registered(
    deployment: Deployment, caplog: pytest.LogCaptureFixture,
) -> None:
    """What `oubliette-server --config` does at start: a command given as a string takes its `args`."""
    deployment.root.joinpath("toolsets.toml").write_text(
        "[toolsets.ext]\n"
        'kind = "command"\n'
        'prefix = "ext"\n'
        f"command = {json.dumps(PYTHON)}\n"
        f"args = [{json.dumps(ECHO_ENDPOINT)}]\n"
        "\n[toolsets.listed]\n"
        'kind = "command"\n'
        'prefix = "listed"\n'
        f"command = [{json.dumps(PYTHON)}, {json.dumps(ECHO_ENDPOINT)}]\n"
        "\n[allowlists]\n"
        'box1 = ["ext", "listed", "ghost"]\n'
    )
    settings = load_config_file(deployment.root / "toolsets.toml")
    # `serve` registers the config's toolsets and allowlists, as `oubliette-server --config` does.
    with caplog.at_level(logging.WARNING, logger="oubliette.server.toolsets"):
        async with running(deployment, toolsets=settings["toolsets"], allowlists=settings["allowlists"]) as run:
            definitions = run.server.toolsets.registry.definitions
            assert [t.name for t in definitions["ext"].tools] == ["echo_external"]
            assert [t.name for t in definitions["listed"].tools] == ["echo_external"]
            assert run.server.toolsets.registry.allowed_ids("box1") == ["ext", "listed"]
            assert any("ghost" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
            tools, _scope = await run.client("box1", "mcp:s1")
            assert toolset_names(tools) == {"ext.echo_external", "listed.echo_external"}
            outcome = await tools.call("ext.echo_external", {"message": "configured"})
            assert not outcome.is_error and outcome.result == {"echo": "configured"}


# -- 7. MCP toolset lifecycle ----------------------------------------------------------------

PID_WRAPPER = """\
import os, sys
with open(sys.argv[1], "w") as handle:
    handle.write(str(os.getpid()))
os.execv(sys.executable, [sys.executable, "-m", "mcp_server_time", "--local-timezone", "UTC"])
"""


class TimeServerLauncher:
    """Runs mcp-server-time through a wrapper that writes the server's pid (the same process, after exec)."""

    def __init__(self, root: Path) -> None:
        self.wrapper = root / "pid_wrapper.py"
        self.wrapper.write_text(PID_WRAPPER)
        self.pid_file = root / "time.pid"

    @property
    def args(self) -> list[str]:
        return [str(self.wrapper), str(self.pid_file)]

    def pid(self) -> int:
        return int(self.pid_file.read_text())

    async def kill(self) -> int:
        """SIGKILL the running server and wait (bounded) until it has exited."""
        pid = self.pid()
        pidfd = os.pidfd_open(pid)
        try:
            os.kill(pid, signal.SIGKILL)
            with trio.fail_after(BOUND):
                await trio.lowlevel.wait_readable(pidfd)  # readable once the process has exited
        finally:
            os.close(pidfd)
        return pid


async def test_mcp_toolset_is_restarted_after_its_server_dies(deployment: Deployment) -> None:
    launcher = TimeServerLauncher(deployment.root)
    async with running(deployment) as run:
        with trio.fail_after(MCP_BOUND):
            registered = await run.server.register_mcp_toolset("time", "time", PYTHON, launcher.args)
        assert registered.kind == "mcp" and not registered.per_session
        assert {t.name for t in registered.tools} == {"get_current_time", "convert_time"}
        await run.server.update_allowed_toolsets("box1", ["time"])
        tools, _scope = await run.client("box1", "mcp:s1")
        assert toolset_names(tools) == {"time.get_current_time", "time.convert_time"}

        with trio.fail_after(MCP_BOUND):
            first = await tools.call("time.get_current_time", {"timezone": "UTC"})
        assert not first.is_error, first.error
        assert first.result["timezone"] == "UTC"

        killed = await launcher.kill()
        with trio.fail_after(MCP_BOUND):
            noticed = await tools.call("time.get_current_time", {"timezone": "UTC"})
        assert noticed.is_error
        assert "MCP toolset 'time' failed during 'get_current_time'" in (noticed.error or "")
        assert "restarted on the next call" in (noticed.error or "")

        with trio.fail_after(MCP_BOUND):
            again = await tools.call("time.get_current_time", {"timezone": "UTC"})
        assert not again.is_error, again.error
        assert again.result["timezone"] == "UTC"
        assert launcher.pid() != killed, "a new server process answered"
        assert registered.ref is not None and registered.ref.restarts == 1


async def test_mcp_toolset_restarts_are_bounded(deployment: Deployment) -> None:
    launcher = TimeServerLauncher(deployment.root)
    async with trio.open_nursery() as nursery:
        toolset = McpToolset("time", PYTHON, launcher.args, nursery=nursery, max_restarts=1)
        with trio.fail_after(MCP_BOUND):
            specs = await toolset.start()
        assert {s.name for s in specs} == {"get_current_time", "convert_time"}
        get_time = {"timezone": "UTC"}

        await launcher.kill()
        with trio.fail_after(MCP_BOUND):
            assert (await toolset.call("get_current_time", get_time)).is_error
            restarted = await toolset.call("get_current_time", get_time)
        assert not restarted.is_error, restarted.error
        assert toolset.restarts == 1

        await launcher.kill()
        with trio.fail_after(MCP_BOUND):
            noticed = await toolset.call("get_current_time", get_time)
            refused = await toolset.call("get_current_time", get_time)
            still_refused = await toolset.call("convert_time", {
                "source_timezone": "UTC", "time": "12:00", "target_timezone": "UTC"})
        assert noticed.is_error and "failed during 'get_current_time'" in (noticed.error or "")
        assert refused.is_error
        assert "MCP toolset 'time' is down" in (refused.error or "")
        assert "restarted 1 times already; not restarting again" in (refused.error or "")
        assert still_refused.is_error and "not restarting again" in (still_refused.error or "")
        assert toolset.restarts == 1
        await toolset.aclose()
        nursery.cancel_scope.cancel()


async def test_mcp_toolset_tool_errors_are_tool_result_errors(deployment: Deployment) -> None:
    """An error the MCP server itself reports (a bad timezone) is the toolset's error text, not a crash."""
    async with running(deployment) as run:
        with trio.fail_after(MCP_BOUND):
            registered = await run.server.register_mcp_toolset(
                "time", "time", PYTHON, ["-m", "mcp_server_time", "--local-timezone", "UTC"])
        await run.server.update_allowed_toolsets("box1", ["time"])
        tools, _scope = await run.client("box1", "mcp:s1")
        with trio.fail_after(MCP_BOUND):
            bad = await tools.call("time.get_current_time", {"timezone": "Not/AZone"})
            good = await tools.call("time.convert_time", {
                "source_timezone": "UTC", "time": "12:00", "target_timezone": "Europe/Paris"})
        assert bad.is_error and "Not/AZone" in (bad.error or "")
        assert not good.is_error, good.error
        assert good.result["target"]["timezone"] == "Europe/Paris"
        assert registered.ref is not None and registered.ref.restarts == 0, "a tool error is not a crash"
