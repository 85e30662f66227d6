"""The connection rooms alone: `ClientConnections` (an instance's agent clients, bounded),
`CallerRegistry` (callers and their event senders), `ToolRouter` and `ToolsetService` (a
session's toolsets, pushed to its clients, `toolset_call`), with fake relay connections and a
fake MCP session (tests/support/fakes.py). The room is named in every failure. (The same through the
real programs: tests/server/features/test_toolsets.py, tests/e2e/test_toolsets.py, tests/server/features/test_declarations.py.)
"""

from __future__ import annotations

import json
import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import pytest
import trio
import trio.testing

from fakes import FakeMcpSession, FakeRelayConnection
from oubliette_server.core.callers import CallerConnection, CallerRegistry
from oubliette_server.core.client_connections import ClientConnections, progress_sink
from oubliette_server.features.toolsets.base import FunctionToolset, ToolSpec, call_progress
from oubliette_server.features.toolsets.registry import ToolsetDefinition
from oubliette_server.features.toolsets.router import ToolRouter
from oubliette_server.features.toolsets.service import ToolsetService
from protocol import RelayError, errors, messages

INSTANCE = "box1"
BOUND = 5.0


# -- ClientConnections ---------------------------------------------------------------------


def test_client_connections_are_bounded_per_instance() -> None:
    clients = ClientConnections(max_per_instance=2)
    a, b, c = (FakeRelayConnection(INSTANCE) for _ in range(3))
    other = FakeRelayConnection("box2")
    for connection in (a, b, other):
        clients.add(connection)
    clients.add(a)  # already tracked: not counted twice

    with pytest.raises(RelayError) as refused:
        clients.add(c)
    assert refused.value.code == errors.DENIED and "max_client_connections" in refused.value.message, (
        f"ClientConnections.add over the limit: {refused.value!r}")
    assert set(clients.of_instance(INSTANCE)) == {a, b}, "ClientConnections: the refused connection is tracked"
    assert clients.count() == 3 and set(clients) == {a, b, other}, f"ClientConnections: count {clients.count()}"

    clients.discard(a)
    clients.discard(FakeRelayConnection(INSTANCE))  # never added: ignored
    clients.add(c)
    assert set(clients.of_instance(INSTANCE)) == {b, c}, "ClientConnections: a slot freed by discard was not reused"
    assert sorted(clients.instances()) == [INSTANCE, "box2"], f"ClientConnections.instances: {clients.instances()}"


def test_progress_sink_queues_progress_notifications_for_the_ref() -> None:
    connection = FakeRelayConnection(INSTANCE)
    assert progress_sink(connection, None) is None, "progress_sink: a sink without a ref"
    send = progress_sink(connection, "p1")
    assert send is not None
    send(0.5, 1.0, "half")
    assert connection.of_method(messages.PROGRESS) == [
        {"ref": "p1", "progress": 0.5, "total": 1.0, "message": "half"}], (
        f"progress_sink: queued {connection.notified}")


# -- CallerRegistry ------------------------------------------------------------------------


class Callers:
    """A caller registry serving in a nursery; `closed` lists the callers `on_closed` heard of."""

    def __init__(self) -> None:
        self.closed: list[CallerConnection] = []
        self.registry = CallerRegistry(self.closed.append)

    def open(self) -> tuple[CallerConnection, FakeMcpSession]:
        caller = self.registry.open("test")
        session = FakeMcpSession()
        caller.mcp_session = session
        return caller, session


@asynccontextmanager
async def serving_callers() -> AsyncIterator[Callers]:
    """A `Callers` whose registry serves (runs its senders) for the block."""
    callers = Callers()
    async with trio.open_nursery() as nursery:
        await nursery.start(callers.registry.serve)
        yield callers
        nursery.cancel_scope.cancel()


