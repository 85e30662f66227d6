"""Fault tests, with the real programs.

Kill -9 of the agent's own `oubliette-client` mid-call: the agent here speaks MCP to
`oubliette-client` by hand over its stdin/stdout, so the test holds the client's process and can
SIGKILL it while a caller tool call is in flight. What must hold: the caller hears at once that
the request was withdrawn, a late answer is refused (nothing is resolved twice), and the log has
exactly one request and one outcome for it.

Store failure between answer and record: the caller answers while the store cannot write (SQLite:
another process holds the database's write lock past the server's busy timeout, as a full disk
fails the same commit; PostgreSQL: the database server is stopped, then started again). What
must hold: the agent is not answered, the caller is told its answer was not recorded and to send
it again, and the retry after the store is back delivers exactly once, with one result in the log;
the same for an approval decision (nothing runs until the decision is stored).

A flood of slow HTTP clients: the relay and a new sandbox are still served, the log stays readable.
A flood of relay connections that never say hello: a sandbox with a valid token and the operator's
health request are still answered, every time.

(Killing the guest runtime and the server mid-call is in tests/server/features/test_orphans.py, killing an HTTP caller in
tests/server/core/test_ownership.py, a caller that disconnects in tests/server/features/test_caller_tool_relay.py.)
"""

from __future__ import annotations

import contextlib
import sqlite3
import subprocess
import sys
import time
from typing import Any, AsyncContextManager, AsyncIterator, Callable, Iterator

import trio

from harness import Deployment, HandMcp, Progress, RawRelay, hello_and_health, never_say_hello, structured, text_of
from turn_end_bursts import BURST, SESSION, burst_to_a_failing_start, post_message

KILL_BOUND = 5.0
"""How soon after SIGKILL of the client the caller must be told the request was cancelled."""

NOTIFY = {"name": "send_notification", "inputSchema": {"type": "object", "properties": {"message": {"type": "string"}}}}


async def test_killing_the_agents_client_mid_call_withdraws_the_request_at_once(deployment: Deployment) -> None:
    async with deployment.caller() as (caller, events):
        declared = await caller.call_tool("session_message", {
            "instance": "box1", "session_id": "k1", "message": "hi",
            "context": {"caller_id": "myapp", "caller_tools": [NOTIFY]},
        })
        assert not declared.is_error, text_of(declared)
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "oubliette_client", "--relay", deployment.relay, "--instance", "box1",
             "--token", deployment.token("box1"), "--session", "mcp:k1"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )
        try:
            agent = HandMcp(process)
            with trio.fail_after(30):
                await agent.send({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                    "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "hand", "version": "1"},
                }})
                assert "result" in await agent.response(1)
                await agent.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
                await agent.send({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
                    "name": "myapp_send_notification", "arguments": {"message": "hello"},
                }})
                request = await events.wait_type("caller_tool_request", tool="send_notification")
            process.kill()
            killed_at = time.monotonic()
            cancelled = await events.wait_type("caller_tool_cancelled", request_id=request["request_id"], timeout=KILL_BOUND)
            took = time.monotonic() - killed_at
        finally:
            process.kill()
            with trio.CancelScope(shield=True):
                await process.wait()
        assert took < KILL_BOUND, f"the caller heard of it {took:.1f} s after the kill"
        assert cancelled["reason"] == "cancelled by the agent"

        late = await caller.call_tool("caller_tool_response", {
            "session_id": "k1", "request_id": request["request_id"], "result": {"status": "sent"},
        })
        assert late.is_error and "no longer pending" in text_of(late), text_of(late)

        frames = structured(await caller.call_tool("session_events", {
            "session_id": "k1", "types": ["caller_tool_request", "caller_tool_result", "caller_tool_cancelled"],
        }))["frames"]
        assert [(f["type"], f["payload"]["request_id"]) for f in frames] == [
            ("caller_tool_request", request["request_id"]), ("caller_tool_cancelled", request["request_id"]),
        ], "one request, one outcome, nothing resolved twice"


