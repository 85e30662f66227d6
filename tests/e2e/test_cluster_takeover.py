"""Instance leases on one PostgreSQL: a guest moving between servers, and a server killed mid-call.

Two real servers (A and B) on one real PostgreSQL (tests/support/postgres.py), real guests and agents.
Which server holds an instance's guest is a lease in the database (docs/SCALING.md, "Instance
leases"): a guest that connects to another server takes its instance over, the server that
lost it drops its guest, and a server killed with SIGKILL loses its instances to the server
the guest reconnects to, which delivers from the acknowledged cursor: nothing lost, nothing
run twice. A caller tool request, or an approval, the dead server was waiting on is closed by
a survivor.
"""

from __future__ import annotations

import json
import signal
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import trio

from harness import Deployment, HttpServer, RawRelay
from oubliette_server.features.cluster.abandoned_requests import ABANDONED_REASON, SERVER_STOPPED, AbandonedRequests
from oubliette_server.features.approvals.service import decision_of
from oubliette_server.core.frame_log import FrameLog
from oubliette_server.core.sessions import SessionRegistry
from oubliette_server.store.api import FrameQuery
from oubliette_server.store.postgres import MIGRATIONS, PostgresFrameStore
from oubliette_server.store.chain import value_digest
from approval_flows import DELETE, GATED, call, decide
from loop_caller import IDLE, INSTANCE, LOOP_AGENT, LoopCaller, ends_with, script, tool
from tether_http import post
from raw_relay_calls import response_to

TOOL = "myapp_send_notification"
LEASE_TTL = 1.5
"""The servers' `[store] lease_ttl` here (default 10 s): short, so the bounds below are short."""
CALL_TIMEOUT_MS = 60_000
"""The interrupted call's timeout: long, so it is B's lease expiring, not the timeout, that closes it."""
CLOSE_BOUND = 3 * LEASE_TTL + 3
"""Kill → the request closed: B's lease expires at most one TTL after the kill (it renews every
third of a TTL), A sweeps every TTL; 1 TTL and 3 s of margin for a loaded machine."""


def config(deployment: Deployment, lease_ttl: float = LEASE_TTL) -> str:
    """A config file declaring `box1`, with this test's lease TTL."""
    path = deployment.config_file(INSTANCE)
    path.write_text(path.read_text() + f"[store]\nlease_ttl = {lease_ttl}\n")
    return str(path)


@asynccontextmanager
async def servers(
    pg_url: str, b_lease_ttl: float = LEASE_TTL,
) -> AsyncIterator[tuple[Deployment, HttpServer, Deployment, HttpServer]]:
    a, b = Deployment(store=pg_url), Deployment(store=pg_url)
    try:
        async with a.http_server("--config", config(a)) as server_a, \
                b.http_server("--config", config(b, b_lease_ttl)) as server_b:
            yield a, server_a, b, server_b
    finally:
        a.cleanup()
        b.cleanup()


async def server_id(server: HttpServer) -> str:
    async with server.unix_rest() as rest:
        return (await rest.get("/v1/health")).json()["server"]["id"]


async def lease_holder(pg_url: str) -> str | None:
    store = PostgresFrameStore(pg_url, pool_size=1)
    async with store.running():
        return await store.lease_holder(INSTANCE)


async def all_frames(pg_url: str) -> list[Any]:
    store = PostgresFrameStore(pg_url, pool_size=1)
    async with store.running():
        return await store.query(INSTANCE, FrameQuery(limit=200))


@asynccontextmanager
async def guest_of(relays: list[Deployment], token: str) -> AsyncIterator[trio.Process]:
    """`oubliette-client run` of box1 given several servers' relay addresses, tried in turn."""
    async with relays[0].guest(INSTANCE, LOOP_AGENT, relay=",".join(d.relay for d in relays), token=token) as process:
        yield process


async def test_leases_in_the_store(pg_url: str) -> None:
    """take (over), renew (one statement; a lease another server took is not renewed), release
    (only one's own), and an expired lease taken without naming a live previous holder."""
    store = PostgresFrameStore(pg_url, pool_size=1)
    async with store.running():
        assert await store.take_lease("box1", "A", 5) is None
        assert await store.renew_leases("A", ["box1", "box2"], 5) == {"box1", "box2"}  # a missing one is written
        assert await store.take_lease("box1", "B", 5) == "A"
        assert await store.renew_leases("A", ["box1", "box2"], 5) == {"box2"}
        await store.release_lease("box1", "A")
        assert await store.lease_holder("box1") == "B"
        await store.release_lease("box1", "B")
        assert await store.lease_holder("box1") is None
        assert await store.take_lease("box3", "A", -1) is None  # already expired, as if A died
        assert await store.take_lease("box3", "B", 5) is None
        assert await store.lease_holder("box3") == "B"