async def test_caller_registry_sends_each_callers_events_in_order() -> None:
    async with serving_callers() as callers:
        caller, session = callers.open()
        for seq in (1, 2, 3):
            caller.push({"seq": seq})
        assert await session.wait_sent(3, BOUND) == [{"seq": 1}, {"seq": 2}, {"seq": 3}], (
            f"CallerRegistry: sent {session.data()}")
        caller.set_log_level("warning")
        caller.push({"seq": 4})
        await trio.testing.wait_all_tasks_blocked()
        assert len(session.sent) == 3, "CallerConnection: an event went to a caller that asked for warnings only"


def test_a_2026_07_28_callers_own_connection_says_it_delivers_no_pushed_event() -> None:
    """Its sender would drop every event (no notification channel: its events ride its requests), so
    it says so, an event pushed to it is not queued (its sender is not woken for nothing), and the
    log tail reads nothing for it; a caller with an MCP session, or not yet, does."""
    caller = CallerConnection("http")
    assert caller.delivers
    caller.owner_key = "k" * 32
    assert not caller.delivers
    caller.push({"seq": 1})
    assert caller._receive.statistics().current_buffer_used == 0
    caller.mcp_session = FakeMcpSession()
    assert caller.delivers
    caller.push({"seq": 2})
    assert caller._receive.statistics().current_buffer_used == 1


async def test_caller_registry_closes_a_caller_once() -> None:
    async with serving_callers() as callers:
        caller, session = callers.open()
        assert callers.registry.count() == 1, "CallerRegistry.count after open"
        callers.registry.close(caller)
        callers.registry.close(caller)
        caller.push({"seq": 1})
        await trio.testing.wait_all_tasks_blocked()
        assert callers.closed == [caller], f"CallerRegistry.close: on_closed heard {callers.closed}"
        assert caller.closed.is_set() and callers.registry.count() == 0, "CallerRegistry.close: caller still open"
        assert session.sent == [], "CallerConnection: a closed caller got an event"


async def test_caller_registry_a_caller_opened_before_it_serves_gets_its_events_once_it_does() -> None:
    callers = Callers()
    caller, session = callers.open()  # before `serve`: an embedder's caller, opened early
    caller.push({"seq": 1})
    async with trio.open_nursery() as nursery:
        await nursery.start(callers.registry.serve)
        assert await session.wait_sent(1, BOUND) == [{"seq": 1}], (
            f"CallerRegistry: a caller opened before serve never got its sender (sent {session.data()})")
        nursery.cancel_scope.cancel()


async def test_caller_registry_a_caller_opened_after_it_stopped_gets_no_sender() -> None:
    callers = Callers()
    async with trio.open_nursery() as nursery:
        await nursery.start(callers.registry.serve)
        nursery.cancel_scope.cancel()
    caller, session = callers.open()
    caller.push({"seq": 1})
    await trio.testing.wait_all_tasks_blocked()
    assert session.sent == [], "CallerRegistry: a stopped registry started a sender"


async def test_caller_registry_a_failing_sender_closes_its_caller_only() -> None:
    async with serving_callers() as callers:
        broken, broken_session = callers.open()
        healthy, healthy_session = callers.open()
        broken_session.fail = True
        broken.push({"seq": 1})
        with trio.fail_after(BOUND):
            await broken.closed.wait()
        healthy.push({"seq": 2})
        assert await healthy_session.wait_sent(1, BOUND) == [{"seq": 2}], "CallerRegistry: the healthy caller got nothing"
        assert callers.closed == [broken], f"CallerRegistry: a failing sender closed {callers.closed}"


# -- ToolRouter ----------------------------------------------------------------------------


async def echo(arguments: dict[str, Any]) -> dict[str, Any]:
    return {"echo": arguments.get("text", "")}


ECHO = ToolSpec(
    name="echo", input_schema={"type": "object", "properties": {"text": {"type": "string"}}},
    result_schema={"type": "object", "required": ["echo"]},
)