# -- a flood of slow HTTP clients (docs/SECURITY.md, "Slow HTTP clients") -------------------------

FLOOD_NOFILE = 256
"""The server's descriptor limit in the flood test: fewer than the flood's connections."""
FLOOD_CLIENTS = 300
FLOOD_CAP = 40
BODY_TIMEOUT = 5.0


async def _slow_post(url: str, token: str, outcomes: list[tuple[int, float]], started: trio.Event, begun: list[int]) -> None:
    """One slow-body client: an authenticated POST announcing 1000 bytes, then a byte every 0.5 s.

    Records (status, seconds until the server answered or cut it off); status 0: closed without an answer."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    began = trio.current_time()
    try:
        stream = await trio.open_tcp_stream(host, int(port))
    except OSError:
        outcomes.append((0, trio.current_time() - began))
        return
    received = bytearray()
    async with stream:
        head = (
            f"POST /v1/instances/box1/tether HTTP/1.1\r\nhost: {host}:{port}\r\nauthorization: Bearer {token}\r\n"
            "content-type: application/json\r\ncontent-length: 1000\r\n\r\n"
        )
        try:
            await stream.send_all(head.encode() + b"{")
            begun.append(1)
            if len(begun) == FLOOD_CLIENTS:
                started.set()
            async with trio.open_nursery() as nursery:

                async def trickle() -> None:
                    while True:
                        await trio.sleep(0.5)
                        await stream.send_all(b" ")

                nursery.start_soon(trickle)
                while b"\r\n\r\n" not in received:
                    chunk = await stream.receive_some(65536)
                    if not chunk:
                        break
                    received.extend(chunk)
                nursery.cancel_scope.cancel()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
    status = int(received.split(b" ", 2)[1]) if received.startswith(b"HTTP/1.1 ") else 0
    outcomes.append((status, trio.current_time() - began))


async def test_a_flood_of_slow_http_clients_leaves_the_relay_and_the_log_usable(deployment: Deployment) -> None:
    """300 authenticated POSTs sending their bodies a byte every 0.5 s, against a server whose
    descriptor limit is 256 and whose HTTP cap is 40: a sandbox still connects to the relay, an
    HTTP request gets a clean JSON 503 while the cap is full and a 200 once the slow clients are
    cut off, each slow client is cut off at the body deadline (408), and the log says so in at
    most a few lines, with no traceback and no "Too many open files"."""
    config = deployment.root / "flood.toml"
    config.write_text(
        f"[server]\nhttp_max_connections = {FLOOD_CAP}\nhttp_body_timeout = {BODY_TIMEOUT}\n\n[instances.box1]\n"
    )
    async with deployment.http_server("--config", str(config), nofile=FLOOD_NOFILE) as server:
        outcomes: list[tuple[int, float]] = []
        all_sent = trio.Event()
        begun: list[int] = []
        async with trio.open_nursery() as flood:
            for _ in range(FLOOD_CLIENTS):
                flood.start_soon(_slow_post, server.url, server.token, outcomes, all_sent, begun)
            with trio.fail_after(20):
                await all_sent.wait()
            # The cap is full now (40 held, the rest refused); the relay is still served.
            with trio.fail_after(10):
                async with RawRelay.connect(deployment) as relay:
                    hello = await relay.hello("box1", deployment.token("box1"))
            assert "result" in hello, hello
            async with server.rest() as rest:
                busy = await rest.get("/v1/health")
            assert busy.status_code == 503, busy.text
            assert busy.json()["error"]["name"] == "internal_error" and "http_max_connections" in busy.json()["error"]["message"]
        assert len(outcomes) == FLOOD_CLIENTS
        cut = [took for status, took in outcomes if status == 408]
        refused = [status for status, _ in outcomes if status == 503]
        # A client that connected after the first were cut off may have been let in (a loaded machine).
        assert len(cut) >= FLOOD_CAP and len(cut) + len(refused) == FLOOD_CLIENTS, sorted(set(outcomes))
        assert max(cut) < BODY_TIMEOUT + 3, f"slow clients were held for up to {max(cut):.1f} s"
        async with server.rest() as rest:
            with trio.fail_after(10):
                healthy = await rest.get("/v1/health")
        assert healthy.status_code == 200, healthy.text
        flood_lines = await server.wait_stderr("HTTP under pressure")
        server.process.terminate()
        with trio.fail_after(10):
            await server.process.wait()
    log = server.stderr.decode(errors="replace")
    assert "Traceback" not in log and "Too many open files" not in log, log[-3000:]
    assert 1 <= len(flood_lines) <= 3 and len(server.stderr_lines("under pressure")) <= 3, log[-3000:]
    assert f"connections refused at the cap of {FLOOD_CAP}" in flood_lines[0], flood_lines


# -- a flood of relay connections that never say hello (docs/SECURITY.md) ------------------------

PREHELLO_NOFILE = 256
"""The server's descriptor limit: its derived relay cap is 96 (docs/SECURITY.md), HTTP's 96."""
PREHELLO_FLOOD = 500
"""More than the descriptor limit and the 128 places the relay's listen backlog had before: without
the relay's cap a sandbox's connect failed at once, or waited for a flooder's hello deadline."""
PREHELLO_ROUNDS = 5
ANSWERED_WITHIN = 10.0
"""Seconds a round's hello and health request have (a sandbox's client waits 10 s for its hello's answer)."""


