"""Two servers on one PostgreSQL database: caller identity, progress and approvals across them.

The caller (MCP over Streamable HTTP, 2026-07-28: named by the bearer token's principal plus its
`owner_key`) opens its session on server A; the guest runtime and the agent's oubliette-client
are on server B. The same caller may then act from either server (its `owner_key` names it on
both: the log records the session owner's identity); anyone else is refused as on one server.
A progress report sent to A reaches the agent waiting on B; an approval B's gated call asks for
is decided by an answer on A or on B (the tool or the HTTP `/approvals` door), or by B's
timeout, and exactly one decision wins when they race. Everything is a real program (the
servers, the guest runtime, tests/support/loop_agent.py) and a real PostgreSQL (tests/support/postgres.py).
"""

from __future__ import annotations

import datetime
import json
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import attrs
import trio

from harness import Deployment, EventLog, HttpServer
from approval_flows import BASH_INPUT, DELETE, GATED, PROMPT, call, decide, frames
from loop_caller import INSTANCE, LOOP_AGENT, LoopCaller, ends_with, tool
from cluster_servers import one_outcome_each, turn_end, two_servers
from cluster_approvals import one_decision_each, session_frames, steps

TOOL = "myapp_send_notification"
SLOW_DELETE = {**DELETE, "name": "slow_delete", "approval_timeout_ms": 1500}
SLOW_GATED = "myapp_slow_delete"


@attrs.define
class Cross:
    """One test's world: the servers, the owner's caller on A and on B, and a stranger on B and on A."""

    server_a: HttpServer
    server_b: HttpServer
    owner_a: LoopCaller
    owner_b: LoopCaller
    stranger_b: LoopCaller
    stranger_a: LoopCaller
    #: The events pushed to the owner's caller on A (2026-07-28: on its waits, request-scoped).
    owner_a_events: EventLog


@asynccontextmanager
async def cross(pg_url: str) -> AsyncIterator[Cross]:
    """Servers A and B on `pg_url` (the guest of `box1` on B) and four 2026-07-28 callers; the
    owner's caller on B takes its `owner_key` from A once the test's first message returned it."""
    a, b = Deployment(store=pg_url), Deployment(store=pg_url)
    try:
        async with a.http_server("--config", str(a.config_file(INSTANCE))) as server_a, \
                b.http_server("--config", str(b.config_file(INSTANCE))) as server_b, \
                b.guest(INSTANCE, LOOP_AGENT):
            await server_b.wait_connected(INSTANCE)
            async with server_a.caller(mode="auto") as (on_a, on_a_events), \
                    server_b.caller(mode="auto", events=False) as (on_b, _), \
                    server_b.caller(mode="auto", events=False) as (other_b, _), \
                    server_a.caller(mode="auto", events=False) as (other_a, _):
                yield Cross(server_a, server_b, LoopCaller(on_a), LoopCaller(on_b), LoopCaller(other_b), LoopCaller(other_a),
                            on_a_events)
            assert server_a.process.returncode is None and server_b.process.returncode is None
    finally:
        a.cleanup()
        b.cleanup()


async def open_on_a(world: Cross, session_id: str, message: str, tools: list[dict]) -> dict[str, Any]:
    """The owner's first message, on A, with `wait`; its caller on B adopts the returned `owner_key`."""
    stop = await world.owner_a.message(session_id, message, tools, wait=60)
    assert world.owner_a.owner_key, stop
    world.owner_b.owner_key = world.owner_a.owner_key
    return stop


async def test_the_same_caller_answers_on_either_server_and_nobody_else(pg_url: str) -> None:
    """Caller on A, agent on B: the owner's answers and progress reports are taken on A and on B
    (its `owner_key` names it on both), reach the agent, and each request ends once; another
    caller is refused on both servers with the one-server error, and nothing is touched."""
    message = steps(call(TOOL, arguments={"n": 1}, progress=True), call(TOOL, arguments={"n": 2}))
    async with cross(pg_url) as w:
        [first] = ends_with(await open_on_a(w, "s1", message, [tool("send_notification")]), "requires_action")["pending"]
        rid = first["request_id"]

        for stranger in (w.stranger_b, w.stranger_a):
            refusals = [
                await stranger.answer("s1", rid, result="hijacked"),
                await stranger.call("caller_tool_progress", session_id="s1", request_id=rid, progress=9),
                await stranger.call("approval_response", session_id="s1", request_id=rid, approve=True),
                await stranger.call("session_events", session_id="s1"),
            ]
            for refused in refusals[:2] + refusals[3:]:
                assert "belongs to another caller" in refused.get("error", ""), refused
            assert "error" in refusals[2], refusals[2]

        via_a = await w.owner_a.call("caller_tool_progress", session_id="s1", request_id=rid,
                                     progress=1, total=2, message="via A")
        assert via_a == {"forwarded": True}, via_a
        await frames(w.owner_a, "s1", "assistant.delta", 1, text=f"{TOOL} progress 1/2 via A")
        via_b = await w.owner_b.call("caller_tool_progress", session_id="s1", request_id=rid,
                                     progress=2, total=2, message="via B")
        assert via_b == {"forwarded": True}, via_b
        await frames(w.owner_b, "s1", "assistant.delta", 1, text=f"{TOOL} progress 2/2 via B")

        answered_b = ends_with(await w.owner_b.answer("s1", rid, result={"status": "from B"}, wait=60), "requires_action")
        assert answered_b["resolved"] is True
        [second] = answered_b["pending"]
        assert second["arguments"] == {"n": 2}
        end = ends_with(await w.owner_a.answer("s1", second["request_id"], error="from A", wait=60), "end_turn")
        late = await w.owner_b.answer("s1", second["request_id"], result="late")
        late_a = await w.owner_a.answer("s1", rid, result="late")
    assert f'{TOOL} -> {{"status": "from B"}}' in end["text"] and f"{TOOL} failed: from A" in end["text"], end
    assert "no longer pending: it was already resolved with an error" in late["error"], late
    assert "no longer pending: it was already resolved" in late_a["error"], late_a
    outcomes = one_outcome_each(
        [f for f in await session_frames(pg_url, "s1", "caller_tool_") if f.type != "caller_tool_progress"])
    assert [o.type for o in outcomes.values()] == ["caller_tool_result"] * 2
    assert "hijacked" not in json.dumps([o.payload for o in outcomes.values()])


