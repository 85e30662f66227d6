"""Approvals (docs/APPROVALS.md): a gated caller tool runs only after its owner's decision.

In process: `OublietteServer` in the test's nursery, the caller API driven directly
(`CallerApi`), the agent's `caller_tool` call over the relay socket through `RelayLink`
(what `oubliette-client` sends), as in tests/server/features/test_caller_tool_answers.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from harness import Deployment, structured, text_of
from protocol import errors
from in_process_calls import INSTANCE, SESSION, InProcess, in_process
from approval_calls import DELETE, AgentCall, answer, gated_session, stored

pytestmark = pytest.mark.in_process

PUBLISHED = "myapp_delete_file"


# -- one decision -----------------------------------------------------------------------


async def test_approve_then_the_call_is_relayed(deployment: Deployment) -> None:
    async with in_process(deployment) as proc:
        owner, events, link = await gated_session(proc, deployment)
        call = AgentCall(proc.nursery, link, "delete_file", {"path": "/tmp/x"})
        request = await events.wait_type("approval_request")
        assert request["request_id"].startswith("apr-")
        assert request["tool_name"] == PUBLISHED and request["arguments"] == {"path": "/tmp/x"}
        assert request["origin"] == "caller" and request["expires_at"].endswith("Z")
        await trio.testing.wait_all_tasks_blocked()
        assert await stored(proc, "caller_tool_request") == [], "nothing runs before the decision"

        approved = await answer(proc, owner, request_id=request["request_id"], approve=True)
        assert structured(approved) == {"resolved": True}
        resolved = await events.wait_type("approval_resolved", request_id=request["request_id"])
        assert (resolved["approve"], resolved["who"], resolved["reason"]) == (True, owner.id, None)

        relayed = await events.wait_type("caller_tool_request")
        assert relayed["arguments"] == {"path": "/tmp/x"}
        assert resolved["seq"] < relayed["seq"]
        done = await proc.call(owner, "caller_tool_response", {
            "session_id": SESSION, "request_id": relayed["request_id"], "result": {"deleted": True},
        })
        assert not done.is_error, text_of(done)
        assert (await call.outcome()).result == {"result": {"deleted": True}}
        assert proc.server.approvals.pending == {}


async def test_deny_with_a_reason_reaches_the_agent_and_nothing_runs(deployment: Deployment) -> None:
    async with in_process(deployment) as proc:
        owner, events, link = await gated_session(proc, deployment)
        call = AgentCall(proc.nursery, link, "delete_file", {"path": "/tmp/x"})
        request = await events.wait_type("approval_request")
        denied = await answer(proc, owner, request_id=request["request_id"], approve=False, reason="not today")
        assert structured(denied) == {"resolved": True}
        await call.outcome()
        assert call.error is not None and call.error.code == errors.DENIED
        assert "not today" in call.error.message and PUBLISHED in call.error.message
        resolved = await events.wait_type("approval_resolved")
        assert (resolved["approve"], resolved["reason"], resolved["who"]) == (False, "not today", owner.id)
        assert await stored(proc, "caller_tool_request") == []


@pytest.mark.parametrize("status", ["success", "error"])
async def test_a_tool_return_answers_the_call_directly(deployment: Deployment, status: str) -> None:
    async with in_process(deployment) as proc:
        owner, events, link = await gated_session(proc, deployment)
        call = AgentCall(proc.nursery, link, "delete_file", {"path": "/tmp/x"})
        request = await events.wait_type("approval_request")
        tool_return = "deleted by the client" if status == "success" else "disk is read-only"
        done = await answer(proc, owner, approvals=[
            {"type": "tool", "tool_call_id": request["request_id"], "tool_return": tool_return, "status": status},
        ])
        assert structured(done) == {"resolved": True}
        await call.outcome()
        if status == "success":
            assert call.result == {"result": "deleted by the client"}
        else:
            assert call.error is not None and call.error.code == errors.TOOL_ERROR
            assert call.error.message == "disk is read-only"
        resolved = await events.wait_type("approval_resolved")
        assert (resolved["kind"], resolved["tool_return"], resolved["status"]) == ("tool", tool_return, status)
        assert await stored(proc, "caller_tool_request") == [], "no caller_tool_request round trip"


async def test_updated_arguments_are_checked_against_the_schema_then_used(deployment: Deployment) -> None:
    async with in_process(deployment) as proc:
        owner, events, link = await gated_session(proc, deployment)
        call = AgentCall(proc.nursery, link, "delete_file", {"path": "/tmp/everything"})
        request = await events.wait_type("approval_request")
        bad = await answer(proc, owner, request_id=request["request_id"], approve=True,
                           updated_arguments={"path": "/etc/passwd"})
        assert bad.is_error
        assert "updated_arguments do not match the inputSchema of 'myapp_delete_file'" in text_of(bad), text_of(bad)
        assert "still pending" in text_of(bad)
        assert list(proc.server.approvals.pending) == [request["request_id"]]
        assert not call.finished.is_set()

        good = await answer(proc, owner, request_id=request["request_id"], approve=True,
                            updated_arguments={"path": "/tmp/one-file"})
        assert structured(good) == {"resolved": True}
        resolved = await events.wait_type("approval_resolved")
        assert resolved["updated_arguments"] == {"path": "/tmp/one-file"}
        relayed = await events.wait_type("caller_tool_request")
        assert relayed["arguments"] == {"path": "/tmp/one-file"}
        await proc.call(owner, "caller_tool_response", {"session_id": SESSION, "request_id": relayed["request_id"], "result": "ok"})
        assert (await call.outcome()).result == {"result": "ok"}


# -- batches and re-answers -----------------------------------------------------------------


async def test_batch_must_cover_exactly_the_pending_ids_and_takes_mixed_decisions(deployment: Deployment) -> None:
    async with in_process(deployment) as proc:
        owner, events, link = await gated_session(proc, deployment)
        first = AgentCall(proc.nursery, link, "delete_file", {"path": "/tmp/a"})
        one = await events.wait_type("approval_request")
        second = AgentCall(proc.nursery, link, "delete_file", {"path": "/tmp/b"})
        two = await events.wait_for(lambda e: e.get("type") == "approval_request" and e["request_id"] != one["request_id"])
        by_path = {one["arguments"]["path"]: one["request_id"], two["arguments"]["path"]: two["request_id"]}

        partial = await answer(proc, owner, approvals=[
            {"type": "approval", "tool_call_id": by_path["/tmp/a"], "approve": False, "reason": "no"},
        ])
        assert partial.is_error
        for request_id in by_path.values():
            assert request_id in text_of(partial), text_of(partial)
        assert "nothing was decided" in text_of(partial)
        unknown = await answer(proc, owner, approvals=[
            {"type": "approval", "tool_call_id": "apr-0000000000000000", "approve": True},
        ])
        assert unknown.is_error and "unknown approval request_id 'apr-0000000000000000'" in text_of(unknown)
        assert sorted(proc.server.approvals.pending) == sorted(by_path.values())

        mixed = await answer(proc, owner, approvals=[
            {"type": "approval", "tool_call_id": by_path["/tmp/a"], "approve": False, "reason": "keep a"},
            {"type": "tool", "tool_call_id": by_path["/tmp/b"], "tool_return": {"deleted": "b"}, "status": "success"},
        ])
        assert structured(mixed) == {"resolved": True}
        await first.outcome()
        await second.outcome()
        assert first.error is not None and first.error.code == errors.DENIED and "keep a" in first.error.message
        assert second.result == {"result": {"deleted": "b"}}
        assert len(await stored(proc, "approval_resolved")) == 2


async def test_identical_re_answer_is_idempotent_and_a_contradicting_one_is_refused(deployment: Deployment) -> None:
    async with in_process(deployment) as proc:
        owner, events, link = await gated_session(proc, deployment)
        call = AgentCall(proc.nursery, link, "delete_file", {"path": "/tmp/x"})
        request = await events.wait_type("approval_request")
        deny = {"request_id": request["request_id"], "approve": False, "reason": "no"}
        assert structured(await answer(proc, owner, **deny)) == {"resolved": True}
        await call.outcome()

        again = await answer(proc, owner, **deny)
        assert structured(again) == {"resolved": True, "already_resolved": True}
        batch_again = await answer(proc, owner, approvals=[
            {"type": "approval", "tool_call_id": request["request_id"], "approve": False},
        ])
        assert structured(batch_again) == {"resolved": True}, "a batch of retries covers no pending id: accepted"
        contradicting = await answer(proc, owner, request_id=request["request_id"], approve=True)
        assert contradicting.is_error
        assert f"approval '{request['request_id']}' is already resolved: denied" in text_of(contradicting)
        assert len(await stored(proc, "approval_resolved")) == 1, "nothing is decided twice"


async def test_only_the_owning_caller_may_answer(deployment: Deployment) -> None:
    async with in_process(deployment) as proc:
        owner, events, link = await gated_session(proc, deployment)
        other, other_events = proc.open_caller()
        joined = await proc.call(other, "session_message", {"instance": INSTANCE, "session_id": "s-other", "message": "hi"})
        assert not joined.is_error
        call = AgentCall(proc.nursery, link, "delete_file", {"path": "/tmp/x"})
        request = await events.wait_type("approval_request")
        refused = await answer(proc, other, request_id=request["request_id"], approve=True)
        assert refused.is_error
        assert "may only be answered by the caller that owns session" in text_of(refused), text_of(refused)
        assert list(proc.server.approvals.pending) == [request["request_id"]]
        assert not call.finished.is_set()
        assert structured(await answer(proc, owner, request_id=request["request_id"], approve=False)) == {"resolved": True}
        await call.outcome()


async def test_bad_forms_are_refused(deployment: Deployment) -> None:
    async with in_process(deployment) as proc:
        owner, events, link = await gated_session(proc, deployment)
        AgentCall(proc.nursery, link, "delete_file", {"path": "/tmp/x"})
        request = await events.wait_type("approval_request")
        both = await answer(proc, owner, request_id=request["request_id"], approve=True, approvals=[
            {"type": "approval", "tool_call_id": request["request_id"], "approve": True}])
        assert both.is_error and "either 'request_id' and 'approve'" in text_of(both)
        half = await answer(proc, owner, request_id=request["request_id"])
        assert half.is_error and "needs both 'request_id' and 'approve'" in text_of(half)
        wrong_session = await proc.call(owner, "approval_response", {
            "session_id": "s-nope", "request_id": request["request_id"], "approve": True})
        assert wrong_session.is_error and "unknown session 's-nope'" in text_of(wrong_session)
        denied_with_args = await answer(proc, owner, request_id=request["request_id"], approve=False,
                                        updated_arguments={"path": "/tmp/y"})
        assert denied_with_args.is_error and "only for an approval" in text_of(denied_with_args)
        assert list(proc.server.approvals.pending) == [request["request_id"]]


# -- turn semantics ---------------------------------------------------------------------------


async def test_turn_stops_on_requires_approval_and_continues_after_the_answer(deployment: Deployment) -> None:
    async with in_process(deployment) as proc:
        owner, events, link = await gated_session(proc, deployment)
        turns: list[Any] = []

        async def send_and_wait() -> None:
            turns.append(await proc.call(owner, "session_message", {
                "instance": INSTANCE, "session_id": SESSION, "message": "delete /tmp/x", "wait": True}))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_and_wait)
            message = await events.wait_type("user.message", text="delete /tmp/x")
            call = AgentCall(proc.nursery, link, "delete_file", {"path": "/tmp/x"})
        stopped = structured(turns[0])
        assert stopped["stop_reason"] == "requires_approval"
        [request] = stopped["approval_requests"]
        assert request["tool_name"] == PUBLISHED and request["arguments"] == {"path": "/tmp/x"}
        assert request["origin"] == "caller" and request["request_id"].startswith("apr-")
        assert stopped["pending"] == [{"kind": "approval", "tool": PUBLISHED, **request}]

        blocked = await proc.call(owner, "session_message", {
            "instance": INSTANCE, "session_id": SESSION, "message": "anything else?"})
        assert blocked.is_error
        assert "PENDING_APPROVAL" in text_of(blocked) and request["request_id"] in text_of(blocked)

        continued: list[Any] = []

        async def approve_and_wait() -> None:
            continued.append(await answer(proc, owner, approvals=[
                {"type": "tool", "tool_call_id": request["request_id"], "tool_return": "gone", "status": "success"}],
                wait=True))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(approve_and_wait)
            await call.outcome()
            assert call.result == {"result": "gone"}
            # The guest runtime ends the turn with the agent's text.
            session = proc.server.sessions.get(INSTANCE, "mcp", SESSION)
            assert session is not None
            await proc.server.frame_log.append(session, "assistant.done", {"text": "deleted: gone"}, reply_to=message["msg_id"])
        ended = structured(continued[0])
        assert ended["resolved"] is True and ended["stop_reason"] == "end_turn"
        assert ended["text"] == "deleted: gone" and ended["msg_id"] == message["msg_id"]
        assert ended["pending"] == []
        after = await proc.call(owner, "session_message", {"instance": INSTANCE, "session_id": SESSION, "message": "thanks"})
        assert not after.is_error, text_of(after)


# -- fail closed --------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["server", "tool"])
async def test_approval_timeout_denies(deployment: Deployment, where: str) -> None:
    config = {"approval_timeout": 0.3} if where == "server" else {}
    tool = dict(DELETE, approval_timeout_ms=300) if where == "tool" else DELETE
    async with in_process(deployment, **config) as proc:
        owner, events, link = await gated_session(proc, deployment, [tool])
        call = AgentCall(proc.nursery, link, "delete_file", {"path": "/tmp/x"})
        request = await events.wait_type("approval_request")
        await call.outcome()
        assert call.error is not None and call.error.code == errors.DENIED
        assert "no decision within 0.3 s" in call.error.message
        resolved = await events.wait_type("approval_resolved")
        assert (resolved["approve"], resolved["who"]) == (False, "timeout")
        late = await answer(proc, owner, request_id=request["request_id"], approve=True)
        assert late.is_error and "already resolved: denied (timeout)" in text_of(late)


async def test_default_approval_timeout_is_ten_minutes(deployment: Deployment, mock_clock: trio.testing.MockClock) -> None:
    mock_clock.rate = 1.0
    async with in_process(deployment) as proc:
        assert proc.server.approvals.default_timeout == 600
        owner, events, link = await gated_session(proc, deployment)
        # As oubliette-client does for a gated tool: its deadline covers the approval timeout.
        call = AgentCall(proc.nursery, link, "delete_file", {"path": "/tmp/x"}, timeout=120 + 600)
        await events.wait_type("approval_request")
        mock_clock.jump(590)
        await trio.testing.wait_all_tasks_blocked()
        assert not call.finished.is_set()
        mock_clock.jump(15)
        await call.outcome()
        assert call.error is not None and "no decision within 600 s" in call.error.message


async def test_caller_disconnect_denies_at_once(deployment: Deployment) -> None:
    async with in_process(deployment) as proc:
        owner, events, link = await gated_session(proc, deployment)
        call = AgentCall(proc.nursery, link, "delete_file", {"path": "/tmp/x"})
        await events.wait_type("approval_request")
        proc.server.close_caller(owner)
        await call.outcome()
        assert call.error is not None and call.error.code == errors.DENIED
        assert "disconnected" in call.error.message
        # The decision is in the log (the owner is gone; nobody else may follow its session).
        [resolved] = await stored(proc, "approval_resolved")
        assert (resolved["approve"], resolved["who"]) == (False, "disconnect")
        assert proc.server.approvals.pending == {}


async def test_agent_cancel_withdraws_the_request(deployment: Deployment) -> None:
    async with in_process(deployment) as proc:
        owner, events, link = await gated_session(proc, deployment)
        call = AgentCall(proc.nursery, link, "delete_file", {"path": "/tmp/x"})
        request = await events.wait_type("approval_request")
        call.scope.cancel()
        resolved = await events.wait_type("approval_resolved", request_id=request["request_id"])
        assert (resolved["approve"], resolved["who"]) == (False, "cancelled")
        assert proc.server.approvals.pending == {}
        late = await answer(proc, owner, request_id=request["request_id"], approve=True)
        assert late.is_error and "already resolved: denied (cancelled)" in text_of(late)
        assert await stored(proc, "caller_tool_request") == []


async def test_clients_learn_the_effective_approval_timeout(deployment: Deployment) -> None:
    """The clients' relay deadline must cover the approval wait: the declared spec carries it."""
    async with in_process(deployment, approval_timeout=42) as proc:
        owner, _ = proc.open_caller()
        await proc.declare(owner, [DELETE, dict(DELETE, name="wipe", approval_timeout_ms=5000)])
        session = proc.server.sessions.get(INSTANCE, "mcp", SESSION)
        assert session is not None
        assert session.caller_tools["delete_file"].approval_timeout_ms == 42_000
        assert session.caller_tools["wipe"].approval_timeout_ms == 5000
        configs = proc.server.caller_tools.configs_for(_ClientStub())  # what a connecting client gets
        assert configs[0]["tools"][0]["approval_timeout_ms"] == 42_000