async def test_a_flood_of_connections_that_never_say_hello_leaves_sandboxes_and_health_served(deployment: Deployment) -> None:
    """500 relay connections that never send a byte, each opened again as soon as the server closes
    it, against a server whose descriptor limit is 256: in every round a sandbox's hello with a
    valid token is answered (connecting again if evicted before its hello was read, as its client
    does) and `/v1/health` answers 200; the evictions are counted in the flood
    WARNING and the metric, and the log has no traceback and no "Too many open files"."""
    async with deployment.http_server(nofile=PREHELLO_NOFILE) as server:
        closed = Progress()
        async with trio.open_nursery() as flood:
            for _ in range(PREHELLO_FLOOD):
                flood.start_soon(never_say_hello, deployment, closed)
            await server.wait_stderr("under pressure")  # the flood has reached a limit
            # A sandbox's connection can be evicted before the server has read its hello (newer
            # flooders arrived first); its client connects again, as `RelayLink` does.
            rounds = [await hello_and_health(deployment, server, ANSWERED_WITHIN, again_if_dropped=True)
                      for _ in range(PREHELLO_ROUNDS)]
            flood.cancel_scope.cancel()
        assert rounds == [("ok", "ok")] * PREHELLO_ROUNDS, rounds
        async with server.unix_rest() as rest:
            metrics = (await rest.get("/metrics")).text
        [evictions] = [line for line in metrics.splitlines() if line.startswith("oubliette_relay_evictions_total ")]
        assert float(evictions.split()[1]) >= PREHELLO_FLOOD - 96, evictions
        server.process.terminate()
        with trio.fail_after(10):
            await server.process.wait()
    log = server.stderr.decode(errors="replace")
    assert "Traceback" not in log and "Too many open files" not in log, log[-3000:]
    assert "connections without a valid hello evicted at the cap of 96" in log, log[-3000:]


@contextlib.contextmanager
def sqlite_write_lock(deployment: Deployment) -> Iterator[None]:
    """Hold the write lock of the server's SQLite log from this process: the server's next commit
    waits out its busy timeout, then fails (as a full disk fails it)."""
    blocker = sqlite3.connect(deployment.data_dir / "frames.sqlite3", isolation_level=None)
    try:
        blocker.execute("BEGIN IMMEDIATE")
        yield
        blocker.execute("ROLLBACK")
    finally:
        blocker.close()


