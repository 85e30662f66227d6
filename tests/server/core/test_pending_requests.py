"""The pending-request engine (oubliette_server/core/pending_requests/) alone, with in-memory fakes.

No store, no subprocess: the frame log's `append` is a list, the shared log a fake. Each rule
of a pending request is checked on caller tool requests and approvals alike: one outcome only,
the deadline, the owner's disconnect, the agent's cancel, the claim held while an answer is
stored (a failed store leaves the request pending), and the single-server crossing doing nothing.
"""

from __future__ import annotations

import contextlib
import logging
from types import SimpleNamespace
from typing import Any, AsyncIterator

import pytest
import trio
import trio.testing

from oubliette_server.features.approvals.service import ApprovalService, Decision
from oubliette_server.features.caller_tool_relay import pending as caller_tool_pending
from oubliette_server.features.caller_tool_relay.pending import CallerCallRegistry, NoLongerPending
from oubliette_server.core.callers import CallerConnection
from oubliette_server.core.pending_requests import RESOLVED_MEMORY, SERVER_SHUTDOWN, RequestBook, SharedStore, SingleServer
from oubliette_server.core.sessions import Session
from oubliette_server.store.api import AnswerNotRecorded, StoreUnavailable
from protocol import RelayError, errors
from protocol.messages import CallerToolSpec
from task_steps import counted_steps


class FakeLog:
    """The frame log's `append` in memory: frames in a list; appends of `failing` types raise."""

    def __init__(self) -> None:
        self.frames: list[SimpleNamespace] = []
        self.failing: set[str] = set()

    async def append(self, session: Session, type: str, payload: dict[str, Any], **_: Any) -> SimpleNamespace:
        """Store a frame (or fail, for a type in `failing`)."""
        await trio.lowlevel.checkpoint()
        if type in self.failing:
            raise StoreUnavailable("the fake store is unavailable")
        frame = SimpleNamespace(seq=len(self.frames) + 1, type=type, payload=payload)
        self.frames.append(frame)
        return frame

    def types(self) -> list[str]:
        """The stored frames' types, in order."""
        return [f.type for f in self.frames]


def world() -> tuple[FakeLog, Session, CallerConnection]:
    """A fake log and session `s1` of box1 owned by a connected caller."""
    caller = CallerConnection("stdio")
    session = Session(instance="box1", channel="mcp", id="s1", caller_id="myapp", owner=caller)
    return FakeLog(), session, caller


async def relay_in_background(
    nursery: trio.Nursery, calls: CallerCallRegistry, session: Session, outcome: list[Any], timeout_ms: int | None = None,
) -> trio.CancelScope:
    """Start an agent's relayed call; its result or error lands in `outcome`; returns its cancel scope."""
    scope = trio.CancelScope()

    async def agent() -> None:
        with scope:
            try:
                outcome.append(await calls.relay(session, CallerToolSpec(name="notify", timeout_ms=timeout_ms), {}))
            except RelayError as err:
                outcome.append(err)

    nursery.start_soon(agent)
    return scope


@contextlib.asynccontextmanager
async def one_pending_call() -> AsyncIterator[SimpleNamespace]:
    """A relayed call waiting for its caller (`call`), with its `log`, `session`, `caller`,
    `calls`, `scope` (the agent's) and `outcome`; the block must end the call within 5 s."""
    log, session, caller = world()
    calls = CallerCallRegistry(log.append, default_timeout=10)
    outcome: list[Any] = []
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            scope = await relay_in_background(nursery, calls, session, outcome)
            [call] = await calls.wait_pending(session)
            yield SimpleNamespace(log=log, session=session, caller=caller, calls=calls, call=call, scope=scope, outcome=outcome)


async def test_a_call_takes_exactly_one_outcome() -> None:
    async with one_pending_call() as t:
        await t.calls.respond(t.caller, "s1", t.call.request_id, {"ok": 1})
        with pytest.raises(NoLongerPending, match="already resolved"):
            await t.calls.respond(t.caller, "s1", t.call.request_id, {"ok": 2})
    assert t.outcome == [{"ok": 1}]
    assert t.log.types() == ["caller_tool_request", "caller_tool_result"]
    assert t.calls.pending_for(t.session) == [] and not t.calls.holds(t.session)