async def test_approvals_asked_on_b_are_decided_on_a_on_b_or_by_bs_timeout(pg_url: str) -> None:
    """B's gated calls: the agent's own action (Claude Code's permission prompt) allowed with a
    rewrite on B by the same caller; a caller tool approved on A (then relayed and answered), one
    denied with a reason on B, and one left to B's approval timeout (a late answer on A is refused)."""
    message = steps(
        call("permission_prompt", arguments=PROMPT),
        call(GATED, arguments={"path": "/tmp/a"}), call(GATED, arguments={"path": "/tmp/b"}),
        call(SLOW_GATED, arguments={"path": "/tmp/c"}),
    )
    async with cross(pg_url) as w:
        stop = ends_with(await open_on_a(w, "s2", message, [DELETE, SLOW_DELETE]), "requires_approval")
        [own] = stop["approval_requests"]
        assert (own["tool_name"], own["arguments"], own["origin"]) == ("Bash", BASH_INPUT, "agent")
        # B appended the request; A's log tail pushed it to the owner's wait on A before the stop.
        assert [e["request_id"] for e in w.owner_a_events.of_type("approval_request")] == [own["request_id"]]
        stop = ends_with(await decide(w.owner_b, "s2", request_id=own["request_id"], approve=True,
                                      updated_arguments={"command": "rm -rf build/tmp"}, wait=60), "requires_approval")
        [ask] = stop["approval_requests"]
        assert (ask["tool_name"], ask["arguments"]) == (GATED, {"path": "/tmp/a"})
        stranger = await w.stranger_b.call("approval_response", session_id="s2", request_id=ask["request_id"], approve=True)
        assert "may only be answered by the caller that owns session 's2'" in stranger.get("error", ""), stranger

        relayed = ends_with(await decide(w.owner_a, "s2", request_id=ask["request_id"], approve=True, wait=60),
                            "requires_action")
        [request] = relayed["pending"]
        assert request["arguments"] == {"path": "/tmp/a"}
        # Not pushed: the stop's `pending` carries the request whole (README.md, "Caller tools").
        pushed = w.owner_a_events.of_type("caller_tool_request")
        assert pushed == [], pushed
        stop = ends_with(await w.owner_a.answer("s2", request["request_id"], result="deleted", wait=60), "requires_approval")
        [ask2] = stop["approval_requests"]
        assert ask2["arguments"] == {"path": "/tmp/b"}

        stop = ends_with(await decide(w.owner_b, "s2", request_id=ask2["request_id"], approve=False,
                                      reason="not that one", wait=60), "requires_approval")
        [ask3] = stop["approval_requests"]
        assert ask3["tool_name"] == SLOW_GATED
        [done] = await frames(w.owner_a, "s2", "assistant.done")
        late = await decide(w.owner_a, "s2", request_id=ask3["request_id"], approve=True)
        again = await decide(w.owner_b, "s2", request_id=ask2["request_id"], approve=False, reason="not that one")
    text = done["text"].splitlines()
    assert 'permission_prompt -> {"behavior":"allow","updatedInput":{"command":"rm -rf build/tmp"}}' in text, text
    assert f"{GATED} -> deleted" in text, text
    assert any(line.startswith(f"{GATED} failed:") and line.endswith("was denied: not that one") for line in text), text
    assert any(line.startswith(f"{SLOW_GATED} failed:") and "no decision within 1.5 s" in line for line in text), text
    assert "already resolved: denied (timeout)" in late.get("error", ""), late
    assert again.get("already_resolved") is True, again  # an identical re-answer is a retry, as on one server
    decisions = one_decision_each(await session_frames(pg_url, "s2", "approval_"))
    assert [(d.payload["approve"], d.payload["who"] == "timeout") for d in decisions] == [
        (True, False), (True, False), (False, False), (False, True)]
    assert decisions[2].payload["reason"] == "not that one"


