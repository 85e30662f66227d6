"""Every approvals flow of docs/APPROVALS.md end to end with the real programs, in both protocol eras.

The programs: oubliette-server as a subprocess (the caller's stdio MCP server, or started with
HTTP listeners for a Streamable HTTP caller), the real guest runtime (`oubliette-client run`)
running tests/support/loop_agent.py, an agent built on the SDK's `Client` that spawns its own
oubliette-client and calls the tools its message scripts. The caller is the SDK's `Client`
with no logging callback: it acts on tool results only (`wait` stops, `session_events`), as a
model would. Eras: `mode="legacy"` (the handshake era) and the SDK's default (2026-07-28).

Which test covers which cell (S = stdio caller, H = Streamable HTTP caller; L = legacy,
M = 2026-07-28; "-" = not applicable). Every flow runs in both eras on stdio; on HTTP a
representative subset (approve, deny, direct return, timeout, plus the updated arguments, the
permission prompt and another caller, which ride along in the same turn), because each test costs a server, a guest
and an agent process (~5 s of CPU; the module's 12 tests take ~60 s of CPU), and the HTTP
door does not change what the approvals service does once a call reached it. To keep that
cost down one turn carries several flows (one scripted call each, decided in turn).

| flow                                       | S/L | S/M | H/L | H/M | test (this module unless named) |
|--------------------------------------------|-----|-----|-----|-----|---------------------------------|
| approve (the tool is then relayed)         |  x  |  x  |  x  |  x  | test_decisions_in_one_turn; also test_approvals_e2e (S/L) |
| deny with a reason                         |  x  |  x  |  x  |  x  | test_decisions_in_one_turn |
| direct tool return (`type: tool`)          |  x  |  x  |  x  |  x  | test_decisions_in_one_turn |
| updated arguments, bad then good           |  x  |  x  |  x  |  x  | test_decisions_in_one_turn |
| the agent's own action (permission prompt) |  x  |  x  |  x  |  x  | test_decisions_in_one_turn (Claude Code's JSON byte for byte) |
| batch with mixed decisions                 |  x  |  x  |     |     | test_batch_mismatched_ids_and_re_answers |
| mismatched / unknown ids                   |  x  |  x  |     |     | test_batch_mismatched_ids_and_re_answers |
| idempotent and contradicting re-answers    |  x  |  x  |     |     | test_batch_mismatched_ids_and_re_answers |
| another caller answering                   |  -  |  -  |  x  |  x  | test_decisions_in_one_turn (a stdio server has exactly one caller) |
| the operator answering over HTTP           |  -  |  -  |  x  |     | test_the_operator_answers_over_http (all three routes) |
| a new message while pending                |  x  |  x  |     |     | test_batch_mismatched_ids_and_re_answers |
| approval timeout (a tool's own)            |  x  |  x  |  x  |  x  | test_decisions_in_one_turn |
| caller disconnect while pending            |  x  |  x  |  x  |     | test_caller_disconnect_denies; H/L: test_the_operator_answers_over_http |
| agent cancel while pending                 |  x  |  x  |     |     | test_waiting_well |
| heartbeats reach the agent (its token)     |  x  |  x  |     |     | test_waiting_well |
| caller progress forwarded                  |  x  |  x  |     |     | test_waiting_well; over HTTP: test_the_operator_answers_over_http |
| a toolset's elicitation answered           |  x  |  x  |     |     | S/L: tests/server/features/test_approval_elicitation.py (by the person, and by approval_response); S/M: tests/server/features/test_approval_elicitation.py (by the person) and test_toolset_elicitation_answered_by_approval_response |

The agent's side is the real SDK client: the loop agent prints each outcome, so the turn's text
(`assistant.done`) shows what the agent got; heartbeats it receives are printed at once (an
`assistant.delta` each), so the caller sees them while the call still waits. In process, the
same flows are checked against the service's internals in tests/server/features/test_approvals.py,
tests/server/features/test_connection_approvals.py (the permission prompt byte for byte, gated toolsets) and
tests/server/features/test_approval_elicitation.py (approvals put to a person); a toolset's own approval timeout in
tests/server/features/test_connection_approvals.py.
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import pytest
import trio

from harness import Deployment
from oubliette_server.store.sqlite import FrameQuery, FrameStore
from loop_caller import INSTANCE, LOOP_AGENT, TURN_TIMEOUT, LoopCaller, ends_with, script, tool
from elicitation_forms import forms_config
from approval_flows import BASH_INPUT, DELETE, GATED, PROMPT, call, decide, frames

"""What Claude Code sends its `--permission-prompt-tool` for an action of its own."""
ERAS = pytest.mark.parametrize("mode", ["legacy", "auto"])
TRANSPORTS = pytest.mark.parametrize("transport", ["stdio", "http"])


class World:
    """One test's programs: the caller (`caller`), and for HTTP the server (`server`) to open another."""

    def __init__(self, caller: LoopCaller, server: Any, mode: str) -> None:
        self.caller = caller
        self.server = server
        self.mode = mode

    @asynccontextmanager
    async def other_caller(self) -> AsyncIterator[LoopCaller]:
        async with self.server.caller(mode=self.mode, events=False) as (client, _events):
            yield LoopCaller(client)


