"""Store first, then answer: an outcome reaches the agent only once its frame is stored.

Services alone, on the real in-memory frame store behind a wrapper whose appends fail on
demand (`FaultyStore`): a caller's answer the store could not write is not delivered, the
caller is told to send it again, the request stays pending, and a retry after the store
recovers delivers exactly once. Ends the server decides (timeout, the agent's cancel, the
caller leaving) agree on both sides whether or not their frame could be stored.
(The same with the real programs, on SQLite and PostgreSQL: tests/e2e/test_faults.py.)
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from oubliette_server.features.approvals.service import ApprovalService, Decision, PendingApproval
from oubliette_server.features.cluster.log_bus import LogBus
from oubliette_server.core.pending_requests import SharedStore
from oubliette_server.features.caller_tool_relay.pending import CallerCallRegistry, PendingCall
from oubliette_server.core.callers import CallerConnection
from oubliette_server.core.frame_log import FrameLog
from oubliette_server.core.sessions import Session, SessionRegistry
from oubliette_server.store.sqlite import FrameStore
from oubliette_server.store.api import AnswerNotRecorded, FrameQuery, StoreUnavailable
from protocol import RelayError, errors
from protocol.messages import CallerToolSpec

OUTCOMES = ("caller_tool_request", "caller_tool_result", "caller_tool_cancelled", "approval_request", "approval_resolved")


class FaultyStore:
    """The in-memory SQLite store, whose appends fail while `failing` is set (a database outage,
    a full disk); `lost_ack` makes the next append commit and then fail anyway (PostgreSQL killed
    after the commit: the statement's fate is unknown to the server)."""

    def __init__(self) -> None:
        self.store = FrameStore.in_memory()
        self.failing = False
        self.lost_ack = False
        self.attempts: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def _fault(self, type: str) -> None:
        self.attempts.append(type)
        if self.failing:
            raise StoreUnavailable("the test store is unavailable")

    async def append(self, instance: str, **kw: Any) -> Any:
        """`FrameStore.append`, or `StoreUnavailable` while failing."""
        self._fault(kw["type"])
        return await self.store.append(instance, **kw)

    async def append_outcome(self, instance: str, request_id: str, **kw: Any) -> Any:
        """`FrameStore.append_outcome`, or `StoreUnavailable` while failing (after the commit with `lost_ack`)."""
        self._fault(kw["type"])
        frame = await self.store.append_outcome(instance, request_id, **kw)
        if self.lost_ack:
            self.lost_ack = False
            raise StoreUnavailable("the test store did not confirm the commit")
        return frame

    async def outcomes(self) -> list[tuple[str, str]]:
        """`(type, request_id)` of every request and outcome frame stored, in order."""
        frames = await self.store.query("box1", FrameQuery(after_seq=0, types=OUTCOMES, limit=200))
        return [(f.type, f.payload["request_id"]) for f in frames]


def world(shared: bool = False) -> tuple[FaultyStore, FrameLog, Session, CallerConnection]:
    """A faulty store, its frame log, and session `s1` of box1 owned by a caller."""
    store = FaultyStore()
    frame_log = FrameLog(store, SessionRegistry())  # type: ignore[arg-type]
    caller = CallerConnection("stdio")
    session = Session(instance="box1", channel="mcp", id="s1", caller_id="myapp", owner=caller)
    return store, frame_log, session, caller


def registry_of(frame_log: FrameLog, store: FaultyStore, shared: bool = False, timeout: float = 600) -> CallerCallRegistry:
    crossing = SharedStore(LogBus(store, frame_log.append_outcome)) if shared else None  # type: ignore[arg-type]
    return CallerCallRegistry(frame_log.append, default_timeout=timeout, crossing=crossing)


SPEC = CallerToolSpec(name="notify")


async def refused_answer(registry: CallerCallRegistry, caller: CallerConnection, call: PendingCall) -> str:
    """Answer `call` while the store fails: the message of the refusal the caller gets."""
    with pytest.raises(AnswerNotRecorded) as refused:
        await registry.respond(caller, "s1", call.request_id, {"ok": True})
    return refused.value.message


class AgentCall:
    """The agent's relayed call, run in the background: `outcome` is its result or its error."""

    def __init__(self, registry: CallerCallRegistry, session: Session, spec: CallerToolSpec = SPEC) -> None:
        self.registry = registry
        self.session = session
        self.spec = spec
        self.outcomes: list[Any] = []
        self.scope = trio.CancelScope()

    async def start(self, nursery: trio.Nursery) -> PendingCall:
        """Make the call in `nursery`; its pending entry, once its request is stored."""
        nursery.start_soon(self.run)
        [call] = await self.registry.wait_pending(self.session)
        return call

    async def run(self) -> None:
        """Relay the call; record what the agent got (a result, a `RelayError`, or "cancelled")."""
        with self.scope:
            try:
                self.outcomes.append(await self.registry.relay(self.session, self.spec, {"message": "hi"}))
            except RelayError as err:
                self.outcomes.append(err)
            return
        self.outcomes.append("cancelled")


@pytest.mark.parametrize("shared", [False, True], ids=["one-server", "shared-store"])
async def test_an_answer_the_store_could_not_write_is_not_delivered_and_a_retry_delivers_it_once(shared: bool) -> None:
    store, frame_log, session, caller = world()
    registry = registry_of(frame_log, store, shared)
    agent = AgentCall(registry, session)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            call = await agent.start(nursery)
            store.failing = True
            message = await refused_answer(registry, caller, call)
            assert "was not recorded, so it was not delivered" in message and "the test store is unavailable" in message
            assert f"'{call.request_id}' is still pending until {call.expires_at}" in message
            assert message.endswith("send caller_tool_response again")
            await trio.testing.wait_all_tasks_blocked()
            assert agent.outcomes == [], "the agent got an answer the log does not have"
            assert [p.request_id for p in registry.pending_for(session)] == [call.request_id], "it stays pending"

            store.failing = False
            await registry.respond(caller, "s1", call.request_id, {"ok": True})
    assert agent.outcomes == [{"ok": True}]
    assert await store.outcomes() == [("caller_tool_request", call.request_id), ("caller_tool_result", call.request_id)]
    with pytest.raises(RelayError, match="no longer pending: it was already resolved"):
        await registry.respond(caller, "s1", call.request_id, {"ok": True})


async def test_an_answer_whose_commit_was_not_confirmed_is_delivered_once_by_its_retry() -> None:
    """Shared store: the database committed the answer but the server never heard (PostgreSQL killed
    right then). The agent, waiting in the log, may hear the stored answer at once; the caller, told
    to retry, sends it again: the stored answer stands, the agent gets it once, and the retry is a
    success, not a refusal of its own answer (a different answer is refused)."""
    store, frame_log, session, caller = world()
    registry = registry_of(frame_log, store, shared=True)
    agent = AgentCall(registry, session)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            call = await agent.start(nursery)
            store.lost_ack = True
            await refused_answer(registry, caller, call)
            await trio.testing.wait_all_tasks_blocked()
            await registry.respond(caller, "s1", call.request_id, {"ok": True})
            with pytest.raises(RelayError, match="no longer pending: it was already resolved"):
                await registry.respond(caller, "s1", call.request_id, {"ok": False})
    assert agent.outcomes == [{"ok": True}]
    assert await store.outcomes() == [("caller_tool_request", call.request_id), ("caller_tool_result", call.request_id)]


async def stored_within(store: FaultyStore, seconds: float, *expected: tuple[str, str]) -> None:
    """Wait (the mock clock's seconds) until the log's requests and outcomes are `expected`,
    looked at again as each frame is stored (the store's long poll)."""
    with trio.fail_after(seconds):
        while True:
            seen = await store.last_seq("box1")
            if await store.outcomes() == list(expected):
                return
            await store.wait_for_frames("box1", FrameQuery(after_seq=seen), seconds)


async def test_the_timeout_after_a_failed_answer_fails_the_call_for_both_sides(autojump_clock: trio.testing.MockClock) -> None:
    """The store is still down at the timeout: the agent hears it timed out all the same, a late
    answer is refused with that, and the timeout is stored once the store is back."""
    store, frame_log, session, caller = world()
    registry = registry_of(frame_log, store, timeout=30)
    agent = AgentCall(registry, session)
    async with trio.open_nursery() as server:
        await server.start(registry.serve)
        async with trio.open_nursery() as nursery:
            call = await agent.start(nursery)
            store.failing = True
            await refused_answer(registry, caller, call)
        [outcome] = agent.outcomes
        assert isinstance(outcome, RelayError) and outcome.code == errors.TIMEOUT
        await trio.sleep(60)
        assert await store.outcomes() == [("caller_tool_request", call.request_id)], "nothing stored in the outage"
        store.failing = False
        with pytest.raises(RelayError, match="no longer pending: it was already timed out"):
            await registry.respond(caller, "s1", call.request_id, {"ok": True})
        await stored_within(store, 60, ("caller_tool_request", call.request_id), ("caller_tool_cancelled", call.request_id))
        server.cancel_scope.cancel()


async def test_an_answer_being_stored_at_the_timeout_wins_if_stored(autojump_clock: trio.testing.MockClock) -> None:
    """The timeout waits for an answer whose frame is being stored: stored, the answer is the call's."""
    store, frame_log, session, caller = world()
    registry = registry_of(frame_log, store, timeout=30)
    agent = AgentCall(registry, session)
    commit = trio.Event()
    real_append = store.append

    async def slow_append(instance: str, **kw: Any) -> Any:
        if kw["type"] == "caller_tool_result":
            await commit.wait()
        return await real_append(instance, **kw)

    store.append = slow_append  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        call = await agent.start(nursery)
        nursery.start_soon(registry.respond, caller, "s1", call.request_id, {"ok": True})
        await trio.sleep(60)  # past the timeout, the answer's commit still held back
        assert agent.outcomes == []
        commit.set()
    assert agent.outcomes == [{"ok": True}]
    assert await store.outcomes() == [("caller_tool_request", call.request_id), ("caller_tool_result", call.request_id)]


async def test_the_agents_cancel_after_a_failed_answer_is_the_calls_end() -> None:
    store, frame_log, session, caller = world()
    registry = registry_of(frame_log, store)
    agent = AgentCall(registry, session)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            call = await agent.start(nursery)
            store.failing = True
            await refused_answer(registry, caller, call)
            store.failing = False
            agent.scope.cancel()
    assert agent.outcomes == ["cancelled"]
    with pytest.raises(RelayError, match="no longer pending: it was already cancelled by the agent"):
        await registry.respond(caller, "s1", call.request_id, {"ok": True})
    assert await store.outcomes() == [("caller_tool_request", call.request_id), ("caller_tool_cancelled", call.request_id)]


async def test_a_caller_that_leaves_while_its_answer_fails_to_store_ends_the_call_as_a_disconnect() -> None:
    store, frame_log, session, caller = world()
    registry = registry_of(frame_log, store)
    agent = AgentCall(registry, session)
    real_append = store.append

    async def leaving_append(instance: str, **kw: Any) -> Any:
        if kw["type"] == "caller_tool_result":
            caller.close()
            assert registry.fail_caller(caller) == 1
            raise StoreUnavailable("the test store is unavailable")
        return await real_append(instance, **kw)

    store.append = leaving_append  # type: ignore[method-assign]
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            call = await agent.start(nursery)
            await refused_answer(registry, caller, call)
    [outcome] = agent.outcomes
    assert isinstance(outcome, RelayError) and outcome.code == errors.PEER_DISCONNECTED
    frames = await store.store.query("box1", FrameQuery(after_seq=0, types=("caller_tool_cancelled",), limit=10))
    assert [f.payload["reason"] for f in frames] == ["caller disconnected"]


# -- approvals -------------------------------------------------------------------------------


class GatedCall:
    """A gated call waiting for its approval, run in the background: `decisions` is what it got."""

    def __init__(self, approvals: ApprovalService, session: Session, caller: CallerConnection, timeout: float = 600) -> None:
        self.approvals = approvals
        self.session = session
        self.caller = caller
        self.timeout = timeout
        self.decisions: list[Decision] = []

    async def start(self, nursery: trio.Nursery) -> PendingApproval:
        """Make the gated call in `nursery`; its pending approval, once its request is stored."""
        nursery.start_soon(self.run)
        [entry] = await self.approvals.wait_pending(self.session)
        return entry

    async def refused(self, entry: PendingApproval, decision: Decision) -> str:
        """Decide `entry` while the store fails: the message of the refusal the caller gets."""
        with pytest.raises(AnswerNotRecorded) as refused:
            await self.approvals.answer(self.caller, "s1", entry.request_id, decision)
        return refused.value.message

    async def run(self) -> None:
        """Ask for the approval; record the decision the call got."""
        self.decisions.append(await self.approvals.request(
            self.session, "notify", {"message": "hi"}, origin="caller", caller=self.caller, timeout=self.timeout,
        ))


async def test_a_decision_the_store_could_not_write_is_not_delivered_and_a_retry_delivers_it_once() -> None:
    store, frame_log, session, caller = world()
    approvals = ApprovalService(frame_log.append)
    gated = GatedCall(approvals, session, caller)
    approve = Decision(approve=True, who="caller")
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            entry = await gated.start(nursery)
            store.failing = True
            message = await gated.refused(entry, approve)
            assert message.endswith("send approval_response again")
            assert f"'{entry.request_id}' is still pending until {entry.expires_at}" in message
            await trio.testing.wait_all_tasks_blocked()
            assert gated.decisions == [], "the gated call was decided by a decision the log does not have"
            assert approvals.pending_for(session) == [entry]

            store.failing = False
            answered = await approvals.answer(caller, "s1", entry.request_id, approve)
            assert answered["resolved"] is True and "already_resolved" not in answered
    assert [d.approve for d in gated.decisions] == [True]
    assert await store.outcomes() == [("approval_request", entry.request_id), ("approval_resolved", entry.request_id)]


async def test_a_batch_the_store_fails_midway_says_which_decisions_stand_and_its_retry_completes_it() -> None:
    store, frame_log, session, caller = world()
    approvals = ApprovalService(frame_log.append)
    first, second = GatedCall(approvals, session, caller), GatedCall(approvals, session, caller)
    real_append = store.append
    resolved = 0

    async def append_once(instance: str, **kw: Any) -> Any:
        nonlocal resolved
        if kw["type"] == "approval_resolved":
            resolved += 1
            if resolved == 2:
                raise StoreUnavailable("the test store is unavailable")
        return await real_append(instance, **kw)

    store.append = append_once  # type: ignore[method-assign]
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(first.run)
            await approvals.wait_pending(session)
            nursery.start_soon(second.run)
            while len(approvals.pending_for(session)) < 2:
                await approvals.wait_changed(session)
            ids = [p.request_id for p in approvals.pending_for(session)]
            batch = [(request_id, Decision(approve=True, who="caller")) for request_id in ids]
            with pytest.raises(StoreUnavailable) as refused:
                await approvals.answer_batch(caller, session, batch)
            assert f"approvals {ids[0]} were recorded" in refused.value.message
            assert refused.value.message.endswith("send approval_response again")
            await trio.testing.wait_all_tasks_blocked()
            assert len(first.decisions + second.decisions) == 1
            await approvals.answer_batch(caller, session, batch)
    assert [d.approve for d in first.decisions + second.decisions] == [True, True]
    assert [t for t, _ in await store.outcomes()].count("approval_resolved") == 2


async def test_the_approval_timeout_while_the_store_is_down_denies_on_both_sides(autojump_clock: trio.testing.MockClock) -> None:
    store, frame_log, session, caller = world()
    approvals = ApprovalService(frame_log.append)
    gated = GatedCall(approvals, session, caller, timeout=30)
    async with trio.open_nursery() as server:
        await server.start(approvals.serve)
        async with trio.open_nursery() as nursery:
            entry = await gated.start(nursery)
            store.failing = True
        [decision] = gated.decisions
        assert (decision.approve, decision.who) == (False, "timeout"), "the denial stands though it could not be stored"
        store.failing = False
        with pytest.raises(RelayError, match="already resolved: denied \\(timeout\\)"):
            await approvals.answer(caller, "s1", entry.request_id, Decision(approve=True, who="caller"))
        await stored_within(store, 60, ("approval_request", entry.request_id), ("approval_resolved", entry.request_id))
        server.cancel_scope.cancel()


# -- a shared store: the agent's server and the caller's are two --------------------------------


class TwoServers:
    """Two servers on one shared store: the agent's (no caller for the session: it waits in the
    log) and the caller's (lists the agent's request read from the log, and answers it there)."""

    def __init__(self, timeout: float = 30) -> None:
        self.store, agent_log, self.agent_session, self.caller = world()
        self.caller_session = Session(instance="box1", channel="mcp", id="s1", caller_id="myapp", owner=self.caller)
        self.agent_session.owner = None
        caller_log = FrameLog(self.store, SessionRegistry())  # type: ignore[arg-type]
        self.agent_side = registry_of(agent_log, self.store, shared=True, timeout=timeout)
        self.caller_side = CallerCallRegistry(
            caller_log.append, default_timeout=timeout, crossing=SharedStore(LogBus(self.store, caller_log.append_outcome)),  # type: ignore[arg-type]
            find_sessions=lambda session_id: [self.caller_session],
        )
        self.agent = AgentCall(self.agent_side, self.agent_session)

    async def start(self, nursery: trio.Nursery) -> PendingCall:
        """The agent's call, as the caller's server lists it."""
        nursery.start_soon(self.agent.run)
        [call] = await self.caller_side.wait_pending(self.caller_session)
        return call


async def test_a_timeout_the_store_could_not_write_refuses_a_later_answer_on_the_callers_server() -> None:
    """The agent's server times the call out while the database is down: the agent hears "timed out",
    and the caller's server, past the request's `expires_at`, refuses the answer that would have
    told the caller "resolved" (nothing is stored for either). (A real clock: `expires_at` is wall time.)"""
    two = TwoServers(timeout=0.5)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            call = await two.start(nursery)
            two.store.failing = True
    [outcome] = two.agent.outcomes
    assert isinstance(outcome, RelayError) and outcome.code == errors.TIMEOUT
    two.store.failing = False
    with pytest.raises(RelayError, match="no longer pending: it was already timed out"):
        await two.caller_side.respond(two.caller, "s1", call.request_id, {"ok": True})
    assert await two.store.outcomes() == [("caller_tool_request", call.request_id)]


async def test_an_outage_while_the_agents_server_waits_in_the_log_does_not_end_the_wait(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Reading the log fails for a while: the agent's server reads again until its deadline, and
    the caller's answer stored after the outage reaches the agent."""
    two = TwoServers(timeout=600)
    real_wait = two.store.store.wait_for_frames
    outage = trio.Event()
    reads_failed = 0

    async def wait_for_frames(instance: str, q: FrameQuery, timeout: float) -> Any:
        nonlocal reads_failed
        if not outage.is_set():
            reads_failed += 1
            raise StoreUnavailable("the test store is unavailable")
        return await real_wait(instance, q, timeout)

    two.store.wait_for_frames = wait_for_frames  # type: ignore[attr-defined]
    with trio.fail_after(60):  # the mock clock's seconds
        async with trio.open_nursery() as nursery:
            nursery.start_soon(two.agent.run)
            while reads_failed < 3:
                await trio.sleep(1)
                assert two.agent.outcomes == [], "the outage ended the agent's wait"
            outage.set()
            [call] = await two.caller_side.wait_pending(two.caller_session)
            await two.caller_side.respond(two.caller, "s1", call.request_id, {"ok": True})
    assert two.agent.outcomes == [{"ok": True}]


async def test_a_timeout_that_loses_to_an_answer_stored_first_gives_the_agent_that_answer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The caller's answer is committed on the caller's server, and the agent's server times the call
    out before it has read that answer from the log: its timeout, stored with `append_outcome`,
    loses, and the agent gets the stored answer, as every server reports it."""
    two = TwoServers(timeout=600)

    async def not_read_yet(*args: Any, **kwargs: Any) -> Any:
        await trio.sleep_forever()

    two.agent_side.crossing.wait_outcome = not_read_yet  # type: ignore[method-assign]
    with trio.fail_after(1200):  # the mock clock's seconds
        async with trio.open_nursery() as nursery:
            call = await two.start(nursery)
            await two.caller_side.respond(two.caller, "s1", call.request_id, {"ok": True})
    assert two.agent.outcomes == [{"ok": True}]
    assert await two.store.outcomes() == [("caller_tool_request", call.request_id), ("caller_tool_result", call.request_id)]


def two_approval_servers() -> tuple[FaultyStore, CallerConnection, Session, Session, ApprovalService, ApprovalService]:
    """A gated call's server, no owner connected there, and the owner's server, on one store: the
    store, the owner, the session as each server holds it, and each server's approvals."""
    store, agent_log, agent_session, caller = world()
    agent_session.owner, agent_session.owner_identity = None, "the owner, connected to the other server"
    owner_session = Session(instance="box1", channel="mcp", id="s1", caller_id="myapp", owner=caller)
    owner_log = FrameLog(store, SessionRegistry())  # type: ignore[arg-type]
    gated_side = ApprovalService(agent_log.append, crossing=SharedStore(LogBus(store, agent_log.append_outcome)))  # type: ignore[arg-type]
    owner_side = ApprovalService(owner_log.append, crossing=SharedStore(LogBus(store, owner_log.append_outcome)))  # type: ignore[arg-type]
    return store, caller, agent_session, owner_session, gated_side, owner_side


async def test_an_approval_timeout_the_store_could_not_write_refuses_a_later_decision_on_the_owners_server() -> None:
    """As for caller tools: the gated call's server denies at its timeout though the database is
    down, and the owner's server refuses a later approval (past `expires_at`) that would have told
    the caller "resolved" while nothing ran. (A real clock: `expires_at` is wall time.)"""
    store, caller, agent_session, owner_session, gated_side, owner_side = two_approval_servers()
    gated = GatedCall(gated_side, agent_session, None, timeout=0.5)  # type: ignore[arg-type]
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(gated.run)
            [entry] = await owner_side.wait_pending(owner_session)
            store.failing = True
    [decision] = gated.decisions
    assert (decision.approve, decision.who) == (False, "timeout")
    store.failing = False
    with pytest.raises(RelayError, match="already resolved: denied \\(timeout\\): it expired at"):
        await owner_side.answer(caller, "s1", entry.request_id, Decision(approve=True, who="caller"))
    assert await store.outcomes() == [("approval_request", entry.request_id)]


async def test_an_approval_timeout_that_loses_to_a_decision_stored_first_gives_the_call_that_decision(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """As for caller tools: the owner's approval is committed on its server, and the gated call's
    server denies at its timeout before it has read that decision from the log: its denial loses,
    and the call is approved, as the log says."""
    store, caller, agent_session, owner_session, gated_side, owner_side = two_approval_servers()

    async def not_read_yet(*args: Any, **kwargs: Any) -> Any:
        await trio.sleep_forever()

    gated_side.crossing.wait_outcome = not_read_yet  # type: ignore[method-assign]
    gated = GatedCall(gated_side, agent_session, None, timeout=600)  # type: ignore[arg-type]
    with trio.fail_after(1200):  # the mock clock's seconds
        async with trio.open_nursery() as nursery:
            nursery.start_soon(gated.run)
            [entry] = await owner_side.wait_pending(owner_session)
            await owner_side.answer(caller, "s1", entry.request_id, Decision(approve=True, who="caller"))
    [decision] = gated.decisions
    assert (decision.approve, decision.who) == (True, "caller")
    assert await store.outcomes() == [("approval_request", entry.request_id), ("approval_resolved", entry.request_id)]


async def test_a_decision_whose_commit_was_not_confirmed_is_an_idempotent_retry() -> None:
    """Shared store, the owner on the gated call's server: the approval was committed but the server
    never heard; the caller's retry finds it stored, the gated call is decided once, the retry succeeds."""
    store, frame_log, session, caller = world()
    approvals = ApprovalService(frame_log.append, crossing=SharedStore(LogBus(store, frame_log.append_outcome)))  # type: ignore[arg-type]
    gated = GatedCall(approvals, session, caller)
    approve = Decision(approve=True, who="caller")
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            entry = await gated.start(nursery)
            store.lost_ack = True
            await gated.refused(entry, approve)
            await trio.testing.wait_all_tasks_blocked()  # the gated call, waiting in the log, may hear it now
            answered = await approvals.answer(caller, "s1", entry.request_id, approve)
            assert answered["resolved"] is True, answered
            with pytest.raises(RelayError, match="already resolved: approved"):
                await approvals.answer(caller, "s1", entry.request_id, Decision(approve=False, who="caller"))
    assert [d.approve for d in gated.decisions] == [True]
    assert await store.outcomes() == [("approval_request", entry.request_id), ("approval_resolved", entry.request_id)]