async def answer_through_a_store_failure(
    deployment: Deployment, store_fails: Callable[[], AsyncContextManager[None]],
) -> None:
    """The agent calls a caller tool; the caller answers while `store_fails()` is entered, then again."""
    async with deployment.caller() as (caller, events):
        declared = await caller.call_tool("session_message", {
            "instance": "box1", "session_id": "f1", "message": "hi",
            "context": {"caller_id": "myapp", "caller_tools": [NOTIFY]},
        })
        assert not declared.is_error, text_of(declared)
        answers: list[Any] = []
        with trio.fail_after(120):
            async with deployment.agent("box1", "mcp:f1") as agent, trio.open_nursery() as nursery:

                async def agent_call() -> None:
                    answers.append(await agent.call_tool("myapp_send_notification", {"message": "hello"}))

                nursery.start_soon(agent_call)
                request = await events.wait_type("caller_tool_request", tool="send_notification")
                answer = {"session_id": "f1", "request_id": request["request_id"], "result": {"status": "sent"}}
                async with store_fails():
                    refused = await caller.call_tool("caller_tool_response", answer)
                    assert answers == [], "the agent got an answer the log does not have"
                    assert refused.is_error, text_of(refused)
                    assert "was not recorded, so it was not delivered" in text_of(refused)
                    assert "is still pending until" in text_of(refused)
                    assert "is still pending until" in text_of(refused) and ": send caller_tool_response again" in text_of(refused), text_of(refused)
                retried = await caller.call_tool("caller_tool_response", answer)
                assert structured(retried) == {"resolved": True}, text_of(retried)
        [result] = answers
        assert not result.is_error and result.structured_content == {"status": "sent"}
        frames = structured(await caller.call_tool("session_events", {
            "session_id": "f1", "types": ["caller_tool_request", "caller_tool_result", "caller_tool_cancelled"],
        }))["frames"]
        assert [(f["type"], f["payload"]["request_id"]) for f in frames] == [
            ("caller_tool_request", request["request_id"]), ("caller_tool_result", request["request_id"]),
        ], "one request, one result: what the agent got"


async def test_a_store_failure_between_answer_and_record_leaves_the_call_pending_sqlite(deployment: Deployment) -> None:
    @contextlib.asynccontextmanager
    async def store_fails() -> AsyncIterator[None]:
        with sqlite_write_lock(deployment):
            yield

    await answer_through_a_store_failure(deployment, store_fails)


async def test_a_store_failure_between_answer_and_record_leaves_the_call_pending_postgres(
    pg_deployment: Deployment, postgres_server: Any,
) -> None:
    @contextlib.asynccontextmanager
    async def store_fails() -> AsyncIterator[None]:
        await trio.to_thread.run_sync(postgres_server.halt)
        try:
            yield
        finally:
            await trio.to_thread.run_sync(postgres_server.start)

    await answer_through_a_store_failure(pg_deployment, store_fails)


async def test_a_store_failure_between_decision_and_record_leaves_the_approval_pending_sqlite(deployment: Deployment) -> None:
    """The same for an approval: the gated call runs only after its `approval_resolved` is stored."""
    from harness import DEMO_AGENT
    from approvals_stdio import DELETE

    async with deployment.caller() as (caller, events), deployment.guest("box1", DEMO_AGENT):
        with trio.fail_after(120):
            stopped = structured(await caller.call_tool("session_message", {
                "instance": "box1", "session_id": "f2", "message": 'Please call myapp_delete_file {"path": "/tmp/x"}',
                "context": {"caller_id": "myapp", "caller_tools": [DELETE]}, "wait": 60,
            }))
            assert stopped["stop_reason"] == "requires_approval", stopped
            [request] = stopped["approval_requests"]
            decision = {"session_id": "f2", "request_id": request["request_id"], "approve": True}
            with sqlite_write_lock(deployment):
                refused = await caller.call_tool("approval_response", decision)
            assert refused.is_error and "was not recorded, so it was not delivered" in text_of(refused), text_of(refused)
            assert ": send approval_response again" in text_of(refused), text_of(refused)
            assert events.of_type("caller_tool_request") == [], "the gated call ran on a decision the log does not have"
            acting = structured(await caller.call_tool("approval_response", {**decision, "wait": 60}))
            assert acting["resolved"] is True and acting["stop_reason"] == "requires_action", acting
            [relayed] = acting["pending"]
            ended = structured(await caller.call_tool("caller_tool_response", {
                "session_id": "f2", "request_id": relayed["request_id"], "result": {"deleted": "/tmp/x"}, "wait": 60,
            }))
            assert ended["stop_reason"] == "end_turn", ended
        frames = structured(await caller.call_tool("session_events", {
            "session_id": "f2", "types": ["approval_request", "approval_resolved"],
        }))["frames"]
        assert [(f["type"], f["payload"].get("approve")) for f in frames] == [
            ("approval_request", None), ("approval_resolved", True),
        ], "one request, one decision: the one the gated call got"