@asynccontextmanager
async def world(deployment: Deployment, transport: str, mode: str, *extra: str) -> AsyncIterator[World]:
    """A guest running the loop agent and a tool-results-only caller on `transport`, all real programs."""
    async with deployment.guest(INSTANCE, LOOP_AGENT):
        if transport == "stdio":
            async with deployment.caller(*extra, mode=mode, events=False) as (client, events):
                yield World(LoopCaller(client), None, mode)
        else:
            async with deployment.http_server(*extra) as server, \
                    server.caller(mode=mode, events=False) as (client, events):
                yield World(LoopCaller(client), server, mode)
    assert events.events == [], "the caller read no event"


# -- approve, deny, direct return, updated arguments, another caller --------------------------


@TRANSPORTS
@ERAS
async def test_decisions_in_one_turn(deployment: Deployment, transport: str, mode: str) -> None:
    """One turn, seven gated calls one after the other, each decided differently with `wait`: two of
    the agent's own actions through Claude Code's permission-prompt contract, then five caller tool
    calls; the last one's own `approval_timeout_ms` passes while the caller decides."""
    paths = ["/tmp/a", "/tmp/b", "/tmp/c", "/tmp/everything"]
    message = script(
        [("permission_prompt", PROMPT)], [("permission_prompt", PROMPT)],
        *[[(GATED, {"path": p})] for p in paths], [("myapp_wipe", {"path": "/tmp/z"})],
    )
    tools = [DELETE, dict(DELETE, name="wipe", approval_timeout_ms=1000)]
    async with world(deployment, transport, mode) as w:
        caller = w.caller
        # The agent's own action (origin "agent"): allowed with a rewrite, then denied with a reason.
        asked = ends_with(await caller.message("s1", message, tools, wait=True), "requires_approval")
        [p1] = asked["approval_requests"]
        assert (p1["tool_name"], p1["arguments"], p1["origin"]) == ("Bash", BASH_INPUT, "agent")
        assert p1["tool_use_id"] == "toolu_01AbC"
        asked = ends_with(await decide(caller, "s1", request_id=p1["request_id"], approve=True,
                                       updated_arguments={"command": "rm -rf build/tmp"}, wait=True), "requires_approval")
        [p2] = asked["approval_requests"]
        assert p2["origin"] == "agent" and p2["request_id"] != p1["request_id"]
        first = ends_with(await decide(caller, "s1", request_id=p2["request_id"], approve=False,
                                       reason="keep the build output", wait=True), "requires_approval")
        [a] = first["approval_requests"]
        assert (a["tool_name"], a["arguments"], a["origin"]) == (GATED, {"path": "/tmp/a"}, "caller")
        assert first["pending"] == [{"kind": "approval", "tool": GATED, **a}]

        # Approve: only now is the call relayed to the caller (requires_action), with the same arguments.
        acting = ends_with(await decide(caller, "s1", request_id=a["request_id"], approve=True, wait=True),
                           "requires_action")
        [relayed] = acting["pending"]
        assert (relayed["kind"], relayed["tool"], relayed["arguments"]) == ("caller_tool", "delete_file", {"path": "/tmp/a"})
        second = ends_with(await caller.answer("s1", relayed["request_id"], result={"deleted": "/tmp/a"}, wait=True),
                           "requires_approval")
        [b] = second["approval_requests"]
        assert b["arguments"] == {"path": "/tmp/b"}

        if w.server is not None:  # another caller of the same server may not decide
            async with w.other_caller() as other:
                refused = await decide(other, "s1", request_id=b["request_id"], approve=True)
                assert "may only be answered by the caller that owns session" in refused["error"], refused
                batch = await decide(other, "s1", approvals=[
                    {"type": "approval", "tool_call_id": b["request_id"], "approve": True}])
                assert "may only be answered by the caller that owns session" in batch["error"], batch

        # Deny with a reason: the agent gets a tool error carrying it; nothing is relayed.
        third = ends_with(await decide(caller, "s1", request_id=b["request_id"], approve=False, reason="keep b",
                                       wait=True), "requires_approval")
        [c] = third["approval_requests"]
        # A direct tool return (Letta's `type: tool`): the agent gets it as the result, no round trip.
        fourth = ends_with(await decide(caller, "s1", approvals=[
            {"type": "tool", "tool_call_id": c["request_id"], "tool_return": {"deleted": "c"}, "status": "success"},
        ], wait=True), "requires_approval")
        [d] = fourth["approval_requests"]
        assert d["arguments"] == {"path": "/tmp/everything"}

        # Updated arguments are checked against the tool's inputSchema again; a refusal leaves it pending.
        bad = await decide(caller, "s1", request_id=d["request_id"], approve=True, updated_arguments={"path": "/etc/passwd"})
        assert "inputSchema" in bad["error"] and "still pending" in bad["error"], bad
        acting = ends_with(await decide(caller, "s1", request_id=d["request_id"], approve=True,
                                        updated_arguments={"path": "/tmp/one"}, wait=True), "requires_action")
        [relayed] = acting["pending"]
        assert relayed["arguments"] == {"path": "/tmp/one"}
        fifth = ends_with(await caller.answer("s1", relayed["request_id"], result="deleted /tmp/one", wait=True),
                          "requires_approval")

        # The approval timeout: nobody decides; it is denied ("timeout") and a late answer is refused.
        [e] = fifth["approval_requests"]
        assert (e["tool_name"], e["expires_at"][-1]) == ("myapp_wipe", "Z")
        [timed_out] = await frames(caller, "s1", "approval_resolved", 1, request_id=e["request_id"])
        assert (timed_out["approve"], timed_out["who"]) == (False, "timeout")
        assert "no decision within 1 s" in timed_out["reason"]
        late = await decide(caller, "s1", request_id=e["request_id"], approve=True)
        assert "already resolved: denied (timeout)" in late["error"], late
        [end] = await frames(caller, "s1", "assistant.done")
        resolved = await frames(caller, "s1", "approval_resolved", 7)

    # Claude Code's contract, byte for byte, as the agent received it: one text block of compact JSON.
    prompts, lines = end["text"].splitlines()[:2], end["text"].splitlines()[2:]
    assert prompts == [
        'permission_prompt -> {"behavior":"allow","updatedInput":{"command":"rm -rf build/tmp"}}',
        'permission_prompt -> {"behavior":"deny","message":"\'Bash\' was denied: keep the build output"}',
    ], prompts
    assert [(r["request_id"], r["approve"]) for r in resolved[:2]] == [(p1["request_id"], True), (p2["request_id"], False)]
    resolved = resolved[2:]
    assert lines[0] == f'{GATED} -> {{"deleted": "/tmp/a"}}', lines
    assert lines[1].startswith(f"{GATED} failed:") and "keep b" in lines[1], lines
    assert lines[2] == f'{GATED} -> {{"deleted": "c"}}', lines
    assert lines[3] == f"{GATED} -> deleted /tmp/one", lines
    assert lines[4].startswith("myapp_wipe failed:") and "no decision within 1 s" in lines[4], lines
    assert [(r["request_id"], r["approve"]) for r in resolved] == [
        (a["request_id"], True), (b["request_id"], False), (c["request_id"], True), (d["request_id"], True),
        (e["request_id"], False)]
    assert resolved[1]["reason"] == "keep b"
    assert (resolved[2]["kind"], resolved[2]["tool_return"]) == ("tool", {"deleted": "c"})
    assert resolved[3]["updated_arguments"] == {"path": "/tmp/one"}