async def test_a_migration_missing_below_the_newest_is_applied(pg_url: str) -> None:
    """Migrations merged from parallel branches: a database at version 5 without 3 gets 3."""
    store = PostgresFrameStore(pg_url, pool_size=1)
    async with store.running():
        pass
    import psycopg

    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("DELETE FROM oubliette_schema WHERE version = 3")
        conn.execute("DROP TABLE resolutions")
    async with store.running():
        assert await store.append_outcome("box1", "r1", channel="mcp", session_id="s", type="caller_tool_result",
                                          payload={"request_id": "r1"}) is not None
    with psycopg.connect(pg_url) as conn:
        assert sorted(r[0] for r in conn.execute("SELECT version FROM oubliette_schema")) == sorted(v for v, _ in MIGRATIONS)


async def test_a_guest_that_connects_to_another_server_takes_its_instance_over(pg_url: str) -> None:
    """A second guest of box1 connecting to A takes the lease from B. A message sent right after
    (through B) reaches only the new guest: B checks the lease before delivering and closes its
    guest, within the lease TTL at the latest."""
    async with servers(pg_url) as (a, server_a, b, server_b):
        token = a.token(INSTANCE)
        async with RawRelay.connect(b) as old:
            assert "result" in await old.hello(INSTANCE, token, role="guest")
            assert await lease_holder(pg_url) == await server_id(server_b)
            async with RawRelay.connect(a) as new:
                assert "result" in await new.hello(INSTANCE, token, role="guest")
                started = trio.current_time()
                assert await lease_holder(pg_url) == await server_id(server_a)
                async with server_b.rest() as rest:
                    sent = await post(rest, INSTANCE, {
                        "type": "user.message", "session": {"channel": "host", "id": "t1"}, "payload": {"text": "hi"},
                    })
                assert await old.closed(timeout=LEASE_TTL + 2), "B kept the guest whose instance A took over"
                dropped_after = trio.current_time() - started
                message = await new.receive(timeout=10)
        assert b"user_message" not in bytes(old._buffer), "B delivered to the guest it no longer holds"
        assert message is not None and message["method"] == "user_message", message
        assert message["params"]["frame"]["seq"] == sent["ingress_seq"]
        assert dropped_after <= LEASE_TTL, dropped_after
        await server_b.wait_stderr("another server", "box1")  # the delivery check or the renewal said why


async def test_both_guests_of_a_taken_over_instance_answer_one_message_and_one_end_is_stored(pg_url: str) -> None:
    """A message arrives as box1's guest moves from B to A: B delivered it to its guest, which
    started the turn; the new guest connects to A, which delivers it again (it was never
    acknowledged). Both guests end the turn at once. B, whose lease A took, refuses its guest's
    end with a clear error and closes that guest after the answer; A stores the new guest's end:
    the log holds one turn end, and B ends no orphan of the turn A's guest runs.

    B's lease TTL is long: its renewal (every third of it) would otherwise find the lease taken and
    close the old guest before its end is sent, on a slow machine, which is not the path tested."""
    async with servers(pg_url, b_lease_ttl=60) as (a, server_a, b, server_b):
        token = a.token(INSTANCE)
        session = {"channel": "host", "id": "t1"}
        async with RawRelay.connect(b) as old:
            assert "result" in await old.hello(INSTANCE, token, role="guest")
            async with server_b.rest() as rest:
                sent = await post(rest, INSTANCE, {"type": "user.message", "session": session, "payload": {"text": "hi"}})
            delivered = await old.receive(timeout=10)
            assert delivered is not None and delivered["params"]["frame"]["seq"] == sent["ingress_seq"], delivered
            msg_id = delivered["params"]["frame"]["msg_id"]
            await old.send({"jsonrpc": "2.0", "id": 1, "method": "append_frame", "params": {
                "session": session, "type": "status.presence", "payload": {"state": "thinking"}, "reply_to": msg_id}})
            assert "result" in await response_to(old, 1)
            async with RawRelay.connect(a) as new:
                assert "result" in await new.hello(INSTANCE, token, role="guest")
                again = await new.receive(timeout=10)
                assert again is not None and again["params"]["frame"]["msg_id"] == msg_id, again
                for guest, who in ((old, "old"), (new, "new")):
                    await guest.send({"jsonrpc": "2.0", "id": 2, "method": "append_frame", "params": {
                        "session": session, "type": "assistant.done", "payload": {"text": who}, "reply_to": msg_id}})
                refused, stored = await response_to(old, 2), await response_to(new, 2)
                assert await old.closed(timeout=5), "B kept the guest of the instance A took over"
        assert "result" in stored, stored
        assert refused["error"]["code"] == -32600 and "no longer holds instance 'box1'" in refused["error"]["message"], refused
        await server_b.wait_stderr("no longer holds instance", "box1")
        ends = [f for f in await all_frames(pg_url) if f.type in ("assistant.done", "session.error")]
        assert [(f.reply_to, f.payload.get("text")) for f in ends] == [(msg_id, "new")], ends