async def test_racing_decisions_across_servers_resolve_each_approval_once(pg_url: str) -> None:
    """An approval on A and a denial on B (the operator's HTTP `/approvals` door) sent at once (A with
    a head start of 0 to 50 ms, so that either wins across the rounds); then
    approvals on A aimed at B's approval deadline. Each approval has one decision in the log,
    exactly one of two racing answers is accepted (the other is refused with the winner), and
    the agent got the winner: an approved call is relayed (and answered), a denied one fails."""
    rounds = 3
    head_starts = [0.0, 0.02, 0.05]  # A's answer goes that much earlier: the winner varies (the HTTP door is quicker)
    offsets = [-0.02, 0.0, 0.02]
    paths = [f"/tmp/{i}" for i in range(rounds)] + [f"/tmp/t{i}" for i in range(len(offsets))]
    message = steps(*[call(GATED if i < rounds else SLOW_GATED, arguments={"path": path}) for i, path in enumerate(paths)])
    won: list[str] = []
    async with cross(pg_url) as w, w.server_b.rest() as admin_b:
        ends_with(await open_on_a(w, "s3", message, [DELETE, SLOW_DELETE]), "requires_approval")
        for i, path in enumerate(paths):
            [ask] = await frames(w.owner_a, "s3", "approval_request", 1, arguments={"path": path})
            answers: dict[str, Any] = {}

            async def on_a(ask: dict[str, Any] = ask) -> None:
                answers["A"] = await decide(w.owner_a, "s3", request_id=ask["request_id"], approve=True)

            async def on_b(ask: dict[str, Any] = ask, delay: float = head_starts[i % rounds]) -> None:
                await trio.sleep(delay)
                response = await admin_b.post(f"/v1/instances/{INSTANCE}/sessions/s3/approvals", json={
                    "request_id": ask["request_id"], "approve": False, "reason": "B"})
                answers["B"] = response.json() if response.status_code == 200 else {
                    "error": response.json()["error"]["message"]}

            if i < rounds:
                async with trio.open_nursery() as race:
                    race.start_soon(on_a)
                    race.start_soon(on_b)
                accepted = [side for side, answer in answers.items() if answer.get("resolved") is True]
                assert len(accepted) == 1, answers
                [loser] = [answer for side, answer in answers.items() if side not in accepted]
                assert "is already resolved: " in loser["error"], answers
                won.append(accepted[0])
            else:
                expires = datetime.datetime.fromisoformat(ask["expires_at"].replace("Z", "+00:00")).timestamp()
                await trio.sleep(max(0.0, expires + offsets[i - rounds] - time.time()))  # aim at B's deadline
                await on_a()
                answer = answers["A"]
                assert answer.get("resolved") is True or "already resolved: denied (timeout)" in answer["error"], answer
                won.append("A" if answer.get("resolved") is True else "timeout")
            if won[-1] == "A":  # approved: the call is relayed to the caller, who answers it
                [request] = await frames(w.owner_a, "s3", "caller_tool_request", 1, arguments={"path": path})
                answered = await w.owner_a.answer("s3", request["request_id"], result=f"ok {path}")
                assert answered == {"resolved": True}, answered
        [done] = await frames(w.owner_a, "s3", "assistant.done")
    decisions = one_decision_each(await session_frames(pg_url, "s3", "approval_"))
    lines = [line for line in done["text"].splitlines() if line.startswith("myapp_")]
    assert len(decisions) == len(lines) == len(won) == len(paths), (decisions, lines, won)
    for winner, decision, line, path in zip(won, decisions, lines, paths):
        if winner == "A":
            assert decision.payload["approve"] is True and line.endswith(f"-> ok {path}"), (decision, line)
        elif winner == "B":
            assert (decision.payload["who"], decision.payload["reason"]) == ("http", "B"), decision
            assert line.endswith("was denied: B"), line
        else:
            assert decision.payload["who"] == "timeout" and "no decision within 1.5 s" in line, (decision, line)


async def test_the_owner_leaving_a_denies_bs_pending_approval_at_once(pg_url: str) -> None:
    """The owner's connection to A ends while B's gated call waits for its approval (timeout 600 s):
    A stores the denial (fail closed, `who: disconnect`) and the agent on B fails now."""
    async with two_servers(pg_url) as (server_a, server_b):
        async with server_a.caller(events=False) as (client, _):
            caller = LoopCaller(client)
            ends_with(await caller.message("s4", steps(call(GATED, arguments={"path": "/tmp/x"})), [DELETE], wait=60),
                      "requires_approval")
        frame = await turn_end(server_b, "s4")
    assert "was denied: the caller disconnected before deciding" in frame["payload"]["text"], frame
    [decision] = one_decision_each(await session_frames(pg_url, "s4", "approval_"))
    assert (decision.payload["approve"], decision.payload["who"]) == (False, "disconnect")