async def test_an_answer_is_stored_without_a_round_trip_and_builds_no_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """An answer takes its call's free claim at once: it reaches the store in the step it was
    made in (no scheduler round trip on the way). And the ends the server decides (the timeout,
    the caller's absence, the agent's cancel, the shutdown: their words and errors) are made only
    for a call that ends so, never for one its caller answers."""
    made: list[Any] = []
    monkeypatch.setattr(caller_tool_pending, "_timed_out", lambda *args: made.append(args))
    async with one_pending_call() as t:
        steps_before_store: list[int] = []
        append = t.calls._append_frame

        async def watched_append(session: Session, type: str, payload: dict[str, Any], **kw: Any) -> Any:
            steps_before_store.append(steps.count)
            return await append(session, type, payload, **kw)

        t.calls._append_frame = watched_append
        with counted_steps() as steps:
            await t.calls.respond(t.caller, "s1", t.call.request_id, {"ok": 1})
    assert t.outcome == [{"ok": 1}] and steps_before_store == [0]
    assert made == []


async def test_an_approval_takes_exactly_one_decision() -> None:
    log, session, caller = world()
    approvals = ApprovalService(log.append)
    decided: list[Decision] = []
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:

            async def gated() -> None:
                decided.append(await approvals.request(session, "notify", {}, origin="caller", caller=caller))

            nursery.start_soon(gated)
            [entry] = await approvals.wait_pending(session)
            await approvals.answer(caller, "s1", entry.request_id, Decision(approve=True, who="caller"))
            again = await approvals.answer(caller, "s1", entry.request_id, Decision(approve=True, who="caller"))
            assert again["already_resolved"] is True  # an identical retry
            with pytest.raises(RelayError, match="already resolved: approved"):
                await approvals.answer(caller, "s1", entry.request_id, Decision(approve=False, who="caller"))
    assert [d.approve for d in decided] == [True]
    assert log.types() == ["approval_request", "approval_resolved"]


async def test_the_deadline_ends_a_call_and_an_approval(autojump_clock: trio.testing.MockClock) -> None:
    log, session, caller = world()
    calls = CallerCallRegistry(log.append, default_timeout=10)
    approvals = ApprovalService(log.append, default_timeout=5)
    outcome: list[Any] = []
    async with trio.open_nursery() as nursery:
        await relay_in_background(nursery, calls, session, outcome, timeout_ms=2000)
    [error] = outcome
    assert isinstance(error, RelayError) and error.code == errors.TIMEOUT
    decision = await approvals.request(session, "notify", {}, origin="caller", caller=caller)
    assert (decision.approve, decision.who) == (False, "timeout")
    assert log.frames[1].payload["reason"] == "timeout"
    assert log.types() == ["caller_tool_request", "caller_tool_cancelled", "approval_request", "approval_resolved"]


async def test_the_owner_disconnecting_ends_its_requests() -> None:
    log, session, caller = world()
    calls = CallerCallRegistry(log.append, default_timeout=10)
    approvals = ApprovalService(log.append)
    outcome: list[Any] = []
    decided: list[Decision] = []
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await relay_in_background(nursery, calls, session, outcome)

            async def gated() -> None:
                decided.append(await approvals.request(session, "notify", {}, origin="caller", caller=caller))

            nursery.start_soon(gated)
            await calls.wait_pending(session)
            await approvals.wait_pending(session)
            assert calls.fail_caller(caller) + approvals.fail_caller(caller) == 2
    [error] = outcome
    assert isinstance(error, RelayError) and error.code == errors.PEER_DISCONNECTED
    assert (decided[0].approve, decided[0].who) == (False, "disconnect")


async def test_the_agents_cancel_ends_a_call_and_a_late_answer_is_told() -> None:
    async with one_pending_call() as t:
        t.scope.cancel()
    with pytest.raises(NoLongerPending, match="cancelled by the agent"):
        await t.calls.respond(t.caller, "s1", t.call.request_id, {"ok": 1})
    assert t.outcome == []
    assert t.log.frames[-1].type == "caller_tool_cancelled"
    assert t.log.frames[-1].payload["reason"] == "cancelled by the agent"