async def test_a_guest_append_resent_to_another_server_is_stored_once(pg_url: str) -> None:
    """The guest's append reached A, which stored it, and the answer was lost (A died, the
    connection broke): the guest resends it to B with the same `append_id` and gets the same
    seq and msg_id; one frame is in the log. Both servers list the feature in their hello
    result; a malformed id is refused (-32602) and stores nothing."""
    async with servers(pg_url) as (a, server_a, b, server_b):
        token = a.token(INSTANCE)
        async with server_a.rest() as rest:
            await post(rest, INSTANCE, {
                "type": "user.message", "session": {"channel": "host", "id": "t1"}, "payload": {"text": "hi"},
            })
        frame = {"session": {"channel": "host", "id": "t1"}, "type": "status.presence", "payload": {"state": "thinking"}}
        answers = []
        for server in (a, b):
            async with RawRelay.connect(server) as guest:
                hello = await guest.hello(INSTANCE, token, role="guest")
                assert hello["result"]["features"] == ["append_id"], hello
                await guest.send({"jsonrpc": "2.0", "id": 1, "method": "append_frame",
                                  "params": {**frame, "append_id": "presence-1"}})
                answers.append(await response_to(guest, 1))
                for n, bad in enumerate(("x" * 65, "a/b", 7, "abc\n"), start=2):
                    await guest.send({"jsonrpc": "2.0", "id": n, "method": "append_frame",
                                      "params": {**frame, "append_id": bad}})
                    error = (await response_to(guest, n))["error"]
                    assert error["code"] == -32602 and "append_id" in error["message"], error
        assert answers[0]["result"] == answers[1]["result"], answers
        presence = [f for f in await all_frames(pg_url) if f.type == "status.presence"]
        assert [f.seq for f in presence] == [answers[0]["result"]["seq"]], presence


async def test_a_message_through_another_server_does_not_start_an_instance_held_elsewhere(pg_url: str) -> None:
    """A has a start command for box1 (wake on message); box1's guest is on B. Messages posted
    through A reach the guest on B and do not run A's start command (a second guest would take
    the instance over). Once the guest left B (its lease released), a message through A does.

    The TTL is long: the lease is released when the guest leaves, and a short one could expire
    under a slow machine's delayed renewal, which is not the path tested."""
    a, b = Deployment(store=pg_url), Deployment(store=pg_url)
    marker = a.root / "started"
    path = a.config_file(start={INSTANCE: ["sh", "-c", f"echo started >> {marker}; echo started >&2"]})
    path.write_text(path.read_text() + "[store]\nlease_ttl = 60\n")
    try:
        async with a.http_server("--config", str(path)) as server_a, \
                b.http_server("--config", config(b, lease_ttl=60)) as server_b, server_a.rest() as rest:
            async with RawRelay.connect(b) as guest:
                assert "result" in await guest.hello(INSTANCE, a.token(INSTANCE), role="guest")
                for i in range(3):
                    sent = await post(rest, INSTANCE, {
                        "type": "user.message", "session": {"channel": "host", "id": "w"}, "payload": {"text": f"m{i}"},
                    })
                    delivered = await guest.receive(timeout=10)
                    assert delivered is not None and delivered["params"]["frame"]["seq"] == sent["ingress_seq"]
            assert not marker.exists(), "A ran the start command of an instance whose guest is on B"
            with trio.fail_after(10):
                while await lease_holder(pg_url) is not None:  # B releases the lease when its guest leaves
                    await trio.sleep(0.05)  # the lease's row has no event to wait on, B no line for it
            await post(rest, INSTANCE, {
                "type": "user.message", "session": {"channel": "host", "id": "w"}, "payload": {"text": "wake"},
            })
            # The start command's stderr, which A logs, says it wrote the marker.
            await server_a.wait_stderr(f"start command of {INSTANCE}: started", timeout=10)
            assert server_b.process.returncode is None
        assert marker.read_text() == "started\n"
    finally:
        a.cleanup()
        b.cleanup()


