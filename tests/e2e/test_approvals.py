"""Approvals end to end with the real programs: oubliette-server on stdio with an SDK caller,
the guest runtime running the scripted demo agent, which calls the gated caller tool through
its own oubliette-client. A caller that acts only on tool results drives the whole turn with `wait`:
requires_approval, approval_response -> requires_action, caller_tool_response -> end_turn.
"""

from __future__ import annotations

import trio

from harness import DEMO_AGENT, Deployment, structured, text_of
from approvals_stdio import DELETE


async def test_requires_approval_then_approve_continues_the_turn(deployment: Deployment) -> None:
    async with deployment.caller() as (caller, events), deployment.guest("box1", DEMO_AGENT):
        with trio.fail_after(60):
            stopped = await caller.call_tool("session_message", {
                "instance": "box1", "session_id": "s-gate",
                "message": 'Please call myapp_delete_file {"path": "/tmp/x"}',
                "context": {"caller_id": "myapp", "caller_tools": [DELETE]}, "wait": 60,
            })
        assert not stopped.is_error, text_of(stopped)
        turn = structured(stopped)
        assert turn["stop_reason"] == "requires_approval", turn
        [request] = turn["approval_requests"]
        assert request["tool_name"] == "myapp_delete_file" and request["arguments"] == {"path": "/tmp/x"}
        assert events.of_type("caller_tool_request") == [], "nothing runs before the decision"

        # Approved, the tool is relayed to the caller: the same wait stops for it (requires_action).
        with trio.fail_after(60):
            approved = await caller.call_tool("approval_response", {
                "session_id": "s-gate", "request_id": request["request_id"], "approve": True, "wait": 60,
            })
        assert not approved.is_error, text_of(approved)
        acting = structured(approved)
        assert acting["resolved"] is True and acting["stop_reason"] == "requires_action", acting
        [relayed] = acting["pending"]
        assert relayed["kind"] == "caller_tool" and relayed["tool"] == "delete_file"
        assert relayed["arguments"] == {"path": "/tmp/x"}
        with trio.fail_after(60):
            done = await caller.call_tool("caller_tool_response", {
                "session_id": "s-gate", "request_id": relayed["request_id"], "result": {"deleted": "/tmp/x"},
                "wait": 60,
            })
        assert not done.is_error, text_of(done)
        ended = structured(done)
        assert ended["resolved"] is True
        assert ended["stop_reason"] == "end_turn", ended
        assert "deleted" in ended["text"] and "/tmp/x" in ended["text"], ended["text"]
        assert ended["msg_id"] == turn["msg_id"] and ended["pending"] == []
        resolved = events.of_type("approval_resolved")
        assert [(r["request_id"], r["approve"]) for r in resolved] == [(request["request_id"], True)]