async def test_tool_router_routes_published_names_and_refuses_the_rest() -> None:
    shared = FunctionToolset({"echo": echo})
    router = ToolRouter(".", "test")
    changed = await router.bind([ToolsetDefinition("util", "util", [ECHO], ref=shared)])

    assert changed and [t["name"] for t in router.published()] == ["util.echo"], (
        f"ToolRouter.bind: published {router.published()}")
    result = await router.call("util.echo", {"text": "hi"})
    assert result.result == {"echo": "hi"}, f"ToolRouter.call: {result}"
    for name, arguments, code, words in [
        ("nope.echo", {}, errors.NOT_FOUND, "Toolset not found: 'nope'"),
        ("util.other", {}, errors.NOT_FOUND, "has no tool named 'util.other'"),
        ("util.echo", {"text": 3}, errors.INVALID_PARAMS, "invalid arguments for util.echo"),
    ]:
        with pytest.raises(RelayError) as refused:
            await router.call(name, arguments)
        assert refused.value.code == code and words in refused.value.message, (
            f"ToolRouter.call({name}, {arguments}): {refused.value!r}")


async def test_tool_router_stops_the_toolsets_it_spawned_only() -> None:
    shared = FunctionToolset({"echo": echo})
    spawned: list[FunctionToolset] = []

    def factory() -> FunctionToolset:
        spawned.append(FunctionToolset({"echo": echo}))
        return spawned[-1]

    router = ToolRouter(".", "test")
    await router.bind([
        ToolsetDefinition("util", "util", [ECHO], ref=shared),
        ToolsetDefinition("mine", "mine", [ECHO], factory=factory),
    ])
    await router.stop()

    assert len(spawned) == 1 and spawned[0].closed, "ToolRouter.stop: the per-session toolset was not stopped"
    assert not shared.closed, "ToolRouter.stop: a shared toolset was stopped"
    assert router.published() == [], "ToolRouter.stop: tools still published"


async def test_tool_router_lists_a_toolset_that_failed_to_start() -> None:
    def broken() -> FunctionToolset:
        raise OSError("cannot start")

    router = ToolRouter(".", "test")
    await router.bind([ToolsetDefinition("bad", "bad", [ECHO], factory=broken)])

    assert [u["toolset"] for u in router.unavailable()] == ["bad"], f"ToolRouter.unavailable: {router.unavailable()}"
    with pytest.raises(RelayError) as refused:
        await router.call("bad.echo", {})
    assert refused.value.code == errors.NOT_FOUND and "cannot start" in refused.value.message, (
        f"ToolRouter.call of a toolset that did not start: {refused.value!r}")


# -- ToolsetService ------------------------------------------------------------------------


def pushed_names(connection: FakeRelayConnection) -> list[list[str]]:
    """The tool names of each `toolsets_config` pushed to the connection."""
    return [[t["name"] for t in json.loads(note.data)["params"]["tools"]]
            for note in connection.of_method(messages.TOOLSETS_CONFIG)]


async def test_toolset_service_pushes_allowlist_changes_to_the_sessions_clients() -> None:
    clients = ClientConnections()
    service = ToolsetService(".", clients)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.serve)
        await service.register_toolset("util", "util", [ECHO], ref=FunctionToolset({"echo": echo}))
        connection = FakeRelayConnection(INSTANCE, "mcp:s1")
        clients.add(connection)
        other = FakeRelayConnection("box2", "mcp:s1")
        clients.add(other)
        first = await service.attach(connection)
        await service.attach(other)
        assert first["tools"] == [], f"ToolsetService.attach: an instance allowed nothing sees {first}"

        await service.update_allowed_toolsets(INSTANCE, ["util"])

        assert pushed_names(connection) == [["util.echo"]], f"ToolsetService: pushed {pushed_names(connection)}"
        assert pushed_names(other) == [], f"ToolsetService: another instance was told {pushed_names(other)}"
        result = await service.call(connection, messages.ToolsetCall(name="util.echo", arguments={"text": "hi"}))
        assert result.result == {"echo": "hi"}, f"ToolsetService.call: {result}"
        nursery.cancel_scope.cancel()