async def test_kill_9_of_the_guests_server_mid_call(pg_url: str) -> None:
    """Caller on A, guest on B, the agent waiting on a caller tool call; B is killed (SIGKILL).

    The guest (given both relay addresses) reconnects to A at once and takes box1 over; the
    agent's call fails at once with a connection error and its turn ends through A; A closes
    the request B was waiting on once B's lease expired (long before its 60 s timeout), so the caller is not
    left with a request nobody waits for; no message is run twice or lost, no request has two
    outcomes, and the call the agent makes again afterwards, through A, is answered."""
    async with servers(pg_url) as (a, server_a, b, server_b):
        id_a = await server_id(server_a)
        async with guest_of([b, a], a.token(INSTANCE)), server_a.caller(events=False) as (client, _):
            await server_b.wait_connected(INSTANCE)
            caller = LoopCaller(client)
            ends_with(await caller.message("s1", IDLE, [tool("send_notification")], wait=60), "end_turn")  # acknowledged
            stop = ends_with(await caller.message(
                "s1", script([(TOOL, {"n": 1})]), [tool("send_notification", timeout_ms=CALL_TIMEOUT_MS)], wait=60,
            ), "requires_action")
            [call] = stop["pending"]

            server_b.process.send_signal(signal.SIGKILL)
            killed = trio.current_time()
            await server_a.wait_connected(INSTANCE, timeout=10)
            reconnected = trio.current_time() - killed
            assert await lease_holder(pg_url) == id_a
            dones: list[dict[str, Any]] = []
            after = 0
            with trio.fail_after(30):
                while len(dones) < 2:  # the idle turn's, then the interrupted turn's
                    events = await caller.call(
                        "session_events", session_id="s1", types=["assistant.done"], after_seq=after, wait_ms=20_000,
                    )
                    dones += events["frames"]
                    after = events["next_seq"]
            turn_ended = trio.current_time() - killed
            done = dones[-1]
            assert f"{TOOL} failed:" in done["payload"]["text"], done

            with trio.fail_after(CLOSE_BOUND + 10):
                closed = await caller.call("session_events", session_id="s1", types=["caller_tool_cancelled"], wait_ms=30_000)
            request_closed = trio.current_time() - killed
            [cancelled] = closed["frames"]
            assert cancelled["payload"]["request_id"] == call["request_id"]
            assert cancelled["payload"]["reason"] == "its server stopped: no server waits for it"
            late = await caller.answer("s1", call["request_id"], result={"status": "late"})
            assert "no longer pending" in late["error"], late

            again = await caller.message(
                "s1", script([(TOOL, {"n": 2})]), [tool("send_notification")], wait=60,
            )
            ends_with(again, "requires_action")
            [call2] = again["pending"]
            end = ends_with(await caller.answer("s1", call2["request_id"], result={"status": "sent"}, wait=60), "end_turn")
            assert f'{TOOL} -> {{"status": "sent"}}' in end["text"], end
        assert server_a.process.returncode is None

    print(f"kill -9 of B: guest on A after {reconnected:.2f} s, turn ended after {turn_ended:.2f} s, "
          f"request closed after {request_closed:.2f} s")
    assert reconnected < 5, reconnected
    assert turn_ended < 15, turn_ended
    assert request_closed <= CLOSE_BOUND, request_closed
    frames = all_frames_checked(await all_frames(pg_url))
    assert frames == 3