# -- batches, ids, re-answers, a new message while pending -----------------------------------


@ERAS
async def test_batch_mismatched_ids_and_re_answers(deployment: Deployment, mode: str) -> None:
    async with world(deployment, "stdio", mode) as w:
        caller = w.caller
        sent = await caller.message("s2", script([(GATED, {"path": "/tmp/a"}), (GATED, {"path": "/tmp/b"})]), [DELETE])
        requests = await frames(caller, "s2", "approval_request", 2)
        ids = {r["arguments"]["path"]: r["request_id"] for r in requests}

        blocked = await caller.message("s2", script(), wait=True)
        assert "PENDING_APPROVAL" in blocked["error"], blocked
        assert all(request_id in blocked["error"] for request_id in ids.values()), blocked

        partial = await decide(caller, "s2", approvals=[
            {"type": "approval", "tool_call_id": ids["/tmp/a"], "approve": False, "reason": "no"}])
        assert "nothing was decided" in partial["error"], partial
        assert all(request_id in partial["error"] for request_id in ids.values()), partial
        unknown = await decide(caller, "s2", approvals=[
            {"type": "approval", "tool_call_id": "apr-0000000000000000", "approve": True}])
        assert "unknown approval request_id 'apr-0000000000000000'" in unknown["error"], unknown
        wrong_session = await decide(caller, "s-nope", request_id=ids["/tmp/a"], approve=True)
        assert "unknown session 's-nope'" in wrong_session["error"], wrong_session

        mixed = ends_with(await decide(caller, "s2", approvals=[
            {"type": "approval", "tool_call_id": ids["/tmp/a"], "approve": False, "reason": "keep a"},
            {"type": "tool", "tool_call_id": ids["/tmp/b"], "tool_return": {"deleted": "b"}, "status": "success"},
        ], wait=True), "end_turn")
        assert mixed["resolved"] is True and mixed["msg_id"] == sent["msg_id"]

        again = await decide(caller, "s2", request_id=ids["/tmp/a"], approve=False, reason="keep a")
        assert again == {"resolved": True, "already_resolved": True}
        contradicting = await decide(caller, "s2", request_id=ids["/tmp/a"], approve=True)
        assert f"approval '{ids['/tmp/a']}' is already resolved: denied" in contradicting["error"], contradicting
        resolved = await frames(caller, "s2", "approval_resolved", 2)
        after = await caller.message("s2", script(), wait=True)  # nothing pending: a new message is taken
        ends_with(after, "end_turn")
        assert len(await frames(caller, "s2", "approval_resolved", 2)) == 2, "nothing is decided twice"

    assert sorted((r["approve"], r.get("kind")) for r in resolved) == [(False, "approval"), (True, "tool")]
    text = mixed["text"]
    assert f"{GATED} failed:" in text and "keep a" in text, text
    assert f'{GATED} -> {{"deleted": "b"}}' in text, text


