"""Three servers on one PostgreSQL database: every server knows every session (docs/SCALING.md).

The caller (MCP over Streamable HTTP, 2026-07-28, named by the bearer token's principal plus its
`owner_key`) opens its session on server A; the guest runtime and the agent's oubliette-client are
on server B; server C has neither opened the session nor held its guest. C learns the session from
the log (the owner from its `session_record`, the pending requests and approvals from their
frames) and serves the owner exactly as A does: `session_message`, `caller_tool_progress`,
`caller_tool_response`, `approval_response` and `session_events` sent to C work, each answer
stored once (`append_outcome`) and heard by the agent waiting on B; another caller gets on C the
very refusal A gives it. Everything is a real program and a real PostgreSQL (tests/support/postgres.py).
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator

import attrs

from harness import Deployment, HttpServer
from approval_flows import DELETE, GATED, call, decide, frames
from loop_caller import INSTANCE, LOOP_AGENT, LoopCaller, ends_with, tool
from cluster_approvals import one_decision_each, session_frames, steps
from cluster_servers import one_outcome_each

TOOL = "myapp_send_notification"


@attrs.define
class Three:
    """One test's world: the owner's caller on A, B and C, a stranger on A and on C."""

    owner_a: LoopCaller
    owner_c: LoopCaller
    stranger_a: LoopCaller
    stranger_c: LoopCaller
    owner_b: LoopCaller

    def same_caller(self, opener: LoopCaller) -> None:
        """The owner's callers on every server take the `owner_key` the opening one was given."""
        assert opener.owner_key
        for caller in (self.owner_a, self.owner_b, self.owner_c):
            caller.owner_key = opener.owner_key


@asynccontextmanager
async def three_servers(pg_url: str) -> AsyncIterator[Three]:
    """Servers A, B and C on `pg_url`, all configured with `box1`, the guest of `box1` on B, and four
    2026-07-28 callers: the owner's and a stranger's on A and on C, the owner's on B."""
    a, b, c = (Deployment(store=pg_url) for _ in range(3))
    try:
        async with a.http_server("--config", str(a.config_file(INSTANCE))) as server_a, \
                b.http_server("--config", str(b.config_file(INSTANCE))) as server_b, \
                c.http_server("--config", str(c.config_file(INSTANCE))) as server_c, \
                b.guest(INSTANCE, LOOP_AGENT):
            await server_b.wait_connected(INSTANCE)
            servers: list[HttpServer] = [server_a, server_b, server_c]
            async with server_a.caller(mode="auto", events=False) as (owner_a, _), \
                    server_c.caller(mode="auto", events=False) as (owner_c, _), \
                    server_a.caller(mode="auto", events=False) as (stranger_a, _), \
                    server_c.caller(mode="auto", events=False) as (stranger_c, _), \
                    server_b.caller(mode="auto", events=False) as (owner_b, _):
                yield Three(LoopCaller(owner_a), LoopCaller(owner_c), LoopCaller(stranger_a), LoopCaller(stranger_c),
                            LoopCaller(owner_b))
            assert all(server.process.returncode is None for server in servers)
    finally:
        for deployment in (a, b, c):
            deployment.cleanup()