def all_frames_checked(frames: list[Any]) -> int:
    """Every message ran once (one `thinking` and one turn end each); every request has one outcome.
    How many messages there were."""
    messages = [f for f in frames if f.type == "user.message"]
    for message in messages:
        replies = [f for f in frames if f.reply_to == message.msg_id]
        assert [f.payload.get("state") for f in replies if f.type == "status.presence"] == ["thinking"], replies
        assert len([f for f in replies if f.type in ("assistant.done", "session.error")]) == 1, replies
    requests = {f.payload["request_id"] for f in frames if f.type == "caller_tool_request"}
    outcomes = [f.payload["request_id"] for f in frames if f.type in ("caller_tool_result", "caller_tool_cancelled")]
    assert sorted(outcomes) == sorted(requests), (requests, outcomes)
    return len(messages)



async def test_the_sweep_finds_and_denies_an_approval_whose_server_died(pg_url: str) -> None:
    """Store level: an `approval_request` of a server whose lease expired is abandoned, one of a
    live server is not; the sweep stores its denial in approvals/service.py's shape (once: a
    second sweep finds nothing), and an approval a server decided itself (a plain frame) is not."""
    store = PostgresFrameStore(pg_url, pool_size=2)
    async with store.running():
        await store.renew_leases("dead", [], -1)  # its server lease expired, as if `dead` was killed
        await store.renew_leases("live", [], 60)
        far = "2999-01-01T00:00:00.000Z"

        async def ask(instance: str, server: str, request_id: str) -> None:
            await store.append(instance, channel="mcp", session_id="s", type="approval_request", payload={
                "request_id": request_id, "tool_name": GATED, "arguments": {}, "origin": "caller",
                "expires_at": far, "server": server,
            })

        await ask("box-dead", "dead", "apr-dead")
        await ask("box-dead", "dead", "apr-decided")
        await store.append("box-dead", channel="mcp", session_id="s", type="approval_resolved", payload={
            "request_id": "apr-decided", "tool_name": GATED, "approve": True, "reason": None, "who": "caller", "kind": "approval",
        })
        await ask("box-live", "live", "apr-live")
        found = await store.abandoned_requests(grace=LEASE_TTL)
        assert [f.payload["request_id"] for f in found] == ["apr-dead"], found

        frame_log = FrameLog(store, SessionRegistry())
        sweeper = AbandonedRequests(store, frame_log.sessions, frame_log.append_outcome, period=LEASE_TTL, grace=LEASE_TTL)
        assert await sweeper.sweep() == 1
        assert await sweeper.sweep() == 0
        assert await store.abandoned_requests(grace=LEASE_TTL) == []
        [resolved] = [f for f in await store.query("box-dead", FrameQuery(limit=50)) if f.type == "approval_resolved"
                      and f.payload["request_id"] == "apr-dead"]
    assert resolved.payload == {
        "request_id": "apr-dead", "tool_name": GATED, "approve": False, "reason": ABANDONED_REASON,
        "who": SERVER_STOPPED, "kind": "approval", "arguments_sha256": value_digest({}),  # the request's arguments
    }
    assert decision_of(resolved.payload).describe() == "denied (server_stopped)"