# -- fail closed: the caller disconnects ---------------------------------------------------------


@ERAS
async def test_caller_disconnect_denies(deployment: Deployment, mode: str) -> None:
    """The stdio caller leaves while an approval is pending: the server denies it before it shuts down
    (a stdio server serves exactly one caller), and the decision is in the durable log."""
    async with deployment.guest(INSTANCE, LOOP_AGENT):
        async with deployment.caller(mode=mode, events=False) as (client, _events):
            caller = LoopCaller(client)
            stopped = ends_with(await caller.message("s4", script([(GATED, {"path": "/tmp/x"})]), [DELETE], wait=True),
                                "requires_approval")
            [request] = stopped["approval_requests"]
    store = FrameStore(deployment.data_dir / "frames.sqlite3")
    try:
        stored = await store.query(INSTANCE, FrameQuery(session_id="s4", types=("approval_resolved",)))
    finally:
        store.close()
    [resolved] = [frame.payload for frame in stored]
    assert resolved["request_id"] == request["request_id"]
    assert (resolved["approve"], resolved["who"]) == (False, "disconnect")
    assert "disconnected" in resolved["reason"]


# -- waiting well: heartbeats, caller progress, the agent's cancel ------------------------------


def progress_lines(text_frames: list[dict[str, Any]], tool_name: str) -> list[str]:
    return [f["text"] for f in text_frames if f["text"].startswith(f"{tool_name} progress ")]