async def test_the_servers_shutdown_is_stored_as_its_own_cause_not_the_agents_cancel() -> None:
    """The server stopping cancels everything with the reason `SERVER_SHUTDOWN` (program/runner.py):
    a caller tool request it ends records "server shutdown" and an approval `who: "server_shutdown"`; the
    agent's own cancel (no reason) still records "cancelled by the agent"."""
    log, session, caller = world()
    calls = CallerCallRegistry(log.append, default_timeout=10)
    approvals = ApprovalService(log.append, default_timeout=10)
    outcome: list[Any] = []
    with trio.fail_after(5):
        async with trio.open_nursery() as server:
            await relay_in_background(server, calls, session, outcome)

            async def gated() -> None:
                await approvals.request(session, "notify", {}, origin="caller", caller=caller)

            server.start_soon(gated)
            await calls.wait_pending(session)
            await approvals.wait_pending(session)
            server.cancel_scope.cancel(reason=SERVER_SHUTDOWN)
    ends = {f.type: f.payload for f in log.frames if f.type in ("caller_tool_cancelled", "approval_resolved")}
    assert ends["caller_tool_cancelled"]["reason"] == "server shutdown", ends
    assert (ends["approval_resolved"]["who"], ends["approval_resolved"]["approve"]) == ("server_shutdown", False), ends
    with pytest.raises(NoLongerPending, match="the server shut down"):
        [request] = [f for f in log.frames if f.type == "caller_tool_request"]
        await calls.respond(caller, "s1", request.payload["request_id"], {"ok": 1})
    async with one_pending_call() as t:
        t.scope.cancel()
    assert t.log.frames[-1].payload["reason"] == "cancelled by the agent", "the agent's cancel is still the agent's"


async def test_a_failed_store_leaves_the_request_pending_under_its_claim() -> None:
    async with one_pending_call() as t:
        t.log.failing.add("caller_tool_result")
        with pytest.raises(AnswerNotRecorded):
            await t.calls.respond(t.caller, "s1", t.call.request_id, {"ok": 1})
        assert t.calls.pending_for(t.session) == [t.call] and t.outcome == []
        t.log.failing.clear()
        await t.calls.respond(t.caller, "s1", t.call.request_id, {"ok": 2})
    assert t.outcome == [{"ok": 2}]


async def test_the_single_server_crossing_does_nothing() -> None:
    single = SingleServer()
    _, session, _ = world()
    made: list[Session] = []
    request: dict[str, Any] = {"request_id": "r1"}
    single.announce(request, expires_at="soon", progress=True)
    assert request == {"request_id": "r1"}
    assert await single.record_of(session) == (None, None) and await single.recorded_sessions("mcp", "s1") == []
    assert await single.session_record(lambda: made.append(session) or session) is None and made == []
    assert await single.read_new(RequestBook(single, ()).cursors, session, ("x",)) == []
    assert await single.owner_elsewhere(session, recorded_only=False) is False
    assert await single.recorded_owner(session) is None
    assert await single.outcome_of(session, "r1", 0, ("x",)) is None
    with trio.move_on_after(0.01) as waited:
        await single.wait_outcome(session, "r1", 0, ("x",))
    assert waited.cancelled_caught  # nobody else answers: only the caller's deadline ends it


async def test_a_book_wait_is_woken_by_a_change_only() -> None:
    _, session, _ = world()
    book: RequestBook[Any] = RequestBook(SingleServer(), ("approval_request",))
    entries: list[Any] = []
    seen: list[list[Any]] = []
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:

            async def sync(session: Session) -> None:
                await trio.lowlevel.checkpoint()

            async def waiter() -> None:
                seen.append(await book.wait_pending(session, sync, lambda s: list(entries)))

            nursery.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()
            assert seen == []
            entries.append(SimpleNamespace(request_id="r1", session=session, frame_seq=1))
            book.notify(session)
    assert [e.request_id for e in seen[0]] == ["r1"]


def test_a_book_remembers_a_bounded_number_of_ended_requests() -> None:
    book: RequestBook[Any] = RequestBook(SingleServer(), ())
    for n in range(RESOLVED_MEMORY + 5):
        book.remember(f"r{n}", n)
    assert len(book.finished) == RESOLVED_MEMORY and "r0" not in book.finished and f"r{RESOLVED_MEMORY + 4}" in book.finished