async def test_toolset_service_call_reports_progress_and_refuses_a_gated_tool_with_nobody_to_ask() -> None:
    async def slow(arguments: dict[str, Any]) -> str:
        report = call_progress.get()
        assert report is not None
        report(1, 2, "half")
        return "done"

    clients = ClientConnections()
    calls: list[tuple[str, BaseException | None]] = []
    service = ToolsetService(".", clients, on_call=lambda toolset, error: calls.append((toolset, error)))
    async with trio.open_nursery() as nursery:
        await nursery.start(service.serve)
        await service.register_toolset("util", "util", [ToolSpec(name="slow"), ToolSpec(name="risky")],
                                       ref=FunctionToolset({"slow": slow, "risky": slow}), requires_approval=["risky"])
        await service.update_allowed_toolsets(INSTANCE, ["util"])
        connection = FakeRelayConnection(INSTANCE, "mcp:s1")
        clients.add(connection)
        await service.attach(connection)

        result = await service.call(connection, messages.ToolsetCall(name="util.slow", progress_ref="p1"))
        assert result.result == "done", f"ToolsetService.call: {result}"
        assert connection.of_method(messages.PROGRESS) == [
            {"ref": "p1", "progress": 1, "total": 2, "message": "half"}], (
            f"ToolsetService.call: progress {connection.notified}")
        with pytest.raises(RelayError) as denied:
            await service.call(connection, messages.ToolsetCall(name="util.risky"))
        assert denied.value.code == errors.DENIED and "nobody to ask" in denied.value.message, (
            f"ToolsetService.call of a gated tool: {denied.value!r}")
        assert [(t, e is None) for t, e in calls] == [("util", True), ("util", False)], (
            f"ToolsetService.on_call heard {calls}")
        nursery.cancel_scope.cancel()


async def test_toolset_service_stops_a_sessions_toolsets_when_its_last_client_goes() -> None:
    spawned: list[FunctionToolset] = []

    def factory() -> FunctionToolset:
        spawned.append(FunctionToolset({"echo": echo}))
        return spawned[-1]

    clients = ClientConnections()
    service = ToolsetService(".", clients)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.serve)
        await service.register_toolset("mine", "mine", [ECHO], factory=factory)
        await service.update_allowed_toolsets(INSTANCE, ["mine"])
        first, second = FakeRelayConnection(INSTANCE, "mcp:s1"), FakeRelayConnection(INSTANCE, "mcp:s1")
        await service.attach(first)
        await service.attach(second)
        assert first.router is second.router and len(spawned) == 1, "ToolsetService: one session, two routers"

        service.detach(first)
        await trio.testing.wait_all_tasks_blocked()
        assert not spawned[0].closed, "ToolsetService.detach: stopped a session another client still uses"
        service.detach(second)
        await trio.testing.wait_all_tasks_blocked()
        assert spawned[0].closed, "ToolsetService.detach: the last client left and the toolset runs on"
        nursery.cancel_scope.cancel()


def test_a_caller_that_reads_no_events_costs_two_log_lines_not_one_per_event(caplog: pytest.LogCaptureFixture) -> None:
    """Its queue full, every further event is dropped: one WARNING when dropping starts, one with
    the count when it reads again, whatever the number of frames the sandbox writes meanwhile."""
    from oubliette_server.core.callers import EVENT_QUEUE_SIZE

    caller = CallerConnection("stdio")
    with caplog.at_level(logging.WARNING, logger="oubliette.server.callers"):
        for seq in range(EVENT_QUEUE_SIZE + 5000):
            caller.push({"seq": seq})
        assert caller._receive.receive_nowait() == {"seq": 0}  # it reads one
        caller.push({"seq": "next"})
    lines = [r.getMessage() for r in caplog.records if r.name == "oubliette.server.callers"]
    assert len(lines) == 2, lines[:5]
    assert f"dropping them from seq {EVENT_QUEUE_SIZE} until it does" in lines[0]
    assert "reads events again; 5000 were dropped" in lines[1]