# -- every turn-end path under concurrency: one end per message ------------------------------

async def test_a_burst_to_a_failing_start_ends_each_message_once(pg_deployment: Deployment) -> None:
    """A turn ends once whichever path ends it (docs/SECURITY.md, "One turn end per message"): the
    failed starts of a burst overlap in ending the same waiting turns, and the store refuses each
    second end. (PostgreSQL: its slower reads let the failed starts overlap; on main, 35-60 of 60
    messages had two or more ends.)"""
    ends = await burst_to_a_failing_start(pg_deployment)
    assert len(ends) == BURST and set(ends.values()) == {1}, sorted(ends.values())


async def test_a_guests_racing_turn_ends_and_its_orphans_end_each_message_once(deployment: Deployment) -> None:
    """The same through the guest's door: a guest sending `assistant.done` and `session.error` for
    each message at once (one stored, one refused as ended already); a guest ending every other
    turn as its connection drops (its end races the orphan's `session.error`). Read from the log
    file once the server stopped."""
    async with deployment.http_server("--config", str(deployment.config_file("box1"))) as server, server.rest() as rest:
        with trio.fail_after(120):
            for n in range(20):
                await post_message(rest, "box1", f"g{n}")
            async with RawRelay.connect(deployment) as guest:
                assert "result" in await guest.hello("box1", deployment.token("box1"), role="guest")
                delivered = [await guest.receive() for _ in range(20)]
                request_id = 0
                for d in delivered:  # started (a frame replying to it), then ended twice at once
                    assert d is not None
                    for type in ("status.presence", "assistant.done", "session.error"):
                        request_id += 1
                        await guest.send({"jsonrpc": "2.0", "id": request_id, "method": "append_frame", "params": {
                            "session": SESSION, "type": type, "payload": {}, "reply_to": d["params"]["frame"]["msg_id"]}})
                answers = [await guest.receive() for _ in range(request_id)]
            refused = [a for a in answers if a is not None and "error" in a]
            assert len(refused) == 20 and all("ended already" in a["error"]["message"] for a in refused), refused

            for n in range(20):
                await post_message(rest, "box1", f"o{n}")
            async with RawRelay.connect(deployment) as guest:
                assert "result" in await guest.hello("box1", deployment.token("box1"), role="guest")
                delivered = [await guest.receive() for _ in range(20)]
                msg_ids = [d["params"]["frame"]["msg_id"] for d in delivered if d is not None]
                for n, msg_id in enumerate(msg_ids):  # each started (stored), then every other one ended
                    await guest.send({"jsonrpc": "2.0", "id": n, "method": "append_frame", "params": {
                        "session": SESSION, "type": "status.presence", "payload": {}, "reply_to": msg_id}})
                started = [await guest.receive() for _ in msg_ids]
                assert all(a is not None and "result" in a for a in started), started
                for n, msg_id in enumerate(msg_ids[1::2]):  # as the connection drops: no answer read
                    await guest.send({"jsonrpc": "2.0", "id": 100 + n, "method": "append_frame", "params": {
                        "session": SESSION, "type": "assistant.done", "payload": {}, "reply_to": msg_id}})
            await server.wait_stderr("disconnected mid-turn; ended")
    ends = deployment.turn_ends("box1")
    assert len(ends) == 40 and set(ends.values()) == {1}, ends