async def test_kill_9_of_the_guests_server_while_its_approval_is_pending(pg_url: str) -> None:
    """Caller on A, guest on B, B's gated caller tool waiting for its approval (timeout 600 s); B
    is killed (SIGKILL). Once B's lease expired, A stores the approval's denial (`who`
    server_stopped), within `3 × lease_ttl + 3` s; the caller sees it resolved, a late approval is
    refused as already resolved, and a new message (refused while an approval is pending) is
    taken and its gated call asked again, through A."""
    async with servers(pg_url) as (a, server_a, b, server_b):
        id_b = await server_id(server_b)
        async with guest_of([b, a], a.token(INSTANCE)), server_a.caller(events=False) as (client, _):
            await server_b.wait_connected(INSTANCE)
            caller = LoopCaller(client)
            ends_with(await caller.message("s1", IDLE, [DELETE], wait=60), "end_turn")  # acknowledged
            gated = json.dumps({"steps": [[call(GATED, arguments={"path": "/tmp/x"})]]})
            stop = ends_with(await caller.message("s1", gated, [DELETE], wait=60), "requires_approval")
            [ask] = stop["approval_requests"]
            [asked] = [f for f in await all_frames(pg_url) if f.type == "approval_request"]
            assert asked.payload["server"] == id_b and asked.payload["request_id"] == ask["request_id"], asked.payload

            server_b.process.send_signal(signal.SIGKILL)
            killed = trio.current_time()
            with trio.fail_after(CLOSE_BOUND + 10):
                closed = await caller.call("session_events", session_id="s1", types=["approval_resolved"], wait_ms=30_000)
            approval_closed = trio.current_time() - killed
            [resolved] = closed["frames"]
            late = await decide(caller, "s1", request_id=ask["request_id"], approve=True)

            await server_a.wait_connected(INSTANCE, timeout=10)
            dones: list[dict[str, Any]] = []
            after = 0
            with trio.fail_after(30):
                while len(dones) < 2:  # the idle turn's, then the interrupted turn's (its call failed)
                    events = await caller.call(
                        "session_events", session_id="s1", types=["assistant.done"], after_seq=after, wait_ms=20_000,
                    )
                    dones += events["frames"]
                    after = events["next_seq"]
            again = ends_with(await caller.message("s1", gated, [DELETE], wait=60), "requires_approval")
            [ask2] = again["approval_requests"]
            assert ask2["request_id"] != ask["request_id"]
            relayed = ends_with(await decide(caller, "s1", request_id=ask2["request_id"], approve=True, wait=60),
                                "requires_action")
            [request] = relayed["pending"]
            end = ends_with(await caller.answer("s1", request["request_id"], result="deleted", wait=60), "end_turn")
        assert server_a.process.returncode is None

    print(f"kill -9 of B: its pending approval denied after {approval_closed:.2f} s")
    assert resolved["payload"]["request_id"] == ask["request_id"]
    assert (resolved["payload"]["approve"], resolved["payload"]["who"], resolved["payload"]["reason"]) == (
        False, SERVER_STOPPED, ABANDONED_REASON), resolved
    assert "already resolved: denied (server_stopped)" in late.get("error", ""), late
    assert f"{GATED} -> deleted" in end["text"], end
    assert approval_closed <= CLOSE_BOUND, approval_closed
    frames = await all_frames(pg_url)
    requests = sorted(f.payload["request_id"] for f in frames if f.type == "approval_request")
    decisions = sorted(f.payload["request_id"] for f in frames if f.type == "approval_resolved")
    assert decisions == requests and len(requests) == 2, (requests, decisions)


async def test_a_decision_taken_after_another_servers_sweep_denied_the_approval_loses_to_that_denial(pg_url: str) -> None:
    """A server stalled past its lease: another server's sweep denied its pending approval (as if
    it were dead). The owner's answer arriving afterwards on the stalled server must not become a
    second decision: it is refused as already resolved, the gated call gets the stored denial,
    and the log holds one `approval_resolved`."""
    from oubliette_server.features.approvals.service import ApprovalService, Decision, resolved_payload
    from oubliette_server.features.cluster.log_bus import LogBus
    from oubliette_server.core.callers import CallerConnection
    from oubliette_server.core.pending_requests import SharedStore
    from protocol.errors import RelayError

    store = PostgresFrameStore(pg_url, pool_size=2)
    async with store.running():
        frame_log = FrameLog(store, SessionRegistry())
        approvals = ApprovalService(frame_log.append, 600, crossing=SharedStore(LogBus(store, frame_log.append_outcome), server_id="me"))
        caller = CallerConnection("test")
        session = frame_log.sessions.get_or_create(INSTANCE, "mcp", "s1")
        decided: list[Decision] = []
        returned = trio.Event()

        async def gated_call() -> None:
            decided.append(await approvals.request(session, GATED, {}, origin="caller", caller=caller))
            returned.set()

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                await nursery.start(approvals.serve)
                nursery.start_soon(gated_call)
                [asked], _ = await store.wait_for_frames(INSTANCE, FrameQuery(types=("approval_request",)), 20)
                request_id = asked.payload["request_id"]
                sweep = Decision(approve=False, who=SERVER_STOPPED, reason=ABANDONED_REASON)
                assert await frame_log.append_outcome(
                    session, "approval_resolved", resolved_payload(request_id, GATED, {}, sweep), request_id,
                ) is not None
                try:
                    await approvals.answer(caller, "s1", request_id, Decision(approve=True, who="caller"))
                except RelayError as refused:
                    assert "already resolved: denied (server_stopped)" in refused.message, refused.message
                else:
                    raise AssertionError("the late local answer was accepted as a second decision")
                await returned.wait()
                nursery.cancel_scope.cancel()
        assert decided[0].approve is False and decided[0].who == SERVER_STOPPED
        resolved = [f for f in await store.query(INSTANCE, FrameQuery(types=("approval_resolved",), limit=50))]
        assert [f.payload["request_id"] for f in resolved] == [request_id]