@ERAS
async def test_waiting_well(deployment: Deployment, mode: str) -> None:
    """Heartbeats on the agent's progress token while an approval waits, strictly increasing; the
    caller's own progress report forwarded; an agent that gives up cancels, which withdraws the request."""
    message = json.dumps({
        "client_args": ["--progress-interval", "0.2"],
        "steps": [
            [call(GATED, arguments={"path": "/tmp/x"}, progress=True)],
            [call("myapp_notify", arguments={"n": 1}, progress=True)],
            [call(GATED, arguments={"path": "/tmp/y"}, cancel_on_progress=True)],
        ],
    })
    async with world(deployment, "stdio", mode) as w:
        caller = w.caller
        first = ends_with(await caller.message("s5", message, [DELETE, tool("notify")], wait=True), "requires_approval")
        [a] = first["approval_requests"]
        beats = progress_lines(await frames(caller, "s5", "assistant.delta", 3), GATED)
        assert len(beats) >= 3 and all(line.endswith(f"waiting for {GATED}") for line in beats), beats
        values = [float(line.split()[2].split("/")[0]) for line in beats]
        assert values == sorted(set(values)), values

        acting = ends_with(await decide(caller, "s5", request_id=a["request_id"], approve=True, wait=True),
                           "requires_action")
        [relayed] = acting["pending"]
        nxt = ends_with(await caller.answer("s5", relayed["request_id"], result="deleted", wait=True), "requires_action")
        [notify] = nxt["pending"]
        assert notify["tool"] == "notify"
        forwarded = await caller.call("caller_tool_progress", session_id="s5", request_id=notify["request_id"],
                                      progress=100, total=200, message="half way")
        assert forwarded == {"forwarded": True}
        [reported] = await frames(caller, "s5", "assistant.delta", 1, text="myapp_notify progress 100/200 half way")

        # The last call: the agent cancels it at its first heartbeat; the caller is told it was withdrawn.
        answered = await caller.answer("s5", notify["request_id"], result="sent")
        assert answered == {"resolved": True}
        requests = await frames(caller, "s5", "approval_request", 2)
        cancelled_id = requests[1]["request_id"]
        [withdrawn] = await frames(caller, "s5", "approval_resolved", 1, request_id=cancelled_id)
        assert (withdrawn["approve"], withdrawn["who"]) == (False, "cancelled")
        late = await decide(caller, "s5", request_id=cancelled_id, approve=True)
        assert "already resolved: denied (cancelled)" in late["error"], late
        [done] = await frames(caller, "s5", "assistant.done")

    text = done["text"].splitlines()
    assert f"{GATED} -> deleted" in text and "myapp_notify -> sent" in text, text
    assert f"{GATED} cancelled" in text, text
    assert not any(line.startswith(f"{GATED} -> ") and "/tmp/y" in line for line in text)
    # The first call's reports, from its first heartbeat to the answer, strictly increase.
    all_values = [float(line.split()[2].split("/")[0]) for line in progress_lines(
        [{"text": line} for line in text[: text.index(f"{GATED} -> deleted")]], GATED)]
    assert all(x < y for x, y in zip(all_values, all_values[1:])), all_values


# -- a toolset's elicitation, answered with approval_response (2026-07-28) ----------------------


async def test_toolset_elicitation_answered_by_approval_response(deployment: Deployment) -> None:
    """The legacy era's cell is test_elicitation's (the same flow with `mode="legacy"`)."""
    config = forms_config(deployment)
    async with world(deployment, "stdio", "auto", "--config", str(config)) as w:
        caller = w.caller
        booked = json.dumps({"steps": [[{"tool": "forms.book", "arguments": {"place": "Chez Oubliette"}}]]})
        stopped = ends_with(await caller.message("s6", booked, wait=True), "requires_approval")
        [request] = stopped["approval_requests"]
        assert request["origin"] == "toolset" and request["tool_name"] == "forms.book"
        assert request["elicitation"]["requestedSchema"]["properties"]["seats"]["type"] == "integer"
        wrong = await decide(caller, "s6", request_id=request["request_id"], approve=True, content={"seats": "many"})
        assert "still pending" in wrong["error"], wrong
        end = ends_with(await decide(caller, "s6", request_id=request["request_id"], approve=True,
                                     content={"seats": 2}, wait=True), "end_turn")
    assert '"action": "accept"' in end["text"] and '"seats": 2' in end["text"], end["text"]


# -- the operator's HTTP doors (tether users) ----------------------------------------------------