async def test_a_third_server_serves_the_owner_and_refuses_anyone_else_as_the_first_does(pg_url: str) -> None:
    """Session opened on A, agent on B: the owner's progress report, answer, approval, reads and next
    message sent to C all work and reach the agent on B; every request and approval ends once; a
    stranger on C gets, word for word, what a stranger on A gets, and nothing is touched."""
    first_turn = steps(call(TOOL, arguments={"n": 1}, progress=True), call(GATED, arguments={"path": "/tmp/a"}))
    second_turn = steps(call(TOOL, arguments={"n": 2}))
    async with three_servers(pg_url) as w:
        stop = ends_with(await w.owner_a.message("s1", first_turn, [tool("send_notification"), DELETE], wait=60),
                         "requires_action")
        w.same_caller(w.owner_a)
        [request] = stop["pending"]
        rid = request["request_id"]

        async def refusals(stranger: LoopCaller) -> list[str]:
            answers = [
                await stranger.answer("s1", rid, result="hijacked"),
                await stranger.call("caller_tool_progress", session_id="s1", request_id=rid, progress=9),
                await stranger.call("approval_response", session_id="s1", request_id=rid, approve=True),
                await stranger.call("session_events", session_id="s1"),
                await stranger.message("s1", "let me in"),
            ]
            return [answer.get("error", f"not refused: {answer}") for answer in answers]

        on_a, on_c = await refusals(w.stranger_a), await refusals(w.stranger_c)
        assert on_c == on_a, (on_a, on_c)
        assert all("belongs to another caller" in text for text in on_a[:2] + on_a[3:]), on_a
        assert on_a[2] == "approval_response: unknown approval request_id '" + rid + "'", on_a

        progress = await w.owner_c.call("caller_tool_progress", session_id="s1", request_id=rid,
                                        progress=1, total=2, message="via C")
        assert progress == {"forwarded": True}, progress
        await frames(w.owner_c, "s1", "assistant.delta", 1, text=f"{TOOL} progress 1/2 via C")

        stop = ends_with(await w.owner_c.answer("s1", rid, result={"status": "from C"}, wait=60), "requires_approval")
        [ask] = stop["approval_requests"]
        assert (ask["tool_name"], ask["arguments"]) == (GATED, {"path": "/tmp/a"})
        stranger = await decide(w.stranger_c, "s1", request_id=ask["request_id"], approve=True)
        assert stranger.get("error") == "approval_response: approval '" + ask["request_id"] + \
            "' may only be answered by the caller that owns session 's1'", stranger

        stop = ends_with(await decide(w.owner_c, "s1", request_id=ask["request_id"], approve=True, wait=60),
                         "requires_action")
        [gated] = stop["pending"]
        assert gated["arguments"] == {"path": "/tmp/a"}
        end = ends_with(await w.owner_c.answer("s1", gated["request_id"], result="deleted", wait=60), "end_turn")
        assert f'{TOOL} -> {{"status": "from C"}}' in end["text"] and f"{GATED} -> deleted" in end["text"], end

        # The next message of the session, sent to C: the agent on B runs it; C answers its request.
        sent = await w.owner_c.message("s1", second_turn, wait=60)
        [again] = ends_with(sent, "requires_action")["pending"]
        assert again["arguments"] == {"n": 2}
        end = ends_with(await w.owner_c.answer("s1", again["request_id"], result="second", wait=60), "end_turn")
        assert f"{TOOL} -> second" in end["text"], end
        read = await w.owner_c.call("session_events", session_id="s1", types=["assistant.done"])
        assert len(read["frames"]) == 2, read
        late = await w.owner_a.answer("s1", rid, result="late")
    assert "no longer pending: it was already resolved" in late.get("error", ""), late
    outcomes = one_outcome_each(
        [f for f in await session_frames(pg_url, "s1", "caller_tool_") if f.type != "caller_tool_progress"])
    assert [o.payload.get("result") for o in outcomes.values()] == [{"status": "from C"}, "deleted", "second"]
    [decision] = one_decision_each(await session_frames(pg_url, "s1", "approval_"))
    assert decision.payload["approve"] is True
    assert not any(f.payload.get("text") == "let me in" for f in await session_frames(pg_url, "s1", "user.message"))