async def test_the_shared_store_crossing_announces_and_stores_through_the_log() -> None:
    stored: list[tuple[str, str]] = []

    async def append_outcome(session: Session, type: str, payload: dict[str, Any], request_id: str, **_: Any) -> Any:
        stored.append((type, request_id))
        return None if len(stored) > 1 else SimpleNamespace(seq=1, type=type, payload=payload)

    shared = SharedStore(SimpleNamespace(append_outcome=append_outcome), server_id="me")  # type: ignore[arg-type]
    _, session, _ = world()
    request: dict[str, Any] = {"request_id": "r1"}
    shared.announce(request, expires_at="soon", progress=None)
    assert request == {"request_id": "r1", "expires_at": "soon", "server": "me"}
    assert await shared.owner_elsewhere(session, recorded_only=False) is True
    assert await shared.store_outcome(None, session, "caller_tool_result", {"request_id": "r1"}) is not None  # type: ignore[arg-type]
    assert await shared.store_outcome(None, session, "caller_tool_cancelled", {"request_id": "r1"}) is None  # type: ignore[arg-type]
    assert stored == [("caller_tool_result", "r1"), ("caller_tool_cancelled", "r1")]


async def test_each_relayed_call_ends_with_one_log_line_naming_its_outcome(
    caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock,
) -> None:
    """Answered, timed out, cancelled by the agent, the caller gone: one INFO line each, with the
    instance, session, request id, tool, outcome and duration, never the arguments or the result."""
    caplog.set_level(logging.INFO, logger="oubliette.server.calls")
    async with one_pending_call() as t:
        await t.calls.respond(t.caller, "s1", t.call.request_id, {"secret": "the result"})
    answered = t.call.request_id
    log, session, caller = world()
    calls = CallerCallRegistry(log.append, default_timeout=10)
    outcome: list[Any] = []
    async with trio.open_nursery() as nursery:
        await relay_in_background(nursery, calls, session, outcome, timeout_ms=2000)
    async with one_pending_call() as t:
        t.scope.cancel()
    cancelled = t.call.request_id
    async with one_pending_call() as t:
        t.calls.fail_caller(t.caller)
    gone = t.call.request_id
    lines = [r.getMessage() for r in caplog.records if r.name == "oubliette.server.calls" and "ended:" in r.message]
    assert len(lines) == 4, lines
    assert lines[0].startswith(f"caller tool request {answered} ended: resolved (instance box1, session mcp:s1, tool notify, ")
    assert "ended: timed out (instance box1, session mcp:s1, tool notify, 2000.0 ms)" in lines[1], lines[1]
    assert lines[2].startswith(f"caller tool request {cancelled} ended: cancelled by the agent (instance box1"), lines[2]
    assert lines[3].startswith(f"caller tool request {gone} ended: closed: the caller disconnected (instance box1"), lines[3]
    assert all(line.endswith(" ms)") for line in lines) and not any("the result" in line for line in lines)


async def test_an_ended_approval_remembers_a_digest_of_the_callers_values_not_the_values() -> None:
    """A decided approval is remembered (for retries) up to RESOLVED_MEMORY times: it keeps the
    digest of its `updated_arguments`, not the values (up to max_payload_bytes each); a retry with
    the same values is still an idempotent success, another is still refused."""
    log, session, caller = world()
    approvals = ApprovalService(log.append)
    big = {"path": "/tmp/x", "blob": "x" * 100_000}
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: approvals.request(session, "notify", {}, origin="caller", caller=caller))
            [entry] = await approvals.wait_pending(session)
            await approvals.answer(caller, "s1", entry.request_id, Decision(approve=True, who="caller", updated_arguments=big))
    remembered = approvals._finished[entry.request_id].decision
    assert remembered.updated_arguments is None and remembered.tool_return is None and remembered.content is None
    assert remembered.answer_digest is not None and len(remembered.answer_digest) == 64
    retry = await approvals.answer(caller, "s1", entry.request_id, Decision(
        approve=True, who="caller", updated_arguments={"blob": "x" * 100_000, "path": "/tmp/x"}))  # keys in another order
    assert retry["already_resolved"] is True
    assert (await approvals.answer(caller, "s1", entry.request_id, Decision(approve=True, who="caller")))["already_resolved"]
    with pytest.raises(RelayError, match="already resolved: approved"):
        await approvals.answer(caller, "s1", entry.request_id, Decision(
            approve=True, who="caller", updated_arguments={**big, "path": "/tmp/y"}))
    assert log.frames[-1].payload["updated_arguments"] == big, "the log keeps the whole decision"