class _ClientStub:
    instance = INSTANCE
    session_key = f"mcp:{SESSION}"


# -- over HTTP (tether users) ----------------------------------------------------------------


async def test_http_route_answers_with_the_admin_token_only(deployment: Deployment) -> None:
    async with deployment.embedded_http_server(INSTANCE) as server, trio.open_nursery() as nursery:
        proc = InProcess(server.app, nursery)
        owner, events, link = await gated_session(proc, deployment)
        call = AgentCall(nursery, link, "delete_file", {"path": "/tmp/x"})
        request = await events.wait_type("approval_request")
        route = f"/v1/instances/{INSTANCE}/sessions/{SESSION}/approvals"
        body = {"request_id": request["request_id"], "approve": False, "reason": "from the dashboard"}

        async with server.rest(token=deployment.token(INSTANCE)) as sandbox:
            refused = await sandbox.post(route, json=body)
        assert refused.status_code == 403, refused.text
        assert "only the HTTP admin token" in refused.json()["error"]["message"]
        assert list(server.app.approvals.pending) == [request["request_id"]]

        async with server.rest() as admin:
            bad = await admin.post(route, json={"request_id": request["request_id"], "approve": True,
                                                "updated_arguments": {"path": "/etc"}})
            assert bad.status_code == 400 and "inputSchema" in bad.json()["error"]["message"]
            unknown = await admin.post(f"/v1/instances/{INSTANCE}/sessions/s-nope/approvals", json=body)
            assert unknown.status_code == 404
            answered = await admin.post(route, json=body)
            assert answered.status_code == 200, answered.text
            assert answered.json() == {"resolved": True}
            again = await admin.post(route, json=body)
            assert again.json() == {"resolved": True, "already_resolved": True}
        await call.outcome()
        assert call.error is not None and "from the dashboard" in call.error.message
        resolved = await events.wait_type("approval_resolved")
        assert (resolved["who"], resolved["approve"]) == ("http", False)
        nursery.cancel_scope.cancel()