async def test_answers_on_other_servers_reach_an_agent_on_the_server_the_session_was_opened_on(pg_url: str) -> None:
    """Session opened on B, where the guest is, so the owner is connected to the agent's own server:
    its requests wait in the log all the same, and an answer stored on C, an approval on A and an
    answer on A reach the agent at once (not at its timeout), each ending once."""
    turn = steps(call(TOOL, arguments={"n": 1}), call(GATED, arguments={"path": "/tmp/b"}))
    slow = dict(tool("send_notification"), timeout_ms=50_000)  # an answer heard only at the timeout fails the wait below
    async with three_servers(pg_url) as w:
        stop = ends_with(await w.owner_b.message("s2", turn, [slow, dict(DELETE, timeout_ms=50_000)], wait=60),
                         "requires_action")
        w.same_caller(w.owner_b)
        [request] = stop["pending"]
        stop = ends_with(await w.owner_c.answer("s2", request["request_id"], result="from C", wait=30), "requires_approval")
        [ask] = stop["approval_requests"]
        stop = ends_with(await decide(w.owner_a, "s2", request_id=ask["request_id"], approve=True, wait=30),
                         "requires_action")
        [gated] = stop["pending"]
        end = ends_with(await w.owner_a.answer("s2", gated["request_id"], result="deleted on A", wait=30), "end_turn")
    assert f"{TOOL} -> from C" in end["text"] and f"{GATED} -> deleted on A" in end["text"], end
    outcomes = one_outcome_each(await session_frames(pg_url, "s2", "caller_tool_"))
    assert [o.payload.get("result") for o in outcomes.values()] == ["from C", "deleted on A"]
    [decision] = one_decision_each(await session_frames(pg_url, "s2", "approval_"))
    assert decision.payload["approve"] is True


async def test_sessions_a_stranger_opens_under_the_owners_id_do_not_hide_it_from_another_server(pg_url: str) -> None:
    """A session id is a name, not a secret: a second caller with the same HTTP token opens the
    owner's session id in 100 other instances (named before the owner's). Server B, which holds
    none of them, still finds the owner's session by its identity: the owner's answer sent to B
    resolves the agent's call on A (it was refused as "belongs to another caller"); the stranger's
    answer to that request is refused."""
    decoys = [f"a{n:03}" for n in range(100)]
    a, b = Deployment(store=pg_url), Deployment(store=pg_url)
    try:
        async with a.http_server("--config", str(a.config_file(INSTANCE, *decoys))) as server_a, \
                b.http_server("--config", str(b.config_file(INSTANCE, *decoys))) as server_b, \
                a.guest(INSTANCE, LOOP_AGENT):
            await server_a.wait_connected(INSTANCE)
            async with server_a.caller(mode="auto", events=False) as (owner_a, _), \
                    server_a.caller(mode="auto", events=False) as (stranger_a, _), \
                    server_b.caller(mode="auto", events=False) as (owner_b, _), \
                    server_b.caller(mode="auto", events=False) as (stranger_b, _):
                owner_a, stranger_a, owner_b, stranger_b = map(LoopCaller, (owner_a, stranger_a, owner_b, stranger_b))
                stop = ends_with(await owner_a.message("s-victim", steps(call(TOOL, arguments={"n": 1})),
                                                       [tool("send_notification")], wait=60), "requires_action")
                [request] = stop["pending"]
                for decoy in decoys:
                    opened = await stranger_a.call("session_message", instance=decoy, session_id="s-victim", message="mine")
                    assert "error" not in opened, opened
                stranger_b.owner_key = stranger_a.owner_key
                owner_b.owner_key = owner_a.owner_key

                refused = await stranger_b.answer("s-victim", request["request_id"], result="hijacked")
                assert "error" in refused, refused  # its own s-victim sessions hold no such request
                end = ends_with(await owner_b.answer("s-victim", request["request_id"], result="from B", wait=60), "end_turn")
                assert f"{TOOL} -> from B" in end["text"], end
    finally:
        a.cleanup()
        b.cleanup()
    outcomes = one_outcome_each(await session_frames(pg_url, "s-victim", "caller_tool_"))
    assert [o.payload.get("result") for o in outcomes.values()] == ["from B"]