async def test_the_operator_answers_over_http(deployment: Deployment) -> None:
    """`POST …/caller_tool_progress`, `…/caller_tool_response` and `…/approvals` answer for the
    session's caller with the server's HTTP token (`wait` too); the instance's own token is refused.
    Then a caller leaves while its approval is pending, and the operator reads the denial."""
    message = json.dumps({"steps": [
        [call("myapp_notify", arguments={"n": 1}, progress=True)], [call(GATED, arguments={"path": "/tmp/x"})],
    ]})
    async with world(deployment, "http", "legacy") as w:
        caller = w.caller
        stopped = ends_with(await caller.message("s7", message, [DELETE, tool("notify")], wait=True), "requires_action")
        [notify] = stopped["pending"]
        route = f"/v1/instances/{INSTANCE}/sessions/s7"
        async with w.server.rest(token=deployment.token(INSTANCE)) as sandbox:
            for door in ("caller_tool_progress", "caller_tool_response", "approvals"):
                refused = await sandbox.post(f"{route}/{door}", json={"request_id": notify["request_id"], "result": "x"})
                assert refused.status_code == 403, refused.text
                assert "only the HTTP admin token" in refused.json()["error"]["message"]
        async with w.server.rest() as admin:
            progress = await admin.post(f"{route}/caller_tool_progress", json={
                "request_id": notify["request_id"], "progress": 3, "total": 4, "message": "three of four"})
            assert progress.status_code == 200 and progress.json() == {"forwarded": True}, progress.text
            await frames(caller, "s7", "assistant.delta", 1, text="myapp_notify progress 3/4 three of four")
            bad = await admin.post(f"{route}/caller_tool_response", json={"request_id": notify["request_id"]})
            assert bad.status_code == 400 and "give either 'result' or 'error'" in bad.json()["error"]["message"]
            unknown = await admin.post(f"/v1/instances/{INSTANCE}/sessions/s-nope/caller_tool_response",
                                       json={"request_id": notify["request_id"], "result": "x"})
            assert unknown.status_code == 404, unknown.text

            answered = await admin.post(f"{route}/caller_tool_response", json={
                "request_id": notify["request_id"], "result": {"sent": True}, "wait": 30})
            assert answered.status_code == 200, answered.text
            gated = answered.json()
            assert gated["resolved"] is True and gated["stop_reason"] == "requires_approval", gated
            [request] = gated["approval_requests"]
            late = await admin.post(f"{route}/caller_tool_response", json={"request_id": notify["request_id"], "result": "again"})
            assert late.status_code == 400 and "no longer pending" in late.json()["error"]["message"], late.text

            denied = await admin.post(f"{route}/approvals", json={
                "request_id": request["request_id"], "approve": False, "reason": "ops says no", "wait": 30})
            assert denied.status_code == 200, denied.text
            end = denied.json()
        [resolved] = await frames(caller, "s7", "approval_resolved")

        # A handshake-era HTTP caller that leaves (its MCP session ends) while an approval of its
        # session is pending: denied at once; the operator reads the outcome over the tether.
        async with w.other_caller() as leaving:
            stopped = ends_with(await leaving.message("s8", script([(GATED, {"path": "/tmp/x"})]), [DELETE], wait=True),
                                "requires_approval")
            [pending] = stopped["approval_requests"]
        async with w.server.rest() as admin:
            left = await tether_frames(admin, "s8", "approval_resolved")
            [done] = await tether_frames(admin, "s8", "assistant.done")
    assert end["stop_reason"] == "end_turn", end
    assert 'myapp_notify -> {"sent": true}' in end["text"] and "ops says no" in end["text"], end["text"]
    assert (resolved["who"], resolved["approve"]) == ("http", False)
    assert [(r["request_id"], r["who"], r["approve"]) for r in left] == [(pending["request_id"], "disconnect", False)]
    assert f"{GATED} failed:" in done["text"] and "the caller disconnected before deciding" in done["text"], done


async def tether_frames(admin: Any, session_id: str, type_: str) -> list[dict[str, Any]]:
    """The operator's view over the tether's long poll: the payloads of the first frames of `type_`."""
    with trio.fail_after(TURN_TIMEOUT):
        while True:
            response = await admin.get(f"/v1/instances/{INSTANCE}/tether/poll", params={
                "channel": "mcp", "session_id": session_id, "types": type_, "wait_ms": 10_000})
            assert response.status_code == 200, response.text
            if found := response.json()["frames"]:
                return [f["payload"] for f in found]
